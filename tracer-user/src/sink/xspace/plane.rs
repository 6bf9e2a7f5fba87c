//! `XPlaneBuilder`: one `XPlane`, encoded as it is built, and
//! `PlaneStream`, which writes a plane out line by line.
//!
//! Event and stat metadata are numbered from 1, like TSL's `XPlaneBuilder`,
//! and interned by name; string stat values are interned too and written as
//! `ref_value`, as TSL does. Lines are encoded straight into the plane's
//! bytes (see [`super::wire`]): [`XPlaneBuilder::write_line`] takes events
//! already in order and holds nothing per event; for sources not in order,
//! [`XPlaneBuilder::push_event`] queues events in a compact form and
//! [`XPlaneBuilder::finish_line`] sorts and writes them. An event costs no
//! allocation, and a line's bytes are what prost would write for the same
//! `XLine` (a test checks).

use ebtrace_proto::tensorflow::profiler::{XEventMetadata, XPlane, XStatMetadata};
use prost::{
    Message as _,
    encoding::{WireType, encode_key, encode_varint},
};
use rustc_hash::FxHashMap;
use std::{
    io::{self, Seek, SeekFrom, Write},
    sync::Arc,
};

use crate::timeline;

use super::{
    StatValue,
    wire::{
        Encoded, EventStats, LineEvent, LineOut, PADDED_VARINT_BYTES, SpillingLine, Stat,
        encode_line, encode_stat_fields, padded_varint,
    },
};

/// An event of the line being built; its stats are the group `shared`,
/// then `stats[stats_start..stats_start + stats_len]` of the builder.
#[derive(Clone, Copy, Debug)]
struct QueuedEvent {
    offset_ps: i64,
    duration_ps: i64,
    metadata_id: i64,
    stats_start: u32,
    stats_len: u32,
    shared: SharedStats,
}

impl QueuedEvent {
    fn as_line_event<'a>(&self, all: &'a [Stat], shared: &'a SharedGroups) -> LineEvent<'a> {
        LineEvent {
            metadata_id: self.metadata_id,
            offset_ps: self.offset_ps,
            duration_ps: self.duration_ps,
            stats: EventStats::Shared {
                encoded: shared.encoded(self.shared),
                own: &all[self.stats_start as usize..][..self.stats_len as usize],
            },
        }
    }
}

/// A group of stats many spans share, encoded in a plane's
/// [`SharedGroups`]; the default is no stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedStats {
    start: u32,
    len: u32,
}

/// The stat groups a plane's spans share (the shared part of a
/// [`timeline::Stats`]), each encoded once, when first met: a kernel's
/// launches share a dozen stats, and encoding them again for every launch
/// took most of a driver call's share of a snapshot.
#[derive(Default)]
pub struct SharedGroups {
    /// By the address of the group's stats, which the timeline being
    /// written keeps alive (and so distinct) while the plane is built.
    ranges: FxHashMap<usize, SharedStats>,
    bytes: Vec<u8>,
}

impl SharedGroups {
    /// The group's encoded stat fields.
    pub fn encoded(&self, group: SharedStats) -> &[u8] {
        &self.bytes[group.start as usize..][..group.len as usize]
    }
}

/// Builds one `XPlane`, interning event and stat names and encoding each line as it is written.
pub struct XPlaneBuilder {
    /// Id, name, metadata and plane stats; the lines are in `lines`.
    plane: XPlane,
    events_by_name: FxHashMap<String, i64>,
    /// [`Self::events_by_name`] by the address of a span's shared name,
    /// which the timeline being written keeps alive (and so distinct)
    /// while the plane is built: a kernel's name of a few hundred bytes is
    /// hashed once, not at each of its launches.
    events_by_span_name: FxHashMap<usize, i64>,
    stats_by_name: FxHashMap<String, i64>,
    /// The id of [`timeline::CORRELATION_STAT`], once a span had one.
    correlation_stat: Option<i64>,
    /// [`FIELD_ROOM`] bytes kept for the plane's own key and length, then
    /// the encoded `lines` fields (field 3), in order.
    lines: Vec<u8>,
    /// The line being built.
    queued: Vec<QueuedEvent>,
    stats: Vec<Stat>,
    shared: SharedGroups,
}

