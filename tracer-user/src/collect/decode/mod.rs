//! Bytes from the ring buffer to typed records: the only place that
//! reinterprets kernel-written memory.
//!
//! [`decode`] reads any record; the record families of variable size or
//! shape have files of their own: [`driver_call`] (CUDA driver calls, also
//! counted in place), [`stack_sample`] (CPU and off-CPU stacks) and
//! [`traceme`] (TraceMe events). [`as_written`] keeps the records a
//! collector holds in the probes' own form.

mod as_written;
mod driver_call;
mod stack_sample;
mod traceme;

use tracer_common::{
    ProcessFork, RecordHeader, RecordKind, SchedSwitch, SchedWakeup, TaskExit, TaskNew, TaskRename,
    cuda::{CudaCall, CudaSymbol},
};

pub use as_written::{encode, held_record_len};
pub use driver_call::{DriverCallCounted, driver_call_counted};
#[cfg(target_arch = "x86_64")]
pub use stack_sample::user_stack;
pub use stack_sample::{SampledPython, StackSample};
pub use traceme::TraceMeEvent;

use driver_call::read_driver_call;
use stack_sample::read_stack_sample;
use traceme::read_traceme;

/// One record from the kernel, decoded. Large, rare records are boxed so
/// that the frequent scheduler records stay small.
#[derive(Clone, Debug)]
pub enum Record {
    /// A `sched_switch` involving a traced thread.
    Switch(SchedSwitch),
    /// A wake-up of a traced thread.
    Wakeup(SchedWakeup),
    // Boxed, as the rare records below: a record's size is its largest
    // variant's, and captures hold millions of switches and wake-ups.
    /// A thread created by a traced thread.
    TaskNew(Box<TaskNew>),
    /// A process forked by a traced thread.
    Fork(ProcessFork),
    /// A traced thread's exit.
    Exit(Box<TaskExit>),
    /// A traced thread's new name.
    Rename(Box<TaskRename>),
    /// A CUDA driver call.
    CudaCall(Box<CudaCall>),
    /// A kernel handle and the name it was looked up by.
    CudaSymbol(Box<CudaSymbol>),
    /// Boxed: it is much larger than the others and much rarer.
    TraceMe(Box<TraceMeEvent>),
    /// A CPU stack sample or an off-CPU stack.
    StackSample(Box<StackSample>),
}

impl Record {
    /// The header the record starts with.
    pub fn header(&self) -> &RecordHeader {
        match self {
            Record::Switch(r) => &r.header,
            Record::Wakeup(r) => &r.header,
            Record::TaskNew(r) => &r.header,
            Record::Fork(r) => &r.header,
            Record::Exit(r) => &r.header,
            Record::Rename(r) => &r.header,
            Record::CudaCall(r) => &r.header,
            Record::CudaSymbol(r) => &r.header,
            Record::TraceMe(r) => &r.header,
            Record::StackSample(r) => &r.header,
        }
    }

    /// `CLOCK_MONOTONIC` time of the record, in ns.
    pub fn ts(&self) -> u64 {
        self.header().ts_ns
    }

    /// A `sched_switch` record as the probes write it: on `cpu`, from
    /// `prev` to `next` (tid, tgid; tgid 0 for a task not traced). For
    /// feeding [`crate::timeline`] without the kernel (tests, benchmarks).
    pub fn sched_switch(
        ts_ns: u64,
        cpu: u32,
        prev: (u32, u32),
        prev_state: u64,
        next: (u32, u32),
    ) -> Record {
        let mut header = RecordHeader::new(
            RecordKind::SchedSwitch,
            size_of::<SchedSwitch>(),
            cpu,
            ts_ns,
        );
        header.detail = prev_state as u16;
        Record::Switch(SchedSwitch {
            header,
            prev_tid: prev.0,
            prev_tgid: prev.1,
            next_tid: next.0,
            next_tgid: next.1,
        })
    }

    /// A `sched_waking` record as the probes write it, on CPU 0: `waker`
    /// woke `woken` (tid, tgid each).
    pub fn sched_waking(ts_ns: u64, woken: (u32, u32), waker: (u32, u32)) -> Record {
        Record::Wakeup(SchedWakeup {
            header: RecordHeader::new(RecordKind::SchedWakeup, size_of::<SchedWakeup>(), 0, ts_ns),
            tid: woken.0,
            tgid: woken.1,
            waker_tid: waker.0,
            waker_tgid: waker.1,
        })
    }

