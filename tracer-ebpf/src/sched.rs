//! Scheduler tracepoints: switches, wake-ups, thread creation, exit and
//! renames of the traced processes' threads.
//!
//! Thread membership: `TARGET_TGIDS` holds the traced processes; the current
//! task's group is known from `bpf_get_current_pid_tgid`, but the *next* task
//! of a switch and the woken task of a wake-up are only tids, so
//! `TRACKED_TIDS` maps every thread of a traced process to its group. It is
//! seeded from `/proc` by userspace and kept up to date here: new threads in
//! `task_newtask` (which sees `clone_flags`), exits in `sched_process_exit`,
//! and any traced thread seen running that userspace missed. Membership is
//! kept whether or not the process is being recorded (`is_recording`):
//! records are written only while it is.
//!
//! The hot events (switches and wake-ups) have two programs each: a raw
//! tracepoint, which reads the kernel's `task_struct` at offsets userspace
//! found in the kernel's BTF and costs the kernel no formatted record, and a
//! classic tracepoint for kernels where that cannot be checked. Both write
//! the same records.

use aya_ebpf::{
    helpers::bpf_probe_read_kernel,
    macros::{raw_tracepoint, tracepoint},
    programs::{RawTracePointContext, TracePointContext},
};
use tracer_common::{
    CLONE_THREAD, COMM_LEN, ProcessFork, RecordKind, SchedSwitch, SchedWakeup, TaskExit, TaskNew,
    TaskRename, tp,
};

use crate::{
    EXIT_HAS_GROUP_DEAD, TASK_CPU_OFFSET, TASK_EXIT_STATE_OFFSET, TASK_PID_OFFSET, current, emit,
    header, is_recording, is_target, off_cpu::note_switch, read, track, tracked_tgid,
};

#[tracepoint(category = "sched", name = "sched_switch")]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    let (Some(prev_tid), Some(prev_state), Some(next_tid)) = (
        read::<u32>(&ctx, tp::SWITCH_PREV_PID),
        read::<u64>(&ctx, tp::SWITCH_PREV_STATE),
        read::<u32>(&ctx, tp::SWITCH_NEXT_PID),
    ) else {
        return 0;
    };
    // The tracepoint fires in the context of the task being switched out.
    let (_, current_tgid) = current();
    switch(prev_tid, current_tgid, next_tid, || prev_state)
}

/// `sched_switch(bool preempt, task_struct *prev, task_struct *next,
/// unsigned int prev_state)` (Linux 5.18+; userspace checks the prototype).
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn raw_sched_switch(ctx: RawTracePointContext) -> i32 {
    let preempt: u64 = ctx.arg(0);
    let next: *const u8 = ctx.arg(2);
    let state: u64 = ctx.arg(3);
    // `prev` is the task switching out: the current one.
    let (prev_tid, current_tgid) = current();
    let Some(next_tid) = task_field(next, &TASK_PID_OFFSET) else {
        return 0;
    };
    // Only read once the switch is known to concern a traced thread.
    let prev_state = || {
        if preempt as u8 != 0 {
            TASK_REPORT_MAX
        } else {
            let prev: *const u8 = ctx.arg(1);
            report_state(
                state as u32,
                task_field(prev, &TASK_EXIT_STATE_OFFSET).unwrap_or(0),
            )
        }
    };
    switch(prev_tid, current_tgid, next_tid, prev_state) as i32
}

/// What the classic tracepoint reports as `prev_state` for a preempted task.
const TASK_REPORT_MAX: u64 = 0x100;

/// `prev_state` as the classic tracepoint reports it
/// (`__trace_sched_switch_state`): one bit, the index of the task's state
/// in the list `ps` prints, or 0 for running.
#[inline(always)]
fn report_state(state: u32, exit_state: u32) -> u64 {
    const TASK_REPORT: u32 = 0x7f;
    const TASK_UNINTERRUPTIBLE: u32 = 0x2;
    const TASK_IDLE: u32 = 0x402;
    const TASK_REPORT_IDLE: u32 = 0x80;
    const TASK_RTLOCK_WAIT: u32 = 0x1000;
    const TASK_FROZEN: u32 = 0x8000;
    let mut report = (state | exit_state) & TASK_REPORT;
    if state & TASK_IDLE == TASK_IDLE {
        report = TASK_REPORT_IDLE;
    }
    if state & (TASK_RTLOCK_WAIT | TASK_FROZEN) != 0 {
        report = TASK_UNINTERRUPTIBLE;
    }
    let index = 32 - report.leading_zeros();
    if index == 0 { 0 } else { 1 << (index - 1) }
}

