//! Unwinding sampled user stacks with the objects' call frame information
//! (`.eh_frame`, `.debug_frame`), with framehop.
//!
//! The kernel walks user stacks by frame pointers, and most code is built
//! without them (Debian's Python, glibc, jaxlib): its walk stops after a
//! frame or two, or wanders. So the sampling program also copies the user
//! registers and the top of the user stack (see `tracer_common::stack`),
//! and the stack is unwound here, while the process runs, from the very
//! files it has mapped. Where an object has no call frame information for
//! an address, framehop follows the frame pointer there.

use std::{
    collections::HashMap,
    ops::{Deref, Range},
    sync::Arc,
    time::{Duration, Instant},
};

use framehop::{
    ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};

use super::{
    ElfObject, MappedObject,
    elf::SectionRange,
    maps::{code_ranges, in_code, objects_of, page_size, read_maps},
};

/// How often a process's mappings are read again when a sample is in code
/// outside them (a library loaded since, JIT code mapped since).
const MAPS_REREAD_AFTER: Duration = Duration::from_secs(1);

/// Most frames an unwound stack keeps (as many as the kernel's walk).
const MAX_FRAMES: usize = tracer_common::stack::MAX_FRAMES;

/// What the sampling program copied of a thread's user state.
#[derive(Clone, Copy, Debug)]
pub struct UserStack<'a> {
    /// The instruction pointer.
    pub ip: u64,
    /// The stack pointer.
    pub sp: u64,
    /// The frame pointer (`rbp`).
    pub bp: u64,
    /// The stack's bytes from `sp` up.
    pub bytes: &'a [u8],
}

impl UserStack<'_> {
    /// The 8 bytes at `address`, if the copy holds them.
    fn read(&self, address: u64) -> Option<u64> {
        let at = usize::try_from(address.checked_sub(self.sp)?).ok()?;
        let word = self.bytes.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }
}

/// An unwound stack: the instruction address, then return addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unwound {
    /// The instruction address, then the return addresses, innermost first.
    pub frames: Vec<u64>,
    /// It reached the stack's outermost frame (rather than stopping where
    /// the copy ended or the information ran out).
    pub complete: bool,
}

/// A section's bytes, in the mapped object they are in.
#[derive(Clone)]
struct SectionBytes {
    object: Arc<ElfObject>,
    range: Range<usize>,
}

impl Deref for SectionBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.object.bytes(self.range.clone())
    }
}

/// One process's modules and the rules framehop found in them.
struct ProcessUnwinder {
    unwinder: UnwinderX86_64<SectionBytes>,
    cache: CacheX86_64,
    /// Its executable mappings, sorted: a sample elsewhere asks for the
    /// maps again. Those of no file (JIT code, the vDSO) are in it too:
    /// they hold no rules to find, and a jax process samples its JIT code
    /// and the vDSO every second.
    code: Vec<Range<u64>>,
    /// The executable mappings of files, sorted: the modules were made
    /// from them.
    modules_code: Vec<Range<u64>>,
    read_at: Instant,
}

/// Unwinds the stacks of sampled processes, keeping each process's
/// modules (and each object, shared between processes) between samples.
#[derive(Default)]
pub struct StackUnwinder {
    processes: HashMap<u32, ProcessUnwinder>,
    /// Objects by device and inode; `None`: not an ELF object it can read.
    objects: HashMap<(String, u64), Option<Arc<ElfObject>>>,
}

impl StackUnwinder {
    /// Unwinds `stack`, sampled in process `pid`; `None` when the process's
    /// mappings cannot be read (it exited).
    pub fn unwind(&mut self, pid: u32, stack: &UserStack<'_>) -> Option<Unwound> {
        self.unwind_at_most(pid, stack, MAX_FRAMES)
    }

