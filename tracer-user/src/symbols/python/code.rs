//! A code object read from the target's memory and checked: its name, its
//! file, and its line table, which names the line of each frame run in it.
//!
//! A frame's code object may have been freed, and its memory reused,
//! between the sample and this read: the `co_firstlineno` the stack
//! program read with the frame must still be there, and every object
//! reached must be of its type (where the types' addresses are known).

use super::{
    Memory,
    layout::{BYTES_DATA, Layout, OBJECT_TYPE, VAR_OBJECT_SIZE},
    line_table::{self, LineTableFormat},
    text::{self, StrError},
};

/// Most bytes read of a line table: a real one is a few bytes a line of
/// source, so more is garbage.
pub const MAX_LINE_TABLE_BYTES: u64 = 1 << 20;

/// A code object's names and line table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    /// `co_qualname` (3.11+, `Class.method`), else `co_name`.
    pub name: String,
    /// `co_filename`.
    pub file: String,
    /// `co_firstlineno`.
    pub first_line: u32,
    /// `co_linetable`.
    line_table: Box<[u8]>,
    format: LineTableFormat,
}

/// Why a code object could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CodeError {
    /// Its memory could not be read (the process may be gone).
    #[error("the code object's memory could not be read")]
    Unreadable,
    /// Its `co_firstlineno` is not the one the stack program read: the
    /// code object was freed and its memory reused.
    #[error("the code object changed since it was sampled")]
    Changed,
    /// What was read is not a code object ebtrace reads.
    #[error("not a code object: {0}")]
    Malformed(&'static str),
    /// Not read: more code objects were read than ebtrace reads in a
    /// second.
    #[error("more code objects to read than ebtrace reads in a second")]
    NotRead,
}

/// Runtime addresses of the types the objects read are checked against
/// (`PyCode_Type`, `PyUnicode_Type`, `PyBytes_Type`), where known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Types {
    /// `PyCode_Type`.
    pub code: Option<u64>,
    /// `PyUnicode_Type`.
    pub str: Option<u64>,
    /// `PyBytes_Type`.
    pub bytes: Option<u64>,
}

impl Code {
    /// The code object at `address`, whose `co_firstlineno` the stack
    /// program read as `first_line`.
    pub fn read(
        memory: &impl Memory,
        layout: &Layout,
        types: &Types,
        address: u64,
        first_line: u32,
    ) -> Result<Code, CodeError> {
        let field = |offset: u64| address.checked_add(offset).ok_or(CodeError::Unreadable);
        let found = memory
            .u32_at(field(u64::from(layout.walk.code_first_line))?)
            .ok_or(CodeError::Unreadable)?;
        if found != first_line {
            return Err(CodeError::Changed);
        }
        if i32::try_from(first_line).is_err() {
            return Err(CodeError::Malformed("negative co_firstlineno"));
        }
        check_type(memory, address, types.code, "not of type code")?;
        let (name, not_name) = match layout.code_qualname {
            Some(qualname) => (qualname, "co_qualname is not a str"),
            None => (layout.code_name, "co_name is not a str"),
        };
        let name = string(memory, layout, types, field(name)?, not_name)?;
        let file = string(
            memory,
            layout,
            types,
            field(layout.code_filename)?,
            "co_filename is not a str",
        )?;
        let line_table = bytes(memory, types, field(layout.code_linetable)?)?;
        Ok(Code {
            name,
            file,
            first_line,
            line_table,
            format: LineTableFormat::of_minor(layout.minor),
        })
    }

    /// The bytes it takes.
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Code>() + self.name.len() + self.file.len() + self.line_table.len()
    }

    /// The line of the instruction a frame run in this code was at:
    /// `instruction` as the stack program read it (3.10's `f_lasti`, or
    /// 3.11+'s pointer into the code object at `address`).
    pub fn line_at(&self, layout: &Layout, address: u64, instruction: u64) -> Option<u32> {
        let offset = layout.instruction_offset(address, instruction)?;
        line_table::line_at(self.format, &self.line_table, self.first_line, offset)
    }
}

