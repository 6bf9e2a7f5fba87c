//! Agents that a killed ebtrace left loaded in a target (found by their
//! memfds), taken out before the next load.

use super::super::{InjectError, calls::Calls, lock::TargetLock, symbols};
use super::{await_agent_thread_end, call_exit, io_err, is_agent_copy, open_session};
use crate::procfs;

/// Most references to one leftover library that killed ebtraces can have
/// left (each killed between its own `RTLD_NOLOAD` and `dlclose`).
const MAX_LEFTOVER_REFS: usize = 64;

/// Takes out the library a killed ebtrace left loaded from memfd `fd`:
/// `exit()`, then `dlclose` until it is gone; closes the memfd. Returns
/// whether a library was loaded.
pub(super) fn unload_leftover(c: &mut Calls, fd: i32, exit: &str) -> Result<bool, InjectError> {
    // A spelling no object is loaded by (see [`unused_path`]): the loader
    // then finds the leftover by the file the descriptor holds.
    let path = format!("/proc/self//fd/{fd}");
    let noload = libc::RTLD_NOW | libc::RTLD_NOLOAD;
    let handle = c.dlopen(&path, noload)?;
    if handle != 0 {
        call_exit(c, handle, exit)?;
        // Our RTLD_NOLOAD reference.
        c.dlclose(handle)?;
        for _ in 0..MAX_LEFTOVER_REFS {
            // One the dead ebtrace left (none left: a pinned copy, which
            // stays); then, is it gone?
            if !c.dlclose(handle)? || c.dlopen(&path, noload)? == 0 {
                break;
            }
            c.dlclose(handle)?;
        }
    }
    c.close(fd)?;
    Ok(handle != 0)
}

/// Descriptors of `pid` that hold an agent's memfd.
pub(super) fn leftover_fds(pid: u32) -> Result<Vec<i32>, InjectError> {
    let targets = procfs::descriptor_targets(pid).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InjectError::NoSuchProcess { pid },
        _ => io_err(format!("listing /proc/{pid}/fd"), e),
    })?;
    let mut fds: Vec<i32> = targets
        .into_iter()
        .filter(|(_, target)| {
            target
                .to_str()
                .and_then(|l| l.strip_suffix(" (deleted)"))
                .is_some_and(is_agent_copy)
        })
        .map(|(fd, _)| fd)
        .collect();
    fds.sort_unstable();
    Ok(fds)
}

pub fn unload_leftovers(pid: u32, exit: &str) -> Result<usize, InjectError> {
    let _lock = TargetLock::take(pid)?;
    unload_leftovers_locked(pid, exit)
}

/// [`unload_leftovers`] by an ebtrace that holds the target's lock: what
/// is loaded now is no live ebtrace's.
pub(super) fn unload_leftovers_locked(pid: u32, exit: &str) -> Result<usize, InjectError> {
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
