//! One capture, from checks to the recorded sources: probes → collector
//! (and agents) → [`timeline::assemble`].
//!
//! [`Capture::start`] checks everything that can be checked before touching
//! the kernel (pids, privileges, tracepoints), then attaches. The caller
//! drives [`Capture::poll`] until it decides to stop (duration, Ctrl-C,
//! targets gone) and calls [`Capture::finish`], which detaches, drains what
//! is left and assembles the [`Timeline`]; a capture shared by several
//! windows (`ebtrace serve`) hands its [`Capture::sources`] to
//! [`timeline::assemble`] per window instead. Whatever ends a capture, what
//! was recorded up to then is kept.

mod agents;
pub mod cpu_profile;

use std::{
    collections::{HashMap, VecDeque},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use crate::{
    agent::{
        AgentRecording, AgentSession, AgentStart, KernelNaming, TraceMeRoute, start_agent_sessions,
    },
    attach::{
        CpuSampler, CudaProbe, ProbeSet, ProbeSetConfig, ProbeStats, SchedProbe, TraceMeOptions,
        TraceMeProbe, cuda, tracefs,
    },
    clock::{ClockSync, monotonic_ns},
    collect::{Collector, Record, StackSample, TraceMeEvent},
    error::{Error, Result},
    metrics::activity::ActivityTally,
    procfs::{self, TargetProcess},
    symbols::stacks::StackSymbolizer,
    timeline::{
        self, InitialState, Sources, Timeline, TraceMeInput, Window, streamed::StreamedScheduling,
    },
};

/// How long the draining thread of [`Capture::assemble_while_draining`]
/// waits between drains at most.
const DRAIN_WHILE_BUILDING: Duration = Duration::from_millis(20);

/// How often the agents hand over what the GPUs ran during a capture.
const DEVICE_COLLECTION_PERIOD: Duration = Duration::from_millis(250);

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
    pub families: ProbeFamilies,
    /// TraceMe settings; the level itself comes from `families`.
    pub traceme: TraceMeOptions,
    /// How each target's TraceMe events are collected.
    pub route: TraceMeRoute,
    /// Never record what the GPU ran through the agent (CUPTI): the GPU
    /// lines then show the work as the host submitted it.
    pub no_device_activity: bool,
    /// The capture is shown once, as one window from its start to
    /// [`Capture::finish`] (`ebtrace record`): its scheduler records become
    /// thread states as they arrive instead of all being held to the end.
    pub one_window: bool,
}

/// Which probe families a capture attaches. Each family has one switch
/// here and checks it in its attach hook in [`Capture::start`]; callers
/// (the command line, the ProfilerService's tracer levels) only flip them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProbeFamilies {
    /// Scheduler tracepoints: thread states, wake-ups, CPU lines.
    pub sched: bool,
    /// CUDA driver API uprobes: launches, copies, syncs, GPU stream lines.
    pub cuda: bool,
    /// TraceMe uprobes at this `host_tracer_level` (0: none).
    pub traceme_level: u32,
    /// CPU stack samples a second per CPU, laid on the thread lines (0: none).
    pub cpu_sample_hz: u32,
}

impl Default for ProbeFamilies {
    fn default() -> Self {
        ProbeFamilies {
            sched: true,
            cuda: true,
            traceme_level: 2,
            cpu_sample_hz: 0,
        }
    }
}

impl ProbeFamilies {
    /// No family at all: nothing would be recorded.
    pub const NONE: ProbeFamilies = ProbeFamilies {
        sched: false,
        cuda: false,
        traceme_level: 0,
        cpu_sample_hz: 0,
    };

    pub fn is_empty(&self) -> bool {
        *self == Self::NONE
    }
}

/// What [`Capture::poll`] saw.
#[derive(Clone, Copy, Debug)]
pub struct PollStatus {
    pub records: usize,
    /// Traced processes still alive.
    pub alive: usize,
}

