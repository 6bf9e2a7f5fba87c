//! A `CudaCall` record's words decoded into what the call said: one typed
//! value per kind of call, read from the argument positions its
//! [`Op`] and [`Shape`](super::Shape) give, so that the rest of ebtrace
//! reads fields rather than words.

use tracer_common::cuda::CudaCall;

use super::{CopyKind, DriverFunction, Memory, MemsetExtent, Op};

/// `CU_STREAM_LEGACY`: the context's legacy default stream, by name.
const STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, by name.
const STREAM_PER_THREAD: u64 = 0x2;

/// The stream a call names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The context's legacy default stream: NULL given to a legacy build
    /// of a function, or `CU_STREAM_LEGACY`.
    LegacyDefault,
    /// The calling thread's default stream: NULL given to a per-thread
    /// build (`_ptsz`/`_ptds`), or `CU_STREAM_PER_THREAD`.
    PerThreadDefault,
    /// A stream the program created (`CUstream`).
    Handle(u64),
}

impl Stream {
    /// The stream that the `CUstream` argument `word` of a call of
    /// `function` names.
    pub fn from_word(word: u64, function: &DriverFunction) -> Stream {
        match word {
            0 if function.per_thread_stream() => Stream::PerThreadDefault,
            0 | STREAM_LEGACY => Stream::LegacyDefault,
            STREAM_PER_THREAD => Stream::PerThreadDefault,
            handle => Stream::Handle(handle),
        }
    }
}

/// A launch's grid and block dimensions and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in x, y and z.
    pub grid: [u32; 3],
    /// Threads per block in x, y and z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_memory_bytes: u32,
}

/// A kernel launch: `cuLaunchKernel*`, `cuLaunchCooperativeKernel*` or
/// `cuLaunchKernelEx*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLaunch {
    /// The `CUfunction` (or `CUkernel`) launched.
    pub function: u64,
    /// Its grid, blocks and shared memory.
    pub config: LaunchConfig,
    /// The stream it was launched on.
    pub stream: Stream,
}

/// A linear copy: `cuMemcpy*` but the 2D/3D ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearCopy {
    /// Its direction as the function's name states it.
    pub kind: CopyKind,
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// The stream the copy runs on: the default stream for a synchronous one.
    pub stream: Stream,
    /// Whether the function is an `Async` one, given a stream.
    pub asynchronous: bool,
}

/// A `CUmemorytype`: where one side of a 2D/3D copy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryType {
    /// `CU_MEMORYTYPE_HOST`.
    Host,
    /// `CU_MEMORYTYPE_DEVICE`.
    Device,
    /// `CU_MEMORYTYPE_ARRAY`.
    Array,
    /// `CU_MEMORYTYPE_UNIFIED`.
    Unified,
    /// Any other value.
    Unknown,
}

impl MemoryType {
    fn from_word(word: u64) -> MemoryType {
        match word {
            1 => MemoryType::Host,
            2 => MemoryType::Device,
            3 => MemoryType::Array,
            4 => MemoryType::Unified,
            _ => MemoryType::Unknown,
        }
    }
}

/// A 2D or 3D copy, from its `CUDA_MEMCPY2D`/`CUDA_MEMCPY3D`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StructCopy {
    /// Where the source is.
    pub src_memory: MemoryType,
    /// Where the destination is.
    pub dst_memory: MemoryType,
    /// Bytes per row.
    pub width_bytes: u64,
    /// Rows per layer.
    pub height: u64,
    /// Layers: 1 for a 2D copy.
    pub depth: u64,
    /// The stream the copy runs on: the default stream for a synchronous one.
    pub stream: Stream,
    /// Whether the function is an `Async` one, given a stream.
    pub asynchronous: bool,
}

impl StructCopy {
    /// Bytes copied (saturating).
    pub fn bytes(&self) -> u64 {
        self.width_bytes
            .saturating_mul(self.height)
            .saturating_mul(self.depth)
    }
}

