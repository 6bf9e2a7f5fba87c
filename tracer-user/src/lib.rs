//! ebtrace: an eBPF-assisted tracer for ML workloads.
//!
//! Data flows one way: **probes and agent → collector → timeline →
//! sinks**, with `capture`, `server` and `cli` above. The modules, floor by
//! floor from the bottom (one bullet per floor); a module uses only those
//! on its own floor and below, which `tests/floors.rs` checks:
//! - the process and its files: [`procfs`] (what `/proc` says about the
//!   targets), [`symbols`] (ELF symbols, addresses and stacks inside running
//!   processes), [`clock`] (`ClockSync`, the one place where kernel time
//!   becomes wall time), [`cuda_api`] (the CUDA driver functions probed and
//!   their signatures), [`error`] (the errors ebtrace reports, each saying
//!   what to do);
//! - [`collect`]: the records entering ebtrace, drained from the probes'
//!   ring buffer and decoded, and what the in-process agents hand over;
//! - what records: [`attach`] (loads the eBPF object and attaches its
//!   programs), [`agent`] (the in-process agent, from ebtrace's side:
//!   loading it into a target with ptrace, and the framework's own profiler
//!   session it runs there);
//! - [`timeline`]: the format-independent model of what each thread did;
//! - what is written: [`sink`] (XSpace, Perfetto and pprof encoding, the
//!   XProf log directory layout), [`metrics`] (Prometheus metrics);
//! - [`capture`]: one capture from checks to what it recorded (which
//!   `timeline::assemble` turns into a timeline), and the flight recorder,
//!   a capture that never ends and keeps only its last seconds;
//! - [`server`]: `ebtrace serve`, the gRPC ProfilerService (the flight
//!   recorder's commands and snapshots among its requests) and the HTTP
//!   endpoints; [`remote`] (`ebtrace capture`: asks servers on many hosts
//!   for their traces);
//! - [`cli`]: the `ebtrace` command line.

#![warn(missing_docs)]

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
pub mod remote;
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
