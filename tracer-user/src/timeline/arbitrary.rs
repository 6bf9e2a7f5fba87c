//! Arbitrary timelines for property tests: every kind of track (thread
//! states on several CPUs, marks, spans, GPU streams), wake-up flows and
//! correlation ids that may or may not find their other end, all within
//! the model's own rules (states partition time, spans nest, a stream's
//! events follow each other).

use std::{collections::BTreeMap, num::NonZeroU64};

use proptest::{collection::vec, prelude::*};

use super::{
    CaptureStats, Cuts, DeviceTrack, EventLimitFrom, FlowId, Mark, MarkKind, Peer, PeerId,
    ProcessInfo, RunnableCause, Span, StateSlice, StreamTiming, StreamTrack, TaskState,
    ThreadCounters, ThreadState, ThreadTrack, Timeline, Value, Window, nest,
};
use crate::clock::ClockSync;

/// Times fall in `0..HORIZON`.
pub const HORIZON: u64 = 2_000;
const PIDS: u32 = 4;

/// Consecutive `[start, end)` pieces between sorted, distinct cut points.
fn pieces(mut cuts: Vec<u64>) -> Vec<(u64, u64)> {
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
}

fn link(id: Option<u8>) -> Option<FlowId> {
    id.and_then(|id| FlowId::new(u32::from(id) + 1))
}

fn state(kind: u8, flow: Option<u8>) -> ThreadState {
    match kind % 5 {
        0 => ThreadState::Running {
            cpu: u32::from(kind / 5 % 3),
        },
        3 => ThreadState::Sampled {
            cpu: u32::from(kind / 5 % 3),
        },
        1 => ThreadState::Runnable {
            cause: RunnableCause::Woken {
                waker: PeerId::new(0).expect("a peer"),
                flow_id: link(flow),
            },
        },
        2 => ThreadState::Blocked {
            state: TaskState::Sleeping,
        },
        _ => ThreadState::Unknown,
    }
}

fn span(start: u64, len: u64, correlation: Option<u8>) -> Span {
    Span {
        start_ns: start,
        end_ns: start + len,
        name: format!("s{}", len % 3).into(),
        stats: vec![("k".into(), Value::I64(1))].into(),
        correlation: correlation.and_then(|id| NonZeroU64::new(id.into())),
    }
}

type ThreadParts = (
    u32,
    Vec<u64>,
    Vec<(u8, Option<u8>)>,
    Vec<(u64, u64, Option<u8>)>,
    Vec<(u64, Option<u8>)>,
);

fn thread_parts() -> impl Strategy<Value = ThreadParts> {
    (
        1..=PIDS,
        vec(0..HORIZON, 0..14),
        vec((any::<u8>(), prop::option::of(0..12u8)), 1..14),
        vec(
            (0..HORIZON, 0..HORIZON / 4, prop::option::of(0..12u8)),
            0..12,
        ),
        vec((0..HORIZON, prop::option::of(0..12u8)), 0..6),
    )
}

fn thread(tid: u32, (pid, cuts, states, spans, marks): ThreadParts) -> ThreadTrack {
    let slices = pieces(cuts)
        .into_iter()
        .zip(states.iter().cycle())
        .map(|((start_ns, end_ns), &(kind, flow))| {
            StateSlice::new(start_ns, end_ns, state(kind, flow))
        })
        .collect();
    let mut spans: Vec<Span> = spans
        .into_iter()
        .map(|(start, len, corr)| span(start, len, corr))
        .collect();
    nest(&mut spans, Cuts::Marked);
    let mut marks: Vec<Mark> = marks
        .into_iter()
        .map(|(ts_ns, flow)| {
            let kind = match flow {
                Some(id) => MarkKind::Wakeup {
                    woken: PeerId::new(0).expect("a peer"),
                    flow_id: link(Some(id)),
                },
                None => MarkKind::Exited,
            };
            Mark::new(ts_ns, kind)
        })
        .collect();
    marks.sort_by_key(|m| m.ts_ns);
    ThreadTrack {
        tid,
        pid,
        name: format!("t{tid}"),
        slices,
        marks,
        spans,
        counters: ThreadCounters::default(),
    }
}

type StreamParts = (u32, i64, u32, Vec<u64>, Vec<Option<u8>>);

fn stream_parts() -> impl Strategy<Value = StreamParts> {
    (
        0..2u32,
        0..3i64,
        1..=PIDS,
        vec(0..HORIZON, 0..12),
        vec(prop::option::of(0..12u8), 1..6),
    )
}

/// A timeline of `0..HORIZON` with every kind of track.
pub fn timeline() -> impl Strategy<Value = Timeline> {
    (vec(thread_parts(), 0..6), vec(stream_parts(), 0..5)).prop_map(|(threads, streams)| {
        let threads: BTreeMap<u32, ThreadTrack> = threads
            .into_iter()
            .enumerate()
            .map(|(i, parts)| {
                let tid = 100 + i as u32;
                (tid, thread(tid, parts))
            })
            .collect();
        let mut tl = Timeline {
            peers: vec![Peer { tid: 1, pid: 1 }],
            start_ns: 0,
            stop_ns: HORIZON,
            clock: ClockSync::from_offset(0),
            processes: (1..=PIDS)
                .map(|pid| {
                    let name = format!("p{pid}");
                    (
                        pid,
                        ProcessInfo {
                            pid,
                            name,
                            exited_ns: None,
                        },
                    )
                })
                .collect(),
            threads,
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats: CaptureStats::default(),
        };
        for (ordinal, id, pid, cuts, correlations) in streams {
            let events: Vec<Span> = pieces(cuts)
                .into_iter()
                .zip(correlations.iter().cycle())
                .map(|((start, end), &corr)| span(start, end - start, corr))
                .collect();
            let device = tl.devices.entry(ordinal).or_insert_with(|| DeviceTrack {
                ordinal,
                streams: BTreeMap::new(),
            });
            if !events.is_empty() && !device.streams.contains_key(&id) {
                device.streams.insert(
                    id,
                    StreamTrack {
                        id,
                        pid,
                        label: format!("stream {id}"),
                        timing: if id % 2 == 0 {
                            StreamTiming::Device
                        } else {
                            StreamTiming::HostObserved
                        },
                        events,
                    },
                );
            }
        }
        tl.devices.retain(|_, d| !d.streams.is_empty());
        tl
    })
}

/// A window over (and somewhat beyond) the timeline's times.
pub fn window() -> impl Strategy<Value = Window> {
    (
        0..HORIZON + 200,
        0..HORIZON + 400,
        prop::option::of(prop::collection::btree_set(1..=PIDS + 1, 0..4)),
        prop::option::of(0..80usize),
    )
        .prop_map(|(start_ns, len, pids, max_events)| Window {
            start_ns,
            stop_ns: start_ns + len,
            pids,
            max_events,
            max_events_from: EventLimitFrom::Request,
        })
}
