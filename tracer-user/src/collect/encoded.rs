//! Records held as the probes wrote them, decoded only when a timeline is
//! built from them: a flight recorder keeps hundreds of thousands a second
//! of a scheduling-heavy target, and keeping a record costs a copy of its
//! bytes instead of a decode and a move into a deque of decoded records.

use std::collections::VecDeque;

use tracer_common::RecordKind;

use super::decode::{Record, decode, encode};

/// Bytes of records in one chunk: records are forgotten a chunk at a time,
/// oldest first. Small enough that a `--retain-memory` of 1 MiB (about
/// 3,600 records) holds nine, large enough that a flood of 500k records a
/// second fills only about 1,200 a second.
const CHUNK_BYTES: usize = 16 * 1024;

/// Forgotten chunks' buffers kept for new chunks, at most: a drain of a
/// flood fills and forgets a few hundred chunks at a time, and taking
/// each from the allocator and giving it back was a sixth of the
/// recorder's samples in `perf`. Buffers only come from forgotten
/// chunks, so the held and the kept buffers together never take more
/// than the held ones once did.
const SPARE_CHUNKS: usize = 256;

/// The size of a switch and of a wake-up record.
const COMMON_RECORD_BYTES: usize = size_of::<tracer_common::SchedSwitch>();
const _: () = assert!(size_of::<tracer_common::SchedWakeup>() == COMMON_RECORD_BYTES);

/// Whether a record of `kind` (its header's) is a CUDA driver record: a
/// call or a kernel's name.
pub fn is_driver_record(kind: u16) -> bool {
    kind == RecordKind::CudaCall as u16 || kind == RecordKind::CudaSymbol as u16
}

/// Records one after the other, each starting with its header (whose
/// `size` leads to the next), in chunks kept in the order they filled.
#[derive(Debug, Default)]
pub struct EncodedRecords {
    chunks: VecDeque<Chunk>,
    len: usize,
    /// How many of them are CUDA driver records, which take far more of a
    /// timeline than a scheduler record.
    driver_records: usize,
    /// Forgotten chunks' buffers, for the next chunks (at most
    /// [`SPARE_CHUNKS`]).
    spares: Vec<Vec<u8>>,
    /// Where [`Self::push`] encodes a record.
    scratch: Vec<u8>,
}

/// Where a held record is: its chunk and its offset there (see
/// [`EncodedRecords::places`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordPlace {
    /// Its chunk's index, the oldest held chunk being 0.
    pub chunk: u32,
    /// Its byte offset in that chunk.
    pub offset: u32,
}

#[derive(Debug)]
struct Chunk {
    bytes: Vec<u8>,
    records: usize,
    driver_records: usize,
    /// The oldest and the newest timestamp in it: records arrive nearly,
    /// not exactly, in time order.
    oldest_ns: u64,
    newest_ns: u64,
}

impl EncodedRecords {
    /// Records held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CUDA driver records held (calls and kernel names), of [`Self::len`].
    pub fn driver_records(&self) -> usize {
        self.driver_records
    }

