//! The names, ids and per-thread counters that `/proc/PID/status`,
//! `comm` and `schedstat` hold.

use std::fs;

use super::{process_dir, thread_dir};

/// The first number on the line of `/proc/PID/status` that starts with
/// `field`.
fn status_number(pid: u32, field: &str) -> Option<u32> {
    let status = fs::read_to_string(process_dir(pid).join("status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The real user id `pid` runs as (`Uid:` in `/proc/PID/status`).
pub fn real_uid(pid: u32) -> Option<u32> {
    status_number(pid, "Uid:")
}

/// Whether user `uid` may trace `pid` by ptrace's own rule (what gdb and
/// py-spy run by that user may do): every user id of the process (real,
/// effective, saved, filesystem) is `uid`, so it is no set-id program
/// running as someone else, and it is dumpable, which `/proc/PID` shows by
/// being owned by its user rather than by root.
pub fn traceable_by(pid: u32, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(status) = fs::read_to_string(process_dir(pid).join("status")) else {
        return false;
    };
    let ids: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let dumpable = fs::metadata(process_dir(pid)).is_ok_and(|m| m.uid() == uid);
    ids.len() == 4 && ids.iter().all(|&id| id == uid) && dumpable
}

/// The seccomp mode of `pid` (`Seccomp:` in `/proc/PID/status`): 0 none,
/// 1 strict, 2 filters.
pub fn seccomp_mode(pid: u32) -> Option<u32> {
    status_number(pid, "Seccomp:")
}

/// Task `tid` of `pid` as its own pid namespace numbers it (the last
/// `NSpid:` of its status): the id it gets from `gettid()` there, another
/// than `tid` in a container with a pid namespace of its own.
pub fn namespace_tid(pid: u32, tid: u32) -> Option<u32> {
    let status = fs::read_to_string(thread_dir(pid, tid).join("status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last()?.parse().ok())
}

/// The process a task id belongs to (itself for a process's main thread).
pub fn process_of_task(tid: u32) -> Option<u32> {
    status_number(tid, "Tgid:")
}

/// The process tracing `pid` (`TracerPid:`), if one does.
pub fn tracer_of(pid: u32) -> Option<u32> {
    status_number(pid, "TracerPid:").filter(|&t| t != 0)
}

/// The field `key` of thread `tid`'s status (`/proc/PID/task/TID/status`).
pub fn thread_status_field(pid: u32, tid: u32, key: &str) -> Option<String> {
    fs::read_to_string(thread_dir(pid, tid).join("status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// The name of thread `tid` of `pid` (`/proc/PID/task/TID/comm`), without
/// its newline.
pub fn thread_name(pid: u32, tid: u32) -> Option<String> {
    let comm = fs::read_to_string(thread_dir(pid, tid).join("comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_string())
}

/// The name of process `pid` (`/proc/PID/comm`), without its newline.
pub fn process_name(pid: u32) -> Option<String> {
    let comm = fs::read_to_string(process_dir(pid).join("comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_string())
}

/// A thread's context switches so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContextSwitches {
    /// Voluntary ones (`voluntary_ctxt_switches`): it blocked or yielded.
    pub voluntary: u64,
    /// Involuntary ones (`nonvoluntary_ctxt_switches`): it was preempted.
    pub involuntary: u64,
}

/// The context switches a `status` text counts (0 for a line it lacks).
pub(super) fn context_switches(status: &str) -> ContextSwitches {
    let mut switches = ContextSwitches::default();
    for line in status.lines() {
        let value = |prefix: &str| line.strip_prefix(prefix)?.trim().parse::<u64>().ok();
        if let Some(v) = value("voluntary_ctxt_switches:") {
            switches.voluntary = v;
        } else if let Some(v) = value("nonvoluntary_ctxt_switches:") {
            switches.involuntary = v;
        }
    }
    switches
}

/// The context switches of thread `tid` of `pid` so far
/// (`/proc/PID/task/TID/status`); `None` once it has exited.
pub fn thread_context_switches(pid: u32, tid: u32) -> Option<ContextSwitches> {
    let status = fs::read_to_string(thread_dir(pid, tid).join("status")).ok()?;
    Some(context_switches(&status))
}

/// The text of `/proc/PID/task/TID/schedstat`: ns on a CPU, ns waiting on a
/// run queue, timeslices run. `None` once the thread has exited.
pub fn thread_schedstat(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(thread_dir(pid, tid).join("schedstat")).ok()
}
