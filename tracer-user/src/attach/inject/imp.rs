//! The load, unload and leftover sessions, in terms of calls made in the
//! target.

use std::{
    fs,
    io::Write as _,
    os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::net::UnixStream,
    },
    time::{Duration, Instant},
};

use super::{
    AGENT_DETACH, InjectError, InjectReport, Injected, MEMFD_NAME,
    hazards::{Hazards, Refusals},
    process_alive, seccomp,
    session::{RESTARTED_WAITS, Session, code_len},
    symbols::{self, LIBC_DLOPEN_MODE_FLAG, TargetFns},
};

const SYS_MEMFD_CREATE: u64 = 319;
const SYS_FUTEX: i64 = 202;

/// How long a session waits for a thread of the target to stop at a safe
/// point (see [`super::session::at_safe_point`]).
const SAFE_POINT_WAIT: Duration = Duration::from_secs(3);
/// How long an earlier agent's thread may take to end before its library
/// is left in place: stopping a framework session it was told to stop
/// converts the session's events first (seconds for millions).
const LEFTOVER_THREAD_WAIT: Duration = Duration::from_secs(5);

/// The threads to make the calls on, in the order to try them: blocked in
/// a syscall the kernel restarts, then waiting on a futex, then running;
/// never one of the agent's, nor one in another syscall (stopping it could
/// end that syscall with EINTR).
fn candidate_threads(pid: u32) -> Result<Vec<u32>, InjectError> {
    let mut ranked: Vec<(u8, u32)> = Vec::new();
    for tid in super::program_threads(pid)? {
        let syscall =
            fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).unwrap_or_default();
        let first = syscall.split_whitespace().next().unwrap_or("");
        let tier = match first.parse::<i64>() {
            Ok(SYS_FUTEX) => 1,
            Ok(nr) if RESTARTED_WAITS.contains(&nr) => 0,
            // In user code: preempted, or running now.
            Ok(-1) => 2,
            _ if first == "running" => 2,
            _ => continue,
        };
        ranked.push((tier, tid));
    }
    ranked.sort_unstable();
    Ok(ranked.into_iter().map(|(_, tid)| tid).collect())
}

