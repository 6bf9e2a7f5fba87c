//! From what a capture recorded to the [`Timeline`] a window shows: the
//! one path `ebtrace record` and `ebtrace serve` both take.
//!
//! The scheduler records make the thread states and CPU lines, the CUDA
//! driver calls their spans and the GPU streams, then the TraceMe events,
//! the frameworks' own XSpaces and the GPU activity the agents handed over
//! are laid on top; spans from different sources are made to nest, and the
//! window cuts the result. Nothing here touches the kernel or the targets:
//! [`crate::capture`] collects the [`Sources`], this turns them into a
//! timeline.

use std::collections::{BTreeMap, HashMap};

use super::{
    CLIPPED_STAT, CaptureStats, CudaTimelineBuilder, Cuts, DecodeBudget, InitialState,
    MAX_DECODED_FRAMEWORK_BYTES, PythonStacks, SchedTimelineBuilder, SourceStats, Timeline,
    TraceMeSource, Window, add_traceme_spans,
    cpu_samples::{add_cpu_samples, narrow_unknown},
    cuda::CudaTimeline,
    launch_stacks::add_launch_stacks,
    launching_ops::{LAUNCHING_OP_STAT, name_launching_ops},
    merge_device_activity, merge_framework_space, nest,
    order::{Ordered, RecordInput, in_time_order_by_builder, take_samples},
    streamed::{REORDER_SLACK_NS, StreamedScheduling},
    torch_ops::add_torch_ops,
};
use crate::{
    clock::ClockSync,
    collect::{
        Record, StackSample, TraceMeEvent,
        agent::{AgentRecording, DriverKernelNames},
        torch_ops::decode_ops,
    },
    symbols::stacks::StackSymbolizer,
};

/// Everything a capture recorded so far, as [`assemble`] takes it.
pub struct Sources<'a> {
    /// When recording began (monotonic ns): a window that starts earlier
    /// shows from here.
    pub start_ns: u64,
    /// Maps the records' monotonic times to wall-clock time.
    pub clock: ClockSync,
    /// The traced processes: pid and name.
    pub processes: Vec<(u32, String)>,
    /// Their threads as `/proc` showed them when recording began.
    pub initial: HashMap<u32, InitialState>,
    /// Thread names as `/proc` shows them now, for threads no record names.
    pub names: HashMap<u32, String>,
    /// Whether the scheduler was traced; without it, the thread states
    /// guessed from `initial` are left out (the threads are kept).
    pub scheduling: bool,
    /// Processes recorded only from some time on (added to a capture
    /// already running), and from when.
    pub tracked_from: Vec<(u32, u64)>,
    /// The records but TraceMe events, in ring-buffer order (one buffer
    /// is shared by all CPUs: reservations are ordered, timestamps taken
    /// just before them are not quite), put in time order here.
    pub records: RecordInput<'a>,
    /// The scheduler records already built into thread states as they
    /// arrived, for a window from the start: the scheduler records in
    /// `records`, if any, are the same ones and are not built again.
    pub streamed: Option<StreamedScheduling>,
    /// Ring-buffer items that could not be decoded.
    pub malformed: u64,
    /// Kernel names asked of the driver inside the targets.
    pub driver_kernel_names: Option<&'a DriverKernelNames>,
    /// The TraceMe events, when a recorder was found in any target.
    pub traceme: Option<TraceMeInput<'a>>,
    /// Problems met while recording, which the trace states.
    pub warnings: Vec<String>,
    /// What the agents' framework sessions recorded.
    pub recordings: &'a [AgentRecording],
    /// GPU activity batches taken from the agents while recording, by pid.
    pub device_batches: &'a [(u32, Vec<u8>)],
    /// Names for the addresses of CPU stack samples, when stacks were
    /// sampled (it resolves them in the live processes).
    pub stacks: Option<&'a mut StackSymbolizer>,
}

