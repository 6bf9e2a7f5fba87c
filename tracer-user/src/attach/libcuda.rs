//! Finding the `libcuda.so.1` a process uses, or the one it would load,
//! and the file offsets of the functions it exports.
//!
//! A process that has loaded the driver shows it in `/proc/PID/maps`. One
//! that has not (the CUDA runtime `dlopen`s it on first use) gets the file
//! its loader would pick: `LD_LIBRARY_PATH` from its environment, its
//! `ld.so.cache`, then the default directories, all looked up inside its
//! own root as its loader would ([`procfs::TargetRoot`]), so containers
//! work, and nothing the process names (a FIFO for a cache, a link out of
//! its root, a device) is opened or read beyond a regular file's cap. A
//! uprobe set on that file's inode fires as soon as the process maps it.

use std::{
    collections::HashMap,
    ffi::OsStr,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
};

use crate::{
    procfs,
    symbols::{ElfObject, mapped_objects},
};

/// The name the CUDA runtime (and every framework) `dlopen`s.
pub const SONAME: &str = "libcuda.so.1";

/// The largest `ld.so.cache` read: a system's is a few hundred KiB.
const MAX_LD_SO_CACHE: u64 = 16 * 1024 * 1024;

/// Directories the loader searches after `LD_LIBRARY_PATH` and the cache.
const DEFAULT_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
    "/usr/lib/wsl/lib",
];

/// How the library was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Mapped into the process already.
    Mapped,
    /// Not loaded yet; this is the file a `dlopen("libcuda.so.1")` would load.
    LoaderSearch {
        /// Where it was found: `LD_LIBRARY_PATH`, `ld.so.cache` or `default directories`.
        via: &'static str,
    },
}

/// The driver library of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Library {
    /// Path as the process sees it.
    pub path: PathBuf,
    /// Path that names the same file from here (`/proc/PID/map_files` or
    /// the descriptor `held` keeps): what the uprobes attach to.
    pub attach_path: PathBuf,
    /// How it was found.
    pub source: Source,
    /// The file found (by the loader's search, or mapped), held open while
    /// this lives.
    pub held: Option<procfs::HeldFile>,
}

/// Finds the driver library of `pid`, or `None` if it has none mapped and
/// none on its library path.
pub fn locate(pid: u32) -> Option<Library> {
    if let Some(lib) = find_mapped(pid) {
        return Some(lib);
    }
    let root = procfs::TargetRoot::open(pid).ok()?;
    let environ = procfs::environment(pid);
    let cache = root
        .read_regular(Path::new("/etc/ld.so.cache"), MAX_LD_SO_CACHE)
        .unwrap_or_else(|e| {
            log::debug!("pid {pid}: its /etc/ld.so.cache is not read: {e}");
            Vec::new()
        });
    let (path, held, via) = search(&root, &environ, &cache)?;
    Some(Library {
        attach_path: held.path(),
        path,
        source: Source::LoaderSearch { via },
        held: Some(held),
    })
}

/// Whether a mapped file is the driver (`libcuda.so.1` or the versioned
/// file it links to, never `libcudart`).
fn is_driver_file(name: &str) -> bool {
    name == SONAME || name.starts_with("libcuda.so.")
}

/// The driver among the files `pid` has mapped.
fn find_mapped(pid: u32) -> Option<Library> {
    let object = mapped_objects(pid)
        .ok()?
        .into_iter()
        .find(|o| is_driver_file(o.file_name()))?;
    let file = object.open_path();
    Some(Library {
        attach_path: file.to_path_buf(),
        path: PathBuf::from(object.path),
        source: Source::Mapped,
        held: file.held().cloned(),
    })
}

/// The loader's search for [`SONAME`] in a process with root `root`,
/// environment `environ` (NUL-separated) and `ld.so.cache` bytes `cache`:
/// the path the process would load, held.
fn search(
    root: &procfs::TargetRoot,
    environ: &[u8],
    cache: &[u8],
) -> Option<(PathBuf, procfs::HeldFile, &'static str)> {
    let found = |p: &Path| root.regular_file(p).ok();
    let library_path = environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"LD_LIBRARY_PATH="))
        .unwrap_or_default();
    for dir in library_path.split(|&b| b == b':' || b == b';') {
        let dir = Path::new(OsStr::from_bytes(dir));
        // Relative entries depend on the process's working directory at
        // dlopen time; the loader itself discourages them.
        if !dir.is_absolute() {
            continue;
        }
        let candidate = dir.join(SONAME);
        if let Some(held) = found(&candidate) {
            return Some((candidate, held, "LD_LIBRARY_PATH"));
        }
    }
    if let Some(candidate) = ld_so_cache_lookup(cache, SONAME)
        && let Some(held) = found(&candidate)
    {
        return Some((candidate, held, "ld.so.cache"));
    }
    DEFAULT_DIRS.iter().find_map(|d| {
        let candidate = Path::new(d).join(SONAME);
        let held = found(&candidate)?;
        Some((candidate, held, "default directories"))
    })
}

