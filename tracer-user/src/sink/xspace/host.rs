//! The host planes: `/host:CPU`, one line per traced thread with its
//! scheduling states, the spans of other sources laid above them and its
//! instants (wake-ups, thread creation, exit); the threads that stayed
//! blocked through the whole capture, on a plane of their own; and one line
//! per CPU, on another.
//!
//! Every line is streamed into its plane: a thread's three sources are each
//! sorted already, so they are merged as they are encoded.

use std::io;

use rustc_hash::FxHashMap;

use super::{
    BLOCKED_THREADS_PLANE, CPU_LINE_BASE, EncodeEvent, EventStats, FlowDirection, HOST_CPU_PLANE,
    LEAST_RUN_THREADS_PLANE, LineEvent, LineOut, PER_CPU_PLANE, PlaneOut, PlaneStream,
    SharedGroups, SharedStats, Stat, XPlaneBuilder, encode_line, flow_stat_value,
};
use crate::timeline::{
    CpuLines, FlowId, MarkKind, Peer, RunnableCause, Span, StateSlice, ThreadState, ThreadTrack,
    Timeline, peer_in,
};

/// Writes `/host:CPU` to `out`, the first host plane; the per-CPU lines'
/// ([`write_per_cpu_lines`], apart so that it can be encoded beside this
/// one), the threads blocked throughout ([`write_blocked_plane`]) and the
/// threads that ran least ([`write_least_run_plane`]) come next when they
/// have lines. `ps` turns a timeline time into picoseconds from the
/// profile start. Each line goes out as it is made.
///
/// XProf's trace viewer shows each plane named `/host:CPU...` as a process
/// of its own, and opens a process of more than 20 lines collapsed into
/// one grey bar. A process's idle pool threads and the CPUs would take it
/// past that; kept apart, `/host:CPU` holds the threads that did something,
/// about those a profiler inside the process shows.
pub(super) fn write_threads_plane<W: PlaneOut>(
    timeline: &Timeline,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let threads = host_threads(timeline, false).into_iter();
    write_thread_plane(0, HOST_CPU_PLANE, threads, timeline, ps, out)
}

/// The per-CPU lines' plane, when a thread ran (see [`write_threads_plane`]).
pub(super) fn write_per_cpu_lines<W: PlaneOut>(
    timeline: &Timeline,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let cpu_lines = timeline.cpu_lines();
    if cpu_lines.is_empty() {
        return Ok(());
    }
    write_per_cpu_plane(&cpu_lines, ps, out)
}

/// The plane of the threads blocked throughout, when there are any (see
/// [`write_threads_plane`]).
pub(super) fn write_blocked_plane<W: PlaneOut>(
    timeline: &Timeline,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let mut blocked = thread_lines(timeline, true).peekable();
    if blocked.peek().is_none() {
        return Ok(());
    }
    write_thread_plane(3, BLOCKED_THREADS_PLANE, blocked, timeline, ps, out)
}

/// The plane of the threads that ran least, when `/host:CPU` would have
/// had more lines than the trace viewer opens (see [`host_threads`]).
pub(super) fn write_least_run_plane<W: PlaneOut>(
    timeline: &Timeline,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let moved = host_threads(timeline, true);
    if moved.is_empty() {
        return Ok(());
    }
    write_thread_plane(
        4,
        LEAST_RUN_THREADS_PLANE,
        moved.into_iter(),
        timeline,
        ps,
        out,
    )
}

/// The threads of `timeline` that were blocked throughout, or the others.
fn thread_lines(timeline: &Timeline, blocked: bool) -> impl Iterator<Item = &ThreadTrack> {
    timeline
        .threads
        .values()
        .filter(move |t| blocked_throughout(t) == blocked)
}

/// The most lines of a process XProf's trace viewer opens it with
/// (`_collapseBigProcessTracks` in its `trace_viewer_index.js`).
const TRACE_VIEWER_OPEN_MAX_LINES: usize = 20;

