//! The table of probed driver functions: each one's name and what its
//! calls do. A function's index here is its id in the attach cookie and
//! in every `CudaCall` record.

use super::{
    CopyKind,
    CopyKind::{DtoD, DtoH, HtoD, Inferred, Peer},
    DriverFunction, Memory,
    MemsetExtent::{self, Linear, Pitched},
    Op,
};

const fn f(name: &'static str, op: Op) -> DriverFunction {
    DriverFunction { name, op }
}

const fn copy(kind: CopyKind, bytes: usize, stream: Option<usize>) -> Op {
    Op::Memcpy {
        kind,
        bytes,
        stream,
    }
}

const fn set(element_bytes: u64, extent: MemsetExtent, stream: Option<usize>) -> Op {
    Op::Memset {
        element_bytes,
        extent,
        stream,
    }
}

/// Every probed function; a name the library does not export is skipped.
pub static FUNCTIONS: &[DriverFunction] = &[
    f("cuLaunchKernel", Op::Launch),
    f("cuLaunchKernel_ptsz", Op::Launch),
    f("cuLaunchCooperativeKernel", Op::Launch),
    f("cuLaunchCooperativeKernel_ptsz", Op::Launch),
    f("cuLaunchKernelEx", Op::LaunchEx),
    f("cuLaunchKernelEx_ptsz", Op::LaunchEx),
    f("cuGraphLaunch", Op::GraphLaunch),
    f("cuGraphLaunch_ptsz", Op::GraphLaunch),
    f("cuMemcpy", copy(Inferred, 2, None)),
    f("cuMemcpy_ptds", copy(Inferred, 2, None)),
    f("cuMemcpyAsync", copy(Inferred, 2, Some(3))),
    f("cuMemcpyAsync_ptsz", copy(Inferred, 2, Some(3))),
    f("cuMemcpyHtoD_v2", copy(HtoD, 2, None)),
    f("cuMemcpyHtoD_v2_ptds", copy(HtoD, 2, None)),
    f("cuMemcpyDtoH_v2", copy(DtoH, 2, None)),
    f("cuMemcpyDtoH_v2_ptds", copy(DtoH, 2, None)),
    f("cuMemcpyDtoD_v2", copy(DtoD, 2, None)),
    f("cuMemcpyDtoD_v2_ptds", copy(DtoD, 2, None)),
    f("cuMemcpyHtoDAsync_v2", copy(HtoD, 2, Some(3))),
    f("cuMemcpyHtoDAsync_v2_ptsz", copy(HtoD, 2, Some(3))),
    f("cuMemcpyDtoHAsync_v2", copy(DtoH, 2, Some(3))),
    f("cuMemcpyDtoHAsync_v2_ptsz", copy(DtoH, 2, Some(3))),
    f("cuMemcpyDtoDAsync_v2", copy(DtoD, 2, Some(3))),
    f("cuMemcpyDtoDAsync_v2_ptsz", copy(DtoD, 2, Some(3))),
    f("cuMemcpyPeer", copy(Peer, 4, None)),
    f("cuMemcpyPeer_ptds", copy(Peer, 4, None)),
    f("cuMemcpyPeerAsync", copy(Peer, 4, Some(5))),
    f("cuMemcpyPeerAsync_ptsz", copy(Peer, 4, Some(5))),
    f(
        "cuMemcpy2D_v2",
        Op::MemcpyStruct {
            three_d: false,
            stream: None,
        },
    ),
    f(
        "cuMemcpy2D_v2_ptds",
        Op::MemcpyStruct {
            three_d: false,
            stream: None,
        },
    ),
    f(
        "cuMemcpy2DUnaligned_v2",
        Op::MemcpyStruct {
            three_d: false,
            stream: None,
        },
    ),
    f(
        "cuMemcpy2DUnaligned_v2_ptds",
        Op::MemcpyStruct {
            three_d: false,
            stream: None,
        },
    ),
    f(
        "cuMemcpy2DAsync_v2",
        Op::MemcpyStruct {
            three_d: false,
            stream: Some(1),
        },
    ),
    f(
        "cuMemcpy2DAsync_v2_ptsz",
        Op::MemcpyStruct {
            three_d: false,
            stream: Some(1),
        },
    ),
    f(
        "cuMemcpy3D_v2",
        Op::MemcpyStruct {
            three_d: true,
            stream: None,
        },
    ),
    f(
        "cuMemcpy3D_v2_ptds",
        Op::MemcpyStruct {
            three_d: true,
            stream: None,
        },
    ),
    f(
        "cuMemcpy3DAsync_v2",
        Op::MemcpyStruct {
            three_d: true,
            stream: Some(1),
        },
    ),
    f(
        "cuMemcpy3DAsync_v2_ptsz",
        Op::MemcpyStruct {
            three_d: true,
            stream: Some(1),
        },
    ),
    f("cuMemsetD8_v2", set(1, Linear, None)),
    f("cuMemsetD8_v2_ptds", set(1, Linear, None)),
    f("cuMemsetD16_v2", set(2, Linear, None)),
    f("cuMemsetD16_v2_ptds", set(2, Linear, None)),
    f("cuMemsetD32_v2", set(4, Linear, None)),
    f("cuMemsetD32_v2_ptds", set(4, Linear, None)),
    f("cuMemsetD8Async", set(1, Linear, Some(3))),
    f("cuMemsetD8Async_ptsz", set(1, Linear, Some(3))),
    f("cuMemsetD16Async", set(2, Linear, Some(3))),
    f("cuMemsetD16Async_ptsz", set(2, Linear, Some(3))),
    f("cuMemsetD32Async", set(4, Linear, Some(3))),
    f("cuMemsetD32Async_ptsz", set(4, Linear, Some(3))),
    f("cuMemsetD2D8_v2", set(1, Pitched, None)),
    f("cuMemsetD2D8_v2_ptds", set(1, Pitched, None)),
    f("cuMemsetD2D16_v2", set(2, Pitched, None)),
    f("cuMemsetD2D16_v2_ptds", set(2, Pitched, None)),
    f("cuMemsetD2D32_v2", set(4, Pitched, None)),
    f("cuMemsetD2D32_v2_ptds", set(4, Pitched, None)),
    f("cuMemsetD2D8Async", set(1, Pitched, Some(5))),
    f("cuMemsetD2D8Async_ptsz", set(1, Pitched, Some(5))),
    f("cuMemsetD2D16Async", set(2, Pitched, Some(5))),
    f("cuMemsetD2D16Async_ptsz", set(2, Pitched, Some(5))),
    f("cuMemsetD2D32Async", set(4, Pitched, Some(5))),
    f("cuMemsetD2D32Async_ptsz", set(4, Pitched, Some(5))),
    f(
        "cuMemAlloc_v2",
        Op::Alloc {
            memory: Memory::Device,
            stream: None,
        },
    ),
    f(
        "cuMemAllocPitch_v2",
        Op::Alloc {
            memory: Memory::DevicePitched,
            stream: None,
        },
    ),
    f(
        "cuMemAllocManaged",
        Op::Alloc {
            memory: Memory::Managed,
            stream: None,
        },
    ),
    f(
        "cuMemAllocHost_v2",
        Op::Alloc {
            memory: Memory::Host,
            stream: None,
        },
    ),
    f(
        "cuMemHostAlloc",
        Op::Alloc {
            memory: Memory::Host,
            stream: None,
        },
    ),
    f(
        "cuMemAllocAsync",
        Op::Alloc {
            memory: Memory::Device,
            stream: Some(2),
        },
    ),
    f(
        "cuMemAllocAsync_ptsz",
        Op::Alloc {
            memory: Memory::Device,
            stream: Some(2),
        },
    ),
    f(
        "cuMemAllocFromPoolAsync",
        Op::Alloc {
            memory: Memory::Device,
            stream: Some(3),
        },
    ),
    f(
        "cuMemAllocFromPoolAsync_ptsz",
        Op::Alloc {
            memory: Memory::Device,
            stream: Some(3),
        },
    ),
    f(
        "cuMemFree_v2",
        Op::Free {
            memory: Memory::Device,
            stream: None,
        },
    ),
    f(
        "cuMemFreeHost",
        Op::Free {
            memory: Memory::Host,
            stream: None,
        },
    ),
    f(
        "cuMemFreeAsync",
        Op::Free {
            memory: Memory::Device,
            stream: Some(1),
        },
    ),
    f(
        "cuMemFreeAsync_ptsz",
        Op::Free {
            memory: Memory::Device,
            stream: Some(1),
        },
    ),
    f("cuStreamSynchronize", Op::StreamSynchronize),
    f("cuStreamSynchronize_ptsz", Op::StreamSynchronize),
    f("cuCtxSynchronize", Op::CtxSynchronize),
    f("cuEventSynchronize", Op::EventSynchronize),
    f("cuStreamWaitEvent", Op::StreamWaitEvent),
    f("cuStreamWaitEvent_ptsz", Op::StreamWaitEvent),
    f("cuDeviceGet", Op::DeviceGet),
    f("cuCtxCreate_v2", Op::CtxCreate { device: 2 }),
    f("cuCtxCreate_v3", Op::CtxCreate { device: 4 }),
    f("cuCtxCreate_v4", Op::CtxCreate { device: 3 }),
    f("cuDevicePrimaryCtxRetain", Op::PrimaryCtxRetain),
    f("cuCtxSetCurrent", Op::CtxSetCurrent),
    f("cuCtxPushCurrent_v2", Op::CtxPushCurrent),
    f("cuCtxPopCurrent_v2", Op::CtxPopCurrent),
    f("cuCtxGetCurrent", Op::CtxGetCurrent),
    f("cuCtxGetDevice", Op::CtxGetDevice),
    f("cuCtxDestroy_v2", Op::CtxDestroy),
    f("cuStreamCreate", Op::StreamCreate),
    f("cuStreamCreateWithPriority", Op::StreamCreate),
    f("cuStreamGetCtx", Op::StreamGetCtx),
    f("cuStreamGetCtx_ptsz", Op::StreamGetCtx),
    f("cuStreamDestroy_v2", Op::StreamDestroy),
    f("cuModuleGetFunction", Op::GetFunction),
    f("cuLibraryGetKernel", Op::GetFunction),
    f("cuKernelGetFunction", Op::KernelGetFunction),
];

