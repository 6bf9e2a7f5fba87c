//! The PyTorch ops benchmark (`--suite torch-ops`): what recording a
//! PyTorch loop's ops costs it, ebtrace against PyTorch's own profiler.
//!
//! The target is `tests/fixtures/python/torch_ops_loop.py` (a CPU training
//! loop, one intra-op thread, each step a `record_function` range) from the
//! venv's PyTorch, one process for the whole run: the machine's speed
//! drifts over seconds, so the configurations take turns within it, phase
//! after phase, the order rotated round by round: untraced; under `ebtrace
//! --no-torch-ops` (scheduling only); under `ebtrace` (scheduling and its
//! ops); under `ebtrace --torch-op-sampling 0.01` (one op in a hundred,
//! drawn by PyTorch: what a recorder's budget could afford); under `torch.profiler.profile` with CPU activities, started and
//! stopped inside the program (SIGUSR2). Each phase's figure is the median
//! time a step took, from the loop's own log of each step's start and end,
//! over `--seconds` from when the configuration is in place.
//!
//! What an op costs: each step makes the same RecordFunctions (the
//! profiler counts them), so the time a step takes under ebtrace, less the
//! time under `ebtrace --no-torch-ops`, divided by them, is what ebtrace's
//! callbacks add to each (both ends); the same against the untraced step
//! for torch.profiler.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, ChildStdout, Command, Stdio},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};

use super::{
    Options,
    harness::{self, Configuration, each, ratio},
    report::Environment,
};
use crate::util::{self, median, say};

/// How long the loop runs before the first phase.
const WARM_UP: Duration = Duration::from_secs(3);
/// From a configuration being in place to its measured phase: ebtrace's
/// window open, the profiler's first steps.
const SETTLE: Duration = Duration::from_millis(300);
/// After a phase: ebtrace writing its trace, the profiler converting.
const AFTER: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Config {
    Untraced,
    EbtraceNoOps,
    Ebtrace,
    EbtraceSampled,
    EbtraceShapes,
    TorchProfiler,
}

/// The chance `Config::EbtraceSampled` records an op with, for its
/// label as well.
macro_rules! sampling {
    () => {
        "0.01"
    };
}
const SAMPLING: &str = sampling!();

impl Configuration for Config {
    const ALL: &'static [Config] = &[
        Config::Untraced,
        Config::EbtraceNoOps,
        Config::Ebtrace,
        Config::EbtraceSampled,
        Config::EbtraceShapes,
        Config::TorchProfiler,
    ];

    fn label(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::EbtraceNoOps => "ebtrace --no-torch-ops",
            Config::Ebtrace => "ebtrace (ops)",
            Config::EbtraceSampled => concat!("ebtrace --torch-op-sampling ", sampling!()),
            Config::EbtraceShapes => "ebtrace --torch-op-shapes",
            Config::TorchProfiler => "torch.profiler (CPU)",
        }
    }
}

/// One measured phase: its configuration and wall-clock span (ns).
struct Phase {
    config: Config,
    round: usize,
    from: f64,
    to: f64,
}

/// The loop, and its stdout.
struct Target {
    child: Child,
    stdout: BufReader<ChildStdout>,
    pid: u32,
}