/// The threads not blocked throughout that `/host:CPU` shows, or (`moved`)
/// those [`LEAST_RUN_THREADS_PLANE`] shows instead. Past
/// [`TRACE_VIEWER_OPEN_MAX_LINES`] of them, those without a span (no
/// TraceMe range, driver call or wait) that were on a CPU least move, the
/// threads of ebtrace's own agent first, until `/host:CPU` opens: the pool
/// threads that woke for a few microseconds make way for the threads a
/// profiler inside the process shows. Threads with spans all stay.
fn host_threads(timeline: &Timeline, moved: bool) -> Vec<&ThreadTrack> {
    let active: Vec<&ThreadTrack> = thread_lines(timeline, false).collect();
    let excess = active.len().saturating_sub(TRACE_VIEWER_OPEN_MAX_LINES);
    let mut movable: Vec<&ThreadTrack> = active
        .iter()
        .copied()
        .filter(|t| t.spans.is_empty())
        .collect();
    movable.sort_by_key(|t| (!is_agent_thread(t), t.counters.on_cpu_ns, t.tid));
    movable.truncate(excess);
    let is_moved = |t: &ThreadTrack| movable.iter().any(|m| m.tid == t.tid);
    active
        .into_iter()
        .filter(|t| is_moved(t) == moved)
        .collect()
}

/// Whether `thread` is one of ebtrace's agent's, not the program's.
fn is_agent_thread(thread: &ThreadTrack) -> bool {
    thread.name.starts_with("ebtrace-agent")
}

/// Writes plane `id`, named `name`, with one line per thread of `threads`.
fn write_thread_plane<'a, W: PlaneOut>(
    id: i64,
    name: &str,
    threads: impl Iterator<Item = &'a ThreadTrack>,
    timeline: &Timeline,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let mut plane = HostThreads::new(id, name);
    let mut stream = PlaneStream::begin(out, 1)?;
    for t in threads {
        let process = timeline
            .processes
            .get(&t.pid)
            .map_or("", |p| p.name.as_str());
        stream.line(|out| plane.write(t, process, &timeline.peers, ps, out))?;
    }
    stream.end(plane.plane)
}

/// Whether the capture saw `thread` do nothing: blocked from start to end,
/// without a span or an instant.
fn blocked_throughout(thread: &ThreadTrack) -> bool {
    !thread.slices.is_empty()
        && thread
            .slices
            .iter()
            .all(|s| matches!(s.state(), ThreadState::Blocked { .. }))
        && thread.spans.is_empty()
        && thread.marks.is_empty()
}

/// A plane of thread lines.
struct HostThreads {
    plane: XPlaneBuilder,
    ids: SchedIds,
}

impl HostThreads {
    fn new(id: i64, name: &str) -> Self {
        let mut plane = XPlaneBuilder::new(id, name);
        let ids = SchedIds::new(&mut plane);
        HostThreads { plane, ids }
    }

    /// Encodes `t`'s line into `out` (`process` is its process's name,
    /// `peers` the timeline's).
    fn write(
        &mut self,
        t: &ThreadTrack,
        process: &str,
        peers: &[Peer],
        ps: &impl Fn(u64) -> i64,
        out: &mut LineOut<'_>,
    ) {
        let host = &mut self.plane;
        self.ids.prepare(host, t);
        let spans = InternedSpans::new(host, &t.spans);
        // Spans sit above the states: cut each state at every span edge.
        let edges = t.span_edges();
        let states = StateEvents {
            slices: t.slices.iter(),
            edges: &edges,
            ps,
            current: None,
        };
        let spans_in_order = spans.order.iter().map(|&index| {
            let span = &t.spans[index];
            LineItem::Span {
                index,
                offset_ps: ps(span.start_ns),
                duration_ps: ps(span.end_ns) - ps(span.start_ns),
            }
        });
        let marks = t.marks.iter().map(|m| LineItem::Mark {
            kind: m.kind(),
            offset_ps: ps(m.ts_ns),
        });
        let line = LineContext {
            ids: &self.ids,
            peers,
            spans: &spans,
            groups: self.plane.shared_groups(),
        };
        let events = merge(merge(states, spans_in_order), marks)
            .map(|item| ThreadEvent { item, line: &line });
        let display = format!("{} [{}] ({} {})", t.name, t.tid, process, t.pid);
        encode_line(out, t.tid.into(), &t.name, &display, events);
    }
}

