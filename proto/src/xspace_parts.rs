//! An encoded XSpace read a part at a time: its planes as bytes, a plane's
//! name and metadata without its lines, a line's header without its
//! events, and the events one by one. A framework's session can hold
//! millions of events; decoding them all into messages at once would take
//! several times the memory of the bytes.
//!
//! The bytes may come from anywhere: every length is checked, and a
//! malformed part is a [`PartError`], never a panic.

use prost::{
    Message as _,
    encoding::{decode_key, decode_varint},
};

use crate::tensorflow::profiler::{XEvent, XEventMetadata, XLine, XPlane, XStat, XStatMetadata};

/// Why a part could not be read.
#[derive(Debug)]
pub enum PartError {
    /// A message did not decode.
    Decode(prost::DecodeError),
    /// The fields around it are malformed: this says how.
    Malformed(&'static str),
}

impl std::fmt::Display for PartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PartError::Decode(e) => e.fmt(f),
            PartError::Malformed(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for PartError {}

impl From<prost::DecodeError> for PartError {
    fn from(e: prost::DecodeError) -> Self {
        PartError::Decode(e)
    }
}

const XSPACE_PLANES: u32 = 1;
const XPLANE_NAME: u32 = 2;
const XPLANE_LINES: u32 = 3;
const XPLANE_EVENT_METADATA: u32 = 4;
const XPLANE_STAT_METADATA: u32 = 5;
const XPLANE_STATS: u32 = 6;
const XLINE_EVENTS: u32 = 4;
const XEVENT_STATS: u32 = 4;
const MAP_ENTRY_VALUE: u32 = 2;
const XEVENT_METADATA_STATS: u32 = 5;
const XEVENT_METADATA_CHILD_IDS: u32 = 6;

/// One field of a message: its number and its encoded bytes, key included
/// (`whole`), and for a length-delimited one its payload.
struct Field<'a> {
    number: u32,
    whole: &'a [u8],
    payload: Option<&'a [u8]>,
}

/// The fields of the message encoded in `bytes`, in the order written.
fn fields(bytes: &[u8]) -> impl Iterator<Item = Result<Field<'_>, PartError>> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let field = next_field(&mut rest);
        if field.is_err() {
            rest = &[];
        }
        Some(field)
    })
}

fn next_field<'a>(rest: &mut &'a [u8]) -> Result<Field<'a>, PartError> {
    let start = *rest;
    let mut buf = *rest;
    let (number, wire_type) = decode_key(&mut buf)?;
    let mut payload = None;
    let len = match wire_type as u8 {
        // Varint
        0 => {
            decode_varint(&mut buf)?;
            0
        }
        // 64-bit
        1 => 8,
        // Length-delimited
        2 => {
            let len = usize::try_from(decode_varint(&mut buf)?)
                .map_err(|_| PartError::Malformed("field length overflows"))?;
            if len > buf.len() {
                return Err(PartError::Malformed(
                    "field runs past the end of its message",
                ));
            }
            payload = Some(&buf[..len]);
            len
        }
        // 32-bit
        5 => 4,
        _ => {
            return Err(PartError::Malformed(
                "group fields are not part of an XSpace",
            ));
        }
    };
    if len > buf.len() {
        return Err(PartError::Malformed(
            "field runs past the end of its message",
        ));
    }
    buf = &buf[len..];
    let used = start.len() - buf.len();
    *rest = buf;
    Ok(Field {
        number,
        whole: &start[..used],
        payload,
    })
}

/// The payloads of the length-delimited fields numbered `number`.
fn payloads(bytes: &[u8], number: u32) -> impl Iterator<Item = Result<&[u8], PartError>> {
    fields(bytes).filter_map(move |f| match f {
        Ok(f) if f.number == number => Some(f.payload.ok_or(PartError::Malformed(
            "a message field is not length-delimited",
        ))),
        Ok(_) => None,
        Err(e) => Some(Err(e)),
    })
}

/// The message in `bytes` with the fields numbered `left_out` left out.
fn without(bytes: &[u8], left_out: u32) -> Result<Vec<u8>, PartError> {
    let mut kept = Vec::new();
    for f in fields(bytes) {
        let f = f?;
        if f.number != left_out {
            kept.extend_from_slice(f.whole);
        }
    }
    Ok(kept)
}

/// The encoded planes of the XSpace in `space`.
pub fn planes(space: &[u8]) -> impl Iterator<Item = Result<&[u8], PartError>> {
    payloads(space, XSPACE_PLANES)
}

/// The name of the plane encoded in `plane` (the last one written, as a
/// decoder takes it).
pub fn plane_name(plane: &[u8]) -> Result<String, PartError> {
    let mut name = Vec::new();
    for p in payloads(plane, XPLANE_NAME) {
        name = p?.to_vec();
    }
    String::from_utf8(name).map_err(|_| PartError::Malformed("a plane name is not UTF-8"))
}

/// The encoded lines of the plane in `plane`.
pub fn lines(plane: &[u8]) -> impl Iterator<Item = Result<&[u8], PartError>> {
    payloads(plane, XPLANE_LINES)
}

