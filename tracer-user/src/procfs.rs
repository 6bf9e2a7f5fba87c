//! What `/proc` tells about the traced processes: existence, threads,
//! names and the state each thread is in when the capture starts.

use std::{
    collections::BTreeMap,
    fs,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use crate::error::{Error, Result};

/// The ids of `pid`'s threads right now (`/proc/PID/task`).
pub fn thread_ids(pid: u32) -> std::io::Result<Vec<u32>> {
    Ok(
        fs::read_dir(proc_root().join(pid.to_string()).join("task"))?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect(),
    )
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

fn proc_root() -> PathBuf {
    PathBuf::from("/proc")
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
    exit_fd: Option<Arc<OwnedFd>>,
}

impl TargetProcess {
    /// Checks that `pid` names a live process (not a thread of another one).
    pub fn open(pid: u32) -> Result<Self> {
        // Opened before the process is checked, so that it is the process
        // checked, not one that took its pid after.
        let exit_fd = pidfd_open(pid).ok().map(Arc::new);
        let stat = fs::read_to_string(proc_root().join(pid.to_string()).join("stat"))
            .ok()
            .and_then(|s| parse_stat(&s))
            .ok_or(Error::NoSuchProcess { pid })?;
        if stat.state == 'Z' || stat.state == 'X' {
            return Err(Error::ZombieProcess { pid });
        }
        let tgid = read_tgid(pid).ok_or(Error::NoSuchProcess { pid })?;
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
        let tasks = proc_root().join(self.pid.to_string()).join("task");
        thread_ids(self.pid)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|tid| {
                let stat = fs::read_to_string(tasks.join(tid.to_string()).join("stat")).ok()?;
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
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        match unsafe { libc::poll(&mut pfd, 1, 0) } {
            0 => true,
            1 => pfd.revents & libc::POLLIN == 0,
            _ => is_alive(self.pid),
        }
    }
}

/// A pidfd of process `pid` (Linux 5.3+).
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// `fd` moved above the descriptors the process holds now (to the lowest
/// free one from 64 below its limit, or from 4032 where the limit is
/// higher), where an exiting process releases it first: its files are
/// released the highest-numbered first, and each BPF link or perf event
/// released waits for an RCU grace period, so that a socket opened among
/// the probes' descriptors would close only tens or hundreds of
/// milliseconds after a SIGKILL. Left where it is where none is free.
pub fn released_first_at_exit(fd: OwnedFd) -> OwnedFd {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return fd;
    }
    let floor = limit.rlim_cur.min(4096).saturating_sub(64);
    if floor <= fd.as_raw_fd() as u64 {
        return fd;
    }
    // SAFETY: duplicates a descriptor this process owns.
    let moved = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, floor as libc::c_int) };
    if moved < 0 {
        return fd;
    }
    // SAFETY: a fresh descriptor that nothing else owns; `fd` closes as it
    // drops.
    unsafe { OwnedFd::from_raw_fd(moved) }
}

/// True while process `pid` exists and has not exited (zombies count as gone).
pub fn is_alive(pid: u32) -> bool {
    fs::read_to_string(proc_root().join(pid.to_string()).join("stat"))
        .ok()
        .and_then(|s| parse_stat(&s))
        .is_some_and(|s| s.state != 'Z' && s.state != 'X')
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
        let dir = proc_root().join(self.pid.to_string());
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
            let Ok(status) = fs::read_to_string(entry.path().join("status")) else {
                continue;
            };
            counters.threads += 1;
            for line in status.lines() {
                let value = |prefix: &str| {
                    line.strip_prefix(prefix)
                        .and_then(|v| v.trim().parse::<u64>().ok())
                };
                if let Some(v) = value("voluntary_ctxt_switches:") {
                    counters.voluntary_switches += v;
                } else if let Some(v) = value("nonvoluntary_ctxt_switches:") {
                    counters.involuntary_switches += v;
                }
            }
        }
        Some(counters)
    }
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of CPU times
/// in `/proc`.
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 { v as u64 } else { 100 }
}

