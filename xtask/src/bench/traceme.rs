//! The TraceMe benchmark (part of `cargo xtask bench`): what one TraceMe
//! costs its process untraced, recorded by an in-process session, recorded
//! by ebtrace (which switches recording on from outside and probes
//! `TraceMeRecorder::Record`), and with bpftrace counting calls of the same
//! function; the event rate ebtrace keeps up with; the memory the target's
//! own recorder holds per recorded event (the price of switching recording
//! on from outside); and how long finding the recorder in jaxlib takes.
//! Results go to stdout and `target/bench/traceme.md`.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{report::Environment, report::thousands, tracer::Traced};
use crate::util::{self, Workload, median, say, signal};

/// Seconds each fixture run lets the target run.
const RUN_SECONDS: f64 = 2.0;
/// Seconds of each jax measurement window, and rounds of them.
const JAX_SECONDS: u64 = 3;
const JAX_ROUNDS: usize = 3;
const RECORD_SYMBOL: &str = "_ZN3tsl8profiler15TraceMeRecorder6RecordEONS1_5EventE";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Config {
    Untraced,
    InProcess,
    Ebtrace,
    Bpftrace,
}

impl Config {
    const ALL: [Config; 4] = [
        Config::Untraced,
        Config::InProcess,
        Config::Ebtrace,
        Config::Bpftrace,
    ];

    fn label(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::InProcess => "in-process",
            Config::Ebtrace => "ebtrace",
            Config::Bpftrace => "bpftrace",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Config::Untraced => "untraced (`g_trace_level` -1: a TraceMe is one atomic load)",
            Config::InProcess => "in-process session at level 2, no probe (every TraceMe queued)",
            Config::Ebtrace => "ebtrace (switches level 2 on from outside, records every event)",
            Config::Bpftrace => "in-process session + bpftrace counting `Record` calls",
        }
    }
}

/// What ebtrace reported about one capture.
#[derive(Clone, Debug)]
struct EbtraceRun {
    events: u64,
    dropped: u64,
    peak_rss_kib: u64,
}

#[derive(Clone, Debug)]
struct Run {
    config: Config,
    traceme_per_s: f64,
    /// On-CPU ns of the target thread per TraceMe (the uprobe's kernel
    /// time included): unlike the rate, hardly moved by other load.
    cpu_ns_per_traceme: f64,
    /// Seconds the target ran (traced, for a traced run).
    run_s: f64,
    /// Events the fixture's recorder queued, and its RSS at the end.
    queued: u64,
    vm_rss_kib: u64,
    ebtrace: Option<EbtraceRun>,
    bpftrace_records: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JaxConfig {
    Untraced,
    Ebtrace,
    InProcess,
}

impl JaxConfig {
    const ALL: [JaxConfig; 3] = [
        JaxConfig::Untraced,
        JaxConfig::Ebtrace,
        JaxConfig::InProcess,
    ];

    fn describe(self) -> &'static str {
        match self {
            JaxConfig::Untraced => "untraced",
            JaxConfig::Ebtrace => "ebtrace capture (level 2 switched on from outside)",
            JaxConfig::InProcess => {
                "jax's own profiler session (`jax.profiler.start_trace`, host tracer level 2, \
                 no Python tracer)"
            }
        }
    }
}

/// The jax measurement: windows of (configuration, steps/s, CPU ns per
/// step), and the memory jaxlib's recorder keeps.
#[derive(Clone, Debug)]
struct JaxRun {
    windows: Vec<(JaxConfig, f64, f64)>,
    /// Events of the first ebtrace capture, and per step.
    events: u64,
    events_per_step: f64,
    rss_control_kib: i64,
    rss_traced_kib: i64,
    discovery_line: String,
    attach: String,
}

struct Bench {
    ebtrace: PathBuf,
    program: PathBuf,
    lib: PathBuf,
    scratch: PathBuf,
    target_cpu: Option<usize>,
}

