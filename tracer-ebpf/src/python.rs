//! The Python frames of the current thread, for the stack programs: its
//! `PyThreadState` through glibc's thread-specific data, then its frame
//! chain, innermost first (see `tracer_common::python`). Every read is of
//! user memory the target controls, through the helper that checks it;
//! the walk is bounded, so a chain that loops or points anywhere ends.
//!
//! Reads of the target's memory are most of what the walk costs: the
//! state's thread and frame come in one read; then each frame, and its
//! code object's first line, which tells userspace a code object freed
//! and its memory reused by another from the one that ran.

use aya_ebpf::{
    helpers::{
        bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{self, bpf_get_current_task_btf},
    },
    macros::map,
    maps::HashMap,
};
use tracer_common::{
    MAX_TARGETS,
    python::{
        FRAME_ENTRY, FRAME_READ_BYTES, FRAME_SHIM, LAYOUT_LASTI, MAX_PYTHON_FRAMES,
        MAX_PYTHON_WALK, NO_OFFSET, PYTHON_NO_THREAD, PYTHON_TRUNCATED, PYTHON_UNREADABLE,
        PYTHON_WALKED, PythonFrameRecord, PythonOffsets, PythonProcess, PythonStack, python_slot,
    },
};

/// See `tracer_common::python::names::PYTHON_PROCESSES`.
#[map]
static PYTHON_PROCESSES: HashMap<u32, PythonProcess> = HashMap::with_max_entries(MAX_TARGETS, 0);

/// See `tracer_common::python::names::TASK_FSBASE_OFFSET`.
#[unsafe(no_mangle)]
static TASK_FSBASE_OFFSET: u32 = 0;

/// glibc's first block of thread-specific data has this many keys; the
/// rest are reached through an array of pointers to blocks of as many.
const KEYS_PER_BLOCK: u32 = 32;
/// glibc's `PTHREAD_KEYS_MAX`.
const MAX_KEYS: u32 = 1024;
/// Bytes of glibc's `struct pthread_key_data { seq; data; }`.
const KEY_DATA_BYTES: u64 = 16;

/// Bytes of scratch memory the walk needs: a thread state's bytes.
pub(crate) const SCRATCH_BYTES: usize = STATE_MASK as usize + 8;

/// Bytes of a thread state read at once are masked with this.
const STATE_MASK: u64 = 511;

/// Writes into `out` the Python frames of the current thread of `tgid`,
/// if `tgid` runs Python; else leaves it empty. `scratch` holds what is
/// read of the target's memory on the way.
///
/// # Safety
/// `out` and `scratch` (of [`SCRATCH_BYTES`]) are exclusively owned,
/// writable memory (parts of a reserved ring-buffer slot).
#[inline(always)]
pub(crate) unsafe fn write_python_stack(out: *mut PythonStack, scratch: *mut u8, tgid: u32) {
    // SAFETY: as the caller's.
    unsafe {
        (*out).len = 0;
        (*out).flags = 0;
        (*out).depth = 0;
        (*out)._pad = 0;
    }
    // SAFETY: the value is copied out at once.
    let Some(process) = (unsafe { PYTHON_PROCESSES.get(tgid) }).copied() else {
        return;
    };
    let mut flags = PYTHON_WALKED;
    // SAFETY: as the caller's.
    match unsafe { current_frame(&process, scratch) } {
        Some(Some(frame)) => {
            // SAFETY: as the caller's.
            unsafe { walk(out, frame, &process.offsets, &mut flags) }
        }
        Some(None) => flags |= PYTHON_UNREADABLE,
        None => flags |= PYTHON_NO_THREAD,
    };
    // SAFETY: as the caller's. Read back from the record, the depth is a
    // value the verifier does not know: every exit of the walk reaches
    // here in one state, and what follows is checked once, not once per
    // depth.
    unsafe {
        let depth = core::ptr::read_volatile(&raw const (*out).depth);
        (*out).len = depth.min(MAX_PYTHON_FRAMES as u32);
        (*out).flags = flags;
    }
}

