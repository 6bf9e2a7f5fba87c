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

mod join;
pub mod records;

use std::collections::{BTreeMap, HashMap};

use tracer_agent::activity::{self, BatchHeader};

pub use records::{Activity, DriverCall, Kernel, Transfer, decode};
use records::{Placement, copy_kind_name, memory_kind_name};

use super::{
    DeviceTrack, Span, StatName, StreamTiming, StreamTrack, Timeline, Value, cuda::demangle,
};
use crate::clock::ClockSync;

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

/// Where the device's work was laid, by the CUPTI correlation id of the
/// call that submitted it.
#[derive(Default)]
struct LaidWork {
    /// `(device, line, index)` of the work's event.
    events: HashMap<u32, (u32, i64, usize)>,
    /// The kernel's name, demangled, of each kernel execution.
    kernel_names: HashMap<u32, String>,
}

/// Records, each with the clock pairing of the batch it came in.
type Clocked<T> = Vec<(T, ClockSync)>;

/// Merges the activity `batches` the agent forwarded from process `pid`.
pub fn merge_device_activity(
    timeline: &mut Timeline,
    pid: u32,
    batches: &[&[u8]],
) -> ActivityMerge {
    let mut merge = ActivityMerge::default();
    let (work, calls) = read_batches(batches, &mut merge);
    if batches.is_empty() {
        return merge;
    }
    drop_host_observed(timeline, pid);
    let laid = lay_work(timeline, pid, work, &mut merge);
    join::join_calls(timeline, pid, calls, &laid, &mut merge);
    sort_lines_of(timeline, pid);
    merge
}

/// The device's work and the driver calls that CUPTI's records in
/// `batches` hold, each with the clock pairing of its batch; counts what
/// was dropped or skipped in `merge`.
fn read_batches(
    batches: &[&[u8]],
    merge: &mut ActivityMerge,
) -> (Clocked<Activity>, Clocked<DriverCall>) {
    let mut work = Vec::new();
    let mut calls = Vec::new();
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
    (work, calls)
}

/// The device ran it: CUPTI's events replace the host-observed ones of `pid`.
fn drop_host_observed(timeline: &mut Timeline, pid: u32) {
    for device in timeline.devices.values_mut() {
        device.streams.retain(|_, s| s.pid != pid);
    }
    timeline.devices.retain(|_, d| !d.streams.is_empty());
}

/// Lays each piece of `work` of `pid` on its CUPTI stream's line, timed
/// by the device.
fn lay_work(
    timeline: &mut Timeline,
    pid: u32,
    work: Clocked<Activity>,
    merge: &mut ActivityMerge,
) -> LaidWork {
    let mut laid = LaidWork::default();
    for (a, clock) in work {
        let (at, name, mut stats) = match &a {
            Activity::Kernel(k) => {
                merge.kernels += 1;
                let name = demangle(&k.name).unwrap_or_else(|| k.name.clone());
                laid.kernel_names.insert(k.at.correlation, name.clone());
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
        stats.extend(placement_stats(&at, pid));
        let events = &mut timeline
            .devices
            .get_mut(&at.device)
            .and_then(|d| d.streams.get_mut(&line))
            .expect("stream_line made it")
            .events;
        events.push(Span {
            start_ns: clock.to_monotonic_ns(at.start),
            end_ns: clock.to_monotonic_ns(at.end.max(at.start)),
            name: name.into(),
            stats: stats.into(),
            correlation: None,
        });
        laid.events
            .insert(at.correlation, (at.device, line, events.len() - 1));
    }
    laid
}

/// Where a piece of work of `pid` ran, as stats.
fn placement_stats(at: &Placement, pid: u32) -> [(StatName, Value); 5] {
    [
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
    ]
}

/// Sorts the spans of `pid`'s threads and the events of its lines by time.
fn sort_lines_of(timeline: &mut Timeline, pid: u32) {
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
    use std::num::NonZeroU64;

    use super::*;
    use crate::timeline::{ThreadCounters, ThreadTrack};

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
        let mut tl = Timeline::empty(0, 10_000_000, ClockSync::from_offset(0));
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

    /// A batch's header, its clocks paired as [`GPU_AHEAD`] says.
    fn header() -> Vec<u8> {
        BatchHeader {
            api_version: 26,
            flags: 0,
            gpu_ns: 5 + GPU_AHEAD,
            monotonic_ns: 5,
            dropped: 0,
        }
        .encode()
        .to_vec()
    }

    fn batch() -> Vec<u8> {
        let mut b = header();
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

    /// A rare launch whose stack the uprobe took reached the driver's code
    /// 30 µs after the uprobe fired: CUPTI's record, inside the span, joins
    /// it all the same.
    #[test]
    fn a_launch_slow_to_reach_the_driver_joins_its_span() {
        let mut tl = timeline();
        let spans = &mut tl.threads.get_mut(&TID).expect("thread").spans;
        spans.truncate(1);
        spans[0].end_ns = 140_000;
        let mut b = header();
        push(&mut b, &driver(307, 130_000, 9), b"");
        push(&mut b, &kernel(150_000, 9, 1), b"_Z5earlyPf");
        let m = merge_device_activity(&mut tl, PID, &[&b]);
        assert_eq!((m.joined, m.spans_from_records), (1, 0));
        let span = &tl.threads[&TID].spans[0];
        assert_eq!(
            span.correlation.map(NonZeroU64::get),
            Some((u64::from(PID) << 32) | 9)
        );
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
