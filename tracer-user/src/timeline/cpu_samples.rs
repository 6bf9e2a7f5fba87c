//! CPU stack samples on the thread lines: each sample becomes an instant
//! on its thread, named after the innermost function of its user stack
//! (of its kernel stack while the thread ran in the kernel), with the
//! whole stack as a stat. A sample also shows its thread on a CPU: where
//! the kernel left a thread's state unknown, the samples narrow it.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::{Span, Stat, StateSlice, Stats, ThreadState, ThreadTrack, Timeline, Value};
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
    // A busy thread's samples repeat a few stacks: each stack is looked up
    // and written out once, and the samples whose stacks read the same
    // (most of a function's addresses, without line numbers) share the
    // name and the stat (a flight recorder's snapshot may hold a hundred
    // thousand samples).
    let mut stack_of: FxHashMap<StackKey<'_>, usize> = FxHashMap::default();
    let mut stacks: Vec<Vec<(Space, u64)>> = Vec::new();
    let which: Vec<usize> = samples
        .iter()
        .map(|s| {
            *stack_of
                .entry((s.tgid, &s.kernel, &s.user))
                .or_insert_with(|| {
                    stacks.push(sample_frames(s));
                    stacks.len() - 1
                })
        })
        .collect();
    drop(stack_of);
    symbolizer.resolve_stacks(stacks.iter().map(Vec::as_slice));
    let mut by_text: FxHashMap<Arc<str>, Described> = FxHashMap::default();
    let described: Vec<Described> = stacks
        .iter()
        .map(|stack| {
            let (name, text) = describe(stack, symbolizer);
            if let Some(same) = by_text.get(text.as_str()) {
                return same.clone();
            }
            let text: Arc<str> = text.into();
            let stat = (STACK_STAT.into(), Value::Str(Arc::clone(&text)));
            let same: Described = (name.into(), Arc::from([stat]));
            by_text.insert(text, same.clone());
            same
        })
        .collect();
    for (s, stack) in samples.iter().zip(which) {
        let (name, stats) = &described[stack];
        let thread = timeline.threads.get_mut(&s.tid).expect("filtered above");
        thread.spans.push(Span {
            start_ns: s.header.ts_ns,
            end_ns: s.header.ts_ns,
            name: Arc::clone(name),
            stats: Stats::shared_then(Arc::clone(stats), Vec::new()),
            correlation: None,
        });
    }
    samples.len() as u64
}

/// A stack's name and stat, as its samples share them.
type Described = (Arc<str>, Arc<[Stat]>);

/// A sample's stack as the probes took it: its process, kernel and user
/// addresses.
type StackKey<'a> = (u32, &'a [u64], &'a [u64]);

