//! ebtrace's kernel-side programs, one module per probe family; this file
//! holds the maps and helpers they share.
//!
//! Every program keeps one invariant: it writes at most one record per
//! event, and only for tasks of a traced process, so the cost for the rest
//! of the system is one or two hash lookups.
#![no_std]
#![no_main]

mod cpu_sample;
mod cuda;
mod off_cpu;
mod python;
mod sched;
mod traceme;

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use tracer_common::{MAX_TARGETS, MAX_TRACKED_TIDS, RecordHeader, RecordKind, stat};

#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(16 * 1024 * 1024, 0);

#[map]
static TARGET_TGIDS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TARGETS, 0);

/// Indexed by tid: a lookup costs a bounds check, where a hash lookup on
/// every switch and wake-up cost tens of nanoseconds.
#[map]
pub(crate) static TRACKED_TIDS: Array<u32> = Array::with_max_entries(MAX_TRACKED_TIDS, 0);

/// A bitmap of the processes whose events are recorded now (see
/// `tracer_common::names::RECORDING_TGIDS`); an array lookup the verifier
/// inlines, so gating every event costs a few instructions.
#[map]
static RECORDING_TGIDS: Array<u64> = Array::with_max_entries(MAX_TRACKED_TIDS / 64, 0);

/// The processes whose driver calls are recorded now (see
/// `tracer_common::names::DRIVER_CALL_TGIDS`), a bitmap like the one above.
#[map]
static DRIVER_CALL_TGIDS: Array<u64> = Array::with_max_entries(MAX_TRACKED_TIDS / 64, 0);

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

/// Set by userspace before load (see `tracer_common::names`).
#[unsafe(no_mangle)]
static WAKEUP_THRESHOLD: u64 = 4 * 1024 * 1024;
#[unsafe(no_mangle)]
pub(crate) static EXIT_HAS_GROUP_DEAD: u32 = 1;
/// `task_struct` offsets for the raw tracepoints, from the kernel's BTF.
#[unsafe(no_mangle)]
pub(crate) static TASK_PID_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
pub(crate) static TASK_EXIT_STATE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
pub(crate) static TASK_CPU_OFFSET: u32 = 0;

#[inline(always)]
pub(crate) fn bump(index: u32) {
    let _ = bump_to(index);
}

/// Adds one to a counter of this CPU; returns its new value.
#[inline(always)]
fn bump_to(index: u32) -> u64 {
    match STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, programs do not migrate while running.
        Some(v) => unsafe {
            *v += 1;
            *v
        },
        None => 0,
    }
}

/// The ring's fill level is looked at once per this many records a CPU
/// submits: asking costs a helper call per event, and the threshold leaves
/// room for far more.
const WAKEUP_CHECK_EVERY: u64 = 64;

/// Reserves, fills and submits one record; counts the outcome.
///
/// Submits never wake the reader unless the ring is past `WAKEUP_THRESHOLD`:
/// waking it on every `sched_switch` would itself cause switches, a
/// feedback loop. The reader also drains on a timer.
#[inline(always)]
pub(crate) fn emit<T: 'static>(record: T) {
    match EVENTS.reserve::<T>(0) {
        Some(mut entry) => {
            entry.write(record);
            entry.submit(count_submit());
        }
        None => bump(stat::DROPPED_RINGBUF_FULL),
    }
}

/// Counts one more record submitted and returns the flags to submit it
/// with: wake the reader only past the fill threshold (see [`emit`]),
/// checked every [`WAKEUP_CHECK_EVERY`] records.
#[inline(always)]
pub(crate) fn count_submit() -> u64 {
    submit_flags(bump_to(stat::SUBMITTED))
}

/// [`count_submit`] for a large record (a stack sample with its copy of
/// the stack): the fill level is looked at for each, as a few of them
/// fill the ring faster than [`WAKEUP_CHECK_EVERY`] small ones.
#[inline(always)]
pub(crate) fn count_large_submit() -> u64 {
    bump(stat::SUBMITTED);
    wakeup_flags()
}

