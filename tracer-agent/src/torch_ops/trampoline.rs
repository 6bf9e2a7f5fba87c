//! The code PyTorch calls for each RecordFunction, in memory the agent
//! never frees.
//!
//! A RecordFunction copies the callbacks' pointers when it starts and
//! calls the end one when it ends, possibly after the callback was
//! removed, and the agent unloaded. So PyTorch is given the addresses of a
//! small trampoline copied into a page of its own: it counts itself in,
//! calls the agent's function through a slot of the data page beside it,
//! and counts itself out; with the slot empty it returns at once. The agent
//! empties the slots before it waits for the count to reach zero and goes:
//! the increment comes before the slot is read, so no call enters the
//! agent after that wait.
//!
//! The pages stay for the life of the process, at the first free one of a
//! few fixed addresses: the next agent loaded into the process finds them
//! there (by their contents) and uses them again, so that many captures
//! leave one trampoline, not one each.

use core::{
    ffi::c_void,
    sync::atomic::{AtomicI64, AtomicUsize, Ordering},
};

use crate::sys;

/// The data page: what the trampoline reads, at the offsets its code uses.
#[repr(C)]
pub struct Slots {
    /// The start functions, one per registered scope: `FUNCTION`,
    /// `BACKWARD_FUNCTION`, `USER_SCOPE`.
    pub start: [AtomicUsize; 3],
    /// The end function.
    pub end: AtomicUsize,
    /// Calls inside the trampoline now.
    pub inside: AtomicI64,
    /// [`MAGIC`], once the pages are set up.
    magic: [u8; 16],
}

/// Marks the data page of a trampoline of this layout.
const MAGIC: [u8; 16] = *b"ebtrace-torch-1\0";

const PAGE: usize = 4096;

/// Where the pages are looked for and made: far below where the kernel
/// places mappings and libraries (near the top of the 47-bit space), far
/// above any heap.
const FIXED_ADDRESSES: [usize; 8] = [
    0x5eb7_a000_0000,
    0x5eb7_b000_0000,
    0x5eb7_c000_0000,
    0x5eb7_d000_0000,
    0x4eb7_a000_0000,
    0x4eb7_b000_0000,
    0x4eb7_c000_0000,
    0x4eb7_d000_0000,
];

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".pushsection .text.ebtrace_torch_trampoline,\"ax\",@progbits",
    ".p2align 4",
    ".globl ebtrace_torch_trampoline_begin",
    ".hidden ebtrace_torch_trampoline_begin",
    "ebtrace_torch_trampoline_begin:",
    // The start callbacks: `std::unique_ptr<ObserverContext>
    // (*)(const RecordFunction&)`: rdi is where the returned pointer goes
    // (a class type with a destructor is returned in memory), rsi the
    // RecordFunction. Each loads its slot's offset and goes on in common.
    "ebtrace_torch_start_0:",
    "    mov eax, 0",
    "    jmp ebtrace_torch_start_common",
    "ebtrace_torch_start_1:",
    "    mov eax, 8",
    "    jmp ebtrace_torch_start_common",
    "ebtrace_torch_start_2:",
    "    mov eax, 16",
    "ebtrace_torch_start_common:",
    "    mov rcx, qword ptr [rip + ebtrace_torch_trampoline_slots]",
    "    lock add qword ptr [rcx + 32], 1",
    "    mov rax, qword ptr [rcx + rax]",
    "    test rax, rax",
    "    jz ebtrace_torch_start_empty",
    // Keeps the slots' address; the push also aligns the stack to 16 for
    // the call, as at any call site.
    "    push rcx",
    "    call rax",
    "    pop rcx",
    "    lock sub qword ptr [rcx + 32], 1",
    "    ret",
    "ebtrace_torch_start_empty:",
    "    lock sub qword ptr [rcx + 32], 1",
    "    mov qword ptr [rdi], 0",
    "    mov rax, rdi",
    "    ret",
    // The end callback: `void (*)(const RecordFunction&, ObserverContext*)`.
    "ebtrace_torch_end:",
    "    mov rcx, qword ptr [rip + ebtrace_torch_trampoline_slots]",
    "    lock add qword ptr [rcx + 32], 1",
    "    mov rax, qword ptr [rcx + 24]",
    "    test rax, rax",
    "    jz ebtrace_torch_end_empty",
    "    push rcx",
    "    call rax",
    "    pop rcx",
    "ebtrace_torch_end_empty:",
    "    lock sub qword ptr [rcx + 32], 1",
    "    ret",
    ".p2align 3",
    // The data page's address, written into the copy.
    "ebtrace_torch_trampoline_slots:",
    "    .quad 0",
    ".globl ebtrace_torch_trampoline_end",
    ".hidden ebtrace_torch_trampoline_end",
    "ebtrace_torch_trampoline_end:",
    ".globl ebtrace_torch_trampoline_entries",
    ".hidden ebtrace_torch_trampoline_entries",
    ".popsection",
    // Each entry's offset from the beginning, for the copy.
    ".pushsection .rodata.ebtrace_torch_trampoline,\"a\",@progbits",
    ".p2align 3",
    "ebtrace_torch_trampoline_entries:",
    "    .quad ebtrace_torch_start_0 - ebtrace_torch_trampoline_begin",
    "    .quad ebtrace_torch_start_1 - ebtrace_torch_trampoline_begin",
    "    .quad ebtrace_torch_start_2 - ebtrace_torch_trampoline_begin",
    "    .quad ebtrace_torch_end - ebtrace_torch_trampoline_begin",
    "    .quad ebtrace_torch_trampoline_slots - ebtrace_torch_trampoline_begin",
    ".popsection",
);

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    static ebtrace_torch_trampoline_begin: u8;
    static ebtrace_torch_trampoline_end: u8;
    static ebtrace_torch_trampoline_entries: [usize; 5];
}