pub struct Capture {
    /// Framework sessions run by the agent; dropped first, which stops
    /// them and takes the agent out of the targets.
    framework: Vec<AgentSession>,
    /// What those sessions recorded so far.
    recordings: Vec<AgentRecording>,
    /// Device activity taken from the sessions while they record, by pid.
    collected: Vec<(u32, Vec<u8>)>,
    last_collection: Instant,
    /// Kernel names asked of the driver inside the targets.
    kernel_naming: KernelNaming,
    /// Whether ebtrace's agent may be loaded for device work.
    agent_for_devices: bool,
    /// Declared before `probe`: dropped first, it switches the targets'
    /// TraceMe recording off while the probes still see it.
    traceme: TraceMeProbe,
    traceme_events: VecDeque<TraceMeEvent>,
    probe: ProbeSet,
    collector: Collector,
    targets: Vec<TargetProcess>,
    initial: HashMap<u32, InitialState>,
    /// Targets added after the capture started ([`Capture::add_target`]),
    /// and when.
    tracked_from: Vec<(u32, u64)>,
    /// Decoded records but TraceMe events, oldest first (a deque: a flight
    /// recorder forgets from the front).
    records: VecDeque<Record>,
    /// With [`CaptureOptions::one_window`], the scheduler records, built
    /// into thread states as they arrive (until [`Capture::sources`] takes
    /// them; records held in `records` from then on).
    streamed: Option<StreamedScheduling>,
    /// The memory `records` takes, in records (see [`record_slots`]).
    record_slots: usize,
    /// Whether older records were forgotten (see [`Capture::forget_before`]).
    forgot: bool,
    /// Launches and synchronizing waits counted as records arrive, until
    /// [`Capture::take_activity`].
    activity: ActivityTally,
    clock: ClockSync,
    start_ns: u64,
    families: ProbeFamilies,
    /// Time from `start` being called to every probe attached.
    pub attach_time: Duration,
    /// CUDA driver probes, if any target has (or would load) the driver.
    cuda: Option<CudaProbe>,
    /// How the capture was asked for, to start the agents again on resume.
    options: CaptureOptions,
    /// Targets whose TraceMe events the uprobes collect.
    uprobe_pids: Vec<u32>,
    /// Names for the stack samples' addresses, when stacks are sampled.
    stacks: Option<StackSymbolizer>,
    /// What the user should know about the probes: one line each.
    pub notes: Vec<String>,
    /// Targets some probes could not cover: one line each.
    pub warnings: Vec<String>,
}

