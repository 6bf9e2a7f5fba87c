//! Starting a capture: the agents first, then the probes attached family by
//! family, then the window opened.

use std::{
    collections::{HashMap, VecDeque},
    thread::JoinHandle,
    time::Instant,
};

use super::{
    Capture, CaptureOptions, ProbeFamilies, default_framework_memory, targets::track_threads,
};
use crate::{
    agent::{AgentError, AgentSession, AgentStart, KernelNaming, start_agent_sessions},
    attach::{
        CpuSampler, CudaProbe, LaunchStacks, OffCpuStacks, ProbeSet, ProbeSetConfig, SchedProbe,
        TraceMeOptions, TraceMeProbe, cuda, read_python_frames, tracefs, traceme::Discovered,
    },
    clock::{ClockSync, monotonic_ns},
    collect::{Collector, EncodedRecords},
    error::Result,
    metrics::activity::ActivityTally,
    procfs::TargetProcess,
    symbols::stacks::StackSymbolizer,
    timeline::{InitialState, streamed::StreamedScheduling},
};

impl Capture {
    /// Checks the kernel, loads and attaches the probes; the capture window
    /// starts when this returns.
    pub fn start(targets: Vec<TargetProcess>, options: &CaptureOptions) -> Result<Self> {
        Self::start_with(targets, options, None)
    }

    /// [`Capture::start`] on `loaded`, a set loaded beforehand (to check
    /// the kernel), where it was loaded as this capture needs; a set is
    /// loaded otherwise.
    pub fn start_with(
        targets: Vec<TargetProcess>,
        options: &CaptureOptions,
        loaded: Option<ProbeSet>,
    ) -> Result<Self> {
        let began = Instant::now();
        let Attached {
            mut framework,
            uprobe_pids,
            mut probe,
            initial,
            cuda,
            mut traceme,
            device_activity,
            off_cpu_stacks,
            mut notes,
            warnings,
        } = Attached::attach(&targets, options, loaded)?;
        open_window(&mut framework, &mut probe, &targets, &mut notes)?;
        let start_ns = monotonic_ns();
        let clock = ClockSync::measure();
        let collector = Collector::new(probe.take_events());
        // After the window opened: every event recorded starts inside it.
        traceme.enable();
        let streamed = options.one_window.then(|| {
            let processes = targets.iter().map(|t| (t.pid, t.name.clone()));
            StreamedScheduling::new(start_ns, processes, initial.clone())
        });
        let sampled = options.families.cpu_sample_hz > 0;
        let launch_stacks = probe.config().launch_stacks.any();
        let mut stacks =
            (sampled || off_cpu_stacks || launch_stacks).then(StackSymbolizer::default);
        if let Some(stacks) = &mut stacks {
            for target in &targets {
                stacks.note_process(target.pid);
            }
        }
        Ok(Capture {
            device_round: Default::default(),
            framework,
            recordings: Vec::new(),
            collected: Vec::new(),
            last_collection: Instant::now(),
            framework_memory: options
                .framework_memory
                .unwrap_or_else(default_framework_memory),
            kernel_naming: KernelNaming::default(),
            agent_for_devices: device_activity || options.name_kernels_with_agent,
            traceme,
            traceme_events: VecDeque::new(),
            probe,
            collector,
            drained: Vec::new(),
            targets,
            initial,
            tracked_from: Vec::new(),
            held: EncodedRecords::default(),
            stack_samples: VecDeque::new(),
            streamed,
            sample_slots: 0,
            forgot: false,
            forgotten_through_ns: 0,
            activity: ActivityTally::default(),
            clock,
            start_ns,
            families: options.families,
            attach_time: began.elapsed(),
            cuda,
            options: options.clone(),
            uprobe_pids,
            stacks,
            notes,
            warnings,
        })
    }
}

