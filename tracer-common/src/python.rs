//! Python frames on sampled stacks: how the programs find the frames a
//! CPython thread is running, and what they write of each.
//!
//! Userspace finds a traced process's interpreter (its `_PyRuntime`, its
//! version, the thread-specific key its threads' states are bound to) and
//! puts a [`PythonProcess`] in [`names::PYTHON_PROCESSES`]. A stack
//! program then reads the sampled thread's `PyThreadState` through
//! glibc's thread-specific data (the thread pointer, `fs_base` on x86-64,
//! is glibc's `struct pthread`), checks that the state is that thread's,
//! and walks its frame chain, innermost first, a bounded number of steps.
//! Each frame's code object and instruction are written as they are;
//! userspace names them, reading the code objects, while the process runs.
//!
//! A chain deeper than a stack record holds keeps both its ends: the
//! innermost [`PYTHON_INNER_FRAMES`] in order, then the outermost
//! [`PYTHON_OUTER_FRAMES`] walked, in a ring (see [`PythonStack`]).

/// Most Python frames written per stack, entry frames of no function's
/// included.
pub const MAX_PYTHON_FRAMES: usize = PYTHON_INNER_FRAMES + PYTHON_OUTER_FRAMES;

/// Frames of a chain's inner end kept, in order, however deep it is.
pub const PYTHON_INNER_FRAMES: usize = 96;

/// Frames of a chain's outer end kept (the last walked), a power of two.
pub const PYTHON_OUTER_FRAMES: usize = 32;

/// Most frames of a chain walked: a chain that loops ends here. Above
/// CPython's default recursion limit (1,000). The verifier walks the loop
/// once per frame: the sampling program takes about 190,000 of its
/// 1,000,000 instructions.
pub const MAX_PYTHON_WALK: usize = 1024;

/// Bytes of the buffer a frame is read into, a power of two: enough for
/// every field of every layout the programs read (3.10's `f_lasti` ends at
/// 100).
pub const FRAME_READ_BYTES: usize = 128;

/// An offset the layout does not have.
pub const NO_OFFSET: u16 = u16::MAX;

/// Names of the maps and globals of the Python frame walk.
pub mod names {
    /// A hash map from tgid to [`super::PythonProcess`]: the processes
    /// whose stacks get Python frames.
    pub const PYTHON_PROCESSES: &str = "PYTHON_PROCESSES";
    /// Global: the offset of `thread.fsbase` in `task_struct` (0: not
    /// known, and no Python frames are read).
    pub const TASK_FSBASE_OFFSET: &str = "TASK_FSBASE_OFFSET";
}

/// Where one process's interpreter keeps what the walk reads.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonProcess {
    /// Offset from the thread pointer of glibc's first block of
    /// thread-specific data (`struct pthread.specific_1stblock`); the
    /// second-level array of pointers follows it, 32 entries later.
    pub specific_offset: u32,
    /// The `pthread_key_t` every Python thread's state is bound to
    /// (`autoTSSkey`).
    pub tss_key: u32,
    /// The frame layout of its version.
    pub offsets: PythonOffsets,
}

/// Byte offsets of the fields the walk reads ([`NO_OFFSET`]: the version
/// has no such field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonOffsets {
    /// `PyThreadState`: its current frame (3.10 `frame`, 3.13 `current_frame`)
    /// or its `_PyCFrame` (3.11, 3.12 `cframe`).
    pub thread_frame: u16,
    /// `_PyCFrame.current_frame`, where the state points at a `_PyCFrame`.
    pub cframe_frame: u16,
    /// `PyThreadState.thread_id` (`pthread_self()`, the thread pointer):
    /// the state found must be the sampled thread's.
    pub thread_id: u16,
    /// The frame's code object (`f_code`, `f_executable`).
    pub frame_code: u16,
    /// The next frame out (`f_back`, `previous`).
    pub frame_previous: u16,
    /// The frame's instruction: 3.10's `f_lasti` (an `int`, in code units),
    /// or a pointer into the code (`prev_instr`, `instr_ptr`).
    pub frame_instruction: u16,
    /// `owner` (a byte), 3.11+.
    pub frame_owner: u16,
    /// `is_entry` (a byte), 3.11 only.
    pub frame_is_entry: u16,
    /// The code object's `co_firstlineno` (an `int`).
    pub code_first_line: u16,
    /// [`LAYOUT_LASTI`], else 0.
    pub flags: u16,
    /// Bytes of a frame read at once (less than [`FRAME_READ_BYTES`]): the
    /// fields above end within them, and a frame at the end of the
    /// interpreter's frame stack is not read past its end.
    pub frame_bytes: u16,
    /// The least `owner` of entry frames that are no function's (3.12 and
    /// 3.13 `FRAME_OWNED_BY_CSTACK`, 3.14 `FRAME_OWNED_BY_INTERPRETER`,
    /// below `FRAME_OWNED_BY_CSTACK`); [`NO_SHIM`]: none (more than any
    /// owner byte).
    pub shim_owner: u16,
    /// 0xff where frames say whether they are an entry (3.11's
    /// `is_entry`), else 0.
    pub entry_mask: u16,
    /// Padding.
    pub _pad: [u16; 3],
}

