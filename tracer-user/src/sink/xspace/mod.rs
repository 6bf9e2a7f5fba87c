//! The XSpace sink: the timeline model as an XProf `XSpace`.
//!
//! Layout (conventions from TSL's `xplane_schema`):
//! - `/host:CPU`: one line per traced thread (id = tid, name = thread name)
//!   and one per CPU that ran a traced thread (id = [`CPU_LINE_BASE`] + cpu,
//!   above any tid the kernel hands out and below XProf's derived-line ids).
//! - `/device:GPU:<ordinal>` (plane id = ordinal): one line per stream (id =
//!   stream id, named `Stream #<id>`) with the work the host submitted to
//!   it; host-observed times, as the plane's `ebtrace_timing` stat says.
//! - `Task Environment`: `profile_start_time` / `profile_stop_time` (epoch
//!   ns) and ebtrace's capture accounting.
//!
//! Line timestamps are relative to the profile start (absolute epoch values
//! overflow XProf's trace viewer). Events on a line must nest and never
//! partially overlap: scheduling states partition a thread's time, so they
//! are leaves; instants sit inside them; spans from other sources (TraceMe,
//! CUDA calls) are laid above them, and a state slice is cut at every span
//! boundary so both fit on one line.

use rustc_hash::FxHashMap;

use ebtrace_proto::tensorflow::profiler::XSpace;
use prost::Message as _;

use crate::timeline::{
    DeviceTrack, MarkKind, RunnableCause, Span, StateSlice, ThreadState, ThreadTrack, Timeline,
};

pub const HOST_CPU_PLANE: &str = "/host:CPU";
pub const TASK_ENV_PLANE: &str = "Task Environment";
/// Prefix of the GPU planes; the device ordinal follows.
pub const GPU_PLANE_PREFIX: &str = "/device:GPU:";
/// Says, on each GPU plane, what its times are.
pub const HOST_OBSERVED_TIMING: &str = "host-observed: each event spans the driver call that \
     submitted the work, not its execution on the GPU (which needs CUPTI)";
/// First line id of the per-CPU lines (pid_max is at most 2^22).
pub const CPU_LINE_BASE: i64 = 0xFFFF_0000;

/// XProf flow stat: 2-bit direction, 56-bit id, 6-bit context type.
pub fn flow_stat_value(id: u64, direction: FlowDirection) -> u64 {
    const GENERIC_CONTEXT: u64 = 0;
    (direction as u64) | ((id & ((1 << 56) - 1)) << 2) | (GENERIC_CONTEXT << 58)
}

#[derive(Clone, Copy, Debug)]
#[repr(u64)]
pub enum FlowDirection {
    In = 1,
    Out = 2,
}

mod plane;

pub use plane::{Encoded, EventStats, LineEvent, Stat, XPlaneBuilder};

/// Stat values are the timeline's values.
pub use crate::timeline::Value as StatValue;

/// Merges two event streams sorted by [`LineEvent::order_key`]; on equal
/// keys `a`'s event comes first (as a stable sort of `a` then `b` would).
struct Merge<'a, A: Iterator<Item = LineEvent<'a>>, B: Iterator<Item = LineEvent<'a>>> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

fn merge<'a, A, B>(a: A, b: B) -> Merge<'a, A, B>
where
    A: Iterator<Item = LineEvent<'a>>,
    B: Iterator<Item = LineEvent<'a>>,
{
    Merge {
        a: a.peekable(),
        b: b.peekable(),
    }
}

impl<'a, A, B> Iterator for Merge<'a, A, B>
where
    A: Iterator<Item = LineEvent<'a>>,
    B: Iterator<Item = LineEvent<'a>>,
{
    type Item = LineEvent<'a>;

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.a.size_hint().0 + self.b.size_hint().0, None)
    }

    #[inline]
    fn next(&mut self) -> Option<LineEvent<'a>> {
        let Some(y) = self.b.peek() else {
            return self.a.next();
        };
        match self.a.peek() {
            Some(x) if y.order_key() < x.order_key() => self.b.next(),
            Some(_) => self.a.next(),
            None => self.b.next(),
        }
    }
}

