//! `cargo xtask bench`: the scheduling benchmark. One run measures, side by
//! side, what tracing costs a context-switch-heavy target (untraced, under
//! ebtrace, under an equivalent bpftrace program), the event rate ebtrace
//! sustains without drops, its peak memory per record, and how long it
//! takes to attach. Results go to stdout and `target/bench/sched.md`.
//! The CUDA benchmark ([`cuda`]) measures what a traced driver call costs;
//! its results go to `target/bench/cuda.md`.

mod bpf;
mod cuda;
mod cuda_links;
mod gpu_activity;
mod harness;
pub mod jax;
mod python_stacks;
mod recorder;
mod torch_ops;

pub use recorder::Target as RecorderTarget;
mod report;
pub mod serve;
mod traceme;
mod traceme_flood;
mod tracer;

use std::{
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    setup,
    util::{self, Workload, say},
};
use harness::{Configuration, write_report};
use tracer::Traced;

#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Rounds of the three alternating configurations.
    pub rounds: usize,
    /// Seconds each overhead run lets the target ping-pong.
    pub seconds: f64,
    /// Seconds of the long ebtrace capture for the memory figure (0: none).
    pub long_seconds: f64,
    /// CPU the target is pinned to (None: unpinned).
    pub target_cpu: Option<usize>,
    /// Which benchmarks to run.
    pub suite: Suite,
    /// Side of the matrix the jax loop's steps multiply.
    pub jax_matrix: u32,
    /// Seconds of launching per CUDA run.
    pub cuda_seconds: f64,
}

/// `cargo xtask bench --suite`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// Scheduling, then TraceMe, then CUDA.
    All,
    Sched,
    Traceme,
    Cuda,
    /// Only part c of the CUDA benchmark: attaching and releasing the
    /// driver probes, uprobe_multi against perf-event links.
    CudaLinks,
    /// What the agent delivers from CUPTI: device records per second
    /// without loss, and the target's memory.
    GpuActivity,
    /// The flight recorder of `ebtrace serve --retain 30s`: its cost while
    /// it runs, and how fast it answers `GetSnapshot`.
    Recorder,
    /// TraceMe through the agent end to end, on a jax process entering
    /// scopes as fast as it can: events per second kept, none missing,
    /// time after the window and ebtrace's memory.
    TracemeFlood,
    /// What sampling a CPython process's stacks at 99 Hz costs it: ebtrace
    /// with and without Python frames against py-spy, and the kernel's
    /// statistics of ebtrace's stack program. Measures the ebtrace already
    /// built (`target/release/ebtrace`).
    PythonStacks,
    /// What recording a PyTorch loop's ops costs it: ebtrace with and
    /// without ops against torch.profiler, taking turns in one process.
    /// Measures the ebtrace already built (`target/release/ebtrace`).
    TorchOps,
}

/// What ebtrace reported about one capture.
#[derive(Clone, Debug)]
pub struct EbtraceRun {
    /// From spawning ebtrace to its "probes attached" line.
    pub spawn_to_attached: Duration,
    /// The attach time ebtrace reports itself.
    pub reported_attach: Duration,
    pub window_s: f64,
    pub records: u64,
    pub dropped: u64,
    pub peak_rss_kib: u64,
}

#[derive(Clone, Debug)]
pub struct BpftraceRun {
    pub spawn_to_attaching: Duration,
    pub spawn_to_ready: Duration,
    pub switches: u64,
    pub wakeups: u64,
}

/// The scheduling suite's configurations: ebtrace through each of its
/// scheduler routes, beside the untraced target and bpftrace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    Untraced,
    /// ebtrace as it runs by default (raw tracepoints where the kernel has BTF).
    Ebtrace,
    /// ebtrace forced onto classic tracepoints (`EBTRACE_SCHED_TRACEPOINTS=classic`).
    EbtraceClassic,
    /// `ebtrace serve` between captures: its probes kept attached, paused.
    EbtraceKept,
    Bpftrace,
}

