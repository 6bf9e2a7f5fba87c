//! The C library functions a session calls in the target, found in the
//! dynamic symbol tables of the libraries the target has mapped, and room
//! for the trampoline's code.

use std::ops::Range;

use super::InjectError;
use crate::symbols::{ElfObject, FoundSymbol, MappedObject, mapped_objects, maps::page_size};

/// Addresses, in the target, of the functions a session calls.
#[derive(Clone, Copy, Debug)]
pub struct TargetFns {
    pub dlopen: u64,
    pub dlsym: u64,
    pub dlclose: u64,
    /// Absent with the private `__libc_dl*` of older glibc.
    pub dlerror: Option<u64>,
    /// `memfd_create`, or else `syscall` (see [`TargetFns::memfd_is_syscall`]).
    pub memfd_create: u64,
    pub memfd_is_syscall: bool,
    pub socketpair: u64,
    pub close: u64,
    /// Where the calling thread's `errno` lives (absent: not kept).
    pub errno_location: Option<u64>,
    /// Names the object an address is in (absent: a copy of the agent left
    /// in the process is not used again).
    pub dladdr: Option<u64>,
    /// Where the calling thread's `dlerror()` state lives, as a distance
    /// from its `errno` (glibc 2.34+ exports both thread-locals: they sit
    /// in the same block); absent: not kept.
    pub dlerror_state_from_errno: Option<i64>,
}

/// Flags of glibc's private `__libc_dlopen_mode` that make it act as
/// `dlopen` called from the program: `__RTLD_DLOPEN`.
pub const LIBC_DLOPEN_MODE_FLAG: u64 = 0x8000_0000;

/// The functions looked up, then the C library's thread-locals.
const NAMES: [&str; 15] = [
    "dlopen",
    "dlsym",
    "dlclose",
    "dlerror",
    "memfd_create",
    "syscall",
    "socketpair",
    "close",
    "__libc_dlopen_mode",
    "__libc_dlsym",
    "__libc_dlclose",
    "__errno_location",
    "dladdr",
    "errno",
    "__libc_dlerror_result",
];

/// How many of [`NAMES`] are functions; the rest are thread-locals.
const FUNCTIONS: usize = 13;

/// Whether `obj` is a C library or dynamic loader worth searching.
fn is_libc(obj: &MappedObject) -> bool {
    let name = obj.file_name();
    ["libc.so", "libc-", "libdl.so", "libdl-", "ld-musl"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// Finds the functions in the C library (and `libdl`) mapped by `pid`.
pub fn resolve(pid: u32) -> Result<TargetFns, InjectError> {
    let objects = mapped_objects(pid).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InjectError::NoSuchProcess { pid },
        _ => InjectError::Io {
            context: format!("reading /proc/{pid}/maps"),
            source: e,
        },
    })?;
    let mut found: [Option<u64>; NAMES.len()] = [None; NAMES.len()];
    for obj in objects.iter().filter(|o| is_libc(o)) {
        let Ok(elf) = ElfObject::open(&obj.open_path(), Some(obj.inode)) else {
            continue;
        };
        let Some(bias) = obj.load_bias(elf.segments(), page_size()) else {
            continue;
        };
        let Ok(scan) = elf.scan(&NAMES, |_| false) else {
            continue;
        };
        for (i, (slot, sym)) in found.iter_mut().zip(&scan.found).enumerate() {
            let wanted = |s: &FoundSymbol| {
                s.exported
                    && (if i < FUNCTIONS {
                        s.function
                    } else {
                        s.thread_local
                    })
            };
            if let Some(sym) = sym.filter(wanted) {
                // A thread-local's value is its offset in the object's
                // block, which the two are compared by.
                let at = if i < FUNCTIONS { bias } else { 0 };
                slot.get_or_insert(at.wrapping_add(sym.vaddr));
            }
        }
        if found[FUNCTIONS].is_some() != found[FUNCTIONS + 1].is_some() {
            // Both from one object or neither.
            found[FUNCTIONS] = None;
            found[FUNCTIONS + 1] = None;
        }
    }
    let [
        dlopen,
        dlsym,
        dlclose,
        dlerror,
        memfd,
        syscall,
        socketpair,
        close,
        p_open,
        p_sym,
        p_close,
        errno_location,
        dladdr,
        errno,
        dlerror_state,
    ] = found;
    let no_loader = || InjectError::NoLoader { pid };
    let (dlopen, dlsym, dlclose, dlerror) = match (dlopen, dlsym, dlclose) {
        (Some(o), Some(s), Some(c)) => (o, s, c, dlerror),
        _ => (
            p_open.ok_or_else(no_loader)?,
            p_sym.ok_or_else(no_loader)?,
            p_close.ok_or_else(no_loader)?,
            None,
        ),
    };
    let (memfd_create, memfd_is_syscall) = match (memfd, syscall) {
        (Some(m), _) => (m, false),
        (None, Some(s)) => (s, true),
        _ => return Err(no_loader()),
    };
    Ok(TargetFns {
        dlopen,
        dlsym,
        dlclose,
        dlerror,
        memfd_create,
        memfd_is_syscall,
        socketpair: socketpair.ok_or_else(no_loader)?,
        close: close.ok_or_else(no_loader)?,
        errno_location,
        dladdr,
        dlerror_state_from_errno: errno
            .zip(dlerror_state)
            .map(|(e, d)| d.wrapping_sub(e) as i64),
    })
}