pub fn run_traceme_bench(
    root: &Path,
    ebtrace: &Path,
    env: &Environment,
    rounds: usize,
) -> Result<()> {
    // The g++ library is stripped: the recorder's symbols are in `.dynsym`,
    // where bpftrace finds them too.
    let program = ebtrace_tests::traceme::build_program();
    let lib = ebtrace_tests::traceme::build_library(ebtrace_tests::traceme::Toolchain::Gcc);
    let bench = Bench {
        ebtrace: ebtrace.to_path_buf(),
        program,
        lib,
        scratch: util::temp_dir(root, "bench-traceme")?,
        target_cpu: env.target_cpu(),
    };
    let started = Instant::now();
    let mut runs = Vec::new();
    for round in 0..rounds {
        for i in 0..Config::ALL.len() {
            let config = Config::ALL[(round + i) % Config::ALL.len()];
            let run = bench.run(config)?;
            say(format!(
                "traceme round {}/{rounds} {:<10} {:>12} TraceMe/s, {:>7.1} CPU ns per TraceMe",
                round + 1,
                config.label(),
                thousands(run.traceme_per_s),
                run.cpu_ns_per_traceme
            ));
            runs.push((round, run));
        }
    }
    let jax = bench.jax(root)?;
    let _ = std::fs::remove_dir_all(&bench.scratch);
    let md = render(env, rounds, &runs, jax.as_ref(), started.elapsed());
    println!();
    print!("{md}");
    let out = root.join("target/bench/traceme.md");
    std::fs::create_dir_all(out.parent().expect("has a parent"))?;
    std::fs::write(&out, &md).with_context(|| format!("writing {}", out.display()))?;
    println!("\nwritten to {}", out.display());
    Ok(())
}

/// `TraceMe: N events recorded` → N.
fn traceme_events(lines: &[String]) -> Option<u64> {
    lines.iter().find_map(|l| {
        l.strip_prefix("TraceMe: ")?
            .split(" events recorded")
            .next()?
            .parse()
            .ok()
    })
}