impl Configuration for Config {
    const ALL: &'static [Config] = &[
        Config::Untraced,
        Config::Ebtrace,
        Config::EbtraceClassic,
        Config::EbtraceKept,
        Config::Bpftrace,
    ];

    fn label(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::Ebtrace => "ebtrace",
            Config::EbtraceClassic => "ebtrace-classic",
            Config::EbtraceKept => "ebtrace-kept",
            Config::Bpftrace => "bpftrace",
        }
    }
}

/// One run of the ping-pong target under one configuration.
#[derive(Clone, Debug)]
pub struct Run {
    pub config: Config,
    /// None for the long memory run.
    pub round: Option<usize>,
    pub seconds: f64,
    pub round_trips_per_s: f64,
    pub ebtrace: Option<EbtraceRun>,
    pub bpftrace: Option<BpftraceRun>,
}

/// Everything a run needs to know about the machine and the binaries.
struct Bench {
    ebtrace: PathBuf,
    fixture: PathBuf,
    scratch: PathBuf,
    /// bpftrace ≥ 0.21 spells tracepoint arguments `args.x`, older `args->x`.
    bpftrace_args: &'static str,
    target_cpu: Option<usize>,
}

/// How long the flight recorder runs before its snapshot: longer than the
/// 30 s it keeps, so that it holds a whole window.
const RECORDER_SECONDS: f64 = 35.0;

/// Runs `opts.suite`; `against`, an earlier ebtrace binary, is measured
/// beside the one built here by the recorder and TraceMe flood suites;
/// the recorder suite runs `recorder_targets` (all when empty).
pub fn run_bench(
    root: &Path,
    opts: Options,
    against: Option<PathBuf>,
    recorder_targets: Vec<RecorderTarget>,
) -> Result<()> {
    util::require_root("bench")?;
    if opts.rounds == 0 || opts.seconds <= 0.0 {
        bail!("--rounds and --seconds must be positive");
    }
    setup::run_setup(root, setup::Options { bench: true })?;
    if opts.suite == Suite::PythonStacks {
        let md = python_stacks::run(root, opts)?;
        return write_report(root, "python-stacks.md", &md);
    }
    if opts.suite == Suite::TorchOps {
        let ebtrace = root.join("target/release/ebtrace");
        if !ebtrace.exists() {
            bail!(
                "{} is missing: build it first (cargo build --release)",
                ebtrace.display()
            );
        }
        let md = torch_ops::run(root, &ebtrace, opts)?;
        return write_report(root, "torch-ops.md", &md);
    }
    let ebtrace = util::build_release(root)?;
    if opts.suite == Suite::Recorder {
        let md = recorder::run(
            root,
            &ebtrace,
            &util::build_fixture(),
            &recorder::Options {
                seconds: RECORDER_SECONDS,
                retain: Duration::from_secs(30),
                target_cpu: opts.target_cpu,
                against,
                targets: recorder_targets,
            },
        )?;
        return write_report(root, "recorder.md", &md);
    }
    if opts.suite == Suite::TracemeFlood {
        let md = traceme_flood::run(
            root,
            &ebtrace,
            &traceme_flood::Options {
                rounds: opts.rounds,
                against,
            },
        )?;
        return write_report(root, "traceme_flood.md", &md);
    }
    if !matches!(
        opts.suite,
        Suite::Cuda | Suite::CudaLinks | Suite::GpuActivity
    ) {
        run_sched(root, &ebtrace, opts)?;
    }
    if matches!(opts.suite, Suite::All | Suite::Cuda | Suite::CudaLinks) {
        let md = cuda::run_bench(
            &ebtrace,
            cuda::Options {
                rounds: opts.rounds,
                seconds: opts.cuda_seconds,
                only_links: opts.suite == Suite::CudaLinks,
            },
        )?;
        write_report(root, "cuda.md", &md)?;
    }
    if matches!(opts.suite, Suite::All | Suite::GpuActivity) {
        let md = gpu_activity::run(
            &ebtrace,
            gpu_activity::Options {
                rounds: opts.rounds,
                seconds: opts.cuda_seconds,
            },
        )?;
        write_report(root, "gpu_activity.md", &md)?;
    }
    Ok(())
}

