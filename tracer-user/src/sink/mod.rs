//! Sinks: where a finished timeline goes.
//!
//! [`xspace`] turns the timeline into XProf's `XSpace`; [`logdir`] writes
//! it where XProf and TensorBoard look for runs.

pub mod logdir;
pub mod xspace;
