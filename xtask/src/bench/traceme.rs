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
/// Seconds of the jax control and traced windows.
const JAX_SECONDS: u64 = 5;
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
    /// Seconds the target ran (traced, for a traced run).
    run_s: f64,
    /// Events the fixture's recorder queued, and its RSS at the end.
    queued: u64,
    vm_rss_kib: u64,
    ebtrace: Option<EbtraceRun>,
    bpftrace_records: Option<u64>,
}

/// The jax measurement: step rates and the memory jaxlib's recorder keeps.
#[derive(Clone, Debug)]
struct JaxRun {
    steps_per_s_untraced: f64,
    steps_per_s_traced: f64,
    steps_per_s_in_process: f64,
    events: u64,
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

/// Builds the fixture program and its g++ library (stripped: the
/// recorder's symbols are in `.dynsym`, where bpftrace finds them too).
fn build_fixture(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let src = root.join("tests/fixtures/traceme");
    let dir = root.join("target/fixtures/traceme-bench");
    std::fs::create_dir_all(&dir)?;
    let program = dir.join("traceme_workload");
    let lib = dir.join("libtraceme-gcc.so");
    util::run(
        Command::new("cc")
            .args(["-O2", "-pthread", "-o"])
            .arg(&program)
            .arg(src.join("traceme_workload.c"))
            .arg("-ldl"),
    )?;
    util::run(
        Command::new("g++")
            .args([
                "-std=c++17",
                "-O2",
                "-fno-omit-frame-pointer",
                "-fPIC",
                "-shared",
                "-fvisibility=hidden",
                "-DTM_EXPORT_TSL=1",
                "-o",
            ])
            .arg(&lib)
            .arg(src.join("tsl_profiler.cc"))
            .arg(src.join("workload.cc")),
    )?;
    util::run(Command::new("strip").arg("--strip-all").arg(&lib))?;
    Ok((program, lib))
}

pub fn run_traceme_bench(
    root: &Path,
    ebtrace: &Path,
    env: &Environment,
    rounds: usize,
) -> Result<()> {
    let (program, lib) = build_fixture(root)?;
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
                "traceme round {}/{rounds} {:<10} {:>12} TraceMe/s",
                round + 1,
                config.label(),
                thousands(run.traceme_per_s)
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
        let mut run = Run {
            config,
            traceme_per_s: events / run_s,
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
                signal(t.pid(), libc::SIGINT);
                t.wait_exit(Duration::from_secs(60))?;
                run.bpftrace_records = t
                    .lines()
                    .iter()
                    .find_map(|l| l.strip_prefix("@records: ")?.trim().parse().ok());
            }
            _ => {}
        }
        Ok(run)
    }

    /// jaxlib: step rate untraced and under ebtrace, and the memory its
    /// recorder keeps for the events ebtrace made it record. Skipped
    /// without jax in `.venv` (`cargo xtask setup` installs it).
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
        // Progress lines: (steps, monotonic time); the rate between two.
        let mut last: Option<(f64, f64)> = None;
        let rate_until = |deadline: Instant, last: &mut Option<(f64, f64)>| -> f64 {
            let mut from: Option<(f64, f64)> = *last;
            let mut to = from;
            while Instant::now() < deadline {
                if let Ok(v) = rx.recv_timeout(Duration::from_millis(100))
                    && let (Some(s), Some(t)) = (v["steps"].as_f64(), v["time"].as_f64())
                {
                    from.get_or_insert((s, t));
                    to = Some((s, t));
                }
            }
            *last = to;
            match (from, to) {
                (Some(a), Some(b)) if b.1 > a.1 => (b.0 - a.0) / (b.1 - a.1),
                _ => 0.0,
            }
        };
        // Let it settle, then a control window, then a traced one.
        rate_until(Instant::now() + Duration::from_secs(2), &mut last);
        let rss0 = rss()?;
        let untraced = rate_until(Instant::now() + Duration::from_secs(JAX_SECONDS), &mut last);
        let rss1 = rss()?;
        let logdir = self.scratch.join("jax-logs");
        let mut ebtrace = Traced::spawn({
            let mut c = Command::new(&self.ebtrace);
            c.args([
                "--pid",
                &pid.to_string(),
                "--duration",
                &format!("{JAX_SECONDS}s"),
            ])
            .args(["--max-events", "100000000", "--logdir"])
            .arg(&logdir);
            c
        })?;
        let discovery_line = ebtrace
            .wait_line(
                |l| l.contains("TraceMe recorder in"),
                Duration::from_secs(60),
            )?
            .trim_start_matches("ebtrace: ")
            .to_string();
        let attach = ebtrace
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
        let traced = rate_until(Instant::now() + Duration::from_secs(JAX_SECONDS), &mut last);
        ebtrace.wait_exit(Duration::from_secs(300))?;
        let rss2 = rss()?;
        let events = traceme_events(ebtrace.lines()).context("no TraceMe summary line")?;
        // jax's own profiler session, recording the same (host tracer
        // level 2, no Python tracer), for comparison.
        signal(pid, libc::SIGUSR1);
        rate_until(Instant::now() + Duration::from_millis(500), &mut last);
        let in_process = rate_until(Instant::now() + Duration::from_secs(JAX_SECONDS), &mut last);
        signal(pid, libc::SIGUSR2);
        rate_until(Instant::now() + Duration::from_secs(2), &mut last);
        signal(pid, libc::SIGTERM);
        let _ = child.wait();
        let _ = reader.join();
        let _ = std::fs::remove_dir_all(&logdir);
        if events == 0 {
            bail!("ebtrace recorded no TraceMe events from jax");
        }
        Ok(Some(JaxRun {
            steps_per_s_untraced: untraced,
            steps_per_s_traced: traced,
            steps_per_s_in_process: in_process,
            events,
            rss_control_kib: rss1 - rss0,
            rss_traced_kib: rss2 - rss1,
            discovery_line,
            attach,
        }))
    }
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
        "| configuration | TraceMe/s (median) | each round | ns per TraceMe | added to in-process |"
    );
    let _ = writeln!(md, "|---|---:|---|---:|---:|");
    let rate = |c: Config| -> Vec<f64> {
        runs.iter()
            .filter(|(_, r)| r.config == c)
            .map(|(_, r)| r.traceme_per_s)
            .collect()
    };
    let in_process_ns = 1e9 / median(&rate(Config::InProcess));
    for c in Config::ALL {
        let rates = rate(c);
        let m = median(&rates);
        let ns = 1e9 / m;
        let added = if matches!(c, Config::Ebtrace | Config::Bpftrace) {
            format!("{:+.0} ns", ns - in_process_ns)
        } else {
            "".to_string()
        };
        let each: Vec<String> = rates.iter().map(|r| thousands(*r)).collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {added} |",
            c.describe(),
            thousands(m),
            each.join(" / "),
            ns
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
            let ratio = |r: f64| r / j.steps_per_s_untraced.max(1e-9);
            let _ = writeln!(
                md,
                "- steps/s ({JAX_SECONDS} s windows, one after the other): untraced {:.0}; during \
                 the ebtrace capture {:.0} ({:.2}x; {:.0} TraceMe events per step); in jax's own \
                 profiler session (`jax.profiler.start_trace`, host tracer level 2, no Python \
                 tracer) {:.0} ({:.2}x)",
                j.steps_per_s_untraced,
                j.steps_per_s_traced,
                ratio(j.steps_per_s_traced),
                j.events as f64 / (j.steps_per_s_traced * JAX_SECONDS as f64).max(1.0),
                j.steps_per_s_in_process,
                ratio(j.steps_per_s_in_process)
            );
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