fn run_sched(root: &Path, ebtrace: &Path, opts: Options) -> Result<()> {
    let ebtrace = ebtrace.to_path_buf();
    let fixture = util::build_fixture();
    let bpftrace_version = util::stdout_of(Command::new("bpftrace").arg("--version"))
        .context("bpftrace --version failed")?;
    let bench = Bench {
        ebtrace: ebtrace.clone(),
        fixture,
        scratch: util::temp_dir(root, "bench")?,
        bpftrace_args: if bpftrace_at_least(&bpftrace_version, 0, 21) {
            "args."
        } else {
            "args->"
        },
        target_cpu: opts.target_cpu,
    };
    let env = report::Environment::probe(root, &ebtrace, &bpftrace_version, opts);
    if opts.suite == Suite::Traceme {
        return traceme::run_traceme_bench(root, &ebtrace, &env, opts.rounds, opts.jax_matrix);
    }
    say(format!(
        "bench: {} rounds x {:?}, {}s each, then one {}s ebtrace capture",
        opts.rounds,
        Config::ALL.iter().map(|c| c.label()).collect::<Vec<_>>(),
        opts.seconds,
        opts.long_seconds
    ));

    let started = Instant::now();
    let mut runs = Vec::new();
    for (round, config) in harness::rotated::<Config>(opts.rounds) {
        let run = bench.pingpong(config, Some(round), opts.seconds)?;
        say(format!(
            "round {}/{} {:<8} {:>9.0} round trips/s",
            round + 1,
            opts.rounds,
            config.label(),
            run.round_trips_per_s
        ));
        runs.push(run);
    }
    if opts.long_seconds > 0.0 {
        let run = bench.pingpong(Config::Ebtrace, None, opts.long_seconds)?;
        say(format!(
            "long ebtrace capture: {:.0} round trips/s, {} records",
            run.round_trips_per_s,
            run.ebtrace.as_ref().map_or(0, |e| e.records)
        ));
        runs.push(run);
    }
    let _ = std::fs::remove_dir_all(&bench.scratch);

    let md = report::render(&env, &runs, started.elapsed());
    write_report(root, "sched.md", &md)?;
    if opts.suite == Suite::All {
        traceme::run_traceme_bench(root, &ebtrace, &env, opts.rounds, opts.jax_matrix)?;
    }
    Ok(())
}

/// Parses "bpftrace v0.17.0" and compares with major.minor.
fn bpftrace_at_least(version: &str, major: u32, minor: u32) -> bool {
    let v = version.trim().trim_start_matches("bpftrace").trim();
    let mut parts = v.trim_start_matches('v').split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .unwrap_or(0)
    });
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    found >= (major, minor)
}

