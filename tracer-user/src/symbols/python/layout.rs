//! Where each CPython version keeps what ebtrace reads: the runtime's
//! interpreter list and thread-specific key, the thread state's frame, a
//! frame's code and instruction, a code object's names and line table, a
//! string's characters. Checked against each version's own headers and
//! against the interpreter's memory at run time (x86-64, release builds,
//! the GIL on).

use tracer_common::python::{LAYOUT_LASTI, NO_OFFSET, NO_SHIM, PythonOffsets};

/// A CPython minor version ebtrace reads: 3.`minor`.
pub const SUPPORTED_MINORS: std::ops::RangeInclusive<u8> = 10..=14;

/// What one CPython version's structures look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// 3.`minor`.
    pub minor: u8,
    /// `_PyRuntime`: the `pthread_key_t` of `autoTSSkey` (its `_key`).
    pub runtime_tss_key: u64,
    /// `_PyRuntime.interpreters.head`.
    pub runtime_interpreters_head: u64,
    /// `PyInterpreterState.next`.
    pub interpreter_next: u64,
    /// `PyInterpreterState`'s first thread state (`tstate_head`, `threads.head`).
    pub interpreter_threads_head: u64,
    /// `PyThreadState.next`.
    pub thread_next: u64,
    /// `PyThreadState.native_thread_id` (the kernel's thread id), 3.11+.
    pub thread_native_id: Option<u64>,
    /// The frame walk's offsets (see [`PythonOffsets`]).
    pub walk: PythonOffsets,
    /// `PyCodeObject.co_filename`.
    pub code_filename: u64,
    /// `PyCodeObject.co_name`.
    pub code_name: u64,
    /// `PyCodeObject.co_qualname`, 3.11+.
    pub code_qualname: Option<u64>,
    /// `PyCodeObject.co_linetable` (a `bytes`).
    pub code_linetable: u64,
    /// `PyCodeObject.co_code_adaptive`: where the bytecode starts inside
    /// the code object (3.11+; 3.10's instruction is an offset).
    pub code_adaptive: Option<u64>,
    /// `sizeof(PyASCIIObject)`: where an ASCII string's characters start.
    pub ascii_data: u64,
    /// `sizeof(PyCompactUnicodeObject)`: where other compact strings'
    /// characters start.
    pub compact_data: u64,
}

/// `PyObject.ob_type`.
pub const OBJECT_TYPE: u64 = 8;
/// `PyVarObject.ob_size`.
pub const VAR_OBJECT_SIZE: u64 = 16;
/// `PyBytesObject.ob_sval`.
pub const BYTES_DATA: u64 = 32;
/// `PyASCIIObject.length`.
pub const STRING_LENGTH: u64 = 16;
/// `PyASCIIObject.state` (its low byte: interned:2, kind:3, compact:1,
/// ascii:1; the rest is padding that holds garbage).
pub const STRING_STATE: u64 = 32;

/// `owner` of 3.12 and 3.13's entry frames (`FRAME_OWNED_BY_CSTACK`).
const OWNED_BY_CSTACK: u16 = 3;
/// The least `owner` of 3.14's frames of no function's
/// (`FRAME_OWNED_BY_INTERPRETER`, then `FRAME_OWNED_BY_CSTACK`), as
/// CPython's own `_PyFrame_IsIncomplete` tells them.
const OWNED_BY_INTERPRETER: u16 = 3;

