//! The Python stacks benchmark (`--suite python-stacks`): what sampling a
//! CPython process's stacks at 99 Hz costs the process, with ebtrace and
//! with py-spy, side by side.
//!
//! The target is `tests/fixtures/python/bench_work.py` on pyenv's CPython
//! 3.11: a CPU-bound loop five Python frames deep, pinned to one CPU, that
//! prints its step count every 0.5 s. Each round runs it, a fresh process
//! per run, order rotated: untraced, under `ebtrace --sample-hz 99
//! --no-python-frames` (native stacks), under `ebtrace --sample-hz 99`
//! (with the Python frames, the default), under `py-spy record --rate 99`
//! (blocking: py-spy stops the process for each sample) and under `py-spy
//! record --rate 99 --nonblocking`. A run's rate is the target's steps per
//! second between its first and last progress lines within the tracer's
//! window: from ebtrace's `probes attached` line or py-spy's `Sampling
//! process` line, for `--seconds`; over the same lines, the target
//! thread's time on its CPU, waiting for it and stopped (`schedstat`): what
//! py-spy's stops take, measured rather than inferred from the rate.
//!
//! For the two ebtrace runs, the kernel's BPF run-time statistics give
//! what the stack program itself costs: its `run_time_ns` and `run_cnt`
//! (from `/proc/<ebtrace>/fdinfo` of its program) when the window opens
//! and at 80% of it. Those runs are rounds apart, and the machine's speed
//! drifts between them by more than the Python frames cost; a last capture
//! switches the frames off and on within itself ([`interleaved`]) for a
//! figure the drift does not blur.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use interleaved::Interleaved;

use super::{
    Options,
    bpf::{BpfStats, ProgStats},
    harness::{self, Configuration, each, ratio},
    jax::monotonic_s,
    report::{Environment, thousands},
    tracer::Traced,
};
use crate::util::{self, median, say};

mod interleaved;

/// The interpreter, 3.`PYTHON_MINOR`: one of the versions ebtrace reads
/// Python frames of (3.10 to 3.14) that py-spy reads too.
const PYTHON_MINOR: u8 = 11;
/// Both tracers' sampling rate.
const HZ: &str = "99";
/// How long the target runs before a tracer starts: past the interpreter's
/// start-up and its first progress line.
const WARM_UP: Duration = Duration::from_millis(700);
/// Pause after each run, so that one tracer's teardown (ebtrace naming its
/// stacks, py-spy writing its file) does not run into the next run.
const SETTLE: Duration = Duration::from_secs(1);
/// The shortest interleaved capture: the phases' own spread (this VM's
/// neighbours) is tens of percent, and the median needs many pairs.
const INTERLEAVED_SECONDS: f64 = 60.0;
/// When, as a fraction of ebtrace's window, its program's statistics are
/// read the second time: well inside the window, before its end.
const STATS_AT: f64 = 0.8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Config {
    Untraced,
    Native,
    Python,
    PySpy,
    PySpyNonblocking,
}

impl Configuration for Config {
    const ALL: &'static [Config] = &[
        Config::Untraced,
        Config::Native,
        Config::Python,
        Config::PySpy,
        Config::PySpyNonblocking,
    ];

    fn label(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::Native => "ebtrace native",
            Config::Python => "ebtrace python",
            Config::PySpy => "py-spy",
            Config::PySpyNonblocking => "py-spy nonblock",
        }
    }
}

impl Config {
    fn describe(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::Native => "`ebtrace --sample-hz 99 --no-python-frames` (native stacks)",
            Config::Python => "`ebtrace --sample-hz 99` (with Python frames, the default)",
            Config::PySpy => "`py-spy record --rate 99` (blocking, its default)",
            Config::PySpyNonblocking => "`py-spy record --rate 99 --nonblocking`",
        }
    }
}

/// What the kernel's statistics say the stack program cost during one
/// ebtrace run.
#[derive(Clone, Copy, Debug)]
struct Kernel {
    /// Per run of the program: every tick of every CPU, most of those on
    /// the CPU the target is not on finding no thread to sample.
    ns_per_run: f64,
    /// All its runs' time over the samples of the target it took: what
    /// one sample of the target costs in the kernel.
    ns_per_sample: f64,
    /// The share of the target's time that took, on its CPU: ns per
    /// sample times samples a second.
    share: f64,
}