/// Writes the per-CPU lines, each slice named after the thread it ran.
fn write_per_cpu_plane<W: PlaneOut>(
    lines: &CpuLines<'_>,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let mut plane = XPlaneBuilder::new(2, PER_CPU_PLANE);
    let (tid_stat, pid_stat) = (plane.stat_metadata(TID), plane.stat_metadata("pid"));
    let thread_event: FxHashMap<u32, i64> = lines
        .threads()
        .map(|t| (t.tid, plane.event_metadata(&t.name)))
        .collect();
    let mut stream = PlaneStream::begin(out, 1)?;
    for (cpu, slices) in lines.iter() {
        let events = slices.map(|s| LineEvent {
            metadata_id: thread_event[&s.tid],
            offset_ps: ps(s.start_ns),
            duration_ps: ps(s.end_ns) - ps(s.start_ns),
            stats: EventStats::inline([
                Stat::i64(tid_stat, s.tid.into()),
                Stat::i64(pid_stat, s.pid.into()),
            ]),
        });
        let name = format!("CPU {cpu}");
        let id = CPU_LINE_BASE + i64::from(cpu);
        stream.line(|out| encode_line(out, id, &name, &name, events))?;
    }
    stream.end(plane)
}

/// An event of a thread's line: the states, spans and marks are merged by
/// time as these (a few words each), and each makes its stats (inline,
/// over a hundred bytes) only once it is encoded (see [`ThreadEvent`]).
#[derive(Clone, Copy)]
enum LineItem {
    /// A scheduling state, or a piece of one cut at a span edge.
    State {
        state: ThreadState,
        offset_ps: i64,
        duration_ps: i64,
    },
    /// The thread's span `index`.
    Span {
        index: usize,
        offset_ps: i64,
        duration_ps: i64,
    },
    Mark {
        kind: MarkKind,
        offset_ps: i64,
    },
}

impl LineItem {
    /// [`LineEvent::order_key`] of the event it is.
    fn order_key(&self) -> (i64, std::cmp::Reverse<i64>) {
        let (offset_ps, duration_ps) = match *self {
            LineItem::State {
                offset_ps,
                duration_ps,
                ..
            }
            | LineItem::Span {
                offset_ps,
                duration_ps,
                ..
            } => (offset_ps, duration_ps),
            LineItem::Mark { offset_ps, .. } => (offset_ps, 0),
        };
        (offset_ps, std::cmp::Reverse(duration_ps))
    }
}

/// What a thread line's items need to become events.
struct LineContext<'a> {
    ids: &'a SchedIds,
    peers: &'a [Peer],
    spans: &'a InternedSpans,
    groups: &'a SharedGroups,
}

/// A thread line's item as [`encode_line`] takes it: its stats are made
/// as it is encoded, not carried through the merge.
struct ThreadEvent<'a> {
    item: LineItem,
    line: &'a LineContext<'a>,
}

impl EncodeEvent for ThreadEvent<'_> {
    fn order_key(&self) -> (i64, std::cmp::Reverse<i64>) {
        self.item.order_key()
    }

    #[inline]
    fn encode_field(&self, out: &mut Vec<u8>) {
        let LineContext {
            ids,
            peers,
            spans,
            groups,
        } = self.line;
        match self.item {
            LineItem::State {
                state,
                offset_ps,
                duration_ps,
            } => {
                let (name, stats) = ids.state(state, peers);
                stats.encode_event(out, name, offset_ps, duration_ps);
            }
            LineItem::Span {
                index,
                offset_ps,
                duration_ps,
            } => {
                let stats = EventStats::Shared {
                    encoded: groups.encoded(spans.shared[index]),
                    own: &spans.stats[spans.ranges[index].clone()],
                };
                stats.encode_event(out, spans.names[index], offset_ps, duration_ps);
            }
            LineItem::Mark { kind, offset_ps } => {
                let (name, stats) = ids.mark(kind, peers);
                stats.encode_event(out, name, offset_ps, 0);
            }
        }
    }
}

/// Merges two item streams sorted by [`LineItem::order_key`]; on equal
/// keys `a`'s item comes first (as a stable sort of `a` then `b` would).
struct Merge<A: Iterator<Item = LineItem>, B: Iterator<Item = LineItem>> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

fn merge<A, B>(a: A, b: B) -> Merge<A, B>
where
    A: Iterator<Item = LineItem>,
    B: Iterator<Item = LineItem>,
{
    Merge {
        a: a.peekable(),
        b: b.peekable(),
    }
}

