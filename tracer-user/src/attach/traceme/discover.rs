//! Finding the TraceMe recorders in a process: every mapped ELF object
//! that defines `TraceMeRecorder::Record(Event&&)` (TSL's `tsl::profiler`
//! or TensorFlow's older `tensorflow::profiler` copy), with its trace-level
//! gate and the C++ string layout its `Event` uses.
//!
//! A process may hold several copies (jaxlib and libtpu each carry one);
//! each is a separate [`Recorder`].
//!
//! Besides the level, TensorFlow 2.21 gates its Python-level TraceMes
//! (`tf.profiler.experimental.Trace`, `tf.function` calls) with an exported
//! `std::atomic<bool>`, `xla::profiler::traceme_enabled`, that its own
//! profiler session sets; it lives in `lib_pywrap_tensorflow_common.so`,
//! not in the object of the recorder those events reach, so every object
//! is searched for it too ([`PythonGate`]). jaxlib carries an unexported
//! copy nothing reads (its `TraceAnnotation` checks the level alone), and
//! libtpu none. TensorFlow up to 2.20 kept that gate in a Python module
//! variable, which cannot be written from outside: such a process is noted.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use memchr::memmem::Finder;

use super::facts::{GateFacts, ObjectFacts, facts_of, search_again};
use crate::symbols::{ElfObject, MappedObject, mapped_objects, maps::page_size};

/// The recorder's symbols, per namespace.
pub(super) struct Names {
    pub namespace: &'static str,
    pub record: &'static str,
    pub trace_level: &'static str,
}

pub(super) const NAMESPACES: [Names; 2] = [
    Names {
        namespace: "tsl",
        record: "_ZN3tsl8profiler15TraceMeRecorder6RecordEONS1_5EventE",
        trace_level: "_ZN3tsl8profiler8internal13g_trace_levelE",
    },
    Names {
        namespace: "tensorflow",
        record: "_ZN10tensorflow8profiler15TraceMeRecorder6RecordEONS1_5EventE",
        trace_level: "_ZN10tensorflow8profiler8internal13g_trace_levelE",
    },
];

/// Common to both `Record` names: objects whose string tables lack it are
/// skipped without a symbol pass.
pub(super) const RECORD_NEEDLE: &[u8] = b"15TraceMeRecorder6RecordEONS1_5EventE";

/// `tsl::profiler::internal::g_trace_filter_bitmap`: a TraceMe records only
/// if its filter mask meets it; all ones unless a session set a mask.
pub(super) const FILTER_BITMAP: &str = "_ZN3tsl8profiler8internal21g_trace_filter_bitmapE";

/// `xla::profiler::traceme_enabled`, the Python-level TraceMe gate.
pub(super) const PYTHON_GATE: &str = "_ZN3xla8profiler15traceme_enabledE";
/// `xla::profiler::PythonHookContext::EnableTraceMe(bool)`: where the gate
/// was a Python module variable (TensorFlow up to 2.20).
pub(super) const PYTHON_GATE_IN_PYTHON: &str =
    "_ZN3xla8profiler17PythonHookContext13EnableTraceMeEb";
/// Common to both: objects without it need no symbol pass for the gate.
pub(super) const PYTHON_GATE_NEEDLE: &[u8] = b"_ZN3xla8profiler";

/// How the object's `std::string` (the event name) is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StringLayout {
    /// libstdc++ (C++11 ABI): 32-byte string, `Event` of 48 bytes.
    Libstdcxx,
    /// libc++ default layout (`std::__1`): 24-byte string, `Event` of 40.
    Libcxx,
    /// libc++ alternate layout (ABI v2 or a private ABI namespace such as
    /// libtpu's `std::__u`): 24-byte string, `Event` of 40.
    LibcxxAlternate,
}

impl StringLayout {
    /// The eBPF program that reads events of this layout.
    pub fn program(self) -> &'static str {
        use tracer_common::traceme::names;
        match self {
            StringLayout::Libstdcxx => names::PROGRAM_LIBSTDCXX,
            StringLayout::Libcxx => names::PROGRAM_LIBCXX,
            StringLayout::LibcxxAlternate => names::PROGRAM_LIBCXX_ALTERNATE,
        }
    }

    /// The layout's name, as the summary and the symbol cache spell it.
    pub fn describe(self) -> &'static str {
        match self {
            StringLayout::Libstdcxx => "libstdc++",
            StringLayout::Libcxx => "libc++",
            StringLayout::LibcxxAlternate => "libc++ alternate layout",
        }
    }
}

/// Evidence of the C++ library an object was built with, from the
/// `std::` inline namespaces in its symbol names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutVotes {
    /// `std::__cxx11::` (libstdc++'s C++11 ABI).
    pub libstdcxx: usize,
    /// `std::__1::` or `std::__ndk1::` (libc++, default layout).
    pub libcxx: usize,
    /// `std::__2::`, `std::__u::`, ... (libc++, alternate layout).
    pub libcxx_alternate: usize,
}

