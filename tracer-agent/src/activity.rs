//! CUPTI activity as the agent forwards it: the records exactly as CUPTI
//! wrote them, batched into [`crate::protocol::DEVICE_ACTIVITY`] frames,
//! and what both sides know of their layouts.
//!
//! A batch is a [`BatchHeader`] followed by records, each
//! `[record_len: u32][name_len: u32][record][name]`: the record's bytes as
//! CUPTI's buffer held them and, for kernels, the name its `name` pointer
//! pointed at (a pointer into the target means nothing outside it).
//!
//! Layouts (`CUPTI_PACKED_ALIGNMENT`, i.e. packed with 8-byte alignment;
//! checked against cudarc's bindings): every kernel record from
//! `CUpti_ActivityKernel4` to `Kernel11` shares the prefix whose offsets
//! are below; the versions differ in their tails. CUPTI walks its buffer
//! itself (`cuptiActivityGetNextRecord`), so the agent learns each
//! record's length from where the next one starts and never needs to know
//! the layout: ebtrace reads it, by the library's API version.

/// `CUPTI_ACTIVITY_KIND_MEMCPY`.
pub const KIND_MEMCPY: u32 = 1;
/// `CUPTI_ACTIVITY_KIND_MEMSET`.
pub const KIND_MEMSET: u32 = 2;
/// `CUPTI_ACTIVITY_KIND_KERNEL`.
pub const KIND_KERNEL: u32 = 3;
/// `CUPTI_ACTIVITY_KIND_DRIVER`.
pub const KIND_DRIVER: u32 = 4;
/// `CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL`.
pub const KIND_CONCURRENT_KERNEL: u32 = 10;

/// Offset of a kernel record's `const char *name`.
pub const KERNEL_NAME_OFFSET: usize = 104;
/// Bytes of the kernel prefix shared by `Kernel4` to `Kernel11` (up to and
/// including `name`).
pub const KERNEL_PREFIX_LEN: usize = 112;

/// Longest kernel name forwarded (longer ones are cut).
pub const MAX_NAME_LEN: usize = 4096;
/// Longest record forwarded (the largest known is under 300 bytes).
pub const MAX_RECORD_LEN: usize = 1024;

/// The CUDA release of a CUPTI API version (`cuptiGetVersion`), as
/// `(major, minor)`: `CUPTI_API_VERSION` is 18 to 28 in 12.x and
/// `major * 10000 + minor * 100 + 1` from 13.0.
pub fn cuda_release(api_version: u32) -> Option<(u32, u32)> {
    Some(match api_version {
        18 => (12, 0),
        20 => (12, 2),
        21 => (12, 3),
        22 => (12, 4),
        23 => (12, 5),
        24 => (12, 6),
        26 => (12, 8),
        28 => (12, 9),
        v if v >= 130_000 => (v / 10_000, v / 100 % 100),
        _ => return None,
    })
}

/// What leads a [`crate::protocol::DEVICE_ACTIVITY`] payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchHeader {
    /// `cuptiGetVersion` of the library that wrote the records.
    pub api_version: u32,
    /// [`FLAG_FINALIZED`], ...
    pub flags: u32,
    /// A `cuptiGetTimestamp` reading ...
    pub gpu_ns: u64,
    /// ... and `CLOCK_MONOTONIC` at the same instant (the middle of the
    /// tightest bracket the agent read).
    pub monotonic_ns: u64,
    /// Records CUPTI dropped for want of a buffer, so far.
    pub dropped: u64,
}

/// CUPTI was finalized by another client during the recording (a
/// framework's own session ends with `cuptiFinalize`): records after that
/// are missing.
pub const FLAG_FINALIZED: u32 = 1;

impl BatchHeader {
    /// Bytes of an encoded header.
    pub const LEN: usize = 32;

    /// The header's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..4].copy_from_slice(&self.api_version.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.gpu_ns.to_le_bytes());
        b[16..24].copy_from_slice(&self.monotonic_ns.to_le_bytes());
        b[24..].copy_from_slice(&self.dropped.to_le_bytes());
        b
    }

    /// Reads a header from the start of `b`, if it is long enough.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::LEN)?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Some(BatchHeader {
            api_version: u32_at(0),
            flags: u32_at(4),
            gpu_ns: u64_at(8),
            monotonic_ns: u64_at(16),
            dropped: u64_at(24),
        })
    }
}

/// The records of a batch payload (after its header): `(record, name)`
/// pairs. Stops at the first malformed entry.
pub fn records(payload: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    let mut rest = payload.get(BatchHeader::LEN..).unwrap_or_default();
    core::iter::from_fn(move || {
        let len = |b: &[u8]| -> Option<usize> {
            Some(u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize)
        };
        let record_len = len(rest)?;
        let name_len = len(rest.get(4..)?)?;
        let body = rest.get(8..)?;
        if record_len > MAX_RECORD_LEN || name_len > MAX_NAME_LEN {
            return None;
        }
        let record = body.get(..record_len)?;
        let name = body.get(record_len..record_len + name_len)?;
        rest = &body[record_len + name_len..];
        Some((record, name))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_of_api_versions() {
        assert_eq!(cuda_release(26), Some((12, 8)));
        assert_eq!(cuda_release(130_001), Some((13, 0)));
        assert_eq!(cuda_release(130_401), Some((13, 4)));
        assert_eq!(cuda_release(19), None);
    }

    #[test]
    fn batches_round_trip_and_stop_at_garbage() {
        let h = BatchHeader {
            api_version: 26,
            flags: FLAG_FINALIZED,
            gpu_ns: 1,
            monotonic_ns: 2,
            dropped: 3,
        };
        let mut payload = h.encode().to_vec();
        for (rec, name) in [(&[1u8, 2, 3][..], &b"k"[..]), (&[4u8][..], &b""[..])] {
            payload.extend((rec.len() as u32).to_le_bytes());
            payload.extend((name.len() as u32).to_le_bytes());
            payload.extend(rec);
            payload.extend(name);
        }
        assert_eq!(BatchHeader::decode(&payload), Some(h));
        let got: Vec<_> = records(&payload).collect();
        assert_eq!(got, [(&[1u8, 2, 3][..], &b"k"[..]), (&[4u8][..], &b""[..])]);
        payload.extend(u32::MAX.to_le_bytes());
        payload.extend(0u32.to_le_bytes());
        assert_eq!(records(&payload).count(), 2);
    }
}
