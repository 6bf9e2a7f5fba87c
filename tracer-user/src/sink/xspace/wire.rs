//! The protobuf wire form of what planes hold: stats, events and lines,
//! written by hand on the hot path (several varints per event, millions
//! of events per trace) and byte for byte what prost would write for the
//! same messages, but for the padded length of very large lines.

use std::mem::MaybeUninit;

use ebtrace_proto::tensorflow::profiler::{XStat, x_stat};
use prost::encoding::WireType;

/// A stat value as written: strings are interned, so a value is 8 bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Encoded {
    /// `int64_value`.
    I64(i64),
    /// `uint64_value`.
    U64(u64),
    /// `double_value`.
    F64(f64),
    /// `ref_value`: the id of the stat metadata holding the string.
    Ref(u64),
}

/// A stat ready to be written: its metadata id and value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    /// Id of its `XStatMetadata` in the plane.
    pub metadata_id: i64,
    /// Its value.
    pub value: Encoded,
}

impl Stat {
    /// A stat of `metadata_id` with `value`.
    pub fn new(metadata_id: i64, value: Encoded) -> Self {
        Stat { metadata_id, value }
    }

    /// A signed integer stat.
    pub fn i64(metadata_id: i64, v: i64) -> Self {
        Self::new(metadata_id, Encoded::I64(v))
    }

    /// An unsigned integer stat.
    pub fn u64(metadata_id: i64, v: u64) -> Self {
        Self::new(metadata_id, Encoded::U64(v))
    }

    /// A string stat whose string is the stat metadata `ref_id`.
    pub fn reference(metadata_id: i64, ref_id: i64) -> Self {
        Self::new(metadata_id, Encoded::Ref(ref_id as u64))
    }

    pub(super) fn as_proto(self) -> XStat {
        let value = match self.value {
            Encoded::I64(v) => x_stat::Value::Int64Value(v),
            Encoded::U64(v) => x_stat::Value::Uint64Value(v),
            Encoded::F64(v) => x_stat::Value::DoubleValue(v),
            Encoded::Ref(v) => x_stat::Value::RefValue(v),
        };
        XStat {
            metadata_id: self.metadata_id,
            value: Some(value),
        }
    }
}

/// A varint, written without prost's per-byte buffer checks (the hot path:
/// several per event).
#[inline]
fn put_varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The one-byte key of a field with a tag below 16 (all tags written here).
#[inline]
const fn key_byte(tag: u32, wire_type: WireType) -> u8 {
    ((tag << 3) | wire_type as u32) as u8
}

fn encode_int64(tag: u32, v: i64, out: &mut Vec<u8>) {
    if v != 0 {
        out.push(key_byte(tag, WireType::Varint));
        put_varint(v as u64, out);
    }
}

fn encode_string(tag: u32, s: &str, out: &mut Vec<u8>) {
    if !s.is_empty() {
        out.push(key_byte(tag, WireType::LengthDelimited));
        put_varint(s.len() as u64, out);
        out.extend_from_slice(s.as_bytes());
    }
}

/// An event's stats: a few inline, or borrowed, the first of them
/// encoded already.
#[derive(Clone, Copy, Debug)]
pub enum EventStats<'a> {
    /// Up to four stats, held by value.
    Inline {
        /// How many of `stats` are the event's.
        len: u8,
        /// The stats, the first `len` used.
        stats: [Stat; 4],
    },
    /// Stats shared with other events, encoded once (with
    /// [`encode_stat_fields`]), then the event's own.
    Shared {
        /// The shared stats, already encoded as `XEvent.stats` fields.
        encoded: &'a [u8],
        /// The event's own stats, written after them.
        own: &'a [Stat],
    },
}

impl<'a> EventStats<'a> {
    /// Up to four stats, copied (a size known when compiled: this is on
    /// every scheduling event's path).
    #[inline(always)]
    pub fn inline<const N: usize>(stats: [Stat; N]) -> Self {
        const { assert!(N <= 4, "at most four stats inline") };
        let mut out = [Stat::i64(0, 0); 4];
        out[..N].copy_from_slice(&stats);
        EventStats::Inline {
            len: N as u8,
            stats: out,
        }
    }

    /// The first `len` of `stats` (at most four).
    #[inline(always)]
    pub fn first(len: usize, stats: [Stat; 4]) -> Self {
        EventStats::Inline {
            len: len.min(4) as u8,
            stats,
        }
    }

