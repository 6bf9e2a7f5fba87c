//! Symbol resolution: the one place that reads ELF symbol tables and turns
//! an object file's addresses into addresses inside a running process.
//!
//! - [`elf`]: a memory-mapped ELF object; finds named symbols in `.symtab`
//!   and `.dynsym` (real wheels keep the ones we need as local `.symtab`
//!   symbols only) and maps virtual addresses to file offsets (uprobes are
//!   attached by file offset);
//! - [`maps`]: the objects a process has mapped (`/proc/PID/maps`), how to
//!   open the very file that is mapped, and where it was loaded;
//! - [`unwind`]: sampled user stacks unwound with the objects' call frame
//!   information (framehop);
//! - [`stacks`]: names, inlined functions and lines for the addresses of
//!   sampled stacks (blazesym, on a thread of its own: `symbolizer_thread`).

pub mod elf;
pub mod maps;
pub mod python;
pub mod stacks;
mod symbolizer_thread;
#[cfg(target_arch = "x86_64")]
pub mod unwind;

pub use elf::{ElfObject, FoundSymbol, LoadSegment, SymbolScan};
pub use maps::{MappedObject, Mapping, ObjectFile, mapped_objects};
