//! The restore guard: a small process that puts back every TraceMe gate
//! ebtrace switched on, should ebtrace die without doing it itself.
//!
//! SIGKILL, the OOM killer or an abort end ebtrace without running any of
//! its code, and a target left recording TraceMes keeps every event in its
//! own memory, growing until it is killed in turn. So before ebtrace writes
//! a gate it starts (once) `ebtrace restore-guard`, its own executable in a
//! session of its own (a closed terminal does not end it), and tells it over
//! a pipe what it is about to write and what to put back. ebtrace holds the
//! only write end of that pipe: the moment ebtrace ends, however it ends,
//! the guard reads end-of-file and restores what is still armed, within
//! milliseconds. When ebtrace restores a gate itself it disarms it first, so
//! a normal exit leaves the guard nothing to do.
//!
//! The guard writes a gate back only if the process is still the same
//! instance (pid and start time) and the gate still holds the value ebtrace
//! wrote: a level a session of the target's own changed since, or a pid
//! reused by another process, is left alone.

use std::{
    collections::BTreeMap,
    fs,
    io::{self, Write as _},
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::process::CommandExt as _,
    },
    path::PathBuf,
    process::{Child, ChildStdin, Command, Stdio},
    sync::Mutex,
};

use rustix::{
    event::{EventfdFlags, PollFd, PollFlags, Timespec},
    fs::MemfdFlags,
    io::FdFlags,
};

use super::cell::Cell;
use crate::procfs::{self, start_time_ticks};

/// The hidden subcommand that runs the guard.
pub const SUBCOMMAND: &str = "restore-guard";

/// A gate ebtrace is switching on, and how to put it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Armed {
    /// The gate.
    pub cell: Cell,
    /// The target's start time (clock ticks since boot): tells a pid
    /// reused by another process apart.
    pub pid_start: u64,
    /// The value ebtrace writes.
    pub on: i64,
    /// The value to put back.
    pub off: i64,
    /// The marker file to remove once restored.
    pub marker: Option<PathBuf>,
}

impl Armed {
    fn render(&self) -> String {
        let mut line = format!(
            "arm {} {} {:x} {} {} {}",
            self.cell.pid, self.pid_start, self.cell.address, self.cell.width, self.on, self.off
        );
        if let Some(m) = &self.marker {
            line.push(' ');
            line.push_str(&m.to_string_lossy());
        }
        line.push('\n');
        line
    }

    fn parse(rest: &str) -> Option<Armed> {
        let mut f = rest.splitn(7, ' ');
        let pid = f.next()?.parse().ok()?;
        let pid_start = f.next()?.parse().ok()?;
        let address = u64::from_str_radix(f.next()?, 16).ok()?;
        let width: u8 = f.next()?.parse().ok()?;
        let on = f.next()?.parse().ok()?;
        let off = f.next()?.parse().ok()?;
        let marker = f.next().filter(|m| !m.is_empty()).map(PathBuf::from);
        matches!(width, 1 | 4).then_some(Armed {
            cell: Cell {
                pid,
                address,
                width,
            },
            pid_start,
            on,
            off,
            marker,
        })
    }

    /// Puts the off value back if the gate is still what ebtrace made it.
    /// Returns what was done, for the guard's one line.
    fn restore_if_ours(&self) -> Option<String> {
        let Cell { pid, address, .. } = self.cell;
        let outcome = if start_time_ticks(pid) != Some(self.pid_start) {
            None
        } else {
            match self.cell.read() {
                Ok(v) if v == self.on => Some(match self.cell.write(self.off) {
                    Ok(()) => format!(
                        "pid {pid}: TraceMe gate at {address:#x} put back from {} to {}",
                        self.on, self.off
                    ),
                    Err(e) => format!("pid {pid}: could not restore the gate at {address:#x}: {e}"),
                }),
                _ => None,
            }
        };
        if let Some(m) = &self.marker {
            let _ = fs::remove_file(m);
        }
        outcome
    }
}

/// The flag that hands the lifeline's descriptor to the guard.
pub const LIFELINE_FLAG: &str = "--lifeline-fd";

/// A robust, process-shared mutex in a memfd, mapped by ebtrace and its
/// guard: whoever holds it, the kernel releases it to the other with
/// `EOWNERDEAD` the moment the holding thread dies.
struct Lifeline {
    mutex: *mut libc::pthread_mutex_t,
    memfd: OwnedFd,
}

