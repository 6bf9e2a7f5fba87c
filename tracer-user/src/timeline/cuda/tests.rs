//! The CUDA timeline from driver calls: launches, copies and memsets on
//! their devices' stream lines, kernel names, and any calls at all.

use std::{collections::BTreeMap, num::NonZeroU64};

use tracer_common::{
    RecordHeader, RecordKind,
    cuda::{CUDA_NAME_LEN, CudaCall, CudaSymbol},
};

use super::{CudaTimelineBuilder, contexts::OrdinalSource, lines::serialize};
use crate::{
    cuda_api,
    timeline::{Span, Stats, Value},
};

const PID: u32 = 50;

fn id(name: &str) -> u16 {
    cuda_api::function_id(name).unwrap_or_else(|| panic!("{name} not in the table"))
}

fn call(name: &str, tid: u32, t: (u64, u64), args: &[u64], extra: &[u64], out: u64) -> CudaCall {
    let mut a = [0; 6];
    a[..args.len()].copy_from_slice(args);
    let mut x = [0; 8];
    x[..extra.len()].copy_from_slice(extra);
    CudaCall {
        header: RecordHeader::new(RecordKind::CudaCall, 160, 0, t.1),
        tid,
        tgid: PID,
        start_ns: t.0,
        function: id(name),
        flags: 0,
        result: 0,
        args: a,
        extra: x,
        out_value: out,
    }
}

fn symbol(handle: u64, name: &str) -> CudaSymbol {
    let mut rec = CudaSymbol {
        header: RecordHeader::new(RecordKind::CudaSymbol, 40 + CUDA_NAME_LEN, 0, 0),
        tid: 1,
        tgid: PID,
        handle,
        len: name.len() as u32 + 1,
        truncated: 0,
        name: [0; CUDA_NAME_LEN],
    };
    rec.name[..name.len()].copy_from_slice(name.as_bytes());
    rec
}

fn stat<'a>(span: &'a Span, name: &str) -> &'a Value {
    span.stats
        .get(name)
        .unwrap_or_else(|| panic!("no stat {name} in {span:?}"))
}

/// A loop launching on two threads, each launch lasting 5 ns, on the
/// legacy default stream (so their work serializes), and a synchronize
/// on a third thread that starts before them all and returns last: in
/// return-time order.
fn two_launching_threads_and_a_long_synchronize(launches: u64) -> Vec<CudaCall> {
    let mut calls: Vec<CudaCall> = (0..launches)
        .map(|i| {
            let (tid, start) = (7 + (i % 2) as u32, 100 + 4 * i);
            call(
                "cuLaunchKernel",
                tid,
                (start, start + 5),
                &[0xf00, 1, 1, 1, 32, 1],
                &[0, 0, 0],
                0,
            )
        })
        .collect();
    calls.push(call(
        "cuCtxSynchronize",
        9,
        (50, 100 + 4 * launches + 10),
        &[],
        &[],
        0,
    ));
    calls.sort_by_key(|c| c.header.ts_ns);
    calls
}

/// `cuda` on a timeline of 0..10,000 cut to `window`.
fn cut_to(
    cuda: super::CudaTimeline,
    window: &crate::timeline::Window,
) -> crate::timeline::Timeline {
    let mut tl = crate::timeline::Timeline {
        start_ns: 0,
        stop_ns: 10_000,
        clock: crate::clock::ClockSync::from_offset(0),
        processes: BTreeMap::new(),
        threads: BTreeMap::new(),
        peers: Vec::new(),
        devices: BTreeMap::new(),
        carried_planes: Vec::new(),
        stats: Default::default(),
    };
    cuda.add_to(&mut tl);
    window.apply(&mut tl);
    tl
}

#[test]
fn a_limit_on_events_makes_no_more_calls_than_the_cut_keeps_and_the_same_trace() {
    let calls = two_launching_threads_and_a_long_synchronize(1_000);
    let build = |max: Option<usize>, shown: Option<&std::collections::BTreeSet<u32>>| {
        let mut b = CudaTimelineBuilder::new(0, 10_000).at_most(max, shown);
        b.push_symbol(&symbol(0xf00, "_Z4stepv"));
        calls.iter().for_each(|c| b.push_call(c));
        b.finish()
    };
    let made =
        |cuda: &super::CudaTimeline| cuda.spans.values().map(|(_, s)| s.len()).sum::<usize>();
    let whole = build(None, None);
    assert_eq!(made(&whole), 1_001);
    for max in [0, 1, 7, 100, 999, 2_000, 2_001, 5_000] {
        let window = crate::timeline::Window {
            max_events: Some(max),
            ..crate::timeline::Window::between(0, 10_000)
        };
        let limited = build(Some(max), None);
        // The synchronize, in flight across every cut, and the launches up
        // to the cut.
        assert!(
            made(&limited) <= max + 2,
            "{max}: {} calls made",
            made(&limited)
        );
        assert_eq!(limited.calls, whole.calls, "{max}");
        assert_eq!(
            cut_to(limited, &window),
            cut_to(whole.clone(), &window),
            "{max}"
        );
    }
    // Where the trace shows another process, this one's calls do not count
    // towards its cut.
    let elsewhere = [PID + 1].into_iter().collect();
    assert_eq!(made(&build(Some(10), Some(&elsewhere))), 1_001);
}

