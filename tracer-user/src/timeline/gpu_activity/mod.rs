//! What the GPU ran, from CUPTI's activity records (forwarded by the
//! agent), merged into the timeline:
//!
//! - kernels, copies and memsets become events on their GPU, one line per
//!   CUPTI stream, timed by the device. They replace the process's
//!   host-observed events (the driver calls' own intervals, see
//!   [`super::cuda`]), which only say when the host submitted the work;
//! - CUPTI's driver API records join each piece of work to the call that
//!   submitted it: a record's thread and interval find the driver call's
//!   span the uprobes recorded, which then shares the work's correlation
//!   id (XProf draws the launch arrow). A call the uprobes did not see gets
//!   a span from the record itself. A launch span whose kernel was looked
//!   up before the capture (`<unresolved 0x…>`) is named from the kernel.
//!
//! GPU timestamps map to `CLOCK_MONOTONIC` through the pair of readings
//! each batch carries ([`ClockSync::pairing`]).

pub mod records;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    num::NonZeroU64,
};

use tracer_agent::activity::{self, BatchHeader};

pub use records::{Activity, DriverCall, Kernel, Transfer, decode};
use records::{copy_kind_name, driver_function, memory_kind_name};

use super::{
    DeviceTrack, Span, Stat, StatName, StreamTiming, StreamTrack, Timeline, Value, cuda::demangle,
};
use crate::clock::ClockSync;

/// How long before CUPTI's record of a driver call the uprobe span of the
/// same call may start (the uprobe fires first; its cost is µs).
const JOIN_SLACK_NS: u64 = 20_000;
/// How far CUPTI's record may stick out of the uprobe span that encloses
/// it (the two clocks are paired to within a µs or so).
const JOIN_TOLERANCE_NS: u64 = 3_000;

/// What became of one process's device activity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivityMerge {
    /// Kernel executions laid on the device streams.
    pub kernels: u64,
    /// Memory copies laid on the device streams.
    pub copies: u64,
    /// Memory sets laid on the device streams.
    pub memsets: u64,
    /// Work joined to a driver call span the uprobes recorded.
    pub joined: u64,
    /// Work whose submitting call got its span from CUPTI's record.
    pub spans_from_records: u64,
    /// Records CUPTI dropped for want of a buffer.
    pub dropped: u64,
    /// Records not read (unknown kinds, malformed).
    pub skipped: u64,
}