/// What a capture has running once every probe is attached, before its
/// window opens.
struct Attached {
    /// The framework sessions the agent runs.
    framework: Vec<AgentSession>,
    /// Targets whose TraceMe events the uprobes collect.
    uprobe_pids: Vec<u32>,
    probe: ProbeSet,
    /// The targets' threads as they were when tracked.
    initial: HashMap<u32, InitialState>,
    cuda: Option<CudaProbe>,
    traceme: TraceMeProbe,
    /// Whether the agents record what the GPUs ran.
    device_activity: bool,
    /// Whether the stacks of long waits are taken.
    off_cpu_stacks: bool,
    /// One line each on what was attached.
    notes: Vec<String>,
    /// Targets some probes could not cover: one line each.
    warnings: Vec<String>,
}

impl Attached {
    /// Checks the kernel, starts the agents and attaches every probe
    /// `options` asks for to `targets`, on `loaded` if it was loaded as
    /// they need.
    fn attach(
        targets: &[TargetProcess],
        options: &CaptureOptions,
        loaded: Option<ProbeSet>,
    ) -> Result<Self> {
        let tracefs_root = tracefs::locate()?;
        let check = tracefs::check_tracepoints(&tracefs_root)?;
        // The agent goes in before the probes are loaded: its control
        // socket then gets a low descriptor number, which a dying ebtrace
        // closes before its many probe links (each takes a while), so the
        // agent notices within milliseconds.
        let level = options.families.traceme_level;
        let device_activity = options.families.cuda && !options.no_device_activity;
        let AgentStart {
            sessions: framework,
            uprobe_pids,
            mut notes,
        } = start_agent_sessions(
            targets,
            level,
            options.route,
            device_activity,
            options.torch_ops(),
        );
        let traceme_options = TraceMeOptions {
            level,
            ..options.traceme
        };
        // Reading the targets' libraries for TraceMe recorders overlaps
        // loading the probes.
        let discovering = discover_in_background(&uprobe_pids, traceme_options);
        let off_cpu_stacks = options.families.sched && !options.families.off_cpu_min.is_zero();
        let config = ProbeSetConfig {
            exit_has_group_dead: check.exit_has_group_dead,
            off_cpu_stacks,
            launch_stacks: if options.families.cuda {
                options.probe.launch_stacks
            } else {
                LaunchStacks::Off
            },
            ..options.probe.clone()
        };
        let mut probe = match loaded {
            Some(set) if set.config() == &config => set,
            _ => ProbeSet::load(&config)?,
        };
        let initial = attach_scheduling(&mut probe, targets, options.families.sched, &mut notes)?;
        let (cuda, messages) = if options.families.cuda {
            CudaProbe::attach(&mut probe, targets, options.driver_calls)?
        } else {
            (None, cuda::CudaMessages::default())
        };
        notes.extend(messages.notes);
        let warnings = messages.warnings;
        notes.extend(
            cuda.iter()
                .flat_map(|c| c.targets.iter().map(cuda::describe)),
        );
        let discovered = match discovering.map(JoinHandle::join) {
            Ok(Ok(found)) => found,
            // No thread to spare, or it panicked: look here.
            _ => TraceMeProbe::discover(&uprobe_pids, &traceme_options),
        };
        let traceme = TraceMeProbe::attach(&mut probe, discovered, traceme_options)?;
        let stacks = Stacks {
            off_cpu: off_cpu_stacks,
            launches: (cuda.is_some() && config.launch_stacks.any())
                .then_some(config.launch_stacks),
        };
        attach_stack_probes(&mut probe, targets, options.families, stacks, &mut notes)?;
        Ok(Attached {
            framework,
            uprobe_pids,
            probe,
            initial,
            cuda,
            traceme,
            device_activity,
            off_cpu_stacks,
            notes,
            warnings,
        })
    }
}

/// Looks for the TraceMe recorders of `pids` on a thread of its own.
fn discover_in_background(
    pids: &[u32],
    options: TraceMeOptions,
) -> std::io::Result<JoinHandle<Discovered>> {
    let pids = pids.to_vec();
    std::thread::Builder::new()
        .name("ebtrace-discover".into())
        .spawn(move || TraceMeProbe::discover(&pids, &options))
}

