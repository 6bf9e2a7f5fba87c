//! The timeline model: what happened to each traced thread and CPU, in
//! `CLOCK_MONOTONIC` nanoseconds, independent of any output format.
//!
//! Sources (the scheduler records; other probes and in-process data) fill
//! it, sinks (`sink::xspace`) read it. Per thread it keeps:
//! - `slices`: a partition of the thread's life into scheduling states
//!   (running, runnable, blocked), consecutive and non-overlapping;
//! - `marks`: instants (wake-ups issued, threads created, exit);
//! - `spans`: named intervals from other sources (e.g. TraceMe ranges or
//!   driver calls, and CPU stack samples as instants) that nest among
//!   themselves; sinks lay them above the scheduling states.
//!
//! States and marks are the bulk of a capture's memory: each is stored in
//! eight bytes (module `packed`), a wake-up naming the other thread by its
//! number in the timeline's [`peers`](Timeline::peers).
//!
//! The per-CPU lines are the running states seen from each CPU, read out
//! of the threads when written (see [`Timeline::cpu_lines`]).
//!
//! Per GPU (`devices`) it keeps the work the host submitted to each stream
//! (see [`cuda`]); a framework's own planes ride along (see [`framework`]).
//! A trace shows the part of it a [`Window`] selects. [`assemble`] is the
//! one path from what a capture recorded to the timeline of a window.

#[cfg(test)]
pub(crate) mod arbitrary;
pub mod assemble;
mod cpu_lines;
pub mod cpu_samples;
pub mod cuda;
pub mod framework;
pub mod gpu_activity;
pub mod launch_stacks;
pub mod launching_ops;
pub mod nest;
mod order;
mod packed;
mod peers;
mod sched;
mod sources;
mod stats;
pub mod streamed;
mod texts;
pub mod torch_ops;
pub mod traceme;
pub mod window;

use std::{collections::BTreeMap, num::NonZeroU64};

pub use assemble::{Sources, TraceMeInput, assemble};
pub use cpu_lines::{CpuLine, CpuLines};
pub use cuda::{CudaTimelineBuilder, DeviceTrack, StreamTiming, StreamTrack};
pub use framework::{
    CarriedPlane, DecodeBudget, FrameworkMerge, MAX_DECODED_FRAMEWORK_BYTES, merge_framework_space,
};
pub use gpu_activity::{ActivityMerge, merge_device_activity};
pub use nest::{Cuts, Nestable, nest};
pub use order::RecordInput;
use packed::{PackedMark, PackedState};
pub use peers::{Peer, PeerId, PeerTable, peer_in};
pub use sched::{InitialState, SchedTimelineBuilder};
pub use sources::{PythonStacks, SourceStats, TraceMeSource};
pub use stats::{Stat, Stats};
pub use texts::SharedTexts;
pub use traceme::{TraceMeSpanStats, add_traceme_spans};
pub use window::{EventLimitFrom, Window};

use crate::clock::ClockSync;

/// Links a wake-up to the slice of the thread it woke, numbered from 1 in
/// each timeline. 32 bits (and never 0, which leaves `Option<FlowId>` as
/// small): a capture's slices are the bulk of its memory.
pub type FlowId = std::num::NonZeroU32;

/// The state of a thread between two scheduler events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadState {
    /// On a CPU.
    Running {
        /// The CPU's number.
        cpu: u32,
    },
    /// Ready to run, waiting for a CPU.
    Runnable {
        /// How it became runnable.
        cause: RunnableCause,
    },
    /// Off the run queue: sleeping, waiting for I/O, stopped...
    Blocked {
        /// The task state the kernel reported.
        state: TaskState,
    },
    /// The kernel delivered no scheduler event that explains this interval
    /// (seen on some virtual machines, for every BPF tracer alike): the
    /// thread was switched out, then seen switching out again.
    Unknown,
    /// On a CPU in a stretch the kernel reported no switch for, as the
    /// thread's own stack samples show: the part of an [`Unknown`]
    /// interval from its first sample to the reported switch-out that
    /// ended it (or from the reported switch-in that began it to its last
    /// sample), or from the first sample to the last of an interval the
    /// kernel showed off a CPU (both switches of that run went unreported).
    ///
    /// [`Unknown`]: ThreadState::Unknown
    Sampled {
        /// The CPU of its sample nearest the reported switch.
        cpu: u32,
    },
}