    /// The memory its chunks take (not the spare buffers kept for the
    /// next ones).
    pub fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.bytes.capacity()).sum()
    }

    /// Keeps `bytes`, one whole record (see
    /// [`super::decode::held_record_len`]).
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        self.holder().push_bytes(bytes);
    }

    /// Keeps the records given to it, after these, until it is dropped.
    pub fn holder(&mut self) -> Holder<'_> {
        let chunk = self.chunks.pop_back().unwrap_or_else(Chunk::empty);
        let scratch = std::mem::take(&mut self.scratch);
        Holder {
            held: self,
            chunk,
            records: 0,
            driver_records: 0,
            scratch,
        }
    }

    /// Keeps `record`, encoded; false (and nothing kept) for a record of
    /// variable size, which [`encode`] does not write.
    pub fn push(&mut self, record: &Record) -> bool {
        self.holder().push(record)
    }

    /// The oldest timestamp in the oldest chunk, and whether every record
    /// of that chunk is older than `cutoff_ns`.
    pub fn oldest(&self, cutoff_ns: u64) -> Option<(u64, bool)> {
        let c = self.chunks.front()?;
        Some((c.oldest_ns, c.newest_ns < cutoff_ns))
    }

    /// The newest timestamp in the oldest chunk: forgetting it forgets
    /// every record it held, none newer than that.
    pub fn oldest_chunk_end(&self) -> Option<u64> {
        self.chunks.front().map(|c| c.newest_ns)
    }

    /// Forgets the oldest chunk; returns how many records it held.
    pub fn forget_oldest(&mut self) -> usize {
        let Some(chunk) = self.chunks.pop_front() else {
            return 0;
        };
        self.len -= chunk.records;
        self.driver_records -= chunk.driver_records;
        if self.spares.len() < SPARE_CHUNKS {
            self.spares.push(chunk.bytes);
        }
        chunk.records
    }

    /// Keeps the records of `newer` after its own, as they are.
    pub fn append(&mut self, mut newer: EncodedRecords) {
        self.len += newer.len;
        self.driver_records += newer.driver_records;
        self.chunks.append(&mut newer.chunks);
    }

    /// Forgets every record.
    pub fn clear(&mut self) {
        *self = EncodedRecords::default();
    }

    /// The records, decoded, oldest chunk first.
    pub fn iter(&self) -> impl Iterator<Item = Record> + '_ {
        self.chunks
            .iter()
            .flat_map(|c| records_in(&c.bytes, |_| true))
    }

    /// Each record's time, kind and place, oldest chunk first, without
    /// decoding it: for putting the records in time order and decoding
    /// them one at a time ([`Self::at`]), so that a timeline built from
    /// hundreds of thousands never has them all decoded at once.
    pub fn places(&self) -> impl Iterator<Item = (u64, u16, RecordPlace)> + '_ {
        self.chunks.iter().enumerate().flat_map(|(i, c)| {
            let chunk = u32::try_from(i).expect("under 4G chunks");
            headers_in(&c.bytes)
                .map(move |(offset, kind, ts_ns)| (ts_ns, kind, RecordPlace { chunk, offset }))
        })
    }

    /// The record at `place`, from [`Self::places`] of these records
    /// unchanged since, decoded.
    pub fn at(&self, place: RecordPlace) -> Option<Record> {
        record_at(&self.chunks.get(place.chunk as usize)?.bytes, place.offset)
    }

    /// The CUDA driver records (calls and kernel names), decoded: the
    /// others are only stepped over, and chunks without any are skipped (a
    /// snapshot of a process without the driver walks none).
    pub fn driver_records_iter(&self) -> impl Iterator<Item = Record> + '_ {
        self.chunks
            .iter()
            .filter(|c| c.driver_records > 0)
            .flat_map(|c| records_in(&c.bytes, is_driver_record))
    }

    /// Keeps the records `keep` returns true for, as `keep` left them;
    /// returns how many it forgot.
    pub fn retain_mut(&mut self, mut keep: impl FnMut(&mut Record) -> bool) -> usize {
        let before = self.len;
        let mut kept = EncodedRecords::default();
        let mut holder = kept.holder();
        for mut r in self.iter() {
            if keep(&mut r) {
                holder.push(&r);
            }
        }
        drop(holder);
        *self = kept;
        before - self.len
    }
}

/// Keeps records after those of an [`EncodedRecords`], as
/// [`EncodedRecords::push_bytes`] does, with the chunk they go in held
/// apart until it is full or the holder is dropped: the drain of a flood
/// keeps hundreds of thousands of records, and reaching that chunk through
/// the deque for each, and counting each in three places, took more time
/// than copying it.
pub struct Holder<'a> {
    held: &'a mut EncodedRecords,
    /// The newest chunk, out of `held` while records go in.
    chunk: Chunk,
    /// Records kept through this holder, and how many of them are driver
    /// records: added to `held`'s counts when it is dropped.
    records: usize,
    driver_records: usize,
    /// Where [`Self::push`] encodes a record.
    scratch: Vec<u8>,
}

