//! Records shared by ebtrace's eBPF programs and its userspace collector.
//!
//! Every record written into the `EVENTS` ring buffer starts with a
//! [`RecordHeader`] whose `kind` says which struct follows and whose `size`
//! is the size of the whole record, so the reader can check it before it
//! reinterprets the bytes. Records are `#[repr(C)]`, padded by hand to a
//! multiple of 8 bytes, and never change layout without a new `kind`.
//!
//! Timestamps are `bpf_ktime_get_ns()`, i.e. `CLOCK_MONOTONIC` nanoseconds;
//! userspace converts them to wall-clock time in one place (`ClockSync`).
#![warn(missing_docs)]
#![no_std]

pub mod cuda;
pub mod python;
pub mod stack;
pub mod traceme;

pub use traceme::TraceMeRecord;

/// Names of the maps and globals defined by the eBPF object.
pub mod names {
    /// Ring buffer every program writes its records into.
    pub const EVENTS: &str = "EVENTS";
    /// Thread-group ids (processes) being traced: `u32 tgid -> u32 1`.
    pub const TARGET_TGIDS: &str = "TARGET_TGIDS";
    /// Threads known to belong to a traced process: an array indexed by
    /// tid, holding the thread's tgid (0: not traced). Sized to the
    /// kernel's `pid_max` at load.
    pub const TRACKED_TIDS: &str = "TRACKED_TIDS";
    /// Processes whose events are recorded now: a bitmap of tgids (bit
    /// `tgid % 64` of word `tgid / 64`), sized to the kernel's `pid_max`
    /// at load. A traced process whose bit is clear is still followed
    /// (its new threads tracked) but writes nothing: probes kept attached
    /// between captures cost no ring-buffer space.
    pub const RECORDING_TGIDS: &str = "RECORDING_TGIDS";
    /// Processes whose driver calls are recorded now: a bitmap like
    /// [`RECORDING_TGIDS`], a process's bit set when its capture window
    /// opens, so that calls made while the probes attach do not fill the
    /// ring buffer with events the window cuts anyway. Every driver call
    /// asks it, so it is an array the verifier inlines, not a hash.
    pub const DRIVER_CALL_TGIDS: &str = "DRIVER_CALL_TGIDS";
    /// Per-CPU outcome counters, indexed by [`crate::stat`].
    pub const STATS: &str = "STATS";
    /// Global `u64`: fill level (bytes) of `EVENTS` past which a submit wakes the reader.
    pub const WAKEUP_THRESHOLD: &str = "WAKEUP_THRESHOLD";
    /// Global `u32`: 1 if `sched_process_exit` has the `group_dead` field.
    pub const EXIT_HAS_GROUP_DEAD: &str = "EXIT_HAS_GROUP_DEAD";
    /// Global `u32`: byte offset of `pid` in `task_struct` (raw tracepoints).
    pub const TASK_PID_OFFSET: &str = "TASK_PID_OFFSET";
    /// Global `u32`: byte offset of `exit_state` in `task_struct`.
    pub const TASK_EXIT_STATE_OFFSET: &str = "TASK_EXIT_STATE_OFFSET";
    /// Global `u32`: byte offset of the last CPU in `task_struct`.
    pub const TASK_CPU_OFFSET: &str = "TASK_CPU_OFFSET";
}

/// Indices into the per-CPU `STATS` array.
pub mod stat {
    /// Records submitted to the ring buffer.
    pub const SUBMITTED: u32 = 0;
    /// Records lost because the ring buffer was full.
    pub const DROPPED_RINGBUF_FULL: u32 = 1;
    /// New threads that could not be tracked: their tid is past the
    /// `TRACKED_TIDS` array (`pid_max` was raised after loading).
    pub const DROPPED_TRACK_FULL: u32 = 2;
    /// Submits that forced a reader wake-up (fill level past the threshold).
    pub const FORCED_WAKEUPS: u32 = 3;
    /// Number of counters.
    pub const COUNT: u32 = 4;
}

/// Size of `TRACKED_TIDS` in the object; set to `pid_max` at load.
pub const MAX_TRACKED_TIDS: u32 = 32_768;
/// Capacity of `TARGET_TGIDS` (processes traced at once).
pub const MAX_TARGETS: u32 = 1_024;

/// `TARGET_TGIDS` values: bits of what the programs do for a process.
pub mod target {
    /// Its threads are followed (from the start of the attach). What is
    /// recorded of it is gated by `RECORDING_TGIDS` and
    /// `DRIVER_CALL_TGIDS`.
    pub const FOLLOWED: u32 = 1;
}

