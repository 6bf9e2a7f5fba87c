//! The activity buffers the agent lends CUPTI: at most [`BUFFERS`] of
//! [`BUFFER_BYTES`], mapped on first use, filled by CUPTI, read and
//! forwarded to ebtrace in [`crate::protocol::DEVICE_ACTIVITY`] frames.
//! CUPTI calls the two callbacks from its own threads; the slots' states
//! hand each buffer from one side to the other.

use core::{
    ffi::c_void,
    sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
};

use super::{Api, ERROR_MAX_LIMIT_REACHED, SUCCESS};
use crate::{
    activity::{self, BatchHeader},
    python::Text,
    sys,
};

/// Bytes of one activity buffer (what wprof and XLA use).
const BUFFER_BYTES: usize = 2 << 20;
/// Buffers CUPTI may hold or fill between two collections: the agent's
/// memory is bounded by `BUFFERS * BUFFER_BYTES` (64 MiB); beyond it CUPTI
/// drops records and counts them.
const BUFFERS: usize = 32;
/// Bytes of the frames the records are forwarded in.
const FRAME_BYTES: usize = 1 << 20;

const FREE: u32 = 0;
const LENT: u32 = 1;
const FILLED: u32 = 2;

/// One activity buffer: lent to CUPTI, filled by it, drained by the agent.
struct Slot {
    state: AtomicU32,
    base: AtomicUsize,
    valid: AtomicUsize,
    order: AtomicU64,
}