/// Checks that the object at `address` is of type `expected`, where known.
fn check_type(
    memory: &impl Memory,
    address: u64,
    expected: Option<u64>,
    wrong: &'static str,
) -> Result<(), CodeError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let at = address
        .checked_add(OBJECT_TYPE)
        .ok_or(CodeError::Unreadable)?;
    match memory.u64_at(at) {
        None => Err(CodeError::Unreadable),
        Some(found) if found != expected => Err(CodeError::Malformed(wrong)),
        Some(_) => Ok(()),
    }
}

/// The pointer at `field`, not null.
fn pointer(memory: &impl Memory, field: u64, null: &'static str) -> Result<u64, CodeError> {
    match memory.u64_at(field) {
        None => Err(CodeError::Unreadable),
        Some(0) => Err(CodeError::Malformed(null)),
        Some(pointer) => Ok(pointer),
    }
}

/// The `str` the pointer at `field` points at.
fn string(
    memory: &impl Memory,
    layout: &Layout,
    types: &Types,
    field: u64,
    wrong: &'static str,
) -> Result<String, CodeError> {
    let address = pointer(memory, field, wrong)?;
    text::try_read_str(memory, layout, address, types.str).map_err(|e| match e {
        StrError::Unreadable => CodeError::Unreadable,
        StrError::Malformed(_) => CodeError::Malformed(wrong),
    })
}

