//! One ebtrace at a time in a target. A second ebtrace's load would take
//! the first one's live agent for a killed ebtrace's leftover and unload
//! it mid-capture, or close its memfd mid-load. So each ebtrace holds a
//! lock named after the target (its pid and start time: a reused pid is
//! another process) from before its load until after its unload; the
//! kernel drops it with the ebtrace that held it, killed or not, and the
//! next one then takes that one's leftovers out.

use std::{
    fs::{self, File, OpenOptions},
    io::{Read as _, Seek as _, Write as _},
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _},
    path::PathBuf,
};

use rustix::fs::FlockOperation;

use super::InjectError;
use crate::procfs;

/// Where the locks are, beside ebtrace's other markers: a host directory
/// that the DaemonSet mounts, so that the node's ebtraces see each other's.
const LOCK_DIR: &str = "/run/ebtrace/agents";
/// How often the lock is taken again when the file was replaced meanwhile.
const TRIES: usize = 4;

/// A target's lock, held; the file goes when it is dropped.
#[derive(Debug)]
pub struct TargetLock {
    /// Open, and locked, for as long as the lock is held.
    file: File,
    path: PathBuf,
}

impl TargetLock {
    /// Takes `pid`'s lock. `None` where locks cannot be kept (no
    /// `/run/ebtrace` can be made: ebtrace is not root); another ebtrace
    /// holding it is [`InjectError::AnotherEbtrace`].
    pub fn take(pid: u32) -> Result<Option<Self>, InjectError> {
        let start = procfs::start_time_ticks(pid).ok_or(InjectError::NoSuchProcess { pid })?;
        if let Err(e) = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(LOCK_DIR)
        {
            log::debug!("pid {pid}: no lock against other ebtraces ({LOCK_DIR}: {e})");
            return Ok(None);
        }
        let path = PathBuf::from(LOCK_DIR).join(format!("{pid}-{start}"));
        for _ in 0..TRIES {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| io_err(&path, e))?;
            if rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(InjectError::AnotherEbtrace {
                    pid,
                    holder: holder.trim().parse().ok(),
                });
            }
            // The holder before may have removed the file between our open
            // and our lock: then the lock is on a file no one else sees.
            let same = fs::metadata(&path)
                .is_ok_and(|m| file.metadata().is_ok_and(|f| f.ino() == m.ino()));
            if !same {
                continue;
            }
            file.set_len(0).map_err(|e| io_err(&path, e))?;
            file.rewind().map_err(|e| io_err(&path, e))?;
            file.write_all(std::process::id().to_string().as_bytes())
                .map_err(|e| io_err(&path, e))?;
            return Ok(Some(TargetLock { file, path }));
        }
        Err(io_err(
            &path,
            std::io::Error::other("replaced each time it was locked"),
        ))
    }
}

impl Drop for TargetLock {
    fn drop(&mut self) {
        // Removed while held, then let go: whoever opens the name next
        // makes a new file.
        let _ = fs::remove_file(&self.path);
        let _ = rustix::fs::flock(&self.file, FlockOperation::Unlock);
    }
}

fn io_err(path: &std::path::Path, source: std::io::Error) -> InjectError {
    InjectError::Io {
        context: format!("the lock {}", path.display()),
        source,
    }
}