/// Merges the activity `batches` the agent forwarded from process `pid`.
pub fn merge_device_activity(
    timeline: &mut Timeline,
    pid: u32,
    batches: &[&[u8]],
) -> ActivityMerge {
    let mut merge = ActivityMerge::default();
    let mut work: Vec<(Activity, ClockSync)> = Vec::new();
    let mut calls: Vec<(DriverCall, ClockSync)> = Vec::new();
    for batch in batches {
        let Some(header) = BatchHeader::decode(batch) else {
            continue;
        };
        let clock = ClockSync::pairing(header.gpu_ns, header.monotonic_ns);
        merge.dropped = merge.dropped.max(header.dropped);
        for (record, name) in activity::records(batch) {
            match decode(header.api_version, record, name) {
                Some(Activity::Driver(d)) => calls.push((d, clock)),
                Some(a) => work.push((a, clock)),
                None => merge.skipped += 1,
            }
        }
    }
    if batches.is_empty() {
        return merge;
    }
    // The device ran it: CUPTI's events replace the host-observed ones.
    for device in timeline.devices.values_mut() {
        device.streams.retain(|_, s| s.pid != pid);
    }
    timeline.devices.retain(|_, d| !d.streams.is_empty());

    // Unique across processes; not 0, as the pid is not.
    let link = |correlation: u32| {
        NonZeroU64::new((u64::from(pid) << 32) | u64::from(correlation)).unwrap_or(NonZeroU64::MAX)
    };
    let mut kernel_names: HashMap<u32, String> = HashMap::new();
    let mut submitted: HashMap<u32, (u32, i64, usize)> = HashMap::new();
    for (a, clock) in work {
        let (at, name, stats) = match &a {
            Activity::Kernel(k) => {
                merge.kernels += 1;
                let name = demangle(&k.name).unwrap_or_else(|| k.name.clone());
                kernel_names.insert(k.at.correlation, name.clone());
                (k.at, name, kernel_stats(k))
            }
            Activity::Memcpy(t) => {
                merge.copies += 1;
                (
                    t.at,
                    format!("Memcpy{}", copy_kind_name(t.kind)),
                    copy_stats(t),
                )
            }
            Activity::Memset(t) => {
                merge.memsets += 1;
                (t.at, "Memset".into(), memset_stats(t))
            }
            Activity::Driver(_) => continue,
        };
        let line = stream_line(timeline, at.device, pid, at.stream);
        let mut stats = stats;
        stats.extend([
            ("device_id".into(), Value::U64(u64::from(at.device))),
            (
                "context_id".into(),
                Value::Str(format!("$${}", at.context).into()),
            ),
            ("stream_id".into(), Value::U64(u64::from(at.stream))),
            (
                "cupti_correlation_id".into(),
                Value::U64(u64::from(at.correlation)),
            ),
            ("pid".into(), Value::I64(i64::from(pid))),
        ]);
        let start = clock.to_monotonic_ns(at.start);
        let events = &mut timeline
            .devices
            .get_mut(&at.device)
            .and_then(|d| d.streams.get_mut(&line))
            .expect("stream_line made it")
            .events;
        events.push(Span {
            start_ns: start,
            end_ns: clock.to_monotonic_ns(at.end.max(at.start)),
            name: name.into(),
            stats: stats.into(),
            correlation: None,
        });
        submitted.insert(at.correlation, (at.device, line, events.len() - 1));
    }

    // Join each piece of work to the call that submitted it; a span joins
    // one call.
    let mut taken: HashSet<(u32, usize)> = HashSet::new();
    let mut starts: HashMap<u32, Vec<(u64, usize)>> = HashMap::new();
    for (call, clock) in calls {
        let Some(&(device, line, index)) = submitted.get(&call.correlation) else {
            continue;
        };
        let (start, end) = (
            clock.to_monotonic_ns(call.start),
            clock.to_monotonic_ns(call.end.max(call.start)),
        );
        let function = driver_function(call.cbid);
        let id = link(call.correlation);
        let by_start = starts
            .entry(call.tid)
            .or_insert_with(|| span_starts(timeline, call.tid));
        let joined = timeline.threads.get_mut(&call.tid).and_then(|t| {
            let i = uprobe_span(&t.spans, by_start, function, start, end, |i| {
                !taken.contains(&(call.tid, i))
            })?;
            taken.insert((call.tid, i));
            Some(&mut t.spans[i])
        });
        let submitted_by = match joined {
            Some(span) => {
                merge.joined += 1;
                span.correlation = Some(id);
                if let Some(name) = kernel_names.get(&call.correlation) {
                    name_unresolved_kernel(span, name);
                }
                span.name.to_string()
            }
            None => {
                let Some(track) = timeline.threads.get_mut(&call.tid) else {
                    continue;
                };
                merge.spans_from_records += 1;
                let name = function
                    .map_or_else(|| format!("CUDA driver call {}", call.cbid), str::to_string);
                let mut stats = vec![
                    (
                        "source".into(),
                        Value::Str("CUPTI driver API record".into()),
                    ),
                    (
                        "result_code".into(),
                        Value::I64(i64::from(call.result as i32)),
                    ),
                ];
                if let Some(kernel) = kernel_names.get(&call.correlation) {
                    stats.push(("kernel".into(), Value::Str(kernel.as_str().into())));
                }
                track.spans.push(Span {
                    start_ns: start,
                    end_ns: end,
                    name: name.as_str().into(),
                    stats: stats.into(),
                    correlation: Some(id),
                });
                name
            }
        };
        let event = &mut timeline
            .devices
            .get_mut(&device)
            .expect("made above")
            .streams
            .get_mut(&line)
            .expect("made above")
            .events[index];
        event.correlation = Some(id);
        event.stats.extend([
            ("submitted_by".into(), Value::Str(submitted_by.into())),
            ("tid".into(), Value::I64(i64::from(call.tid))),
        ]);
    }
    for track in timeline.threads.values_mut().filter(|t| t.pid == pid) {
        track
            .spans
            .sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
    }
    for device in timeline.devices.values_mut() {
        for stream in device.streams.values_mut().filter(|s| s.pid == pid) {
            stream.events.sort_by_key(|e| (e.start_ns, e.end_ns));
        }
    }
    merge
}

