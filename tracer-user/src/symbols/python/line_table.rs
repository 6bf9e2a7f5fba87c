//! A code object's line table (`co_linetable`), decoded at one instruction
//! the way CPython's own `co_lines()` decodes it.
//!
//! The table comes from the target's memory: whatever its bytes, decoding
//! ends, in one pass over them, without a panic or an overflow; a table
//! that stops making sense ends where it stops.

/// How a version encodes `co_linetable`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTableFormat {
    /// 3.10 (PEP 626): `(bytes advanced: u8, line delta: i8)` pairs,
    /// -128 meaning "no line".
    Pep626,
    /// 3.11+: the locations table (CPython's `Objects/locations.md`).
    Locations,
}

impl LineTableFormat {
    /// The format of CPython 3.`minor`.
    pub fn of_minor(minor: u8) -> Self {
        if minor <= 10 {
            LineTableFormat::Pep626
        } else {
            LineTableFormat::Locations
        }
    }
}

/// The source line of the instruction `byte_offset` bytes into the
/// bytecode of a code object whose `co_firstlineno` is `first_line`;
/// `None` where the table gives it no line, where the table ends before
/// it, or where the line is not a real one (≤ 0, or past `u32`).
pub fn line_at(
    format: LineTableFormat,
    table: &[u8],
    first_line: u32,
    byte_offset: u64,
) -> Option<u32> {
    let range = Ranges::new(format, table, first_line).find(|r| byte_offset < r.end)?;
    range
        .line
        .filter(|&line| line > 0)
        .and_then(|line| u32::try_from(line).ok())
}

/// Bytecode bytes `[start, end)` and their line (`None`: no line). The
/// ranges follow each other from 0; some are empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    start: u64,
    end: u64,
    line: Option<i64>,
}

/// The ranges a table describes, in order.
struct Ranges<'a> {
    format: LineTableFormat,
    table: &'a [u8],
    /// Index of the next entry in `table`.
    at: usize,
    /// The line the deltas add up to.
    line: i64,
    /// Where the next range starts.
    end: u64,
}

impl<'a> Ranges<'a> {
    fn new(format: LineTableFormat, table: &'a [u8], first_line: u32) -> Self {
        Ranges {
            format,
            table,
            at: 0,
            line: i64::from(first_line),
            end: 0,
        }
    }

    /// The next 3.10 pair. Even a "no line" pair advances the address:
    /// skipping its bytes would shift every range after it.
    fn next_pep626(&mut self) -> Option<Range> {
        let (&advance, &delta) = (self.table.get(self.at)?, self.table.get(self.at + 1)?);
        self.at += 2;
        let delta = delta as i8;
        let start = self.end;
        self.end = start.checked_add(u64::from(advance))?;
        let line = if delta == i8::MIN {
            None
        } else {
            self.line = self.line.checked_add(i64::from(delta))?;
            Some(self.line)
        };
        Some(Range {
            start,
            end: self.end,
            line,
        })
    }

    /// The next 3.11+ entry. Like CPython, only the line delta is read of
    /// its bytes, and the next entry is the next byte with bit 7 set.
    fn next_location(&mut self) -> Option<Range> {
        let header = *self.table.get(self.at)?;
        if header & 0x80 == 0 {
            return None;
        }
        self.at += 1;
        let code = (header >> 3) & 15;
        let delta = match code {
            13 | 14 => self.signed_varint()?,
            10..=12 => i64::from(code - 10),
            _ => 0,
        };
        self.line = self.line.checked_add(delta)?;
        while self.table.get(self.at).is_some_and(|b| b & 0x80 == 0) {
            self.at += 1;
        }
        let start = self.end;
        self.end = start.checked_add((u64::from(header & 7) + 1) * 2)?;
        let line = (code != 15).then_some(self.line);
        Some(Range {
            start,
            end: self.end,
            line,
        })
    }