/// A memset: `cuMemsetD*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memset {
    /// Destination address.
    pub dst: u64,
    /// Bytes per element: 1, 2 or 4.
    pub element_bytes: u64,
    /// Elements written: the count, or width times height (saturating).
    pub elements: u64,
    /// The stream the memset runs on: the default stream for a synchronous one.
    pub stream: Stream,
    /// Whether the function is an `Async` one, given a stream.
    pub asynchronous: bool,
}

impl Memset {
    /// Bytes written (saturating).
    pub fn bytes(&self) -> u64 {
        self.elements.saturating_mul(self.element_bytes)
    }
}

/// What one driver call said, by kind of call. Handles and devices the
/// call returned (through its out-pointer) are meaningful only when the
/// call succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallArgs {
    /// A kernel launch.
    Launch(KernelLaunch),
    /// `cuGraphLaunch`.
    GraphLaunch {
        /// The `CUgraphExec` launched.
        graph_exec: u64,
        /// The stream it was launched on.
        stream: Stream,
    },
    /// A linear copy.
    Memcpy(LinearCopy),
    /// A 2D or 3D copy.
    MemcpyStruct(StructCopy),
    /// A memset.
    Memset(Memset),
    /// An allocation.
    Alloc {
        /// The kind of memory allocated.
        memory: Memory,
        /// Bytes asked for (width times height for pitched memory).
        bytes: u64,
        /// The address returned.
        address: u64,
        /// The stream of a stream-ordered allocation.
        stream: Option<Stream>,
    },
    /// A free.
    Free {
        /// The kind of memory freed.
        memory: Memory,
        /// The address freed.
        address: u64,
        /// The stream of a stream-ordered free.
        stream: Option<Stream>,
    },
    /// `cuStreamSynchronize`.
    StreamSynchronize {
        /// The stream waited for.
        stream: Stream,
    },
    /// `cuCtxSynchronize`.
    CtxSynchronize,
    /// `cuEventSynchronize`.
    EventSynchronize {
        /// The `CUevent` waited for.
        event: u64,
    },
    /// `cuStreamWaitEvent`: work queued on a stream.
    StreamWaitEvent {
        /// The stream made to wait.
        stream: Stream,
        /// The `CUevent` it waits for.
        event: u64,
    },
    /// `cuDeviceGet`.
    DeviceGet {
        /// The `CUdevice` returned, as its 32 bits.
        device: u32,
        /// The ordinal asked for, as its 32 bits.
        ordinal: u32,
    },
    /// `cuCtxCreate*`: the new context becomes the thread's current one.
    CtxCreate {
        /// The `CUdevice` the context is on, as its 32 bits.
        device: u32,
        /// The `CUcontext` returned.
        context: u64,
    },
    /// `cuDevicePrimaryCtxRetain`.
    PrimaryCtxRetain {
        /// The `CUdevice` whose primary context it is, as its 32 bits.
        device: u32,
        /// The `CUcontext` returned.
        context: u64,
    },
    /// `cuCtxSetCurrent`.
    CtxSetCurrent {
        /// The `CUcontext` made current (NULL: none).
        context: u64,
    },
    /// `cuCtxPushCurrent`.
    CtxPushCurrent {
        /// The `CUcontext` pushed.
        context: u64,
    },
    /// `cuCtxPopCurrent`.
    CtxPopCurrent {
        /// The `CUcontext` popped.
        context: u64,
    },
    /// `cuCtxGetCurrent`.
    CtxGetCurrent {
        /// The current `CUcontext` (NULL: none).
        context: u64,
    },
    /// `cuCtxGetDevice`.
    CtxGetDevice {
        /// The current context's `CUdevice`, as its 32 bits.
        device: u32,
    },
    /// `cuCtxDestroy`.
    CtxDestroy {
        /// The `CUcontext` destroyed.
        context: u64,
    },
    /// `cuStreamCreate*`.
    StreamCreate {
        /// The `CUstream` created.
        stream: u64,
    },
    /// `cuStreamGetCtx`.
    StreamGetCtx {
        /// The `CUstream` asked about.
        stream: u64,
        /// Its `CUcontext`.
        context: u64,
    },
    /// `cuStreamDestroy`.
    StreamDestroy {
        /// The `CUstream` destroyed.
        stream: u64,
    },
    /// `cuModuleGetFunction` / `cuLibraryGetKernel`: a lookup by name.
    GetFunction {
        /// The `CUfunction` or `CUkernel` returned.
        handle: u64,
    },
    /// `cuKernelGetFunction`.
    KernelGetFunction {
        /// The `CUkernel` asked about.
        kernel: u64,
        /// Its `CUfunction` in the current context.
        function: u64,
    },
}

