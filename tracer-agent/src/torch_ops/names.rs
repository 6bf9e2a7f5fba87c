//! The names of ops, interned from the callbacks of many threads at once
//! into a fixed table: an open-addressed set of name hashes whose bytes
//! lie in a fixed arena. Neither grows; a name that finds no room is
//! counted and its ops carry [`NO_NAME`].

use core::{
    ffi::c_char,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::op_records::{MAX_NAME_LEN, NO_NAME};

/// One slot of the table: a name's hash (0: free), then where its bytes
/// are (0 until they are copied).
#[repr(C)]
pub struct NameSlot {
    hash: AtomicU64,
    place: AtomicU64,
}

/// Set in a published place (a name of no bytes is published too).
const PUBLISHED: u64 = 1 << 63;
/// Slots tried before a name is given up.
const PROBES: usize = 64;

impl NameSlot {
    /// Where the name's bytes are in the arena, once copied.
    pub fn published(&self) -> Option<(u32, u32)> {
        let place = self.place.load(Ordering::Acquire);
        (place & PUBLISHED != 0).then_some(((place >> 32) as u32 & 0x7fff_ffff, place as u32))
    }
}

/// FNV-1a of `bytes`, never 0.
fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

/// The bytes of C string `name`, up to [`MAX_NAME_LEN`].
///
/// # Safety
/// `name` is null or a NUL-terminated string.
unsafe fn bytes_of<'a>(name: *const c_char) -> &'a [u8] {
    if name.is_null() {
        return &[];
    }
    let mut len = 0;
    // SAFETY: reads stop at the terminating NUL, or before.
    while len < MAX_NAME_LEN && unsafe { *name.add(len) } != 0 {
        len += 1;
    }
    // SAFETY: the `len` bytes just read.
    unsafe { core::slice::from_raw_parts(name.cast::<u8>(), len) }
}

/// The id of `name` in `slots` (interning it, its bytes copied into the
/// arena of `region`), or [`NO_NAME`].
///
/// # Safety
/// `slots` and `region` are a live region's; `name` as for [`bytes_of`].
pub unsafe fn intern(slots: &[NameSlot], region: *mut u8, name: *const c_char) -> u32 {
    // SAFETY: as the caller promises.
    unsafe { intern_bytes(slots, region, bytes_of(name)) }
}

/// The id of `bytes` (at most [`MAX_NAME_LEN`] of them are kept), as
/// [`intern`] gives a name's.
///
/// # Safety
/// `slots` and `region` are a live region's.
pub unsafe fn intern_bytes(slots: &[NameSlot], region: *mut u8, bytes: &[u8]) -> u32 {
    let bytes = &bytes[..bytes.len().min(MAX_NAME_LEN)];
    let h = hash(bytes);
    let mask = slots.len() - 1;
    let mut i = h as usize & mask;
    for _ in 0..PROBES {
        let Some(slot) = slots.get(i) else {
            break;
        };
        match slot
            .hash
            .compare_exchange(0, h, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: as the caller promises.
                unsafe { publish(slot, region, bytes) };
                return i as u32;
            }
            Err(found) if found == h => return i as u32,
            Err(_) => i = (i + 1) & mask,
        }
    }
    // SAFETY: as the caller promises.
    let (_, _, lost) = unsafe { super::region::arena(region) };
    lost.fetch_add(1, Ordering::Relaxed);
    NO_NAME
}

/// Copies `bytes` into the arena and publishes where in `slot`; an arena
/// that is full counts the name lost (its slot stays unpublished).
///
/// # Safety
/// `region` is a live region; `slot` was just taken by this call.
unsafe fn publish(slot: &NameSlot, region: *mut u8, bytes: &[u8]) {
    // SAFETY: as the caller promises.
    let (arena, next, lost) = unsafe { super::region::arena(region) };
    let offset = next.fetch_add(bytes.len(), Ordering::Relaxed);
    if offset + bytes.len() > super::region::ARENA {
        lost.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // SAFETY: these arena bytes were reserved for this call alone.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), arena.add(offset), bytes.len()) };
    let place = PUBLISHED | ((offset as u64) << 32) | bytes.len() as u64;
    slot.place.store(place, Ordering::Release);
}
