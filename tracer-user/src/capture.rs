//! One capture, from checks to timeline: probes → collector → timeline.
//!
//! [`Capture::start`] checks everything that can be checked before touching
//! the kernel (pids, privileges, tracepoints), then attaches. The caller
//! drives [`Capture::poll`] until it decides to stop (duration, Ctrl-C,
//! targets gone) and calls [`Capture::finish`], which detaches, drains what
//! is left and builds the [`Timeline`]. Whatever ends a capture, what was
//! recorded up to then is kept.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::{
    attach::{
        ProbeSet, ProbeSetConfig, ProbeStats, SchedProbe, TraceMeOptions, TraceMeProbe, tracefs,
    },
    clock::{ClockSync, monotonic_ns},
    collect::{Collector, Record, TraceMeEvent},
    error::{Error, Result},
    procfs::{self, TargetProcess},
    timeline::{CaptureStats, InitialState, SchedTimelineBuilder, Timeline, add_traceme_spans},
};

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Fails unless this process may load tracing eBPF programs: root, or
/// CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN on kernels before 5.8).
pub fn check_privileges() -> Result<()> {
    let caps = procfs::effective_capabilities();
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        return Ok(());
    }
    let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
        .into_iter()
        .filter(|(c, _)| !has(*c))
        .map(|(_, n)| n)
        .collect();
    Err(Error::NotPrivileged {
        missing: missing.join(", "),
    })
}

/// Opens every target pid (fails on the first unknown one).
pub fn open_targets(pids: &[u32]) -> Result<Vec<TargetProcess>> {
    let mut targets: Vec<TargetProcess> = Vec::new();
    for &pid in pids {
        let t = TargetProcess::open(pid)?;
        if !targets.iter().any(|o| o.pid == t.pid) {
            targets.push(t);
        }
    }
    Ok(targets)
}

#[derive(Clone, Debug, Default)]
pub struct CaptureOptions {
    pub probe: ProbeSetConfig,
    pub traceme: TraceMeOptions,
}

/// What [`Capture::poll`] saw.
#[derive(Clone, Copy, Debug)]
pub struct PollStatus {
    pub records: usize,
    /// Traced processes still alive.
    pub alive: usize,
}

pub struct Capture {
    /// Declared before `probe`: dropped first, it switches the targets'
    /// TraceMe recording off while the probes still see it.
    traceme: TraceMeProbe,
    traceme_events: Vec<TraceMeEvent>,
    probe: ProbeSet,
    collector: Collector,
    targets: Vec<TargetProcess>,
    initial: HashMap<u32, InitialState>,
    records: Vec<Record>,
    clock: ClockSync,
    start_ns: u64,
    /// Time from `start` being called to every probe attached.
    pub attach_time: Duration,
}

impl Capture {
    /// Checks the kernel, loads and attaches the probes; the capture window
    /// starts when this returns.
    pub fn start(targets: Vec<TargetProcess>, options: &CaptureOptions) -> Result<Self> {
        let began = Instant::now();
        let tracefs_root = tracefs::locate()?;
        let check = tracefs::check_tracepoints(&tracefs_root)?;
        let config = ProbeSetConfig {
            exit_has_group_dead: check.exit_has_group_dead,
            ..options.probe.clone()
        };
        let mut probe = ProbeSet::load(&config)?;
        for t in &targets {
            probe.add_target(t.pid)?;
        }
        // Follow thread creation first, then list the threads that exist:
        // a thread created in between is seen by one or the other.
        SchedProbe::attach_thread_creation(&mut probe)?;
        let mut initial = HashMap::new();
        for t in &targets {
            let threads = t.threads();
            probe.track_threads(t.pid, threads.keys().copied())?;
            for (tid, stat) in threads {
                initial.insert(
                    tid,
                    InitialState {
                        pid: t.pid,
                        name: stat.comm,
                        state: stat.state,
                        cpu: stat.cpu,
                    },
                );
            }
        }
        SchedProbe::attach_scheduling(&mut probe)?;
        let pids: Vec<u32> = targets.iter().map(|t| t.pid).collect();
        let mut traceme = TraceMeProbe::attach(&mut probe, &pids, options.traceme)?;
        let start_ns = monotonic_ns();
        let clock = ClockSync::measure();
        let collector = Collector::new(probe.take_events());
        // After the window opened: every event recorded starts inside it.
        traceme.enable();
        Ok(Capture {
            traceme,
            traceme_events: Vec::new(),
            probe,
            collector,
            targets,
            initial,
            records: Vec::new(),
            clock,
            start_ns,
            attach_time: began.elapsed(),
        })
    }