impl CallArgs {
    /// What the call `rec` of `function` said.
    pub fn decode(function: &DriverFunction, rec: &CudaCall) -> CallArgs {
        let words = Words {
            function,
            args: &rec.args,
            extra: &rec.extra,
            out: rec.out_value,
        };
        let (a, out) = (words.args, words.out);
        match function.op {
            Op::Launch => CallArgs::Launch(words.launch()),
            Op::LaunchEx => CallArgs::Launch(words.launch_ex()),
            Op::GraphLaunch => CallArgs::GraphLaunch {
                graph_exec: a[0],
                stream: words.stream(a[1]),
            },
            Op::Memcpy {
                kind,
                bytes,
                stream,
            } => CallArgs::Memcpy(words.linear_copy(kind, bytes, stream)),
            Op::MemcpyStruct { three_d, stream } => {
                CallArgs::MemcpyStruct(words.struct_copy(three_d, stream))
            }
            Op::Memset {
                element_bytes,
                extent,
                stream,
            } => CallArgs::Memset(words.memset(element_bytes, extent, stream)),
            Op::Alloc { memory, stream } => words.alloc(memory, stream),
            Op::Free { memory, stream } => CallArgs::Free {
                memory,
                address: a[0],
                stream: stream.map(|i| words.stream(a[i])),
            },
            Op::StreamSynchronize => CallArgs::StreamSynchronize {
                stream: words.stream(a[0]),
            },
            Op::CtxSynchronize => CallArgs::CtxSynchronize,
            Op::EventSynchronize => CallArgs::EventSynchronize { event: a[0] },
            Op::StreamWaitEvent => CallArgs::StreamWaitEvent {
                stream: words.stream(a[0]),
                event: a[1],
            },
            Op::DeviceGet => CallArgs::DeviceGet {
                device: out as u32,
                ordinal: a[1] as u32,
            },
            Op::CtxCreate { device } => CallArgs::CtxCreate {
                device: a[device] as u32,
                context: out,
            },
            Op::PrimaryCtxRetain => CallArgs::PrimaryCtxRetain {
                device: a[1] as u32,
                context: out,
            },
            Op::CtxSetCurrent => CallArgs::CtxSetCurrent { context: a[0] },
            Op::CtxPushCurrent => CallArgs::CtxPushCurrent { context: a[0] },
            Op::CtxPopCurrent => CallArgs::CtxPopCurrent { context: out },
            Op::CtxGetCurrent => CallArgs::CtxGetCurrent { context: out },
            Op::CtxGetDevice => CallArgs::CtxGetDevice { device: out as u32 },
            Op::CtxDestroy => CallArgs::CtxDestroy { context: a[0] },
            Op::StreamCreate => CallArgs::StreamCreate { stream: out },
            Op::StreamGetCtx => CallArgs::StreamGetCtx {
                stream: a[0],
                context: out,
            },
            Op::StreamDestroy => CallArgs::StreamDestroy { stream: a[0] },
            Op::GetFunction => CallArgs::GetFunction { handle: out },
            Op::KernelGetFunction => CallArgs::KernelGetFunction {
                kernel: a[1],
                function: out,
            },
        }
    }

    /// The function (or kernel) handle a launch runs; `None` for the other
    /// calls.
    pub fn launched_function(&self) -> Option<u64> {
        match self {
            CallArgs::Launch(launch) => Some(launch.function),
            _ => None,
        }
    }
}

/// The words of one call of `function`.
struct Words<'a> {
    function: &'a DriverFunction,
    args: &'a [u64; 6],
    extra: &'a [u64; 8],
    out: u64,
}

