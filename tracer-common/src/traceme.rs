//! TraceMe records: one per call of `TraceMeRecorder::Record(Event&&)` in a
//! traced process (TSL's host tracing, in jaxlib, TensorFlow and libtpu).
//!
//! The uprobe copies the event as the target hands it over: its name (up to
//! [`NAME_CAP`] bytes) and its two wall-clock times, whose meaning depends
//! on their signs (complete event, activity start or end, instant); user
//! space decodes that. Records are variable-sized: the header's `size`
//! covers the fixed part and the copied name, rounded up to 8 bytes.

use crate::RecordHeader;

/// Most bytes of a name copied; longer names are cut and marked.
pub const NAME_CAP: usize = 1024;

/// Names of the TraceMe programs and maps in the eBPF object.
pub mod names {
    /// Uprobe for objects built with libstdc++ (`std::string` of 32 bytes).
    pub const PROGRAM_LIBSTDCXX: &str = "traceme_record_libstdcxx";
    /// Uprobe for objects built with libc++'s default string layout.
    pub const PROGRAM_LIBCXX: &str = "traceme_record_libcxx";
    /// Uprobe for objects built with libc++'s alternate string layout
    /// (ABI v2 and private ABI namespaces such as libtpu's `std::__u`).
    pub const PROGRAM_LIBCXX_ALTERNATE: &str = "traceme_record_libcxx_alt";
    /// Per-CPU counters, indexed by [`super::stat`].
    pub const STATS: &str = "TRACEME_STATS";
}

/// Indices into the per-CPU `TRACEME_STATS` array.
pub mod stat {
    /// Uprobe hits in a traced process.
    pub const HITS: u32 = 0;
    /// Events whose `Event` struct could not be read (record not written).
    pub const EVENT_UNREADABLE: u32 = 1;
    /// Events written without their name (its memory could not be read).
    pub const NAME_UNREADABLE: u32 = 2;
    /// Number of counters.
    pub const COUNT: u32 = 3;
}

/// [`TraceMeRecord::flags`]: the name's memory could not be read.
pub const FLAG_NAME_UNREADABLE: u16 = 1;

/// One `TraceMeRecorder::Record(Event&&)` call. `header.ts_ns` is the
/// kernel's monotonic time of the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TraceMeRecord {
    /// Its `size` covers the fixed part and the copied name, rounded up to
    /// 8 bytes ([`traceme_record_size`]).
    pub header: RecordHeader,
    /// Thread that called `Record`.
    pub tid: u32,
    /// Thread group of `tid`: a recorded process.
    pub tgid: u32,
    /// Address of the probed `Record` in the target: tells which loaded
    /// object (each has its own recorder) recorded the event.
    pub site: u64,
    /// `Event::start_time`: epoch ns, or `-activity id` for an activity end.
    pub start_time: i64,
    /// `Event::end_time`: epoch ns, or `-activity id` for an activity start.
    pub end_time: i64,
    /// Length of the name in the target.
    pub name_len: u32,
    /// Bytes of the name copied into `name` (at most [`NAME_CAP`]).
    pub copied: u16,
    /// [`FLAG_NAME_UNREADABLE`].
    pub flags: u16,
    /// The name, its first `copied` bytes copied (no terminating NUL).
    pub name: [u8; NAME_CAP],
}

/// Size of the fixed part that precedes the name.
pub const TRACEME_PREFIX: usize = core::mem::offset_of!(TraceMeRecord, name);

/// Size of a record that carries `copied` name bytes.
pub const fn traceme_record_size(copied: usize) -> usize {
    TRACEME_PREFIX + ((copied + 7) & !7)
}
