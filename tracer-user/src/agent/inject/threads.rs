//! Each thread's `pthread_self()`, which names it in a framework's own
//! trace (TSL hashes it into its thread ids: see `timeline::framework`).

use std::collections::HashMap;

use super::{InjectError, ptrace::Tracee};

/// Reads the thread pointer (`fs_base`, which glibc's `pthread_self()`
/// returns) of every thread of `pid` but the agent's and those `known`
/// says are read already, stopping one thread at a time for a few
/// microseconds. Threads that end meanwhile are skipped, and so are those
/// asleep where no signal reaches them (state D), which would not stop,
/// and those in a call the stop would cut short
/// ([`InjectError::WouldCutShort`]): they are read once out of it.
pub fn thread_pointers(
    pid: u32,
    known: impl Fn(u32) -> bool,
) -> Result<HashMap<u32, u64>, InjectError> {
    let mut found = HashMap::new();
    for tid in super::program_threads(pid)?
        .into_iter()
        .filter(|t| !known(*t) && crate::procfs::thread_state(pid, *t) != Some('D'))
    {
        let mut thread = match Tracee::seize(pid, tid) {
            Ok(t) => t,
            Err(InjectError::TargetExited { .. }) => return Err(InjectError::TargetExited { pid }),
            Err(e @ InjectError::NotPermitted { .. }) => return Err(e),
            // The thread ended in between, or is in a call the stop would
            // cut short.
            Err(_) => continue,
        };
        if let Ok(regs) = thread.regs() {
            found.insert(tid, regs.fs_base);
        }
        thread.detach()?;
    }
    Ok(found)
}
