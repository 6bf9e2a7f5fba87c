//! The sink's packets, decoded again with prost.

use std::{collections::BTreeMap, num::NonZeroU64, sync::Arc};

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

/// A span at an arrow's start carries its flow, one at its end ends it;
/// neither carries the arrow as an argument.
#[test]
fn arrows_between_spans_are_flows() {
    let mut timeline = timeline();
    let spans = &mut timeline.threads.get_mut(&11).expect("thread 11").spans;
    let id = 1 << 55 | 3;
    let flow = |end| (crate::timeline::FLOW_STAT.into(), Value::Flow(id, end));
    spans[0].stats.push(flow(FlowEnd::From));
    spans[2].stats.push(flow(FlowEnd::To));
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 0,
    };
    let bytes = timeline_to_perfetto_bytes(&timeline, clocks);
    let trace = Trace::decode(bytes.as_slice()).unwrap();
    let named = |n: &str| {
        trace
            .packet
            .iter()
            .find_map(|p| match p.data.as_ref()? {
                trace_packet::Data::TrackEvent(e)
                    if e.name_field == Some(track_event::NameField::Name(n.into())) =>
                {
                    Some(e.clone())
                }
                _ => None,
            })
            .expect(n)
    };
    let (step, mark) = (named("step"), named("mark"));
    assert_eq!(
        (step.flow_ids, step.terminating_flow_ids),
        (vec![id], vec![])
    );
    assert_eq!(
        (mark.flow_ids, mark.terminating_flow_ids),
        (vec![], vec![id])
    );
    assert!(step.debug_annotations.is_empty() && mark.debug_annotations.is_empty());
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

#[test]
fn a_stack_text_reads_back_as_its_frames() {
    let text = "leaf app.c:3 (inlined)\nouter app.c:9\ncopy_page [k]\nentry [k] (inlined)\n\
                run script.py:12\n0x7f00 [k]";
    assert_eq!(
        samples::stack_frames(text).collect::<Vec<_>>(),
        [
            ("leaf app.c:3 (inlined)", false),
            ("outer app.c:9", false),
            ("copy_page [k]", true),
            ("entry [k] (inlined)", true),
            ("run script.py:12", false),
            ("0x7f00 [k]", true),
        ]
    );
    assert_eq!(
        samples::stack_frames("").collect::<Vec<_>>(),
        [(crate::timeline::cpu_samples::UNKNOWN_FRAME, false)]
    );
}