#[test]
fn launch_on_a_created_stream_of_device_1() {
    let mut b = CudaTimelineBuilder::new(100, 10_000);
    b.push_call(&call("cuDeviceGet", 7, (100, 110), &[0, 1], &[], 1));
    b.push_call(&call(
        "cuCtxCreate_v2",
        7,
        (120, 130),
        &[0, 0, 1],
        &[],
        0xc1,
    ));
    b.push_call(&call("cuStreamCreate", 7, (140, 150), &[0, 0], &[], 0x5a));
    b.push_symbol(&symbol(0xf00, "_Z6vecAddPKfS0_Pfi"));
    b.push_call(&call(
        "cuLaunchKernel",
        7,
        (200, 260),
        &[0xf00, 16, 2, 1, 256, 1],
        &[1, 48, 0x5a],
        0,
    ));
    let tl = b.finish();
    let spans = &tl.spans[&7].1;
    let launch = spans.iter().find(|s| &*s.name == "cuLaunchKernel").unwrap();
    assert_eq!(
        stat(launch, "kernel"),
        &Value::Str("vecAdd(float const*, float const*, float*, int)".into())
    );
    assert_eq!(stat(launch, "grid"), &Value::Str("16,2,1".into()));
    assert_eq!(stat(launch, "block"), &Value::Str("256,1,1".into()));
    assert_eq!(stat(launch, "shared_memory_bytes"), &Value::U64(48));
    assert_eq!(launch.correlation, NonZeroU64::new(1));
    let gpu1 = &tl.devices[&1];
    let line = &gpu1.streams[&1];
    assert_eq!(line.label, "0x5a");
    assert_eq!(line.events.len(), 1);
    assert_eq!((line.events[0].start_ns, line.events[0].end_ns), (200, 260));
    assert_eq!(line.events[0].correlation, NonZeroU64::new(1));
    assert_eq!(
        stat(&line.events[0], "device_ordinal_source"),
        &Value::Str("context".into())
    );
    assert_eq!(tl.calls, 5 - 1);
}

#[test]
fn unknown_handles_and_failed_launches_are_honest() {
    let mut b = CudaTimelineBuilder::new(0, 10_000);
    let mut failed = call(
        "cuLaunchKernel_ptsz",
        3,
        (10, 20),
        &[0xabc, 0, 1, 1, 1, 1],
        &[1, 0, 0],
        0,
    );
    failed.result = 1;
    b.push_call(&failed);
    b.push_call(&call(
        "cuLaunchKernel_ptsz",
        3,
        (30, 40),
        &[0xabc, 1, 1, 1, 1, 1],
        &[1, 0, 0],
        0,
    ));
    let tl = b.finish();
    let spans = &tl.spans[&3].1;
    assert_eq!(
        stat(&spans[0], "result"),
        &Value::Str("CUDA_ERROR_INVALID_VALUE".into())
    );
    assert_eq!(
        stat(&spans[0], "kernel"),
        &Value::Str("<unresolved 0xabc>".into())
    );
    assert_eq!(spans[0].correlation, None);
    // Only the successful launch reached the GPU: the per-thread stream of tid 3.
    let gpu0 = &tl.devices[&0];
    assert_eq!(gpu0.streams.len(), 1);
    let line = gpu0.streams.values().next().unwrap();
    assert_eq!(line.label, "per-thread default stream of tid 3");
    assert_eq!(line.events.len(), 1);
    assert_eq!(
        stat(&line.events[0], "device_ordinal_source"),
        &Value::Str(OrdinalSource::Unknown.describe().into())
    );
}

#[test]
fn launch_config_and_memcpy_struct_words_decode() {
    let mut b = CudaTimelineBuilder::new(0, 10_000);
    b.push_call(&call(
        "cuLaunchKernelEx",
        4,
        (1, 2),
        &[0x7000, 0xf1],
        &[8 | 2 << 32, 1 | 128 << 32, 1 | 1 << 32, 1024, 0x77],
        0,
    ));
    b.push_call(&call(
        "cuMemcpy2DAsync_v2",
        4,
        (3, 4),
        &[0x7100, 0x77],
        &[1, 0, 2, 0xd0, 64, 3],
        0,
    ));
    let tl = b.finish();
    let spans = &tl.spans[&4].1;
    assert_eq!(stat(&spans[0], "grid"), &Value::Str("8,2,1".into()));
    assert_eq!(stat(&spans[0], "block"), &Value::Str("128,1,1".into()));
    assert_eq!(stat(&spans[0], "shared_memory_bytes"), &Value::U64(1024));
    assert_eq!(stat(&spans[1], "bytes"), &Value::U64(192));
    assert_eq!(stat(&spans[1], "direction"), &Value::Str("HtoD".into()));
    let line = &tl.devices[&0].streams[&1];
    let names: Vec<&str> = line.events.iter().map(|e| &*e.name).collect();
    assert_eq!(names, ["<unresolved 0xf1>", "MemcpyH2D"]);
}

