//! The C library functions a session calls in the target, found in the
//! dynamic symbol tables of the libraries the target has mapped, and a
//! `syscall` instruction to run the first syscalls through.

use std::{fs::File, os::unix::fs::FileExt as _};

use super::InjectError;
use crate::symbols::{ElfObject, MappedObject, mapped_objects, maps::page_size};

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
    /// A `syscall` instruction in an executable mapping of the C library.
    pub syscall_insn: u64,
}

/// Flags of glibc's private `__libc_dlopen_mode` that make it act as
/// `dlopen` called from the program: `__RTLD_DLOPEN`.
pub const LIBC_DLOPEN_MODE_FLAG: u64 = 0x8000_0000;

const NAMES: [&str; 11] = [
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
];

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
    let mut libc_obj = None;
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
        for (slot, sym) in found.iter_mut().zip(&scan.found) {
            if let Some(sym) = sym.filter(|s| s.exported && s.function) {
                slot.get_or_insert(bias.wrapping_add(sym.vaddr));
            }
        }
        if scan.found[7].is_some() && libc_obj.is_none() {
            libc_obj = Some(obj);
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
    let libc_obj = libc_obj.ok_or_else(no_loader)?;
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
        syscall_insn: find_syscall_insn(pid, libc_obj)?,
    })
}

/// The address of a `syscall` instruction (0f 05) in the C library's code.
fn find_syscall_insn(pid: u32, libc_obj: &MappedObject) -> Result<u64, InjectError> {
    let mem = File::open(format!("/proc/{pid}/mem")).map_err(|e| InjectError::Io {
        context: format!("opening /proc/{pid}/mem"),
        source: e,
    })?;
    let mut buf = vec![0u8; 256 * 1024];
    for m in libc_obj.mappings.iter().filter(|m| m.perms.contains('x')) {
        let mut at = m.start;
        while at < m.end {
            let len = ((m.end - at) as usize).min(buf.len());
            let Ok(n) = mem.read_at(&mut buf[..len], at) else {
                break;
            };
            if n == 0 {
                break;
            }
            if let Some(i) = memchr::memmem::find(&buf[..n], &[0x0f, 0x05]) {
                return Ok(at + i as u64);
            }
            // Keep the last byte: an instruction may straddle chunks.
            at += (n as u64).saturating_sub(1).max(1);
        }
    }
    Err(InjectError::NoLoader { pid })
}
