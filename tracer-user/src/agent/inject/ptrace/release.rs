//! Letting a seized thread go, with the signals that arrived while it was
//! held delivered again as they came.

use std::time::{Duration, Instant};

use super::{InjectError, PTRACE_INTERRUPT, SigInfo, Tracee, ptrace};

/// How long the signals held back get to be taken by the thread again.
const REDELIVERY_WAIT: Duration = Duration::from_millis(200);
/// The first real-time signal as the kernel counts (glibc keeps 32 and 33).
const SIGRTMIN: i32 = 32;
const PTRACE_DETACH: libc::c_long = 17;
const PTRACE_CONT: libc::c_long = 7;
const PTRACE_SETSIGINFO: libc::c_long = 0x4203;

impl Tracee {
    /// Lets the thread go with the state it is in, delivering the signals
    /// that arrived meanwhile as they came: each is queued again and, at
    /// the stop where the thread takes it, given back its own `siginfo_t`
    /// (its sender and code: glibc's `setxid` handshake, for one, acts
    /// only on a signal its own process sent).
    pub fn detach(&mut self) -> Result<(), InjectError> {
        if !self.attached {
            return Ok(());
        }
        let mut pending = std::mem::take(&mut self.pending);
        // A standard signal pending twice is taken once.
        let mut seen = Vec::new();
        pending.retain(|(sig, _)| {
            *sig >= SIGRTMIN
                || !seen.contains(sig) && {
                    seen.push(*sig);
                    true
                }
        });
        if let Some(held) = self.pass_on.take() {
            pending.insert(0, held);
        }
        let last = self.redeliver(&mut pending);
        self.attached = false;
        ptrace(PTRACE_DETACH, self.tid, 0, last as u64)
            .map(drop)
            .map_err(|e| self.ptrace_error("detach", e))
    }

    /// Delivers all of `pending` but the last, which the caller delivers as
    /// it detaches (0: none left, or the thread never took them within
    /// [`REDELIVERY_WAIT`]: then they are pending still, as sent again).
    fn redeliver(&mut self, pending: &mut Vec<(i32, SigInfo)>) -> i32 {
        for (sig, _) in pending.iter() {
            // SAFETY: sends a signal to the thread that received it first.
            unsafe {
                libc::syscall(
                    libc::SYS_tgkill,
                    self.pid as libc::c_long,
                    self.tid as libc::c_long,
                    *sig as libc::c_long,
                )
            };
        }
        let deadline = Instant::now() + REDELIVERY_WAIT;
        let mut deliver = 0;
        while !pending.is_empty() {
            if ptrace(PTRACE_CONT, self.tid, 0, deliver as u64).is_err() {
                return 0;
            }
            deliver = 0;
            let stop = loop {
                match self.stopped_now() {
                    Ok(true) => break Some(self.status.take().unwrap_or(0)),
                    Ok(false) if Instant::now() < deadline => std::thread::yield_now(),
                    _ => break None,
                }
            };
            let Some(status) = stop else {
                // Not taken in time: hold the thread again to let it go.
                if self.request(PTRACE_INTERRUPT, 0, 0, "interrupt").is_ok() {
                    let _ = self.wait();
                }
                self.pending.clear();
                return 0;
            };
            if !libc::WIFSTOPPED(status) {
                return 0;
            }
            let sig = libc::WSTOPSIG(status);
            if status >> 16 != 0 || sig == libc::SIGTRAP | 0x80 {
                continue;
            }
            deliver = sig;
            if let Some(at) = pending.iter().position(|(s, _)| *s == sig) {
                let (_, mut info) = pending.remove(at);
                let _ = ptrace(PTRACE_SETSIGINFO, self.tid, 0, info.as_mut_ptr() as u64);
            }
            if pending.is_empty() {
                return deliver;
            }
        }
        deliver
    }
}