impl XPlaneBuilder {
    /// An empty plane with this id and name.
    pub fn new(id: i64, name: &str) -> Self {
        XPlaneBuilder {
            plane: XPlane {
                id,
                name: name.to_string(),
                ..Default::default()
            },
            events_by_name: FxHashMap::default(),
            events_by_span_name: FxHashMap::default(),
            stats_by_name: FxHashMap::default(),
            correlation_stat: None,
            lines: vec![0; FIELD_ROOM],
            queued: Vec::new(),
            stats: Vec::new(),
            shared: SharedGroups::default(),
        }
    }

    /// The id of the event metadata named `name`, created if new.
    pub fn event_metadata(&mut self, name: &str) -> i64 {
        if let Some(&id) = self.events_by_name.get(name) {
            return id;
        }
        let id = self.events_by_name.len() as i64 + 1;
        self.plane.event_metadata.insert(
            id,
            XEventMetadata {
                id,
                name: name.to_string(),
                ..Default::default()
            },
        );
        self.events_by_name.insert(name.to_string(), id);
        id
    }

    /// [`Self::event_metadata`] of a span's name.
    pub fn span_metadata(&mut self, name: &Arc<str>) -> i64 {
        let key = Arc::as_ptr(name).cast::<u8>() as usize;
        if let Some(&id) = self.events_by_span_name.get(&key) {
            return id;
        }
        let id = self.event_metadata(name);
        self.events_by_span_name.insert(key, id);
        id
    }

    /// The id of the stat metadata named `name` (a stat's name, or a string
    /// value referred to by `ref_value`), created if new.
    pub fn stat_metadata(&mut self, name: &str) -> i64 {
        if let Some(&id) = self.stats_by_name.get(name) {
            return id;
        }
        let id = self.stats_by_name.len() as i64 + 1;
        self.plane.stat_metadata.insert(
            id,
            XStatMetadata {
                id,
                name: name.to_string(),
                ..Default::default()
            },
        );
        self.stats_by_name.insert(name.to_string(), id);
        id
    }

    /// A stat named `name` with a timeline value (strings interned).
    pub fn stat(&mut self, name: &str, value: &StatValue) -> Stat {
        let value = match value {
            StatValue::I64(v) => Encoded::I64(*v),
            StatValue::U64(v) => Encoded::U64(*v),
            StatValue::F64(v) => Encoded::F64(*v),
            StatValue::Str(s) => Encoded::Ref(self.stat_metadata(s) as u64),
            StatValue::Flow(id, end) => Encoded::U64(super::flow_stat_value(
                *id,
                match end {
                    timeline::FlowEnd::From => super::FlowDirection::Out,
                    timeline::FlowEnd::To => super::FlowDirection::In,
                },
            )),
        };
        Stat::new(self.stat_metadata(name), value)
    }

    /// Interns `span`'s stats: their shared group (encoded the first time
    /// it is met), returned, and their own, appended to `own`, then its
    /// correlation id.
    pub fn span_stats(&mut self, span: &timeline::Span, own: &mut Vec<Stat>) -> SharedStats {
        let stats = &span.stats;
        let group = match stats.shared() {
            Some(group) if !group.is_empty() => {
                let key = group.as_ptr() as usize;
                match self.shared.ranges.get(&key) {
                    Some(&range) => range,
                    None => {
                        let interned: Vec<Stat> =
                            group.iter().map(|(k, v)| self.stat(k, v)).collect();
                        let start = self.shared.bytes.len();
                        encode_stat_fields(&interned, &mut self.shared.bytes);
                        let range = SharedStats {
                            start: u32::try_from(start).expect("under 4 GB of shared stats"),
                            len: (self.shared.bytes.len() - start) as u32,
                        };
                        self.shared.ranges.insert(key, range);
                        range
                    }
                }
            }
            _ => SharedStats::default(),
        };
        for (k, v) in stats.own() {
            let stat = self.stat(k, v);
            own.push(stat);
        }
        if let Some(id) = span.correlation {
            let name = match self.correlation_stat {
                Some(name) => name,
                None => {
                    let name = self.stat_metadata(timeline::CORRELATION_STAT);
                    self.correlation_stat = Some(name);
                    name
                }
            };
            own.push(Stat::u64(name, id.get()));
        }
        group
    }

