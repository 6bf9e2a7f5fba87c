//! A memory-mapped 64-bit little-endian ELF object and the symbol lookups
//! ebtrace needs from it.
//!
//! Libraries like jaxlib's `libjax_common.so` (350 MB, 740k symbols) are
//! searched in one linear pass over the raw symbol tables, comparing names
//! by length first; a prefilter over the string tables skips the pass for
//! objects that cannot contain any wanted name.

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use object::{
    Endianness,
    elf::{PT_LOAD, SHT_DYNSYM, SHT_SYMTAB, STT_FUNC, STT_GNU_IFUNC, STT_TLS},
    read::elf::{FileHeader as _, ProgramHeader as _, SectionHeader as _, Sym as _},
};

type FileHeader = object::elf::FileHeader64<Endianness>;

/// A read-only private mapping of a whole file.
struct Mmap(memmap2::Mmap);

impl Mmap {
    fn map(file: &File) -> io::Result<Self> {
        if file.metadata()?.len() == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "empty file"));
        }
        crate::procfs::survive_truncated_files();
        // SAFETY: a read-only private mapping. A process's libraries are
        // replaced by new files, not written in place; one truncated under
        // us reads as zeros past its new end (see
        // `procfs::survive_truncated_files`), and its contents are never
        // trusted.
        unsafe { memmap2::Mmap::map(file) }.map(Mmap)
    }

    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A `PT_LOAD` segment: where a range of the file goes in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    /// Virtual address of its start (`p_vaddr`).
    pub vaddr: u64,
    /// Its size in memory, in bytes (`p_memsz`).
    pub memsz: u64,
    /// Offset of its start in the file (`p_offset`).
    pub offset: u64,
    /// Its size in the file, in bytes (`p_filesz`).
    pub filesz: u64,
    /// Mapped executable (`PF_X`).
    pub executable: bool,
}

/// Where a section is: see [`ElfObject::section`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SectionRange {
    /// Its virtual addresses in the object.
    pub svma: std::ops::Range<u64>,
    /// Its contents in the file, if the file holds them.
    pub file: Option<std::ops::Range<usize>>,
}

/// A defined symbol found by [`ElfObject::scan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoundSymbol {
    /// Virtual address in the object file (`st_value`).
    pub vaddr: u64,
    /// Size in bytes (`st_size`).
    pub size: u64,
    /// Found in `.dynsym` (exported) rather than only in `.symtab`.
    pub exported: bool,
    /// A function (`STT_FUNC` or `STT_GNU_IFUNC`), not data.
    pub function: bool,
    /// A thread-local variable (`STT_TLS`): `vaddr` is its offset in the
    /// object's thread-local block.
    pub thread_local: bool,
}

/// Result of one pass over an object's symbol tables.
#[derive(Clone, Debug, Default)]
pub struct SymbolScan {
    /// One entry per wanted name, in the order asked.
    pub found: Vec<Option<FoundSymbol>>,
    /// Symbols looked at (both tables).
    pub symbols: usize,
    /// How long the scan took.
    pub elapsed: Duration,
}

/// A mapped ELF object.
pub struct ElfObject {
    path: PathBuf,
    map: Mmap,
    segments: Vec<LoadSegment>,
    /// The file's device, inode, size and change time.
    stat: (u64, u64, u64, i64, i64),
}

fn invalid(path: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: {what}", path.display()),
    )
}