    /// [`Self::unwind`], keeping up to `max_frames` frames.
    pub fn unwind_at_most(
        &mut self,
        pid: u32,
        stack: &UserStack<'_>,
        max_frames: usize,
    ) -> Option<Unwound> {
        let stale = match self.processes.get(&pid) {
            None => true,
            Some(p) => !in_code(&p.code, stack.ip) && p.read_at.elapsed() >= MAPS_REREAD_AFTER,
        };
        if stale && !self.read_maps(pid) {
            return None;
        }
        let process = self.processes.get_mut(&pid)?;
        let mut read_stack = |address: u64| stack.read(address).ok_or(());
        let mut frames = process.unwinder.iter_frames(
            stack.ip,
            UnwindRegsX86_64::new(stack.ip, stack.sp, stack.bp),
            &mut process.cache,
            &mut read_stack,
        );
        let mut out = Vec::new();
        let complete = loop {
            match frames.next() {
                Ok(Some(frame)) if out.len() < max_frames => out.push(address_of(frame)),
                Ok(Some(_)) | Err(_) => break false,
                Ok(None) => break true,
            }
        };
        Some(Unwound {
            frames: out,
            complete,
        })
    }

    /// Drops what it keeps of `pid`, and the objects no process maps now.
    fn forget(&mut self, pid: u32) {
        if self.processes.remove(&pid).is_some() {
            self.forget_unmapped_objects();
        }
    }

    /// Drops the processes that exited (a daemon samples processes that
    /// come and go for days), and the objects only they mapped.
    fn forget_exited(&mut self) {
        let before = self.processes.len();
        self.processes
            .retain(|pid, _| crate::procfs::is_listed(*pid));
        if self.processes.len() < before {
            self.forget_unmapped_objects();
        }
    }

    /// Drops the objects no process maps now, and what it could not open
    /// (tried again when a process maps it next).
    fn forget_unmapped_objects(&mut self) {
        // The modules of a process hold their objects' sections.
        self.objects
            .retain(|_, o| o.as_ref().is_some_and(|o| Arc::strong_count(o) > 1));
    }

    /// Reads `pid`'s mappings; makes a module of each object's code if they
    /// changed. False if they cannot be read (the process exited).
    fn read_maps(&mut self, pid: u32) -> bool {
        let Ok(maps) = read_maps(pid) else {
            self.forget(pid);
            return false;
        };
        let code = code_ranges(&maps);
        let objects = objects_of(pid, maps);
        let modules_code = code_ranges(objects.iter().flat_map(|o| &o.mappings));
        if let Some(known) = self.processes.get_mut(&pid)
            && known.modules_code == modules_code
        {
            // No file loaded since: keep the rules found so far.
            known.code = code;
            known.read_at = Instant::now();
            return true;
        }
        let process = self.process_unwinder(&objects, code, modules_code);
        match self.processes.insert(pid, process) {
            None => self.forget_exited(),
            // Libraries it unloaded may be mapped by no process now.
            Some(_) => self.forget_unmapped_objects(),
        }
        true
    }

    /// A module of each object's code.
    fn process_unwinder(
        &mut self,
        objects: &[MappedObject],
        code: Vec<Range<u64>>,
        modules_code: Vec<Range<u64>>,
    ) -> ProcessUnwinder {
        let mut unwinder = UnwinderX86_64::new();
        let page_size = page_size();
        for mapped in objects {
            if !mapped.mappings.iter().any(|m| m.perms.contains('x')) {
                continue;
            }
            let Some(object) = self.object(mapped) else {
                continue;
            };
            let Some(bias) = mapped.load_bias(object.segments(), page_size) else {
                continue;
            };
            for m in mapped.mappings.iter().filter(|m| m.perms.contains('x')) {
                unwinder.add_module(Module::new(
                    mapped.path.clone(),
                    m.start..m.end,
                    bias,
                    section_info(&object),
                ));
            }
        }
        ProcessUnwinder {
            unwinder,
            cache: CacheX86_64::new(),
            code,
            modules_code,
            read_at: Instant::now(),
        }
    }

    fn object(&mut self, mapped: &MappedObject) -> Option<Arc<ElfObject>> {
        self.objects
            .entry((mapped.dev.clone(), mapped.inode))
            .or_insert_with(|| {
                ElfObject::open(&mapped.open_path(), Some(mapped.inode))
                    .ok()
                    .map(Arc::new)
            })
            .clone()
    }
}