    /// The groups [`span_stats`](Self::span_stats) encoded.
    pub fn shared_groups(&self) -> &SharedGroups {
        &self.shared
    }

    /// Adds a stat to the plane itself.
    pub fn add_plane_stat(&mut self, name: &str, value: &StatValue) {
        let stat = self.stat(name, value).as_proto();
        self.plane.stats.push(stat);
    }

    /// Room for `events` more events with `stats` stats in all on the line
    /// being built, and no more: a GPU stream's line of tens of thousands
    /// of launches would otherwise grow by doubling, up to twice what it
    /// holds, and copy itself each time.
    pub fn reserve_exact(&mut self, events: usize, stats: usize) {
        self.queued.reserve_exact(events);
        self.stats.reserve_exact(stats);
    }

    /// Queues an event on the line being built.
    pub fn push_event(
        &mut self,
        metadata_id: i64,
        offset_ps: i64,
        duration_ps: i64,
        stats: &[Stat],
    ) {
        let stats_start = u32::try_from(self.stats.len()).expect("under 4G stats per line");
        self.stats.extend_from_slice(stats);
        self.queued.push(QueuedEvent {
            offset_ps,
            duration_ps,
            metadata_id,
            stats_start,
            stats_len: stats.len() as u32,
            shared: SharedStats::default(),
        });
    }

    /// Queues an event with `span`'s stats (see
    /// [`span_stats`](Self::span_stats)) on the line being built.
    pub fn push_span_event(
        &mut self,
        metadata_id: i64,
        offset_ps: i64,
        duration_ps: i64,
        span: &timeline::Span,
    ) {
        let stats_start = u32::try_from(self.stats.len()).expect("under 4G stats per line");
        let mut own = std::mem::take(&mut self.stats);
        let shared = self.span_stats(span, &mut own);
        self.stats = own;
        self.queued.push(QueuedEvent {
            offset_ps,
            duration_ps,
            metadata_id,
            stats_start,
            stats_len: self.stats.len() as u32 - stats_start,
            shared,
        });
    }

    /// Ends the line being built (with [`push_event`](Self::push_event)):
    /// its events, sorted so that parents precede children, are written as
    /// line `id`.
    pub fn finish_line(&mut self, id: i64, name: &str, display_name: &str) {
        let mut lines = std::mem::take(&mut self.lines);
        self.finish_line_into(&mut LineOut::Buffer(&mut lines), id, name, display_name);
        self.lines = lines;
    }

    /// [`finish_line`](Self::finish_line), the line encoded into `out`
    /// (a [`PlaneStream::line`]'s): a GPU stream's line of tens of
    /// thousands of launches is then never in two buffers at once.
    pub fn finish_line_into(
        &mut self,
        out: &mut LineOut<'_>,
        id: i64,
        name: &str,
        display_name: &str,
    ) {
        let mut queued = std::mem::take(&mut self.queued);
        let mut stats = std::mem::take(&mut self.stats);
        // Stable: equal events keep the order they were queued in.
        queued.sort_by_key(|e| (e.offset_ps, std::cmp::Reverse(e.duration_ps)));
        encode_line(
            out,
            id,
            name,
            display_name,
            queued.iter().map(|e| e.as_line_event(&stats, &self.shared)),
        );
        queued.clear();
        stats.clear();
        self.queued = queued;
        self.stats = stats;
    }