    /// A varint: 6-bit chunks, least significant first, 0x40 meaning
    /// another follows; at most 60 bits, and never a byte with bit 7 set
    /// (the next entry's header), else the table is garbage.
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..60).step_by(6) {
            let byte = *self.table.get(self.at)?;
            if byte & 0x80 != 0 {
                return None;
            }
            self.at += 1;
            value |= u64::from(byte & 63) << shift;
            if byte & 64 == 0 {
                return Some(value);
            }
        }
        None
    }

    /// A signed varint: the sign in bit 0, the magnitude above it.
    fn signed_varint(&mut self) -> Option<i64> {
        let value = self.varint()?;
        let magnitude = i64::try_from(value >> 1).ok()?;
        Some(if value & 1 != 0 {
            -magnitude
        } else {
            magnitude
        })
    }
}

impl Iterator for Ranges<'_> {
    type Item = Range;

    fn next(&mut self) -> Option<Range> {
        match self.format {
            LineTableFormat::Pep626 => self.next_pep626(),
            LineTableFormat::Locations => self.next_location(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LineTableFormat::{Locations, Pep626};

    /// A 3.10 table of `(advance, delta)` pairs.
    fn pep626(pairs: &[(u8, i8)]) -> Vec<u8> {
        pairs.iter().flat_map(|&(a, d)| [a, d as u8]).collect()
    }

    /// The lines of every instruction (2 bytes each) from 0 to `bytes`.
    fn lines(format: LineTableFormat, table: &[u8], first: u32, bytes: u64) -> Vec<Option<u32>> {
        (0..bytes)
            .step_by(2)
            .map(|at| line_at(format, table, first, at))
            .collect()
    }

    #[test]
    fn minors_pick_formats() {
        assert_eq!(LineTableFormat::of_minor(10), Pep626);
        for minor in 11..=13 {
            assert_eq!(LineTableFormat::of_minor(minor), Locations);
        }
    }

    #[test]
    fn pep626_pairs_give_lines() {
        let table = pep626(&[(6, 1), (0, -128), (4, 2), (2, -1)]);
        assert_eq!(
            lines(Pep626, &table, 10, 14),
            [
                Some(11),
                Some(11),
                Some(11),
                Some(13),
                Some(13),
                Some(12),
                None
            ]
        );
    }

    /// A "no line" pair still advances the address (py-spy does not, and
    /// names every later instruction's line wrongly).
    #[test]
    fn pep626_no_line_advances_the_address() {
        let table = pep626(&[(2, 0), (4, -128), (2, 3)]);
        assert_eq!(
            lines(Pep626, &table, 5, 10),
            [Some(5), None, None, Some(8), None]
        );
    }

    /// A pair that advances nothing moves the line only; one that
    /// overshoots 127 lines comes as several.
    #[test]
    fn pep626_empty_ranges_only_move_the_line() {
        let table = pep626(&[(0, 127), (0, 100), (2, 0), (2, -50)]);
        assert_eq!(lines(Pep626, &table, 1, 4), [Some(228), Some(178)]);
    }

    #[test]
    fn pep626_lines_not_real_are_none() {
        assert_eq!(line_at(Pep626, &pep626(&[(2, -3)]), 3, 0), None);
        assert_eq!(line_at(Pep626, &pep626(&[(2, -4)]), 3, 0), None);
        assert_eq!(line_at(Pep626, &pep626(&[(2, 1)]), u32::MAX, 0), None);
        assert_eq!(line_at(Pep626, &[2, 0, 2], 3, 2), None, "odd byte");
        assert_eq!(line_at(Pep626, &[], 3, 0), None);
    }

    /// A locations entry header: `code`, `units` code units.
    fn header(code: u8, units: u8) -> u8 {
        0x80 | code << 3 | (units - 1)
    }

    /// A varint's bytes.
    fn varint(mut v: u64) -> Vec<u8> {
        let mut out = vec![];
        while v >= 64 {
            out.push(64 | (v & 63) as u8);
            v >>= 6;
        }
        out.push(v as u8);
        out
    }

    fn signed_varint(v: i64) -> Vec<u8> {
        varint(if v < 0 {
            v.unsigned_abs() << 1 | 1
        } else {
            (v as u64) << 1
        })
    }

    #[test]
    fn locations_entries_of_each_kind_give_lines() {
        let mut table = vec![header(0, 1), 0x12]; // short form: same line
        table.extend([header(11, 2), 4, 9]); // one line form: +1
        table.extend([header(12, 1), 0, 3]); // +2
        table.push(header(13, 1)); // no columns: -200
        table.extend(signed_varint(-200));
        table.extend([header(14, 3)]); // long form: +1000
        table.extend(signed_varint(1000));
        table.extend([varint(2), varint(5), varint(300)].concat());
        table.push(header(15, 1)); // no location
        table.extend([header(10, 1), 1, 2]); // one line form: +0
        let expected = [
            Some(300),
            Some(301),
            Some(301),
            Some(303),
            Some(103),
            Some(1103),
            Some(1103),
            Some(1103),
            None,
            Some(1103),
            None,
        ];
        assert_eq!(lines(Locations, &table, 300, 22), expected);
    }

    #[test]
    fn locations_garbage_ends_the_table() {
        // Bytes an entry does not need are skipped, as CPython skips them.
        let padded = [header(0, 1), 1, 5, 6, header(11, 1), 0, 0];
        assert_eq!(lines(Locations, &padded, 7, 6), [Some(7), Some(8), None]);
        // A table that does not start with a header byte.
        let table = [0x05, header(0, 1), 1];
        assert_eq!(lines(Locations, &table, 7, 4), [None, None]);
        // A varint cut short by the end, or by a header.
        let cut = [header(10, 1), 0, 0, header(13, 1), 0x41];
        assert_eq!(lines(Locations, &cut, 7, 4), [Some(7), None]);
        let interrupted = [header(13, 1), 0x41, header(0, 1), 0];
        assert_eq!(line_at(Locations, &interrupted, 7, 0), None);
        // A varint longer than 60 bits.
        let mut long = vec![header(13, 1)];
        long.extend([0x7f; 11]);
        long.push(0);
        assert_eq!(line_at(Locations, &long, 7, 0), None);
    }

    #[test]
    fn locations_lines_not_real_are_none() {
        let mut table = vec![header(13, 1)];
        table.extend(signed_varint(-5));
        assert_eq!(line_at(Locations, &table, 5, 0), None);
        let mut past = vec![header(13, 1)];
        past.extend(signed_varint(1 << 40));
        assert_eq!(line_at(Locations, &past, 5, 0), None);
    }

    /// An entry of the locations table, as CPython's compiler writes it.
    fn encode_entry(table: &mut Vec<u8>, units: u8, delta: Option<i64>) {
        match delta {
            None => table.push(header(15, units)),
            Some(0) => table.extend([header(3, units), 0x21]),
            Some(d @ 1..=2) => table.extend([header(10 + d as u8, units), 5, 9]),
            Some(d) if d % 2 == 0 => {
                table.push(header(13, units));
                table.extend(signed_varint(d));
            }
            Some(d) => {
                table.push(header(14, units));
                table.extend(signed_varint(d));
                table.extend([varint(1), varint(70), varint(4)].concat());
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Any bytes, any offset, any first line: an answer, not a panic.
        #[test]
        fn any_table_decodes_without_panicking(
            table in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            first in proptest::prelude::any::<u32>(),
            offset in proptest::prop_oneof![0u64..600, proptest::prelude::any::<u64>()],
        ) {
            line_at(Pep626, &table, first, offset);
            line_at(Locations, &table, first, offset);
        }

        /// Entries written as CPython's compiler writes them decode to
        /// the lines they were written with.
        #[test]
        fn encoded_locations_decode_to_their_lines(
            entries in proptest::collection::vec(
                (1u8..=8, proptest::option::weighted(0.9, -3000i64..3000)),
                0..64,
            ),
            first in 1u32..100_000,
        ) {
            let mut table = vec![];
            let mut expected = vec![];
            let mut line = i64::from(first);
            for &(units, delta) in &entries {
                encode_entry(&mut table, units, delta);
                line += delta.unwrap_or(0);
                let real = delta.and_then(|_| u32::try_from(line).ok()).filter(|&l| l > 0);
                expected.extend(std::iter::repeat_n(real, usize::from(units)));
            }
            expected.push(None);
            let bytes = expected.len() as u64 * 2;
            proptest::prop_assert_eq!(lines(Locations, &table, first, bytes), expected);
        }
    }
}