/// A sample's name (the innermost function of its user stack, else of
/// its kernel stack) and its stack's text: innermost frame first, one per
/// line.
fn describe(stack: &[(Space, u64)], symbolizer: &StackSymbolizer) -> (String, String) {
    let mut lines = Vec::new();
    let mut innermost_user = None;
    let mut innermost = None;
    for &(space, address) in stack {
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
    (name, lines.join("\n"))
}

/// Narrows the [`ThreadState::Unknown`] intervals with the threads' own
/// stack samples, each of which shows its thread on a CPU at its time. An
/// interval ended by a reported switch-out (its switch-in went unreported)
/// was on a CPU from its first sample on; one begun by a reported
/// switch-in (its switch-out went unreported), up to its last. Those parts
/// become [`ThreadState::Sampled`]; the rest stays unknown. Returns how
/// many intervals it narrowed.
pub fn narrow_unknown(timeline: &mut Timeline, samples: &[&StackSample]) -> u64 {
    let with_unknown: FxHashSet<u32> = timeline
        .threads
        .values()
        .filter(|t| t.slices.iter().any(|s| s.state() == ThreadState::Unknown))
        .map(|t| t.tid)
        .collect();
    if with_unknown.is_empty() {
        return 0;
    }
    let mut seen: FxHashMap<u32, Vec<(u64, u32)>> = FxHashMap::default();
    for s in samples.iter().filter(|s| with_unknown.contains(&s.tid)) {
        seen.entry(s.tid)
            .or_default()
            .push((s.header.ts_ns, s.header.cpu.into()));
    }
    let mut narrowed = 0;
    for (tid, mut seen) in seen {
        seen.sort_unstable();
        if let Some(thread) = timeline.threads.get_mut(&tid) {
            narrowed += narrow_thread(thread, &seen);
        }
    }
    narrowed
}

/// [`narrow_unknown`] for one thread, `seen` being its samples' times and
/// CPUs, in time order.
fn narrow_thread(thread: &mut ThreadTrack, seen: &[(u64, u32)]) -> u64 {
    let mut slices = Vec::with_capacity(thread.slices.len() + 2);
    let mut narrowed = 0;
    for (i, &slice) in thread.slices.iter().enumerate() {
        if slice.state() != ThreadState::Unknown {
            slices.push(slice);
            continue;
        }
        let (start, end) = (slice.start_ns, slice.end_ns);
        let inside = &seen[seen.partition_point(|&(ts, _)| ts < start)
            ..seen.partition_point(|&(ts, _)| ts < end)];
        let next = thread
            .slices
            .get(i + 1)
            .filter(|n| n.start_ns == end)
            .map(StateSlice::state);
        let (Some(&(first, first_cpu)), Some(&(last, last_cpu)), Some(next)) =
            (inside.first(), inside.last(), next)
        else {
            slices.push(slice);
            continue;
        };
        let pieces = if next.on_cpu().is_some() {
            [
                (start, last, ThreadState::Sampled { cpu: last_cpu }),
                (last, end, ThreadState::Unknown),
            ]
        } else {
            [
                (start, first, ThreadState::Unknown),
                (first, end, ThreadState::Sampled { cpu: first_cpu }),
            ]
        };
        for (from, to, state) in pieces {
            if to <= from {
                continue;
            }
            if state != ThreadState::Unknown {
                let c = &mut thread.counters;
                c.unknown_ns = c.unknown_ns.saturating_sub(to - from);
                c.on_cpu_ns += to - from;
                narrowed += 1;
            }
            slices.push(StateSlice::new(from, to, state));
        }
    }
    thread.slices = slices;
    narrowed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::{RunnableCause, TaskState, ThreadCounters};

    const PREEMPTED: ThreadState = ThreadState::Runnable {
        cause: RunnableCause::Preempted,
    };
    const SLEEPING: ThreadState = ThreadState::Blocked {
        state: TaskState::Sleeping,
    };

    fn thread(slices: &[(u64, u64, ThreadState)]) -> ThreadTrack {
        let mut counters = ThreadCounters::default();
        for &(from, to, state) in slices {
            match state {
                ThreadState::Unknown => counters.unknown_ns += to - from,
                s if s.on_cpu().is_some() => counters.on_cpu_ns += to - from,
                _ => counters.blocked_ns += to - from,
            }
        }
        ThreadTrack {
            tid: 4,
            pid: 4,
            name: "t".into(),
            slices: slices
                .iter()
                .map(|&(from, to, state)| StateSlice::new(from, to, state))
                .collect(),
            marks: vec![],
            spans: vec![],
            counters,
        }
    }

    fn states(t: &ThreadTrack) -> Vec<(u64, u64, ThreadState)> {
        t.slices
            .iter()
            .map(|s| (s.start_ns, s.end_ns, s.state()))
            .collect()
    }

    /// The switch-in went unreported, the switch-out that ended the
    /// interval did not: on a CPU from the first sample to that switch-out.
    #[test]
    fn an_unreported_switch_in_is_narrowed_to_the_first_sample() {
        let mut t = thread(&[
            (0, 100, ThreadState::Running { cpu: 0 }),
            (100, 1_000, ThreadState::Unknown),
            (1_000, 1_200, SLEEPING),
        ]);
        let n = narrow_thread(&mut t, &[(50, 0), (400, 1), (700, 1), (1_100, 1)]);
        assert_eq!(n, 1);
        assert_eq!(
            states(&t),
            [
                (0, 100, ThreadState::Running { cpu: 0 }),
                (100, 400, ThreadState::Unknown),
                (400, 1_000, ThreadState::Sampled { cpu: 1 }),
                (1_000, 1_200, SLEEPING),
            ]
        );
        assert_eq!(t.counters.unknown_ns, 300);
        assert_eq!(t.counters.on_cpu_ns, 100 + 600);
    }

    /// The switch-out went unreported, the switch-in that ended the
    /// interval did not: on a CPU from its start to the last sample.
    #[test]
    fn an_unreported_switch_out_is_narrowed_to_the_last_sample() {
        let mut t = thread(&[
            (0, 100, PREEMPTED),
            (100, 1_000, ThreadState::Unknown),
            (1_000, 1_200, ThreadState::Running { cpu: 1 }),
        ]);
        let n = narrow_thread(&mut t, &[(300, 0), (600, 0)]);
        assert_eq!(n, 1);
        assert_eq!(
            states(&t),
            [
                (0, 100, PREEMPTED),
                (100, 600, ThreadState::Sampled { cpu: 0 }),
                (600, 1_000, ThreadState::Unknown),
                (1_000, 1_200, ThreadState::Running { cpu: 1 }),
            ]
        );
        assert_eq!(t.counters.unknown_ns, 400);
        assert_eq!(t.counters.on_cpu_ns, 500 + 200);
    }

    /// Without a sample inside, or with the interval last on the line (what
    /// ended it is not known), nothing changes; a sample right at the start
    /// leaves no unknown part.
    #[test]
    fn only_sampled_intervals_with_a_known_end_are_narrowed() {
        let line = [
            (0, 100, ThreadState::Unknown),
            (100, 200, SLEEPING),
            (200, 300, ThreadState::Unknown),
        ];
        let mut t = thread(&line);
        assert_eq!(narrow_thread(&mut t, &[(150, 0), (250, 0), (300, 0)]), 0);
        assert_eq!(states(&t), line);

        let mut t = thread(&line);
        assert_eq!(narrow_thread(&mut t, &[(0, 3)]), 1);
        assert_eq!(
            states(&t),
            [
                (0, 100, ThreadState::Sampled { cpu: 3 }),
                (100, 200, SLEEPING),
                (200, 300, ThreadState::Unknown),
            ]
        );
        assert_eq!(t.counters.unknown_ns, 100);

        // Ended by a reported switch-in (its switch-out went unreported),
        // its only sample at its start: nothing is known past that
        // instant, so it stays unknown.
        let line = [
            (0, 100, ThreadState::Unknown),
            (100, 200, ThreadState::Running { cpu: 0 }),
        ];
        let mut t = thread(&line);
        assert_eq!(narrow_thread(&mut t, &[(0, 0)]), 0);
        assert_eq!(states(&t), line);
    }

    /// Samples with one stack share its name and its stat; a sample with
    /// another stack has its own, named after its innermost function.
    #[test]
    fn samples_of_one_stack_share_its_texts() {
        use tracer_common::{RecordHeader, RecordKind};
        let pid = std::process::id();
        let (write, read) = (
            libc::write as *const () as u64,
            libc::read as *const () as u64,
        );
        let sample = |ts, address| StackSample {
            header: RecordHeader::new(RecordKind::StackSample, 0, 0, ts),
            tid: 4,
            tgid: pid,
            user: Box::new([address]),
            kernel: Box::new([]),
            user_unreadable: false,
            kernel_unreadable: false,
        };
        let samples = [
            sample(10, write),
            sample(20, read),
            sample(30, write),
            sample(40, write + 1),
        ];
        let mut symbolizer = StackSymbolizer::default();
        for s in &samples {
            symbolizer.note_sample(s);
        }
        let mut timeline = Timeline {
            start_ns: 0,
            stop_ns: 100,
            clock: crate::clock::ClockSync::from_offset(0),
            processes: Default::default(),
            peers: Vec::new(),
            threads: [(4, thread(&[(0, 100, ThreadState::Running { cpu: 0 })]))].into(),
            devices: Default::default(),
            carried_planes: Vec::new(),
            stats: Default::default(),
        };
        let refs: Vec<&StackSample> = samples.iter().collect();
        assert_eq!(
            add_cpu_samples(&mut timeline, &refs, (0, 100), &mut symbolizer),
            4
        );
        let spans = &timeline.threads[&4].spans;
        let names: Vec<&str> = spans.iter().map(|s| &*s.name).collect();
        assert!(
            names[0].contains("write") && names[1].contains("read"),
            "{names:?}"
        );
        assert!(Arc::ptr_eq(&spans[0].name, &spans[2].name));
        let (first, third) = (spans[0].stats.shared(), spans[2].stats.shared());
        assert!(Arc::ptr_eq(first.unwrap(), third.unwrap()));
        assert!(!Arc::ptr_eq(
            first.unwrap(),
            spans[1].stats.shared().unwrap()
        ));
        let Some(Value::Str(stack)) = spans[1].stats.get(STACK_STAT) else {
            panic!("{:?}", spans[1].stats)
        };
        assert!(stack.contains("read"), "{stack}");
        assert!(spans.iter().all(|s| s.stats.own().is_empty()));
        // Another address whose stack reads the same (the same function,
        // no other line) shares the same copy.
        let text = |i: usize| spans[i].stats.get(STACK_STAT).cloned();
        let shared = |i: usize| spans[i].stats.shared().unwrap();
        for (i, j) in [(0, 1), (0, 3), (1, 3)] {
            assert_eq!(
                text(i) == text(j),
                Arc::ptr_eq(shared(i), shared(j)),
                "{i} {j}"
            );
        }
    }
}