    /// Stats of the event's own, none encoded already.
    pub fn own(stats: &'a [Stat]) -> Self {
        EventStats::Shared {
            encoded: &[],
            own: stats,
        }
    }

    /// Writes the `events` field (4) of an `XLine` holding an event of
    /// `metadata_id`, times and these stats.
    #[inline(always)]
    pub fn encode_event(
        &self,
        out: &mut Vec<u8>,
        metadata_id: i64,
        offset_ps: i64,
        duration_ps: i64,
    ) {
        match *self {
            EventStats::Inline { len, ref stats } => encode_event(
                out,
                metadata_id,
                offset_ps,
                duration_ps,
                &stats[..usize::from(len)],
            ),
            EventStats::Shared { encoded: [], own } => {
                encode_event(out, metadata_id, offset_ps, duration_ps, own)
            }
            EventStats::Shared { encoded, own } => {
                encode_event_in_parts(out, metadata_id, offset_ps, duration_ps, encoded, own)
            }
        }
    }
}

/// One event of a line, as [`XPlaneBuilder::write_line`] writes it.
#[derive(Clone, Copy, Debug)]
pub struct LineEvent<'a> {
    /// Id of its `XEventMetadata` in the plane.
    pub metadata_id: i64,
    /// Start, in ps from the line's `timestamp_ns`.
    pub offset_ps: i64,
    /// Length, in ps.
    pub duration_ps: i64,
    /// Its stats.
    pub stats: EventStats<'a>,
}

impl LineEvent<'_> {
    /// Parents before children: by start, then longest first.
    pub fn order_key(&self) -> (i64, std::cmp::Reverse<i64>) {
        (self.offset_ps, std::cmp::Reverse(self.duration_ps))
    }
}

/// An event [`encode_line`] writes: a [`LineEvent`], or a sink's own
/// smaller one that makes its stats only as it is encoded (with
/// [`encode_event`]), rather than carrying them.
pub trait EncodeEvent {
    /// See [`LineEvent::order_key`].
    fn order_key(&self) -> (i64, std::cmp::Reverse<i64>);

    /// Writes the `events` field (4) of an `XLine` holding this event.
    fn encode_field(&self, out: &mut Vec<u8>);
}

impl EncodeEvent for LineEvent<'_> {
    fn order_key(&self) -> (i64, std::cmp::Reverse<i64>) {
        LineEvent::order_key(self)
    }

    #[inline]
    fn encode_field(&self, out: &mut Vec<u8>) {
        self.stats
            .encode_event(out, self.metadata_id, self.offset_ps, self.duration_ps);
    }
}

/// Writes the `events` field (4) of an `XLine` holding an event of
/// `metadata_id`, times and `stats`.
///
/// The event is encoded in place, past a length of one byte (the hot
/// path: one per event, and nearly all take fewer than 128 bytes): a
/// longer one is moved up one byte after. An event with more stats than
/// [`EventBytes`] holds takes the slower path.
#[inline(always)]
pub fn encode_event(
    out: &mut Vec<u8>,
    metadata_id: i64,
    offset_ps: i64,
    duration_ps: i64,
    stats: &[Stat],
) {
    if stats.len() > EventBytes::MAX_STATS {
        return encode_event_in_parts(out, metadata_id, offset_ps, duration_ps, &[], stats);
    }
    out.reserve(3 + EventBytes::CAPACITY);
    let start = out.len();
    let (head, rest) = out.spare_capacity_mut().split_at_mut(2);
    let mut body = EventBytes {
        bytes: rest,
        len: 0,
    };
    body.header(metadata_id, offset_ps, duration_ps);
    for s in stats {
        body.stat_field(s);
    }
    let len = body.len;
    head[0].write(key_byte(4, WireType::LengthDelimited));
    let written = if len < 0x80 {
        head[1].write(len as u8);
        2 + len
    } else {
        // At most `CAPACITY` (under 2^14): two length bytes.
        rest.copy_within(..len, 1);
        head[1].write(len as u8 | 0x80);
        rest[0].write((len >> 7) as u8);
        3 + len
    };
    // SAFETY: the `written` bytes past `start` (the key, the length and the
    // body) were all written above, within the capacity reserved.
    unsafe { out.set_len(start + written) };
}

