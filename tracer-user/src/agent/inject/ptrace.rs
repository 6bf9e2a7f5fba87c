//! The ptrace side of a session: seizing one thread, stopping it, its
//! registers and memory, running it to the next syscall stop, and letting it
//! go again with the signals that arrived meanwhile.
//!
//! Signals that reach the thread while it is held are suppressed and
//! remembered; [`Tracee::detach`] delivers them again (the first with the
//! detach itself, the others with `tgkill`), so the target loses none.
//!
//! Registers are never written at a syscall-entry stop: the kernel runs
//! the thread's seccomp filters after that stop, on whatever number the
//! tracer left, and a skipped syscall (-1) is on no allowlist. A stop at a
//! syscall's entry is first run out to the syscall's exit, its number
//! replaced by one the filters let run ([`Tracee::set_harmless_syscall`]).

use std::{
    fs::File,
    io,
    os::unix::fs::FileExt as _,
    time::{Duration, Instant},
};

use super::InjectError;

mod regsets;
mod release;

const PTRACE_GETREGS: libc::c_long = 12;
const PTRACE_SETREGS: libc::c_long = 13;
const PTRACE_SYSCALL: libc::c_long = 24;
const PTRACE_SEIZE: libc::c_long = 0x4206;
const PTRACE_INTERRUPT: libc::c_long = 0x4207;
const PTRACE_GET_SYSCALL_INFO: libc::c_long = 0x420e;
const PTRACE_GETSIGINFO: libc::c_long = 0x4202;
/// `sizeof(siginfo_t)`.
const SIGINFO_LEN: usize = 128;
/// A `siginfo_t`, as bytes.
type SigInfo = [u8; SIGINFO_LEN];
/// glibc's signal for `setuid()` and the like in a multithreaded program.
const SIGSETXID: i32 = 33;
/// How long a thread seized gets to stop: one in user code or an
/// interruptible wait stops at once.
const SEIZE_WAIT: Duration = Duration::from_secs(2);
const PTRACE_O_TRACESYSGOOD: libc::c_long = 1;
const PTRACE_EVENT_STOP: i32 = 128;
const SYSCALL_INFO_ENTRY: u8 = 1;
const SYSCALL_INFO_EXIT: u8 = 2;

/// Syscalls that a stop ends with EINTR even where no handler runs
/// (signal(7)): `semop` (65), `rt_sigtimedwait` (128), `semtimedop` (220),
/// `epoll_wait` (232), `epoll_pwait` (281), `epoll_pwait2` (441),
/// `io_getevents` (208), `io_pgetevents` (333), `io_uring_enter` (426: it
/// ends with EINTR only where it submitted nothing, so issuing it again
/// waits again); and those on a socket with
/// a receive or send timeout (`SO_RCVTIMEO`, `SO_SNDTIMEO`): `read` (0),
/// `write` (1), `readv` (19), `writev` (20), `accept` (43), `sendto` (44),
/// `recvfrom` (45), `sendmsg` (46), `recvmsg` (47), `accept4` (288),
/// `recvmmsg` (299), `sendmmsg` (307). EINTR with no signal pending can
/// only be the stop's, and it means nothing was transferred: the call is
/// issued again as it was.
const ENDED_BY_A_STOP: [u64; 21] = [
    65, 128, 220, 232, 281, 441, 208, 333, 426, 0, 1, 19, 20, 43, 44, 45, 46, 47, 288, 299, 307,
];
/// `connect`: a stop ends it with EINTR on a socket with a send timeout.
/// On a Unix-domain socket the kernel keeps nothing of the interrupted
/// wait, so it is issued again as it was; on a TCP socket the connection
/// goes on meanwhile, and issued again it fails with `EALREADY`.
const CONNECT: u64 = 42;
/// Syscalls that a stop ends with EINTR and that cannot always be issued
/// again as they were ([`CONNECT`]). A thread blocked in one is never
/// stopped: [`Tracee::seize`] looks just before it stops the thread.
const NEVER_STOPPED_IN: [i64; 1] = [CONNECT as i64];
/// How long [`Tracee::step_until`] looks for the next stop without sleeping.
const SPIN_FOR: Duration = Duration::from_millis(1);
/// The x86-64 `syscall` instruction.
const SYSCALL_INSN: [u8; 2] = [0x0f, 0x05];