/// [`PythonOffsets::shim_owner`] of a version without shims.
pub const NO_SHIM: u16 = 0x100;

/// [`PythonOffsets::flags`]: 3.10. The instruction is `f_lasti`, and every
/// frame is run by a C call of its own (each is an entry frame).
pub const LAYOUT_LASTI: u16 = 1;

/// One Python frame of a stack, as the program read it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PythonFrameRecord {
    /// Address of its code object.
    pub code: u64,
    /// Its instruction: `f_lasti` (3.10) or the instruction pointer.
    pub instruction: u64,
    /// The code object's `co_firstlineno` as read (`u32::MAX`: it could
    /// not be): userspace checks the code object it reads at
    /// [`Self::code`] against it.
    pub first_line: u32,
    /// [`FRAME_ENTRY`].
    pub flags: u32,
}

/// [`PythonFrameRecord::flags`]: the outermost frame of one C call of the
/// interpreter's eval loop: the frames up to it stand in for one native
/// `_PyEval_EvalFrameDefault` frame.
pub const FRAME_ENTRY: u32 = 1;
/// [`PythonFrameRecord::flags`]: an entry frame of no function's (3.12+
/// `FRAME_OWNED_BY_CSTACK`, 3.14 also `FRAME_OWNED_BY_INTERPRETER`), pushed by each C call of the eval loop below
/// its first frame: the frame before it was the outermost of its call.
pub const FRAME_SHIM: u32 = 2;

/// Python frames of one stack record.
///
/// Frame `i` of the chain (0 innermost) is in slot `i` while `i` is below
/// [`PYTHON_INNER_FRAMES`]; beyond, in slot `PYTHON_INNER_FRAMES + (i -
/// PYTHON_INNER_FRAMES) % PYTHON_OUTER_FRAMES`, so where the chain is
/// deeper than [`MAX_PYTHON_FRAMES`] the last slots hold its outermost
/// frames, rotated, and those between the two ends are left out.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PythonStack {
    /// Frames filled in [`Self::frames`]: the least of [`Self::depth`] and
    /// [`MAX_PYTHON_FRAMES`].
    pub len: u32,
    /// [`PYTHON_TRUNCATED`], [`PYTHON_UNREADABLE`], [`PYTHON_NO_THREAD`].
    pub flags: u32,
    /// Frames of the chain walked, at most [`MAX_PYTHON_WALK`].
    pub depth: u32,
    /// Padding.
    pub _pad: u32,
    /// The frames, the first [`Self::len`] filled.
    pub frames: [PythonFrameRecord; MAX_PYTHON_FRAMES],
}

/// The slot of [`PythonStack::frames`] frame `i` of a chain goes in.
pub const fn python_slot(i: usize) -> usize {
    if i < PYTHON_INNER_FRAMES {
        i
    } else {
        PYTHON_INNER_FRAMES + (i - PYTHON_INNER_FRAMES) % PYTHON_OUTER_FRAMES
    }
}

/// [`PythonStack::flags`]: the chain went on past the frames walked
/// ([`MAX_PYTHON_WALK`]).
pub const PYTHON_TRUNCATED: u32 = 1;
/// [`PythonStack::flags`]: a frame or thread state could not be read
/// (the chain ends there).
pub const PYTHON_UNREADABLE: u32 = 2;
/// [`PythonStack::flags`]: the process runs Python, and the thread has no
/// Python state of its own (a thread Python never ran in).
pub const PYTHON_NO_THREAD: u32 = 4;
/// [`PythonStack::flags`]: the process runs Python and its frames were
/// looked for (set whenever the walk ran).
pub const PYTHON_WALKED: u32 = 8;