    pub fn targets(&self) -> &[TargetProcess] {
        &self.targets
    }

    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    /// What the TraceMe probes found in the targets, one line each.
    pub fn traceme_notes(&self) -> Vec<String> {
        let mut lines = self.traceme.notes.clone();
        lines.extend(self.traceme.recorders.iter().map(|r| r.describe()));
        lines
    }

    /// Drains the ring buffer; TraceMe events go to their own list.
    fn drain(&mut self) {
        let before = self.records.len();
        self.collector.drain(&mut self.records);
        let mut traceme = 0;
        for r in self.records.drain(before..).collect::<Vec<_>>() {
            match r {
                Record::TraceMe(e) => {
                    self.traceme_events.push(*e);
                    traceme += 1;
                }
                other => self.records.push(other),
            }
        }
        self.traceme.count_events(traceme);
    }

    /// Waits up to `timeout` for data, drains it, and reports progress.
    pub fn poll(&mut self, timeout: Duration) -> PollStatus {
        self.collector.wait(timeout);
        self.drain();
        PollStatus {
            records: self.records.len(),
            alive: self.targets.iter().filter(|t| t.is_alive()).count(),
        }
    }

    pub fn probe_stats(&self) -> Result<ProbeStats> {
        self.probe.stats()
    }

    /// Ends the capture now: detaches, drains, builds the timeline of the
    /// whole capture.
    pub fn finish(mut self, ended_early: Option<String>) -> Result<(Timeline, ProbeStats)> {
        let stop_ns = monotonic_ns();
        self.traceme.restore();
        // Kernel-side miss counters live in the programs: read them first.
        let missed = self.probe.stats()?.missed_by_kernel;
        let traceme_kernel = TraceMeProbe::stats(&mut self.probe);
        self.probe.detach();
        let stats = ProbeStats {
            missed_by_kernel: missed,
            ..self.probe.stats()?
        };
        self.drain();
        if traceme_kernel.event_unreadable + traceme_kernel.name_unreadable > 0 {
            self.traceme.warn(format!(
                "{} TraceMe events could not be read from the target, {} were recorded without their name",
                traceme_kernel.event_unreadable, traceme_kernel.name_unreadable
            ));
        }
        let timeline = self.timeline_between(self.start_ns, stop_ns, stats.dropped(), ended_early);
        Ok((timeline, stats))
    }

    /// Builds the timeline of `[start_ns, stop_ns]` (monotonic) from what
    /// has been drained so far, leaving the capture running: overlapping
    /// windows can share one set of probes. `dropped` is reported as is.
    pub fn timeline_between(
        &mut self,
        start_ns: u64,
        stop_ns: u64,
        dropped: u64,
        ended_early: Option<String>,
    ) -> Timeline {
        // One ring buffer is shared by all CPUs; reservations are ordered,
        // timestamps taken just before them are not quite.
        self.records.sort_by_key(Record::ts);
        let mut names = HashMap::new();
        for t in &self.targets {
            for (tid, stat) in t.threads() {
                names.insert(tid, stat.comm);
            }
        }
        let mut builder = SchedTimelineBuilder::new(
            start_ns.max(self.start_ns),
            stop_ns,
            self.targets.iter().map(|t| (t.pid, t.name.clone())),
            self.initial.clone(),
        );
        // Records before the window still tell each thread's state at its start.
        let end = self.records.partition_point(|r| r.ts() <= stop_ns);
        for r in &self.records[..end] {
            builder.push(r);
        }
        let capture_stats = CaptureStats {
            records: 0,
            dropped,
            malformed: self.collector.malformed,
            inconsistencies: 0,
            ended_early,
            notes: Vec::new(),
            warnings: self.traceme.warnings().to_vec(),
        };
        let mut timeline = builder.finish(self.clock, &names, capture_stats);
        self.add_traceme(&mut timeline);
        timeline
    }

    /// Lays the TraceMe events on the threads' lines and says how it went.
    fn add_traceme(&self, timeline: &mut Timeline) {
        if self.traceme.recorders.is_empty() {
            return;
        }
        let spans = add_traceme_spans(timeline, &self.traceme_events);
        let notes = &mut timeline.stats.notes;
        notes.extend(self.traceme.recorders.iter().map(|r| r.describe()));
        notes.push(format!(
            "TraceMe: {} events recorded, {} spans on the thread lines \
             ({} outside the window, {} unpaired activity halves, {} cut to nest)",
            self.traceme_events.len(),
            spans.spans,
            spans.outside_window,
            spans.unpaired_activity_halves,
            spans.clipped
        ));
    }
}
