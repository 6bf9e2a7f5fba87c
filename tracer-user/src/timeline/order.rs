//! Records put in time order for the timeline's builders: the ring
//! buffer delivers them in order but for a few that come a little late
//! (each probe takes its timestamp just before it reserves its room, and
//! another CPU may reserve in between).

use super::streamed::StreamedScheduling;
use crate::collect::Record;

/// The records up to `stop_ns` in time order; without the scheduler's
/// when they were built while recording (`streamed`). Those are most of
/// the records: the few others are sorted apart rather than all of them.
pub(super) fn in_time_order(
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
        sort_by_time(records);
        let end = records.partition_point(|r| r.ts() <= stop_ns);
        (&records[..end], Vec::new())
    };
    all.iter().chain(others)
}

/// Sorts `records` by time, stably, as the ring buffer delivers them: in
/// order but for a few records a little late. Each late record is moved
/// back to its place (a full sort would copy them all); past a budget of
/// moves, with records far out of place, a full sort does the rest.
fn sort_by_time(records: &mut [Record]) {
    let mut moved = 0;
    for i in 1..records.len() {
        let ts = records[i].ts();
        if ts >= records[i - 1].ts() {
            continue;
        }
        // After the records of the same time: a stable sort keeps them first.
        let to = records[..i].partition_point(|r| r.ts() <= ts);
        moved += i - to;
        if moved > records.len() {
            records.sort_by_key(Record::ts);
            return;
        }
        records[to..=i].rotate_right(1);
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
            sort_by_time(&mut records);
            proptest::prop_assert_eq!(order(&records), order(&expected));
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
        sort_by_time(&mut records);
        assert_eq!(order(&records), order(&expected));
    }
}
