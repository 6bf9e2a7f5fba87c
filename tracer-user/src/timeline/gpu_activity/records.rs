//! CUPTI activity records, read from their bytes by the layout of the
//! library that wrote them (`tracer_agent::activity` has the frame format).
//!
//! Offsets are those of cudarc's bindings (`#[repr(C, packed(8))]`):
//! - kernels (`CUpti_ActivityKernel9` in CUDA 12.x, `Kernel10` in 13.0,
//!   `Kernel11` = `Kernel10` + `priority` from 13.1): a prefix shared since
//!   `Kernel4`, then tails that only grow. A newer release's kernel is read
//!   by the prefix and the tail fields known so far;
//! - `CUpti_ActivityMemcpy6` / `Memcpy5` and `CUpti_ActivityMemset4`:
//!   the fields read here sit at the same offsets in every version;
//! - `CUpti_ActivityAPI` (driver calls): 40 bytes, unchanged.
//!
//! The bytes come from inside the target: any value, any length.

use tracer_agent::activity;

/// One CUPTI record, times in the GPU's timebase (`cuptiGetTimestamp`).
#[derive(Clone, Debug, PartialEq)]
pub enum Activity {
    /// A kernel execution.
    Kernel(Kernel),
    /// A memory copy.
    Memcpy(Transfer),
    /// A memory set.
    Memset(Transfer),
    /// A driver API call.
    Driver(DriverCall),
}

/// Where and when a piece of device work ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// Start, GPU timebase ns.
    pub start: u64,
    /// End, GPU timebase ns.
    pub end: u64,
    /// The CUDA device id.
    pub device: u32,
    /// The CUDA context id.
    pub context: u32,
    /// The CUDA stream id.
    pub stream: u32,
    /// CUPTI's id of the driver call that submitted it.
    pub correlation: u32,
}

/// A kernel execution.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Kernel {
    /// Where and when it ran.
    pub at: Placement,
    /// Its function name, as CUPTI gave it (mangled).
    pub name: String,
    /// Grid size in blocks, x, y, z.
    pub grid: [i32; 3],
    /// Block size in threads, x, y, z.
    pub block: [i32; 3],
    /// Registers per thread.
    pub registers: u16,
    /// Static shared memory per block, in bytes.
    pub static_shared: i32,
    /// Dynamic shared memory per block, in bytes.
    pub dynamic_shared: i32,
    /// CUPTI's id of this launch's grid, unique at run time.
    pub grid_id: i64,
    /// From `Kernel9` on.
    pub graph_id: Option<u32>,
    /// From `Kernel11` (CUDA 13.1) on.
    pub priority: Option<i32>,
}

/// A copy (`kind` is the copy kind) or a memset (`kind` is the memory
/// kind; `value` the value set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfer {
    /// Where and when it ran.
    pub at: Placement,
    /// Bytes copied or set.
    pub bytes: u64,
    /// Copy kind (`CUpti_ActivityMemcpyKind`) or memory kind (`CUpti_ActivityMemoryKind`).
    pub kind: u8,
    /// A copy's source memory kind (`CUpti_ActivityMemoryKind`); 0 for a memset.
    pub src_kind: u8,
    /// A copy's destination memory kind; 0 for a memset.
    pub dst_kind: u8,
    /// `CUpti_ActivityFlag` bits; bit 0 says asynchronous.
    pub flags: u16,
    /// The value a memset set; 0 for a copy.
    pub value: u32,
}

/// A driver API call, as CUPTI timed it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCall {
    /// `CUpti_driver_api_trace_cbid`.
    pub cbid: u32,
    /// Start, GPU timebase ns.
    pub start: u64,
    /// End, GPU timebase ns.
    pub end: u64,
    /// The calling process.
    pub pid: u32,
    /// The calling thread.
    pub tid: u32,
    /// Its CUPTI correlation id, shared with the work it submitted.
    pub correlation: u32,
    /// The `CUresult` it returned.
    pub result: u32,
}