/// A session on the first thread found at a safe point, the candidates
/// tried again and again for up to [`SAFE_POINT_WAIT`].
fn open_session(pid: u32) -> Result<Session, InjectError> {
    let code = symbols::code_room(pid, code_len())?;
    let mut hazards = Hazards::of(pid)?;
    let began = Instant::now();
    let mut tries = 0;
    let mut refusals = Refusals::default();
    loop {
        for tid in candidate_threads(pid)? {
            tries += 1;
            match Session::open(pid, tid, code, &mut hazards) {
                Ok(Ok(session)) => return Ok(session),
                Ok(Err(refusal)) => refusals.count(refusal),
                // The thread ended in between.
                Err(_) if thread_gone(pid, tid) => {}
                Err(e) => return Err(e),
            }
        }
        if !process_alive(pid) {
            return Err(InjectError::NoSuchProcess { pid });
        }
        if began.elapsed() >= SAFE_POINT_WAIT {
            return Err(InjectError::NoSafePoint {
                pid,
                seconds: SAFE_POINT_WAIT.as_secs(),
                tries,
                refusals: refusals.to_string(),
            });
        }
        // Lets the threads move on from where they were.
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn thread_gone(pid: u32, tid: u32) -> bool {
    process_alive(pid) && !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

fn io_err(context: impl Into<String>, source: std::io::Error) -> InjectError {
    InjectError::Io {
        context: context.into(),
        source,
    }
}

/// The first call of the loading's that the seccomp filters of the
/// session's thread would kill it for, where they can be read and run.
fn forbidden_call(pid: u32, s: &Session) -> Option<&'static str> {
    if crate::procfs::seccomp_mode(pid) != Some(2) {
        return None;
    }
    let Some(filters) = s.seccomp_filters() else {
        log::debug!("pid {pid}: its seccomp filters cannot be read (CAP_SYS_ADMIN); not judged");
        return None;
    };
    seccomp::LOADING_CALLS
        .iter()
        .find(|(_, nr, args)| seccomp::judge(&filters, *nr, *args) == seccomp::Verdict::Harmful)
        .map(|(name, _, _)| *name)
}

/// A descriptor of the target, duplicated into ebtrace (`pidfd_getfd`).
fn take_fd(pid: u32, pidfd: &OwnedFd, fd: i32) -> Result<OwnedFd, InjectError> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: pidfd_getfd on a pidfd we own; returns a new descriptor.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if r < 0 {
        return Err(io_err(
            format!("copying descriptor {fd} of pid {pid} (pidfd_getfd needs Linux 5.6+)"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, InjectError> {
    crate::procfs::pidfd_open(pid).map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => InjectError::NoSuchProcess { pid },
        _ => io_err(format!("pidfd_open of pid {pid} (needs Linux 5.3+)"), e),
    })
}

/// Calls on the thread of a session, by function name.
struct Calls<'a> {
    s: &'a mut Session,
    fns: TargetFns,
}

impl Calls<'_> {
    fn pid(&self) -> u32 {
        self.s.pid()
    }

    /// Has the thread's `errno` and `dlerror()` state put back at the end:
    /// the calls' failures set the one and every call resets the other,
    /// and the program may be about to read its own. A C library without
    /// `__errno_location` (none known) leaves both as the calls do; one
    /// older than glibc 2.34, the `dlerror()` state.
    fn keep_thread_state(&mut self) {
        if let Some(f) = self.fns.errno_location
            && let Err(e) = self
                .s
                .keep_thread_state(f, self.fns.dlerror_state_from_errno)
        {
            log::debug!("pid {}: errno not kept: {e}", self.pid());
        }
    }

    fn dlopen(&mut self, path: &str, flags: i32) -> Result<u64, InjectError> {
        self.s.reset_scratch();
        let p = self.s.put_str(path)?;
        let mut mode = flags as u64;
        if self.fns.dlerror.is_none() {
            mode |= LIBC_DLOPEN_MODE_FLAG;
        }
        self.s.call("dlopen", self.fns.dlopen, &[p, mode])
    }

    fn dlsym(&mut self, handle: u64, name: &str) -> Result<u64, InjectError> {
        self.s.reset_scratch();
        let p = self.s.put_str(name)?;
        self.s.call("dlsym", self.fns.dlsym, &[handle, p])
    }

    fn dlclose(&mut self, handle: u64) -> Result<(), InjectError> {
        self.s
            .call("dlclose", self.fns.dlclose, &[handle])
            .map(drop)
    }

    fn close(&mut self, fd: i32) -> Result<(), InjectError> {
        self.s.call("close", self.fns.close, &[fd as u64]).map(drop)
    }

    /// The target's `dlerror()` text.
    fn dlerror(&mut self) -> String {
        let Some(f) = self.fns.dlerror else {
            return "no reason given (this C library has no dlerror)".into();
        };
        match self.s.call("dlerror", f, &[]) {
            Ok(0) => "no reason given".into(),
            Ok(p) => self
                .s
                .read_cstring(p)
                .unwrap_or_else(|e| format!("(its message is unreadable: {e})")),
            Err(e) => format!("(dlerror failed: {e})"),
        }
    }

    fn memfd_create(&mut self) -> Result<i32, InjectError> {
        self.s.reset_scratch();
        let name = self.s.put_str(MEMFD_NAME)?;
        let flags = (libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64;
        let fd = if self.fns.memfd_is_syscall {
            self.s.call(
                "syscall",
                self.fns.memfd_create,
                &[SYS_MEMFD_CREATE, name, flags],
            )?
        } else {
            self.s
                .call("memfd_create", self.fns.memfd_create, &[name, flags])?
        } as i32;
        if fd < 0 {
            return Err(InjectError::TargetCall {
                pid: self.pid(),
                call: "memfd_create",
                detail: "it returned -1 (out of descriptors or memory?)".into(),
            });
        }
        Ok(fd)
    }

    fn socketpair(&mut self) -> Result<[i32; 2], InjectError> {
        self.s.reset_scratch();
        let slot = self.s.put(&[0xff; 8])?;
        let kind = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        let r = self.s.call(
            "socketpair",
            self.fns.socketpair,
            &[libc::AF_UNIX as u64, kind, 0, slot],
        )?;
        let mut b = [0u8; 8];
        self.s.read(slot, &mut b)?;
        if r as i32 != 0 {
            return Err(InjectError::TargetCall {
                pid: self.pid(),
                call: "socketpair",
                detail: "it returned -1 (out of descriptors?)".into(),
            });
        }
        let fd = |i: usize| i32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Ok([fd(0), fd(4)])
    }
}

/// What a load has set up so far in the target, to undo on failure.
#[derive(Default)]
struct Partial {
    memfd: Option<i32>,
    agent_fd: Option<i32>,
    handle: Option<u64>,
}

impl Partial {
    fn undo(&self, c: &mut Calls) {
        if let Some(h) = self.handle {
            let _ = c.dlclose(h);
        }
        for fd in [self.agent_fd, self.memfd].into_iter().flatten() {
            let _ = c.close(fd);
        }
    }
}

pub fn load(pid: u32, library: &[u8], entry: &str) -> Result<(Injected, UnixStream), InjectError> {
    let began = Instant::now();
    if !process_alive(pid) {
        return Err(InjectError::NoSuchProcess { pid });
    }
    unload_leftovers(pid, AGENT_DETACH)?;
    let fns = symbols::resolve(pid)?;
    let pidfd = pidfd_open(pid)?;
    let mut s = open_session(pid)?;
    if let Some(call) = forbidden_call(pid, &s) {
        s.close()?;
        return Err(InjectError::SeccompForbids { pid, call });
    }
    let tid = s.tid();
    let mut c = Calls { s: &mut s, fns };
    c.keep_thread_state();
    let mut partial = Partial::default();
    let loaded = load_calls(&mut c, &mut partial, &pidfd, library, entry);
    if loaded.is_err() {
        partial.undo(&mut c);
    }
    let stopped = Some(s.stopped());
    let diverted = s.close();
    let (handle, ours) = loaded?;
    let report = InjectReport {
        stopped,
        thread_diverted: diverted?,
        total: began.elapsed(),
    };
    let injected = Injected {
        pid,
        tid,
        handle,
        memfd: partial.memfd.expect("set by a successful load"),
        report,
    };
    Ok((injected, UnixStream::from(ours)))
}

fn load_calls(
    c: &mut Calls,
    partial: &mut Partial,
    pidfd: &OwnedFd,
    library: &[u8],
    entry: &str,
) -> Result<(u64, OwnedFd), InjectError> {
    let pid = c.pid();
    let memfd = c.memfd_create()?;
    partial.memfd = Some(memfd);
    let mut file = fs::File::from(take_fd(pid, pidfd, memfd)?);
    file.write_all(library).map_err(|e| {
        io_err(
            format!("writing the agent library into pid {pid}'s memfd"),
            e,
        )
    })?;
    seal(&file).map_err(|e| io_err(format!("sealing the agent library in pid {pid}"), e))?;
    drop(file);
    let [agent_fd, our_fd] = c.socketpair()?;
    partial.agent_fd = Some(agent_fd);
    let ours = take_fd(pid, pidfd, our_fd);
    c.close(our_fd)?;
    let ours = ours?;
    let handle = c.dlopen(
        &format!("/proc/self/fd/{memfd}"),
        libc::RTLD_NOW | libc::RTLD_LOCAL,
    )?;
    if handle == 0 {
        let message = c.dlerror();
        return Err(InjectError::Dlopen { pid, message });
    }
    partial.handle = Some(handle);
    let f = c.dlsym(handle, entry)?;
    if f == 0 {
        let message = c.dlerror();
        return Err(InjectError::MissingSymbol {
            pid,
            symbol: entry.to_string(),
            message,
        });
    }
    let r = c.s.call("agent entry", f, &[agent_fd as u64])? as i32;
    if r != 0 {
        return Err(InjectError::AgentFailed {
            pid,
            function: entry.to_string(),
            code: if r < 0 { r } else { -libc::EIO },
        });
    }
    // The agent owns its end of the socketpair now.
    partial.agent_fd = None;
    Ok((handle, ours))
}

pub fn unload(injected: &Injected, exit: &str) -> Result<InjectReport, InjectError> {
    let began = Instant::now();
    let pid = injected.pid;
    if !process_alive(pid) {
        return Err(InjectError::TargetExited { pid });
    }
    // The agent's thread, told to end, may still run its exit path (the
    // thread-local destructors of the C library, CUDA or TSL): the exit
    // function would join it from the thread taken over, which may hold
    // what those destructors wait for. Let it end on its own first.
    await_agent_thread_end(pid)?;
    let fns = symbols::resolve(pid)?;
    let mut s = open_session(pid)?;
    let mut c = Calls { s: &mut s, fns };
    c.keep_thread_state();
    let unloaded = unload_agent(&mut c, injected.handle, injected.memfd, exit);
    let stopped = Some(s.stopped());
    let diverted = s.close();
    unloaded?;
    Ok(InjectReport {
        stopped,
        thread_diverted: diverted?,
        total: began.elapsed(),
    })
}

/// `exit()`, then `dlclose` and `close(memfd)`. With an `exit()` that
/// fails, the library stays: its code may run still. The memfd is closed
/// only if its descriptor number still holds it: a program that closed it
/// may have opened something else under that number since.
fn unload_agent(c: &mut Calls, handle: u64, memfd: i32, exit: &str) -> Result<(), InjectError> {
    call_exit(c, handle, exit)?;
    c.dlclose(handle)?;
    if leftover_fds(c.pid())?.contains(&memfd) {
        c.close(memfd)?;
    }
    Ok(())
}

/// Seals the library's memfd: nothing in the target (or anyone it passes
/// the descriptor to) can change the code ebtrace's agent runs from.
fn seal(file: &fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on a descriptor we own, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn call_exit(c: &mut Calls, handle: u64, exit: &str) -> Result<(), InjectError> {
    let pid = c.pid();
    let f = c.dlsym(handle, exit)?;
    if f == 0 {
        let message = c.dlerror();
        return Err(InjectError::MissingSymbol {
            pid,
            symbol: exit.to_string(),
            message,
        });
    }
    let r = c.s.call("agent exit", f, &[])? as i32;
    if r != 0 {
        return Err(InjectError::AgentFailed {
            pid,
            function: exit.to_string(),
            code: if r < 0 { r } else { -libc::EIO },
        });
    }
    Ok(())
}

/// Waits up to [`LEFTOVER_THREAD_WAIT`] for the agent's thread in `pid` to
/// be gone.
fn await_agent_thread_end(pid: u32) -> Result<(), InjectError> {
    let began = Instant::now();
    while super::agent_thread_running(pid) {
        if began.elapsed() >= LEFTOVER_THREAD_WAIT {
            return Err(InjectError::AgentThreadRunning {
                pid,
                seconds: LEFTOVER_THREAD_WAIT.as_secs(),
            });
        }
        // A thread told to end is gone within a millisecond or so.
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Most references to one leftover library that killed ebtraces can have
/// left (each killed between its own `RTLD_NOLOAD` and `dlclose`).
const MAX_LEFTOVER_REFS: usize = 64;

/// Takes out the library a killed ebtrace left loaded from memfd `fd`:
/// `exit()`, then `dlclose` until it is gone; closes the memfd. Returns
/// whether a library was loaded.
fn unload_leftover(c: &mut Calls, fd: i32, exit: &str) -> Result<bool, InjectError> {
    let path = format!("/proc/self/fd/{fd}");
    let noload = libc::RTLD_NOW | libc::RTLD_NOLOAD;
    let handle = c.dlopen(&path, noload)?;
    if handle != 0 {
        call_exit(c, handle, exit)?;
        // Our RTLD_NOLOAD reference.
        c.dlclose(handle)?;
        for _ in 0..MAX_LEFTOVER_REFS {
            // One the dead ebtrace left; then, is it gone?
            c.dlclose(handle)?;
            if c.dlopen(&path, noload)? == 0 {
                break;
            }
            c.dlclose(handle)?;
        }
    }
    c.close(fd)?;
    Ok(handle != 0)
}

/// Descriptors of `pid` that hold an agent's memfd.
fn leftover_fds(pid: u32) -> Result<Vec<i32>, InjectError> {
    let dir = fs::read_dir(format!("/proc/{pid}/fd")).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InjectError::NoSuchProcess { pid },
        _ => io_err(format!("listing /proc/{pid}/fd"), e),
    })?;
    let wanted = format!("/memfd:{MEMFD_NAME} (deleted)");
    let mut fds: Vec<i32> = dir
        .flatten()
        .filter(|e| fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == wanted.as_str()))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    Ok(fds)
}

pub fn unload_leftovers(pid: u32, exit: &str) -> Result<usize, InjectError> {
    let fds = leftover_fds(pid)?;
    if fds.is_empty() {
        return Ok(0);
    }
    // The library's exit joins its thread. A thread still running may wait
    // for something the thread taken over holds (Python's GIL): the join
    // would wait for ever. One that ebtrace's exit just told to stop ends
    // within milliseconds.
    await_agent_thread_end(pid)?;
    let fns = symbols::resolve(pid)?;
    let mut s = open_session(pid)?;
    let mut c = Calls { s: &mut s, fns };
    c.keep_thread_state();
    let mut unloaded = 0;
    let mut result = Ok(());
    for fd in fds {
        match unload_leftover(&mut c, fd, exit) {
            Ok(was_loaded) => unloaded += usize::from(was_loaded),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let diverted = s.close();
    result?;
    diverted?;
    Ok(unloaded)
}