/// The trampoline of this process: its entries, and the slots they call
/// through.
pub struct Trampoline {
    /// The start entries, in the order of [`Slots::start`].
    pub start: [usize; 3],
    /// The end entry.
    pub end: usize,
    /// The data page.
    pub slots: &'static Slots,
}

/// The code's bytes and its entries' offsets in them.
#[cfg(target_arch = "x86_64")]
fn code() -> (&'static [u8], [usize; 5]) {
    // SAFETY: both symbols are in the section above, `end` after `begin`;
    // the entries table is five words.
    unsafe {
        let begin = &raw const ebtrace_torch_trampoline_begin;
        let end = &raw const ebtrace_torch_trampoline_end;
        let len = end as usize - begin as usize;
        (
            core::slice::from_raw_parts(begin, len),
            ebtrace_torch_trampoline_entries,
        )
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn code() -> (&'static [u8], [usize; 5]) {
    (&[], [0; 5])
}

impl Trampoline {
    /// The process's trampoline: the one an earlier agent left, or one
    /// made now. The error says why there is none.
    pub fn get() -> Result<Trampoline, &'static str> {
        let (code, entries) = code();
        if code.is_empty() {
            return Err("PyTorch ops are recorded on x86-64 only");
        }
        if code.len() + 8 > PAGE {
            return Err("the trampoline does not fit its page");
        }
        for address in FIXED_ADDRESSES {
            if let Some(slots) = left_at(address, code, entries[4]) {
                return Ok(Self::at(address, slots, entries));
            }
            if let Some(slots) = make_at(address, code, entries[4]) {
                return Ok(Self::at(address, slots, entries));
            }
        }
        Err("no room for the trampoline at any of its addresses")
    }

    fn at(address: usize, slots: &'static Slots, entries: [usize; 5]) -> Trampoline {
        Trampoline {
            start: [
                address + entries[0],
                address + entries[1],
                address + entries[2],
            ],
            end: address + entries[3],
            slots,
        }
    }

    /// Points the trampoline at the agent's functions.
    pub fn fill(&self, start: [usize; 3], end: usize) {
        for (slot, f) in self.slots.start.iter().zip(start) {
            slot.store(f, Ordering::SeqCst);
        }
        self.slots.end.store(end, Ordering::SeqCst);
    }

    /// Empties the slots, then waits until no call is inside the agent's
    /// functions (a call takes well under a microsecond; only a thread
    /// stopped inside one keeps this waiting).
    pub fn empty_and_drain(&self) {
        for slot in &self.slots.start {
            slot.store(0, Ordering::SeqCst);
        }
        self.slots.end.store(0, Ordering::SeqCst);
        while self.slots.inside.load(Ordering::SeqCst) > 0 {
            sys::sleep_ns(100_000);
        }
    }
}

/// Empties the slots of the process's trampoline, if it has one, without
/// waiting for calls inside: for a forked child, whose only thread is the
/// one calling this. Async-signal-safe.
pub fn empty_existing() {
    let (code, entries) = code();
    if code.is_empty() {
        return;
    }
    for address in FIXED_ADDRESSES {
        if let Some(slots) = left_at(address, code, entries[4]) {
            for slot in &slots.start {
                slot.store(0, Ordering::SeqCst);
            }
            slots.end.store(0, Ordering::SeqCst);
        }
    }
}

/// The data page of the trampoline an earlier agent of this layout left at
/// `address`, if there is one.
fn left_at(address: usize, code: &[u8], slots_offset: usize) -> Option<&'static Slots> {
    let mut magic = [0u8; 16];
    let data = address + PAGE;
    let magic_at = data + core::mem::offset_of!(Slots, magic);
    if sys::read_own_memory(magic_at, &mut magic) != magic.len() || magic != MAGIC {
        return None;
    }
    // Its code is this agent's code, but for the slots' address.
    let mut left = [0u8; PAGE];
    let left = &mut left[..code.len()];
    if sys::read_own_memory(address, left) != code.len() {
        return None;
    }
    let same = left[..slots_offset] == code[..slots_offset]
        && left[slots_offset..slots_offset + 8] == data.to_le_bytes()
        && left[slots_offset + 8..] == code[slots_offset + 8..];
    // SAFETY: the page is mapped (it was just read), writable (made so
    // below), and holds a `Slots` that nothing unmaps.
    same.then(|| unsafe { &*(data as *const Slots) })
}