impl ElfObject {
    /// Maps `path`; fails unless it is a 64-bit little-endian ELF file.
    /// With `expected_inode`, also fails if the file opened is not that one
    /// (the path was replaced since it was mapped).
    pub fn open(path: &Path, expected_inode: Option<u64>) -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        // A FIFO or a device in the object's place neither blocks the open
        // nor is read.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)?;
        let meta = file.metadata()?;
        if !meta.file_type().is_file() {
            return Err(invalid(path, "is not a regular file"));
        }
        if let Some(inode) = expected_inode
            && meta.ino() != inode
        {
            return Err(invalid(path, "is not the file the process mapped"));
        }
        let map = Mmap::map(&file)?;
        let bytes = map.bytes();
        if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
            return Err(invalid(path, "not a 64-bit little-endian ELF object"));
        }
        let header = FileHeader::parse(bytes).map_err(|e| invalid(path, e))?;
        let endian = header.endian().map_err(|e| invalid(path, e))?;
        let segments = header
            .program_headers(endian, bytes)
            .map_err(|e| invalid(path, e))?
            .iter()
            .filter(|p| p.p_type(endian) == PT_LOAD)
            .map(|p| LoadSegment {
                vaddr: p.p_vaddr(endian),
                memsz: p.p_memsz(endian),
                offset: p.p_offset(endian),
                filesz: p.p_filesz(endian),
                executable: p.p_flags(endian) & object::elf::PF_X != 0,
            })
            .collect();
        Ok(ElfObject {
            path: path.to_path_buf(),
            map,
            segments,
            stat: (
                meta.dev(),
                meta.ino(),
                meta.size(),
                meta.ctime(),
                meta.ctime_nsec(),
            ),
        })
    }

    /// The path it was opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its `PT_LOAD` segments.
    pub fn segments(&self) -> &[LoadSegment] {
        &self.segments
    }

    /// Offset in the file of the byte loaded at `vaddr` (what a uprobe is
    /// attached by), if a segment's file contents cover it.
    pub fn file_offset(&self, vaddr: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|s| vaddr >= s.vaddr && vaddr - s.vaddr < s.filesz)
            .and_then(|s| (vaddr - s.vaddr).checked_add(s.offset))
    }

    /// The object's GNU build-id (`NT_GNU_BUILD_ID` note), if it has one:
    /// it names the build, whatever the file's path or copy.
    pub fn build_id(&self) -> Option<Vec<u8>> {
        let bytes = self.map.bytes();
        let header = FileHeader::parse(bytes).ok()?;
        let endian = header.endian().ok()?;
        for phdr in header.program_headers(endian, bytes).ok()? {
            let Ok(Some(mut notes)) = phdr.notes(endian, bytes) else {
                continue;
            };
            while let Ok(Some(note)) = notes.next() {
                if note.name() == object::elf::ELF_NOTE_GNU
                    && note.n_type(endian) == object::elf::NT_GNU_BUILD_ID
                    && !note.desc().is_empty()
                {
                    return Some(note.desc().to_vec());
                }
            }
        }
        None
    }

    /// A name for this object's contents: `build-<hex>` from its build-id,
    /// else `file-...` from the file's device, inode, size and change time
    /// (which any write to the file changes), for objects built without
    /// one (jaxlib's).
    pub fn identity(&self) -> String {
        match self.build_id() {
            Some(id) => format!(
                "build-{}",
                id.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
            None => {
                let (dev, ino, size, ctime, nsec) = self.stat;
                format!("file-{dev:x}-{ino:x}-{size:x}-{ctime:x}.{nsec:x}")
            }
        }
    }

    /// The section `name`: its virtual addresses and, if the file holds
    /// its contents (not `SHT_NOBITS`), where in the file they are.
    pub fn section(&self, name: &str) -> Option<SectionRange> {
        let bytes = self.map.bytes();
        let header = FileHeader::parse(bytes).ok()?;
        let endian = header.endian().ok()?;
        let sections = header.sections(endian, bytes).ok()?;
        let (_, section) = sections.section_by_name(endian, name.as_bytes())?;
        let address = section.sh_addr(endian);
        let size = section.sh_size(endian);
        let file = section.file_range(endian).and_then(|(offset, len)| {
            let start = usize::try_from(offset).ok()?;
            let end = start.checked_add(usize::try_from(len).ok()?)?;
            (end <= bytes.len()).then_some(start..end)
        });
        Some(SectionRange {
            svma: address..address.checked_add(size)?,
            file,
        })
    }

    /// The file's bytes in `range` (see [`Self::section`]).
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.map.bytes()[range]
    }

    /// The file's byte at `offset`, if the file has one there.
    pub fn byte_at(&self, offset: u64) -> Option<u8> {
        self.map.bytes().get(usize::try_from(offset).ok()?).copied()
    }

    /// True if any string table of the object contains `needle`: a quick
    /// test before a full [`scan`](Self::scan).
    pub fn strings_contain(&self, needle: &[u8]) -> bool {
        let finder = memchr::memmem::Finder::new(needle);
        self.string_tables()
            .iter()
            .any(|s| finder.find(s).is_some())
    }

    fn string_tables(&self) -> Vec<&[u8]> {
        let bytes = self.map.bytes();
        let Ok(header) = FileHeader::parse(bytes) else {
            return Vec::new();
        };
        let Ok(endian) = header.endian() else {
            return Vec::new();
        };
        let Ok(sections) = header.sections(endian, bytes) else {
            return Vec::new();
        };
        [SHT_SYMTAB, SHT_DYNSYM]
            .into_iter()
            .filter_map(|kind| {
                let table = sections.symbols(endian, bytes, kind).ok()?;
                let strings = sections.section(table.string_section()).ok()?;
                strings.data(endian, bytes).ok()
            })
            .collect()
    }

    /// One pass over `.symtab` and `.dynsym`: finds the defined symbols
    /// named in `wanted`, and shows every symbol name (defined or not) to
    /// `visit` until it returns false.
    pub fn scan(
        &self,
        wanted: &[&str],
        visit: impl FnMut(&[u8]) -> bool,
    ) -> io::Result<SymbolScan> {
        self.scan_tables(&[SHT_SYMTAB, SHT_DYNSYM], wanted, visit)
    }

    /// [`Self::scan`] of `.dynsym` alone: the symbols the object exports,
    /// without reading a large `.symtab`.
    pub fn scan_exported(&self, wanted: &[&str]) -> io::Result<SymbolScan> {
        self.scan_tables(&[SHT_DYNSYM], wanted, |_| false)
    }

    fn scan_tables(
        &self,
        kinds: &[u32],
        wanted: &[&str],
        mut visit: impl FnMut(&[u8]) -> bool,
    ) -> io::Result<SymbolScan> {
        let began = Instant::now();
        let bytes = self.map.bytes();
        let header = FileHeader::parse(bytes).map_err(|e| invalid(&self.path, e))?;
        let endian = header.endian().map_err(|e| invalid(&self.path, e))?;
        let sections = header
            .sections(endian, bytes)
            .map_err(|e| invalid(&self.path, e))?;
        let mut scan = SymbolScan {
            found: vec![None; wanted.len()],
            ..SymbolScan::default()
        };
        let mut visiting = true;
        for &kind in kinds {
            let table = sections
                .symbols(endian, bytes, kind)
                .map_err(|e| invalid(&self.path, e))?;
            let strings = table.strings();
            scan.symbols += table.len();
            for sym in table.iter().skip(1) {
                let Ok(name) = sym.name(endian, strings) else {
                    continue;
                };
                if visiting {
                    visiting = visit(name);
                }
                if sym.is_undefined(endian) {
                    continue;
                }
                for (slot, w) in scan.found.iter_mut().zip(wanted) {
                    if name.len() != w.len() || name != w.as_bytes() {
                        continue;
                    }
                    match slot {
                        // `.symtab` comes first; the same name in `.dynsym`
                        // says the symbol is also exported.
                        Some(found) => found.exported |= kind == SHT_DYNSYM,
                        None => {
                            *slot = Some(FoundSymbol {
                                vaddr: sym.st_value(endian),
                                size: sym.st_size(endian),
                                exported: kind == SHT_DYNSYM,
                                function: matches!(sym.st_type(), STT_FUNC | STT_GNU_IFUNC),
                                thread_local: sym.st_type() == STT_TLS,
                            })
                        }
                    }
                }
            }
        }
        scan.elapsed = began.elapsed();
        Ok(scan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary itself is an ELF object with symbols.
    fn self_object() -> ElfObject {
        let exe = std::env::current_exe().unwrap();
        ElfObject::open(&exe, None).unwrap()
    }

    #[test]
    fn finds_own_main_and_maps_it_to_a_file_offset() {
        let obj = self_object();
        assert!(obj.strings_contain(b"main"));
        assert!(!obj.strings_contain(b"no-such-symbol-\x01\x02"));
        let scan = obj.scan(&["main", "no_such_symbol"], |_| true).unwrap();
        let main = scan.found[0].expect("main is defined");
        assert!(main.function);
        assert!(scan.found[1].is_none());
        assert!(scan.symbols > 100);
        let offset = obj.file_offset(main.vaddr).expect("main is in a segment");
        assert!(
            obj.segments()
                .iter()
                .any(|s| s.executable && main.vaddr >= s.vaddr && main.vaddr < s.vaddr + s.memsz)
        );
        assert!(offset < std::fs::metadata(obj.path()).unwrap().len());
    }

    #[test]
    fn reads_the_build_id_that_readelf_shows() {
        // Debian's loader has a build-id; `file`/`readelf -n` show it as hex.
        let path = Path::new("/lib64/ld-linux-x86-64.so.2");
        let Ok(obj) = ElfObject::open(path, None) else {
            return;
        };
        let id = obj.build_id().expect("the loader has a build-id");
        assert!(id.len() >= 16, "{id:?}");
        let out = std::process::Command::new("readelf")
            .args(["-n", path.to_str().unwrap()])
            .output();
        if let Ok(out) = out {
            let text = String::from_utf8_lossy(&out.stdout);
            let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
            assert!(text.contains(&format!("Build ID: {hex}")), "{hex}\n{text}");
        }
    }

    #[test]
    fn visit_stops_when_asked() {
        let obj = self_object();
        let mut seen = 0;
        obj.scan(&[], |_| {
            seen += 1;
            seen < 10
        })
        .unwrap();
        assert_eq!(seen, 10);
    }

    /// An object truncated by its owner while ebtrace has it mapped (as
    /// any target's owner may): its symbols read as zeros, and ebtrace
    /// goes on.
    #[test]
    fn an_object_truncated_while_mapped_reads_as_zeros() {
        let path = std::env::temp_dir().join(format!("ebtrace-elf-cut-{}", std::process::id()));
        std::fs::copy(std::env::current_exe().unwrap(), &path).unwrap();
        let obj = ElfObject::open(&path, None).unwrap();
        let whole = obj.scan_exported(&["main"]).unwrap();
        assert!(whole.symbols > 0);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        let cut = obj.scan_exported(&["main"]);
        assert!(cut.is_err() || cut.unwrap().found[0].is_none());
        assert!(obj.build_id().is_none());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn rejects_non_elf_and_replaced_files() {
        let dir = std::env::temp_dir().join(format!("ebtrace-elf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let err = ElfObject::open(&fifo, None).err().unwrap();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let text = dir.join("not-elf");
        std::fs::write(&text, vec![b'x'; 100]).unwrap();
        let err = ElfObject::open(&text, None).err().unwrap();
        assert!(err.to_string().contains("not a 64-bit"), "{err}");
        let exe = std::env::current_exe().unwrap();
        let err = ElfObject::open(&exe, Some(1)).err().unwrap();
        assert!(err.to_string().contains("not the file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Where a mutation lands: mostly in the headers and tables that
    /// parsing follows (ELF header, program headers, and the section
    /// headers and tables at the end), sometimes anywhere.
    fn mutation(len: usize) -> impl proptest::strategy::Strategy<Value = (usize, u8)> {
        use proptest::prelude::*;
        let tail = len.saturating_sub(4096);
        (
            prop_oneof![0..64usize, 64..1024usize.min(len), tail..len, 0..len],
            any::<u8>(),
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(384))]

        /// A damaged or hostile ELF object (a traced process maps what it
        /// likes) is read or refused, never a panic.
        #[test]
        fn mutated_elf_objects_are_read_or_refused(
            mutations in proptest::collection::vec(mutation(real_elf().len()), 1..24),
            keep in proptest::prelude::any::<proptest::sample::Index>(),
            truncate in proptest::prelude::any::<bool>(),
        ) {
            let mut bytes = real_elf().to_vec();
            for (at, value) in mutations {
                bytes[at] = value;
            }
            if truncate {
                bytes.truncate(keep.index(bytes.len() + 1));
            }
            let path = scratch_file(&bytes);
            if let Ok(obj) = ElfObject::open(&path, None) {
                obj.strings_contain(b"main");
                let scan = obj.scan(&["main", "_start", "__libc_start_main"], |_| true);
                for found in scan.into_iter().flat_map(|s| s.found).flatten() {
                    if let Some(offset) = obj.file_offset(found.vaddr) {
                        obj.byte_at(offset);
                    }
                }
                for seg in obj.segments() {
                    obj.file_offset(seg.vaddr.wrapping_add(seg.filesz / 2));
                }
            }
            std::fs::remove_file(&path).unwrap();
        }
    }

    /// A small real ELF executable.
    fn real_elf() -> &'static [u8] {
        static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        BYTES.get_or_init(|| std::fs::read("/bin/true").expect("read /bin/true"))
    }

    fn scratch_file(bytes: &[u8]) -> PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("ebtrace-elf-prop-{}-{n}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        path
    }
}
