//! The capture's side of ebtrace's agents: what their sessions recorded
//! (framework XSpaces, GPU activity), collected while and after recording,
//! the kernel names asked of the driver inside the targets, and how all of
//! it is laid on the timeline.

use std::{collections::BTreeMap, time::Instant};

use super::Capture;
use crate::timeline::{Timeline, merge_device_activity, merge_framework_space};

impl Capture {
    /// Collects what the framework sessions recorded so far; with
    /// `restart`, each session goes on recording in a new one.
    pub(super) fn collect_framework(&mut self, restart: bool) {
        for session in &mut self.framework {
            match session.collect(restart) {
                Ok(r) => self.recordings.push(r),
                Err(_) if session.target_exited() => self.traceme.warn(format!(
                    "pid {}: exited during the capture: {} recorded inside it since the last \
                     collection is lost with it; the rest of the trace is kept",
                    session.pid,
                    session.what_records()
                )),
                Err(why) => self.traceme.warn(format!(
                    "pid {}: {}: {why}",
                    session.pid,
                    session.what_records()
                )),
            }
        }
    }

    /// Takes what the GPUs ran so far from the agents that record it: the
    /// agent's buffers are bounded, and a target that exits takes only
    /// the last period's records with it.
    pub(super) fn collect_device_activity(&mut self) {
        self.last_collection = Instant::now();
        for session in self
            .framework
            .iter_mut()
            .filter(|s| s.started.device.is_some())
        {
            match session.collect_device_activity() {
                Ok(batches) => self
                    .collected
                    .extend(batches.into_iter().map(|b| (session.pid, b))),
                // The stop says what went wrong (or that the target exited).
                Err(why) => log::debug!("pid {}: collecting GPU activity: {why}", session.pid),
            }
        }
    }

    /// Asks the driver inside the targets for the names of the kernels
    /// launched so far by handles no symbol record names.
    pub(super) fn name_kernels(&mut self) {
        if !self.families.cuda {
            return;
        }
        let unnamed = crate::timeline::cuda::unnamed_kernels(&self.records);
        self.kernel_naming
            .ask(unnamed, &mut self.framework, self.agent_for_devices);
    }

    /// Merges what the framework sessions recorded and says how it went.
    pub(super) fn add_framework(&self, timeline: &mut Timeline) {
        for (r, xspace) in self
            .recordings
            .iter()
            .flat_map(|r| r.xspaces.iter().map(move |x| (r, x)))
        {
            match merge_framework_space(timeline, r.pid, xspace, &r.threads) {
                Ok(m) => {
                    timeline.stats.sources.add_framework(r.pid, &m);
                    timeline.stats.notes.push(format!(
                        "pid {}: the framework's own session: {} events on the thread lines, \
                         {} planes carried over",
                        r.pid, m.spans, m.planes
                    ));
                    if m.unnamed_lines > 0 {
                        timeline.stats.warnings.push(format!(
                            "pid {}: {} events of {} framework threads left out: those threads \
                             ended before ebtrace could name them",
                            r.pid, m.unnamed_events, m.unnamed_lines
                        ));
                    }
                }
                Err(e) => timeline.stats.warnings.push(format!(
                    "pid {}: the framework's XSpace is unreadable ({e}); its events are missing",
                    r.pid
                )),
            }
        }
    }

    /// Lays what the GPUs ran (CUPTI, through the agent) on their lines and
    /// says how it went.
    pub(super) fn add_device_activity(&self, timeline: &mut Timeline) {
        let mut by_pid: BTreeMap<u32, Vec<&[u8]>> = BTreeMap::new();
        for (pid, batch) in &self.collected {
            by_pid.entry(*pid).or_default().push(batch);
        }
        for r in &self.recordings {
            if let Some(problem) = &r.problem {
                timeline
                    .stats
                    .warnings
                    .push(format!("pid {}: {problem}", r.pid));
            }
            if !r.device_activity.is_empty() {
                by_pid
                    .entry(r.pid)
                    .or_default()
                    .extend(r.device_activity.iter().map(Vec::as_slice));
            }
        }
        for (pid, batches) in by_pid {
            let m = merge_device_activity(timeline, pid, &batches);
            timeline.stats.sources.gpu_activity.insert(pid, m);
            timeline.stats.notes.push(format!(
                "pid {pid}: GPU activity (CUPTI): {} kernels, {} copies, {} memsets; \
                 {} joined to the driver call spans of the uprobes, {} calls shown from \
                 CUPTI's own records",
                m.kernels, m.copies, m.memsets, m.joined, m.spans_from_records
            ));
            if m.dropped > 0 {
                timeline.stats.warnings.push(format!(
                    "pid {pid}: CUPTI dropped {} activity records (its buffers were full): \
                     shorten the window or collect more often",
                    m.dropped
                ));
            }
        }
    }
}