/// Allocators that programs preload in place of the C library's
/// `malloc`: the loader's calls allocate through them.
const ALLOCATORS: [&str; 4] = [
    "libtcmalloc",
    "libjemalloc",
    "libmimalloc",
    "libc_malloc_debug",
];

/// Whether a thread stopped in `obj`'s code may hold a lock the agent's
/// loading needs: the C library (with `libdl` and `libpthread`), the
/// dynamic loader, and a `malloc` put in their place.
fn is_runtime(obj: &MappedObject) -> bool {
    let name = obj.file_name();
    is_libc(obj)
        || name.starts_with("ld-")
        || name.starts_with("libpthread")
        || ALLOCATORS.iter().any(|a| name.starts_with(a))
}

/// The executable mappings of the code [`is_runtime`] names in `pid`: a
/// thread stopped in them may hold their locks (see
/// [`super::session::at_safe_point`]).
pub fn runtime_code(pid: u32) -> Result<Vec<Range<u64>>, InjectError> {
    let objects = mapped_objects(pid).map_err(|e| InjectError::Io {
        context: format!("reading /proc/{pid}/maps"),
        source: e,
    })?;
    Ok(objects
        .iter()
        .filter(|o| is_runtime(o))
        .flat_map(|o| &o.mappings)
        .filter(|m| m.perms.contains('x'))
        .map(|m| m.start..m.end)
        .collect())
}

/// Where `len` bytes of code can go in `pid`: the unused tail of the last
/// page of an executable segment (file bytes past the segment, never run),
/// 16-byte aligned. The dynamic loader and the C library, never unloaded,
/// are tried first; the same place is found every time.
pub fn code_room(pid: u32, len: u64) -> Result<u64, InjectError> {
    let mut objects = mapped_objects(pid).map_err(|e| InjectError::Io {
        context: format!("reading /proc/{pid}/maps"),
        source: e,
    })?;
    // The agent's own library goes away in the middle of an unload.
    objects.retain(|o| !o.path.contains(super::MEMFD_NAME));
    objects.sort_by_key(|o| {
        let name = o.file_name();
        (!name.starts_with("ld-"), !is_libc(o))
    });
    let page = page_size();
    for obj in &objects {
        let Ok(elf) = ElfObject::open(&obj.open_path(), Some(obj.inode)) else {
            continue;
        };
        let Some(bias) = obj.load_bias(elf.segments(), page) else {
            continue;
        };
        for seg in elf.segments().iter().filter(|s| s.executable) {
            let end = bias.wrapping_add(seg.vaddr).wrapping_add(seg.memsz);
            let at = end.next_multiple_of(16);
            let page_end = end.next_multiple_of(page);
            let mapped_x = obj
                .mappings
                .iter()
                .any(|m| m.perms.contains('x') && m.start <= at && at + len <= m.end);
            if at + len <= page_end && mapped_x {
                return Ok(at);
            }
        }
    }
    Err(InjectError::TargetCall {
        pid,
        call: "placing the trampoline",
        detail: "no executable page of a mapped library has room left".into(),
    })
}