impl<A, B> Iterator for Merge<A, B>
where
    A: Iterator<Item = LineItem>,
    B: Iterator<Item = LineItem>,
{
    type Item = LineItem;

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.a.size_hint().0 + self.b.size_hint().0, None)
    }

    #[inline]
    fn next(&mut self) -> Option<LineItem> {
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

/// A thread's scheduling states as line items, each cut at every span
/// edge inside it (`edges` sorted, without repeats). States partition
/// time, so the edges are walked once.
struct StateEvents<'a, P: Fn(u64) -> i64> {
    slices: std::slice::Iter<'a, StateSlice>,
    edges: &'a [u64],
    ps: P,
    /// The state being cut: where the next piece starts and where the
    /// state ends.
    current: Option<(ThreadState, u64, u64)>,
}

impl<P: Fn(u64) -> i64> Iterator for StateEvents<'_, P> {
    type Item = LineItem;

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.slices.len(), None)
    }

    #[inline]
    fn next(&mut self) -> Option<LineItem> {
        let (state, from, end) = match self.current.take() {
            Some(c) => c,
            None => {
                let s = self.slices.next()?;
                (s.state(), s.start_ns, s.end_ns)
            }
        };
        while self.edges.first().is_some_and(|&e| e <= from) {
            self.edges = &self.edges[1..];
        }
        let to = match self.edges.first() {
            Some(&e) if e < end => {
                self.current = Some((state, e, end));
                e
            }
            _ => end,
        };
        Some(LineItem::State {
            state,
            offset_ps: (self.ps)(from),
            duration_ps: (self.ps)(to) - (self.ps)(from),
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
    /// Those of the blocked states, by [`crate::timeline::TaskState`]:
    /// looked up for every blocked state, which is not rare.
    blocked_states: [Option<i64>; 8],
}

/// The rarer names: why a thread was runnable, blocked states, instants.
const YIELDED: &str = "yielded";
const NEW_THREAD: &str = "new thread";
const AT_START: &str = "runnable at capture start";
const UNKNOWN: &str = "Unknown";
const REASON: &str = "reason";
const NO_EVENT: &str = "the kernel reported no scheduler event for this interval";
const SAMPLED: &str =
    "on a CPU in its stack samples; the kernel reported no switch onto it for this interval";
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
            blocked_states: [None; 8],
        }
    }

    /// Interns the rarer names `thread`'s events use.
    fn prepare(&mut self, plane: &mut XPlaneBuilder, thread: &ThreadTrack) {
        let mut need = |name: &'static str, event: bool| {
            *self.rare.entry(name).or_insert_with(|| {
                if event {
                    plane.event_metadata(name)
                } else {
                    plane.stat_metadata(name)
                }
            })
        };
        for s in &thread.slices {
            match s.state() {
                ThreadState::Runnable {
                    cause: RunnableCause::Yielded,
                } => {
                    need(YIELDED, false);
                }
                ThreadState::Runnable {
                    cause: RunnableCause::Created,
                } => {
                    need(NEW_THREAD, false);
                }
                ThreadState::Runnable {
                    cause: RunnableCause::AtStart,
                } => {
                    need(AT_START, false);
                }
                ThreadState::Blocked { state } => {
                    let id = &mut self.blocked_states[state as usize];
                    if id.is_none() {
                        *id = Some(need(state.describe(), false));
                    }
                }
                ThreadState::Unknown => {
                    need(UNKNOWN, true);
                    need(REASON, false);
                    need(NO_EVENT, false);
                }
                ThreadState::Sampled { .. } => {
                    need(REASON, false);
                    need(SAMPLED, false);
                }
                _ => {}
            }
        }
        for m in &thread.marks {
            match m.kind() {
                MarkKind::ThreadCreated { .. } => {
                    need(THREAD_CREATED, true);
                    need(TID, false);
                }
                MarkKind::ProcessForked { .. } => {
                    need(PROCESS_FORKED, true);
                    need(CHILD_PID, false);
                }
                MarkKind::Exited => {
                    need(THREAD_EXIT, true);
                }
                MarkKind::Wakeup { .. } => {}
            }
        }
    }

    /// A name [`prepare`](Self::prepare) interned.
    fn rare(&self, name: &str) -> i64 {
        self.rare[name]
    }

    /// The event name and stats of a scheduling state.
    #[inline]
    fn state(&self, state: ThreadState, peers: &[Peer]) -> (i64, EventStats<'static>) {
        let one = |s: Stat| EventStats::inline([s]);
        match state {
            ThreadState::Running { cpu } => (self.running, one(Stat::i64(self.cpu, cpu.into()))),
            ThreadState::Sampled { cpu } => {
                let why = Stat::reference(self.rare(REASON), self.rare(SAMPLED));
                let stats = EventStats::inline([Stat::i64(self.cpu, cpu.into()), why]);
                (self.running, stats)
            }
            ThreadState::Runnable { cause } => {
                let cause_is = |id| Stat::reference(self.cause, id);
                let stats = match cause {
                    RunnableCause::Woken { waker, flow_id } => {
                        let waker = peer_in(peers, waker);
                        let stats = [
                            cause_is(self.woken),
                            Stat::i64(self.waker_tid, waker.tid.into()),
                            Stat::i64(self.waker_pid, waker.pid.into()),
                            self.flow(flow_id, FlowDirection::In),
                        ];
                        EventStats::first(if flow_id.is_some() { 4 } else { 3 }, stats)
                    }
                    RunnableCause::Preempted => one(cause_is(self.preempted)),
                    RunnableCause::Yielded => one(cause_is(self.rare(YIELDED))),
                    RunnableCause::Created => one(cause_is(self.rare(NEW_THREAD))),
                    RunnableCause::AtStart => one(cause_is(self.rare(AT_START))),
                };
                (self.runnable, stats)
            }
            ThreadState::Blocked { state } => {
                let text = self.blocked_states[state as usize].expect("interned by prepare");
                (self.blocked, one(Stat::reference(self.prev_state, text)))
            }
            ThreadState::Unknown => {
                let why = Stat::reference(self.rare(REASON), self.rare(NO_EVENT));
                (self.rare(UNKNOWN), one(why))
            }
        }
    }

    /// The flow stat of a linked wake-up (unused when there is no link).
    fn flow(&self, flow_id: Option<FlowId>, direction: FlowDirection) -> Stat {
        let id = flow_id.map_or(0, |f| f.get().into());
        Stat::u64(self.flow, flow_stat_value(id, direction))
    }

    /// The event name and stats of an instant.
    #[inline]
    fn mark(&self, kind: MarkKind, peers: &[Peer]) -> (i64, EventStats<'static>) {
        match kind {
            MarkKind::Wakeup { woken, flow_id } => {
                let woken = peer_in(peers, woken);
                let stats = [
                    Stat::i64(self.woken_tid, woken.tid.into()),
                    Stat::i64(self.woken_pid, woken.pid.into()),
                    self.flow(flow_id, FlowDirection::Out),
                    Stat::i64(0, 0),
                ];
                let n = if flow_id.is_some() { 3 } else { 2 };
                (self.wakeup, EventStats::first(n, stats))
            }
            MarkKind::ThreadCreated { tid } => (
                self.rare(THREAD_CREATED),
                EventStats::inline([Stat::i64(self.rare(TID), tid.into())]),
            ),
            MarkKind::ProcessForked { pid } => (
                self.rare(PROCESS_FORKED),
                EventStats::inline([Stat::i64(self.rare(CHILD_PID), pid.into())]),
            ),
            MarkKind::Exited => (self.rare(THREAD_EXIT), EventStats::inline([])),
        }
    }
}

/// A thread's spans with their names and stats interned: the stats of span
/// `i` are the plane's group `shared[i]`, then `stats[ranges[i]]`.
struct InternedSpans {
    names: Vec<i64>,
    shared: Vec<SharedStats>,
    ranges: Vec<std::ops::Range<usize>>,
    stats: Vec<Stat>,
    /// Span indices in [`LineEvent::order_key`] order.
    order: Vec<usize>,
}

impl InternedSpans {
    fn new(plane: &mut XPlaneBuilder, spans: &[Span]) -> Self {
        let mut out = InternedSpans {
            names: Vec::with_capacity(spans.len()),
            shared: Vec::with_capacity(spans.len()),
            ranges: Vec::with_capacity(spans.len()),
            stats: Vec::new(),
            order: (0..spans.len()).collect(),
        };
        for span in spans {
            out.names.push(plane.span_metadata(&span.name));
            let from = out.stats.len();
            out.shared.push(plane.span_stats(span, &mut out.stats));
            out.ranges.push(from..out.stats.len());
        }
        // Timelines come with their spans nested and sorted (`timeline::nest`).
        out.order
            .sort_by_key(|&i| (spans[i].start_ns, std::cmp::Reverse(spans[i].end_ns)));
        out
    }
}
