//! Feeding driver calls to a [`CudaTimelineBuilder`]: each call becomes a
//! span on its thread, and the work it submitted an event on its stream's
//! line, the two sharing a correlation id.

use std::{collections::BTreeSet, num::NonZeroU64, sync::Arc};

use rustc_hash::FxHashMap;
use tracer_common::cuda::{CudaCall, flags};

use super::{
    CudaTimeline, CudaTimelineBuilder, EarliestStarts,
    contexts::OrdinalSource,
    describe::{self, Work},
    lines::{StreamKey, serialize},
};
use crate::{
    cuda_api::{self, CallArgs, DriverFunction},
    timeline::{Cuts, SharedTexts, Span, Stat, Stats, Value, nest},
};

/// The `result` of a call recorded at its entry only
/// ([`cuda_api::DriverFunction::entry_only`]): it shows as an instant.
const ENTRY_ONLY_RESULT: &str = "not recorded (probed at entry only)";

/// Stats that spans share, and the launch details they were made from.
pub(super) struct SharedGroup {
    _details: Arc<[Stat]>,
    stats: Arc<[Stat]>,
}

/// Where a call's work went.
struct Submitted {
    /// Shared by the call's span and the work's event.
    correlation: Option<NonZeroU64>,
    /// The label of the work's stream line.
    label: Arc<str>,
    /// The device the work went to.
    ordinal: u32,
}

impl CudaTimelineBuilder {
    /// `start_ns..stop_ns` is the capture window (monotonic ns).
    pub fn new(start_ns: u64, stop_ns: u64) -> Self {
        CudaTimelineBuilder {
            start_ns,
            stop_ns,
            ..Default::default()
        }
    }

    /// Makes only what a trace of at most `max_events` events, of the
    /// `shown` processes (all where `None`), can show: calls starting after
    /// where it will be cut are counted, not built.
    pub fn at_most(mut self, max_events: Option<usize>, shown: Option<&BTreeSet<u32>>) -> Self {
        self.limit = max_events.map(|max| EarliestStarts::new(max, shown.cloned()));
        self
    }

    /// Feeds one driver call (records in return-time order).
    pub fn push_call(&mut self, rec: &CudaCall) {
        let Some(function) = cuda_api::function(rec.function) else {
            return;
        };
        let args = CallArgs::decode(function, rec);
        let ok = rec.result == 0;
        if ok {
            self.learn(rec, &args);
        }
        let end = rec.header.ts_ns;
        if end < self.start_ns || rec.start_ns > self.stop_ns {
            return;
        }
        let start = rec.start_ns.max(self.start_ns);
        let interval = (start, end.min(self.stop_ns).max(start));
        self.out.calls += 1;
        if self
            .limit
            .as_ref()
            .is_some_and(|l| l.past_the_cut(rec.tgid, start))
        {
            // Numbered as if made: the correlations of the calls made after
            // it are those of the whole window's. Its thread is known, as it
            // would be.
            if ok && describe::submits_work(&args) {
                self.correlations += 1;
            }
            self.out
                .spans
                .entry(rec.tid)
                .or_insert_with(|| (rec.tgid, Vec::new()));
            return;
        }
        let (stats, work) = self.describe(rec, &args);
        // A launch's details are shared: so are the stats its call and its
        // work have in common with others; their correlation is their own.
        // Those stats are made only for a new group.
        let details = stats.shared().cloned();
        let submitted = work
            .filter(|_| ok)
            .map(|work| self.push_work(rec, function, interval, work, details.as_ref()));
        if let Some(limit) = &mut self.limit {
            limit.made(rec.tgid, start);
        }
        let stats = self.call_span_stats(rec, stats, details.as_ref(), submitted.as_ref());
        let name = self.texts.get(function.name);
        self.out
            .spans
            .entry(rec.tid)
            .or_insert_with(|| (rec.tgid, Vec::new()))
            .1
            .push(Span {
                start_ns: interval.0,
                end_ns: interval.1,
                name,
                stats,
                correlation: submitted.and_then(|s| s.correlation),
            });
    }

    /// Updates what is known about contexts, streams and names from a
    /// successful call.
    fn learn(&mut self, rec: &CudaCall, args: &CallArgs) {
        if let CallArgs::KernelGetFunction { kernel, function } = *args {
            self.name_function_of_kernel(rec.tgid, kernel, function);
        }
        self.contexts.learn(rec.tgid, rec.tid, args);
    }

    /// Lays `work` on its stream's line over `start_ns..end_ns`.
    fn push_work(
        &mut self,
        rec: &CudaCall,
        function: &DriverFunction,
        (start_ns, end_ns): (u64, u64),
        work: Work,
        details: Option<&Arc<[Stat]>>,
    ) -> Submitted {
        self.correlations += 1;
        let correlation = NonZeroU64::new(self.correlations);
        let (ordinal, source) = self.contexts.ordinal(rec.tgid, rec.tid, work.stream);
        let key = StreamKey::of(work.stream, rec.tid);
        let (line, label) = self.stream_line(ordinal, rec.tgid, key);
        let stats = self.work_stats(rec, function, work.stats, details, &label, source);
        self.out
            .devices
            .get_mut(&ordinal)
            .and_then(|d| d.streams.get_mut(&line))
            .expect("stream_line created the line")
            .events
            .push(Span {
                start_ns,
                end_ns,
                name: work.name,
                stats,
                correlation,
            });
        Submitted {
            correlation,
            label,
            ordinal,
        }
    }

