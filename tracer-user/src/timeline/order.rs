//! Records put in time order for the timeline's builders: the ring
//! buffer delivers them in order but for a few that come a little late
//! (each probe takes its timestamp just before it reserves its room, and
//! another CPU may reserve in between).

use std::{borrow::Cow, collections::VecDeque};

use super::streamed::StreamedScheduling;
use crate::collect::{EncodedRecords, Record, RecordPlace, StackSample, is_driver_record};

/// The records a timeline is built from, but TraceMe events.
pub enum RecordInput<'a> {
    /// Decoded already, in the order the ring buffer delivered them.
    Decoded(Vec<Record>),
    /// As a capture holds them: the scheduler and driver records encoded,
    /// in ring-buffer order, the stack samples apart, in time order. They
    /// are put in time order by their times and places, then decoded one
    /// at a time as the builders take them: a flight recorder's snapshot
    /// never has them all decoded at once (a driver call decoded takes
    /// more than its held bytes).
    Held {
        /// The scheduler and driver records, in ring-buffer order.
        records: &'a EncodedRecords,
        /// The stack samples, in time order.
        samples: &'a VecDeque<Box<StackSample>>,
    },
}

impl Default for RecordInput<'_> {
    fn default() -> Self {
        RecordInput::Decoded(Vec::new())
    }
}

/// A record of [`RecordInput::Held`] in time order: where it is, 16 bytes.
#[derive(Clone, Copy)]
pub(super) struct Entry {
    ts_ns: u64,
    place: RecordPlace,
}

/// The stack samples of a [`RecordInput`], which go to no builder: lent by
/// a capture, or taken out of decoded records.
pub(super) enum Samples<'a> {
    Lent(Vec<&'a StackSample>),
    Taken(Vec<StackSample>),
}

impl Samples<'_> {
    pub(super) fn as_refs(&self) -> Vec<&StackSample> {
        match self {
            Samples::Lent(samples) => samples.clone(),
            Samples::Taken(samples) => samples.iter().collect(),
        }
    }
}

/// The stack samples of `input` up to `stop_ns`, in time order (stably),
/// out of its records: [`in_time_order_by_builder`] then gives the
/// others. A capture's are lent, not copied.
pub(super) fn take_samples<'a>(input: &mut RecordInput<'a>, stop_ns: u64) -> Samples<'a> {
    let up_to = |ts_ns: u64| ts_ns <= stop_ns;
    match input {
        RecordInput::Held { samples, .. } => {
            let samples: &'a VecDeque<Box<StackSample>> = samples;
            let mut lent: Vec<&'a StackSample> = samples
                .iter()
                .map(|s| &**s)
                .filter(|s| up_to(s.header.ts_ns))
                .collect();
            lent.sort_by_key(|s| s.header.ts_ns);
            Samples::Lent(lent)
        }
        RecordInput::Decoded(records) => {
            let (samples, others): (Vec<Record>, Vec<Record>) = std::mem::take(records)
                .into_iter()
                .partition(|r| matches!(r, Record::StackSample(_)));
            *records = others;
            let mut taken: Vec<StackSample> = samples
                .into_iter()
                .filter_map(|r| match r {
                    Record::StackSample(s) if up_to(s.header.ts_ns) => Some(*s),
                    _ => None,
                })
                .collect();
            taken.sort_by_key(|s| s.header.ts_ns);
            Samples::Taken(taken)
        }
    }
}

/// The records of one builder, in time order: borrowed, or the places of
/// held ones, each decoded as it is taken.
pub(super) enum Ordered<'b> {
    Decoded(std::vec::IntoIter<&'b Record>),
    Held {
        records: &'b EncodedRecords,
        order: std::vec::IntoIter<Entry>,
    },
}

impl Ordered<'_> {
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Ordered::Decoded(records) => records.len() == 0,
            Ordered::Held { order, .. } => order.len() == 0,
        }
    }
}

impl<'b> Iterator for Ordered<'b> {
    type Item = Cow<'b, Record>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Ordered::Decoded(records) => records.next().map(Cow::Borrowed),
            Ordered::Held { records, order } => order.find_map(|e| {
                let record = records.at(e.place);
                debug_assert!(record.is_some(), "no record at {:?}", e.place);
                record.map(Cow::Owned)
            }),
        }
    }
}

/// The records up to `stop_ns` in time order, in two: the CUDA driver's,
/// and the others; without the scheduler's when they were built while
/// recording (`streamed`). No builder reads the other's records, so each
/// half can be built on a thread of its own.
pub(super) fn in_time_order_by_builder<'b>(
    input: &'b mut RecordInput<'_>,
    stop_ns: u64,
    streamed: bool,
) -> (Ordered<'b>, Ordered<'b>) {
    match input {
        RecordInput::Decoded(records) => {
            let (driver, others): (Vec<&Record>, Vec<&Record>) =
                decoded_in_time_order(records, stop_ns, streamed)
                    .partition(|r| is_driver_record(r.header().kind));
            (
                Ordered::Decoded(driver.into_iter()),
                Ordered::Decoded(others.into_iter()),
            )
        }
        RecordInput::Held { records, .. } => {
            let records = &**records;
            let (driver, others) = held_in_time_order(records, stop_ns, streamed);
            let ordered = |order: Vec<Entry>| Ordered::Held {
                records,
                order: order.into_iter(),
            };
            (ordered(driver), ordered(others))
        }
    }
}

