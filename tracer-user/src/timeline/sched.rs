//! `SchedTimelineBuilder`: turns scheduler records into per-thread state
//! slices.
//!
//! Records must be fed in timestamp order. Each thread runs a small state
//! machine; every handler keeps one invariant: a thread's slices are
//! consecutive and never overlap, and only the part inside the capture
//! window is kept. What a thread did before its first record is inferred
//! from that record (a switch-out means it was running, a switch-in that it
//! was runnable, a wake-up that it was blocked) or, for threads with no
//! record at all, from the `/proc` state read when the capture started.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rustc_hash::FxHashMap;

use tracer_common::{CLONE_THREAD, PREEMPTED};

use super::{
    CaptureStats, FlowId, Mark, MarkKind, Peer, PeerTable, ProcessInfo, RunnableCause, StateSlice,
    TaskState, ThreadCounters, ThreadState, ThreadTrack, Timeline,
};
use crate::{clock::ClockSync, collect::Record};

/// A thread as `/proc` showed it when the capture started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitialState {
    /// Its process.
    pub pid: u32,
    /// Its name (`comm`).
    pub name: String,
    /// `/proc/.../stat` state letter.
    pub state: char,
    /// The CPU it last ran on.
    pub cpu: u32,
}

#[derive(Default)]
struct ThreadBuild {
    pid: u32,
    name: Option<String>,
    /// Current state and since when; `None` before the first record.
    cur: Option<(ThreadState, u64)>,
    /// Creation time, for threads created during the capture.
    born_ns: Option<u64>,
    seen_switch_in: bool,
    dead: bool,
    last_cpu: Option<u32>,
    slices: Vec<StateSlice>,
    marks: Vec<Mark>,
    counters: ThreadCounters,
}

/// The window a thread's states are kept in, and the processes followed
/// from later than its start.
struct Bounds {
    start_ns: u64,
    stop_ns: u64,
    tracked_from: FxHashMap<u32, u64>,
}

impl Bounds {
    /// Whether a record at `ts` is counted. The records from between
    /// attaching and the window's start set the threads' states up, but
    /// the counters cover the window alone.
    fn counts(&self, ts: u64) -> bool {
        ts >= self.start_ns
    }
}

/// Thread `tid` of process `pid`, made on its first record.
fn thread_entry(threads: &mut FxHashMap<u32, ThreadBuild>, tid: u32, pid: u32) -> &mut ThreadBuild {
    let t = threads.entry(tid).or_default();
    if t.pid == 0 {
        t.pid = pid;
    }
    t
}

impl ThreadBuild {
    /// Ends the current state at `ts`; `before_first` is what the thread
    /// must have been doing if this is its first record. Returns the events
    /// the slice kept makes (a Running one makes a CPU slice too).
    fn close(&mut self, ts: u64, before_first: ThreadState, bounds: &Bounds) -> usize {
        let (state, since) = match self.cur {
            Some(cur) => cur,
            None if self.dead => return 0,
            None => {
                let tracked_from = bounds.tracked_from.get(&self.pid).copied();
                (
                    before_first,
                    self.born_ns.or(tracked_from).unwrap_or(bounds.start_ns),
                )
            }
        };
        self.cur = None;
        let (from, to) = (since.max(bounds.start_ns), ts.min(bounds.stop_ns));
        if to <= from {
            return 0;
        }
        let d = to - from;
        match state {
            ThreadState::Running { .. } | ThreadState::Sampled { .. } => {
                self.counters.on_cpu_ns += d
            }
            ThreadState::Runnable { .. } => self.counters.runnable_ns += d,
            ThreadState::Blocked { .. } => self.counters.blocked_ns += d,
            ThreadState::Unknown => self.counters.unknown_ns += d,
        }
        self.slices.push(StateSlice::new(from, to, state));
        if matches!(state, ThreadState::Running { .. }) {
            2
        } else {
            1
        }
    }

    /// Opens the state a switch-out leaves the thread in; `counted` says
    /// whether the switch falls in the window the counters cover.
    fn after_switch_out(&mut self, prev_state: u64, ts: u64, counted: bool) {
        let n = u64::from(counted);
        let next = if prev_state == PREEMPTED {
            self.counters.involuntary_switches += n;
            ThreadState::Runnable {
                cause: RunnableCause::Preempted,
            }
        } else if prev_state & 0xff == 0 {
            self.counters.involuntary_switches += n;
            ThreadState::Runnable {
                cause: RunnableCause::Yielded,
            }
        } else {
            self.counters.voluntary_switches += n;
            let state = TaskState::from_prev_state(prev_state);
            if state == TaskState::Dead {
                self.dead = true;
                return;
            }
            ThreadState::Blocked { state }
        };
        self.cur = Some((next, ts));
    }
}

