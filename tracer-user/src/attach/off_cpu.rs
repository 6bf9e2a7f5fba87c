//! `OffCpuStacks`: where threads waited. For a thread of a recorded
//! process that waited in a system call for at least a given time, a raw
//! tracepoint on `sys_exit` writes its user stack as the call returns:
//! the record of a CPU stack sample, marked off-CPU, with the call's
//! number (see `tracer-ebpf/src/off_cpu.rs`).
//!
//! The tracepoint sets every thread on the machine on the kernel's slower
//! system-call path while it is attached (about 100 ns a call on a 2-core
//! VM, see BENCHMARKS.md), so the stacks are taken only when asked for,
//! and never by the always-on flight recorder.

use std::time::Duration;

use aya::{maps::Array, programs::RawTracePoint};
use tracer_common::stack::names;

use super::ProbeSet;
use crate::error::{Error, Result};

/// The off-CPU stack probe family.
pub struct OffCpuStacks;

impl OffCpuStacks {
    /// Takes the stacks of waits of at least `min` from now on.
    pub fn attach(set: &mut ProbeSet, min: Duration) -> Result<()> {
        let min_us = u32::try_from(min.as_micros()).unwrap_or(u32::MAX).max(1);
        let map = set
            .ebpf()
            .map_mut(names::OFF_CPU_MIN_US)
            .expect("map is in the object");
        Array::<_, u32>::try_from(map)
            .and_then(|mut a| a.set(0, min_us, 0))
            .map_err(|e| Error::Map {
                name: names::OFF_CPU_MIN_US,
                source: Box::new(e),
            })?;
        let program: &mut RawTracePoint = set
            .ebpf()
            .program_mut(names::OFF_CPU_PROGRAM)
            .expect("program is in the object")
            .try_into()
            .expect("program is a raw tracepoint program");
        program.load().map_err(|source| Error::Attach {
            what: format!("program {} (verifier)", names::OFF_CPU_PROGRAM),
            source: Box::new(source),
        })?;
        let link = program
            .attach(names::OFF_CPU_TRACEPOINT)
            .and_then(|id| program.take_link(id))
            .map_err(|source| Error::Attach {
                what: format!(
                    "the raw tracepoint {} for off-CPU stacks (CONFIG_FTRACE_SYSCALLS); \
                     leave out --off-cpu-min to trace without them",
                    names::OFF_CPU_TRACEPOINT
                ),
                source: Box::new(source),
            })?;
        set.keep_link(link);
        Ok(())
    }
}
