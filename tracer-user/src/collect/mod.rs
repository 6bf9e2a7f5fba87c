//! The collector: drains the eBPF ring buffer into decoded [`Record`]s, or
//! into [`EncodedRecords`] kept as the probes wrote them.
//!
//! It owns the userspace end of the ring buffer. Producers do not wake it
//! per record (see `tracer-ebpf`), so it drains on a timer and when the
//! ring passes its fill threshold.

pub mod agent;
mod decode;
mod encoded;
mod ring;
mod stop;
pub mod torch_ops;

use std::{os::fd::AsRawFd as _, time::Duration};

use tracer_common::python::{PYTHON_TRUNCATED, PYTHON_UNREADABLE};

use crate::symbols::python::frames::PythonFrames;

pub use decode::{
    DecodeError, DriverCallCounted, Record, SampledPython, StackSample, TraceMeEvent, decode,
};
pub use encoded::{EncodedRecords, RecordPlace, is_driver_record};
pub use ring::{RingError, RingReader, RingUsage};
pub use stop::{DrainStop, StopOnDrop};

/// The userspace end of the probes' ring buffer: drains it into records.
pub struct Collector {
    ring: RingReader,
    decoder: Decoder,
}

/// Decodes the items the collector does not keep as they are.
#[derive(Default)]
struct Decoder {
    /// Records that could not be decoded (a kernel/userspace mismatch).
    malformed: u64,
    /// Unwinds the user stacks of stack samples, made at the first one.
    #[cfg(target_arch = "x86_64")]
    unwinder: Option<Box<crate::symbols::unwind::StackUnwinder>>,
    /// Names the Python frames of stack samples and puts them in their
    /// user stacks.
    python: PythonFrames,
}

impl Collector {
    /// A collector draining `ring`.
    pub fn new(ring: RingReader) -> Self {
        Collector {
            ring,
            decoder: Decoder::default(),
        }
    }

    /// Ring-buffer items that could not be decoded (a kernel/userspace
    /// mismatch) since it started or [`Self::clear_malformed`].
    pub fn malformed(&self) -> u64 {
        self.decoder.malformed
    }

    /// Forgets what it knows of process `pid`'s interpreter (it exited: a
    /// process that reuses its pid has its own).
    pub fn forget_process(&mut self, pid: u32) {
        self.decoder.python.forget_process(pid);
    }

    /// Starts the count of [`Self::malformed`] over.
    pub fn clear_malformed(&mut self) {
        self.decoder.malformed = 0;
    }

    /// Bytes read from the ring buffer so far, and its size.
    pub fn ring_usage(&self) -> RingUsage {
        self.ring.usage()
    }

    /// Waits until the kernel forces a wake-up or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        self.poll(timeout, None);
    }

    /// [`Self::wait`], which `stop` also ends.
    pub fn wait_unless_stopped(&self, timeout: Duration, stop: &DrainStop) {
        if !stop.is_stopped() {
            self.poll(timeout, stop.event_fd());
        }
    }

    fn poll(&self, timeout: Duration, also: Option<i32>) {
        let ring = self.ring.fd().as_raw_fd();
        match also {
            Some(fd) => stop::poll_readable(&[ring, fd], timeout),
            None => stop::poll_readable(&[ring], timeout),
        }
    }

    /// Moves everything in the ring buffer into `out`, decoded; returns
    /// how many.
    pub fn drain(&mut self, out: &mut Vec<Record>) -> usize {
        let decoder = &mut self.decoder;
        self.ring.drain(|item| decoder.decode_into(item, out))
    }

    /// Moves everything in the ring buffer out of it: the scheduler and
    /// driver records into `held` as they are (most of a flood, and nothing
    /// more is done with them until a timeline is built), each driver call
    /// shown to `tally` on the way, the others into `others`, decoded.
    /// Returns how many.
    pub fn drain_holding(
        &mut self,
        held: &mut EncodedRecords,
        others: &mut Vec<Record>,
        mut tally: impl FnMut(DriverCallCounted),
    ) -> usize {
        let decoder = &mut self.decoder;
        let mut holder = held.holder();
        self.ring.drain(|item| match decode::held_record_len(item) {
            Some(len) => {
                let record = &item[..len];
                if len != size_of::<tracer_common::SchedSwitch>()
                    && let Some(call) = decode::driver_call_counted(record)
                {
                    tally(call);
                }
                holder.push_bytes(record);
            }
            None => decoder.decode_into(item, others),
        })
    }
}

impl Decoder {
    /// Decodes one ring-buffer item into `out`, unwinding a stack sample's
    /// user stack; counts it as malformed if it cannot be decoded.
    fn decode_into(&mut self, item: &[u8], out: &mut Vec<Record>) {
        match decode(item) {
            #[cfg(target_arch = "x86_64")]
            Ok(Record::StackSample(mut sample)) => {
                if let Some(stack) = decode::user_stack(item) {
                    let unwinder = self.unwinder.get_or_insert_default();
                    unwind_user_stack(unwinder, &mut sample, &stack);
                }
                name_python_frames(&mut self.python, &mut sample);
                out.push(Record::StackSample(sample));
            }
            Ok(record) => out.push(record),
            Err(_) => self.malformed += 1,
        }
    }
}

/// Puts `sample`'s Python frames, named, in its user stack, in place of
/// the eval-loop frames that ran them.
fn name_python_frames(python: &mut PythonFrames, sample: &mut StackSample) {
    let read = std::mem::take(&mut sample.python.read);
    if read.is_empty() && sample.python.flags & (PYTHON_TRUNCATED | PYTHON_UNREADABLE) == 0 {
        return;
    }
    let (user, mixed) = python.mix(
        sample.tgid,
        &sample.user,
        &read,
        sample.python.flags,
        sample.python.left_out,
    );
    sample.user = user.into();
    sample.python.named = mixed.named;
    sample.python.unreadable = mixed.unreadable;
    sample.python.left_out = mixed.left_out;
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