impl Sources<'_> {
    /// A capture of `processes` that recorded nothing (yet).
    pub fn new(start_ns: u64, clock: ClockSync, processes: Vec<(u32, String)>) -> Self {
        Sources {
            start_ns,
            clock,
            processes,
            initial: HashMap::new(),
            names: HashMap::new(),
            scheduling: false,
            tracked_from: Vec::new(),
            records: RecordInput::default(),
            streamed: None,
            malformed: 0,
            driver_kernel_names: None,
            traceme: None,
            warnings: Vec::new(),
            recordings: &[],
            device_batches: &[],
            stacks: None,
        }
    }
}

/// The TraceMe events of a capture and what its probes found.
pub struct TraceMeInput<'a> {
    /// The events the uprobes recorded.
    pub events: &'a [TraceMeEvent],
    /// For the summary: one line per recorder, Python gate, and target
    /// left recording.
    pub notes: Vec<String>,
}

/// The timeline `window` shows of `sources`. `dropped` (records the ring
/// buffer or a probe family lost) and `ended_early` (why the capture ended
/// before its window did) are stated as given.
pub fn assemble(
    sources: Sources<'_>,
    window: &Window,
    dropped: u64,
    ended_early: Option<String>,
) -> Timeline {
    let stop_ns = window.stop_ns;
    let window_start = window.start_ns.max(sources.start_ns);
    let mut cuda = CudaTimelineBuilder::new(window_start, stop_ns)
        .at_most(window.max_events, window.pids.as_ref());
    if let Some(k) = sources.driver_kernel_names {
        cuda.add_driver_names(&k.names);
    }
    let mut warnings = sources.warnings;
    let streamed = sources.streamed.is_some();
    let mut builder = sched_builder(
        sources.streamed,
        (window_start, stop_ns),
        sources.processes,
        sources.initial,
        &mut warnings,
    );
    for &(pid, since_ns) in &sources.tracked_from {
        builder.tracked_from(pid, since_ns);
    }
    // Records before the window still tell each thread's state at its start.
    let mut records = sources.records;
    let samples = take_samples(&mut records, stop_ns);
    let (driver, others) = in_time_order_by_builder(&mut records, stop_ns, streamed);
    let capture_stats = CaptureStats {
        records: 0,
        dropped,
        malformed: sources.malformed,
        inconsistencies: 0,
        ended_early,
        notes: Vec::new(),
        warnings,
        sources: SourceStats {
            kernel_names: sources
                .driver_kernel_names
                .map(|k| k.counts.clone())
                .unwrap_or_default(),
            ..SourceStats::default()
        },
    };
    // The driver's records are built beside the scheduler's, on a thread
    // of their own: a snapshot of a launch loop holds hundreds of
    // thousands of each. Held records are decoded one at a time as each
    // builder takes them.
    let (mut timeline, cuda) = std::thread::scope(|scope| {
        let cuda_built = match driver.is_empty() {
            true => Err(cuda),
            false => Ok(std::thread::Builder::new()
                .name("ebtrace-cuda".into())
                .spawn_scoped(scope, move || build_cuda(cuda, driver))
                .expect("a thread to build the driver calls' spans")),
        };
        for r in others {
            builder.push(&r);
        }
        let timeline = builder.finish(sources.clock, &sources.names, capture_stats);
        let cuda = match cuda_built {
            Ok(thread) => thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            Err(cuda) => cuda.finish(),
        };
        (timeline, cuda)
    });
    drop(records);
    let samples = samples.as_refs();
    if !sources.scheduling {
        without_scheduling(&mut timeline);
    }
    cuda.add_to(&mut timeline);
    if let Some(k) = sources.driver_kernel_names {
        timeline.stats.notes.extend(k.notes.iter().cloned());
    }
    if let Some(traceme) = sources.traceme {
        add_traceme(&mut timeline, traceme);
    }
    if let Some(symbolizer) = sources.stacks {
        add_stacks(&mut timeline, &samples, (window_start, stop_ns), symbolizer);
    }
    add_framework(&mut timeline, sources.recordings);
    add_ops(&mut timeline, sources.recordings);
    add_device_activity(&mut timeline, sources.recordings, sources.device_batches);
    let named = name_launching_ops(&mut timeline);
    for (pid, n) in named.into_iter().collect::<BTreeMap<_, _>>() {
        timeline.stats.notes.push(format!(
            "pid {pid}: {n} kernels, copies and memsets named after the PyTorch op that \
             launched them ({LAUNCHING_OP_STAT})"
        ));
    }
    let cut: u64 = timeline
        .threads
        .values_mut()
        .map(|t| nest(&mut t.spans, Cuts::Marked))
        .sum();
    timeline.stats.sources.spans_cut_to_nest = cut;
    if cut > 0 {
        timeline.stats.notes.push(format!(
            "{cut} spans from different sources overlapped and were cut to nest \
             (stat {CLIPPED_STAT})"
        ));
    }
    window.apply(&mut timeline);
    timeline
}

