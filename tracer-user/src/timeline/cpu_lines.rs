//! The per-CPU lines: which traced thread ran on each CPU, and when.
//!
//! They are the threads' `Running` states seen from the CPU's side, so
//! they are read out of the threads' slices when a sink writes them rather
//! than kept beside them: held as slices of their own, they took a quarter
//! of a large capture's memory, at its peak. Windowing, restricting to some
//! processes and cutting at an event count apply to them through the
//! threads' slices.

use std::{cmp::Reverse, collections::BTreeMap, collections::BinaryHeap};

use super::{CpuSlice, ThreadTrack, Timeline};

/// Where each CPU's slices are among the threads': 8 bytes a slice.
pub struct CpuLines<'t> {
    threads: Vec<&'t ThreadTrack>,
    /// Per CPU, `(thread, slice)` indices of its `Running` slices, thread
    /// after thread, each thread's in the order of its slices.
    per_cpu: BTreeMap<u32, Vec<(u32, u32)>>,
}

impl Timeline {
    /// The per-CPU lines of this timeline's threads.
    pub fn cpu_lines(&self) -> CpuLines<'_> {
        let threads: Vec<&ThreadTrack> = self.threads.values().collect();
        let mut per_cpu: BTreeMap<u32, Vec<(u32, u32)>> = BTreeMap::new();
        for (t, thread) in threads.iter().enumerate() {
            // A thread's consecutive runs are mostly on one CPU.
            let mut last: Option<(u32, &mut Vec<(u32, u32)>)> = None;
            for (s, slice) in thread.slices.iter().enumerate() {
                let Some(cpu) = slice.state().on_cpu() else {
                    continue;
                };
                let line = match last {
                    Some((on, line)) if on == cpu => line,
                    _ => per_cpu.entry(cpu).or_default(),
                };
                line.push((t as u32, s as u32));
                last = Some((cpu, line));
            }
        }
        CpuLines { threads, per_cpu }
    }
}

impl<'t> CpuLines<'t> {
    /// Whether no CPU has a slice.
    pub fn is_empty(&self) -> bool {
        self.per_cpu.is_empty()
    }

    /// Slices on all CPUs.
    pub fn len(&self) -> usize {
        self.per_cpu.values().map(Vec::len).sum()
    }

    /// The threads that ran on some CPU, each once.
    pub fn threads(&self) -> impl Iterator<Item = &'t ThreadTrack> + '_ {
        let mut ran = vec![false; self.threads.len()];
        for &(t, _) in self.per_cpu.values().flatten() {
            ran[t as usize] = true;
        }
        self.threads
            .iter()
            .zip(ran)
            .filter_map(|(thread, ran)| ran.then_some(*thread))
    }

    /// Each CPU with a slice, in order, and its slices by start, the
    /// longer first on equal starts (as sinks lay out nested events), then
    /// by thread id. (A thread's own slices never share a start: states
    /// are built with some length.)
    pub fn iter(&self) -> impl Iterator<Item = (u32, CpuLine<'_, 't>)> {
        self.per_cpu
            .iter()
            .map(|(&cpu, slices)| (cpu, CpuLine::new(&self.threads, slices)))
    }
}

/// One CPU's slices, merged from its threads' runs of slices.
pub struct CpuLine<'a, 't> {
    /// Per run of one thread's slices on the CPU: the thread, and the
    /// indices of the slices still to come.
    runs: Vec<(&'t ThreadTrack, &'a [(u32, u32)])>,
    /// The next slice of each unfinished run, earliest first: start, end
    /// (the longer first) and run.
    next: BinaryHeap<Reverse<(u64, Reverse<u64>, usize)>>,
    /// Slices still to come.
    left: usize,
}

impl<'a, 't> CpuLine<'a, 't> {
    fn new(threads: &[&'t ThreadTrack], slices: &'a [(u32, u32)]) -> Self {
        let runs: Vec<_> = slices
            .chunk_by(|a, b| a.0 == b.0)
            .map(|run| (threads[run[0].0 as usize], run))
            .collect();
        let next = (0..runs.len())
            .filter_map(|run| head(&runs, run).map(Reverse))
            .collect();
        CpuLine {
            runs,
            next,
            left: slices.len(),
        }
    }
}

/// The heap entry of the next slice of `run`, if it has one.
fn head(runs: &[(&ThreadTrack, &[(u32, u32)])], run: usize) -> Option<(u64, Reverse<u64>, usize)> {
    let (thread, rest) = runs[run];
    let &(_, s) = rest.first()?;
    let slice = &thread.slices[s as usize];
    Some((slice.start_ns, Reverse(slice.end_ns), run))
}

impl Iterator for CpuLine<'_, '_> {
    type Item = CpuSlice;

