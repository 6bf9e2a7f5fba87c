//! CPU stack samples on the thread lines: each sample becomes an instant
//! on its thread, named after the innermost function of its user stack
//! (of its kernel stack while the thread ran in the kernel), with the
//! whole stack as a stat. A sample also shows its thread on a CPU: where
//! the kernel left a thread's state unknown, the samples narrow it.
//!
//! An off-CPU stack (taken as a system call that waited long returned)
//! becomes a span over the wait it explains, the thread's Blocked state
//! that ended last before it, named `waited in` the call.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::{Span, Stat, StateSlice, Stats, ThreadState, ThreadTrack, Timeline, Value};
use crate::{
    collect::StackSample,
    symbols::{
        python::frames,
        stacks::{Space, StackSymbolizer, Symbol},
    },
};

/// Stat of a sample's instant: its stack, innermost frame first, one per
/// line; kernel frames marked `[k]`, inlined ones `(inlined)`.
pub const STACK_STAT: &str = "cpu_sample_stack";
/// Stat of an off-CPU span: the user stack its thread waited in, as
/// [`STACK_STAT`] writes it.
pub const OFF_CPU_STACK_STAT: &str = "off_cpu_stack";
/// What an off-CPU span's name begins with, before its system call's name
/// (or, for a number this build does not know, the innermost function).
pub const OFF_CPU_PREFIX: &str = "waited in ";
/// Name of a sample whose innermost frame could not be named.
pub const UNKNOWN_FRAME: &str = "[unknown]";

/// What [`add_cpu_samples`] laid on the thread lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaidStacks {
    /// Samples of threads on a CPU, as instants.
    pub samples: u64,
    /// Off-CPU stacks, as spans over the waits they explain.
    pub off_cpu: u64,
    /// Of both, those with Python frames.
    pub with_python: u64,
    /// Python frames that could not be named, marked in the stacks.
    pub python_unreadable: u64,
    /// Python frames of stacks deeper than a sample keeps, left out.
    pub python_left_out: u64,
}

/// Lays the samples and off-CPU stacks of `[start_ns, stop_ns]` on their
/// threads' lines (those of threads the timeline does not know are left
/// out).
pub fn add_cpu_samples(
    timeline: &mut Timeline,
    samples: &[&StackSample],
    (start_ns, stop_ns): (u64, u64),
    symbolizer: &mut StackSymbolizer,
) -> LaidStacks {
    let samples: Vec<&StackSample> = samples
        .iter()
        .copied()
        .filter(|s| !s.launch && (start_ns..=stop_ns).contains(&s.header.ts_ns))
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
                    stacks.push(s.stack().frames());
                    stacks.len() - 1
                })
        })
        .collect();
    drop(stack_of);
    symbolizer.resolve_stacks(stacks.iter().map(Vec::as_slice));
    let mut by_text: FxHashMap<Arc<str>, Described> = FxHashMap::default();
    // Each stack's name and stat, and its text for an off-CPU span's stat.
    let described: Vec<(Described, Arc<str>)> = stacks
        .iter()
        .map(|stack| {
            let (name, text) = describe(stack, symbolizer);
            if let Some((text, same)) = by_text.get_key_value(text.as_str()) {
                return (same.clone(), Arc::clone(text));
            }
            let text: Arc<str> = text.into();
            let stat = (STACK_STAT.into(), Value::Str(Arc::clone(&text)));
            let same: Described = (name.into(), Arc::from([stat]));
            by_text.insert(Arc::clone(&text), same.clone());
            (same, text)
        })
        .collect();
    let mut laid = LaidStacks::default();
    let mut off_cpu_described: FxHashMap<(usize, u32), Described> = FxHashMap::default();
    for (s, stack) in samples.iter().zip(which) {
        laid.with_python += u64::from(s.python.named > 0);
        laid.python_unreadable += u64::from(s.python.unreadable);
        laid.python_left_out += u64::from(s.python.left_out);
        let thread = timeline.threads.get_mut(&s.tid).expect("filtered above");
        let ts = s.header.ts_ns;
        let (start_ns, end_ns, (name, stats)) = if s.is_off_cpu() {
            let (from, to) = waited(thread, ts, s.off_cpu_us, start_ns);
            let key = (stack, s.syscall);
            let described = off_cpu_described.entry(key).or_insert_with(|| {
                let ((function, _), text) = &described[stack];
                let call = syscall_name(s.syscall).unwrap_or(function);
                let stat = (OFF_CPU_STACK_STAT.into(), Value::Str(Arc::clone(text)));
                (format!("{OFF_CPU_PREFIX}{call}").into(), Arc::from([stat]))
            });
            laid.off_cpu += 1;
            (from, to, &*described)
        } else {
            laid.samples += 1;
            (ts, ts, &described[stack].0)
        };
        thread.spans.push(Span {
            start_ns,
            end_ns,
            name: Arc::clone(name),
            stats: Stats::shared_then(Arc::clone(stats), Vec::new()),
            correlation: None,
        });
    }
    laid
}

