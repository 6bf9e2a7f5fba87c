//! A process's CPython interpreter, found from outside: the object that
//! holds `_PyRuntime` (libpython, or a statically linked executable), its
//! version, where its eval loop's code lies, the key its threads' states
//! are bound to, and where glibc keeps that key's data in a thread.

use std::ops::Range;

use super::{Memory, code::Types, layout::Layout};
use crate::{
    procfs::ProcessMemory,
    symbols::{ElfObject, MappedObject, mapped_objects, maps::page_size, unwind::cold_part_after},
};

/// The eval loop: each native frame in it runs Python frames.
const EVAL_FUNCTIONS: [&str; 2] = ["_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold"];
const RUNTIME: &str = "_PyRuntime";
const VERSION: &str = "Py_Version";
const TYPES: [&str; 3] = ["PyCode_Type", "PyUnicode_Type", "PyBytes_Type"];

/// `_Py_DebugOffsets` (3.13+) begins `_PyRuntime` with this cookie.
const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";

/// Most interpreters and threads looked at to find glibc's layout.
const MAX_INTERPRETERS: usize = 16;
const MAX_THREADS: usize = 4096;
/// Threads whose data must agree on glibc's layout.
const THREADS_CHECKED: usize = 8;
/// Where glibc's `specific_1stblock` may lie in `struct pthread` (0x310
/// in glibc 2.36); searched, so that other releases work.
const SPECIFIC_SEARCHED: Range<u64> = 0x100..0x1000;
const KEYS_PER_BLOCK: u32 = 32;
const MAX_KEYS: u32 = 1024;

/// A CPython interpreter in a running process.
#[derive(Clone, Debug)]
pub struct PythonRuntime {
    /// The process.
    pub pid: u32,
    /// `3.minor.micro`.
    pub version: String,
    /// Its structures.
    pub layout: Layout,
    /// The object that holds it, as the process maps it.
    pub object: String,
    /// Runtime addresses of the eval loop's code.
    pub eval: Vec<Range<u64>>,
    /// Runtime addresses of the types a code object's fields are checked against.
    pub types: Types,
    /// The `pthread_key_t` its threads' states are bound to.
    pub tss_key: u32,
    /// Offset of glibc's first block of thread-specific data from a
    /// thread's pointer.
    pub specific_offset: u32,
}

/// Why a process's Python frames cannot be read (it gets native stacks).
#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    /// A version ebtrace has no layout for.
    #[error("CPython {0} is not one ebtrace reads (3.10 to 3.14)")]
    UnknownVersion(String),
    /// A build without the GIL.
    #[error("CPython {0} is a free-threaded build, whose frames ebtrace does not read yet")]
    FreeThreaded(String),
    /// The runtime's memory did not read as expected.
    #[error("CPython {version} in {object}: {what}")]
    Unexpected {
        /// Its version.
        version: String,
        /// The object it is in.
        object: String,
        /// What did not check out.
        what: &'static str,
    },
    /// Its symbols or memory could not be read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What a symbol scan found of the interpreter's object.
struct Found {
    runtime: u64,
    version: Option<u64>,
    eval: Vec<Range<u64>>,
    types: Types,
}

impl PythonRuntime {
    /// The interpreter of `pid`, if it runs CPython (`Ok(None)`: it does
    /// not).
    pub fn find(pid: u32) -> Result<Option<PythonRuntime>, PythonError> {
        let objects = mapped_objects(pid)?;
        let Some((object, found)) = objects
            .iter()
            .filter(|o| looks_like_python(o.file_name()))
            .find_map(|o| Some((o, scan(o).ok()??)))
        else {
            return Ok(None);
        };
        let memory = ProcessMemory::open(pid)?;
        let (minor, version) = version_of(&memory, object, &found)?;
        let unexpected = |what| PythonError::Unexpected {
            version: version.clone(),
            object: object.file_name().to_string(),
            what,
        };
        let Some(mut layout) = Layout::of(minor) else {
            return Err(PythonError::UnknownVersion(version));
        };
        if minor >= 13 {
            read_debug_offsets(&memory, found.runtime, &mut layout, &version)?;
        }
        let key = tss_key(&memory, found.runtime, &layout)
            .ok_or_else(|| unexpected("its thread-state key is not set up"))?;
        let specific_offset =
            specific_offset(&memory, found.runtime, &layout, key).ok_or_else(|| {
                unexpected("its threads' states were not found in glibc's thread data")
            })?;
        Ok(Some(PythonRuntime {
            pid,
            version,
            layout,
            object: object.path.clone(),
            eval: found.eval,
            types: found.types,
            tss_key: key,
            specific_offset,
        }))
    }