/// Enough evidence to stop looking.
const VOTES_NEEDED: usize = 64;

impl LayoutVotes {
    pub(super) fn count(&mut self, name: &[u8], finders: &NamespaceFinders) -> bool {
        let NamespaceFinders { cxx11, libcxx, ndk } = finders;
        if cxx11.find(name).is_some() {
            self.libstdcxx += 1;
        }
        // `St3__X`: std::__X, a one-character libc++ ABI namespace.
        if let Some(at) = libcxx.find(name)
            && let Some(&ns) = name.get(at + 5)
            && ns.is_ascii_alphanumeric()
        {
            if ns == b'1' {
                self.libcxx += 1;
            } else {
                self.libcxx_alternate += 1;
            }
        } else if ndk.find(name).is_some() {
            self.libcxx += 1;
        }
        self.libstdcxx.max(self.libcxx).max(self.libcxx_alternate) < VOTES_NEEDED
    }

    /// The layout with the most evidence, if there is any.
    pub fn layout(&self) -> Option<StringLayout> {
        let best = self.libstdcxx.max(self.libcxx).max(self.libcxx_alternate);
        if best == 0 {
            None
        } else if best == self.libstdcxx {
            Some(StringLayout::Libstdcxx)
        } else if best == self.libcxx {
            Some(StringLayout::Libcxx)
        } else {
            Some(StringLayout::LibcxxAlternate)
        }
    }
}

/// Searchers for the `std::` inline namespaces in mangled names.
pub(super) struct NamespaceFinders {
    /// `St7__cxx11`: libstdc++.
    cxx11: Finder<'static>,
    /// `St3__`: a one-character libc++ namespace follows.
    libcxx: Finder<'static>,
    /// `St6__ndk1`: the Android NDK's libc++.
    ndk: Finder<'static>,
}

impl NamespaceFinders {
    pub(super) fn new() -> Self {
        NamespaceFinders {
            cxx11: Finder::new(b"St7__cxx11"),
            libcxx: Finder::new(b"St3__"),
            ndk: Finder::new(b"St6__ndk1"),
        }
    }
}

/// One TraceMe recorder in a process.
#[derive(Clone, Debug)]
pub struct Recorder {
    /// The process.
    pub pid: u32,
    /// The object's path as the process sees it.
    pub object: String,
    /// Where ebtrace opens (and attaches to) that very file.
    pub open_path: PathBuf,
    /// `tsl` or `tensorflow`.
    pub namespace: &'static str,
    /// How its `Event`'s name string is laid out.
    pub layout: StringLayout,
    /// File offset of `Record` (where the uprobe goes).
    pub record_offset: u64,
    /// Address of `Record` in the process (a record's `site`).
    pub record_address: u64,
    /// Address of `g_trace_level` in the process, if the object has it.
    pub trace_level_address: Option<u64>,
    /// Address of `g_trace_filter_bitmap` in the process, if it has it.
    pub filter_bitmap_address: Option<u64>,
    /// Symbols looked at.
    pub symbols: usize,
    /// How long the symbol lookup took.
    pub lookup_time: Duration,
    /// The symbols were remembered from an earlier search of the same file.
    pub cached: bool,
    /// Files the process had mapped.
    pub objects: usize,
    /// How long searching all of them took.
    pub search_time: Duration,
}

impl Recorder {
    /// The object's file name, without its directory.
    pub fn file_name(&self) -> &str {
        self.object.rsplit('/').next().unwrap_or(&self.object)
    }
}

/// The Python-level TraceMe gate of a process (TensorFlow 2.21 and later).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonGate {
    /// The process.
    pub pid: u32,
    /// The object's path as the process sees it.
    pub object: String,
    /// Address of `xla::profiler::traceme_enabled` (one byte).
    pub address: u64,
}

impl PythonGate {
    /// The object's file name, without its directory.
    pub fn file_name(&self) -> &str {
        self.object.rsplit('/').next().unwrap_or(&self.object)
    }
}

/// An object that has a recorder ebtrace cannot use, and why.
#[derive(Clone, Debug)]
pub struct Unusable {
    /// The object's path as the process sees it.
    pub object: String,
    /// Why its recorder cannot be used.
    pub reason: String,
}

/// What [`discover`] found in one process.
#[derive(Clone, Debug, Default)]
pub struct Discovery {
    /// The usable recorders.
    pub recorders: Vec<Recorder>,
    /// Objects whose recorder cannot be used.
    pub unusable: Vec<Unusable>,
    /// Exported Python TraceMe gates, to switch with the level.
    pub python_gates: Vec<PythonGate>,
    /// Objects that gate Python TraceMes in Python itself (older
    /// TensorFlow): those events cannot be switched on from outside.
    pub python_gates_in_python: Vec<String>,
    /// Objects mapped in the process (all were looked at).
    pub objects: usize,
    /// How long the search took.
    pub elapsed: Duration,
}

