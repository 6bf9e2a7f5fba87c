//! The records a capture holds: taken in as the ring buffer is drained,
//! and, for a flight recorder, forgotten once too old or too many.

use super::Capture;
use crate::{
    collect::{Record, StackSample},
    timeline::streamed::StreamedScheduling,
};

impl Capture {
    /// Drains the ring buffer: scheduler and driver records are held as the
    /// probes wrote them, unless thread states are built from them as they arrive;
    /// TraceMe events go to their own list.
    pub(super) fn drain(&mut self) {
        let mut batch = std::mem::take(&mut self.drained);
        if self.streamed.is_some() {
            self.collector.drain(&mut batch);
        } else {
            let activity = &mut self.activity;
            self.collector
                .drain_holding(&mut self.held, &mut batch, |call| activity.count_call(call));
        }
        self.take_in(&mut batch);
        self.drained = batch;
    }

    /// Keeps `batch`, records drained from the ring buffer, leaving it
    /// empty.
    pub(super) fn take_in(&mut self, batch: &mut Vec<Record>) {
        let mut traceme = 0;
        let mut held = self.held.holder();
        for r in batch.drain(..) {
            match r {
                Record::TraceMe(e) => {
                    self.traceme_events.push_back(*e);
                    traceme += 1;
                }
                Record::StackSample(sample) => {
                    if let Some(stacks) = self.stacks.as_mut() {
                        stacks.note_stack(sample.stack());
                    }
                    self.sample_slots += sample_slots(&sample);
                    self.stack_samples.push_back(sample);
                }
                other => {
                    if let Some(streamed) = &mut self.streamed
                        && StreamedScheduling::takes(&other)
                    {
                        // A window with a known end is one `serve` session's:
                        // the others sharing the capture need the records.
                        if streamed.window().1.is_none() {
                            streamed.push(other);
                            continue;
                        }
                        streamed.push(other.clone());
                    }
                    self.activity.count(&other);
                    held.push(&other);
                }
            }
        }
        self.traceme.count_events(traceme);
        if let Some(streamed) = &mut self.streamed {
            streamed.settle();
        }
    }

    /// Forgets the records older than `cutoff_ns`, and past that the
    /// oldest ones beyond the memory of `max_records` records (a stack
    /// sample takes several): what a flight recorder keeps. Scheduler
    /// records go a chunk at a time, once all of a chunk is too old.
    /// Returns how many records and TraceMe events it forgot.
    pub fn forget_before(&mut self, cutoff_ns: u64, max_records: usize) -> u64 {
        let mut n = 0;
        loop {
            let over = self.held_slots() > max_records;
            let chunk = self.held.oldest(cutoff_ns);
            let sample = self.stack_samples.front().map(|s| s.header.ts_ns);
            // Over the cap the oldest goes, whichever it is; under it, what
            // is too old. Records arrive nearly in time order: stop at the
            // first recent one.
            let forget_chunk = match (chunk, sample) {
                (Some((oldest, too_old)), Some(ts)) if over => oldest <= ts || too_old,
                (Some((_, too_old)), _) => over || too_old,
                (None, _) => false,
            };
            if forget_chunk {
                let end = self.held.oldest_chunk_end().unwrap_or(0);
                self.forgotten_through_ns = self.forgotten_through_ns.max(end);
                n += self.held.forget_oldest();
            } else if let Some(ts) = sample
                && (over || ts < cutoff_ns)
            {
                if let Some(s) = self.stack_samples.pop_front() {
                    self.sample_slots -= sample_slots(&s);
                }
                self.forgotten_through_ns = self.forgotten_through_ns.max(ts);
                n += 1;
            } else {
                break;
            }
        }
        let old_traceme = self
            .traceme_events
            .iter()
            .position(|e| e.header.ts_ns >= cutoff_ns)
            .unwrap_or(self.traceme_events.len());
        self.traceme_events.drain(..old_traceme);
        let forgotten = (n + old_traceme) as u64;
        self.forgot |= forgotten > 0;
        forgotten
    }

    /// From when on it holds every record the probes wrote: just past the
    /// newest one [`Self::forget_before`] forgot (0 if none). A flight
    /// recorder whose `--retain-memory` filled up holds less than its
    /// `--retain`; a window before this time would show gaps as idle.
    pub fn complete_since_ns(&self) -> u64 {
        match self.forgotten_through_ns {
            0 => 0,
            t => t + 1,
        }
    }

    /// Forgets what it holds of process `pid`, which exited and whose pid a
    /// new process now has: the old one's records would be read as the new
    /// one's. A scheduler record that also tells of another process keeps
    /// that side (the old process reads as an untraced one there). Returns
    /// how many records and TraceMe events it forgot.
    pub fn forget_process(&mut self, pid: u32) -> u64 {
        let (samples, traceme) = (self.stack_samples.len(), self.traceme_events.len());
        let held = self.held.retain_mut(|r| without_process(r, pid));
        self.stack_samples.retain(|s| s.tgid != pid);
        self.traceme_events.retain(|e| e.tgid != pid);
        self.sample_slots = self.stack_samples.iter().map(|s| sample_slots(s)).sum();
        let forgotten = (held + samples - self.stack_samples.len() + traceme
            - self.traceme_events.len()) as u64;
        self.forgot |= forgotten > 0;
        forgotten
    }

