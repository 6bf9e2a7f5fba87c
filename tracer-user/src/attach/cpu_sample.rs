//! `CpuSampler`: CPU stack sampling. One software clock event per online
//! CPU ticks at the sampling rate and runs the `cpu_sample` program, which
//! writes the stacks of whatever thread of a recorded process it finds on
//! the CPU (see `tracer-ebpf/src/cpu_sample.rs`).
//!
//! System-wide per-CPU events rather than one per traced thread: threads
//! the target starts later are sampled too, and the cost is one event per
//! CPU whatever the number of threads.

use aya::programs::{
    PerfEvent,
    perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
};
use tracer_common::stack;

use super::ProbeSet;
use crate::error::{Error, Result};

/// Sampling rate of `/debug/pprof/profile` when none is asked for: the
/// 100 Hz of Go's runtime profiler, off by one so that the ticks do not
/// march in step with work on a 10 ms period.
pub const DEFAULT_HZ: u64 = 99;
/// Sampling rate of the flight recorder when none is asked for: it samples
/// for as long as it runs, on every node, so at the rate Parca's agent
/// takes for the same job (prime, out of step with periodic work too). At
/// 99 Hz the samples of one busy thread took about 0.4% of a CPU on an
/// H200 machine, most of the recorder's budget.
pub const RECORDER_DEFAULT_HZ: u32 = 19;
/// The highest rate accepted: beyond it, the ticks themselves would cost
/// the traced program noticeable time.
pub const MAX_HZ: u64 = 10_000;

/// The stack-sampling probe family.
pub struct CpuSampler;

impl CpuSampler {
    /// Attaches the sampling program to a clock event ticking `hz` times a
    /// second on every online CPU.
    pub fn attach(set: &mut ProbeSet, hz: u64) -> Result<()> {
        let cpus = aya::util::online_cpus().map_err(|(what, source)| {
            Error::io(format!("listing the online CPUs ({what})"), source)
        })?;
        let program: &mut PerfEvent = set
            .ebpf()
            .program_mut(stack::names::PROGRAM)
            .expect("program is in the object")
            .try_into()
            .expect("program is a perf_event program");
        program.load().map_err(|source| Error::Attach {
            what: format!("program {} (verifier)", stack::names::PROGRAM),
            source: Box::new(source),
        })?;
        let mut links = Vec::with_capacity(cpus.len());
        for cpu in cpus {
            let link = program
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Frequency(hz.clamp(1, MAX_HZ)),
                    false,
                )
                .and_then(|id| program.take_link(id))
                .map_err(|source| Error::Attach {
                    what: format!(
                        "a {hz} Hz CPU clock event on CPU {cpu} (perf_event_open: needs \
                         CAP_PERFMON or root, and kernel.perf_event_paranoid allowing it)"
                    ),
                    source: Box::new(source),
                })?;
            links.push(link);
        }
        for link in links {
            set.keep_link(link);
        }
        Ok(())
    }
}