/// The name of x86-64's system call number `nr`, if this build knows it.
fn syscall_name(nr: u32) -> Option<&'static str> {
    syscalls::x86_64::Sysno::new(nr as usize).map(|s| s.name())
}

/// The wait an off-CPU stack taken at `ts` explains: the thread's last
/// Blocked state that began before it (it then waited for a CPU, and ran
/// at `ts`); without one (no scheduling recorded), the `off_cpu_us` the
/// probe measured before `ts`, from `window_start` at the earliest.
fn waited(thread: &ThreadTrack, ts: u64, off_cpu_us: u32, window_start: u64) -> (u64, u64) {
    let before = thread.slices.partition_point(|s| s.start_ns < ts);
    let blocked = thread.slices[..before]
        .iter()
        .rev()
        .take(8)
        .find(|s| matches!(s.state(), ThreadState::Blocked { .. }));
    match blocked {
        Some(s) => (s.start_ns, s.end_ns.min(ts)),
        None => (
            ts.saturating_sub(u64::from(off_cpu_us) * 1000)
                .max(window_start),
            ts,
        ),
    }
}

/// A stack's name and stat, as its samples share them.
type Described = (Arc<str>, Arc<[Stat]>);

/// A sample's stack as the probes took it: its process, kernel and user
/// addresses.
type StackKey<'a> = (u32, &'a [u64], &'a [u64]);

/// A sample's name (see [`sample_name`]) and its stack's text: innermost
/// frame first, one per line.
pub(super) fn describe(stack: &[(Space, u64)], symbolizer: &StackSymbolizer) -> (String, String) {
    let mut lines = Vec::new();
    let mut named = Vec::with_capacity(stack.len());
    for &(space, address) in stack {
        let symbol = symbolizer.get(space, address);
        let mark = if space == Space::Kernel { " [k]" } else { "" };
        if symbol.frames.is_empty() {
            let place = symbol.place().unwrap_or_else(|| format!("{address:#x}"));
            lines.push(format!("{place}{mark}"));
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
        named.push((space, symbol));
    }
    let name = sample_name(&named).unwrap_or_else(|| UNKNOWN_FRAME.to_string());
    (name, lines.join("\n"))
}

/// What a sample is named after: its innermost Python frame where the
/// thread ran the interpreter's own code, or the C runtime on its behalf
/// (the frames inside it are the interpreter's work for that Python line),
/// else the innermost function of its user stack (native code, called from
/// Python or not), else of its kernel stack.
fn sample_name(stack: &[(Space, Arc<Symbol>)]) -> Option<String> {
    let first = |s: &Symbol| s.frames.first().map(|f| f.function.clone());
    let mut user = stack.iter().filter(|(space, _)| *space != Space::Kernel);
    let python = user.clone().position(|(space, _)| *space == Space::Python);
    if let Some(at) = python {
        let in_interpreter = user.clone().take(at).all(|(_, s)| {
            s.module
                .as_deref()
                .is_some_and(|m| frames::is_interpreter_object(m) || frames::is_c_runtime_object(m))
        });
        if in_interpreter {
            return user.nth(at).and_then(|(_, s)| first(s));
        }
    }
    user.find_map(|(_, s)| first(s))
        .or_else(|| stack.iter().find_map(|(_, s)| first(s)))
}

/// What [`narrow_unknown`] found in the threads' stack samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Narrowed {
    /// [`ThreadState::Unknown`] intervals whose on-CPU part the samples showed.
    pub unknown: u64,
    /// Runnable or Blocked intervals a sample of their own thread lay in:
    /// the kernel reported neither the switch onto a CPU nor the one off it.
    pub contradicted: u64,
}

