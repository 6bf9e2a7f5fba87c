//! Switching TraceMe recording on in a process from outside, and off again.
//!
//! TraceMe records only while `g_trace_level >= level` of the TraceMe. With
//! no profiler session in the process the gate is -1 and `Record` is never
//! called. ebtrace then writes the requested level (ProfileOptions'
//! `host_tracer_level`) through `/proc/PID/mem` and puts -1 back when the
//! capture ends: at its normal end, on Ctrl-C or SIGTERM, on an error and
//! on a panic (`Drop`). A session already running in the process (level
//! >= 0) is left alone: ebtrace only observes what it records.
//!
//! What enabling costs the target: its recorder queues every event in
//! per-thread memory until a session of its own drains it (TSL's
//! `TraceMeRecorder::Stop`); nothing else does. That memory is held until
//! the next in-process session, so the caller bounds it (`--max-events`).
//!
//! A killed ebtrace (SIGKILL) cannot restore the gate, and the target keeps
//! queueing events. So before writing, ebtrace leaves a marker under
//! [`MARKER_DIR`] naming the process instance, the address and the level;
//! the next ebtrace run on that process finds it, recognizes the level as
//! ebtrace's own (not a session's), takes it over and restores -1 at its
//! end. The marker also keeps two concurrent ebtraces from both enabling.

use std::{
    fs::{self, OpenOptions},
    io::{self, Write as _},
    os::unix::fs::{FileExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use crate::procfs::start_time_ticks;

/// Where the markers live (a tmpfs: they do not outlive a reboot, and
/// neither do the processes they name).
pub const MARKER_DIR: &str = "/run/ebtrace";

/// `kTracingDisabled`.
pub const DISABLED: i32 = -1;

/// Where a process's trace level stands, as far as ebtrace is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LevelState {
    /// ebtrace switched recording on at `level`. `adopted`: a killed
    /// ebtrace had left it on, and this one took it over.
    Enabled { level: i32, adopted: bool },
    /// A profiler session in the process has it at `level`: observed only.
    InProcess { level: i32 },
    /// Another running ebtrace (`owner`) switched it on: observed only.
    OtherEbtrace { owner: u32, level: i32 },
    /// ebtrace had it on at `level` and put -1 back; `early`: before the
    /// capture ended (`--max-events`).
    Restored { level: i32, early: bool },
    /// Reading or writing the level failed.
    Failed { error: String },
}

impl LevelState {
    /// True while the target records TraceMes at all.
    pub fn recording(&self) -> bool {
        matches!(
            self,
            LevelState::Enabled { .. }
                | LevelState::InProcess { .. }
                | LevelState::OtherEbtrace { .. }
        )
    }

    pub fn describe(&self) -> String {
        match self {
            LevelState::Enabled {
                level,
                adopted: false,
            } => {
                format!("level {level} set by ebtrace (no profiler session in the process)")
            }
            LevelState::Enabled {
                level,
                adopted: true,
            } => format!(
                "level {level} left on by an ebtrace that was killed; taken over, will be restored"
            ),
            LevelState::InProcess { level } => {
                format!("a profiler session in the process has level {level}; observing only")
            }
            LevelState::OtherEbtrace { owner, level } => {
                format!("another ebtrace (pid {owner}) set level {level}; observing only")
            }
            LevelState::Restored {
                level,
                early: false,
            } => {
                format!("level {level} set by ebtrace, restored to -1")
            }
            LevelState::Restored { level, early: true } => {
                format!("level {level} set by ebtrace, restored to -1 early (--max-events reached)")
            }
            LevelState::Failed { error } => format!("trace level not switched: {error}"),
        }
    }
}

fn mem_path(pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/mem"))
}

/// Reads the `int` at `address` in `pid`.
pub fn read_level(pid: u32, address: u64) -> io::Result<i32> {
    let mem = fs::File::open(mem_path(pid))?;
    let mut buf = [0u8; 4];
    mem.read_exact_at(&mut buf, address)?;
    Ok(i32::from_ne_bytes(buf))
}

/// Writes the `int` at `address` in `pid` (one aligned 4-byte store).
fn write_level(pid: u32, address: u64, level: i32) -> io::Result<()> {
    let mem = OpenOptions::new().write(true).open(mem_path(pid))?;
    let n = mem.write_at(&level.to_ne_bytes(), address)?;
    if n != 4 {
        return Err(io::Error::other(format!("short write ({n} of 4 bytes)")));
    }
    Ok(())
}

/// Who wrote a level, as recorded in a marker file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Marker {
    owner_pid: u32,
    owner_start: u64,
    level: i32,
}

impl Marker {
    fn render(&self) -> String {
        format!(
            "owner_pid {}\nowner_start {}\nlevel {}\n",
            self.owner_pid, self.owner_start, self.level
        )
    }