/// Looks for TraceMe recorders in every object `pid` has mapped.
pub fn discover(pid: u32) -> std::io::Result<Discovery> {
    let began = Instant::now();
    let objects = mapped_objects(pid)?;
    let mut found = Discovery {
        objects: objects.len(),
        ..Discovery::default()
    };
    for object in &objects {
        let path = object.open_path();
        // Unreadable or non-ELF mappings (fonts, caches, ...) hold neither.
        let Ok(elf) = ElfObject::open(&path, Some(object.inode)) else {
            continue;
        };
        let mut facts = facts_of(&elf);
        let mut found_recorder = recorder(object, &elf, path.clone(), &facts);
        if facts.cached && found_recorder.is_err() {
            // What was remembered does not fit this object: look again.
            facts = search_again(&elf);
            found_recorder = recorder(object, &elf, path, &facts);
        }
        match found_recorder {
            Ok(Some(recorder)) => found.recorders.push(recorder),
            Ok(None) => {}
            Err(reason) => found.unusable.push(Unusable {
                object: object.path.clone(),
                reason,
            }),
        }
        match facts.gate {
            GateFacts::Exported(vaddr) => {
                if let Some(bias) = object.load_bias(elf.segments(), page_size()) {
                    found.python_gates.push(PythonGate {
                        pid: object.pid,
                        object: object.path.clone(),
                        address: bias.wrapping_add(vaddr),
                    });
                }
            }
            GateFacts::InPython => found.python_gates_in_python.push(object.path.clone()),
            GateFacts::None => {}
        }
    }
    found.elapsed = began.elapsed();
    for r in &mut found.recorders {
        r.objects = found.objects;
        r.search_time = found.elapsed;
    }
    Ok(found)
}

/// The recorder `facts` describe in one mapped object: `Ok(None)` if it
/// has none, `Err(why)` if it has one that cannot be used.
fn recorder(
    object: &MappedObject,
    elf: &ElfObject,
    path: PathBuf,
    facts: &ObjectFacts,
) -> Result<Option<Recorder>, String> {
    let Some(r) = facts.recorder.clone()? else {
        return Ok(None);
    };
    let bias = object
        .load_bias(elf.segments(), page_size())
        .ok_or_else(|| "cannot find where it is loaded".to_string())?;
    // A uprobe goes at this offset: it must be code this object loads
    // (the address may come from the cache).
    let record_offset = elf
        .segments()
        .iter()
        .any(|s| s.executable && r.record >= s.vaddr && r.record - s.vaddr < s.filesz)
        .then(|| elf.file_offset(r.record))
        .flatten()
        .ok_or_else(|| "TraceMeRecorder::Record is outside its loaded code".to_string())?;
    Ok(Some(Recorder {
        pid: object.pid,
        object: object.path.clone(),
        open_path: path,
        namespace: NAMESPACES[r.namespace].namespace,
        layout: r.layout,
        record_offset,
        record_address: bias.wrapping_add(r.record),
        trace_level_address: r.trace_level.map(|a| bias.wrapping_add(a)),
        filter_bitmap_address: r.filter_bitmap.map(|a| bias.wrapping_add(a)),
        symbols: facts.symbols,
        lookup_time: facts.lookup_time,
        cached: facts.cached,
        objects: 0,
        search_time: Duration::ZERO,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn votes(names: &[&str]) -> LayoutVotes {
        let finders = NamespaceFinders::new();
        let mut v = LayoutVotes::default();
        for n in names {
            v.count(n.as_bytes(), &finders);
        }
        v
    }

    #[test]
    fn tells_string_layouts_from_std_namespaces() {
        let gnu = votes(&[
            "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE9_M_createERmm",
            "_ZNSt8__detail15_List_node_base7_M_hookEPS0_",
        ]);
        assert_eq!(gnu.layout(), Some(StringLayout::Libstdcxx));
        let llvm =
            votes(&["_ZNSt3__112basic_stringIcNS_11char_traitsIcEENS_9allocatorIcEEE6appendEPKc"]);
        assert_eq!(llvm.layout(), Some(StringLayout::Libcxx));
        let tpu = votes(&[
            "_ZNSt3__u12basic_stringIcNS_11char_traitsIcEENS_9allocatorIcEEE6resizeEmc",
            "_ZNSt3__u6vectorIiNS_9allocatorIiEEE7reserveEm",
        ]);
        assert_eq!(tpu.layout(), Some(StringLayout::LibcxxAlternate));
        assert_eq!(votes(&["_ZN3foo3barEv", "main"]).layout(), None);
        assert_eq!(
            votes(&["_ZNSt6__ndk112basic_stringIcEE"]).layout(),
            Some(StringLayout::Libcxx)
        );
    }

    #[test]
    fn this_process_has_no_recorder() {
        let found = discover(std::process::id()).unwrap();
        assert!(found.objects > 0);
        assert!(found.recorders.is_empty());
        assert!(found.unusable.is_empty());
        assert!(found.python_gates.is_empty() && found.python_gates_in_python.is_empty());
    }
}
