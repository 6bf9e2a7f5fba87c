//! The TraceMe benchmark (part of `cargo xtask bench`): what one TraceMe
//! costs its process untraced, recorded by an in-process session, recorded
//! by ebtrace (which switches recording on from outside and probes
//! `TraceMeRecorder::Record`), and with bpftrace counting calls of the same
//! function; the event rate ebtrace keeps up with; and the memory the
//! target's own recorder holds per recorded event (the price of switching
//! recording on from outside). The jax part ([`jax`]) sets ebtrace's routes
//! against jax's own profiler session on one jax process.
//! Results go to stdout and `target/bench/traceme.md`.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    harness::{self, Configuration},
    jax,
    report::Environment,
    report::thousands,
    tracer::Traced,
};
use crate::util::{self, Workload, median, say, signal};

/// Seconds each fixture run lets the target run.
const RUN_SECONDS: f64 = 2.0;
const RECORD_SYMBOL: &str = "_ZN3tsl8profiler15TraceMeRecorder6RecordEONS1_5EventE";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Config {
    Untraced,
    InProcess,
    Ebtrace,
    Bpftrace,
}

impl Configuration for Config {
    const ALL: &'static [Config] = &[
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
}

impl Config {
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
    jax_matrix: u32,
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
    for (round, config) in harness::rotated::<Config>(rounds) {
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
    let jax = jax::run(
        root,
        ebtrace,
        &bench.scratch,
        bench.target_cpu,
        rounds,
        jax_matrix,
    )?;
    let _ = std::fs::remove_dir_all(&bench.scratch);
    let md = render(env, rounds, &runs, jax.as_ref(), started.elapsed());
    harness::write_report(root, "traceme.md", &md)
}

impl Bench {
    fn fixture(&self, in_process: bool) -> Command {
        let mut cmd = harness::pinned(&self.program, self.target_cpu);
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
        let logdir = self.scratch.join("logs");
        let (mut tracer, paused) =
            harness::while_stopped(workload.pid, || self.attach(config, &workload, &logdir))?;
        let paused_s = paused.as_secs_f64();
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
                let done = harness::finish_ebtrace(t)?;
                let s = &done.summary;
                run.ebtrace = Some(EbtraceRun {
                    events: s
                        .traceme
                        .as_ref()
                        .context("no TraceMe in the summary")?
                        .events,
                    dropped: s.records.dropped,
                    peak_rss_kib: done.peak_rss_kib,
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

    /// Starts the tracer of `config`, if any, on the stopped `workload`.
    fn attach(&self, config: Config, workload: &Workload, logdir: &Path) -> Result<Option<Traced>> {
        Ok(match config {
            Config::Ebtrace => {
                let duration = format!("{}s", RUN_SECONDS as u64 * 2 + 60);
                let mut cmd =
                    harness::ebtrace_command(&self.ebtrace, workload.pid, &duration, logdir);
                cmd.args(["--max-events", "1000000000"]);
                Some(harness::spawn_ebtrace(
                    cmd,
                    |l| l.contains("level 2 set by ebtrace"),
                    Duration::from_secs(60),
                )?)
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
        })
    }
}

fn render(
    env: &Environment,
    rounds: usize,
    runs: &[(usize, Run)],
    jax: Option<&jax::JaxRun>,
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
    for &c in Config::ALL {
        let cpu = of(c, |r| r.cpu_ns_per_traceme);
        let m = median(&cpu);
        let added = if matches!(c, Config::Ebtrace | Config::Bpftrace) {
            format!("{:+.0} ns", m - in_process_ns)
        } else {
            String::new()
        };
        let _ = writeln!(
            md,
            "| {} | {:.1} | {} | {added} | {} |",
            c.describe(),
            m,
            harness::each(&cpu, 0),
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
            jax::render_memory(&mut md, j);
            jax::render(&mut md, j);
        }
        None => {
            let _ = writeln!(md, "- jaxlib: not measured (no jax in `.venv`)");
        }
    }
    md
}