/// A sample this close to an interval's edge is taken to be at the edge.
const EDGE_NS: u64 = 1_000;

/// Narrows the [`ThreadState::Unknown`] intervals with the threads' own
/// stack samples, each of which shows its thread on a CPU at its time. An
/// interval ended by a reported switch-out (its switch-in went unreported)
/// was on a CPU from its first sample on; one begun by a reported
/// switch-in (its switch-out went unreported), up to its last. Those parts
/// become [`ThreadState::Sampled`]; the rest stays unknown.
///
/// A Runnable or Blocked interval with a sample of its thread inside hides
/// an unreported switch in and out: from its first sample to its last it
/// is [`ThreadState::Sampled`], either side of them [`ThreadState::Unknown`].
pub fn narrow_unknown(timeline: &mut Timeline, samples: &[&StackSample]) -> Narrowed {
    let mut seen: FxHashMap<u32, Vec<(u64, u32)>> = FxHashMap::default();
    for s in samples.iter().filter(|s| s.is_cpu_sample()) {
        seen.entry(s.tid)
            .or_default()
            .push((s.header.ts_ns, s.header.cpu.into()));
    }
    let mut narrowed = Narrowed::default();
    for (tid, mut seen) in seen {
        seen.sort_unstable();
        if let Some(thread) = timeline.threads.get_mut(&tid) {
            let n = narrow_thread(thread, &seen);
            narrowed.unknown += n.unknown;
            narrowed.contradicted += n.contradicted;
        }
    }
    narrowed
}

