//! The userspace end of the probes' ring buffer, read in batches.
//!
//! aya's `RingBuf` hands out one item at a time and publishes the
//! consumer position after each: on a flood that is a store per record to
//! the cache line every reservation in the kernel reads, on the traced
//! process's CPU. This reader walks every committed record up to the
//! producer position it read once, and publishes how far it got once per
//! batch (and every [`PUBLISH_EVERY`] bytes, so that a long batch frees
//! room as it goes). The layout is the kernel's (`kernel/bpf/ringbuf.c`):
//! a consumer page, a producer page, then the data pages, which the kernel
//! lets a reader map twice in a row so that a record that wraps around
//! reads as one slice. This reader maps them once, and copies the one
//! record a lap that wraps around: its resident memory is the ring's size,
//! not twice that, and that memory counts in the flight recorder's
//! `--retain-memory`.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    sync::atomic::{AtomicU32, AtomicUsize, Ordering},
};

use aya::maps::{MapData, MapType};
use memmap2::{Mmap, MmapMut, MmapOptions};

/// Each record's header: its length, with these two bits set while it is
/// being written and when it was discarded; then its page offset.
const HEADER_BYTES: usize = 8;
const BUSY_BIT: u32 = 1 << 31;
const DISCARD_BIT: u32 = 1 << 30;

/// Bytes read between two publications of the consumer position.
const PUBLISH_EVERY: usize = 256 * 1024;

/// Why the ring buffer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The map is not a `BPF_MAP_TYPE_RINGBUF`.
    #[error("the events map is not a ring buffer")]
    NotARing,
    /// Its size could not be read.
    #[error("reading the events map's size: {0}")]
    Info(#[source] aya::maps::MapError),
    /// Its pages could not be mapped.
    #[error("mapping the ring buffer into memory: {0}")]
    Map(#[source] std::io::Error),
}

/// How much went through a ring buffer, and how much it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingUsage {
    /// Bytes read from it so far (records and their headers).
    pub read: u64,
    /// Its size in bytes.
    pub size: usize,
}

/// Reads records from a BPF ring buffer mapped into this process.
pub struct RingReader {
    /// Owns the map's descriptor.
    map: MapData,
    /// The consumer page: the position this reader publishes.
    consumer: MmapMut,
    /// The producer page (the kernel's position), then the data.
    producer: Mmap,
    data_offset: usize,
    mask: usize,
    /// How far this reader has read.
    pos: usize,
    /// A record that wraps around the end of the data, put together.
    wrapped: Vec<u8>,
}

impl RingReader {
    /// Maps `map`, a `BPF_MAP_TYPE_RINGBUF`, and reads from where its
    /// consumer position is.
    pub fn new(map: MapData) -> Result<Self, RingError> {
        let info = map.info().map_err(RingError::Info)?;
        if !matches!(info.map_type(), Ok(MapType::RingBuf)) {
            return Err(RingError::NotARing);
        }
        let size = info.max_entries() as usize;
        let page = crate::symbols::maps::page_size() as usize;
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: a ring buffer's pages stay mapped as long as the mapping
        // (the kernel pins them); the consumer page is only written through
        // the atomic in `publish`, the others only read through atomics
        // and byte slices the kernel no longer writes (committed records).
        let consumer =
            unsafe { MmapOptions::new().len(page).map_mut(fd) }.map_err(RingError::Map)?;
        // SAFETY: as above.
        let producer = unsafe {
            MmapOptions::new()
                .offset(page as u64)
                .len(page + size)
                .map(fd)
        }
        .map_err(RingError::Map)?;
        let mut reader = RingReader {
            map,
            consumer,
            producer,
            data_offset: page,
            mask: size - 1,
            pos: 0,
            wrapped: Vec::new(),
        };
        reader.pos = reader.consumer_pos().load(Ordering::Acquire);
        Ok(reader)
    }

    /// Bytes read from the ring since it was made, and its size.
    pub fn usage(&self) -> RingUsage {
        RingUsage {
            read: self.pos as u64,
            size: self.mask + 1,
        }
    }

    /// The ring buffer map's descriptor, to wait on.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.map.fd().as_fd()
    }

    fn consumer_pos(&self) -> &AtomicUsize {
        // SAFETY: the consumer page is page-aligned and at least a usize
        // long; the kernel reads it atomically.
        unsafe { &*self.consumer.as_ptr().cast::<AtomicUsize>() }
    }

    fn producer_pos(&self) -> usize {
        // SAFETY: as for `consumer_pos`; the kernel writes it with release
        // ordering after the records before it are reserved.
        unsafe { &*self.producer.as_ptr().cast::<AtomicUsize>() }.load(Ordering::Acquire)
    }

    /// Hands every committed record to `each`, in the ring's order, and
    /// frees their room. Stops at a record still being written: the next
    /// call reads it. Returns how many records it read.
    pub fn drain(&mut self, mut each: impl FnMut(&[u8])) -> usize {
        let mut n = 0;
        let mut published = self.pos;
        // Walked in a local, which stays in a register; `self.pos` is set
        // where the walk stops.
        let mut pos = self.pos;
        'walk: loop {
            let producer = self.producer_pos();
            if producer <= pos {
                break;
            }
            // Positions only grow (64 bits do not wrap): `<` rather than
            // `!=` also ends a walk that a wrong length took past the end.
            while pos < producer {
                let offset = self.data_offset + (pos & self.mask);
                // Headers are 8-byte aligned in a ring of whole pages: one
                // never wraps around.
                let Some(header) = self.producer.get(offset..offset + HEADER_BYTES) else {
                    // Cannot be: the mask keeps it inside the data. Stop
                    // rather than spin on it.
                    break 'walk;
                };
                // SAFETY: 8-byte aligned (records are), inside the mapping;
                // the kernel commits a record by clearing the busy bit with a
                // fully ordered exchange: acquire pairs with it.
                let len_and_flags =
                    unsafe { &*header.as_ptr().cast::<AtomicU32>() }.load(Ordering::Acquire);
                if len_and_flags & BUSY_BIT != 0 {
                    break 'walk;
                }
                let len = (len_and_flags & !(BUSY_BIT | DISCARD_BIT)) as usize;
                if len_and_flags & DISCARD_BIT == 0 {
                    let body = offset + HEADER_BYTES;
                    if let Some(record) = self.producer.get(body..body + len) {
                        each(record);
                        n += 1;
                    } else if self.put_together(body, len) {
                        each(&self.wrapped);
                        n += 1;
                    }
                }
                pos += (HEADER_BYTES + len).next_multiple_of(8);
                if pos.wrapping_sub(published) >= PUBLISH_EVERY {
                    self.pos = pos;
                    self.publish(&mut published);
                }
            }
        }
        self.pos = pos;
        self.publish(&mut published);
        n
    }

    /// Puts the record of `len` bytes at `body` that wraps around the end
    /// of the data together in [`Self::wrapped`]; false for a length no
    /// record of the ring has.
    #[cold]
    fn put_together(&mut self, body: usize, len: usize) -> bool {
        let data = &self.producer[self.data_offset..];
        let start = body - self.data_offset;
        if len > data.len() || start > data.len() {
            return false;
        }
        let (tail, head) = (&data[start..], &data[..len - (data.len() - start)]);
        self.wrapped.clear();
        self.wrapped.extend_from_slice(tail);
        self.wrapped.extend_from_slice(head);
        true
    }

    fn publish(&self, published: &mut usize) {
        if *published != self.pos {
            // Release: the kernel reuses the room only after reading this.
            self.consumer_pos().store(self.pos, Ordering::Release);
            *published = self.pos;
        }
    }
}