/// The innermost frame of the current thread's `PyThreadState` (0: none
/// running): `None` if the thread has no state, `Some(None)` if its frame
/// could not be read.
///
/// # Safety
/// `scratch` is as [`write_python_stack`]'s.
#[inline(always)]
unsafe fn current_frame(process: &PythonProcess, scratch: *mut u8) -> Option<Option<u64>> {
    let o = &process.offsets;
    let thread_pointer = thread_pointer()?;
    let state = thread_state(process, thread_pointer)?;
    // The state's thread and frame, in one read (of less than
    // `STATE_MASK` bytes, every layout's).
    let first = u64::from(o.thread_frame.min(o.thread_id));
    let last = u64::from(o.thread_frame.max(o.thread_id));
    let size = (last + 8 - first) & STATE_MASK;
    // SAFETY: `size` is within the scratch; the helper checks the source.
    let failed = unsafe {
        generated::bpf_probe_read_user(scratch.cast(), size as u32, (state + first) as *const _)
    } != 0;
    if failed {
        return None;
    }
    // SAFETY: both offsets are within the bytes just read, masked within the scratch.
    let (thread_id, frame) = unsafe {
        (
            scratch
                .add(((u64::from(o.thread_id) - first) & STATE_MASK) as usize)
                .cast::<u64>()
                .read(),
            scratch
                .add(((u64::from(o.thread_frame) - first) & STATE_MASK) as usize)
                .cast::<u64>()
                .read(),
        )
    };
    if thread_id != thread_pointer {
        return None;
    }
    if o.cframe_frame == NO_OFFSET || frame == 0 {
        return Some(Some(frame));
    }
    Some(read_user(frame + u64::from(o.cframe_frame)))
}

/// The current thread's `PyThreadState`, if it has one: the pointer bound
/// to the interpreter's key in glibc's data of the thread (which the
/// caller checks names the thread back).
#[inline(always)]
fn thread_state(process: &PythonProcess, thread_pointer: u64) -> Option<u64> {
    let key = process.tss_key;
    let specific = thread_pointer + u64::from(process.specific_offset);
    let slot = if key < KEYS_PER_BLOCK {
        specific + KEY_DATA_BYTES * u64::from(key)
    } else if key < MAX_KEYS {
        let blocks = specific + KEY_DATA_BYTES * u64::from(KEYS_PER_BLOCK);
        let block: u64 = read_user(blocks + 8 * u64::from(key / KEYS_PER_BLOCK))?;
        if block == 0 {
            return None;
        }
        block + KEY_DATA_BYTES * u64::from(key % KEYS_PER_BLOCK)
    } else {
        return None;
    };
    let state: u64 = read_user(slot + 8)?;
    (state != 0).then_some(state)
}

/// The current thread's thread pointer (`fs_base`).
#[inline(always)]
fn thread_pointer() -> Option<u64> {
    // SAFETY: a global read-only after load.
    let offset = unsafe { core::ptr::read_volatile(&TASK_FSBASE_OFFSET) };
    if offset == 0 {
        return None;
    }
    // SAFETY: the current task, read with a helper that checks the address.
    let fs_base = unsafe {
        let task = bpf_get_current_task_btf() as *const u8;
        bpf_probe_read_kernel(task.add(offset as usize).cast::<u64>()).ok()?
    };
    (fs_base != 0).then_some(fs_base)
}

/// Walks the frame chain from `frame` into `out`, and the frames walked
/// into its `depth`.
///
/// Frame `i` of the chain goes in slot [`python_slot`]`(i)`, entry frames
/// of no function's too (marked [`FRAME_SHIM`]), and the loop's body has
/// no branch but its
/// exits: every way through an iteration then leaves the same state, and
/// the verifier walks the loop once per iteration instead of once per way
/// of getting there (which exceeds its limit within a few iterations).
///
/// # Safety
/// As [`write_python_stack`]'s.
#[inline(always)]
unsafe fn walk(out: *mut PythonStack, mut frame: u64, o: &PythonOffsets, flags: &mut u32) {
    let f = Fields::new(o);
    // Masked into the buffer (a power of two), not clamped: see [`Field`].
    let size = u32::from(o.frame_bytes) & (FRAME_READ_BYTES as u32 - 1);
    let first_line_offset = u64::from(o.code_first_line);
    let mut buf = [0u64; FRAME_WORDS];
    for i in 0..MAX_PYTHON_WALK {
        // SAFETY: as the caller's.
        unsafe { (*out).depth = i as u32 };
        if frame == 0 {
            return;
        }
        // SAFETY: `size` is at most the buffer's; the helper checks the source.
        let failed = unsafe {
            generated::bpf_probe_read_user(buf.as_mut_ptr().cast(), size, frame as *const _)
        } != 0;
        if failed {
            *flags |= PYTHON_UNREADABLE;
            return;
        }
        // 3.14's `f_executable` is a tagged reference: its low bits are
        // flags, never part of an object's (8-byte aligned) address.
        let code = f.code.of(&buf) & !7;
        let raw = f.instruction.of(&buf);
        // 3.10's `f_lasti` is an `int`, sign-extended; elsewhere a pointer.
        let lasti = raw as u32 as i32 as i64 as u64;
        let instruction = (lasti & f.lasti_mask) | (raw & !f.lasti_mask);
        let shim = at_least(f.owner.of(&buf) & 0xff, f.shim_owner);
        let entry = 1 ^ is_zero(f.is_entry.of(&buf) & f.is_entry_mask);
        let frame_flags = f.entry_flags | (shim * FRAME_SHIM) | (entry * FRAME_ENTRY);
        // A shim's code is none's; its line is read and never used, which
        // keeps every way through here alike.
        let mut first_line = u32::MAX;
        // SAFETY: the helper checks the source and fails where it cannot read.
        unsafe {
            generated::bpf_probe_read_user(
                (&raw mut first_line).cast(),
                4,
                (code + first_line_offset) as *const _,
            )
        };
        // SAFETY: as the caller's; the slot is within the array.
        if let Some(slot) = unsafe { (*out).frames.get_mut(python_slot(i)) } {
            *slot = PythonFrameRecord {
                code,
                instruction,
                first_line,
                flags: frame_flags,
            };
        }
        frame = f.previous.of(&buf);
    }
    // SAFETY: as the caller's.
    unsafe { (*out).depth = MAX_PYTHON_WALK as u32 };
    if frame != 0 {
        *flags |= PYTHON_TRUNCATED;
    }
}