impl Capture {
    /// Checks the kernel, loads and attaches the probes; the capture window
    /// starts when this returns.
    pub fn start(targets: Vec<TargetProcess>, options: &CaptureOptions) -> Result<Self> {
        let began = Instant::now();
        let tracefs_root = tracefs::locate()?;
        let check = tracefs::check_tracepoints(&tracefs_root)?;
        // The agent goes in before the probes are loaded: its control
        // socket then gets a low descriptor number, which a dying ebtrace
        // closes before its many probe links (each takes a while), so the
        // agent notices within milliseconds.
        let level = options.families.traceme_level;
        let device_activity = options.families.cuda && !options.no_device_activity;
        let AgentStart {
            sessions: mut framework,
            uprobe_pids,
            mut notes,
        } = start_agent_sessions(&targets, level, options.route, device_activity);
        let traceme_options = TraceMeOptions {
            level,
            ..options.traceme
        };
        // Reading the targets' libraries for TraceMe recorders overlaps
        // loading the probes.
        let discovering = {
            let (pids, options) = (uprobe_pids.clone(), traceme_options);
            std::thread::Builder::new()
                .name("ebtrace-discover".into())
                .spawn(move || TraceMeProbe::discover(&pids, &options))
        };
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
        let initial = track_threads(&mut probe, &targets)?;
        if options.families.sched {
            notes.push(SchedProbe::attach_scheduling(&mut probe)?);
        }
        let (cuda, warnings) = if options.families.cuda {
            CudaProbe::attach(&mut probe, &targets)?
        } else {
            (None, Vec::new())
        };
        notes.extend(
            cuda.iter()
                .flat_map(|c| c.targets.iter().map(cuda::describe)),
        );
        let discovered = match discovering.map(std::thread::JoinHandle::join) {
            Ok(Ok(found)) => found,
            // No thread to spare, or it panicked: look here.
            _ => TraceMeProbe::discover(&uprobe_pids, &traceme_options),
        };
        let mut traceme = TraceMeProbe::attach(&mut probe, discovered, traceme_options)?;
        let hz = options.families.cpu_sample_hz;
        if hz > 0 {
            CpuSampler::attach(&mut probe, u64::from(hz))?;
            notes.push(format!("CPU stacks: sampled {hz} times a second per CPU"));
        }
        for session in &mut framework {
            if let Err(why) = session.open_window() {
                notes.push(format!(
                    "pid {}: device activity before the window is kept: {why}",
                    session.pid
                ));
            }
        }
        for t in &targets {
            probe.open_window(t.pid)?;
        }
        let start_ns = monotonic_ns();
        let clock = ClockSync::measure();
        let collector = Collector::new(probe.take_events());
        // After the window opened: every event recorded starts inside it.
        traceme.enable();
        let streamed = options.one_window.then(|| {
            let processes = targets.iter().map(|t| (t.pid, t.name.clone()));
            StreamedScheduling::new(start_ns, processes, initial.clone())
        });
        Ok(Capture {
            framework,
            recordings: Vec::new(),
            collected: Vec::new(),
            last_collection: Instant::now(),
            kernel_naming: KernelNaming::default(),
            agent_for_devices: device_activity,
            traceme,
            traceme_events: VecDeque::new(),
            probe,
            collector,
            targets,
            initial,
            tracked_from: Vec::new(),
            records: VecDeque::new(),
            streamed,
            record_slots: 0,
            forgot: false,
            activity: ActivityTally::default(),
            clock,
            start_ns,
            families: options.families,
            attach_time: began.elapsed(),
            cuda,
            options: options.clone(),
            uprobe_pids,
            stacks: (hz > 0).then(StackSymbolizer::default),
            notes,
            warnings,
        })
    }

    pub fn targets(&self) -> &[TargetProcess] {
        &self.targets
    }

    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    pub fn families(&self) -> ProbeFamilies {
        self.families
    }

    /// The targets whose CUDA driver is probed, and how.
    pub fn cuda_targets(&self) -> &[cuda::CudaTarget] {
        self.cuda.as_ref().map_or(&[], |c| &c.targets)
    }

    /// The agent sessions recording inside the targets.
    pub fn agent_sessions(&self) -> &[AgentSession] {
        &self.framework
    }

    /// The targets whose TraceMe recorders the uprobes watch.
    pub fn traceme_uprobe_pids(&self) -> Vec<u32> {
        self.traceme
            .recorders
            .iter()
            .map(|r| r.recorder.pid)
            .collect()
    }

    /// What the TraceMe probes found in the targets, one line each.
    pub fn traceme_notes(&self) -> Vec<String> {
        let mut lines = self.traceme.notes.clone();
        lines.extend(traceme_findings(&self.traceme));
        lines
    }

    /// Drains the ring buffer; TraceMe events go to their own list.
    fn drain(&mut self) {
        let mut batch = Vec::new();
        self.collector.drain(&mut batch);
        self.take_in(batch);
    }

    /// Keeps `batch`, records drained from the ring buffer.
    fn take_in(&mut self, batch: Vec<Record>) {
        let mut traceme = 0;
        for r in batch {
            match r {
                Record::TraceMe(e) => {
                    self.traceme_events.push_back(*e);
                    traceme += 1;
                }
                other if self.streamed.is_some() && StreamedScheduling::takes(&other) => {
                    if let Some(streamed) = &mut self.streamed {
                        streamed.push(other);
                    }
                }
                other => {
                    self.activity.count(&other);
                    if let (Record::StackSample(sample), Some(stacks)) =
                        (&other, self.stacks.as_mut())
                    {
                        stacks.note_sample(sample);
                    }
                    self.record_slots += record_slots(&other);
                    self.records.push_back(other);
                }
            }
        }
        self.traceme.count_events(traceme);
        if let Some(streamed) = &mut self.streamed {
            streamed.settle();
        }
    }