/// Appends `stats` as an `XEvent`'s `stats` fields (4), to be copied into
/// the events that share them (see [`EventStats::Shared`]).
pub fn encode_stat_fields(stats: &[Stat], out: &mut Vec<u8>) {
    for s in stats {
        EventBytes::append(out, |b| b.stat_field(s));
    }
}

/// [`encode_event`] for an event whose first stats come encoded already
/// (`encoded`, a group many events share; maybe none), then its `own` (any
/// number): its parts are appended one by one past a length of one byte,
/// and the body moved up if its length needs more.
fn encode_event_in_parts(
    out: &mut Vec<u8>,
    metadata_id: i64,
    offset_ps: i64,
    duration_ps: i64,
    encoded: &[u8],
    own: &[Stat],
) {
    out.push(key_byte(4, WireType::LengthDelimited));
    let length_at = out.len();
    out.push(0);
    EventBytes::append(out, |b| b.header(metadata_id, offset_ps, duration_ps));
    out.extend_from_slice(encoded);
    encode_stat_fields(own, out);
    let body = length_at + 1;
    let len = out.len() - body;
    let (mut length, mut n, mut v) = ([0u8; 10], 0, len as u64);
    while v >= 0x80 {
        length[n] = v as u8 | 0x80;
        v >>= 7;
        n += 1;
    }
    length[n] = v as u8;
    n += 1;
    if n > 1 {
        out.resize(out.len() + n - 1, 0);
        out.copy_within(body..body + len, body + n - 1);
    }
    out[length_at..length_at + n].copy_from_slice(&length[..n]);
}

/// An event's body being encoded, straight into the spare capacity of
/// the output (no buffer to clear, nothing to copy out).
struct EventBytes<'a> {
    bytes: &'a mut [MaybeUninit<u8>],
    len: usize,
}

impl EventBytes<'_> {
    /// Stats an event may have to be encoded here.
    const MAX_STATS: usize = 4;
    /// Three keys and three varints, then per stat a key, a length byte
    /// and a body of at most 22 bytes (two keys and two varints).
    const CAPACITY: usize = 3 * 11 + Self::MAX_STATS * 24;

    /// Appends to `out` what `write` encodes (at most [`Self::CAPACITY`]
    /// bytes).
    fn append(out: &mut Vec<u8>, write: impl FnOnce(&mut EventBytes<'_>)) {
        out.reserve(Self::CAPACITY);
        let start = out.len();
        let mut bytes = EventBytes {
            bytes: out.spare_capacity_mut(),
            len: 0,
        };
        write(&mut bytes);
        let len = bytes.len;
        // SAFETY: `write` wrote the `len` bytes past `start`, within the
        // capacity reserved (every write is bounds-checked against it).
        unsafe { out.set_len(start + len) };
    }

    #[inline(always)]
    fn push(&mut self, byte: u8) {
        self.bytes[self.len].write(byte);
        self.len += 1;
    }

    #[inline(always)]
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.push(v as u8);
    }

    #[inline(always)]
    fn int64(&mut self, tag: u32, v: i64) {
        if v != 0 {
            self.push(key_byte(tag, WireType::Varint));
            self.varint(v as u64);
        }
    }

    /// An `XEvent`'s fields but its stats: metadata_id = 1, offset_ps = 2
    /// (a oneof member: always written), duration_ps = 3.
    #[inline(always)]
    fn header(&mut self, metadata_id: i64, offset_ps: i64, duration_ps: i64) {
        self.int64(1, metadata_id);
        self.push(key_byte(2, WireType::Varint));
        self.varint(offset_ps as u64);
        self.int64(3, duration_ps);
    }

    /// A `stats` field (4) of an `XEvent`. `XStat`: metadata_id = 1; the
    /// value oneof: double 2, uint64 3, int64 4, ref 7 (a oneof member is
    /// written even when zero).
    #[inline(always)]
    fn stat_field(&mut self, s: &Stat) {
        self.push(key_byte(4, WireType::LengthDelimited));
        let length_at = self.len;
        self.push(0);
        self.int64(1, s.metadata_id);
        match s.value {
            Encoded::I64(v) => {
                self.push(key_byte(4, WireType::Varint));
                self.varint(v as u64);
            }
            Encoded::U64(v) => {
                self.push(key_byte(3, WireType::Varint));
                self.varint(v);
            }
            Encoded::F64(v) => {
                self.push(key_byte(2, WireType::SixtyFourBit));
                for byte in v.to_le_bytes() {
                    self.push(byte);
                }
            }
            Encoded::Ref(v) => {
                self.push(key_byte(7, WireType::Varint));
                self.varint(v);
            }
        }
        self.bytes[length_at].write((self.len - length_at - 1) as u8);
    }
}

