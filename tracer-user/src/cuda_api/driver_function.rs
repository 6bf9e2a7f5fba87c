//! What a probed driver function is: what its calls do, with the
//! positions of the arguments that matter, and how its entry and return
//! probes are set up for it.

use tracer_common::cuda::{REGISTER_ARGS, cookie, extra_words, shape};

use super::table::arity;

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
    pub(super) fn base_name(&self) -> &'static str {
        let name = self.name;
        name.strip_suffix("_ptsz")
            .or_else(|| name.strip_suffix("_ptds"))
            .unwrap_or(name)
    }

    /// The attach cookie of the function with table index `id`.
    pub fn cookie(&self, id: u16) -> u64 {
        let extra = self.shape().extra_words();
        let args = self.register_args();
        let cookie = if self.entry_only() {
            cookie::encode_entry_only(id, args, extra)
        } else {
            cookie::encode(id, args, extra, self.out_arg(), self.name_arg())
        };
        if self.submits_work() {
            cookie | cookie::SUBMITS
        } else {
            cookie
        }
    }

    /// Whether its calls submit work to a GPU: launches, copies, memsets.
    pub fn submits_work(&self) -> bool {
        matches!(
            self.op,
            Op::Launch
                | Op::LaunchEx
                | Op::GraphLaunch
                | Op::Memcpy { .. }
                | Op::MemcpyStruct { .. }
                | Op::Memset { .. }
        )
    }
}

/// Which of [`FUNCTIONS`](super::FUNCTIONS) a capture probes.
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