/// A thread's scheduling states as events, each cut at every span edge
/// inside it (`edges` sorted, without repeats). States partition time, so
/// the edges are walked once.
struct StateEvents<'a, P: Fn(u64) -> i64> {
    slices: std::slice::Iter<'a, StateSlice>,
    edges: &'a [u64],
    ids: &'a SchedIds,
    ps: P,
    /// The state being cut: its name, stats, where the next piece starts
    /// and where the state ends.
    current: Option<(i64, EventStats<'static>, u64, u64)>,
}

impl<'a, P: Fn(u64) -> i64> Iterator for StateEvents<'a, P> {
    type Item = LineEvent<'a>;

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.slices.len(), None)
    }

    #[inline]
    fn next(&mut self) -> Option<LineEvent<'a>> {
        let (name, stats, from, end) = match self.current.take() {
            Some(c) => c,
            None => {
                let s = self.slices.next()?;
                let (name, stats) = self.ids.state(&s.state);
                (name, stats, s.start_ns, s.end_ns)
            }
        };
        while self.edges.first().is_some_and(|&e| e <= from) {
            self.edges = &self.edges[1..];
        }
        let to = match self.edges.first() {
            Some(&e) if e < end => {
                self.current = Some((name, stats, e, end));
                e
            }
            _ => end,
        };
        Some(LineEvent {
            metadata_id: name,
            offset_ps: (self.ps)(from),
            duration_ps: (self.ps)(to) - (self.ps)(from),
            stats,
        })
    }
}

/// The ids of the names scheduling events use, interned once per plane;
/// [`prepare`](Self::prepare) interns those a thread's events need, so the
/// events can then be produced (twice: see [`XPlaneBuilder::write_line`])
/// without touching the plane.
struct SchedIds {
    running: i64,
    runnable: i64,
    blocked: i64,
    wakeup: i64,
    cpu: i64,
    cause: i64,
    waker_tid: i64,
    waker_pid: i64,
    flow: i64,
    woken_tid: i64,
    woken_pid: i64,
    woken: i64,
    preempted: i64,
    prev_state: i64,
    /// Names used by fewer events, interned on first use.
    rare: FxHashMap<&'static str, i64>,
}

/// The rarer names: why a thread was runnable, blocked states, instants.
const YIELDED: &str = "yielded";
const NEW_THREAD: &str = "new thread";
const AT_START: &str = "runnable at capture start";
const UNKNOWN: &str = "Unknown";
const REASON: &str = "reason";
const NO_EVENT: &str = "the kernel reported no scheduler event for this interval";
const THREAD_CREATED: &str = "Thread created";
const PROCESS_FORKED: &str = "Process forked";
const THREAD_EXIT: &str = "Thread exit";
const TID: &str = "tid";
const CHILD_PID: &str = "child_pid";

impl SchedIds {
    fn new(plane: &mut XPlaneBuilder) -> Self {
        SchedIds {
            running: plane.event_metadata("Running"),
            runnable: plane.event_metadata("Runnable"),
            blocked: plane.event_metadata("Blocked"),
            wakeup: plane.event_metadata("Wakeup"),
            cpu: plane.stat_metadata("cpu"),
            cause: plane.stat_metadata("cause"),
            waker_tid: plane.stat_metadata("waker_tid"),
            waker_pid: plane.stat_metadata("waker_pid"),
            flow: plane.stat_metadata("flow"),
            woken_tid: plane.stat_metadata("woken_tid"),
            woken_pid: plane.stat_metadata("woken_pid"),
            woken: plane.stat_metadata("woken"),
            preempted: plane.stat_metadata("preempted"),
            prev_state: plane.stat_metadata("prev_state"),
            rare: FxHashMap::default(),
        }
    }

