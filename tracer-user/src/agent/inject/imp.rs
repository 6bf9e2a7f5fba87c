//! The load, unload and leftover sessions, in terms of calls made in the
//! target.

use std::{
    fs,
    io::Write as _,
    os::{fd::OwnedFd, unix::net::UnixStream},
    time::{Duration, Instant},
};

use rustix::{fs::SealFlags, process::PidfdGetfdFlags};

use super::{
    AGENT_DETACH, InjectError, InjectReport, Injected, MEMFD_NAME, calls::Calls, lock::TargetLock,
    seccomp, session::Session, symbols,
};
use crate::procfs;

/// How long an earlier agent's thread may take to end before its library
/// is left in place: stopping a framework session it was told to stop
/// converts the session's events first (seconds for millions).
const LEFTOVER_THREAD_WAIT: Duration = Duration::from_secs(5);

fn io_err(context: impl Into<String>, source: std::io::Error) -> InjectError {
    InjectError::Io {
        context: context.into(),
        source,
    }
}

/// Why the seccomp filters of the session's thread stand in the way of
/// the load (see [`seccomp::forbidden`]), where they can be read and run.
fn seccomp_refusal(pid: u32, s: &Session) -> Option<InjectError> {
    if procfs::seccomp_mode(pid) != Some(2) {
        return None;
    }
    let Some(filters) = s.seccomp_filters() else {
        log::debug!("pid {pid}: its seccomp filters cannot be read (CAP_SYS_ADMIN); not judged");
        return None;
    };
    seccomp::forbidden(filters).map(|(call, verdict)| match verdict {
        seccomp::Verdict::Fails { errno } => InjectError::SeccompFails { pid, call, errno },
        _ => InjectError::SeccompForbids { pid, call },
    })
}

/// A descriptor of the target, duplicated into ebtrace (`pidfd_getfd`).
fn take_fd(pid: u32, pidfd: &OwnedFd, fd: i32) -> Result<OwnedFd, InjectError> {
    rustix::process::pidfd_getfd(pidfd, fd, PidfdGetfdFlags::empty()).map_err(|e| {
        io_err(
            format!("copying descriptor {fd} of pid {pid} (pidfd_getfd needs Linux 5.6+)"),
            e.into(),
        )
    })
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, InjectError> {
    procfs::pidfd_open(pid).map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => InjectError::NoSuchProcess { pid },
        _ => io_err(format!("pidfd_open of pid {pid} (needs Linux 5.3+)"), e),
    })
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
    let loaded_at = procfs::boot_ticks_now();
    if !procfs::is_alive(pid) {
        return Err(InjectError::NoSuchProcess { pid });
    }
    let lock = TargetLock::take(pid)?;
    unload_leftovers_locked(pid, AGENT_DETACH)?;
    let name = copy_name(library);
    let pinned = pinned_copy(pid, &name)?;
    if pinned.is_some() {
        // Its thread, if a capture that ended left it running, ends first.
        await_agent_thread_end(pid)?;
    }
    let fns = symbols::resolve(pid)?;
    let pidfd = pidfd_open(pid)?;
    let mut s = open_session(pid)?;
    if let Some(refusal) = seccomp_refusal(pid, &s) {
        s.close()?;
        return Err(refusal);
    }
    let tid = s.tid();
    let mut c = Calls { s: &mut s, fns };
    c.keep_thread_state();
    let mut partial = Partial::default();
    let reused = match pinned {
        Some(address) => reuse_calls(&mut c, &mut partial, &pidfd, address, entry),
        None => Ok(None),
    };
    let loaded = match reused {
        Ok(Some(loaded)) => Ok(loaded),
        Ok(None) => load_calls(&mut c, &mut partial, &pidfd, library, &name, entry),
        Err(e) => Err(e),
    };
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
        memfd: partial.memfd,
        report,
        loaded_at,
        lock,
    };
    Ok((injected, UnixStream::from(ours)))
}

