//! The few facts the raw scheduler tracepoints need from the kernel's own
//! type information (`/sys/kernel/btf/vmlinux`): where `task_struct` keeps
//! a thread's id, exit state and CPU, and that the tracepoints pass the
//! arguments the programs expect. Raw tracepoints hand the programs the
//! kernel's pointers instead of a formatted record, so these offsets replace
//! the tracefs formats that classic tracepoints are checked against.
//!
//! Only what this needs of BTF is read: the type section's records, walked
//! once, and the names of structs, their members and function prototypes'
//! parameters. aya-obj parses BTF too but keeps members private.

use std::path::Path;

/// The kernel's own BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

/// Where the raw scheduler programs find a thread's fields in its
/// `task_struct`, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskOffsets {
    /// `pid` (the thread id).
    pub pid: u32,
    /// `exit_state`.
    pub exit_state: u32,
    /// The CPU the thread last ran on (`thread_info.cpu`, or `cpu`).
    pub cpu: u32,
}

/// Why the raw tracepoints cannot be used; the classic ones are then.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not BTF or is cut short.
    #[error("not valid BTF: {0}")]
    Malformed(&'static str),
    /// A type or member the programs rely on is not there as expected.
    #[error("{0}")]
    Mismatch(String),
}

/// One type record: its kind, name, size-or-type and trailing entries.
#[derive(Clone, Copy)]
struct Type<'a> {
    kind: u32,
    kind_flag: bool,
    name: u32,
    size_or_type: u32,
    /// The trailing entries (members, parameters...), `vlen` of them.
    entries: &'a [u8],
    vlen: usize,
}

/// A parsed BTF blob: its types by id (id 0 is `void`) and string section.
pub struct Btf<'a> {
    types: Vec<Type<'a>>,
    strings: &'a [u8],
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

