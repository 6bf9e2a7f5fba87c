//! CPU stack sampling: a `perf_event` program on one clock event per CPU
//! (attached by userspace at the sampling rate). A tick that lands in a
//! thread of a recorded process writes its kernel and user stacks as the
//! kernel walks them, and the user registers and the top of the user
//! stack for userspace to unwind, and, in a Python process, the Python
//! frames the thread runs (`python.rs`); every other tick costs one bitmap
//! lookup.
//!
//! [`write_stack`] also writes the off-CPU stacks (see `off_cpu.rs`).

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_F_USER_STACK, bpf_perf_event_data, pt_regs},
    helpers::{
        bpf_get_stack, bpf_probe_read_kernel,
        generated::{bpf_get_current_task_btf, bpf_probe_read_user, bpf_task_pt_regs},
    },
    macros::perf_event,
    programs::PerfEventContext,
};
use tracer_common::{
    RecordKind,
    stack::{
        FLAG_KERNEL_UNREADABLE, FLAG_USER_UNREADABLE, MAX_FRAMES, STACK_COPY_BYTES,
        STACK_COPY_CHUNK, StackSampleWithCopy,
    },
    stat,
};

use crate::{EVENTS, bump, count_large_submit, current, header, is_recording};

const _: () = assert!(crate::python::SCRATCH_BYTES <= STACK_COPY_BYTES);

const STACK_BYTES: u32 = (MAX_FRAMES * 8) as u32;

#[perf_event]
pub fn cpu_sample(ctx: PerfEventContext) -> u32 {
    let (tid, tgid) = current();
    if !is_recording(tgid) {
        return 0;
    }
    // SAFETY: this program's context.
    let regs = unsafe { sampled_user_regs(&ctx) };
    let what = StackOf {
        regs,
        kernel: true,
        flags: 0,
        off_cpu_us: 0,
        syscall: 0,
        at_ns: 0,
    };
    // SAFETY: a perf_event context is what `bpf_get_stack` takes.
    unsafe { write_stack(ctx.as_ptr(), tid, tgid, &what) };
    0
}

/// What [`write_stack`] writes beside the stacks.
pub(crate) struct StackOf {
    /// The user registers unwinding starts from (`None`: a kernel thread).
    pub regs: Option<[u64; 3]>,
    /// Whether to walk the kernel stack too.
    pub kernel: bool,
    pub flags: u32,
    pub off_cpu_us: u32,
    pub syscall: u32,
    /// The record's time, if not now (a driver call's start).
    pub at_ns: u64,
}

/// Writes one stack record of the current thread: its kernel and user
/// stacks as the kernel walks them from `ctx`, then `regs` and the top of
/// the user stack they point into.
///
/// # Safety
/// `ctx` is the running program's context.
#[inline(always)]
pub(crate) unsafe fn write_stack(ctx: *mut c_void, tid: u32, tgid: u32, what: &StackOf) {
    let Some(mut entry) = EVENTS.reserve::<StackSampleWithCopy>(0) else {
        bump(stat::DROPPED_RINGBUF_FULL);
        return;
    };
    let slot = entry.as_mut_ptr();
    // SAFETY: `slot` is the reserved ring-buffer slot; this only takes the
    // address of its first field.
    let record = unsafe { &raw mut (*slot).sample };
    // First, while few paths lead here: the walk's loop is verified once
    // per path into it. The stack's copy, written last, is its scratch
    // memory.
    // SAFETY: both are parts of the reserved, exclusively owned slot.
    unsafe {
        crate::python::write_python_stack(
            &raw mut (*record).python,
            (*slot).stack.as_mut_ptr(),
            tgid,
        )
    };
    // SAFETY: `record` is the reserved, exclusively owned ring-buffer
    // slot; each copy is bounded by its array's size.
    unsafe {
        let user = bpf_get_stack(
            ctx,
            (*record).user.as_mut_ptr().cast(),
            STACK_BYTES,
            BPF_F_USER_STACK as u64,
        );
        let kernel = if what.kernel {
            bpf_get_stack(ctx, (*record).kernel.as_mut_ptr().cast(), STACK_BYTES, 0)
        } else {
            0
        };
        (*record).header = header(RecordKind::StackSample, size_of::<StackSampleWithCopy>());
        if what.at_ns != 0 {
            (*record).header.ts_ns = what.at_ns;
        }
        (*record).tid = tid;
        (*record).tgid = tgid;
        (*record).user_frames = frames(user);
        (*record).kernel_frames = frames(kernel);
        (*record).flags = what.flags
            | if user < 0 { FLAG_USER_UNREADABLE } else { 0 }
            | if kernel < 0 {
                FLAG_KERNEL_UNREADABLE
            } else {
                0
            };
        (*record).off_cpu_us = what.off_cpu_us;
        (*record).syscall = what.syscall;
        (*record).stack_len = 0;
        (*record).user_regs = [0; 3];
        if let Some(regs) = what.regs {
            (*record).user_regs = regs;
            (*record).stack_len = copy_stack((*slot).stack.as_mut_ptr(), regs[1]);
        }
    }
    entry.submit(count_large_submit());
}