/// The plane in `plane` without its lines (its id, name, metadata and
/// stats), and its lines, encoded.
pub fn plane_without_lines(plane: &[u8]) -> Result<(XPlane, Vec<&[u8]>), PartError> {
    let head = XPlane::decode(without(plane, XPLANE_LINES)?.as_slice())?;
    Ok((head, lines(plane).collect::<Result<_, _>>()?))
}

/// The line in `line` without its events, how many events it has, and an
/// iterator that decodes them one at a time.
pub fn line_without_events(
    line: &[u8],
) -> Result<
    (
        XLine,
        usize,
        impl Iterator<Item = Result<XEvent, PartError>>,
    ),
    PartError,
> {
    let head = XLine::decode(without(line, XLINE_EVENTS)?.as_slice())?;
    let count = payloads(line, XLINE_EVENTS).try_fold(0, |n, e| e.map(|_| n + 1))?;
    let events = payloads(line, XLINE_EVENTS).map(|e| Ok(XEvent::decode(e?)?));
    Ok((head, count, events))
}

/// How many events a line holds, and how many stats those events hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LineShape {
    /// Its events.
    pub events: usize,
    /// Their stats, all together.
    pub stats: usize,
}

/// The [`LineShape`] of the line encoded in `line`, read without decoding
/// its events.
pub fn line_shape(line: &[u8]) -> Result<LineShape, PartError> {
    let mut shape = LineShape::default();
    for event in payloads(line, XLINE_EVENTS) {
        shape.events += 1;
        shape.stats += count(event?, XEVENT_STATS);
    }
    Ok(shape)
}

/// At most how much memory the plane encoded in `plane` takes once
/// decoded into an [`XPlane`], in bytes, read without decoding it:
/// [`decoded_head_bytes`] and [`decoded_line_bytes`] of each of its lines.
/// Two bytes of an empty event decode into `size_of::<XEvent>()`: what a
/// target sends is bounded by this before it is decoded.
pub fn decoded_plane_bytes(plane: &[u8]) -> Result<usize, PartError> {
    let mut bytes = decoded_head_bytes(plane)?;
    for line in lines(plane) {
        bytes += decoded_line_bytes(line?)?;
    }
    Ok(bytes)
}

/// At most how much memory the plane encoded in `plane`, its lines left
/// out ([`plane_without_lines`]), takes decoded: the room of each message
/// it holds, twice over (vectors and maps grow by doubling), and its own
/// bytes (every string), a packed child id taking 8 where it took 1.
pub fn decoded_head_bytes(plane: &[u8]) -> Result<usize, PartError> {
    let mut rooms = size_of::<XPlane>();
    let mut own = 0;
    let mut packed = 0;
    for f in fields(plane) {
        let f = f?;
        if f.number == XPLANE_LINES {
            continue;
        }
        own += f.whole.len();
        let Some(payload) = f.payload else { continue };
        match f.number {
            XPLANE_EVENT_METADATA => {
                rooms += size_of::<(i64, XEventMetadata)>() + 1;
                for metadata in payloads(payload, MAP_ENTRY_VALUE) {
                    for m in fields(metadata?) {
                        let m = m?;
                        match m.number {
                            XEVENT_METADATA_STATS => rooms += size_of::<XStat>(),
                            XEVENT_METADATA_CHILD_IDS => packed += m.whole.len(),
                            _ => {}
                        }
                    }
                }
            }
            XPLANE_STAT_METADATA => rooms += size_of::<(i64, XStatMetadata)>() + 1,
            XPLANE_STATS => rooms += size_of::<XStat>(),
            _ => {}
        }
    }
    Ok(2 * rooms + own + 8 * packed)
}

/// At most how much memory the line encoded in `line` takes decoded into
/// an [`XLine`] (as [`decoded_head_bytes`] counts).
pub fn decoded_line_bytes(line: &[u8]) -> Result<usize, PartError> {
    let shape = line_shape(line)?;
    let rooms =
        size_of::<XLine>() + shape.events * size_of::<XEvent>() + shape.stats * size_of::<XStat>();
    Ok(2 * rooms + line.len())
}

