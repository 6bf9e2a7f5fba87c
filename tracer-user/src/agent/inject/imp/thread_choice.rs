//! Which thread of the target makes the calls: one stopped at a safe
//! point, tried again and again for a few seconds; none of a target that
//! cannot run.

use std::time::{Duration, Instant};

use super::super::{
    InjectError,
    hazards::{Hazards, Refusals},
    loader_lock::LoaderLocks,
    session::{RESTARTED_WAITS, Session, code_len},
    symbols,
};
use crate::procfs;

const SYS_FUTEX: i64 = 202;

/// How long a session waits for a thread of the target to stop at a safe
/// point (see [`super::super::session::at_safe_point`]).
const SAFE_POINT_WAIT: Duration = Duration::from_secs(3);
/// The threads to make the calls on, in the order to try them: blocked in
/// a syscall the kernel restarts, then waiting on a futex, then running;
/// never one of the agent's, nor one in another syscall (stopping it could
/// end that syscall with EINTR), nor one asleep where no signal reaches it
/// (state D: it would not stop for ptrace).
fn candidate_threads(pid: u32) -> Result<Vec<u32>, InjectError> {
    let mut ranked: Vec<(u8, u32)> = Vec::new();
    for tid in super::super::program_threads(pid)? {
        if procfs::thread_state(pid, tid) == Some('D') {
            continue;
        }
        let tier = match procfs::thread_syscall_number(pid, tid) {
            Some(SYS_FUTEX) => 1,
            Some(nr) if RESTARTED_WAITS.contains(&nr) => 0,
            // In user code: preempted, or running now.
            Some(-1) => 2,
            _ => continue,
        };
        ranked.push((tier, tid));
    }
    ranked.sort_unstable();
    Ok(ranked.into_iter().map(|(_, tid)| tid).collect())
}

/// A session on the first thread found at a safe point, the candidates
/// tried again and again for up to [`SAFE_POINT_WAIT`].
pub(super) fn open_session(pid: u32) -> Result<Session, InjectError> {
    refuse_a_target_that_cannot_run(pid)?;
    let code = symbols::code_room(pid, code_len())?;
    let mut hazards = Hazards::of(pid)?;
    let loader_locks = LoaderLocks::of(pid);
    let began = Instant::now();
    let mut tries = 0;
    let mut refusals = Refusals::default();
    loop {
        for tid in candidate_threads(pid)? {
            tries += 1;
            match Session::open(pid, tid, code, &mut hazards) {
                Ok(Ok(mut session)) => {
                    session.watch_loader_locks(loader_locks);
                    return Ok(session);
                }
                Ok(Err(refusal)) => refusals.count(refusal),
                // The thread ended in between.
                Err(_) if thread_gone(pid, tid) => {}
                Err(e) => return Err(e),
            }
        }
        if !procfs::is_alive(pid) {
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

/// A stopped process, or one in a frozen cgroup, runs none of the calls
/// until it is continued: the load would wait for it, and its agent's
/// thread would join the stop.
fn refuse_a_target_that_cannot_run(pid: u32) -> Result<(), InjectError> {
    if let Some(cgroup) = procfs::frozen_cgroup(pid) {
        return Err(InjectError::TargetFrozen { pid, cgroup });
    }
    let stopped = super::super::program_threads(pid)?
        .into_iter()
        .any(|tid| procfs::thread_state(pid, tid) == Some('T'));
    if stopped {
        return Err(InjectError::TargetStopped { pid });
    }
    Ok(())
}

fn thread_gone(pid: u32, tid: u32) -> bool {
    procfs::is_alive(pid) && !procfs::thread_is_listed(pid, tid)
}