/// One run of one configuration.
#[derive(Clone, Debug)]
struct Run {
    config: Config,
    rate: Rate,
    /// ebtrace only.
    kernel: Option<Kernel>,
    /// Samples the tracer took: ebtrace's on the target's thread lines,
    /// py-spy's `Samples: N`.
    samples: u64,
    /// ebtrace only: its samples with Python frames.
    python_stacks: Option<u64>,
}

struct Bench {
    ebtrace: PathBuf,
    python: PathBuf,
    py_spy: PathBuf,
    fixture: PathBuf,
    scratch: PathBuf,
    seconds: f64,
    target_cpu: Option<usize>,
}

/// Runs the suite; the Markdown report.
pub fn run(root: &Path, opts: Options) -> Result<String> {
    let ebtrace = &built_ebtrace(root)?;
    let bench = Bench {
        ebtrace: ebtrace.to_path_buf(),
        python: cpython(PYTHON_MINOR)?,
        py_spy: py_spy(root)?,
        fixture: root.join("tests/fixtures/python/bench_work.py"),
        scratch: util::temp_dir(root, "python-stacks")?,
        seconds: opts.seconds,
        target_cpu: opts.target_cpu,
    };
    bench.check_ebtrace()?;
    let versions = format!(
        "{}, CPython {}",
        util::stdout_of(Command::new(&bench.py_spy).arg("--version")).unwrap_or_default(),
        util::stdout_of(Command::new(&bench.python).arg("--version"))
            .unwrap_or_default()
            .trim_start_matches("Python ")
    );
    let env = Environment::probe(root, ebtrace, &versions, opts);
    say(format!(
        "python stacks: {} rounds x {:?}, {} s each",
        opts.rounds,
        Config::ALL.iter().map(|c| c.label()).collect::<Vec<_>>(),
        opts.seconds
    ));
    let started = Instant::now();
    let mut runs = Vec::new();
    for (round, config) in harness::rotated::<Config>(opts.rounds) {
        let run = bench.run(config);
        thread::sleep(SETTLE);
        let run = run?;
        say(progress(&run, round, opts.rounds));
        runs.push(run);
    }
    let seconds = (opts.seconds * opts.rounds as f64).max(INTERLEAVED_SECONDS);
    say(format!(
        "python stacks: one capture, Python frames switched off and on for {seconds} s"
    ));
    let interleaved = bench.interleaved(seconds)?;
    let _ = std::fs::remove_dir_all(&bench.scratch);
    Ok(render(&env, &runs, &interleaved, opts, started.elapsed()))
}

/// The progress line of one run.
fn progress(run: &Run, round: usize, rounds: usize) -> String {
    let kernel = run.kernel.map_or(String::new(), |k| {
        format!(
            ", stack program {:.0} ns per sample ({:.0} per run)",
            k.ns_per_sample, k.ns_per_run
        )
    });
    format!(
        "python stacks round {}/{rounds} {:<15} {:>7} steps/s, {} samples{kernel}",
        round + 1,
        run.config.label(),
        thousands(run.rate.steps_per_s),
        run.samples
    )
}

/// The release binary as it was last built: the suite measures it without
/// building it again, so that a binary built elsewhere (by a test run, or
/// with other changes in progress) can be measured as it is.
fn built_ebtrace(root: &Path) -> Result<PathBuf> {
    let path = root.join("target/release/ebtrace");
    if !path.exists() {
        bail!(
            "{} is missing: build it first (cargo build --release)",
            path.display()
        );
    }
    say(format!("measuring {} as built", path.display()));
    Ok(path)
}

/// CPython 3.`minor` under pyenv: its newest patch release.
fn cpython(minor: u8) -> Result<PathBuf> {
    match ebtrace_tests::pyenv::installed_cpython(minor) {
        Some(python) => Ok(python),
        None => bail!(
            "CPython 3.{minor} not found under {}: the Python stacks benchmark runs on it; \
             install it with `pyenv install 3.{minor}`",
            ebtrace_tests::pyenv::pyenv_root()
                .join("versions")
                .display()
        ),
    }
}

/// py-spy, installed into the venv by `cargo xtask setup`.
fn py_spy(root: &Path) -> Result<PathBuf> {
    let path = root.join(".venv/bin/py-spy");
    if !path.exists() {
        bail!(
            "{} is missing: the Python stacks benchmark compares ebtrace with it; run \
             `cargo xtask setup`",
            path.display()
        );
    }
    Ok(path)
}

