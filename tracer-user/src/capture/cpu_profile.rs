//! A CPU profile of running processes: their stacks sampled for a while
//! (see [`CpuSampler`]), symbolized, as a pprof profile. Nothing is loaded
//! into the processes; the sampling links go when the profile ends or
//! ebtrace exits, however it exits.

use std::{
    collections::HashMap,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use crate::{
    attach::{CpuSampler, CudaProbe, LaunchStacks, ProbeSet, ProbeSetConfig, read_python_frames},
    clock::realtime_ns,
    collect::{Collector, Record, StackSample},
    cuda_api::DriverCalls,
    error::Result,
    procfs::TargetProcess,
    sink::pprof::{self, SamplingInfo},
    symbols::stacks::StackSymbolizer,
};

/// Room for about 200 samples (each with its 16 KiB copy of the user
/// stack); the program wakes the drain once a quarter of it is used.
const RING_BYTES: u32 = 4 * 1024 * 1024;
/// How often the ring is drained while sampling.
const DRAIN_PERIOD: Duration = Duration::from_millis(100);

/// A finished CPU profile.
pub struct CpuProfile {
    /// The gzipped pprof profile.
    pub pprof: Vec<u8>,
    /// Stack samples in it.
    pub samples: usize,
    /// Samples the kernel could not hand over (ring buffer full).
    pub dropped: u64,
    /// How long it sampled (shorter than asked when `stop` was set).
    pub sampled_for: Duration,
}

/// Samples the stacks of `targets` `hz` times a second per CPU for
/// `duration`, or until `stop` is set (the profile then covers what was
/// sampled until then).
pub fn take_cpu_profile(
    targets: &[TargetProcess],
    duration: Duration,
    hz: u64,
    stop: &AtomicBool,
) -> Result<CpuProfile> {
    super::check_privileges()?;
    let mut set = ProbeSet::load(&ProbeSetConfig {
        ring_bytes: RING_BYTES,
        launch_stacks: LaunchStacks::Every,
        ..ProbeSetConfig::default()
    })?;
    for t in targets {
        set.add_target(t.pid)?;
    }
    read_python_frames(&mut set, targets)?;
    // The driver calls that submit work, for their stacks: the profile's
    // launches. A process without the driver, or one it cannot be probed
    // in, still gets its CPU profile.
    let cuda = CudaProbe::attach(&mut set, targets, DriverCalls::Every)
        .ok()
        .and_then(|(cuda, _)| cuda);
    for t in targets {
        set.open_window(t.pid)?;
    }
    let mut collector = Collector::new(set.take_events());
    let start_unix_ns = realtime_ns() as i64;
    let started = Instant::now();
    CpuSampler::attach(&mut set, hz)?;
    let mut samples = Vec::new();
    let mut thread_names = HashMap::new();
    let mut batch = Vec::new();
    let mut symbolizer = StackSymbolizer::default();
    while !stop.load(Ordering::Relaxed) && started.elapsed() < duration {
        collector.wait(DRAIN_PERIOD.min(duration.saturating_sub(started.elapsed())));
        let before = samples.len();
        keep_samples(&mut collector, &mut batch, &mut samples);
        // Names of threads, and where the processes have their code, are
        // kept for those that exit before the end.
        note_thread_names(targets, &samples[before..], &mut thread_names);
        for s in &samples[before..] {
            symbolizer.note_stack(s.stack());
        }
    }
    let sampled_for = started.elapsed();
    let dropped = set.stats().map(|s| s.dropped()).unwrap_or(0);
    drop(cuda);
    set.detach();
    let before = samples.len();
    keep_samples(&mut collector, &mut batch, &mut samples);
    note_thread_names(targets, &samples[before..], &mut thread_names);
    for s in &samples[before..] {
        symbolizer.note_stack(s.stack());
    }
    let process_names = targets.iter().map(|t| (t.pid, t.name.clone())).collect();
    let info = SamplingInfo {
        hz,
        start_unix_ns,
        duration_ns: sampled_for.as_nanos() as i64,
    };
    let pprof = pprof::encode(
        &samples,
        &thread_names,
        &process_names,
        &info,
        &mut symbolizer,
    );
    Ok(CpuProfile {
        pprof,
        samples: samples.len(),
        dropped,
        sampled_for,
    })
}

fn keep_samples(
    collector: &mut Collector,
    batch: &mut Vec<Record>,
    samples: &mut Vec<StackSample>,
) {
    collector.drain(batch);
    samples.extend(batch.drain(..).filter_map(|r| match r {
        Record::StackSample(s) => Some(*s),
        _ => None,
    }));
}

/// Adds the names of threads of `new` samples not named yet.
fn note_thread_names(
    targets: &[TargetProcess],
    new: &[StackSample],
    names: &mut HashMap<u32, String>,
) {
    if new.iter().all(|s| names.contains_key(&s.tid)) {
        return;
    }
    for t in targets {
        for (tid, stat) in t.threads() {
            names.entry(tid).or_insert(stat.comm);
        }
    }
}