/// [`narrow_unknown`] for one thread, `seen` being its samples' times and
/// CPUs, in time order.
fn narrow_thread(thread: &mut ThreadTrack, seen: &[(u64, u32)]) -> Narrowed {
    let mut slices = Vec::with_capacity(thread.slices.len() + 2);
    let mut narrowed = Narrowed::default();
    for (i, &slice) in thread.slices.iter().enumerate() {
        let (start, end) = (slice.start_ns, slice.end_ns);
        let state = slice.state();
        if state.on_cpu().is_some() {
            slices.push(slice);
            continue;
        }
        let inside = |margin: u64| {
            let (from, to) = (start + margin, end.saturating_sub(margin));
            if to <= from {
                return &seen[..0];
            }
            &seen[seen.partition_point(|&(ts, _)| ts < from)
                ..seen.partition_point(|&(ts, _)| ts < to)]
        };
        let pieces = if state == ThreadState::Unknown {
            let inside = inside(0);
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
            if next.on_cpu().is_some() {
                vec![
                    (start, last, ThreadState::Sampled { cpu: last_cpu }),
                    (last, end, ThreadState::Unknown),
                ]
            } else {
                vec![
                    (start, first, ThreadState::Unknown),
                    (first, end, ThreadState::Sampled { cpu: first_cpu }),
                ]
            }
        } else {
            let inside = inside(EDGE_NS);
            let (Some(&(first, cpu)), Some(&(last, _))) = (inside.first(), inside.last()) else {
                slices.push(slice);
                continue;
            };
            narrowed.contradicted += 1;
            let c = &mut thread.counters;
            match state {
                ThreadState::Runnable { .. } => {
                    c.runnable_ns = c.runnable_ns.saturating_sub(end - start)
                }
                _ => c.blocked_ns = c.blocked_ns.saturating_sub(end - start),
            }
            c.unknown_ns += end - start;
            vec![
                (start, first, ThreadState::Unknown),
                (first, last, ThreadState::Sampled { cpu }),
                (last, end, ThreadState::Unknown),
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
                if slice.state() == ThreadState::Unknown {
                    narrowed.unknown += 1;
                }
            }
            match slices.last_mut() {
                // One sample alone leaves two unknown parts: one interval.
                Some(prev)
                    if state == ThreadState::Unknown
                        && prev.state() == ThreadState::Unknown
                        && prev.end_ns == from =>
                {
                    *prev = StateSlice::new(prev.start_ns, to, state);
                }
                _ => slices.push(StateSlice::new(from, to, state)),
            }
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
                ThreadState::Runnable { .. } => counters.runnable_ns += to - from,
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
        assert_eq!(n.unknown, 1);
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
        assert_eq!(n.unknown, 1);
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
        assert_eq!(
            narrow_thread(&mut t, &[(100, 0), (250, 0), (300, 0)]),
            Narrowed::default()
        );
        assert_eq!(states(&t), line);

        let mut t = thread(&line);
        assert_eq!(narrow_thread(&mut t, &[(0, 3)]).unknown, 1);
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
        assert_eq!(narrow_thread(&mut t, &[(0, 0)]), Narrowed::default());
        assert_eq!(states(&t), line);
    }

    /// A sample inside a Runnable interval: the kernel reported neither the
    /// switch onto a CPU nor the one off it. On a CPU from the first sample
    /// to the last; either side, unknown.
    #[test]
    fn a_sample_in_a_runnable_interval_shows_an_unreported_run() {
        let mut t = thread(&[
            (0, 10_000, ThreadState::Running { cpu: 0 }),
            (10_000, 20_000, PREEMPTED),
            (20_000, 30_000, ThreadState::Running { cpu: 1 }),
        ]);
        let n = narrow_thread(&mut t, &[(5_000, 0), (13_000, 1), (16_000, 1)]);
        assert_eq!(
            n,
            Narrowed {
                unknown: 0,
                contradicted: 1
            }
        );
        assert_eq!(
            states(&t),
            [
                (0, 10_000, ThreadState::Running { cpu: 0 }),
                (10_000, 13_000, ThreadState::Unknown),
                (13_000, 16_000, ThreadState::Sampled { cpu: 1 }),
                (16_000, 20_000, ThreadState::Unknown),
                (20_000, 30_000, ThreadState::Running { cpu: 1 }),
            ]
        );
        assert_eq!(t.counters.runnable_ns, 0);
        assert_eq!(t.counters.unknown_ns, 7_000);
        assert_eq!(t.counters.on_cpu_ns, 23_000);
    }

    /// One sample inside a Blocked interval leaves it one unknown interval;
    /// a sample within a microsecond of its edge belongs to the switch.
    #[test]
    fn a_lone_sample_in_a_wait_makes_it_unknown_and_one_at_its_edge_does_not() {
        let line = [
            (0, 10_000, ThreadState::Running { cpu: 0 }),
            (10_000, 20_000, SLEEPING),
            (20_000, 30_000, ThreadState::Running { cpu: 0 }),
        ];
        let mut t = thread(&line);
        assert_eq!(
            narrow_thread(&mut t, &[(10_500, 0), (19_200, 0)]),
            Narrowed::default()
        );
        assert_eq!(states(&t), line);

        let n = narrow_thread(&mut t, &[(15_000, 0)]);
        assert_eq!(n.contradicted, 1);
        assert_eq!(
            states(&t),
            [
                (0, 10_000, ThreadState::Running { cpu: 0 }),
                (10_000, 20_000, ThreadState::Unknown),
                (20_000, 30_000, ThreadState::Running { cpu: 0 }),
            ]
        );
        assert_eq!(t.counters.blocked_ns, 0);
        assert_eq!(t.counters.unknown_ns, 10_000);
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
            off_cpu_us: 0,
            syscall: 0,
            python: Default::default(),
            launch: false,
        };
        let samples = [
            sample(10, write),
            sample(20, read),
            sample(30, write),
            sample(40, write + 1),
        ];
        let mut symbolizer = StackSymbolizer::default();
        for s in &samples {
            symbolizer.note_stack(s.stack());
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
            add_cpu_samples(&mut timeline, &refs, (0, 100), &mut symbolizer).samples,
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

    /// An off-CPU stack spans the Blocked state that ended last before it
    /// was taken, is named after its system call and carries its stack;
    /// without one, it spans the time the probe measured, from the
    /// window's start at the earliest.
    #[test]
    fn an_off_cpu_stack_spans_the_wait_it_explains() {
        use tracer_common::{RecordHeader, RecordKind};
        const FUTEX: u32 = 202;
        let pid = std::process::id();
        let read = libc::read as *const () as u64;
        let stack = |tid, ts, off_cpu_us, syscall| StackSample {
            header: RecordHeader::new(RecordKind::StackSample, 0, 0, ts),
            tid,
            tgid: pid,
            user: Box::new([read]),
            kernel: Box::new([]),
            user_unreadable: false,
            kernel_unreadable: false,
            off_cpu_us,
            syscall,
            python: Default::default(),
            launch: false,
        };
        let blocked = ThreadState::Blocked {
            state: super::super::TaskState::Sleeping,
        };
        let waiting = thread(&[
            (0, 100_000, ThreadState::Running { cpu: 0 }),
            (100_000, 300_000, blocked),
            (
                300_000,
                320_000,
                ThreadState::Runnable {
                    cause: super::super::RunnableCause::Yielded,
                },
            ),
            (320_000, 400_000, ThreadState::Running { cpu: 0 }),
        ]);
        let stacks = [
            stack(4, 320_500, 220, FUTEX),
            stack(5, 50_000, 80, u32::MAX),
        ];
        let mut symbolizer = StackSymbolizer::default();
        for s in &stacks {
            symbolizer.note_stack(s.stack());
        }
        let mut alone = thread(&[(0, 400_000, ThreadState::Running { cpu: 0 })]);
        alone.tid = 5;
        let mut timeline = Timeline {
            start_ns: 0,
            stop_ns: 400_000,
            clock: crate::clock::ClockSync::from_offset(0),
            processes: Default::default(),
            peers: Vec::new(),
            threads: [(4, waiting), (5, alone)].into(),
            devices: Default::default(),
            carried_planes: Vec::new(),
            stats: Default::default(),
        };
        let refs: Vec<&StackSample> = stacks.iter().collect();
        let laid = add_cpu_samples(&mut timeline, &refs, (10_000, 400_000), &mut symbolizer);
        assert_eq!(
            laid,
            LaidStacks {
                samples: 0,
                off_cpu: 2,
                ..LaidStacks::default()
            }
        );

        let span = &timeline.threads[&4].spans[0];
        assert_eq!((span.start_ns, span.end_ns), (100_000, 300_000));
        assert_eq!(&*span.name, "waited in futex");
        let stats = span.stats.shared().unwrap();
        assert_eq!(&*stats[0].0, OFF_CPU_STACK_STAT);
        assert!(
            matches!(&stats[0].1, Value::Str(t) if t.contains("read")),
            "{stats:?}"
        );

        // No Blocked state (scheduling not recorded): 80 µs before it, cut
        // at the window's start; a number no system call has: named after
        // the innermost function.
        let span = &timeline.threads[&5].spans[0];
        assert_eq!((span.start_ns, span.end_ns), (10_000, 50_000));
        assert!(
            span.name.starts_with(OFF_CPU_PREFIX) && span.name.contains("read"),
            "{}",
            span.name
        );
    }
}
