//! The marker files that say which ebtrace switched a gate on, and the
//! sweep at every start that restores the gates of ebtraces that died.

use std::{
    fs::{self, OpenOptions},
    io::{self, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::Path,
};

use super::{super::cell::Cell, DISABLED};
use crate::procfs::start_time_ticks;

/// Who switched a cell on, as recorded in a marker file: enough for any
/// later ebtrace to restore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Marker {
    pub owner_pid: u32,
    pub owner_start: u64,
    /// The on value written.
    pub level: i64,
    /// The value to put back.
    pub off: i64,
    pub width: u8,
}

impl Marker {
    /// The marker file's text.
    pub(super) fn render(&self) -> String {
        format!(
            "owner_pid {}\nowner_start {}\nlevel {}\noff {}\nwidth {}\n",
            self.owner_pid, self.owner_start, self.level, self.off, self.width
        )
    }

    /// A marker file's text read back; `None` if it is not one.
    pub(super) fn parse(text: &str) -> Option<Marker> {
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .map(str::trim)
        };
        let width: u8 = field("width").map_or(Some(4), |w| w.parse().ok())?;
        Some(Marker {
            owner_pid: field("owner_pid")?.parse().ok()?,
            owner_start: field("owner_start")?.parse().ok()?,
            level: field("level")?.parse().ok()?,
            // Markers of older ebtraces name only g_trace_level.
            off: field("off").map_or(Some(i64::from(DISABLED)), |o| o.parse().ok())?,
            width: matches!(width, 1 | 4).then_some(width)?,
        })
    }

    /// This ebtrace's marker for writing `level` over `off` into a cell of
    /// `width` bytes; `None` if its own start time cannot be read.
    pub(super) fn mine(level: i64, off: i64, width: u8) -> Option<Marker> {
        let me = std::process::id();
        Some(Marker {
            owner_pid: me,
            owner_start: start_time_ticks(me)?,
            level,
            off,
            width,
        })
    }

    /// Whether the ebtrace that wrote it is another one, still running.
    pub(super) fn owner_alive(&self) -> bool {
        self.owner_pid != std::process::id()
            && start_time_ticks(self.owner_pid) == Some(self.owner_start)
    }
}

/// A marker file's name: `traceme-<pid>-<start ticks>-<address hex>`.
pub(super) fn marker_name(pid: u32, started: u64, address: u64) -> String {
    format!("traceme-{pid}-{started}-{address:x}")
}

/// The pid, start ticks and address a marker file's name says.
pub(super) fn parse_marker_name(name: &str) -> Option<(u32, u64, u64)> {
    let mut fields = name.strip_prefix("traceme-")?.split('-');
    let pid = fields.next()?.parse().ok()?;
    let started = fields.next()?.parse().ok()?;
    let address = u64::from_str_radix(fields.next()?, 16).ok()?;
    fields.next().is_none().then_some((pid, started, address))
}

/// Cleans up after ebtraces that died: removes the markers of processes
/// that no longer exist, and for a live target whose marker's owner is
/// gone, puts the off value back if the cell still holds what that owner
/// wrote. A cell that moved on since (a session of the target's own) and a
/// pid reused by another process are left alone. Returns one line per
/// cell restored. Runs at every ebtrace start.
pub fn sweep_markers(dir: &Path) -> Vec<String> {
    let mut restored = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return restored;
    };
    // Python gates (one byte) before levels, as ebtrace itself restores.
    let mut entries: Vec<fs::DirEntry> = entries.flatten().collect();
    entries.sort_by_key(|e| {
        fs::read_to_string(e.path())
            .ok()
            .and_then(|t| Marker::parse(&t))
            .map_or(0, |m| m.width)
    });
    for entry in entries {
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(crate::attach::traceme::left_behind::is_stale)
        {
            let _ = fs::remove_file(entry.path());
            continue;
        }
        let Some((pid, started, address)) = name.to_str().and_then(parse_marker_name) else {
            continue;
        };
        if start_time_ticks(pid) != Some(started) {
            let _ = fs::remove_file(entry.path());
            continue;
        }
        let Some(marker) = fs::read_to_string(entry.path())
            .ok()
            .and_then(|t| Marker::parse(&t))
        else {
            continue;
        };
        if marker.owner_pid == std::process::id() || marker.owner_alive() {
            continue;
        }
        let cell = Cell {
            pid,
            address,
            width: marker.width,
        };
        if cell.read().ok() == Some(marker.level) && cell.write(marker.off).is_ok() {
            restored.push(format!(
                "pid {pid}: TraceMe gate at {address:#x} left at {} by an ebtrace that died \
                 (pid {}); put back to {}",
                marker.level, marker.owner_pid, marker.off
            ));
        }
        let _ = fs::remove_file(entry.path());
    }
    restored
}

/// Creates `path` holding `marker`; false if it already exists.
pub(super) fn create_marker(path: &Path, marker: &Marker) -> io::Result<bool> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(mut f) => {
            f.write_all(marker.render().as_bytes())?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Replaces `path` with `marker` atomically.
pub(super) fn replace_marker(path: &Path, marker: &Marker) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, marker.render())?;
    fs::rename(&tmp, path)
}