impl Words<'_> {
    fn stream(&self, word: u64) -> Stream {
        Stream::from_word(word, self.function)
    }

    /// The stream of work that a function with its stream argument at
    /// `index`, if any, submits: the NULL (default) stream for a
    /// synchronous one.
    fn work_stream(&self, index: Option<usize>) -> Stream {
        self.stream(index.map_or(0, |i| self.args[i]))
    }

    /// `(f, gx, gy, gz, bx, by | bz, shmem, stream, ...)`: the last three
    /// on the stack.
    fn launch(&self) -> KernelLaunch {
        let (a, x) = (self.args, self.extra);
        KernelLaunch {
            function: a[0],
            config: LaunchConfig {
                grid: [a[1] as u32, a[2] as u32, a[3] as u32],
                block: [a[4] as u32, a[5] as u32, x[0] as u32],
                shared_memory_bytes: x[1] as u32,
            },
            stream: self.stream(x[2]),
        }
    }

    /// `(const CUlaunchConfig *, f, ...)`: the struct's `unsigned int`
    /// fields two to a word, then its stream.
    fn launch_ex(&self) -> KernelLaunch {
        let x = self.extra;
        let (gx, gy) = halves(x[0]);
        let (gz, bx) = halves(x[1]);
        let (by, bz) = halves(x[2]);
        KernelLaunch {
            function: self.args[1],
            config: LaunchConfig {
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared_memory_bytes: halves(x[3]).0,
            },
            stream: self.stream(x[4]),
        }
    }

    fn linear_copy(&self, kind: CopyKind, bytes: usize, stream: Option<usize>) -> LinearCopy {
        let a = self.args;
        // A peer copy's contexts follow each of its pointers.
        let (dst, src) = match kind {
            CopyKind::Peer => (a[0], a[2]),
            _ => (a[0], a[1]),
        };
        LinearCopy {
            kind,
            dst,
            src,
            bytes: a[bytes],
            stream: self.work_stream(stream),
            asynchronous: stream.is_some(),
        }
    }

    /// The `CUDA_MEMCPY2D`/`3D` fields the probe saved: source memory
    /// type, -, destination memory type, -, width in bytes, height, depth.
    fn struct_copy(&self, three_d: bool, stream: Option<usize>) -> StructCopy {
        let x = self.extra;
        StructCopy {
            src_memory: MemoryType::from_word(x[0]),
            dst_memory: MemoryType::from_word(x[2]),
            width_bytes: x[4],
            height: x[5],
            depth: if three_d { x[6] } else { 1 },
            stream: self.work_stream(stream),
            asynchronous: stream.is_some(),
        }
    }

    fn memset(&self, element_bytes: u64, extent: MemsetExtent, stream: Option<usize>) -> Memset {
        let a = self.args;
        Memset {
            dst: a[0],
            element_bytes,
            elements: match extent {
                MemsetExtent::Linear => a[2],
                MemsetExtent::Pitched => a[3].saturating_mul(a[4]),
            },
            stream: self.work_stream(stream),
            asynchronous: stream.is_some(),
        }
    }

    fn alloc(&self, memory: Memory, stream: Option<usize>) -> CallArgs {
        let a = self.args;
        CallArgs::Alloc {
            memory,
            bytes: match memory {
                Memory::DevicePitched => a[2].saturating_mul(a[3]),
                _ => a[1],
            },
            address: self.out,
            stream: stream.map(|i| self.stream(a[i])),
        }
    }
}

