//! What one trace may show of a timeline: a time window, some of its
//! processes, and at most a number of events. `ebtrace record` and every
//! `ebtrace serve` session pass their timeline through [`Window::apply`],
//! so every track obeys the same rules whatever produced it:
//!
//! - every event lies inside `[start_ns, stop_ns]`: an interval that
//!   crosses an edge is cut there (which keeps nested spans nested), what
//!   lies wholly outside goes;
//! - only the processes in `pids` remain: their threads, their CPU slices
//!   and their GPU streams;
//! - with `max_events`, the trace ends where that many events have
//!   started, counted as a sink writes them (see
//!   [`ThreadTrack::line_event_starts`]); the capture accounting says where
//!   and why;
//! - a link whose other end went (a wake-up's flow, a driver call's
//!   correlation with the work it submitted) is removed from the end that
//!   stays, so no viewer draws an arrow to nothing.
//!
//! CPU lines and GPU streams left without events go; thread lines stay,
//! with their whole-window counters.

use std::{collections::BTreeSet, num::NonZeroU64};

use super::{MarkKind, RunnableCause, Span, ThreadState, Timeline};

/// The part of a timeline one trace shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// Start, monotonic ns; the timeline's own window is narrowed to this
    /// one.
    pub start_ns: u64,
    /// End, monotonic ns.
    pub stop_ns: u64,
    /// Only these processes (`None`: all of them).
    pub pids: Option<BTreeSet<u32>>,
    /// At most this many events (`None`: no limit).
    pub max_events: Option<usize>,
    /// Who set `max_events`, which the trace names where it is reached.
    pub max_events_from: EventLimitFrom,
}

/// Who set a window's [`Window::max_events`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventLimitFrom {
    /// The request's `max_events`.
    #[default]
    Request,
    /// The server's `--max-capture-events`, below what the request asked.
    Server,
}

impl Window {
    /// Everything between two times.
    pub fn between(start_ns: u64, stop_ns: u64) -> Self {
        Window {
            start_ns,
            stop_ns,
            pids: None,
            max_events: None,
            max_events_from: EventLimitFrom::Request,
        }
    }

    /// Cuts `tl` to this window; returns where it was cut short for
    /// `max_events`, if it was.
    pub fn apply(&self, tl: &mut Timeline) -> Option<u64> {
        tl.start_ns = tl.start_ns.max(self.start_ns);
        tl.stop_ns = tl.stop_ns.min(self.stop_ns).max(tl.start_ns);
        if let Some(pids) = &self.pids {
            restrict_to(tl, pids);
        }
        clip(tl);
        let cut = self
            .max_events
            .and_then(|max| cut_at_events(tl, max, self.max_events_from));
        unlink_dangling(tl);
        cut
    }
}

/// Keeps only the processes in `pids`.
fn restrict_to(tl: &mut Timeline, pids: &BTreeSet<u32>) {
    tl.processes.retain(|pid, _| pids.contains(pid));
    tl.threads.retain(|_, t| pids.contains(&t.pid));
    for device in tl.devices.values_mut() {
        device.streams.retain(|_, s| pids.contains(&s.pid));
    }
    tl.carried_planes.retain(|p| pids.contains(&p.pid));
}

/// Keeps what lies inside `[tl.start_ns, tl.stop_ns]`, cutting what
/// crosses an edge. An interval must keep some length to stay; an instant
/// stays if it lies inside, edges included.
fn clip(tl: &mut Timeline) {
    let (start, stop) = (tl.start_ns, tl.stop_ns);
    let inside = |from: u64, to: u64| {
        let (a, b) = (from.max(start), to.min(stop));
        if from == to {
            (start..=stop).contains(&from).then_some((from, to))
        } else {
            (a < b).then_some((a, b))
        }
    };
    for t in tl.threads.values_mut() {
        t.slices.retain_mut(|s| {
            inside(s.start_ns, s.end_ns.max(s.start_ns))
                .map(|(a, b)| (s.start_ns, s.end_ns) = (a, b))
                .is_some()
        });
        t.marks.retain(|m| (start..=stop).contains(&m.ts_ns));
        clip_spans(&mut t.spans, &inside);
    }
    for device in tl.devices.values_mut() {
        for stream in device.streams.values_mut() {
            clip_spans(&mut stream.events, &inside);
        }
    }
    super::framework::clip_carried(&mut tl.carried_planes, &inside);
    drop_empty_lines(tl);
}

