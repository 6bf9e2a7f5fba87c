//! ebtrace's developer tasks: `cargo xtask <setup|demo|test|bench>`.

mod bench;
mod demo;
mod setup;
mod test;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "ebtrace's developer tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install the toolchains, bpf-linker, Debian packages and the XProf
    /// venv (.venv) that the other tasks need; does nothing if all is there.
    Setup {
        /// Also install what `bench` needs (bpftrace).
        #[arg(long)]
        bench: bool,
    },
    /// Build, trace the fixture for 2 s into ./ebtrace-logs and check that
    /// XProf can read the trace (as root).
    Demo {
        /// Trace a GPU workload instead: a PyTorch matmul loop where a GPU
        /// and PyTorch are there, else the stand-in CUDA driver's workload
        /// with the stand-in CUPTI; the trace then has `/device:GPU:n`
        /// planes with what the GPU ran.
        #[arg(long)]
        gpu: bool,
    },
    /// fmt, clippy and every test, with nothing allowed to skip (as root).
    /// Arguments after `--` go to the test binaries.
    Test {
        #[arg(last = true)]
        libtest_args: Vec<String>,
    },
    /// The benchmarks: scheduling (overhead against bpftrace, event rate,
    /// memory and attach time; target/bench/sched.md), TraceMe
    /// (target/bench/traceme.md) and CUDA (ns per traced cuLaunchKernel,
    /// launch rate, attaching and releasing the driver probes;
    /// target/bench/cuda.md). As root.
    Bench {
        /// Rounds of untraced / ebtrace / bpftrace runs.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Seconds per run.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Seconds of the long ebtrace capture for the memory figure (0: skip).
        #[arg(long, default_value_t = 10.0)]
        long_seconds: f64,
        /// CPU to pin the target to: both its threads then share one CPU,
        /// which makes the ping-pong rate stable run to run.
        #[arg(long, default_value_t = 0, conflicts_with = "unpinned")]
        target_cpu: usize,
        /// Let the scheduler place the target's threads (noisy: ping and
        /// pong on one CPU or on two give rates 5x apart).
        #[arg(long)]
        unpinned: bool,
        /// Benchmark `ebtrace serve` instead: response time of 2 s capture
        /// requests and memory; writes target/bench/serve.md (uses
        /// --rounds and the target pinning).
        #[arg(long)]
        serve: bool,
        /// With --serve, --suite recorder or --suite traceme-flood: an
        /// earlier ebtrace binary,
        /// measured in the same run after the one built here on each
        /// target, for a before/after table.
        #[arg(long)]
        against: Option<std::path::PathBuf>,
        /// Which benchmarks: all, sched, traceme (TraceMe cost per event
        /// against bpftrace, event rate, memory) or cuda (ns per traced
        /// cuLaunchKernel against bpftrace, launch rate).
        #[arg(long, value_enum, default_value_t = bench::Suite::All)]
        suite: bench::Suite,
        /// Seconds of launching per CUDA run.
        #[arg(long, default_value_t = 3.0)]
        cuda_seconds: f64,
        /// With --suite recorder: only these targets (comma-separated).
        #[arg(long, value_enum, value_delimiter = ',')]
        recorder_targets: Vec<bench::RecorderTarget>,
        /// Side of the square matrix each step of the jax loop of the
        /// TraceMe suite multiplies: 64 (default) makes about 7,000 steps a
        /// second here, 8 a loop three times as dense in TraceMe events.
        #[arg(long, default_value_t = bench::jax::DEFAULT_MATRIX, value_parser = clap::value_parser!(u32).range(1..=4096))]
        jax_matrix: u32,
    },
}

fn main() {
    // One line with the whole cause chain; no backtrace even when
    // RUST_BACKTRACE is set (these errors are for people, not debuggers).
    if let Err(e) = run() {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let root = util::repo_root();
    match cli.command {
        Task::Setup { bench } => setup::run_setup(&root, setup::Options { bench }),
        Task::Demo { gpu } => demo::run_demo(&root, gpu),
        Task::Test { libtest_args } => test::run_tests(&root, &libtest_args),
        Task::Bench {
            rounds,
            target_cpu,
            unpinned,
            serve: true,
            against,
            ..
        } => bench::serve::run(
            &root,
            bench::serve::Options {
                rounds,
                target_cpu: (!unpinned).then_some(target_cpu),
                against,
            },
        ),
        Task::Bench {
            rounds,
            seconds,
            long_seconds,
            target_cpu,
            unpinned,
            serve: false,
            suite,
            cuda_seconds,
            against,
            recorder_targets,
            jax_matrix,
        } => {
            if against.is_some()
                && !matches!(suite, bench::Suite::Recorder | bench::Suite::TracemeFlood)
            {
                anyhow::bail!(
                    "--against measures --serve, --suite recorder or --suite traceme-flood; \
                     drop it or add one"
                );
            }
            if !recorder_targets.is_empty() && suite != bench::Suite::Recorder {
                anyhow::bail!("--recorder-targets picks targets of --suite recorder; add it");
            }
            bench::run_bench(
                &root,
                bench::Options {
                    rounds,
                    seconds,
                    long_seconds,
                    target_cpu: (!unpinned).then_some(target_cpu),
                    suite,
                    cuda_seconds,
                    jax_matrix,
                },
                against,
                recorder_targets,
            )
        }
    }
}
