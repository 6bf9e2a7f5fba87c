//! The GPU activity benchmark (`--suite gpu-activity`): what ebtrace's
//! agent delivers from CUPTI, on the stand-in CUDA workload (simulated
//! GPU, stand-in CUPTI writing records in the real layouts) launching as
//! fast as it can on every thread.
//!
//! Per round, one capture of a workload already running:
//! - **device records per second** that reach the trace (kernels, copies,
//!   memsets), and how many CUPTI dropped (the goal: none);
//! - **the target's memory**: its resident set before the capture and its
//!   peak during it (`VmHWM` after resetting it through `clear_refs`), the
//!   growth being the agent, its CUPTI buffers and CUPTI's own.

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use ebtrace_tests::cuda::CudaWorkload;

use super::harness::{self, status_kib};
use crate::util::{median, say};

#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub rounds: usize,
    /// Seconds of each capture.
    pub seconds: f64,
}

#[derive(Clone, Copy, Debug)]
struct Round {
    records: u64,
    dropped: u64,
    rss_before_kib: u64,
    rss_peak_kib: u64,
}

/// Runs the rounds; the Markdown report.
pub fn run(ebtrace: &Path, opts: Options) -> Result<String> {
    let mut rounds = Vec::new();
    for round in 0..opts.rounds {
        let r = one_round(ebtrace, opts.seconds)?;
        say(format!(
            "gpu activity round {}/{}: {:.0} device records/s, {} dropped, target peak +{} MiB",
            round + 1,
            opts.rounds,
            r.records as f64 / opts.seconds,
            r.dropped,
            r.rss_peak_kib.saturating_sub(r.rss_before_kib) / 1024
        ));
        rounds.push(r);
    }
    Ok(render(&rounds, opts))
}

fn one_round(ebtrace: &Path, seconds: f64) -> Result<Round> {
    let mut workload = CudaWorkload::start_with_cupti(&["--iters", "100000000"], &[]);
    workload.go();
    std::thread::sleep(Duration::from_millis(300));
    let pid = workload.pid;
    let kib = |field: &str| {
        status_kib(pid, field).with_context(|| format!("no {field} in /proc/{pid}/status"))
    };
    let rss_before_kib = kib("VmRSS")?;
    // "5" resets the peak resident set (VmHWM) to the current one.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").context("resetting VmHWM")?;
    let logdir = std::env::temp_dir().join(format!("ebtrace-gpu-activity-{pid}"));
    let summary = harness::run_ebtrace(harness::ebtrace_command(
        ebtrace,
        pid,
        &format!("{seconds}s"),
        &logdir,
    ));
    let rss_peak_kib = kib("VmHWM")?;
    let _ = std::fs::remove_dir_all(&logdir);
    drop(workload);
    let activity = summary?
        .process(pid)
        .and_then(|p| p.gpu_activity.clone())
        .context("no GPU activity in ebtrace's summary")?;
    Ok(Round {
        records: activity.kernels + activity.copies + activity.memsets,
        dropped: activity.dropped,
        rss_before_kib,
        rss_peak_kib,
    })
}

fn render(rounds: &[Round], opts: Options) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## GPU activity through the agent (stand-in CUPTI), {} rounds of {} s\n",
        opts.rounds, opts.seconds
    );
    let _ = writeln!(
        md,
        "| round | device records/s in the trace | dropped by CUPTI | target RSS before | peak during | growth |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|");
    for (i, r) in rounds.iter().enumerate() {
        let _ = writeln!(
            md,
            "| {} | {:.0} | {} | {} MiB | {} MiB | {} MiB |",
            i + 1,
            r.records as f64 / opts.seconds,
            r.dropped,
            r.rss_before_kib / 1024,
            r.rss_peak_kib / 1024,
            r.rss_peak_kib.saturating_sub(r.rss_before_kib) / 1024
        );
    }
    let rates: Vec<f64> = rounds
        .iter()
        .map(|r| r.records as f64 / opts.seconds)
        .collect();
    let growth: Vec<f64> = rounds
        .iter()
        .map(|r| r.rss_peak_kib.saturating_sub(r.rss_before_kib) as f64 / 1024.0)
        .collect();
    let _ = writeln!(
        md,
        "\nMedian: {:.0} device records/s delivered, {} dropped in all; the target grew by \
         {:.0} MiB (at most {:.0} MiB; the agent lends CUPTI at most 64 MiB of buffers).",
        median(&rates),
        rounds.iter().map(|r| r.dropped).sum::<u64>(),
        median(&growth),
        growth.iter().copied().fold(0.0, f64::max)
    );
    md
}
