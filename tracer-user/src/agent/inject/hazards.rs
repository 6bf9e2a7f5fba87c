//! Where a thread must not be taken over, judged from its whole stack (the
//! innermost instruction alone, [`super::session::at_safe_point`], misses a
//! thread that waits inside such code): the dynamic loader (a `dlopen`, a
//! library's constructor), any allocator's entry points (the C library's
//! `malloc`, or one that a program or a tool interposes: tcmalloc, jemalloc,
//! memray, heaptrack, ASAN, its own), a signal handler, and the C library's
//! set-id calls. The agent's loading allocates, takes the loader's lock and
//! starts a thread: a thread inside one of those may hold a lock the
//! loading then waits for, for ever.

use std::{fmt, ops::Range};

use super::{InjectError, ptrace::Regs, ptrace::Tracee};
use crate::symbols::{
    ElfObject, mapped_objects,
    maps::page_size,
    unwind::{StackUnwinder, UserStack},
};

/// The allocators' entry points, by the names any of them exports.
const ALLOCATOR_FUNCTIONS: [&str; 22] = [
    "malloc",
    "free",
    "calloc",
    "realloc",
    "reallocarray",
    "memalign",
    "posix_memalign",
    "aligned_alloc",
    "valloc",
    "pvalloc",
    "malloc_usable_size",
    "__libc_malloc",
    "__libc_free",
    "__libc_calloc",
    "__libc_realloc",
    "__libc_memalign",
    "_Znwm",
    "_Znam",
    "_ZdlPv",
    "_ZdaPv",
    "_ZdlPvm",
    "_ZdaPvm",
];

/// The C library's calls that change the process's ids: in a multithreaded
/// program each holds the lock on the cache of thread stacks while it waits
/// for every other thread to change its own ids, and starting or joining a
/// thread (the agent's) takes that lock.
const SET_ID_FUNCTIONS: [&str; 9] = [
    "setuid",
    "setgid",
    "seteuid",
    "setegid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setgroups",
];

/// The code a signal handler returns through (`__restore_rt`:
/// `rt_sigreturn`): glibc's `mov $15, %rax; syscall`, musl's
/// `mov $15, %eax; syscall`.
const RESTORERS: [&[u8]; 2] = [
    &[0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05],
    &[0xb8, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05],
];

/// How much of a thread's stack is read to unwind it: the first copy, and
/// the larger one for a stack the first did not hold whole.
const STACK_COPY: usize = 64 * 1024;
const DEEP_STACK_COPY: usize = 1024 * 1024;
/// How far past the program's entry point its `_start` may call the C
/// library's start (`__libc_start_main`).
const ENTRY_CODE: u64 = 64;
/// Frames looked at: far more than a sample keeps, for a deep recursion.
const MAX_FRAMES: usize = 16 * 1024;

/// Why a thread was not taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Stopped in the C library or the loader, or in a syscall that a stop
    /// would end (see [`super::session::at_safe_point`]).
    Busy,
    /// The dynamic loader is on its stack.
    InLoader,
    /// An allocator is on its stack.
    InAllocator,
    /// A signal handler is on its stack.
    InSignalHandler,
    /// A set-id call of the C library is on its stack.
    InSetId,
    /// Its stack could not be unwound to its outermost frame: what is
    /// beyond may be any of the above.
    StackUnknown,
}

/// How often each refusal happened, for the error that says no thread
/// could be taken over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refusals {
    pub busy: u32,
    pub in_loader: u32,
    pub in_allocator: u32,
    pub in_signal_handler: u32,
    pub in_set_id: u32,
    pub stack_unknown: u32,
}

impl Refusals {
    pub fn count(&mut self, refusal: Refusal) {
        match refusal {
            Refusal::Busy => self.busy += 1,
            Refusal::InLoader => self.in_loader += 1,
            Refusal::InAllocator => self.in_allocator += 1,
            Refusal::InSignalHandler => self.in_signal_handler += 1,
            Refusal::InSetId => self.in_set_id += 1,
            Refusal::StackUnknown => self.stack_unknown += 1,
        }
    }
}

impl fmt::Display for Refusals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts = [
            (
                self.busy,
                "inside the C library or the loader, or in a syscall the kernel does not restart",
            ),
            (self.in_loader, "with the dynamic loader on its stack"),
            (self.in_allocator, "with an allocator on its stack"),
            (self.in_signal_handler, "in a signal handler"),
            (
                self.in_set_id,
                "changing the process's ids (setuid() and the like)",
            ),
            (
                self.stack_unknown,
                "with a stack that could not be unwound to its outermost frame",
            ),
        ];
        let mut first = true;
        for (n, what) in parts.into_iter().filter(|(n, _)| *n > 0) {
            write!(f, "{}{n} {what}", if first { "" } else { ", " })?;
            first = false;
        }
        if first {
            write!(f, "no thread to try")?;
        }
        Ok(())
    }
}