/// A `u32` field of a `task_struct`, at the offset in `offset`.
#[inline(always)]
fn task_field(task: *const u8, offset: &u32) -> Option<u32> {
    // SAFETY: globals are read-only after load.
    let offset = unsafe { core::ptr::read_volatile(offset) };
    // SAFETY: a probe read of kernel memory; a bad address fails, it does
    // not fault.
    unsafe { bpf_probe_read_kernel(task.wrapping_add(offset as usize) as *const u32) }.ok()
}

/// Records a switch that concerns a traced thread; `prev_state` is only
/// asked then.
#[inline(always)]
fn switch(
    prev_tid: u32,
    current_tgid: u32,
    next_tid: u32,
    prev_state: impl FnOnce() -> u64,
) -> u32 {
    // The switched-out task is the current one: its group is known, and
    // a thread userspace missed is tracked here.
    let tracked = tracked_tgid(prev_tid);
    let prev_tgid = if prev_tid == 0 {
        0
    } else if tracked == current_tgid {
        current_tgid
    } else if is_target(current_tgid) {
        track(prev_tid, current_tgid);
        current_tgid
    } else {
        if tracked != 0 {
            // A tid reused since its thread was tracked.
            track(prev_tid, 0);
        }
        0
    };
    let next_tgid = tracked_tgid(next_tid);
    let (prev_recorded, next_recorded) = (is_recording(prev_tgid), is_recording(next_tgid));
    if !prev_recorded && !next_recorded {
        return 0;
    }
    let mut header = header(RecordKind::SchedSwitch, size_of::<SchedSwitch>());
    // The kernel's states stop at TASK_REPORT_MAX (0x100).
    let state = prev_state();
    header.detail = state as u16;
    // Not a thread that exits (`X`, `Z`): its tid may come back as another.
    let blocked = state != 0 && state != TASK_REPORT_MAX && state & 0x30 == 0;
    note_switch(
        prev_tid,
        prev_recorded,
        blocked,
        next_tid,
        next_recorded,
        header.ts_ns,
    );
    emit(SchedSwitch {
        header,
        prev_tid,
        prev_tgid,
        next_tid,
        next_tgid,
    });
    0
}

#[inline(always)]
fn wakeup(ctx: &TracePointContext, new: bool) -> u32 {
    let (Some(tid), Some(target_cpu)) = (
        read::<u32>(ctx, tp::WAKEUP_PID),
        read::<u32>(ctx, tp::WAKEUP_TARGET_CPU),
    ) else {
        return 0;
    };
    woken(tid, target_cpu, new)
}

/// `sched_waking(task_struct *p)` and `sched_wakeup_new(task_struct *p)`.
#[inline(always)]
fn raw_wakeup(ctx: &RawTracePointContext, new: bool) -> i32 {
    let task: *const u8 = ctx.arg(0);
    let (Some(tid), Some(target_cpu)) = (
        task_field(task, &TASK_PID_OFFSET),
        task_field(task, &TASK_CPU_OFFSET),
    ) else {
        return 0;
    };
    woken(tid, target_cpu, new) as i32
}

#[inline(always)]
fn woken(tid: u32, target_cpu: u32, new: bool) -> u32 {
    let tgid = tracked_tgid(tid);
    if !is_recording(tgid) {
        return 0;
    }
    let (waker_tid, waker_tgid) = current();
    let mut header = header(RecordKind::SchedWakeup, size_of::<SchedWakeup>());
    header.detail = SchedWakeup::detail(target_cpu, new);
    emit(SchedWakeup {
        header,
        tid,
        tgid,
        waker_tid,
        waker_tgid,
    });
    0
}