    /// Forgets the records older than `cutoff_ns`, and past that the
    /// oldest ones beyond the memory of `max_records` records (a stack
    /// sample takes several): what a flight recorder keeps. Returns how
    /// many records and TraceMe events it forgot.
    pub fn forget_before(&mut self, cutoff_ns: u64, max_records: usize) -> u64 {
        // Records arrive nearly in time order: stop at the first recent one.
        let mut n = 0;
        while let Some(r) = self.records.front()
            && (r.ts() < cutoff_ns || self.record_slots > max_records)
        {
            self.record_slots -= record_slots(r);
            self.records.pop_front();
            n += 1;
        }
        let old_traceme = self
            .traceme_events
            .iter()
            .position(|e| e.header.ts_ns >= cutoff_ns)
            .unwrap_or(self.traceme_events.len());
        self.traceme_events.drain(..old_traceme);
        let forgotten = (n + old_traceme) as u64;
        self.forgot |= forgotten > 0;
        forgotten
    }

    /// Records `target` too from now on (a process the flight recorder's
    /// `--discover` found after it started): what was recorded of the
    /// others stays. Returns what the user should know, one line each.
    pub fn add_target(&mut self, target: TargetProcess) -> Result<Vec<String>> {
        let pid = target.pid;
        if self.targets.iter().any(|t| t.pid == pid) {
            return Ok(Vec::new());
        }
        self.probe.add_target(pid)?;
        let added = (|| -> Result<Vec<String>> {
            let one = std::slice::from_ref(&target);
            let initial = track_threads(&mut self.probe, one)?;
            let mut notes = Vec::new();
            if self.families.cuda {
                match &mut self.cuda {
                    Some(cuda) => notes.extend(cuda.add(&mut self.probe, one)),
                    None => {
                        let (cuda, warnings) = CudaProbe::attach(&mut self.probe, one)?;
                        self.cuda = cuda;
                        notes.extend(warnings);
                    }
                }
                let probed = self.cuda.iter().flat_map(|c| &c.targets);
                notes.extend(probed.filter(|c| c.pid == pid).map(cuda::describe));
            }
            self.probe.open_window(pid)?;
            self.initial.extend(initial);
            Ok(notes)
        })();
        match added {
            Ok(notes) => {
                self.tracked_from.push((pid, monotonic_ns()));
                self.targets.push(target);
                Ok(notes)
            }
            Err(e) => {
                let _ = self.probe.remove_target(pid);
                Err(e)
            }
        }
    }

    /// Stops recording target `pid`, which has exited, so that a process
    /// that reuses its pid is not recorded, and lets its driver probes go;
    /// what it recorded stays.
    pub fn forget_target(&mut self, pid: u32) -> Result<()> {
        if let Some(cuda) = &mut self.cuda {
            cuda.release_target(pid);
        }
        self.probe.remove_target(pid)
    }

    /// Forgets all it knows of target `pid`, which exited (see
    /// [`Self::forget_target`]) and whose records are all forgotten: its
    /// threads, the names of its code. A flight recorder would otherwise
    /// keep them for every process that came and went.
    pub fn drop_target(&mut self, pid: u32) {
        self.targets.retain(|t| t.pid != pid);
        self.initial.retain(|_, thread| thread.pid != pid);
        self.tracked_from.retain(|(p, _)| *p != pid);
        if let Some(stacks) = &mut self.stacks {
            stacks.forget_process(pid);
        }
    }

    /// What the targets did through the probes since the last call.
    pub fn take_activity(&mut self) -> ActivityTally {
        self.activity.take()
    }

