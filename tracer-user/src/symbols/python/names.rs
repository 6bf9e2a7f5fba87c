//! The names of Python frames (function, file, line), kept once for every
//! capture of this ebtrace, each behind a number that a stack's tagged
//! entry carries.
//!
//! The table is bounded in names and in bytes, whatever names a target
//! makes up. A name not used for longer than any stack holding it can
//! live ([`keep_names_for`]: a capture's longest, or a flight recorder's
//! retention) is forgotten when room is needed, so a server that runs for
//! months keeps naming new frames; its number is never handed out again.

use std::{
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rustc_hash::FxHashMap;

use crate::symbols::stacks::{Frame, Symbol};

/// The module Python frames are reported in (pprof's mapping).
pub const PYTHON_MODULE: &str = "[python]";

/// Most distinct names kept.
const MAX_NAMES: usize = 1 << 20;
/// Most bytes the names take (their text twice, as key and as name, and
/// what holds them).
const MAX_NAME_BYTES: usize = 64 << 20;
/// How long a name unused may still be in a stack, until a server says.
const DEFAULT_KEEP_FOR: Duration = Duration::from_secs(3600);
/// How soon a table found full, with nothing it may forget, is looked
/// through again.
const SWEEP_AGAIN_AFTER: Duration = Duration::from_secs(1);
/// What a name takes beside its text.
const NAME_OVERHEAD_BYTES: usize = 160;

/// Frames that could not be named, marked where they stood.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marker {
    /// Its frame or code object could not be read.
    Unreadable = 0,
    /// Its code object was freed and its memory reused since the sample.
    Changed = 1,
    /// Its code object did not read as one.
    Malformed = 2,
    /// The chain went on past the frames the program reads.
    Truncated = 3,
    /// More distinct frames at once than are kept.
    TooMany = 4,
    /// Its name was forgotten before its stack was written (a stack held
    /// longer than [`keep_names_for`] said).
    Forgotten = 5,
    /// Its code object was not read: more were to be read than ebtrace
    /// reads in a second.
    NotRead = 6,
    /// Frames of a chain deeper than a stack keeps, between the innermost
    /// and the outermost it keeps.
    LeftOut = 7,
}

impl Marker {
    pub(super) const ALL: [Marker; 8] = [
        Marker::Unreadable,
        Marker::Changed,
        Marker::Malformed,
        Marker::Truncated,
        Marker::TooMany,
        Marker::Forgotten,
        Marker::NotRead,
        Marker::LeftOut,
    ];

    fn text(self) -> &'static str {
        match self {
            Marker::Unreadable => "[unreadable python frame]",
            Marker::Changed => "[python frame: code object reused]",
            Marker::Malformed => "[python frame: not a code object]",
            Marker::Truncated => "[more python frames]",
            Marker::TooMany => "[python frame: too many distinct frames]",
            Marker::Forgotten => "[python frame: name forgotten]",
            Marker::NotRead => "[python frame: not read, too many new code objects]",
            Marker::LeftOut => "[python frames left out: the stack is deeper than ebtrace keeps]",
        }
    }

    fn symbol(self) -> Arc<Symbol> {
        named(Frame {
            function: self.text().to_string(),
            file: None,
            line: None,
        })
    }
}

fn named(frame: Frame) -> Arc<Symbol> {
    Arc::new(Symbol {
        frames: vec![frame],
        module: Some(PYTHON_MODULE.to_string()),
        file_offset: None,
    })
}

/// How many names are kept and what they take, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NameStats {
    /// Names kept now.
    pub names: u64,
    /// Bytes they take.
    pub bytes: u64,
    /// Names forgotten to make room, since ebtrace started.
    pub forgotten: u64,
}

/// The most a table may hold, and for how long a name stays.
#[derive(Clone, Copy, Debug)]
struct Limits {
    names: usize,
    bytes: usize,
    keep_for: Duration,
}