    /// A driver call of function `function` (an index of
    /// [`crate::cuda_api`]'s table) as the probes write it, on CPU 0: by
    /// `thread` (tid, tgid) from `start_ns` to `end_ns`, succeeded, with
    /// `args`, the rest zero.
    pub fn driver_call(
        function: u16,
        (start_ns, end_ns): (u64, u64),
        thread: (u32, u32),
        args: [u64; 6],
    ) -> Record {
        Record::CudaCall(Box::new(CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 0, end_ns),
            tid: thread.0,
            tgid: thread.1,
            start_ns,
            function,
            flags: 0,
            result: 0,
            args,
            extra: [0; 8],
            out_value: 0,
        }))
    }
}

/// Why a ring-buffer item is not a record.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Shorter than a record header: its length in bytes.
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    /// The header names no known kind.
    #[error("unknown record kind {0}")]
    UnknownKind(u16),
    /// The size in the header is not its kind's, or the item is shorter.
    #[error("record kind {kind:?} claims {claimed} bytes, expected {expected}, got {got}")]
    Size {
        /// The record's kind.
        kind: RecordKind,
        /// The size in its header, in bytes.
        claimed: usize,
        /// The size of its kind, in bytes.
        expected: usize,
        /// The item's length, in bytes.
        got: usize,
    },
}

/// A record of `kind` claims its size in its header: it must be the
/// size of that kind, and the ring buffer's item must hold it.
fn check_size(
    bytes: &[u8],
    kind: RecordKind,
    claimed: usize,
    expected: usize,
) -> Result<(), DecodeError> {
    if claimed != expected || bytes.len() < expected {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected,
            got: bytes.len(),
        });
    }
    Ok(())
}

fn read<T: Copy>(bytes: &[u8], kind: RecordKind, claimed: usize) -> Result<T, DecodeError> {
    check_size(bytes, kind, claimed, size_of::<T>())?;
    // SAFETY: length checked; T is a plain #[repr(C)] record; unaligned read.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// The header every record starts with, if `bytes` hold one.
fn header(bytes: &[u8]) -> Option<RecordHeader> {
    if bytes.len() < size_of::<RecordHeader>() {
        return None;
    }
    // SAFETY: length checked above; unaligned read of a plain record.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

/// Decodes one ring-buffer item.
pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    let header = header(bytes).ok_or(DecodeError::Short(bytes.len()))?;
    let kind = RecordKind::from_u16(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    let size = usize::from(header.size);
    Ok(match kind {
        RecordKind::SchedSwitch => Record::Switch(read(bytes, kind, size)?),
        RecordKind::SchedWakeup => Record::Wakeup(read(bytes, kind, size)?),
        RecordKind::TaskNew => Record::TaskNew(Box::new(read(bytes, kind, size)?)),
        RecordKind::ProcessFork => Record::Fork(read(bytes, kind, size)?),
        RecordKind::TaskExit => Record::Exit(Box::new(read(bytes, kind, size)?)),
        RecordKind::TaskRename => Record::Rename(Box::new(read(bytes, kind, size)?)),
        RecordKind::CudaCall => Record::CudaCall(Box::new(read_driver_call(bytes, size)?)),
        RecordKind::CudaSymbol => Record::CudaSymbol(Box::new(read(bytes, kind, size)?)),
        RecordKind::TraceMe => Record::TraceMe(Box::new(read_traceme(bytes, size)?)),
        RecordKind::StackSample => Record::StackSample(Box::new(read_stack_sample(bytes, size)?)),
    })
}

/// The bytes of `record`, as the probes write it.
fn bytes_of<T: aya::Pod>(record: &T) -> &[u8] {
    // SAFETY: a `Pod` record is plain `#[repr(C)]` data without implicit
    // padding: every one of its bytes is initialized.
    unsafe { std::slice::from_raw_parts((record as *const T).cast::<u8>(), size_of::<T>()) }
}

#[cfg(test)]
mod tests;
