//! PyTorch's ops (decoded by `collect::torch_ops`) → spans on the lines of
//! the threads that ran them, above the scheduling states and around the
//! driver calls they made, like a framework's TraceMe events: each op or
//! `record_function` range one span named as PyTorch names it, with its
//! kind in the [`SCOPE_STAT`] stat.
//!
//! Each span also carries XProf's `tf_op` stat ([`FRAMEWORK_OP_STAT`]),
//! from which XProf's framework op stats count host ops and their self
//! time; the trace viewer shows it as one more argument. The program's
//! steps (`ProfilerStep#N`, or ranges named `train...`/`test...`) carry the
//! stats from which XProf groups ops into steps ([`STEP_ROOT_STAT`]).
//! An op PyTorch numbered carries its number ([`SEQUENCE_STAT`]): a
//! backward function has its forward op's.
//!
//! RecordFunctions of one thread nest by construction (each is a scope);
//! one ended on another thread than it started on may not, and is cut to
//! nest ([`nest`], cuts marked). Times are `CLOCK_MONOTONIC`, as the
//! timeline's; ops not wholly inside the window are left out, as TraceMe
//! events are.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use super::{Cuts, FLOW_STAT, FlowEnd, Nestable, Span, Stat, Stats, Timeline, Value, nest};
use crate::collect::torch_ops::{OpScope, TorchOp};

/// Stat of an op's span: what kind of RecordFunction it was
/// ([`OpScope::as_str`]).
pub const SCOPE_STAT: &str = "torch_scope";

/// Stat of an op's span: its sequence number (`RecordFunction::seqNr()`),
/// which a forward op shares with the backward function autograd made of
/// it; torch.profiler calls it "Sequence number".
pub const SEQUENCE_STAT: &str = "sequence_number";

/// Stat of an ATen op's span, where asked for: its input shapes, as
/// torch.profiler's `record_shapes` writes them (`[[64, 256], []]`).
pub const SHAPES_STAT: &str = "input_shapes";

/// Stat from which XProf's framework op stats take a host event as an op
/// (its `kTfOp`), whatever the event's name.
pub const FRAMEWORK_OP_STAT: &str = "tf_op";

/// The [`FRAMEWORK_OP_STAT`] of an op named `name`: the name with each
/// `::` made a `.` and a `:` after it, which XProf reads as an op named so
/// whose type is its name too (`aten::addmm` → `aten.addmm:`; as it
/// stands, XProf would split it at its first `:` and know neither half).
/// None for a name XProf already takes as an op by itself, a `name:Type`
/// or its own prefixes: the stat would count it twice.
pub(super) fn framework_op(name: &str) -> Option<String> {
    let own_prefix = name.starts_with("Iterator::") || name.starts_with("MEMCPY");
    if own_prefix || name.replace("::", "").contains(':') {
        return None;
    }
    Some(format!("{}:", name.replace("::", ".")))
}

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
    /// `record_function` ranges marked as steps for XProf.
    pub steps: u64,
    /// Backward functions with an arrow from the forward op that made them.
    pub linked: u64,
}

/// Stat that makes XProf take a span as a step of the program (its
/// `kIsRoot`): XProf groups the ops inside it into that step, for its
/// step-time graph and its input pipeline analysis.
pub const STEP_ROOT_STAT: &str = "_r";
/// Stat numbering a step for XProf (its `kStepNum`).
pub const STEP_NUMBER_STAT: &str = "step_num";

/// Prefix of the ranges torch.profiler's schedule makes a step each.
const PROFILER_STEP: &str = "ProfilerStep#";

/// Whether a `record_function` range named `name` is a step of the
/// program: torch.profiler's `ProfilerStep#N`, or a range XProf takes as
/// a step by its name (starting `train` or `test`, with no `/`).
fn is_step(name: &str) -> bool {
    name.starts_with(PROFILER_STEP)
        || ((name.starts_with("train") || name.starts_with("test")) && !name.contains('/'))
}

/// An op's span, its kind and its sequence number.
struct Candidate(Span, OpScope, Option<u64>);

