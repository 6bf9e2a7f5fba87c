//! The CUDA driver API as ebtrace sees it: which `libcuda.so.1` functions
//! are probed, where their arguments are, and what each call means.
//!
//! A function's index in [`FUNCTIONS`] is its id in the attach cookie and
//! in every `CudaCall` record, so attach (`attach::cuda`) and decoding
//! (`timeline::cuda`) read the same table. Signatures follow `cuda.h` (CUDA
//! 12); `_ptsz`/`_ptds` are the per-thread-default-stream builds of the same
//! function, whose NULL stream is the calling thread's own default stream.
//!
//! - `driver_function`: what a function's calls do ([`Op`]) and how it is
//!   probed ([`Shape`], [`DriverFunction::cookie`]);
//! - `table`: the functions probed ([`FUNCTIONS`]);
//! - `decode`: a call's words as typed fields ([`CallArgs`]);
//! - `results`: `CUresult` names.

mod decode;
mod driver_function;
mod results;
mod table;

pub use decode::{
    CallArgs, KernelLaunch, LaunchConfig, LinearCopy, MemoryType, Memset, Stream, StructCopy,
};
pub use driver_function::{CopyKind, DriverCalls, DriverFunction, Memory, MemsetExtent, Op, Shape};
pub use results::result_name;
pub use table::{FUNCTIONS, function, function_id};