/// `sched_waking`, not `sched_wakeup`: only the former is sure to fire in the
/// waker's context (see `tracer_common::SchedWakeup`).
#[tracepoint(category = "sched", name = "sched_waking")]
pub fn sched_waking(ctx: TracePointContext) -> u32 {
    wakeup(&ctx, false)
}

#[tracepoint(category = "sched", name = "sched_wakeup_new")]
pub fn sched_wakeup_new(ctx: TracePointContext) -> u32 {
    wakeup(&ctx, true)
}

#[raw_tracepoint(tracepoint = "sched_waking")]
pub fn raw_sched_waking(ctx: RawTracePointContext) -> i32 {
    raw_wakeup(&ctx, false)
}

#[raw_tracepoint(tracepoint = "sched_wakeup_new")]
pub fn raw_sched_wakeup_new(ctx: RawTracePointContext) -> i32 {
    raw_wakeup(&ctx, true)
}

/// Fires in the parent while it creates a task; only here are `clone_flags`
/// visible, which tell a new thread of the group from a new process.
#[tracepoint(category = "task", name = "task_newtask")]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let (parent_tid, parent_tgid) = current();
    if !is_target(parent_tgid) {
        return 0;
    }
    let (Some(child_tid), Some(clone_flags), Some(comm)) = (
        read::<u32>(&ctx, tp::NEWTASK_PID),
        read::<u64>(&ctx, tp::NEWTASK_CLONE_FLAGS),
        read::<[u8; COMM_LEN]>(&ctx, tp::NEWTASK_COMM),
    ) else {
        return 0;
    };
    if clone_flags & CLONE_THREAD != 0 {
        track(child_tid, parent_tgid);
    }
    if !is_recording(parent_tgid) {
        return 0;
    }
    emit(TaskNew {
        header: header(RecordKind::TaskNew, size_of::<TaskNew>()),
        parent_tid,
        parent_tgid,
        child_tid,
        _pad: 0,
        clone_flags,
        comm,
    });
    0
}

#[tracepoint(category = "sched", name = "sched_process_fork")]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let (parent_tid, parent_tgid) = current();
    if !is_recording(parent_tgid) {
        return 0;
    }
    let Some(child_tid) = read::<u32>(&ctx, tp::FORK_CHILD_PID) else {
        return 0;
    };
    emit(ProcessFork {
        header: header(RecordKind::ProcessFork, size_of::<ProcessFork>()),
        parent_tid,
        parent_tgid,
        child_tid,
        is_thread: (tracked_tgid(child_tid) == parent_tgid) as u32,
    });
    0
}

#[tracepoint(category = "sched", name = "sched_process_exit")]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    let (tid, tgid) = current();
    if !is_target(tgid) {
        return 0;
    }
    // SAFETY: globals are read-only after load.
    let group_dead = if unsafe { core::ptr::read_volatile(&EXIT_HAS_GROUP_DEAD) } != 0 {
        read::<u8>(&ctx, tp::EXIT_GROUP_DEAD).unwrap_or(0) as u32
    } else {
        2
    };
    let comm = aya_ebpf::helpers::bpf_get_current_comm().unwrap_or([0; COMM_LEN]);
    track(tid, 0);
    if !is_recording(tgid) {
        return 0;
    }
    emit(TaskExit {
        header: header(RecordKind::TaskExit, size_of::<TaskExit>()),
        tid,
        tgid,
        group_dead,
        _pad: 0,
        comm,
    });
    0
}

#[tracepoint(category = "task", name = "task_rename")]
pub fn task_rename(ctx: TracePointContext) -> u32 {
    let Some(tid) = read::<u32>(&ctx, tp::RENAME_PID) else {
        return 0;
    };
    let tgid = tracked_tgid(tid);
    if !is_recording(tgid) {
        return 0;
    }
    let Some(comm) = read::<[u8; COMM_LEN]>(&ctx, tp::RENAME_NEWCOMM) else {
        return 0;
    };
    emit(TaskRename {
        header: header(RecordKind::TaskRename, size_of::<TaskRename>()),
        tid,
        tgid,
        comm,
    });
    0
}