fn decoded_in_time_order(
    records: &mut [Record],
    stop_ns: u64,
    streamed: bool,
) -> impl Iterator<Item = &Record> {
    let (all, others) = if streamed {
        let mut others: Vec<&Record> = records
            .iter()
            .filter(|r| r.ts() <= stop_ns && !StreamedScheduling::takes(r))
            .collect();
        others.sort_by_key(|r| r.ts());
        (&[][..], others)
    } else {
        sort_by_time(records, Record::ts);
        let end = records.partition_point(|r| r.ts() <= stop_ns);
        (&records[..end], Vec::new())
    };
    all.iter().chain(others)
}

/// The places of the held records up to `stop_ns`, the CUDA driver's and
/// the others, each in the order [`decoded_in_time_order`] puts them
/// decoded.
fn held_in_time_order(
    records: &EncodedRecords,
    stop_ns: u64,
    streamed: bool,
) -> (Vec<Entry>, Vec<Entry>) {
    let mut driver = Vec::with_capacity(records.driver_records());
    // With `streamed`, the scheduler's records, most of them, are left out.
    let mut others = Vec::with_capacity(match streamed {
        true => 0,
        false => records.len() - records.driver_records(),
    });
    for (ts_ns, kind, place) in records.places() {
        let entry = Entry { ts_ns, place };
        if is_driver_record(kind) {
            driver.push(entry);
        } else if !(streamed && StreamedScheduling::takes_kind(kind)) {
            others.push(entry);
        }
    }
    for order in [&mut driver, &mut others] {
        sort_by_time(order, |e| e.ts_ns);
        order.truncate(order.partition_point(|e| e.ts_ns <= stop_ns));
    }
    (driver, others)
}

