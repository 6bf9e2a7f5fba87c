//! PyTorch's ops as the agent forwards them: one
//! [`crate::protocol::TORCH_OPS`] frame at the end of a recording, and
//! what both sides know of its layout.
//!
//! The frame is an [`OpsHeader`], then `names` [`NameEntry`]s, then
//! `arena_len` bytes of names (each entry points into them), then
//! `records` [`OpRecord`]s in the order the program's threads reserved
//! their slots. Every number is little-endian. A record is one end of a
//! RecordFunction: its start (with its scope and its name's id) or its end;
//! the two ends of one are told by the thread and the address of the
//! `at::RecordFunction` object, which lives from its start to its end.

/// [`OpsHeader::magic`]: `TOPS`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"TOPS");
/// [`OpsHeader::version`].
pub const VERSION: u32 = 3;

/// [`OpRecord::what`] of a RecordFunction's end.
pub const END: u32 = u32::MAX;
/// Name ids are below this; a start's scope sits above them in
/// [`OpRecord::what`].
pub const NAME_ID_LIMIT: u32 = 1 << 24;
/// The name id of a start whose name did not fit in the agent's table.
pub const NO_NAME: u32 = NAME_ID_LIMIT - 1;
/// [`OpRecord::sequence`] of an end, and of a start PyTorch gave none
/// (or whose number the agent could not read).
pub const NO_SEQUENCE: i64 = -1;
/// Longest name kept (longer ones are cut).
pub const MAX_NAME_LEN: usize = 255;

/// `at::RecordScope::FUNCTION`: ATen ops, autograd nodes.
pub const SCOPE_FUNCTION: u32 = 0;
/// `at::RecordScope::BACKWARD_FUNCTION`: autograd's backward functions.
pub const SCOPE_BACKWARD_FUNCTION: u32 = 1;
/// `at::RecordScope::USER_SCOPE`: `record_function` ranges.
pub const SCOPE_USER: u32 = 7;

/// [`OpRecord::what`] of a start in `scope` named by `name_id`.
pub const fn start_what(scope: u32, name_id: u32) -> u32 {
    (scope << 24) | (name_id & (NAME_ID_LIMIT - 1))
}

/// What leads a [`crate::protocol::TORCH_OPS`] payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpsHeader {
    /// [`MAGIC`].
    pub magic: u32,
    /// [`VERSION`].
    pub version: u32,
    /// Records that follow.
    pub records: u32,
    /// Name entries that follow.
    pub names: u32,
    /// Bytes of names after the entries.
    pub arena_len: u32,
    /// Names that did not fit in the table (their ops are [`NO_NAME`]).
    pub names_lost: u32,
    /// Records that did not fit in the buffer.
    pub dropped: u64,
}

impl OpsHeader {
    /// Bytes of an encoded header.
    pub const LEN: usize = 32;

    /// The header's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..12].copy_from_slice(&self.records.to_le_bytes());
        b[12..16].copy_from_slice(&self.names.to_le_bytes());
        b[16..20].copy_from_slice(&self.arena_len.to_le_bytes());
        b[20..24].copy_from_slice(&self.names_lost.to_le_bytes());
        b[24..].copy_from_slice(&self.dropped.to_le_bytes());
        b
    }

    /// Reads a header; `None` if `b` is too short.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        Some(OpsHeader {
            magic: word(0)?,
            version: word(4)?,
            records: word(8)?,
            names: word(12)?,
            arena_len: word(16)?,
            names_lost: word(20)?,
            dropped: u64::from_le_bytes(b.get(24..32)?.try_into().ok()?),
        })
    }
}

/// Where a name id's bytes are in the arena.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct NameEntry {
    /// The id starts carry.
    pub id: u32,
    /// Offset of its bytes in the arena.
    pub offset: u32,
    /// Their length.
    pub len: u32,
}

impl NameEntry {
    /// Bytes of an encoded entry.
    pub const LEN: usize = 12;

    /// Reads entry `b` (exactly [`Self::LEN`] bytes).
    pub fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        Some(NameEntry {
            id: word(0)?,
            offset: word(4)?,
            len: word(8)?,
        })
    }
}

/// One end of a RecordFunction, as the callback wrote it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct OpRecord {
    /// `CLOCK_MONOTONIC` ns.
    pub ts_ns: u64,
    /// Address of the `at::RecordFunction`: the same at both ends.
    pub record_function: u64,
    /// Kernel tid of the thread it ran on.
    pub tid: u32,
    /// [`start_what`], or [`END`].
    pub what: u32,
    /// A start's sequence number (`RecordFunction::seqNr()`): autograd's,
    /// shared by a forward op and the backward function it made; or
    /// [`NO_SEQUENCE`].
    pub sequence: i64,
    /// A start's input shapes, as the name id of their text
    /// (`[[64, 256], []]`), or [`NO_NAME`].
    pub shapes: u32,
    /// Zero.
    pub reserved: u32,
}

impl OpRecord {
    /// Bytes of an encoded record.
    pub const LEN: usize = 40;

    /// Reads record `b` (exactly [`Self::LEN`] bytes).
    pub fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        let quad = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
        Some(OpRecord {
            ts_ns: quad(0)?,
            record_function: quad(8)?,
            tid: word(16)?,
            what: word(20)?,
            sequence: quad(24)? as i64,
            shapes: word(32)?,
            reserved: word(36)?,
        })
    }
}

// The agent sends its in-memory entries and records as they are.
const _: () = assert!(core::mem::size_of::<NameEntry>() == NameEntry::LEN);
const _: () = assert!(core::mem::size_of::<OpRecord>() == OpRecord::LEN);
const _: () = assert!(cfg!(target_endian = "little"));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = OpsHeader {
            magic: MAGIC,
            version: VERSION,
            records: 3,
            names: 2,
            arena_len: 17,
            names_lost: 1,
            dropped: 1 << 40,
        };
        assert_eq!(OpsHeader::decode(&h.encode()), Some(h));
        assert_eq!(OpsHeader::decode(&h.encode()[..31]), None);
    }

    #[test]
    fn a_start_carries_its_scope_above_its_name() {
        let what = start_what(SCOPE_USER, 5);
        assert_eq!(what >> 24, SCOPE_USER);
        assert_eq!(what & (NAME_ID_LIMIT - 1), 5);
        assert_ne!(start_what(SCOPE_BACKWARD_FUNCTION, NO_NAME), END);
    }
}
