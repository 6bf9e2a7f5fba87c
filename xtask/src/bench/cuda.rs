//! `cargo xtask bench --only cuda`: what a traced `cuLaunchKernel` costs.
//!
//! The target is `tests/fixtures/cuda_workload --bench-seconds S`: after
//! setting up a context, stream and kernel, it waits for a line on stdin,
//! then calls `cuLaunchKernel` of the stand-in `libcuda.so.1` in a loop for
//! S seconds and prints its ns per call. Each round runs it untraced, under
//! ebtrace (entry + return probe, one record per call) and under an
//! equivalent bpftrace uprobe + uretprobe (saves the start time and the
//! function argument per thread, sums durations at return). A second part
//! runs ebtrace with one launching thread per CPU, for the highest launch
//! rate it records, and says whether it dropped anything. A third
//! ([`cuda_links`](super::cuda_links)) times attaching and releasing the
//! driver probes with each way of linking them.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{
    cuda_links::{self, LinkRun, Links},
    harness::{self, Configuration as _, Tracer as Config},
    report::thousands,
    tracer::Traced,
};
use crate::util::{self, median, say};

#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub rounds: usize,
    /// Seconds of launching per run.
    pub seconds: f64,
    /// Only the attach and release part.
    pub only_links: bool,
}

/// What the workload reported about one run.
#[derive(Clone, Copy, Debug)]
struct Launches {
    launches: u64,
    threads: u64,
    elapsed_s: f64,
    ns_per_launch: f64,
}

#[derive(Clone, Debug)]
struct Run {
    config: Config,
    launches: Launches,
    /// ebtrace's records and drops.
    recorded: Option<(u64, u64)>,
    /// Calls bpftrace counted.
    counted: Option<u64>,
}

struct Bench {
    ebtrace: PathBuf,
    lib_dir: PathBuf,
    workload: PathBuf,
    seconds: f64,
}

pub fn run_bench(ebtrace: &Path, opts: Options) -> Result<String> {
    let (lib_dir, workload) = ebtrace_tests::cuda::build();
    let bench = Bench {
        ebtrace: ebtrace.to_path_buf(),
        lib_dir,
        workload,
        seconds: opts.seconds,
    };
    let started = Instant::now();
    let mut runs = Vec::new();
    let mut rate_runs = Vec::new();
    if !opts.only_links {
        bench.cost_and_rate(opts.rounds, &mut runs, &mut rate_runs)?;
    }
    let mut link_runs = Vec::new();
    for (round, links) in harness::rotated::<Links>(opts.rounds) {
        let workload = Workload::start(&bench, 1)?;
        let scratch = std::env::temp_dir().join(format!("ebtrace-links-{}", workload.pid));
        let run = cuda_links::run(&bench.ebtrace, workload.pid, links, &scratch);
        let _ = std::fs::remove_dir_all(&scratch);
        let run = run?;
        say(format!(
            "cuda links round {}/{} {links:?}: attach {:?}, released in {:?} when killed; \
             attach right after a capture {:?}",
            round + 1,
            opts.rounds,
            run.attach,
            run.release_killed,
            run.attach_after
        ));
        link_runs.push(run);
    }
    Ok(render(
        &runs,
        &rate_runs,
        &link_runs,
        opts,
        started.elapsed(),
    ))
}