/// Thread 11 is sampled three times (twice in one stack, once while its
/// state says blocked), thread 12 once in the first stack; the instant
/// `mark` carries no stack and is no sample.
#[test]
fn cpu_samples_carry_interned_callstacks_on_their_own_sequence() {
    use ebtrace_proto::perfetto::protos::{InternedData, PerfSample, profiling};

    use crate::timeline::cpu_samples::STACK_STAT;

    const SHALLOW: &str = "leaf app.c:3 (inlined)\nouter app.c:9\nmain";
    const DEEP: &str = "copy_page [k]\nentry [k] (inlined)\nouter app.c:9\nmain";
    let sample = |ts: u64, text: &str| Span {
        stats: Stats::shared_then(
            Arc::from([(STACK_STAT.into(), Value::Str(text.into()))]),
            Vec::new(),
        ),
        ..span("leaf", ts, ts, None)
    };
    let mut timeline = timeline();
    let spans = &mut timeline.threads.get_mut(&11).unwrap().spans;
    spans.extend([
        sample(150, SHALLOW),
        sample(250, SHALLOW),
        sample(600, DEEP),
    ]);
    spans.sort_by_key(|s| s.start_ns);
    timeline.threads.get_mut(&12).unwrap().spans = vec![sample(500, SHALLOW)];
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 1_000,
    };
    let bytes = timeline_to_perfetto_bytes(&timeline, clocks);
    let trace = Trace::decode(bytes.as_slice()).unwrap();

    let mut interned = InternedData::default();
    let mut got: Vec<(u64, PerfSample, u32, bool)> = Vec::new();
    let mut carrying = 0;
    for p in &trace.packet {
        let Some(trace_packet::Data::PerfSample(s)) = &p.data else {
            continue;
        };
        assert_eq!(
            p.optional_trusted_packet_sequence_id,
            Some(
                trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(
                    samples::SAMPLES_SEQUENCE_ID
                )
            )
        );
        if let Some(new) = &p.interned_data {
            carrying += 1;
            interned.mapping_paths.extend(new.mapping_paths.clone());
            interned.mappings.extend(new.mappings.clone());
            interned.function_names.extend(new.function_names.clone());
            interned.frames.extend(new.frames.clone());
            interned.callstacks.extend(new.callstacks.clone());
        }
        got.push((
            p.timestamp(),
            *s,
            p.sequence_flags(),
            p.first_packet_on_sequence(),
        ));
    }
    assert_ne!(samples::SAMPLES_SEQUENCE_ID, SEQUENCE_ID);

    // Only the first packet clears the sequence's state; all use it.
    let (cleared, needs) = (
        trace_packet::SequenceFlags::SeqIncrementalStateCleared as u32,
        trace_packet::SequenceFlags::SeqNeedsIncrementalState as u32,
    );
    let flags: Vec<(u32, bool)> = got.iter().map(|g| (g.2, g.3)).collect();
    assert_eq!(
        flags,
        [
            (cleared | needs, true),
            (needs, false),
            (needs, false),
            (needs, false)
        ]
    );
    // Interned data travels only with the samples that need something new.
    assert_eq!(carrying, 2);

    // Each name, frame and stack interned once.
    let names: Vec<&[u8]> = interned.function_names.iter().map(|n| n.str()).collect();
    assert_eq!(names.len(), 5, "{names:?}");
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len());
    assert_eq!(interned.frames.len(), names.len());
    assert_eq!(interned.callstacks.len(), 2);
    assert_eq!(interned.mappings.len(), 2);

    let name_of = |iid: u64| {
        let f = interned.frames.iter().find(|f| f.iid() == iid).unwrap();
        let n = interned
            .function_names
            .iter()
            .find(|n| n.iid() == f.function_name_id())
            .unwrap();
        let m = interned
            .mappings
            .iter()
            .find(|m| m.iid() == f.mapping_id())
            .unwrap();
        let path = interned
            .mapping_paths
            .iter()
            .find(|p| p.iid() == m.path_string_ids[0])
            .unwrap();
        (
            String::from_utf8(n.str().to_vec()).unwrap(),
            String::from_utf8(path.str().to_vec()).unwrap(),
        )
    };
    // Root first: the text's lines reversed.
    let stack_of = |s: &PerfSample| -> Vec<(String, String)> {
        let c = interned
            .callstacks
            .iter()
            .find(|c| c.iid() == s.callstack_iid())
            .unwrap();
        c.frame_ids.iter().map(|&f| name_of(f)).collect()
    };
    let lines = |text: &str, kernel_from: usize| -> Vec<(String, String)> {
        let mut l: Vec<_> = text
            .lines()
            .enumerate()
            .map(|(i, l)| {
                let mapping = if i < kernel_from {
                    "[kernel]"
                } else {
                    "[user]"
                };
                (l.to_string(), mapping.to_string())
            })
            .collect();
        l.reverse();
        l
    };
    let boot = |ns: u64| ns + 1_000;
    let rows: Vec<_> = got
        .iter()
        .map(|(ts, s, ..)| (*ts, s.tid(), s.pid(), s.cpu(), s.cpu_mode(), stack_of(s)))
        .collect();
    use profiling::CpuMode::{ModeKernel, ModeUser};
    assert_eq!(
        rows,
        [
            (boot(150), 11, 10, 1, ModeUser, lines(SHALLOW, 0)),
            (boot(250), 11, 10, 0, ModeUser, lines(SHALLOW, 0)),
            (boot(600), 11, 10, 1, ModeKernel, lines(DEEP, 2)),
            (boot(500), 12, 10, 0, ModeUser, lines(SHALLOW, 0)),
        ]
    );
    assert_eq!(
        write_timeline(&timeline, clocks, Vec::new())
            .unwrap()
            .perf_samples,
        4
    );
    // The instants stay, with their stacks as text.
    let instants = trace
        .packet
        .iter()
        .filter(|p| {
            matches!(&p.data, Some(trace_packet::Data::TrackEvent(e))
                if e.r#type() == track_event::Type::Instant && !e.debug_annotations.is_empty())
        })
        .count();
    assert_eq!(instants, 4);
}