/// Where a line is encoded: a buffer that holds all of it (a plane's
/// bytes, an in-memory answer), or one that a file's writer empties as it
/// fills, so that a line of millions of events is not held whole.
pub enum LineOut<'a> {
    /// A buffer that holds the whole line.
    Buffer(&'a mut Vec<u8>),
    /// A buffer a file's writer empties as it fills.
    File(SpillingLine<'a>),
}

/// A line on its way into a file: `buf` holds what is not written yet,
/// which starts at `base` in the file.
pub struct SpillingLine<'a> {
    file: &'a mut dyn WriteSeek,
    buf: &'a mut Vec<u8>,
    base: u64,
    error: Option<std::io::Error>,
}

/// A file, or anything written and seeked as one.
pub trait WriteSeek: std::io::Write + std::io::Seek {}

impl<T: std::io::Write + std::io::Seek> WriteSeek for T {}

/// Bytes a [`SpillingLine`] holds before it writes them out.
pub(super) const SPILL_BYTES: usize = 1 << 20;

impl<'a> SpillingLine<'a> {
    /// A line written to `file` from its current position, through `buf`
    /// (empty).
    pub fn new(file: &'a mut dyn WriteSeek, buf: &'a mut Vec<u8>) -> std::io::Result<Self> {
        let base = file.stream_position()?;
        Ok(SpillingLine {
            file,
            buf,
            base,
            error: None,
        })
    }

    /// Writes out what it still holds; the first error met, if any.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.spill();
        self.error.map_or(Ok(()), Err)
    }

    fn spill(&mut self) {
        if self.error.is_none()
            && let Err(e) = self.file.write_all(self.buf)
        {
            self.error = Some(e);
        }
        self.base += self.buf.len() as u64;
        self.buf.clear();
    }

    /// Writes `bytes` over what was written at `at`, before `base`.
    fn overwrite_written(&mut self, at: u64, bytes: &[u8]) {
        use std::io::SeekFrom;
        if self.error.is_some() {
            return;
        }
        let written = (|| {
            self.file.seek(SeekFrom::Start(at))?;
            self.file.write_all(bytes)?;
            self.file.seek(SeekFrom::Start(self.base)).map(drop)
        })();
        if let Err(e) = written {
            self.error = Some(e);
        }
    }
}

impl LineOut<'_> {
    fn bytes(&mut self) -> &mut Vec<u8> {
        match self {
            LineOut::Buffer(b) => b,
            LineOut::File(f) => &mut *f.buf,
        }
    }

    /// Where the next byte goes, in the whole output; and where what the
    /// buffer holds starts.
    fn position(&self) -> (u64, u64) {
        match self {
            LineOut::Buffer(b) => (b.len() as u64, 0),
            LineOut::File(f) => (f.base + f.buf.len() as u64, f.base),
        }
    }

    /// Between two events: a file's line is written out past a size.
    fn between_events(&mut self) {
        if let LineOut::File(f) = self
            && f.buf.len() >= SPILL_BYTES
        {
            f.spill();
        }
    }

    /// Writes `bytes` over the output's at `at`.
    fn overwrite(&mut self, at: u64, bytes: &[u8]) {
        let (_, base) = self.position();
        match self {
            LineOut::File(f) if at < base => f.overwrite_written(at, bytes),
            _ => {
                let i = (at - base) as usize;
                self.bytes()[i..i + bytes.len()].copy_from_slice(bytes);
            }
        }
    }
}

