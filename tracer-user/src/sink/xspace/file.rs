//! An XSpace written to a file so that a disk that fills up leaves a
//! trace XProf still opens: the planes that fit, whole, and a warning that
//! says what is missing. An XSpace is a sequence of top-level fields, so
//! the file cut where a plane ends, and the closing part written after it,
//! is a valid one.

use std::{
    fs::File,
    io::{self, BufWriter, Seek, SeekFrom, Write},
};

use super::PlaneOut;

/// How much of a trace went into its file.
#[derive(Debug)]
pub enum Written {
    /// All of it.
    Whole,
    /// The disk filled up: the file holds the planes named, then the
    /// closing part; the rest was dropped.
    Partial {
        /// The planes kept, in order.
        kept: Vec<String>,
        /// What the write failed with.
        why: io::Error,
    },
}

/// Whether `e` says the file can grow no further: a full disk, a quota
/// or a file size limit, where a shorter trace may still fit.
pub fn is_out_of_space(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::FileTooLarge
    )
}

/// Writes to `file`, at its start, the planes `write_planes` writes and
/// then the closing part `closing` makes; where the file can grow no
/// further, keeps the planes that were written whole and closes the trace
/// after them, with `closing` given the warning that says so.
pub fn write_trace_file(
    file: &mut File,
    write_planes: impl FnOnce(&mut PartsWriter<'_>) -> io::Result<()>,
    closing: impl Fn(&[String]) -> Vec<u8>,
) -> io::Result<Written> {
    let mut out = PartsWriter {
        out: BufWriter::with_capacity(1 << 20, file),
        parts: Vec::new(),
    };
    let written = write_planes(&mut out)
        .and_then(|()| out.write_all(&closing(&[])))
        .and_then(|()| out.flush());
    let why = match written {
        Ok(()) => return Ok(Written::Whole),
        Err(e) if is_out_of_space(&e) => e,
        Err(e) => return Err(e),
    };
    let PartsWriter { out, mut parts } = out;
    // What is still buffered belongs to a part that did not fit.
    let (file, _) = out.into_parts();
    loop {
        let end = parts.last().map_or(0, |p| p.end);
        // Cutting the file back frees the room the unfinished part took.
        file.set_len(end)?;
        file.seek(SeekFrom::Start(end))?;
        let kept: Vec<String> = parts.iter().map(|p| p.name.clone()).collect();
        let warning = partial_warning(&kept, &why);
        match file.write_all(&closing(&[warning])) {
            Ok(()) => return Ok(Written::Partial { kept, why }),
            Err(e) if is_out_of_space(&e) && parts.pop().is_some() => {}
            Err(e) => return Err(e),
        }
    }
}

/// The trace's warning that it is partial.
fn partial_warning(kept: &[String], why: &io::Error) -> String {
    let kept = match kept {
        [] => "none of its planes".to_string(),
        names => names.join(", "),
    };
    format!(
        "partial trace: writing it failed ({why}); it holds {kept}, and the Task Environment; \
         the rest was lost"
    )
}

/// A part of the trace written whole, and where it ends in the file.
struct Part {
    name: String,
    end: u64,
}

/// The writer the planes go to, which keeps where each ends.
pub struct PartsWriter<'f> {
    out: BufWriter<&'f mut File>,
    parts: Vec<Part>,
}

impl Write for PartsWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

impl Seek for PartsWriter<'_> {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.out.seek(pos)
    }
}

impl PlaneOut for PartsWriter<'_> {
    fn part_done(&mut self, what: &str) -> io::Result<()> {
        let end = self.out.stream_position()?;
        if self.parts.last().map_or(0, |p| p.end) == end {
            // Nothing was written for it.
            return Ok(());
        }
        // Only what reached the file counts as written.
        self.out.flush()?;
        self.parts.push(Part {
            name: what.to_string(),
            end,
        });
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use ebtrace_proto::tensorflow::profiler::{XPlane, XSpace};
    use prost::Message as _;

    use super::*;

    fn plane_bytes(name: &str, events: usize) -> Vec<u8> {
        XSpace {
            planes: vec![XPlane {
                name: name.into(),
                lines: vec![ebtrace_proto::tensorflow::profiler::XLine {
                    events: vec![Default::default(); events],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }
        .encode_to_vec()
    }

    fn closing(warnings: &[String]) -> Vec<u8> {
        XSpace {
            warnings: warnings.to_vec(),
            hostnames: vec!["host".into()],
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// Writes two planes to `file` as a disk that fills up past `room`
    /// bytes would take them: half of the first that does not fit, then
    /// ENOSPC.
    fn write_two_planes(file: &mut File, room: u64) -> io::Result<Written> {
        write_trace_file(
            file,
            |out| {
                for (name, events) in [("/host:CPU", 1000), ("/host:CPU per CPU", 5000)] {
                    let bytes = plane_bytes(name, events);
                    if out.stream_position()? + bytes.len() as u64 > room {
                        out.write_all(&bytes[..bytes.len() / 2])?;
                        return Err(io::ErrorKind::StorageFull.into());
                    }
                    out.write_all(&bytes)?;
                    out.part_done(name)?;
                }
                Ok(())
            },
            closing,
        )
    }

    /// The XSpace `file` holds, read from its start.
    pub(in crate::sink::xspace) fn read_back(file: &mut File) -> XSpace {
        let mut bytes = Vec::new();
        file.seek(SeekFrom::Start(0)).unwrap();
        io::Read::read_to_end(file, &mut bytes).unwrap();
        XSpace::decode(bytes.as_slice()).expect("a whole XSpace")
    }

    #[test]
    fn a_full_disk_keeps_the_planes_that_fit_and_says_so() {
        let mut file = tempfile();
        let Written::Partial { kept, why } = write_two_planes(&mut file, 8 << 10).unwrap() else {
            panic!("the second plane does not fit");
        };
        assert_eq!(kept, ["/host:CPU"]);
        assert_eq!(why.kind(), io::ErrorKind::StorageFull);
        let space = read_back(&mut file);
        assert_eq!(space.planes.len(), 1);
        assert_eq!(space.planes[0].lines[0].events.len(), 1000);
        assert_eq!(space.hostnames, ["host"]);
        assert!(space.warnings[0].starts_with("partial trace:"));
        assert!(space.warnings[0].contains("it holds /host:CPU, and"));
    }

    #[test]
    fn a_trace_that_fits_is_written_whole() {
        let mut file = tempfile();
        assert!(matches!(
            write_two_planes(&mut file, u64::MAX).unwrap(),
            Written::Whole
        ));
        let space = read_back(&mut file);
        assert_eq!(space.planes.len(), 2);
        assert!(space.warnings.is_empty());
    }

    /// A file open for reading and writing, its name already removed.
    pub(in crate::sink::xspace) fn tempfile() -> File {
        let path = std::env::temp_dir().join(format!(
            "ebtrace-parts-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }
}