/// The CUDA driver's spans and GPU streams of `driver`'s records.
fn build_cuda(mut cuda: CudaTimelineBuilder, driver: Ordered<'_>) -> CudaTimeline {
    for r in driver {
        match &*r {
            Record::CudaCall(c) => cuda.push_call(c),
            Record::CudaSymbol(s) => cuda.push_symbol(s),
            _ => unreachable!("only the driver's records are split off"),
        }
    }
    cuda.finish()
}

/// Without the scheduler probes the builder can only guess thread states
/// from `/proc` at the start: drop those guesses, keep the threads.
fn without_scheduling(timeline: &mut Timeline) {
    for t in timeline.threads.values_mut() {
        t.slices.clear();
        t.marks.clear();
        t.counters = Default::default();
    }
}

/// Lays the TraceMe events on the threads' lines and says how it went.
fn add_traceme(timeline: &mut Timeline, traceme: TraceMeInput<'_>) {
    let spans = add_traceme_spans(timeline, traceme.events);
    timeline.stats.sources.traceme = Some(TraceMeSource {
        events: traceme.events.len() as u64,
        spans,
        ..TraceMeSource::default()
    });
    let notes = &mut timeline.stats.notes;
    notes.extend(traceme.notes);
    notes.push(format!(
        "TraceMe: {} events recorded, {} spans on the thread lines \
         ({} outside the window, {} unpaired activity halves, {} cut to nest)",
        traceme.events.len(),
        spans.spans,
        spans.outside_window,
        spans.unpaired_activity_halves,
        spans.clipped
    ));
}

/// The scheduling builder: the one that built thread states while
/// recording, fed what it still queued, or a new one for the window.
fn sched_builder(
    streamed: Option<StreamedScheduling>,
    (window_start, stop_ns): (u64, u64),
    processes: Vec<(u32, String)>,
    initial: HashMap<u32, InitialState>,
    warnings: &mut Vec<String>,
) -> SchedTimelineBuilder {
    match streamed {
        Some(streamed) => {
            let (mut builder, queued, late) = streamed.finish(stop_ns);
            for r in &queued {
                builder.push(r);
            }
            if late > 0 {
                warnings.push(format!(
                    "{late} scheduler records reached ebtrace more than {} ms after later \
                     ones and were laid out of order: some thread states around them may be \
                     wrong",
                    REORDER_SLACK_NS / 1_000_000
                ));
            }
            builder
        }
        None => SchedTimelineBuilder::new(window_start, stop_ns, processes, initial),
    }
}