    /// Records held now (TraceMe events included).
    pub fn held(&self) -> usize {
        self.records.len() + self.traceme_events.len()
    }

    /// Waits up to `timeout` for data, drains it, and reports progress.
    pub fn poll(&mut self, timeout: Duration) -> PollStatus {
        self.collector.wait(timeout);
        self.drain();
        if self.last_collection.elapsed() >= DEVICE_COLLECTION_PERIOD {
            self.collect_device_activity();
        }
        PollStatus {
            records: self.records.len() + self.streamed.as_ref().map_or(0, |s| s.len()),
            alive: self.targets.iter().filter(|t| t.is_alive()).count(),
        }
    }

    /// Stops recording and forgets what was recorded, keeping the probes
    /// attached for [`Self::resume`]: the programs still run on the
    /// targets' events (and keep following their threads) but write
    /// nothing. The agents and the TraceMe recording ebtrace switched on
    /// are taken out of the targets, as at the end of a capture.
    pub fn pause(&mut self) -> Result<()> {
        for session in self.framework.drain(..) {
            // A target that exited took its agent with it.
            let _ = session.close();
        }
        self.traceme.restore();
        for t in &self.targets {
            self.probe.pause_target(t.pid)?;
        }
        self.drain();
        self.forget_recorded();
        Ok(())
    }

    /// Records again after [`Self::pause`], as if the capture had just
    /// started: a new window, a new look at the targets' threads, the
    /// agents started again. Fails (and the caller starts a new capture)
    /// where the probes attached then no longer fit: a target exited, or
    /// its TraceMe events would now go another route.
    pub fn resume(&mut self) -> std::result::Result<(), String> {
        let began = Instant::now();
        if let Some(t) = self.targets.iter().find(|t| !t.is_alive()) {
            return Err(format!("pid {} exited", t.pid));
        }
        // What arrived since the pause (a driver call that returned
        // after it) belongs to no window.
        self.drain();
        self.forget_recorded();
        let level = self.options.families.traceme_level;
        let device_activity = self.options.families.cuda && !self.options.no_device_activity;
        let AgentStart {
            sessions: mut framework,
            uprobe_pids,
            notes,
        } = start_agent_sessions(&self.targets, level, self.options.route, device_activity);
        if uprobe_pids != self.uprobe_pids {
            return Err("the targets' TraceMe events now take another route".into());
        }
        self.notes = notes;
        let resumed = (|| -> Result<()> {
            for t in &self.targets {
                self.probe.resume_target(t.pid)?;
            }
            self.initial = track_threads(&mut self.probe, &self.targets)?;
            for session in &mut framework {
                if let Err(why) = session.open_window() {
                    self.notes.push(format!(
                        "pid {}: device activity before the window is kept: {why}",
                        session.pid
                    ));
                }
            }
            for t in &self.targets {
                self.probe.open_window(t.pid)?;
            }
            Ok(())
        })();
        if let Err(e) = resumed {
            return Err(e.to_string());
        }
        self.framework = framework;
        self.start_ns = monotonic_ns();
        self.clock = ClockSync::measure();
        self.last_collection = Instant::now();
        self.traceme.rearm();
        self.attach_time = began.elapsed();
        Ok(())
    }

    /// Drops every record and recording kept so far.
    fn forget_recorded(&mut self) {
        self.records = VecDeque::new();
        self.streamed = None;
        self.record_slots = 0;
        self.traceme_events = VecDeque::new();
        self.forgot = false;
        self.recordings = Vec::new();
        self.collected = Vec::new();
        self.kernel_naming = KernelNaming::default();
        self.collector.malformed = 0;
    }

    pub fn probe_stats(&self) -> Result<ProbeStats> {
        Ok(ProbeStats {
            dropped_by_family: self.family_drops()?,
            ..self.probe.stats()?
        })
    }

    /// Events the probe families lost in their own maps.
    fn family_drops(&self) -> Result<u64> {
        Ok(match &self.cuda {
            Some(c) => c.stats()?.pending_full,
            None => 0,
        })
    }

