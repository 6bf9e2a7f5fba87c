//! Sinks: where a finished timeline goes.
//!
//! [`xspace`] turns the timeline into XProf's `XSpace`; [`logdir`] writes
//! it where XProf and TensorBoard look for runs. [`perfetto`] writes
//! Perfetto's native trace beside it. [`pprof`] writes CPU stack samples as
//! a pprof profile. [`held_dir`] is how every one of them writes a file.

pub mod held_dir;
pub mod logdir;
pub mod perfetto;
pub mod pprof;
pub mod xspace;