    fn next(&mut self) -> Option<CpuSlice> {
        let mut top = self.next.peek_mut()?;
        let Reverse((start_ns, Reverse(end_ns), run)) = *top;
        let (thread, rest) = &mut self.runs[run];
        let out = CpuSlice {
            start_ns,
            end_ns,
            tid: thread.tid,
            pid: thread.pid,
        };
        *rest = &rest[1..];
        self.left -= 1;
        // The run's next slice takes its place: one sift instead of two.
        match head(&self.runs, run) {
            Some(next) => *top = Reverse(next),
            None => {
                std::collections::binary_heap::PeekMut::pop(top);
            }
        }
        Some(out)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        clock::ClockSync,
        timeline::{CaptureStats, StateSlice, TaskState, ThreadCounters, ThreadState},
    };

    fn thread(tid: u32, pid: u32, slices: &[(u64, u64, Option<u32>)]) -> ThreadTrack {
        ThreadTrack {
            tid,
            pid,
            name: format!("t{tid}"),
            slices: slices
                .iter()
                .map(|&(start_ns, end_ns, cpu)| {
                    StateSlice::new(
                        start_ns,
                        end_ns,
                        match cpu {
                            Some(cpu) => ThreadState::Running { cpu },
                            None => ThreadState::Blocked {
                                state: TaskState::Sleeping,
                            },
                        },
                    )
                })
                .collect(),
            marks: vec![],
            spans: vec![],
            counters: ThreadCounters::default(),
        }
    }

    fn timeline(threads: Vec<ThreadTrack>) -> Timeline {
        Timeline {
            start_ns: 0,
            stop_ns: 100,
            clock: ClockSync::from_offset(0),
            processes: BTreeMap::new(),
            peers: Vec::new(),
            threads: threads.into_iter().map(|t| (t.tid, t)).collect(),
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats: CaptureStats::default(),
        }
    }

    /// Per CPU: start, end, tid, pid of each slice.
    type Lines = Vec<(u32, Vec<(u64, u64, u32, u32)>)>;

    fn lines(tl: &Timeline) -> Lines {
        tl.cpu_lines()
            .iter()
            .map(|(cpu, line)| {
                let slices = line.map(|s| (s.start_ns, s.end_ns, s.tid, s.pid));
                (cpu, slices.collect())
            })
            .collect()
    }

    #[test]
    fn threads_running_slices_read_per_cpu_in_time_order() {
        let tl = timeline(vec![
            thread(
                1,
                10,
                &[(0, 10, Some(0)), (10, 20, None), (20, 30, Some(1))],
            ),
            thread(2, 10, &[(0, 5, None), (5, 15, Some(1)), (30, 40, Some(0))]),
            thread(
                3,
                11,
                &[(10, 20, Some(0)), (20, 25, Some(0)), (40, 50, None)],
            ),
        ]);
        assert_eq!(
            lines(&tl),
            vec![
                (
                    0,
                    vec![
                        (0, 10, 1, 10),
                        (10, 20, 3, 11),
                        (20, 25, 3, 11),
                        (30, 40, 2, 10)
                    ]
                ),
                (1, vec![(5, 15, 2, 10), (20, 30, 1, 10)]),
            ]
        );
        let lines = tl.cpu_lines();
        assert_eq!(lines.len(), 6);
        let hints: Vec<_> = lines.iter().map(|(_, l)| l.size_hint()).collect();
        assert_eq!(hints, [(4, Some(4)), (2, Some(2))]);
        let ran: Vec<u32> = lines.threads().map(|t| t.tid).collect();
        assert_eq!(ran, vec![1, 2, 3]);
    }

    #[test]
    fn equal_starts_read_longer_first_then_by_thread_and_a_thread_never_running_is_left_out() {
        let tl = timeline(vec![
            thread(4, 1, &[(7, 9, Some(2)), (9, 12, Some(2))]),
            thread(2, 1, &[(7, 7, Some(2)), (9, 12, Some(2))]),
            thread(3, 1, &[(5, 8, None), (9, 12, Some(2))]),
            thread(9, 1, &[(0, 50, None)]),
        ]);
        let line = [(7, 9, 4), (7, 7, 2), (9, 12, 2), (9, 12, 3), (9, 12, 4)];
        let line = line.map(|(start, end, tid)| (start, end, tid, 1)).to_vec();
        assert_eq!(lines(&tl), vec![(2, line)]);
        let lines = tl.cpu_lines();
        assert_eq!(
            lines.threads().map(|t| t.tid).collect::<Vec<_>>(),
            [2, 3, 4]
        );
        assert!(
            timeline(vec![thread(9, 1, &[(0, 50, None)])])
                .cpu_lines()
                .is_empty()
        );
    }
}