    /// Writes line `id` with `events`, which must come sorted by
    /// [`LineEvent::order_key`] (parents before children): see
    /// [`encode_line`].
    pub fn write_line<'a>(
        &mut self,
        id: i64,
        name: &str,
        display_name: &str,
        events: impl IntoIterator<Item = LineEvent<'a>>,
    ) {
        encode_line(
            &mut LineOut::Buffer(&mut self.lines),
            id,
            name,
            display_name,
            events,
        );
    }

    /// The plane encoded as field `field` of the enclosing message.
    ///
    /// Protobuf allows a message's fields in any order, so the plane's id,
    /// name, metadata and stats follow its lines, and the key and length go
    /// in the room kept before them: the lines are never copied into
    /// another buffer (only moved down by the few bytes left over).
    pub fn into_field(self, field: u32) -> Vec<u8> {
        let mut out = self.lines;
        self.plane.encode(&mut out).expect("a Vec grows as needed");
        let len = out.len() - FIELD_ROOM;
        let mut key_and_len = Vec::with_capacity(FIELD_ROOM);
        encode_key(field, WireType::LengthDelimited, &mut key_and_len);
        encode_varint(len as u64, &mut key_and_len);
        let from = FIELD_ROOM - key_and_len.len();
        out[from..FIELD_ROOM].copy_from_slice(&key_and_len);
        out.drain(..from);
        out
    }
}

/// Room for a field's key (up to 5 bytes) and a length (up to 10).
const FIELD_ROOM: usize = 15;

/// Bytes of the length of a [`PlaneStream`]'s plane.
const PLANE_LENGTH_BYTES: usize = PADDED_VARINT_BYTES;

/// A plane written into `out` as a field of the enclosing message while it
/// is built: its lines go out as they are finished, so that only the line
/// being built is held. The plane's length is known at its end: it is
/// written then, in the [`PLANE_LENGTH_BYTES`] kept for it before the lines
/// (a varint padded with continuation bytes, which protobuf parsers take
/// as they take any).
pub struct PlaneStream<'w, W: PlaneOut> {
    out: &'w mut W,
    /// Where the length goes.
    length_at: u64,
    /// What a line holds before it is written out, when the output is not
    /// a buffer to encode it in.
    spare: Vec<u8>,
}

/// Where planes are streamed: a seekable writer. One that appends to a
/// buffer in memory lends it, so that lines are encoded in place rather
/// than encoded apart and copied (tens of MB for a large answer).
pub trait PlaneOut: Write + Seek {
    /// The buffer writes append to, if they append to one now.
    fn buffer(&mut self) -> Option<&mut Vec<u8>> {
        None
    }

    /// Told after each part of the trace (a plane, named `what`) is
    /// written whole: a trace cut there still decodes.
    fn part_done(&mut self, what: &str) -> io::Result<()> {
        let _ = what;
        Ok(())
    }
}

impl PlaneOut for io::Cursor<Vec<u8>> {
    fn buffer(&mut self) -> Option<&mut Vec<u8>> {
        let at_end = self.position() == self.get_ref().len() as u64;
        at_end.then(|| self.get_mut())
    }
}

impl PlaneOut for io::BufWriter<std::fs::File> {}

impl<'w, W: PlaneOut> PlaneStream<'w, W> {
    /// Starts a plane as field `field` of the message being written to `out`.
    pub fn begin(out: &'w mut W, field: u32) -> io::Result<Self> {
        let mut key = Vec::with_capacity(5);
        encode_key(field, WireType::LengthDelimited, &mut key);
        out.write_all(&key)?;
        let length_at = out.stream_position()?;
        out.write_all(&[0; PLANE_LENGTH_BYTES])?;
        Ok(PlaneStream {
            out,
            length_at,
            spare: Vec::new(),
        })
    }

