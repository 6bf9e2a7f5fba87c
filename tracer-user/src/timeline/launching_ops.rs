//! Which PyTorch op launched each piece of GPU work: the innermost op or
//! `record_function` range on the thread around the driver call that
//! submitted it, as torch.profiler relates a kernel to its op. The driver
//! call shares its correlation id with the device event (CUPTI's, or the
//! host-observed one), so the op's name goes on the device event: XProf's
//! details pane and its kernel stats then say which op ran each kernel,
//! and the trace viewer's arrow leads from the launch inside that op to
//! the kernel.

use std::{cmp::Reverse, collections::HashMap, num::NonZeroU64, sync::Arc};

use super::{
    Span, Timeline, Value,
    torch_ops::{FRAMEWORK_OP_STAT, SCOPE_STAT, framework_op},
};

/// Stat of a device event: the PyTorch op (or `record_function` range)
/// whose driver call submitted it.
pub const LAUNCHING_OP_STAT: &str = "torch_op";

/// Names each device event of `timeline` after the op that launched it;
/// returns how many were named, by pid.
pub fn name_launching_ops(timeline: &mut Timeline) -> HashMap<u32, u64> {
    let mut op_of: HashMap<NonZeroU64, Arc<str>> = HashMap::new();
    for track in timeline.threads.values() {
        innermost_ops(&track.spans, &mut op_of);
    }
    let mut named: HashMap<u32, u64> = HashMap::new();
    if op_of.is_empty() {
        return named;
    }
    // XProf's name of each op, made once per op name (a GPU job launches
    // the same few ops millions of times).
    let mut framework_names: HashMap<Arc<str>, Option<Arc<str>>> = HashMap::new();
    for stream in timeline
        .devices
        .values_mut()
        .flat_map(|d| d.streams.values_mut())
    {
        for event in &mut stream.events {
            let Some(op) = event.correlation.and_then(|id| op_of.get(&id)) else {
                continue;
            };
            event
                .stats
                .push((LAUNCHING_OP_STAT.into(), Value::Str(Arc::clone(op))));
            let tf_op = framework_names
                .entry(Arc::clone(op))
                .or_insert_with(|| framework_op(op).map(Arc::from));
            if let Some(tf_op) = tf_op {
                event
                    .stats
                    .push((FRAMEWORK_OP_STAT.into(), Value::Str(Arc::clone(tf_op))));
            }
            *named.entry(stream.pid).or_default() += 1;
        }
    }
    named
}

/// Adds to `op_of` the innermost op around each of one thread's (nested)
/// `spans` that carries a correlation id.
fn innermost_ops(spans: &[Span], op_of: &mut HashMap<NonZeroU64, Arc<str>>) {
    let is_op = |s: &Span| s.stats.get(SCOPE_STAT).is_some();
    if !spans.iter().any(is_op) {
        return;
    }
    let mut ordered: Vec<&Span> = spans.iter().collect();
    ordered.sort_by_key(|s| (s.start_ns, Reverse(s.end_ns)));
    let mut open: Vec<&Span> = Vec::new();
    for span in ordered {
        while open.last().is_some_and(|op| op.end_ns < span.start_ns) {
            open.pop();
        }
        if is_op(span) {
            open.push(span);
        } else if let (Some(id), Some(op)) = (span.correlation, open.last()) {
            op_of.insert(id, Arc::clone(&op.name));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;

    use super::{LAUNCHING_OP_STAT, name_launching_ops};
    use crate::{
        clock::ClockSync,
        timeline::{
            Span, Stats, Timeline, Value,
            cuda::{DeviceTrack, StreamTiming, StreamTrack},
            torch_ops::{FRAMEWORK_OP_STAT, SCOPE_STAT},
        },
    };

    fn span(start_ns: u64, end_ns: u64, name: &str, op: bool, correlation: u64) -> Span {
        let stats: Stats = if op {
            vec![(SCOPE_STAT.into(), Value::Str("function".into()))].into()
        } else {
            Stats::default()
        };
        Span {
            start_ns,
            end_ns,
            name: name.into(),
            stats,
            correlation: NonZeroU64::new(correlation),
        }
    }

    fn stat(event: &Span, name: &str) -> Option<String> {
        match event.stats.get(name) {
            Some(Value::Str(s)) => Some(s.to_string()),
            _ => None,
        }
    }

    #[test]
    fn each_kernel_is_named_after_the_innermost_op_around_its_launch() {
        let mut timeline = Timeline::empty(0, 10_000, ClockSync::from_offset(0));
        let track = timeline.thread_track(7, 7, || "main".into());
        track.spans = vec![
            span(150, 160, "cuLaunchKernel", false, 1),
            span(100, 900, "train_step", true, 0),
            span(120, 190, "aten::addmm", true, 0),
            span(110, 200, "aten::linear", true, 0),
            span(300, 310, "cuMemcpyHtoDAsync", false, 2),
            span(950, 960, "cuLaunchKernel", false, 3),
        ];
        let events = (1..=4)
            .map(|c| span(1000 + c * 10, 1005 + c * 10, "kernel", false, c))
            .collect();
        timeline.devices.insert(
            0,
            DeviceTrack {
                ordinal: 0,
                streams: [(
                    1,
                    StreamTrack {
                        id: 1,
                        pid: 7,
                        label: "stream".into(),
                        timing: StreamTiming::Device,
                        events,
                    },
                )]
                .into(),
            },
        );
        let named = name_launching_ops(&mut timeline);
        assert_eq!(named.get(&7), Some(&2));
        let events = &timeline.devices[&0].streams[&1].events;
        let ops: Vec<_> = events.iter().map(|e| stat(e, LAUNCHING_OP_STAT)).collect();
        assert_eq!(
            ops,
            [
                Some("aten::addmm".into()),
                Some("train_step".into()),
                None,
                None
            ]
        );
        assert_eq!(
            stat(&events[0], FRAMEWORK_OP_STAT).as_deref(),
            Some("aten.addmm:")
        );
    }
}