/// Tracepoint fields the eBPF programs read, as (category, event, field,
/// byte offset). Userspace checks them against tracefs `format` files before
/// loading, so a kernel with another layout fails with a clear message
/// instead of yielding garbage.
pub const TRACEPOINT_FIELDS: &[(&str, &str, &str, usize)] = &[
    ("sched", "sched_switch", "prev_pid", tp::SWITCH_PREV_PID),
    ("sched", "sched_switch", "prev_state", tp::SWITCH_PREV_STATE),
    ("sched", "sched_switch", "next_pid", tp::SWITCH_NEXT_PID),
    ("sched", "sched_waking", "pid", tp::WAKEUP_PID),
    ("sched", "sched_waking", "target_cpu", tp::WAKEUP_TARGET_CPU),
    ("sched", "sched_wakeup_new", "pid", tp::WAKEUP_PID),
    (
        "sched",
        "sched_wakeup_new",
        "target_cpu",
        tp::WAKEUP_TARGET_CPU,
    ),
    (
        "sched",
        "sched_process_fork",
        "child_pid",
        tp::FORK_CHILD_PID,
    ),
    ("sched", "sched_process_exit", "pid", tp::EXIT_PID),
    ("task", "task_newtask", "pid", tp::NEWTASK_PID),
    ("task", "task_newtask", "comm", tp::NEWTASK_COMM),
    (
        "task",
        "task_newtask",
        "clone_flags",
        tp::NEWTASK_CLONE_FLAGS,
    ),
    ("task", "task_rename", "pid", tp::RENAME_PID),
    ("task", "task_rename", "newcomm", tp::RENAME_NEWCOMM),
];

/// Byte offsets of tracepoint fields (stable since Linux 4.x; checked at start-up).
pub mod tp {
    /// `sched_switch`: `prev_pid`, the tid switched out.
    pub const SWITCH_PREV_PID: usize = 24;
    /// `sched_switch`: `prev_state` (see [`crate::SchedSwitch::prev_state`]).
    pub const SWITCH_PREV_STATE: usize = 32;
    /// `sched_switch`: `next_pid`, the tid switched in.
    pub const SWITCH_NEXT_PID: usize = 56;
    /// `sched_waking` and `sched_wakeup_new`: `pid`, the woken tid.
    pub const WAKEUP_PID: usize = 24;
    /// `sched_waking` and `sched_wakeup_new`: `target_cpu`.
    pub const WAKEUP_TARGET_CPU: usize = 32;
    /// `sched_process_fork`: `child_pid`, the new task's tid.
    pub const FORK_CHILD_PID: usize = 20;
    /// `sched_process_exit`: `pid`, the exiting tid.
    pub const EXIT_PID: usize = 24;
    /// `group_dead` exists since Linux 6.9 only; see [`crate::names::EXIT_HAS_GROUP_DEAD`].
    pub const EXIT_GROUP_DEAD: usize = 32;
    /// `task_newtask`: `pid`, the new task's tid.
    pub const NEWTASK_PID: usize = 8;
    /// `task_newtask`: `comm`, the new task's name.
    pub const NEWTASK_COMM: usize = 12;
    /// `task_newtask`: `clone_flags`.
    pub const NEWTASK_CLONE_FLAGS: usize = 32;
    /// `task_rename`: `pid`, the renamed tid.
    pub const RENAME_PID: usize = 8;
    /// `task_rename`: `newcomm`, the new name.
    pub const RENAME_NEWCOMM: usize = 28;
}

/// Length of a kernel task name (`TASK_COMM_LEN`).
pub const COMM_LEN: usize = 16;

/// `clone(2)` flag that makes the new task a thread of the caller's group.
pub const CLONE_THREAD: u64 = 0x0001_0000;

/// Which record follows a [`RecordHeader`].
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A context switch ([`SchedSwitch`]). 1 and 2 were the 40-byte
    /// layouts of the switch and the wake-up.
    SchedSwitch = 9,
    /// A wake-up ([`SchedWakeup`]).
    SchedWakeup = 10,
    /// A task created by a traced thread ([`TaskNew`]).
    TaskNew = 3,
    /// A fork or clone by a traced thread ([`ProcessFork`]).
    ProcessFork = 4,
    /// A traced thread's exit ([`TaskExit`]).
    TaskExit = 5,
    /// A traced thread's new name ([`TaskRename`]).
    TaskRename = 6,
    /// A completed CUDA driver call ([`cuda::CudaCall`]).
    CudaCall = 20,
    /// A kernel handle and its name ([`cuda::CudaSymbol`]).
    CudaSymbol = 21,
    /// A [`TraceMeRecord`] (variable size).
    TraceMe = 7,
    /// A CPU stack sample ([`stack::StackSampleWithCopy`]).
    StackSample = 8,
}