fn load_calls(
    c: &mut Calls,
    partial: &mut Partial,
    pidfd: &OwnedFd,
    library: &[u8],
    name: &str,
    entry: &str,
) -> Result<(u64, OwnedFd), InjectError> {
    let pid = c.pid();
    let memfd = c.memfd_create(name)?;
    partial.memfd = Some(memfd);
    let mut file = fs::File::from(take_fd(pid, pidfd, memfd)?);
    if !is_fresh_memfd(&file, name) {
        return Err(InjectError::TargetCall {
            pid,
            call: "memfd_create",
            detail: format!(
                "descriptor {memfd} is no longer the memfd made for the agent (a thread of the \
                 program put another file there): nothing was written"
            ),
        });
    }
    file.write_all(library).map_err(|e| {
        io_err(
            format!("writing the agent library into pid {pid}'s memfd"),
            e,
        )
    })?;
    seal(&file).map_err(|e| io_err(format!("sealing the agent library in pid {pid}"), e))?;
    drop(file);
    let (agent_fd, ours) = socketpair(c, partial, pidfd)?;
    let path = unused_path(c, memfd)?;
    let handle = c.dlopen(&path, libc::RTLD_NOW | libc::RTLD_LOCAL)?;
    if handle == 0 {
        let message = c.dlerror();
        return Err(InjectError::Dlopen { pid, message });
    }
    partial.handle = Some(handle);
    start_agent(c, partial, handle, entry, agent_fd)?;
    Ok((handle, ours))
}

/// How many spellings of a path to the memfd [`unused_path`] tries.
const PATH_SPELLINGS: usize = 16;

/// A path to the target's descriptor `fd` that no loaded object is known
/// by. The loader matches a name before it opens anything: a copy pinned
/// earlier (of this agent or another version) keeps the path it was loaded
/// from, whose descriptor number may be `fd` now, and `dlopen` of that path
/// would return it. Spellings differ by `./` components; none has `//`,
/// which [`leftovers::unload_leftover`]'s lookups use.
fn unused_path(c: &mut Calls, fd: i32) -> Result<String, InjectError> {
    for dots in 0..PATH_SPELLINGS {
        let path = format!("/proc/self/fd/{}{fd}", "./".repeat(dots));
        let known = c.dlopen(&path, libc::RTLD_NOW | libc::RTLD_NOLOAD)?;
        if known == 0 {
            return Ok(path);
        }
        c.dlclose(known)?;
    }
    Err(InjectError::TargetCall {
        pid: c.pid(),
        call: "dlopen",
        detail: format!(
            "{PATH_SPELLINGS} spellings of a path to the agent's memfd all name libraries loaded already"
        ),
    })
}

/// Starts again the copy of the agent pinned at `address`: a reference to
/// it, its exit (which joins the thread a capture left, ended by now),
/// then its entry on a new socketpair. None where the loader does not know
/// the copy as expected: a fresh one is loaded instead.
fn reuse_calls(
    c: &mut Calls,
    partial: &mut Partial,
    pidfd: &OwnedFd,
    address: u64,
    entry: &str,
) -> Result<Option<(u64, OwnedFd)>, InjectError> {
    let Some(handle) = c.loaded_object_at(address)? else {
        log::debug!(
            "pid {}: the agent's pinned copy is not known to the loader; loading anew",
            c.pid()
        );
        return Ok(None);
    };
    partial.handle = Some(handle);
    call_exit(c, handle, AGENT_DETACH)?;
    let (agent_fd, ours) = socketpair(c, partial, pidfd)?;
    start_agent(c, partial, handle, entry, agent_fd)?;
    Ok(Some((handle, ours)))
}

/// A socketpair in the target whose one end is moved into ebtrace: the
/// target's end, and ebtrace's.
fn socketpair(
    c: &mut Calls,
    partial: &mut Partial,
    pidfd: &OwnedFd,
) -> Result<(i32, OwnedFd), InjectError> {
    let [agent_fd, our_fd] = c.socketpair()?;
    partial.agent_fd = Some(agent_fd);
    let ours = take_fd(c.pid(), pidfd, our_fd);
    c.close(our_fd)?;
    Ok((agent_fd, ours?))
}

/// Calls the agent's `entry(agent_fd)`, which starts its thread.
fn start_agent(
    c: &mut Calls,
    partial: &mut Partial,
    handle: u64,
    entry: &str,
    agent_fd: i32,
) -> Result<(), InjectError> {
    let pid = c.pid();
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
    Ok(())
}

/// The memfd name of `library`'s copies: [`MEMFD_NAME`], a dot and a hash
/// of its bytes. A copy that stays mapped once unloaded (CUPTI keeps the
/// agent's callbacks, so the agent pins itself) is known by it as this
/// library's, and used again rather than loaded anew. FNV-1a: a name, not
/// a defence (a program that forged one would run its own code in itself).
fn copy_name(library: &[u8]) -> String {
    let hash = library.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{MEMFD_NAME}.{hash:016x}")
}

