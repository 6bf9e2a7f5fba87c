//! PyTorch's ops as the agent hands them over (`tracer_agent::op_records`):
//! each RecordFunction's start and end paired into one op. Everything here
//! comes from the target: counts and offsets are checked against the
//! payload, names cut and made UTF-8, and records that make no sense are
//! counted, never trusted.

use std::{collections::HashMap, sync::Arc};

use tracer_agent::op_records::{
    self, END, MAX_NAME_LEN, NAME_ID_LIMIT, NameEntry, OpRecord, OpsHeader,
    SCOPE_BACKWARD_FUNCTION, SCOPE_FUNCTION, SCOPE_USER,
};

/// The name of an op whose name the agent's table had no room for.
pub const UNNAMED_OP: &str = "(op name not kept)";

/// What kind of RecordFunction an op is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpScope {
    /// An ATen op or autograd node (`RecordScope::FUNCTION`).
    Function,
    /// A backward function autograd ran (`RecordScope::BACKWARD_FUNCTION`).
    Backward,
    /// A `record_function` range (`RecordScope::USER_SCOPE`).
    User,
}

impl OpScope {
    fn of(scope: u32) -> Option<Self> {
        match scope {
            SCOPE_FUNCTION => Some(OpScope::Function),
            SCOPE_BACKWARD_FUNCTION => Some(OpScope::Backward),
            SCOPE_USER => Some(OpScope::User),
            _ => None,
        }
    }

    /// How the trace names it (the `torch_scope` stat).
    pub fn as_str(self) -> &'static str {
        match self {
            OpScope::Function => "function",
            OpScope::Backward => "backward_function",
            OpScope::User => "user_scope",
        }
    }
}

/// One RecordFunction, start to end, on the thread that started it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchOp {
    /// Kernel tid.
    pub tid: u32,
    /// `CLOCK_MONOTONIC` ns.
    pub start_ns: u64,
    /// `CLOCK_MONOTONIC` ns.
    pub end_ns: u64,
    /// Its name (`aten::addmm`, `AddmmBackward0`, a `record_function`'s).
    pub name: Arc<str>,
    /// What kind it is.
    pub scope: OpScope,
    /// Its sequence number where PyTorch gave one (autograd's: a forward
    /// op and the backward function it made share it).
    pub sequence: Option<u64>,
    /// Its input shapes as torch.profiler writes them (`[[64, 256], []]`),
    /// where they were asked for.
    pub shapes: Option<Arc<str>>,
}

/// The ops of one recording, and what could not be made of the rest.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodedOps {
    /// The ops, in the order they ended.
    pub ops: Vec<TorchOp>,
    /// Records the agent's buffer had no room for.
    pub dropped: u64,
    /// Names its table had no room for.
    pub names_lost: u32,
    /// Starts without an end (still running when the callbacks were
    /// removed) and ends without a start.
    pub unpaired: u64,
    /// Records with a scope, a thread or times that make no sense.
    pub malformed: u64,
}