/// Appends line `id` with `events` to `out`, as the `lines` field (3) of
/// an `XPlane`; the events must come sorted by [`LineEvent::order_key`]
/// (parents before children). They are encoded in place, as they come:
/// nothing is held per event.
pub fn encode_line<E: EncodeEvent>(
    out: &mut LineOut<'_>,
    id: i64,
    name: &str,
    display_name: &str,
    events: impl IntoIterator<Item = E>,
) {
    let events = events.into_iter();
    // A typical event takes about 30 bytes.
    let expected = 64 + name.len() + display_name.len() + 32 * events.size_hint().0;
    let room = match out {
        LineOut::Buffer(_) => expected,
        LineOut::File(_) => expected.min(2 * SPILL_BYTES),
    };
    out.bytes().reserve(room);
    if let LineOut::Buffer(buffer) = out {
        populate_spare(buffer, room);
    }
    // The line's length is known once it is written: room is kept for
    // the longest length varint, and the line moved down onto it after.
    out.bytes().push(key_byte(3, WireType::LengthDelimited));
    let (length_at, _) = out.position();
    out.bytes().extend_from_slice(&[0; LINE_LENGTH_ROOM]);
    let (body_at, _) = out.position();
    // XLine: id = 1, name = 2, events = 4, display_name = 11 (prost
    // writes fields in tag order; timestamp_ns stays 0: relative times).
    encode_int64(1, id, out.bytes());
    encode_string(2, name, out.bytes());
    let mut last = None;
    for e in events {
        debug_assert!(last <= Some(e.order_key()), "events out of order");
        last = Some(e.order_key());
        e.encode_field(out.bytes());
        out.between_events();
    }
    encode_string(11, display_name, out.bytes());
    let (end, base) = out.position();
    let body_len = end - body_at;
    assert!(body_len < 1 << (7 * LINE_LENGTH_ROOM), "a line over 32 GiB");
    if body_len >= PADDED_LINE_LENGTH_FROM as u64 || length_at < base {
        // Moving a large line would copy it once more than needed (and
        // part of it may be written out already).
        out.overwrite(length_at, &padded_varint(body_len));
        return;
    }
    let (length_at, body_at) = ((length_at - base) as usize, (body_at - base) as usize);
    let out = out.bytes();
    let mut length = Vec::with_capacity(LINE_LENGTH_ROOM);
    put_varint(body_len, &mut length);
    out.copy_within(body_at.., length_at + length.len());
    out[length_at..length_at + length.len()].copy_from_slice(&length);
    out.truncate(length_at + length.len() + body_len as usize);
}

/// Lines expected to take at least this much have their room faulted in
/// at once.
const POPULATE_FROM: usize = 1 << 20;

/// Faults in the `room` bytes past the end of `buffer` (within its
/// capacity) in one call (`MADV_POPULATE_WRITE`, Linux 5.14) rather than a
/// page fault per 4 KiB as a large line fills them; older kernels ignore
/// the advice.
fn populate_spare(buffer: &mut Vec<u8>, room: usize) {
    if room < POPULATE_FROM {
        return;
    }
    let page = crate::symbols::maps::page_size() as usize;
    let spare = buffer.spare_capacity_mut();
    let start = spare.as_ptr() as usize;
    let (from, to) = (
        start.next_multiple_of(page),
        (start + room.min(spare.len())) / page * page,
    );
    if to > from {
        // SAFETY: advice on whole pages inside the buffer's own allocation,
        // past what it holds; populating changes no contents.
        unsafe {
            libc::madvise(
                from as *mut libc::c_void,
                to - from,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
}

/// Bytes of a [`padded_varint`]: up to 32 GiB.
pub(super) const PADDED_VARINT_BYTES: usize = 5;

/// Room for a line's length.
const LINE_LENGTH_ROOM: usize = PADDED_VARINT_BYTES;

/// Lines of this many bytes or more keep their length padded to
/// [`LINE_LENGTH_ROOM`] bytes rather than being moved onto a shorter one.
pub(super) const PADDED_LINE_LENGTH_FROM: usize = 64 * 1024;

/// `v` (below 2^35) as a varint of exactly five bytes, padded with
/// continuation bits: protobuf parsers read it as they read the shortest
/// form, and room for it can be kept before knowing how long that is.
pub(super) fn padded_varint(v: u64) -> [u8; PADDED_VARINT_BYTES] {
    debug_assert!(v < 1 << (7 * PADDED_VARINT_BYTES));
    let mut out = [0u8; PADDED_VARINT_BYTES];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = ((v >> (7 * i)) & 0x7f) as u8;
        if i + 1 < PADDED_VARINT_BYTES {
            *byte |= 0x80;
        }
    }
    out
}