/// Builds the threads' scheduling states, marks and counters in a capture window from its scheduler
/// records, fed in time order.
pub struct SchedTimelineBuilder {
    bounds: Bounds,
    targets: BTreeSet<u32>,
    initial: FxHashMap<u32, InitialState>,
    /// Looked up several times per record: a fast hash for small keys.
    threads: FxHashMap<u32, ThreadBuild>,
    processes: BTreeMap<u32, ProcessInfo>,
    /// The next wake-up's flow id; 0 once they are all taken.
    next_flow_id: u32,
    /// The threads wake-ups name.
    peers: PeerTable,
    /// State slices made so far, a Running one twice (its CPU slice).
    slice_events: usize,
    records: u64,
    inconsistencies: u64,
}

impl SchedTimelineBuilder {
    /// `start_ns..stop_ns` is the capture window (monotonic ns); `processes`
    /// the traced processes; `initial` their threads at start.
    pub fn new(
        start_ns: u64,
        stop_ns: u64,
        processes: impl IntoIterator<Item = (u32, String)>,
        initial: HashMap<u32, InitialState>,
    ) -> Self {
        let processes: BTreeMap<u32, ProcessInfo> = processes
            .into_iter()
            .map(|(pid, name)| {
                (
                    pid,
                    ProcessInfo {
                        pid,
                        name,
                        exited_ns: None,
                    },
                )
            })
            .collect();
        SchedTimelineBuilder {
            bounds: Bounds {
                start_ns,
                stop_ns,
                tracked_from: FxHashMap::default(),
            },
            targets: processes.keys().copied().collect(),
            initial: initial.into_iter().collect(),
            threads: FxHashMap::default(),
            processes,
            next_flow_id: 1,
            peers: PeerTable::default(),
            slice_events: 0,
            records: 0,
            inconsistencies: 0,
        }
    }

    /// Ends the window at `stop_ns`, for a builder made before the end was
    /// known (see [`super::streamed`]); records fed so far must not be later.
    pub fn stop_at(&mut self, stop_ns: u64) {
        self.bounds.stop_ns = stop_ns;
    }

    /// At least how many events the timeline will have that start no
    /// later than the last record fed: the state slices made so far and
    /// the CPU slices of the Running ones (marks not counted).
    pub fn events_made(&self) -> usize {
        self.slice_events
    }

    /// Counts `n` records of the window that were not fed (see
    /// [`super::streamed`]).
    pub fn count_unfed(&mut self, n: u64) {
        self.records += n;
    }

    /// Says that the probes follow process `pid` from `since_ns` only (it
    /// was added to a capture already running): its threads' states
    /// before then are unknown, not what their first records imply.
    pub fn tracked_from(&mut self, pid: u32, since_ns: u64) {
        self.bounds.tracked_from.insert(pid, since_ns);
    }

    fn thread(&mut self, tid: u32, pid: u32) -> &mut ThreadBuild {
        thread_entry(&mut self.threads, tid, pid)
    }

