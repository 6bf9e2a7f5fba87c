//! One session with a target: a seized thread, its interrupted state made
//! resumable, and the trampoline through which it calls functions.

use std::{
    ops::Range,
    time::{Duration, Instant},
};

use super::{
    InjectError, StopPoint,
    hazards::{Hazards, Refusal},
    loader_lock::LoaderLocks,
    ptrace::{Regs, Stop, Tracee},
    seccomp::{self, Insn},
    trampoline::{self, BLOCK_LEN, RESULT, SCRATCH},
};

const SYS_RESTART_SYSCALL: u64 = 219;
const ERESTARTSYS: i64 = -512;
const ERESTARTNOINTR: i64 = -513;
const ERESTARTNOHAND: i64 = -514;
const ERESTART_RESTARTBLOCK: i64 = -516;
/// How long one call made on the thread may take. The calls load a small
/// library and start a thread (milliseconds); one that takes longer waits
/// for something that may never come.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long, in all, a call that holds the loader's lock is waited for
/// (see [`Session::call`]).
const HELD_LOCK_WAIT: Duration = Duration::from_secs(20);
/// The `cs` of 64-bit user code, and the user `ss`.
const USER_CS_64: u64 = 0x33;
const USER_SS: u64 = 0x2b;

/// The state the kernel would resume the thread at: an interrupted
/// syscall that the kernel restarts is set up to be issued again
/// (`rip` back on its `syscall`, `rax` its number, or `restart_syscall`),
/// as the kernel's own restart logic does, so that it is replayed rather
/// than failing with EINTR. `orig_rax` is -1: the state is plain user
/// state, which the kernel resumes as it is.
pub fn normalize(mut regs: Regs) -> Regs {
    let ret = regs.rax as i64;
    if (regs.orig_rax as i64) >= 0 {
        match ret {
            ERESTARTSYS | ERESTARTNOINTR | ERESTARTNOHAND => {
                regs.rip -= 2;
                regs.rax = regs.orig_rax;
            }
            ERESTART_RESTARTBLOCK => {
                regs.rip -= 2;
                regs.rax = SYS_RESTART_SYSCALL;
            }
            _ => {}
        }
    }
    regs.orig_rax = u64::MAX;
    regs
}

/// Syscalls a thread can be taken out of and put back into without the
/// program seeing a difference: the kernel restarts them (or resumes them
/// through `restart_syscall`) after a stop. `read` (0), `poll` (7),
/// `select` (23), `pause` (34), `nanosleep` (35), `wait4` (61), `futex`
/// (202), `clock_nanosleep` (230), `pselect6` (270), `ppoll` (271).
/// (`epoll_wait` is not one: it fails with EINTR.)
pub const RESTARTED_WAITS: [i64; 10] = [0, 7, 23, 34, 35, 61, 202, 230, 270, 271];

/// Whether a thread stopped with `raw` registers can call into the C
/// library without meeting a lock it holds itself (malloc's arena, the
/// loader's): blocked in a wait the kernel restarts, or stopped in code
/// outside `runtime` (the C library and the loader). A thread stopped
/// inside `malloc`, or in the `brk` it makes with its arena locked, would
/// wait for itself in the session's first `dlopen`.
pub fn at_safe_point(raw: &Regs, runtime: &[Range<u64>]) -> bool {
    if (raw.orig_rax as i64) >= 0 {
        let restarted = matches!(
            raw.rax as i64,
            ERESTARTSYS | ERESTARTNOINTR | ERESTARTNOHAND | ERESTART_RESTARTBLOCK
        );
        return restarted && RESTARTED_WAITS.contains(&(raw.orig_rax as i64));
    }
    !runtime.iter().any(|r| r.contains(&raw.rip))
}

impl StopPoint {
    pub(super) fn of(raw: &Regs) -> Self {
        if (raw.orig_rax as i64) >= 0 {
            StopPoint::Wait {
                syscall: raw.orig_rax as i64,
            }
        } else {
            StopPoint::Code { ip: raw.rip }
        }
    }
}

