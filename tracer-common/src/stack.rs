//! CPU stack samples: one record per tick of a per-CPU clock (a perf
//! event at the sampling rate) that found a thread of a recorded process
//! on the CPU. The program copies the thread's kernel and user call
//! stacks as the kernel unwinds them (frame pointers for user code), as
//! instruction addresses, and, after them, the user registers and the top
//! of the user stack: userspace unwinds that with the objects' call frame
//! information, which code built without frame pointers still has, and
//! symbolizes the result.

use crate::RecordHeader;

/// Bytes of the user stack copied, from the stack pointer up (perf's
/// default for `--call-graph dwarf` is 8 KiB).
pub const STACK_COPY_BYTES: usize = 16 * 1024;

/// The copy is made in pieces of this many bytes, up to the first that
/// cannot be read: the top of a main thread's stack is where its mapping
/// ends.
pub const STACK_COPY_CHUNK: usize = 1024;

/// Most frames kept of each stack: the kernel's default
/// `kernel.perf_event_max_stack`.
pub const MAX_FRAMES: usize = 127;

/// Names of the sampling program in the eBPF object.
pub mod names {
    /// The `perf_event` program attached to one clock event per CPU.
    pub const PROGRAM: &str = "cpu_sample";
}

/// [`StackSampleRecord::flags`]: the user stack could not be read (the
/// kernel returned an error, e.g. in a kernel thread).
pub const FLAG_USER_UNREADABLE: u32 = 1;
/// [`StackSampleRecord::flags`]: the kernel stack could not be read.
pub const FLAG_KERNEL_UNREADABLE: u32 = 2;

/// One sample. Fixed size: the verifier then proves every copy in bounds
/// with constants, and at sampling rates (tens to hundreds a second per
/// CPU) the unused frames cost nothing that matters.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleRecord {
    pub header: RecordHeader,
    pub tid: u32,
    pub tgid: u32,
    /// Frames filled in [`Self::user`] (innermost first).
    pub user_frames: u32,
    /// Frames filled in [`Self::kernel`] (innermost first).
    pub kernel_frames: u32,
    /// [`FLAG_USER_UNREADABLE`], [`FLAG_KERNEL_UNREADABLE`].
    pub flags: u32,
    pub _pad: u32,
    pub user: [u64; MAX_FRAMES],
    pub kernel: [u64; MAX_FRAMES],
    /// The user registers unwinding starts from: instruction, stack and
    /// frame pointer (x86-64's rip, rsp, rbp).
    pub user_regs: [u64; 3],
    /// Bytes of [`StackSampleWithCopy::stack`] copied from
    /// `user_regs[1]` up (0: none).
    pub stack_len: u32,
    pub _pad2: u32,
}

/// What the program writes: the sample, then the top of the user stack.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleWithCopy {
    pub sample: StackSampleRecord,
    pub stack: [u8; STACK_COPY_BYTES],
}
