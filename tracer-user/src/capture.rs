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
//!
//! Its rooms: [`start`] (agents, probes and the window's opening),
//! [`records`] (what it holds, and forgets), [`targets`] (the processes it
//! records, taken on and let go while it runs), [`windows`] (what it hands
//! over to be shown), [`agents`] (the in-process agent's sessions),
//! [`cpu_profile`] (pprof profiles).

mod agents;
pub mod cpu_profile;
pub mod flight_recorder;
mod records;
mod start;
mod targets;
mod windows;

pub use targets::open_targets;
use targets::track_threads;

use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use tracer_agent::protocol::OPS_ALL;

use crate::{
    agent::{AgentSession, AgentStart, KernelNaming, TorchOps, TraceMeRoute, start_agent_sessions},
    attach::{CudaProbe, ProbeSet, ProbeSetConfig, ProbeStats, TraceMeOptions, TraceMeProbe, cuda},
    clock::{ClockSync, monotonic_ns},
    collect::{
        Collector, EncodedRecords, Record, StackSample, TraceMeEvent, agent::AgentRecording,
    },
    cuda_api::DriverCalls,
    error::{Error, Result},
    metrics::activity::ActivityTally,
    procfs::{self, TargetProcess},
    symbols::stacks::StackSymbolizer,
    timeline::{self, InitialState, Timeline, Window, streamed::StreamedScheduling},
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

/// What a capture records, and how.
#[derive(Clone, Debug, Default)]
pub struct CaptureOptions {
    /// How the eBPF object is loaded.
    pub probe: ProbeSetConfig,
    /// Which probe families are attached.
    pub families: ProbeFamilies,
    /// TraceMe settings; the level itself comes from `families`.
    pub traceme: TraceMeOptions,
    /// How each target's TraceMe events are collected.
    pub route: TraceMeRoute,
    /// Never record what the GPU ran through the agent (CUPTI): the GPU
    /// lines then show the work as the host submitted it.
    pub no_device_activity: bool,
    /// Never record PyTorch's ops through the agent.
    pub no_torch_ops: bool,
    /// Record this many in a million of PyTorch's ops (RecordFunctions,
    /// drawn by PyTorch); none: every one.
    pub torch_op_millionths: Option<u32>,
    /// Record each ATen op's input shapes too.
    pub torch_op_shapes: bool,
    /// Most the framework's profiler session, run by the agent, may grow a
    /// target by (its resident memory, in bytes) before ebtrace stops it;
    /// none: [`default_framework_memory`].
    pub framework_memory: Option<u64>,
    /// Where no agent of the capture's runs in a target (the flight
    /// recorder runs none), load one for a moment to ask the target's CUDA
    /// driver for the names of kernels looked up before the capture.
    pub name_kernels_with_agent: bool,
    /// Which CUDA driver functions are probed, when `families.cuda` is on.
    pub driver_calls: DriverCalls,
    /// The capture is shown once, as one window from its start to
    /// [`Capture::finish`] (`ebtrace record`): its scheduler records become
    /// thread states as they arrive instead of all being held to the end.
    pub one_window: bool,
}

impl CaptureOptions {
    /// What of PyTorch's ops the agent records.
    pub fn torch_ops(&self) -> TorchOps {
        TorchOps {
            millionths: if self.no_torch_ops {
                0
            } else {
                self.torch_op_millionths.map_or(OPS_ALL, |m| m.min(OPS_ALL))
            },
            shapes: self.torch_op_shapes,
        }
    }
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
    /// The user stack of a thread that waited in a system call at least
    /// this long, taken as the call returns and laid over the wait on its
    /// line (zero: none).
    pub off_cpu_min: Duration,
    /// Whether the stacks of CPython targets get their Python frames.
    pub python_frames: bool,
}

impl Default for ProbeFamilies {
    fn default() -> Self {
        ProbeFamilies {
            sched: true,
            cuda: true,
            traceme_level: 2,
            cpu_sample_hz: 0,
            off_cpu_min: Duration::ZERO,
            python_frames: true,
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
        off_cpu_min: Duration::ZERO,
        python_frames: false,
    };

    /// Whether no family is on.
    pub fn is_empty(&self) -> bool {
        ProbeFamilies {
            python_frames: false,
            ..*self
        } == Self::NONE
    }
}

/// What [`Capture::poll`] saw.
#[derive(Clone, Copy, Debug)]
pub struct PollStatus {
    /// Records held so far, stack samples included.
    pub records: usize,
    /// Traced processes still alive.
    pub alive: usize,
}

/// A capture in progress: its probes, agents and what they recorded so far.
pub struct Capture {
    /// The agents being asked what the GPUs ran, holding their sessions
    /// meanwhile; dropped first, waiting for its answers.
    device_round: agents::DeviceRound,
    /// Framework sessions run by the agent; dropped next, which stops
    /// them and takes the agent out of the targets.
    framework: Vec<AgentSession>,
    /// What those sessions recorded so far.
    recordings: Vec<AgentRecording>,
    /// Device activity taken from the sessions while they record, by pid.
    collected: Vec<(u32, Vec<u8>)>,
    last_collection: Instant,
    /// [`CaptureOptions::framework_memory`], resolved at the start.
    framework_memory: u64,
    /// Kernel names asked of the driver inside the targets.
    kernel_naming: KernelNaming,
    /// Whether ebtrace's agent may be loaded for device work (kernel
    /// names included).
    agent_for_devices: bool,
    /// Declared before `probe`: dropped first, it switches the targets'
    /// TraceMe recording off while the probes still see it.
    traceme: TraceMeProbe,
    traceme_events: VecDeque<TraceMeEvent>,
    probe: ProbeSet,
    collector: Collector,
    /// What one drain of the ring buffer decoded, on its way into `held`
    /// and the lists beside it: kept between drains, so that a flood does not map,
    /// fault in and unmap megabytes of fresh memory at every one.
    drained: Vec<Record>,
    targets: Vec<TargetProcess>,
    initial: HashMap<u32, InitialState>,
    /// Targets added after the capture started ([`Capture::add_target`]),
    /// and when.
    tracked_from: Vec<(u32, u64)>,
    /// The records but stack samples and TraceMe events, oldest first,
    /// as the probes wrote them (a flight recorder holds hundreds of
    /// thousands a second of a busy target, and forgets the oldest).
    held: EncodedRecords,
    /// The stack samples, decoded as they arrive (their user stacks are
    /// unwound while the process still has the code it ran), oldest first.
    stack_samples: VecDeque<Box<StackSample>>,
    /// With [`CaptureOptions::one_window`], the scheduler records, built
    /// into thread states as they arrive (until [`Capture::sources`] takes
    /// them; records held in `held` from then on).
    streamed: Option<StreamedScheduling>,
    /// The memory `stack_samples` takes, in records (see
    /// [`records::sample_slots`]).
    sample_slots: usize,
    /// Whether older records were forgotten (see [`Capture::forget_before`]).
    forgot: bool,
    /// The newest time of a record [`Capture::forget_before`] forgot.
    forgotten_through_ns: u64,
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
    /// The processes recorded now.
    pub fn targets(&self) -> &[TargetProcess] {
        &self.targets
    }

    /// Whether an agent records in any target (its answers are awaited
    /// when the capture finishes).
    pub fn has_agents(&self) -> bool {
        !self.framework.is_empty() || self.device_round.is_running()
    }

    /// When the capture window started (`CLOCK_MONOTONIC` ns); reset by [`Self::resume`].
    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    /// The probe families it was started with.
    pub fn families(&self) -> ProbeFamilies {
        self.families
    }

    /// The targets whose CUDA driver is probed, and how.
    pub fn cuda_targets(&self) -> &[cuda::CudaTarget] {
        self.cuda.as_ref().map_or(&[], |c| &c.targets)
    }

    /// The agent sessions recording inside the targets, once those being
    /// asked what the GPUs ran have answered.
    pub fn agent_sessions(&mut self) -> &[AgentSession] {
        self.end_device_round();
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

    /// What the targets did through the probes since the last call.
    pub fn take_activity(&mut self) -> ActivityTally {
        self.activity.take()
    }

    /// Bytes drained from the probes' ring buffer so far, and its size.
    pub fn ring_usage(&self) -> crate::collect::RingUsage {
        self.collector.ring_usage()
    }

    /// Waits up to `timeout` for data, drains it, and reports progress.
    pub fn poll(&mut self, timeout: Duration) -> PollStatus {
        self.collector.wait(timeout);
        self.drain();
        self.bound_framework_sessions();
        self.collect_device_activity();
        // A window with a known end streams records that are also kept.
        let streamed_only = self
            .streamed
            .as_ref()
            .filter(|s| s.window().1.is_none())
            .map_or(0, |s| s.len());
        PollStatus {
            records: self.held.len() + self.stack_samples.len() + streamed_only,
            alive: self.targets.iter().filter(|t| t.is_alive()).count(),
        }
    }

    /// Stops recording and forgets what was recorded, keeping the probes
    /// attached for [`Self::resume`]: the programs still run on the
    /// targets' events (and keep following their threads) but write
    /// nothing. The agents and the TraceMe recording ebtrace switched on
    /// are taken out of the targets, as at the end of a capture.
    pub fn pause(&mut self) -> Result<()> {
        self.end_device_round();
        for session in self.framework.drain(..) {
            for warning in agents::take_out(session) {
                log::warn!("{warning}");
            }
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
        } = start_agent_sessions(
            &self.targets,
            level,
            self.options.route,
            device_activity,
            self.options.torch_ops(),
        );
        if uprobe_pids != self.uprobe_pids {
            return Err("the targets' TraceMe events now take another route".into());
        }
        self.notes = notes;
        let resumed = (|| -> Result<()> {
            for t in &self.targets {
                self.probe.resume_target(t.pid)?;
            }
            self.initial = track_threads(&mut self.probe, &self.targets)?;
            start::open_window(
                &mut framework,
                &mut self.probe,
                &self.targets,
                &mut self.notes,
            )
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
        self.held.clear();
        self.stack_samples = VecDeque::new();
        self.streamed = None;
        self.sample_slots = 0;
        self.traceme_events = VecDeque::new();
        self.forgot = false;
        self.forgotten_through_ns = 0;
        self.recordings = Vec::new();
        self.collected = Vec::new();
        self.kernel_naming = KernelNaming::default();
        self.collector.clear_malformed();
    }

    /// The probes' outcome counters, with the events the families lost in their own maps.
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
        // Records keep coming while the agents deliver; the states built of
        // them must still end with the window.
        if let Some(streamed) = &mut self.streamed {
            streamed.end_at(stop_ns);
        }
        // TraceMe levels back first, while the probes still see the
        // targets: every event recorded with ebtrace's level on is counted.
        self.traceme.restore();
        // Kernel-side miss counters live in the programs: read them first.
        let missed = self.probe.stats()?.missed_by_kernel;
        let traceme_kernel = TraceMeProbe::stats(&mut self.probe);
        // The programs ignore the targets from now on, before the agents
        // hand over what they recorded: a framework's session takes seconds
        // to do so, and records made meanwhile would fill the ring buffer
        // and count as dropped from the trace. The programs stay attached
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
        self.collect_framework(false);
        // With the driver calls that were still running at the end.
        self.drain();
        self.name_kernels();
        for session in self.framework.drain(..) {
            for warning in agents::take_out(session) {
                self.traceme.warn(warning);
            }
        }
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
}

/// How much a framework's profiler session may grow a target by when no
/// bound is given: a quarter of the memory the machine has available as
/// the capture starts (at least 1 GiB). The framework's own session has no
/// bound; this one only keeps a capture from pushing the machine towards
/// its out-of-memory killer, and leaves a normal capture whole: a jax loop
/// recording 330,000 TraceMe events a second grows by about 50 MiB a
/// second, so 30 s take 1.5 GiB.
pub fn default_framework_memory() -> u64 {
    const FLOOR: u64 = 1 << 30;
    crate::procfs::mem_available_bytes().map_or(FLOOR, |available| (available / 4).max(FLOOR))
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