/// How many fields numbered `number` the message in `bytes` has, up to
/// the first malformed one (which fails when the message is decoded).
fn count(bytes: &[u8], number: u32) -> usize {
    fields(bytes)
        .map_while(Result::ok)
        .filter(|f| f.number == number)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensorflow::profiler::{XEventMetadata, XSpace, XStat, x_event, x_stat};

    fn space() -> XSpace {
        let event = |at: i64, stat: u64| XEvent {
            metadata_id: 1,
            data: Some(x_event::Data::OffsetPs(at)),
            duration_ps: 5,
            stats: vec![XStat {
                metadata_id: 2,
                value: Some(x_stat::Value::Uint64Value(stat)),
            }],
        };
        let mut host = XPlane {
            id: 3,
            name: "/host:CPU".into(),
            ..Default::default()
        };
        host.event_metadata.insert(
            1,
            XEventMetadata {
                id: 1,
                name: "step".into(),
                ..Default::default()
            },
        );
        for id in 0..3 {
            host.lines.push(XLine {
                id,
                name: format!("thread {id}"),
                timestamp_ns: 100 * id,
                duration_ps: 7,
                events: (0..4)
                    .map(|i| event(i * 10, (id * 10 + i) as u64))
                    .collect(),
                ..Default::default()
            });
        }
        XSpace {
            planes: vec![
                host,
                XPlane {
                    id: 9,
                    name: "Task Environment".into(),
                    ..Default::default()
                },
            ],
            hostnames: vec!["h".into()],
            ..Default::default()
        }
    }

    /// The parts read back make the space that was written.
    #[test]
    fn the_parts_make_the_whole() {
        let space = space();
        let bytes = space.encode_to_vec();
        let mut rebuilt = XSpace::decode(bytes.as_slice()).unwrap();
        rebuilt.planes.clear();
        for plane in planes(&bytes) {
            let plane = plane.unwrap();
            let (mut head, lines) = plane_without_lines(plane).unwrap();
            assert_eq!(plane_name(plane).unwrap(), head.name);
            assert!(head.lines.is_empty());
            for line in lines {
                let (mut line, count, events) = line_without_events(line).unwrap();
                assert!(line.events.is_empty());
                line.events = events.collect::<Result<_, _>>().unwrap();
                assert_eq!(line.events.len(), count);
                head.lines.push(line);
            }
            rebuilt.planes.push(head);
        }
        assert_eq!(rebuilt, space);
    }

    /// Cut short anywhere, or with a length past its end, it is an error
    /// and not a panic.
    #[test]
    fn truncated_or_lying_bytes_are_errors() {
        let bytes = space().encode_to_vec();
        for cut in 0..bytes.len() {
            let read = || -> Result<usize, PartError> {
                let mut n = 0;
                for plane in planes(&bytes[..cut]) {
                    let plane = plane?;
                    plane_name(plane)?;
                    for line in plane_without_lines(plane)?.1 {
                        for e in line_without_events(line)?.2 {
                            e?;
                            n += 1;
                        }
                    }
                }
                Ok(n)
            };
            // Whatever is read of a cut space is no more than the whole.
            assert!(read().map_or(true, |n| n <= 12), "cut at {cut}");
        }
        // A plane that says it is longer than the space.
        let lying = [0x0a, 0x7f, 0x12, 0x01, b'x'];
        assert!(planes(&lying).next().unwrap().is_err());
    }

    /// The estimate is no less than what decoding takes, and within a few
    /// times of it for events like a framework's.
    #[test]
    fn a_planes_decoded_size_is_bounded_before_decoding() {
        fn heap(plane: &XPlane) -> usize {
            let line = |l: &XLine| {
                size_of::<XLine>()
                    + l.name.len()
                    + l.events
                        .iter()
                        .map(|e| size_of::<XEvent>() + e.stats.len() * size_of::<XStat>())
                        .sum::<usize>()
            };
            size_of::<XPlane>() + plane.name.len() + plane.lines.iter().map(line).sum::<usize>()
        }
        let host = &space().planes[0];
        let bytes = host.encode_to_vec();
        let bound = decoded_plane_bytes(&bytes).unwrap();
        assert!(
            bound >= heap(host) && bound < 4 * heap(host) + bytes.len(),
            "{bound}"
        );
        assert_eq!(
            line_shape(&host.lines[0].encode_to_vec()).unwrap(),
            LineShape {
                events: 4,
                stats: 4
            }
        );
        // A million empty events: two bytes each on the wire.
        let empty = XPlane {
            lines: vec![XLine {
                events: vec![XEvent::default(); 1_000_000],
                ..Default::default()
            }],
            ..Default::default()
        };
        let bytes = empty.encode_to_vec();
        assert!(bytes.len() < 2_100_000);
        assert!(decoded_plane_bytes(&bytes).unwrap() >= 1_000_000 * size_of::<XEvent>());
        // Packed child ids: one byte each, eight decoded.
        let mut parent = XPlane::default();
        parent.event_metadata.insert(
            1,
            XEventMetadata {
                child_id: vec![1; 10_000],
                ..Default::default()
            },
        );
        let bytes = parent.encode_to_vec();
        assert!(decoded_plane_bytes(&bytes).unwrap() >= 80_000);
        // Malformed bytes are an error, as everywhere here.
        assert!(decoded_plane_bytes(&[0x1a, 0x7f]).is_err());
    }

    proptest::proptest! {
        /// Any bytes at all are read without a panic.
        #[test]
        fn any_bytes_are_read_without_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            for plane in planes(&bytes).flatten() {
                let _ = plane_name(plane);
                if let Ok((_, lines)) = plane_without_lines(plane) {
                    for line in lines {
                        if let Ok((_, _, events)) = line_without_events(line) {
                            events.for_each(drop);
                        }
                    }
                }
                let _ = decoded_plane_bytes(plane);
            }
        }
    }
}