struct KeptName {
    symbol: Arc<Symbol>,
    used: Instant,
    bytes: usize,
}

/// The names, by the number their tagged entries carry.
struct Names {
    markers: Vec<Arc<Symbol>>,
    symbols: FxHashMap<u64, KeptName>,
    ids: FxHashMap<Frame, u64>,
    next: u64,
    bytes: usize,
    forgotten: u64,
    limits: Limits,
    /// When a full table was last looked through for names to forget.
    swept: Option<Instant>,
}

impl Names {
    fn new(limits: Limits) -> Self {
        Names {
            markers: Marker::ALL.iter().map(|m| m.symbol()).collect(),
            symbols: FxHashMap::default(),
            ids: FxHashMap::default(),
            next: Marker::ALL.len() as u64,
            bytes: 0,
            forgotten: 0,
            limits,
            swept: None,
        }
    }

    /// The number naming `frame`, used `now`.
    fn id_of(&mut self, frame: Frame, now: Instant) -> u64 {
        if let Some(&id) = self.ids.get(&frame) {
            if let Some(kept) = self.symbols.get_mut(&id) {
                kept.used = now;
            }
            return id;
        }
        let bytes = 2 * (frame.function.len() + frame.file.as_ref().map_or(0, String::len))
            + NAME_OVERHEAD_BYTES;
        let room = self.has_room(bytes) || (self.forget_unused(now) && self.has_room(bytes));
        if !room {
            return Marker::TooMany as u64;
        }
        let id = self.next;
        self.next += 1;
        self.bytes += bytes;
        self.symbols.insert(
            id,
            KeptName {
                symbol: named(frame.clone()),
                used: now,
                bytes,
            },
        );
        self.ids.insert(frame, id);
        id
    }

    fn has_room(&self, bytes: usize) -> bool {
        self.symbols.len() < self.limits.names && self.bytes + bytes <= self.limits.bytes
    }

    /// Forgets the names not used within the limits' `keep_for` of `now`;
    /// false if the table was looked through too recently to look again.
    fn forget_unused(&mut self, now: Instant) -> bool {
        if self
            .swept
            .is_some_and(|at| now.saturating_duration_since(at) < SWEEP_AGAIN_AFTER)
        {
            return false;
        }
        self.swept = Some(now);
        let keep_for = self.limits.keep_for;
        let before = self.symbols.len();
        let mut freed = 0;
        self.symbols.retain(|_, kept| {
            let keep = now.saturating_duration_since(kept.used) <= keep_for;
            if !keep {
                freed += kept.bytes;
            }
            keep
        });
        let symbols = &self.symbols;
        self.ids.retain(|_, id| symbols.contains_key(id));
        self.bytes -= freed;
        self.forgotten += (before - self.symbols.len()) as u64;
        true
    }

    fn symbol(&self, id: u64) -> Arc<Symbol> {
        match self.markers.get(id as usize) {
            Some(marker) => Arc::clone(marker),
            None => self.symbols.get(&id).map_or_else(
                || Arc::clone(&self.markers[Marker::Forgotten as usize]),
                |kept| Arc::clone(&kept.symbol),
            ),
        }
    }

    fn stats(&self) -> NameStats {
        NameStats {
            names: self.symbols.len() as u64,
            bytes: self.bytes as u64,
            forgotten: self.forgotten,
        }
    }
}

/// How long a name unused is kept, in milliseconds ([`keep_names_for`]).
static KEEP_FOR_MS: AtomicU64 = AtomicU64::new(DEFAULT_KEEP_FOR.as_millis() as u64);

/// Says how long a stack may be held before it is written (its names
/// looked up): the longest capture, or the flight recorder's retention.
/// Names unused for longer than that, and a minute more, may be forgotten.
pub fn keep_names_for(held: Duration) {
    let keep = held.saturating_add(Duration::from_secs(60));
    KEEP_FOR_MS.store(keep.as_millis() as u64, Ordering::Relaxed);
}