fn clip_spans(spans: &mut Vec<Span>, inside: &impl Fn(u64, u64) -> Option<(u64, u64)>) {
    spans.retain_mut(|s| {
        inside(s.start_ns, s.end_ns.max(s.start_ns))
            .map(|(a, b)| (s.start_ns, s.end_ns) = (a, b))
            .is_some()
    });
}

fn drop_empty_lines(tl: &mut Timeline) {
    for device in tl.devices.values_mut() {
        device.streams.retain(|_, s| !s.events.is_empty());
    }
    tl.devices.retain(|_, d| !d.streams.is_empty());
}

/// If `tl` has more than `max` events, ends it at the time before which at
/// most `max` of them start, and says so in its accounting.
fn cut_at_events(tl: &mut Timeline, max: usize, from: EventLimitFrom) -> Option<u64> {
    let bound = tl.event_count_bound();
    if bound <= max {
        return None;
    }
    let mut starts = Vec::with_capacity(bound);
    tl.event_starts(|t| starts.push(t));
    if starts.len() <= max {
        return None;
    }
    let (_, &mut cut, _) = starts.select_nth_unstable(max);
    drop(starts);
    let limit = match from {
        EventLimitFrom::Request => format!("max_events ({max})"),
        EventLimitFrom::Server => format!("this server's --max-capture-events ({max})"),
    };
    let why = format!(
        "{limit} was reached; the trace covers the first {:.0} ms of the window",
        cut.saturating_sub(tl.start_ns) as f64 / 1e6
    );
    tl.stats.ended_early = Some(match tl.stats.ended_early.take() {
        Some(e) => format!("{e}; {why}"),
        None => why,
    });
    truncate(tl, cut);
    Some(cut)
}

/// Ends the timeline at `cut`: what starts at or after it goes, what runs
/// across it is cut there. A thread's scheduling states are cut at the
/// same edges as before, so its events before `cut` stay as they were.
fn truncate(tl: &mut Timeline, cut: u64) {
    tl.stop_ns = cut;
    let spans = |spans: &mut Vec<Span>| {
        spans.retain(|x| x.start_ns < cut);
        for x in spans.iter_mut() {
            x.end_ns = x.end_ns.min(cut);
        }
    };
    for t in tl.threads.values_mut() {
        t.slices.retain(|x| x.start_ns < cut);
        for x in &mut t.slices {
            x.end_ns = x.end_ns.min(cut);
        }
        t.marks.retain(|m| m.ts_ns < cut);
        spans(&mut t.spans);
    }
    for stream in tl.devices.values_mut().flat_map(|d| d.streams.values_mut()) {
        spans(&mut stream.events);
    }
    drop_empty_lines(tl);
}

/// The correlation id of a driver call or of the work it submitted.
fn correlation(span: &Span) -> Option<u64> {
    span.correlation.map(NonZeroU64::get)
}

fn forget_correlation(span: &mut Span) {
    span.correlation = None;
}

/// A set of link ids: a bitmap when they are dense (the builders number
/// their links from 1), else sorted.
enum IdSet {
    Dense(Vec<u64>),
    Sparse(Vec<u64>),
}

impl IdSet {
    fn new(mut ids: Vec<u64>) -> Self {
        let max = ids.iter().copied().max().unwrap_or(0);
        if max / 8 <= ids.len() as u64 + 64 {
            let mut bits = vec![0u64; (max / 64 + 1) as usize];
            for id in ids {
                bits[(id / 64) as usize] |= 1 << (id % 64);
            }
            IdSet::Dense(bits)
        } else {
            ids.sort_unstable();
            IdSet::Sparse(ids)
        }
    }

    fn contains(&self, id: u64) -> bool {
        match self {
            IdSet::Dense(bits) => {
                let word = usize::try_from(id / 64).ok().and_then(|w| bits.get(w));
                word.is_some_and(|w| (w >> (id % 64)) & 1 == 1)
            }
            IdSet::Sparse(ids) => ids.binary_search(&id).is_ok(),
        }
    }
}

