//! `ebtrace record --json`: what the end-of-capture summary says, as one
//! JSON object for scripts (one line on stdout). Times are nanoseconds;
//! `notes` and `warnings` are the lines printed for people, in order.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::Serialize;

use crate::{
    attach::{ProbeStats, cuda::Links, libcuda::Source},
    capture::Capture,
    timeline::{PythonStacks, StreamTiming, ThreadCounters, Timeline, TraceMeSource},
};

/// What is known once the probes are attached: kept until the summary.
pub struct Start {
    attach: Duration,
    processes: BTreeMap<u32, Process>,
    notes: Vec<String>,
    warnings: Vec<String>,
}

impl Start {
    /// Takes what `capture` says about its targets and probes; `notes` and
    /// `warnings` are the lines printed when the window opened.
    pub fn of(capture: &mut Capture, notes: Vec<String>, warnings: Vec<String>) -> Self {
        let mut processes: BTreeMap<u32, Process> = capture
            .targets()
            .iter()
            .map(|t| {
                (
                    t.pid,
                    Process {
                        pid: t.pid,
                        name: t.name.clone(),
                        ..Process::default()
                    },
                )
            })
            .collect();
        for pid in capture.traceme_uprobe_pids() {
            if let Some(p) = processes.get_mut(&pid) {
                p.traceme_route = Some("uprobe");
            }
        }
        for s in capture.agent_sessions() {
            let Some(p) = processes.get_mut(&s.pid) else {
                continue;
            };
            if s.started.framework.is_some() {
                p.traceme_route = Some("agent");
            }
            let preloaded = s.preloaded();
            p.agent = Some(Agent {
                preloaded,
                load_ns: (!preloaded).then(|| ns(s.load.total)),
                thread_kept_ns: (!preloaded).then(|| ns(s.load.thread_diverted)),
                framework_session: s.started.framework.clone(),
                device_activity: s.started.device.clone(),
            });
        }
        for t in capture.cuda_targets() {
            let Some(p) = processes.get_mut(&t.pid) else {
                continue;
            };
            let (links, link_kind, no_multi_because) = match &t.links {
                Links::Multi(n) => (*n, "uprobe_multi", None),
                Links::Perf(n, why) => (*n, "perf_event", Some(why.clone())),
            };
            p.cuda_probes = Some(CudaProbes {
                library: t.library.path.clone(),
                loaded: matches!(t.library.source, Source::Mapped),
                functions: t.probed,
                skipped_functions: t.skipped.len(),
                links,
                link_kind,
                no_multi_because,
            });
        }
        Start {
            attach: capture.attach_time,
            processes,
            notes,
            warnings,
        }
    }
}

/// What the capture was asked for.
pub struct Asked {
    /// The XProf log directory the trace is written under.
    pub logdir: PathBuf,
    /// `--duration`.
    pub requested: Duration,
    /// `--max-events`, to tell whether TraceMe recording stopped at it.
    pub max_events: u64,
}

/// The summary object.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// The version of ebtrace that made the capture.
    pub ebtrace_version: &'static str,
    /// The `.xplane.pb` written.
    pub trace: PathBuf,
    /// The Perfetto trace, with `--perfetto`.
    pub perfetto_trace: Option<PathBuf>,
    /// The XProf log directory the trace was written under.
    pub logdir: PathBuf,
    /// `--duration`.
    pub requested_duration_ns: u64,
    /// The capture window.
    pub window: WindowTimes,
    /// From starting to every probe attached.
    pub attach_ns: u64,
    /// Why the capture ended before its duration, if it did.
    pub ended_early: Option<String>,
    /// Kernel records captured and lost.
    pub records: Records,
    /// Scheduler transitions the kernel did not report (shown as Unknown).
    pub unreported_transitions: u64,
    /// The traced processes, by pid.
    pub processes: Vec<Process>,
    /// Threads with anything on the trace, most time on CPU first.
    pub threads: Vec<Thread>,
    /// Per GPU and kind of timing, as the summary's `GPU n:` lines.
    pub gpus: Vec<Gpu>,
    /// The TraceMe uprobe route, if any recorder was probed.
    pub traceme: Option<TraceMe>,
    /// Spans from different sources cut so that they nest.
    pub spans_cut_to_nest: u64,
    /// CPU stack samples on the thread lines (`--sample-hz`), if sampled.
    pub cpu_samples: Option<u64>,
    /// Off-CPU stacks over the threads' long waits (`--off-cpu-min`), if taken.
    pub off_cpu_stacks: Option<u64>,
    /// Of those samples and stacks, the ones with Python frames, and the
    /// Python frames that could not be read; if stacks were taken.
    pub python_stacks: Option<PythonStacks>,
    /// The summary's informational lines.
    pub notes: Vec<String>,
    /// The summary's warnings, then those the library logged.
    pub warnings: Vec<String>,
}