impl ThreadState {
    /// The CPU the thread was on, if it was on one.
    #[inline]
    pub fn on_cpu(self) -> Option<u32> {
        match self {
            ThreadState::Running { cpu } | ThreadState::Sampled { cpu } => Some(cpu),
            _ => None,
        }
    }
}

/// Why a thread became runnable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunnableCause {
    /// Switched out while still runnable (the scheduler preempted it).
    Preempted,
    /// Gave up the CPU while runnable (e.g. `sched_yield`).
    Yielded,
    /// Woken by another task.
    Woken {
        /// In [`Timeline::peers`].
        waker: PeerId,
        /// Links the waker's [`MarkKind::Wakeup`] to this slice; `None`
        /// when the trace does not show the waker's side.
        flow_id: Option<FlowId>,
    },
    /// First wake-up of a newly created thread.
    Created,
    /// Already runnable when the capture started.
    AtStart,
}

/// The kernel's reported task state of a blocked thread (`prev_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// S: interruptible sleep (waiting on a futex, a pipe, a timer...).
    Sleeping,
    /// D: uninterruptible sleep (usually I/O).
    DiskSleep,
    /// T: stopped by a signal.
    Stopped,
    /// t: stopped by a tracer.
    TracingStop,
    /// X or Z: exiting.
    Dead,
    /// P: parked kernel thread.
    Parked,
    /// I: idle kernel thread.
    Idle,
    /// Blocked before the capture started, for an unknown reason.
    Unknown,
}

impl TaskState {
    /// Decodes a `sched_switch` `prev_state` (one bit per reported state).
    pub fn from_prev_state(prev_state: u64) -> Self {
        match prev_state & 0xff {
            0x01 => TaskState::Sleeping,
            0x02 => TaskState::DiskSleep,
            0x04 => TaskState::Stopped,
            0x08 => TaskState::TracingStop,
            0x10 | 0x20 => TaskState::Dead,
            0x40 => TaskState::Parked,
            0x80 => TaskState::Idle,
            _ => TaskState::Unknown,
        }
    }

    /// From the state letter of `/proc/PID/stat`.
    pub fn from_proc_letter(letter: char) -> Self {
        match letter {
            'S' => TaskState::Sleeping,
            'D' => TaskState::DiskSleep,
            'T' => TaskState::Stopped,
            't' => TaskState::TracingStop,
            'X' | 'Z' => TaskState::Dead,
            'P' => TaskState::Parked,
            'I' => TaskState::Idle,
            _ => TaskState::Unknown,
        }
    }

    /// `ps`-style letter and description.
    pub fn describe(&self) -> &'static str {
        match self {
            TaskState::Sleeping => "S (sleeping)",
            TaskState::DiskSleep => "D (uninterruptible, usually I/O)",
            TaskState::Stopped => "T (stopped)",
            TaskState::TracingStop => "t (tracing stop)",
            TaskState::Dead => "X (exiting)",
            TaskState::Parked => "P (parked)",
            TaskState::Idle => "I (idle)",
            TaskState::Unknown => "? (blocked before the capture)",
        }
    }
}

/// One stretch of time a thread spent in one state, `[start_ns, end_ns)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSlice {
    /// Start, monotonic ns.
    pub start_ns: u64,
    /// End (excluded), monotonic ns.
    pub end_ns: u64,
    state: PackedState,
}

impl StateSlice {
    /// `state` over `[start_ns, end_ns)`, stored packed (eight bytes).
    pub fn new(start_ns: u64, end_ns: u64, state: ThreadState) -> Self {
        StateSlice {
            start_ns,
            end_ns,
            state: PackedState::new(state),
        }
    }

