//! Stack sample records: a thread's stacks where the sampling clock found
//! it or where it waited, and the copy of its user stack to unwind.

use tracer_common::{
    RecordHeader, RecordKind,
    python::{
        MAX_PYTHON_FRAMES, MAX_PYTHON_WALK, PYTHON_INNER_FRAMES, PYTHON_OUTER_FRAMES,
        PythonFrameRecord, PythonStack,
    },
    stack::{
        FLAG_KERNEL_UNREADABLE, FLAG_LAUNCH, FLAG_OFF_CPU, FLAG_USER_UNREADABLE, MAX_FRAMES,
        STACK_COPY_BYTES, StackSampleRecord, StackSampleWithCopy,
    },
};

use super::{DecodeError, check_size, read};
use crate::symbols::stacks::SampledStack;

/// A CPU stack sample: where a thread of a traced process was when the
/// sampling clock of its CPU ticked.
#[derive(Clone, Debug)]
pub struct StackSample {
    /// Kind, size, CPU and time of the record.
    pub header: RecordHeader,
    /// The sampled thread.
    pub tid: u32,
    /// Its process.
    pub tgid: u32,
    /// User-space instruction addresses, innermost first (every one past
    /// the first is a return address).
    pub user: Box<[u64]>,
    /// Kernel instruction addresses, innermost first.
    pub kernel: Box<[u64]>,
    /// The user stack could not be read (a kernel thread, or unwinding failed).
    pub user_unreadable: bool,
    /// The kernel stack could not be read.
    pub kernel_unreadable: bool,
    /// 0 for a tick of the sampling clock. Otherwise the stack was taken as
    /// the system call the thread waited in returned (an off-CPU stack:
    /// where it waited), after this many microseconds off the CPU.
    pub off_cpu_us: u32,
    /// With [`Self::off_cpu_us`]: the number of the system call the thread
    /// waited in.
    pub syscall: u32,
    /// Its Python frames, in a process that runs CPython.
    pub python: SampledPython,
    /// Not a sample but the stack of a driver call that submits work, taken
    /// at its entry: its header's time is the call's start.
    pub launch: bool,
}

/// The Python frames of a sample: as the program read them, until they
/// are named into its user stack, then what came of them.
#[derive(Clone, Debug, Default)]
pub struct SampledPython {
    /// The frames read, innermost first; emptied once named.
    pub read: Box<[PythonFrameRecord]>,
    /// The walk's flags (`tracer_common::python::PYTHON_*`).
    pub flags: u32,
    /// Frames of a chain deeper than a record holds, left out between the
    /// first [`PYTHON_INNER_FRAMES`] of [`Self::read`] and the rest (its
    /// outermost).
    pub left_out: u32,
    /// Python frames named in the user stack.
    pub named: u32,
    /// Python frames that could not be named, marked in the user stack.
    pub unreadable: u32,
}

impl StackSample {
    /// Whether this is the stack of a thread that waited in a system call,
    /// not a sample of a thread on a CPU.
    pub fn is_off_cpu(&self) -> bool {
        self.off_cpu_us != 0
    }

    /// Whether this is a tick of the sampling clock: neither an off-CPU
    /// stack nor a driver call's.
    pub fn is_cpu_sample(&self) -> bool {
        !self.is_off_cpu() && !self.launch
    }

    /// Its stacks, as the symbolizer reads them.
    pub fn stack(&self) -> SampledStack<'_> {
        SampledStack {
            pid: self.tgid,
            kernel: &self.kernel,
            user: &self.user,
        }
    }
}

/// A stack sample keeps only the frames the kernel filled in; the copy
/// of the user stack behind it is read by [`user_stack`].
pub(super) fn read_stack_sample(bytes: &[u8], claimed: usize) -> Result<StackSample, DecodeError> {
    let kind = RecordKind::StackSample;
    check_size(bytes, kind, claimed, size_of::<StackSampleWithCopy>())?;
    let r: StackSampleRecord = read(bytes, kind, size_of::<StackSampleRecord>())?;
    let frames = |n: u32| (n as usize).min(MAX_FRAMES);
    Ok(StackSample {
        header: r.header,
        tid: r.tid,
        tgid: r.tgid,
        user: r.user[..frames(r.user_frames)].into(),
        kernel: r.kernel[..frames(r.kernel_frames)].into(),
        user_unreadable: r.flags & FLAG_USER_UNREADABLE != 0,
        kernel_unreadable: r.flags & FLAG_KERNEL_UNREADABLE != 0,
        off_cpu_us: if r.flags & FLAG_OFF_CPU != 0 {
            r.off_cpu_us.max(1)
        } else {
            0
        },
        syscall: r.syscall,
        python: python_frames(&r.python),
        launch: r.flags & FLAG_LAUNCH != 0,
    })
}

/// The frames of `stack` innermost first, those of its outer end put back
/// in order, and how many were left out between its ends.
fn python_frames(stack: &PythonStack) -> SampledPython {
    let len = (stack.len as usize).min(MAX_PYTHON_FRAMES);
    let depth = (stack.depth as usize).clamp(len, MAX_PYTHON_WALK);
    let mut read: Box<[PythonFrameRecord]> = stack.frames[..len].into();
    let mut left_out = 0;
    if depth > MAX_PYTHON_FRAMES {
        read[PYTHON_INNER_FRAMES..]
            .rotate_left((depth - PYTHON_INNER_FRAMES) % PYTHON_OUTER_FRAMES);
        left_out = (depth - MAX_PYTHON_FRAMES) as u32;
    }
    SampledPython {
        read,
        flags: stack.flags,
        left_out,
        ..SampledPython::default()
    }
}

/// The user registers and stack bytes a stack sample record carries
/// (`bytes` decoded as a
/// [`Record::StackSample`](super::Record::StackSample)), if it copied any.
#[cfg(target_arch = "x86_64")]
pub fn user_stack(bytes: &[u8]) -> Option<crate::symbols::unwind::UserStack<'_>> {
    if bytes.len() < size_of::<StackSampleWithCopy>() {
        return None;
    }
    // SAFETY: length checked; a plain #[repr(C)] record; unaligned read.
    let r: StackSampleRecord = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let len = (r.stack_len as usize).min(STACK_COPY_BYTES);
    if len == 0 {
        return None;
    }
    let stack = &bytes[size_of::<StackSampleRecord>()..][..len];
    let [ip, sp, bp] = r.user_regs;
    Some(crate::symbols::unwind::UserStack {
        ip,
        sp,
        bp,
        bytes: stack,
    })
}