/// The contents of the `bytes` the pointer at `field` (`co_linetable`)
/// points at, in one read.
fn bytes(memory: &impl Memory, types: &Types, field: u64) -> Result<Box<[u8]>, CodeError> {
    let address = pointer(memory, field, "co_linetable is null")?;
    check_type(memory, address, types.bytes, "co_linetable is not bytes")?;
    let at = |offset: u64| address.checked_add(offset).ok_or(CodeError::Unreadable);
    let size = memory
        .u64_at(at(VAR_OBJECT_SIZE)?)
        .ok_or(CodeError::Unreadable)?;
    // A negative `ob_size` reads as a huge `u64`.
    if size > MAX_LINE_TABLE_BYTES {
        return Err(CodeError::Malformed("co_linetable's size is out of range"));
    }
    let mut table = vec![0; size as usize];
    if !table.is_empty() && !memory.read(at(BYTES_DATA)?, &mut table) {
        return Err(CodeError::Unreadable);
    }
    Ok(table.into_boxed_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbols::python::text::tests::{FakeMemory, STR_TYPE, str_object};

    const CODE_TYPE: u64 = 0x7777_0000;
    const BYTES_TYPE: u64 = 0x6666_0000;
    const TYPES: Types = Types {
        code: Some(CODE_TYPE),
        str: Some(STR_TYPE),
        bytes: Some(BYTES_TYPE),
    };
    const CODE: u64 = 0x10000;
    const QUALNAME: u64 = 0x20000;
    const NAME: u64 = 0x21000;
    const FILE: u64 = 0x22000;
    const TABLE: u64 = 0x23000;
    const FIRST_LINE: u32 = 40;

    /// A `bytes` object of `data`.
    fn bytes_object(data: &[u8]) -> Vec<u8> {
        let mut object = vec![0u8; BYTES_DATA as usize];
        object[8..16].copy_from_slice(&BYTES_TYPE.to_le_bytes());
        object[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
        object.extend_from_slice(data);
        object.push(0);
        object
    }

    /// A line table of the layout's version: bytes [0, 6) on line
    /// `FIRST_LINE + 2`, [6, 10) on the next.
    fn table_of(layout: &Layout) -> Vec<u8> {
        match LineTableFormat::of_minor(layout.minor) {
            LineTableFormat::Pep626 => vec![6, 2, 4, 1],
            LineTableFormat::Locations => vec![0x80 | 13 << 3 | 2, 4, 0x80 | 11 << 3 | 1, 0, 3],
        }
    }

    /// The memory of a code object at `CODE` and the objects it points at.
    fn memory_of(layout: &Layout) -> FakeMemory {
        let mut code = vec![0u8; 256];
        let mut put = |offset: u64, value: &[u8]| {
            code[offset as usize..offset as usize + value.len()].copy_from_slice(value);
        };
        put(OBJECT_TYPE, &CODE_TYPE.to_le_bytes());
        put(
            u64::from(layout.walk.code_first_line),
            &FIRST_LINE.to_le_bytes(),
        );
        put(layout.code_name, &NAME.to_le_bytes());
        if let Some(qualname) = layout.code_qualname {
            put(qualname, &QUALNAME.to_le_bytes());
        }
        put(layout.code_filename, &FILE.to_le_bytes());
        put(layout.code_linetable, &TABLE.to_le_bytes());
        let mut memory = FakeMemory::default();
        memory.regions.insert(CODE, code);
        memory
            .regions
            .insert(QUALNAME, str_object(layout, "Café.méthode_λ", 0xab));
        memory
            .regions
            .insert(NAME, str_object(layout, "méthode_λ", 0));
        memory
            .regions
            .insert(FILE, str_object(layout, "/srv/app/models.py", 0x1234));
        memory
            .regions
            .insert(TABLE, bytes_object(&table_of(layout)));
        memory
    }

    /// A frame's instruction `offset` bytes into the code, as read.
    fn instruction(layout: &Layout, offset: u64) -> u64 {
        match layout.code_adaptive {
            None => offset / 2,
            Some(adaptive) => CODE + adaptive + offset,
        }
    }

    fn layouts() -> impl Iterator<Item = Layout> {
        (10..=13).filter_map(Layout::of)
    }

    #[test]
    fn code_objects_of_each_version_are_read() {
        for layout in layouts() {
            let memory = memory_of(&layout);
            let code = Code::read(&memory, &layout, &TYPES, CODE, FIRST_LINE).unwrap();
            let name = if layout.minor == 10 {
                "méthode_λ"
            } else {
                "Café.méthode_λ"
            };
            assert_eq!(code.name, name);
            assert_eq!(code.file, "/srv/app/models.py");
            assert_eq!(code.first_line, FIRST_LINE);
            let line = |offset| code.line_at(&layout, CODE, instruction(&layout, offset));
            assert_eq!(
                [line(0), line(4), line(6), line(8), line(10)],
                [Some(42), Some(42), Some(43), Some(43), None]
            );
            let before = if layout.minor == 10 { u64::MAX } else { CODE };
            assert_eq!(
                code.line_at(&layout, CODE, before),
                None,
                "3.{}",
                layout.minor
            );
            let untyped = Code::read(&memory, &layout, &Types::default(), CODE, FIRST_LINE);
            assert_eq!(untyped, Ok(code));
        }
    }

    #[test]
    fn reused_code_objects_are_changed() {
        for layout in layouts() {
            let memory = memory_of(&layout);
            let read = Code::read(&memory, &layout, &TYPES, CODE, FIRST_LINE + 1);
            assert_eq!(read, Err(CodeError::Changed));
        }
    }

    /// The memory of a 3.12 code object, changed by `change`, read.
    fn read_changed(change: impl FnOnce(&mut FakeMemory, &Layout)) -> Result<Code, CodeError> {
        let layout = Layout::of(12).unwrap();
        let mut memory = memory_of(&layout);
        change(&mut memory, &layout);
        Code::read(&memory, &layout, &TYPES, CODE, FIRST_LINE)
    }

    /// Writes `value` at `offset` into the region at `region`.
    fn poke(memory: &mut FakeMemory, region: u64, offset: u64, value: &[u8]) {
        let bytes = memory.regions.get_mut(&region).unwrap();
        bytes[offset as usize..offset as usize + value.len()].copy_from_slice(value);
    }

    #[test]
    fn objects_of_the_wrong_type_are_malformed() {
        let malformed = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::Malformed(_)));
        assert!(malformed(read_changed(|m, _| poke(
            m,
            CODE,
            OBJECT_TYPE,
            &1u64.to_le_bytes()
        ))));
        assert!(malformed(read_changed(|m, l| {
            poke(m, CODE, l.code_filename, &TABLE.to_le_bytes())
        })));
        assert!(malformed(read_changed(|m, l| {
            poke(m, CODE, l.code_linetable, &FILE.to_le_bytes())
        })));
        assert!(malformed(read_changed(|m, l| {
            poke(m, CODE, l.code_qualname.unwrap(), &0u64.to_le_bytes())
        })));
        assert!(malformed(read_changed(|m, _| {
            poke(
                m,
                TABLE,
                VAR_OBJECT_SIZE,
                &(MAX_LINE_TABLE_BYTES + 1).to_le_bytes(),
            )
        })));
        assert!(malformed(read_changed(|m, _| {
            poke(m, TABLE, VAR_OBJECT_SIZE, &(-2i64).to_le_bytes())
        })));
    }

    /// A negative `co_firstlineno` has no line table to start from.
    #[test]
    fn negative_first_lines_are_malformed() {
        let layout = Layout::of(11).unwrap();
        let mut memory = memory_of(&layout);
        let negative = -3i32;
        poke(
            &mut memory,
            CODE,
            u64::from(layout.walk.code_first_line),
            &negative.to_le_bytes(),
        );
        let read = Code::read(&memory, &layout, &TYPES, CODE, negative as u32);
        assert!(matches!(read, Err(CodeError::Malformed(_))), "{read:?}");
    }

    #[test]
    fn memory_not_there_is_unreadable() {
        let layout = Layout::of(13).unwrap();
        let memory = memory_of(&layout);
        for address in [0, CODE + 0x1000, u64::MAX - 8] {
            let read = Code::read(&memory, &layout, &TYPES, address, FIRST_LINE);
            assert_eq!(read, Err(CodeError::Unreadable), "{address:#x}");
        }
        let gone = |region| read_changed(|m, _| drop(m.regions.remove(&region)));
        for region in [QUALNAME, FILE, TABLE] {
            assert_eq!(gone(region), Err(CodeError::Unreadable), "{region:#x}");
        }
        let table_past_memory =
            read_changed(|m, _| poke(m, TABLE, VAR_OBJECT_SIZE, &64u64.to_le_bytes()));
        assert_eq!(table_past_memory, Err(CodeError::Unreadable));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Whatever the memory holds (here garbage whose fields point back
        /// into it, so that the read goes deep): a code object or an
        /// error, not a panic.
        #[test]
        fn any_memory_reads_without_panicking(
            mut garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 512),
            pointers in proptest::collection::vec(proptest::option::of(0u64..512), 4),
            sizes in proptest::collection::vec(proptest::option::of(0u64..80), 4),
            minor in 10u8..=13,
            first_line in proptest::prelude::any::<u32>(),
            instruction in proptest::prelude::any::<u64>(),
        ) {
            let layout = Layout::of(minor).unwrap();
            let fields = [
                layout.code_name,
                layout.code_qualname.unwrap_or(layout.code_name),
                layout.code_filename,
                layout.code_linetable,
            ];
            for ((field, pointer), size) in fields.into_iter().zip(pointers).zip(sizes) {
                if let Some(pointer) = pointer {
                    let field = field as usize;
                    garbage[field..field + 8].copy_from_slice(&(CODE + pointer).to_le_bytes());
                    if let (Some(size), Some(at)) = (size, garbage.get_mut(pointer as usize + 16..pointer as usize + 24)) {
                        at.copy_from_slice(&size.to_le_bytes());
                    }
                }
            }
            let at = usize::from(layout.walk.code_first_line);
            garbage[at..at + 4].copy_from_slice(&first_line.to_le_bytes());
            let mut memory = FakeMemory::default();
            memory.regions.insert(CODE, garbage);
            for types in [Types::default(), TYPES] {
                if let Ok(code) = Code::read(&memory, &layout, &types, CODE, first_line) {
                    code.line_at(&layout, CODE, instruction);
                    code.line_at(&layout, CODE, CODE + instruction % 1024);
                }
            }
        }
    }
}
