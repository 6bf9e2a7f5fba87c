//! Loading a shared library (ebtrace's in-process agent) into a running
//! process, without restarting it, and taking it out again.
//!
//! One thread of the target is seized with ptrace and made to call, in
//! turn, `memfd_create`, `socketpair`, `dlopen`, `dlsym` and the library's
//! entry point, through a trampoline ([`trampoline`]: code in the unused
//! tail of a library's last code page, data on the thread's own stack)
//! that restores the thread's state by itself: if ebtrace dies at any
//! moment, the thread finishes the call under way and returns to its own
//! code. No syscall is ever run on the thread outside a call, so there is
//! no moment where ebtrace's death strands it. A thread interrupted in a
//! syscall is set up exactly as the kernel's restart logic would
//! ([`session::normalize`]), so an interrupted `read` or `nanosleep` is
//! replayed and no EINTR reaches the program. A thread found inside a call
//! that a killed ebtrace left under way is let finish it first. The calls
//! allocate and take the loader's lock, so the thread must hold neither:
//! one stopped inside the C library, the loader or a preloaded allocator
//! (in `malloc`, say), or with the loader, any allocator, a signal handler
//! or one of libc's set-id functions (`setuid` and the like hold the
//! thread-stack lock while every other thread changes its ids) anywhere on
//! its stack, is let go and another moment or thread is tried
//! ([`session::at_safe_point`], [`hazards`]). A call that still does
//! not return in a few seconds is abandoned where it waits, and the thread
//! put back, unless the thread holds one of the loader's locks
//! ([`loader_lock`]): then it is waited for longer, and at last left to
//! finish by itself.
//!
//! The library is written to a memfd named `ebtrace-agent.HASH` (a hash
//! of its bytes) that stays open in the target until [`Injected::unload`];
//! an ebtrace killed meanwhile leaves it behind, and [`unload_leftovers`]
//! (which [`load`] runs first) takes such agents out. A copy that pinned
//! itself (it gave CUPTI callbacks) stays mapped after its unload: [`load`]
//! starts that copy again, found by its name, instead of loading another.
//! The agent's own threads must be named `ebtrace-agent…`: they are never
//! the thread chosen to make the calls.
//! The agent must write to its socket with `MSG_NOSIGNAL` (an ebtrace gone
//! must not SIGPIPE the target), and its exit function must return 0 when
//! it is not attached (leftovers may never have been).
//!
//! Each of [`load`], [`Injected::unload`] and [`unload_leftovers`] runs
//! its whole ptrace session on the calling thread (a tracer is a thread).
//! x86-64 only.

#[cfg(target_arch = "x86_64")]
mod calls;
#[cfg(target_arch = "x86_64")]
mod hazards;
#[cfg(target_arch = "x86_64")]
mod loader_lock;
#[cfg(target_arch = "x86_64")]
mod lock;
#[cfg(target_arch = "x86_64")]
mod ptrace;
#[cfg(target_arch = "x86_64")]
mod seccomp;
#[cfg(target_arch = "x86_64")]
mod session;
#[cfg(target_arch = "x86_64")]
mod symbols;
#[cfg(target_arch = "x86_64")]
mod threads;
#[cfg(target_arch = "x86_64")]
mod trampoline;

pub mod check;

use std::{os::unix::net::UnixStream, time::Duration};

/// The agent's function that stops it, called on leftovers by [`load`].
pub const AGENT_DETACH: &str = tracer_agent::DETACH_SYMBOL;
/// Name of the memfd that holds the library in the target (followed by a
/// dot and the library's hash).
pub const MEMFD_NAME: &str = "ebtrace-agent";
/// Threads whose name starts with this belong to the agent.
pub const AGENT_THREAD_PREFIX: &str = "ebtrace-agent";

/// A library loaded into a target by [`load`]; [`Injected::unload`] takes
/// it out again.
#[derive(Debug)]
pub struct Injected {
    /// The target process.
    pub pid: u32,
    /// The thread that made the calls.
    pub tid: u32,
    /// The `dlopen` handle, in the target.
    pub handle: u64,
    /// The memfd holding the library, a descriptor number in the target;
    /// none for a pinned copy used again.
    pub memfd: Option<i32>,
    /// How long the load took.
    pub report: InjectReport,
    /// When the load began, in clock ticks since boot: children started
    /// since may hold a copy of the agent.
    loaded_at: u64,
    /// Held until the agent is unloaded: no other ebtrace loads meanwhile.
    #[cfg(target_arch = "x86_64")]
    lock: Option<lock::TargetLock>,
}