/// Whether `path` (a memfd's, as `/proc/PID/fd` and `maps` show it, less
/// ` (deleted)`) holds a copy of the agent, of any version.
fn is_agent_copy(path: &str) -> bool {
    path.strip_prefix("/memfd:")
        .and_then(|p| p.strip_prefix(MEMFD_NAME))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// An address in the copy named `name` that `pid` maps: one pinned by an
/// earlier capture (the leftovers, with their memfds, are gone by now).
fn pinned_copy(pid: u32, name: &str) -> Result<Option<u64>, InjectError> {
    let objects = crate::symbols::mapped_objects(pid).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InjectError::NoSuchProcess { pid },
        _ => io_err(format!("reading /proc/{pid}/maps"), e),
    })?;
    let path = format!("/memfd:{name}");
    Ok(objects
        .iter()
        .find(|o| o.path == path)
        .and_then(|o| o.mappings.first())
        .map(|m| m.start))
}

pub fn unload(injected: &Injected, exit: &str) -> Result<InjectReport, InjectError> {
    let began = Instant::now();
    let pid = injected.pid;
    if !procfs::is_alive(pid) {
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
    unload_from_children(pid, injected.loaded_at, exit);
    Ok(InjectReport {
        stopped,
        thread_diverted: diverted?,
        total: began.elapsed(),
    })
}

/// Takes the agent out of the children `pid` forked since `since` (clock
/// ticks since boot) that still hold it: a child forked while the agent
/// ran keeps an idle copy, its memfd and nothing else (the agent's fork
/// handler closed the rest). What cannot be taken out is said in a line.
fn unload_from_children(pid: u32, since: u64, exit: &str) {
    for child in procfs::descendants_since(pid, since) {
        if leftover_fds(child).is_ok_and(|fds| fds.is_empty()) {
            continue;
        }
        if let Err(e) = unload_leftovers(child, exit) {
            log::warn!(
                "pid {child}, forked by pid {pid} while its agent was loaded, keeps an idle copy \
                 of it: {e}"
            );
        }
    }
}

/// `exit()`, then `dlclose` and `close(memfd)` (a copy used again has
/// none). With an `exit()` that fails, the library stays: its code may run
/// still. The memfd is closed only if its descriptor number still holds
/// it: a program that closed it may have opened something else under that
/// number since.
fn unload_agent(
    c: &mut Calls,
    handle: u64,
    memfd: Option<i32>,
    exit: &str,
) -> Result<(), InjectError> {
    call_exit(c, handle, exit)?;
    c.dlclose(handle)?;
    if let Some(memfd) = memfd
        && leftover_fds(c.pid())?.contains(&memfd)
    {
        c.close(memfd)?;
    }
    Ok(())
}

/// Seals the library's memfd: nothing in the target (or anyone it passes
/// the descriptor to) can change the code ebtrace's agent runs from.
/// Whether `file`, copied from the target's descriptor that `memfd_create`
/// returned, is still that memfd: empty, unlinked, unsealed, named `name`.
/// A thread of the program may have put another file at that number since
/// (`dup2`, `close` and `open`): the agent written there would land in it.
fn is_fresh_memfd(file: &fs::File, name: &str) -> bool {
    use std::os::{fd::AsRawFd as _, unix::fs::MetadataExt as _};
    let memfd_path = format!("/memfd:{name} (deleted)");
    let named = procfs::own_descriptor_target(file.as_raw_fd())
        .is_ok_and(|p| p.as_os_str() == memfd_path.as_str());
    let empty = file
        .metadata()
        .is_ok_and(|m| m.is_file() && m.len() == 0 && m.nlink() == 0);
    let unsealed = rustix::fs::fcntl_get_seals(file).is_ok_and(|s| s.is_empty());
    named && empty && unsealed
}

fn seal(file: &fs::File) -> std::io::Result<()> {
    let seals = SealFlags::SEAL | SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE;
    Ok(rustix::fs::fcntl_add_seals(file, seals)?)
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

mod leftovers;
mod thread_choice;

pub use leftovers::unload_leftovers;
use leftovers::{leftover_fds, unload_leftovers_locked};
use thread_choice::open_session;

#[cfg(test)]
mod tests;
