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
//!
//! The parts: [`Cell`] (reading and writing a gate), [`LevelState`] (where
//! a gate stands), `marker` (the marker files and their sweep), `children`
//! (the gate in processes forked while it was on) and, here,
//! [`TraceLevelSwitch`], which switches one gate on and off again.

mod children;
mod marker;
mod state;

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use super::{cell::Cell, guard};
use crate::procfs::start_time_ticks;

pub use children::{describe_children, put_back_in_children};
pub(crate) use marker::Marker;
pub use marker::sweep_markers;
pub use state::LevelState;

use marker::{create_marker, marker_name, replace_marker};

/// Where the markers live (a tmpfs: they do not outlive a reboot, and
/// neither do the processes they name).
pub const MARKER_DIR: &str = "/run/ebtrace";

/// `kTracingDisabled`, the off value of `g_trace_level`.
pub const DISABLED: i32 = -1;

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

impl Drop for TraceLevelSwitch {
    fn drop(&mut self) {
        if let Some(warning) = self.restore(false) {
            eprintln!("ebtrace: warning: {warning}");
        }
    }
}

#[cfg(test)]
mod tests;