/// What a process's stacks are checked against.
pub struct Hazards {
    pid: u32,
    /// The C library's and the loader's code, and the known allocators'.
    pub runtime: Vec<Range<u64>>,
    loader: Vec<Range<u64>>,
    allocators: Vec<Range<u64>>,
    set_id: Vec<Range<u64>>,
    restorers: Vec<u64>,
    /// Every executable mapping, a file's or not (JIT code).
    executable: Vec<Range<u64>>,
    /// Where a whole stack ends: the C library's code (`clone3`, `clone`
    /// and `start_thread` begin every other thread) and the program's
    /// entry point (`_start` begins its main thread).
    roots: Vec<Range<u64>>,
    unwinder: StackUnwinder,
}

impl Hazards {
    /// Reads `pid`'s mapped objects for the code above.
    pub fn of(pid: u32) -> Result<Self, InjectError> {
        let runtime = super::symbols::runtime_code(pid)?;
        let objects = mapped_objects(pid).map_err(|e| InjectError::Io {
            context: format!("reading /proc/{pid}/maps"),
            source: e,
        })?;
        let mut hazards = Hazards {
            pid,
            runtime,
            loader: Vec::new(),
            allocators: Vec::new(),
            set_id: Vec::new(),
            restorers: Vec::new(),
            executable: executable_mappings(pid)?,
            roots: crate::procfs::entry_point(pid)
                .map(|entry| entry..entry + ENTRY_CODE)
                .into_iter()
                .collect(),
            unwinder: StackUnwinder::default(),
        };
        for obj in &objects {
            let name = obj.file_name();
            let code = obj
                .mappings
                .iter()
                .filter(|m| m.perms.contains('x'))
                .map(|m| m.start..m.end);
            if name.starts_with("ld-") {
                hazards.loader.extend(code.clone());
            }
            let c_library = name.starts_with("libc.so")
                || name.starts_with("libc-")
                || name.starts_with("ld-musl");
            if c_library {
                hazards.roots.extend(code.clone());
                for range in code {
                    hazards.restorers.extend(restorers_in(pid, range));
                }
            }
            let Ok(elf) = ElfObject::open(&obj.open_path(), Some(obj.inode)) else {
                continue;
            };
            let Some(bias) = obj.load_bias(elf.segments(), page_size()) else {
                continue;
            };
            let functions = |names: &[&str]| -> Vec<Range<u64>> {
                let Ok(scan) = elf.scan_exported(names) else {
                    return Vec::new();
                };
                scan.found
                    .iter()
                    .flatten()
                    .filter(|s| s.exported && s.function)
                    .map(|s| {
                        let start = bias.wrapping_add(s.vaddr);
                        start..start.wrapping_add(s.size.max(1))
                    })
                    .collect()
            };
            hazards.allocators.extend(functions(&ALLOCATOR_FUNCTIONS));
            if c_library {
                hazards.set_id.extend(functions(&SET_ID_FUNCTIONS));
            }
        }
        // Reads the process's objects for the unwinder now, not while a
        // thread is stopped.
        let _ = hazards.unwinder.unwind(
            pid,
            &UserStack {
                ip: 0,
                sp: 0,
                bp: 0,
                bytes: &[],
            },
        );
        Ok(hazards)
    }

    /// Why the thread `tracee`, stopped with `regs`, must not be taken
    /// over; `None` if its stack holds none of the code above (or cannot
    /// be unwound: then its innermost instruction alone decides).
    /// Fails closed: a stack that cannot be unwound whole is refused, as
    /// what lies beyond the frames read may hold any of the hazards.
    pub fn on_stack(&mut self, tracee: &Tracee, regs: &Regs) -> Option<Refusal> {
        let mut unwound = None;
        for copy in [STACK_COPY, DEEP_STACK_COPY] {
            let stack = read_stack(tracee, regs.rsp, copy);
            unwound = self.unwinder.unwind_at_most(
                self.pid,
                &UserStack {
                    ip: regs.rip,
                    sp: regs.rsp,
                    bp: regs.rbp,
                    bytes: &stack,
                },
                MAX_FRAMES,
            );
            let held_whole = stack.len() < copy;
            if held_whole || unwound.as_ref().is_some_and(|u| u.complete) {
                break;
            }
        }
        let Some(unwound) = unwound else {
            return Some(Refusal::StackUnknown);
        };
        let within =
            |ranges: &[Range<u64>], address: u64| ranges.iter().any(|r| r.contains(&address));
        for (i, &frame) in unwound.frames.iter().enumerate() {
            // A return address points just past its call.
            let address = if i == 0 { frame } else { frame.wrapping_sub(1) };
            // A frame outside all code: the unwind went astray, and what
            // lies beyond is not known.
            if !within(&self.executable, address) {
                return Some(Refusal::StackUnknown);
            }
            if self.restorers.iter().any(|&r| (r..r + 16).contains(&frame)) {
                return Some(Refusal::InSignalHandler);
            }
            if within(&self.loader, address) {
                return Some(Refusal::InLoader);
            }
            if within(&self.allocators, address) {
                return Some(Refusal::InAllocator);
            }
            if within(&self.set_id, address) {
                return Some(Refusal::InSetId);
            }
        }
        let rooted = unwound.frames.last().is_some_and(|&outermost| {
            within(&self.roots, outermost) || within(&self.roots, outermost.wrapping_sub(1))
        });
        (!unwound.complete || !rooted).then_some(Refusal::StackUnknown)
    }
}