/// Sorts `items` by time (`ts`), stably, as the ring buffer delivers
/// records: in order but for a few a little late. Each late one is moved
/// back to its place (a full sort would copy them all); past a budget of
/// moves, with records far out of place, a full sort does the rest.
fn sort_by_time<T>(items: &mut [T], ts: impl Fn(&T) -> u64) {
    let mut moved = 0;
    for i in 1..items.len() {
        let t = ts(&items[i]);
        if t >= ts(&items[i - 1]) {
            continue;
        }
        // After the items of the same time: a stable sort keeps them first.
        let to = items[..i].partition_point(|r| ts(r) <= t);
        moved += i - to;
        if moved > items.len() {
            items.sort_by_key(ts);
            return;
        }
        items[to..=i].rotate_right(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PID: u32 = 7;

    /// (time, which record) of each record, in order.
    fn order(records: &[Record]) -> Vec<(u64, u32)> {
        records
            .iter()
            .map(|r| match r {
                Record::Switch(s) => (r.ts(), s.prev_tid),
                _ => unreachable!("only switches here"),
            })
            .collect()
    }

    proptest::proptest! {
        /// Late records moved back, or far ones left to a full sort, give
        /// what a stable sort gives.
        #[test]
        fn records_sort_by_time_as_a_stable_sort_does(
            times in proptest::collection::vec(0u64..40, 0..200),
            late in proptest::collection::vec((0usize..200, 0u64..5), 0..6),
        ) {
            // Mostly in order (as the ring buffer delivers), a few late.
            let mut times = times;
            times.sort_unstable();
            for (i, by) in late {
                if let Some(t) = times.get_mut(i) {
                    *t = t.saturating_sub(by);
                }
            }
            let mut records: Vec<Record> = times
                .iter()
                .enumerate()
                .map(|(i, &ts)| Record::sched_switch(ts, 0, (i as u32, PID), 0, (0, 0)))
                .collect();
            let mut expected = records.clone();
            expected.sort_by_key(Record::ts);
            sort_by_time(&mut records, Record::ts);
            proptest::prop_assert_eq!(order(&records), order(&expected));
        }
    }

    /// Time, kind and the thread it tells of: what tells records apart here.
    fn key(r: &Record) -> (u64, u16, u32) {
        let tid = match r {
            Record::Switch(s) => s.prev_tid,
            Record::CudaCall(c) => c.tid,
            Record::StackSample(s) => s.tid,
            other => unreachable!("{other:?}"),
        };
        (r.ts(), r.header().kind, tid)
    }

    /// The keys of the records [`in_time_order_by_builder`] gives: the
    /// driver's, then the others.
    fn by_builder(
        input: &mut RecordInput<'_>,
        stop_ns: u64,
        streamed: bool,
    ) -> Vec<(u64, u16, u32)> {
        let (driver, others) = in_time_order_by_builder(input, stop_ns, streamed);
        driver.chain(others).map(|r| key(&r)).collect()
    }

    fn call(ts: u64, tid: u32) -> Record {
        Record::driver_call(0, (ts.saturating_sub(1), ts), (tid, PID), [0; 6])
    }

    fn sample(ts: u64, tid: u32) -> Box<StackSample> {
        use tracer_common::{RecordHeader, RecordKind};
        Box::new(StackSample {
            header: RecordHeader::new(RecordKind::StackSample, 0, 0, ts),
            tid,
            tgid: PID,
            user: Box::new([1, 2]),
            kernel: Box::new([]),
            user_unreadable: false,
            kernel_unreadable: false,
            off_cpu_us: 0,
            syscall: 0,
            python: Default::default(),
            launch: false,
        })
    }

    proptest::proptest! {
        /// Held records come in time order (stably), the driver's apart
        /// from the others, up to the window's end, without the
        /// scheduler's when their states were streamed;
        /// the samples apart, in time order up to the end. The same
        /// records decoded, with the samples among them, come the same.
        #[test]
        fn held_records_come_as_the_same_records_decoded_do(
            times in proptest::collection::vec((0u64..40, proptest::bool::ANY), 0..200),
            late in proptest::collection::vec((0usize..200, 0u64..5), 0..6),
            sample_times in proptest::collection::vec(0u64..40, 0..12),
            stop_ns in 0u64..45,
            streamed in proptest::bool::ANY,
        ) {
            let mut times = times;
            times.sort_unstable();
            for (i, by) in late {
                if let Some((t, _)) = times.get_mut(i) {
                    *t = t.saturating_sub(by);
                }
            }
            let records: Vec<Record> = times
                .iter()
                .enumerate()
                .map(|(i, &(ts, is_call))| match is_call {
                    true => call(ts, i as u32),
                    false => Record::sched_switch(ts, 0, (i as u32, PID), 0, (0, 0)),
                })
                .collect();
            let mut sample_times = sample_times;
            sample_times.sort_unstable();
            let samples: VecDeque<Box<StackSample>> = sample_times
                .iter()
                .enumerate()
                .map(|(i, &ts)| sample(ts, 1_000 + i as u32))
                .collect();
            let mut want: Vec<&Record> = records
                .iter()
                .filter(|r| r.ts() <= stop_ns)
                .filter(|r| !(streamed && StreamedScheduling::takes(r)))
                .collect();
            want.sort_by_key(|r| r.ts());
            // The driver's records first, then the others, each in order.
            let (want_driver, want_others): (Vec<&Record>, Vec<&Record>) =
                want.into_iter().partition(|r| matches!(r, Record::CudaCall(_)));
            let want: Vec<_> = want_driver.into_iter().chain(want_others).map(key).collect();
            let want_samples: Vec<(u64, u32)> = samples
                .iter()
                .filter(|s| s.header.ts_ns <= stop_ns)
                .map(|s| (s.header.ts_ns, s.tid))
                .collect();
            let sample_keys = |taken: Samples<'_>| -> Vec<(u64, u32)> {
                taken.as_refs().iter().map(|s| (s.header.ts_ns, s.tid)).collect()
            };

            let mut held = EncodedRecords::default();
            for r in &records {
                proptest::prop_assert!(held.push(r));
            }
            let mut input = RecordInput::Held {
                records: &held,
                samples: &samples,
            };
            proptest::prop_assert_eq!(sample_keys(take_samples(&mut input, stop_ns)), want_samples.clone());
            proptest::prop_assert_eq!(by_builder(&mut input, stop_ns, streamed), want.clone());

            // Decoded, the samples among the records by time.
            let mut decoded = Vec::new();
            let mut apart = samples.iter().peekable();
            for r in &records {
                while let Some(s) = apart.next_if(|s| s.header.ts_ns < r.ts()) {
                    decoded.push(Record::StackSample(s.clone()));
                }
                decoded.push(r.clone());
            }
            decoded.extend(apart.map(|s| Record::StackSample(s.clone())));
            let mut decoded = RecordInput::Decoded(decoded);
            proptest::prop_assert_eq!(sample_keys(take_samples(&mut decoded, stop_ns)), want_samples);
            proptest::prop_assert_eq!(by_builder(&mut decoded, stop_ns, streamed), want);
        }
    }

    #[test]
    fn records_far_out_of_order_are_sorted_whole() {
        let mut records: Vec<Record> = (0..100u32)
            .rev()
            .map(|i| Record::sched_switch(u64::from(i / 2), 0, (i, PID), 0, (0, 0)))
            .collect();
        let mut expected = records.clone();
        expected.sort_by_key(Record::ts);
        sort_by_time(&mut records, Record::ts);
        assert_eq!(order(&records), order(&expected));
    }
}
