//! Switching gates of this very process on and off, and the markers left
//! behind.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, AtomicI32, Ordering},
};

use super::{
    Cell, DISABLED, LevelState, Marker, TraceLevelSwitch, marker::parse_marker_name, marker_name,
    sweep_markers,
};
use crate::procfs::start_time_ticks;

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