/// The capture window, in wall-clock ns since the epoch (the XSpace's
/// `profile_start_time` and `profile_stop_time`).
#[derive(Debug, Serialize)]
pub struct WindowTimes {
    /// Start of the window.
    pub start_unix_ns: u64,
    /// End of the window.
    pub stop_unix_ns: u64,
    /// Length of the window, in ns.
    pub duration_ns: u64,
}

/// Kernel records: captured, and every way of losing them.
#[derive(Debug, Serialize)]
pub struct Records {
    /// Kernel records the timeline was built from.
    pub captured: u64,
    /// All lost records: the sum of the four below and `malformed`.
    pub dropped: u64,
    /// Records lost because the ring buffer was full.
    pub ring_buffer_full: u64,
    /// Threads beyond the tracking map's capacity.
    pub thread_map_full: u64,
    /// Program runs the kernel skipped (another BPF program was active).
    pub missed_by_kernel: u64,
    /// Events a probe family lost in its own maps (CUDA calls whose entry
    /// could not be saved).
    pub probe_maps_full: u64,
    /// Records that could not be decoded.
    pub malformed: u64,
}

/// One traced process.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Process {
    /// Its process id.
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub name: String,
    /// Whether its last thread exited during the capture.
    pub exited: bool,
    /// Its threads on the trace.
    pub threads: usize,
    /// `agent` or `uprobe`: how its TraceMe events were collected.
    pub traceme_route: Option<&'static str>,
    /// ebtrace's agent in it, if loaded or preloaded.
    pub agent: Option<Agent>,
    /// Its CUDA driver probes, if it was probed.
    pub cuda_probes: Option<CudaProbes>,
    /// What its framework's own profiler sessions gave.
    pub framework_session: Option<FrameworkSession>,
    /// What CUPTI recorded of its GPU work.
    pub gpu_activity: Option<GpuActivity>,
    /// Kernels launched with handles looked up before the capture.
    pub kernel_names: Option<KernelNames>,
}

/// ebtrace's agent in one process.
#[derive(Clone, Debug, Serialize)]
pub struct Agent {
    /// Started with the process (`LD_PRELOAD`) rather than loaded now.
    pub preloaded: bool,
    /// How long loading it took, in ns; none when preloaded.
    pub load_ns: Option<u64>,
    /// How long one thread of the process was kept from its own code.
    pub thread_kept_ns: Option<u64>,
    /// The framework profiler session it ran, e.g. `jax 0.10.2 ProfilerSession`.
    pub framework_session: Option<String>,
    /// The device activity source it ran, e.g. CUPTI's.
    pub device_activity: Option<String>,
}

/// The CUDA driver probes of one process.
#[derive(Clone, Debug, Serialize)]
pub struct CudaProbes {
    /// The CUDA driver library probed.
    pub library: PathBuf,
    /// Mapped by the process (else found where its loader would look).
    pub loaded: bool,
    /// Driver functions probed.
    pub functions: usize,
    /// Driver functions exported but not probed.
    pub skipped_functions: usize,
    /// Probe links attached.
    pub links: usize,
    /// `uprobe_multi` or `perf_event`.
    pub link_kind: &'static str,
    /// Why perf-event links were used instead of `uprobe_multi` ones.
    pub no_multi_because: Option<String>,
}

/// What the framework profiler sessions that the agent ran in one process gave.
#[derive(Clone, Debug, Serialize)]
pub struct FrameworkSession {
    /// Events laid on the thread lines.
    pub events: u64,
    /// Planes of the framework's own carried into the trace as they were.
    pub planes_carried: u64,
    /// Events of threads that ended before ebtrace could name them.
    pub events_left_out: u64,
    /// How much the process's resident memory grew at most while the
    /// session recorded, in bytes.
    pub target_growth_bytes: u64,
}

