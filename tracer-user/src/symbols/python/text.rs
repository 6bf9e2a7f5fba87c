//! A CPython `str` object's characters, read from the target's memory.
//!
//! Only compact strings are read (every string the compiler makes, and so
//! every code object's names, is one): their characters follow the object
//! header, so one read, bounded by [`MAX_STR_CHARS`], gets them all.

use super::{
    Memory,
    layout::{Layout, OBJECT_TYPE, STRING_LENGTH, STRING_STATE},
};

/// Most characters read of a string: a name or a path longer than this
/// is not one worth the read (or not a string at all).
pub const MAX_STR_CHARS: u64 = 4096;

/// Why a string could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StrError {
    /// Its memory could not be read.
    #[error("the string's memory could not be read")]
    Unreadable,
    /// What was read is not a compact `str` ebtrace reads.
    #[error("not a string: {0}")]
    Malformed(&'static str),
}

/// The characters of the compact `str` at `address`, if it is one.
pub fn read_str(memory: &impl Memory, layout: &Layout, address: u64) -> Option<String> {
    try_read_str(memory, layout, address, None).ok()
}

/// Like [`read_str`], and the object's type must be `str_type` (the
/// runtime address of `PyUnicode_Type`) where that is known.
pub fn read_str_of_type(
    memory: &impl Memory,
    layout: &Layout,
    address: u64,
    str_type: Option<u64>,
) -> Option<String> {
    try_read_str(memory, layout, address, str_type).ok()
}

/// Like [`read_str_of_type`], saying why not: memory that cannot be read
/// (the process may be gone) is not memory that holds garbage.
pub fn try_read_str(
    memory: &impl Memory,
    layout: &Layout,
    address: u64,
    str_type: Option<u64>,
) -> Result<String, StrError> {
    let at = |offset: u64| address.checked_add(offset).ok_or(StrError::Unreadable);
    if let Some(expected) = str_type {
        let found = memory
            .u64_at(at(OBJECT_TYPE)?)
            .ok_or(StrError::Unreadable)?;
        if found != expected {
            return Err(StrError::Malformed("not of type str"));
        }
    }
    let length = memory
        .u64_at(at(STRING_LENGTH)?)
        .ok_or(StrError::Unreadable)?;
    // The state's bit fields take its low byte; the rest is padding.
    let state = memory
        .u32_at(at(STRING_STATE)?)
        .ok_or(StrError::Unreadable)?
        & 0xff;
    // A negative `Py_ssize_t` reads as a huge `u64`.
    if length > MAX_STR_CHARS {
        return Err(StrError::Malformed("length out of range"));
    }
    let kind = (state >> 2) & 7;
    let ascii = (state >> 6) & 1 == 1;
    if (state >> 5) & 1 != 1 {
        return Err(StrError::Malformed("not compact"));
    }
    if !matches!(kind, 1 | 2 | 4) || (ascii && kind != 1) {
        return Err(StrError::Malformed("bad kind"));
    }
    let data = at(if ascii {
        layout.ascii_data
    } else {
        layout.compact_data
    })?;
    // At most 4096 characters of at most 4 bytes: no overflow.
    let mut bytes = vec![0u8; (length * u64::from(kind)) as usize];
    if !bytes.is_empty() && !memory.read(data, &mut bytes) {
        return Err(StrError::Unreadable);
    }
    decode(&bytes, kind, ascii)
}

