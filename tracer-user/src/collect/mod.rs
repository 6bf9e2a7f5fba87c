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
    /// Unwinds the user stacks of stack samples, made at the first one.
    #[cfg(target_arch = "x86_64")]
    unwinder: Option<Box<crate::symbols::unwind::StackUnwinder>>,
}

impl Collector {
    pub fn new(ring: RingBuf<MapData>) -> Self {
        Collector {
            ring,
            malformed: 0,
            #[cfg(target_arch = "x86_64")]
            unwinder: None,
        }
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
                #[cfg(target_arch = "x86_64")]
                Ok(Record::StackSample(mut sample)) => {
                    if let Some(stack) = decode::user_stack(&item) {
                        let unwinder = self.unwinder.get_or_insert_default();
                        unwind_user_stack(unwinder, &mut sample, &stack);
                    }
                    out.push(Record::StackSample(sample));
                }
                Ok(record) => out.push(record),
                Err(_) => self.malformed += 1,
            }
        }
        out.len() - before
    }
}

/// Replaces the kernel's frame-pointer walk of `sample`'s user stack with
/// the unwinding of its copy where that went further: to the outermost
/// frame, or past where the walk stopped. The walk stays where unwinding
/// found less (no copy of a stack deeper than the copy, code that only
/// frame pointers describe beyond it).
#[cfg(target_arch = "x86_64")]
fn unwind_user_stack(
    unwinder: &mut crate::symbols::unwind::StackUnwinder,
    sample: &mut StackSample,
    stack: &crate::symbols::unwind::UserStack<'_>,
) {
    let Some(unwound) = unwinder.unwind(sample.tgid, stack) else {
        return;
    };
    if unwound.complete || unwound.frames.len() > sample.user.len() {
        sample.user = unwound.frames.into();
        sample.user_unreadable = false;
    }
}
