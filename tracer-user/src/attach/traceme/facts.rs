//! What one object file holds for TraceMe: its recorder's symbols, their
//! C++ string layout and the Python TraceMe gate. These depend on the build
//! only, not on the process mapping it, so they are found with one pass
//! over the object's symbols and remembered by its build-id (or, for
//! objects built without one, such as jaxlib's, by the file's inode, size
//! and change time): in memory for the life of an `ebtrace serve`, and on
//! disk for the next `ebtrace` (jaxlib's 740k symbols take a quarter of a
//! second to search).
//!
//! The disk cache is a directory only its owner can write
//! (`EBTRACE_CACHE_DIR`, else `/var/cache/ebtrace` for root, else
//! `$XDG_CACHE_HOME/ebtrace` or `~/.cache/ebtrace`); one small text file per
//! object. A file that does not parse is ignored and rewritten, and every
//! address read from it is checked against the object's segments before a
//! probe goes there.

use std::{
    collections::HashMap,
    io::Write as _,
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _},
    path::PathBuf,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use super::recorder_symbols::{
    FILTER_BITMAP, LayoutVotes, NAMESPACES, NamespaceFinders, PYTHON_GATE, PYTHON_GATE_IN_PYTHON,
    PYTHON_GATE_NEEDLE, RECORD_NEEDLE, StringLayout,
};
use crate::symbols::ElfObject;

/// Where the disk cache is kept, if not in the default place.
pub const CACHE_DIR_ENV: &str = "EBTRACE_CACHE_DIR";
/// First line of a cache file; bumped when the format or what is found
/// changes.
const FORMAT: &str = "ebtrace traceme facts 1";

/// A recorder's symbols in an object (addresses as in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecorderFacts {
    /// Index into the recorder namespaces (`tsl`, `tensorflow`).
    pub namespace: usize,
    /// How its `Event`'s name string is laid out.
    pub layout: StringLayout,
    /// `TraceMeRecorder::Record`.
    pub record: u64,
    /// `g_trace_level`.
    pub trace_level: Option<u64>,
    /// `g_trace_filter_bitmap`.
    pub filter_bitmap: Option<u64>,
}

/// The Python-level TraceMe gate in an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateFacts {
    /// The object has no gate.
    None,
    /// An exported `xla::profiler::traceme_enabled` at this address.
    Exported(u64),
    /// The gate is a Python module variable (TensorFlow up to 2.20).
    InPython,
}

/// Everything TraceMe needs to know of one object file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectFacts {
    /// `Err(why)` where the object has a recorder ebtrace cannot use.
    pub recorder: Result<Option<RecorderFacts>, String>,
    /// Its Python TraceMe gate.
    pub gate: GateFacts,
    /// Symbols searched to find these (0 when no search was needed).
    pub symbols: usize,
    /// How long finding them took, or reading them back from the cache.
    pub lookup_time: Duration,
    /// Read back from the cache rather than searched.
    pub cached: bool,
}

impl ObjectFacts {
    const NOTHING: ObjectFacts = ObjectFacts {
        recorder: Ok(None),
        gate: GateFacts::None,
        symbols: 0,
        lookup_time: Duration::ZERO,
        cached: false,
    };

