//! ebtrace: an eBPF-assisted tracer for ML workloads.
//!
//! Data flows one way: **probes → collector → timeline → sinks**.
//! - [`attach`]: loads the eBPF object and attaches its programs;
//! - [`collect`]: drains the ring buffer into decoded records;
//! - [`cuda_api`]: the CUDA driver functions probed and their signatures;
//! - [`clock`]: `ClockSync`, the one place where kernel time becomes wall time;
//! - [`timeline`]: the format-independent model of what each thread did;
//! - [`sink`]: XSpace encoding and the XProf log directory layout;
//! - [`capture`]: one capture from checks to what it recorded (which
//!   `timeline::assemble` turns into a timeline);
//! - [`procfs`]: what `/proc` says about the targets;
//! - [`server`]: `ebtrace serve`, the gRPC ProfilerService;
//! - [`symbols`]: ELF symbol lookup and addresses inside running processes;
//! - [`cli`]: the `ebtrace` command line.

pub mod agent;
pub mod attach;
pub mod capture;
pub mod cli;
pub mod clock;
pub mod collect;
pub mod cuda_api;
pub mod error;
pub mod metrics;
pub mod procfs;
pub mod server;
pub mod sink;
pub mod symbols;
pub mod timeline;

pub use error::{Error, Result};

/// Serves allocations of 1 MiB and more (records, timelines, XSpaces) with
/// their own mappings: freeing one gives its memory back at once, so an idle
/// `ebtrace serve` does not keep a finished capture's pages, and growing one
/// remaps it instead of copying. (glibc otherwise raises this threshold as
/// large blocks are freed, up to 32 MiB, and keeps what falls below it.)
/// The `ebtrace` binary sets it first thing; benchmarks of the library do
/// too.
pub fn large_buffers_from_mmap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: a plain allocator setting, made before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}
