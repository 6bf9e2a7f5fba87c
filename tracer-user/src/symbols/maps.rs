//! The objects a process has mapped, from `/proc/PID/maps`, and where each
//! was loaded.

use std::{
    io,
    ops::{Deref, Range},
    path::{Path, PathBuf},
};

use super::elf::LoadSegment;
use crate::procfs;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// First address of the mapping.
    pub start: u64,
    /// Address just past its end.
    pub end: u64,
    /// Permissions, e.g. `r-xp`.
    pub perms: String,
    /// Offset in the file of `start`.
    pub offset: u64,
    /// The file's device, `major:minor` in hex.
    pub dev: String,
    /// The file's inode; 0 for an anonymous mapping.
    pub inode: u64,
    /// File path, `[heap]`-style name, or empty.
    pub path: String,
    /// The file was deleted (or replaced) after it was mapped.
    pub deleted: bool,
}

/// Parses one line of `/proc/PID/maps`; paths may contain spaces.
pub fn parse_maps_line(line: &str) -> Option<Mapping> {
    let mut rest = line;
    let mut field = || {
        let trimmed = rest.trim_start();
        let end = trimmed.find(' ').unwrap_or(trimmed.len());
        let (f, r) = trimmed.split_at(end);
        rest = r;
        f
    };
    let (range, perms, offset, dev, inode) = (field(), field(), field(), field(), field());
    let (start, end) = range.split_once('-')?;
    let path = rest.trim_start();
    let (path, deleted) = match path.strip_suffix(" (deleted)") {
        Some(p) => (p, true),
        None => (path, false),
    };
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        perms: perms.to_string(),
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: dev.to_string(),
        inode: inode.parse().ok()?,
        path: path.to_string(),
        deleted,
    })
}

/// A file mapped into a process, with all its mappings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedObject {
    /// The process.
    pub pid: u32,
    /// The path as the process sees it.
    pub path: String,
    /// The file's device, `major:minor` in hex.
    pub dev: String,
    /// The file's inode.
    pub inode: u64,
    /// Its mappings, in address order.
    pub mappings: Vec<Mapping>,
}

/// A path that opens a mapped object's very file from here, valid while
/// this lives (it may hold the file open): it derefs to that path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectFile {
    path: PathBuf,
    held: Option<procfs::HeldFile>,
}

impl Deref for ObjectFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for ObjectFile {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl ObjectFile {
    /// The descriptor holding the file, if one does.
    pub fn held(&self) -> Option<&procfs::HeldFile> {
        self.held.as_ref()
    }
}

impl MappedObject {
    /// Where this process's file can be opened from here (and attached
    /// to): looked up in the process's root as its loader would
    /// ([`procfs::TargetRoot`]: absolute links stay inside it, only a
    /// regular file is taken) and held, if that is still the file mapped;
    /// else (gone, or another one there) through its mapping.
    pub fn open_path(&self) -> ObjectFile {
        let first = &self.mappings[0];
        let held = procfs::TargetRoot::open(self.pid)
            .and_then(|root| root.regular_file(Path::new(&self.path)))
            .ok()
            .filter(|held| !first.deleted && held.inode().is_ok_and(|ino| ino == self.inode));
        match held {
            Some(held) => ObjectFile {
                path: held.path(),
                held: Some(held),
            },
            None => ObjectFile {
                path: procfs::mapped_file(self.pid, first.start, first.end),
                held: None,
            },
        }
    }

    /// The file name, for messages.
    pub fn file_name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }

    /// Difference between addresses in the process and virtual addresses in
    /// the file. The loader maps all segments with one bias; it is found
    /// from the first segment's mapping, confirmed by the executable
    /// segment landing on an executable mapping (a file may also be mapped
    /// as plain data).
    pub fn load_bias(&self, segments: &[LoadSegment], page_size: u64) -> Option<u64> {
        let first = segments.iter().min_by_key(|s| s.vaddr)?;
        let page = |v: u64| v & !(page_size - 1);
        let exec = segments.iter().find(|s| s.executable);
        let candidates = self
            .mappings
            .iter()
            .filter(|m| m.offset == page(first.offset))
            .filter_map(|m| m.start.checked_sub(page(first.vaddr)));
        let mut fallback = None;
        for bias in candidates {
            fallback.get_or_insert(bias);
            let Some(exec) = exec else {
                return Some(bias);
            };
            let at = bias.wrapping_add(exec.vaddr);
            if self
                .mappings
                .iter()
                .any(|m| m.perms.contains('x') && m.start <= at && at < m.end)
            {
                return Some(bias);
            }
        }
        fallback
    }
}

/// Reads and parses `/proc/PID/maps`.
pub fn read_maps(pid: u32) -> io::Result<Vec<Mapping>> {
    let text = procfs::maps_text(pid)?;
    Ok(text.lines().filter_map(parse_maps_line).collect())
}

/// The files a process has mapped (one entry per file, in address order).
pub fn mapped_objects(pid: u32) -> io::Result<Vec<MappedObject>> {
    Ok(objects_of(pid, read_maps(pid)?))
}

/// The files among `maps`, a process's mappings (one entry per file, in
/// address order).
pub fn objects_of(pid: u32, maps: Vec<Mapping>) -> Vec<MappedObject> {
    let mut objects: Vec<MappedObject> = Vec::new();
    for m in maps {
        if m.inode == 0 || !m.path.starts_with('/') {
            continue;
        }
        match objects
            .iter_mut()
            .find(|o| o.inode == m.inode && o.dev == m.dev)
        {
            Some(o) => o.mappings.push(m),
            None => objects.push(MappedObject {
                pid,
                path: m.path.clone(),
                dev: m.dev.clone(),
                inode: m.inode,
                mappings: vec![m],
            }),
        }
    }
    objects
}

/// The system page size.
pub fn page_size() -> u64 {
    match rustix::param::page_size() {
        // 0, or -1 from the C library.
        size if size == 0 || size > isize::MAX as usize => 4096,
        size => size as u64,
    }
}

/// The executable ones of `maps`, sorted.
pub fn code_ranges<'a>(maps: impl IntoIterator<Item = &'a Mapping>) -> Vec<Range<u64>> {
    let mut code: Vec<Range<u64>> = maps
        .into_iter()
        .filter(|m| m.perms.contains('x'))
        .map(|m| m.start..m.end)
        .collect();
    code.sort_by_key(|r| r.start);
    code
}

/// Whether `address` is in one of the sorted `code` ranges.
pub fn in_code(code: &[Range<u64>], address: u64) -> bool {
    let i = code.partition_point(|r| r.start <= address);
    code[..i].last().is_some_and(|r| address < r.end)
}

/// A page of code in no file, as JIT code is: mapped executable, and
/// unmapped when dropped.
#[cfg(test)]
pub struct AnonymousCode {
    /// Start of the page.
    pub address: u64,
}

#[cfg(test)]
impl AnonymousCode {
    /// Maps one page, readable and executable.
    pub fn map() -> Self {
        // SAFETY: a new anonymous mapping of one page, unmapped on drop.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page_size() as usize,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        AnonymousCode { address: at as u64 }
    }
}