/// Where a thread taken over was stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopPoint {
    /// Blocked in this restarted wait (syscall number).
    Wait {
        /// The x86-64 syscall number.
        syscall: i64,
    },
    /// Running its own code at this instruction.
    Code {
        /// The instruction pointer.
        ip: u64,
    },
}

/// How long a load or unload took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InjectReport {
    /// How long the hijacked thread was kept from its own code.
    pub thread_diverted: Duration,
    /// The whole operation, from ebtrace's side.
    pub total: Duration,
    /// Where the thread was taken over (none when none was).
    pub stopped: Option<StopPoint>,
}

/// Why a load or unload failed, one actionable line each.
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    /// The target is gone or never existed.
    #[error("no process with pid {pid} (is it still running? check with `ps -p {pid}`)")]
    NoSuchProcess {
        /// The target process.
        pid: u32,
    },

    /// The kernel refused `PTRACE_SEIZE` or opening `/proc/PID/mem`.
    #[error("not permitted to attach to pid {pid} with ptrace: {why}")]
    NotPermitted {
        /// The target process.
        pid: u32,
        /// What stands in the way (another tracer, a missing capability,
        /// Yama's ptrace scope) and how to lift it.
        why: String,
    },

    /// The target is stopped (SIGSTOP, a job-control stop): code run in it
    /// would run while the program itself cannot, and an agent's thread
    /// would join the stop.
    #[error(
        "pid {pid} is stopped (SIGSTOP or a job-control stop): ebtrace runs no code in a stopped \
         process; continue it (`kill -CONT {pid}`) and capture again"
    )]
    TargetStopped {
        /// The target process.
        pid: u32,
    },

    /// The target's cgroup is frozen: none of its threads would run a call.
    #[error(
        "pid {pid} is in the frozen cgroup {cgroup}: ebtrace runs no code in it until it is \
         thawed (write 0 to that cgroup's cgroup.freeze, or THAWED to its freezer.state)"
    )]
    TargetFrozen {
        /// The target process.
        pid: u32,
        /// The frozen cgroup's path in its hierarchy.
        cgroup: String,
    },

    /// A thread did not stop for ptrace in time: it sleeps where no signal
    /// reaches it (state D: a hung NFS or FUSE read, a v1 freezer).
    #[error(
        "thread {tid} of pid {pid} did not stop within {seconds} s (it sleeps uninterruptibly, \
         state D): ebtrace left it; capture again once it runs"
    )]
    ThreadUnresponsive {
        /// The target process.
        pid: u32,
        /// The thread.
        tid: u32,
        /// How long it was given.
        seconds: u64,
    },

    /// A thread is blocked in a call that a stop would end early, with an
    /// error the program would see (`connect` with a send timeout): it is
    /// never stopped there.
    #[error(
        "thread {tid} of pid {pid} is blocked in syscall {syscall}, which a stop would end \
         early: ebtrace left it alone"
    )]
    WouldCutShort {
        /// The target process.
        pid: u32,
        /// The thread.
        tid: u32,
        /// The syscall's number.
        syscall: i64,
    },

    /// Another ebtrace (or this one, for another capture) is loading into
    /// the target, or its agent is loaded there.
    #[error(
        "pid {pid} is being captured by another ebtrace{}: one ebtrace at a time loads its agent \
         into a process; wait for that capture to end",
        holder.map(|h| format!(" (pid {h})")).unwrap_or_default()
    )]
    AnotherEbtrace {
        /// The target process.
        pid: u32,
        /// The ebtrace holding the target's lock, where it says.
        holder: Option<u32>,
    },

    /// The target exited during the operation.
    #[error("pid {pid} exited while ebtrace was loading or unloading its agent")]
    TargetExited {
        /// The target process.
        pid: u32,
    },

    /// The target runs code the trampoline cannot drive (32-bit code, a
    /// shadow stack, another architecture).
    #[error("loading the agent into an x86-64 Linux process is all ebtrace supports: {what}")]
    UnsupportedArch {
        /// What about the target is unsupported.
        what: String,
    },

    /// The target maps no C library to provide `dlopen`.
    #[error(
        "pid {pid} maps no C library with dlopen (statically linked?); the in-process agent \
         cannot be loaded into it"
    )]
    NoLoader {
        /// The target process.
        pid: u32,
    },

    /// `dlopen` of the agent's memfd returned no handle.
    #[error("dlopen of the agent in pid {pid} failed: {message}")]
    Dlopen {
        /// The target process.
        pid: u32,
        /// The target's `dlerror()` text.
        message: String,
    },

    /// `dlsym` found no such function in the loaded agent.
    #[error("the agent library in pid {pid} has no function `{symbol}`: {message}")]
    MissingSymbol {
        /// The target process.
        pid: u32,
        /// The function looked up.
        symbol: String,
        /// The target's `dlerror()` text.
        message: String,
    },

    /// The agent's entry or exit function returned an error.
    #[error("the agent's {function}() in pid {pid} failed: {}", std::io::Error::from_raw_os_error(-code))]
    AgentFailed {
        /// The target process.
        pid: u32,
        /// The agent function called.
        function: String,
        /// What it returned, a negated errno.
        code: i32,
    },

    /// A call made in the target failed.
    #[error("{call}() in pid {pid} failed: {detail}")]
    TargetCall {
        /// The target process.
        pid: u32,
        /// The function called in the target.
        call: &'static str,
        /// How it failed.
        detail: String,
    },

    /// A call made in the target was killed by a signal.
    #[error(
        "{call}() in pid {pid} crashed with signal {signal}; the call was abandoned and the \
         thread's own state put back"
    )]
    TargetCrashed {
        /// The target process.
        pid: u32,
        /// The function called in the target.
        call: &'static str,
        /// The signal number.
        signal: i32,
    },

    /// The target's seccomp filter would punish a syscall the load needs.
    #[error(
        "pid {pid} runs under a seccomp filter that would kill it (or stop it) for the {call}() \
         call loading the agent makes: ebtrace does not load its agent into it; use \
         --traceme uprobe and --no-device-activity, or start it with the agent preloaded"
    )]
    SeccompForbids {
        /// The target process.
        pid: u32,
        /// The call the filter forbids.
        call: &'static str,
    },

    /// The target's seccomp filter would fail a syscall the load cannot do
    /// without, leaving the load half-done in it.
    #[error(
        "pid {pid} runs under a seccomp filter that fails the {call}() call loading the agent \
         makes (errno {errno}): ebtrace does not load its agent into it; allow {call} in its \
         profile, or use --traceme uprobe and --no-device-activity"
    )]
    SeccompFails {
        /// The target process.
        pid: u32,
        /// The call the filter fails.
        call: &'static str,
        /// The errno it fails with.
        errno: u32,
    },

    /// A call made in the target did not return in time and was abandoned.
    #[error(
        "{call}() in pid {pid} did not return in {seconds} s (it waits for something another \
         thread holds{}); the call was abandoned where it waited, holding none of the \
         loader's locks, and the thread put back in its own code",
        match lock_holder {
            Some(tid) => format!(": thread {tid} holds the loader's lock, in a library \
                constructor that never ends, say"),
            None => String::new(),
        }
    )]
    CallTimedOut {
        /// The target process.
        pid: u32,
        /// The function called in the target.
        call: &'static str,
        /// How long it was given, in seconds.
        seconds: u64,
        /// The thread holding the loader's lock, where one does.
        lock_holder: Option<u32>,
    },

    /// A call made in the target that holds the loader's lock did not
    /// return in time, and was left to finish by itself.
    #[error(
        "{call}() in pid {pid} has not returned in {seconds} s, and its thread {tid} holds the \
         loader's lock (it waits for something another thread holds: an allocator's lock, or a \
         file); pulled out, it would hold that lock for ever, so the thread was left to finish \
         it by itself and go back to its own code; nothing was started, and the next ebtrace \
         run on pid {pid} takes out what it loads"
    )]
    CallLeftToFinish {
        /// The target process.
        pid: u32,
        /// The thread making the call.
        tid: u32,
        /// The function called in the target.
        call: &'static str,
        /// How long it was waited for, in seconds.
        seconds: u64,
    },

    /// A call was asked of a thread left inside an earlier one.
    #[error(
        "thread {tid} of pid {pid} is still inside a call left to finish by itself; no other \
         call is made on it"
    )]
    ThreadInCall {
        /// The target process.
        pid: u32,
        /// The thread.
        tid: u32,
    },

    /// No thread of the target stopped where it could safely make the
    /// calls.
    #[error(
        "no thread of pid {pid} stopped where it could call into the C library in {seconds} s \
         ({tries} tries: {refusals}); try again, or start the program with the agent preloaded \
         (`ebtrace agent-library --help`)"
    )]
    NoSafePoint {
        /// The target process.
        pid: u32,
        /// How long threads were tried, in seconds.
        seconds: u64,
        /// How many thread stops were tried.
        tries: u32,
        /// Why the stops were refused, counted by reason.
        refusals: String,
    },

    /// A leftover agent's thread did not end after its exit function.
    #[error(
        "an earlier agent's thread in pid {pid} has not ended after {seconds} s (it waits for \
         the program, such as for Python's GIL): its library stays loaded, inert once the thread \
         ends; try again later, or use --traceme uprobe"
    )]
    AgentThreadRunning {
        /// The target process.
        pid: u32,
        /// How long it was waited for, in seconds.
        seconds: u64,
    },

    /// A ptrace request failed.
    #[error("ptrace {what} of thread {tid} failed: {source}")]
    Ptrace {
        /// The request.
        what: &'static str,
        /// The thread it was made on.
        tid: u32,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },

    /// Any other I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Loads `library` into `pid` and calls its `entry(fd)` with one end of a