/// The sampled thread's user registers (rip, rsp, rbp): the interrupted
/// ones when the tick came in user mode, else those the kernel saved when
/// the thread entered it. `None` for a kernel thread.
///
/// # Safety
/// `ctx` is this program's context.
#[inline(always)]
unsafe fn sampled_user_regs(ctx: &PerfEventContext) -> Option<[u64; 3]> {
    // SAFETY: a perf_event program's context is its `bpf_perf_event_data`,
    // whose registers it may read.
    let regs = unsafe { &(*ctx.as_ptr().cast::<bpf_perf_event_data>()).regs };
    if regs.cs & 3 == 3 {
        return Some([regs.rip, regs.rsp, regs.rbp]);
    }
    // SAFETY: as the caller's.
    unsafe { saved_user_regs() }
}

/// The user registers the kernel saved when the current thread entered
/// it; `None` for a kernel thread.
///
/// # Safety
/// Called from a program that may call `bpf_task_pt_regs`.
#[inline(always)]
unsafe fn saved_user_regs() -> Option<[u64; 3]> {
    // SAFETY: the current task's saved user registers, read with a helper
    // that checks the address.
    let saved: pt_regs = unsafe {
        let task = bpf_get_current_task_btf();
        bpf_probe_read_kernel(bpf_task_pt_regs(task) as *const pt_regs).ok()?
    };
    (saved.cs & 3 == 3).then_some([saved.rip, saved.rsp, saved.rbp])
}

/// Copies the user stack from `sp` up into `out`, a piece at a time up to
/// the first piece that cannot be read; returns the bytes copied.
///
/// # Safety
/// `out` has room for `STACK_COPY_BYTES`.
#[inline(always)]
unsafe fn copy_stack(out: *mut u8, sp: u64) -> u32 {
    let mut copied = 0;
    for i in 0..STACK_COPY_BYTES / STACK_COPY_CHUNK {
        let offset = i * STACK_COPY_CHUNK;
        // SAFETY: `offset + STACK_COPY_CHUNK` is within `out`; the helper
        // checks the source and zeroes the piece if it cannot read it.
        let failed = unsafe {
            bpf_probe_read_user(
                out.add(offset).cast(),
                STACK_COPY_CHUNK as u32,
                (sp + offset as u64) as *const _,
            )
        } != 0;
        if failed {
            break;
        }
        copied += STACK_COPY_CHUNK as u32;
    }
    copied
}

/// Frames in a stack of `bytes` bytes (`bpf_get_stack`'s result).
#[inline(always)]
fn frames(bytes: i64) -> u32 {
    if bytes <= 0 { 0 } else { (bytes as u32) / 8 }
}
