//! Python frames: finding a process's CPython interpreter, telling the
//! stack programs how to walk its frames, and naming the frames they
//! read (function, file, line) from the code objects in its memory.
//!
//! - [`layout`]: where each CPython version keeps what is read;
//! - [`line_table`]: a code object's line table, decoded at an instruction;
//! - [`text`]: a `str` object's characters;
//! - [`code`]: a code object read and checked;
//! - [`runtime`]: a process's interpreter, found from outside;
//! - [`names`]: the frames' names, bounded, kept for every capture;
//! - [`frames`]: the frames a stack program read, named and put in
//!   their native stack.
//!
//! Everything read here is the target's memory, which it may change or
//! corrupt at any moment: every read is bounded and checked, and what
//! does not check out is an unreadable frame, never another's name.

pub mod code;
pub mod frames;
pub mod layout;
pub mod line_table;
pub mod names;
pub mod runtime;
pub mod text;

/// Memory of a process, read whole or not at all.
pub trait Memory {
    /// Fills `out` from `address`; false if any of it cannot be read.
    fn read(&self, address: u64, out: &mut [u8]) -> bool;

    /// The `u64` at `address`.
    fn u64_at(&self, address: u64) -> Option<u64> {
        let mut b = [0; 8];
        self.read(address, &mut b).then(|| u64::from_le_bytes(b))
    }

    /// The `u32` at `address`.
    fn u32_at(&self, address: u64) -> Option<u32> {
        let mut b = [0; 4];
        self.read(address, &mut b).then(|| u32::from_le_bytes(b))
    }
}