/// The function with table index `id`.
pub fn function(id: u16) -> Option<&'static DriverFunction> {
    FUNCTIONS.get(usize::from(id))
}

/// The table index of the function named `name`, if it is probed.
pub fn function_id(name: &str) -> Option<u16> {
    FUNCTIONS
        .iter()
        .position(|f| f.name == name)
        .map(|i| i as u16)
}

/// How many arguments the driver function `name` (of [`FUNCTIONS`], without
/// a per-thread suffix) takes, as `cuda.h` declares it.
pub(super) fn arity(name: &str) -> Option<usize> {
    Some(match name {
        "cuCtxSynchronize" => 0,
        "cuMemFree_v2"
        | "cuMemFreeHost"
        | "cuStreamSynchronize"
        | "cuEventSynchronize"
        | "cuCtxSetCurrent"
        | "cuCtxPushCurrent_v2"
        | "cuCtxPopCurrent_v2"
        | "cuCtxGetCurrent"
        | "cuCtxGetDevice"
        | "cuCtxDestroy_v2"
        | "cuStreamDestroy_v2"
        | "cuMemcpy2D_v2"
        | "cuMemcpy2DUnaligned_v2"
        | "cuMemcpy3D_v2" => 1,
        "cuGraphLaunch"
        | "cuMemcpy2DAsync_v2"
        | "cuMemcpy3DAsync_v2"
        | "cuMemAlloc_v2"
        | "cuMemAllocHost_v2"
        | "cuMemFreeAsync"
        | "cuDeviceGet"
        | "cuDevicePrimaryCtxRetain"
        | "cuStreamCreate"
        | "cuStreamGetCtx"
        | "cuKernelGetFunction" => 2,
        "cuMemcpy"
        | "cuMemcpyHtoD_v2"
        | "cuMemcpyDtoH_v2"
        | "cuMemcpyDtoD_v2"
        | "cuMemsetD8_v2"
        | "cuMemsetD16_v2"
        | "cuMemsetD32_v2"
        | "cuMemAllocManaged"
        | "cuMemHostAlloc"
        | "cuMemAllocAsync"
        | "cuStreamWaitEvent"
        | "cuCtxCreate_v2"
        | "cuStreamCreateWithPriority"
        | "cuModuleGetFunction"
        | "cuLibraryGetKernel" => 3,
        "cuLaunchKernelEx"
        | "cuMemcpyAsync"
        | "cuMemcpyHtoDAsync_v2"
        | "cuMemcpyDtoHAsync_v2"
        | "cuMemcpyDtoDAsync_v2"
        | "cuMemsetD8Async"
        | "cuMemsetD16Async"
        | "cuMemsetD32Async"
        | "cuMemAllocFromPoolAsync"
        | "cuCtxCreate_v4" => 4,
        "cuMemcpyPeer" | "cuMemsetD2D8_v2" | "cuMemsetD2D16_v2" | "cuMemsetD2D32_v2"
        | "cuMemAllocPitch_v2" | "cuCtxCreate_v3" => 5,
        "cuMemcpyPeerAsync" | "cuMemsetD2D8Async" | "cuMemsetD2D16Async" | "cuMemsetD2D32Async" => {
            6
        }
        "cuLaunchCooperativeKernel" => 10,
        "cuLaunchKernel" => 11,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use tracer_common::cuda::cookie;

    use super::*;
    use crate::cuda_api::DriverCalls;

    #[test]
    fn names_are_unique_and_ids_fit_the_cookie() {
        let names: HashSet<&str> = FUNCTIONS.iter().map(|f| f.name).collect();
        assert_eq!(names.len(), FUNCTIONS.len());
        assert!(FUNCTIONS.len() < usize::from(u16::MAX));
    }

    #[test]
    fn every_per_thread_variant_has_its_legacy_twin() {
        for f in FUNCTIONS.iter().filter(|f| f.per_thread_stream()) {
            let base = &f.name[..f.name.len() - 5];
            let twin = FUNCTIONS
                .iter()
                .find(|g| g.name == base)
                .unwrap_or_else(|| panic!("{} has no {base}", f.name));
            assert_eq!(twin.op, f.op, "{}", f.name);
        }
    }

    /// An entry-only function has nothing to read after the call, and
    /// its cookie says so; the others' cookies keep what their return reads.
    #[test]
    fn entry_only_functions_need_no_return() {
        let entry_only: Vec<&str> = FUNCTIONS
            .iter()
            .filter(|f| f.entry_only())
            .map(|f| f.name)
            .collect();
        assert!(entry_only.contains(&"cuCtxSetCurrent"), "{entry_only:?}");
        for (id, f) in FUNCTIONS.iter().enumerate() {
            let c = f.cookie(id as u16);
            assert_eq!(cookie::function(c), id as u16);
            assert_eq!(cookie::entry_only(c), f.entry_only(), "{}", f.name);
            if f.entry_only() {
                assert_eq!((f.out_arg(), f.name_arg()), (None, None), "{}", f.name);
                assert!(!matches!(f.op, Op::Launch | Op::LaunchEx), "{}", f.name);
            } else {
                assert_eq!(cookie::out_arg(c), f.out_arg().map(usize::from));
                assert_eq!(cookie::name_arg(c), f.name_arg().map(usize::from));
            }
        }
    }

    /// The flight recorder leaves out the per-launch lookup only; lookups
    /// by name, which name kernels loaded while it records, stay.
    #[test]
    fn the_always_on_set_leaves_out_only_the_per_launch_lookup() {
        let left_out: Vec<&str> = FUNCTIONS
            .iter()
            .filter(|f| !DriverCalls::AlwaysOn.probes(f))
            .map(|f| f.name)
            .collect();
        assert_eq!(left_out, ["cuKernelGetFunction"]);
        assert!(FUNCTIONS.iter().all(|f| DriverCalls::Every.probes(f)));
    }

    #[test]
    fn argument_indices_are_registers() {
        for f in FUNCTIONS {
            let indices: Vec<usize> = match f.op {
                Op::Memcpy { bytes, stream, .. } => {
                    [Some(bytes), stream].into_iter().flatten().collect()
                }
                Op::MemcpyStruct { stream, .. }
                | Op::Memset { stream, .. }
                | Op::Alloc { stream, .. }
                | Op::Free { stream, .. } => stream.into_iter().collect(),
                Op::CtxCreate { device } => vec![device],
                _ => vec![],
            };
            let out = [f.out_arg(), f.name_arg()].into_iter().flatten();
            let args = f.register_args();
            assert!(
                indices.iter().all(|&i| i < args) && out.into_iter().all(|i| usize::from(i) < args),
                "{}: {indices:?} of {args} arguments",
                f.name
            );
        }
    }

    /// Every function's number of arguments is known, and is what the
    /// stand-in driver's header (written to `cuda.h`'s signatures)
    /// declares, where it declares the function.
    #[test]
    fn arities_are_cuda_hs() {
        let header = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/cuda_driver.h"
        ))
        .expect("the stand-in driver's header");
        let mut declared = std::collections::HashMap::new();
        for entry in header.split("X(").skip(1) {
            let Some((name, rest)) = entry.split_once(',') else {
                continue;
            };
            let Some(params) = rest.split_once('(').and_then(|(_, p)| p.split_once(')')) else {
                continue;
            };
            let params = params.0.replace('\\', " ");
            let count = if params.trim() == "void" {
                0
            } else {
                params.split(',').count()
            };
            declared.insert(name.trim().to_string(), count);
        }
        let mut checked = 0;
        for f in FUNCTIONS {
            let arity = arity(f.base_name()).unwrap_or_else(|| panic!("{}: no arity", f.name));
            if let Some(&n) = declared.get(f.name) {
                assert_eq!(arity, n, "{}", f.name);
                checked += 1;
            }
        }
        assert!(checked > 30, "{checked} functions in the header");
    }
}