    /// Ends the capture now: stops recording, drains, builds the timeline
    /// of the whole capture. The probes, which no longer record anything,
    /// come back to be released once the trace is out.
    pub fn finish(
        mut self,
        ended_early: Option<String>,
    ) -> Result<(Timeline, ProbeStats, AttachedProbes)> {
        let stop_ns = monotonic_ns();
        self.collect_framework(false);
        self.drain();
        self.name_kernels();
        for session in self.framework.drain(..) {
            let pid = session.pid;
            let exited = session.target_exited();
            if let Err(why) = session.close()
                && !exited
            {
                self.traceme
                    .warn(format!("pid {pid}: taking the agent out: {why}"));
            }
        }
        self.traceme.restore();
        // Kernel-side miss counters live in the programs: read them first.
        let missed = self.probe.stats()?.missed_by_kernel;
        let traceme_kernel = TraceMeProbe::stats(&mut self.probe);
        // The programs ignore the targets from now on; they stay attached
        // until the caller lets them go (see [`AttachedProbes`]): releasing
        // links is slow, and the trace need not wait for it.
        for t in &self.targets {
            self.probe.remove_target(t.pid)?;
        }
        let stats = ProbeStats {
            missed_by_kernel: missed,
            dropped_by_family: self.family_drops()?,
            ..self.probe.stats()?
        };
        self.drain();
        if traceme_kernel.event_unreadable + traceme_kernel.name_unreadable > 0 {
            self.traceme.warn(format!(
                "{} TraceMe events could not be read from the target, {} were recorded without their name",
                traceme_kernel.event_unreadable, traceme_kernel.name_unreadable
            ));
        }
        let window = Window::between(self.start_ns, stop_ns);
        let mut timeline =
            timeline::assemble(self.sources(), &window, stats.dropped(), ended_early);
        if let Some(t) = &mut timeline.stats.sources.traceme {
            t.unreadable = traceme_kernel.event_unreadable;
            t.unnamed = traceme_kernel.name_unreadable;
        }
        let probes = AttachedProbes {
            _cuda: self.cuda,
            _probe: self.probe,
        };
        Ok((timeline, stats, probes))
    }

    /// Everything recorded so far, for [`timeline::assemble`]: drained
    /// records, and what the agents recorded, collected now. The capture
    /// goes on running: overlapping windows can share one set of probes.
    pub fn sources(&mut self) -> Sources<'_> {
        self.sources_and_collector().0
    }

    /// [`timeline::assemble`] of `window` from what is held so far, while
    /// another thread goes on draining the ring buffer: a large window
    /// (a flight recorder's snapshot) takes long enough to build that the
    /// ring would fill meanwhile. What it drained is taken in afterwards.
    pub fn assemble_while_draining(
        &mut self,
        window: &Window,
        dropped: u64,
        ended_early: Option<String>,
    ) -> Timeline {
        let (sources, collector) = self.sources_and_collector();
        let built = AtomicBool::new(false);
        let (timeline, drained) = std::thread::scope(|scope| {
            let draining = scope.spawn(|| {
                let mut batch = Vec::new();
                while !built.load(Ordering::Acquire) {
                    collector.wait(DRAIN_WHILE_BUILDING);
                    collector.drain(&mut batch);
                }
                batch
            });
            let timeline = timeline::assemble(sources, window, dropped, ended_early);
            built.store(true, Ordering::Release);
            let drained = draining.join().expect("the draining thread does not panic");
            (timeline, drained)
        });
        self.take_in(drained);
        timeline
    }

    /// [`Self::sources`], and the collector, which they do not borrow.
    fn sources_and_collector(&mut self) -> (Sources<'_>, &mut Collector) {
        self.collect_framework(true);
        self.name_kernels();
        let mut names = HashMap::new();
        for t in &self.targets {
            for (tid, stat) in t.threads() {
                names.insert(tid, stat.comm);
            }
        }
        let traceme_events = self.traceme_events.make_contiguous();
        let traceme = (!self.traceme.recorders.is_empty()).then(|| {
            let mut notes = traceme_findings(&self.traceme);
            notes.extend(self.traceme.left_in_targets());
            TraceMeInput {
                events: traceme_events,
                notes,
            }
        });
        // Once older records are forgotten, the threads' states when the
        // capture began no longer lead up to the first record kept.
        let initial = if self.forgot {
            HashMap::new()
        } else {
            self.initial.clone()
        };
        let sources = Sources {
            start_ns: self.start_ns,
            clock: self.clock,
            processes: self
                .targets
                .iter()
                .map(|t| (t.pid, t.name.clone()))
                .collect(),
            initial,
            names,
            scheduling: self.families.sched,
            tracked_from: self.tracked_from.clone(),
            records: self.records.make_contiguous(),
            streamed: self.streamed.take(),
            malformed: self.collector.malformed,
            kernel_naming: Some(&self.kernel_naming),
            traceme,
            warnings: self.traceme.warnings().to_vec(),
            recordings: &self.recordings,
            device_batches: &self.collected,
            stacks: self.stacks.as_mut(),
        };
        (sources, &mut self.collector)
    }
}