/// Splits a word holding two `unsigned int` struct fields.
fn halves(word: u64) -> (u32, u32) {
    (word as u32, (word >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind};

    use super::*;
    use crate::cuda_api::{function, function_id};

    fn decode(name: &str, args: &[u64], extra: &[u64], out: u64) -> CallArgs {
        let id = function_id(name).unwrap_or_else(|| panic!("{name} not in the table"));
        let mut rec = CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 0, 0),
            tid: 1,
            tgid: 1,
            start_ns: 0,
            function: id,
            flags: 0,
            result: 0,
            args: [0; 6],
            extra: [0; 8],
            out_value: out,
        };
        rec.args[..args.len()].copy_from_slice(args);
        rec.extra[..extra.len()].copy_from_slice(extra);
        CallArgs::decode(function(id).expect("in the table"), &rec)
    }

    #[test]
    fn launch_words_decode_into_function_config_and_stream() {
        let launch = decode(
            "cuLaunchKernel",
            &[0xf00, 16, 2, 1, 256, 1],
            &[1, 48, 0x5a],
            0,
        );
        let expected = KernelLaunch {
            function: 0xf00,
            config: LaunchConfig {
                grid: [16, 2, 1],
                block: [256, 1, 1],
                shared_memory_bytes: 48,
            },
            stream: Stream::Handle(0x5a),
        };
        assert_eq!(launch, CallArgs::Launch(expected));
        assert_eq!(launch.launched_function(), Some(0xf00));
        // `CUlaunchConfig`'s `unsigned int` fields come two to a word.
        let launch_ex = decode(
            "cuLaunchKernelEx",
            &[0x7000, 0xf1],
            &[8 | 2 << 32, 1 | 128 << 32, 1 | 1 << 32, 1024, 0x77],
            0,
        );
        let expected = KernelLaunch {
            function: 0xf1,
            config: LaunchConfig {
                grid: [8, 2, 1],
                block: [128, 1, 1],
                shared_memory_bytes: 1024,
            },
            stream: Stream::Handle(0x77),
        };
        assert_eq!(launch_ex, CallArgs::Launch(expected));
    }

    #[test]
    fn a_null_stream_is_the_default_stream_of_the_functions_build() {
        let stream = |name: &str, args: &[u64]| match decode(name, args, &[], 0) {
            CallArgs::Memcpy(copy) => (copy.stream, copy.asynchronous),
            other => panic!("{name}: {other:?}"),
        };
        let legacy = stream("cuMemcpyHtoDAsync_v2", &[0xd0, 0x10, 64, 0]);
        assert_eq!(legacy, (Stream::LegacyDefault, true));
        let per_thread = stream("cuMemcpyHtoDAsync_v2_ptsz", &[0xd0, 0x10, 64, 0]);
        assert_eq!(per_thread, (Stream::PerThreadDefault, true));
        let synchronous = stream("cuMemcpy_ptds", &[0xd0, 0x10, 64]);
        assert_eq!(synchronous, (Stream::PerThreadDefault, false));
        let named = stream("cuMemcpyAsync", &[0xd0, 0x10, 64, STREAM_PER_THREAD]);
        assert_eq!(named, (Stream::PerThreadDefault, true));
    }

    #[test]
    fn copy_and_memset_sizes_decode() {
        let peer = decode(
            "cuMemcpyPeerAsync",
            &[0xd0, 0xc0, 0x10, 0xc1, 4096, 0x5a],
            &[],
            0,
        );
        let CallArgs::Memcpy(peer) = peer else {
            panic!("{peer:?}")
        };
        assert_eq!((peer.dst, peer.src, peer.bytes), (0xd0, 0x10, 4096));
        assert_eq!(peer.stream, Stream::Handle(0x5a));
        let two_d = decode(
            "cuMemcpy2DAsync_v2",
            &[0x7100, 0x77],
            &[1, 0, 2, 0xd0, 64, 3],
            0,
        );
        let CallArgs::MemcpyStruct(two_d) = two_d else {
            panic!("{two_d:?}")
        };
        assert_eq!(
            (two_d.src_memory, two_d.dst_memory),
            (MemoryType::Host, MemoryType::Device)
        );
        assert_eq!((two_d.bytes(), two_d.depth), (192, 1));
        let memset = decode("cuMemsetD2D32_v2", &[0xd0, 256, 7, 16, 3], &[], 0);
        let CallArgs::Memset(memset) = memset else {
            panic!("{memset:?}")
        };
        assert_eq!((memset.elements, memset.bytes()), (48, 192));
        assert_eq!(memset.stream, Stream::LegacyDefault);
    }
}
