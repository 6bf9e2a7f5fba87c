//! What each source beside the scheduler delivered to a timeline, as
//! numbers: the summary's lines say the same in words.

use std::collections::BTreeMap;

use super::{ActivityMerge, FrameworkMerge, TraceMeSpanStats};
use crate::collect::agent::KernelNames;

/// Per-source accounting of one capture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// TraceMe events the uprobes recorded, if any recorder was probed.
    pub traceme: Option<TraceMeSource>,
    /// What each process's framework sessions (run by the agent) gave, by
    /// pid, summed over its frameworks.
    pub frameworks: BTreeMap<u32, FrameworkMerge>,
    /// What each process's GPU activity (CUPTI, through the agent) gave,
    /// by pid, summed over its collections.
    pub gpu_activity: BTreeMap<u32, ActivityMerge>,
    /// Kernels launched with handles looked up before the capture, by pid.
    pub kernel_names: BTreeMap<u32, KernelNames>,
    /// Spans from different sources cut so that they nest.
    pub spans_cut_to_nest: u64,
    /// CPU stack samples laid on the thread lines, when stacks were sampled.
    pub cpu_samples: Option<u64>,
    /// Off-CPU stacks laid over the waits they explain, when taken.
    pub off_cpu_stacks: Option<u64>,
    /// Of the samples and off-CPU stacks, those with Python frames, and
    /// the Python frames that could not be named; when stacks were taken.
    pub python_stacks: Option<PythonStacks>,
}

/// Python frames in the stacks laid on the thread lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PythonStacks {
    /// Samples and off-CPU stacks with at least one Python frame.
    pub stacks_with_python: u64,
    /// Python frames that could not be read or named, marked in their
    /// stacks (`[unreadable python frame]` and the like).
    pub unreadable_frames: u64,
    /// Python frames of stacks deeper than a sample keeps, left out
    /// between the innermost and outermost frames it kept (marked
    /// `[python frames left out: ...]` once per stack).
    pub frames_beyond_limit: u64,
}

/// The TraceMe uprobe route's events and what became of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceMeSource {
    /// Events read from the targets.
    pub events: u64,
    /// What became of them as spans.
    pub spans: TraceMeSpanStats,
    /// Events the probe could not read from the target (lost).
    pub unreadable: u64,
    /// Events recorded without their name.
    pub unnamed: u64,
    /// Whether recording was switched off at `--max-events`.
    pub stopped_at_max_events: bool,
}

impl SourceStats {
    /// Adds one framework XSpace's merge to `pid`'s.
    pub fn add_framework(&mut self, pid: u32, m: &FrameworkMerge) {
        let total = self.frameworks.entry(pid).or_default();
        total.spans += m.spans;
        total.unnamed_lines += m.unnamed_lines;
        total.unnamed_events += m.unnamed_events;
        total.planes += m.planes;
        total.target_growth = total.target_growth.max(m.target_growth);
    }
}