/// The general-purpose registers, as `PTRACE_GETREGS` gives them.
pub type Regs = libc::user_regs_struct;

/// What stopped the thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Entering a syscall: its number and the address after its `syscall`.
    SyscallEntry { nr: u64, ip: u64 },
    /// Leaving a syscall.
    SyscallExit,
    /// A signal is about to be delivered (it was suppressed and remembered).
    Signal(i32),
    /// `PTRACE_INTERRUPT` or a group stop.
    Event,
}

/// One seized thread of a target process.
pub struct Tracee {
    pub pid: u32,
    pub tid: u32,
    mem: File,
    /// Signals suppressed while the thread was held, in arrival order,
    /// each with its `siginfo_t` as the kernel gave it.
    pending: Vec<(i32, SigInfo)>,
    attached: bool,
    /// A stop's wait status taken but not decoded yet.
    status: Option<i32>,
    /// A signal to deliver as the thread resumes: glibc's `SIGSETXID`,
    /// which a thread of the program that changes its ids (`setuid`) sends
    /// every thread, waiting for each to run its handler while it holds
    /// the lock `pthread_create` needs: held back, it would stall both the
    /// program and the agent's start. Its handler is async-signal-safe.
    pass_on: Option<(i32, SigInfo)>,
    /// Stopped at a syscall's entry, not resumed since.
    at_syscall_entry: bool,
    /// A syscall without effects that the thread's filters let run: what a
    /// syscall-entry stop is run out with before registers are written.
    harmless_syscall: u64,
}

/// `getpid`: no filter in use refuses it.
const GETPID: u64 = 39;
/// How many stops running a syscall out to its exit may take (its exit's
/// comes next; the bound is for a kernel that says otherwise).
const STOPS_TO_EXIT: usize = 8;

