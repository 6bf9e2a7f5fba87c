//! The memory a recording writes into: a fixed region mapped for the
//! capture, holding a record buffer, a name table and its arena, and their
//! counters, and laid out again at the end, in place, as the frame ebtrace
//! reads (see `op_records`).

use core::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::names::NameSlot;
use crate::{
    op_records::{self, NameEntry, OpRecord, OpsHeader},
    sys,
};

/// Records the buffer holds: 40 MiB of address space, resident only as
/// far as a capture fills it.
pub(super) const CAPACITY: usize = 1 << 20;
/// Slots of the name table (a power of two).
const NAME_SLOTS: usize = 1 << 13;
/// Bytes for names.
pub(super) const ARENA: usize = 1 << 19;

// Where each part lies in the region. The frame sent at the end is built
// in place, from its start: header, entries, names, records (see
// `op_records`), each moved down over room the previous part did not use.
const ENTRIES_AT: usize = OpsHeader::LEN;
const ARENA_AT: usize = ENTRIES_AT + NAME_SLOTS * NameEntry::LEN;
const RECORDS_AT: usize = (ARENA_AT + ARENA).next_multiple_of(8);
const SLOTS_AT: usize = RECORDS_AT + CAPACITY * OpRecord::LEN;
const COUNTERS_AT: usize = SLOTS_AT + NAME_SLOTS * core::mem::size_of::<NameSlot>();
const REGION_BYTES: usize = (COUNTERS_AT + core::mem::size_of::<Counters>()).next_multiple_of(4096);

/// The region's counters.
#[repr(C)]
struct Counters {
    /// Record slots taken (some past the end: those are dropped).
    next: AtomicUsize,
    /// Records that did not fit.
    dropped: AtomicU64,
    /// Bytes of the arena taken.
    arena_next: AtomicUsize,
    /// Names that did not fit.
    names_lost: AtomicU32,
}

/// Maps a region: zeroed (an empty name table), resident only as far as
/// a capture writes into it.
pub(super) fn map() -> Option<*mut u8> {
    // SAFETY: fresh private memory, never backed by swap until touched.
    let region = unsafe {
        sys::mmap(
            core::ptr::null_mut(),
            REGION_BYTES,
            sys::PROT_READ_WRITE,
            sys::MAP_PRIVATE_ANONYMOUS | sys::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (region != sys::MAP_FAILED).then(|| region.cast::<u8>())
}

/// Unmaps a region [`map`] made.
///
/// # Safety
/// No callback writes into it or will.
pub(super) unsafe fn unmap(region: *mut u8) {
    // SAFETY: as the caller promises; the mapping is REGION_BYTES long.
    unsafe { sys::munmap(region.cast(), REGION_BYTES) };
}

/// The region's counters.
///
/// # Safety
/// `region` is a live region.
unsafe fn counters<'a>(region: *mut u8) -> &'a Counters {
    // SAFETY: the counters lie at an aligned offset of the region.
    unsafe { &*(region.add(COUNTERS_AT) as *const Counters) }
}

/// The region's name table.
///
/// # Safety
/// `region` is a live region.
pub(super) unsafe fn name_slots<'a>(region: *mut u8) -> &'a [NameSlot] {
    // SAFETY: the slots lie at an aligned offset of the region, zeroed
    // (empty) when it was mapped.
    unsafe { core::slice::from_raw_parts(region.add(SLOTS_AT) as *const NameSlot, NAME_SLOTS) }
}

/// Lays the frame out from the region's start, in place; returns it.
///
/// # Safety
/// `region` is a live region no callback writes into any more.
pub(super) unsafe fn build_frame<'a>(region: *mut u8) -> &'a [u8] {
    // SAFETY: every offset is inside the region, and each part moves down
    // over room the parts before it did not take.
    unsafe {
        let counters = counters(region);
        let records = counters.next.load(Ordering::Acquire).min(CAPACITY);
        let arena_len = counters.arena_next.load(Ordering::Acquire).min(ARENA);
        let mut names = 0usize;
        for (id, slot) in name_slots(region).iter().enumerate() {
            if let Some((offset, len)) = slot.published() {
                let entry = NameEntry {
                    id: id as u32,
                    offset,
                    len,
                };
                let at = region.add(ENTRIES_AT + names * NameEntry::LEN) as *mut NameEntry;
                at.write_unaligned(entry);
                names += 1;
            }
        }
        let mut end = ENTRIES_AT + names * NameEntry::LEN;
        core::ptr::copy(region.add(ARENA_AT), region.add(end), arena_len);
        end += arena_len;
        core::ptr::copy(
            region.add(RECORDS_AT),
            region.add(end),
            records * OpRecord::LEN,
        );
        end += records * OpRecord::LEN;
        let header = OpsHeader {
            magic: op_records::MAGIC,
            version: op_records::VERSION,
            records: records as u32,
            names: names as u32,
            arena_len: arena_len as u32,
            names_lost: counters.names_lost.load(Ordering::Acquire),
            dropped: counters.dropped.load(Ordering::Acquire),
        };
        core::ptr::copy_nonoverlapping(header.encode().as_ptr(), region, OpsHeader::LEN);
        core::slice::from_raw_parts(region, end)
    }
}

/// Takes a slot for `record`, or counts it dropped.
pub(super) fn write(region: *mut u8, record: OpRecord) {
    // SAFETY: `region` is live while a callback runs (see `unregister`).
    let counters = unsafe { counters(region) };
    let slot = counters.next.fetch_add(1, Ordering::Relaxed);
    if slot >= CAPACITY {
        counters.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // SAFETY: slot `slot` is this call's alone, inside the records' part.
    unsafe {
        let at = region.add(RECORDS_AT + slot * OpRecord::LEN) as *mut OpRecord;
        at.write(record);
    }
}

/// Where the arena lies in `region`, and its counters (for [`names`]).
///
/// # Safety
/// `region` is a live region.
pub(super) unsafe fn arena<'a>(region: *mut u8) -> (*mut u8, &'a AtomicUsize, &'a AtomicU32) {
    // SAFETY: as the caller promises.
    unsafe {
        let c = counters(region);
        (region.add(ARENA_AT), &c.arena_next, &c.names_lost)
    }
}
