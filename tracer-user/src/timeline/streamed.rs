//! Scheduling records turned into thread states as they arrive, for a
//! window that starts when the capture does: `ebtrace record`'s one window
//! (the records need not all be held until the end, only the thread states
//! they make), or the first `serve` session on a capture, whose end is
//! known from the start (its answer then waits only for the last records,
//! not for all of them to be built). Such a window may also stop being
//! built once it holds more events than the trace may show
//! (`max_events`): the trace ends before then anyway.
//!
//! The ring buffer delivers records almost in time order (each probe takes
//! its timestamp just before it reserves its room, and another CPU may
//! reserve in between), while [`SchedTimelineBuilder`] needs them in order:
//! records wait in a short queue until every record up to
//! [`REORDER_SLACK_NS`] older than the newest one seen has arrived.

use std::collections::HashMap;

use tracer_common::RecordKind;

use super::{InitialState, SchedTimelineBuilder};
use crate::collect::Record;

/// How much older than the newest record seen a record may still arrive.
/// Far more than the disorder of one ring buffer (nanoseconds to a few
/// microseconds), and short enough that the queue stays small.
pub const REORDER_SLACK_NS: u64 = 100_000_000;

/// The scheduler records of a capture so far: built into thread states up
/// to [`REORDER_SLACK_NS`] before the newest, the rest queued.
pub struct StreamedScheduling {
    builder: SchedTimelineBuilder,
    /// The window: from the capture's start, to a known end or none yet.
    window: (u64, Option<u64>),
    /// Records later than this are not taken: the window's end, once
    /// known.
    taken_until_ns: u64,
    /// Once the builder holds this many events, later records are left
    /// out (see [`SchedTimelineBuilder::events_made`]).
    max_events: Option<usize>,
    /// Records left out for it.
    unbuilt: u64,
    queued: Vec<Record>,
    newest_ns: u64,
    /// Records that arrived after a later one had been built in: fed in
    /// anyway, out of order.
    late: u64,
    /// The time of the last record built in.
    built_until_ns: u64,
    built: usize,
}

impl StreamedScheduling {
    /// A capture of `processes` whose window starts at `start_ns` and whose
    /// threads were as `initial` says then.
    pub fn new(
        start_ns: u64,
        processes: impl IntoIterator<Item = (u32, String)>,
        initial: HashMap<u32, InitialState>,
    ) -> Self {
        Self::with_end(start_ns, None, processes, initial)
    }

    /// Leaves out the records after the builder holds more than
    /// `max_events` events:
    /// a trace cut at `max_events` ([`super::Window::apply`] of every
    /// process) ends before the last record built, so it is the same, all
    /// but the threads' whole-window counters.
    pub fn at_most(mut self, max_events: Option<usize>) -> Self {
        self.max_events = max_events;
        self
    }

    /// Like [`Self::new`], for a window whose end `stop_ns` is known:
    /// records past it are not taken.
    pub fn until(
        start_ns: u64,
        stop_ns: u64,
        processes: impl IntoIterator<Item = (u32, String)>,
        initial: HashMap<u32, InitialState>,
    ) -> Self {
        Self::with_end(start_ns, Some(stop_ns), processes, initial)
    }

    fn with_end(
        start_ns: u64,
        stop_ns: Option<u64>,
        processes: impl IntoIterator<Item = (u32, String)>,
        initial: HashMap<u32, InitialState>,
    ) -> Self {
        let end = stop_ns.unwrap_or(u64::MAX);
        StreamedScheduling {
            builder: SchedTimelineBuilder::new(start_ns, end, processes, initial),
            window: (start_ns, stop_ns),
            taken_until_ns: end,
            max_events: None,
            unbuilt: 0,
            queued: Vec::new(),
            newest_ns: 0,
            late: 0,
            built_until_ns: 0,
            built: 0,
        }
    }

    /// Ends the window at `stop_ns`, which must be no earlier than the
    /// records built so far: later records are not taken. For a capture
    /// that goes on draining after its window ended (while an agent
    /// delivers the framework's session), whose states must still stop
    /// where the window does.
    pub fn end_at(&mut self, stop_ns: u64) {
        self.taken_until_ns = stop_ns;
        self.builder.stop_at(stop_ns);
        self.queued.retain(|r| r.ts() <= stop_ns);
    }