impl Bench {
    /// Parts a and b.
    fn cost_and_rate(
        &self,
        rounds: usize,
        runs: &mut Vec<Run>,
        rate_runs: &mut Vec<Run>,
    ) -> Result<()> {
        let bench = self;
        let opts = Options {
            rounds,
            seconds: self.seconds,
            only_links: false,
        };
        for (round, config) in harness::rotated::<Config>(opts.rounds) {
            let run = bench.run(config, 1)?;
            say(format!(
                "cuda round {}/{} {:<8} {:>7.0} ns per cuLaunchKernel",
                round + 1,
                opts.rounds,
                config.label(),
                run.launches.ns_per_launch
            ));
            runs.push(run);
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        for threads in [1, cpus] {
            let run = bench.run(Config::EbtraceNoLaunchStacks, threads)?;
            say(format!(
                "cuda ebtrace, {threads} launching thread(s): {:.0} launches/s, {} dropped",
                run.launches.launches as f64 / run.launches.elapsed_s,
                run.recorded.map_or(0, |r| r.1)
            ));
            rate_runs.push(run);
        }
        Ok(())
    }
}

/// The workload, set up and waiting for its start line.
struct Workload {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<std::process::ChildStdout>,
    pid: u32,
}

impl Workload {
    fn start(bench: &Bench, threads: usize) -> Result<Self> {
        let mut child = Command::new(&bench.workload)
            .args(["--bench-seconds", &bench.seconds.to_string()])
            .args(["--bench-threads", &threads.to_string()])
            .env("LD_LIBRARY_PATH", &bench.lib_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting cuda_workload")?;
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut first = String::new();
        stdout.read_line(&mut first)?;
        let v: serde_json::Value =
            serde_json::from_str(&first).with_context(|| format!("start line {first:?}"))?;
        let pid = v["pid"].as_u64().context("no pid")? as u32;
        Ok(Workload {
            child,
            stdin,
            stdout,
            pid,
        })
    }

    fn go(mut self) -> Result<Launches> {
        let mut stdin = self.stdin.take().expect("once");
        stdin.write_all(b"go\n")?;
        drop(stdin);
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        let status = self.child.wait()?;
        util::check_status("cuda_workload", status)?;
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("result line {line:?}"))?;
        let num = |k: &str| v[k].as_f64().with_context(|| format!("no {k} in {line:?}"));
        Ok(Launches {
            launches: num("launches")? as u64,
            threads: num("threads")? as u64,
            elapsed_s: num("elapsed_s")?,
            ns_per_launch: num("ns_per_launch")?,
        })
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Bench {
    fn run(&self, config: Config, threads: usize) -> Result<Run> {
        let workload = Workload::start(self, threads)?;
        let logdir = std::env::temp_dir().join(format!("ebtrace-cuda-bench-{}", workload.pid));
        let mut tracer = match config {
            Config::Untraced => None,
            Config::Ebtrace | Config::EbtraceNoLaunchStacks => {
                let duration = format!("{}s", self.seconds.ceil() + 60.0);
                let mut cmd =
                    harness::ebtrace_command(&self.ebtrace, workload.pid, &duration, &logdir);
                if config == Config::EbtraceNoLaunchStacks {
                    cmd.arg("--no-launch-stacks");
                }
                Some(harness::spawn_ebtrace(
                    cmd,
                    harness::attached,
                    Duration::from_secs(60),
                )?)
            }
            Config::Bpftrace => {
                let lib = self.lib_dir.join("libcuda.so.1");
                let program = format!(
                    "BEGIN {{ printf(\"xtask: bpftrace ready\\n\"); }}\n\
                     uprobe:{lib}:cuLaunchKernel {{ @start[tid] = nsecs; @function[tid] = arg0; }}\n\
                     uretprobe:{lib}:cuLaunchKernel /@start[tid]/ {{ @calls = count(); \
                     @ns = sum(nsecs - @start[tid]); delete(@start[tid]); delete(@function[tid]); }}\n",
                    lib = lib.display()
                );
                let mut cmd = Command::new("bpftrace");
                cmd.args(["-p", &workload.pid.to_string(), "-e", &program]);
                let mut t = Traced::spawn(cmd)?;
                t.wait_line(
                    |l| l.contains("xtask: bpftrace ready"),
                    Duration::from_secs(60),
                )?;
                Some(t)
            }
        };
        let launches = workload.go()?;
        let mut run = Run {
            config,
            launches,
            recorded: None,
            counted: None,
        };
        match (config, tracer.as_mut()) {
            (Config::Ebtrace | Config::EbtraceNoLaunchStacks, Some(t)) => {
                let records = harness::finish_ebtrace(t)?.summary.records;
                run.recorded = Some((records.captured, records.dropped));
                let _ = std::fs::remove_dir_all(&logdir);
            }
            (Config::Bpftrace, Some(t)) => {
                run.counted = Some(t.finish_bpftrace_map("calls")?);
            }
            _ => {}
        }
        // Without stacks every launch must be recorded; a launch stack is
        // a 21 KiB record, and at this loop's rate the ring fills.
        if let (Some((records, _)), true) = (
            run.recorded,
            threads == 1 && config == Config::EbtraceNoLaunchStacks,
        ) && records < launches.launches
        {
            bail!(
                "ebtrace recorded {records} records for {} launches",
                launches.launches
            );
        }
        Ok(run)
    }
}

fn render(
    runs: &[Run],
    rate_runs: &[Run],
    link_runs: &[LinkRun],
    opts: Options,
    took: Duration,
) -> String {
    let mut md = String::new();
    let date = util::stdout_of(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let bpftrace = util::stdout_of(Command::new("bpftrace").arg("--version"));
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ = writeln!(
        md,
        "## CUDA driver benchmark ({})\n\n- machine: {cpus} CPUs, kernel {}; {}",
        date.unwrap_or_default(),
        kernel.trim(),
        bpftrace.unwrap_or_default()
    );
    if runs.is_empty() {
        let _ = writeln!(
            md,
            "- {} rounds of part c only (`--suite cuda-links`); took {:.0} s",
            opts.rounds,
            took.as_secs_f64()
        );
    } else {
        let _ = writeln!(
            md,
            "- target: `cuda_workload --bench-seconds {}`: one thread \
             calls `cuLaunchKernel` of the stand-in `libcuda.so.1` in a loop; {} rounds of \
             untraced / ebtrace / bpftrace (order rotated each round); took {:.0} s",
            opts.seconds,
            opts.rounds,
            took.as_secs_f64()
        );
    }
    if !runs.is_empty() {
        render_cost_and_rate(&mut md, runs, rate_runs);
    }
    if !link_runs.is_empty() {
        cuda_links::render(&mut md, link_runs);
    }
    md
}

/// Parts a and b.
fn render_cost_and_rate(md: &mut String, runs: &[Run], rate_runs: &[Run]) {
    let _ = writeln!(
        md,
        "\n### a. ns per cuLaunchKernel call\n\n| configuration | ns per call (median) | each \
         round | added by the probes |\n|---|---:|---|---:|"
    );
    let ns = |c: Config| -> Vec<f64> {
        runs.iter()
            .filter(|r| r.config == c)
            .map(|r| r.launches.ns_per_launch)
            .collect()
    };
    let base = median(&ns(Config::Untraced));
    for &c in Config::ALL {
        let v = ns(c);
        let what = match c {
            Config::Untraced => "untraced",
            Config::Ebtrace => {
                "ebtrace (entry + return uprobe, all driver functions probed, each launch with \
                 its stack: the default)"
            }
            Config::EbtraceNoLaunchStacks => {
                "ebtrace `--no-launch-stacks` (entry + return uprobe, one 96-byte record per \
                 launch)"
            }
            Config::Bpftrace => {
                "bpftrace (uprobe + uretprobe on cuLaunchKernel: saves time and argument, \
                 sums durations)"
            }
        };
        let _ = writeln!(
            md,
            "| {what} | {:.0} | {} | {:+.0} ns |",
            median(&v),
            harness::each(&v, 0),
            median(&v) - base
        );
    }
    let counted: Vec<String> = runs
        .iter()
        .filter_map(|r| Some(format!("{}/{}", r.counted?, r.launches.launches)))
        .collect();
    let _ = writeln!(
        md,
        "\nbpftrace counted / launches made: {}.",
        counted.join(", ")
    );
    let dropped: Vec<String> = runs
        .iter()
        .filter(|r| r.config == Config::Ebtrace)
        .filter_map(|r| Some(format!("{} of {}", r.recorded?.1, r.launches.launches)))
        .collect();
    let _ = writeln!(
        md,
        "\nRecords ebtrace dropped with launch stacks (ring buffer full), of the launches made: \
         {}.",
        dropped.join(", ")
    );
    let _ = writeln!(
        md,
        "\n### b. Launch rate recorded by ebtrace (`--no-launch-stacks`)\n\n| launching threads | launches/s | records \
         | dropped |\n|---:|---:|---:|---:|"
    );
    let mut best: Option<f64> = None;
    for r in rate_runs {
        let rate = r.launches.launches as f64 / r.launches.elapsed_s;
        let (records, dropped) = r.recorded.unwrap_or_default();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} |",
            r.launches.threads,
            thousands(rate),
            thousands(records as f64),
            thousands(dropped as f64)
        );
        if dropped == 0 {
            best = Some(best.map_or(rate, |b: f64| b.max(rate)));
        }
    }
    match best {
        Some(b) => {
            let _ = writeln!(
                md,
                "\nHighest launch rate with zero drops: **{} launches/s** (default 16 MiB ring \
                 buffer); the probes themselves bound the rate.",
                thousands(b)
            );
        }
        None => {
            let _ = writeln!(md, "\nEvery rate run dropped records.");
        }
    }
}
