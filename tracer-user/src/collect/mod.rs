//! The collector: drains the eBPF ring buffer into decoded [`Record`]s.
//!
//! It owns the userspace end of the ring buffer. Producers do not wake it
//! per record (see `tracer-ebpf`), so it drains on a timer and when the
//! ring passes its fill threshold.

mod decode;

use std::{os::fd::AsRawFd as _, time::Duration};

use aya::maps::{MapData, RingBuf};
pub use decode::{DecodeError, Record, StackSample, TraceMeEvent, decode};

pub struct Collector {
    ring: RingBuf<MapData>,
    /// Records that could not be decoded (a kernel/userspace mismatch).
    pub malformed: u64,
}

impl Collector {
    pub fn new(ring: RingBuf<MapData>) -> Self {
        Collector { ring, malformed: 0 }
    }

    /// Waits until the kernel forces a wake-up or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let mut pfd = libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd; EINTR (e.g. Ctrl-C) just ends the wait early.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }

    /// Moves everything in the ring buffer into `out`; returns how many.
    pub fn drain(&mut self, out: &mut Vec<Record>) -> usize {
        let before = out.len();
        while let Some(item) = self.ring.next() {
            match decode(&item) {
                Ok(record) => out.push(record),
                Err(_) => self.malformed += 1,
            }
        }
        out.len() - before
    }
}