    /// Interns the rarer names `thread`'s events use.
    fn prepare(&mut self, plane: &mut XPlaneBuilder, thread: &ThreadTrack) {
        let mut need = |name: &'static str, event: bool| {
            self.rare.entry(name).or_insert_with(|| {
                if event {
                    plane.event_metadata(name)
                } else {
                    plane.stat_metadata(name)
                }
            });
        };
        for s in &thread.slices {
            match s.state {
                ThreadState::Runnable {
                    cause: RunnableCause::Yielded,
                } => need(YIELDED, false),
                ThreadState::Runnable {
                    cause: RunnableCause::Created,
                } => need(NEW_THREAD, false),
                ThreadState::Runnable {
                    cause: RunnableCause::AtStart,
                } => need(AT_START, false),
                ThreadState::Blocked { state } => need(state.describe(), false),
                ThreadState::Unknown => {
                    need(UNKNOWN, true);
                    need(REASON, false);
                    need(NO_EVENT, false);
                }
                _ => {}
            }
        }
        for m in &thread.marks {
            match m.kind {
                MarkKind::ThreadCreated { .. } => {
                    need(THREAD_CREATED, true);
                    need(TID, false);
                }
                MarkKind::ProcessForked { .. } => {
                    need(PROCESS_FORKED, true);
                    need(CHILD_PID, false);
                }
                MarkKind::Exited => need(THREAD_EXIT, true),
                MarkKind::Wakeup { .. } => {}
            }
        }
    }

    /// A name [`prepare`](Self::prepare) interned.
    fn rare(&self, name: &str) -> i64 {
        self.rare[name]
    }

    /// The event name and stats of a scheduling state.
    fn state(&self, state: &ThreadState) -> (i64, EventStats<'static>) {
        let one = |s: Stat| EventStats::inline(&[s]);
        match *state {
            ThreadState::Running { cpu } => (self.running, one(Stat::i64(self.cpu, cpu.into()))),
            ThreadState::Runnable { cause } => {
                let cause_is = |id| Stat::reference(self.cause, id);
                let stats = match cause {
                    RunnableCause::Woken {
                        waker_tid,
                        waker_pid,
                        flow_id,
                    } => EventStats::inline(&[
                        cause_is(self.woken),
                        Stat::i64(self.waker_tid, waker_tid.into()),
                        Stat::i64(self.waker_pid, waker_pid.into()),
                        Stat::u64(self.flow, flow_stat_value(flow_id, FlowDirection::In)),
                    ]),
                    RunnableCause::Preempted => one(cause_is(self.preempted)),
                    RunnableCause::Yielded => one(cause_is(self.rare(YIELDED))),
                    RunnableCause::Created => one(cause_is(self.rare(NEW_THREAD))),
                    RunnableCause::AtStart => one(cause_is(self.rare(AT_START))),
                };
                (self.runnable, stats)
            }
            ThreadState::Blocked { state } => {
                let text = self.rare(state.describe());
                (self.blocked, one(Stat::reference(self.prev_state, text)))
            }
            ThreadState::Unknown => {
                let why = Stat::reference(self.rare(REASON), self.rare(NO_EVENT));
                (self.rare(UNKNOWN), one(why))
            }
        }
    }

    /// The event name and stats of an instant.
    fn mark(&self, kind: &MarkKind) -> (i64, EventStats<'static>) {
        match *kind {
            MarkKind::Wakeup { tid, pid, flow_id } => (
                self.wakeup,
                EventStats::inline(&[
                    Stat::i64(self.woken_tid, tid.into()),
                    Stat::i64(self.woken_pid, pid.into()),
                    Stat::u64(self.flow, flow_stat_value(flow_id, FlowDirection::Out)),
                ]),
            ),
            MarkKind::ThreadCreated { tid } => (
                self.rare(THREAD_CREATED),
                EventStats::inline(&[Stat::i64(self.rare(TID), tid.into())]),
            ),
            MarkKind::ProcessForked { pid } => (
                self.rare(PROCESS_FORKED),
                EventStats::inline(&[Stat::i64(self.rare(CHILD_PID), pid.into())]),
            ),
            MarkKind::Exited => (self.rare(THREAD_EXIT), EventStats::inline(&[])),
        }
    }
}