/// A thread's spans as `(start, index)`, sorted.
fn span_starts(timeline: &Timeline, tid: u32) -> Vec<(u64, usize)> {
    let mut starts: Vec<(u64, usize)> = timeline.threads.get(&tid).map_or_else(Vec::new, |t| {
        t.spans
            .iter()
            .enumerate()
            .map(|(i, s)| (s.start_ns, i))
            .collect()
    });
    starts.sort_unstable();
    starts
}

/// The uprobe span of the driver call CUPTI timed at `[start, end]`: one
/// of the same function (when CUPTI's id names it) that encloses it and
/// is `free`, the nearest by midpoint; its index. `by_start` is
/// [`span_starts`] of the thread.
fn uprobe_span(
    spans: &[Span],
    by_start: &[(u64, usize)],
    function: Option<&str>,
    start: u64,
    end: u64,
    free: impl Fn(usize) -> bool,
) -> Option<usize> {
    let (lo, hi) = (
        start.saturating_sub(JOIN_SLACK_NS),
        end.saturating_add(JOIN_SLACK_NS),
    );
    let mid = start / 2 + end / 2;
    let first = by_start.partition_point(|&(s, _)| s < lo);
    by_start[first..]
        .iter()
        .take_while(|&&(s, _)| s <= hi)
        .map(|&(_, i)| (i, &spans[i]))
        .filter(|(_, s)| {
            s.start_ns <= start.saturating_add(JOIN_TOLERANCE_NS)
                && s.end_ns.saturating_add(JOIN_TOLERANCE_NS) >= end
        })
        .filter(|(_, s)| match function {
            Some(f) => &*s.name == f,
            None => s.name.starts_with("cu"),
        })
        .filter(|(i, _)| free(*i))
        .min_by_key(|(_, s)| (s.start_ns / 2 + s.end_ns / 2).abs_diff(mid))
        .map(|(i, _)| i)
}

/// Names the kernel of a launch span whose function handle was looked up
/// before the capture.
fn name_unresolved_kernel(span: &mut Span, name: &str) {
    let unresolved =
        |(k, v): &Stat| k == "kernel" && matches!(v, Value::Str(s) if s.starts_with("<unresolved"));
    // Stats shared with other spans are copied only for the spans changed.
    if !span.stats.iter().any(unresolved) {
        return;
    }
    for stat in span.stats.iter_mut() {
        if unresolved(stat) {
            stat.1 = Value::Str(name.into());
        }
    }
}

/// The line of CUPTI stream `stream` of `pid` on GPU `device` (made on
/// first use): the stream id, unless another process's stream has it.
fn stream_line(timeline: &mut Timeline, device: u32, pid: u32, stream: u32) -> i64 {
    let track = timeline
        .devices
        .entry(device)
        .or_insert_with(|| DeviceTrack {
            ordinal: device,
            streams: BTreeMap::new(),
        });
    let mut id = i64::from(stream);
    while track.streams.get(&id).is_some_and(|s| s.pid != pid) {
        id += 1 << 32;
    }
    track.streams.entry(id).or_insert_with(|| StreamTrack {
        id,
        pid,
        label: format!("CUPTI stream {stream} of pid {pid}"),
        timing: StreamTiming::Device,
        events: Vec::new(),
    });
    id
}