/// Decodes one [`tracer_agent::protocol::TORCH_OPS`] payload; the error
/// says why it is not one.
pub fn decode_ops(payload: &[u8]) -> Result<DecodedOps, String> {
    let header = OpsHeader::decode(payload).ok_or("shorter than its header")?;
    if header.magic != op_records::MAGIC || header.version != op_records::VERSION {
        return Err(format!(
            "version {} of the format, not {}",
            header.version,
            op_records::VERSION
        ));
    }
    let entries_len = header.names as usize * NameEntry::LEN;
    let records_len = header.records as usize * OpRecord::LEN;
    let rest = &payload[OpsHeader::LEN..];
    let expected = entries_len as u64 + u64::from(header.arena_len) + records_len as u64;
    if rest.len() as u64 != expected {
        return Err(format!(
            "{} bytes after the header where its counts make {expected}",
            rest.len()
        ));
    }
    let (entries, rest) = rest.split_at(entries_len);
    let (arena, records) = rest.split_at(header.arena_len as usize);
    let names = read_names(entries, arena);
    let mut out = DecodedOps {
        dropped: header.dropped,
        names_lost: header.names_lost,
        ..DecodedOps::default()
    };
    let unnamed: Arc<str> = UNNAMED_OP.into();
    // Starts not ended yet, by the RecordFunction's address (unique while
    // it lives, whichever thread ends it).
    let mut open: HashMap<u64, OpRecord> = HashMap::new();
    for record in records
        .chunks_exact(OpRecord::LEN)
        .filter_map(OpRecord::decode)
    {
        if record.what != END {
            if OpScope::of(record.what >> 24).is_none() || record.tid == 0 {
                out.malformed += 1;
            } else if open.insert(record.record_function, record).is_some() {
                out.unpaired += 1;
            }
            continue;
        }
        let Some(start) = open.remove(&record.record_function) else {
            out.unpaired += 1;
            continue;
        };
        if record.ts_ns < start.ts_ns {
            out.malformed += 1;
            continue;
        }
        let id = start.what & (NAME_ID_LIMIT - 1);
        out.ops.push(TorchOp {
            tid: start.tid,
            start_ns: start.ts_ns,
            end_ns: record.ts_ns,
            name: names.get(&id).cloned().unwrap_or_else(|| unnamed.clone()),
            scope: OpScope::of(start.what >> 24).expect("checked at its start"),
            sequence: u64::try_from(start.sequence).ok(),
            shapes: names.get(&start.shapes).cloned(),
        });
    }
    out.unpaired += open.len() as u64;
    Ok(out)
}