/// `window ...; R records captured, D dropped` → D.
fn dropped(lines: &[String]) -> Option<u64> {
    lines.iter().find_map(|l| {
        let rest = l
            .strip_prefix("window ")?
            .split(" records captured, ")
            .nth(1)?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

impl Bench {
    fn fixture(&self, in_process: bool) -> Command {
        let mut cmd = match self.target_cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpu.to_string()]).arg(&self.program);
                c
            }
            None => Command::new(&self.program),
        };
        cmd.arg("--lib")
            .arg(format!("gcc={}", self.lib.display()))
            .args(["--mode", "burst", "--threads", "1"]);
        if in_process {
            cmd.args(["--in-process-level", "2"]);
        }
        cmd
    }

    /// One run of the burst fixture under `config` (the target is stopped
    /// while the tracer attaches; that time is not counted).
    fn run(&self, config: Config) -> Result<Run> {
        let in_process = matches!(config, Config::InProcess | Config::Bpftrace);
        let workload = Workload::start(self.fixture(in_process))?;
        signal(workload.pid, libc::SIGSTOP);
        let stopped_at = Instant::now();
        let logdir = self.scratch.join("logs");
        let mut tracer = match config {
            Config::Ebtrace => {
                let mut cmd = Command::new(&self.ebtrace);
                cmd.args(["--pid", &workload.pid.to_string()])
                    .args(["--duration", &format!("{}s", RUN_SECONDS as u64 * 2 + 60)])
                    .args(["--max-events", "1000000000"])
                    .arg("--logdir")
                    .arg(&logdir);
                let mut t = Traced::spawn(cmd)?;
                t.wait_line(
                    |l| l.contains("level 2 set by ebtrace"),
                    Duration::from_secs(60),
                )?;
                Some(t)
            }
            Config::Bpftrace => {
                let program = format!(
                    "BEGIN {{ printf(\"xtask: bpftrace ready\\n\"); }}\n\
                     uprobe:{}:{RECORD_SYMBOL} /pid == {}/ {{ @records = count(); }}\n",
                    self.lib.display(),
                    workload.pid
                );
                let mut t = Traced::spawn({
                    let mut c = Command::new("bpftrace");
                    c.args(["-e", &program]);
                    c
                })?;
                t.wait_line(
                    |l| l.contains("xtask: bpftrace ready"),
                    Duration::from_secs(60),
                )?;
                Some(t)
            }
            _ => None,
        };
        signal(workload.pid, libc::SIGCONT);
        let paused_s = stopped_at.elapsed().as_secs_f64();
        thread::sleep(Duration::from_secs_f64(RUN_SECONDS));
        let counters = workload.stop()?;
        let events = counters["burst_events"].as_f64().context("burst_events")?;
        let elapsed_s = counters["elapsed_s"].as_f64().context("elapsed_s")?;
        let run_s = (elapsed_s - paused_s).max(1e-3);
        let cpu_s = counters["worker_cpu_s"].as_f64().context("worker_cpu_s")?;
        let mut run = Run {
            config,
            traceme_per_s: events / run_s,
            cpu_ns_per_traceme: cpu_s * 1e9 / events.max(1.0),
            run_s,
            queued: counters["queued"]["gcc"].as_u64().unwrap_or(0),
            vm_rss_kib: counters["vm_rss_kib"].as_u64().unwrap_or(0),
            ebtrace: None,
            bpftrace_records: None,
        };
        match (config, tracer.as_mut()) {
            (Config::Ebtrace, Some(t)) => {
                // It ends by itself once its target has exited.
                let peak_rss_kib = t.wait_exit(Duration::from_secs(300))?;
                run.ebtrace = Some(EbtraceRun {
                    events: traceme_events(t.lines()).context("no TraceMe summary line")?,
                    dropped: dropped(t.lines()).context("no summary line")?,
                    peak_rss_kib,
                });
                let _ = std::fs::remove_dir_all(&logdir);
            }
            (Config::Bpftrace, Some(t)) => {
                // Its count is a cross-check only: a bpftrace that does not
                // exit (seen once in a loaded VM) does not void the run.
                signal(t.pid(), libc::SIGINT);
                match t.wait_exit(Duration::from_secs(60)) {
                    Ok(_) => {
                        run.bpftrace_records = t
                            .lines()
                            .iter()
                            .find_map(|l| l.strip_prefix("@records: ")?.trim().parse().ok());
                    }
                    Err(e) => say(format!("warning: {e:#}")),
                }
            }
            _ => {}
        }
        Ok(run)
    }

    /// jaxlib: cost per step untraced, under ebtrace and in jax's own
    /// profiler session, and the memory its recorder keeps for the events
    /// ebtrace made it record. Skipped without jax in `.venv` (`cargo xtask
    /// setup` installs it).
    fn jax(&self, root: &Path) -> Result<Option<JaxRun>> {
        let python = root.join(".venv/bin/python");
        if !util::succeeds(Command::new(&python).args(["-c", "import jax"])) {
            say("no jax in .venv: skipping the jaxlib measurements (run `cargo xtask setup`)");
            return Ok(None);
        }
        let mut cmd = Command::new(&python);
        if let Some(cpu) = self.target_cpu {
            cmd = Command::new("taskset");
            cmd.args(["-c", &cpu.to_string()]).arg(&python);
        }
        let mut child = cmd
            .arg(root.join("tests/fixtures/traceme/jax_workload.py"))
            .arg("--bench")
            .env("JAX_PLATFORMS", "cpu")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the jax workload")?;
        let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
        let stdout = child.stdout.take().expect("piped");
        let reader = thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line)
                    && tx.send(v).is_err()
                {
                    break;
                }
            }
        });
        let first = rx
            .recv_timeout(Duration::from_secs(120))
            .context("jax workload start line")?;
        let pid = first["pid"].as_u64().context("pid")? as u32;
        let rss = || -> Result<i64> {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
            status
                .lines()
                .find_map(|l| {
                    l.strip_prefix("VmRSS:")?
                        .trim()
                        .strip_suffix(" kB")?
                        .parse()
                        .ok()
                })
                .context("VmRSS")
        };
        // Between the first and the last progress line of a window: steps
        // per second, and on-CPU time of all its threads per step.
        let window = |length: Duration| -> (f64, f64) {
            let deadline = Instant::now() + length;
            let mut first: Option<(f64, f64, u64)> = None;
            let mut last = first;
            while Instant::now() < deadline {
                if let Ok(v) = rx.recv_timeout(Duration::from_millis(100))
                    && let (Some(s), Some(t)) = (v["steps"].as_f64(), v["time"].as_f64())
                {
                    let cpu = process_cpu_ns(pid);
                    first.get_or_insert((s, t, cpu));
                    last = Some((s, t, cpu));
                }
            }
            match (first, last) {
                (Some(a), Some(b)) if b.0 > a.0 && b.1 > a.1 => {
                    ((b.0 - a.0) / (b.1 - a.1), (b.2 - a.2) as f64 / (b.0 - a.0))
                }
                _ => (0.0, 0.0),
            }
        };
        // Waits for the workload's {"session": state} line.
        let session = |state: &str| -> Result<()> {
            let deadline = Instant::now() + Duration::from_secs(300);
            while Instant::now() < deadline {
                if let Ok(v) = rx.recv_timeout(Duration::from_millis(100))
                    && v["session"].as_str() == Some(state)
                {
                    return Ok(());
                }
            }
            bail!("the jax workload's profiler session never {state}")
        };
        let length = Duration::from_secs(JAX_SECONDS);
        window(Duration::from_secs(2));
        let mut windows = Vec::new();
        let mut memory = None;
        let mut discovery_line = String::new();
        let mut attach = String::new();
        for round in 0..JAX_ROUNDS {
            let rss0 = rss()?;
            let (rate, cpu) = window(length);
            windows.push((JaxConfig::Untraced, rate, cpu));
            let rss1 = rss()?;

            let logdir = self.scratch.join("jax-logs");
            let mut ebtrace = Traced::spawn({
                let mut c = Command::new(&self.ebtrace);
                c.args(["--pid", &pid.to_string()])
                    .args(["--duration", &format!("{}s", JAX_SECONDS + 1)])
                    .args(["--max-events", "100000000", "--logdir"])
                    .arg(&logdir);
                c
            })?;
            discovery_line = ebtrace
                .wait_line(
                    |l| l.contains("TraceMe recorder in"),
                    Duration::from_secs(60),
                )?
                .trim_start_matches("ebtrace: ")
                .to_string();
            attach = ebtrace
                .lines()
                .iter()
                .find_map(|l| {
                    Some(
                        l.split("probes attached in ")
                            .nth(1)?
                            .split(')')
                            .next()?
                            .to_string(),
                    )
                })
                .unwrap_or_default();
            let (rate, cpu) = window(length);
            windows.push((JaxConfig::Ebtrace, rate, cpu));
            ebtrace.wait_exit(Duration::from_secs(300))?;
            let events = traceme_events(ebtrace.lines()).context("no TraceMe summary line")?;
            let _ = std::fs::remove_dir_all(&logdir);
            if events == 0 {
                bail!("ebtrace recorded no TraceMe events from jax");
            }
            if round == 0 {
                // Before an in-process session drains the recorder.
                memory = Some((rss1 - rss0, rss()? - rss1, events, rate));
            }

            // jax's own profiler session, recording the same (host tracer
            // level 2, no Python tracer).
            signal(pid, libc::SIGUSR1);
            session("started")?;
            window(Duration::from_millis(500));
            let (rate, cpu) = window(length);
            windows.push((JaxConfig::InProcess, rate, cpu));
            // Stopping writes the session's trace, which takes a while.
            signal(pid, libc::SIGUSR2);
            session("stopped")?;
            window(Duration::from_secs(1));
        }
        signal(pid, libc::SIGTERM);
        let _ = child.wait();
        let _ = reader.join();
        let (rss_control_kib, rss_traced_kib, events, traced_rate) =
            memory.context("no ebtrace window")?;
        Ok(Some(JaxRun {
            windows,
            events,
            events_per_step: events as f64 / (traced_rate * JAX_SECONDS as f64).max(1.0),
            rss_control_kib,
            rss_traced_kib,
            discovery_line,
            attach,
        }))
    }
}