/// XProf's `kernel_details` (what its kernel_stats tool parses) and more.
fn kernel_stats(k: &Kernel) -> Vec<(StatName, Value)> {
    let [gx, gy, gz] = k.grid;
    let [bx, by, bz] = k.block;
    let mut stats = vec![
        (
            "kernel_details".into(),
            Value::Str(format!(
                "regs:{} static_shared:{} dynamic_shared:{} grid:{gx},{gy},{gz} block:{bx},{by},{bz}",
                k.registers, k.static_shared, k.dynamic_shared
            ).into()),
        ),
        ("grid_id".into(), Value::I64(k.grid_id)),
    ];
    if demangle(&k.name).is_some() {
        stats.push(("mangled_name".into(), Value::Str(k.name.as_str().into())));
    }
    if let Some(g) = k.graph_id.filter(|&g| g != 0) {
        stats.push(("graph_id".into(), Value::U64(u64::from(g))));
    }
    if let Some(p) = k.priority {
        stats.push(("stream_priority".into(), Value::I64(i64::from(p))));
    }
    stats
}

/// XProf's `memcpy_details`.
fn copy_stats(t: &Transfer) -> Vec<(StatName, Value)> {
    vec![(
        "memcpy_details".into(),
        Value::Str(
            format!(
                "kind_src:{} kind_dst:{} size:{} dest:{} async:{}",
                memory_kind_name(t.src_kind),
                memory_kind_name(t.dst_kind),
                t.bytes,
                t.at.device,
                t.flags & 1 != 0
            )
            .into(),
        ),
    )]
}