/// A thread's spans with their names and stats interned: the stats of span
/// `i` are `stats[ranges[i]]`.
struct InternedSpans {
    names: Vec<i64>,
    ranges: Vec<std::ops::Range<usize>>,
    stats: Vec<Stat>,
    /// Span indices in [`LineEvent::order_key`] order.
    order: Vec<usize>,
}

impl InternedSpans {
    fn new(plane: &mut XPlaneBuilder, spans: &[Span]) -> Self {
        let mut out = InternedSpans {
            names: Vec::with_capacity(spans.len()),
            ranges: Vec::with_capacity(spans.len()),
            stats: Vec::new(),
            order: (0..spans.len()).collect(),
        };
        for span in spans {
            out.names.push(plane.event_metadata(&span.name));
            let from = out.stats.len();
            for (k, v) in &span.stats {
                let stat = plane.stat(k, v);
                out.stats.push(stat);
            }
            out.ranges.push(from..out.stats.len());
        }
        // Timelines come with their spans nested and sorted (`nest_spans`).
        out.order
            .sort_by_key(|&i| (spans[i].start_ns, std::cmp::Reverse(spans[i].end_ns)));
        out
    }
}

/// Queues a span (its stats interned) on the plane's current line.
fn push_span(
    plane: &mut XPlaneBuilder,
    name: &str,
    start: i64,
    end: i64,
    stats: &[(String, StatValue)],
) {
    let id = plane.event_metadata(name);
    let stats: Vec<Stat> = stats.iter().map(|(k, v)| plane.stat(k, v)).collect();
    plane.push_event(id, start, end - start, &stats);
}

