//! The CUDA driver API as ebtrace sees it: which `libcuda.so.1` functions
//! are probed, where their arguments are, and what each call means.
//!
//! A function's index in [`FUNCTIONS`] is its id in the attach cookie and
//! in every `CudaCall` record, so attach (`attach::cuda`) and decoding
//! (`timeline::cuda`) read the same table. Signatures follow `cuda.h` (CUDA
//! 12); `_ptsz`/`_ptds` are the per-thread-default-stream builds of the same
//! function, whose NULL stream is the calling thread's own default stream.

use tracer_common::cuda::{REGISTER_ARGS, cookie, extra_words, shape};

/// Which entry program saves a function's arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// The six register arguments.
    Registers,
    /// Registers and the stack arguments 7..9 (`cuLaunchKernel`).
    Stack,
    /// Registers and the `CUlaunchConfig` that argument 0 points to.
    LaunchConfig,
    /// Registers and the `CUDA_MEMCPY2D` that argument 0 points to.
    Memcpy2D,
    /// Registers and the `CUDA_MEMCPY3D` that argument 0 points to.
    Memcpy3D,
}

impl Shape {
    /// The eBPF program that implements this shape.
    pub fn program(self) -> &'static str {
        match self {
            Shape::Registers => shape::REGISTERS,
            Shape::Stack => shape::STACK,
            Shape::LaunchConfig => shape::LAUNCH_CONFIG,
            Shape::Memcpy2D => shape::MEMCPY2D,
            Shape::Memcpy3D => shape::MEMCPY3D,
        }
    }

    /// How many words of a call's `extra` this shape's program fills, and
    /// so its records carry.
    pub fn extra_words(self) -> usize {
        match self {
            Shape::Registers => extra_words::REGISTERS,
            Shape::Stack => extra_words::STACK,
            Shape::LaunchConfig => extra_words::LAUNCH_CONFIG,
            Shape::Memcpy2D => extra_words::MEMCPY2D,
            Shape::Memcpy3D => extra_words::MEMCPY3D,
        }
    }
}

/// Direction of a copy as the function's name states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// Host to device.
    HtoD,
    /// Device to host.
    DtoH,
    /// Device to device.
    DtoD,
    /// Between the memories of two devices (contexts).
    Peer,
    /// `cuMemcpy`/`cuMemcpyAsync`: the driver infers it from the pointers.
    Inferred,
    /// 2D/3D copies: read from the struct's memory types.
    FromStruct,
}

/// How many elements a memset writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemsetExtent {
    /// `(dst, value, N[, stream])`.
    Linear,
    /// `(dst, pitch, value, width, height[, stream])`.
    Pitched,
}

/// What kind of memory an allocation or free is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Device memory.
    Device,
    /// Pitched device memory: `(dptr*, pitch*, width, height, elem)`.
    DevicePitched,
    /// Unified (managed) memory.
    Managed,
    /// Page-locked host memory.
    Host,
}

/// What a call does, with the argument indices that matter (registers
/// 0..6; stack and struct words are in the record's `extra`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `(f, gx, gy, gz, bx, by | bz, shmem, stream, ...)`: the last three on the stack.
    Launch,
    /// `(const CUlaunchConfig *, f, params, extra)`.
    LaunchEx,
    /// `(CUgraphExec, stream)`.
    GraphLaunch,
    /// `(dst, src, bytes[, stream])`, peer: `(dst, dstCtx, src, srcCtx, bytes[, stream])`.
    Memcpy {
        /// The copy's direction.
        kind: CopyKind,
        /// Index of the byte count argument.
        bytes: usize,
        /// Index of the stream argument; none for a synchronous copy.
        stream: Option<usize>,
    },
    /// `(const CUDA_MEMCPY2D/3D *[, stream])`.
    MemcpyStruct {
        /// A `CUDA_MEMCPY3D` rather than a `CUDA_MEMCPY2D`.
        three_d: bool,
        /// Index of the stream argument; none for a synchronous copy.
        stream: Option<usize>,
    },
    /// A memset, `cuMemsetD*`.
    Memset {
        /// Bytes per element: 1, 2 or 4.
        element_bytes: u64,
        /// Where the element count is.
        extent: MemsetExtent,
        /// Index of the stream argument; none for a synchronous memset.
        stream: Option<usize>,
    },
    /// `(ptr *out, bytes, ...[, stream])`.
    Alloc {
        /// The kind of memory allocated.
        memory: Memory,
        /// Index of the stream argument of a stream-ordered allocation.
        stream: Option<usize>,
    },
    /// `(ptr[, stream])`.
    Free {
        /// The kind of memory freed.
        memory: Memory,
        /// Index of the stream argument of a stream-ordered free.
        stream: Option<usize>,
    },
    /// `(stream)`.
    StreamSynchronize,
    /// `()`.
    CtxSynchronize,
    /// `(event)`.
    EventSynchronize,
    /// `(stream, event, flags)`.
    StreamWaitEvent,
    /// `(CUdevice *out, int ordinal)`.
    DeviceGet,
    /// `(CUcontext *out, ..., CUdevice dev)` with `dev` at this index; the
    /// new context becomes the thread's current one.
    CtxCreate {
        /// Index of the `CUdevice` argument.
        device: usize,
    },
    /// `(CUcontext *out, CUdevice dev)`.
    PrimaryCtxRetain,
    /// `(CUcontext)`.
    CtxSetCurrent,
    /// `(CUcontext)`.
    CtxPushCurrent,
    /// `(CUcontext *out)`.
    CtxPopCurrent,
    /// `(CUcontext *out)`.
    CtxGetCurrent,
    /// `(CUdevice *out)`.
    CtxGetDevice,
    /// `(CUcontext)`.
    CtxDestroy,
    /// `(CUstream *out, flags[, priority])`.
    StreamCreate,
    /// `(stream, CUcontext *out)`.
    StreamGetCtx,
    /// `(stream)`.
    StreamDestroy,
    /// `(CUfunction/CUkernel *out, module/library, const char *name)`.
    GetFunction,
    /// `(CUfunction *out, CUkernel)`.
    KernelGetFunction,
}