    /// What the stack programs need to walk its threads' frames.
    pub fn walk(&self) -> tracer_common::python::PythonProcess {
        tracer_common::python::PythonProcess {
            specific_offset: self.specific_offset,
            tss_key: self.tss_key,
            offsets: self.layout.walk,
        }
    }

    /// Whether `address` (a lookup address) is in the eval loop.
    pub fn in_eval(&self, address: u64) -> bool {
        self.eval.iter().any(|r| r.contains(&address))
    }
}

impl Memory for ProcessMemory {
    fn read(&self, address: u64, out: &mut [u8]) -> bool {
        ProcessMemory::read(self, address, out)
    }
}

/// Whether an object's file name may hold an interpreter: `libpython3.X.so`
/// or a `python3.X` executable (checked by its symbols after).
pub fn looks_like_python(file_name: &str) -> bool {
    file_name.starts_with("libpython3") || file_name.starts_with("python")
}

/// The interpreter's symbols in `object`, if it holds `_PyRuntime`.
fn scan(object: &MappedObject) -> std::io::Result<Option<Found>> {
    let elf = ElfObject::open(&object.open_path(), Some(object.inode))?;
    let mut wanted = vec![RUNTIME, VERSION];
    wanted.extend(EVAL_FUNCTIONS);
    wanted.extend(TYPES);
    let scan = elf.scan(&wanted, |_| false)?;
    let Some(runtime) = scan.found[0] else {
        return Ok(None);
    };
    let Some(bias) = object.load_bias(elf.segments(), page_size()) else {
        return Ok(None);
    };
    let at = |i: usize| scan.found[i].map(|s| bias.wrapping_add(s.vaddr));
    let mut eval: Vec<Range<u64>> = scan.found[2..4]
        .iter()
        .flatten()
        .map(|s| s.vaddr..s.vaddr + s.size.max(1))
        .collect();
    // A stripped interpreter (Debian's, Ubuntu's) names only the eval
    // loop's hot part, and may run most of its opcodes in the cold one.
    if let (Some(hot), None) = (scan.found[2], scan.found[3]) {
        eval.extend(cold_part_after(&elf, hot.vaddr));
    }
    let eval = eval
        .into_iter()
        .map(|r| bias.wrapping_add(r.start)..bias.wrapping_add(r.end))
        .collect();
    Ok(Some(Found {
        runtime: bias.wrapping_add(runtime.vaddr),
        version: at(1),
        eval,
        types: Types {
            code: at(4),
            str: at(5),
            bytes: at(6),
        },
    }))
}

/// The interpreter's minor version and its `3.minor.micro`: `Py_Version`
/// (3.11+), else the object's file name (`libpython3.10.so.1.0`,
/// `python3.10`).
fn version_of(
    memory: &ProcessMemory,
    object: &MappedObject,
    found: &Found,
) -> Result<(u8, String), PythonError> {
    if let Some(hex) = found.version.and_then(|at| memory.u32_at(at)) {
        let (major, minor, micro) = (hex >> 24, (hex >> 16) & 0xff, (hex >> 8) & 0xff);
        let version = format!("{major}.{minor}.{micro}");
        if major != 3 {
            return Err(PythonError::UnknownVersion(version));
        }
        return Ok((minor as u8, version));
    }
    let name = object.file_name();
    let digits = name
        .trim_start_matches("libpython")
        .trim_start_matches("python")
        .strip_prefix("3.")
        .map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap_or("")
        });
    match digits.and_then(|d| d.parse::<u8>().ok()) {
        Some(minor) => Ok((minor, format!("3.{minor}"))),
        None => Err(PythonError::UnknownVersion(format!("in {name}"))),
    }
}