/// new socketpair; returns the other end. Agents an earlier, killed ebtrace
/// left loaded are taken out first.
pub fn load(pid: u32, library: &[u8], entry: &str) -> Result<(Injected, UnixStream), InjectError> {
    #[cfg(target_arch = "x86_64")]
    return imp::load(pid, library, entry);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pid, library, entry);
        Err(unsupported())
    }
}

impl Injected {
    /// Calls the agent's `exit()` (which stops its threads), then unloads
    /// the library and closes its memfd. If `exit()` fails the library
    /// stays loaded (its code may still run) and the error says why.
    pub fn unload(self, exit: &str) -> Result<InjectReport, InjectError> {
        #[cfg(target_arch = "x86_64")]
        {
            let unloaded = imp::unload(&self, exit);
            // Another ebtrace may load once this one's agent is out.
            drop(self.lock);
            unloaded
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = exit;
            Err(unsupported())
        }
    }
}

/// Takes out the agents that a killed ebtrace left loaded in `pid` (found
/// by their memfd); returns how many were unloaded.
pub fn unload_leftovers(pid: u32, exit: &str) -> Result<usize, InjectError> {
    #[cfg(target_arch = "x86_64")]
    return imp::unload_leftovers(pid, exit);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pid, exit);
        Err(unsupported())
    }
}

