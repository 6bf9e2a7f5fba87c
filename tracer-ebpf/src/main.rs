//! ebtrace's kernel-side programs.
//!
//! Scheduling tracepoints, filtered in the kernel to the traced thread
//! groups. Every program keeps one invariant: it writes at most one record,
//! and only for tasks of a traced process, so the cost for the rest of the
//! system is one or two hash lookups.
//!
//! Thread membership: `TARGET_TGIDS` holds the traced processes; the current
//! task's group is known from `bpf_get_current_pid_tgid`, but the *next* task
//! of a switch and the woken task of a wake-up are only tids, so
//! `TRACKED_TIDS` maps every thread of a traced process to its group. It is
//! seeded from `/proc` by userspace and kept up to date here: new threads in
//! `task_newtask` (which sees `clone_flags`), exits in `sched_process_exit`,
//! and any traced thread seen running that userspace missed.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{BPF_NOEXIST, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use tracer_common::{
    CLONE_THREAD, COMM_LEN, MAX_TARGETS, MAX_TRACKED_TIDS, ProcessFork, RecordHeader, RecordKind,
    SchedSwitch, SchedWakeup, TaskExit, TaskNew, TaskRename, WAKEUP_NEW, stat, tp,
};

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(16 * 1024 * 1024, 0);

#[map]
static TARGET_TGIDS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TARGETS, 0);

#[map]
static TRACKED_TIDS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TRACKED_TIDS, 0);

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

/// Set by userspace before load (see `tracer_common::names`).
#[unsafe(no_mangle)]
static WAKEUP_THRESHOLD: u64 = 4 * 1024 * 1024;
#[unsafe(no_mangle)]
static EXIT_HAS_GROUP_DEAD: u32 = 1;

#[inline(always)]
fn bump(index: u32) {
    if let Some(v) = STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, programs do not migrate while running.
        unsafe { *v += 1 };
    }
}

/// Reserves, fills and submits one record; counts the outcome.
///
/// Submits never wake the reader unless the ring is past `WAKEUP_THRESHOLD`:
/// waking it on every `sched_switch` would itself cause switches, a
/// feedback loop. The reader also drains on a timer.
#[inline(always)]
fn emit<T: 'static>(record: T) {
    match EVENTS.reserve::<T>(0) {
        Some(mut entry) => {
            entry.write(record);
            // SAFETY: globals are read-only after load.
            let threshold = unsafe { core::ptr::read_volatile(&WAKEUP_THRESHOLD) };
            let flags = if EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= threshold {
                bump(stat::FORCED_WAKEUPS);
                BPF_RB_FORCE_WAKEUP
            } else {
                BPF_RB_NO_WAKEUP
            };
            entry.submit(flags as u64);
            bump(stat::SUBMITTED);
        }
        None => bump(stat::DROPPED_RINGBUF_FULL),
    }
}

#[inline(always)]
fn header(kind: RecordKind, size: usize) -> RecordHeader {
    // SAFETY: plain helper calls without pointer arguments.
    let (cpu, ts) = unsafe { (bpf_get_smp_processor_id(), bpf_ktime_get_ns()) };
    RecordHeader::new(kind, size, cpu, ts)
}

#[inline(always)]
fn is_target(tgid: u32) -> bool {
    tgid != 0 && TARGET_TGIDS.get_ptr(tgid).is_some()
}

#[inline(always)]
fn tracked_tgid(tid: u32) -> u32 {
    if tid == 0 {
        return 0;
    }
    match TRACKED_TIDS.get_ptr(tid) {
        // SAFETY: pointer into a live map value.
        Some(tgid) => unsafe { *tgid },
        None => 0,
    }
}

#[inline(always)]
fn track(tid: u32, tgid: u32) {
    if TRACKED_TIDS.get_ptr(tid).is_none()
        && TRACKED_TIDS.insert(tid, tgid, BPF_NOEXIST as u64).is_err()
        && TRACKED_TIDS.get_ptr(tid).is_none()
    {
        bump(stat::DROPPED_TRACK_FULL);
    }
}

#[inline(always)]
fn current() -> (u32, u32) {
    let id = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    (id as u32, (id >> 32) as u32)
}

#[inline(always)]
fn read<T>(ctx: &TracePointContext, offset: usize) -> Option<T> {
    // SAFETY: offsets are checked against tracefs by userspace before load.
    unsafe { ctx.read_at::<T>(offset) }.ok()
}

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
    let prev_tgid = if prev_tid != 0 && is_target(current_tgid) {
        track(prev_tid, current_tgid);
        current_tgid
    } else {
        0
    };
    let next_tgid = tracked_tgid(next_tid);
    if prev_tgid == 0 && next_tgid == 0 {
        return 0;
    }
    emit(SchedSwitch {
        header: header(RecordKind::SchedSwitch, size_of::<SchedSwitch>()),
        prev_tid,
        prev_tgid,
        next_tid,
        next_tgid,
        prev_state,
    });
    0
}

#[inline(always)]
fn wakeup(ctx: &TracePointContext, flags: u32) -> u32 {
    let (Some(tid), Some(target_cpu)) = (
        read::<u32>(ctx, tp::WAKEUP_PID),
        read::<u32>(ctx, tp::WAKEUP_TARGET_CPU),
    ) else {
        return 0;
    };
    let tgid = tracked_tgid(tid);
    if tgid == 0 {
        return 0;
    }
    let (waker_tid, waker_tgid) = current();
    emit(SchedWakeup {
        header: header(RecordKind::SchedWakeup, size_of::<SchedWakeup>()),
        tid,
        tgid,
        waker_tid,
        waker_tgid,
        target_cpu,
        flags,
    });
    0
}

#[tracepoint(category = "sched", name = "sched_wakeup")]
pub fn sched_wakeup(ctx: TracePointContext) -> u32 {
    wakeup(&ctx, 0)
}

#[tracepoint(category = "sched", name = "sched_wakeup_new")]
pub fn sched_wakeup_new(ctx: TracePointContext) -> u32 {
    wakeup(&ctx, WAKEUP_NEW)
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
    if !is_target(parent_tgid) {
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
    let _ = TRACKED_TIDS.remove(tid);
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
    if tgid == 0 {
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