fn ptrace(req: libc::c_long, tid: u32, addr: u64, data: u64) -> io::Result<libc::c_long> {
    // SAFETY: a raw ptrace request; `addr`/`data` point into buffers the
    // callers own and size for the request, or are plain values.
    let r = unsafe { libc::syscall(libc::SYS_ptrace, req, tid as libc::c_long, addr, data) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl Tracee {
    /// Seizes `tid` of `pid` and stops it. Nothing in the target changes if
    /// ebtrace dies now: a tracer's exit lets its tracees go (a wait the
    /// stop ended is replayed from then on, see
    /// [`Self::replay_wait_ended_by_the_stop`]).
    ///
    /// A thread blocked in a call a stop would cut short
    /// ([`NEVER_STOPPED_IN`]) is left alone: [`InjectError::WouldCutShort`].
    /// It is looked at as late as can be, so only a thread that enters such
    /// a call within the microseconds before the stop is caught in it (see
    /// [`Self::replay_wait_ended_by_the_stop`] for what then follows).
    pub fn seize(pid: u32, tid: u32) -> Result<Self, InjectError> {
        let mem = crate::procfs::memory_file(pid).map_err(|e| open_error(pid, e))?;
        if let Some(syscall) = crate::procfs::thread_syscall_number(pid, tid)
            .filter(|nr| NEVER_STOPPED_IN.contains(nr))
        {
            return Err(InjectError::WouldCutShort { pid, tid, syscall });
        }
        ptrace(PTRACE_SEIZE, tid, 0, PTRACE_O_TRACESYSGOOD as u64)
            .map_err(|e| open_error(pid, e))?;
        let mut t = Tracee {
            pid,
            tid,
            mem,
            pending: Vec::new(),
            attached: true,
            status: None,
            pass_on: None,
            at_syscall_entry: false,
            harmless_syscall: GETPID,
        };
        t.request(PTRACE_INTERRUPT, 0, 0, "interrupt")?;
        let deadline = Instant::now() + SEIZE_WAIT;
        loop {
            if !t.stopped_by(deadline)? {
                // Asleep where the interrupt does not reach it: it stops
                // when it wakes, and is let go when this thread of
                // ebtrace's ends (a tracer's exit releases its tracees).
                return Err(InjectError::ThreadUnresponsive {
                    pid,
                    tid,
                    seconds: SEIZE_WAIT.as_secs(),
                });
            }
            match t.decode_stop()? {
                Stop::Event => {
                    t.replay_wait_ended_by_the_stop()?;
                    return Ok(t);
                }
                Stop::Signal(_) | Stop::SyscallEntry { .. } | Stop::SyscallExit => {
                    // Suppressed (and remembered); the interrupt is still due.
                    t.resume()?;
                }
            }
        }
    }

    /// Sets a wait that this stop ended with EINTR (no signal having come)
    /// up to be issued again when the thread resumes, as the kernel does
    /// for the waits it restarts: the program never sees it end. A wait
    /// with a timeout starts it afresh. A `connect` is issued again on a
    /// Unix-domain socket only; on another it ends with EINTR, as with a
    /// signal.
    fn replay_wait_ended_by_the_stop(&mut self) -> Result<(), InjectError> {
        if !self.pending.is_empty() {
            return Ok(());
        }
        let mut regs = self.regs()?;
        if regs.rax as i64 != -i64::from(libc::EINTR) {
            return Ok(());
        }
        let replayable = ENDED_BY_A_STOP.contains(&regs.orig_rax)
            || (regs.orig_rax == CONNECT
                && crate::procfs::is_unix_socket(self.pid, regs.rdi as i32));
        if !replayable {
            return Ok(());
        }
        let mut insn = [0u8; 2];
        let at = regs.rip.wrapping_sub(2);
        if self.read(at, &mut insn).is_err() || insn != SYSCALL_INSN {
            return Ok(());
        }
        regs.rip = at;
        regs.rax = regs.orig_rax;
        regs.orig_rax = u64::MAX;
        self.set_regs(&regs)
    }

    fn request(
        &self,
        req: libc::c_long,
        addr: u64,
        data: u64,
        what: &'static str,
    ) -> Result<(), InjectError> {
        ptrace(req, self.tid, addr, data)
            .map(drop)
            .map_err(|e| self.ptrace_error(what, e))
    }

    fn ptrace_error(&self, what: &'static str, e: io::Error) -> InjectError {
        if e.raw_os_error() == Some(libc::ESRCH) && !crate::procfs::is_alive(self.pid) {
            InjectError::TargetExited { pid: self.pid }
        } else {
            InjectError::Ptrace {
                what,
                tid: self.tid,
                source: e,
            }
        }
    }

    /// Waits for the thread's next stop.
    fn wait(&mut self) -> Result<Stop, InjectError> {
        if self.status.is_some() {
            return self.decode_stop();
        }
        let mut status = 0;
        loop {
            // SAFETY: waits for our own tracee; `status` is a valid out pointer.
            let r = unsafe { libc::waitpid(self.tid as i32, &mut status, libc::__WALL) };
            if r >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                self.attached = false;
                return Err(match e.raw_os_error() {
                    Some(libc::ECHILD) => InjectError::TargetExited { pid: self.pid },
                    _ => self.ptrace_error("wait", e),
                });
            }
        }
        self.status = Some(status);
        self.decode_stop()
    }

    /// What the stop whose status [`Self::wait`] or [`Self::stopped_now`]
    /// took is.
    fn decode_stop(&mut self) -> Result<Stop, InjectError> {
        let status = self.status.take().unwrap_or(0);
        self.at_syscall_entry = false;
        if !libc::WIFSTOPPED(status) {
            self.attached = false;
            return Err(InjectError::TargetExited { pid: self.pid });
        }
        let sig = libc::WSTOPSIG(status);
        if status >> 16 == PTRACE_EVENT_STOP {
            return Ok(Stop::Event);
        }
        if sig == libc::SIGTRAP | 0x80 {
            let stop = self.syscall_stop()?;
            self.at_syscall_entry = matches!(stop, Stop::SyscallEntry { .. });
            return Ok(stop);
        }
        let mut info: SigInfo = [0; SIGINFO_LEN];
        let _ = ptrace(PTRACE_GETSIGINFO, self.tid, 0, info.as_mut_ptr() as u64);
        if sig == SIGSETXID {
            // Passed on as the thread resumes (see `pass_on`).
            self.pass_on = Some((sig, info));
            return Ok(Stop::Signal(sig));
        }
        self.pending.push((sig, info));
        Ok(Stop::Signal(sig))
    }

    fn syscall_stop(&self) -> Result<Stop, InjectError> {
        // struct ptrace_syscall_info: op, pad, arch, ip, sp, then nr for an
        // entry stop.
        let mut info = [0u64; 11];
        self.request(
            PTRACE_GET_SYSCALL_INFO,
            std::mem::size_of_val(&info) as u64,
            info.as_mut_ptr() as u64,
            "syscall info",
        )?;
        Ok(match info[0] as u8 {
            SYSCALL_INFO_ENTRY => Stop::SyscallEntry {
                nr: info[3],
                ip: info[1],
            },
            SYSCALL_INFO_EXIT => Stop::SyscallExit,
            _ => Stop::Event,
        })
    }

    /// Lets the thread run on from a stop, taking the signal to pass on.
    fn resume(&mut self) -> Result<(), InjectError> {
        let sig = self.pass_on.take().map_or(0, |(sig, _)| sig);
        self.at_syscall_entry = false;
        self.request(PTRACE_SYSCALL, 0, sig as u64, "resume")
    }

    /// Sets the syscall a syscall-entry stop is run out with: `nr` must be
    /// one the thread's filters let run (or fail), and have no effect.
    pub fn set_harmless_syscall(&mut self, nr: u32) {
        self.harmless_syscall = u64::from(nr);
    }

    /// From a syscall-entry stop, runs the thread to that syscall's exit,
    /// the harmless syscall in its place: from there on nothing the kernel
    /// does before the thread's own code looks at its registers.
    fn run_out_of_syscall_entry(&mut self) -> Result<(), InjectError> {
        let mut regs = self.regs()?;
        regs.orig_rax = self.harmless_syscall;
        self.write_regs(&regs)?;
        for _ in 0..STOPS_TO_EXIT {
            match self.step()? {
                Stop::SyscallExit => return Ok(()),
                // Suppressed and remembered, as at every stop.
                Stop::Signal(_) | Stop::Event => {}
                Stop::SyscallEntry { .. } => break,
            }
        }
        Err(InjectError::TargetCall {
            pid: self.pid,
            call: "a syscall run out to its exit",
            detail: format!("thread {} did not reach the syscall's exit", self.tid),
        })
    }

    /// Lets the thread run to its next stop (syscall entry or exit,
    /// signal, event).
    pub fn step(&mut self) -> Result<Stop, InjectError> {
        self.resume()?;
        self.wait()
    }

    /// [`Self::step`], but waiting only until `deadline`: past it the
    /// thread is stopped where it is (in a wait, say) and `None` returned.
    pub fn step_until(&mut self, deadline: Instant) -> Result<Option<Stop>, InjectError> {
        self.resume()?;
        let resumed = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            if self.stopped_now()? {
                return self.decode_stop().map(Some);
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // A call's stops come microseconds apart, and the thread is
            // kept from its own code meanwhile: look again at once for a
            // millisecond. A call blocked that long may block for good:
            // then look less and less often.
            if now - resumed < SPIN_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(2));
            }
        }
        // The thread's next stop, whatever it is (leaving the wait it was
        // in, as often as not), holds it: resumed from there, it might go
        // back into the wait before the interrupt's own stop.
        self.request(PTRACE_INTERRUPT, 0, 0, "interrupt")?;
        self.wait()?;
        Ok(None)
    }

    /// Whether the thread stops by `deadline` (its status then waits to be
    /// decoded by [`Self::decode_stop`]).
    fn stopped_by(&mut self, deadline: Instant) -> Result<bool, InjectError> {
        let mut pause = Duration::from_micros(20);
        loop {
            if self.stopped_now()? {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// Whether the thread has stopped (its status then waits to be decoded
    /// by [`Self::decode_stop`]), without blocking.
    fn stopped_now(&mut self) -> Result<bool, InjectError> {
        let mut status = 0;
        // SAFETY: polls our own tracee; `status` is a valid out pointer.
        let r =
            unsafe { libc::waitpid(self.tid as i32, &mut status, libc::__WALL | libc::WNOHANG) };
        match r {
            0 => Ok(false),
            r if r > 0 => {
                self.status = Some(status);
                Ok(true)
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    return Ok(false);
                }
                self.attached = false;
                Err(match e.raw_os_error() {
                    Some(libc::ECHILD) => InjectError::TargetExited { pid: self.pid },
                    _ => self.ptrace_error("wait", e),
                })
            }
        }
    }

    /// Forgets the last remembered signal (it was a fault of our own call,
    /// which is abandoned; delivering it again would kill the target).
    pub fn drop_last_signal(&mut self) {
        self.pending.pop();
    }

    pub fn regs(&self) -> Result<Regs, InjectError> {
        // SAFETY: user_regs_struct is plain integers; all-zero is valid.
        let mut regs: Regs = unsafe { std::mem::zeroed() };
        self.request(
            PTRACE_GETREGS,
            0,
            &mut regs as *mut Regs as u64,
            "read registers",
        )?;
        Ok(regs)
    }

    /// Writes the thread's registers, as they are to be when it next runs
    /// its own code: a syscall-entry stop is first run out to its exit.
    pub fn set_regs(&mut self, regs: &Regs) -> Result<(), InjectError> {
        if self.at_syscall_entry {
            self.run_out_of_syscall_entry()?;
        }
        self.write_regs(regs)
    }

    fn write_regs(&self, regs: &Regs) -> Result<(), InjectError> {
        self.request(
            PTRACE_SETREGS,
            0,
            regs as *const Regs as u64,
            "write registers",
        )
    }

    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), InjectError> {
        self.mem
            .read_exact_at(buf, addr)
            .map_err(|e| self.mem_error("read", addr, e))
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) -> Result<(), InjectError> {
        self.mem
            .write_all_at(bytes, addr)
            .map_err(|e| self.mem_error("write", addr, e))
    }

    pub fn read_u64(&self, addr: u64) -> Result<u64, InjectError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// A NUL-terminated string of at most `max` bytes (lossy UTF-8), read
    /// page by page so that one ending before an unmapped page is read.
    pub fn read_cstring(&self, mut addr: u64, max: usize) -> Result<String, InjectError> {
        let mut out = Vec::new();
        while out.len() < max {
            let chunk = (4096 - (addr % 4096) as usize).min(max - out.len());
            let mut buf = vec![0u8; chunk];
            self.read(addr, &mut buf)?;
            if let Some(end) = buf.iter().position(|&b| b == 0) {
                out.extend_from_slice(&buf[..end]);
                break;
            }
            out.extend_from_slice(&buf);
            addr += chunk as u64;
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    fn mem_error(&self, what: &'static str, addr: u64, e: io::Error) -> InjectError {
        if !crate::procfs::is_alive(self.pid) {
            return InjectError::TargetExited { pid: self.pid };
        }
        InjectError::Io {
            context: format!("{what} memory of pid {} at {addr:#x}", self.pid),
            source: e,
        }
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        let _ = self.detach();
    }
}

/// The error for a failed open of `/proc/PID/mem` or `PTRACE_SEIZE`.
fn open_error(pid: u32, e: io::Error) -> InjectError {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH) => InjectError::NoSuchProcess { pid },
        Some(libc::EPERM | libc::EACCES) => InjectError::NotPermitted {
            pid,
            why: super::why_not_permitted(pid),
        },
        _ => InjectError::Io {
            context: format!("attaching to pid {pid}"),
            source: e,
        },
    }
}
