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
