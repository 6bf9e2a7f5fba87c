//! CPU stack samples: one record per tick of a per-CPU clock (a perf
//! event at the sampling rate) that found a thread of a recorded process
//! on the CPU. The program copies the thread's kernel and user call
//! stacks as the kernel unwinds them (frame pointers for user code), as
//! instruction addresses, and, after them, the user registers and the top
//! of the user stack: userspace unwinds that with the objects' call frame
//! information, which code built without frame pointers still has, and
//! symbolizes the result.
//!
//! Off-CPU stacks are the same record, marked [`FLAG_OFF_CPU`]: the user
//! stack of a thread that waited long in a system call, taken as the call
//! returned.

use crate::{RecordHeader, python::PythonStack};

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
    /// The raw tracepoint program on `sys_exit`: the stacks of threads
    /// returning from a system call they waited in for long.
    pub const OFF_CPU_PROGRAM: &str = "off_cpu_stack";
    /// The raw tracepoint [`OFF_CPU_PROGRAM`] attaches to: fires in the
    /// thread itself as a system call returns, its user stack still where
    /// it made the call.
    pub const OFF_CPU_TRACEPOINT: &str = "sys_exit";
    /// An array indexed by tid, sized to `pid_max` at load where off-CPU
    /// stacks may be taken (else one entry, never written), for the
    /// threads of recorded processes: 0, or [`super::blocked_since`] from
    /// the thread's switch-out blocked until its switch-in, then
    /// [`super::resumed`] until its system call returns or it is switched
    /// out again.
    pub const BLOCKED_AT_US: &str = "BLOCKED_AT_US";
    /// A one-entry array: the shortest wait, in microseconds, whose stack
    /// is taken as its system call returns (0: none, and waits are not
    /// noted).
    pub const OFF_CPU_MIN_US: &str = "OFF_CPU_MIN_US";
    /// Global (`u64`) set before load: the stacks of driver calls that
    /// submit work ([`super::FLAG_LAUNCH`]): 0 for every call,
    /// [`super::NO_LAUNCH_STACKS`] for none, else at least this many
    /// nanoseconds between two on one CPU (a bound on their cost).
    pub const LAUNCH_STACK_GAP_NS: &str = "LAUNCH_STACK_GAP_NS";
    /// A one-entry per-CPU array: the start of the driver call whose stack
    /// the CPU took last (`bpf_ktime_get_ns`), which the stack program
    /// reached by tail call writes as the record's time.
    pub const LAUNCH_STACK_LAST_NS: &str = "LAUNCH_STACK_LAST_NS";
    /// A one-entry program array: [`LAUNCH_STACK_PROGRAM`], which the
    /// driver calls' entry programs tail-call to take a launch stack.
    pub const LAUNCH_STACK_JUMP: &str = "LAUNCH_STACK_JUMP";
    /// The program that writes a launch stack, in the entry's context: one
    /// program verifies the stack walk, not each entry program.
    pub const LAUNCH_STACK_PROGRAM: &str = "cuda_launch_stack";
}

/// [`names::LAUNCH_STACK_GAP_NS`] that takes no launch stacks.
pub const NO_LAUNCH_STACKS: u64 = u64::MAX;

/// [`StackSampleRecord::flags`]: the user stack could not be read (the
/// kernel returned an error, e.g. in a kernel thread).
pub const FLAG_USER_UNREADABLE: u32 = 1;
/// [`StackSampleRecord::flags`]: the kernel stack could not be read.
pub const FLAG_KERNEL_UNREADABLE: u32 = 2;
/// [`StackSampleRecord::flags`]: not a tick of the sampling clock but the
/// stack of a thread that waited long in a system call, taken as the call
/// returned: where it waited ([`StackSampleRecord::off_cpu_us`] says how
/// long, [`StackSampleRecord::syscall`] in which call).
pub const FLAG_OFF_CPU: u32 = 4;

/// [`StackSampleRecord::flags`]: not a tick of the sampling clock but the
/// stack of a CUDA driver call that submits work (a launch, a copy, a
/// memset), taken at its entry: where it was made from. Its header's time
/// is the call's start, the `start_ns` of its `CudaCall`.
pub const FLAG_LAUNCH: u32 = 8;

/// How long after its switch-in a thread's system call may return for its
/// wait to count as the call's: the return from a wait takes
/// microseconds; a thread that ran its own code in between (after a wait
/// outside a system call, such as a page fault) made another call.
pub const MAX_RETURN_US: u32 = 1_000;

/// A [`names::BLOCKED_AT_US`] entry for a thread that switched out
/// blocked at `now_us` (microseconds, wrapping every 35 minutes): odd.
#[inline(always)]
pub const fn blocked_since(now_us: u64) -> u64 {
    (((now_us as u32) << 1) | 1) as u64
}