/// The memory a held record takes, in records: one, but a stack sample
/// also holds its frames.
fn record_slots(r: &Record) -> usize {
    match r {
        Record::StackSample(s) => {
            let frames = (s.user.len() + s.kernel.len()) * size_of::<u64>();
            1 + (size_of::<StackSample>() + frames).div_ceil(size_of::<Record>())
        }
        _ => 1,
    }
}

/// Follows the threads `targets` have now and notes how `/proc` shows
/// them: thread creation must be followed already, so that a thread
/// created in between is seen by one or the other.
fn track_threads(
    probe: &mut ProbeSet,
    targets: &[TargetProcess],
) -> Result<HashMap<u32, InitialState>> {
    let mut initial = HashMap::new();
    for t in targets {
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
    Ok(initial)
}

/// The TraceMe recorders and Python gates found, one line each.
fn traceme_findings(probe: &TraceMeProbe) -> Vec<String> {
    let mut lines: Vec<String> = probe.recorders.iter().map(|r| r.describe()).collect();
    lines.extend(probe.python_gates.iter().map(|g| g.describe()));
    lines
}

/// The probes of a finished capture: attached, recording nothing.
/// Dropping them releases their links (in parallel, but the kernel closes
/// tracepoint links one grace period at a time: about 40 ms each).
pub struct AttachedProbes {
    // Held for their links (dropped in this order: uprobes first).
    _cuda: Option<CudaProbe>,
    _probe: ProbeSet,
}

impl AttachedProbes {
    /// For a process about to exit: hands the links to a child process
    /// that releases them in the background once this one has exited, so
    /// that the exit does not wait for the kernel.
    pub fn release_after_exit(self) {
        crate::attach::links::release_after_exit();
        drop(self);
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind};

    use super::*;

    /// The flight recorder's memory cap counts a stack sample's frames.
    #[test]
    fn a_stack_sample_takes_the_room_of_its_frames() {
        let sample = |frames: usize| {
            Record::StackSample(Box::new(StackSample {
                header: RecordHeader::new(RecordKind::StackSample, 0, 0, 0),
                tid: 1,
                tgid: 1,
                user: vec![0; frames].into(),
                kernel: vec![0; frames].into(),
                user_unreadable: false,
                kernel_unreadable: false,
            }))
        };
        let switch = Record::sched_switch(0, 0, (1, 1), 0, (2, 2));
        assert_eq!(record_slots(&switch), 1);
        let (few, many) = (record_slots(&sample(1)), record_slots(&sample(127)));
        assert!(few >= 2, "{few}");
        // 254 frames of 8 bytes, in records of at most 48 bytes.
        assert!(many > 254 * 8 / size_of::<Record>(), "{many}");
    }
}