impl Target {
    fn start(python: &Path, script: &Path, cpu: Option<usize>) -> Result<Target> {
        let mut cmd = harness::pinned(python, cpu);
        let mut child = cmd
            .arg(script)
            // The profiler's phases are measured, not summarized.
            .arg("--no-summary")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the PyTorch loop")?;
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let first = read_json(&mut stdout)?;
        let pid = first["pid"].as_u64().context("no pid")? as u32;
        Ok(Target { child, stdout, pid })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_json(stdout: &mut BufReader<ChildStdout>) -> Result<serde_json::Value> {
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    serde_json::from_str(&line).with_context(|| format!("the loop printed {line:?}"))
}

fn wall_ns() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as f64
}

/// Runs the suite; the report's markdown.
pub fn run(root: &Path, ebtrace: &Path, opts: Options) -> Result<String> {
    let python = root.join(".venv/bin/python");
    if !util::succeeds(Command::new(&python).args(["-c", "import torch"])) {
        bail!("no PyTorch in .venv (run `cargo xtask setup`)");
    }
    let script = root.join("tests/fixtures/python/torch_ops_loop.py");
    let scratch = util::temp_dir(root, "torch-ops")?;
    let torch_version = util::stdout_of(
        Command::new(&python).args(["-c", "import torch; print(torch.__version__)"]),
    )
    .unwrap_or_default();
    let env = Environment::probe(
        root,
        ebtrace,
        &format!("PyTorch {}", torch_version.trim()),
        opts,
    );
    let mut target = Target::start(&python, &script, opts.target_cpu)?;
    thread::sleep(WARM_UP);
    say(format!(
        "torch ops: {} rounds x {:?}, {} s each, one process",
        opts.rounds,
        Config::ALL.iter().map(|c| c.label()).collect::<Vec<_>>(),
        opts.seconds
    ));
    let started = Instant::now();
    let mut phases = Vec::new();
    for (round, config) in harness::rotated::<Config>(opts.rounds) {
        let (from, to) = phase(ebtrace, &target, config, opts.seconds, &scratch)?;
        phases.push(Phase {
            config,
            round,
            from,
            to,
        });
        thread::sleep(AFTER);
    }
    util::signal(target.pid, libc::SIGUSR1);
    let report = read_json(&mut target.stdout)?;
    let profiled = read_json(&mut target.stdout)?;
    let _ = std::fs::remove_dir_all(&scratch);
    let steps: Vec<(f64, f64)> = report["steps"]
        .as_array()
        .context("no steps")?
        .iter()
        .filter_map(|s| Some((s[0].as_f64()?, s[1].as_f64()?)))
        .collect();
    let profiled_steps = profiled["profiled_steps"].as_f64().unwrap_or(0.0);
    let counted: f64 = profiled["counts"]
        .as_object()
        .context("no counts")?
        .values()
        .filter_map(serde_json::Value::as_f64)
        .sum();
    // The train_step range itself is one more.
    let per_step = counted / profiled_steps.max(1.0) + 1.0;
    Ok(render(
        &env,
        &phases,
        &steps,
        per_step,
        opts,
        started.elapsed(),
    ))
}

/// Puts `config` in place, measures for `seconds`, takes it away; the
/// measured span.
fn phase(
    ebtrace: &Path,
    target: &Target,
    config: Config,
    seconds: f64,
    scratch: &Path,
) -> Result<(f64, f64)> {
    let measure = Duration::from_secs_f64(seconds);
    let span = || {
        thread::sleep(SETTLE);
        let from = wall_ns();
        thread::sleep(measure);
        (from, wall_ns())
    };
    match config {
        Config::Untraced => Ok(span()),
        Config::TorchProfiler => {
            util::signal(target.pid, libc::SIGUSR2);
            let measured = span();
            util::signal(target.pid, libc::SIGUSR2);
            Ok(measured)
        }
        Config::Ebtrace | Config::EbtraceSampled | Config::EbtraceShapes | Config::EbtraceNoOps => {
            let logdir = scratch.join("trace");
            let duration = format!("{}s", (seconds + SETTLE.as_secs_f64() + 1.0).ceil());
            let mut cmd = harness::ebtrace_command(ebtrace, target.pid, &duration, &logdir);
            let ready: fn(&str) -> bool = match config {
                Config::EbtraceNoOps => {
                    cmd.arg("--no-torch-ops");
                    harness::attached
                }
                _ => |l| l.contains("PyTorch ops through RecordFunction callbacks"),
            };
            if config == Config::EbtraceSampled {
                cmd.args(["--torch-op-sampling", SAMPLING]);
            }
            if config == Config::EbtraceShapes {
                cmd.arg("--torch-op-shapes");
            }
            let mut t = harness::spawn_ebtrace(cmd, ready, Duration::from_secs(60))?;
            let measured = span();
            harness::finish_ebtrace(&mut t)?;
            let _ = std::fs::remove_dir_all(&logdir);
            Ok(measured)
        }
    }
}

/// The median time a step that began in `[from, to)` took, in ns: the
/// median, not the mean, so that the moments the machine took the CPU away
/// (this VM's neighbours) weigh as little as they can.
fn step_ns(steps: &[(f64, f64)], from: f64, to: f64) -> f64 {
    let took: Vec<f64> = steps
        .iter()
        .filter(|(start, _)| from <= *start && *start < to)
        .map(|(start, end)| end - start)
        .collect();
    median(&took)
}

fn render(
    env: &Environment,
    phases: &[Phase],
    steps: &[(f64, f64)],
    per_step: f64,
    opts: Options,
    took: Duration,
) -> String {
    let rounds = opts.rounds;
    let of = |round: usize, c: Config| {
        phases
            .iter()
            .find(|p| p.round == round && p.config == c)
            .map(|p| step_ns(steps, p.from, p.to))
    };
    let times = |config: Config| -> Vec<f64> {
        (0..rounds).filter_map(|round| of(round, config)).collect()
    };
    // Per round, how much longer a step took under `a` than under `b`.
    let per_round = |a: Config, b: Config| -> Vec<f64> {
        (0..rounds)
            .filter_map(|round| Some(ratio(of(round, a)?, of(round, b)?)))
            .collect()
    };
    // ns an op adds: the step's added time over its RecordFunctions.
    let op_ns = |with: Config, without: Config| -> Vec<f64> {
        (0..rounds)
            .filter_map(|round| Some((of(round, with)? - of(round, without)?) / per_step))
            .collect()
    };
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## PyTorch ops: ebtrace against torch.profiler ({})\n",
        env.date()
    );
    let _ = writeln!(md, "{}", env.header_lines());
    let _ = writeln!(
        md,
        "One PyTorch CPU training loop ({per_step:.0} RecordFunctions a step), the \
         configurations taking turns within it, {rounds} rounds of {} s each, order \
         rotated ({:.0} s in all).\n",
        opts.seconds,
        took.as_secs_f64()
    );
    let _ = writeln!(
        md,
        "| configuration | a step's median time, µs (median of the rounds; each round) |"
    );
    let _ = writeln!(md, "|---|---|");
    for config in Config::ALL {
        let t: Vec<f64> = times(*config).iter().map(|ns| ns / 1e3).collect();
        let _ = writeln!(
            md,
            "| {} | {:.0} ({}) |",
            config.label(),
            median(&t),
            each(&t, 0)
        );
    }
    let ops = op_ns(Config::Ebtrace, Config::EbtraceNoOps);
    let profiler = op_ns(Config::TorchProfiler, Config::Untraced);
    let cost_ratio: Vec<f64> = ops
        .iter()
        .zip(&profiler)
        .map(|(a, b)| ratio(*a, *b))
        .collect();
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "- ebtrace's ops, over `ebtrace --no-torch-ops`: {:.0} ns an op ({}); a step \
         {:.3}x as long ({})",
        median(&ops),
        each(&ops, 0),
        median(&per_round(Config::Ebtrace, Config::EbtraceNoOps)),
        each(&per_round(Config::Ebtrace, Config::EbtraceNoOps), 3)
    );
    let _ = writeln!(
        md,
        "- torch.profiler (CPU), over untraced: {:.0} ns an op ({}); a step {:.3}x as \
         long ({})",
        median(&profiler),
        each(&profiler, 0),
        median(&per_round(Config::TorchProfiler, Config::Untraced)),
        each(&per_round(Config::TorchProfiler, Config::Untraced), 3)
    );
    let _ = writeln!(
        md,
        "- ebtrace's ops cost {:.2}x what torch.profiler's cost ({}); target: at most 1.0x",
        median(&cost_ratio),
        each(&cost_ratio, 2)
    );
    let shapes = op_ns(Config::EbtraceShapes, Config::EbtraceNoOps);
    let _ = writeln!(
        md,
        "- ebtrace's ops with input shapes, over `ebtrace --no-torch-ops`: {:.0} ns an op ({}); \
         a step {:.3}x as long ({})",
        median(&shapes),
        each(&shapes, 0),
        median(&per_round(Config::EbtraceShapes, Config::EbtraceNoOps)),
        each(&per_round(Config::EbtraceShapes, Config::EbtraceNoOps), 3)
    );
    // The loop keeps one CPU busy: a step's added time over its time is
    // the share of a CPU the sampled ops take.
    let sampled = per_round(Config::EbtraceSampled, Config::EbtraceNoOps);
    let share: Vec<f64> = sampled.iter().map(|r| (r - 1.0) * 100.0).collect();
    let sampled_ns = op_ns(Config::EbtraceSampled, Config::EbtraceNoOps);
    let _ = writeln!(
        md,
        "- ebtrace's ops sampled at {SAMPLING}, over `ebtrace --no-torch-ops`: {:.0} ns an op \
         ({}); {:.2}% of the loop's CPU ({}%)",
        median(&sampled_ns),
        each(&sampled_ns, 0),
        median(&share),
        each(&share, 2)
    );
    md
}