impl Bench {
    /// Fails unless the binary knows `--no-python-frames`: one built before
    /// it would refuse the native-only runs after a round of work.
    fn check_ebtrace(&self) -> Result<()> {
        let help = util::stdout_of(Command::new(&self.ebtrace).arg("--help")).unwrap_or_default();
        if !help.contains("--no-python-frames") {
            bail!(
                "{} has no --no-python-frames: build it again (cargo build --release)",
                self.ebtrace.display()
            );
        }
        Ok(())
    }

    /// One run of `config` on a fresh target.
    fn run(&self, config: Config) -> Result<Run> {
        let target = Target::start(&self.python, &self.fixture, self.target_cpu)?;
        thread::sleep(WARM_UP);
        match config {
            Config::Untraced => {
                let from = monotonic_s();
                Ok(Run {
                    config,
                    rate: target.measure(from, from + self.seconds)?,
                    kernel: None,
                    samples: 0,
                    python_stacks: None,
                })
            }
            Config::Native | Config::Python => self.ebtrace(&target, config),
            Config::PySpy | Config::PySpyNonblocking => self.py_spy(&target, config),
        }
    }

    /// A run under ebtrace, with the kernel's statistics of its stack
    /// program on for it.
    fn ebtrace(&self, target: &Target, config: Config) -> Result<Run> {
        let _stats = BpfStats::enable()?;
        let logdir = self.scratch.join(format!("ebtrace-{}", target.pid));
        let duration = format!("{}s", self.seconds);
        let mut cmd = harness::ebtrace_command(&self.ebtrace, target.pid, &duration, &logdir);
        cmd.args(["--sample-hz", HZ]);
        if config == Config::Native {
            cmd.arg("--no-python-frames");
        }
        let spawned = monotonic_s();
        let mut t = harness::spawn_ebtrace(cmd, harness::attached, Duration::from_secs(60))?;
        let from = spawned + t.last_mark().expect("a line was awaited").as_secs_f64();
        let first = ProgStats::read(t.pid())?;
        sleep_until(from + STATS_AT * self.seconds);
        let second = ProgStats::read(t.pid())?;
        let rate = target.measure(from, from + self.seconds)?;
        harness::finish_ebtrace(&mut t)?;
        let _ = std::fs::remove_dir_all(&logdir);
        let summary = raw_summary(t.stdout())?;
        let window_s = summary["window"]["duration_ns"].as_f64().unwrap_or(0.0) / 1e9;
        let samples = summary["cpu_samples"].as_u64().unwrap_or(0);
        let python_stacks = summary["python_stacks"]["stacks_with_python"]
            .as_u64()
            .unwrap_or(0);
        check_frames(config, samples, python_stacks)?;
        let samples_per_s = samples as f64 / window_s.max(1e-9);
        Ok(Run {
            config,
            rate,
            kernel: Some(kernel_cost_between(&first, &second, samples_per_s)?),
            samples,
            python_stacks: Some(python_stacks),
        })
    }