impl Nestable for Candidate {
    fn span(&self) -> &Span {
        &self.0
    }
    fn span_mut(&mut self) -> &mut Span {
        &mut self.0
    }
}

/// Marks the steps among one thread's `candidates` (sorted by start) for
/// XProf: each the nth step of its thread, `ProfilerStep#N` step N.
fn mark_steps(candidates: &mut [Candidate]) -> u64 {
    let mut marked = 0;
    for Candidate(span, scope, _) in candidates {
        if *scope != OpScope::User || !is_step(&span.name) {
            continue;
        }
        marked += 1;
        let number = span
            .name
            .strip_prefix(PROFILER_STEP)
            .and_then(|n| n.parse::<i64>().ok())
            .unwrap_or(marked as i64);
        span.stats.push((STEP_ROOT_STAT.into(), Value::I64(1)));
        span.stats
            .push((STEP_NUMBER_STAT.into(), Value::I64(number)));
    }
    marked
}

/// Prefix of the range autograd's engine opens around each backward
/// function it runs.
const ENGINE_CALL: &str = "autograd::engine::evaluate_function: ";

/// Gives each of one thread's `candidates` (sorted by start) with a
/// sequence number its [`SEQUENCE_STAT`]; as torch.profiler does, the
/// engine's range around a backward function takes that function's.
fn number(candidates: &mut [Candidate]) {
    for i in 1..candidates.len() {
        let (before, after) = candidates.split_at_mut(i);
        let (engine, inner) = (&mut before[i - 1], &after[0]);
        if engine.1 == OpScope::Function
            && engine.2.is_none()
            && inner.1 == OpScope::Backward
            && engine.0.name.starts_with(ENGINE_CALL)
        {
            engine.2 = inner.2;
        }
    }
    for Candidate(span, _, sequence) in candidates {
        if let Some(n) = sequence {
            span.stats.push((SEQUENCE_STAT.into(), Value::U64(*n)));
        }
    }
}

/// Arrows of process `pid` are numbered from here (above the 32-bit ids
/// of wake-ups), its pid above a count of [`MAX_ARROWS`].
const ARROW_IDS: u64 = 1 << 55;
/// Arrows drawn in one process at most.
const MAX_ARROWS: u64 = 1 << 24;

/// Draws an arrow ([`FLOW_STAT`]) from each forward op to the backward
/// function autograd made of it, over `pid`'s threads (each one's
/// candidates sorted by start); returns how many. The two share a
/// sequence number; of the forward ops sharing one (an op and the ops it
/// calls), the last to start made the node, as torch.profiler links them.
/// Sequence numbers count per thread, so only a process whose numbered
/// forward ops all ran on one thread gets arrows.
fn link_backward(pid: u32, threads: &mut [(u32, Vec<Candidate>)]) -> u64 {
    let is_forward = |c: &Candidate| {
        c.1 == OpScope::Function && c.2.is_some() && !c.0.name.starts_with(ENGINE_CALL)
    };
    let mut forward_threads = threads
        .iter()
        .enumerate()
        .filter(|(_, (_, candidates))| candidates.iter().any(is_forward))
        .map(|(i, _)| i);
    let (Some(forward), None) = (forward_threads.next(), forward_threads.next()) else {
        return 0;
    };
    // The forward op that made each number's node: the last to start.
    let mut made: HashMap<u64, usize> = HashMap::new();
    for (i, c) in threads[forward].1.iter().enumerate() {
        if let (true, Some(n)) = (is_forward(c), c.2) {
            made.insert(n, i);
        }
    }
    // Each number's first backward function, over every thread.
    let mut first: HashMap<u64, (u64, usize, usize)> = HashMap::new();
    for (t, (_, candidates)) in threads.iter().enumerate() {
        for (i, c) in candidates.iter().enumerate() {
            let Some(n) =
                c.2.filter(|n| c.1 == OpScope::Backward && made.contains_key(n))
            else {
                continue;
            };
            let entry = first.entry(n).or_insert((c.0.start_ns, t, i));
            if c.0.start_ns < entry.0 {
                *entry = (c.0.start_ns, t, i);
            }
        }
    }
    let mut links: Vec<(u64, usize, usize)> =
        first.into_iter().map(|(n, (_, t, i))| (n, t, i)).collect();
    links.sort_unstable();
    links.truncate(MAX_ARROWS as usize);
    let base = ARROW_IDS | u64::from(pid) << 24;
    for (k, (n, t, i)) in links.iter().enumerate() {
        let id = base | k as u64;
        threads[*t].1[*i]
            .0
            .stats
            .push((FLOW_STAT.into(), Value::Flow(id, FlowEnd::To)));
        threads[forward].1[made[n]]
            .0
            .stats
            .push((FLOW_STAT.into(), Value::Flow(id, FlowEnd::From)));
    }
    links.len() as u64
}