/// Kernel tid → `pthread_self()` of each thread of `pid` but the agent's
/// and those `known` names (see [`threads::thread_pointers`]).
pub fn thread_pointers(
    pid: u32,
    known: impl Fn(u32) -> bool,
) -> Result<std::collections::HashMap<u32, u64>, InjectError> {
    #[cfg(target_arch = "x86_64")]
    return threads::thread_pointers(pid, known);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pid, known);
        Err(unsupported())
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn unsupported() -> InjectError {
    InjectError::UnsupportedArch {
        what: format!("this ebtrace was built for {}", std::env::consts::ARCH),
    }
}

#[cfg(target_arch = "x86_64")]
mod imp;

/// The program's own threads of `pid`: every thread but the agent's.
fn program_threads(pid: u32) -> Result<Vec<u32>, InjectError> {
    let tids = crate::procfs::thread_ids(pid).map_err(|_| InjectError::NoSuchProcess { pid })?;
    Ok(tids
        .into_iter()
        .filter(|tid| !is_agent_thread(pid, *tid))
        .collect())
}

fn is_agent_thread(pid: u32, tid: u32) -> bool {
    crate::procfs::thread_name(pid, tid).is_some_and(|c| c.starts_with(AGENT_THREAD_PREFIX))
}

/// Whether an agent's thread runs in `pid`: another capture's, or one an
/// ebtrace that ended is stopping, which [`load`] waits for.
pub fn agent_thread_running(pid: u32) -> bool {
    crate::procfs::thread_ids(pid)
        .is_ok_and(|tids| tids.into_iter().any(|t| is_agent_thread(pid, t)))
}

/// Why ptrace was refused, with what to do about it.
fn why_not_permitted(pid: u32) -> String {
    if let Some(tracer) = crate::procfs::tracer_of(pid) {
        let comm = crate::procfs::process_name(tracer).unwrap_or_default();
        return format!(
            "it is already traced by pid {tracer} ({}), e.g. a debugger; detach that first",
            comm.trim()
        );
    }
    const CAP_SYS_PTRACE: u32 = 19;
    let has_cap = crate::procfs::effective_capabilities() & (1 << CAP_SYS_PTRACE) != 0;
    let yama = crate::procfs::sysctl_number("kernel/yama/ptrace_scope");
    match yama {
        Some(3) => "kernel.yama.ptrace_scope is 3, which forbids ptrace for everyone until reboot"
            .to_string(),
        _ if !has_cap => format!(
            "run ebtrace as root (or give it CAP_SYS_PTRACE){}",
            match yama {
                Some(n @ 1..) => format!(
                    "; kernel.yama.ptrace_scope is {n} (`sysctl kernel.yama.ptrace_scope=0` \
                     lets a user trace their own processes)"
                ),
                _ => String::new(),
            }
        ),
        _ => "the kernel refused although ebtrace has CAP_SYS_PTRACE (a security module such \
              as SELinux or AppArmor, or a container without that capability?)"
            .to_string(),
    }
}