    /// A run under py-spy.
    fn py_spy(&self, target: &Target, config: Config) -> Result<Run> {
        let output = self.scratch.join(format!("py-spy-{}.txt", target.pid));
        let mut cmd = Command::new(&self.py_spy);
        cmd.args(["record", "--pid", &target.pid.to_string(), "--rate", HZ])
            // py-spy takes whole seconds: it may sample past the window.
            .args(["--duration", &format!("{:.0}", self.seconds.ceil())])
            .args(["--format", "raw", "--output"])
            .arg(&output);
        if config == Config::PySpyNonblocking {
            cmd.arg("--nonblocking");
        }
        let spawned = monotonic_s();
        let mut t = Traced::spawn(cmd)?;
        t.wait_line(|l| l.contains("Sampling process"), Duration::from_secs(60))?;
        let from = spawned + t.last_mark().expect("a line was awaited").as_secs_f64();
        let rate = target.measure(from, from + self.seconds)?;
        t.wait_exit(Duration::from_secs(60))?;
        let _ = std::fs::remove_file(&output);
        let samples = t
            .lines()
            .iter()
            .find_map(|l| {
                l.split("Samples: ")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .with_context(|| format!("no `Samples: N` line from py-spy: {:?}", t.lines()))?;
        Ok(Run {
            config,
            rate,
            kernel: None,
            samples,
            python_stacks: None,
        })
    }
}

/// ebtrace's `--json` summary, whole (the harness reads only part of it).
fn raw_summary(stdout: &[String]) -> Result<serde_json::Value> {
    let line = stdout
        .iter()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("no --json summary on ebtrace's stdout: {stdout:?}"))?;
    serde_json::from_str(line).with_context(|| format!("ebtrace's --json summary {line:?}"))
}

/// Fails unless the run sampled the target and got Python frames exactly
/// when asked to: else it would not measure what its row says.
fn check_frames(config: Config, samples: u64, python_stacks: u64) -> Result<()> {
    if samples == 0 {
        bail!("ebtrace took no stack samples of the target");
    }
    match (config, python_stacks) {
        (Config::Python, 0) => bail!("ebtrace's {samples} samples had no Python frames"),
        (Config::Native, n) if n > 0 => {
            bail!("ebtrace --no-python-frames gave {n} samples with Python frames")
        }
        _ => Ok(()),
    }
}

fn sleep_until(t: f64) {
    let left = t - monotonic_s();
    if left > 0.0 {
        thread::sleep(Duration::from_secs_f64(left));
    }
}

/// The running fixture and its progress lines.
struct Target {
    child: Child,
    pid: u32,
    /// Each progress line so far.
    progress: Arc<Mutex<Vec<Progress>>>,
    reader: Option<JoinHandle<()>>,
}

impl Target {
    fn start(python: &Path, fixture: &Path, cpu: Option<usize>) -> Result<Self> {
        let mut child = harness::pinned(python, cpu)
            .arg(fixture)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting bench_work.py")?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let pid = serde_json::from_str::<serde_json::Value>(&first)
            .ok()
            .and_then(|v| v["pid"].as_u64());
        let Some(pid) = pid else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("bench_work.py printed {first:?}, not its pid");
        };
        let pid = pid as u32;
        let progress = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::clone(&progress);
        let reader = thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if let (Some(time), Some(steps)) = (v["time"].as_f64(), v["steps"].as_f64()) {
                    let (on_cpu_ns, waiting_ns) = schedstat(pid);
                    shared.lock().expect("not poisoned").push(Progress {
                        time,
                        steps,
                        read_at: monotonic_s(),
                        on_cpu_ns,
                        waiting_ns,
                    });
                }
            }
        });
        Ok(Target {
            child,
            pid,
            progress,
            reader: Some(reader),
        })
    }

    /// The target's rate and time between the first and the last progress
    /// line stamped within `[from, to]` (CLOCK_MONOTONIC seconds). Waits
    /// until `to` has passed.
    fn measure(&self, from: f64, to: f64) -> Result<Rate> {
        sleep_until(to + 0.05);
        let progress = self.progress.lock().expect("not poisoned");
        let mut inside = progress.iter().filter(|p| (from..=to).contains(&p.time));
        match (inside.next(), inside.next_back()) {
            (Some(a), Some(b)) if b.time > a.time && b.steps > a.steps => Ok(Rate::between(a, b)),
            _ => bail!(
                "bench_work.py printed fewer than two progress lines between {from:.3} and \
                 {to:.3} (CLOCK_MONOTONIC s): give it more --seconds"
            ),
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// One progress line of the target, with its thread's times so far
/// (`/proc/PID/schedstat`) read as the line arrived.
#[derive(Clone, Copy, Debug)]
struct Progress {
    /// The target's stamp (CLOCK_MONOTONIC seconds).
    time: f64,
    steps: f64,
    /// When the times were read (CLOCK_MONOTONIC seconds).
    read_at: f64,
    on_cpu_ns: u64,
    waiting_ns: u64,
}

/// The target over a run's window.
#[derive(Clone, Copy, Debug)]
struct Rate {
    steps_per_s: f64,
    /// On-CPU time per step, which includes what runs in the target's
    /// context on its behalf: the stack program's samples.
    cpu_ns_per_step: f64,
    /// Shares of the wall time: on its CPU, runnable but waiting for it,
    /// and neither: stopped (by py-spy's ptrace), since the loop never
    /// blocks.
    on_cpu: f64,
    waiting: f64,
    stopped: f64,
}

impl Rate {
    fn between(a: &Progress, b: &Progress) -> Self {
        let wall_ns = (b.read_at - a.read_at).max(1e-9) * 1e9;
        let on_cpu = b.on_cpu_ns.saturating_sub(a.on_cpu_ns) as f64;
        let waiting = b.waiting_ns.saturating_sub(a.waiting_ns) as f64;
        Rate {
            steps_per_s: (b.steps - a.steps) / (b.time - a.time),
            cpu_ns_per_step: on_cpu / (b.steps - a.steps),
            on_cpu: on_cpu / wall_ns,
            waiting: waiting / wall_ns,
            stopped: (1.0 - (on_cpu + waiting) / wall_ns).max(0.0),
        }
    }
}

/// The on-CPU and run-queue ns of `pid`'s main thread so far (the
/// target's only thread); zeros once it is gone.
fn schedstat(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).unwrap_or_default();
    let mut fields = text.split_whitespace().map(|f| f.parse().unwrap_or(0));
    (fields.next().unwrap_or(0), fields.next().unwrap_or(0))
}

/// What the stack program cost from `earlier` to `later`, the target
/// being sampled `samples_per_s` times a second meanwhile.
fn kernel_cost_between(
    earlier: &ProgStats,
    later: &ProgStats,
    samples_per_s: f64,
) -> Result<Kernel> {
    let (ns, runs) = later.since(earlier)?;
    let samples = samples_per_s * (later.at - earlier.at);
    let ns_per_sample = ns / samples.max(1.0);
    Ok(Kernel {
        ns_per_run: ns / runs,
        ns_per_sample,
        share: ns_per_sample * samples_per_s / 1e9,
    })
}

fn render(
    env: &Environment,
    runs: &[Run],
    interleaved: &Interleaved,
    opts: Options,
    took: Duration,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## Python stacks benchmark ({})\n", env.date());
    md.push_str(&env.header_lines());
    let _ = writeln!(
        md,
        "- target: `tests/fixtures/python/bench_work.py`, a CPU-bound loop five Python frames \
         deep (main → run → outer_step → middle_step → inner_hot / cold_leaf) counting its \
         steps; {}; {} rounds of the {} configurations (order rotated), a fresh target each \
         run, {} s of each tracer's window; took {:.0} s",
        match env.target_cpu() {
            Some(cpu) => format!("pinned to CPU {cpu}, tracers unpinned"),
            None => "not pinned".to_string(),
        },
        opts.rounds,
        Config::ALL.len(),
        opts.seconds,
        took.as_secs_f64()
    );
    let _ = writeln!(
        md,
        "- rate: the target's steps per second between its first and its last progress line \
         (one every 0.5 s) within the tracer's window, from ebtrace's `probes attached` line or \
         py-spy's `Sampling process` line on"
    );
    if env.virtual_machine() {
        let _ = writeln!(
            md,
            "\n> Measured in a VM, where a sample costs several times what it costs on bare \
             metal: compare the ratios, ebtrace against py-spy measured in the same run."
        );
    }
    rates_table(&mut md, runs);
    time_table(&mut md, runs);
    kernel_cost(&mut md, runs);
    versus_py_spy(&mut md, runs);
    direct_cost(&mut md, runs, opts.seconds);
    interleaved::render(&mut md, interleaved);
    md
}

/// The target's rate under each configuration, and the samples taken.
fn rates_table(md: &mut String, runs: &[Run]) {
    let _ = writeln!(
        md,
        "\n### a. The target's rate\n\n| configuration | target steps/s (median) | each round | \
         vs untraced | vs native-only ebtrace |\n|---|---:|---|---:|---:|"
    );
    let base = median(&rates(runs, Config::Untraced));
    let native = median(&rates(runs, Config::Native));
    for &c in Config::ALL {
        let v = rates(runs, c);
        let each: Vec<String> = v.iter().map(|x| thousands(*x)).collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.2} |",
            c.describe(),
            thousands(median(&v)),
            each.join(" / "),
            ratio(median(&v), base),
            ratio(median(&v), native)
        );
    }
    let samples = |c: Config, f: fn(&Run) -> Option<u64>| -> Vec<f64> {
        runs.iter()
            .filter(|r| r.config == c)
            .filter_map(|r| Some(f(r)? as f64))
            .collect()
    };
    let _ = writeln!(
        md,
        "\nSamples of the target a run: ebtrace native {}, with Python frames {} ({} of them \
         with Python frames); py-spy {}, `--nonblocking` {}.",
        each(&samples(Config::Native, |r| Some(r.samples)), 0),
        each(&samples(Config::Python, |r| Some(r.samples)), 0),
        each(&samples(Config::Python, |r| r.python_stacks), 0),
        each(&samples(Config::PySpy, |r| Some(r.samples)), 0),
        each(&samples(Config::PySpyNonblocking, |r| Some(r.samples)), 0)
    );
}

