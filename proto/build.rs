//! Generates the message types and gRPC stubs from `proto/`.
//!
//! The `.proto` files are parsed by `protox` (pure Rust), so building needs no
//! `protoc` binary.

use std::path::PathBuf;

/// Every file that defines a message or service; imports resolve from `proto/`.
const PROTOS: &[&str] = &[
    "tensorflow/profiler/xplane.proto",
    "tensorflow/profiler_options.proto",
    "tensorflow/profiler_service.proto",
    "tensorflow/profiler_analysis.proto",
    "perfetto/perfetto_trace.proto",
    "perftools/profile.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let include = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    println!("cargo:rerun-if-changed={}", include.display());
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", include.join(proto).display());
    }

    let fds = protox::compile(PROTOS, [&include])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