    /// The room what it holds takes, in scheduler records: a driver record
    /// or a stack sample takes several.
    fn held_slots(&self) -> usize {
        self.held.len() + self.held.driver_records() * (DRIVER_RECORD_SLOTS - 1) + self.sample_slots
    }

    /// The memory the records it holds take, about: the scheduler and
    /// driver records' chunks, the stack samples with their frames.
    pub fn held_bytes(&self) -> usize {
        self.held.bytes() + self.sample_slots * size_of::<Record>()
    }

    /// Records held now (TraceMe events included).
    pub fn held(&self) -> usize {
        self.held.len() + self.stack_samples.len() + self.traceme_events.len()
    }
}

/// Whether `r` still tells something once process `pid` is taken out of
/// it: what it says of `pid` is cleared, what it says of others stays.
fn without_process(r: &mut Record, pid: u32) -> bool {
    match r {
        Record::Switch(s) => {
            if s.prev_tgid == pid {
                s.prev_tgid = 0;
            }
            if s.next_tgid == pid {
                s.next_tgid = 0;
            }
            s.prev_tgid != 0 || s.next_tgid != 0
        }
        Record::Wakeup(w) => {
            if w.waker_tgid == pid {
                w.waker_tgid = 0;
            }
            w.tgid != pid
        }
        Record::TaskNew(t) => t.parent_tgid != pid,
        Record::Fork(f) => f.parent_tgid != pid,
        Record::Exit(e) => e.tgid != pid,
        Record::Rename(n) => n.tgid != pid,
        Record::CudaCall(c) => c.tgid != pid,
        Record::CudaSymbol(c) => c.tgid != pid,
        Record::TraceMe(e) => e.tgid != pid,
        Record::StackSample(s) => s.tgid != pid,
    }
}

/// The memory a CUDA driver record takes, held and in a snapshot, in
/// scheduler records (which the flight recorder's cap counts, 192 bytes
/// each): it is held in 96 to 160 bytes (120 for a launch) rather than
/// 32, and becomes two spans with a dozen stats (the call on its thread,
/// the work on its stream's line; all their stats shared by the launches
/// of one kernel and configuration on one stream, and encoded once per
/// plane).
/// Measured on a flat-out launch loop
/// (`a_snapshot_of_driver_calls_is_built_within_the_retained_memory`):
/// about 0.46 KB a call at a snapshot's peak beyond what the server held,
/// the calls made while it is built included; counted as 0.96 KB.
pub(super) const DRIVER_RECORD_SLOTS: usize = 5;

/// The memory a stack sample takes, in records: its own and its frames'.
pub(super) fn sample_slots(s: &StackSample) -> usize {
    let frames = (s.user.len() + s.kernel.len()) * size_of::<u64>();
    1 + (size_of::<StackSample>() + frames).div_ceil(size_of::<Record>())
}

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind};

    use super::*;

    /// Taking an exited process out of the records keeps what they say of
    /// the others.
    #[test]
    fn a_process_taken_out_leaves_the_others_sides() {
        let (old, other) = (1000, 2000);
        let mut records = vec![
            Record::sched_switch(1, 0, (old, old), 1, (other, other)),
            Record::sched_switch(2, 0, (other, other), 1, (3000, 3000)),
            Record::sched_waking(3, (old + 1, old), (other, other)),
            Record::sched_waking(4, (other, other), (old, old)),
            Record::sched_switch(5, 0, (old, old), 1, (old + 1, old)),
        ];
        records.retain_mut(|r| without_process(r, old));
        assert_eq!(records.len(), 3);
        let Record::Switch(s) = &records[0] else {
            panic!("{:?}", records[0])
        };
        assert_eq!((s.prev_tgid, s.next_tgid, s.next_tid), (0, other, other));
        assert!(matches!(&records[1], Record::Switch(s) if s.prev_tgid == other));
        let Record::Wakeup(w) = &records[2] else {
            panic!("{:?}", records[2])
        };
        assert_eq!((w.tgid, w.waker_tgid), (other, 0));
    }

    /// The flight recorder's memory cap counts a stack sample's frames.
    #[test]
    fn a_stack_sample_takes_the_room_of_its_frames() {
        let sample = |frames: usize| StackSample {
            header: RecordHeader::new(RecordKind::StackSample, 0, 0, 0),
            tid: 1,
            tgid: 1,
            user: vec![0; frames].into(),
            kernel: vec![0; frames].into(),
            user_unreadable: false,
            kernel_unreadable: false,
            off_cpu_us: 0,
            syscall: 0,
            python: Default::default(),
            launch: false,
        };
        let (few, many) = (sample_slots(&sample(1)), sample_slots(&sample(127)));
        assert!(few >= 2, "{few}");
        // 254 frames of 8 bytes, in records of at most 48 bytes.
        assert!(many > 254 * 8 / size_of::<Record>(), "{many}");
    }
}