/// Where the target's time went under each configuration.
fn time_table(md: &mut String, runs: &[Run]) {
    let _ = writeln!(
        md,
        "\n### b. Where the target's time went\n\nIts thread's `/proc/PID/schedstat` over the \
         same lines: on-CPU time per step (the stack program's samples run in its context and \
         count there), and the shares of the wall time it was on its CPU, waiting for it \
         (runnable), and neither: stopped, as py-spy's ptrace stops it (the loop never \
         blocks). Medians of the rounds.\n\n| configuration | CPU µs per step | each round | \
         on CPU | waiting | stopped |\n|---|---:|---|---:|---:|---:|"
    );
    for &c in Config::ALL {
        let of = |f: fn(&Rate) -> f64| -> Vec<f64> {
            runs.iter()
                .filter(|r| r.config == c)
                .map(|r| f(&r.rate))
                .collect()
        };
        let cpu_us = of(|r| r.cpu_ns_per_step / 1e3);
        let _ = writeln!(
            md,
            "| {} | {:.2} | {} | {:.2}% | {:.2}% | {:.2}% |",
            c.label(),
            median(&cpu_us),
            each(&cpu_us, 2),
            median(&of(|r| r.on_cpu)) * 100.0,
            median(&of(|r| r.waiting)) * 100.0,
            median(&of(|r| r.stopped)) * 100.0
        );
    }
}