/// Lays process `pid`'s `ops` on its threads' lines.
pub fn add_torch_ops(timeline: &mut Timeline, pid: u32, ops: &[TorchOp]) -> TorchOpSpans {
    let mut out = TorchOpSpans::default();
    // One set of stats for each kind and name, shared by its spans.
    let mut stats_of: HashMap<(OpScope, Arc<str>), Arc<[Stat]>> = HashMap::new();
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
        let stats = stats_of
            .entry((op.scope, Arc::clone(&op.name)))
            .or_insert_with(|| {
                let scope = (SCOPE_STAT.into(), Value::Str(op.scope.as_str().into()));
                let framework = framework_op(&op.name)
                    .map(|v| (FRAMEWORK_OP_STAT.into(), Value::Str(v.into())));
                std::iter::once(scope).chain(framework).collect()
            });
        per_thread.entry(op.tid).or_default().push(Candidate(
            Span {
                start_ns: op.start_ns,
                end_ns: op.end_ns,
                name: Arc::clone(&op.name),
                stats: Stats::shared_then(
                    Arc::clone(stats),
                    op.shapes
                        .as_ref()
                        .map(|s| (SHAPES_STAT.into(), Value::Str(Arc::clone(s))))
                        .into_iter()
                        .collect(),
                ),
                correlation: None,
            },
            op.scope,
            op.sequence,
        ));
    }
    let mut threads: Vec<(u32, Vec<Candidate>)> = per_thread.into_iter().collect();
    for (_, candidates) in &mut threads {
        out.clipped += nest(candidates, Cuts::Marked);
        candidates.sort_by_key(|c| (c.0.start_ns, std::cmp::Reverse(c.0.end_ns)));
        out.steps += mark_steps(candidates);
        number(candidates);
    }
    out.linked = link_backward(pid, &mut threads);
    for (tid, candidates) in threads {
        let track = timeline.thread_track(tid, pid, || format!("thread {tid}"));
        track.spans.extend(candidates.into_iter().map(|c| c.0));
        track
            .spans
            .sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{
        Candidate, OpScope, SEQUENCE_STAT, Span, Stats, Value, framework_op, is_step, number,
    };

    fn candidate(start_ns: u64, name: &str, scope: OpScope, sequence: Option<u64>) -> Candidate {
        let span = Span {
            start_ns,
            end_ns: start_ns + 10,
            name: Arc::from(name),
            stats: Stats::shared_then(Arc::from([]), Vec::new()),
            correlation: None,
        };
        Candidate(span, scope, sequence)
    }

    /// The forward op that made a node (the last of its number to start)
    /// gets an arrow to the first backward function of that number, on
    /// whatever thread it ran; ops without a backward function get none.
    #[test]
    fn arrows_go_from_the_forward_op_to_its_backward_function() {
        use super::{FLOW_STAT, FlowEnd, link_backward};
        let forward = vec![
            candidate(0, "aten::linear", OpScope::Function, Some(7)),
            candidate(1, "aten::t", OpScope::Function, Some(7)),
            candidate(2, "aten::addmm", OpScope::Function, Some(8)),
            candidate(3, "aten::relu", OpScope::Function, Some(9)),
        ];
        let backward = vec![
            candidate(
                20,
                "autograd::engine::evaluate_function: AddmmBackward0",
                OpScope::Function,
                Some(8),
            ),
            candidate(21, "AddmmBackward0", OpScope::Backward, Some(8)),
            candidate(30, "TBackward0", OpScope::Backward, Some(7)),
        ];
        let mut threads = vec![(10, forward), (11, backward)];
        assert_eq!(link_backward(5, &mut threads), 2);
        let ends = |c: &Candidate| -> Vec<(u64, FlowEnd)> {
            c.0.stats
                .iter()
                .filter(|(name, _)| name == FLOW_STAT)
                .map(|(_, v)| match v {
                    Value::Flow(id, end) => (*id, *end),
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        let (f, b) = (&threads[0].1, &threads[1].1);
        assert!(ends(&f[0]).is_empty() && ends(&f[3]).is_empty() && ends(&b[0]).is_empty());
        let (t, tb) = (ends(&f[1]), ends(&b[2]));
        let (mm, mmb) = (ends(&f[2]), ends(&b[1]));
        assert_eq!((t[0].1, tb[0].1), (FlowEnd::From, FlowEnd::To));
        assert_eq!((t[0].0, mm[0].0), (tb[0].0, mmb[0].0));
        assert_ne!(t[0].0, mm[0].0);
        assert!(t[0].0 > u64::from(u32::MAX));

        // Numbered forward ops on two threads: numbers may repeat, no arrow.
        let mut two = vec![
            (
                10,
                vec![candidate(0, "aten::t", OpScope::Function, Some(7))],
            ),
            (
                12,
                vec![candidate(0, "aten::t", OpScope::Function, Some(7))],
            ),
            (
                11,
                vec![candidate(9, "TBackward0", OpScope::Backward, Some(7))],
            ),
        ];
        assert_eq!(link_backward(5, &mut two), 0);
    }

    /// Numbered ops carry their number; the engine's range takes that of
    /// the backward function it runs, as torch.profiler gives it.
    #[test]
    fn the_engines_range_takes_its_backward_functions_number() {
        let mut candidates = [
            candidate(0, "aten::addmm", OpScope::Function, Some(7)),
            candidate(1, "aten::empty", OpScope::Function, None),
            candidate(
                20,
                "autograd::engine::evaluate_function: AddmmBackward0",
                OpScope::Function,
                None,
            ),
            candidate(21, "AddmmBackward0", OpScope::Backward, Some(7)),
            candidate(22, "aten::mm", OpScope::Function, None),
            candidate(
                40,
                "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
                OpScope::Function,
                None,
            ),
            candidate(
                41,
                "torch::autograd::AccumulateGrad",
                OpScope::Function,
                None,
            ),
        ];
        number(&mut candidates);
        let numbers: Vec<Option<u64>> = candidates
            .iter()
            .map(|c| match c.0.stats.get(SEQUENCE_STAT) {
                Some(Value::U64(n)) => Some(*n),
                _ => None,
            })
            .collect();
        assert_eq!(numbers, [Some(7), None, Some(7), Some(7), None, None, None]);
    }

    #[test]
    fn steps_are_those_xprof_or_torch_profiler_name_so() {
        for step in ["train_step", "ProfilerStep#12", "test", "training loop"] {
            assert!(is_step(step), "{step}");
        }
        for other in [
            "Optimizer.step#SGD.step",
            "train/step",
            "my_step",
            "aten::add",
        ] {
            assert!(!is_step(other), "{other}");
        }
    }

    #[test]
    fn framework_op_names_read_as_xprof_reads_them() {
        assert_eq!(framework_op("aten::addmm").as_deref(), Some("aten.addmm:"));
        assert_eq!(
            framework_op("Optimizer.step#SGD.step").as_deref(),
            Some("Optimizer.step#SGD.step:")
        );
        assert_eq!(framework_op("train_step").as_deref(), Some("train_step:"));
        // XProf takes these by their names: a stat would count them twice.
        for own in ["fwd:Linear", "a::b:c", "Iterator::Batch", "MEMCPYHToD"] {
            assert_eq!(framework_op(own), None, "{own}");
        }
    }
}