    fn parse(text: &str) -> Option<Marker> {
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .map(str::trim)
        };
        Some(Marker {
            owner_pid: field("owner_pid")?.parse().ok()?,
            owner_start: field("owner_start")?.parse().ok()?,
            level: field("level")?.parse().ok()?,
        })
    }

    fn mine(level: i32) -> Option<Marker> {
        let me = std::process::id();
        Some(Marker {
            owner_pid: me,
            owner_start: start_time_ticks(me)?,
            level,
        })
    }

    fn owner_alive(&self) -> bool {
        self.owner_pid != std::process::id()
            && start_time_ticks(self.owner_pid) == Some(self.owner_start)
    }
}

/// Removes the markers of processes that no longer exist (a target that
/// exited while a killed ebtrace's level was on leaves one behind).
fn prune_markers(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("traceme-")) else {
            continue;
        };
        let mut fields = rest.split('-');
        let (Some(pid), Some(started)) = (
            fields.next().and_then(|p| p.parse::<u32>().ok()),
            fields.next().and_then(|s| s.parse::<u64>().ok()),
        ) else {
            continue;
        };
        if start_time_ticks(pid) != Some(started) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Creates `path` holding `marker`; false if it already exists.
fn create_marker(path: &Path, marker: &Marker) -> io::Result<bool> {
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
fn replace_marker(path: &Path, marker: &Marker) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, marker.render())?;
    fs::rename(&tmp, path)
}

/// The trace level of one recorder in one process, switched on by
/// [`engage`](Self::engage) if nobody has it on, and back off by
/// [`restore`](Self::restore) or when dropped.
#[derive(Debug)]
pub struct TraceLevelSwitch {
    pid: u32,
    address: u64,
    state: LevelState,
    marker: Option<PathBuf>,
    marker_dir: PathBuf,
}

impl TraceLevelSwitch {
    /// Switches recording on at `level` unless it already is.
    pub fn engage(pid: u32, address: u64, level: i32) -> Self {
        Self::engage_with_markers(pid, address, level, Path::new(MARKER_DIR))
    }

    pub fn engage_with_markers(pid: u32, address: u64, level: i32, marker_dir: &Path) -> Self {
        let mut switch = TraceLevelSwitch {
            pid,
            address,
            state: LevelState::Failed {
                error: String::new(),
            },
            marker: None,
            marker_dir: marker_dir.to_path_buf(),
        };
        switch.state = switch
            .try_engage(level)
            .unwrap_or_else(|e| LevelState::Failed {
                error: format!("/proc/{pid}/mem at {address:#x}: {e}"),
            });
        switch
    }

    fn marker_path(&self) -> io::Result<PathBuf> {
        let started = start_time_ticks(self.pid)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the process is gone"))?;
        Ok(self
            .marker_dir
            .join(format!("traceme-{}-{started}-{:x}", self.pid, self.address)))
    }

    fn try_engage(&mut self, level: i32) -> io::Result<LevelState> {
        prune_markers(&self.marker_dir);
        let current = read_level(self.pid, self.address)?;
        let path = self.marker_path()?;
        let mine = Marker::mine(level)
            .ok_or_else(|| io::Error::other("cannot read ebtrace's own start time"))?;
        if let Some(found) = fs::read_to_string(&path)
            .ok()
            .and_then(|t| Marker::parse(&t))
        {
            if found.owner_alive() {
                return Ok(LevelState::OtherEbtrace {
                    owner: found.owner_pid,
                    level: current,
                });
            }
            if current == found.level {
                // Left on by an ebtrace that could not restore it.
                replace_marker(&path, &mine)?;
                self.marker = Some(path);
                if level != current {
                    write_level(self.pid, self.address, level)?;
                }
                return Ok(LevelState::Enabled {
                    level,
                    adopted: true,
                });
            }
            // Stale, and the level has moved on since: not ours any more.
            let _ = fs::remove_file(&path);
        }
        if current != DISABLED {
            return Ok(LevelState::InProcess { level: current });
        }
        if !create_marker(&path, &mine)? {
            let owner = fs::read_to_string(&path)
                .ok()
                .and_then(|t| Marker::parse(&t))
                .map_or(0, |m| m.owner_pid);
            return Ok(LevelState::OtherEbtrace {
                owner,
                level: read_level(self.pid, self.address)?,
            });
        }
        self.marker = Some(path.clone());
        if let Err(e) = write_level(self.pid, self.address, level) {
            let _ = fs::remove_file(&path);
            self.marker = None;
            return Err(e);
        }
        Ok(LevelState::Enabled {
            level,
            adopted: false,
        })
    }

    pub fn state(&self) -> &LevelState {
        &self.state
    }

    /// Puts -1 back if ebtrace switched recording on (and nobody changed
    /// the level since). Returns a warning if it could not.
    pub fn restore(&mut self, early: bool) -> Option<String> {
        let LevelState::Enabled { level, .. } = self.state else {
            return None;
        };
        let warning = match read_level(self.pid, self.address) {
            Ok(current) if current == level => write_level(self.pid, self.address, DISABLED)
                .err()
                .map(|e| format!("could not restore the trace level of pid {}: {e}", self.pid)),
            Ok(current) => Some(format!(
                "pid {}: trace level is {current}, not the {level} ebtrace set; left as is",
                self.pid
            )),
            // The process exited: nothing left to restore.
            Err(_) => None,
        };
        if let Some(path) = self.marker.take() {
            let _ = fs::remove_file(path);
        }
        self.state = LevelState::Restored { level, early };
        warning
    }
}