/// The stack program's own cost, from the kernel's statistics.
fn kernel_cost(md: &mut String, runs: &[Run]) {
    let _ = writeln!(
        md,
        "\n### c. The stack program in the kernel\n\nThe `cpu_sample` program's `run_time_ns` \
         and `run_cnt` (the kernel's BPF statistics, on for the ebtrace runs only) from ebtrace's \
         window opening to {:.0}% of it. Per sample: the time of all its runs over the target's \
         samples meanwhile (at the rate of samples the window got); per run: over every run, \
         one a tick of each CPU, those on the CPU without the target finding nothing to \
         sample.\n\n| stacks | ns per sample (median) | each round | ns per run (median) | \
         each round |\n|---|---:|---|---:|---|",
        STATS_AT * 100.0
    );
    let kernel = |c: Config, f: fn(&Kernel) -> f64| -> Vec<f64> {
        runs.iter()
            .filter(|r| r.config == c)
            .filter_map(|r| Some(f(r.kernel.as_ref()?)))
            .collect()
    };
    for (c, what) in [
        (Config::Native, "native only (`--no-python-frames`)"),
        (Config::Python, "with Python frames"),
    ] {
        let per_sample = kernel(c, |k| k.ns_per_sample);
        let per_run = kernel(c, |k| k.ns_per_run);
        let _ = writeln!(
            md,
            "| {what} | {:.0} | {} | {:.0} | {} |",
            median(&per_sample),
            each(&per_sample, 0),
            median(&per_run),
            each(&per_run, 0)
        );
    }
    let native = median(&kernel(Config::Native, |k| k.ns_per_sample));
    let python = median(&kernel(Config::Python, |k| k.ns_per_sample));
    let added: Vec<f64> = per_round(runs, |round| {
        let of = |c: Config| Some(round.iter().find(|r| r.config == c)?.kernel?.ns_per_sample);
        Some((ratio(of(Config::Python)?, of(Config::Native)?) - 1.0) * 100.0)
    });
    // Rounds that disagree on the sign leave the addition within the noise.
    let resolved = added.iter().all(|&a| a > 0.0) || added.iter().all(|&a| a < 0.0);
    let verdict = if resolved {
        format!(
            "**Python frames add {:.0}% to what native sampling costs** in the kernel",
            median(&added)
        )
    } else {
        format!(
            "What Python frames add to what native sampling costs in the kernel: not resolved \
             (median {:.0}%, the rounds disagreeing: more rounds or a quieter machine)",
            median(&added)
        )
    };
    let _ = writeln!(
        md,
        "\n{verdict}: the median of the rounds' own ratios ({} %), the two runs of a round being \
         close in time where the machine's speed drifts between rounds; {:+.0} ns a sample \
         between the medians.",
        each(&added, 0),
        python - native
    );
}