// SAFETY: the mapping is shared memory that lives as long as the Lifeline;
// the mutex in it is made for use across threads and processes.
unsafe impl Send for Lifeline {}

impl Lifeline {
    fn map(memfd: OwnedFd) -> io::Result<Lifeline> {
        let size = std::mem::size_of::<libc::pthread_mutex_t>();
        // SAFETY: a fresh shared mapping of a descriptor we own; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Lifeline {
            mutex: p.cast(),
            memfd,
        })
    }

    /// A new lifeline, held by the calling thread.
    fn create() -> io::Result<Lifeline> {
        let memfd = rustix::fs::memfd_create(c"ebtrace-guard-lifeline", MemfdFlags::CLOEXEC)?;
        let size = std::mem::size_of::<libc::pthread_mutex_t>() as u64;
        rustix::fs::ftruncate(&memfd, size)?;
        let lifeline = Lifeline::map(memfd)?;
        // SAFETY: the attribute and the mutex live in memory we own (the
        // stack, the mapping), are initialized before use, and the mutex is
        // locked by this thread only.
        let rc = unsafe {
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            libc::pthread_mutexattr_init(&mut attr);
            libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
            let rc = libc::pthread_mutex_init(lifeline.mutex, &attr);
            libc::pthread_mutexattr_destroy(&mut attr);
            if rc == 0 {
                libc::pthread_mutex_lock(lifeline.mutex)
            } else {
                rc
            }
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(lifeline)
    }

    /// Blocks until the holder dies (or unlocks).
    fn wait_for_holder(&self) {
        // SAFETY: the mutex was initialized by the holder before it handed
        // the descriptor over; EOWNERDEAD leaves it locked by us, which is
        // all we need.
        unsafe { libc::pthread_mutex_lock(self.mutex) };
    }
}

/// ebtrace's ends of the pipe and lifeline to its guard.
struct Link {
    child: Child,
    stdin: ChildStdin,
    _lifeline: Lifeline,
}

static LINK: Mutex<Option<Link>> = Mutex::new(None);

fn spawn() -> io::Result<Link> {
    let lifeline = Lifeline::create()?;
    let memfd: RawFd = lifeline.memfd.as_raw_fd();
    let mut command = Command::new(procfs::own_executable());
    command
        .arg(SUBCOMMAND)
        .arg(LIFELINE_FLAG)
        .arg(memfd.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // SAFETY: setsid and fcntl are plain syscalls, async-signal-safe, that
    // touch no memory of the parent; they run in the forked child just
    // before exec, where `memfd` is open as in ebtrace (the lifeline holds
    // it until the child has started).
    unsafe {
        command.pre_exec(move || {
            rustix::process::setsid()?;
            let memfd = BorrowedFd::borrow_raw(memfd);
            rustix::io::fcntl_setfd(memfd, FdFlags::empty())?;
            Ok(())
        });
    }
    let mut child = command.spawn()?;
    let stdin = child.stdin.take().expect("stdin is piped");
    Ok(Link {
        child,
        stdin,
        _lifeline: lifeline,
    })
}

/// Starts the guard now. Call it from the main thread: the lifeline is
/// held by the thread that starts the guard, and must live as long as
/// ebtrace does.
pub fn start() -> io::Result<()> {
    let mut link = LINK.lock().unwrap_or_else(|e| e.into_inner());
    if link.is_none() {
        *link = Some(spawn()?);
    }
    Ok(())
}

/// Hands `armed` to the guard, starting it on first use (or again, if it
/// died). An error means no guard could be reached: the caller must not
/// write the gate.
pub fn arm(armed: Armed) -> io::Result<()> {
    let line = armed.render();
    let mut link = LINK.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..2 {
        if link.is_none() {
            *link = Some(spawn()?);
        }
        let l = link.as_mut().expect("just set");
        match l
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| l.stdin.flush())
        {
            Ok(()) => return Ok(()),
            Err(_) => {
                // The guard is gone (killed): reap it and start another.
                if let Some(mut old) = link.take() {
                    let _ = old.child.wait();
                }
            }
        }
    }
    Err(io::Error::other(
        "the guard process exits as soon as it starts",
    ))
}