    /// Feeds one record; records must come in timestamp order.
    pub fn push(&mut self, record: &Record) {
        let ts = record.ts();
        if ts > self.bounds.stop_ns {
            return;
        }
        if self.bounds.counts(ts) {
            self.records += 1;
        }
        match record {
            Record::Switch(r) => {
                let cpu = u32::from(r.header.cpu);
                if r.prev_tgid != 0 {
                    self.switch_out(r.prev_tid, r.prev_tgid, cpu, r.prev_state(), ts);
                }
                if r.next_tgid != 0 {
                    self.switch_in(r.next_tid, r.next_tgid, cpu, ts);
                }
            }
            Record::Wakeup(r) => {
                self.wakeup(r.tid, r.tgid, r.waker_tid, r.waker_tgid, r.is_new(), ts);
            }
            Record::TaskNew(r) => {
                if r.clone_flags & CLONE_THREAD != 0 {
                    let name = comm_to_string(&r.comm);
                    let child = self.thread(r.child_tid, r.parent_tgid);
                    child.born_ns = Some(ts);
                    child.name = Some(name);
                    self.thread(r.parent_tid, r.parent_tgid)
                        .marks
                        .push(Mark::new(ts, MarkKind::ThreadCreated { tid: r.child_tid }));
                }
            }
            Record::Fork(r) => {
                if r.is_thread == 0 {
                    self.thread(r.parent_tid, r.parent_tgid)
                        .marks
                        .push(Mark::new(ts, MarkKind::ProcessForked { pid: r.child_tid }));
                }
            }
            Record::Exit(r) => {
                let t = self.thread(r.tid, r.tgid);
                t.marks.push(Mark::new(ts, MarkKind::Exited));
                if t.name.is_none() {
                    t.name = Some(comm_to_string(&r.comm));
                }
                if r.group_dead == 1
                    && let Some(p) = self.processes.get_mut(&r.tgid)
                {
                    p.exited_ns = Some(ts);
                }
            }
            Record::Rename(r) => {
                self.thread(r.tid, r.tgid).name = Some(comm_to_string(&r.comm));
            }
            // Other probe families' records are built by their own builders
            // (`timeline::cuda`, `timeline::traceme`).
            Record::CudaCall(_)
            | Record::CudaSymbol(_)
            | Record::TraceMe(_)
            | Record::StackSample(_) => {}
        }
    }

    fn switch_out(&mut self, tid: u32, pid: u32, cpu: u32, prev_state: u64, ts: u64) {
        let t = thread_entry(&mut self.threads, tid, pid);
        let before_first = match t.cur {
            Some((ThreadState::Running { .. }, _)) => ThreadState::Running { cpu },
            // Inferred wrongly before the first switch-in (e.g. a wake-up
            // that found it still on the CPU): it was running all along.
            _ if !t.seen_switch_in => {
                t.slices.clear();
                t.counters = ThreadCounters {
                    wakeups: t.counters.wakeups,
                    ..ThreadCounters::default()
                };
                t.cur = None;
                ThreadState::Running { cpu }
            }
            // The switch-in (and maybe the wake-up) was never reported:
            // when it ran within this interval is unknown.
            Some((_, since)) => {
                t.cur = Some((ThreadState::Unknown, since));
                self.inconsistencies += 1;
                ThreadState::Unknown
            }
            None => ThreadState::Running { cpu },
        };
        t.last_cpu = Some(cpu);
        self.slice_events += t.close(ts, before_first, &self.bounds);
        t.after_switch_out(prev_state, ts, self.bounds.counts(ts));
    }

    fn switch_in(&mut self, tid: u32, pid: u32, cpu: u32, ts: u64) {
        let t = thread_entry(&mut self.threads, tid, pid);
        if self.bounds.counts(ts) && t.last_cpu.is_some_and(|c| c != cpu) {
            t.counters.migrations += 1;
        }
        t.last_cpu = Some(cpu);
        t.seen_switch_in = true;
        t.dead = false;
        match t.cur {
            // Already running: its switch-out was never reported.
            Some((ThreadState::Running { .. }, since)) => {
                t.cur = Some((ThreadState::Unknown, since));
                self.inconsistencies += 1;
            }
            // Its wake-up was never reported; the wait is usually short,
            // so the slice stays blocked.
            Some((ThreadState::Blocked { .. }, _)) => self.inconsistencies += 1,
            _ => {}
        }
        let before = ThreadState::Runnable {
            cause: if t.born_ns.is_some() {
                RunnableCause::Created
            } else {
                RunnableCause::AtStart
            },
        };
        self.slice_events += t.close(ts, before, &self.bounds);
        t.cur = Some((ThreadState::Running { cpu }, ts));
    }