impl Bench {
    /// Runs the ping-pong target for `seconds` under `config`.
    ///
    /// ebtrace needs the target's pid and bpftrace its thread ids, so the
    /// target starts first and is stopped (SIGSTOP) right after it names
    /// its threads; the tracer starts and attaches; then the target
    /// continues (SIGCONT), runs `seconds` and is told to stop. The stopped
    /// time is taken out of the target's own elapsed time.
    fn pingpong(&self, config: Config, round: Option<usize>, seconds: f64) -> Result<Run> {
        let mut cmd = harness::pinned(&self.fixture, self.target_cpu);
        cmd.args(["--mode", "pingpong"]);
        let workload = Workload::start(cmd)?;
        let logdir = self.scratch.join("logs");
        let mut kept = None;
        let (mut tracer, paused) = harness::while_stopped(workload.pid, || {
            Ok(match config {
                Config::Untraced => None,
                Config::Ebtrace => Some(self.start_ebtrace(&workload, &logdir, seconds, false)?),
                Config::EbtraceClassic => {
                    Some(self.start_ebtrace(&workload, &logdir, seconds, true)?)
                }
                Config::EbtraceKept => {
                    kept = Some(serve::KeptProbes::start(&self.ebtrace, workload.pid)?);
                    None
                }
                Config::Bpftrace => Some(self.start_bpftrace(&workload)?),
            })
        })?;
        let paused_s = paused.as_secs_f64();
        thread::sleep(Duration::from_secs_f64(seconds));
        let counters = workload.stop()?;
        if let Some(server) = kept {
            server.stop()?;
        }
        let round_trips = counters["round_trips"].as_f64().context("round_trips")?;
        let elapsed_s = counters["elapsed_s"].as_f64().context("elapsed_s")?;
        let round_trips_per_s = round_trips / (elapsed_s - paused_s).max(1e-3);

        let mut run = Run {
            config,
            round,
            seconds,
            round_trips_per_s,
            ebtrace: None,
            bpftrace: None,
        };
        match (config, tracer.as_mut()) {
            (Config::Ebtrace | Config::EbtraceClassic, Some(t)) => {
                // ebtrace ends by itself once every traced process exited.
                let spawn_to_attached = t.last_mark().expect("an awaited line");
                let done = harness::finish_ebtrace(t)?;
                let s = &done.summary;
                run.ebtrace = Some(EbtraceRun {
                    spawn_to_attached,
                    reported_attach: s.attach(),
                    window_s: s.window_s(),
                    records: s.records.captured,
                    dropped: s.records.dropped,
                    peak_rss_kib: done.peak_rss_kib,
                });
                let _ = std::fs::remove_dir_all(&logdir);
            }
            (Config::Bpftrace, Some(t)) => run.bpftrace = Some(t.finish_bpftrace()?),
            _ => {}
        }
        Ok(run)
    }

    fn start_ebtrace(
        &self,
        w: &Workload,
        logdir: &Path,
        seconds: f64,
        classic: bool,
    ) -> Result<Traced> {
        // The summary (--json) is printed after the capture, and the
        // progress bar is hidden when stderr is not a terminal, so it costs
        // the target nothing. The duration only has to outlast the run.
        let duration = format!("{}s", (seconds * 2.0).ceil() + 60.0);
        let mut cmd = harness::ebtrace_command(&self.ebtrace, w.pid, &duration, logdir);
        if classic {
            cmd.env("EBTRACE_SCHED_TRACEPOINTS", "classic");
        }
        harness::spawn_ebtrace(cmd, harness::attached, Duration::from_secs(60))
    }

    fn start_bpftrace(&self, w: &Workload) -> Result<Traced> {
        let (ping, pong) = (w.tid("ping")?, w.tid("pong")?);
        let a = self.bpftrace_args;
        // Same filter as ebtrace's: the switched-out task belongs to the
        // target (`pid` is the tgid of the current task) or the switched-in
        // one is a target thread; wakeups of target threads. BEGIN fires
        // once the probes are attached and marks the start of tracing.
        let program = format!(
            "BEGIN {{ printf(\"xtask: bpftrace ready\\n\"); }}\n\
             tracepoint:sched:sched_switch /pid == {pid} || {a}next_pid == {ping} || {a}next_pid == {pong}/ \
             {{ @switch[cpu] = count(); }}\n\
             tracepoint:sched:sched_waking /{a}pid == {ping} || {a}pid == {pong}/ \
             {{ @wakeup[cpu] = count(); }}\n",
            pid = w.pid
        );
        let mut cmd = Command::new("bpftrace");
        cmd.args(["-e", &program]);
        let mut t = Traced::spawn(cmd)?;
        t.wait_line(|l| l.starts_with("Attaching "), Duration::from_secs(60))?;
        t.wait_line(
            |l| l.contains("xtask: bpftrace ready"),
            Duration::from_secs(60),
        )?;
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpftrace_versions() {
        assert!(!bpftrace_at_least("bpftrace v0.17.0", 0, 21));
        assert!(bpftrace_at_least("bpftrace v0.21.2", 0, 21));
        assert!(bpftrace_at_least("bpftrace v1.0.0-rc1", 0, 21));
    }
}