/// Follows the targets' threads (and, with `sched`, their scheduling);
/// returns the threads they had.
fn attach_scheduling(
    probe: &mut ProbeSet,
    targets: &[TargetProcess],
    sched: bool,
    notes: &mut Vec<String>,
) -> Result<HashMap<u32, InitialState>> {
    for t in targets {
        probe.add_target(t.pid)?;
    }
    // Follow thread creation first, then list the threads that exist:
    // a thread created in between is seen by one or the other.
    SchedProbe::attach_thread_creation(probe)?;
    let initial = track_threads(probe, targets)?;
    if sched {
        notes.push(SchedProbe::attach_scheduling(probe)?);
    }
    Ok(initial)
}

/// Which stacks other than the CPU samples a capture takes.
#[derive(Clone, Copy)]
struct Stacks {
    /// Of long waits.
    off_cpu: bool,
    /// Of driver calls that submit work: which.
    launches: Option<LaunchStacks>,
}

/// Attaches the CPU sampler and the off-CPU stacks, as `families` asks,
/// with the Python frames of the `targets` that run Python.
fn attach_stack_probes(
    probe: &mut ProbeSet,
    targets: &[TargetProcess],
    families: ProbeFamilies,
    stacks: Stacks,
    notes: &mut Vec<String>,
) -> Result<()> {
    let hz = families.cpu_sample_hz;
    let off_cpu_stacks = stacks.off_cpu;
    if (hz > 0 || off_cpu_stacks || stacks.launches.is_some()) && families.python_frames {
        notes.extend(read_python_frames(probe, targets)?);
    }
    match stacks.launches {
        Some(LaunchStacks::PerCpuPerSecond(n)) => notes.push(format!(
            "launch stacks: CUDA driver calls that submit work carry the stack they were made \
             from, at most {n} a second on each CPU (--launch-stacks-per-s)"
        )),
        Some(_) => notes.push(
            "launch stacks: each CUDA driver call that submits work carries the stack it was \
             made from (--no-launch-stacks: none)"
                .into(),
        ),
        None => {}
    }
    if hz > 0 {
        CpuSampler::attach(probe, u64::from(hz))?;
        notes.push(format!("CPU stacks: sampled {hz} times a second per CPU"));
    }
    if off_cpu_stacks {
        let off_cpu_min = families.off_cpu_min;
        OffCpuStacks::attach(probe, off_cpu_min)?;
        notes.push(format!(
            "off-CPU stacks: of system calls that waited {} or longer",
            humantime::format_duration(off_cpu_min)
        ));
    }
    Ok(())
}

/// Opens the capture window: in the framework sessions, then for the
/// probes of every target.
pub(super) fn open_window(
    framework: &mut [AgentSession],
    probe: &mut ProbeSet,
    targets: &[TargetProcess],
    notes: &mut Vec<String>,
) -> Result<()> {
    for (pid, why) in open_agent_windows(framework) {
        notes.push(match why {
            AgentError::Refused(_) => {
                format!("pid {pid}: device activity before the window is kept: {why}")
            }
            _ => format!("pid {pid}: opening the window: {why}"),
        });
    }
    for t in targets {
        probe.open_window(t.pid)?;
    }
    Ok(())
}

/// Tells every agent that the window opens, all at once, each on a thread
/// of its own: an agent that stays silent holds the opening for as long as
/// its silence is allowed, once, however many others do too. Returns each
/// refusal.
fn open_agent_windows(framework: &mut [AgentSession]) -> Vec<(u32, AgentError)> {
    let answers = super::agents::ask_each(
        framework,
        |session| session.open_window().err().map(|why| (session.pid, why)),
        |pid, why| Some((pid, AgentError::Channel(why))),
    );
    answers.into_iter().flatten().collect()
}