/// When the process started (`starttime`, field 22 of `/proc/PID/stat`, in
/// clock ticks since boot): with the pid, it names one process instance,
/// even after the pid is reused.
pub fn start_time_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(proc_root().join(pid.to_string()).join("stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name; field 22 the 20th.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// Now, in the clock ticks since boot that [`start_time_ticks`] counts in.
pub fn boot_ticks_now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; CLOCK_BOOTTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    let hz = clock_ticks_per_second();
    ts.tv_sec as u64 * hz + ts.tv_nsec as u64 * hz / 1_000_000_000
}

/// The processes descended from `pid` (children, their children...) that
/// started at or after `since` (clock ticks since boot), from the parent
/// pids in `/proc/*/stat`.
pub fn descendants_since(pid: u32, since: u64) -> Vec<u32> {
    let mut parents: Vec<(u32, u32, u64)> = Vec::new();
    for child in process_ids() {
        let Ok(stat) = fs::read_to_string(proc_root().join(child.to_string()).join("stat")) else {
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

/// The mapping of `pid` that holds `address`: its start, file offset,
/// device, inode and path, as `/proc/PID/maps` lists them.
pub fn mapping_at(pid: u32, address: u64) -> Option<(u64, u64, String, u64, String)> {
    let maps = fs::read_to_string(proc_root().join(pid.to_string()).join("maps")).ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (start, end) = parts.next()?.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        if !(start..end).contains(&address) {
            return None;
        }
        let _perms = parts.next()?;
        let offset = u64::from_str_radix(parts.next()?, 16).ok()?;
        let device = parts.next()?.to_string();
        let inode = parts.next()?.parse().ok()?;
        let path = parts.next().unwrap_or("").to_string();
        Some((start, offset, device, inode, path))
    })
}

/// Resident memory of a process in bytes (`/proc/PID/statm`).
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = fs::read_to_string(proc_root().join(pid.to_string()).join("statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).unwrap_or(4096))
}

/// The memory the machine has available for new work, in bytes
/// (`MemAvailable` of `/proc/meminfo`).
pub fn mem_available_bytes() -> Option<u64> {
    let meminfo = fs::read_to_string(proc_root().join("meminfo")).ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// ebtrace's own resident memory in bytes (0 where `/proc` says nothing).
pub fn own_resident_bytes() -> usize {
    resident_bytes(std::process::id()).unwrap_or(0) as usize
}

fn read_tgid(pid: u32) -> Option<u32> {
    status_number(pid, "Tgid:")
}

/// The real user id `pid` runs as (`Uid:` in `/proc/PID/status`).
pub fn real_uid(pid: u32) -> Option<u32> {
    status_number(pid, "Uid:")
}

/// The seccomp mode of `pid` (`Seccomp:` in `/proc/PID/status`): 0 none,
/// 1 strict, 2 filters.
pub fn seccomp_mode(pid: u32) -> Option<u32> {
    status_number(pid, "Seccomp:")
}

/// The process a task id belongs to (itself for a process's main thread).
pub fn process_of_task(tid: u32) -> Option<u32> {
    read_tgid(tid)
}

/// The first number on the line of `/proc/PID/status` that starts with
/// `field`.
fn status_number(pid: u32, field: &str) -> Option<u32> {
    let status = fs::read_to_string(proc_root().join(pid.to_string()).join("status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Reads `out.len()` bytes of `pid`'s memory at `address`
/// (`/proc/PID/mem`: the rights ptrace needs over `pid`).
pub fn read_memory(pid: u32, address: u64, out: &mut [u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let mem = fs::File::open(proc_root().join(pid.to_string()).join("mem"))?;
    mem.read_exact_at(out, address)
}

/// The text of `/proc/PID/maps`: what `pid` has mapped, line by line.
pub fn maps_text(pid: u32) -> std::io::Result<String> {
    fs::read_to_string(proc_root().join(pid.to_string()).join("maps"))
}

/// The executable `pid` runs (`/proc/PID/exe`); empty where it cannot be
/// read.
pub fn executable(pid: u32) -> PathBuf {
    fs::read_link(proc_root().join(pid.to_string()).join("exe")).unwrap_or_default()
}

/// The name of thread `tid` of `pid` (`/proc/PID/task/TID/comm`), without
/// its newline.
pub fn thread_name(pid: u32, tid: u32) -> Option<String> {
    let path = proc_root()
        .join(pid.to_string())
        .join("task")
        .join(tid.to_string())
        .join("comm");
    let comm = fs::read_to_string(path).ok()?;
    Some(comm.trim_end_matches('\n').to_string())
}

/// The name of process `pid` (`/proc/PID/comm`), without its newline.
pub fn process_name(pid: u32) -> Option<String> {
    let comm = fs::read_to_string(proc_root().join(pid.to_string()).join("comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_string())
}

/// The field `key` of thread `tid`'s status (`/proc/PID/task/TID/status`).
pub fn thread_status_field(pid: u32, tid: u32, key: &str) -> Option<String> {
    let path = proc_root()
        .join(pid.to_string())
        .join("task")
        .join(tid.to_string())
        .join("status");
    fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// The process tracing `pid` (`TracerPid:`), if one does.
pub fn tracer_of(pid: u32) -> Option<u32> {
    status_number(pid, "TracerPid:").filter(|&t| t != 0)
}

/// A number a file under `/proc/sys` holds (`kernel/pid_max`, say).
pub fn sysctl_number(name: &str) -> Option<u64> {
    fs::read_to_string(proc_root().join("sys").join(name))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The running kernel's release (`/proc/sys/kernel/osrelease`); empty where
/// it cannot be read.
pub fn kernel_release() -> String {
    fs::read_to_string(proc_root().join("sys/kernel/osrelease"))
        .map(|r| r.trim().to_string())
        .unwrap_or_default()
}

/// User plus system CPU time of this process, in seconds (`/proc/self/stat`).
pub fn own_cpu_seconds() -> Option<f64> {
    let stat = fs::read_to_string(proc_root().join("self/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) as f64 / clock_ticks_per_second() as f64)
}

/// Effective capability set of this process (`CapEff` in `/proc/self/status`).
pub fn effective_capabilities() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// Whether a seccomp filter is in force on this process (`Seccomp: 2`).
pub fn seccomp_filtered() -> bool {
    fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .is_some_and(|v| v.trim() == "2")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_released_first_sits_above_the_others_and_closes_on_exec() {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let before = ours.as_raw_fd();
        let moved = released_first_at_exit(ours.into());
        let highest_other = fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&fd| fd != moved.as_raw_fd())
            .max()
            .unwrap();
        assert!(moved.as_raw_fd() > before && moved.as_raw_fd() > highest_other);
        // SAFETY: reads the flags of a descriptor this test owns.
        let flags = unsafe { libc::fcntl(moved.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }

    /// What `/proc` says of this test's own process, against what the
    /// standard library and the kernel's interfaces say.
    #[test]
    fn this_process_read_through_proc() {
        let pid = std::process::id();
        assert_eq!(executable(pid), std::env::current_exe().unwrap());
        assert!(maps_text(pid).unwrap().contains("[stack]"));
        let main = thread_name(pid, pid).unwrap();
        assert!(!main.is_empty() && !main.ends_with('\n'), "{main:?}");
        assert_eq!(process_name(pid).unwrap(), main);
        assert!(thread_status_field(pid, pid, "Tgid").is_some_and(|t| t == pid.to_string()));
        assert_eq!(tracer_of(pid), None);
        assert!(sysctl_number("kernel/pid_max").is_some_and(|n| n >= 301));
        // SAFETY: an all-zero `utsname` is valid (arrays of bytes).
        let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
        // SAFETY: uname fills the struct it is given.
        let rc = unsafe { libc::uname(&mut uts) };
        assert_eq!(rc, 0);
        // SAFETY: uname NUL-terminates its fields.
        let release = unsafe { std::ffi::CStr::from_ptr(uts.release.as_ptr()) };
        assert_eq!(kernel_release(), release.to_str().unwrap());
        assert!(own_cpu_seconds().is_some());
    }

    #[test]
    fn parses_stat_with_odd_comm() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 \
                    55 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let stat = parse_stat(line).unwrap();
        assert_eq!(stat.tid, 4242);
        assert_eq!(stat.comm, "a (b) c");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.cpu, 1);
    }

    #[test]
    fn opens_self_and_lists_own_threads() {
        let me = std::process::id();
        let target = TargetProcess::open(me).unwrap();
        assert_eq!(target.pid, me);
        assert!(target.threads().contains_key(&me));
        assert!(target.is_alive());
        let started = start_time_ticks(me).unwrap();
        assert!(started > 0);
        assert_eq!(start_time_ticks(me), Some(started));
    }

    /// Gone once it exited, before it is reaped (a zombie), as `/proc`
    /// says; and not alive again when reaped.
    #[test]
    fn a_child_that_exits_is_gone_while_still_a_zombie() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let target = TargetProcess::open(child.id()).unwrap();
        assert!(target.exit_fd.is_some(), "no pidfd on this kernel");
        assert!(target.is_alive());
        child.kill().unwrap();
        let gone = std::time::Instant::now();
        while target.is_alive() {
            assert!(gone.elapsed().as_secs() < 10, "still alive after SIGKILL");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!is_alive(child.id()), "/proc still shows it running");
        child.wait().unwrap();
        assert!(!target.is_alive());
    }

    #[test]
    fn counters_of_self_grow_with_work() {
        let me = TargetProcess::open(std::process::id()).unwrap();
        let before = me.counters().unwrap();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(60) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        let after = me.counters().unwrap();
        assert!(after.cpu_ticks > before.cpu_ticks, "{before:?} {after:?}");
        assert!(after.voluntary_switches > before.voluntary_switches);
        assert!(after.threads >= 1);
    }

    #[test]
    fn unknown_pid_is_reported() {
        // pid_max is at most 2^22, so this pid cannot exist.
        let err = TargetProcess::open(4_194_305 + 7).unwrap_err();
        assert!(matches!(err, Error::NoSuchProcess { .. }));
    }
}