/// What CUPTI recorded of one process's GPU work.
#[derive(Clone, Debug, Serialize)]
pub struct GpuActivity {
    /// Kernel executions.
    pub kernels: u64,
    /// Memory copies.
    pub copies: u64,
    /// Memory sets.
    pub memsets: u64,
    /// Work joined to a driver call the uprobes recorded.
    pub joined_to_driver_calls: u64,
    /// Driver calls shown from CUPTI's own records.
    pub calls_from_cupti: u64,
    /// Records CUPTI dropped for want of a buffer.
    pub dropped: u64,
    /// Records not read (unknown kinds, malformed).
    pub skipped: u64,
}

/// Kernel names asked of the CUDA driver inside one process.
#[derive(Clone, Debug, Serialize)]
pub struct KernelNames {
    /// Function handles asked for.
    pub asked: u64,
    /// Function handles the driver named.
    pub named: u64,
}

/// One thread's totals over the window.
#[derive(Debug, Serialize)]
pub struct Thread {
    /// Its thread id.
    pub tid: u32,
    /// Its process id.
    pub pid: u32,
    /// Its name (`/proc/PID/task/TID/comm`).
    pub name: String,
    /// Its time in each state and its event counts.
    #[serde(flatten)]
    pub counters: ThreadCounters,
}

/// One GPU's streams of one kind of timing.
#[derive(Debug, Serialize)]
pub struct Gpu {
    /// The CUDA device ordinal.
    pub ordinal: u32,
    /// `host_observed` (spans of the submitting calls) or `device` (timed
    /// by the GPU, from CUPTI).
    pub timing: &'static str,
    /// Events on those streams.
    pub events: usize,
    /// Streams with this timing.
    pub streams: usize,
}

/// The TraceMe uprobe route's events and what became of them.
#[derive(Debug, Serialize)]
pub struct TraceMe {
    /// Events read from the targets.
    pub events: u64,
    /// Spans added to the timeline.
    pub spans: u64,
    /// Events not wholly inside the capture window.
    pub outside_window: u64,
    /// Activity starts and ends whose partner was not recorded.
    pub unpaired_activity_halves: u64,
    /// Spans cut to make them nest.
    pub cut_to_nest: u64,
    /// Records with impossible times.
    pub malformed: u64,
    /// Events the probe could not read from the target: lost.
    pub unreadable: u64,
    /// Events recorded without their name.
    pub unnamed: u64,
    /// Recording was switched off at `--max-events`.
    pub stopped_at_max_events: bool,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

impl Summary {
    /// Everything the human summary of `timeline` says, with what was
    /// known at `start` and the warnings the library logged; the trace
    /// paths are set by [`Summary::written_to`] once the files are out.
    pub fn new(
        start: Start,
        timeline: &Timeline,
        probe: &ProbeStats,
        out: Asked,
        logged_warnings: Vec<String>,
    ) -> Self {
        let stats = &timeline.stats;
        let sources = &stats.sources;
        let processes = processes_on_the_timeline(start.processes, timeline);
        let threads = threads_by_time_on_cpu(timeline);
        let gpus = gpus_by_timing(timeline);
        let traceme = sources.traceme.map(|t| TraceMe::of(&t, out.max_events));

        let mut notes = start.notes;
        notes.extend(stats.notes.iter().cloned());
        let mut warnings = start.warnings;
        warnings.extend(stats.warnings.iter().cloned());
        warnings.extend(logged_warnings);

        Summary {
            ebtrace_version: env!("CARGO_PKG_VERSION"),
            trace: PathBuf::new(),
            perfetto_trace: None,
            logdir: out.logdir,
            requested_duration_ns: ns(out.requested),
            window: WindowTimes {
                start_unix_ns: timeline.clock.to_wall_ns(timeline.start_ns),
                stop_unix_ns: timeline.clock.to_wall_ns(timeline.stop_ns),
                duration_ns: timeline.duration_ns(),
            },
            attach_ns: ns(start.attach),
            ended_early: stats.ended_early.clone(),
            records: Records {
                captured: stats.records,
                dropped: probe.dropped() + stats.malformed,
                ring_buffer_full: probe.dropped_ringbuf_full,
                thread_map_full: probe.dropped_track_full,
                missed_by_kernel: probe.missed_by_kernel,
                probe_maps_full: probe.dropped_by_family,
                malformed: stats.malformed,
            },
            unreported_transitions: stats.inconsistencies,
            processes,
            threads,
            gpus,
            traceme,
            spans_cut_to_nest: sources.spans_cut_to_nest,
            cpu_samples: sources.cpu_samples,
            off_cpu_stacks: sources.off_cpu_stacks,
            python_stacks: sources.python_stacks,
            notes,
            warnings,
        }
    }

