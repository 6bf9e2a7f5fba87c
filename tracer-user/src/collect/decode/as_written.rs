//! Records as the probes wrote them: the length of one a collector keeps
//! in that form, and writing a decoded one back into it.

use tracer_common::{
    ProcessFork, RecordKind, SchedSwitch, SchedWakeup, TaskExit, TaskNew, TaskRename,
    cuda::{CudaCall, CudaSymbol},
};

use super::{Record, bytes_of, driver_call::encode_driver_call, header};

/// The length of the record `bytes` holds if it is one a collector keeps
/// as the probes wrote it: a scheduler record (a switch, a wake-up, a new
/// task, a fork, an exit, a rename) or a CUDA driver record (a call, a
/// kernel's name). `None` for any other kind, and for bytes
/// [`decode`](super::decode) would refuse (it says why).
#[inline]
pub fn held_record_len(bytes: &[u8]) -> Option<usize> {
    let header = header(bytes)?;
    // Switches and wake-ups are most of a flood: told apart by two
    // comparisons rather than a jump through a table of every kind.
    const COMMON: usize = size_of::<SchedSwitch>();
    const _: () = assert!(size_of::<SchedWakeup>() == COMMON);
    if (header.kind == RecordKind::SchedSwitch as u16
        || header.kind == RecordKind::SchedWakeup as u16)
        && usize::from(header.size) == COMMON
    {
        return (bytes.len() >= COMMON).then_some(COMMON);
    }
    let expected = match RecordKind::from_u16(header.kind)? {
        RecordKind::SchedSwitch => size_of::<SchedSwitch>(),
        RecordKind::SchedWakeup => size_of::<SchedWakeup>(),
        RecordKind::TaskNew => size_of::<TaskNew>(),
        RecordKind::ProcessFork => size_of::<ProcessFork>(),
        RecordKind::TaskExit => size_of::<TaskExit>(),
        RecordKind::TaskRename => size_of::<TaskRename>(),
        RecordKind::CudaCall => {
            let size = usize::from(header.size);
            return (CudaCall::words_of_size(size).is_some() && bytes.len() >= size)
                .then_some(size);
        }
        RecordKind::CudaSymbol => size_of::<CudaSymbol>(),
        _ => return None,
    };
    (usize::from(header.size) == expected && bytes.len() >= expected).then_some(expected)
}

/// Appends `record` to `out` as the probes write it, which
/// [`decode`](super::decode) reads back. False, and nothing written, for
/// the records of variable size (stack samples, TraceMe events).
pub fn encode(record: &Record, out: &mut Vec<u8>) -> bool {
    match record {
        Record::Switch(r) => out.extend_from_slice(bytes_of(r)),
        Record::Wakeup(r) => out.extend_from_slice(bytes_of(r)),
        Record::TaskNew(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::Fork(r) => out.extend_from_slice(bytes_of(r)),
        Record::Exit(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::Rename(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::CudaCall(r) => encode_driver_call(r, out),
        Record::CudaSymbol(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::TraceMe(_) | Record::StackSample(_) => return false,
    }
    true
}
