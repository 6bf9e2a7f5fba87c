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
    /// The raw tracepoint program on `sys_exit`: the stacks of threads
    /// returning from a system call they waited in for long.
    pub const OFF_CPU_PROGRAM: &str = "off_cpu_stack";
    /// The raw tracepoint [`OFF_CPU_PROGRAM`] attaches to: fires in the
    /// thread itself as a system call returns, its user stack still where
    /// it made the call.
    pub const OFF_CPU_TRACEPOINT: &str = "sys_exit";
    /// An array indexed by tid, sized to `pid_max` at load where off-CPU
    /// stacks may be taken (else one entry, never written), for the
    /// threads of recorded processes: 0, or [`blocked_since`] (odd) from
    /// the thread's switch-out blocked until its switch-in, then
    /// [`resumed_after`] (even) until its system call returns or it is
    /// switched out again.
    pub const BLOCKED_AT_US: &str = "BLOCKED_AT_US";
    /// A one-entry array: the shortest wait, in microseconds, whose stack
    /// is taken as its system call returns (0: none, and waits are not
    /// noted).
    pub const OFF_CPU_MIN_US: &str = "OFF_CPU_MIN_US";
}

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

/// A [`names::BLOCKED_AT_US`] entry for a thread that switched out
/// blocked at `now_us` (microseconds, wrapping every 35 minutes).
#[inline(always)]
pub const fn blocked_since(now_us: u64) -> u32 {
    ((now_us as u32) << 1) | 1
}

/// A [`names::BLOCKED_AT_US`] entry for a thread that ran again
/// `off_us` microseconds after it blocked (at least 1).
#[inline(always)]
pub const fn resumed_after(off_us: u32) -> u32 {
    let off = if off_us == 0 { 1 } else { off_us };
    (if off > u32::MAX >> 1 {
        u32::MAX >> 1
    } else {
        off
    }) << 1
}

/// The microseconds between an entry [`blocked_since`] `then` and
/// `now_us`.
#[inline(always)]
pub const fn blocked_for(then: u32, now_us: u64) -> u32 {
    ((now_us as u32) << 1).wrapping_sub(then & !1) >> 1
}

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
    /// [`FLAG_USER_UNREADABLE`], [`FLAG_KERNEL_UNREADABLE`], [`FLAG_OFF_CPU`].
    pub flags: u32,
    /// With [`FLAG_OFF_CPU`]: microseconds from the thread's switch-out to
    /// the stack (blocked, then waiting for a CPU); 0 for a sample.
    pub off_cpu_us: u32,
    pub user: [u64; MAX_FRAMES],
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
}

/// What the program writes: the sample, then the top of the user stack.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleWithCopy {
    pub sample: StackSampleRecord,
    pub stack: [u8; STACK_COPY_BYTES],
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait is measured across the clock's wrap in the entry, and a
    /// resumed entry is even and never 0, as the programs tell them apart.
    #[test]
    fn waits_are_measured_across_the_wrap() {
        let then = blocked_since(5_000);
        assert_eq!(then & 1, 1);
        assert_eq!(blocked_for(then, 17_000), 12_000);
        let near_wrap = (1u64 << 31) - 10;
        assert_eq!(blocked_for(blocked_since(near_wrap), near_wrap + 30), 30);
        assert_eq!(
            blocked_for(blocked_since(u64::from(u32::MAX)), u64::from(u32::MAX) + 7),
            7
        );
        for off in [0, 1, 12_000, u32::MAX] {
            let r = resumed_after(off);
            assert!(r != 0 && r & 1 == 0, "{off}: {r}");
        }
        assert_eq!(resumed_after(12_000) >> 1, 12_000);
        assert_eq!(resumed_after(u32::MAX) >> 1, u32::MAX >> 1);
    }
}