/// Narrows the scheduling states with the threads' own CPU samples, then
/// lays the samples and off-CPU stacks of `window` on the thread lines.
fn add_stacks(
    timeline: &mut Timeline,
    samples: &[&StackSample],
    (window_start, stop_ns): (u64, u64),
    symbolizer: &mut StackSymbolizer,
) {
    let narrowed = narrow_unknown(timeline, samples);
    // Each such interval hides a switch onto a CPU and one off it.
    timeline.stats.inconsistencies += 2 * narrowed.contradicted;
    if narrowed.contradicted > 0 {
        timeline.stats.notes.push(format!(
            "{} Runnable or Blocked intervals hold stack samples of their own thread, so the \
             kernel left a switch onto a CPU and back unreported in each: shown Unknown, and \
             Running from their first sample to their last",
            narrowed.contradicted
        ));
    }
    if narrowed.unknown > 0 {
        timeline.stats.notes.push(format!(
            "{} of those Unknown intervals narrowed by the threads' own stack samples \
             (shown Running, with a reason)",
            narrowed.unknown
        ));
    }
    let launches = add_launch_stacks(timeline, samples, symbolizer);
    if launches > 0 {
        timeline.stats.notes.push(format!(
            "{launches} driver calls with the stacks they were made from (launch_stack)"
        ));
    }
    let laid = add_cpu_samples(timeline, samples, (window_start, stop_ns), symbolizer);
    timeline.stats.sources.cpu_samples = Some(laid.samples);
    timeline.stats.sources.off_cpu_stacks = Some(laid.off_cpu);
    timeline.stats.sources.python_stacks = Some(PythonStacks {
        stacks_with_python: laid.with_python,
        unreadable_frames: laid.python_unreadable,
        frames_beyond_limit: laid.python_left_out,
    });
    if laid.samples > 0 || (laid.off_cpu == 0 && launches == 0) {
        timeline.stats.notes.push(format!(
            "{} CPU stack samples on the thread lines",
            laid.samples
        ));
    }
    if laid.with_python > 0 {
        timeline.stats.notes.push(format!(
            "{} of the stacks with Python frames ({} Python frames could not be read)",
            laid.with_python, laid.python_unreadable
        ));
    }
    if laid.python_left_out > 0 {
        timeline.stats.notes.push(format!(
            "{} Python frames left out of stacks deeper than {} frames (each stack keeps its \
             innermost {} and outermost {})",
            laid.python_left_out,
            tracer_common::python::MAX_PYTHON_FRAMES,
            tracer_common::python::PYTHON_INNER_FRAMES,
            tracer_common::python::PYTHON_OUTER_FRAMES
        ));
    }
    if laid.off_cpu > 0 {
        timeline.stats.notes.push(format!(
            "{} off-CPU stacks on the thread lines (waits of --off-cpu-min or more)",
            laid.off_cpu
        ));
    }
}

/// Merges what the framework sessions recorded and says how it went.
fn add_framework(timeline: &mut Timeline, recordings: &[AgentRecording]) {
    let mut budget = DecodeBudget::default();
    for (r, xspace) in recordings
        .iter()
        .flat_map(|r| r.xspaces.iter().map(move |x| (r, x)))
    {
        let (mut m, merged) =
            merge_framework_space(timeline, r.pid, xspace, &r.threads, &mut budget);
        m.target_growth = r.target_growth;
        timeline.stats.sources.add_framework(r.pid, &m);
        timeline.stats.notes.push(format!(
            "pid {}: the framework's own session: {} events on the thread lines, \
             {} planes carried over; the process grew by {} MiB at most while it recorded",
            r.pid,
            m.spans,
            m.planes,
            m.target_growth >> 20
        ));
        if m.unnamed_lines > 0 {
            timeline.stats.warnings.push(format!(
                "pid {}: {} events of {} framework threads left out: those threads \
                 ended before ebtrace could name them",
                r.pid, m.unnamed_events, m.unnamed_lines
            ));
        }
        if m.events_over_budget > 0 {
            timeline.stats.warnings.push(format!(
                "pid {}: {} events of the framework's session left out: decoded, they would \
                 take more than the {} MiB a capture keeps of its frameworks' sessions; a shorter \
                 capture records fewer",
                r.pid,
                m.events_over_budget,
                MAX_DECODED_FRAMEWORK_BYTES >> 20
            ));
        }
        if let Err(e) = merged {
            timeline.stats.warnings.push(format!(
                "pid {}: the framework's XSpace is malformed ({e}): what came before that \
                 point is in the trace, the rest is missing",
                r.pid
            ));
        }
    }
}

