//! PyTorch's ops (decoded by `collect::torch_ops`) → spans on the lines of
//! the threads that ran them, above the scheduling states and around the
//! driver calls they made, like a framework's TraceMe events: each op or
//! `record_function` range one span named as PyTorch names it, with its
//! kind in the [`SCOPE_STAT`] stat.
//!
//! RecordFunctions of one thread nest by construction (each is a scope);
//! one ended on another thread than it started on may not, and is cut to
//! nest ([`nest`], cuts marked). Times are `CLOCK_MONOTONIC`, as the
//! timeline's; ops not wholly inside the window are left out, as TraceMe
//! events are.

use std::{collections::BTreeMap, sync::Arc};

use super::{Cuts, Nestable, Span, Stats, Timeline, Value, nest};
use crate::collect::torch_ops::{OpScope, TorchOp};

/// Stat of an op's span: what kind of RecordFunction it was
/// ([`OpScope::as_str`]).
pub const SCOPE_STAT: &str = "torch_scope";

/// What became of a process's ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchOpSpans {
    /// ATen ops laid on the thread lines.
    pub ops: u64,
    /// Backward functions.
    pub backward: u64,
    /// `record_function` ranges.
    pub user_ranges: u64,
    /// Ops not wholly inside the window.
    pub outside_window: u64,
    /// Spans cut to nest.
    pub clipped: u64,
}

struct Candidate(Span);

impl Nestable for Candidate {
    fn span(&self) -> &Span {
        &self.0
    }
    fn span_mut(&mut self) -> &mut Span {
        &mut self.0
    }
}

/// Lays process `pid`'s `ops` on its threads' lines.
pub fn add_torch_ops(timeline: &mut Timeline, pid: u32, ops: &[TorchOp]) -> TorchOpSpans {
    let mut out = TorchOpSpans::default();
    let scope_stats: BTreeMap<OpScope, Arc<[(super::StatName, Value)]>> =
        [OpScope::Function, OpScope::Backward, OpScope::User]
            .into_iter()
            .map(|s| {
                let stat = (SCOPE_STAT.into(), Value::Str(s.as_str().into()));
                (s, Arc::from([stat]))
            })
            .collect();
    let mut per_thread: BTreeMap<u32, Vec<Candidate>> = BTreeMap::new();
    for op in ops {
        if op.start_ns < timeline.start_ns || op.end_ns > timeline.stop_ns {
            out.outside_window += 1;
            continue;
        }
        match op.scope {
            OpScope::Function => out.ops += 1,
            OpScope::Backward => out.backward += 1,
            OpScope::User => out.user_ranges += 1,
        }
        per_thread.entry(op.tid).or_default().push(Candidate(Span {
            start_ns: op.start_ns,
            end_ns: op.end_ns,
            name: Arc::clone(&op.name),
            stats: Stats::shared_then(Arc::clone(&scope_stats[&op.scope]), Vec::new()),
            correlation: None,
        }));
    }
    for (tid, mut candidates) in per_thread {
        out.clipped += nest(&mut candidates, Cuts::Marked);
        let track = timeline.thread_track(tid, pid, || format!("thread {tid}"));
        track.spans.extend(candidates.into_iter().map(|c| c.0));
        track
            .spans
            .sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
    }
    out
}