/// Whether an entry is [`blocked_since`]'s.
#[inline(always)]
pub const fn is_blocked(entry: u64) -> bool {
    entry & 1 == 1
}

/// The microseconds between an entry [`blocked_since`] and `now_us`.
#[inline(always)]
pub const fn blocked_for(entry: u64, now_us: u64) -> u32 {
    ((now_us as u32) << 1).wrapping_sub(entry as u32 & !1) >> 1
}

/// A [`names::BLOCKED_AT_US`] entry for a thread switched in at `now_us`
/// after `off_us` (at least 1) off the CPU: even and never 0.
#[inline(always)]
pub const fn resumed(off_us: u32, now_us: u64) -> u64 {
    let off = if off_us == 0 { 1 } else { off_us };
    ((off as u64) << 32) | (((now_us as u32) << 1) as u64)
}

/// The time off the CPU a [`resumed`] entry holds.
#[inline(always)]
pub const fn resumed_off_us(entry: u64) -> u32 {
    (entry >> 32) as u32
}

/// The microseconds between a [`resumed`] entry's switch-in and `now_us`.
#[inline(always)]
pub const fn since_resumed_us(entry: u64, now_us: u64) -> u32 {
    ((now_us as u32) << 1).wrapping_sub(entry as u32) >> 1
}

/// One sample. Fixed size: the verifier then proves every copy in bounds
/// with constants, and at sampling rates (tens to hundreds a second per
/// CPU) the unused frames cost nothing that matters.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleRecord {
    /// Its `ts_ns` is the tick's time, or the system call's return with
    /// [`FLAG_OFF_CPU`].
    pub header: RecordHeader,
    /// Thread whose stacks these are (the current one).
    pub tid: u32,
    /// Thread group of `tid`: a recorded process.
    pub tgid: u32,
    /// Frames filled in [`Self::user`] (innermost first).
    pub user_frames: u32,
    /// Frames filled in [`Self::kernel`] (innermost first).
    pub kernel_frames: u32,
    /// [`FLAG_USER_UNREADABLE`], [`FLAG_KERNEL_UNREADABLE`], [`FLAG_OFF_CPU`].
    pub flags: u32,
    /// With [`FLAG_OFF_CPU`]: microseconds from the thread's switch-out to
    /// the stack (blocked, then waiting for a CPU); 0 for a sample.
    pub off_cpu_us: u32,
    /// User-space instruction addresses, the first [`Self::user_frames`]
    /// filled.
    pub user: [u64; MAX_FRAMES],
    /// Kernel instruction addresses, the first [`Self::kernel_frames`]
    /// filled.
    pub kernel: [u64; MAX_FRAMES],
    /// The user registers unwinding starts from: instruction, stack and
    /// frame pointer (x86-64's rip, rsp, rbp).
    pub user_regs: [u64; 3],
    /// Bytes of [`StackSampleWithCopy::stack`] copied from
    /// `user_regs[1]` up (0: none).
    pub stack_len: u32,
    /// With [`FLAG_OFF_CPU`]: the number of the system call the thread
    /// waited in (x86-64's).
    pub syscall: u32,
    /// The Python frames the thread was running, where its process runs
    /// CPython (see [`crate::python`]).
    pub python: PythonStack,
}

/// What the program writes: the sample, then the top of the user stack.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleWithCopy {
    /// The stacks and the user registers.
    pub sample: StackSampleRecord,
    /// The user stack from the stack pointer up, its first
    /// [`StackSampleRecord::stack_len`] bytes copied.
    pub stack: [u8; STACK_COPY_BYTES],
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait is measured across the clock's wrap, and the entries of a
    /// blocked and a resumed thread tell apart, as the programs read them.
    #[test]
    fn waits_are_measured_across_the_wrap() {
        let then = blocked_since(5_000);
        assert!(is_blocked(then));
        assert_eq!(blocked_for(then, 17_000), 12_000);
        let near_wrap = (1u64 << 31) - 10;
        assert_eq!(blocked_for(blocked_since(near_wrap), near_wrap + 30), 30);
        assert_eq!(
            blocked_for(blocked_since(u64::from(u32::MAX)), u64::from(u32::MAX) + 7),
            7
        );
        for (off, at) in [(0, 0), (1, 1 << 31), (12_000, 17_000), (u32::MAX, u64::MAX)] {
            let r = resumed(off, at);
            assert!(r != 0 && !is_blocked(r), "{off}, {at}: {r:#x}");
            assert_eq!(resumed_off_us(r), off.max(1));
            assert_eq!(since_resumed_us(r, at.wrapping_add(40)), 40);
        }
    }
}