/// The flags for the `n`th record this CPU submits.
#[inline(always)]
fn submit_flags(n: u64) -> u64 {
    if !n.is_multiple_of(WAKEUP_CHECK_EVERY) {
        return BPF_RB_NO_WAKEUP as u64;
    }
    wakeup_flags()
}

/// Wake the reader if the ring is past `WAKEUP_THRESHOLD`.
#[inline(always)]
fn wakeup_flags() -> u64 {
    // SAFETY: globals are read-only after load.
    let threshold = unsafe { core::ptr::read_volatile(&WAKEUP_THRESHOLD) };
    let flags = if EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= threshold {
        bump(stat::FORCED_WAKEUPS);
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    flags as u64
}

/// Like [`emit`], for a record whose size is only known at run time
/// (at most the size of the map value it is copied from).
#[inline(always)]
pub(crate) fn emit_bytes(record: &[u8]) {
    let submitted = match STATS.get_ptr(stat::SUBMITTED) {
        // SAFETY: per-CPU slot, programs do not migrate while running.
        Some(v) => (unsafe { *v }) + 1,
        None => 0,
    };
    match EVENTS.output::<[u8]>(record, submit_flags(submitted)) {
        Ok(()) => bump(stat::SUBMITTED),
        Err(_) => bump(stat::DROPPED_RINGBUF_FULL),
    }
}

#[inline(always)]
pub(crate) fn header(kind: RecordKind, size: usize) -> RecordHeader {
    // SAFETY: plain helper calls without pointer arguments.
    let (cpu, ts) = unsafe { (bpf_get_smp_processor_id(), bpf_ktime_get_ns()) };
    RecordHeader::new(kind, size, cpu, ts)
}

#[inline(always)]
pub(crate) fn is_target(tgid: u32) -> bool {
    tgid != 0 && TARGET_TGIDS.get_ptr(tgid).is_some()
}

/// Whether the driver calls of a traced process are recorded (its capture
/// window is open).
#[inline(always)]
pub(crate) fn records_driver_calls(tgid: u32) -> bool {
    has_bit(&DRIVER_CALL_TGIDS, tgid)
}

/// Whether the events of process `tgid` are recorded now.
#[inline(always)]
pub(crate) fn is_recording(tgid: u32) -> bool {
    has_bit(&RECORDING_TGIDS, tgid)
}

/// Whether `tgid`'s bit is set in a bitmap of tgids.
#[inline(always)]
fn has_bit(bitmap: &Array<u64>, tgid: u32) -> bool {
    if tgid == 0 {
        return false;
    }
    match bitmap.get(tgid / 64) {
        Some(word) => *word & (1u64 << (tgid % 64)) != 0,
        None => false,
    }
}

#[inline(always)]
pub(crate) fn tracked_tgid(tid: u32) -> u32 {
    if tid == 0 {
        return 0;
    }
    TRACKED_TIDS.get(tid).copied().unwrap_or(0)
}

/// Records that `tid` belongs to `tgid` (0: to no traced process).
#[inline(always)]
pub(crate) fn track(tid: u32, tgid: u32) {
    match TRACKED_TIDS.get_ptr_mut(tid) {
        // SAFETY: pointer into a live map value; a racing writer writes
        // the same thread's group.
        Some(slot) => unsafe {
            if *slot != tgid {
                *slot = tgid;
            }
        },
        None => bump(stat::DROPPED_TRACK_FULL),
    }
}

#[inline(always)]
pub(crate) fn current() -> (u32, u32) {
    let id = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    (id as u32, (id >> 32) as u32)
}

#[inline(always)]
pub(crate) fn read<T>(ctx: &TracePointContext, offset: usize) -> Option<T> {
    // SAFETY: offsets are checked against tracefs by userspace before load.
    unsafe { ctx.read_at::<T>(offset) }.ok()
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
