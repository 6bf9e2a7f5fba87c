//! One session with a target: a seized thread, its interrupted state made
//! resumable, and the trampoline through which it calls functions.

use std::time::{Duration, Instant};

use super::{
    InjectError,
    ptrace::{Regs, Stop, Tracee},
    symbols::TargetFns,
    trampoline::{self, ARGS, FN, MAPPING_LEN, RESULT, SAVED, SCRATCH, SCRATCH_LEN},
};

const SYS_MMAP: u64 = 9;
const SYS_MPROTECT: u64 = 10;
const SYS_MUNMAP: u64 = 11;
const SYS_RESTART_SYSCALL: u64 = 219;
const ERESTARTSYS: i64 = -512;
const ERESTARTNOINTR: i64 = -513;
const ERESTARTNOHAND: i64 = -514;
const ERESTART_RESTARTBLOCK: i64 = -516;
/// The `cs` of 64-bit user code.
const USER_CS_64: u64 = 0x33;

/// The state the kernel would resume the thread at: an interrupted
/// syscall that the kernel restarts is set up to be issued again
/// (`rip` back on its `syscall`, `rax` its number), as the kernel's own
/// restart logic does, so that it is replayed rather than failing with
/// EINTR. `orig_rax` is -1: the state is plain user state.
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

/// A seized thread with the trampoline mapped in its process.
pub struct Session {
    tracee: Tracee,
    /// The thread's own (normalized) state.
    saved: Regs,
    syscall_insn: u64,
    base: u64,
    marker_ip: u64,
    /// Next free byte of the scratch area.
    scratch: u64,
    stopped_at: Instant,
    closed: bool,
}

fn failed(pid: u32, call: &'static str, detail: impl Into<String>) -> InjectError {
    InjectError::TargetCall {
        pid,
        call,
        detail: detail.into(),
    }
}

impl Session {
    /// Seizes `tid`, maps the trampoline and writes it.
    pub fn open(pid: u32, tid: u32, fns: &TargetFns) -> Result<Self, InjectError> {
        let tracee = Tracee::seize(pid, tid)?;
        let stopped_at = Instant::now();
        let raw = tracee.regs()?;
        if raw.cs != USER_CS_64 {
            return Err(InjectError::UnsupportedArch {
                what: format!("pid {pid} runs 32-bit code"),
            });
        }
        let saved = normalize(raw);
        // The thread's own `syscall` if it was stopped in one, else libc's.
        let mut syscall_insn = fns.syscall_insn;
        if (raw.orig_rax as i64) >= 0 {
            let mut b = [0u8; 2];
            if tracee.read(raw.rip - 2, &mut b).is_ok() && b == [0x0f, 0x05] {
                syscall_insn = raw.rip - 2;
            }
        }
        let mut session = Session {
            tracee,
            saved,
            syscall_insn,
            base: 0,
            marker_ip: 0,
            scratch: SCRATCH,
            stopped_at,
            closed: false,
        };
        let prot_rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let base = session.bootstrap(SYS_MMAP, &[0, MAPPING_LEN, prot_rw, flags, u64::MAX, 0])?;
        if base < 0 {
            return Err(failed(
                pid,
                "mmap",
                std::io::Error::from_raw_os_error(-base as i32).to_string(),
            ));
        }
        session.base = base as u64;
        let prot_rx = (libc::PROT_READ | libc::PROT_EXEC) as u64;
        let r = session.bootstrap(SYS_MPROTECT, &[session.base, trampoline::CODE_LEN, prot_rx])?;
        if r < 0 {
            return Err(failed(
                pid,
                "mprotect",
                std::io::Error::from_raw_os_error(-r as i32).to_string(),
            ));
        }
        let (code, marker_end) = trampoline::code(trampoline::FpSave::detect());
        session.marker_ip = session.base + marker_end;
        let t = &session.tracee;
        t.write(session.base, &code)?;
        t.write(session.base + SAVED, &trampoline::saved_block(&saved))?;
        Ok(session)
    }

    pub fn pid(&self) -> u32 {
        self.tracee.pid
    }

    fn bootstrap(&mut self, nr: u64, args: &[u64]) -> Result<i64, InjectError> {
        self.tracee
            .raw_syscall(&self.saved, self.syscall_insn, nr, args)
    }

    /// Copies `bytes` into the scratch area; returns their address.
    pub fn put(&mut self, bytes: &[u8]) -> Result<u64, InjectError> {
        let at = self.scratch.next_multiple_of(8);
        if at + bytes.len() as u64 > SCRATCH + SCRATCH_LEN {
            return Err(failed(self.pid(), "copy", "scratch area full"));
        }
        self.scratch = at + bytes.len() as u64;
        self.tracee.write(self.base + at, bytes)?;
        Ok(self.base + at)
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

    /// Calls `f(args)` on the thread; returns its `rax`.
    pub fn call(&mut self, name: &'static str, f: u64, args: &[u64]) -> Result<u64, InjectError> {
        let mut block = [0u64; 8];
        block[0] = f;
        block[1..1 + args.len()].copy_from_slice(args);
        let bytes: Vec<u8> = block.iter().flat_map(|v| v.to_le_bytes()).collect();
        debug_assert_eq!(ARGS - FN, 8);
        debug_assert_eq!(RESULT - FN, 56);
        self.tracee.write(self.base + FN, &bytes)?;
        let mut r = self.saved;
        r.rip = self.base;
        // Below the red zone, 16-byte aligned: the trampoline's `call`
        // then gives the callee the frame alignment the ABI promises.
        r.rsp = (self.saved.rsp - 256) & !15;
        r.orig_rax = u64::MAX;
        self.tracee.set_regs(&r)?;
        loop {
            match self.tracee.step()? {
                Stop::SyscallEntry { ip, .. } if ip == self.marker_ip => break,
                Stop::Signal(
                    sig @ (libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE),
                ) => {
                    // The call faulted: abandon it (the thread's own state is
                    // put back when the session closes).
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
        self.tracee.read_u64(self.base + RESULT)
    }

    /// Puts the thread's state back, unmaps the trampoline and lets the
    /// thread go; returns how long it was kept from its own code.
    pub fn close(mut self) -> Result<Duration, InjectError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<Duration, InjectError> {
        self.closed = true;
        let mut result = self.tracee.set_regs(&self.saved);
        if result.is_ok() && self.base != 0 {
            let unmapped = self.bootstrap(SYS_MUNMAP, &[self.base, MAPPING_LEN]);
            // The thread's own state again, whatever munmap did.
            result = self.tracee.set_regs(&self.saved).and(unmapped.map(|r| {
                if r < 0 {
                    log::warn!("pid {}: unmapping the trampoline failed ({r})", self.pid());
                }
            }));
        }
        let diverted = self.stopped_at.elapsed();
        self.tracee.detach().and(result).map(|()| diverted)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.finish();
        }
    }
}