    /// Writes out the line `encode` encodes (with [`encode_line`]) into
    /// what it is given: the output's own buffer where it lends it, or
    /// else a buffer written out as it fills (a file's).
    pub fn line(&mut self, encode: impl FnOnce(&mut LineOut<'_>)) -> io::Result<()> {
        if let Some(buffer) = self.out.buffer() {
            encode(&mut LineOut::Buffer(buffer));
            // The line was appended past the writer's position.
            self.out.seek(SeekFrom::End(0))?;
            return Ok(());
        }
        let mut out = LineOut::File(SpillingLine::new(&mut *self.out, &mut self.spare)?);
        encode(&mut out);
        match out {
            LineOut::File(line) => line.finish(),
            LineOut::Buffer(_) => unreachable!("the line stays a file's"),
        }
    }

    /// Writes the lines `plane` finished since the last call.
    pub fn flush(&mut self, plane: &mut XPlaneBuilder) -> io::Result<()> {
        self.out.write_all(&plane.lines[FIELD_ROOM..])?;
        plane.lines.truncate(FIELD_ROOM);
        Ok(())
    }

    /// Writes the rest of `plane` (its lines, then its id, name, metadata
    /// and stats) and its length.
    pub fn end(mut self, mut plane: XPlaneBuilder) -> io::Result<()> {
        self.flush(&mut plane)?;
        self.out.write_all(&plane.plane.encode_to_vec())?;
        let end = self.out.stream_position()?;
        let length = end - self.length_at - PLANE_LENGTH_BYTES as u64;
        if length >= 1 << (7 * PLANE_LENGTH_BYTES) {
            return Err(io::Error::other("a plane of 32 GiB or more"));
        }
        self.out.seek(SeekFrom::Start(self.length_at))?;
        self.out.write_all(&padded_varint(length))?;
        self.out.seek(SeekFrom::Start(end))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use ebtrace_proto::tensorflow::profiler::{XEvent, XLine, XSpace, x_event};

    use super::*;
    use crate::sink::xspace::wire::{
        PADDED_LINE_LENGTH_FROM, SPILL_BYTES as SPILL_BYTES_FOR_TESTS,
    };

    /// Line `id` with `events`, as prost encodes it as a plane's field.
    fn prost_line(id: i64, name: &str, display_name: &str, events: Vec<XEvent>) -> Vec<u8> {
        let mut out = Vec::new();
        let line = XLine {
            id,
            name: name.into(),
            display_name: display_name.into(),
            events,
            ..Default::default()
        };
        prost::encoding::message::encode(3, &line, &mut out);
        out
    }

    /// The hand-written encoding is byte for byte prost's.
    #[test]
    fn lines_encode_as_prost_does() {
        let mut b = XPlaneBuilder::new(0, "p");
        let running = b.event_metadata("Running");
        let step = b.event_metadata("step");
        let cpu = b.stat_metadata("cpu");
        let cause = b.stat("cause", &StatValue::Str("woken".into()));
        let stats_a = [Stat::i64(cpu, -3), cause, Stat::u64(cpu, u64::MAX)];
        let stats_b = [Stat::new(cpu, Encoded::F64(1.5)), Stat::i64(cpu, 0)];
        // More than 127 bytes: a two-byte length.
        let stats_c = [Stat::u64(cpu, u64::MAX); 10];
        // As many stats as are encoded in place, and still a two-byte
        // length (negative ids and values take ten bytes each).
        let stats_d = [Stat::i64(-1, i64::MIN); 4];
        // Queued out of order; sorted by start, longest first.
        b.push_event(-1, -1, -1, &stats_d);
        b.push_event(running, 500, 0, &stats_b);
        b.push_event(step, 900, -1, &stats_c);
        b.push_event(step, 0, 1_000, &[]);
        b.push_event(running, 0, 400, &stats_a);
        b.finish_line(42, "worker", "worker [42]");
        b.finish_line(7, "", "");

        let event = |metadata_id, offset, duration_ps, stats: &[Stat]| XEvent {
            metadata_id,
            duration_ps,
            stats: stats.iter().map(|s| s.as_proto()).collect(),
            data: Some(x_event::Data::OffsetPs(offset)),
        };
        let mut expected = prost_line(
            42,
            "worker",
            "worker [42]",
            vec![
                event(-1, -1, -1, &stats_d),
                event(step, 0, 1_000, &[]),
                event(running, 0, 400, &stats_a),
                event(running, 500, 0, &stats_b),
                event(step, 900, -1, &stats_c),
            ],
        );
        expected.extend(prost_line(7, "", "", vec![]));
        assert_eq!(b.lines[FIELD_ROOM..], expected);

        // As a plane of an XSpace, lines first.
        b.add_plane_stat("note", &StatValue::Str("hello".into()));
        let space = XSpace::decode(b.into_field(1).as_slice()).unwrap();
        let plane = &space.planes[0];
        assert_eq!((plane.id, plane.name.as_str()), (0, "p"));
        assert_eq!(plane.lines.len(), 2);
        assert_eq!(plane.lines[0].events.len(), 5);
        assert_eq!(plane.stats.len(), 1);
        assert_eq!(plane.event_metadata.len(), 2);
    }

    /// Spans sharing a group of stats: the group is encoded once, and each
    /// event reads as prost writes it with all its stats, short or long.
    #[test]
    fn shared_stat_groups_encode_as_prost_does() {
        use std::sync::Arc;

        let mut b = XPlaneBuilder::new(0, "p");
        let launch = b.event_metadata("launch");
        let group: Arc<[timeline::Stat]> = vec![
            ("kernel".into(), StatValue::Str("a_kernel".into())),
            ("grid".into(), StatValue::U64(7)),
        ]
        .into();
        let many: Arc<[timeline::Stat]> = (0..12)
            .map(|i| (format!("s{i}").into(), StatValue::I64(i64::MIN + i)))
            .collect();
        let own = |n: u64| vec![("n".into(), StatValue::U64(n))];
        let span = |stats, correlation| timeline::Span {
            start_ns: 0,
            end_ns: 0,
            name: "launch".into(),
            stats,
            correlation: std::num::NonZeroU64::new(correlation),
        };
        let spans = [
            span(timeline::Stats::shared_then(group.clone(), own(1)), 1),
            span(timeline::Stats::shared_then(many.clone(), own(2)), 0),
            span(timeline::Stats::shared_then(group.clone(), vec![]), 3),
            span(timeline::Stats::from(own(4)), 4),
            span(timeline::Stats::shared_then(many.clone(), vec![]), 0),
        ];
        for (i, span) in spans.iter().enumerate() {
            b.push_span_event(launch, i as i64 * 10, 5, span);
        }
        assert_eq!(b.shared_groups().ranges.len(), 2, "each group encoded once");
        b.finish_line(1, "stream", "stream");

        let mut reference = XPlaneBuilder::new(0, "p");
        let launch = reference.event_metadata("launch");
        let events: Vec<XEvent> =
            spans
                .iter()
                .enumerate()
                .map(|(i, span)| XEvent {
                    metadata_id: launch,
                    duration_ps: 5,
                    stats: span
                        .stats
                        .iter()
                        .cloned()
                        .chain(span.correlation.map(|id| {
                            (timeline::CORRELATION_STAT.into(), StatValue::U64(id.get()))
                        }))
                        .map(|(k, v)| reference.stat(&k, &v).as_proto())
                        .collect(),
                    data: Some(x_event::Data::OffsetPs(i as i64 * 10)),
                })
                .collect();
        assert!(events[1].encoded_len() > 127, "a two-byte length");
        assert_eq!(
            b.lines[FIELD_ROOM..],
            prost_line(1, "stream", "stream", events)
        );
    }

    /// A line too large to be moved onto its shortest length reads as
    /// prost's encoding of it reads.
    #[test]
    fn a_large_line_decodes_as_prost_encodes_it() {
        let mut b = XPlaneBuilder::new(0, "p");
        let running = b.event_metadata("Running");
        let cpu = b.stat_metadata("cpu");
        let events: Vec<XEvent> = (0..10_000)
            .map(|i| XEvent {
                metadata_id: running,
                duration_ps: 7,
                stats: vec![Stat::i64(cpu, i % 3).as_proto()],
                data: Some(x_event::Data::OffsetPs(i * 10)),
            })
            .collect();
        for e in &events {
            let Some(x_event::Data::OffsetPs(offset)) = e.data else {
                unreachable!()
            };
            b.push_event(
                running,
                offset,
                e.duration_ps,
                &[Stat::i64(cpu, (offset / 10) % 3)],
            );
        }
        b.finish_line(9, "big", "big [9]");
        assert!(b.lines.len() > FIELD_ROOM + PADDED_LINE_LENGTH_FROM);
        let expected = XLine {
            id: 9,
            name: "big".into(),
            display_name: "big [9]".into(),
            events,
            ..Default::default()
        };
        let space = XSpace::decode(b.into_field(1).as_slice()).unwrap();
        assert_eq!(space.planes[0].lines, [expected]);
    }

    /// A plane streamed line by line decodes as the same plane built whole,
    /// and the message goes on after it; lines encoded straight into the
    /// output read as those encoded in the plane's own buffer.
    #[test]
    fn a_streamed_plane_reads_as_one_built_whole() {
        let build = |stream: Option<&mut PlaneStream<'_, std::io::Cursor<Vec<u8>>>>| {
            let mut b = XPlaneBuilder::new(3, "p");
            let id = b.event_metadata("step");
            b.add_plane_stat("note", &StatValue::Str("hello".into()));
            let mut stream = stream;
            for line in 0..300 {
                for i in 0..line {
                    b.push_event(id, i * 10, 5, &[Stat::i64(id, i)]);
                }
                let name = format!("line {line}");
                match stream.as_deref_mut() {
                    // Encoded straight into the output, or in the plane's
                    // buffer and then written out.
                    Some(s) if line % 2 == 1 => s
                        .line(|out| b.finish_line_into(out, line, &name, ""))
                        .unwrap(),
                    Some(s) => {
                        b.finish_line(line, &name, "");
                        s.flush(&mut b).unwrap();
                    }
                    None => b.finish_line(line, &name, ""),
                }
            }
            b
        };
        let whole = XSpace::decode(build(None).into_field(1).as_slice()).unwrap();

        let mut out = std::io::Cursor::new(Vec::new());
        let mut stream = PlaneStream::begin(&mut out, 1).unwrap();
        let plane = build(Some(&mut stream));
        stream.end(plane).unwrap();
        XSpace {
            hostnames: vec!["h".into()],
            ..Default::default()
        }
        .encode(&mut out.get_mut())
        .unwrap();
        let streamed = XSpace::decode(out.get_ref().as_slice()).unwrap();
        assert_eq!(streamed.planes, whole.planes);
        assert_eq!(streamed.planes[0].lines.len(), 300);
        assert_eq!(streamed.hostnames, ["h"]);
    }

    /// An output that does not lend its buffer, as a file does not.
    struct FileLike(std::io::Cursor<Vec<u8>>);

    impl Write for FileLike {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Seek for FileLike {
        fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
            self.0.seek(pos)
        }
    }

    impl PlaneOut for FileLike {}

    /// Lines written out as they are encoded (a file's, a line of several
    /// MiB among small ones) read as the same lines encoded in memory.
    #[test]
    fn lines_written_out_as_they_fill_read_as_lines_built_in_memory() {
        fn write<W: PlaneOut>(out: &mut W) {
            let mut b = XPlaneBuilder::new(1, "p");
            let id = b.event_metadata("Running");
            let mut stream = PlaneStream::begin(out, 1).unwrap();
            for (line, events) in [(1, 3), (2, 200_000), (3, 0), (4, 2_000)] {
                let events = (0..events).map(|i| LineEvent {
                    metadata_id: id,
                    offset_ps: i * 1_000,
                    duration_ps: 500,
                    stats: EventStats::inline([Stat::i64(id, i)]),
                });
                let name = format!("line {line}");
                stream
                    .line(|out| encode_line(out, line, &name, "", events))
                    .unwrap();
            }
            stream.end(b).unwrap();
        }
        let mut in_memory = std::io::Cursor::new(Vec::new());
        write(&mut in_memory);
        let mut file = FileLike(std::io::Cursor::new(Vec::new()));
        write(&mut file);
        let bytes = file.0.into_inner();
        assert!(
            bytes.len() > 2 * SPILL_BYTES_FOR_TESTS,
            "{} bytes",
            bytes.len()
        );
        let (a, b) = (
            XSpace::decode(in_memory.get_ref().as_slice()).unwrap(),
            XSpace::decode(bytes.as_slice()).unwrap(),
        );
        assert_eq!(a.planes, b.planes);
        let lines: Vec<usize> = b.planes[0].lines.iter().map(|l| l.events.len()).collect();
        assert_eq!(lines, [3, 200_000, 0, 2_000]);
        assert_eq!(b.planes[0].lines[1].events[199_999].duration_ps, 500);
    }
}
