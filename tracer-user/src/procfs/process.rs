//! Which processes and threads there are, what state each is in, and when
//! each process started.

use std::{collections::BTreeMap, fs, os::fd::OwnedFd, sync::Arc};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::{files::pidfd_open, proc_root, process_dir, status, thread_dir};
use crate::error::{Error, Result};

/// The ids of `pid`'s threads right now (`/proc/PID/task`).
pub fn thread_ids(pid: u32) -> std::io::Result<Vec<u32>> {
    Ok(fs::read_dir(process_dir(pid).join("task"))?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect())
}

/// The ids of the processes there are right now (`/proc`).
pub fn process_ids() -> Vec<u32> {
    fs::read_dir(proc_root())
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// One line of `/proc/PID/task/TID/stat`, the fields we use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskStat {
    /// The thread id.
    pub tid: u32,
    /// Its name, without the parentheses.
    pub comm: String,
    /// Single-letter state: R, S, D, T, t, Z, X, I, ...
    pub state: char,
    /// CPU the task last ran on.
    pub cpu: u32,
}

/// Parses a `stat` line; `comm` may contain spaces and parentheses.
pub fn parse_stat(line: &str) -> Option<TaskStat> {
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let tid = line[..open].trim().parse().ok()?;
    let comm = line[open + 1..close].to_string();
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    // rest[0] is field 3 (state); field 39 (processor) is rest[36].
    let state = rest.first()?.chars().next()?;
    let cpu = rest.get(36)?.parse().ok()?;
    Some(TaskStat {
        tid,
        comm,
        state,
        cpu,
    })
}

/// A process to trace.
#[derive(Clone, Debug)]
pub struct TargetProcess {
    /// The process id.
    pub pid: u32,
    /// Its name (`comm`) when it was opened.
    pub name: String,
    /// A pidfd of it, readable once it has exited: a watcher asks many
    /// times a second whether its targets still run, and reading `/proc`
    /// each time would cost more than the rest of its work. None where
    /// the kernel has no pidfds.
    pub(super) exit_fd: Option<Arc<OwnedFd>>,
}

impl TargetProcess {
    /// Checks that `pid` names a live process (not a thread of another one).
    pub fn open(pid: u32) -> Result<Self> {
        // Opened before the process is checked, so that it is the process
        // checked, not one that took its pid after.
        let exit_fd = pidfd_open(pid).ok().map(Arc::new);
        let stat = fs::read_to_string(process_dir(pid).join("stat"))
            .ok()
            .and_then(|s| parse_stat(&s))
            .ok_or(Error::NoSuchProcess { pid })?;
        if stat.state == 'Z' || stat.state == 'X' {
            return Err(Error::ZombieProcess { pid });
        }
        let tgid = status::process_of_task(pid).ok_or(Error::NoSuchProcess { pid })?;
        if tgid != pid {
            // A thread id: trace its whole process, as the user surely meant.
            return TargetProcess::open(tgid);
        }
        Ok(TargetProcess {
            pid,
            name: stat.comm,
            exit_fd,
        })
    }

    /// The process's threads and their states right now.
    pub fn threads(&self) -> BTreeMap<u32, TaskStat> {
        thread_ids(self.pid)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|tid| {
                let stat = fs::read_to_string(thread_dir(self.pid, tid).join("stat")).ok()?;
                Some((tid, parse_stat(&stat)?))
            })
            .collect()
    }

    /// True while the process exists and has not exited (zombies count as
    /// gone). Never true of a process that took the pid after it.
    pub fn is_alive(&self) -> bool {
        let Some(fd) = &self.exit_fd else {
            return is_alive(self.pid);
        };
        let mut polled = [PollFd::new(fd.as_ref(), PollFlags::IN)];
        let no_wait = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut polled, Some(&no_wait)) {
            Ok(0) => true,
            Ok(1) => !polled[0].revents().contains(PollFlags::IN),
            _ => is_alive(self.pid),
        }
    }
}