impl RecordKind {
    /// The kind whose discriminant is `v`; `None` for one unknown or retired.
    pub const fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            9 => Self::SchedSwitch,
            10 => Self::SchedWakeup,
            3 => Self::TaskNew,
            4 => Self::ProcessFork,
            5 => Self::TaskExit,
            6 => Self::TaskRename,
            20 => Self::CudaCall,
            21 => Self::CudaSymbol,
            7 => Self::TraceMe,
            8 => Self::StackSample,
            _ => return None,
        })
    }
}

/// Common prefix of every record (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RecordHeader {
    /// A [`RecordKind`] discriminant.
    pub kind: u16,
    /// Size in bytes of the whole record, header included.
    pub size: u16,
    /// CPU the program ran on.
    pub cpu: u16,
    /// A small field of the record's own, here so that the most frequent
    /// records, switches and wake-ups, take 32 bytes: see
    /// [`SchedSwitch::prev_state`] and [`SchedWakeup::target_cpu`]; 0 in
    /// the others.
    pub detail: u16,
    /// `CLOCK_MONOTONIC` nanoseconds.
    pub ts_ns: u64,
}

impl RecordHeader {
    /// The header of a `kind` record of `size` bytes written on `cpu` at
    /// `ts_ns`, its `detail` 0.
    pub const fn new(kind: RecordKind, size: usize, cpu: u32, ts_ns: u64) -> Self {
        Self {
            kind: kind as u16,
            size: size as u16,
            cpu: cpu as u16,
            detail: 0,
            ts_ns,
        }
    }
}

/// `sched:sched_switch` where the previous or the next task is traced.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SchedSwitch {
    /// Its `detail` is the tracepoint's `prev_state`.
    pub header: RecordHeader,
    /// Thread switched out (the current one when the tracepoint fired);
    /// 0 for the idle task.
    pub prev_tid: u32,
    /// Thread group of `prev_tid` if it is traced, else 0.
    pub prev_tgid: u32,
    /// Thread switched in; 0 for the idle task.
    pub next_tid: u32,
    /// Thread group of `next_tid` if it is traced, else 0.
    pub next_tgid: u32,
}

impl SchedSwitch {
    /// The tracepoint's `prev_state`: 0 = still runnable, [`PREEMPTED`]
    /// = preempted, else one bit per reported task state (S, D, T, ...):
    /// never past `PREEMPTED`, so it fits the header's `detail`.
    pub const fn prev_state(&self) -> u64 {
        self.header.detail as u64
    }
}

/// `prev_state` value the kernel reports for a preempted task (`TASK_REPORT_MAX`).
pub const PREEMPTED: u64 = 0x100;

/// `sched:sched_waking` / `sched:sched_wakeup_new` of a traced thread.
///
/// `sched_waking` rather than `sched_wakeup`: it fires in the waker's
/// context, while `sched_wakeup` of a remote wake-up fires on the woken
/// task's CPU, in whatever task runs there.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SchedWakeup {
    /// Its `detail` is the target CPU, with [`WAKEUP_NEW`] set for
    /// `sched_wakeup_new`.
    pub header: RecordHeader,
    /// Woken thread.
    pub tid: u32,
    /// Thread group of `tid`: a recorded process (no other's wake-ups are
    /// written).
    pub tgid: u32,
    /// Task that issued the wake-up (the current task when the tracepoint
    /// fired; for a wake-up from an interrupt, the task it interrupted).
    pub waker_tid: u32,
    /// Thread group of `waker_tid`, traced or not.
    pub waker_tgid: u32,
}

/// The bit of a wake-up's `detail` set for `sched_wakeup_new` (the first
/// wake-up of a new task).
pub const WAKEUP_NEW: u16 = 0x8000;

impl SchedWakeup {
    /// The header's `detail` of a wake-up of a task to `target_cpu`.
    pub const fn detail(target_cpu: u32, new: bool) -> u16 {
        (target_cpu as u16 & !WAKEUP_NEW) | if new { WAKEUP_NEW } else { 0 }
    }

    /// For `sched_waking`, the CPU the task last ran on; for
    /// `sched_wakeup_new`, the CPU it was placed on.
    pub const fn target_cpu(&self) -> u32 {
        (self.header.detail & !WAKEUP_NEW) as u32
    }

    /// A `sched_wakeup_new`: the first wake-up of a new task.
    pub const fn is_new(&self) -> bool {
        self.header.detail & WAKEUP_NEW != 0
    }
}

// The two records of a scheduling flood: 32 bytes each.
const _: () = assert!(size_of::<SchedSwitch>() == 32 && size_of::<SchedWakeup>() == 32);