    /// Whether [`Self::push`] takes `record` (the scheduler's records, which
    /// [`SchedTimelineBuilder`] builds; other families have their own).
    pub fn takes(record: &Record) -> bool {
        Self::takes_kind(record.header().kind)
    }

    /// [`Self::takes`] for a record of `kind` (its header's), not decoded.
    pub fn takes_kind(kind: u16) -> bool {
        matches!(
            RecordKind::from_u16(kind),
            Some(
                RecordKind::SchedSwitch
                    | RecordKind::SchedWakeup
                    | RecordKind::TaskNew
                    | RecordKind::ProcessFork
                    | RecordKind::TaskExit
                    | RecordKind::TaskRename
            )
        )
    }

    /// The window it builds: its start, and its end where known.
    pub fn window(&self) -> (u64, Option<u64>) {
        self.window
    }

    /// Queues a record [`Self::takes`]; [`Self::settle`] builds it in.
    /// Records past a known end are left out.
    pub fn push(&mut self, record: Record) {
        if record.ts() > self.taken_until_ns {
            return;
        }
        if self.is_full() {
            self.unbuilt += 1;
            return;
        }
        if record.ts() < self.built_until_ns {
            self.late += 1;
        }
        self.newest_ns = self.newest_ns.max(record.ts());
        self.queued.push(record);
    }

    /// Builds in the queued records older than the newest by more than
    /// [`REORDER_SLACK_NS`], in time order.
    pub fn settle(&mut self) {
        let ready_until = self.newest_ns.saturating_sub(REORDER_SLACK_NS);
        // Stable: records with one timestamp keep the ring buffer's order.
        self.queued.sort_by_key(Record::ts);
        let ready = self.queued.partition_point(|r| r.ts() <= ready_until);
        for (i, r) in self.queued.drain(..ready).enumerate() {
            if holds_more_than(&self.builder, self.max_events) {
                self.unbuilt += (ready - i) as u64;
                break;
            }
            self.built_until_ns = self.built_until_ns.max(r.ts());
            self.builder.push(&r);
            self.built += 1;
        }
        if self.is_full() {
            self.unbuilt += self.queued.len() as u64;
            self.queued = Vec::new();
        }
    }

    /// Whether it holds more than `max_events` events and takes no more
    /// records: the trace is cut where the event after the first
    /// `max_events` starts, which then lies no later than the records
    /// built.
    fn is_full(&self) -> bool {
        holds_more_than(&self.builder, self.max_events)
    }

    /// Records taken so far.
    pub fn len(&self) -> usize {
        self.built + self.queued.len() + self.unbuilt as usize
    }

    /// Whether no record was taken.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The builder, whose window now ends at `stop_ns`, the records still
    /// queued, in time order (the caller feeds them with the others), and
    /// how many records came later than [`REORDER_SLACK_NS`].
    pub fn finish(mut self, stop_ns: u64) -> (SchedTimelineBuilder, Vec<Record>, u64) {
        self.builder.stop_at(stop_ns);
        self.builder.count_unfed(self.unbuilt);
        self.queued.sort_by_key(Record::ts);
        (self.builder, self.queued, self.late)
    }
}