#[test]
fn legacy_streams_of_two_processes_get_two_lines() {
    let mut b = CudaTimelineBuilder::new(0, 100);
    let mut other = call("cuMemsetD32_v2", 9, (3, 4), &[0xd0, 0, 16], &[], 0);
    other.tgid = PID + 1;
    b.push_call(&call("cuMemsetD32_v2", 8, (1, 2), &[0xd0, 0, 16], &[], 0));
    b.push_call(&other);
    let tl = b.finish();
    let labels: Vec<(i64, &str)> = tl.devices[&0]
        .streams
        .values()
        .map(|s| (s.id, s.label.as_str()))
        .collect();
    assert_eq!(
        labels,
        [
            (0, "legacy default stream of pid 50"),
            (1, "legacy default stream of pid 51")
        ]
    );
}

#[test]
fn kernel_names_carry_over_to_functions_and_get_cut_marks() {
    let mut b = CudaTimelineBuilder::new(0, 100);
    b.push_symbol(&symbol(0x10, "plain_c_kernel"));
    b.push_call(&call(
        "cuKernelGetFunction",
        1,
        (1, 2),
        &[0, 0x10],
        &[],
        0x20,
    ));
    let mut cut = symbol(0x30, "_Z3fooi");
    cut.truncated = 1;
    b.push_symbol(&cut);
    assert_eq!(&*b.kernel_name(PID, 0x20).0, "plain_c_kernel");
    assert_eq!(&*b.kernel_name(PID, 0x30).0, "_Z3fooi…");
}

#[test]
fn overlapping_work_on_a_stream_is_made_to_follow() {
    let work = |start_ns, end_ns, name: &str| Span {
        start_ns,
        end_ns,
        name: name.into(),
        stats: Stats::default(),
        correlation: None,
    };
    let mut events = vec![work(20, 50, "b"), work(10, 50, "a"), work(60, 70, "c")];
    serialize(&mut events);
    let got: Vec<(&str, u64, u64)> = events
        .iter()
        .map(|e| (&*e.name, e.start_ns, e.end_ns))
        .collect();
    assert_eq!(got, vec![("a", 10, 50), ("b", 50, 50), ("c", 60, 70)]);
}

/// A driver call as a hostile (or buggy) process may make it: any
/// function, any arguments, any result, times around the window.
fn any_call() -> impl proptest::strategy::Strategy<Value = CudaCall> {
    use proptest::prelude::*;
    let small = prop_oneof![0u64..4, any::<u64>()];
    (
        (1u32..4, 0u64..12_000, 0u64..3_000),
        0..cuda_api::FUNCTIONS.len() as u16 + 2,
        prop_oneof![Just(0u32), any::<u32>()],
        proptest::array::uniform6(small.clone()),
        proptest::array::uniform8(small.clone()),
        small,
    )
        .prop_map(
            |((tid, start, len), function, result, args, extra, out)| CudaCall {
                header: RecordHeader::new(RecordKind::CudaCall, 160, 0, start + len),
                tid,
                tgid: PID,
                start_ns: start,
                function,
                flags: 0,
                result,
                args,
                extra,
                out_value: out,
            },
        )
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Whatever calls the target makes, host spans nest, each stream's
    /// work follows itself, and the window keeps everything inside it.
    #[test]
    fn any_calls_make_a_well_formed_timeline(
        mut calls in proptest::collection::vec(any_call(), 0..60),
    ) {
        calls.sort_by_key(|c| c.header.ts_ns);
        let mut b = CudaTimelineBuilder::new(1_000, 10_000);
        for c in &calls {
            b.push_call(c);
        }
        let cuda = b.finish();
        for (_, spans) in cuda.spans.values() {
            for (i, a) in spans.iter().enumerate() {
                for x in &spans[i + 1..] {
                    let apart = a.end_ns <= x.start_ns || x.end_ns <= a.start_ns;
                    let nested = (a.start_ns <= x.start_ns && x.end_ns <= a.end_ns)
                        || (x.start_ns <= a.start_ns && a.end_ns <= x.end_ns);
                    proptest::prop_assert!(apart || nested, "{a:?} / {x:?}");
                }
            }
        }
        for stream in cuda.devices.values().flat_map(|d| d.streams.values()) {
            proptest::prop_assert!(stream.events.windows(2).all(|w| w[0].end_ns <= w[1].start_ns));
            proptest::prop_assert!(stream.events.iter().all(|e| e.start_ns <= e.end_ns));
        }
        let tl = cut_to(cuda, &crate::timeline::Window::between(1_000, 10_000));
        for e in tl.device_events() {
            proptest::prop_assert!(1_000 <= e.start_ns && e.end_ns <= 10_000);
        }
    }
}