    /// Searches `elf` (one pass over its symbols, skipped where its string
    /// tables hold none of the names).
    pub fn search(elf: &ElfObject) -> ObjectFacts {
        let started = std::time::Instant::now();
        let has_recorder = elf.strings_contain(RECORD_NEEDLE);
        let has_gate = elf.strings_contain(PYTHON_GATE_NEEDLE);
        if !has_recorder && !has_gate {
            return ObjectFacts::NOTHING;
        }
        let mut wanted: Vec<&str> = NAMESPACES
            .iter()
            .flat_map(|n| [n.record, n.trace_level])
            .collect();
        let filter_at = wanted.len();
        wanted.extend([FILTER_BITMAP, PYTHON_GATE, PYTHON_GATE_IN_PYTHON]);
        let finders = NamespaceFinders::new();
        let mut votes = LayoutVotes::default();
        let scan = match elf.scan(&wanted, |name| has_recorder && votes.count(name, &finders)) {
            Ok(scan) => scan,
            Err(e) => {
                return ObjectFacts {
                    recorder: Err(e.to_string()),
                    lookup_time: started.elapsed(),
                    ..ObjectFacts::NOTHING
                };
            }
        };
        let recorder = NAMESPACES
            .iter()
            .enumerate()
            .find_map(|(i, _)| Some((i, scan.found[2 * i]?, scan.found[2 * i + 1])))
            .map(|(namespace, record, level)| {
                let layout = votes.layout().ok_or_else(|| {
                    "cannot tell which C++ library it was built with (no std:: symbols)".to_string()
                })?;
                Ok(RecorderFacts {
                    namespace,
                    layout,
                    record: record.vaddr,
                    trace_level: level.map(|s| s.vaddr),
                    // Only TSL's copy has a filter.
                    filter_bitmap: (NAMESPACES[namespace].namespace == "tsl")
                        .then(|| scan.found[filter_at])
                        .flatten()
                        .map(|s| s.vaddr),
                })
            })
            .transpose();
        let gate = match (scan.found[filter_at + 1], scan.found[filter_at + 2]) {
            // Unexported copies (jaxlib's) have no reader outside their object.
            (Some(g), _) if g.exported && !g.function => GateFacts::Exported(g.vaddr),
            (None, Some(_)) => GateFacts::InPython,
            _ => GateFacts::None,
        };
        ObjectFacts {
            recorder,
            gate,
            symbols: scan.symbols,
            lookup_time: started.elapsed(),
            cached: false,
        }
    }

    /// The cache file's text.
    fn to_text(&self) -> String {
        let hex = |v: Option<u64>| v.map_or("-".to_string(), |v| format!("{v:#x}"));
        let recorder = match &self.recorder {
            Ok(None) => "recorder none".to_string(),
            Err(why) => format!("recorder unusable {}", why.replace('\n', " ")),
            Ok(Some(r)) => format!(
                "recorder {} {} {:#x} {} {}",
                NAMESPACES[r.namespace].namespace,
                r.layout.describe().replace(' ', "_"),
                r.record,
                hex(r.trace_level),
                hex(r.filter_bitmap),
            ),
        };
        let gate = match self.gate {
            GateFacts::None => "gate none".to_string(),
            GateFacts::Exported(at) => format!("gate exported {at:#x}"),
            GateFacts::InPython => "gate in-python".to_string(),
        };
        format!("{FORMAT}\nsymbols {}\n{recorder}\n{gate}\n", self.symbols)
    }

    /// Parses a cache file's text; `None` if it is not one this version
    /// wrote.
    fn from_text(text: &str) -> Option<ObjectFacts> {
        let mut lines = text.lines();
        if lines.next()? != FORMAT {
            return None;
        }
        let symbols = lines.next()?.strip_prefix("symbols ")?.parse().ok()?;
        let addr = |s: &str| u64::from_str_radix(s.strip_prefix("0x")?, 16).ok();
        let maybe = |s: &str| {
            if s == "-" {
                Some(None)
            } else {
                addr(s).map(Some)
            }
        };
        let recorder = lines.next()?.strip_prefix("recorder ")?;
        let recorder = if recorder == "none" {
            Ok(None)
        } else if let Some(why) = recorder.strip_prefix("unusable ") {
            Err(why.to_string())
        } else {
            let f: Vec<&str> = recorder.split(' ').collect();
            let [namespace, layout, record, level, filter] = f[..] else {
                return None;
            };
            let layout = [
                StringLayout::Libstdcxx,
                StringLayout::Libcxx,
                StringLayout::LibcxxAlternate,
            ]
            .into_iter()
            .find(|l| l.describe().replace(' ', "_") == layout)?;
            Ok(Some(RecorderFacts {
                namespace: NAMESPACES.iter().position(|n| n.namespace == namespace)?,
                layout,
                record: addr(record)?,
                trace_level: maybe(level)?,
                filter_bitmap: maybe(filter)?,
            }))
        };
        let gate = match lines.next()?.strip_prefix("gate ")? {
            "none" => GateFacts::None,
            "in-python" => GateFacts::InPython,
            other => GateFacts::Exported(addr(other.strip_prefix("exported ")?)?),
        };
        Some(ObjectFacts {
            recorder,
            gate,
            symbols,
            lookup_time: Duration::ZERO,
            cached: true,
        })
    }
}