#[cfg(test)]
impl Drop for AnonymousCode {
    fn drop(&mut self) {
        // SAFETY: the page mapped in `map`, used no more.
        unsafe { libc::munmap(self.address as *mut libc::c_void, page_size() as usize) };
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn code_ranges_hold_their_start_and_not_their_end() {
        let code = [0x1000..0x2000, 0x5000..0x6000];
        assert!(in_code(&code, 0x1000) && in_code(&code, 0x5fff));
        assert!(!in_code(&code, 0x2000) && !in_code(&code, 0xfff) && !in_code(&code, 0x7000));
        assert!(!in_code(&[], 0x1000));
    }

    #[test]
    fn parses_lines_with_spaces_and_deleted_files() {
        let m = parse_maps_line(
            "7f0000001000-7f0000002000 r-xp 00001000 fd:01 1234   /opt/my lib/libx.so (deleted)",
        )
        .unwrap();
        assert_eq!(
            (m.start, m.end, m.offset, m.inode),
            (0x7f0000001000, 0x7f0000002000, 0x1000, 1234)
        );
        assert_eq!(m.path, "/opt/my lib/libx.so");
        assert!(m.deleted);
        assert_eq!(m.perms, "r-xp");
        let anon = parse_maps_line("7ffd0000-7ffd1000 rw-p 00000000 00:00 0").unwrap();
        assert_eq!(anon.path, "");
        assert!(parse_maps_line("garbage").is_none());
    }

    fn mapping(start: u64, end: u64, perms: &str, offset: u64) -> Mapping {
        Mapping {
            start,
            end,
            perms: perms.into(),
            offset,
            dev: "fd:01".into(),
            inode: 7,
            path: "/lib/x.so".into(),
            deleted: false,
        }
    }

    #[test]
    fn load_bias_uses_the_mapping_the_loader_made() {
        // jaxlib-like layout: R at 0, RX at file 0x38d7f80 / vaddr 0x38d8f80.
        let segments = [
            LoadSegment {
                vaddr: 0,
                memsz: 0x38d7f68,
                offset: 0,
                filesz: 0x38d7f68,
                executable: false,
            },
            LoadSegment {
                vaddr: 0x38d8f80,
                memsz: 0x1000,
                offset: 0x38d7f80,
                filesz: 0x1000,
                executable: true,
            },
        ];
        let base = 0x7f00_0000_0000;
        let object = MappedObject {
            pid: 1,
            path: "/lib/x.so".into(),
            dev: "fd:01".into(),
            inode: 7,
            mappings: vec![
                // A plain data mapping of the same file, first in address order.
                mapping(0x5000_0000, 0x5000_1000, "r--s", 0),
                mapping(base, base + 0x38d8000, "r--p", 0),
                mapping(
                    base + 0x38d8000,
                    base + 0x38d9000 + 0x1000,
                    "r-xp",
                    0x38d7000,
                ),
            ],
        };
        assert_eq!(object.load_bias(&segments, 4096), Some(base));
        assert_eq!(object.file_name(), "x.so");
        // No such file under pid 1's root: the mapping itself is opened.
        assert_eq!(
            object.open_path().to_path_buf(),
            PathBuf::from("/proc/1/map_files/50000000-50001000")
        );
    }

    /// A function whose address the test knows at run time.
    #[unsafe(no_mangle)]
    #[inline(never)]
    extern "C" fn ebtrace_symbols_test_marker() -> u32 {
        7
    }

    #[test]
    fn symbol_plus_bias_is_the_runtime_address() {
        assert_eq!(ebtrace_symbols_test_marker(), 7);
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let objects = mapped_objects(std::process::id()).unwrap();
        let me = objects
            .iter()
            .find(|o| Path::new(&o.path) == exe)
            .expect("own executable is mapped");
        // Found in this process's root, and held.
        let file = me.open_path();
        assert!(file.held().is_some());
        assert_eq!(std::fs::read_link(&*file).unwrap(), exe);
        let elf = crate::symbols::ElfObject::open(&me.open_path(), Some(me.inode)).unwrap();
        let bias = me.load_bias(elf.segments(), page_size()).unwrap();
        let scan = elf
            .scan(&["ebtrace_symbols_test_marker"], |_| true)
            .unwrap();
        let marker = scan.found[0].expect("marker symbol");
        let runtime = ebtrace_symbols_test_marker as extern "C" fn() -> u32 as usize as u64;
        assert_eq!(bias + marker.vaddr, runtime);
    }
}