/// Host name to record in the XSpace (XProf matches it to the file name).
pub fn local_hostname() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Converts a timeline into an XSpace for `hostname` (decoded form; sinks
/// that only write should use [`timeline_to_xspace_bytes`]).
pub fn timeline_to_xspace(timeline: &Timeline, hostname: &str) -> XSpace {
    XSpace::decode(timeline_to_xspace_bytes(timeline, hostname).as_slice())
        .expect("we encode valid XSpaces")
}

/// Converts a timeline into an encoded XSpace for `hostname`.
pub fn timeline_to_xspace_bytes(timeline: &Timeline, hostname: &str) -> Vec<u8> {
    let start = timeline.start_ns;
    let ps = |ns: u64| (ns.saturating_sub(start) as i64) * 1000;
    let mut host = XPlaneBuilder::new(0, HOST_CPU_PLANE);
    let mut ids = SchedIds::new(&mut host);

    for t in timeline.threads.values() {
        ids.prepare(&mut host, t);
        let spans = InternedSpans::new(&mut host, &t.spans);
        // Spans sit above the states: cut each state at every span edge.
        let mut edges: Vec<u64> = t
            .spans
            .iter()
            .flat_map(|s| [s.start_ns, s.end_ns])
            .collect();
        edges.sort_unstable();
        edges.dedup();
        let ids = &ids;
        let events = {
            let states = StateEvents {
                slices: t.slices.iter(),
                edges: &edges,
                ids,
                ps,
                current: None,
            };
            let spans = spans.order.iter().map(|&i| {
                let span = &t.spans[i];
                LineEvent {
                    metadata_id: spans.names[i],
                    offset_ps: ps(span.start_ns),
                    duration_ps: ps(span.end_ns) - ps(span.start_ns),
                    stats: EventStats::Shared(&spans.stats[spans.ranges[i].clone()]),
                }
            });
            let marks = t.marks.iter().map(|m| {
                let (name, stats) = ids.mark(&m.kind);
                LineEvent {
                    metadata_id: name,
                    offset_ps: ps(m.ts_ns),
                    duration_ps: 0,
                    stats,
                }
            });
            merge(merge(states, spans), marks)
        };
        let process = timeline
            .processes
            .get(&t.pid)
            .map_or(String::new(), |p| p.name.clone());
        let display = format!("{} [{}] ({} {})", t.name, t.tid, process, t.pid);
        host.write_line(t.tid.into(), &t.name, &display, events);
    }

    // Each CPU slice is named after the thread it ran.
    let (tid_stat, pid_stat) = (host.stat_metadata(TID), host.stat_metadata("pid"));
    let mut thread_event: FxHashMap<u32, i64> = FxHashMap::default();
    for slices in timeline.cpus.values() {
        for s in slices {
            thread_event
                .entry(s.tid)
                .or_insert_with(|| match timeline.threads.get(&s.tid) {
                    Some(t) => host.event_metadata(&t.name),
                    None => host.event_metadata(&format!("thread {}", s.tid)),
                });
        }
    }
    for (cpu, slices) in &timeline.cpus {
        let events = {
            slices.iter().map(|s| LineEvent {
                metadata_id: thread_event[&s.tid],
                offset_ps: ps(s.start_ns),
                duration_ps: ps(s.end_ns) - ps(s.start_ns),
                stats: EventStats::inline(&[
                    Stat::i64(tid_stat, s.tid.into()),
                    Stat::i64(pid_stat, s.pid.into()),
                ]),
            })
        };
        let name = format!("CPU {cpu}");
        host.write_line(CPU_LINE_BASE + i64::from(*cpu), &name, &name, events);
    }

    let devices = timeline
        .devices
        .values()
        .map(|d| device_plane(d, &ps))
        .collect::<Vec<_>>();

    let mut env = XPlaneBuilder::new(1, TASK_ENV_PLANE);
    env.add_plane_stat(
        "profile_start_time",
        &StatValue::U64(timeline.clock.to_wall_ns(timeline.start_ns)),
    );
    env.add_plane_stat(
        "profile_stop_time",
        &StatValue::U64(timeline.clock.to_wall_ns(timeline.stop_ns)),
    );
    env.add_plane_stat(
        "ebtrace_version",
        &StatValue::Str(env!("CARGO_PKG_VERSION").into()),
    );
    env.add_plane_stat("ebtrace_records", &StatValue::U64(timeline.stats.records));
    env.add_plane_stat(
        "ebtrace_dropped_records",
        &StatValue::U64(timeline.stats.dropped),
    );
    env.add_plane_stat(
        "ebtrace_unreported_transitions",
        &StatValue::U64(timeline.stats.inconsistencies),
    );
    let pids = timeline
        .processes
        .keys()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    env.add_plane_stat("ebtrace_pids", &StatValue::Str(pids));

    let mut warnings = Vec::new();
    if timeline.stats.dropped > 0 {
        warnings.push(format!(
            "ebtrace: {} records were dropped (ring buffer full); this trace is partial",
            timeline.stats.dropped
        ));
    }
    if timeline.stats.inconsistencies > 0 {
        warnings.push(format!(
            "ebtrace: {} scheduler transitions were not reported by the kernel; \
             the intervals they leave unexplained are marked Unknown",
            timeline.stats.inconsistencies
        ));
    }
    if let Some(why) = &timeline.stats.ended_early {
        warnings.push(format!("ebtrace: capture ended early: {why}"));
    }
    warnings.extend(
        timeline
            .stats
            .warnings
            .iter()
            .map(|w| format!("ebtrace: {w}")),
    );
    // The host plane is by far the largest: its buffer becomes the output
    // (fields may come in any order; XSpace's own follow its planes).
    let mut out = host.into_field(1);
    for device in devices {
        out.extend_from_slice(&device.into_field(1));
    }
    out.extend_from_slice(&env.into_field(1));
    XSpace {
        planes: vec![],
        errors: vec![],
        warnings,
        hostnames: vec![hostname.to_string()],
    }
    .encode(&mut out)
    .expect("a Vec grows as needed");
    out
}

/// A GPU plane: one line per stream, events as recorded (they neither
/// overlap nor nest on a stream).
fn device_plane(device: &DeviceTrack, ps: &impl Fn(u64) -> i64) -> XPlaneBuilder {
    let mut plane = XPlaneBuilder::new(
        i64::from(device.ordinal),
        &format!("{GPU_PLANE_PREFIX}{}", device.ordinal),
    );
    plane.add_plane_stat("device_ordinal", &StatValue::I64(device.ordinal.into()));
    plane.add_plane_stat(
        "ebtrace_timing",
        &StatValue::Str(HOST_OBSERVED_TIMING.into()),
    );
    for stream in device.streams.values() {
        for e in &stream.events {
            push_span(&mut plane, &e.name, ps(e.start_ns), ps(e.end_ns), &e.stats);
        }
        let name = format!("Stream #{}", stream.id);
        let display = format!("{name} ({}; host-observed)", stream.label);
        plane.finish_line(stream.id, &name, &display);
    }
    plane
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use ebtrace_proto::tensorflow::profiler::{XEvent, x_event, x_stat};

    use super::*;
    use crate::{
        clock::ClockSync,
        timeline::{CaptureStats, StateSlice, TaskState, ThreadCounters, ThreadTrack},
    };

    fn offset_ps(e: &XEvent) -> i64 {
        match e.data {
            Some(x_event::Data::OffsetPs(o)) => o,
            _ => 0,
        }
    }

    #[test]
    fn flow_bits() {
        assert_eq!(flow_stat_value(5, FlowDirection::Out), (5 << 2) | 2);
        assert_eq!(flow_stat_value(5, FlowDirection::In) & 3, 1);
    }

    #[test]
    fn builds_relative_lines_and_task_environment() {
        let slices = vec![
            StateSlice {
                start_ns: 1_000,
                end_ns: 1_500,
                state: ThreadState::Running { cpu: 1 },
            },
            StateSlice {
                start_ns: 1_500,
                end_ns: 2_000,
                state: ThreadState::Blocked {
                    state: TaskState::Sleeping,
                },
            },
        ];
        let mut threads = BTreeMap::new();
        threads.insert(
            42,
            ThreadTrack {
                tid: 42,
                pid: 42,
                name: "worker".into(),
                slices,
                marks: vec![],
                spans: vec![crate::timeline::Span {
                    start_ns: 1_200,
                    end_ns: 1_700,
                    name: "step".into(),
                    stats: vec![("step_num".into(), StatValue::I64(3))],
                }],
                counters: ThreadCounters::default(),
            },
        );
        let tl = Timeline {
            start_ns: 1_000,
            stop_ns: 2_000,
            clock: ClockSync::from_offset(1_000_000),
            processes: BTreeMap::new(),
            threads,
            cpus: BTreeMap::new(),
            devices: BTreeMap::new(),
            stats: CaptureStats::default(),
        };
        let xs = timeline_to_xspace(&tl, "host");
        assert_eq!(xs.hostnames, vec!["host"]);
        let cpu = &xs.planes[0];
        assert_eq!(cpu.name, HOST_CPU_PLANE);
        let line = &cpu.lines[0];
        assert_eq!(
            (line.id, line.name.as_str(), line.timestamp_ns),
            (42, "worker", 0)
        );
        let names: HashMap<i64, &str> = cpu
            .event_metadata
            .values()
            .map(|m| (m.id, m.name.as_str()))
            .collect();
        let ev: Vec<(&str, i64, i64)> = line
            .events
            .iter()
            .map(|e| (names[&e.metadata_id], offset_ps(e), e.duration_ps))
            .collect();
        // The span sits above the states, which are cut at its edges.
        assert_eq!(
            ev,
            vec![
                ("Running", 0, 200_000),
                ("step", 200_000, 500_000),
                ("Running", 200_000, 300_000),
                ("Blocked", 500_000, 200_000),
                ("Blocked", 700_000, 300_000),
            ]
        );
        let env = &xs.planes[1];
        let stat_names: HashMap<i64, &str> = env
            .stat_metadata
            .values()
            .map(|m| (m.id, m.name.as_str()))
            .collect();
        let start = env
            .stats
            .iter()
            .find(|s| stat_names[&s.metadata_id] == "profile_start_time")
            .unwrap();
        assert_eq!(start.value, Some(x_stat::Value::Uint64Value(1_001_000)));
    }
}