/// XProf's `Memset_details`.
fn memset_stats(t: &Transfer) -> Vec<(StatName, Value)> {
    vec![(
        "Memset_details".into(),
        Value::Str(
            format!(
                "kind:{} size:{} value:{:#x} async:{}",
                memory_kind_name(t.kind),
                t.bytes,
                t.value,
                t.flags & 1 != 0
            )
            .into(),
        ),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::{CaptureStats, ThreadCounters, ThreadTrack};

    const PID: u32 = 40;
    const TID: u32 = 41;
    /// GPU clock = monotonic + this.
    const GPU_AHEAD: u64 = 1_000_000_000;

    fn timeline() -> Timeline {
        let launch = |start: u64, kernel: &str, correlation: u64| Span {
            start_ns: start,
            end_ns: start + 10_000,
            name: "cuLaunchKernel".into(),
            stats: vec![("kernel".into(), Value::Str(kernel.into()))].into(),
            correlation: NonZeroU64::new(correlation),
        };
        let mut tl = Timeline {
            start_ns: 0,
            stop_ns: 10_000_000,
            clock: ClockSync::from_offset(0),
            processes: BTreeMap::new(),
            peers: Vec::new(),
            threads: BTreeMap::new(),
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats: CaptureStats::default(),
        };
        tl.threads.insert(
            TID,
            ThreadTrack {
                tid: TID,
                pid: PID,
                name: "launcher".into(),
                slices: Vec::new(),
                marks: Vec::new(),
                spans: vec![
                    launch(100_000, "<unresolved 0xf00>", 1),
                    launch(200_000, "vecAdd", 2),
                ],
                counters: ThreadCounters::default(),
            },
        );
        // The host-observed events of those launches.
        tl.devices.insert(
            0,
            DeviceTrack {
                ordinal: 0,
                streams: BTreeMap::from([(
                    1,
                    StreamTrack {
                        id: 1,
                        pid: PID,
                        label: "0x1234".into(),
                        timing: StreamTiming::HostObserved,
                        events: vec![],
                    },
                )]),
            },
        );
        tl
    }

    fn push(batch: &mut Vec<u8>, record: &[u8], name: &[u8]) {
        batch.extend((record.len() as u32).to_le_bytes());
        batch.extend((name.len() as u32).to_le_bytes());
        batch.extend(record);
        batch.extend(name);
    }

    fn kernel(start: u64, correlation: u32, name_ptr: u64) -> Vec<u8> {
        let mut r = vec![0u8; records::KERNEL9_LEN];
        r[..4].copy_from_slice(&activity::KIND_CONCURRENT_KERNEL.to_le_bytes());
        r[16..24].copy_from_slice(&(start + GPU_AHEAD).to_le_bytes());
        r[24..32].copy_from_slice(&(start + 30_000 + GPU_AHEAD).to_le_bytes());
        r[48..52].copy_from_slice(&7u32.to_le_bytes());
        r[92..96].copy_from_slice(&correlation.to_le_bytes());
        r[104..112].copy_from_slice(&name_ptr.to_le_bytes());
        r
    }

    fn driver(cbid: u32, start: u64, correlation: u32) -> Vec<u8> {
        let mut r = vec![0u8; records::API_LEN];
        r[..4].copy_from_slice(&activity::KIND_DRIVER.to_le_bytes());
        r[4..8].copy_from_slice(&cbid.to_le_bytes());
        r[8..16].copy_from_slice(&(start + GPU_AHEAD).to_le_bytes());
        r[16..24].copy_from_slice(&(start + 5_000 + GPU_AHEAD).to_le_bytes());
        r[28..32].copy_from_slice(&TID.to_le_bytes());
        r[32..36].copy_from_slice(&correlation.to_le_bytes());
        r
    }

    fn batch() -> Vec<u8> {
        let mut b = BatchHeader {
            api_version: 26,
            flags: 0,
            gpu_ns: 5 + GPU_AHEAD,
            monotonic_ns: 5,
            dropped: 0,
        }
        .encode()
        .to_vec();
        push(&mut b, &driver(307, 102_000, 9), b"");
        push(&mut b, &driver(307, 202_000, 10), b"");
        // A launch the uprobes did not see (e.g. it came before them).
        push(&mut b, &driver(307, 302_000, 11), b"");
        push(&mut b, &kernel(120_000, 9, 1), b"_Z5earlyPf");
        push(&mut b, &kernel(220_000, 10, 2), b"_Z6vecAddPKfS0_Pfi");
        push(&mut b, &kernel(320_000, 11, 3), b"late");
        b
    }

    #[test]
    fn kernels_replace_host_observed_work_and_join_their_launches() {
        let mut tl = timeline();
        let m = merge_device_activity(&mut tl, PID, &[&batch()]);
        assert_eq!((m.kernels, m.joined, m.spans_from_records), (3, 2, 1));
        let stream = &tl.devices[&0].streams;
        assert_eq!(stream.keys().copied().collect::<Vec<_>>(), [7]);
        let events = &stream[&7].events;
        assert_eq!(events[0].start_ns, 120_000);
        assert_eq!(events[0].end_ns, 150_000);
        assert_eq!(&*events[0].name, "early(float*)");
        let correlation = |s: &Span| s.correlation.map(NonZeroU64::get);
        let spans = &tl.threads[&TID].spans;
        for (span, event, id) in [(&spans[0], &events[0], 9u64), (&spans[1], &events[1], 10)] {
            let id = (u64::from(PID) << 32) | id;
            assert_eq!(correlation(span), Some(id));
            assert_eq!(correlation(event), Some(id));
        }
        // The kernel looked up before the capture is named from CUPTI.
        assert!(
            spans[0]
                .stats
                .contains(&("kernel".into(), Value::Str("early(float*)".into())))
        );
        // The third launch got its span from CUPTI's record.
        assert_eq!(spans[2].start_ns, 302_000);
        assert_eq!(&*spans[2].name, "cuLaunchKernel");
        assert_eq!(correlation(&spans[2]), correlation(&events[2]));
    }

    proptest::proptest! {
        /// Whatever the agent forwards: merged or skipped, never a panic.
        #[test]
        fn any_batches_merge(batches: Vec<Vec<u8>>, cut in 0usize..2000) {
            let mut tl = timeline();
            let batches: Vec<&[u8]> = batches.iter().map(Vec::as_slice).collect();
            merge_device_activity(&mut tl, PID, &batches);
            let b = batch();
            merge_device_activity(&mut tl, PID, &[&b[..cut.min(b.len())]]);
        }
    }
}
