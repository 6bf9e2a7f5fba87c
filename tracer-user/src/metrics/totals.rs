//! Per-process totals read from `/proc` at each scrape. CPU time comes
//! from the process's own counter (`/proc/PID/stat`, exited threads
//! included); run-queue wait and context switches only exist per thread,
//! so they are summed over every thread ebtrace has seen, an exited thread
//! counting as last read (what it did after the previous scrape is missed).

use std::collections::{BTreeMap, HashMap};

use crate::procfs::{self, TargetProcess};

/// One thread's cumulative counters (`/proc/PID/task/TID/schedstat` and
/// `status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadSample {
    /// Time spent runnable, waiting on a run queue, in ns.
    pub runqueue_wait_ns: u64,
    /// Voluntary context switches.
    pub voluntary_switches: u64,
    /// Involuntary context switches.
    pub involuntary_switches: u64,
}

impl ThreadSample {
    /// Reads thread `tid` of `pid`; `None` once it has exited.
    pub fn read(pid: u32, tid: u32) -> Option<Self> {
        let schedstat = procfs::thread_schedstat(pid, tid)?;
        let switches = procfs::thread_context_switches(pid, tid)?;
        Some(ThreadSample {
            voluntary_switches: switches.voluntary,
            involuntary_switches: switches.involuntary,
            ..parse_schedstat(&schedstat)?
        })
    }

    fn add(&mut self, other: &ThreadSample) {
        self.runqueue_wait_ns += other.runqueue_wait_ns;
        self.voluntary_switches += other.voluntary_switches;
        self.involuntary_switches += other.involuntary_switches;
    }
}

/// `schedstat`: time on the CPU (ns), time waiting on a run queue (ns),
/// timeslices run.
fn parse_schedstat(line: &str) -> Option<ThreadSample> {
    let mut fields = line.split_whitespace().map(|f| f.parse::<u64>().ok());
    let _on_cpu_ns = fields.next()??;
    Some(ThreadSample {
        runqueue_wait_ns: fields.next()??,
        ..ThreadSample::default()
    })
}

/// What one watched process has done since ebtrace first saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessTotals {
    /// The process id.
    pub pid: u32,
    /// Its name (`comm`).
    pub name: String,
    /// Its live threads.
    pub threads: usize,
    /// User + system CPU time of the whole process, ns (clock-tick
    /// resolution).
    pub cpu_ns: u64,
    /// Every thread's counters summed: the live ones now, the exited ones
    /// as last read. A thread born and gone between two scrapes is missed.
    pub sum: ThreadSample,
}

/// The last reading of every thread of every watched process.
#[derive(Debug, Default)]
pub struct Totals {
    processes: HashMap<u32, Tracked>,
}

#[derive(Debug, Default)]
struct Tracked {
    /// Start time of the process, to tell a reused pid.
    started: Option<u64>,
    live: HashMap<u32, ThreadSample>,
    /// The exited threads' last readings, summed.
    retired: ThreadSample,
}

impl Totals {
    /// Reads `targets` now; processes no longer watched are forgotten.
    pub fn refresh(&mut self, targets: &[TargetProcess]) -> Vec<ProcessTotals> {
        self.processes
            .retain(|pid, _| targets.iter().any(|t| t.pid == *pid));
        let mut out = Vec::new();
        for t in targets {
            let started = procfs::start_time_ticks(t.pid);
            let tracked = self.processes.entry(t.pid).or_default();
            if tracked.started != started {
                *tracked = Tracked {
                    started,
                    ..Tracked::default()
                };
            }
            let now: BTreeMap<u32, ThreadSample> = procfs::thread_ids(t.pid)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|tid| Some((tid, ThreadSample::read(t.pid, tid)?)))
                .collect();
            for (tid, last) in &tracked.live {
                if !now.contains_key(tid) {
                    tracked.retired.add(last);
                }
            }
            tracked.live = now.into_iter().collect();
            let mut sum = tracked.retired;
            for s in tracked.live.values() {
                sum.add(s);
            }
            let cpu_ns = t.counters().map_or(0, |c| {
                c.cpu_ticks * 1_000_000_000 / procfs::clock_ticks_per_second()
            });
            out.push(ProcessTotals {
                pid: t.pid,
                name: t.name.clone(),
                threads: tracked.live.len(),
                cpu_ns,
                sum,
            });
        }
        out.sort_by_key(|p| p.pid);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_fields_are_on_cpu_then_waiting() {
        let s = parse_schedstat("123456789 2345 67\n").unwrap();
        assert_eq!(s.runqueue_wait_ns, 2_345);
        assert_eq!(parse_schedstat("garbage"), None);
        assert_eq!(parse_schedstat(""), None);
    }

    #[test]
    fn cpu_time_of_exited_threads_still_counts() {
        let me = TargetProcess::open(std::process::id()).unwrap();
        let mut totals = Totals::default();
        // 200 ms of its own CPU time, however busy the machine is.
        let spin = || {
            let cpu = crate::clock::ClockId::ThreadCPUTime;
            while crate::clock::now_ns(cpu) < 200_000_000 {
                std::hint::spin_loop();
            }
        };
        let worker = std::thread::spawn(spin);
        // Seen while it runs, then gone.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let during = totals.refresh(std::slice::from_ref(&me));
        worker.join().unwrap();
        let after = totals.refresh(std::slice::from_ref(&me));
        // The worker ran at least 180 ms more after it was first seen.
        let grown = after[0].cpu_ns.saturating_sub(during[0].cpu_ns);
        assert!(grown >= 150_000_000, "{grown} ns");
        assert!(after[0].sum.voluntary_switches >= during[0].sum.voluntary_switches);
        assert!(after[0].sum.runqueue_wait_ns >= during[0].sum.runqueue_wait_ns);
    }
}
