//! CPU stack sampling: a `perf_event` program on one clock event per CPU
//! (attached by userspace at the sampling rate). A tick that lands in a
//! thread of a recorded process writes its kernel and user stacks; every
//! other tick costs one bitmap lookup.

use aya_ebpf::{
    EbpfContext as _, bindings::BPF_F_USER_STACK, helpers::bpf_get_stack, macros::perf_event,
    programs::PerfEventContext,
};
use tracer_common::{
    RecordKind,
    stack::{FLAG_KERNEL_UNREADABLE, FLAG_USER_UNREADABLE, MAX_FRAMES, StackSampleRecord},
    stat,
};

use crate::{EVENTS, bump, count_submit, current, header, is_recording};

const STACK_BYTES: u32 = (MAX_FRAMES * 8) as u32;

#[perf_event]
pub fn cpu_sample(ctx: PerfEventContext) -> u32 {
    let (tid, tgid) = current();
    if !is_recording(tgid) {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<StackSampleRecord>(0) else {
        bump(stat::DROPPED_RINGBUF_FULL);
        return 0;
    };
    let record = entry.as_mut_ptr();
    // SAFETY: `record` is the reserved, exclusively owned ring-buffer
    // slot; each copy is bounded by its array's size.
    unsafe {
        let user = bpf_get_stack(
            ctx.as_ptr(),
            (*record).user.as_mut_ptr().cast(),
            STACK_BYTES,
            BPF_F_USER_STACK as u64,
        );
        let kernel = bpf_get_stack(
            ctx.as_ptr(),
            (*record).kernel.as_mut_ptr().cast(),
            STACK_BYTES,
            0,
        );
        (*record).header = header(RecordKind::StackSample, size_of::<StackSampleRecord>());
        (*record).tid = tid;
        (*record).tgid = tgid;
        (*record).user_frames = frames(user);
        (*record).kernel_frames = frames(kernel);
        (*record).flags = if user < 0 { FLAG_USER_UNREADABLE } else { 0 }
            | if kernel < 0 {
                FLAG_KERNEL_UNREADABLE
            } else {
                0
            };
        (*record)._pad = 0;
    }
    entry.submit(count_submit());
    0
}

/// Frames in a stack of `bytes` bytes (`bpf_get_stack`'s result).
#[inline(always)]
fn frames(bytes: i64) -> u32 {
    if bytes <= 0 { 0 } else { (bytes as u32) / 8 }
}