/// True while process `pid` exists and has not exited (zombies count as gone).
pub fn is_alive(pid: u32) -> bool {
    fs::read_to_string(process_dir(pid).join("stat"))
        .ok()
        .and_then(|s| parse_stat(&s))
        .is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

/// Whether `/proc` lists process `pid`: until it is reaped (a zombie too).
pub fn is_listed(pid: u32) -> bool {
    process_dir(pid).exists()
}

/// Whether `/proc` lists thread `tid` of `pid`: until it is reaped.
pub fn thread_is_listed(pid: u32, tid: u32) -> bool {
    thread_dir(pid, tid).exists()
}

/// The single-letter state of thread `tid` of `pid` (see [`TaskStat`]).
pub fn thread_state(pid: u32, tid: u32) -> Option<char> {
    let stat = fs::read_to_string(thread_dir(pid, tid).join("stat")).ok()?;
    parse_stat(&stat).map(|s| s.state)
}

/// What thread `tid` of `pid` is doing (`/proc/PID/task/TID/syscall`): the
/// number and arguments of the syscall it is blocked in, `-1` and its
/// registers while in user code, or `running`.
pub fn thread_syscall(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(thread_dir(pid, tid).join("syscall")).ok()
}

/// The number of the syscall thread `tid` of `pid` is blocked in, `-1`
/// while it is in user code or running now (see [`thread_syscall`]);
/// `None` once it is gone.
pub fn thread_syscall_number(pid: u32, tid: u32) -> Option<i64> {
    let text = thread_syscall(pid, tid)?;
    match text.split_whitespace().next()? {
        "running" => Some(-1),
        nr => nr.parse().ok(),
    }
}

/// Cumulative CPU time and context switches of a process, for rates
/// over a window (two readings apart).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessCounters {
    /// User + system CPU time of the whole process (exited threads
    /// included), in clock ticks.
    pub cpu_ticks: u64,
    /// Voluntary context switches of its live threads
    /// (`/proc/PID/task/*/status`).
    pub voluntary_switches: u64,
    /// Involuntary context switches of its live threads.
    pub involuntary_switches: u64,
    /// Its live threads.
    pub threads: usize,
}

impl TargetProcess {
    /// Reads the process's counters now; `None` once it has exited.
    pub fn counters(&self) -> Option<ProcessCounters> {
        let dir = process_dir(self.pid);
        let stat = fs::read_to_string(dir.join("stat")).ok()?;
        let close = stat.rfind(')')?;
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // utime and stime are fields 14 and 15: rest[11] and rest[12].
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
        let mut counters = ProcessCounters {
            cpu_ticks: ticks(11)? + ticks(12)?,
            ..ProcessCounters::default()
        };
        for entry in fs::read_dir(dir.join("task")).ok()?.flatten() {
            let Ok(text) = fs::read_to_string(entry.path().join("status")) else {
                continue;
            };
            counters.threads += 1;
            let switches = status::context_switches(&text);
            counters.voluntary_switches += switches.voluntary;
            counters.involuntary_switches += switches.involuntary;
        }
        Some(counters)
    }
}

/// When the process started (`starttime`, field 22 of `/proc/PID/stat`, in
/// clock ticks since boot): with the pid, it names one process instance,
/// even after the pid is reused.
pub fn start_time_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(process_dir(pid).join("stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name; field 22 the 20th.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// The processes descended from `pid` (children, their children...) that
/// started at or after `since` (clock ticks since boot), from the parent
/// pids in `/proc/*/stat`.
pub fn descendants_since(pid: u32, since: u64) -> Vec<u32> {
    let mut parents: Vec<(u32, u32, u64)> = Vec::new();
    for child in process_ids() {
        let Ok(stat) = fs::read_to_string(process_dir(child).join("stat")) else {
            continue;
        };
        let Some(after_comm) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        // Field 4 (ppid) is the second after the name; field 22 the 20th.
        if let (Some(Ok(ppid)), Some(Ok(started))) = (
            fields.get(1).map(|f| f.parse::<u32>()),
            fields.get(19).map(|f| f.parse::<u64>()),
        ) {
            parents.push((child, ppid, started));
        }
    }
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for &(child, ppid, started) in &parents {
            if ppid == parent && started >= since && !found.contains(&child) {
                found.push(child);
                frontier.push(child);
            }
        }
    }
    found
}
