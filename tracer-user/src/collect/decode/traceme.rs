//! TraceMe records: a target's `TraceMeRecorder::Record` call, of a size
//! that follows the name it copied.

use tracer_common::{
    RecordHeader, RecordKind, TraceMeRecord,
    traceme::{FLAG_NAME_UNREADABLE, TRACEME_PREFIX, traceme_record_size},
};

use super::DecodeError;

/// A `TraceMeRecorder::Record(Event&&)` call as the uprobe saw it.
#[derive(Clone, Debug)]
pub struct TraceMeEvent {
    /// Kind, size, CPU and time of the record.
    pub header: RecordHeader,
    /// The thread that recorded the event.
    pub tid: u32,
    /// Its process.
    pub tgid: u32,
    /// Address of the probed `Record`: which recorder (loaded object).
    pub site: u64,
    /// `Event::start_time`, as the target wrote it (wall-clock epoch ns,
    /// or minus an activity's id at its end).
    pub start_time: i64,
    /// `Event::end_time`, as the target wrote it (wall-clock epoch ns, or
    /// minus an activity's id at its start).
    pub end_time: i64,
    /// The name, or its first `NAME_CAP` bytes (invalid UTF-8 replaced).
    pub name: String,
    /// The name was longer than what was copied.
    pub truncated: bool,
    /// Length in bytes of the whole name in the target.
    pub name_len: u32,
    /// The name's memory could not be read; `name` is empty.
    pub name_unreadable: bool,
}

/// A TraceMe record is its fixed part plus the copied name, rounded up to
/// 8 bytes: both sizes must agree.
pub(super) fn read_traceme(bytes: &[u8], claimed: usize) -> Result<TraceMeEvent, DecodeError> {
    let kind = RecordKind::TraceMe;
    let full = size_of::<TraceMeRecord>();
    if claimed < TRACEME_PREFIX || claimed > full || bytes.len() < claimed {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected: TRACEME_PREFIX,
            got: bytes.len(),
        });
    }
    // Only the fixed part is copied out; the name is read in place.
    let mut fixed = std::mem::MaybeUninit::<TraceMeRecord>::uninit();
    let p = fixed.as_mut_ptr();
    // SAFETY: `bytes` holds at least TRACEME_PREFIX bytes, which cover every
    // field before `name`; only those fields are read, through raw pointers.
    let (header, tid, tgid, site, start_time, end_time, name_len, copied, flags) = unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast::<u8>(), TRACEME_PREFIX);
        (
            (&raw const (*p).header).read(),
            (&raw const (*p).tid).read(),
            (&raw const (*p).tgid).read(),
            (&raw const (*p).site).read(),
            (&raw const (*p).start_time).read(),
            (&raw const (*p).end_time).read(),
            (&raw const (*p).name_len).read(),
            usize::from((&raw const (*p).copied).read()),
            (&raw const (*p).flags).read(),
        )
    };
    if traceme_record_size(copied) != claimed {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected: traceme_record_size(copied),
            got: bytes.len(),
        });
    }
    let name_unreadable = flags & FLAG_NAME_UNREADABLE != 0;
    Ok(TraceMeEvent {
        header,
        tid,
        tgid,
        site,
        start_time,
        end_time,
        name: String::from_utf8_lossy(&bytes[TRACEME_PREFIX..TRACEME_PREFIX + copied]).into_owned(),
        truncated: !name_unreadable && name_len as usize > copied,
        name_len,
        name_unreadable,
    })
}
