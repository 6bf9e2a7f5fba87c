//! The TraceMe flood benchmark (`--suite traceme-flood`): ebtrace's agent
//! route end to end on a jax process that enters TraceMe scopes as fast as
//! one thread can (`jax_workload.py --flood`, about 3M a second here).
//!
//! Per round and binary, one capture of the running process:
//! - **events per second** of the window that reach the trace, and how many
//!   scopes between the fixture's marks are missing (the goal: none);
//! - **the time after the window**, from its end to ebtrace's exit: the
//!   framework's session stopping and converting its events inside the
//!   target, then ebtrace merging and writing them;
//! - **ebtrace's own CPU time** over the whole capture;
//! - **ebtrace's peak RSS**, and per million events in the trace.
//!
//! With `--against OLD`, OLD captures the same process right after the
//! binary built here, each round: the same flood, side by side.

use std::{
    fmt::Write as _,
    io::Read as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ebtrace_tests::{
    python::{flood_count, start_jax_with},
    xspace,
};

use super::harness::{Summary, each};
use crate::util::{median, say};

/// Seconds each capture records.
const SECONDS: f64 = 2.0;

pub struct Options {
    pub rounds: usize,
    pub against: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug)]
struct Round {
    events: u64,
    window_s: f64,
    missing: i64,
    after_window: Duration,
    /// ebtrace's own CPU time, user and system.
    cpu: Duration,
    peak_rss_kib: u64,
}

impl Round {
    fn events_per_s(&self) -> f64 {
        self.events as f64 / self.window_s
    }

    fn mib_per_million(&self) -> f64 {
        self.peak_rss_kib as f64 / 1024.0 / (self.events as f64 / 1e6)
    }
}

/// Runs the rounds; the Markdown report.
pub fn run(root: &Path, ebtrace: &Path, opts: &Options) -> Result<String> {
    let python = root.join(".venv/bin/python");
    if !python.exists() {
        bail!("no .venv with jax: run `cargo xtask setup`");
    }
    let mut binaries = vec![("built", ebtrace.to_path_buf())];
    if let Some(old) = &opts.against {
        binaries.push(("against", old.clone()));
    }
    let mut rounds: Vec<Vec<Round>> = vec![Vec::new(); binaries.len()];
    let mut traces = Vec::new();
    for round in 0..opts.rounds {
        for (i, (label, binary)) in binaries.iter().enumerate() {
            let (r, trace) = one_capture(&python, binary)?;
            say(format!(
                "traceme flood round {}/{} ({label}): {:.2}M events/s in the trace, \
                 {:.2} s after the window, peak RSS {} MiB",
                round + 1,
                opts.rounds,
                r.events_per_s() / 1e6,
                r.after_window.as_secs_f64(),
                r.peak_rss_kib / 1024
            ));
            rounds[i].push(r);
            traces.push((i, rounds[i].len() - 1, trace));
        }
    }
    // Counted once every capture is done: decoding a trace grows this
    // process, and a child it starts inherits its peak resident set.
    for (i, round, (logdir, pid)) in traces {
        let trace = ebtrace_tests::xplane_files(&logdir)
            .into_iter()
            .next()
            .context("no trace written")?;
        rounds[i][round].missing = flood_count(&xspace::load(&trace), pid).missing;
        let _ = std::fs::remove_dir_all(&logdir);
    }
    Ok(render(&binaries, &rounds, opts))
}

/// One capture of a fresh flood process by `ebtrace`; its log directory
/// and the process's pid, for [`flood_count`].
fn one_capture(python: &Path, ebtrace: &Path) -> Result<(Round, (PathBuf, u32))> {
    let workload = start_jax_with(python, &["--flood"]);
    // Past jax's start-up: the loop is flat out.
    std::thread::sleep(Duration::from_secs(2));
    let pid = workload.pid;
    let logdir = std::env::temp_dir().join(format!("ebtrace-traceme-flood-{pid}"));
    let mut child = Command::new(ebtrace)
        .args([
            "--pid",
            &pid.to_string(),
            "--duration",
            &format!("{SECONDS}s"),
        ])
        .args(["--traceme", "agent", "--max-events", "100000000", "--json"])
        .arg("--logdir")
        .arg(&logdir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting ebtrace")?;
    let started = Instant::now();
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .context("ebtrace's stdout")?
        .read_to_string(&mut stdout)?;
    let (status, peak_rss_kib, cpu) = wait_with_usage(child.id())?;
    let elapsed = started.elapsed();
    if status != 0 {
        bail!("ebtrace exited with status {status}");
    }
    let summary = Summary::from_stdout(&stdout.lines().collect::<Vec<_>>())?;
    let window_s = summary.window.duration_ns as f64 / 1e9;
    let events = summary
        .process(pid)
        .and_then(|p| p.framework_session.as_ref())
        .map(|f| f.events)
        .context("no framework session in ebtrace's summary")?;
    let attach = Duration::from_nanos(summary.attach_ns);
    let round = Round {
        events,
        window_s,
        missing: 0,
        after_window: elapsed.saturating_sub(attach + Duration::from_secs_f64(window_s)),
        cpu,
        peak_rss_kib,
    };
    Ok((round, (logdir, pid)))
}

/// Reaps child `pid`: its exit status, its peak resident set (KiB; at
/// least this process's own when it started the child) and its CPU time.
fn wait_with_usage(pid: u32) -> Result<(i32, u64, Duration)> {
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `status` and `usage` are valid for writes; `pid` is our own
    // unreaped child.
    let reaped = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    if reaped != pid as libc::pid_t {
        bail!("waiting for ebtrace: {}", std::io::Error::last_os_error());
    }
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Ok((
        libc::WEXITSTATUS(status),
        usage.ru_maxrss as u64,
        time(usage.ru_utime) + time(usage.ru_stime),
    ))
}

fn render(binaries: &[(&str, PathBuf)], rounds: &[Vec<Round>], opts: &Options) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## TraceMe flood through the agent, {} rounds of {SECONDS} s captures\n",
        opts.rounds
    );
    let _ = writeln!(
        md,
        "| binary | events/s in the trace (median; each) | scopes missing | after the window | ebtrace CPU | ebtrace peak RSS | MiB per million events |"
    );
    let _ = writeln!(md, "|---|---|---:|---|---|---|---|");
    for ((label, _), rs) in binaries.iter().zip(rounds) {
        let rates: Vec<f64> = rs.iter().map(|r| r.events_per_s() / 1e6).collect();
        let after: Vec<f64> = rs.iter().map(|r| r.after_window.as_secs_f64()).collect();
        let cpu: Vec<f64> = rs.iter().map(|r| r.cpu.as_secs_f64()).collect();
        let rss: Vec<f64> = rs.iter().map(|r| r.peak_rss_kib as f64 / 1024.0).collect();
        let per_million: Vec<f64> = rs.iter().map(Round::mib_per_million).collect();
        let _ = writeln!(
            md,
            "| {label} | **{:.2}M** ({}) | {} | {:.2} s ({}) | {:.2} s ({}) | {:.0} MiB ({}) | **{:.0}** ({}) |",
            median(&rates),
            each(&rates, 2),
            rs.iter().map(|r| r.missing).sum::<i64>(),
            median(&after),
            each(&after, 2),
            median(&cpu),
            each(&cpu, 2),
            median(&rss),
            each(&rss, 0),
            median(&per_million),
            each(&per_million, 0),
        );
    }
    md
}
