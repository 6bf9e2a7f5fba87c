//! Launch stacks on the driver calls: each call that submits work (a
//! launch, a copy, a memset) gets the stack it was made from, native and
//! Python, innermost frame first, as its `launch_stack` stat: which line of
//! the program launched a kernel. A stack the probes took at a call's entry
//! carries the call's start, which is the call's span's.
//!
//! A launch loop repeats a few stacks: each is named and written once,
//! and the spans share its text (the XSpace keeps it once per plane).

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::{Timeline, Value, cpu_samples::describe};
use crate::{
    collect::StackSample,
    symbols::stacks::{Space, StackSymbolizer},
};

/// Stat of a driver call's span: the stack the call was made from, as a
/// sample's `cpu_sample_stack` writes it.
pub const LAUNCH_STACK_STAT: &str = "launch_stack";

/// Puts the launch stacks among `samples` on their calls' spans; returns
/// how many calls got one.
pub fn add_launch_stacks(
    timeline: &mut Timeline,
    samples: &[&StackSample],
    symbolizer: &mut StackSymbolizer,
) -> u64 {
    let mut stack_of: FxHashMap<(u32, &[u64], &[u64]), usize> = FxHashMap::default();
    let mut stacks: Vec<Vec<(Space, u64)>> = Vec::new();
    let mut call_stack: FxHashMap<(u32, u64), usize> = FxHashMap::default();
    for s in samples.iter().filter(|s| s.launch) {
        let i = *stack_of
            .entry((s.tgid, &s.kernel, &s.user))
            .or_insert_with(|| {
                stacks.push(s.stack().frames());
                stacks.len() - 1
            });
        call_stack.insert((s.tid, s.header.ts_ns), i);
    }
    if call_stack.is_empty() {
        return 0;
    }
    symbolizer.resolve_stacks(stacks.iter().map(Vec::as_slice));
    let texts: Vec<Arc<str>> = stacks
        .iter()
        .map(|stack| describe(stack, symbolizer).1.into())
        .collect();
    let mut laid = 0;
    let mut tids: Vec<u32> = call_stack.keys().map(|(tid, _)| *tid).collect();
    tids.sort_unstable();
    tids.dedup();
    for tid in tids {
        let Some(thread) = timeline.threads.get_mut(&tid) else {
            continue;
        };
        for span in &mut thread.spans {
            let Some(i) = call_stack.remove(&(tid, span.start_ns)) else {
                continue;
            };
            let text = Value::Str(Arc::clone(&texts[i]));
            span.stats.push((LAUNCH_STACK_STAT.into(), text));
            laid += 1;
        }
    }
    laid
}