impl<'a> Btf<'a> {
    /// Parses `data` (little-endian BTF, as this machine's kernel writes it).
    pub fn parse(data: &'a [u8]) -> Result<Self, BtfError> {
        let short = BtfError::Malformed("header cut short");
        if data.get(0..2).map(|m| u16::from_le_bytes([m[0], m[1]])) != Some(MAGIC) {
            return Err(BtfError::Malformed("bad magic"));
        }
        let hdr_len = u32_at(data, 4).ok_or(short)? as usize;
        let field = |i: usize| {
            u32_at(data, 8 + 4 * i)
                .map(|v| v as usize)
                .ok_or(BtfError::Malformed("header cut short"))
        };
        let (type_off, type_len, str_off, str_len) = (field(0)?, field(1)?, field(2)?, field(3)?);
        let section = |off: usize, len: usize| {
            hdr_len
                .checked_add(off)
                .and_then(|start| data.get(start..start.checked_add(len)?))
                .ok_or(BtfError::Malformed("section outside the file"))
        };
        let type_bytes = section(type_off, type_len)?;
        let strings = section(str_off, str_len)?;
        let mut types = vec![Type {
            kind: 0,
            kind_flag: false,
            name: 0,
            size_or_type: 0,
            entries: &[],
            vlen: 0,
        }];
        let mut at = 0;
        while at < type_bytes.len() {
            let cut = BtfError::Malformed("type record cut short");
            let name = u32_at(type_bytes, at).ok_or(cut)?;
            let info = u32_at(type_bytes, at + 4).ok_or(BtfError::Malformed("cut short"))?;
            let size_or_type =
                u32_at(type_bytes, at + 8).ok_or(BtfError::Malformed("cut short"))?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let entry_size = match kind {
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12,
                KIND_ENUM | KIND_FUNC_PROTO => 8,
                _ => 0,
            };
            let extra = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                _ => vlen * entry_size,
            };
            if kind == 0 || kind > KIND_ENUM64 {
                return Err(BtfError::Malformed("unknown type kind"));
            }
            let entries = type_bytes
                .get(at + 12..at + 12 + extra)
                .ok_or(BtfError::Malformed("type record cut short"))?;
            types.push(Type {
                kind,
                kind_flag: info >> 31 != 0,
                name,
                size_or_type,
                entries,
                vlen: if entry_size == 0 { 0 } else { vlen },
            });
            at += 12 + extra;
        }
        Ok(Btf { types, strings })
    }

    fn name(&self, offset: u32) -> &'a [u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    fn get(&self, id: u32) -> Option<Type<'a>> {
        self.types.get(id as usize).copied()
    }

    /// The first type of `kind` named `name`.
    fn find(&self, kind: u32, name: &str) -> Option<Type<'a>> {
        self.types
            .iter()
            .find(|t| t.kind == kind && self.name(t.name) == name.as_bytes())
            .copied()
    }

    /// The type `id` refers to once typedefs and qualifiers are looked
    /// through.
    fn resolve(&self, mut id: u32) -> Option<Type<'a>> {
        for _ in 0..32 {
            let t = self.get(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// `(name, type id, bit offset)` of each member of a struct or union.
    fn members(&self, t: Type<'a>) -> impl Iterator<Item = (&'a [u8], u32, u32)> + '_ {
        (0..t.vlen).filter_map(move |i| {
            let at = 12 * i;
            let (name, ty, offset) = (
                u32_at(t.entries, at)?,
                u32_at(t.entries, at + 4)?,
                u32_at(t.entries, at + 8)?,
            );
            // With kind_flag, the top byte is a bitfield's size.
            let bits = if t.kind_flag {
                offset & 0xff_ffff
            } else {
                offset
            };
            Some((self.name(name), ty, bits))
        })
    }

    /// Byte offset and size of `path` (member names, outermost first) in
    /// `t`, looking inside anonymous structs and unions on the way (at most
    /// `depth` levels: BTF may be cyclic).
    fn member_offset(&self, t: Type<'a>, path: &[&str], depth: u32) -> Option<(u32, u32)> {
        let (first, rest) = path.split_first()?;
        let depth = depth.checked_sub(1)?;
        for (name, ty, bits) in self.members(t) {
            let member = self.resolve(ty)?;
            let found = if name.is_empty() && matches!(member.kind, KIND_STRUCT | KIND_UNION) {
                self.member_offset(member, path, depth)
            } else if name == first.as_bytes() {
                if rest.is_empty() {
                    Some((0, self.size_of(member)?))
                } else {
                    self.member_offset(member, rest, depth)
                }
            } else {
                None
            };
            if let Some((inner, size)) = found {
                if bits % 8 != 0 {
                    return None;
                }
                return Some(((bits / 8).checked_add(inner)?, size));
            }
        }
        None
    }

    fn size_of(&self, t: Type<'a>) -> Option<u32> {
        match t.kind {
            KIND_INT | KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 => Some(t.size_or_type),
            KIND_PTR => Some(8),
            _ => None,
        }
    }

    /// The parameters of tracepoint `name`'s BPF prototype
    /// (`btf_trace_<name>`, whose first parameter is the context): for each,
    /// the kind and name of the type it resolves to (pointers resolved to
    /// their target's name).
    fn tracepoint_params(&self, name: &str) -> Option<Vec<(u32, Vec<u8>)>> {
        let typedef = self.find(KIND_TYPEDEF, &format!("btf_trace_{name}"))?;
        let ptr = self.resolve(typedef.size_or_type)?;
        let proto = (ptr.kind == KIND_PTR)
            .then(|| self.resolve(ptr.size_or_type))
            .flatten()?;
        if proto.kind != KIND_FUNC_PROTO {
            return None;
        }
        (0..proto.vlen)
            .map(|i| {
                let t = self.resolve(u32_at(proto.entries, 8 * i + 4)?)?;
                let named = if t.kind == KIND_PTR {
                    self.resolve(t.size_or_type)?
                } else {
                    t
                };
                Some((t.kind, self.name(named.name).to_vec()))
            })
            .collect()
    }
}

/// Where `task_struct` keeps a thread's thread pointer (x86-64's
/// `thread.fsbase`), from the kernel's BTF: the stack programs read a
/// Python thread's state through it. `None` where it cannot be told.
pub fn task_fsbase_offset() -> Option<u32> {
    let data = std::fs::read(Path::new(VMLINUX_BTF)).ok()?;
    let btf = Btf::parse(&data).ok()?;
    let task = btf.find(KIND_STRUCT, "task_struct")?;
    match btf.member_offset(task, &["thread", "fsbase"], 8)? {
        (offset, 8) => Some(offset),
        _ => None,
    }
}

impl TaskOffsets {
    /// Reads the kernel's BTF and checks that the scheduler tracepoints
    /// pass what the raw programs expect.
    pub fn from_kernel() -> Result<Self, BtfError> {
        let data = std::fs::read(Path::new(VMLINUX_BTF)).map_err(|source| BtfError::Read {
            path: VMLINUX_BTF.into(),
            source,
        })?;
        Self::from_btf(&Btf::parse(&data)?)
    }