/// `f` of each round's runs (they run, and are kept, a round at a time).
fn per_round(runs: &[Run], f: impl Fn(&[Run]) -> Option<f64>) -> Vec<f64> {
    runs.chunks(Config::ALL.len()).filter_map(f).collect()
}

/// What ebtrace with Python frames costs the target against what each
/// py-spy mode costs it: the ratio of their slowdowns.
fn versus_py_spy(md: &mut String, runs: &[Run]) {
    let _ = writeln!(md, "\n### d. ebtrace against py-spy\n");
    let base = median(&rates(runs, Config::Untraced));
    let slowdown = |c: Config| 1.0 - median(&rates(runs, c)) / base.max(1e-9);
    for py_spy in [Config::PySpy, Config::PySpyNonblocking] {
        let compared = [Config::Untraced, Config::Python, py_spy];
        // The noise: the largest spread of the rounds of the rates compared.
        let noise = compared
            .iter()
            .map(|&c| spread(&rates(runs, c)))
            .fold(0.0, f64::max);
        let (ebtrace, other) = (slowdown(Config::Python), slowdown(py_spy));
        let verdict = if ebtrace <= noise || other <= noise {
            format!(
                "not resolved (slowdowns {:.1}% and {:.1}% against a spread of ±{:.0}% between \
                 rounds: more rounds or a quieter machine)",
                ebtrace * 100.0,
                other * 100.0,
                noise * 100.0
            )
        } else {
            format!(
                "**{:.2}x** (slowdowns {:.1}% and {:.1}%)",
                ratio(ebtrace, other),
                ebtrace * 100.0,
                other * 100.0
            )
        };
        let _ = writeln!(
            md,
            "- ebtrace (with Python frames) costs the target, against {}: {verdict}",
            py_spy.describe()
        );
    }
}

/// The time each tracer's samples took from the target, measured rather
/// than inferred from its rate: py-spy's stops (the stopped share beyond
/// the untraced one) against the stack program's time on the target's CPU.
/// A stopped share within what runs nobody stops show (the share is the
/// difference of two clocks read a little apart) counts as none.
fn direct_cost(md: &mut String, runs: &[Run], seconds: f64) {
    let of = |c: Config, f: &dyn Fn(&Run) -> Option<f64>| -> f64 {
        median(
            &runs
                .iter()
                .filter(|r| r.config == c)
                .filter_map(f)
                .collect::<Vec<_>>(),
        )
    };
    let untraced = of(Config::Untraced, &|r| Some(r.rate.stopped));
    // Twice the most the measure showed of a target that nothing stops.
    let floor = 2.0
        * runs
            .iter()
            .filter(|r| matches!(r.config, Config::Untraced | Config::Native | Config::Python))
            .map(|r| r.rate.stopped)
            .fold(0.0, f64::max);
    let ebtrace = of(Config::Python, &|r| Some(r.kernel?.share));
    // py-spy's --duration is whole seconds.
    let per_s = seconds.ceil().max(1.0);
    for py_spy in [Config::PySpy, Config::PySpyNonblocking] {
        let stopped = of(py_spy, &|r| Some(r.rate.stopped));
        if stopped <= floor {
            let _ = writeln!(
                md,
                "- Measured directly, {} stopped the target no more than runs that nothing stops \
                 show (≤ {:.3}% of its time): no stops to compare ebtrace's samples with.",
                py_spy.describe(),
                floor * 100.0
            );
            continue;
        }
        let stopped = stopped - untraced;
        let samples_per_s = of(py_spy, &|r| Some(r.samples as f64)) / per_s;
        let _ = writeln!(
            md,
            "- Measured directly, {} stopped the target {:.3}% of its time beyond the untraced \
             runs' ({:.1} µs a sample); ebtrace's samples (with Python frames) took {:.3}% of it, \
             on its CPU: **{:.2}x** what py-spy's stops take.",
            py_spy.describe(),
            stopped * 100.0,
            stopped * 1e6 / samples_per_s.max(1e-9),
            ebtrace * 100.0,
            ratio(ebtrace, stopped)
        );
    }
}

