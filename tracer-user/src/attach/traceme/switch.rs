//! Switching a target's TraceMe recording on from outside, and off again.
//!
//! TraceMe records only while `g_trace_level >= level` of the TraceMe. With
//! no profiler session in the process the gate is -1 and `Record` is never
//! called. Some frameworks add a second gate for their Python-level
//! TraceMes (TensorFlow's `xla::profiler::traceme_enabled`, a bool). Each
//! such gate is a [`Cell`] in the target's memory; ebtrace writes its "on"
//! value through `/proc/PID/mem` and puts the "off" value back when the
//! capture ends: at its normal end, on Ctrl-C or SIGTERM, on an error and
//! on a panic (`Drop`). A cell some session already has on is left alone:
//! ebtrace only observes what it records.
//!
//! What enabling costs the target: its recorder queues every event in
//! per-thread memory until a session of its own drains it (TSL's
//! `TraceMeRecorder::Stop`); nothing else does. That memory is held until
//! the next in-process session, so the caller bounds it (`--max-events`).
//!
//! An ebtrace that dies without running its own code (SIGKILL, the OOM
//! killer, an abort) cannot restore anything itself, so before each write
//! the cell is handed to the [`guard`](super::guard), a small process that
//! outlives ebtrace and restores it the moment ebtrace's end of a pipe
//! closes. As a last resort (the guard killed too) ebtrace also leaves a
//! marker under [`MARKER_DIR`] naming the process instance, the cell and
//! the values; every later ebtrace start sweeps the markers and restores
//! the cells of dead owners (see [`sweep_markers`]). The marker also keeps
//! two concurrent ebtraces from both enabling.

