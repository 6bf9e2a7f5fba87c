//! How many TraceMe events ebtrace's captures have left queued in each
//! process, over all of them. On the uprobe route the framework's recorder
//! keeps every event it records, in the process's memory, until a profiler
//! session of the process's own drains it; nothing ebtrace does frees it.
//! So `--max-events` bounds what all captures of one process instance leave
//! there together, across windows, `ebtrace serve` captures and separate
//! ebtrace runs: the count lives in a file under
//! [`MARKER_DIR`](super::switch::MARKER_DIR) named after the process
//! instance, removed once that instance is gone.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
};

use crate::procfs::start_time_ticks;

const PREFIX: &str = "traceme-left-";

fn path(dir: &Path, pid: u32, started: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{pid}-{started}"))
}

/// Events ebtrace left in `pid` (this instance of it) so far.
pub fn read(dir: &Path, pid: u32) -> u64 {
    let Some(started) = start_time_ticks(pid) else {
        return 0;
    };
    fs::read_to_string(path(dir, pid, started))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// Adds `events` to what ebtrace left in `pid`. A count that cannot be
/// written is lost: the next capture then bounds only its own events.
pub fn add(dir: &Path, pid: u32, events: u64) {
    let Some(started) = start_time_ticks(pid) else {
        return;
    };
    if events == 0 {
        return;
    }
    let total = read(dir, pid).saturating_add(events);
    let target = path(dir, pid, started);
    let temporary = dir.join(format!("{PREFIX}{pid}-{started}.{}", std::process::id()));
    let written = fs::create_dir_all(dir).and_then(|()| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temporary)?;
        writeln!(f, "{total}")?;
        fs::rename(&temporary, &target)
    });
    if let Err(e) = written {
        let _ = fs::remove_file(&temporary);
        log::warn!(
            "pid {pid}: cannot note the TraceMe events left in it ({}: {e})",
            target.display()
        );
    }
}

/// Whether `name` is a count of this module's whose process instance is
/// gone (or a temporary one left by an ebtrace that died writing it).
pub fn is_stale(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(PREFIX) else {
        return false;
    };
    if rest.contains('.') {
        let owner = rest.rsplit('.').next().and_then(|p| p.parse::<u32>().ok());
        return owner.is_none_or(|p| !crate::procfs::is_alive(p));
    }
    let Some((pid, started)) = rest.split_once('-') else {
        return true;
    };
    match (pid.parse::<u32>(), started.parse::<u64>()) {
        (Ok(pid), Ok(started)) => start_time_ticks(pid) != Some(started),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_process_instance_and_go_with_it() {
        let dir = std::env::temp_dir().join(format!("ebtrace-left-{}", std::process::id()));
        let me = std::process::id();
        assert_eq!(read(&dir, me), 0);
        add(&dir, me, 700);
        add(&dir, me, 300);
        assert_eq!(read(&dir, me), 1000);
        let started = start_time_ticks(me).unwrap();
        let name = format!("{PREFIX}{me}-{started}");
        assert!(!is_stale(&name));
        // Another instance of the same pid, and a malformed name.
        assert!(is_stale(&format!("{PREFIX}{me}-{}", started + 1)));
        assert!(is_stale(&format!("{PREFIX}{me}")));
        assert!(!is_stale("traceme-1-2-3"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