/// The names the entries point at in `arena`; an entry pointing outside
/// it is left out.
fn read_names(entries: &[u8], arena: &[u8]) -> HashMap<u32, Arc<str>> {
    entries
        .chunks_exact(NameEntry::LEN)
        .filter_map(NameEntry::decode)
        .filter(|e| e.id < NAME_ID_LIMIT && e.len as usize <= MAX_NAME_LEN)
        .filter_map(|e| {
            let start = e.offset as usize;
            let bytes = arena.get(start..start.checked_add(e.len as usize)?)?;
            let name: String = String::from_utf8_lossy(bytes)
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
            Some((e.id, Arc::from(name)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use tracer_agent::op_records::{NO_NAME, NO_SEQUENCE, start_what};

    use super::*;

    /// A payload as the agent builds one.
    fn payload(names: &[(u32, &str)], records: &[OpRecord], dropped: u64) -> Vec<u8> {
        let mut arena: Vec<u8> = Vec::new();
        let mut entries = Vec::new();
        for (id, name) in names {
            entries.extend(id.to_le_bytes());
            entries.extend((arena.len() as u32).to_le_bytes());
            entries.extend((name.len() as u32).to_le_bytes());
            arena.extend(name.as_bytes());
        }
        let header = OpsHeader {
            magic: op_records::MAGIC,
            version: op_records::VERSION,
            records: records.len() as u32,
            names: names.len() as u32,
            arena_len: arena.len() as u32,
            names_lost: 0,
            dropped,
        };
        let mut out = header.encode().to_vec();
        out.extend(entries);
        out.extend(arena);
        for r in records {
            out.extend(r.ts_ns.to_le_bytes());
            out.extend(r.record_function.to_le_bytes());
            out.extend(r.tid.to_le_bytes());
            out.extend(r.what.to_le_bytes());
            out.extend(r.sequence.to_le_bytes());
            out.extend(r.shapes.to_le_bytes());
            out.extend(r.reserved.to_le_bytes());
        }
        out
    }

    fn rec(ts_ns: u64, rf: u64, tid: u32, what: u32) -> OpRecord {
        OpRecord {
            ts_ns,
            record_function: rf,
            tid,
            what,
            sequence: NO_SEQUENCE,
            shapes: NO_NAME,
            reserved: 0,
        }
    }

    fn numbered(ts_ns: u64, rf: u64, tid: u32, what: u32, sequence: i64) -> OpRecord {
        OpRecord {
            sequence,
            ..rec(ts_ns, rf, tid, what)
        }
    }

    #[test]
    fn starts_and_ends_pair_by_their_record_function() {
        let records = [
            rec(100, 0xa, 7, start_what(SCOPE_USER, 1)),
            numbered(110, 0xb, 7, start_what(SCOPE_FUNCTION, 2), 41),
            // Another thread's op, ended on a third thread.
            numbered(115, 0xc, 8, start_what(SCOPE_BACKWARD_FUNCTION, 3), 41),
            rec(120, 0xb, 7, END),
            rec(125, 0xc, 9, END),
            rec(130, 0xa, 7, END),
            // The same address again, later; a negative number is none.
            numbered(140, 0xb, 7, start_what(SCOPE_FUNCTION, NO_NAME), -7),
            rec(150, 0xb, 7, END),
            // Ended without a start; started without an end.
            rec(160, 0xd, 7, END),
            rec(170, 0xe, 7, start_what(SCOPE_FUNCTION, 2)),
        ];
        let names = [(1, "train_step"), (2, "aten::addmm"), (3, "AddmmBackward0")];
        let decoded = decode_ops(&payload(&names, &records, 5)).unwrap();
        let got: Vec<(u32, u64, u64, &str, OpScope)> = decoded
            .ops
            .iter()
            .map(|o| (o.tid, o.start_ns, o.end_ns, &*o.name, o.scope))
            .collect();
        assert_eq!(
            got,
            [
                (7, 110, 120, "aten::addmm", OpScope::Function),
                (8, 115, 125, "AddmmBackward0", OpScope::Backward),
                (7, 100, 130, "train_step", OpScope::User),
                (7, 140, 150, UNNAMED_OP, OpScope::Function),
            ]
        );
        let numbers: Vec<Option<u64>> = decoded.ops.iter().map(|o| o.sequence).collect();
        assert_eq!(numbers, [Some(41), Some(41), None, None]);
        assert_eq!((decoded.unpaired, decoded.dropped), (2, 5));
    }

    #[test]
    fn records_that_make_no_sense_are_counted() {
        let records = [
            rec(100, 0xa, 7, start_what(4, 1)),
            rec(100, 0xb, 0, start_what(SCOPE_FUNCTION, 1)),
            rec(100, 0xc, 7, start_what(SCOPE_FUNCTION, 1)),
            rec(90, 0xc, 7, END),
        ];
        let decoded = decode_ops(&payload(&[(1, "x")], &records, 0)).unwrap();
        assert!(decoded.ops.is_empty());
        assert_eq!(decoded.malformed, 3);
    }

    #[test]
    fn names_outside_the_arena_and_bad_bytes_are_not_trusted() {
        let mut p = payload(&[(1, "aten::mm\u{7}")], &[], 0);
        let names = read_names(&p[32..44], &p[44..]);
        assert_eq!(&*names[&1], "aten::mm?");
        // An entry pointing past the arena.
        p[36..40].copy_from_slice(&100u32.to_le_bytes());
        assert!(read_names(&p[32..44], &p[44..]).is_empty());
    }

    #[test]
    fn a_payload_whose_counts_do_not_add_up_is_refused() {
        let p = payload(&[(1, "a")], &[rec(1, 1, 1, END)], 0);
        assert!(decode_ops(&p[..p.len() - 1]).is_err());
        assert!(decode_ops(&p[..10]).is_err());
        let mut wrong = p.clone();
        wrong[4] = 9;
        assert!(decode_ops(&wrong).unwrap_err().contains("version 9"));
    }

    proptest::proptest! {
        #[test]
        fn any_payload_decodes_or_is_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = decode_ops(&bytes);
        }
    }
}
