//! Kernel names: the names lookups gave function handles (copied by the
//! probes, or asked of the driver), demangled, and the handles launched
//! that none of them names.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
};

use tracer_common::cuda::CudaSymbol;

use super::CudaTimelineBuilder;
use crate::{
    collect::Record,
    cuda_api::{self, CallArgs},
};

/// A kernel's name.
#[derive(Clone, Debug)]
pub(super) struct Symbol {
    /// Demangled where possible.
    name: Arc<str>,
    mangled: Option<Arc<str>>,
}

/// A name copied by the probe: up to the NUL, marked when cut short.
fn symbol_from(rec: &CudaSymbol) -> Option<Symbol> {
    let len = (rec.len as usize).min(rec.name.len());
    let bytes = &rec.name[..len];
    let bytes = &bytes[..bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len())];
    if bytes.is_empty() {
        return None;
    }
    let raw = String::from_utf8_lossy(bytes).into_owned();
    if rec.truncated != 0 {
        return Some(Symbol {
            name: format!("{raw}…").into(),
            mangled: Some(raw.into()),
        });
    }
    Some(symbol_named(raw))
}

/// A whole symbol name, demangled where it is mangled.
fn symbol_named(raw: String) -> Symbol {
    match demangle(&raw) {
        Some(name) => Symbol {
            name: name.into(),
            mangled: Some(raw.into()),
        },
        None => Symbol {
            name: raw.into(),
            mangled: None,
        },
    }
}

/// The function handles that successful launches among `records` ran and
/// no symbol record among them names, by process: the kernels the
/// program looked up before the capture.
pub fn unnamed_kernels(records: impl IntoIterator<Item = Record>) -> BTreeMap<u32, BTreeSet<u64>> {
    let mut named = HashSet::new();
    let mut launched: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for r in records {
        match &r {
            Record::CudaSymbol(s) if symbol_from(s).is_some() => {
                named.insert((s.tgid, s.handle));
            }
            Record::CudaCall(c) if c.result == 0 => {
                if let Some(f) = cuda_api::function(c.function)
                    .and_then(|function| CallArgs::decode(function, c).launched_function())
                {
                    launched.entry(c.tgid).or_default().insert(f);
                }
            }
            _ => {}
        }
    }
    for (pid, handles) in &mut launched {
        handles.retain(|h| *h != 0 && !named.contains(&(*pid, *h)));
    }
    launched.retain(|_, handles| !handles.is_empty());
    launched
}

/// Demangles an Itanium C++ name (`_Z...`); `None` for C names.
pub fn demangle(name: &str) -> Option<String> {
    if !name.starts_with("_Z") {
        return None;
    }
    cpp_demangle::Symbol::new(name).ok()?.demangle().ok()
}

impl CudaTimelineBuilder {
    /// Names kernels as the driver inside their process named them
    /// (by `(pid, handle)`), where no symbol record of the capture does.
    pub fn add_driver_names(&mut self, names: &HashMap<(u32, u64), String>) {
        for (&key, raw) in names {
            self.symbols
                .entry(key)
                .or_insert_with(|| symbol_named(raw.clone()));
        }
    }

    /// Notes the kernel name a `cuModuleGetFunction` or `cuLibraryGetKernel` lookup gave its
    /// handle.
    pub fn push_symbol(&mut self, rec: &CudaSymbol) {
        if let Some(symbol) = symbol_from(rec) {
            self.symbols.insert((rec.tgid, rec.handle), symbol);
        }
    }

    /// The name of kernel `handle` of process `pid`, and its mangled name;
    /// `<unresolved 0x…>` when no lookup named it.
    pub(super) fn kernel_name(&mut self, pid: u32, handle: u64) -> (Arc<str>, Option<Arc<str>>) {
        match self.symbols.get(&(pid, handle)) {
            Some(s) => (Arc::clone(&s.name), s.mangled.clone()),
            None => (
                self.texts.format(format_args!("<unresolved {handle:#x}>")),
                None,
            ),
        }
    }

    /// `cuKernelGetFunction`: the function `function` of process `pid`
    /// runs kernel `kernel`, and has its name.
    pub(super) fn name_function_of_kernel(&mut self, pid: u32, kernel: u64, function: u64) {
        if let Some(symbol) = self.symbols.get(&(pid, kernel)).cloned() {
            self.symbols.insert((pid, function), symbol);
        }
    }
}