    fn wakeup(
        &mut self,
        tid: u32,
        pid: u32,
        waker_tid: u32,
        waker_pid: u32,
        created: bool,
        ts: u64,
    ) {
        let initial_letter = self.initial.get(&tid).map(|i| i.state);
        let counted = self.bounds.counts(ts);
        let t = self.thread(tid, pid);
        let blocked_before = match t.cur {
            Some((ThreadState::Blocked { .. }, _)) => true,
            // Still on a CPU, or already queued: nothing changes.
            Some(_) => false,
            None if t.born_ns.is_some() => true,
            None => !matches!(initial_letter, Some('R')),
        };
        if !blocked_before {
            return;
        }
        if counted {
            t.counters.wakeups += 1;
        }
        let before = ThreadState::Blocked {
            state: initial_letter.map_or(TaskState::Unknown, TaskState::from_proc_letter),
        };
        let cause = if created {
            RunnableCause::Created
        } else {
            let flow_id = FlowId::new(self.next_flow_id);
            self.next_flow_id = self.next_flow_id.checked_add(1).unwrap_or(0);
            if self.targets.contains(&waker_pid)
                && (self.bounds.start_ns..=self.bounds.stop_ns).contains(&ts)
            {
                let woken = self.peers.id(Peer { tid, pid });
                let mark = Mark::new(ts, MarkKind::Wakeup { woken, flow_id });
                self.thread(waker_tid, waker_pid).marks.push(mark);
            }
            RunnableCause::Woken {
                waker: self.peers.id(Peer {
                    tid: waker_tid,
                    pid: waker_pid,
                }),
                flow_id,
            }
        };
        let t = self.threads.get_mut(&tid).expect("thread exists");
        // Between creation and first wake-up a thread is not schedulable.
        if t.born_ns.is_none() || t.cur.is_some() {
            self.slice_events += t.close(ts, before, &self.bounds);
        }
        t.cur = Some((ThreadState::Runnable { cause }, ts));
    }

    /// Closes every open state at the end of the window. `names` gives the
    /// thread names `/proc` shows at the end (for threads never renamed).
    pub fn finish(
        mut self,
        clock: ClockSync,
        names: &HashMap<u32, String>,
        mut stats: CaptureStats,
    ) -> Timeline {
        // Threads that existed at start but produced no record at all.
        let initial: Vec<(u32, InitialState)> =
            self.initial.iter().map(|(k, v)| (*k, v.clone())).collect();
        for (tid, init) in &initial {
            self.thread(*tid, init.pid);
        }
        let stop = self.bounds.stop_ns;
        let tids: Vec<u32> = self.threads.keys().copied().collect();
        for tid in tids {
            let before = match self.initial.get(&tid) {
                Some(i) if i.state == 'R' => ThreadState::Running { cpu: i.cpu },
                Some(i) => ThreadState::Blocked {
                    state: TaskState::from_proc_letter(i.state),
                },
                None => ThreadState::Blocked {
                    state: TaskState::Unknown,
                },
            };
            let t = self.threads.get_mut(&tid).expect("thread exists");
            self.slice_events += t.close(stop, before, &self.bounds);
        }

        let mut threads = BTreeMap::new();
        for (tid, mut t) in self.threads {
            // What the vectors kept for growth goes back: the largest
            // buffers of a capture.
            t.slices.shrink_to_fit();
            t.marks.shrink_to_fit();
            let name = t
                .name
                .or_else(|| names.get(&tid).cloned())
                .or_else(|| self.initial.get(&tid).map(|i| i.name.clone()))
                .unwrap_or_else(|| format!("thread {tid}"));
            let mut marks = t.marks;
            marks.retain(|m| m.ts_ns >= self.bounds.start_ns && m.ts_ns <= self.bounds.stop_ns);
            threads.insert(
                tid,
                ThreadTrack {
                    tid,
                    pid: t.pid,
                    name,
                    slices: t.slices,
                    marks,
                    spans: Vec::new(),
                    counters: t.counters,
                },
            );
        }
        stats.records = self.records;
        stats.inconsistencies = self.inconsistencies;
        Timeline {
            start_ns: self.bounds.start_ns,
            stop_ns: self.bounds.stop_ns,
            clock,
            processes: self.processes,
            threads,
            peers: self.peers.into_peers(),
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats,
        }
    }
}