/// One probed driver function.
#[derive(Clone, Copy, Debug)]
pub struct DriverFunction {
    /// The exported symbol.
    pub name: &'static str,
    /// What a call does.
    pub op: Op,
}

impl DriverFunction {
    /// Which entry program saves its arguments.
    pub fn shape(&self) -> Shape {
        match self.op {
            Op::Launch => Shape::Stack,
            Op::LaunchEx => Shape::LaunchConfig,
            Op::MemcpyStruct { three_d: false, .. } => Shape::Memcpy2D,
            Op::MemcpyStruct { three_d: true, .. } => Shape::Memcpy3D,
            _ => Shape::Registers,
        }
    }

    /// The argument the return probe dereferences (8 bytes).
    pub fn out_arg(&self) -> Option<u8> {
        match self.op {
            Op::Alloc { .. }
            | Op::DeviceGet
            | Op::CtxCreate { .. }
            | Op::PrimaryCtxRetain
            | Op::CtxPopCurrent
            | Op::CtxGetCurrent
            | Op::CtxGetDevice
            | Op::StreamCreate
            | Op::GetFunction
            | Op::KernelGetFunction => Some(0),
            Op::StreamGetCtx => Some(1),
            _ => None,
        }
    }

    /// The `const char *` name argument copied after a successful call.
    pub fn name_arg(&self) -> Option<u8> {
        matches!(self.op, Op::GetFunction).then_some(2)
    }

    /// Built for per-thread default streams: NULL means the thread's own stream.
    pub fn per_thread_stream(&self) -> bool {
        self.name.ends_with("_ptsz") || self.name.ends_with("_ptds")
    }

    /// Probed at its entry only: its arguments say all a trace shows of it,
    /// and it returns at once, so its time and result are not worth a
    /// second uprobe (about 0.8 µs on the calling thread). The frameworks
    /// set the current context around most of their driver calls (jax: 4
    /// of its 11 calls a step), and a stream's wait for an event is queued
    /// without waiting.
    pub fn entry_only(&self) -> bool {
        matches!(
            self.op,
            Op::CtxSetCurrent | Op::CtxPushCurrent | Op::StreamWaitEvent
        )
    }

    /// How many arguments it takes in registers (x86-64 SysV: the first
    /// six), which its records carry.
    pub fn register_args(&self) -> usize {
        arity(self.base_name()).map_or(REGISTER_ARGS, |n| n.min(REGISTER_ARGS))
    }

    /// Its name without the per-thread-stream suffix.
    fn base_name(&self) -> &'static str {
        let name = self.name;
        name.strip_suffix("_ptsz")
            .or_else(|| name.strip_suffix("_ptds"))
            .unwrap_or(name)
    }

    /// The attach cookie of the function with table index `id`.
    pub fn cookie(&self, id: u16) -> u64 {
        let extra = self.shape().extra_words();
        let args = self.register_args();
        if self.entry_only() {
            cookie::encode_entry_only(id, args, extra)
        } else {
            cookie::encode(id, args, extra, self.out_arg(), self.name_arg())
        }
    }
}

/// How many arguments the driver function `name` (of [`FUNCTIONS`], without
/// a per-thread suffix) takes, as `cuda.h` declares it.
fn arity(name: &str) -> Option<usize> {
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

/// Which of [`FUNCTIONS`] a capture probes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DriverCalls {
    /// Every one: a capture shows every driver call the program made.
    #[default]
    Every,
    /// All but `cuKernelGetFunction`, the flight recorder's: the CUDA
    /// runtime looks a kernel's function up before each launch (jax: 2 of
    /// its 11 calls a step), only for the name a lookup by name gave it,
    /// and the recorder's snapshots ask the driver for the names instead.
    AlwaysOn,
}

impl DriverCalls {
    /// Whether `function` is probed.
    pub fn probes(self, function: &DriverFunction) -> bool {
        match self {
            DriverCalls::Every => true,
            DriverCalls::AlwaysOn => function.op != Op::KernelGetFunction,
        }
    }
}

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

use CopyKind::{DtoD, DtoH, HtoD, Inferred, Peer};
use MemsetExtent::{Linear, Pitched};

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

/// `CUresult` names of the codes a trace is likely to show.
pub fn result_name(code: u32) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        720 => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

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
