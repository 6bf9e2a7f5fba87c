//! Bytes from the ring buffer to typed records: the only place that
//! reinterprets kernel-written memory.

use tracer_common::{
    ProcessFork, RecordHeader, RecordKind, SchedSwitch, SchedWakeup, TaskExit, TaskNew, TaskRename,
    cuda::{CudaCall, CudaSymbol},
};

/// One record from the kernel, decoded. Large, rare records are boxed so
/// that the frequent scheduler records stay small.
#[derive(Clone, Debug)]
pub enum Record {
    Switch(SchedSwitch),
    Wakeup(SchedWakeup),
    TaskNew(TaskNew),
    Fork(ProcessFork),
    Exit(TaskExit),
    Rename(TaskRename),
    CudaCall(Box<CudaCall>),
    CudaSymbol(Box<CudaSymbol>),
}

impl Record {
    pub fn header(&self) -> &RecordHeader {
        match self {
            Record::Switch(r) => &r.header,
            Record::Wakeup(r) => &r.header,
            Record::TaskNew(r) => &r.header,
            Record::Fork(r) => &r.header,
            Record::Exit(r) => &r.header,
            Record::Rename(r) => &r.header,
            Record::CudaCall(r) => &r.header,
            Record::CudaSymbol(r) => &r.header,
        }
    }

    /// `CLOCK_MONOTONIC` time of the record, in ns.
    pub fn ts(&self) -> u64 {
        self.header().ts_ns
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("unknown record kind {0}")]
    UnknownKind(u16),
    #[error("record kind {kind:?} claims {claimed} bytes, expected {expected}, got {got}")]
    Size {
        kind: RecordKind,
        claimed: usize,
        expected: usize,
        got: usize,
    },
}

fn read<T: Copy>(bytes: &[u8], kind: RecordKind, claimed: usize) -> Result<T, DecodeError> {
    let expected = size_of::<T>();
    if claimed != expected || bytes.len() < expected {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected,
            got: bytes.len(),
        });
    }
    // SAFETY: length checked; T is a plain #[repr(C)] record; unaligned read.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Decodes one ring-buffer item.
pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    if bytes.len() < size_of::<RecordHeader>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    // SAFETY: length checked above.
    let header: RecordHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let kind = RecordKind::from_u16(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    let size = usize::from(header.size);
    Ok(match kind {
        RecordKind::SchedSwitch => Record::Switch(read(bytes, kind, size)?),
        RecordKind::SchedWakeup => Record::Wakeup(read(bytes, kind, size)?),
        RecordKind::TaskNew => Record::TaskNew(read(bytes, kind, size)?),
        RecordKind::ProcessFork => Record::Fork(read(bytes, kind, size)?),
        RecordKind::TaskExit => Record::Exit(read(bytes, kind, size)?),
        RecordKind::TaskRename => Record::Rename(read(bytes, kind, size)?),
        RecordKind::CudaCall => Record::CudaCall(Box::new(read(bytes, kind, size)?)),
        RecordKind::CudaSymbol => Record::CudaSymbol(Box::new(read(bytes, kind, size)?)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T>(v: &T) -> Vec<u8> {
        // SAFETY: reading the bytes of a plain record.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    #[test]
    fn decodes_a_switch() {
        let rec = SchedSwitch {
            header: RecordHeader::new(RecordKind::SchedSwitch, size_of::<SchedSwitch>(), 1, 99),
            prev_tid: 10,
            prev_tgid: 10,
            next_tid: 11,
            next_tgid: 0,
            prev_state: 1,
        };
        let Record::Switch(got) = decode(&bytes_of(&rec)).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((got.prev_tid, got.next_tid, got.header.ts_ns), (10, 11, 99));
    }

    #[test]
    fn rejects_bad_sizes_and_kinds() {
        let mut rec = SchedWakeup {
            header: RecordHeader::new(RecordKind::SchedWakeup, 8, 0, 0),
            tid: 1,
            tgid: 1,
            waker_tid: 2,
            waker_tgid: 2,
            target_cpu: 0,
            flags: 0,
        };
        assert!(matches!(
            decode(&bytes_of(&rec)),
            Err(DecodeError::Size { .. })
        ));
        rec.header.kind = 77;
        assert_eq!(
            decode(&bytes_of(&rec)).unwrap_err(),
            DecodeError::UnknownKind(77)
        );
        assert_eq!(decode(&[0u8; 3]).unwrap_err(), DecodeError::Short(3));
    }
}