fn holds_more_than(builder: &SchedTimelineBuilder, max_events: Option<usize>) -> bool {
    max_events.is_some_and(|max| builder.events_made() > max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{clock::ClockSync, timeline::Timeline};

    fn switch(ts: u64, prev: u32, next: u32) -> Record {
        Record::sched_switch(ts, 0, (prev, 1), 1, (next, 1))
    }

    fn built(stream: StreamedScheduling, stop_ns: u64) -> Timeline {
        let (mut builder, rest, late) = stream.finish(stop_ns);
        assert_eq!(late, 0);
        for r in &rest {
            builder.push(r);
        }
        builder.finish(
            ClockSync::from_offset(0),
            &HashMap::new(),
            Default::default(),
        )
    }

    /// Records in any order within the slack make the timeline the same
    /// records in order make, and only those past the slack are built in
    /// before the end.
    #[test]
    fn records_out_of_order_within_the_slack_build_what_ordered_ones_do() {
        let ms = 1_000_000;
        let ordered: Vec<Record> = (1..=400u64)
            .map(|i| switch(i * ms, 10 + (i % 2) as u32, 10 + ((i + 1) % 2) as u32))
            .collect();
        let mut expected =
            SchedTimelineBuilder::new(0, 500 * ms, [(1, "p".into())], HashMap::new());
        for r in &ordered {
            expected.push(r);
        }
        let expected = expected.finish(
            ClockSync::from_offset(0),
            &HashMap::new(),
            Default::default(),
        );

        let mut stream = StreamedScheduling::new(0, [(1, "p".into())], HashMap::new());
        // Pairs swapped, in batches of 50, as drains deliver them.
        for batch in ordered.chunks(50) {
            for pair in batch.chunks(2) {
                for r in pair.iter().rev() {
                    assert!(StreamedScheduling::takes(r));
                    stream.push(r.clone());
                }
            }
            stream.settle();
        }
        assert_eq!(stream.len(), 400);
        // 400 ms of records, 100 ms of slack: 300 built in, 100 queued.
        assert_eq!(stream.queued.len(), 100);
        assert_eq!(built(stream, 500 * ms), expected);
    }

    /// A record older than what was already built in is counted.
    #[test]
    fn a_record_later_than_the_slack_is_counted() {
        let ms = 1_000_000;
        let mut stream = StreamedScheduling::new(0, [(1, "p".into())], HashMap::new());
        stream.push(switch(10 * ms, 10, 11));
        stream.push(switch(300 * ms, 11, 10));
        stream.settle();
        stream.push(switch(5 * ms, 10, 11));
        stream.settle();
        let (_, queued, late) = stream.finish(400 * ms);
        assert_eq!((queued.len(), late), (1, 1));
    }

    /// With `max_events`, records stop being built once the thread states
    /// hold more events than that, and are counted all the same.
    #[test]
    fn building_stops_past_max_events() {
        let ms = 1_000_000;
        let mut stream =
            StreamedScheduling::until(0, 1_000 * ms, [(1, "p".into())], HashMap::new())
                .at_most(Some(10));
        for i in 1..=500u64 {
            stream.push(switch(
                i * ms,
                10 + (i % 2) as u32,
                10 + ((i + 1) % 2) as u32,
            ));
            stream.settle();
        }
        assert!(stream.built < 20, "{} built", stream.built);
        assert_eq!(stream.len(), 500);
        assert!(stream.queued.is_empty());
        let (builder, queued, _) = stream.finish(1_000 * ms);
        assert!(queued.is_empty());
        assert!(builder.events_made() > 10);
    }

    /// A window ended while records go on arriving (an agent still
    /// delivering): no state runs past its end, however long the records
    /// keep coming, and each thread's time adds up to the window.
    #[test]
    fn records_after_an_ended_window_build_nothing_past_it() {
        let ms = 1_000_000;
        let mut stream = StreamedScheduling::new(0, [(1, "p".into())], HashMap::new());
        let feed = |stream: &mut StreamedScheduling, from: u64, to: u64| {
            for i in from..=to {
                stream.push(switch(
                    i * ms,
                    10 + (i % 2) as u32,
                    10 + ((i + 1) % 2) as u32,
                ));
            }
            stream.settle();
        };
        feed(&mut stream, 1, 500);
        stream.end_at(450 * ms);
        // Five more seconds of records, built in as drains bring them.
        for second in 0..5 {
            feed(&mut stream, 501 + second * 1_000, 1_500 + second * 1_000);
        }
        let timeline = built(stream, 450 * ms);
        for t in timeline.threads.values() {
            assert!(t.slices.iter().all(|s| s.end_ns <= 450 * ms), "{t:?}");
            let c = &t.counters;
            let total = c.on_cpu_ns + c.runnable_ns + c.blocked_ns + c.unknown_ns;
            assert_eq!(total, 450 * ms, "thread {}: {c:?}", t.tid);
        }
    }
}