/// Lays PyTorch's ops on the thread lines and says how it went.
fn add_ops(timeline: &mut Timeline, recordings: &[AgentRecording]) {
    for r in recordings {
        for payload in &r.torch_ops {
            let decoded = match decode_ops(payload) {
                Ok(d) => d,
                Err(why) => {
                    timeline.stats.warnings.push(format!(
                        "pid {}: PyTorch's ops left out: the agent's records are malformed \
                         ({why})",
                        r.pid
                    ));
                    continue;
                }
            };
            let mut ops = decoded.ops;
            for op in &mut ops {
                if let Some(&tid) = r.namespace_tids.get(&op.tid) {
                    op.tid = tid;
                }
            }
            let laid = add_torch_ops(timeline, r.pid, &ops);
            timeline.stats.notes.push(format!(
                "pid {}: PyTorch: {} ops, {} backward functions and {} record_function \
                 ranges on the thread lines ({} outside the window, {} unfinished when it \
                 closed){}{}",
                r.pid,
                laid.ops,
                laid.backward,
                laid.user_ranges,
                laid.outside_window,
                decoded.unpaired,
                match laid.steps {
                    0 => String::new(),
                    n => format!("; {n} of them steps for XProf"),
                },
                match laid.linked {
                    0 => String::new(),
                    n => format!("; {n} backward functions linked to their forward op"),
                }
            ));
            if decoded.dropped > 0 || decoded.names_lost > 0 {
                timeline.stats.warnings.push(format!(
                    "pid {}: PyTorch ops: {} records did not fit the agent's buffer and \
                     {} names its table: shorten the window",
                    r.pid, decoded.dropped, decoded.names_lost
                ));
            }
            if decoded.malformed > 0 {
                timeline.stats.warnings.push(format!(
                    "pid {}: PyTorch ops: {} malformed records left out",
                    r.pid, decoded.malformed
                ));
            }
        }
    }
}