/// Byte length of `CUpti_ActivityKernel9` (CUDA 12.x).
pub const KERNEL9_LEN: usize = 208;
/// Byte length of `CUpti_ActivityKernel10` (CUDA 13.0).
pub const KERNEL10_LEN: usize = 216;
/// Byte length of `CUpti_ActivityKernel11` (CUDA 13.1 on).
pub const KERNEL11_LEN: usize = 224;
/// Byte length of `CUpti_ActivityMemcpy6`.
pub const MEMCPY6_LEN: usize = 96;
/// Byte length of `CUpti_ActivityMemset4`.
pub const MEMSET4_LEN: usize = 88;
/// Byte length of `CUpti_ActivityAPI`.
pub const API_LEN: usize = 40;

/// CUPTI API version of CUDA 13.1, whose kernel record adds `priority`.
const API_13_1: u32 = 130_101;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&self, at: usize) -> Option<u8> {
        self.0.get(at).copied()
    }
    fn u16(&self, at: usize) -> Option<u16> {
        Some(u16::from_le_bytes(self.0.get(at..at + 2)?.try_into().ok()?))
    }
    fn u32(&self, at: usize) -> Option<u32> {
        Some(u32::from_le_bytes(self.0.get(at..at + 4)?.try_into().ok()?))
    }
    fn i32(&self, at: usize) -> Option<i32> {
        self.u32(at).map(|v| v as i32)
    }
    fn u64(&self, at: usize) -> Option<u64> {
        Some(u64::from_le_bytes(self.0.get(at..at + 8)?.try_into().ok()?))
    }
}

/// Reads one record written by a CUPTI of `api_version`; `name` is the
/// string a kernel's name pointer pointed at. None for kinds not read
/// here and for records too short for their kind.
pub fn decode(api_version: u32, record: &[u8], name: &[u8]) -> Option<Activity> {
    let b = Bytes(record);
    Some(match b.u32(0)? {
        activity::KIND_KERNEL | activity::KIND_CONCURRENT_KERNEL => {
            if record.len() < activity::KERNEL_PREFIX_LEN {
                return None;
            }
            let i3 = |at: usize| -> Option<[i32; 3]> {
                Some([b.i32(at)?, b.i32(at + 4)?, b.i32(at + 8)?])
            };
            Activity::Kernel(Kernel {
                at: Placement {
                    start: b.u64(16)?,
                    end: b.u64(24)?,
                    device: b.u32(40)?,
                    context: b.u32(44)?,
                    stream: b.u32(48)?,
                    correlation: b.u32(92)?,
                },
                name: String::from_utf8_lossy(name).into_owned(),
                grid: i3(52)?,
                block: i3(64)?,
                registers: b.u16(6)?,
                static_shared: b.i32(76)?,
                dynamic_shared: b.i32(80)?,
                grid_id: b.u64(96)? as i64,
                graph_id: (record.len() >= KERNEL9_LEN).then(|| b.u32(156)).flatten(),
                priority: (api_version >= API_13_1 && record.len() >= KERNEL11_LEN)
                    .then(|| b.i32(216))
                    .flatten(),
            })
        }
        activity::KIND_MEMCPY => Activity::Memcpy(Transfer {
            at: placement_at_32(&b)?,
            bytes: b.u64(8)?,
            kind: b.u8(4)?,
            src_kind: b.u8(5)?,
            dst_kind: b.u8(6)?,
            flags: u16::from(b.u8(7)?),
            value: 0,
        }),
        activity::KIND_MEMSET => Activity::Memset(Transfer {
            at: placement_at_32(&b)?,
            bytes: b.u64(8)?,
            kind: b.u16(50)? as u8,
            src_kind: 0,
            dst_kind: 0,
            flags: b.u16(48)?,
            value: b.u32(4)?,
        }),
        activity::KIND_DRIVER => Activity::Driver(DriverCall {
            cbid: b.u32(4)?,
            start: b.u64(8)?,
            end: b.u64(16)?,
            pid: b.u32(24)?,
            tid: b.u32(28)?,
            correlation: b.u32(32)?,
            result: b.u32(36)?,
        }),
        _ => return None,
    })
}