/// `task:task_newtask` called by a traced thread.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TaskNew {
    /// Written in the parent as it creates the task.
    pub header: RecordHeader,
    /// Thread creating the task (the current one).
    pub parent_tid: u32,
    /// Thread group of `parent_tid`: a recorded process.
    pub parent_tgid: u32,
    /// The new task's tid (its pid, if it is a new process).
    pub child_tid: u32,
    /// Explicit padding, 0: records have no implicit padding.
    pub _pad: u32,
    /// The `clone(2)` flags; [`CLONE_THREAD`] set for a new thread of the
    /// parent's group.
    pub clone_flags: u64,
    /// The new task's name (its parent's, copied at creation),
    /// NUL-terminated.
    pub comm: [u8; COMM_LEN],
}

/// `sched:sched_process_fork` called by a traced thread.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessFork {
    /// Written in the parent once the child is created.
    pub header: RecordHeader,
    /// Thread that forked or cloned (the current one).
    pub parent_tid: u32,
    /// Thread group of `parent_tid`: a recorded process.
    pub parent_tgid: u32,
    /// The new task's tid (its pid, if it is a new process).
    pub child_tid: u32,
    /// 1 if the child joined the parent's thread group (and is now tracked).
    pub is_thread: u32,
}

/// `sched:sched_process_exit` of a traced thread.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TaskExit {
    /// Written by the exiting thread.
    pub header: RecordHeader,
    /// Exiting thread (the current one).
    pub tid: u32,
    /// Thread group of `tid`: a recorded process.
    pub tgid: u32,
    /// 1 if this was the last thread of its group (the process is gone);
    /// 2 if the kernel does not say (no `group_dead` field).
    pub group_dead: u32,
    /// Explicit padding, 0: records have no implicit padding.
    pub _pad: u32,
    /// The thread's name as it exits, NUL-terminated (zeros if it could
    /// not be read).
    pub comm: [u8; COMM_LEN],
}

/// `task:task_rename` of a traced thread (e.g. `pthread_setname_np`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TaskRename {
    /// Written by the renamed thread or, through its `/proc` `comm` file,
    /// by another thread of its process.
    pub header: RecordHeader,
    /// Renamed thread.
    pub tid: u32,
    /// Thread group of `tid`: a recorded process.
    pub tgid: u32,
    /// The new name, NUL-terminated.
    pub comm: [u8; COMM_LEN],
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: `RecordHeader` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for RecordHeader {}
    // SAFETY: `SchedSwitch` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for SchedSwitch {}
    // SAFETY: `SchedWakeup` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for SchedWakeup {}
    // SAFETY: `TaskNew` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for TaskNew {}
    // SAFETY: `ProcessFork` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for ProcessFork {}
    // SAFETY: `TaskExit` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for TaskExit {}
    // SAFETY: `TaskRename` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for TaskRename {}
    // SAFETY: `TraceMeRecord` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for TraceMeRecord {}
    // SAFETY: `PythonProcess` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for crate::python::PythonProcess {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_are_padded_to_8_bytes() {
        assert_eq!(size_of::<RecordHeader>(), 16);
        assert_eq!(size_of::<SchedSwitch>(), 32);
        assert_eq!(size_of::<SchedWakeup>(), 32);
        assert_eq!(size_of::<TaskNew>(), 56);
        assert_eq!(size_of::<ProcessFork>(), 32);
        assert_eq!(size_of::<TaskExit>(), 48);
        assert_eq!(size_of::<TaskRename>(), 40);
        assert_eq!(size_of::<python::PythonProcess>(), 40);
        assert_eq!(size_of::<python::PythonFrameRecord>(), 24);
        assert_eq!(traceme::TRACEME_PREFIX, 56);
        assert_eq!(size_of::<TraceMeRecord>(), 56 + traceme::NAME_CAP);
        assert_eq!(
            size_of::<python::PythonStack>(),
            16 + 24 * python::MAX_PYTHON_FRAMES
        );
        assert_eq!(
            size_of::<stack::StackSampleRecord>(),
            40 + 2 * 8 * stack::MAX_FRAMES + 32 + size_of::<python::PythonStack>()
        );
        assert_eq!(
            size_of::<stack::StackSampleWithCopy>(),
            size_of::<stack::StackSampleRecord>() + stack::STACK_COPY_BYTES
        );
        assert_eq!(traceme::traceme_record_size(0), 56);
        assert_eq!(traceme::traceme_record_size(1), 64);
        assert_eq!(
            traceme::traceme_record_size(traceme::NAME_CAP),
            size_of::<TraceMeRecord>()
        );
    }

    #[test]
    fn kinds_round_trip() {
        for k in (3..=10u16).chain([20, 21]) {
            assert_eq!(RecordKind::from_u16(k).map(|k| k as u16), Some(k));
        }
        // 1 and 2 were the switch's and the wake-up's 40-byte layouts.
        for gone in [0, 1, 2, 11, 19, 22] {
            assert!(RecordKind::from_u16(gone).is_none(), "{gone}");
        }
    }
}