/// Looks `name` up in a glibc `ld.so.cache` (the "glibc-ld.so.cache1.1"
/// format, alone or after the old one), x86-64 entries only.
pub fn ld_so_cache_lookup(cache: &[u8], name: &str) -> Option<PathBuf> {
    const MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
    const HEADER: usize = 48;
    const ENTRY: usize = 24;
    const FLAG_ELF_LIBC6: i32 = 0x0003;
    const FLAG_X8664_LIB64: i32 = 0x0300;
    let start = cache.windows(MAGIC.len()).position(|w| w == MAGIC)?;
    let new = &cache[start..];
    let u32_at =
        |o: usize| -> Option<u32> { Some(u32::from_le_bytes(new.get(o..o + 4)?.try_into().ok()?)) };
    // Strings are offsets from the start of the new-format header.
    let string_at = |o: u32| -> Option<&[u8]> {
        let s = new.get(o as usize..)?;
        Some(&s[..s.iter().position(|&b| b == 0)?])
    };
    let count = u32_at(MAGIC.len())? as usize;
    for i in 0..count {
        let e = HEADER + i * ENTRY;
        let flags = u32_at(e)? as i32;
        if flags & 0xff != FLAG_ELF_LIBC6 || flags & 0xff00 != FLAG_X8664_LIB64 {
            continue;
        }
        if string_at(u32_at(e + 4)?)? == name.as_bytes() {
            let value = string_at(u32_at(e + 8)?)?;
            return Some(PathBuf::from(OsStr::from_bytes(value)));
        }
    }
    None
}

/// Why a function cannot be probed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unprobeable {
    /// Its first instruction has a `lock` prefix: the kernel refuses a
    /// uprobe there (and a return probe must sit on the first instruction).
    LockPrefix,
}

/// File offsets of the exported functions of an ELF file, for the names
/// in `wanted`; a name it does not export is left out.
pub fn function_offsets(
    path: &Path,
    wanted: &[&str],
) -> std::io::Result<HashMap<String, Result<u64, Unprobeable>>> {
    let elf = ElfObject::open(path, None)?;
    let scan = elf.scan(wanted, |_| false)?;
    let mut found = HashMap::new();
    for (name, symbol) in wanted.iter().zip(scan.found) {
        let Some(symbol) = symbol.filter(|s| s.exported && s.function) else {
            continue;
        };
        let Some(offset) = elf.file_offset(symbol.vaddr) else {
            continue;
        };
        let entry = if elf.byte_at(offset) == Some(0xf0) {
            Err(Unprobeable::LockPrefix)
        } else {
            Ok(offset)
        };
        found.insert(name.to_string(), entry);
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    /// A minimal new-format cache with one x86-64 and one i386 entry.
    fn cache(entries: &[(i32, &str, &str)]) -> Vec<u8> {
        let mut strings = Vec::new();
        let header = 48 + entries.len() * 24;
        let mut body = Vec::new();
        for (flags, key, value) in entries {
            let k = header + strings.len();
            strings.extend_from_slice(key.as_bytes());
            strings.push(0);
            let v = header + strings.len();
            strings.extend_from_slice(value.as_bytes());
            strings.push(0);
            body.extend_from_slice(&flags.to_le_bytes());
            body.extend_from_slice(&(k as u32).to_le_bytes());
            body.extend_from_slice(&(v as u32).to_le_bytes());
            body.extend_from_slice(&0u32.to_le_bytes());
            body.extend_from_slice(&0u64.to_le_bytes());
        }
        let mut out = b"glibc-ld.so.cache1.1".to_vec();
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        out.resize(48, 0);
        out.extend(body);
        out.extend(strings);
        out
    }

    #[test]
    fn cache_lookup_takes_the_x86_64_entry() {
        let c = cache(&[
            (0x0003, "libcuda.so.1", "/usr/lib32/libcuda.so.1"),
            (
                0x0303,
                "libcuda.so.1",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            ),
        ]);
        assert_eq!(
            ld_so_cache_lookup(&c, "libcuda.so.1"),
            Some(PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.1"))
        );
        assert_eq!(ld_so_cache_lookup(&c, "libfoo.so"), None);
        assert_eq!(ld_so_cache_lookup(b"garbage", "libcuda.so.1"), None);
    }

    #[test]
    fn this_machines_cache_finds_libc() {
        let Ok(bytes) = fs::read("/etc/ld.so.cache") else {
            return;
        };
        let libc = ld_so_cache_lookup(&bytes, "libc.so.6").expect("libc.so.6 in ld.so.cache");
        assert!(libc.exists(), "{}", libc.display());
    }

    #[test]
    fn driver_files_are_told_from_the_runtime() {
        assert!(is_driver_file("libcuda.so.1"));
        assert!(is_driver_file("libcuda.so.550.54.15"));
        assert!(!is_driver_file("libcudart.so.12"));
        assert!(!is_driver_file("libcuda.so"));
    }

    #[test]
    fn search_prefers_ld_library_path() {
        let dir = std::env::temp_dir().join(format!("ebtrace-libcuda-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("libcuda.so.550.1"), b"").unwrap();
        let _ = fs::remove_file(dir.join(SONAME));
        std::os::unix::fs::symlink("libcuda.so.550.1", dir.join(SONAME)).unwrap();
        let environ = format!("A=1\0LD_LIBRARY_PATH=relative:{}\0", dir.display());
        let root = procfs::TargetRoot::open(std::process::id()).unwrap();
        let (path, held, via) = search(&root, environ.as_bytes(), b"").unwrap();
        assert_eq!((path, via), (dir.join(SONAME), "LD_LIBRARY_PATH"));
        // The file the link leads to, held.
        let target = fs::metadata(dir.join("libcuda.so.550.1")).unwrap();
        let held = fs::metadata(held.path()).unwrap();
        use std::os::unix::fs::MetadataExt as _;
        assert_eq!((held.dev(), held.ino()), (target.dev(), target.ino()));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn offsets_of_this_test_binarys_libc() {
        // libc's dynamic symbols stand in for the driver's.
        let maps = procfs::maps_text(std::process::id()).unwrap();
        let libc = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("libc.so"))
            .expect("libc mapped");
        let found = function_offsets(Path::new(libc), &["malloc", "not_a_symbol"]).unwrap();
        assert!(matches!(found.get("malloc"), Some(Ok(o)) if *o > 0));
        assert!(!found.contains_key("not_a_symbol"));
    }
}