/// Copies and memsets: start@16, end@24, then device, context, stream and
/// correlation ids from 32.
fn placement_at_32(b: &Bytes) -> Option<Placement> {
    Some(Placement {
        start: b.u64(16)?,
        end: b.u64(24)?,
        device: b.u32(32)?,
        context: b.u32(36)?,
        stream: b.u32(40)?,
        correlation: b.u32(44)?,
    })
}

/// `CUpti_ActivityMemcpyKind` in XProf's words.
pub fn copy_kind_name(kind: u8) -> &'static str {
    match kind {
        1 => "HtoD",
        2 => "DtoH",
        3 => "HtoA",
        4 => "AtoH",
        5 => "AtoA",
        6 => "AtoD",
        7 => "DtoA",
        8 => "DtoD",
        9 => "HtoH",
        10 => "PtoP",
        _ => "Unknown",
    }
}

/// `CUpti_ActivityMemoryKind`.
pub fn memory_kind_name(kind: u8) -> &'static str {
    match kind {
        1 => "pageable",
        2 => "pinned",
        3 => "device",
        4 => "array",
        5 => "managed",
        6 => "device_static",
        7 => "managed_static",
        _ => "unknown",
    }
}

/// The driver function of a CUPTI driver callback id, for those that
/// submit or wait for device work (the ids are fixed across releases).
pub fn driver_function(cbid: u32) -> Option<&'static str> {
    Some(match cbid {
        17 => "cuCtxSynchronize",
        121 => "cuEventSynchronize",
        126 => "cuStreamSynchronize",
        216 => "cuMemsetD8Async",
        218 => "cuMemsetD16Async",
        220 => "cuMemsetD32Async",
        249 => "cuMemsetD8_v2",
        250 => "cuMemsetD16_v2",
        251 => "cuMemsetD32_v2",
        276 => "cuMemcpyHtoD_v2",
        277 => "cuMemcpyHtoDAsync_v2",
        278 => "cuMemcpyDtoH_v2",
        279 => "cuMemcpyDtoHAsync_v2",
        280 => "cuMemcpyDtoD_v2",
        281 => "cuMemcpyDtoDAsync_v2",
        295 => "cuStreamWaitEvent",
        305 => "cuMemcpy",
        306 => "cuMemcpyAsync",
        307 => "cuLaunchKernel",
        318 => "cuMemcpyPeer",
        319 => "cuMemcpyPeerAsync",
        440 => "cuStreamSynchronize_ptsz",
        442 => "cuLaunchKernel_ptsz",
        477 => "cuLaunchCooperativeKernel",
        478 => "cuLaunchCooperativeKernel_ptsz",
        514 => "cuGraphLaunch",
        515 => "cuGraphLaunch_ptsz",
        652 => "cuLaunchKernelEx",
        653 => "cuLaunchKernelEx_ptsz",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel record of `len` bytes as CUPTI lays it out.
    fn kernel(len: usize) -> Vec<u8> {
        let mut r = vec![0u8; len];
        r[..4].copy_from_slice(&activity::KIND_CONCURRENT_KERNEL.to_le_bytes());
        r[6..8].copy_from_slice(&40u16.to_le_bytes());
        r[16..24].copy_from_slice(&1_000u64.to_le_bytes());
        r[24..32].copy_from_slice(&1_500u64.to_le_bytes());
        r[40..44].copy_from_slice(&1u32.to_le_bytes());
        r[44..48].copy_from_slice(&2u32.to_le_bytes());
        r[48..52].copy_from_slice(&13u32.to_le_bytes());
        for (i, v) in [16i32, 2, 1, 256, 1, 1].iter().enumerate() {
            r[52 + 4 * i..56 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        r[76..80].copy_from_slice(&512i32.to_le_bytes());
        r[80..84].copy_from_slice(&1024i32.to_le_bytes());
        r[92..96].copy_from_slice(&77u32.to_le_bytes());
        r[96..104].copy_from_slice(&5i64.to_le_bytes());
        r[104..112].copy_from_slice(&0xdead_beefu64.to_le_bytes());
        if len >= KERNEL9_LEN {
            r[156..160].copy_from_slice(&9u32.to_le_bytes());
        }
        if len >= KERNEL11_LEN {
            r[216..220].copy_from_slice(&(-3i32).to_le_bytes());
        }
        r
    }

    #[test]
    fn kernels_of_each_layout() {
        for (version, len, priority) in [
            (26, KERNEL9_LEN, None),
            (130_001, KERNEL10_LEN, None),
            (130_101, KERNEL11_LEN, Some(-3)),
            // A newer release: the prefix and the known tail are read.
            (130_401, KERNEL11_LEN + 16, Some(-3)),
        ] {
            let Some(Activity::Kernel(k)) = decode(version, &kernel(len), b"_Z3fooi") else {
                panic!("version {version} not read");
            };
            assert_eq!(
                k.at,
                Placement {
                    start: 1_000,
                    end: 1_500,
                    device: 1,
                    context: 2,
                    stream: 13,
                    correlation: 77
                }
            );
            assert_eq!((k.grid, k.block), ([16, 2, 1], [256, 1, 1]));
            assert_eq!(
                (k.registers, k.static_shared, k.dynamic_shared),
                (40, 512, 1024)
            );
            assert_eq!((k.grid_id, k.graph_id, k.priority), (5, Some(9), priority));
            assert_eq!(k.name, "_Z3fooi");
        }
    }

    #[test]
    fn copies_memsets_and_driver_calls() {
        let mut m = vec![0u8; MEMCPY6_LEN];
        m[..4].copy_from_slice(&activity::KIND_MEMCPY.to_le_bytes());
        m[4..8].copy_from_slice(&[1, 1, 3, 1]);
        m[8..16].copy_from_slice(&4096u64.to_le_bytes());
        m[44..48].copy_from_slice(&8u32.to_le_bytes());
        let Some(Activity::Memcpy(t)) = decode(26, &m, b"") else {
            panic!()
        };
        assert_eq!(
            (t.kind, t.src_kind, t.dst_kind, t.flags, t.bytes),
            (1, 1, 3, 1, 4096)
        );
        assert_eq!(t.at.correlation, 8);

        let mut s = vec![0u8; MEMSET4_LEN];
        s[..4].copy_from_slice(&activity::KIND_MEMSET.to_le_bytes());
        s[4..8].copy_from_slice(&0xabu32.to_le_bytes());
        s[50..52].copy_from_slice(&3u16.to_le_bytes());
        let Some(Activity::Memset(t)) = decode(26, &s, b"") else {
            panic!()
        };
        assert_eq!((t.value, t.kind), (0xab, 3));

        let mut a = vec![0u8; API_LEN];
        a[..4].copy_from_slice(&activity::KIND_DRIVER.to_le_bytes());
        a[4..8].copy_from_slice(&307u32.to_le_bytes());
        a[28..32].copy_from_slice(&4242u32.to_le_bytes());
        a[32..36].copy_from_slice(&8u32.to_le_bytes());
        let Some(Activity::Driver(d)) = decode(26, &a, b"") else {
            panic!()
        };
        assert_eq!((d.cbid, d.tid, d.correlation), (307, 4242, 8));
        assert_eq!(driver_function(d.cbid), Some("cuLaunchKernel"));
    }

    proptest::proptest! {
        /// Any bytes, any version: a record or None, never a panic.
        #[test]
        fn any_bytes_decode_or_not(version: u32, record: Vec<u8>, name: Vec<u8>) {
            let _ = decode(version, &record, &name);
        }

        #[test]
        fn truncated_records_are_refused(cut in 0usize..KERNEL9_LEN) {
            let k = kernel(KERNEL9_LEN);
            let got = decode(26, &k[..cut], b"");
            proptest::prop_assert_eq!(got.is_some(), cut >= activity::KERNEL_PREFIX_LEN);
        }
    }
}