use std::{
    fs::{self, OpenOptions},
    io::{self, Write as _},
    os::unix::fs::{FileExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use super::guard;
use crate::procfs::start_time_ticks;

/// Where the markers live (a tmpfs: they do not outlive a reboot, and
/// neither do the processes they name).
pub const MARKER_DIR: &str = "/run/ebtrace";

/// `kTracingDisabled`, the off value of `g_trace_level`.
pub const DISABLED: i32 = -1;

/// A gate in a target's memory: an aligned integer of `width` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cell {
    /// The target process.
    pub pid: u32,
    /// The gate's address in the target.
    pub address: u64,
    /// 4 for `std::atomic<int>`, 1 for `std::atomic<bool>`.
    pub width: u8,
}

impl Cell {
    /// `g_trace_level` (an `std::atomic<int>`).
    pub fn trace_level(pid: u32, address: u64) -> Cell {
        Cell {
            pid,
            address,
            width: 4,
        }
    }

    /// A boolean gate (an `std::atomic<bool>`).
    pub fn flag(pid: u32, address: u64) -> Cell {
        Cell {
            pid,
            address,
            width: 1,
        }
    }

    /// Reads the value (sign-extended for 4 bytes, 0/1 for a bool).
    pub fn read(&self) -> io::Result<i64> {
        let mem = fs::File::open(mem_path(self.pid))?;
        match self.width {
            1 => {
                let mut b = [0u8; 1];
                mem.read_exact_at(&mut b, self.address)?;
                Ok(i64::from(b[0]))
            }
            _ => {
                let mut b = [0u8; 4];
                mem.read_exact_at(&mut b, self.address)?;
                Ok(i64::from(i32::from_ne_bytes(b)))
            }
        }
    }

    /// Writes the value in one aligned store.
    pub fn write(&self, value: i64) -> io::Result<()> {
        let mem = OpenOptions::new().write(true).open(mem_path(self.pid))?;
        let bytes4 = (value as i32).to_ne_bytes();
        let bytes: &[u8] = match self.width {
            1 => &[value as u8],
            _ => &bytes4,
        };
        let n = mem.write_at(bytes, self.address)?;
        if n != bytes.len() {
            return Err(io::Error::other(format!(
                "short write ({n} of {} bytes)",
                bytes.len()
            )));
        }
        Ok(())
    }
}

fn mem_path(pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/mem"))
}

/// Where a gate stands, as far as ebtrace is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LevelState {
    /// ebtrace switched it on.
    Enabled {
        /// The value written.
        level: i32,
        /// A killed ebtrace had left it on, and this one took it over.
        adopted: bool,
    },
    /// A profiler session in the process has it on: observed only.
    InProcess {
        /// The value found.
        level: i32,
    },
    /// Another running ebtrace switched it on: observed only.
    OtherEbtrace {
        /// That ebtrace's pid.
        owner: u32,
        /// The value it wrote.
        level: i32,
    },
    /// ebtrace had it on and put the off value back.
    Restored {
        /// The value it had written.
        level: i32,
        /// Put back before the capture ended (`--max-events`).
        early: bool,
    },
    /// Reading or writing it failed.
    Failed {
        /// What failed, and how.
        error: String,
    },
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

    /// One line for the capture summary on where the gate stands.
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
    fn render(&self) -> String {
        format!(
            "owner_pid {}\nowner_start {}\nlevel {}\noff {}\nwidth {}\n",
            self.owner_pid, self.owner_start, self.level, self.off, self.width
        )
    }

    fn parse(text: &str) -> Option<Marker> {
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

    fn mine(level: i64, off: i64, width: u8) -> Option<Marker> {
        let me = std::process::id();
        Some(Marker {
            owner_pid: me,
            owner_start: start_time_ticks(me)?,
            level,
            off,
            width,
        })
    }

    fn owner_alive(&self) -> bool {
        self.owner_pid != std::process::id()
            && start_time_ticks(self.owner_pid) == Some(self.owner_start)
    }
}

/// A marker file's name: `traceme-<pid>-<start ticks>-<address hex>`.
fn marker_name(pid: u32, started: u64, address: u64) -> String {
    format!("traceme-{pid}-{started}-{address:x}")
}

fn parse_marker_name(name: &str) -> Option<(u32, u64, u64)> {
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
        if name.to_str().is_some_and(super::left_behind::is_stale) {
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

/// One gate of one process, switched on by [`engage`](Self::engage) if
/// nobody has it on, and back off by [`restore`](Self::restore) or when
/// dropped.
#[derive(Debug)]
pub struct TraceLevelSwitch {
    cell: Cell,
    off: i64,
    state: LevelState,
    marker: Option<PathBuf>,
    marker_dir: PathBuf,
    /// Hand the cell to the guard before writing it (always, outside this
    /// module's unit tests, which write cells of their own process).
    use_guard: bool,
    /// The guard has it armed.
    guarded: bool,
    /// When it was switched on (clock ticks since boot): a process forked
    /// from the target since then inherited the gate switched on.
    engaged_at: u64,
}

impl TraceLevelSwitch {
    /// Switches `g_trace_level` at `address` to `level` unless recording
    /// is already on.
    pub fn engage(pid: u32, address: u64, level: i32) -> Self {
        Self::engage_cell(
            Cell::trace_level(pid, address),
            i64::from(level),
            i64::from(DISABLED),
            Path::new(MARKER_DIR),
            true,
        )
    }

    /// Switches a boolean gate at `address` on unless it already is.
    pub fn engage_flag(pid: u32, address: u64) -> Self {
        Self::engage_cell(Cell::flag(pid, address), 1, 0, Path::new(MARKER_DIR), true)
    }

    /// Switches `cell` from `off` to `on`, with markers in `marker_dir`;
    /// `use_guard`: arm the restore guard first.
    pub fn engage_cell(cell: Cell, on: i64, off: i64, marker_dir: &Path, use_guard: bool) -> Self {
        let mut switch = TraceLevelSwitch {
            cell,
            off,
            state: LevelState::Failed {
                error: String::new(),
            },
            marker: None,
            marker_dir: marker_dir.to_path_buf(),
            use_guard,
            guarded: false,
            engaged_at: crate::procfs::boot_ticks_now(),
        };
        switch.state = switch
            .try_engage(on)
            .unwrap_or_else(|e| LevelState::Failed {
                error: format!("/proc/{}/mem at {:#x}: {e}", cell.pid, cell.address),
            });
        switch
    }

    /// The gate this switch works.
    pub fn cell(&self) -> Cell {
        self.cell
    }

    fn marker_path(&self) -> io::Result<PathBuf> {
        let started = start_time_ticks(self.cell.pid)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the process is gone"))?;
        Ok(self
            .marker_dir
            .join(marker_name(self.cell.pid, started, self.cell.address)))
    }

    fn try_engage(&mut self, on: i64) -> io::Result<LevelState> {
        let level = on as i32;
        let current = self.cell.read()?;
        let path = self.marker_path()?;
        let mine = Marker::mine(on, self.off, self.cell.width)
            .ok_or_else(|| io::Error::other("cannot read ebtrace's own start time"))?;
        if let Some(found) = fs::read_to_string(&path)
            .ok()
            .and_then(|t| Marker::parse(&t))
        {
            if found.owner_alive() {
                return Ok(LevelState::OtherEbtrace {
                    owner: found.owner_pid,
                    level: current as i32,
                });
            }
            if current == found.level {
                // Left on by an ebtrace that could not restore it.
                replace_marker(&path, &mine)?;
                self.marker = Some(path);
                self.hand_to_guard(on)?;
                if on != current {
                    self.cell.write(on)?;
                }
                return Ok(LevelState::Enabled {
                    level,
                    adopted: true,
                });
            }
            // Stale, and the cell has moved on since: not ours any more.
            let _ = fs::remove_file(&path);
        }
        if current != self.off {
            return Ok(LevelState::InProcess {
                level: current as i32,
            });
        }
        if !create_marker(&path, &mine)? {
            let owner = fs::read_to_string(&path)
                .ok()
                .and_then(|t| Marker::parse(&t))
                .map_or(0, |m| m.owner_pid);
            return Ok(LevelState::OtherEbtrace {
                owner,
                level: self.cell.read()? as i32,
            });
        }
        self.marker = Some(path.clone());
        let written = self.hand_to_guard(on).and_then(|()| self.cell.write(on));
        if let Err(e) = written {
            let _ = fs::remove_file(&path);
            self.marker = None;
            if self.guarded {
                guard::release(self.cell);
                self.guarded = false;
            }
            return Err(e);
        }
        Ok(LevelState::Enabled {
            level,
            adopted: false,
        })
    }

    /// Tells the guard about the write before it happens: if ebtrace dies
    /// right after, the guard still knows what to put back.
    fn hand_to_guard(&mut self, on: i64) -> io::Result<()> {
        if !self.use_guard {
            return Ok(());
        }
        let started = start_time_ticks(self.cell.pid)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the process is gone"))?;
        guard::arm(guard::Armed {
            cell: self.cell,
            pid_start: started,
            on,
            off: self.off,
            marker: self.marker.clone(),
        })
        .map_err(|e| io::Error::other(format!("cannot start the restore guard: {e}")))?;
        self.guarded = true;
        Ok(())
    }

    /// Where the gate stands now.
    pub fn state(&self) -> &LevelState {
        &self.state
    }

    /// Puts the off value back if ebtrace switched the cell on (and nobody
    /// changed it since). Returns a warning if it could not.
    pub fn restore(&mut self, early: bool) -> Option<String> {
        let LevelState::Enabled { level, .. } = self.state else {
            return None;
        };
        let pid = self.cell.pid;
        let warning = match self.cell.read() {
            Ok(current) if current == i64::from(level) => self
                .cell
                .write(self.off)
                .err()
                .map(|e| format!("could not restore the trace level of pid {pid}: {e}")),
            Ok(current) => Some(format!(
                "pid {pid}: trace level is {current}, not the {level} ebtrace set; left as is"
            )),
            // The process exited: nothing left to restore.
            Err(_) => None,
        };
        let forked = self.restore_forked(i64::from(level));
        if let Some(path) = self.marker.take() {
            let _ = fs::remove_file(path);
        }
        if std::mem::take(&mut self.guarded) {
            guard::release(self.cell);
        }
        self.state = LevelState::Restored { level, early };
        match (warning, forked) {
            (Some(w), Some(f)) => Some(format!("{w}; {f}")),
            (w, f) => w.or(f),
        }
    }

    /// Puts the gate back in the processes forked from the target while it
    /// was on (see [`put_back_in_children`]).
    fn restore_forked(&self, on: i64) -> Option<String> {
        // One tick of slack: the clock ticks are coarse.
        let since = self.engaged_at.saturating_sub(1);
        let restored = put_back_in_children(self.cell, since, on, self.off);
        describe_children(self.cell.pid, self.cell.address, self.off, &restored)
    }
}

/// Puts the gate `cell` back to `off` in the processes forked from its
/// process since `since` (clock ticks since boot) that inherited it `on`
/// and still hold that value (no session of theirs switched it: they would
/// record into their memory for ever), and still run the same code at the
/// gate's address (one that called exec since has other code there).
/// Returns their pids.
pub fn put_back_in_children(cell: Cell, since: u64, on: i64, off: i64) -> Vec<u32> {
    let parent = cell.pid;
    let Some(ours) = crate::procfs::mapping_at(parent, cell.address) else {
        return Vec::new();
    };
    let mut restored = Vec::new();
    for child in crate::procfs::descendants_since(parent, since) {
        if crate::procfs::mapping_at(child, cell.address).as_ref() != Some(&ours) {
            continue;
        }
        let cell = Cell { pid: child, ..cell };
        if cell.read().ok() == Some(on) && cell.write(off).is_ok() {
            restored.push(child);
        }
    }
    restored
}

/// The line that says in which children of `parent` the gate at `address`
/// was put back to `off`; none if in none.
pub fn describe_children(parent: u32, address: u64, off: i64, children: &[u32]) -> Option<String> {
    (!children.is_empty()).then(|| {
        format!(
            "pid {parent}: the TraceMe gate at {address:#x} was on when it forked; put back to \
             {off} in its child{} {}",
            if children.len() == 1 { "" } else { "ren" },
            children
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
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
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

    use super::*;

    /// A level in this very process: /proc/self/mem works like a target's.
    fn level_cell(v: i32) -> &'static AtomicI32 {
        Box::leak(Box::new(AtomicI32::new(v)))
    }

    fn addr<T>(cell: &T) -> u64 {
        cell as *const T as u64
    }

    fn marker_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ebtrace-level-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn engage(cell: &AtomicI32, level: i32, dir: &Path) -> TraceLevelSwitch {
        TraceLevelSwitch::engage_cell(
            Cell::trace_level(std::process::id(), addr(cell)),
            i64::from(level),
            i64::from(DISABLED),
            dir,
            false,
        )
    }

    #[test]
    fn markers_of_gone_processes_are_swept() {
        let dir = marker_dir("prune");
        fs::create_dir_all(&dir).unwrap();
        let me = std::process::id();
        let live = dir.join(marker_name(me, start_time_ticks(me).unwrap(), 0x1000));
        let reused_pid = dir.join(marker_name(me, 1, 0x1000));
        let other = dir.join("unrelated");
        for p in [&live, &reused_pid, &other] {
            fs::write(p, "x").unwrap();
        }
        assert!(sweep_markers(&dir).is_empty());
        assert!(live.exists() && other.exists());
        assert!(!reused_pid.exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn sweeping_restores_what_a_dead_owner_left_on_and_nothing_else() {
        let dir = marker_dir("sweep");
        fs::create_dir_all(&dir).unwrap();
        let me = std::process::id();
        let started = start_time_ticks(me).unwrap();
        let dead = |level: i64, off: i64, width: u8| Marker {
            owner_pid: 1,
            owner_start: u64::MAX,
            level,
            off,
            width,
        };
        // Left on by the dead owner: restored.
        let left_on = level_cell(2);
        fs::write(
            dir.join(marker_name(me, started, addr(left_on))),
            dead(2, -1, 4).render(),
        )
        .unwrap();
        // Moved on since (a session of the target's own): left alone.
        let moved_on = level_cell(3);
        fs::write(
            dir.join(marker_name(me, started, addr(moved_on))),
            dead(2, -1, 4).render(),
        )
        .unwrap();
        // A bool gate.
        let flag: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(true)));
        fs::write(
            dir.join(marker_name(me, started, addr(flag))),
            dead(1, 0, 1).render(),
        )
        .unwrap();
        let restored = sweep_markers(&dir);
        assert_eq!(restored.len(), 2, "{restored:?}");
        assert_eq!(left_on.load(Ordering::SeqCst), DISABLED);
        assert_eq!(moved_on.load(Ordering::SeqCst), 3);
        assert!(!flag.load(Ordering::SeqCst));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn marker_round_trips_and_reads_old_markers() {
        let m = Marker {
            owner_pid: 12,
            owner_start: 345,
            level: 2,
            off: -1,
            width: 4,
        };
        assert_eq!(Marker::parse(&m.render()), Some(m));
        assert_eq!(
            Marker::parse("owner_pid 12\nowner_start 345\nlevel 2\n"),
            Some(m)
        );
        assert_eq!(Marker::parse("owner_pid 1\n"), None);
        assert_eq!(
            Marker::parse("owner_pid 1\nowner_start 2\nlevel 2\nwidth 3\n"),
            None
        );
        assert_eq!(
            parse_marker_name("traceme-12-345-7f00"),
            Some((12, 345, 0x7f00))
        );
        assert_eq!(parse_marker_name("traceme-12-345"), None);
    }

    #[test]
    fn enables_and_restores_a_disabled_level() {
        let dir = marker_dir("enable");
        let cell = level_cell(DISABLED);
        let mut s = engage(cell, 2, &dir);
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
    fn a_bool_gate_is_switched_and_restored() {
        let dir = marker_dir("flag");
        let flag: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
        let mut s = TraceLevelSwitch::engage_cell(
            Cell::flag(std::process::id(), addr(flag)),
            1,
            0,
            &dir,
            false,
        );
        assert!(matches!(s.state(), LevelState::Enabled { level: 1, .. }));
        assert!(flag.load(Ordering::SeqCst));
        assert_eq!(s.restore(false), None);
        assert!(!flag.load(Ordering::SeqCst));
        // Already on (the framework's own session): observed only.
        flag.store(true, Ordering::SeqCst);
        let s = TraceLevelSwitch::engage_cell(
            Cell::flag(std::process::id(), addr(flag)),
            1,
            0,
            &dir,
            false,
        );
        assert_eq!(s.state(), &LevelState::InProcess { level: 1 });
        drop(s);
        assert!(flag.load(Ordering::SeqCst));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn leaves_an_in_process_session_alone() {
        let dir = marker_dir("session");
        let cell = level_cell(1);
        let s = engage(cell, 3, &dir);
        assert_eq!(s.state(), &LevelState::InProcess { level: 1 });
        drop(s);
        assert_eq!(cell.load(Ordering::SeqCst), 1);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn dropping_restores_and_a_changed_level_is_left_alone() {
        let dir = marker_dir("drop");
        let cell = level_cell(DISABLED);
        drop(engage(cell, 2, &dir));
        assert_eq!(cell.load(Ordering::SeqCst), DISABLED);

        let mut s = engage(cell, 2, &dir);
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
        let probe = engage(cell, 2, &dir);
        let path = probe.marker_path().unwrap();
        drop(probe);
        // A marker whose owner is not running (pid 1 never has that start time).
        fs::create_dir_all(&dir).unwrap();
        let dead = Marker {
            owner_pid: 1,
            owner_start: u64::MAX,
            level: 2,
            off: -1,
            width: 4,
        };
        fs::write(&path, dead.render()).unwrap();
        let mut s = engage(cell, 2, &dir);
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
                off: -1,
                width: 4,
            }
            .render(),
        )
        .unwrap();
        let s = engage(cell, 2, &dir);
        assert_eq!(s.state(), &LevelState::OtherEbtrace { owner: 1, level: 2 });
        drop(s);
        assert_eq!(cell.load(Ordering::SeqCst), 2);
        let _ = fs::remove_dir_all(&dir);
    }
}
