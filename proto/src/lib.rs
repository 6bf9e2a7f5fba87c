//! Protobuf messages and gRPC stubs for talking to XProf and TensorFlow/JAX profiler clients.
//!
//! - [`tensorflow::profiler`]: the XSpace file format (`<host>.xplane.pb`) that XProf reads.
//! - [`tensorflow`]: `ProfileOptions`, the `ProfilerService` gRPC service that `jax.collect_profile`,
//!   `tf.profiler.experimental.client.trace` and XProf's capture button call, and the Cloud TPU
//!   `ProfileAnalysis` service, each with client and server stubs.
//! - [`perfetto::protos`]: Perfetto's native trace format (`perfetto_trace.pb`), pruned to the
//!   packets ebtrace writes; field numbers are Perfetto's own.
//! - [`perftools::profiles`]: the pprof profile (`go tool pprof`, Parca, Pyroscope), with
//!   pprof's own field numbers.
//!
//! - [`xspace_parts`]: an encoded XSpace read a plane, a line and an event at a time.
//!
//! The `.proto` sources under `proto/` are our own, written from the published field numbers of
//! the TSL profiler protos; `build.rs` compiles them with `protox`, so no `protoc` is needed.
#![warn(missing_docs)]

pub mod xspace_parts;

/// Package `tensorflow`: profiler options and the profiler gRPC services.
#[allow(
    clippy::allow_attributes_without_reason,
    missing_docs,
    reason = "the gRPC stubs tonic generates allow lints without reasons; the rest is generated \
              from the .proto files, whose comments carry the documentation"
)]
pub mod tensorflow {
    tonic::include_proto!("tensorflow");

    /// Package `tensorflow.profiler`: the XSpace trace container.
    pub mod profiler {
        tonic::include_proto!("tensorflow.profiler");
    }
}

/// Package `perfetto.protos`: the Perfetto trace (`Trace` of `TracePacket`s).
pub mod perfetto {
    /// Perfetto's trace packets, pruned to the fields ebtrace writes.
    #[allow(
        missing_docs,
        reason = "generated from the .proto files, whose comments carry the documentation"
    )]
    pub mod protos {
        tonic::include_proto!("perfetto.protos");
    }
}

/// Package `perftools.profiles`: the pprof CPU profile.
pub mod perftools {
    /// pprof's `Profile` and the messages it is made of.
    #[allow(
        missing_docs,
        reason = "generated from the .proto files, whose comments carry the documentation"
    )]
    pub mod profiles {
        tonic::include_proto!("perftools.profiles");
    }
}
