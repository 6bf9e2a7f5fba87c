//! Off-CPU stacks: where the threads of recorded processes waited, for
//! the waits of at least `OFF_CPU_MIN_US`.
//!
//! The switch program notes when such a thread switches out blocked and,
//! as it switches in again, how long it was off the CPU
//! ([`note_switch`]). A raw tracepoint on `sys_exit` then fires in the
//! thread itself as the system call it waited in returns (within
//! `MAX_RETURN_US` of the switch-in; later, the thread ran its own code
//! after a wait outside a system call and made another): its user stack
//! is still where it made the call, and its registers are the ones the
//! kernel saved at the call. There it writes the record of a stack sample,
//! marked off-CPU, with the call's number. Only kprobes or BPF
//! trampolines fire in the resumed thread before that, and kernels built
//! without kprobes, or that refuse trampolines, have neither.

use aya_ebpf::{
    EbpfContext as _,
    bindings::pt_regs,
    helpers::{bpf_ktime_get_ns, bpf_probe_read_kernel},
    macros::{map, raw_tracepoint},
    maps::Array,
    programs::RawTracePointContext,
};
use tracer_common::{
    MAX_TRACKED_TIDS,
    stack::{
        FLAG_OFF_CPU, MAX_RETURN_US, blocked_for, blocked_since, is_blocked, resumed,
        resumed_off_us, since_resumed_us,
    },
};

use crate::{
    cpu_sample::{StackOf, write_stack},
    current, is_recording,
};

/// See `tracer_common::stack::names::BLOCKED_AT_US`.
#[map]
static BLOCKED_AT_US: Array<u64> = Array::with_max_entries(MAX_TRACKED_TIDS, 0);

/// See `tracer_common::stack::names::OFF_CPU_MIN_US`.
#[map]
static OFF_CPU_MIN_US: Array<u32> = Array::with_max_entries(1, 0);

/// Called by the switch program at `ts_ns` for a switch of which at least
/// one side is recorded: `prev` switched out (blocked or not, and
/// recorded or not), `next` is switched in.
#[inline(always)]
pub(crate) fn note_switch(
    prev_tid: u32,
    prev_recorded: bool,
    prev_blocked: bool,
    next_tid: u32,
    next_recorded: bool,
    ts_ns: u64,
) {
    let min = OFF_CPU_MIN_US.get(0).copied().unwrap_or(0);
    if min == 0 {
        return;
    }
    let now_us = ts_ns / 1000;
    if prev_recorded && let Some(slot) = BLOCKED_AT_US.get_ptr_mut(prev_tid) {
        // SAFETY: a live array slot; only the thread's own switches and
        // system calls write it, and they do not run at once.
        unsafe {
            *slot = if prev_blocked {
                blocked_since(now_us)
            } else {
                // A resume not followed by a system call's return before
                // the thread went off again: not a wait in one.
                0
            };
        }
    }
    if next_recorded && let Some(slot) = BLOCKED_AT_US.get_ptr_mut(next_tid) {
        // SAFETY: as above.
        unsafe {
            let then = *slot;
            if is_blocked(then) {
                let off = blocked_for(then, now_us);
                *slot = if off >= min { resumed(off, now_us) } else { 0 };
            }
        }
    }
}

/// `sys_exit(struct pt_regs *regs, long ret)`, in the returning thread.
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn off_cpu_stack(ctx: RawTracePointContext) -> i32 {
    let (tid, tgid) = current();
    let Some(slot) = BLOCKED_AT_US.get_ptr_mut(tid) else {
        return 0;
    };
    // SAFETY: a live array slot of the current thread (see `note_switch`).
    let noted = unsafe { *slot };
    if noted == 0 || is_blocked(noted) {
        return 0;
    }
    // SAFETY: as above.
    unsafe { *slot = 0 };
    if !is_recording(tgid) {
        return 0;
    }
    // SAFETY: a plain helper call.
    let now_us = unsafe { bpf_ktime_get_ns() } / 1000;
    if since_resumed_us(noted, now_us) > MAX_RETURN_US {
        return 0;
    }
    let regs: *const pt_regs = ctx.arg(0);
    // SAFETY: the registers the kernel saved at the call, read with a
    // helper that checks the address.
    let Ok(regs) = (unsafe { bpf_probe_read_kernel(regs) }) else {
        return 0;
    };
    let what = StackOf {
        regs: Some([regs.rip, regs.rsp, regs.rbp]),
        // The kernel stack here is the system call's exit path.
        kernel: false,
        flags: FLAG_OFF_CPU,
        off_cpu_us: resumed_off_us(noted),
        syscall: regs.orig_rax as u32,
        at_ns: 0,
    };
    // SAFETY: a raw tracepoint's context is what `bpf_get_stack` takes.
    unsafe { write_stack(ctx.as_ptr(), tid, tgid, &what) };
    0
}