/// Maps the two pages at `address` (if it is free) and sets them up.
fn make_at(address: usize, code: &[u8], slots_offset: usize) -> Option<&'static Slots> {
    // SAFETY: asks for fresh pages at `address` only if nothing is there
    // (MAP_FIXED_NOREPLACE; a kernel that ignores it places them elsewhere,
    // and they are given back).
    let mem = unsafe {
        sys::mmap(
            address as *mut c_void,
            2 * PAGE,
            sys::PROT_READ_WRITE,
            sys::MAP_PRIVATE_ANONYMOUS | sys::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if mem == sys::MAP_FAILED {
        return None;
    }
    if mem as usize != address {
        // SAFETY: the pages just mapped, elsewhere.
        unsafe { sys::munmap(mem, 2 * PAGE) };
        return None;
    }
    let data = address + PAGE;
    // SAFETY: both pages are ours and writable; the code fits the first.
    unsafe {
        core::ptr::copy_nonoverlapping(code.as_ptr(), mem.cast::<u8>(), code.len());
        core::ptr::write_unaligned((address + slots_offset) as *mut usize, data);
        let slots = data as *mut Slots;
        (&raw mut (*slots).magic).write(MAGIC);
        if sys::mprotect(mem, PAGE, sys::PROT_READ_EXEC) != 0 {
            sys::munmap(mem, 2 * PAGE);
            return None;
        }
        Some(&*slots)
    }
}