fn wake_flow(kind: MarkKind) -> Option<u64> {
    match kind {
        MarkKind::Wakeup { flow_id, .. } => flow_id.map(|f| f.get().into()),
        _ => None,
    }
}

fn woken_flow(state: ThreadState) -> Option<u64> {
    match state {
        ThreadState::Runnable {
            cause: RunnableCause::Woken { flow_id, .. },
        } => flow_id.map(|f| f.get().into()),
        _ => None,
    }
}

/// Removes the links whose other end is not in the timeline.
fn unlink_dangling(tl: &mut Timeline) {
    // Wake-ups: the waker's mark flows into the woken thread's slice.
    let threads = || tl.threads.values();
    let wakes = IdSet::new(
        threads()
            .flat_map(|t| &t.marks)
            .filter_map(|m| wake_flow(m.kind()))
            .collect(),
    );
    let woken = IdSet::new(
        threads()
            .flat_map(|t| &t.slices)
            .filter_map(|s| woken_flow(s.state()))
            .collect(),
    );
    for t in tl.threads.values_mut() {
        for m in &mut t.marks {
            if let MarkKind::Wakeup {
                woken: peer,
                flow_id: Some(id),
            } = m.kind()
                && !woken.contains(id.get().into())
            {
                m.set_kind(MarkKind::Wakeup {
                    woken: peer,
                    flow_id: None,
                });
            }
        }
        for s in &mut t.slices {
            if let ThreadState::Runnable {
                cause:
                    RunnableCause::Woken {
                        waker,
                        flow_id: Some(id),
                    },
            } = s.state()
                && !wakes.contains(id.get().into())
            {
                s.set_state(ThreadState::Runnable {
                    cause: RunnableCause::Woken {
                        waker,
                        flow_id: None,
                    },
                });
            }
        }
    }

    // Driver calls and the work they submitted share a correlation id.
    let submitted = IdSet::new(tl.device_events().filter_map(correlation).collect());
    let calls = IdSet::new(
        tl.threads
            .values()
            .flat_map(|t| &t.spans)
            .filter_map(correlation)
            .collect(),
    );
    for span in tl.threads.values_mut().flat_map(|t| &mut t.spans) {
        if correlation(span).is_some_and(|id| !submitted.contains(id)) {
            forget_correlation(span);
        }
    }
    let events = tl
        .devices
        .values_mut()
        .flat_map(|d| d.streams.values_mut())
        .flat_map(|s| &mut s.events);
    for event in events {
        if correlation(event).is_some_and(|id| !calls.contains(id)) {
            forget_correlation(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::{
        clock::ClockSync,
        timeline::{
            DeviceTrack, FlowId, StateSlice, StreamTiming, StreamTrack, ThreadCounters,
            ThreadTrack, arbitrary,
        },
    };

    /// Every event's `(start, end)`, per kind of track.
    fn intervals(tl: &Timeline) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for t in tl.threads.values() {
            out.extend(t.slices.iter().map(|s| (s.start_ns, s.end_ns)));
            out.extend(t.marks.iter().map(|m| (m.ts_ns, m.ts_ns)));
            out.extend(t.spans.iter().map(|s| (s.start_ns, s.end_ns)));
        }
        for (_, line) in tl.cpu_lines().iter() {
            out.extend(line.map(|s| (s.start_ns, s.end_ns)));
        }
        out.extend(tl.device_events().map(|e| (e.start_ns, e.end_ns)));
        out
    }

    fn assert_nested(spans: &[Span]) {
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                let disjoint = a.end_ns <= b.start_ns || b.end_ns <= a.start_ns;
                let a_in_b = b.start_ns <= a.start_ns && a.end_ns <= b.end_ns;
                let b_in_a = a.start_ns <= b.start_ns && b.end_ns <= a.end_ns;
                assert!(disjoint || a_in_b || b_in_a, "{a:?} and {b:?} overlap");
            }
        }
    }

    /// Flow ids of wake-ups, (out, in).
    fn flows(tl: &Timeline) -> (BTreeSet<FlowId>, BTreeSet<FlowId>) {
        let mut out = BTreeSet::new();
        let mut into = BTreeSet::new();
        for t in tl.threads.values() {
            for m in &t.marks {
                if let MarkKind::Wakeup {
                    flow_id: Some(id), ..
                } = m.kind()
                {
                    out.insert(id);
                }
            }
            for s in &t.slices {
                if let ThreadState::Runnable {
                    cause:
                        RunnableCause::Woken {
                            flow_id: Some(id), ..
                        },
                } = s.state()
                {
                    into.insert(id);
                }
            }
        }
        (out, into)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_windowed_timeline_keeps_every_rule(
            tl in arbitrary::timeline(),
            window in arbitrary::window(),
        ) {
            let original = tl.clone();
            let mut tl = tl;
            let cut = window.apply(&mut tl);

            // Inside the window, and inside what the timeline covered.
            prop_assert!(tl.start_ns >= window.start_ns.max(original.start_ns));
            prop_assert!(tl.stop_ns >= tl.start_ns);
            prop_assert!(tl.stop_ns <= window.stop_ns.max(tl.start_ns));
            for (start, end) in intervals(&tl) {
                prop_assert!(tl.start_ns <= start && start <= end && end <= tl.stop_ns);
            }
            // At most max_events, as the sink writes them.
            if let Some(max) = window.max_events {
                prop_assert!(tl.event_count() <= max);
            }
            prop_assert_eq!(cut.is_some(), tl.stats.ended_early.is_some());
            // Only the asked processes.
            if let Some(pids) = &window.pids {
                prop_assert!(tl.threads.values().all(|t| pids.contains(&t.pid)));
                let lines = tl.cpu_lines();
                prop_assert!(lines.iter().flat_map(|(_, l)| l).all(|s| pids.contains(&s.pid)));
                let streams = tl.devices.values().flat_map(|d| d.streams.values());
                prop_assert!(streams.clone().all(|s| pids.contains(&s.pid)));
                prop_assert!(tl.processes.keys().all(|p| pids.contains(p)));
            }
            // Nesting, states in order, no empty line.
            for t in tl.threads.values() {
                assert_nested(&t.spans);
                prop_assert!(t.slices.windows(2).all(|w| w[0].end_ns <= w[1].start_ns));
            }
            let lines_with_events = |d: &DeviceTrack| {
                !d.streams.is_empty() && d.streams.values().all(|s| !s.events.is_empty())
            };
            prop_assert!(tl.devices.values().all(lines_with_events));
            // Every link has both ends.
            let (out, into) = flows(&tl);
            prop_assert_eq!(out, into);
            let calls: BTreeSet<u64> =
                tl.threads.values().flat_map(|t| &t.spans).filter_map(correlation).collect();
            let submitted: BTreeSet<u64> = tl.device_events().filter_map(correlation).collect();
            prop_assert_eq!(calls, submitted);

            // Cutting for max_events keeps exactly the events that started
            // before the cut, as they were.
            let whole = Window { max_events: None, ..window.clone() };
            let mut uncut = original;
            whole.apply(&mut uncut);
            match cut {
                None => prop_assert_eq!(&tl, &uncut),
                Some(cut) => {
                    let mut before = 0;
                    uncut.event_starts(|t| before += usize::from(t < cut));
                    prop_assert_eq!(tl.event_count(), before);
                    prop_assert_eq!(tl.stop_ns, cut);
                }
            }
        }

        #[test]
        fn event_count_is_what_the_sink_writes(
            tl in arbitrary::timeline(),
            window in arbitrary::window(),
        ) {
            let mut tl = tl;
            window.apply(&mut tl);
            let space = crate::sink::xspace::timeline_to_xspace(&tl, "host");
            let written: usize = space
                .planes
                .iter()
                .flat_map(|p| &p.lines)
                .map(|l| l.events.len())
                .sum();
            prop_assert_eq!(tl.event_count(), written);
            prop_assert!(tl.event_count() <= tl.event_count_bound());
        }
    }

    fn timeline() -> Timeline {
        let mut tl = Timeline::empty(0, 1000, ClockSync::from_offset(0));
        for (tid, pid) in [(1, 1), (2, 1), (3, 3)] {
            tl.threads.insert(
                tid,
                ThreadTrack {
                    tid,
                    pid,
                    name: format!("t{tid}"),
                    slices: (0..10)
                        .map(|i| {
                            StateSlice::new(i * 100, (i + 1) * 100, ThreadState::Running { cpu: 0 })
                        })
                        .collect(),
                    marks: vec![],
                    spans: vec![],
                    counters: ThreadCounters::default(),
                },
            );
        }
        tl
    }

    /// Work submitted by pid 3: `n` launches on one stream, each with its
    /// driver call on thread 3.
    fn with_launches(mut tl: Timeline, n: u64) -> Timeline {
        let launch = |i: u64| Span {
            start_ns: i * 10,
            end_ns: i * 10 + 5,
            name: "vecAdd".into(),
            stats: crate::timeline::Stats::default(),
            correlation: NonZeroU64::new(i + 1),
        };
        let stream = StreamTrack {
            id: 1,
            pid: 3,
            label: "0x1".into(),
            timing: StreamTiming::HostObserved,
            events: (0..n).map(launch).collect(),
        };
        tl.devices.insert(
            0,
            DeviceTrack {
                ordinal: 0,
                streams: BTreeMap::from([(1, stream)]),
            },
        );
        tl.threads.get_mut(&3).unwrap().spans = (0..n)
            .map(|i| Span {
                name: "cuLaunchKernel".into(),
                ..launch(i)
            })
            .collect();
        tl
    }

    #[test]
    fn id_sets_dense_and_sparse() {
        let ids = [0, 1, 63, 64, 500];
        let dense = IdSet::new(ids.to_vec());
        assert!(matches!(dense, IdSet::Dense(_)));
        let sparse = IdSet::new(vec![u64::MAX, 3, 1 << 40]);
        assert!(matches!(sparse, IdSet::Sparse(_)));
        for id in [0, 1, 2, 63, 64, 65, 500, 501, 1 << 40, u64::MAX] {
            assert_eq!(dense.contains(id), ids.contains(&id), "{id}");
            let in_sparse = [u64::MAX, 3, 1 << 40].contains(&id);
            assert_eq!(sparse.contains(id), in_sparse, "{id}");
        }
    }

    #[test]
    fn restricting_keeps_only_the_asked_processes_and_their_streams() {
        let mut tl = with_launches(timeline(), 3);
        let only_1 = Window {
            pids: Some(BTreeSet::from([1])),
            ..Window::between(0, 1000)
        };
        only_1.apply(&mut tl);
        assert_eq!(tl.threads.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
        let lines = tl.cpu_lines();
        let on_cpus: Vec<u32> = lines.iter().flat_map(|(_, l)| l).map(|s| s.tid).collect();
        assert_eq!(on_cpus.len(), 20);
        assert!(on_cpus.iter().all(|&tid| tid == 1 || tid == 2));
        assert!(tl.devices.is_empty(), "{:?}", tl.devices);
        let mut all = timeline();
        Window::between(0, 1000).apply(&mut all);
        assert_eq!(all, timeline());
    }

    #[test]
    fn max_events_counts_and_cuts_device_work_too() {
        // 30 states on CPU 0, the same 30 on its line, and 100 pieces of
        // state, 100 launches, 100 GPU events: a limit between the host and
        // the total count.
        let tl = with_launches(timeline(), 100);
        let total = tl.event_count();
        assert_eq!(total, 2 * 30 + 2 * 100 + 2 * 100 - 10);
        for max in [0, 1, 10, 50, 300, total - 1, total] {
            let mut cut = tl.clone();
            let window = Window {
                max_events: Some(max),
                ..Window::between(0, 1000)
            };
            let at = window.apply(&mut cut);
            assert!(cut.event_count() <= max, "{max}: {}", cut.event_count());
            assert_eq!(at.is_some(), max < total, "{max}");
            let launches = cut.threads[&3].spans.len();
            assert_eq!(launches, cut.device_events().count(), "{max}");
        }
    }
}
