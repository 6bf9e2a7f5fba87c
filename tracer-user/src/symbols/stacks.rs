//! Names for the addresses of sampled stacks, with blazesym: functions
//! (demangled), the functions inlined at an address, and file:line where
//! the object has debug information. User addresses are resolved in the
//! sampled process (its mappings, while it runs), kernel ones from
//! `/proc/kallsyms`.

use std::{collections::HashMap, sync::Arc};

use blazesym::{
    Pid,
    symbolize::{
        CodeInfo, Input, Symbolized, Symbolizer,
        source::{Kernel, Process, Source},
    },
};

use crate::collect::StackSample;

/// Whose address space an address is in.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Space {
    Kernel,
    Process(u32),
}

/// One function at an address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
}

/// What is at one address: the functions inlined there, innermost first,
/// then the function the address is in. Empty where nothing is known.
#[derive(Clone, Debug, Default)]
pub struct Symbol {
    pub frames: Vec<Frame>,
    /// The object the address is in, where known.
    pub module: Option<String>,
}

/// Resolves addresses, each once per address space, and keeps the
/// answers (a capture that lives on, such as the flight recorder, asks
/// again for the same addresses).
#[derive(Default)]
pub struct StackSymbolizer {
    cache: HashMap<(Space, u64), Arc<Symbol>>,
}

/// The address to look up for frame `depth` of a stack: every frame past
/// the innermost is a return address, which may already be the next
/// line's (or, after a call that does not return, the next function's).
pub fn lookup_address(depth: usize, address: u64) -> u64 {
    if depth == 0 {
        address
    } else {
        address.saturating_sub(1)
    }
}

/// A sample's stack as the addresses to look up: kernel frames, then user
/// frames, innermost first.
pub fn sample_frames(sample: &StackSample) -> Vec<(Space, u64)> {
    let kernel = sample
        .kernel
        .iter()
        .enumerate()
        .map(|(depth, a)| (Space::Kernel, lookup_address(depth, *a)));
    let user = sample
        .user
        .iter()
        .enumerate()
        .map(|(depth, a)| (Space::Process(sample.tgid), lookup_address(depth, *a)));
    kernel.chain(user).collect()
}

fn frame(function: &str, code_info: Option<&CodeInfo<'_>>) -> Frame {
    Frame {
        function: function.to_string(),
        file: code_info.map(|c| c.to_path().display().to_string()),
        line: code_info.and_then(|c| c.line),
    }
}

impl StackSymbolizer {
    /// Resolves every address of `stacks` (see [`sample_frames`]), one
    /// batch per address space.
    pub fn resolve_stacks<'a>(&mut self, stacks: impl IntoIterator<Item = &'a [(Space, u64)]>) {
        let mut by_space: HashMap<Space, Vec<u64>> = HashMap::new();
        for stack in stacks {
            for (space, address) in stack {
                by_space.entry(*space).or_default().push(*address);
            }
        }
        for (space, addresses) in by_space {
            self.resolve(space, addresses);
        }
    }

    /// Resolves `addresses` of `space` (lookup addresses, see
    /// [`lookup_address`]) and keeps the answers for [`Self::get`]. An
    /// address that cannot be resolved (the process exited, the object has
    /// no symbols) gets an empty [`Symbol`].
    pub fn resolve(&mut self, space: Space, addresses: impl IntoIterator<Item = u64>) {
        let mut wanted: Vec<u64> = addresses
            .into_iter()
            .filter(|a| !self.cache.contains_key(&(space, *a)))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        if wanted.is_empty() {
            return;
        }
        let source = match space {
            Space::Kernel => Source::Kernel(Kernel::default()),
            Space::Process(pid) => Source::Process(Process::new(Pid::from(pid))),
        };
        // blazesym's symbolizer keeps the objects it parsed: it lives for
        // one batch, so that nothing of a target's libraries stays in
        // memory between captures (and so that this type can move between
        // threads, which blazesym's cannot).
        let symbolizer = Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .build();
        let found = symbolizer
            .symbolize(&source, Input::AbsAddr(&wanted))
            .unwrap_or_default();
        for (i, address) in wanted.into_iter().enumerate() {
            let symbol = match found.get(i) {
                Some(Symbolized::Sym(sym)) => {
                    let mut frames: Vec<Frame> = sym
                        .inlined
                        .iter()
                        .rev()
                        .map(|f| frame(&f.name, f.code_info.as_ref()))
                        .collect();
                    frames.push(frame(&sym.name, sym.code_info.as_deref()));
                    Symbol {
                        frames,
                        module: sym
                            .module
                            .as_ref()
                            .map(|m| m.to_string_lossy().into_owned()),
                    }
                }
                _ => Symbol::default(),
            };
            self.cache.insert((space, address), Arc::new(symbol));
        }
    }

    /// What [`Self::resolve`] found at `address` of `space`.
    pub fn get(&self, space: Space, address: u64) -> Arc<Symbol> {
        self.cache
            .get(&(space, address))
            .cloned()
            .unwrap_or_default()
    }
}
