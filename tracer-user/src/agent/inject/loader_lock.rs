//! Who holds the dynamic loader's locks: glibc keeps them (`dl_load_lock`,
//! `dl_load_write_lock`, `dl_load_tls_lock`) in its exported
//! `_rtld_global`, as recursive `pthread_mutex_t`s that name their owner.
//!
//! A call into `dlopen`, `dlsym` or `dlclose` that does not return in time
//! may be waiting to take one of them, or may hold one and wait for
//! something else (an allocator's lock, a file). Pulled out of the first,
//! the thread holds nothing; pulled out of the second, it would hold the
//! lock for ever and every later `dlopen` of the program would wait for
//! it. This tells the two apart, by the lock words themselves: the layout
//! of `_rtld_global` changes between glibc versions, a mutex's does not.

use std::ops::Range;

use super::{InjectError, ptrace::Tracee};
use crate::symbols::{ElfObject, mapped_objects, maps::page_size};

/// The bytes of `pthread_mutex_t` read: `__lock`, `__count`, `__owner`,
/// `__nusers`, `__kind`.
const MUTEX_WORDS: usize = 5;
/// The most of `_rtld_global` read for its locks: glibc's is a few KiB;
/// a loader's file the target controls may claim any size.
const LOADER_STATE_AT_MOST: u64 = 64 << 10;
/// `PTHREAD_MUTEX_RECURSIVE_NP`, in the low bits of `__kind`.
const RECURSIVE: i32 = 1;
const KIND_MASK: i32 = 3;
/// `__kind` flags above the type (elision, robust, PI, PP, private).
const KIND_FLAGS_AT_MOST: i32 = 0x3ff;

/// Where a target's loader keeps its locks.
#[derive(Clone, Debug)]
pub struct LoaderLocks {
    /// `_rtld_global`, in the target.
    state: Range<u64>,
}

impl LoaderLocks {
    /// The loader's state in `pid`: None where it is not glibc's (musl
    /// exports none), or where its file cannot be read.
    pub fn of(pid: u32) -> Option<Self> {
        let objects = mapped_objects(pid).ok()?;
        objects
            .iter()
            .filter(|o| o.file_name().starts_with("ld-linux"))
            .find_map(|obj| {
                let elf = ElfObject::open(&obj.open_path(), Some(obj.inode)).ok()?;
                let bias = obj.load_bias(elf.segments(), page_size())?;
                let scan = elf.scan_exported(&["_rtld_global"]).ok()?;
                let sym = scan.found[0]
                    .filter(|s| !s.function && !s.thread_local && s.size <= LOADER_STATE_AT_MOST)?;
                let start = bias.wrapping_add(sym.vaddr);
                Some(LoaderLocks {
                    state: start..start + sym.size,
                })
            })
    }

    /// The threads that hold one of the loader's locks now, each once.
    pub fn holders(&self, tracee: &Tracee) -> Result<Vec<u32>, InjectError> {
        let mut bytes = vec![0u8; (self.state.end - self.state.start) as usize];
        tracee.read(self.state.start, &mut bytes)?;
        Ok(held_recursive_mutexes(self.state.start, &bytes))
    }
}

/// The owners of the held recursive mutexes among `bytes` (read at
/// `base`, where mutexes are 8-byte aligned).
fn held_recursive_mutexes(base: u64, bytes: &[u8]) -> Vec<u32> {
    let skip = (base.next_multiple_of(8) - base) as usize;
    let word = |at: usize| i32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let mut owners = Vec::new();
    for at in (skip..bytes.len().saturating_sub(4 * MUTEX_WORDS - 1)).step_by(8) {
        let (lock, count, owner, kind) = (word(at), word(at + 4), word(at + 8), word(at + 16));
        let recursive = kind & KIND_MASK == RECURSIVE && (0..=KIND_FLAGS_AT_MOST).contains(&kind);
        if lock != 0 && count >= 1 && owner > 0 && recursive && !owners.contains(&(owner as u32)) {
            owners.push(owner as u32);
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mutex(lock: i32, count: i32, owner: i32, kind: i32) -> Vec<u8> {
        [lock, count, owner, 0, kind, 0, 0, 0, 0, 0]
            .into_iter()
            .flat_map(i32::to_le_bytes)
            .collect()
    }

    #[test]
    fn held_recursive_mutexes_name_their_owners() {
        let mut bytes = vec![0u8; 8];
        bytes.extend(mutex(1, 1, 4242, RECURSIVE));
        bytes.extend(mutex(0, 0, 0, RECURSIVE)); // free
        bytes.extend(mutex(1, 0, 77, 0)); // a plain mutex: not the loader's kind
        bytes.extend(mutex(2, 3, 4242, RECURSIVE | 128)); // the same owner, again
        bytes.extend(mutex(1, 1, 99, RECURSIVE));
        assert_eq!(held_recursive_mutexes(0x1000, &bytes), [4242, 99]);
        // Read from an unaligned start, the words are found where they lie.
        let mut shifted = vec![0u8; 4];
        shifted.extend(&bytes);
        assert_eq!(held_recursive_mutexes(0x1004, &shifted), [4242, 99]);
    }

    /// This process's own loader: `dl_iterate_phdr` runs its callback with
    /// one of the loader's locks held by the calling thread, and it is
    /// free again after.
    #[test]
    fn a_loader_lock_is_seen_held_by_its_thread_and_only_while_held() {
        struct Seen {
            locks: LoaderLocks,
            inside: Vec<u32>,
        }
        fn now(locks: &LoaderLocks) -> Vec<u32> {
            let len = (locks.state.end - locks.state.start) as usize;
            // SAFETY: this process's own `_rtld_global`, read in place.
            let bytes = unsafe { std::slice::from_raw_parts(locks.state.start as *const u8, len) };
            held_recursive_mutexes(locks.state.start, bytes)
        }
        unsafe extern "C" fn visit(
            _: *mut libc::dl_phdr_info,
            _: libc::size_t,
            seen: *mut libc::c_void,
        ) -> libc::c_int {
            // SAFETY: the `Seen` passed below.
            let seen = unsafe { &mut *seen.cast::<Seen>() };
            seen.inside = now(&seen.locks);
            1
        }
        let locks = LoaderLocks::of(std::process::id()).expect("glibc's loader");
        // SAFETY: no arguments.
        let ours = unsafe { libc::gettid() } as u32;
        assert!(!now(&locks).contains(&ours), "held before");
        let mut seen = Seen {
            locks,
            inside: Vec::new(),
        };
        // SAFETY: `visit` takes the `Seen` it is given.
        unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut seen).cast()) };
        assert!(seen.inside.contains(&ours), "{:?}", seen.inside);
        assert!(!now(&seen.locks).contains(&ours), "held after");
    }
}