/// The steps per second of each run of `config`, in the order they ran.
fn rates(runs: &[Run], config: Config) -> Vec<f64> {
    runs.iter()
        .filter(|r| r.config == config)
        .map(|r| r.rate.steps_per_s)
        .collect()
}

/// Half the range of `values` over their median: how far a rate moved
/// between rounds, as a fraction.
fn spread(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    (max - min) / 2.0 / median(values).max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(config: Config, steps_per_s: f64) -> Run {
        Run {
            config,
            rate: Rate {
                steps_per_s,
                cpu_ns_per_step: 0.0,
                on_cpu: 1.0,
                waiting: 0.0,
                stopped: 0.0,
            },
            kernel: None,
            samples: 0,
            python_stacks: None,
        }
    }

    #[test]
    fn a_slowdown_within_the_spread_is_not_resolved() {
        let mut runs = Vec::new();
        for (untraced, python, blocking, nonblocking) in [
            (10_000.0, 9_000.0, 8_000.0, 9_950.0),
            (10_100.0, 9_100.0, 8_100.0, 10_050.0),
            (9_900.0, 8_900.0, 7_900.0, 9_850.0),
        ] {
            runs.push(run(Config::Untraced, untraced));
            runs.push(run(Config::Python, python));
            runs.push(run(Config::PySpy, blocking));
            runs.push(run(Config::PySpyNonblocking, nonblocking));
        }
        let mut md = String::new();
        versus_py_spy(&mut md, &runs);
        let lines: Vec<&str> = md.lines().filter(|l| l.starts_with("- ")).collect();
        // 10% against 20%: half py-spy's cost; 0.5% is within ±1%.
        assert!(lines[0].contains("**0.50x**"), "{md}");
        assert!(lines[1].contains("not resolved"), "{md}");
    }

    #[test]
    fn stops_against_the_stack_programs_time() {
        let mut runs = Vec::new();
        for _ in 0..3 {
            let mut untraced = run(Config::Untraced, 100.0);
            untraced.rate.stopped = 0.000_2;
            let mut python = run(Config::Python, 100.0);
            python.kernel = Some(Kernel {
                ns_per_run: 8_000.0,
                ns_per_sample: 8_000.0,
                share: 0.000_8,
            });
            let mut blocking = run(Config::PySpy, 100.0);
            blocking.rate.stopped = 0.010_2;
            blocking.samples = 500;
            let mut nonblocking = run(Config::PySpyNonblocking, 100.0);
            nonblocking.rate.stopped = 0.000_1;
            runs.extend([untraced, python, blocking, nonblocking]);
        }
        let mut md = String::new();
        direct_cost(&mut md, &runs, 5.0);
        let lines: Vec<&str> = md.lines().collect();
        // 1% stopped at 100 samples a second: 100 µs a sample.
        assert!(lines[0].contains("1.000% of its time"), "{md}");
        assert!(lines[0].contains("(100.0 µs a sample)"), "{md}");
        assert!(lines[0].contains("**0.08x**"), "{md}");
        assert!(lines[1].contains("no stops to compare"), "{md}");
    }

    #[test]
    fn stats_over_the_targets_samples() {
        let first = ProgStats {
            at: 10.0,
            run_time_ns: 1_000,
            run_cnt: 10,
        };
        let second = ProgStats {
            at: 12.0,
            run_time_ns: 401_000,
            run_cnt: 410,
        };
        let k = kernel_cost_between(&first, &second, 100.0).unwrap();
        assert_eq!(k.ns_per_run, 1_000.0);
        assert_eq!(k.ns_per_sample, 2_000.0);
        assert!((k.share - 0.000_2).abs() < 1e-12, "{k:?}");
        assert!(kernel_cost_between(&first, &first, 100.0).is_err());
    }

    #[test]
    fn frames_as_asked() {
        assert!(check_frames(Config::Python, 100, 90).is_ok());
        assert!(check_frames(Config::Python, 100, 0).is_err());
        assert!(check_frames(Config::Native, 100, 0).is_ok());
        assert!(check_frames(Config::Native, 100, 3).is_err());
        assert!(check_frames(Config::Native, 0, 0).is_err());
    }
}