/// A seized thread, ready to call functions through the trampoline.
pub struct Session {
    tracee: Tracee,
    /// The thread's own (normalized) state.
    saved: Regs,
    /// Its floating-point and vector state: the trampoline saves and
    /// restores it around each call itself, but a call abandoned (faulted,
    /// timed out) never reaches that restore.
    saved_fp: (u32, Vec<u8>),
    /// The thread's `errno` and where it lives, once [`Self::keep_thread_state`]
    /// read it: the calls' failures set it.
    saved_errno: Option<(u64, [u8; 4])>,
    /// The thread's `dlerror()` state once [`Self::keep_thread_state`] read it.
    saved_dlerror: Option<DlerrorState>,
    code: u64,
    marker_ip: u64,
    /// The data block, below the thread's stack pointer.
    block: u64,
    /// Next free byte of the scratch area (offset in the block).
    scratch: u64,
    /// Where zeros go before each call: the XSAVE area's header (or the
    /// block itself, with FXSAVE).
    fp_header: u64,
    /// The thread's seccomp filters, newest first, where it has some and
    /// they can be read.
    filters: Option<Vec<Vec<Insn>>>,
    /// Where the loader keeps its locks (glibc's).
    loader_locks: Option<LoaderLocks>,
    /// A call that held the loader's lock was left to finish by itself:
    /// the thread is no longer the session's to use or put back.
    left_in_call: bool,
    stopped_at: Instant,
    stopped: StopPoint,
    closed: bool,
}

