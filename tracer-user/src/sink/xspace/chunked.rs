//! Planes encoded apart from the trace they go into, in chunks that are
//! freed one at a time as they are copied into it: the copy then takes
//! about one chunk more memory, not the planes' whole size again.

use std::io::{self, Seek, SeekFrom, Write};

use super::PlaneOut;

/// The size a chunk is filled to (a plane's length, written after its
/// lines, may rewrite bytes of an earlier one).
const CHUNK_BYTES: usize = 1 << 20;

/// Bytes written in chunks, with seeks back over them.
pub struct Chunked {
    chunks: Vec<Vec<u8>>,
    chunk_bytes: usize,
    len: u64,
    pos: u64,
}

impl Default for Chunked {
    fn default() -> Self {
        Chunked::with_chunk_bytes(CHUNK_BYTES)
    }
}

impl Chunked {
    fn with_chunk_bytes(chunk_bytes: usize) -> Self {
        Chunked {
            chunks: Vec::new(),
            chunk_bytes,
            len: 0,
            pos: 0,
        }
    }

    /// Writes every byte to `out`, freeing each chunk once it is written.
    pub fn write_into(self, out: &mut impl Write) -> io::Result<()> {
        for chunk in self.chunks {
            out.write_all(&chunk)?;
        }
        Ok(())
    }
}

impl Write for Chunked {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut rest = buf;
        while !rest.is_empty() {
            let pos = usize::try_from(self.pos).map_err(io::Error::other)?;
            let (index, at) = (pos / self.chunk_bytes, pos % self.chunk_bytes);
            if index == self.chunks.len() {
                self.chunks.push(Vec::with_capacity(self.chunk_bytes));
            }
            let chunk = &mut self.chunks[index];
            let n = (self.chunk_bytes - at).min(rest.len());
            // What is there is written over, the rest appended.
            let over = chunk.len().saturating_sub(at).min(n);
            chunk[at..at + over].copy_from_slice(&rest[..over]);
            chunk.extend_from_slice(&rest[over..n]);
            rest = &rest[n..];
            self.pos += n as u64;
        }
        self.len = self.len.max(self.pos);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Seek for Chunked {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match pos {
            // Past the end would leave a gap no write fills.
            Some(pos) if pos <= self.len => {
                self.pos = pos;
                Ok(pos)
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a seek outside what was written",
            )),
        }
    }
}

impl PlaneOut for Chunked {}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;

    proptest::proptest! {
        /// Writes and seeks back make the bytes a `Cursor` over a `Vec`
        /// makes of them, across chunk boundaries.
        #[test]
        fn it_holds_what_a_cursor_holds(
            chunk_bytes in 1usize..40,
            steps in proptest::collection::vec((0usize..200, 1usize..100, proptest::bool::ANY), 1..12),
        ) {
            let mut chunked = Chunked::with_chunk_bytes(chunk_bytes);
            let mut cursor = Cursor::new(Vec::new());
            for (i, &(back, len, seek)) in steps.iter().enumerate() {
                if seek {
                    let end = cursor.get_ref().len() as u64;
                    let to = SeekFrom::Start(end.saturating_sub(back as u64));
                    proptest::prop_assert_eq!(chunked.seek(to).unwrap(), cursor.seek(to).unwrap());
                }
                let bytes: Vec<u8> = (0..len).map(|b| (b * 7 + i) as u8).collect();
                chunked.write_all(&bytes).unwrap();
                cursor.write_all(&bytes).unwrap();
                let end = SeekFrom::End(0);
                proptest::prop_assert_eq!(chunked.seek(end).unwrap(), cursor.seek(end).unwrap());
            }
            let mut out = Vec::new();
            chunked.write_into(&mut out).unwrap();
            proptest::prop_assert!(out == *cursor.get_ref());
        }
    }

    #[test]
    fn a_seek_past_the_end_is_refused() {
        let mut chunked = Chunked::default();
        chunked.write_all(&[1, 2, 3]).unwrap();
        assert!(chunked.seek(SeekFrom::Start(4)).is_err());
        assert!(chunked.seek(SeekFrom::Current(-4)).is_err());
        assert_eq!(chunked.seek(SeekFrom::End(-1)).unwrap(), 2);
    }
}