/// Where `_Py_DebugOffsets` of 3.`minor` keeps each offset ebtrace takes
/// from it (the struct grew between 3.13 and 3.14).
struct DebugPositions {
    runtime_interpreters_head: usize,
    interpreter_next: usize,
    interpreter_threads_head: usize,
    thread_next: usize,
    thread_frame: usize,
    thread_id: usize,
    thread_native_id: usize,
    frame_previous: usize,
    frame_code: usize,
    frame_instruction: usize,
    frame_owner: usize,
    code_filename: usize,
    code_name: usize,
    code_qualname: usize,
    code_linetable: usize,
    code_first_line: usize,
    code_adaptive: usize,
    ascii_data: usize,
}

impl DebugPositions {
    fn of(minor: u8) -> Option<DebugPositions> {
        match minor {
            13 => Some(DebugPositions {
                runtime_interpreters_head: 0x28,
                interpreter_next: 0x40,
                interpreter_threads_head: 0x48,
                thread_next: 0xa8,
                thread_frame: 0xb8,
                thread_id: 0xc0,
                thread_native_id: 0xc8,
                frame_previous: 0xe8,
                frame_code: 0xf0,
                frame_instruction: 0xf8,
                frame_owner: 0x108,
                code_filename: 0x118,
                code_name: 0x120,
                code_qualname: 0x128,
                code_linetable: 0x130,
                code_first_line: 0x138,
                code_adaptive: 0x158,
                ascii_data: 0x230,
            }),
            14 => Some(DebugPositions {
                runtime_interpreters_head: 0x28,
                interpreter_next: 0x40,
                interpreter_threads_head: 0x48,
                thread_next: 0xc0,
                thread_frame: 0xd0,
                thread_id: 0xd8,
                thread_native_id: 0xe0,
                frame_previous: 0x100,
                frame_code: 0x108,
                frame_instruction: 0x110,
                frame_owner: 0x120,
                code_filename: 0x140,
                code_name: 0x148,
                code_qualname: 0x150,
                code_linetable: 0x158,
                code_first_line: 0x160,
                code_adaptive: 0x180,
                ascii_data: 0x280,
            }),
            _ => None,
        }
    }
}

/// Bytes of `_Py_DebugOffsets` read: past the last position of any version.
const DEBUG_OFFSETS_BYTES: usize = 0x288;

/// Takes the offsets 3.13+ publishes at the start of `_PyRuntime` over the
/// table's, where they are sane; a free-threaded build is refused.
fn read_debug_offsets(
    memory: &ProcessMemory,
    runtime: u64,
    layout: &mut Layout,
    version: &str,
) -> Result<(), PythonError> {
    let Some(p) = DebugPositions::of(layout.minor) else {
        return Ok(());
    };
    let mut header = [0u8; DEBUG_OFFSETS_BYTES];
    if !memory.read(runtime, &mut header) || &header[..8] != DEBUG_COOKIE {
        return Ok(());
    }
    let at = |offset: usize| u64::from_le_bytes(header[offset..offset + 8].try_into().unwrap());
    if at(16) != 0 {
        return Err(PythonError::FreeThreaded(version.to_string()));
    }
    let small = |offset: usize| u16::try_from(at(offset)).ok().filter(|v| *v < 0x4000);
    let mut debug = *layout;
    let fields = [
        (
            &mut debug.runtime_interpreters_head,
            p.runtime_interpreters_head,
        ),
        (&mut debug.interpreter_next, p.interpreter_next),
        (
            &mut debug.interpreter_threads_head,
            p.interpreter_threads_head,
        ),
        (&mut debug.thread_next, p.thread_next),
        (&mut debug.code_filename, p.code_filename),
        (&mut debug.code_name, p.code_name),
        (&mut debug.code_linetable, p.code_linetable),
        (&mut debug.ascii_data, p.ascii_data),
    ];
    for (field, offset) in fields {
        *field = small(offset).map(u64::from).unwrap_or(*field);
    }
    let walk = &mut debug.walk;
    for (field, offset) in [
        (&mut walk.thread_frame, p.thread_frame),
        (&mut walk.thread_id, p.thread_id),
        (&mut walk.frame_previous, p.frame_previous),
        (&mut walk.frame_code, p.frame_code),
        (&mut walk.frame_instruction, p.frame_instruction),
        (&mut walk.frame_owner, p.frame_owner),
        (&mut walk.code_first_line, p.code_first_line),
    ] {
        *field = small(offset).unwrap_or(*field);
    }
    debug.code_qualname = small(p.code_qualname)
        .map(u64::from)
        .or(debug.code_qualname);
    debug.code_adaptive = small(p.code_adaptive)
        .map(u64::from)
        .or(debug.code_adaptive);
    debug.thread_native_id = small(p.thread_native_id)
        .map(u64::from)
        .or(debug.thread_native_id);
    if walk_end(&debug) <= u64::from(debug.walk.frame_bytes) {
        *layout = debug;
    }
    Ok(())
}