    /// The state, unpacked.
    #[inline]
    pub fn state(&self) -> ThreadState {
        self.state.get()
    }

    /// Replaces the state.
    pub fn set_state(&mut self, state: ThreadState) {
        self.state = PackedState::new(state);
    }

    /// Length of the slice, in ns.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }
}

/// An instant on a thread's timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    /// When, monotonic ns.
    pub ts_ns: u64,
    kind: PackedMark,
}

impl Mark {
    /// `kind` at `ts_ns`, stored packed (eight bytes).
    pub fn new(ts_ns: u64, kind: MarkKind) -> Self {
        Mark {
            ts_ns,
            kind: PackedMark::new(kind),
        }
    }

    /// The kind, unpacked.
    #[inline]
    pub fn kind(&self) -> MarkKind {
        self.kind.get()
    }

    /// Replaces the kind.
    pub fn set_kind(&mut self, kind: MarkKind) {
        self.kind = PackedMark::new(kind);
    }
}

/// What a [`Mark`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkKind {
    /// This thread woke `woken` (in [`Timeline::peers`]); `flow_id`
    /// matches the woken thread's slice (`None` when the trace does not
    /// show that slice).
    Wakeup {
        /// The thread woken.
        woken: PeerId,
        /// Links this mark to the woken thread's slice.
        flow_id: Option<FlowId>,
    },
    /// This thread created a thread of its own process.
    ThreadCreated {
        /// The new thread.
        tid: u32,
    },
    /// This thread forked a new process.
    ProcessForked {
        /// The new process.
        pid: u32,
    },
    /// The thread exited.
    Exited,
}

/// A typed value attached to a span (becomes an XStat).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A signed integer.
    I64(i64),
    /// An unsigned integer.
    U64(u64),
    /// A floating-point number.
    F64(f64),
    /// Text, shared: the spans of a driver call and of the work it
    /// submitted repeat a few texts (kernel names, stream labels) tens of
    /// thousands of times in a flight recorder's snapshot.
    Str(std::sync::Arc<str>),
    /// One end of an arrow from one span to another (a [`FLOW_STAT`]):
    /// the arrow's id, unique in the timeline, and which end this is.
    Flow(u64, FlowEnd),
}

/// The stat of a span at one end of an arrow ([`Value::Flow`]).
pub const FLOW_STAT: &str = "flow";

/// Which end of an arrow a span is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowEnd {
    /// The arrow leaves this span.
    From,
    /// The arrow reaches this span.
    To,
}

/// A named interval on a thread, `[start_ns, end_ns]` (equal for an
/// instant). Spans of one thread must nest: a source that produces
/// partially overlapping intervals resolves them before adding them.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Start, monotonic ns.
    pub start_ns: u64,
    /// End (included), monotonic ns.
    pub end_ns: u64,
    /// Shared by the spans of one name (a framework's session repeats a
    /// few names millions of times).
    pub name: std::sync::Arc<str>,
    /// Values attached to it, written as XStats.
    pub stats: Stats,
    /// The id a CUDA driver call's span shares with the device event of
    /// the work it submitted; XProf draws an arrow from one to the other.
    /// The sinks write it as the stat [`CORRELATION_STAT`], after the
    /// others. Kept here rather than among the stats, which would take an
    /// allocation for every launch of a snapshot (its other stats are
    /// shared).
    pub correlation: Option<NonZeroU64>,
}

/// A stat's name: nearly always one the code spells out, allocated only
/// when made at run time (a framework's own metadata).
pub type StatName = std::borrow::Cow<'static, str>;

/// Stat on a span that had to be shortened to nest: the ns cut off.
pub const CLIPPED_STAT: &str = "ebtrace_clipped_ns";
/// The stat a span's [`Span::correlation`] is written as (u64).
pub const CORRELATION_STAT: &str = "correlation_id";