impl Holder<'_> {
    /// Keeps `record`, encoded; false (and nothing kept) for a record of
    /// variable size, which [`encode`] does not write.
    pub fn push(&mut self, record: &Record) -> bool {
        let mut bytes = std::mem::take(&mut self.scratch);
        bytes.clear();
        let encoded = encode(record, &mut bytes);
        if encoded {
            self.push_bytes(&bytes);
        }
        self.scratch = bytes;
        encoded
    }

    /// Keeps `bytes`, one whole record (see
    /// [`super::decode::held_record_len`]). Always inlined: in the loop
    /// that drains the ring, the chunk's length and counts then stay in
    /// registers (a tenth of the recorder's CPU on a flood).
    #[inline(always)]
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        let ts_ns = u64::from_ne_bytes(bytes[8..16].try_into().expect("a record has a header"));
        if self.chunk.bytes.len() + bytes.len() > self.chunk.bytes.capacity() {
            self.next_chunk(bytes.len());
        }
        let chunk = &mut self.chunk;
        // Most records of a flood are switches and wake-ups of one size:
        // copied as such, not through a call to `memmove`.
        let filled = chunk.bytes.len();
        let mut driver = false;
        match chunk
            .bytes
            .spare_capacity_mut()
            .get_mut(..COMMON_RECORD_BYTES)
        {
            Some(room) if bytes.len() == COMMON_RECORD_BYTES => {
                room.write_copy_of_slice(bytes);
                // SAFETY: the bytes up to there were just written.
                unsafe { chunk.bytes.set_len(filled + COMMON_RECORD_BYTES) };
            }
            _ => {
                chunk.bytes.extend_from_slice(bytes);
                driver = is_driver_record(u16::from_ne_bytes([bytes[0], bytes[1]]));
            }
        }
        chunk.note(ts_ns);
        chunk.driver_records += usize::from(driver);
        self.driver_records += usize::from(driver);
        self.records += 1;
    }

    /// Puts the newest chunk, full, after the others, and starts one with
    /// room for `len` bytes in a forgotten chunk's buffer.
    #[cold]
    fn next_chunk(&mut self, len: usize) {
        let mut bytes = self.held.spares.pop().unwrap_or_default();
        bytes.clear();
        bytes.reserve_exact(CHUNK_BYTES.max(len));
        let full = std::mem::replace(&mut self.chunk, Chunk::new(bytes));
        self.held.keep_chunk(full);
    }
}

impl Drop for Holder<'_> {
    fn drop(&mut self) {
        let newest = std::mem::replace(&mut self.chunk, Chunk::empty());
        self.held.keep_chunk(newest);
        self.held.len += self.records;
        self.held.driver_records += self.driver_records;
        self.held.scratch = std::mem::take(&mut self.scratch);
    }
}

impl EncodedRecords {
    /// Puts `chunk` after the others; an empty one's buffer is kept for
    /// the next.
    fn keep_chunk(&mut self, chunk: Chunk) {
        if chunk.records > 0 {
            self.chunks.push_back(chunk);
        } else if chunk.bytes.capacity() > 0 && self.spares.len() < SPARE_CHUNKS {
            self.spares.push(chunk.bytes);
        }
    }
}

impl Chunk {
    fn new(bytes: Vec<u8>) -> Self {
        Chunk {
            bytes,
            records: 0,
            driver_records: 0,
            oldest_ns: u64::MAX,
            newest_ns: 0,
        }
    }

    /// A chunk with no room: the first record starts a real one.
    fn empty() -> Self {
        Chunk::new(Vec::new())
    }

    #[inline]
    fn note(&mut self, ts_ns: u64) {
        self.records += 1;
        self.oldest_ns = self.oldest_ns.min(ts_ns);
        self.newest_ns = self.newest_ns.max(ts_ns);
    }
}

