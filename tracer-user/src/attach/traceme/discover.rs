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

use std::time::{Duration, Instant};

use super::{
    facts::{GateFacts, ObjectFacts, facts_of, search_again},
    recorder_symbols::{NAMESPACES, StringLayout},
};
use crate::symbols::{ElfObject, MappedObject, ObjectFile, mapped_objects, maps::page_size};

/// One TraceMe recorder in a process.
#[derive(Clone, Debug)]
pub struct Recorder {
    /// The process.
    pub pid: u32,
    /// The object's path as the process sees it.
    pub object: String,
    /// Where ebtrace opens (and attaches to) that very file.
    pub open_path: ObjectFile,
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
    path: ObjectFile,
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

    #[test]
    fn this_process_has_no_recorder() {
        let found = discover(std::process::id()).unwrap();
        assert!(found.objects > 0);
        assert!(found.recorders.is_empty());
        assert!(found.unusable.is_empty());
        assert!(found.python_gates.is_empty() && found.python_gates_in_python.is_empty());
    }
}
