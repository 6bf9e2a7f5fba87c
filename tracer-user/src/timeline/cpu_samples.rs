//! CPU stack samples on the thread lines: each sample becomes an instant
//! on its thread, named after the innermost function of its user stack
//! (of its kernel stack while the thread ran in the kernel), with the
//! whole stack as a stat.

use super::{Span, Timeline, Value};
use crate::{
    collect::StackSample,
    symbols::stacks::{Space, StackSymbolizer, sample_frames},
};

/// Stat of a sample's instant: its stack, innermost frame first, one per
/// line; kernel frames marked `[k]`, inlined ones `(inlined)`.
pub const STACK_STAT: &str = "cpu_sample_stack";
/// Name of a sample whose innermost frame could not be named.
pub const UNKNOWN_FRAME: &str = "[unknown]";

/// Lays the samples of `[start_ns, stop_ns]` on their threads' lines;
/// returns how many (samples of threads the timeline does not know are
/// left out).
pub fn add_cpu_samples(
    timeline: &mut Timeline,
    samples: &[&StackSample],
    (start_ns, stop_ns): (u64, u64),
    symbolizer: &mut StackSymbolizer,
) -> u64 {
    let samples: Vec<&StackSample> = samples
        .iter()
        .copied()
        .filter(|s| (start_ns..=stop_ns).contains(&s.header.ts_ns))
        .filter(|s| timeline.threads.contains_key(&s.tid))
        .collect();
    let stacks: Vec<Vec<(Space, u64)>> = samples.iter().map(|s| sample_frames(s)).collect();
    symbolizer.resolve_stacks(stacks.iter().map(Vec::as_slice));
    for (s, stack) in samples.iter().zip(stacks) {
        let mut lines = Vec::new();
        let mut innermost_user = None;
        let mut innermost = None;
        for (space, address) in stack {
            let symbol = symbolizer.get(space, address);
            let mark = if space == Space::Kernel { " [k]" } else { "" };
            if symbol.frames.is_empty() {
                lines.push(format!("{address:#x}{mark}"));
                continue;
            }
            for (i, f) in symbol.frames.iter().enumerate() {
                let inlined = if i + 1 < symbol.frames.len() {
                    " (inlined)"
                } else {
                    ""
                };
                let place = match (&f.file, f.line) {
                    (Some(file), Some(line)) => format!(" {file}:{line}"),
                    _ => String::new(),
                };
                lines.push(format!("{}{place}{mark}{inlined}", f.function));
            }
            let name = &symbol.frames[0].function;
            innermost.get_or_insert_with(|| name.clone());
            if space != Space::Kernel {
                innermost_user.get_or_insert_with(|| name.clone());
            }
        }
        let name = innermost_user
            .or(innermost)
            .unwrap_or_else(|| UNKNOWN_FRAME.to_string());
        let thread = timeline.threads.get_mut(&s.tid).expect("filtered above");
        thread.spans.push(Span {
            start_ns: s.header.ts_ns,
            end_ns: s.header.ts_ns,
            name: name.into(),
            stats: vec![(STACK_STAT.into(), Value::Str(lines.join("\n").into()))].into(),
        });
    }
    samples.len() as u64
}