/// The characters of a string of `kind` bytes a character.
fn decode(bytes: &[u8], kind: u32, ascii: bool) -> Result<String, StrError> {
    let text = match kind {
        1 if ascii => {
            if !bytes.is_ascii() {
                return Err(StrError::Malformed("ascii string with a byte past 0x7f"));
            }
            bytes.iter().map(|&b| char::from(b)).collect()
        }
        1 => bytes.iter().map(|&b| char::from(b)).collect(),
        2 => code_points(
            bytes
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
        ),
        _ => code_points(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
    };
    Ok(text)
}

/// Code points as characters: each UCS-2 unit or UCS-4 value is one (a
/// lone surrogate, or a value past Unicode, is U+FFFD).
fn code_points(points: impl Iterator<Item = u32>) -> String {
    points
        .map(|p| char::from_u32(p).unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    use std::{cell::Cell, collections::BTreeMap};

    use super::*;

    /// Memory made of regions (start address, bytes); a read must lie
    /// within one. Counts reads.
    #[derive(Default)]
    pub(in crate::symbols::python) struct FakeMemory {
        pub regions: BTreeMap<u64, Vec<u8>>,
        pub reads: Cell<usize>,
    }

    impl Memory for FakeMemory {
        fn read(&self, address: u64, out: &mut [u8]) -> bool {
            self.reads.set(self.reads.get() + 1);
            let Some((&start, bytes)) = self.regions.range(..=address).next_back() else {
                return false;
            };
            let from = (address - start) as usize;
            match bytes.get(from..from.saturating_add(out.len())) {
                Some(found) => {
                    out.copy_from_slice(found);
                    true
                }
                None => false,
            }
        }
    }

    /// The type `str` objects built here have.
    pub(in crate::symbols::python) const STR_TYPE: u64 = 0x5555_0000;

    /// A compact `str` object of `text`, as CPython lays it out for
    /// `layout` (the narrowest kind that holds it), with `garbage` in the
    /// state's padding.
    pub(in crate::symbols::python) fn str_object(
        layout: &Layout,
        text: &str,
        garbage: u32,
    ) -> Vec<u8> {
        let widest = text.chars().map(u32::from).max().unwrap_or(0);
        let (kind, ascii) = match widest {
            0..0x80 => (1u32, true),
            0x80..0x100 => (1, false),
            0x100..0x10000 => (2, false),
            _ => (4, false),
        };
        let data = if ascii {
            layout.ascii_data
        } else {
            layout.compact_data
        };
        let mut object = vec![0u8; data as usize];
        object[8..16].copy_from_slice(&STR_TYPE.to_le_bytes());
        object[16..24].copy_from_slice(&(text.chars().count() as u64).to_le_bytes());
        let state = garbage << 8 | u32::from(ascii) << 6 | 1 << 5 | kind << 2;
        object[32..36].copy_from_slice(&state.to_le_bytes());
        for c in text.chars() {
            object.extend_from_slice(&u32::from(c).to_le_bytes()[..kind as usize]);
        }
        object
    }

    fn memory_with(address: u64, bytes: Vec<u8>) -> FakeMemory {
        let mut memory = FakeMemory::default();
        memory.regions.insert(address, bytes);
        memory
    }

    fn layouts() -> impl Iterator<Item = Layout> {
        (10..=13).filter_map(Layout::of)
    }

    #[test]
    fn strings_of_each_kind_are_read_in_one_read() {
        for layout in layouts() {
            for text in ["", "threading.py", "café", "café_λ", "naïve 🐍", "𝔁"] {
                let memory = memory_with(0x1000, str_object(&layout, text, 0));
                let read = read_str_of_type(&memory, &layout, 0x1000, Some(STR_TYPE));
                assert_eq!(read.as_deref(), Some(text), "3.{}", layout.minor);
                // The type, the length, the state, the characters.
                assert!(
                    memory.reads.get() <= 4,
                    "3.{}: {} reads",
                    layout.minor,
                    memory.reads.get()
                );
            }
        }
    }

    #[test]
    fn garbage_past_the_state_byte_is_ignored() {
        let layout = Layout::of(12).unwrap();
        let memory = memory_with(0x1000, str_object(&layout, "café_λ", 0xde_adbe));
        assert_eq!(
            read_str(&memory, &layout, 0x1000).as_deref(),
            Some("café_λ")
        );
    }

    #[test]
    fn lone_surrogates_and_values_past_unicode_are_replaced() {
        let layout = Layout::of(11).unwrap();
        let mut two = str_object(&layout, "ab\u{3bb}", 0);
        let at = layout.compact_data as usize;
        two[at + 2..at + 4].copy_from_slice(&0xd800u16.to_le_bytes());
        assert_eq!(
            read_str(&memory_with(0, two), &layout, 0).as_deref(),
            Some("a\u{fffd}\u{3bb}")
        );
        let mut four = str_object(&layout, "🐍x", 0);
        four[at..at + 4].copy_from_slice(&0x11_0000u32.to_le_bytes());
        assert_eq!(
            read_str(&memory_with(0, four), &layout, 0).as_deref(),
            Some("\u{fffd}x")
        );
    }

    #[test]
    fn what_is_not_a_compact_string_is_refused() {
        let layout = Layout::of(13).unwrap();
        let good = str_object(&layout, "name", 0);
        let with = |at: usize, bytes: &[u8]| {
            let mut object = good.clone();
            object[at..at + bytes.len()].copy_from_slice(bytes);
            try_read_str(
                &memory_with(0x1000, object),
                &layout,
                0x1000,
                Some(STR_TYPE),
            )
        };
        let malformed = |r: Result<String, StrError>| matches!(r, Err(StrError::Malformed(_)));
        assert!(malformed(with(8, &1u64.to_le_bytes())), "wrong type");
        assert!(
            malformed(with(16, &(-1i64).to_le_bytes())),
            "negative length"
        );
        assert!(malformed(with(16, &4097u64.to_le_bytes())), "too long");
        assert!(malformed(with(32, &[0x60 | 3 << 2])), "bad kind");
        assert!(
            malformed(with(32, &[0x60 | 2 << 2])),
            "ascii and two bytes a character"
        );
        assert!(malformed(with(32, &[0x40 | 1 << 2])), "not compact");
        assert!(malformed(with(40, b"n\xe9")), "ascii with a byte past 0x7f");
        assert_eq!(
            with(16, &40u64.to_le_bytes()),
            Err(StrError::Unreadable),
            "past the memory"
        );
        let empty = FakeMemory::default();
        assert_eq!(
            try_read_str(&empty, &layout, 0x1000, None),
            Err(StrError::Unreadable)
        );
        assert_eq!(
            try_read_str(&empty, &layout, u64::MAX - 4, None),
            Err(StrError::Unreadable)
        );
        assert_eq!(
            try_read_str(&memory_with(0x1000, good.clone()), &layout, 0x1000, None).as_deref(),
            Ok("name")
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Whatever the memory holds: a string or a refusal, not a panic.
        #[test]
        fn any_memory_reads_without_panicking(
            mut bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            length in proptest::option::of(0u64..64),
            address in proptest::prop_oneof![0x1000u64..0x1100, proptest::prelude::any::<u64>()],
            minor in 10u8..=13,
            str_type in proptest::option::of(proptest::prelude::any::<u64>()),
        ) {
            if let (Some(length), Some(field)) = (length, bytes.get_mut(16..24)) {
                field.copy_from_slice(&length.to_le_bytes());
            }
            let layout = Layout::of(minor).unwrap();
            let memory = memory_with(0x1000, bytes);
            let _ = try_read_str(&memory, &layout, address, str_type);
        }
    }
}