/// Per-thread totals over the capture window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThreadCounters {
    /// Time on a CPU ([`ThreadState::Running`] or [`ThreadState::Sampled`]), in ns.
    pub on_cpu_ns: u64,
    /// Time runnable, waiting for a CPU, in ns.
    pub runnable_ns: u64,
    /// Time blocked, in ns.
    pub blocked_ns: u64,
    /// Time in [`ThreadState::Unknown`] intervals.
    pub unknown_ns: u64,
    /// Switches out while blocking (what `/proc` calls voluntary).
    pub voluntary_switches: u64,
    /// Switches out while still runnable (preempted or yielded).
    pub involuntary_switches: u64,
    /// Wake-ups this thread received.
    pub wakeups: u64,
    /// Times it ran on another CPU than the time before.
    pub migrations: u64,
}

/// Everything known about one traced thread.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadTrack {
    /// Thread id.
    pub tid: u32,
    /// Its process id.
    pub pid: u32,
    /// Its name (`comm`).
    pub name: String,
    /// Its scheduling states, in time order, consecutive and non-overlapping.
    pub slices: Vec<StateSlice>,
    /// Instants on it: wake-ups issued, threads created, exit.
    pub marks: Vec<Mark>,
    /// Named intervals from other sources, nested.
    pub spans: Vec<Span>,
    /// Its totals over the window.
    pub counters: ThreadCounters,
}

impl ThreadTrack {
    /// Every span start and end, sorted, once each: where a sink cuts the
    /// scheduling states so that they nest under the spans.
    pub fn span_edges(&self) -> Vec<u64> {
        let mut edges: Vec<u64> = self
            .spans
            .iter()
            .flat_map(|s| [s.start_ns, s.end_ns])
            .collect();
        edges.sort_unstable();
        edges.dedup();
        edges
    }

    /// Shows `visit` the start of every event a sink writes on this
    /// thread's line: its marks, its spans, and its scheduling states cut
    /// at every span edge inside them (spans are laid above the states,
    /// and the events of a line must nest).
    pub fn line_event_starts(&self, mut visit: impl FnMut(u64)) {
        self.marks.iter().for_each(|m| visit(m.ts_ns));
        self.spans.iter().for_each(|s| visit(s.start_ns));
        let edges = self.span_edges();
        let mut rest = edges.as_slice();
        for s in &self.slices {
            visit(s.start_ns);
            while let Some((&e, after)) = rest.split_first()
                && e <= s.start_ns
            {
                rest = after;
            }
            while let Some((&e, after)) = rest.split_first()
                && e < s.end_ns
            {
                visit(e);
                rest = after;
            }
        }
    }
}

/// Which traced thread ran on a CPU, `[start_ns, end_ns)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuSlice {
    /// Start, monotonic ns.
    pub start_ns: u64,
    /// End (excluded), monotonic ns.
    pub end_ns: u64,
    /// The thread that ran.
    pub tid: u32,
    /// Its process id.
    pub pid: u32,
}

/// A traced process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Process id.
    pub pid: u32,
    /// Its name (`comm`).
    pub name: String,
    /// When its last thread exited, if it did during the capture.
    pub exited_ns: Option<u64>,
}

/// Capture-wide accounting, stored in the output so a partial trace says so.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Records the timeline was built from.
    pub records: u64,
    /// Records lost in the kernel, every way ([`crate::attach::ProbeStats::dropped`]).
    pub dropped: u64,
    /// Ring-buffer items that could not be decoded.
    pub malformed: u64,
    /// Scheduler transitions the kernel did not report (a switch-out of a
    /// thread not running, a switch-in of one already running); the
    /// intervals they leave unexplained are [`ThreadState::Unknown`].
    pub inconsistencies: u64,
    /// Why the capture ended before its duration, if it did.
    pub ended_early: Option<String>,
    /// Lines about other sources for the end-of-capture summary.
    pub notes: Vec<String>,
    /// Problems the trace itself should state (XSpace warnings).
    pub warnings: Vec<String>,
    /// What the other sources delivered, as numbers.
    pub sources: SourceStats,
}