/// The ranges of `pid`'s executable mappings.
fn executable_mappings(pid: u32) -> Result<Vec<Range<u64>>, InjectError> {
    let maps = crate::procfs::maps_text(pid).map_err(|e| InjectError::Io {
        context: format!("reading /proc/{pid}/maps"),
        source: e,
    })?;
    Ok(maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (range, perms) = (fields.next()?, fields.next()?);
            let (start, end) = range.split_once('-')?;
            perms
                .contains('x')
                .then_some(u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?)
        })
        .collect())
}

/// The top of the stack from `sp` up: up to `copy` bytes, less where the
/// stack's mapping ends first.
fn read_stack(tracee: &Tracee, sp: u64, copy: usize) -> Vec<u8> {
    const PAGE: usize = 4096;
    let mut bytes = Vec::with_capacity(copy);
    let mut at = sp;
    while bytes.len() < copy {
        let len = (PAGE - (at as usize % PAGE)).min(copy - bytes.len());
        let mut chunk = vec![0u8; len];
        if tracee.read(at, &mut chunk).is_err() {
            break;
        }
        bytes.extend_from_slice(&chunk);
        at += len as u64;
    }
    bytes
}

/// How much of a C library's code is searched for signal restorers: a
/// real one's is a few MiB; a mapping named like one may be any size.
const C_LIBRARY_CODE_AT_MOST: u64 = 64 << 20;
/// How much of it is read at a time.
const RESTORER_SEARCH_CHUNK: usize = 1 << 20;

/// Addresses of signal restorers in `pid`'s code `range` (a C library's),
/// searched in its first [`C_LIBRARY_CODE_AT_MOST`] bytes, until a page
/// does not read (a mapping may reach past its file's end).
fn restorers_in(pid: u32, range: Range<u64>) -> Vec<u64> {
    let overlap = RESTORERS.iter().map(|p| p.len()).max().unwrap_or(1) - 1;
    let end = range
        .end
        .min(range.start.saturating_add(C_LIBRARY_CODE_AT_MOST));
    let mut found = Vec::new();
    let mut chunk = vec![0u8; RESTORER_SEARCH_CHUNK + overlap];
    let mut at = range.start;
    while at < end {
        let len = ((end - at) as usize).min(chunk.len());
        let code = &mut chunk[..len];
        if crate::procfs::read_memory(pid, at, code).is_err() {
            break;
        }
        found.extend(
            RESTORERS
                .iter()
                .flat_map(|pattern| memchr::memmem::find_iter(code, pattern))
                .map(|offset| at + offset as u64),
        );
        if len < chunk.len() {
            break;
        }
        at += (len - overlap) as u64;
    }
    found.sort_unstable();
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_say_why_each_thread_was_let_go() {
        let mut r = Refusals::default();
        assert_eq!(r.to_string(), "no thread to try");
        r.count(Refusal::InAllocator);
        r.count(Refusal::InAllocator);
        r.count(Refusal::Busy);
        assert_eq!(
            r.to_string(),
            "1 inside the C library or the loader, or in a syscall the kernel does not restart, \
             2 with an allocator on its stack"
        );
    }

    #[test]
    fn this_process_s_c_library_has_a_signal_restorer() {
        let pid = std::process::id();
        let hazards = Hazards::of(pid).unwrap();
        assert!(!hazards.restorers.is_empty());
        assert!(!hazards.loader.is_empty());
        // The C library's malloc, at least, and its set-id calls.
        assert!(!hazards.allocators.is_empty());
        assert_eq!(hazards.set_id.len(), SET_ID_FUNCTIONS.len());
    }
}