fn names() -> std::sync::MutexGuard<'static, Names> {
    static NAMES: OnceLock<Mutex<Names>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(|| {
            Mutex::new(Names::new(Limits {
                names: MAX_NAMES,
                bytes: MAX_NAME_BYTES,
                keep_for: DEFAULT_KEEP_FOR,
            }))
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    names.limits.keep_for = Duration::from_millis(KEEP_FOR_MS.load(Ordering::Relaxed));
    names
}

/// The number naming `frame`, used `now` (or [`Marker::TooMany`]'s).
pub(super) fn id_of(frame: Frame, now: Instant) -> u64 {
    names().id_of(frame, now)
}

/// The name numbered `id`.
pub(super) fn symbol_of(id: u64) -> Arc<Symbol> {
    names().symbol(id)
}

/// How many names are kept, and what they take.
pub fn name_stats() -> NameStats {
    names().stats()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: usize) -> Frame {
        Frame {
            function: format!("f{n}"),
            file: Some("work.py".into()),
            line: Some(1),
        }
    }

    fn small(keep_for: Duration) -> Names {
        Names::new(Limits {
            names: 4,
            bytes: usize::MAX,
            keep_for,
        })
    }

    /// A table that fills up forgets what no stack can still hold, and
    /// names new frames again; a forgotten number is not handed out again.
    #[test]
    fn names_unused_past_the_holding_time_make_room_for_new_ones() {
        let start = Instant::now();
        let mut names = small(Duration::from_secs(10));
        let old: Vec<u64> = (0..4).map(|n| names.id_of(frame(n), start)).collect();
        let later = start + Duration::from_secs(5);
        // Still used: kept when room is needed.
        assert_eq!(names.id_of(frame(0), later), old[0]);
        assert_eq!(names.id_of(frame(9), later), Marker::TooMany as u64);
        let much_later = start + Duration::from_secs(12);
        let new = names.id_of(frame(10), much_later);
        assert!(new > old[3], "{new}");
        assert_eq!(names.symbol(new).frames, [frame(10)]);
        assert_eq!(names.symbol(old[0]).frames, [frame(0)]);
        assert_eq!(
            names.symbol(old[1]).frames[0].function,
            Marker::Forgotten.text()
        );
        assert_eq!(names.stats().forgotten, 3);
        assert_eq!(names.stats().names, 2);
        // Named again, under a new number.
        assert!(names.id_of(frame(1), much_later) > new);
    }

    /// A full table whose names are all in use is looked through at most
    /// once a second, not at every new frame.
    #[test]
    fn a_full_table_in_use_is_not_looked_through_at_every_frame() {
        let start = Instant::now();
        let mut names = small(Duration::from_secs(60));
        for n in 0..4 {
            names.id_of(frame(n), start);
        }
        assert_eq!(names.id_of(frame(5), start), Marker::TooMany as u64);
        assert!(!names.forget_unused(start + Duration::from_millis(10)));
        assert!(names.forget_unused(start + Duration::from_secs(2)));
    }

    /// Long names fill the table by their bytes.
    #[test]
    fn names_are_bounded_in_bytes() {
        let mut names = Names::new(Limits {
            names: usize::MAX,
            bytes: 4 * (2 * 4096 + NAME_OVERHEAD_BYTES),
            keep_for: Duration::from_secs(60),
        });
        let long = |n: usize| Frame {
            function: format!("{n:04096}"),
            file: None,
            line: None,
        };
        let now = Instant::now();
        for n in 0..4 {
            assert!(names.id_of(long(n), now) >= Marker::ALL.len() as u64);
        }
        assert_eq!(names.id_of(long(4), now), Marker::TooMany as u64);
        assert_eq!(
            names.stats().bytes,
            4 * (2 * 4096 + NAME_OVERHEAD_BYTES) as u64
        );
    }
}
