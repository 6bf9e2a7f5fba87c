//! Loading ebtrace's eBPF object and attaching its programs.
//!
//! [`probe_set`] owns the loaded object and its shared maps; one module per
//! probe family attaches its programs on it: [`sched`] for the scheduler
//! tracepoints, [`cuda`] for the CUDA driver uprobes (with [`libcuda`]
//! finding the library and [`uprobe_multi`] linking its programs), [`traceme`]
//! for TraceMe events of jaxlib / TensorFlow / libtpu processes, [`cpu_sample`] for
//! CPU stack samples, [`off_cpu`] for the stacks of threads that blocked long. [`tracefs`] finds and checks the kernel's
//! tracepoints first.

pub mod btf;
pub mod cpu_sample;
pub mod cuda;
pub mod libcuda;
pub mod links;
pub mod off_cpu;
pub mod probe_set;
pub mod python;
pub mod sched;
pub mod tracefs;
pub mod traceme;
pub mod uprobe_multi;

pub use cpu_sample::CpuSampler;
pub use cuda::CudaProbe;
pub use off_cpu::OffCpuStacks;
pub use probe_set::{LaunchStacks, ProbeSet, ProbeSetConfig, ProbeStats};
pub use python::read_python_frames;
pub use sched::SchedProbe;
pub use traceme::{TraceMeOptions, TraceMeProbe, restore_children_of_session};

/// The eBPF object built by `build.rs` (empty when built with `AYA_BUILD_SKIP`).
pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer-ebpf"));