/// `tid` seized and stopped; `None` where it is in a call the stop would
/// cut short (it is tried again later, as a busy thread is).
fn seize_unless_cut_short(pid: u32, tid: u32) -> Result<Option<Tracee>, InjectError> {
    match Tracee::seize(pid, tid) {
        Ok(t) => Ok(Some(t)),
        Err(InjectError::WouldCutShort { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

impl Session {
    /// Seizes `tid` and writes the trampoline's code at `code` (room found
    /// by [`super::symbols::code_room`] for [`code_len`] bytes). A
    /// [`Refusal`]: the thread was not [at a safe point](at_safe_point), or
    /// its stack holds one of the `hazards`, and it was let go untouched.
    pub fn open(
        pid: u32,
        tid: u32,
        code: u64,
        hazards: &mut Hazards,
    ) -> Result<Result<Self, Refusal>, InjectError> {
        let shstk = crate::procfs::thread_status_field(pid, tid, "x86_Thread_features")
            .is_some_and(|f| f.contains("shstk"));
        if shstk {
            return Err(InjectError::UnsupportedArch {
                what: format!("thread {tid} of pid {pid} runs with a shadow stack (CET)"),
            });
        }
        let fp = trampoline::FpSave::detect();
        let Some(mut tracee) = seize_unless_cut_short(pid, tid)? else {
            return Ok(Err(Refusal::Busy));
        };
        if in_call(&tracee, code, fp)? {
            // A killed ebtrace's call is still under way on this thread:
            // let it finish and restore itself, then start over.
            finish_call(&mut tracee, code, fp)?;
            tracee.detach()?;
            let Some(again) = seize_unless_cut_short(pid, tid)? else {
                return Ok(Err(Refusal::Busy));
            };
            tracee = again;
        }
        let stopped_at = Instant::now();
        let raw = tracee.regs()?;
        if raw.cs != USER_CS_64 {
            return Err(InjectError::UnsupportedArch {
                what: format!("pid {pid} runs 32-bit code"),
            });
        }
        let refusal = if at_safe_point(&raw, &hazards.runtime) {
            hazards.on_stack(&tracee, &raw)
        } else {
            Some(Refusal::Busy)
        };
        if let Some(refusal) = refusal {
            tracee.detach()?;
            return Ok(Err(refusal));
        }
        let filters = match crate::procfs::seccomp_mode(pid) {
            Some(2) => tracee.seccomp_filters(),
            _ => None,
        };
        let marker = match &filters {
            Some(filters) => {
                seccomp::marker_syscall(filters).ok_or(InjectError::SeccompForbids {
                    pid,
                    call: "getpid",
                })?
            }
            None => trampoline::GETPID,
        };
        tracee.set_harmless_syscall(marker);
        let saved = normalize(raw);
        let saved_fp = tracee.fp_state()?;
        let (bytes, marker_end) = trampoline::code(fp, marker);
        tracee.write(code, &bytes)?;
        let block = trampoline::block_at(saved.rsp);
        Ok(Ok(Session {
            fp_header: block - fp.header_below_block(),
            filters,
            tracee,
            saved,
            saved_fp,
            saved_errno: None,
            saved_dlerror: None,
            code,
            marker_ip: code + marker_end,
            block,
            scratch: SCRATCH,
            loader_locks: None,
            left_in_call: false,
            stopped_at,
            stopped: StopPoint::of(&raw),
            closed: false,
        }))
    }

    pub fn pid(&self) -> u32 {
        self.tracee.pid
    }

    /// The thread the calls are made on.
    pub fn tid(&self) -> u32 {
        self.tracee.tid
    }

    /// Where that thread was stopped.
    pub fn stopped(&self) -> StopPoint {
        self.stopped
    }

    /// The thread's seccomp filters, where it has some and they can be
    /// read (see [`Tracee::seccomp_filters`]).
    pub fn seccomp_filters(&self) -> Option<&[Vec<Insn>]> {
        self.filters.as_deref()
    }

    /// Makes the whole scratch area free again (what was put there is used
    /// by one call only).
    pub fn reset_scratch(&mut self) {
        self.scratch = SCRATCH;
    }

    /// Copies `bytes` into the scratch area; returns their address.
    pub fn put(&mut self, bytes: &[u8]) -> Result<u64, InjectError> {
        let at = self.scratch.next_multiple_of(8);
        if at + bytes.len() as u64 > BLOCK_LEN {
            return Err(InjectError::TargetCall {
                pid: self.pid(),
                call: "copy",
                detail: "scratch area full".into(),
            });
        }
        self.scratch = at + bytes.len() as u64;
        self.tracee.write(self.block + at, bytes)?;
        Ok(self.block + at)
    }

    /// A NUL-terminated copy of `s` in the target.
    pub fn put_str(&mut self, s: &str) -> Result<u64, InjectError> {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        self.put(&b)
    }

    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), InjectError> {
        self.tracee.read(addr, buf)
    }

    pub fn read_cstring(&self, addr: u64) -> Result<String, InjectError> {
        self.tracee.read_cstring(addr, 1024)
    }

    /// Has the session tell, at a call's timeout, whether the thread holds
    /// one of the loader's `locks`.
    pub fn watch_loader_locks(&mut self, locks: Option<LoaderLocks>) {
        self.loader_locks = locks;
    }

    /// Calls `f(args)` on the thread; returns its `rax`. A call that has
    /// not returned within [`CALL_TIMEOUT`] waits for something another
    /// thread holds. Where the thread holds none of the loader's locks
    /// (it waits to take one, say, behind a library constructor that never
    /// ends), the call is abandoned where it waits: the thread's own state
    /// is put back when the session closes. Where it holds one (it took
    /// it, and waits for an allocator's lock or a file), pulling it out
    /// would leave the lock held for ever: the call is waited for up to
    /// [`HELD_LOCK_WAIT`], and then left to finish by itself (the
    /// trampoline puts the thread back in its own code). The call ends at
    /// the marker's syscall-entry stop; the next call, or the close, runs
    /// the marker out to its exit before writing registers.
    pub fn call(&mut self, name: &'static str, f: u64, args: &[u64]) -> Result<u64, InjectError> {
        if self.left_in_call {
            return Err(InjectError::ThreadInCall {
                pid: self.pid(),
                tid: self.tid(),
            });
        }
        // The XSAVE header must be zero but for what XSAVE writes: the
        // stack holds anything. One write from there to the block's end.
        let mut bytes = vec![0u8; (self.block - self.fp_header) as usize];
        bytes.extend(trampoline::block(&self.saved, f, args));
        self.tracee.write(self.fp_header, &bytes)?;
        let mut r = self.saved;
        r.rip = self.code;
        r.rsp = self.block;
        r.orig_rax = u64::MAX;
        self.tracee.set_regs(&r)?;
        let began = Instant::now();
        let mut deadline = began + CALL_TIMEOUT;
        loop {
            let Some(stop) = self.tracee.step_until(deadline)? else {
                let holders = self.loader_lock_holders();
                let tid = self.tid();
                if !holders.contains(&tid) {
                    return Err(InjectError::CallTimedOut {
                        pid: self.pid(),
                        call: name,
                        seconds: began.elapsed().as_secs(),
                        lock_holder: holders.first().copied(),
                    });
                }
                if deadline - began < HELD_LOCK_WAIT {
                    log::warn!(
                        "pid {}: {name}() has not returned in {} s, and thread {tid} making it \
                         holds the loader's lock (it waits for an allocator's lock or a file, \
                         say); pulled out now, it would keep that lock for ever, so it is \
                         waited for, up to {} s in all",
                        self.pid(),
                        CALL_TIMEOUT.as_secs(),
                        HELD_LOCK_WAIT.as_secs()
                    );
                    deadline = began + HELD_LOCK_WAIT;
                    continue;
                }
                self.left_in_call = true;
                return Err(InjectError::CallLeftToFinish {
                    pid: self.pid(),
                    tid,
                    call: name,
                    seconds: HELD_LOCK_WAIT.as_secs(),
                });
            };
            match stop {
                Stop::SyscallEntry { ip, .. } if ip == self.marker_ip => break,
                Stop::Signal(
                    sig @ (libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE),
                ) => {
                    // The call faulted: abandon it (the thread's own state
                    // is put back when the session closes).
                    self.tracee.drop_last_signal();
                    return Err(InjectError::TargetCrashed {
                        pid: self.pid(),
                        call: name,
                        signal: sig,
                    });
                }
                _ => {}
            }
        }
        self.tracee.read_u64(self.block + RESULT)
    }

    /// The threads holding one of the loader's locks now; none where they
    /// cannot be told.
    fn loader_lock_holders(&self) -> Vec<u32> {
        let Some(locks) = &self.loader_locks else {
            return Vec::new();
        };
        locks.holders(&self.tracee).unwrap_or_else(|e| {
            log::debug!("pid {}: the loader's locks unreadable: {e}", self.pid());
            Vec::new()
        })
    }

    /// Notes the thread's `errno` (`errno_location` is the target's
    /// `__errno_location`), to put it back when the session closes; and
    /// its `dlerror()` state, `dlerror_from_errno` bytes from its `errno`
    /// (see [`DlerrorState`]).
    pub fn keep_thread_state(
        &mut self,
        errno_location: u64,
        dlerror_from_errno: Option<i64>,
    ) -> Result<(), InjectError> {
        let at = self.call("__errno_location", errno_location, &[])?;
        let mut value = [0u8; 4];
        self.tracee.read(at, &mut value)?;
        self.saved_errno = Some((at, value));
        if let Some(distance) = dlerror_from_errno {
            let slot = at.wrapping_add_signed(distance);
            self.saved_dlerror = Some(DlerrorState::keep(&self.tracee, slot)?);
        }
        Ok(())
    }

    /// Puts the thread's registers back and lets it go, straight to its own
    /// code (not through the trampoline's restore, which is for an ebtrace
    /// that died: a thread seized again in there would look like one in a
    /// call); returns how long it was kept from its own code.
    pub fn close(mut self) -> Result<Duration, InjectError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<Duration, InjectError> {
        self.closed = true;
        let left_in_call = self.left_in_call;
        let errno = match self.saved_errno {
            Some((at, value)) => self.tracee.write(at, &value),
            None => Ok(()),
        };
        let dlerror = match &self.saved_dlerror {
            Some(state) => state.put_back(&self.tracee),
            None => Ok(()),
        };
        // A call left to finish puts the registers back by itself; the
        // errno and `dlerror()` state put back now are the program's unless
        // that call, once it ends, fails and sets its own.
        let restored = errno.and(dlerror).and_then(|()| match left_in_call {
            true => Ok(()),
            false => self
                .tracee
                .set_fp_state(&self.saved_fp)
                .and_then(|()| self.tracee.set_regs(&self.saved)),
        });
        let diverted = self.stopped_at.elapsed();
        self.tracee.detach().and(restored).map(|()| diverted)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.finish();
        }
    }
}

/// A thread's `dlerror()` state in glibc 2.34+: a thread-local pointer to
/// the result of its last `dl*` call that failed, which the next call frees
/// (with the message `dlerror()` may have handed the program). The program
/// may hold an error it has not read yet, or that message: the session's
/// own calls must neither lose the one nor free the other. So the pointer
/// is cleared before the calls, which then find no result to free, and set
/// again after them. An ebtrace killed in between leaves the thread with
/// no error to report and the result unfreed, never a freed one in use.
struct DlerrorState {
    /// The thread-local pointer, and its value.
    slot: u64,
    result: u64,
}

impl DlerrorState {
    fn keep(tracee: &Tracee, slot: u64) -> Result<Self, InjectError> {
        let result = tracee.read_u64(slot)?;
        if result != 0 {
            tracee.write(slot, &0u64.to_le_bytes())?;
        }
        Ok(DlerrorState { slot, result })
    }

    fn put_back(&self, tracee: &Tracee) -> Result<(), InjectError> {
        tracee.write(self.slot, &self.result.to_le_bytes())
    }
}

/// How far above the stack pointer a call under way is looked for.
const CALL_SCAN: u64 = 128 * 1024;

/// Whether the thread is inside a trampoline call (made by an ebtrace that
/// died since): its stack holds the call's return address, below a block
/// with a user-mode `iretq` frame.
fn in_call(t: &Tracee, code: u64, fp: trampoline::FpSave) -> Result<bool, InjectError> {
    let ret = (code + trampoline::call_return(fp)).to_le_bytes();
    let rsp = t.regs()?.rsp;
    let mut page = vec![0u8; 4096];
    let mut at = rsp & !7;
    while at < rsp + CALL_SCAN {
        let len = (4096 - (at % 4096)) as usize;
        if t.read(at, &mut page[..len]).is_err() {
            break;
        }
        for (i, word) in page[..len].chunks_exact(8).enumerate() {
            if word != ret {
                continue;
            }
            let block = at + 8 * i as u64 + trampoline::return_slot_below_block(fp);
            let (mut cs, mut ss) = ([0u8; 8], [0u8; 8]);
            let framed = t.read(block + trampoline::IRET_CS, &mut cs).is_ok()
                && t.read(block + trampoline::IRET_SS, &mut ss).is_ok();
            if framed && u64::from_le_bytes(cs) == USER_CS_64 && u64::from_le_bytes(ss) == USER_SS {
                return Ok(true);
            }
        }
        at += len as u64;
    }
    Ok(false)
}

/// Lets a call under way reach the trampoline's marker.
fn finish_call(t: &mut Tracee, code: u64, fp: trampoline::FpSave) -> Result<(), InjectError> {
    let marker = code + trampoline::code(fp, trampoline::GETPID).1;
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(10) {
        if let Stop::SyscallEntry { ip, .. } = t.step()?
            && ip == marker
        {
            return Ok(());
        }
    }
    Err(InjectError::TargetCall {
        pid: t.pid,
        call: "a call an earlier ebtrace left under way",
        detail: format!("thread {} has not finished it in 10 s", t.tid),
    })
}

/// Length of the trampoline's code on this CPU.
pub fn code_len() -> u64 {
    trampoline::code(trampoline::FpSave::detect(), trampoline::GETPID)
        .0
        .len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regs(orig_rax: u64, rax: i64) -> Regs {
        // SAFETY: plain integers.
        let mut r: Regs = unsafe { std::mem::zeroed() };
        r.orig_rax = orig_rax;
        r.rax = rax as u64;
        r.rip = 0x1002;
        r
    }

    #[test]
    fn normalize_replays_what_the_kernel_restarts() {
        for code in [ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND] {
            let n = normalize(regs(0, code));
            assert_eq!((n.rip, n.rax, n.orig_rax), (0x1000, 0, u64::MAX));
        }
        let n = normalize(regs(230, ERESTART_RESTARTBLOCK));
        assert_eq!((n.rip, n.rax), (0x1000, SYS_RESTART_SYSCALL));
        // A finished syscall keeps its result; EINTR is the program's.
        let n = normalize(regs(0, 17));
        assert_eq!((n.rip, n.rax, n.orig_rax), (0x1002, 17, u64::MAX));
        let n = normalize(regs(232, -4));
        assert_eq!((n.rip, n.rax), (0x1002, -4i64 as u64));
        // Not in a syscall: only orig_rax (already -1) is set.
        let n = normalize(regs(u64::MAX, ERESTARTSYS));
        assert_eq!((n.rip, n.rax), (0x1002, ERESTARTSYS as u64));
    }

    #[test]
    fn only_restarted_waits_and_code_outside_the_c_library_are_safe() {
        let libc = [0x1000..0x2000, 0x8000..0x9000];
        // Blocked in futex, read, nanosleep: the kernel restarts them.
        assert!(at_safe_point(&regs(202, ERESTARTSYS), &libc));
        assert!(at_safe_point(&regs(0, ERESTARTSYS), &libc));
        assert!(at_safe_point(&regs(35, ERESTART_RESTARTBLOCK), &libc));
        // In malloc's brk, its arena locked; a finished read; epoll_wait,
        // which fails with EINTR.
        assert!(!at_safe_point(&regs(12, 0x5555_0000), &libc));
        assert!(!at_safe_point(&regs(0, 4), &libc));
        assert!(!at_safe_point(&regs(232, ERESTARTNOHAND), &libc));
        // Running: in the C library (0x1002) or in the program's code.
        assert!(!at_safe_point(&regs(u64::MAX, 0), &libc));
        let mut outside = regs(u64::MAX, 0);
        outside.rip = 0x4000;
        assert!(at_safe_point(&outside, &libc));
    }
}