/// 1 if `x` is 0, else 0, without a branch (for `x` below 2^63).
#[inline(always)]
fn is_zero(x: u64) -> u32 {
    ((opaque(x | x.wrapping_neg()) >> 63) ^ 1) as u32
}

/// `x`, through memory: the compiler no longer knows what it can be, and
/// cannot turn arithmetic on it back into a comparison (a branch: BPF has
/// no conditional move), which splits the verifier's path in two.
#[inline(always)]
fn opaque(x: u64) -> u64 {
    // SAFETY: a read of a local.
    unsafe { core::ptr::read_volatile(&x) }
}

/// 1 if `x >= y`, else 0, without a branch (for both below 2^63).
#[inline(always)]
fn at_least(x: u64, y: u64) -> u32 {
    ((x.wrapping_sub(y) >> 63) ^ 1) as u32
}

/// Words of a frame read at once.
const FRAME_WORDS: usize = FRAME_READ_BYTES / 8;

/// Where a field lies in a frame read into words: its word and its shift
/// within the word (a field never straddles two). Masked, not clamped:
/// a branch here would split every path through the loop in two.
#[derive(Clone, Copy)]
struct Field {
    word: usize,
    shift: u64,
}

impl Field {
    #[inline(always)]
    fn at(offset: u16) -> Field {
        Field {
            word: (offset as usize >> 3) & (FRAME_WORDS - 1),
            shift: (offset as u64 & 7) * 8,
        }
    }

    /// The field's bytes, from its offset to the end of its word.
    #[inline(always)]
    fn of(self, buf: &[u64; FRAME_WORDS]) -> u64 {
        // SAFETY: `word` is within `buf`, masked in `at`.
        let value = unsafe { *buf.as_ptr().add(self.word) };
        value >> self.shift
    }
}

/// The frame fields of a layout, and the masks that stand in for its
/// branches (see [`PythonOffsets::entry_mask`] and
/// [`PythonOffsets::shim_owner`]).
struct Fields {
    code: Field,
    previous: Field,
    instruction: Field,
    owner: Field,
    is_entry: Field,
    /// All ones where the instruction is 3.10's `f_lasti`.
    lasti_mask: u64,
    is_entry_mask: u64,
    shim_owner: u64,
    /// [`FRAME_ENTRY`] where every frame is an entry (3.10).
    entry_flags: u32,
}

impl Fields {
    #[inline(always)]
    fn new(o: &PythonOffsets) -> Fields {
        let lasti = u64::from(o.flags & LAYOUT_LASTI);
        Fields {
            code: Field::at(o.frame_code),
            previous: Field::at(o.frame_previous),
            instruction: Field::at(o.frame_instruction),
            owner: Field::at(o.frame_owner),
            is_entry: Field::at(o.frame_is_entry),
            lasti_mask: opaque(0u64.wrapping_sub(lasti)),
            is_entry_mask: u64::from(o.entry_mask),
            shim_owner: u64::from(o.shim_owner),
            entry_flags: lasti as u32 * FRAME_ENTRY,
        }
    }
}

#[inline(always)]
fn read_user<T>(address: u64) -> Option<T> {
    // SAFETY: the helper checks the address and fails where it cannot read.
    unsafe { bpf_probe_read_user(address as *const T) }.ok()
}