impl Drop for TraceLevelSwitch {
    fn drop(&mut self) {
        if let Some(warning) = self.restore(false) {
            eprintln!("ebtrace: warning: {warning}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI32, Ordering};

    use super::*;

    /// A level in this very process: /proc/self/mem works like a target's.
    fn level_cell(v: i32) -> &'static AtomicI32 {
        Box::leak(Box::new(AtomicI32::new(v)))
    }

    fn addr(cell: &AtomicI32) -> u64 {
        cell as *const AtomicI32 as u64
    }

    fn marker_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ebtrace-level-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn markers_of_gone_processes_are_pruned() {
        let dir = marker_dir("prune");
        fs::create_dir_all(&dir).unwrap();
        let me = std::process::id();
        let live = dir.join(format!(
            "traceme-{me}-{}-1000",
            start_time_ticks(me).unwrap()
        ));
        let reused_pid = dir.join(format!("traceme-{me}-1-1000"));
        let other = dir.join("unrelated");
        for p in [&live, &reused_pid, &other] {
            fs::write(p, "x").unwrap();
        }
        prune_markers(&dir);
        assert!(live.exists() && other.exists());
        assert!(!reused_pid.exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn marker_round_trips() {
        let m = Marker {
            owner_pid: 12,
            owner_start: 345,
            level: 2,
        };
        assert_eq!(Marker::parse(&m.render()), Some(m));
        assert_eq!(Marker::parse("owner_pid 1\n"), None);
    }

    #[test]
    fn enables_and_restores_a_disabled_level() {
        let dir = marker_dir("enable");
        let cell = level_cell(DISABLED);
        let me = std::process::id();
        let mut s = TraceLevelSwitch::engage_with_markers(me, addr(cell), 2, &dir);
        assert_eq!(
            s.state(),
            &LevelState::Enabled {
                level: 2,
                adopted: false
            }
        );
        assert_eq!(cell.load(Ordering::SeqCst), 2);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        assert_eq!(s.restore(false), None);
        assert_eq!(cell.load(Ordering::SeqCst), DISABLED);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        assert_eq!(
            s.state(),
            &LevelState::Restored {
                level: 2,
                early: false
            }
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn leaves_an_in_process_session_alone() {
        let dir = marker_dir("session");
        let cell = level_cell(1);
        let s = TraceLevelSwitch::engage_with_markers(std::process::id(), addr(cell), 3, &dir);
        assert_eq!(s.state(), &LevelState::InProcess { level: 1 });
        drop(s);
        assert_eq!(cell.load(Ordering::SeqCst), 1);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn dropping_restores_and_a_changed_level_is_left_alone() {
        let dir = marker_dir("drop");
        let cell = level_cell(DISABLED);
        let me = std::process::id();
        drop(TraceLevelSwitch::engage_with_markers(
            me,
            addr(cell),
            2,
            &dir,
        ));
        assert_eq!(cell.load(Ordering::SeqCst), DISABLED);

        let mut s = TraceLevelSwitch::engage_with_markers(me, addr(cell), 2, &dir);
        cell.store(5, Ordering::SeqCst);
        let warning = s.restore(false).expect("a warning");
        assert!(warning.contains("left as is"), "{warning}");
        assert_eq!(cell.load(Ordering::SeqCst), 5);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn takes_over_a_level_left_by_a_dead_ebtrace() {
        let dir = marker_dir("adopt");
        let cell = level_cell(2);
        let me = std::process::id();
        let probe = TraceLevelSwitch::engage_with_markers(me, addr(cell), 2, &dir);
        let path = probe.marker_path().unwrap();
        drop(probe);
        // A marker whose owner is not running (pid 1 never has that start time).
        fs::create_dir_all(&dir).unwrap();
        let dead = Marker {
            owner_pid: 1,
            owner_start: u64::MAX,
            level: 2,
        };
        fs::write(&path, dead.render()).unwrap();
        let mut s = TraceLevelSwitch::engage_with_markers(me, addr(cell), 2, &dir);
        assert_eq!(
            s.state(),
            &LevelState::Enabled {
                level: 2,
                adopted: true
            }
        );
        s.restore(false);
        assert_eq!(cell.load(Ordering::SeqCst), DISABLED);
        assert!(!path.exists());

        // A live owner (this process, seen from "another" ebtrace): observe.
        cell.store(2, Ordering::SeqCst);
        fs::write(
            &path,
            Marker {
                owner_pid: 1,
                owner_start: start_time_ticks(1).unwrap(),
                level: 2,
            }
            .render(),
        )
        .unwrap();
        let s = TraceLevelSwitch::engage_with_markers(me, addr(cell), 2, &dir);
        assert_eq!(s.state(), &LevelState::OtherEbtrace { owner: 1, level: 2 });
        drop(s);
        assert_eq!(cell.load(Ordering::SeqCst), 2);
        let _ = fs::remove_dir_all(&dir);
    }
}