    /// The stats of a call's work: `own` (or the launch's shared
    /// `details`), then where it went and who submitted it.
    fn work_stats(
        &mut self,
        rec: &CudaCall,
        function: &DriverFunction,
        own: Stats,
        details: Option<&Arc<[Stat]>>,
        label: &Arc<str>,
        source: OrdinalSource,
    ) -> Stats {
        let tail = |texts: &mut SharedTexts| {
            vec![
                ("stream".into(), Value::Str(Arc::clone(label))),
                ("submitted_by".into(), texts.value(function.name)),
                ("tid".into(), Value::I64(i64::from(rec.tid))),
                ("pid".into(), Value::I64(i64::from(rec.tgid))),
                (
                    "device_ordinal_source".into(),
                    texts.value(source.describe()),
                ),
            ]
        };
        match details {
            Some(details) => {
                let key = (
                    details_key(details),
                    text_key(label),
                    rec.function,
                    rec.tid,
                    rec.tgid,
                    source,
                );
                let group = shared_group(&mut self.work_groups, key, details, || {
                    tail(&mut self.texts)
                });
                Stats::shared_then(group, Vec::new())
            }
            None => {
                let mut stats = own;
                stats.reserve_exact(5);
                stats.extend(tail(&mut self.texts));
                stats
            }
        }
    }

    /// The stats of a call's span: `own` (or the launch's shared
    /// `details`), then its result and where its work went.
    fn call_span_stats(
        &mut self,
        rec: &CudaCall,
        own: Stats,
        details: Option<&Arc<[Stat]>>,
        submitted: Option<&Submitted>,
    ) -> Stats {
        let entry_only = rec.flags & flags::ENTRY_ONLY != 0;
        let tail = |texts: &mut SharedTexts| call_tail(texts, rec, entry_only, submitted);
        match details {
            Some(details) => {
                let (line, ordinal) =
                    submitted.map_or((0, u32::MAX), |s| (text_key(&s.label), s.ordinal));
                // An entry-only call's result is not known: not a success.
                let result = if entry_only { u32::MAX } else { rec.result };
                let key = (details_key(details), result, line, ordinal);
                let group = shared_group(&mut self.call_groups, key, details, || {
                    tail(&mut self.texts)
                });
                Stats::shared_then(group, Vec::new())
            }
            None => {
                let mut stats = own;
                // Exactly: a flight recorder's snapshot holds many thousands of calls.
                stats.reserve_exact(4);
                stats.extend(tail(&mut self.texts));
                stats
            }
        }
    }

    /// Host spans nest, device events follow each other on their stream.
    pub fn finish(mut self) -> CudaTimeline {
        for (_, spans) in self.out.spans.values_mut() {
            nest(spans, Cuts::Silent);
        }
        for device in self.out.devices.values_mut() {
            for stream in device.streams.values_mut() {
                serialize(&mut stream.events);
            }
        }
        self.out
    }
}

/// A call's result, and the line and device of its work if any.
fn call_tail(
    texts: &mut SharedTexts,
    rec: &CudaCall,
    entry_only: bool,
    submitted: Option<&Submitted>,
) -> Vec<Stat> {
    let mut tail = Vec::with_capacity(4);
    if entry_only {
        tail.push(("result".into(), texts.value(ENTRY_ONLY_RESULT)));
    } else {
        let result = match cuda_api::result_name(rec.result) {
            Some(name) => texts.get(name),
            None => texts.format(format_args!("CUresult {}", rec.result)),
        };
        tail.extend([
            (
                "result_code".into(),
                Value::I64(i64::from(rec.result as i32)),
            ),
            ("result".into(), Value::Str(result)),
        ]);
    }
    if let Some(submitted) = submitted {
        tail.extend([
            ("stream".into(), Value::Str(Arc::clone(&submitted.label))),
            (
                "device_ordinal".into(),
                Value::I64(i64::from(submitted.ordinal)),
            ),
        ]);
    }
    tail
}

/// A key part that tells launch details apart while they are alive.
fn details_key(details: &Arc<[Stat]>) -> usize {
    Arc::as_ptr(details).cast::<u8>() as usize
}

/// A key part that tells shared texts apart while they are alive (a
/// stream's label lives as long as the builder).
fn text_key(text: &Arc<str>) -> usize {
    Arc::as_ptr(text).cast::<u8>() as usize
}

/// `details` then what `more` makes (only for a new group), shared by the
/// spans whose `key` is the same.
fn shared_group<K: std::hash::Hash + Eq>(
    groups: &mut FxHashMap<K, SharedGroup>,
    key: K,
    details: &Arc<[Stat]>,
    more: impl FnOnce() -> Vec<Stat>,
) -> Arc<[Stat]> {
    let group = groups.entry(key).or_insert_with(|| SharedGroup {
        _details: Arc::clone(details),
        stats: details
            .iter()
            .cloned()
            .chain(more())
            .collect::<Vec<_>>()
            .into(),
    });
    Arc::clone(&group.stats)
}