/// The records of one chunk's bytes (whole records when kept) whose kind
/// `wanted` accepts.
fn records_in<'a>(
    bytes: &'a [u8],
    wanted: impl Fn(u16) -> bool + 'a,
) -> impl Iterator<Item = Record> + 'a {
    headers_in(bytes)
        .filter(move |&(_, kind, _)| wanted(kind))
        .filter_map(|(offset, _, _)| record_at(bytes, offset))
}

/// The record at `offset` of one chunk's bytes, decoded.
fn record_at(bytes: &[u8], offset: u32) -> Option<Record> {
    let record = bytes.get(offset as usize..)?;
    let size = usize::from(u16::from_ne_bytes(record.get(2..4)?.try_into().ok()?));
    let decoded = decode(record.get(..size)?);
    debug_assert!(decoded.is_ok(), "{decoded:?}");
    decoded.ok()
}

/// The offset, kind and time of each record in one chunk's bytes.
fn headers_in(bytes: &[u8]) -> impl Iterator<Item = (u32, u16, u64)> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let record = bytes.get(at..)?;
        let kind = u16::from_ne_bytes(record.get(0..2)?.try_into().ok()?);
        let size = usize::from(u16::from_ne_bytes(record.get(2..4)?.try_into().ok()?));
        let ts_ns = u64::from_ne_bytes(record.get(8..16)?.try_into().ok()?);
        let offset = u32::try_from(at).ok()?;
        at += size.max(1);
        Some((offset, kind, ts_ns))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::decode::held_record_len;

    fn switch(ts: u64, prev: u32, next: u32) -> Record {
        Record::sched_switch(ts, 1, (prev, prev), 1, (next, next))
    }

    fn timestamps(held: &EncodedRecords) -> Vec<u64> {
        held.iter().map(|r| r.ts()).collect()
    }

    /// What it gives back is what it was given, whether as records or as
    /// the bytes the probes write, across chunks.
    #[test]
    fn records_come_back_as_they_were_kept() {
        let mut held = EncodedRecords::default();
        let n = 3 * CHUNK_BYTES / COMMON_RECORD_BYTES;
        let mut bytes = Vec::new();
        for ts in 0..n as u64 {
            if ts % 2 == 0 {
                assert!(held.push(&switch(ts, 10, 11)));
            } else {
                bytes.clear();
                encode(&Record::sched_waking(ts, (12, 12), (13, 13)), &mut bytes);
                assert_eq!(held_record_len(&bytes), Some(bytes.len()));
                held.push_bytes(&bytes);
            }
        }
        assert_eq!(held.len(), n);
        assert!(held.chunks.len() >= 3, "{} chunks", held.chunks.len());
        assert_eq!(timestamps(&held), (0..n as u64).collect::<Vec<_>>());
        let Some(Record::Wakeup(w)) = held.iter().nth(1) else {
            panic!("not a wake-up")
        };
        assert_eq!((w.tid, w.waker_tgid), (12, 13));
    }

    /// Chunks are forgotten whole, and counted exactly; a chunk with one
    /// record newer than the cutoff stays.
    #[test]
    fn the_oldest_chunk_goes_first_and_its_records_are_counted() {
        let mut held = EncodedRecords::default();
        let n = 2 * CHUNK_BYTES / COMMON_RECORD_BYTES;
        for ts in 0..n as u64 {
            held.push(&switch(1_000 + ts, 1, 2));
        }
        let first = held.chunks[0].records;
        let (oldest, all_older) = held.oldest(1_000 + first as u64).unwrap();
        assert_eq!((oldest, all_older), (1_000, true));
        assert!(!held.oldest(1_000 + first as u64 - 1).unwrap().1);
        let bytes = held.bytes();
        assert!(
            bytes >= n * COMMON_RECORD_BYTES && bytes <= n * COMMON_RECORD_BYTES + 2 * CHUNK_BYTES,
            "{bytes} bytes for {n} records"
        );
        assert_eq!(held.forget_oldest(), first);
        assert_eq!(held.len(), n - first);
        assert_eq!(held.bytes(), bytes - CHUNK_BYTES);
        assert_eq!(timestamps(&held)[0], 1_000 + first as u64);
        while held.forget_oldest() > 0 {}
        assert!(held.is_empty());
        assert_eq!(held.iter().count(), 0);
        assert_eq!(held.bytes(), 0);
    }

    /// New chunks take the buffers of forgotten ones, so the held and the
    /// kept buffers together never outgrow what was held at most; past
    /// [`SPARE_CHUNKS`] a forgotten buffer is freed.
    #[test]
    fn new_chunks_take_the_buffers_of_forgotten_ones() {
        let mut held = EncodedRecords::default();
        let per_chunk = CHUNK_BYTES / COMMON_RECORD_BYTES;
        let fill = |held: &mut EncodedRecords, chunks: usize| {
            for ts in 0..(chunks * per_chunk) as u64 {
                held.push(&switch(ts, 1, 2));
            }
        };
        fill(&mut held, SPARE_CHUNKS + 3);
        assert_eq!(held.chunks.len(), SPARE_CHUNKS + 3);
        let mut forgotten: Vec<*const u8> = held
            .chunks
            .iter()
            .take(3)
            .map(|c| c.bytes.as_ptr())
            .collect();
        for _ in 0..3 {
            held.forget_oldest();
        }
        assert_eq!(held.spares.len(), 3);
        fill(&mut held, 3);
        let mut reused: Vec<*const u8> = held
            .chunks
            .iter()
            .rev()
            .take(3)
            .map(|c| c.bytes.as_ptr())
            .collect();
        reused.sort();
        forgotten.sort();
        assert_eq!(reused, forgotten);
        assert!(held.spares.is_empty());
        while held.forget_oldest() > 0 {}
        assert_eq!(held.spares.len(), SPARE_CHUNKS);
        held.clear();
        assert!(held.spares.is_empty());
    }

    /// A holder's records go after those already held, in the newest
    /// chunk while it has room, and count once it is dropped; a holder
    /// given nothing leaves no chunk behind.
    #[test]
    fn a_holder_keeps_records_after_the_others_and_counts_them_when_dropped() {
        let mut held = EncodedRecords::default();
        held.push(&switch(0, 1, 2));
        drop(held.holder());
        assert_eq!((held.len(), held.chunks.len()), (1, 1));
        let per_chunk = CHUNK_BYTES / COMMON_RECORD_BYTES;
        let mut bytes = Vec::new();
        {
            let mut holder = held.holder();
            for ts in 1..=(2 * per_chunk) as u64 {
                bytes.clear();
                encode(&switch(ts, 1, 2), &mut bytes);
                holder.push_bytes(&bytes);
            }
        }
        assert_eq!(held.len(), 2 * per_chunk + 1);
        assert_eq!(held.chunks.len(), 3);
        assert_eq!(
            held.chunks.iter().map(|c| c.records).collect::<Vec<_>>(),
            [per_chunk, per_chunk, 1]
        );
        assert_eq!(
            timestamps(&held),
            (0..=(2 * per_chunk) as u64).collect::<Vec<_>>()
        );
        assert_eq!(held.oldest(u64::MAX), Some((0, true)));
        assert_eq!(held.forget_oldest(), per_chunk);
        assert_eq!(held.len(), per_chunk + 1);
    }

    /// Driver records are counted apart, and leave the count with their
    /// chunk, or when left out, or with the records they were appended to.
    #[test]
    fn driver_records_are_counted_wherever_they_go() {
        let call = || Record::driver_call(0, (0, 1), (7, 7), [0; 6]);
        let mut held = EncodedRecords::default();
        let mut bytes = Vec::new();
        encode(&call(), &mut bytes);
        assert_eq!(held_record_len(&bytes), Some(bytes.len()));
        while held.chunks.len() < 2 {
            held.push(&switch(1, 1, 2));
            held.push_bytes(&bytes);
        }
        assert_eq!(held.driver_records(), held.len() / 2);
        let mut newer = EncodedRecords::default();
        newer.push(&call());
        newer.push(&switch(2, 1, 2));
        let first = held.chunks[0].records;
        held.append(newer);
        let before = held.driver_records();
        assert_eq!(
            held.iter()
                .filter(|r| matches!(r, Record::CudaCall(_)))
                .count(),
            before
        );
        assert_eq!(held.driver_records_iter().count(), before);
        // A chunk of scheduler records alone is skipped, not walked.
        let mut sched_only = EncodedRecords::default();
        while sched_only.chunks.len() < 2 {
            sched_only.push(&switch(1, 1, 2));
        }
        sched_only.push(&call());
        assert_eq!(
            sched_only
                .chunks
                .iter()
                .filter(|c| c.driver_records > 0)
                .count(),
            1
        );
        assert_eq!(sched_only.driver_records_iter().count(), 1);
        held.forget_oldest();
        assert_eq!(held.driver_records(), before - first / 2);
        held.retain_mut(|r| !matches!(r, Record::CudaCall(_)));
        assert_eq!(held.driver_records(), 0);
        assert!(!held.is_empty());
    }

    /// Records rewritten or left out by `retain_mut` read back so.
    #[test]
    fn retained_records_read_back_as_rewritten() {
        let mut held = EncodedRecords::default();
        for ts in 0..1_000 {
            held.push(&switch(ts, 1 + (ts % 3) as u32, 7));
        }
        let forgotten = held.retain_mut(|r| match r {
            Record::Switch(s) if s.prev_tgid == 1 => false,
            Record::Switch(s) => {
                s.next_tgid = 0;
                true
            }
            _ => true,
        });
        assert_eq!(forgotten, 334);
        assert_eq!(held.len(), 666);
        assert!(held.iter().all(|r| matches!(
            r,
            Record::Switch(s) if s.prev_tgid != 1 && s.next_tgid == 0
        )));
    }

    /// Stack samples and TraceMe events are not held here.
    #[test]
    fn records_of_variable_size_are_refused() {
        let mut held = EncodedRecords::default();
        let sample = Record::StackSample(Box::new(crate::collect::StackSample {
            header: tracer_common::RecordHeader::new(
                tracer_common::RecordKind::StackSample,
                0,
                0,
                0,
            ),
            tid: 1,
            tgid: 1,
            user: Box::new([]),
            kernel: Box::new([]),
            user_unreadable: false,
            kernel_unreadable: false,
            off_cpu_us: 0,
            syscall: 0,
            python: Default::default(),
            launch: false,
        }));
        assert!(!held.push(&sample));
        assert!(held.is_empty());
        assert_eq!(held.iter().count(), 0);
    }

    /// Each record's place gives back that record, decoded, with the time
    /// and kind its place was listed with, across chunks and sizes.
    #[test]
    fn a_record_is_found_again_at_its_place() {
        let mut held = EncodedRecords::default();
        let call = |ts: u64| Record::driver_call(0, (ts - 1, ts), (ts as u32, 1), [ts; 6]);
        let n = 3 * CHUNK_BYTES / COMMON_RECORD_BYTES;
        for ts in 1..=n as u64 {
            let record = if ts % 7 == 0 {
                call(ts)
            } else {
                switch(ts, ts as u32, 2)
            };
            assert!(held.push(&record));
        }
        let places: Vec<_> = held.places().collect();
        assert_eq!(places.len(), n);
        assert!(places.iter().any(|(_, _, p)| p.chunk >= 2));
        for ((ts, kind, place), decoded) in places.into_iter().zip(held.iter()) {
            let found = held.at(place).expect("a record at its place");
            assert_eq!((found.ts(), found.header().kind), (ts, kind));
            assert_eq!(found.ts(), decoded.ts());
            match found {
                Record::CudaCall(c) => assert_eq!((ts % 7, c.args[5]), (0, ts)),
                Record::Switch(s) => assert_eq!(s.prev_tid, ts as u32),
                other => panic!("{other:?}"),
            }
        }
        let past = RecordPlace {
            chunk: 99,
            offset: 0,
        };
        assert!(held.at(past).is_none());
    }
}