/// Lays what the GPUs ran (CUPTI, through the agent) on their lines and
/// says how it went: the batches taken while recording, then those the
/// sessions handed over when they stopped.
fn add_device_activity(
    timeline: &mut Timeline,
    recordings: &[AgentRecording],
    collected: &[(u32, Vec<u8>)],
) {
    let mut by_pid: BTreeMap<u32, Vec<&[u8]>> = BTreeMap::new();
    for (pid, batch) in collected {
        by_pid.entry(*pid).or_default().push(batch);
    }
    for r in recordings {
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

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind, cuda::CudaCall};

    use super::*;
    use crate::{
        cuda_api,
        timeline::{
            FlowId, Peer, PeerId, ProcessInfo, RunnableCause, Span, TaskState, ThreadState, Value,
        },
    };

    const PID: u32 = 7;
    const TID: u32 = 11;

    fn sync_call(start_ns: u64, end_ns: u64) -> Record {
        let function =
            cuda_api::function_id("cuCtxSynchronize").expect("cuCtxSynchronize is probed");
        Record::CudaCall(Box::new(CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 0, end_ns),
            tid: TID,
            tgid: PID,
            start_ns,
            function,
            flags: 0,
            result: 0,
            args: [0; 6],
            extra: [0; 8],
            out_value: 0,
        }))
    }

    fn traceme(start_ns: i64, end_ns: i64, name: &str) -> TraceMeEvent {
        TraceMeEvent {
            header: RecordHeader::new(RecordKind::TraceMe, 64, 0, end_ns as u64),
            tid: TID,
            tgid: PID,
            site: 0x1000,
            start_time: start_ns,
            end_time: end_ns,
            name: name.into(),
            truncated: false,
            name_len: name.len() as u32,
            name_unreadable: false,
        }
    }

    #[test]
    fn nothing_recorded_gives_the_window_and_its_processes() {
        let clock = ClockSync::from_offset(5);
        let sources = Sources::new(1_000, clock, vec![(PID, "p".into())]);
        let tl = assemble(sources, &Window::between(500, 2_000), 3, Some("why".into()));
        let expected = Timeline {
            peers: Vec::new(),
            start_ns: 1_000,
            stop_ns: 2_000,
            clock,
            processes: [(
                PID,
                ProcessInfo {
                    pid: PID,
                    name: "p".into(),
                    exited_ns: None,
                },
            )]
            .into(),
            threads: BTreeMap::new(),
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats: CaptureStats {
                dropped: 3,
                ended_early: Some("why".into()),
                ..CaptureStats::default()
            },
        };
        assert_eq!(tl, expected);
    }

    /// Records out of time order, a driver call that outlives the TraceMe
    /// enclosing its start, and a capture with or without the scheduler.
    #[test]
    fn every_source_lands_on_one_timeline_whose_spans_nest() {
        let events = [traceme(1_200, 1_300, "step#n=1#")];
        let assembled = |scheduling: bool| {
            let records = vec![
                Record::sched_switch(1_150, 0, (0, 0), 0, (TID, PID)),
                Record::sched_waking(1_100, (TID, PID), (PID, PID)),
                sync_call(1_250, 1_320),
            ];
            let initial = [(
                TID,
                InitialState {
                    pid: PID,
                    name: "worker".into(),
                    state: 'S',
                    cpu: 0,
                },
            )];
            let sources = Sources {
                scheduling,
                initial: initial.into(),
                records: RecordInput::Decoded(records),
                traceme: Some(TraceMeInput {
                    events: &events,
                    notes: vec!["recorder found".into()],
                }),
                warnings: vec!["a probe complained".into()],
                ..Sources::new(1_000, ClockSync::from_offset(0), vec![(PID, "p".into())])
            };
            assemble(sources, &Window::between(1_000, 2_000), 0, None)
        };

        let tl = assembled(true);
        let t = &tl.threads[&TID];
        let slices: Vec<(u64, u64, ThreadState)> = t
            .slices
            .iter()
            .map(|s| (s.start_ns, s.end_ns, s.state()))
            .collect();
        // The waker's line shows its wake-up mark: the flow has both ends.
        let waker = tl
            .peers
            .iter()
            .position(|&p| p == Peer { tid: PID, pid: PID });
        let woken = RunnableCause::Woken {
            waker: waker.and_then(PeerId::new).expect("the waker is a peer"),
            flow_id: FlowId::new(1),
        };
        let sleeping = TaskState::Sleeping;
        assert_eq!(
            slices,
            vec![
                (1_000, 1_100, ThreadState::Blocked { state: sleeping }),
                (1_100, 1_150, ThreadState::Runnable { cause: woken }),
                (1_150, 2_000, ThreadState::Running { cpu: 0 }),
            ]
        );
        let spans: Vec<(&str, u64, u64)> = t
            .spans
            .iter()
            .map(|s| (&*s.name, s.start_ns, s.end_ns))
            .collect();
        assert_eq!(
            spans,
            vec![("step", 1_200, 1_300), ("cuCtxSynchronize", 1_250, 1_300)]
        );
        let clipped = |s: &Span| {
            s.stats
                .iter()
                .find(|(k, _)| k == CLIPPED_STAT)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(clipped(&t.spans[0]), None);
        assert_eq!(clipped(&t.spans[1]), Some(Value::I64(20)));
        assert_eq!(tl.stats.records, 3, "2 scheduler records and 1 driver call");
        assert_eq!(tl.stats.warnings, vec!["a probe complained".to_string()]);
        let notes = &tl.stats.notes;
        assert_eq!(notes[0], "recorder found");
        assert!(notes[1].starts_with("TraceMe: 1 events recorded, 1 spans"));
        assert!(notes[2].starts_with("1 spans from different sources overlapped"));
        assert_eq!(notes.len(), 3);
        let lines = tl.cpu_lines();
        let cpus: Vec<(u32, usize)> = lines.iter().map(|(cpu, l)| (cpu, l.count())).collect();
        assert_eq!(cpus, vec![(0, 1)]);

        // Without the scheduler, the thread keeps its spans but no states.
        let tl = assembled(false);
        let t = &tl.threads[&TID];
        assert!(t.slices.is_empty() && t.marks.is_empty() && tl.cpu_lines().is_empty());
        assert_eq!(t.spans.len(), 2);
    }

    /// A window whose thread states were built while it was recorded, its
    /// records kept as well (a `serve` session's), is the window built from
    /// the records at the end: records past its end and driver calls among
    /// them included.
    #[test]
    fn a_window_built_while_recording_is_the_one_built_at_the_end() {
        let ms = 1_000_000;
        let (start, stop) = (10 * ms, 400 * ms);
        let (a, b) = (TID, TID + 1);
        let mut records = Vec::new();
        for i in 0..2_000u64 {
            let ts = start + i * ms / 4;
            let (prev, next) = if i % 2 == 0 { (a, b) } else { (b, a) };
            records.push(Record::sched_waking(ts, (next, PID), (prev, PID)));
            records.push(Record::sched_switch(ts + 1, 0, (prev, PID), 1, (next, PID)));
            if i % 50 == 0 {
                records.push(sync_call(ts + 2, ts + 1_000));
            }
        }
        // Neighbours swapped, as the ring buffer may deliver them.
        for pair in records.chunks_mut(2) {
            pair.reverse();
        }
        let initial = || {
            [a, b]
                .into_iter()
                .map(|tid| {
                    let state = InitialState {
                        pid: PID,
                        name: "w".into(),
                        state: 'S',
                        cpu: 0,
                    };
                    (tid, state)
                })
                .collect::<HashMap<_, _>>()
        };
        let processes = || vec![(PID, "p".to_string())];
        let assembled = |max_events: Option<usize>, streaming: bool| {
            let mut streamed =
                StreamedScheduling::until(start, stop, processes(), initial()).at_most(max_events);
            for batch in records.chunks(300) {
                for r in batch.iter().filter(|r| StreamedScheduling::takes(r)) {
                    streamed.push(r.clone());
                }
                streamed.settle();
            }
            let sources = Sources {
                scheduling: true,
                initial: initial(),
                records: RecordInput::Decoded(records.clone()),
                streamed: streaming.then_some(streamed),
                ..Sources::new(start, ClockSync::from_offset(0), processes())
            };
            let window = Window {
                max_events,
                ..Window::between(start, stop)
            };
            assemble(sources, &window, 0, None)
        };
        let at_the_end = assembled(None, false);
        assert!(at_the_end.threads[&a].slices.len() > 1_000);
        assert_eq!(at_the_end.threads[&a].spans.len(), 32);
        assert_eq!(assembled(None, true), at_the_end);

        // Cut at max_events, where building stopped early: the same trace
        // but for the threads' whole-window counters.
        let without_counters = |mut tl: Timeline| {
            tl.threads
                .values_mut()
                .for_each(|t| t.counters = Default::default());
            tl
        };
        let at_the_end = without_counters(assembled(Some(1_000), false));
        assert!(
            at_the_end.stop_ns < stop / 2,
            "cut at {}",
            at_the_end.stop_ns
        );
        assert_eq!(without_counters(assembled(Some(1_000), true)), at_the_end);
    }
}
