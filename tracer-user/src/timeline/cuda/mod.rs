//! `CudaTimelineBuilder`: CUDA driver calls become spans on the calling
//! thread, and the work they submit becomes events on per-stream lines of
//! the GPU it went to.
//!
//! Device events are **host-observed**: each spans the driver call that
//! submitted the work, not the GPU's execution, which only CUPTI can time.
//! Each submission gets a correlation id shared by its host span and its
//! device event, from which XProf draws the launch arrows.
//!
//! What the driver API reveals, and so what this module knows:
//! - kernel names, from the `cuModuleGetFunction` / `cuLibraryGetKernel`
//!   lookups seen during the capture (`cuKernelGetFunction` carries a
//!   kernel's name to its function); a handle looked up before is named
//!   `<unresolved 0x…>`;
//! - a context's device, from `cuCtxCreate*`, `cuDevicePrimaryCtxRetain`
//!   and `cuCtxGetDevice`; a thread's current context from
//!   `cuCtxSetCurrent` / `cuCtxPushCurrent` / `cuCtxPopCurrent` /
//!   `cuCtxGetCurrent` / `cuCtxCreate`; a stream's context from
//!   `cuStreamCreate*` on a thread with a known context, or
//!   `cuStreamGetCtx`. Work whose device stays unknown is shown on GPU 0
//!   and says so in its `device_ordinal_source` stat.
//!
//! Records must be fed in return-time order (the header time). Each call
//! is decoded once ([`crate::cuda_api::CallArgs`]); `builder` feeds the
//! calls, `describe` says what each call and the work it submitted show,
//! `contexts` finds the device of a submission, `symbols` names kernels
//! and `lines` lays the work on per-stream lines.

mod builder;
mod contexts;
mod describe;
mod lines;
mod symbols;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet, BinaryHeap},
    sync::Arc,
};

use rustc_hash::FxHashMap;
pub use symbols::{demangle, unnamed_kernels};

use self::{
    builder::SharedGroup,
    contexts::{Contexts, OrdinalSource},
    describe::LaunchDetails,
    lines::StreamKey,
    symbols::Symbol,
};
use super::{SharedTexts, Span};
use crate::cuda_api::LaunchConfig;

/// Work submitted to one GPU, as the host saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceTrack {
    /// The CUDA device ordinal.
    pub ordinal: u32,
    /// Lines by stream id.
    pub streams: BTreeMap<i64, StreamTrack>,
}

impl DeviceTrack {
    /// How many of its streams are timed by `timing`, and their events.
    pub fn count_timed(&self, timing: StreamTiming) -> (usize, usize) {
        self.streams
            .values()
            .filter(|s| s.timing == timing)
            .fold((0, 0), |(streams, events), s| {
                (streams + 1, events + s.events.len())
            })
    }
}

/// One stream's submissions, in order; events never overlap.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamTrack {
    /// 0 for the legacy default stream, then 1, 2, ... in order of first use.
    pub id: i64,
    /// The process whose work it holds.
    pub pid: u32,
    /// What the stream is: its handle, or which default stream.
    pub label: String,
    /// Where its events' times come from.
    pub timing: StreamTiming,
    /// The work submitted, in order.
    pub events: Vec<Span>,
}

/// Where a stream's event times come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamTiming {
    /// Each event spans the driver call that submitted the work.
    #[default]
    HostObserved,
    /// The device's own start and end of the work (CUPTI activity).
    Device,
}

/// The CUDA part of a timeline.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CudaTimeline {
    /// Host spans by tid, with the thread's pid; they nest.
    pub spans: FxHashMap<u32, (u32, Vec<Span>)>,
    /// GPUs by ordinal, with the work submitted to them.
    pub devices: BTreeMap<u32, DeviceTrack>,
    /// Driver calls in the window.
    pub calls: u64,
}

impl CudaTimeline {
    /// Adds the spans to their threads and the GPUs to `timeline`.
    pub fn add_to(self, timeline: &mut super::Timeline) {
        for (tid, (pid, spans)) in self.spans {
            let track = timeline.thread_track(tid, pid, || format!("thread {tid}"));
            // Moved, not copied, onto a thread with no spans yet.
            if track.spans.is_empty() {
                track.spans = spans;
            } else {
                track.spans.extend(spans);
            }
            track
                .spans
                .sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
        }
        timeline.devices.extend(self.devices);
        timeline.stats.records += self.calls;
    }
}

/// Builds a [`CudaTimeline`] from driver-call and kernel-name records fed in return-time order.
#[derive(Default)]
pub struct CudaTimelineBuilder {
    start_ns: u64,
    stop_ns: u64,
    /// `(pid, CUfunction or CUkernel)` → name.
    symbols: FxHashMap<(u32, u64), Symbol>,
    /// What the calls said about devices, contexts and streams.
    contexts: Contexts,
    /// `(ordinal, pid, stream)` → line id and label.
    stream_ids: FxHashMap<(u32, u32, StreamKey), (i64, Arc<str>)>,
    /// Correlation ids given out so far (they are numbered from 1).
    correlations: u64,
    /// The texts of stats and span names, one copy each.
    texts: SharedTexts,
    /// Launch details by process, function handle and configuration.
    launch_details: FxHashMap<(u32, u64, LaunchConfig), LaunchDetails>,
    /// A launch's call's stats but its correlation, by its details, result,
    /// stream line and device; and its work's, by its details, stream
    /// line, function, thread, process and how its device was found. The
    /// details are kept with them: their address is in the key.
    call_groups: FxHashMap<(usize, u32, usize, u32), SharedGroup>,
    work_groups: FxHashMap<(usize, usize, u16, u32, u32, OrdinalSource), SharedGroup>,
    /// Where the trace is to hold at most so many events: the starts of
    /// the earliest made.
    limit: Option<EarliestStarts>,
    out: CudaTimeline,
}

/// The starts of the earliest `max + 1` calls' spans made, for a trace
/// cut where the event after its first `max` starts
/// ([`super::Window::max_events`]): counting every line's events, the cut
/// lies no later than the last of these, so a call starting after it is
/// cut, with its work (which starts with the call, or later on a busy
/// stream), and need not be made. Once `max + 1` are made, a call is made
/// only if it started before all but `max` of them: one in flight across
/// the cut. A span's start is what the trace shows (nesting cuts ends),
/// where its work's may move later, so only calls are counted.
struct EarliestStarts {
    max: usize,
    /// The processes the trace shows, where not all: only their events
    /// count.
    shown: Option<BTreeSet<u32>>,
    /// A max-heap: the latest of them on top.
    starts: BinaryHeap<u64>,
}

impl EarliestStarts {
    fn new(max: usize, shown: Option<BTreeSet<u32>>) -> Self {
        EarliestStarts {
            max,
            shown,
            starts: BinaryHeap::new(),
        }
    }

    fn counts(&self, pid: u32) -> bool {
        self.shown.as_ref().is_none_or(|shown| shown.contains(&pid))
    }

    /// Whether a call of `pid` starting at `start_ns` starts after the cut.
    fn past_the_cut(&self, pid: u32, start_ns: u64) -> bool {
        self.counts(pid)
            && self.starts.len() > self.max
            && self.starts.peek().is_some_and(|&last| start_ns > last)
    }

    /// Counts a call of `pid` made that starts at `start_ns`.
    fn made(&mut self, pid: u32, start_ns: u64) {
        if !self.counts(pid) {
            return;
        }
        self.starts.push(start_ns);
        if self.starts.len() > self.max + 1 {
            self.starts.pop();
        }
    }
}