/// A kernel `comm` (NUL-padded, not always NUL-terminated) as a string.
pub fn comm_to_string(comm: &[u8]) -> String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PID: u32 = 100;

    fn wakeup(ts: u64, tid: u32, waker: u32) -> Record {
        Record::sched_waking(ts, (tid, PID), (waker, PID))
    }

    fn build(records: &[Record], initial: &[(u32, char)]) -> Timeline {
        let initial = initial
            .iter()
            .map(|&(tid, state)| {
                (
                    tid,
                    InitialState {
                        pid: PID,
                        name: format!("t{tid}"),
                        state,
                        cpu: 0,
                    },
                )
            })
            .collect();
        let mut b = SchedTimelineBuilder::new(1_000, 2_000, [(PID, "p".into())], initial);
        for r in records {
            b.push(r);
        }
        b.finish(
            ClockSync::from_offset(0),
            &HashMap::new(),
            CaptureStats::default(),
        )
    }

    fn assert_partition(t: &ThreadTrack) {
        for w in t.slices.windows(2) {
            assert_eq!(
                w[0].end_ns, w[1].start_ns,
                "gap or overlap in {:?}",
                t.slices
            );
        }
    }

    #[test]
    fn ping_pong_gives_wakeups_and_flows() {
        let recs = [
            // 101 runs, blocks at 1100 and wakes 102, which runs 1100..1300.
            wakeup(1_090, 102, 101),
            Record::sched_switch(1_100, 0, (101, PID), 0x1, (102, PID)),
            wakeup(1_290, 101, 102),
            Record::sched_switch(1_300, 0, (102, PID), 0x1, (101, PID)),
        ];
        let tl = build(&recs, &[(101, 'R'), (102, 'S')]);
        let a = &tl.threads[&101];
        let b = &tl.threads[&102];
        assert_partition(a);
        assert_partition(b);
        assert_eq!(a.counters.on_cpu_ns, 100 + 700);
        assert_eq!(a.counters.voluntary_switches, 1);
        assert_eq!(b.counters.on_cpu_ns, 200);
        assert_eq!(b.counters.wakeups, 1);
        // 102 slept from the window start until woken at 1090.
        assert_eq!(
            b.slices[0].state(),
            ThreadState::Blocked {
                state: TaskState::Sleeping
            }
        );
        assert_eq!((b.slices[0].start_ns, b.slices[0].end_ns), (1_000, 1_090));
        let ThreadState::Runnable {
            cause: RunnableCause::Woken { waker, flow_id },
        } = b.slices[1].state()
        else {
            panic!("{:?}", b.slices[1])
        };
        assert_eq!(tl.peer(waker), Peer { tid: 101, pid: PID });
        assert!(flow_id.is_some());
        assert!(a.marks.iter().any(|m| match m.kind() {
            MarkKind::Wakeup { woken, flow_id: f } =>
                tl.peer(woken) == Peer { tid: 102, pid: PID } && f == flow_id,
            _ => false,
        }));
        // CPU 0 shows 101, then 102, then 101.
        let lines = tl.cpu_lines();
        let (cpu, line) = lines.iter().next().expect("a CPU line");
        assert_eq!(cpu, 0);
        let cpu0: Vec<u32> = line.map(|s| s.tid).collect();
        assert_eq!(cpu0, vec![101, 102, 101]);
    }

    #[test]
    fn preemption_is_involuntary_and_runnable() {
        let recs = [
            Record::sched_switch(1_200, 1, (7, PID), PREEMPTED, (0, 0)),
            Record::sched_switch(1_250, 1, (0, 0), 0, (7, PID)),
        ];
        let tl = build(&recs, &[]);
        let t = &tl.threads[&7];
        assert_eq!(t.counters.involuntary_switches, 1);
        assert_eq!(t.counters.runnable_ns, 50);
        assert_eq!(t.counters.on_cpu_ns, 200 + 750);
        assert_partition(t);
    }

    #[test]
    fn only_transitions_in_the_window_are_counted() {
        let recs = [
            Record::sched_switch(500, 1, (7, PID), PREEMPTED, (0, 0)),
            Record::sched_switch(600, 0, (0, 0), 0, (7, PID)),
            Record::sched_switch(700, 0, (7, PID), 0x1, (0, 0)),
            wakeup(800, 7, 8),
            Record::sched_switch(900, 1, (0, 0), 0, (7, PID)),
            Record::sched_switch(1_200, 1, (7, PID), PREEMPTED, (0, 0)),
            Record::sched_switch(1_250, 0, (0, 0), 0, (7, PID)),
        ];
        let tl = build(&recs, &[]);
        let t = &tl.threads[&7];
        assert_eq!(t.counters.involuntary_switches, 1);
        assert_eq!(t.counters.voluntary_switches, 0);
        assert_eq!(t.counters.wakeups, 0);
        assert_eq!(t.counters.migrations, 1);
        assert_eq!(t.counters.on_cpu_ns, 200 + 750);
        assert_partition(t);
    }

    #[test]
    fn silent_threads_take_their_proc_state() {
        let tl = build(&[], &[(5, 'S'), (6, 'R')]);
        assert_eq!(tl.threads[&5].counters.blocked_ns, 1_000);
        assert_eq!(tl.threads[&6].counters.on_cpu_ns, 1_000);
    }

    #[test]
    fn wakeup_of_a_thread_still_on_cpu_is_corrected() {
        // Unknown thread gets a wake-up (it had not slept yet), then switches out.
        let recs = [
            wakeup(1_100, 9, 8),
            Record::sched_switch(1_500, 0, (9, PID), 0x1, (0, 0)),
        ];
        let tl = build(&recs, &[]);
        let t = &tl.threads[&9];
        assert_eq!(t.counters.on_cpu_ns, 500);
        assert_eq!(t.counters.blocked_ns, 500);
        assert_partition(t);
    }

    #[test]
    fn unreported_switch_in_leaves_an_unknown_interval() {
        let recs = [
            Record::sched_switch(1_100, 0, (0, 0), 0, (4, PID)),
            Record::sched_switch(1_200, 0, (4, PID), 0x1, (0, 0)),
            // No wake-up, no switch-in reported, then a switch-out.
            Record::sched_switch(1_700, 0, (4, PID), 0x1, (0, 0)),
        ];
        let tl = build(&recs, &[]);
        let t = &tl.threads[&4];
        assert_partition(t);
        assert_eq!(t.counters.on_cpu_ns, 100);
        assert_eq!(t.counters.unknown_ns, 500);
        assert_eq!(t.slices[2].state(), ThreadState::Unknown);
        assert_eq!(tl.stats.inconsistencies, 1);
    }

    /// A process added to a running capture: its threads' lines start
    /// when it was added, whether they ran then or stayed silent; another
    /// process's from the window's start.
    #[test]
    fn a_process_tracked_from_later_starts_its_lines_then() {
        let initial = [(7, PID), (8, PID + 1), (9, PID)]
            .into_iter()
            .map(|(tid, pid)| {
                let name = format!("t{tid}");
                let state = 'S';
                (
                    tid,
                    InitialState {
                        pid,
                        name,
                        state,
                        cpu: 0,
                    },
                )
            })
            .collect();
        let processes = [(PID, "p".into()), (PID + 1, "q".into())];
        let mut b = SchedTimelineBuilder::new(1_000, 2_000, processes, initial);
        b.tracked_from(PID, 1_500);
        b.push(&Record::sched_switch(1_800, 0, (7, PID), 0x1, (0, 0)));
        let tl = b.finish(
            ClockSync::from_offset(0),
            &HashMap::new(),
            CaptureStats::default(),
        );
        let ran = &tl.threads[&7];
        assert_partition(ran);
        assert_eq!(
            (ran.slices[0].start_ns, ran.slices[0].end_ns),
            (1_500, 1_800)
        );
        assert!(matches!(ran.slices[0].state(), ThreadState::Running { .. }));
        assert_eq!(tl.threads[&9].slices[0].start_ns, 1_500);
        assert_eq!(tl.threads[&8].slices[0].start_ns, 1_000);
    }

    /// A capture's memory is mostly its slices and marks: they stay small.
    #[test]
    fn slices_and_marks_stay_small() {
        assert_eq!(size_of::<StateSlice>(), 24);
        assert_eq!(size_of::<Mark>(), 16);
    }

    #[test]
    fn exit_ends_the_thread() {
        let recs = [Record::sched_switch(1_400, 0, (9, PID), 0x10, (0, 0))];
        let tl = build(&recs, &[]);
        let t = &tl.threads[&9];
        assert_eq!(t.slices.len(), 1);
        assert_eq!(t.slices[0].end_ns, 1_400);
    }

    #[test]
    fn records_outside_the_window_are_clipped() {
        let recs = [
            Record::sched_switch(900, 0, (0, 0), 0, (3, PID)),
            Record::sched_switch(2_500, 0, (3, PID), 0x1, (0, 0)),
        ];
        let tl = build(&recs, &[]);
        let t = &tl.threads[&3];
        assert_eq!(t.counters.on_cpu_ns, 1_000);
        assert_eq!((t.slices[0].start_ns, t.slices[0].end_ns), (1_000, 2_000));
    }
}
