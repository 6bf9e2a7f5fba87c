//! An XSpace a server sent, written to a file as ebtrace writes its own
//! ([`super::file`]): a disk that fills up keeps the planes that fit,
//! whole, then the Task Environment, the server's warnings and host names,
//! and a warning that says what is missing. The XSpace is split at its
//! top-level fields as it arrived, never decoded whole.

use std::{fs::File, io};

use ebtrace_proto::tensorflow::profiler::XSpace;
use prost::{
    Message as _,
    bytes::Buf as _,
    encoding::{WireType, decode_key, decode_varint},
};

use super::{
    PlaneOut, TASK_ENV_PLANE,
    file::{Written, write_trace_file},
};

/// `XSpace.planes`, `XPlane.name`.
const PLANES: u32 = 1;
const PLANE_NAME: u32 = 2;

/// Writes the encoded XSpace `bytes` to `file`, at its start; where the
/// file can grow no further, keeps the planes written whole (see
/// [`write_trace_file`]). Bytes that are no XSpace are an error
/// (`InvalidData`) and nothing is written.
pub fn write_received_trace(file: &mut File, bytes: &[u8]) -> io::Result<Written> {
    let fields = top_level_fields(bytes)?;
    let (mut planes, rest): (Vec<_>, Vec<_>) = fields.into_iter().partition(|f| f.number == PLANES);
    let names = planes
        .iter()
        .map(|p| plane_name(p.payload))
        .collect::<io::Result<Vec<_>>>()?;
    // As ebtrace writes its own: the Task Environment closes the trace.
    let task_env = (names.last().map(String::as_str) == Some(TASK_ENV_PLANE))
        .then(|| planes.pop())
        .flatten();
    write_trace_file(
        file,
        |out| {
            for (plane, name) in planes.iter().zip(&names) {
                io::Write::write_all(out, plane.whole)?;
                out.part_done(name)?;
            }
            Ok(())
        },
        |more| {
            let mut closing: Vec<u8> = task_env
                .iter()
                .chain(&rest)
                .flat_map(|f| f.whole)
                .copied()
                .collect();
            XSpace {
                warnings: more.to_vec(),
                ..Default::default()
            }
            .encode(&mut closing)
            .expect("a Vec grows");
            closing
        },
    )
}

/// A field of an encoded message: its number, its bytes whole (key
/// included), and its payload where it is length-delimited.
struct Field<'a> {
    number: u32,
    whole: &'a [u8],
    payload: &'a [u8],
}

fn top_level_fields(bytes: &[u8]) -> io::Result<Vec<Field<'_>>> {
    let mut fields = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let (field, after) = next_field(rest)?;
        fields.push(field);
        rest = after;
    }
    Ok(fields)
}

/// The field at the start of `bytes`, and what follows it.
fn next_field(bytes: &[u8]) -> io::Result<(Field<'_>, &[u8])> {
    let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    let mut cursor = bytes;
    let (number, wire_type) = decode_key(&mut cursor).map_err(|e| invalid(e.to_string()))?;
    let skip = match wire_type {
        WireType::Varint => {
            decode_varint(&mut cursor).map_err(|e| invalid(e.to_string()))?;
            0
        }
        WireType::SixtyFourBit => 8,
        WireType::ThirtyTwoBit => 4,
        WireType::LengthDelimited => {
            decode_varint(&mut cursor).map_err(|e| invalid(e.to_string()))? as usize
        }
        WireType::StartGroup | WireType::EndGroup => {
            return Err(invalid(format!("field {number} is a group")));
        }
    };
    if cursor.remaining() < skip {
        return Err(invalid(format!("field {number} runs past the end")));
    }
    let payload_at = bytes.len() - cursor.len();
    let end = payload_at + skip;
    let payload = match wire_type {
        WireType::LengthDelimited => &bytes[payload_at..end],
        _ => &[][..],
    };
    let field = Field {
        number,
        whole: &bytes[..end],
        payload,
    };
    Ok((field, &bytes[end..]))
}

/// The name of the encoded XPlane `plane` (empty if it has none).
fn plane_name(plane: &[u8]) -> io::Result<String> {
    let mut rest = plane;
    let mut name = String::new();
    while !rest.is_empty() {
        let (field, after) = next_field(rest)?;
        if field.number == PLANE_NAME {
            name = String::from_utf8_lossy(field.payload).into_owned();
        }
        rest = after;
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use ebtrace_proto::tensorflow::profiler::{XLine, XPlane};

    use super::super::file::tests::{read_back, tempfile};
    use super::*;

    fn space() -> XSpace {
        let plane = |name: &str, events: usize| XPlane {
            id: 3,
            name: name.into(),
            lines: vec![XLine {
                events: vec![Default::default(); events],
                ..Default::default()
            }],
            ..Default::default()
        };
        XSpace {
            planes: vec![
                plane("/host:CPU", 10),
                plane("/device:GPU:0", 20),
                plane(TASK_ENV_PLANE, 1),
            ],
            errors: vec!["an error".into()],
            warnings: vec!["a warning".into()],
            hostnames: vec!["node-1".into()],
        }
    }

    #[test]
    fn the_fields_are_split_where_they_end() {
        let bytes = space().encode_to_vec();
        let fields = top_level_fields(&bytes).unwrap();
        let numbers: Vec<u32> = fields.iter().map(|f| f.number).collect();
        assert_eq!(numbers, [1, 1, 1, 2, 3, 4]);
        let joined: Vec<u8> = fields.iter().flat_map(|f| f.whole).copied().collect();
        assert_eq!(joined, bytes);
        assert_eq!(plane_name(fields[1].payload).unwrap(), "/device:GPU:0");
    }

    #[test]
    fn a_trace_that_fits_is_written_as_it_came() {
        let mut file = tempfile();
        let written = write_received_trace(&mut file, &space().encode_to_vec()).unwrap();
        assert!(matches!(written, Written::Whole), "{written:?}");
        assert_eq!(read_back(&mut file), space());
    }

    #[test]
    fn what_is_no_xspace_is_refused() {
        let bytes = space().encode_to_vec();
        for cut in [&bytes[..bytes.len() - 1], &[0x0b][..], &[0xff][..]] {
            let refused = top_level_fields(cut)
                .and_then(|f| f.iter().try_for_each(|f| plane_name(f.payload).map(drop)));
            assert_eq!(
                refused.map_err(|e| e.kind()).err(),
                Some(io::ErrorKind::InvalidData),
                "{cut:?}"
            );
        }
    }
}