/// The end of the last frame field the walk reads.
fn walk_end(layout: &Layout) -> u64 {
    let w = &layout.walk;
    [
        (w.frame_code, 8),
        (w.frame_previous, 8),
        (w.frame_instruction, 8),
        (w.frame_owner, 1),
    ]
    .iter()
    .map(|(o, size)| u64::from(*o) + size)
    .max()
    .unwrap_or(0)
}

/// The interpreter's thread-state key, once initialised.
fn tss_key(memory: &ProcessMemory, runtime: u64, layout: &Layout) -> Option<u32> {
    let key_at = runtime + layout.runtime_tss_key;
    let initialised = memory.u32_at(key_at - 4)?;
    let key = memory.u32_at(key_at)?;
    (initialised == 1 && key < MAX_KEYS).then_some(key)
}

/// The thread states of the process's interpreters, with each one's
/// thread pointer (`thread_id`), the first [`THREADS_CHECKED`] found.
fn thread_states(memory: &ProcessMemory, runtime: u64, layout: &Layout) -> Vec<(u64, u64)> {
    let mut states = Vec::new();
    let mut interpreter = memory.u64_at(runtime + layout.runtime_interpreters_head);
    for _ in 0..MAX_INTERPRETERS {
        let Some(interp) = interpreter.filter(|a| *a != 0) else {
            break;
        };
        let mut thread = memory.u64_at(interp + layout.interpreter_threads_head);
        for _ in 0..MAX_THREADS {
            let Some(state) = thread.filter(|a| *a != 0) else {
                break;
            };
            let id = memory.u64_at(state + u64::from(layout.walk.thread_id));
            if let Some(id) = id.filter(|id| *id != 0) {
                states.push((state, id));
                if states.len() == THREADS_CHECKED {
                    return states;
                }
            }
            thread = memory.u64_at(state + layout.thread_next);
        }
        interpreter = memory.u64_at(interp + layout.interpreter_next);
    }
    states
}

/// Where glibc keeps thread-specific data in a thread: the offset from the
/// thread pointer at which the most thread states found are bound to
/// `key` (a state whose thread has just exited may be bound nowhere).
fn specific_offset(memory: &ProcessMemory, runtime: u64, layout: &Layout, key: u32) -> Option<u32> {
    let states = thread_states(memory, runtime, layout);
    let bound = |offset: u64| {
        states
            .iter()
            .filter(|&&(state, thread)| key_data(memory, thread, offset, key) == Some(state))
            .count()
    };
    let mut best = (0, 0);
    for offset in SPECIFIC_SEARCHED.step_by(8) {
        let n = bound(offset);
        if n > best.0 {
            best = (n, offset);
        }
    }
    (best.0 > 0).then(|| u32::try_from(best.1).ok()).flatten()
}

/// The data bound to `key` in the thread at `thread`, glibc's thread-specific
/// data being at `offset` from it (as `pthread_getspecific` reads it, and
/// the stack programs after it).
fn key_data(memory: &ProcessMemory, thread: u64, offset: u64, key: u32) -> Option<u64> {
    let specific = thread.checked_add(offset)?;
    let slot = if key < KEYS_PER_BLOCK {
        specific + 16 * u64::from(key)
    } else {
        let blocks = specific + 16 * u64::from(KEYS_PER_BLOCK);
        let block = memory.u64_at(blocks + 8 * u64::from(key / KEYS_PER_BLOCK))?;
        if block == 0 {
            return None;
        }
        block + 16 * u64::from(key % KEYS_PER_BLOCK)
    };
    memory.u64_at(slot + 8)
}