    /// The offsets in `btf`, once its tracepoint prototypes are checked.
    pub fn from_btf(btf: &Btf<'_>) -> Result<Self, BtfError> {
        let mismatch = |what: &str| BtfError::Mismatch(what.to_string());
        let task = btf
            .find(KIND_STRUCT, "task_struct")
            .ok_or_else(|| mismatch("no struct task_struct"))?;
        let int_member = |path: &[&str]| match btf.member_offset(task, path, 8) {
            Some((offset, 4)) => Ok(offset),
            _ => Err(mismatch(&format!(
                "task_struct.{} is not a 4-byte member",
                path.join(".")
            ))),
        };
        let offsets = TaskOffsets {
            pid: int_member(&["pid"])?,
            exit_state: int_member(&["exit_state"])?,
            cpu: int_member(&["thread_info", "cpu"]).or_else(|_| int_member(&["cpu"]))?,
        };
        let task_ptr = (KIND_PTR, b"task_struct".to_vec());
        let expect = |name: &str, params: &[Option<&(u32, Vec<u8>)>]| {
            let found = btf
                .tracepoint_params(name)
                .ok_or_else(|| mismatch(&format!("no prototype for tracepoint {name}")))?;
            let matches = found.len() == params.len()
                && found
                    .iter()
                    .zip(params)
                    .all(|(f, want)| want.is_none_or(|w| f == w));
            if matches {
                Ok(())
            } else {
                Err(mismatch(&format!(
                    "tracepoint {name} passes other arguments than ebtrace reads"
                )))
            }
        };
        let uint = (KIND_INT, b"unsigned int".to_vec());
        let boolean = (KIND_INT, b"_Bool".to_vec());
        // (void *ctx, bool preempt, prev, next, unsigned int prev_state): Linux 5.18+.
        expect(
            "sched_switch",
            &[
                None,
                Some(&boolean),
                Some(&task_ptr),
                Some(&task_ptr),
                Some(&uint),
            ],
        )?;
        expect("sched_waking", &[None, Some(&task_ptr)])?;
        expect("sched_wakeup_new", &[None, Some(&task_ptr)])?;
        Ok(offsets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernels_btf_places_the_thread_pointer() {
        let offset = task_fsbase_offset().expect("task_struct.thread.fsbase in this kernel's BTF");
        assert!(offset > 0 && offset.is_multiple_of(8), "{offset}");
    }

    #[test]
    fn rejects_what_is_not_btf() {
        assert!(matches!(Btf::parse(b""), Err(BtfError::Malformed(_))));
        assert!(matches!(
            Btf::parse(&[0x9f, 0xeb, 1, 0, 24, 0, 0, 0]),
            Err(BtfError::Malformed(_))
        ));
    }

    /// This kernel's own BTF (where it has one) gives offsets inside
    /// `task_struct` and the 5.18+ `sched_switch` prototype.
    #[test]
    fn this_kernels_btf_describes_the_scheduler_tracepoints() {
        let Ok(data) = std::fs::read(VMLINUX_BTF) else {
            return;
        };
        let btf = Btf::parse(&data).expect("the kernel's BTF parses");
        let task = btf.find(KIND_STRUCT, "task_struct").unwrap();
        let offsets = TaskOffsets::from_btf(&btf).expect("raw tracepoints usable");
        for o in [offsets.pid, offsets.exit_state, offsets.cpu] {
            assert!(o > 0 && o < task.size_or_type, "{offsets:?}");
        }
        // `tgid` follows `pid` in every kernel since 2.6.
        assert_eq!(
            btf.member_offset(task, &["tgid"], 8),
            Some((offsets.pid + 4, 4))
        );
    }

    proptest::proptest! {
        /// Whatever bytes follow a valid header, parsing returns, never panics.
        #[test]
        fn parsing_arbitrary_types_never_panics(body in proptest::collection::vec(0u8..=255, 0..512)) {
            let mut data = vec![0x9f, 0xeb, 1, 0, 24, 0, 0, 0];
            for v in [0u32, body.len() as u32 / 2, body.len() as u32 / 2, body.len() as u32 / 2] {
                data.extend(v.to_le_bytes());
            }
            data.extend(&body);
            if let Ok(btf) = Btf::parse(&data) {
                let _ = TaskOffsets::from_btf(&btf);
            }
        }
    }
}
