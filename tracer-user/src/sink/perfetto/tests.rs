//! The sink's packets, decoded again with prost.

use std::{collections::BTreeMap, num::NonZeroU64};

use ebtrace_proto::perfetto::protos::{Trace, ftrace_event, trace_packet, track_event};
use prost::Message as _;

use super::*;
use crate::{
    clock::ClockSync,
    timeline::{
        CaptureStats, DeviceTrack, FlowId, Peer, PeerId, ProcessInfo, RunnableCause, StateSlice,
        Stats, StreamTiming, StreamTrack, TaskState, ThreadCounters, ThreadState, ThreadTrack,
    },
};

fn span(name: &str, start_ns: u64, end_ns: u64, correlation: Option<u64>) -> Span {
    Span {
        start_ns,
        end_ns,
        name: name.into(),
        stats: Stats::default(),
        correlation: correlation.and_then(NonZeroU64::new),
    }
}

/// Thread 11 runs on CPU 1, sleeps, is woken by 12 (running on CPU 0)
/// and runs again; it launches a kernel that runs on stream 1 of GPU 0.
fn timeline() -> Timeline {
    let slice = |start_ns, end_ns, state| StateSlice::new(start_ns, end_ns, state);
    let woken = ThreadState::Runnable {
        cause: RunnableCause::Woken {
            waker: PeerId::new(0).expect("a peer"),
            flow_id: FlowId::new(1),
        },
    };
    let thread = |tid: u32, name: &str, slices, spans| ThreadTrack {
        tid,
        pid: 10,
        name: name.into(),
        slices,
        marks: vec![],
        spans,
        counters: ThreadCounters::default(),
    };
    let threads = BTreeMap::from([
        (
            11,
            thread(
                11,
                "worker",
                vec![
                    slice(100, 200, ThreadState::Running { cpu: 1 }),
                    slice(
                        200,
                        300,
                        ThreadState::Blocked {
                            state: TaskState::DiskSleep,
                        },
                    ),
                    slice(300, 350, woken),
                    slice(350, 1_000, ThreadState::Running { cpu: 1 }),
                ],
                vec![
                    span("step", 100, 900, None),
                    span("cuLaunchKernel", 400, 450, Some(7)),
                    span("mark", 500, 500, None),
                ],
            ),
        ),
        (
            12,
            thread(
                12,
                "waker",
                vec![slice(100, 1_000, ThreadState::Running { cpu: 0 })],
                vec![],
            ),
        ),
    ]);
    Timeline {
        peers: vec![Peer { tid: 12, pid: 10 }],
        start_ns: 100,
        stop_ns: 1_000,
        clock: ClockSync::from_offset(5_000),
        processes: BTreeMap::from([(
            10,
            ProcessInfo {
                pid: 10,
                name: "python".into(),
                exited_ns: None,
            },
        )]),
        threads,
        devices: BTreeMap::from([(
            0,
            DeviceTrack {
                ordinal: 0,
                streams: BTreeMap::from([(
                    1,
                    StreamTrack {
                        id: 1,
                        pid: 10,
                        label: "0x1234".into(),
                        timing: StreamTiming::HostObserved,
                        events: vec![span("kernel", 460, 700, Some(7))],
                    },
                )]),
            },
        )]),
        carried_planes: Vec::new(),
        stats: CaptureStats::default(),
    }
}

#[test]
fn scheduling_spans_and_flows_come_out_as_perfetto_models_them() {
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 1_000_000,
    };
    let bytes = timeline_to_perfetto_bytes(&timeline(), clocks);
    let trace = Trace::decode(bytes.as_slice()).unwrap();

    let mut switches = Vec::new();
    let mut wakings = Vec::new();
    let mut events = Vec::new();
    for p in &trace.packet {
        match p.data.as_ref().unwrap() {
            trace_packet::Data::FtraceEvents(b) => {
                for e in &b.event {
                    match e.event.as_ref().unwrap() {
                        ftrace_event::Event::SchedSwitch(s) => switches.push((
                            b.cpu(),
                            e.timestamp(),
                            s.prev_pid(),
                            s.prev_state(),
                            s.next_pid(),
                        )),
                        ftrace_event::Event::SchedWaking(w) => {
                            wakings.push((b.cpu(), e.timestamp(), e.pid(), w.pid(), w.target_cpu()))
                        }
                    }
                }
            }
            trace_packet::Data::TrackEvent(e) => events.push((
                p.timestamp(),
                e.r#type(),
                e.name_field.clone(),
                e.flow_ids.clone(),
                e.terminating_flow_ids.clone(),
            )),
            _ => {}
        }
    }
    let boot = |ns: u64| ns + 1_000_000;
    // Switched out into uninterruptible sleep (D = 2), back in after the
    // wake-up; the thread still running at the end is not switched out.
    assert_eq!(
        switches,
        vec![
            (0, boot(100), 0, 0, 12),
            (1, boot(100), 0, 0, 11),
            (1, boot(200), 11, 2, 0),
            (1, boot(350), 0, 0, 11),
        ]
    );
    assert_eq!(stats_of(&bytes).sched_switches, 4);
    // Woken by 12 on the waker's CPU, targeting the CPU 11 then ran on.
    assert_eq!(wakings, vec![(0, boot(300), 12, 11, 1)]);

    let name = |n: &str| Some(track_event::NameField::Name(n.into()));
    use track_event::Type::*;
    let kinds: Vec<_> = events
        .iter()
        .map(|(ts, t, n, out, into)| (*ts, *t, n.clone(), out.clone(), into.clone()))
        .collect();
    let flow = vec![launch_flow(7)];
    assert_eq!(
        kinds,
        vec![
            (boot(100), SliceBegin, name("step"), vec![], vec![]),
            (
                boot(400),
                SliceBegin,
                name("cuLaunchKernel"),
                flow.clone(),
                vec![]
            ),
            (boot(450), SliceEnd, None, vec![], vec![]),
            (boot(500), Instant, name("mark"), vec![], vec![]),
            (boot(900), SliceEnd, None, vec![], vec![]),
            (boot(460), SliceBegin, name("kernel"), vec![], flow.clone()),
            (boot(700), SliceEnd, None, vec![], vec![]),
        ]
    );
}

/// The stats `write_timeline` reports, checked against what it wrote.
fn stats_of(bytes: &[u8]) -> PerfettoStats {
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 1_000_000,
    };
    let stats = write_timeline(&timeline(), clocks, Vec::new()).unwrap();
    assert_eq!(stats.bytes as usize, bytes.len());
    stats
}
