//! Loading ebtrace's eBPF object and attaching its programs.
//!
//! One module per probe family: [`sched`] for the scheduler tracepoints.
//! [`tracefs`] finds and checks the kernel's tracepoints first.

pub mod sched;
pub mod tracefs;

pub use sched::{ProbeStats, SchedProbe, SchedProbeConfig};

/// The eBPF object built by `build.rs` (empty when built with `AYA_BUILD_SKIP`).
pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer-ebpf"));