fn address_of(frame: FrameAddress) -> u64 {
    match frame {
        FrameAddress::InstructionPointer(a) => a,
        FrameAddress::ReturnAddress(a) => a.get(),
    }
}

/// The code of `function`'s cold part, from the object's `.eh_frame` alone
/// (no symbol needed): GCC moves a function's rarely run blocks into a
/// part of their own (`function.cold`, a local symbol that stripped
/// objects lack) and describes that part in the frame entry right after
/// the function's. That entry is taken only if its code starts inside a
/// frame, as a part does: a function starts with nothing on the stack
/// but its return address. `None` unless the entry at `function` (an
/// address in the object) is followed by such a part.
pub fn cold_part_after(object: &ElfObject, function: u64) -> Option<Range<u64>> {
    use gimli::UnwindSection as _;
    let eh_frame = object.section(".eh_frame")?;
    let text = object.section(".text")?;
    let bytes = object.bytes(eh_frame.file?);
    let section = gimli::EhFrame::new(bytes, gimli::LittleEndian);
    let bases = gimli::BaseAddresses::default()
        .set_eh_frame(eh_frame.svma.start)
        .set_text(text.svma.start);
    let mut entries = section.entries(&bases);
    let mut after_function = false;
    while let Ok(Some(entry)) = entries.next() {
        let gimli::CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let fde = partial
            .parse(|section, bases, offset| section.cie_from_offset(bases, offset))
            .ok()?;
        let code = fde.initial_address()..fde.end_address();
        if after_function {
            let apart = !code.contains(&function) && code.start != code.end;
            let in_text = text.svma.contains(&code.start) && code.end <= text.svma.end;
            let mut context = gimli::UnwindContext::new();
            let first = fde
                .unwind_info_for_address(&section, &bases, &mut context, code.start)
                .ok()?;
            let entry = matches!(
                first.cfa(),
                gimli::CfaRule::RegisterAndOffset { register, offset: 8 }
                    if *register == gimli::X86_64::RSP
            ) && first.registers().all(|(r, _)| *r == gimli::X86_64::RA);
            return (apart && in_text && !entry).then_some(code);
        }
        after_function = code.start == function;
    }
    None
}

