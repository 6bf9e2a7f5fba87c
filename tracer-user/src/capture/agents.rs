//! The capture's side of ebtrace's agents: what their sessions recorded
//! (framework XSpaces, GPU activity), collected while and after recording,
//! and the kernel names asked of the driver inside the targets
//! ([`crate::timeline::assemble`] lays all of it on the timeline).

use std::time::Instant;

use super::Capture;
use crate::attach::restore_children_of_session;
use crate::{
    agent::{AgentError, AgentSession, KernelNaming},
    attach::TraceMeProbe,
    collect::{Collector, EncodedRecords, agent::AgentRecording},
};

impl Capture {
    /// Stops the framework session of each target that grew, since it
    /// started, past [`CaptureOptions::framework_memory`]: the framework
    /// keeps every event in the target's memory until its session stops,
    /// and a flood of them could exhaust it. The stop is asked for and not
    /// waited for (the agent converts what the session holds meanwhile):
    /// the capture's window and its other sources go on as asked. What the
    /// session recorded is kept; the GPU's activity goes on recording.
    ///
    /// [`CaptureOptions::framework_memory`]: super::CaptureOptions::framework_memory
    pub(super) fn bound_framework_sessions(&mut self) {
        let budget = self.framework_memory;
        for session in &mut self.framework {
            let Some((grown, after)) = session.framework_growth() else {
                continue;
            };
            if grown <= budget {
                continue;
            }
            let pid = session.pid;
            match session.begin_framework_stop() {
                Ok(()) => self.traceme.warn(format!(
                    "pid {pid}: the framework's profiler session grew the process by {} MiB in \
                     {:.1} s, past the {} MiB it may take (--max-target-growth-mib): ebtrace \
                     stopped it there to spare the process's memory, and the TraceMe events after \
                     that are missing",
                    grown >> 20,
                    after.as_secs_f64(),
                    budget >> 20,
                )),
                Err(why) => self.traceme.warn(format!(
                    "pid {pid}: stopping the framework's profiler session early: {why}"
                )),
            }
        }
    }

    /// Collects what the framework sessions recorded so far; with
    /// `restart`, each session goes on recording in a new one.
    pub(super) fn collect_framework(&mut self, restart: bool) {
        self.agent_questions_apart().0.collect_framework(restart);
    }

    /// Takes what the GPUs ran so far from the agents that record it: the
    /// agent's buffers are bounded, and a target that exits takes only
    /// the last period's records with it. The other agents are told that
    /// ebtrace is still there, which renews their sessions' leases.
    pub(super) fn collect_device_activity(&mut self) {
        self.last_collection = Instant::now();
        for session in &mut self.framework {
            if session.started.device.is_none() {
                if let Err(why) = session.keep_alive() {
                    log::debug!("pid {}: renewing the agent's lease: {why}", session.pid);
                }
                continue;
            }
            match session.collect_device_activity() {
                Ok(batches) => self
                    .collected
                    .extend(batches.into_iter().map(|b| (session.pid, b))),
                // Said once: the agent is asked nothing more.
                Err(AgentError::Unanswered) => {}
                Err(why) if session.target_exited() => {
                    log::debug!("pid {}: collecting GPU activity: {why}", session.pid)
                }
                Err(why) => log::warn!("pid {}: collecting GPU activity: {why}", session.pid),
            }
        }
    }

    /// Asks the driver inside the targets for the names of the kernels
    /// launched so far by handles no symbol record names.
    pub(super) fn name_kernels(&mut self) {
        self.agent_questions_apart().0.name_kernels();
    }

    /// What asking the agents takes of the capture, and its collector
    /// apart: another thread may drain that meanwhile.
    pub(super) fn agent_questions_apart(&mut self) -> (AgentQuestions<'_>, &mut Collector) {
        let Capture {
            framework,
            recordings,
            traceme,
            kernel_naming,
            held,
            families,
            agent_for_devices,
            collector,
            ..
        } = self;
        let questions = AgentQuestions {
            framework,
            recordings,
            traceme,
            kernel_naming,
            held,
            cuda: families.cuda,
            may_load_agent: *agent_for_devices,
        };
        (questions, collector)
    }
}

/// The parts of a [`Capture`] its agents' answers go to. The answers can
/// take seconds (an agent loaded into a target to name its kernels, one
/// that is slow to answer), so a flight recorder's snapshot asks them while
/// another thread drains the ring buffer, which these parts leave out.
pub(super) struct AgentQuestions<'a> {
    framework: &'a mut Vec<AgentSession>,
    recordings: &'a mut Vec<AgentRecording>,
    traceme: &'a mut TraceMeProbe,
    kernel_naming: &'a mut KernelNaming,
    held: &'a EncodedRecords,
    cuda: bool,
    may_load_agent: bool,
}

impl AgentQuestions<'_> {
    /// [`Capture::collect_framework`].
    pub(super) fn collect_framework(&mut self, restart: bool) {
        for session in self.framework.iter_mut() {
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

    /// [`Capture::name_kernels`].
    pub(super) fn name_kernels(&mut self) {
        if !self.cuda {
            return;
        }
        let unnamed = crate::timeline::cuda::unnamed_kernels(self.held.driver_records_iter());
        self.kernel_naming
            .ask(unnamed, self.framework, self.may_load_agent);
    }
}

/// Takes the agent out of its process and puts back the TraceMe gate in
/// the children forked while the framework's session ran there; the lines
/// that say what went wrong or was put back.
pub(super) fn take_out(session: AgentSession) -> Vec<String> {
    let pid = session.pid;
    let began = session.framework_began();
    let mut lines = Vec::new();
    if let Err(why) = session.close() {
        lines.push(format!("pid {pid}: taking the agent out: {why}"));
    }
    if let Some((since, level)) = began {
        lines.extend(restore_children_of_session(pid, since, level));
    }
    lines
}