/// Tells the guard that ebtrace restored `cell` itself.
pub fn release(cell: Cell) {
    let mut link = LINK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = link.as_mut() {
        let line = format!("release {} {:x}\n", cell.pid, cell.address);
        let _ = l.stdin.write_all(line.as_bytes());
    }
}

/// The guard's pid, if one runs (for tests and the summary).
pub fn guard_pid() -> Option<u32> {
    let link = LINK.lock().unwrap_or_else(|e| e.into_inner());
    link.as_ref().map(|l| l.child.id())
}

/// What the guard holds: armed gates by (pid, address).
#[derive(Debug, Default)]
struct Ledger {
    armed: BTreeMap<(u32, u64), Armed>,
}

impl Ledger {
    /// Applies one line from ebtrace; unknown lines are ignored.
    fn apply(&mut self, line: &str) {
        let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
        match verb {
            "arm" => {
                if let Some(a) = Armed::parse(rest) {
                    self.armed.insert((a.cell.pid, a.cell.address), a);
                }
            }
            "release" => {
                let mut f = rest.split(' ');
                if let (Some(Ok(pid)), Some(Ok(address))) = (
                    f.next().map(str::parse::<u32>),
                    f.next().map(|a| u64::from_str_radix(a, 16)),
                ) {
                    self.armed.remove(&(pid, address));
                }
            }
            _ => {}
        }
    }

    /// ebtrace is gone: restores what it left armed, Python gates (one
    /// byte) before levels, as ebtrace itself does.
    fn restore_all(&self) -> Vec<String> {
        let (flags, levels): (Vec<&Armed>, Vec<&Armed>) =
            self.armed.values().partition(|a| a.cell.width == 1);
        flags
            .into_iter()
            .chain(levels)
            .filter_map(Armed::restore_if_ours)
            .collect()
    }
}

/// The guard's main loop (`ebtrace restore-guard --lifeline-fd N`, started
/// by [`start`]): takes in ebtrace's lines until ebtrace dies or ends, then
/// restores what is still armed. Returns the exit code.
pub fn run(lifeline_fd: Option<RawFd>) -> i32 {
    // Ctrl-C in ebtrace's terminal and a closed terminal are for ebtrace,
    // which restores on its own.
    // SAFETY: installing SIG_IGN has no preconditions.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    // The guard is a few MiB at most; the OOM killer should pick anything
    // else first (best effort: needs CAP_SYS_RESOURCE).
    let _ = procfs::set_own_oom_score_adj(-1000);
    let parent = std::os::unix::process::parent_id();
    let report = |done: Vec<String>| {
        let mut stderr = io::stderr();
        for d in &done {
            let _ = writeln!(
                stderr,
                "ebtrace restore-guard: ebtrace (pid {parent}) ended without restoring; {d}"
            );
        }
    };
    let (died_tx, died_rx) = std::sync::mpsc::channel::<()>();
    let wake = match Wake::new() {
        Ok(w) => w,
        Err(_) => return 1,
    };
    if let Some(fd) = lifeline_fd {
        // SAFETY: ebtrace handed this descriptor to us and nothing else
        // in this process uses it.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        if let Ok(lifeline) = Lifeline::map(memfd) {
            let notify = wake.notifier();
            std::thread::spawn(move || {
                lifeline.wait_for_holder();
                let _ = died_tx.send(());
                notify();
            });
        }
    }
    let mut ledger = Ledger::default();
    let mut pipe = Pipe::default();
    loop {
        let (input, died) = wake.wait(io::stdin().as_fd());
        if input {
            let open = pipe.take_in(&mut ledger);
            if !open {
                break;
            }
        }
        if died && died_rx.try_recv().is_ok() {
            // What ebtrace wrote before dying is in the pipe already.
            pipe.take_in(&mut ledger);
            report(ledger.restore_all());
        }
    }
    report(ledger.restore_all());
    0
}

/// Lines from ebtrace, split as they arrive.
#[derive(Default)]
struct Pipe {
    partial: Vec<u8>,
}