    /// Where the trace (and the Perfetto trace) went.
    pub fn written_to(mut self, trace: PathBuf, perfetto_trace: Option<PathBuf>) -> Self {
        self.trace = trace;
        self.perfetto_trace = perfetto_trace;
        self
    }

    /// One line of JSON.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("a summary always serializes")
    }
}

/// The processes known at the start and those the timeline has, each with
/// its threads and what its framework session, GPU activity and kernel
/// names gave.
fn processes_on_the_timeline(
    mut processes: BTreeMap<u32, Process>,
    timeline: &Timeline,
) -> Vec<Process> {
    let sources = &timeline.stats.sources;
    for (pid, info) in &timeline.processes {
        let p = processes.entry(*pid).or_insert_with(|| Process {
            pid: *pid,
            name: info.name.clone(),
            ..Process::default()
        });
        p.exited = info.exited_ns.is_some();
    }
    for t in timeline.threads.values() {
        if let Some(p) = processes.get_mut(&t.pid) {
            p.threads += 1;
        }
    }
    for (pid, m) in &sources.frameworks {
        if let Some(p) = processes.get_mut(pid) {
            p.framework_session = Some(FrameworkSession {
                events: m.spans,
                planes_carried: m.planes,
                events_left_out: m.unnamed_events,
                target_growth_bytes: m.target_growth,
            });
        }
    }
    for (pid, m) in &sources.gpu_activity {
        if let Some(p) = processes.get_mut(pid) {
            p.gpu_activity = Some(GpuActivity {
                kernels: m.kernels,
                copies: m.copies,
                memsets: m.memsets,
                joined_to_driver_calls: m.joined,
                calls_from_cupti: m.spans_from_records,
                dropped: m.dropped,
                skipped: m.skipped,
            });
        }
    }
    for (pid, k) in &sources.kernel_names {
        if let Some(p) = processes.get_mut(pid) {
            p.kernel_names = Some(KernelNames {
                asked: k.asked,
                named: k.named,
            });
        }
    }
    processes.into_values().collect()
}

/// Every thread of the timeline, most time on CPU first.
fn threads_by_time_on_cpu(timeline: &Timeline) -> Vec<Thread> {
    let mut threads: Vec<Thread> = timeline
        .threads
        .values()
        .map(|t| Thread {
            tid: t.tid,
            pid: t.pid,
            name: t.name.clone(),
            counters: t.counters,
        })
        .collect();
    threads.sort_by_key(|t| std::cmp::Reverse(t.counters.on_cpu_ns));
    threads
}

/// Each GPU's streams, host-observed then device-timed, where it has any.
fn gpus_by_timing(timeline: &Timeline) -> Vec<Gpu> {
    let mut gpus = Vec::new();
    for (ordinal, device) in &timeline.devices {
        for (timing, name) in [
            (StreamTiming::HostObserved, "host_observed"),
            (StreamTiming::Device, "device"),
        ] {
            let (streams, events) = device.count_timed(timing);
            if streams > 0 {
                gpus.push(Gpu {
                    ordinal: *ordinal,
                    timing: name,
                    events,
                    streams,
                });
            }
        }
    }
    gpus
}

impl TraceMe {
    /// What the TraceMe uprobe route recorded; `max_events` tells whether
    /// recording stopped at `--max-events`.
    fn of(t: &TraceMeSource, max_events: u64) -> Self {
        TraceMe {
            events: t.events,
            spans: t.spans.spans,
            outside_window: t.spans.outside_window,
            unpaired_activity_halves: t.spans.unpaired_activity_halves,
            cut_to_nest: t.spans.clipped,
            malformed: t.spans.malformed,
            unreadable: t.unreadable,
            unnamed: t.unnamed,
            stopped_at_max_events: t.events >= max_events,
        }
    }
}
