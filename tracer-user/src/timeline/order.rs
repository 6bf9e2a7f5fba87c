//! Records put in time order for the timeline's builders: the ring
//! buffer delivers them in order but for a few that come a little late
//! (each probe takes its timestamp just before it reserves its room, and
//! another CPU may reserve in between).

use std::{borrow::Cow, collections::VecDeque};

use super::streamed::StreamedScheduling;
use crate::collect::{EncodedRecords, Record, RecordPlace, StackSample};

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
        records: &'a EncodedRecords,
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
struct Entry {
    ts_ns: u64,
    /// Its place among the held records, or, with chunk [`SAMPLE`], the
    /// index of a stack sample.
    place: RecordPlace,
}

/// The chunk of an [`Entry`] that is a stack sample.
const SAMPLE: u32 = u32::MAX;

/// The records up to `stop_ns` in time order; without the scheduler's
/// when they were built while recording (`streamed`). Those are most of
/// the records: the few others are sorted apart rather than all of them.
pub(super) fn in_time_order<'b>(
    input: &'b mut RecordInput<'_>,
    stop_ns: u64,
    streamed: bool,
) -> Box<dyn Iterator<Item = Cow<'b, Record>> + 'b> {
    match input {
        RecordInput::Decoded(records) => {
            Box::new(decoded_in_time_order(records, stop_ns, streamed).map(Cow::Borrowed))
        }
        RecordInput::Held { records, samples } => {
            let (records, samples) = (&**records, &**samples);
            let order = held_in_time_order(records, samples, stop_ns, streamed);
            Box::new(order.into_iter().filter_map(move |e| match e.place.chunk {
                SAMPLE => Some(Cow::Owned(Record::StackSample(
                    samples[e.place.offset as usize].clone(),
                ))),
                _ => {
                    let record = records.at(e.place);
                    debug_assert!(record.is_some(), "no record at {:?}", e.place);
                    record.map(Cow::Owned)
                }
            }))
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

/// The places of the held records and samples up to `stop_ns`, in the
/// order [`decoded_in_time_order`] puts them decoded: the samples merged
/// by time among the records as they were held, then sorted stably.
fn held_in_time_order(
    records: &EncodedRecords,
    samples: &VecDeque<Box<StackSample>>,
    stop_ns: u64,
    streamed: bool,
) -> Vec<Entry> {
    // Streamed, the scheduler's records (most of them) are left out.
    let mut order = match streamed {
        true => Vec::new(),
        false => Vec::with_capacity(records.len() + samples.len()),
    };
    let mut held_samples = samples.iter().map(|s| &**s).enumerate().peekable();
    let sample = |(i, s): (usize, &StackSample)| Entry {
        ts_ns: s.header.ts_ns,
        place: RecordPlace {
            chunk: SAMPLE,
            offset: u32::try_from(i).expect("under 4G samples"),
        },
    };
    for (ts_ns, kind, place) in records.places() {
        while let Some(s) = held_samples.next_if(|(_, s)| s.header.ts_ns < ts_ns) {
            order.push(sample(s));
        }
        if !(streamed && StreamedScheduling::takes_kind(kind)) {
            order.push(Entry { ts_ns, place });
        }
    }
    order.extend(held_samples.map(sample));
    if streamed {
        order.retain(|e| e.ts_ns <= stop_ns);
        order.sort_by_key(|e| e.ts_ns);
    } else {
        sort_by_time(&mut order, |e| e.ts_ns);
        order.truncate(order.partition_point(|e| e.ts_ns <= stop_ns));
    }
    order
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
        })
    }

    proptest::proptest! {
        /// Records held, and samples apart, come in the order and as the
        /// same records decoded (the samples merged by time among them as
        /// they were held) do: late ones moved back, none past the end,
        /// the scheduler's left out when its states were streamed.
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
            let mut held = EncodedRecords::default();
            for r in &records {
                proptest::prop_assert!(held.push(r));
            }
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
            let want: Vec<_> = in_time_order(&mut decoded, stop_ns, streamed)
                .map(|r| key(&r))
                .collect();
            let mut input = RecordInput::Held {
                records: &held,
                samples: &samples,
            };
            let got: Vec<_> = in_time_order(&mut input, stop_ns, streamed)
                .map(|r| key(&r))
                .collect();
            proptest::prop_assert_eq!(got, want);
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