impl Layout {
    /// The layout of CPython 3.`minor`, if ebtrace reads it.
    pub fn of(minor: u8) -> Option<Layout> {
        let walk =
            |thread_frame, cframe_frame, thread_id, code, previous, instruction| PythonOffsets {
                thread_frame,
                cframe_frame,
                thread_id,
                frame_code: code,
                frame_previous: previous,
                frame_instruction: instruction,
                frame_owner: NO_OFFSET,
                frame_is_entry: NO_OFFSET,
                code_first_line: 0,
                flags: 0,
                frame_bytes: 72,
                shim_owner: NO_SHIM,
                entry_mask: 0,
                _pad: [0; 3],
            };
        let layout = match minor {
            10 => Layout {
                minor,
                runtime_tss_key: 588,
                runtime_interpreters_head: 32,
                interpreter_next: 0,
                interpreter_threads_head: 8,
                thread_next: 8,
                thread_native_id: None,
                walk: PythonOffsets {
                    code_first_line: 40,
                    flags: LAYOUT_LASTI,
                    frame_bytes: 104,
                    ..walk(24, NO_OFFSET, 176, 32, 24, 96)
                },
                code_filename: 104,
                code_name: 112,
                code_qualname: None,
                code_linetable: 120,
                code_adaptive: None,
                ascii_data: 48,
                compact_data: 72,
            },
            11 => Layout {
                minor,
                runtime_tss_key: 596,
                runtime_interpreters_head: 40,
                interpreter_next: 0,
                interpreter_threads_head: 16,
                thread_next: 8,
                thread_native_id: Some(160),
                walk: PythonOffsets {
                    frame_owner: 69,
                    frame_is_entry: 68,
                    entry_mask: 0xff,
                    code_first_line: 72,
                    ..walk(56, 8, 152, 32, 48, 56)
                },
                code_filename: 112,
                code_name: 120,
                code_qualname: Some(128),
                code_linetable: 136,
                code_adaptive: Some(184),
                ascii_data: 48,
                compact_data: 72,
            },
            12 => Layout {
                minor,
                runtime_tss_key: 1548,
                runtime_interpreters_head: 40,
                interpreter_next: 0,
                interpreter_threads_head: 72,
                thread_next: 8,
                thread_native_id: Some(144),
                walk: PythonOffsets {
                    frame_owner: 70,
                    code_first_line: 68,
                    shim_owner: OWNED_BY_CSTACK,
                    ..walk(56, 0, 136, 0, 8, 56)
                },
                code_filename: 112,
                code_name: 120,
                code_qualname: Some(128),
                code_linetable: 136,
                code_adaptive: Some(192),
                ascii_data: 40,
                compact_data: 56,
            },
            13 => Layout {
                minor,
                runtime_tss_key: 2164,
                runtime_interpreters_head: 632,
                interpreter_next: 7264,
                interpreter_threads_head: 7344,
                thread_next: 8,
                thread_native_id: Some(160),
                walk: PythonOffsets {
                    frame_owner: 70,
                    code_first_line: 68,
                    shim_owner: OWNED_BY_CSTACK,
                    ..walk(72, NO_OFFSET, 152, 0, 8, 56)
                },
                code_filename: 112,
                code_name: 120,
                code_qualname: Some(128),
                code_linetable: 136,
                code_adaptive: Some(200),
                ascii_data: 40,
                compact_data: 56,
            },
            14 => Layout {
                minor,
                runtime_tss_key: 2340,
                runtime_interpreters_head: 808,
                interpreter_next: 7272,
                interpreter_threads_head: 7344,
                thread_next: 8,
                thread_native_id: Some(160),
                walk: PythonOffsets {
                    frame_owner: 74,
                    code_first_line: 68,
                    shim_owner: OWNED_BY_INTERPRETER,
                    frame_bytes: 80,
                    ..walk(72, NO_OFFSET, 152, 0, 8, 56)
                },
                code_filename: 112,
                code_name: 120,
                code_qualname: Some(128),
                code_linetable: 136,
                code_adaptive: Some(208),
                ascii_data: 40,
                compact_data: 56,
            },
            _ => return None,
        };
        Some(layout)
    }

    /// The byte offset into the code's bytecode of a frame's instruction as
    /// the walk read it (`f_lasti`, or a pointer into the code object at
    /// `code`); `None` before the frame's first instruction or outside
    /// the code.
    pub fn instruction_offset(&self, code: u64, instruction: u64) -> Option<u64> {
        match self.code_adaptive {
            None => {
                let lasti = instruction as i64;
                (lasti >= 0).then(|| lasti as u64 * 2)
            }
            Some(adaptive) => instruction.checked_sub(code.checked_add(adaptive)?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field the walk reads lies within the bytes it reads of a frame.
    #[test]
    fn the_walk_reads_each_field_within_the_bytes_it_reads() {
        for minor in SUPPORTED_MINORS {
            let w = Layout::of(minor).unwrap().walk;
            let within =
                |offset: u16, size: u16| offset == NO_OFFSET || offset + size <= w.frame_bytes;
            assert!(
                within(w.frame_code, 8) && within(w.frame_previous, 8),
                "3.{minor}"
            );
            // The state's thread and frame are read at once, less than 512 bytes.
            let (first, last) = (
                w.thread_frame.min(w.thread_id),
                w.thread_frame.max(w.thread_id),
            );
            assert!(last + 8 - first < 512, "3.{minor}");
            assert!(first % 8 == 0 && last % 8 == 0, "3.{minor}");
            // The program reads a frame a word at a time: no field straddles two.
            let straddles = |offset: u16, size: u16| offset != NO_OFFSET && offset % 8 + size > 8;
            assert!(
                !straddles(w.frame_code, 8) && !straddles(w.frame_previous, 8),
                "3.{minor}"
            );
            let instruction = if w.flags & LAYOUT_LASTI != 0 { 4 } else { 8 };
            assert!(within(w.frame_instruction, instruction), "3.{minor}");
            assert!(!straddles(w.frame_instruction, instruction), "3.{minor}");
            assert!(
                within(w.frame_owner, 1) && within(w.frame_is_entry, 1),
                "3.{minor}"
            );
            assert!(
                usize::from(w.frame_bytes) < tracer_common::python::FRAME_READ_BYTES,
                "3.{minor}"
            );
        }
        assert!(Layout::of(9).is_none() && Layout::of(15).is_none());
    }

    #[test]
    fn instruction_offsets_count_bytes() {
        let l310 = Layout::of(10).unwrap();
        assert_eq!(l310.instruction_offset(0x1000, 7), Some(14));
        assert_eq!(l310.instruction_offset(0x1000, u64::MAX), None);
        let l313 = Layout::of(13).unwrap();
        assert_eq!(l313.instruction_offset(0x1000, 0x1000 + 200 + 6), Some(6));
        assert_eq!(l313.instruction_offset(0x1000, 0x10), None);
    }
}