/// Facts already found, by [`ElfObject::identity`].
static MEMORY: LazyLock<Mutex<HashMap<String, ObjectFacts>>> = LazyLock::new(Default::default);

/// The facts of `elf`: remembered or read back by its identity, else
/// searched (and remembered).
pub fn facts_of(elf: &ElfObject) -> ObjectFacts {
    let started = std::time::Instant::now();
    let id = elf.identity();
    if let Some(f) = MEMORY.lock().ok().and_then(|m| m.get(&id).cloned()) {
        return ObjectFacts {
            cached: true,
            lookup_time: started.elapsed(),
            ..f
        };
    }
    let file = cache_dir().map(|dir| dir.join(&id));
    let read = file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .and_then(|text| ObjectFacts::from_text(&text));
    let facts = match read {
        Some(f) => ObjectFacts {
            lookup_time: started.elapsed(),
            ..f
        },
        None => return search_again(elf),
    };
    if let Ok(mut m) = MEMORY.lock() {
        m.insert(id, facts.clone());
    }
    facts
}

/// Searches `elf` again, replacing what was remembered of it: for facts
/// read back that do not fit the object.
pub fn search_again(elf: &ElfObject) -> ObjectFacts {
    let facts = ObjectFacts::search(elf);
    let id = elf.identity();
    if let Some(dir) = cache_dir() {
        write_atomically(&dir.join(&id), &facts.to_text());
    }
    if let Ok(mut m) = MEMORY.lock() {
        m.insert(id, facts.clone());
    }
    facts
}

/// The disk cache's directory, created if needed; `None` where it cannot
/// be used safely (someone else could write into it).
fn cache_dir() -> Option<PathBuf> {
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    let base = match std::env::var_os(CACHE_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None if euid == 0 => PathBuf::from("/var/cache/ebtrace"),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?
            .join("ebtrace"),
    };
    let dir = base.join("traceme");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .ok()?;
    let meta = std::fs::metadata(&dir).ok()?;
    (meta.uid() == euid && meta.mode() & 0o022 == 0).then_some(dir)
}

/// Writes `text` to `file` through a temporary file and a rename, so that
/// a concurrent reader sees the old file or the new one; failures only cost
/// the next run a search.
fn write_atomically(file: &std::path::Path, text: &str) {
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .and_then(|()| std::fs::rename(&tmp, file));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<ObjectFacts> {
        let base = ObjectFacts {
            symbols: 742_798,
            ..ObjectFacts::NOTHING
        };
        vec![
            base.clone(),
            ObjectFacts {
                recorder: Err("cannot tell which C++ library it was built with".into()),
                gate: GateFacts::InPython,
                ..base.clone()
            },
            ObjectFacts {
                recorder: Ok(Some(RecorderFacts {
                    namespace: 0,
                    layout: StringLayout::LibcxxAlternate,
                    record: 0x1234_5678,
                    trace_level: Some(0x9abc_def0),
                    filter_bitmap: None,
                })),
                gate: GateFacts::Exported(0xfeed),
                ..base
            },
        ]
    }

    #[test]
    fn the_cache_text_reads_back_as_written() {
        for facts in sample() {
            let text = facts.to_text();
            assert!(text.starts_with(FORMAT));
            let back = ObjectFacts::from_text(&text).expect(&text);
            assert_eq!(
                back,
                ObjectFacts {
                    cached: true,
                    ..facts
                }
            );
        }
        assert_eq!(ObjectFacts::from_text("ebtrace traceme facts 0\n"), None);
        assert_eq!(ObjectFacts::from_text(""), None);
    }

    #[test]
    fn this_test_binary_has_no_recorder() {
        let exe = std::env::current_exe().unwrap();
        let elf = ElfObject::open(&exe, None).unwrap();
        let searched = ObjectFacts::search(&elf);
        assert_eq!(searched.recorder, Ok(None));
        assert_eq!(searched.gate, GateFacts::None);
    }

    proptest::proptest! {
        /// A cache file is untrusted: whatever it holds, reading it returns.
        #[test]
        fn reading_any_cache_text_never_panics(lines in proptest::collection::vec("[ -~]{0,40}", 0..6)) {
            let mut text = format!("{FORMAT}\n");
            text.push_str(&lines.join("\n"));
            let _ = ObjectFacts::from_text(&text);
            let _ = ObjectFacts::from_text(&lines.join("\n"));
        }
    }
}