/// The whole capture.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Start of the capture window, monotonic ns.
    pub start_ns: u64,
    /// End of the capture window, monotonic ns.
    pub stop_ns: u64,
    /// Converts the timeline's monotonic ns to wall-clock time.
    pub clock: ClockSync,
    /// The traced processes, by pid.
    pub processes: BTreeMap<u32, ProcessInfo>,
    /// The traced threads, by tid.
    pub threads: BTreeMap<u32, ThreadTrack>,
    /// The threads wake-ups name, numbered by [`PeerId`].
    pub peers: Vec<Peer>,
    /// GPUs by ordinal, with the work submitted to them.
    pub devices: BTreeMap<u32, DeviceTrack>,
    /// Planes a framework's own profiler recorded that have no model here
    /// (XLA's metadata, device planes): see [`framework`].
    pub carried_planes: Vec<CarriedPlane>,
    /// What the capture recorded and lost.
    pub stats: CaptureStats,
}

impl Timeline {
    /// A timeline of nothing over `[start_ns, stop_ns]`, for tests.
    #[cfg(test)]
    pub(crate) fn empty(start_ns: u64, stop_ns: u64, clock: ClockSync) -> Timeline {
        Timeline {
            start_ns,
            stop_ns,
            clock,
            processes: BTreeMap::new(),
            peers: Vec::new(),
            threads: BTreeMap::new(),
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats: CaptureStats::default(),
        }
    }
}

impl Timeline {
    /// The track of thread `tid` of process `pid`, made empty and named
    /// `name()` if the timeline has none yet (a thread that only another
    /// source, TraceMe or the driver calls, saw).
    pub fn thread_track(
        &mut self,
        tid: u32,
        pid: u32,
        name: impl FnOnce() -> String,
    ) -> &mut ThreadTrack {
        self.threads.entry(tid).or_insert_with(|| ThreadTrack {
            tid,
            pid,
            name: name(),
            slices: Vec::new(),
            marks: Vec::new(),
            spans: Vec::new(),
            counters: ThreadCounters::default(),
        })
    }

    /// Length of the capture window, in ns.
    pub fn duration_ns(&self) -> u64 {
        self.stop_ns - self.start_ns
    }

    /// The thread a wake-up names (tid and pid 0 if `id` is not from this
    /// timeline).
    pub fn peer(&self, id: PeerId) -> Peer {
        peer_in(&self.peers, id)
    }

    /// Shows `visit` the start of every event a sink writes: thread lines
    /// (see [`ThreadTrack::line_event_starts`]), CPU lines, GPU streams.
    pub fn event_starts(&self, mut visit: impl FnMut(u64)) {
        for t in self.threads.values() {
            t.line_event_starts(&mut visit);
        }
        self.running_slices().for_each(|s| visit(s.start_ns));
        self.device_events().for_each(|e| visit(e.start_ns));
    }

    /// Number of events a sink writes.
    pub fn event_count(&self) -> usize {
        let mut n = 0;
        self.event_starts(|_| n += 1);
        n
    }

    /// At least [`event_count`](Self::event_count), without cutting the
    /// scheduling states (each span adds at most two cuts).
    pub fn event_count_bound(&self) -> usize {
        self.threads
            .values()
            .map(|t| t.slices.len() + t.marks.len() + 3 * t.spans.len())
            .sum::<usize>()
            + self.running_slices().count()
            + self.device_events().count()
    }

    /// The slices of the per-CPU lines (see [`cpu_lines`](Self::cpu_lines)).
    fn running_slices(&self) -> impl Iterator<Item = &StateSlice> {
        self.threads
            .values()
            .flat_map(|t| &t.slices)
            .filter(|s| s.state().on_cpu().is_some())
    }

    /// The work on every GPU stream.
    pub fn device_events(&self) -> impl Iterator<Item = &Span> {
        self.devices
            .values()
            .flat_map(|d| d.streams.values())
            .flat_map(|s| &s.events)
    }
}