/// The sections framehop reads, as the object holds them.
fn section_info(object: &Arc<ElfObject>) -> ExplicitModuleSectionInfo<SectionBytes> {
    let section = |name: &str| object.section(name);
    let svma = |s: &Option<SectionRange>| s.as_ref().map(|s| s.svma.clone());
    let bytes = |s: &Option<SectionRange>| {
        s.as_ref()
            .and_then(|s| s.file.clone())
            .map(|range| SectionBytes {
                object: Arc::clone(object),
                range,
            })
    };
    let text = section(".text");
    let eh_frame = section(".eh_frame");
    let eh_frame_hdr = section(".eh_frame_hdr");
    let debug_frame = section(".debug_frame");
    ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: svma(&text),
        text: bytes(&text),
        got_svma: svma(&section(".got")),
        eh_frame_svma: svma(&eh_frame),
        eh_frame: bytes(&eh_frame),
        eh_frame_hdr_svma: svma(&eh_frame_hdr),
        eh_frame_hdr: bytes(&eh_frame_hdr),
        debug_frame: bytes(&debug_frame),
        // Mach-O's.
        stubs_svma: None,
        stub_helper_svma: None,
        unwind_info: None,
        text_segment_svma: None,
        text_segment: None,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::Strategy as _;

    use super::*;

    #[test]
    fn the_copy_is_read_only_within_its_bytes() {
        let bytes: Vec<u8> = (0u8..24).collect();
        let stack = UserStack {
            ip: 0,
            sp: 0x1000,
            bp: 0,
            bytes: &bytes,
        };
        assert_eq!(
            stack.read(0x1000),
            Some(u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]))
        );
        assert_eq!(
            stack.read(0x1010),
            Some(u64::from_le_bytes([16, 17, 18, 19, 20, 21, 22, 23]))
        );
        // Below the stack pointer, across the end, past it, at the top of
        // the address space: not in the copy.
        for address in [0xff8, 0x1011, 0x1018, u64::MAX - 3] {
            assert_eq!(stack.read(address), None, "{address:#x}");
        }
    }

    /// An address in this test binary's code.
    fn own_code() -> u64 {
        own_code as fn() -> u64 as usize as u64
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// A traced process controls its stack: whatever it holds, and
        /// wherever its registers point, unwinding ends, within
        /// `MAX_FRAMES`, without a panic. Words near real code make the
        /// unwinder follow the call frame information of this process's
        /// own objects.
        #[test]
        fn any_stack_unwinds_to_a_bounded_end(
            words in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::prelude::any::<u64>(),
                    (0u64..0x4000).prop_map(|o| own_code() + o),
                    (0u64..0x800).prop_map(|o| 0x7ff0_0000_0000 + o * 8),
                ],
                0..600,
            ),
            ip_offset in proptest::option::of(0u64..0x4000),
            sp in proptest::prelude::any::<u64>(),
            bp in proptest::prelude::any::<u64>(),
        ) {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let stack = UserStack {
                ip: ip_offset.map_or(sp ^ bp, |o| own_code() + o),
                sp,
                bp,
                bytes: &bytes,
            };
            let mut unwinder = StackUnwinder::default();
            let unwound = unwinder
                .unwind(std::process::id(), &stack)
                .expect("this process's maps are readable");
            proptest::prop_assert!(unwound.frames.len() <= MAX_FRAMES);
        }
    }

    /// Code in no file (JIT code, the vDSO) is not a reason to read the
    /// maps again; code mapped after they were read is.
    #[test]
    fn maps_are_read_again_for_code_mapped_since_and_not_for_code_in_no_file() {
        use super::super::maps::AnonymousCode;

        let jit = AnonymousCode::map();
        let bytes = [0u8; 64];
        let sampled_at = |ip: u64| UserStack {
            ip,
            sp: 0x1000,
            bp: 0,
            bytes: &bytes,
        };
        let pid = std::process::id();
        let mut unwinder = StackUnwinder::default();
        assert!(unwinder.unwind(pid, &sampled_at(jit.address)).is_some());
        let long_ago = Instant::now() - 2 * MAPS_REREAD_AFTER;
        unwinder.processes.get_mut(&pid).unwrap().read_at = long_ago;
        assert!(unwinder.unwind(pid, &sampled_at(jit.address + 8)).is_some());
        assert_eq!(unwinder.processes[&pid].read_at, long_ago);
        let later = AnonymousCode::map();
        assert!(unwinder.unwind(pid, &sampled_at(later.address)).is_some());
        assert!(unwinder.processes[&pid].read_at > long_ago);
        assert!(in_code(&unwinder.processes[&pid].code, later.address));
    }

    #[test]
    fn a_process_that_is_gone_is_not_unwound() {
        let mut unwinder = StackUnwinder::default();
        let stack = UserStack {
            ip: 0x1000,
            sp: 0x2000,
            bp: 0,
            bytes: &[0; 64],
        };
        // Above any pid_max.
        assert_eq!(unwinder.unwind(u32::MAX, &stack), None);
        assert!(unwinder.processes.is_empty() && unwinder.objects.is_empty());
    }

    #[test]
    fn objects_are_let_go_with_the_last_process_that_maps_them() {
        let mut unwinder = StackUnwinder::default();
        let bytes = [0u8; 64];
        let stack = UserStack {
            ip: own_code(),
            sp: 0x1000,
            bp: 0,
            bytes: &bytes,
        };
        assert!(unwinder.unwind(std::process::id(), &stack).is_some());
        assert!(unwinder.objects.values().any(Option::is_some));
        unwinder.forget(std::process::id());
        assert!(unwinder.processes.is_empty() && unwinder.objects.is_empty());
    }
}