impl Slot {
    /// Takes a free slot (FREE → LENT); false if it is not free.
    fn claim(&self) -> bool {
        self.state
            .compare_exchange(FREE, LENT, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: Slot = Slot {
    state: AtomicU32::new(FREE),
    base: AtomicUsize::new(0),
    valid: AtomicUsize::new(0),
    order: AtomicU64::new(0),
};
static SLOTS: [Slot; BUFFERS] = [EMPTY_SLOT; BUFFERS];
static FILL_ORDER: AtomicU64 = AtomicU64::new(0);
/// Whether buffers are lent (only while recording).
pub(super) static LENDING: AtomicBool = AtomicBool::new(false);
/// Buffer requests refused: CUPTI drops what they would have held.
pub(super) static REFUSED: AtomicU64 = AtomicU64::new(0);

/// A fresh private anonymous mapping of `len` bytes, if there is memory.
fn map_anonymous(len: usize) -> Option<*mut c_void> {
    // SAFETY: asks for new memory; touches no existing mapping.
    let p = unsafe {
        sys::mmap(
            core::ptr::null_mut(),
            len,
            sys::PROT_READ_WRITE,
            sys::MAP_PRIVATE_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != sys::MAP_FAILED).then_some(p)
}

/// `CUpti_BuffersCallbackRequestFunc`: lends a free buffer, mapping it on
/// first use; none while not recording or when all are in use.
pub(super) extern "C" fn lend_buffer(
    buffer: *mut *mut u8,
    size: *mut usize,
    max_records: *mut usize,
) {
    let mut given: *mut u8 = core::ptr::null_mut();
    // The claim comes last: a slot is taken only while lending.
    if LENDING.load(Ordering::Acquire)
        && let Some(slot) = SLOTS.iter().find(|s| s.claim())
    {
        let mut base = slot.base.load(Ordering::Acquire);
        if base == 0 {
            if let Some(p) = map_anonymous(BUFFER_BYTES) {
                base = p as usize;
                slot.base.store(base, Ordering::Release);
            } else {
                slot.state.store(FREE, Ordering::Release);
            }
        }
        given = base as *mut u8;
    }
    if given.is_null() {
        REFUSED.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: CUPTI passes valid out pointers.
    unsafe {
        *buffer = given;
        *size = if given.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

/// `CUpti_BuffersCallbackCompleteFunc`: marks the buffer filled; the
/// agent's thread reads it at the next collection.
pub(super) extern "C" fn take_back_buffer(
    _context: *mut c_void,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    let Some(slot) = SLOTS
        .iter()
        .find(|s| s.base.load(Ordering::Acquire) == buffer as usize && !buffer.is_null())
    else {
        return;
    };
    slot.valid.store(valid.min(BUFFER_BYTES), Ordering::Release);
    slot.order
        .store(FILL_ORDER.fetch_add(1, Ordering::AcqRel), Ordering::Release);
    slot.state.store(FILLED, Ordering::Release);
}

/// Reads the filled buffers in the order they were filled and forwards
/// their records; returns why some were not, if any.
pub(super) fn forward(
    api: &Api,
    header: &BatchHeader,
    deliver: &mut impl FnMut(&[u8]),
) -> Option<Text> {
    // Unmapped below.
    let Some(frame) = map_anonymous(FRAME_BYTES) else {
        return Some(Text::new("no memory to forward the GPU activity"));
    };
    // SAFETY: the mapping is FRAME_BYTES long and only this thread uses it.
    let frame = unsafe { core::slice::from_raw_parts_mut(frame as *mut u8, FRAME_BYTES) };
    let mut out = Frame {
        buf: frame,
        len: 0,
        header,
        delivered: false,
    };
    out.reset();
    loop {
        let next = SLOTS
            .iter()
            .filter(|s| s.state.load(Ordering::Acquire) == FILLED)
            .min_by_key(|s| s.order.load(Ordering::Acquire));
        let Some(slot) = next else { break };
        let base = slot.base.load(Ordering::Acquire) as *mut u8;
        let valid = slot.valid.load(Ordering::Acquire);
        for_each_record(api, base, valid, |record, name| {
            out.push(record, name, deliver)
        });
        slot.state.store(FREE, Ordering::Release);
    }
    out.finish(deliver);
    // SAFETY: the mapping made above, no longer used.
    unsafe { sys::munmap(out.buf.as_mut_ptr().cast(), FRAME_BYTES) };
    None
}

/// Calls `visit` with each record of a filled buffer and, for kernels,
/// the name it points at. A record's length is where the next one starts.
fn for_each_record(api: &Api, base: *mut u8, valid: usize, mut visit: impl FnMut(&[u8], &[u8])) {
    let mut current: *mut u8 = core::ptr::null_mut();
    let end = base as usize + valid;
    let mut emit = |from: *mut u8, to: usize| {
        let len = to
            .saturating_sub(from as usize)
            .min(activity::MAX_RECORD_LEN);
        // SAFETY: the record lies inside the buffer CUPTI filled.
        let record = unsafe { core::slice::from_raw_parts(from, len) };
        visit(record, kernel_name(record));
    };
    loop {
        let mut next: *mut u8 = current;
        // SAFETY: the buffer and valid size CUPTI gave; `next` is the
        // cursor CUPTI advances.
        let r = unsafe { (api.next_record)(base, valid, &mut next) };
        if r != SUCCESS || next.is_null() || (next as usize) >= end {
            if !current.is_null() {
                emit(current, end);
            }
            if r != SUCCESS && r != ERROR_MAX_LIMIT_REACHED {
                return;
            }
            return;
        }
        if !current.is_null() {
            emit(current, next as usize);
        }
        current = next;
    }
}

/// The name a kernel record points at (CUPTI owns the string).
fn kernel_name(record: &[u8]) -> &[u8] {
    let kind = record
        .get(..4)
        .map_or(0, |k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
    if !matches!(
        kind,
        activity::KIND_KERNEL | activity::KIND_CONCURRENT_KERNEL
    ) || record.len() < activity::KERNEL_PREFIX_LEN
    {
        return &[];
    }
    let mut p = [0u8; 8];
    p.copy_from_slice(&record[activity::KERNEL_NAME_OFFSET..activity::KERNEL_NAME_OFFSET + 8]);
    let name = usize::from_le_bytes(p) as *const u8;
    if name.is_null() {
        return &[];
    }
    let mut len = 0;
    // SAFETY: CUPTI's name strings are NUL-terminated and live as long as
    // the module they name; at most MAX_NAME_LEN bytes are read.
    unsafe {
        while len < activity::MAX_NAME_LEN && *name.add(len) != 0 {
            len += 1;
        }
        core::slice::from_raw_parts(name, len)
    }
}

/// Flushes until CUPTI holds none of the agent's buffers, for at most
/// [`TAKE_BACK_TRIES`] flushes a few ms apart; false if it still holds some.
/// Call it once [`LENDING`] is off. A buffer CUPTI kept would stay its
/// current buffer after the agent is gone: the records of the program's own
/// profiler (torch.profiler, enabled later) would go into it, and no one
/// would ever flush it.
pub(super) fn take_back_lent(api: &Api) -> bool {
    for _ in 0..TAKE_BACK_TRIES {
        // SAFETY: a plain call.
        unsafe { (api.flush_all)(super::FLUSH_FORCED) };
        if !SLOTS
            .iter()
            .any(|s| s.state.load(Ordering::Acquire) == LENT)
        {
            return true;
        }
        sys::sleep_ns(TAKE_BACK_PAUSE_NS);
    }
    false
}

/// Flushes [`take_back_lent`] tries: the records of work still running on
/// the GPU arrive once it ends, so 100 tries 2 ms apart wait for a kernel of
/// up to 0.2 s.
const TAKE_BACK_TRIES: usize = 100;
const TAKE_BACK_PAUSE_NS: u64 = 2_000_000;

/// Unmaps the buffers CUPTI does not hold (they are mapped again when
/// recording restarts).
pub(super) fn release_free_buffers() {
    for slot in SLOTS.iter().filter(|s| s.claim()) {
        let base = slot.base.swap(0, Ordering::AcqRel);
        if base != 0 {
            // SAFETY: a buffer mapped by `lend_buffer`, held by no one.
            unsafe { sys::munmap(base as *mut c_void, BUFFER_BYTES) };
        }
        slot.state.store(FREE, Ordering::Release);
    }
}

/// A DEVICE_ACTIVITY payload being filled.
struct Frame<'a> {
    buf: &'a mut [u8],
    len: usize,
    header: &'a BatchHeader,
    delivered: bool,
}

impl Frame<'_> {
    fn reset(&mut self) {
        self.buf[..BatchHeader::LEN].copy_from_slice(&self.header.encode());
        self.len = BatchHeader::LEN;
    }

    fn push(&mut self, record: &[u8], name: &[u8], deliver: &mut impl FnMut(&[u8])) {
        let need = 8 + record.len() + name.len();
        if self.len + need > self.buf.len() {
            self.flush(deliver);
        }
        let at = self.len;
        self.buf[at..at + 4].copy_from_slice(&(record.len() as u32).to_le_bytes());
        self.buf[at + 4..at + 8].copy_from_slice(&(name.len() as u32).to_le_bytes());
        self.buf[at + 8..at + 8 + record.len()].copy_from_slice(record);
        self.buf[at + 8 + record.len()..at + need].copy_from_slice(name);
        self.len += need;
    }

    fn flush(&mut self, deliver: &mut impl FnMut(&[u8])) {
        if self.len > BatchHeader::LEN {
            deliver(&self.buf[..self.len]);
            self.delivered = true;
        }
        self.reset();
    }

    /// Delivers the records still in the frame; with none delivered at
    /// all, the header alone, which still tells the clock and the drops.
    fn finish(&mut self, deliver: &mut impl FnMut(&[u8])) {
        if self.len > BatchHeader::LEN || !self.delivered {
            deliver(&self.buf[..self.len]);
        }
    }
}

/// Frees the buffers CUPTI has filled, unread (what was recorded before
/// the capture window).
pub(super) fn discard_filled() {
    for slot in &SLOTS {
        let _ = slot
            .state
            .compare_exchange(FILLED, FREE, Ordering::AcqRel, Ordering::Acquire);
    }
}

#[cfg(test)]
mod tests {
    use super::{BatchHeader, Frame};

    fn header() -> BatchHeader {
        BatchHeader {
            api_version: 26,
            flags: 0,
            gpu_ns: 1,
            monotonic_ns: 2,
            dropped: 0,
        }
    }

    /// Each payload a frame of `capacity` bytes delivers for `records`.
    fn delivered(capacity: usize, records: &[&[u8]]) -> Vec<usize> {
        let header = header();
        let mut buf = vec![0u8; capacity];
        let mut out = Frame {
            buf: &mut buf,
            len: 0,
            header: &header,
            delivered: false,
        };
        out.reset();
        let mut sizes = Vec::new();
        let mut deliver = |p: &[u8]| sizes.push(p.len());
        for r in records {
            out.push(r, b"", &mut deliver);
        }
        out.finish(&mut deliver);
        sizes
    }

    #[test]
    fn a_few_records_are_delivered_not_only_a_frames_worth() {
        let h = BatchHeader::LEN;
        assert_eq!(delivered(1 << 12, &[&[1; 16], &[2; 24]]), [h + 24 + 32]);
    }

    #[test]
    fn records_past_a_full_frame_go_in_the_next() {
        let h = BatchHeader::LEN;
        assert_eq!(
            delivered(h + 48, &[&[1; 16], &[2; 16], &[3; 16]]),
            [h + 48, h + 24]
        );
        assert_eq!(delivered(h + 48, &[&[1; 16], &[2; 16]]), [h + 48]);
    }

    #[test]
    fn nothing_recorded_still_tells_the_clock() {
        assert_eq!(delivered(1 << 12, &[]), [BatchHeader::LEN]);
    }
}