/// On-CPU time of all threads of `pid` so far (`/proc/PID/task/*/schedstat`).
fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| {
            std::fs::read_to_string(t.path().join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn render(
    env: &Environment,
    rounds: usize,
    runs: &[(usize, Run)],
    jax: Option<&JaxRun>,
    took: Duration,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## TraceMe benchmark ({})\n", env.date());
    md.push_str(&env.header_lines());
    let _ = writeln!(
        md,
        "- target: `traceme_workload --mode burst --threads 1` with the fixture library built by \
         g++ (a stand-in for TSL's recorder with the same ABI; `Record` starts with `push %rbp`): \
         one thread running back-to-back `TraceMe(\"burst_event\")` scopes; {}; {rounds} rounds of \
         the four configurations (order rotated), {RUN_SECONDS} s each; took {:.0} s",
        match env.target_cpu() {
            Some(cpu) => format!("pinned to CPU {cpu}, tracers unpinned"),
            None => "not pinned".to_string(),
        },
        took.as_secs_f64()
    );
    if env.virtual_machine() {
        let _ = writeln!(
            md,
            "\n> Measured in a VM, where a uprobe hit costs several times what it costs on bare \
             metal: compare ebtrace with bpftrace measured in the same run."
        );
    }
    let _ = writeln!(md, "\n#### a. Cost per TraceMe\n");
    let _ = writeln!(
        md,
        "CPU time of the target thread per TraceMe (kernel time of a probe hit included), median \
         of the rounds, and the wall-clock rate. The CPU time is what to compare: the rate also \
         moves with other load on the machine.\n"
    );
    let _ = writeln!(
        md,
        "| configuration | CPU ns per TraceMe | each round | added to in-process | TraceMe/s (wall, median) |"
    );
    let _ = writeln!(md, "|---|---:|---|---:|---:|");
    let of = |c: Config, f: fn(&Run) -> f64| -> Vec<f64> {
        runs.iter()
            .filter(|(_, r)| r.config == c)
            .map(|(_, r)| f(r))
            .collect()
    };
    let in_process_ns = median(&of(Config::InProcess, |r| r.cpu_ns_per_traceme));
    for c in Config::ALL {
        let cpu = of(c, |r| r.cpu_ns_per_traceme);
        let m = median(&cpu);
        let added = if matches!(c, Config::Ebtrace | Config::Bpftrace) {
            format!("{:+.0} ns", m - in_process_ns)
        } else {
            String::new()
        };
        let each: Vec<String> = cpu.iter().map(|v| format!("{v:.0}")).collect();
        let _ = writeln!(
            md,
            "| {} | {:.1} | {} | {added} | {} |",
            c.describe(),
            m,
            each.join(" / "),
            thousands(median(&of(c, |r| r.traceme_per_s)))
        );
    }
    let _ = writeln!(md, "\n#### b. Events ebtrace recorded\n");
    let _ = writeln!(
        md,
        "| round | TraceMe events | per second | dropped | the fixture queued | ebtrace peak RSS |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|");
    let mut best = 0.0f64;
    for (round, r) in runs.iter().filter(|(_, r)| r.config == Config::Ebtrace) {
        let e = r.ebtrace.as_ref().expect("ebtrace run");
        let per_s = e.events as f64 / r.run_s;
        if e.dropped == 0 && e.events == r.queued {
            best = best.max(per_s);
        }
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.0} MiB |",
            round + 1,
            thousands(e.events as f64),
            thousands(per_s),
            e.dropped,
            thousands(r.queued as f64),
            e.peak_rss_kib as f64 / 1024.0
        );
    }
    let _ = writeln!(
        md,
        "\nHighest rate with nothing dropped and every queued event recorded: **{} TraceMe \
         events/s** (one target thread; the target's own rate under the probe, not a ceiling \
         of ebtrace's reader).",
        thousands(best)
    );
    if let Some(bt) = runs
        .iter()
        .find_map(|(_, r)| r.bpftrace_records.map(|n| (n, r.queued)))
    {
        let _ = writeln!(
            md,
            "bpftrace counted {} `Record` calls against {} events queued in its last run.",
            thousands(bt.0 as f64),
            thousands(bt.1 as f64)
        );
    }
    let _ = writeln!(md, "\n#### c. Memory the target's recorder keeps\n");
    let untraced_rss: Vec<f64> = runs
        .iter()
        .filter(|(_, r)| r.config == Config::Untraced)
        .map(|(_, r)| r.vm_rss_kib as f64)
        .collect();
    let per_event: Vec<f64> = runs
        .iter()
        .filter(|(_, r)| r.config == Config::InProcess && r.queued > 0)
        .map(|(_, r)| (r.vm_rss_kib as f64 - median(&untraced_rss)) * 1024.0 / r.queued as f64)
        .collect();
    if !per_event.is_empty() {
        let _ = writeln!(
            md,
            "- fixture (TSL's queue layout: 48-byte events in 64 KiB blocks, names within the \
             15-byte short-string buffer): **{:.0} MB per million events** (RSS of in-process \
             runs minus an untraced run, over the events queued)",
            median(&per_event)
        );
    }
    match jax {
        Some(j) => {
            let net = (j.rss_traced_kib - j.rss_control_kib) as f64 * 1024.0;
            let _ = writeln!(
                md,
                "- jaxlib 0.10.2 (`jax_workload.py --bench`, a 64x64 jitted step in a \
                 TraceAnnotation, back to back): RSS grew {} KiB in {JAX_SECONDS} s untraced and \
                 {} KiB in {JAX_SECONDS} s of ebtrace capture that recorded {} events: **{:.0} MB \
                 per million events** (names longer than 15 bytes add a heap string each). That \
                 memory stays until a profiler session in the process drains it; `--max-events` \
                 (default 1,000,000) bounds it.",
                j.rss_control_kib,
                j.rss_traced_kib,
                thousands(j.events as f64),
                net / j.events as f64
            );
            let _ = writeln!(md, "\n#### d. jaxlib under ebtrace\n");
            let _ = writeln!(
                md,
                "{JAX_ROUNDS} rounds of {JAX_SECONDS} s windows (untraced, ebtrace, jax's own \
                 session) of `jax_workload.py --bench`; on-CPU time of all the process's threads \
                 per step, and steps per second (wall). ebtrace recorded {:.0} TraceMe events per \
                 step.\n",
                j.events_per_step
            );
            let _ = writeln!(
                md,
                "| configuration | CPU µs per step (median) | each round | vs untraced | steps/s (median) |"
            );
            let _ = writeln!(md, "|---|---:|---|---:|---:|");
            let of = |c: JaxConfig, cpu: bool| -> Vec<f64> {
                j.windows
                    .iter()
                    .filter(|w| w.0 == c)
                    .map(|w| if cpu { w.2 / 1e3 } else { w.1 })
                    .collect()
            };
            let base = median(&of(JaxConfig::Untraced, true));
            for c in JaxConfig::ALL {
                let cpu = of(c, true);
                let each: Vec<String> = cpu.iter().map(|v| format!("{v:.1}")).collect();
                let _ = writeln!(
                    md,
                    "| {} | {:.1} | {} | {:.2}x | {:.0} |",
                    c.describe(),
                    median(&cpu),
                    each.join(" / "),
                    median(&cpu) / base.max(1e-9),
                    median(&of(c, false))
                );
            }
            let _ = writeln!(md);
            let _ = writeln!(md, "- ebtrace: `{}`", j.discovery_line);
            let _ = writeln!(
                md,
                "- attach (all probes, recorder search included): {}",
                j.attach
            );
        }
        None => {
            let _ = writeln!(md, "- jaxlib: not measured (no jax in `.venv`)");
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_lines() {
        let lines = vec![
            "window 2000.0ms; 12 records captured, 3 dropped".to_string(),
            "TraceMe: 1044677 events recorded, 1044663 spans on the thread lines".to_string(),
        ];
        assert_eq!(traceme_events(&lines), Some(1_044_677));
        assert_eq!(dropped(&lines), Some(3));
        assert_eq!(traceme_events(&lines[..1]), None);
    }
}