impl Pipe {
    /// Reads what stdin has now (without blocking) into `ledger`; false at
    /// end-of-file.
    fn take_in(&mut self, ledger: &mut Ledger) -> bool {
        // Raw reads: a buffered reader could hold lines poll cannot see.
        let stdin_handle = io::stdin();
        let stdin = stdin_handle.as_fd();
        let mut buf = [0u8; 4096];
        let no_wait = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            let mut polled = [PollFd::from_borrowed_fd(stdin, PollFlags::IN)];
            if !matches!(rustix::event::poll(&mut polled, Some(&no_wait)), Ok(1..)) {
                return true;
            }
            match rustix::io::read(stdin, &mut buf) {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    self.partial.extend_from_slice(&buf[..n]);
                    while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = self.partial.drain(..=end).collect();
                        ledger.apply(String::from_utf8_lossy(&line).trim_end());
                    }
                }
            }
        }
    }
}

/// Waits on stdin and on the lifeline thread at once (an eventfd).
struct Wake {
    event: std::sync::Arc<OwnedFd>,
}

impl Wake {
    fn new() -> io::Result<Wake> {
        let event = rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?;
        Ok(Wake {
            event: std::sync::Arc::new(event),
        })
    }

    fn notifier(&self) -> impl FnOnce() + Send + 'static {
        let event = std::sync::Arc::clone(&self.event);
        move || {
            let _ = rustix::io::write(&event, &1u64.to_ne_bytes());
        }
    }

    /// Blocks until `fd` is readable (or hung up) or the notifier ran;
    /// returns (fd ready, notified).
    fn wait(&self, fd: BorrowedFd<'_>) -> (bool, bool) {
        let mut polled = [
            PollFd::from_borrowed_fd(fd, PollFlags::IN),
            PollFd::new(&self.event, PollFlags::IN),
        ];
        if rustix::event::poll(&mut polled, None).is_err() {
            return (false, false);
        }
        let notified = !polled[1].revents().is_empty();
        if notified {
            let mut count = [0u8; 8];
            let _ = rustix::io::read(&self.event, &mut count);
        }
        (!polled[0].revents().is_empty(), notified)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

    use super::*;

    fn me() -> (u32, u64) {
        let pid = std::process::id();
        (pid, start_time_ticks(pid).unwrap())
    }

    fn armed(cell: Cell, pid_start: u64, on: i64, off: i64) -> Armed {
        Armed {
            cell,
            pid_start,
            on,
            off,
            marker: Some(PathBuf::from("/run/ebtrace/traceme-1-2-3 with space")),
        }
    }

    #[test]
    fn lines_round_trip() {
        let a = armed(Cell::trace_level(12, 0x7f00_1234), 99, 2, -1);
        let line = a.render();
        let mut ledger = Ledger::default();
        ledger.apply(line.trim_end());
        assert_eq!(ledger.armed.get(&(12, 0x7f00_1234)), Some(&a));
        ledger.apply("release 12 7f001234");
        assert!(ledger.armed.is_empty());
        ledger.apply("arm 1 2 zz 4 2 -1");
        ledger.apply("arm 1 2 10 3 2 -1");
        ledger.apply("nonsense");
        assert!(ledger.armed.is_empty());
    }

    #[test]
    fn restores_only_what_is_still_ebtraces() {
        let (pid, started) = me();
        let level: &'static AtomicI32 = Box::leak(Box::new(AtomicI32::new(2)));
        let moved: &'static AtomicI32 = Box::leak(Box::new(AtomicI32::new(3)));
        let reused: &'static AtomicI32 = Box::leak(Box::new(AtomicI32::new(2)));
        let flag: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(true)));
        let at = |p: *const u8| p as u64;
        let mut ledger = Ledger::default();
        for a in [
            armed(
                Cell::trace_level(pid, at(level.as_ptr().cast())),
                started,
                2,
                -1,
            ),
            armed(
                Cell::trace_level(pid, at(moved.as_ptr().cast())),
                started,
                2,
                -1,
            ),
            // Same pid, another start time: a different process.
            armed(
                Cell::trace_level(pid, at(reused.as_ptr().cast())),
                started + 1,
                2,
                -1,
            ),
            armed(Cell::flag(pid, at(flag.as_ptr().cast())), started, 1, 0),
        ] {
            ledger.apply(a.render().trim_end());
        }
        let done = ledger.restore_all();
        assert_eq!(done.len(), 2, "{done:?}");
        assert_eq!(level.load(Ordering::SeqCst), -1);
        assert_eq!(moved.load(Ordering::SeqCst), 3);
        assert_eq!(reused.load(Ordering::SeqCst), 2);
        assert!(!flag.load(Ordering::SeqCst));
    }
}
