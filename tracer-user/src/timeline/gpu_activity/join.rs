//! Joining each piece of device work to the driver call that submitted
//! it: CUPTI's driver API record of the call finds, by thread and
//! interval, the span the uprobes recorded of it, which then shares the
//! work's correlation id. A call the uprobes did not see gets a span from
//! the record itself.

use std::{
    collections::{HashMap, HashSet},
    num::NonZeroU64,
};

use super::{ActivityMerge, Clocked, DriverCall, LaidWork, records::driver_function};
use crate::timeline::{Span, Stat, ThreadTrack, Timeline, Value};

/// How long before CUPTI's record of a driver call the uprobe span of the
/// same call may start: the uprobe fires first, and with the call's stack
/// taken (Python frames too) a call made rarely, its caches cold, spent
/// 28 µs in it on a 2-core VM before the driver's own code ran.
const JOIN_SLACK_NS: u64 = 1_000_000;
/// How far CUPTI's record may stick out of the uprobe span that encloses
/// it (the two clocks are paired to within a µs or so).
const JOIN_TOLERANCE_NS: u64 = 3_000;

/// Joins each of `calls` of `pid` to the work it submitted, as `laid`
/// says where that work is; a span joins one call.
pub(super) fn join_calls(
    timeline: &mut Timeline,
    pid: u32,
    calls: Clocked<DriverCall>,
    laid: &LaidWork,
    merge: &mut ActivityMerge,
) {
    let mut taken: HashSet<(u32, usize)> = HashSet::new();
    let mut starts: HashMap<u32, Vec<(u64, usize)>> = HashMap::new();
    for (call, clock) in calls {
        let Some(&event) = laid.events.get(&call.correlation) else {
            continue;
        };
        let interval = (
            clock.to_monotonic_ns(call.start),
            clock.to_monotonic_ns(call.end.max(call.start)),
        );
        let function = driver_function(call.cbid);
        let id = correlation_id(pid, call.correlation);
        let kernel = laid.kernel_names.get(&call.correlation).map(String::as_str);
        let by_start = starts
            .entry(call.tid)
            .or_insert_with(|| span_starts(timeline, call.tid));
        let joined = timeline.threads.get_mut(&call.tid).and_then(|t| {
            let (start, end) = interval;
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
                if let Some(name) = kernel {
                    name_unresolved_kernel(span, name);
                }
                span.name.to_string()
            }
            None => {
                let Some(track) = timeline.threads.get_mut(&call.tid) else {
                    continue;
                };
                merge.spans_from_records += 1;
                push_span_from_record(track, &call, function, interval, id, kernel)
            }
        };
        mark_submitted(timeline, event, id, submitted_by, call.tid);
    }
}

/// The id that links a call of `pid` and its work: unique across
/// processes; not 0, as the pid is not.
fn correlation_id(pid: u32, correlation: u32) -> NonZeroU64 {
    NonZeroU64::new((u64::from(pid) << 32) | u64::from(correlation)).unwrap_or(NonZeroU64::MAX)
}

/// Gives a call the uprobes did not see a span on `track` from CUPTI's
/// record of it; the span's name.
fn push_span_from_record(
    track: &mut ThreadTrack,
    call: &DriverCall,
    function: Option<&str>,
    (start_ns, end_ns): (u64, u64),
    id: NonZeroU64,
    kernel: Option<&str>,
) -> String {
    let name = function.map_or_else(|| format!("CUDA driver call {}", call.cbid), str::to_string);
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
    if let Some(kernel) = kernel {
        stats.push(("kernel".into(), Value::Str(kernel.into())));
    }
    track.spans.push(Span {
        start_ns,
        end_ns,
        name: name.as_str().into(),
        stats: stats.into(),
        correlation: Some(id),
    });
    name
}

/// Links the work event at `(device, line, index)` to its call, made by
/// `tid` and named `submitted_by`.
fn mark_submitted(
    timeline: &mut Timeline,
    (device, line, index): (u32, i64, usize),
    id: NonZeroU64,
    submitted_by: String,
    tid: u32,
) {
    let event = &mut timeline
        .devices
        .get_mut(&device)
        .expect("lay_work made it")
        .streams
        .get_mut(&line)
        .expect("lay_work made it")
        .events[index];
    event.correlation = Some(id);
    event.stats.extend([
        ("submitted_by".into(), Value::Str(submitted_by.into())),
        ("tid".into(), Value::I64(i64::from(tid))),
    ]);
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
/// is `free`, the latest to start; its index. `by_start` is
/// [`span_starts`] of the thread. The calls of one thread follow one
/// another, so the search goes back from the record's start and ends at
/// the first such span.
fn uprobe_span(
    spans: &[Span],
    by_start: &[(u64, usize)],
    function: Option<&str>,
    start: u64,
    end: u64,
    free: impl Fn(usize) -> bool,
) -> Option<usize> {
    let lo = start.saturating_sub(JOIN_SLACK_NS);
    let last = by_start.partition_point(|&(s, _)| s <= start.saturating_add(JOIN_TOLERANCE_NS));
    by_start[..last]
        .iter()
        .rev()
        .take_while(|&&(s, _)| s >= lo)
        .map(|&(_, i)| (i, &spans[i]))
        .filter(|(_, s)| s.end_ns.saturating_add(JOIN_TOLERANCE_NS) >= end)
        .filter(|(_, s)| match function {
            Some(f) => &*s.name == f,
            None => s.name.starts_with("cu"),
        })
        .find(|(i, _)| free(*i))
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
