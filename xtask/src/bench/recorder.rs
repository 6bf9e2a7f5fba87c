//! `cargo xtask bench --suite recorder`: what the flight recorder of
//! `ebtrace serve --retain 30s` costs while it runs, and how fast it
//! answers `GetSnapshot` once it holds its whole window.
//!
//! For each target, pinned to one CPU (the scheduling fixture's light
//! `mixed` mode and its ping-pong; a jax loop, `jax_workload.py --bench`;
//! `cuda_workload --bench-seconds` launching kernels flat out, with 10 µs
//! of its own work between launches, and so with each launch made of the
//! two driver calls jax's steps make most of): the target's rate untraced for
//! the run's seconds, then with the recorder on for as long; ebtrace's own
//! CPU time over that run (`/proc/PID/stat`) and from 10 s into it on (its
//! steady state, once its one-off start is over), its resident memory, the
//! records it holds; then one `GetSnapshot`, timed from sending to the
//! decoded response, and ebtrace's peak resident memory while it answered.
//! With `--against PATH`, an earlier binary records the same target right
//! after the one built here, row by row.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, profiler::XSpace, profiler_service_client::ProfilerServiceClient,
};
use prost::Message as _;

use super::{
    harness::{self, status_kib},
    jax,
    serve::Server,
};
use crate::util::{self, Workload, say};

#[derive(Clone, Debug)]
pub struct Options {
    pub seconds: f64,
    pub retain: Duration,
    pub target_cpu: Option<usize>,
    /// An earlier ebtrace binary to measure beside the one built here.
    pub against: Option<PathBuf>,
    /// The targets to run (all when empty).
    pub targets: Vec<Target>,
}

/// A target of the recorder benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// The fixture's light mix of a spinning, a sleeping and a ping-pong thread.
    Mixed,
    /// The ping-pong flat out.
    Pingpong,
    /// A jax loop.
    Jax,
    /// The stand-in driver's launch loops, flat out and 10 µs apart.
    Cuda,
}

impl Options {
    fn runs(&self, target: Target) -> bool {
        self.targets.is_empty() || self.targets.contains(&target)
    }
}

struct Row {
    /// The target, and what its rate counts.
    mode: &'static str,
    unit: &'static str,
    /// Which binary recorded: "built" or "against".
    binary: &'static str,
    /// The recorder's stack samples a second per CPU (`--retain-sample-hz`).
    sample_hz: &'static str,
    /// The target's own rate (round trips/s) untraced and with the recorder.
    rate: (f64, f64),
    /// ebtrace's CPU over the run, in percent of one CPU.
    cpu_percent: f64,
    /// ebtrace's CPU from [`SETTLE`] into the run on, in percent of one CPU.
    steady_percent: f64,
    /// What its CPU over the run holds beyond the steady rate: the one-off
    /// start (the kernel's symbol table, the first objects' symbols and
    /// debug information), in ms.
    start_ms: f64,
    rss_kib: u64,
    /// ebtrace's peak resident memory while it answered the snapshot.
    peak_rss_kib: u64,
    held: u64,
    forgotten: u64,
    snapshot: Duration,
    /// The server's own figures for the snapshot, from its log: building
    /// the timeline, then building and encoding the XSpace (ms).
    server_ms: Option<(u64, u64, u64)>,
    events: usize,
    bytes: usize,
}

/// How long into a run ebtrace's steady CPU is measured from (at most a
/// third of the run): its one-off start is over by then.
const SETTLE: Duration = Duration::from_secs(10);

/// [`SETTLE`], or a third of a shorter run.
fn settle(opts: &Options) -> Duration {
    SETTLE.min(Duration::from_secs_f64(opts.seconds / 3.0))
}

/// ebtrace's CPU where its recorder came on, and a reading [`SETTLE`]
/// later: CPU ns of all its threads (`/proc/PID/task/*/schedstat`), and
/// when.
struct CpuReadings {
    ticks: (u64, Instant),
    settled: std::thread::JoinHandle<(u64, Instant)>,
}

pub fn run(root: &Path, ebtrace: &Path, fixture: &Path, opts: &Options) -> Result<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut binaries = vec![("built", ebtrace)];
    if let Some(against) = &opts.against {
        binaries.push(("against", against.as_path()));
    }
    let mut rows = Vec::new();
    // 1 Hz against the default: what the stack samples cost.
    for (target, mode, sample_hz) in [
        (Target::Mixed, "mixed", "1"),
        (Target::Mixed, "mixed", DEFAULT_HZ),
        (Target::Pingpong, "pingpong", "1"),
        (Target::Pingpong, "pingpong", DEFAULT_HZ),
    ] {
        if !opts.runs(target) {
            continue;
        }
        let untraced = target_rate(fixture, mode, opts, |_| Ok(()))?;
        for &(binary, path) in &binaries {
            let recorded = recorded_run(&runtime, path, mode, sample_hz, opts, &mut rows);
            let traced = target_rate(fixture, mode, opts, recorded)?;
            if let Some(r) = rows.last_mut() {
                r.rate = (untraced, traced);
                r.sample_hz = sample_hz;
                r.binary = binary;
            }
        }
    }
    if opts.runs(Target::Jax) {
        jax_rows(root, &runtime, &binaries, opts, &mut rows)?;
    }
    if !opts.runs(Target::Cuda) {
        return Ok(render(&rows, opts));
    }
    let (lib_dir, workload) = ebtrace_tests::cuda::build();
    // Each launch alone, or after a cuCtxSetCurrent as jax's steps make
    // them (`cuLaunchKernelEx`).
    for (mode, gap_ns, calls) in [
        ("cuda, flat out", 0, &[][..]),
        ("cuda, 10 µs apart", 10_000, &[]),
        ("cuda, jax's calls, 10 µs apart", 10_000, &["--bench-jax"]),
    ] {
        let loop_of = LaunchLoop {
            lib_dir: &lib_dir,
            workload: &workload,
            gap_ns,
            calls,
        };
        let untraced = cuda_rate(&loop_of, opts, |_| Ok(()))?;
        for &(binary, path) in &binaries {
            let recorded = recorded_run(&runtime, path, mode, DEFAULT_HZ, opts, &mut rows);
            let traced = cuda_rate(&loop_of, opts, recorded)?;
            if let Some(r) = rows.last_mut() {
                r.rate = (untraced, traced);
                r.unit = "launches";
                r.sample_hz = DEFAULT_HZ;
                r.binary = binary;
            }
        }
    }
    Ok(render(&rows, opts))
}

/// What a run of a target calls back when `ebtrace` records it: starts the
/// recorder while the target waits, and measures it into `rows` once the
/// run is over.
fn recorded_run<'a>(
    runtime: &'a tokio::runtime::Runtime,
    ebtrace: &'a Path,
    mode: &'static str,
    sample_hz: &'a str,
    opts: &'a Options,
    rows: &'a mut Vec<Row>,
) -> impl FnMut(Phase) -> Result<()> + 'a {
    let mut recording = None;
    move |phase| match phase {
        Phase::Stopped(pid) => {
            recording = Some(start_recorder(ebtrace, pid, opts, sample_hz)?);
            Ok(())
        }
        Phase::Ran => {
            let (server, readings) = recording.take().context("the recorder did not start")?;
            let measured = measure(runtime, mode, &server, readings)?;
            server.stop()?;
            rows.push(measured);
            Ok(())
        }
    }
}

/// The recorder's stack-sampling rate when none is given
/// (`--retain-sample-hz`).
const DEFAULT_HZ: &str = "19";

/// The flag that sets the recorder's sampling rate: `--retain-sample-hz`,
/// or, for a binary `--against` that predates it, `--sample-hz`.
fn sample_rate_flag(ebtrace: &Path) -> Result<&'static str> {
    let help = std::process::Command::new(ebtrace)
        .args(["serve", "--help"])
        .output()
        .with_context(|| format!("running {} serve --help", ebtrace.display()))?;
    Ok(
        if String::from_utf8_lossy(&help.stdout).contains("--retain-sample-hz") {
            "--retain-sample-hz"
        } else {
            "--sample-hz"
        },
    )
}

/// `ebtrace serve --pid PID --retain ...`, once its recorder is on, and its
/// CPU readings from then.
fn start_recorder(
    ebtrace: &Path,
    pid: u32,
    opts: &Options,
    sample_hz: &str,
) -> Result<(Server, CpuReadings)> {
    let retain = format!("{}s", opts.retain.as_secs());
    let server = Server::start(
        ebtrace,
        pid,
        &[
            "--retain",
            &retain,
            "--http",
            "127.0.0.1:0",
            sample_rate_flag(ebtrace)?,
            sample_hz,
        ],
    )?;
    server.wait_line("flight recorder on", Duration::from_secs(60))?;
    let ebtrace_pid = server.child.id();
    let ticks = ticks(ebtrace_pid);
    let settle = settle(opts);
    let settled = std::thread::spawn(move || {
        std::thread::sleep(settle);
        (harness::process_cpu_ns(ebtrace_pid), Instant::now())
    });
    Ok((server, CpuReadings { ticks, settled }))
}

/// One jax process: its steps per second over a window untraced, then
/// over a window of each binary's recorder.
fn jax_rows(
    root: &Path,
    runtime: &tokio::runtime::Runtime,
    binaries: &[(&'static str, &Path)],
    opts: &Options,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let python = root.join(".venv/bin/python");
    if !util::succeeds(std::process::Command::new(&python).args(["-c", "import jax"])) {
        say("no jax in .venv: skipping the jax target (run `cargo xtask setup`)");
        return Ok(());
    }
    let target = jax::Target::start(
        &python,
        &root.join("tests/fixtures/traceme/jax_workload.py"),
        opts.target_cpu,
        jax::DEFAULT_MATRIX,
    )?;
    std::thread::sleep(Duration::from_secs(2));
    let from = jax::monotonic_s();
    let (untraced, _) = target.measure(from, from + opts.seconds)?;
    for &(binary, path) in binaries {
        let (server, readings) = start_recorder(path, target.pid, opts, DEFAULT_HZ)?;
        let from = jax::monotonic_s();
        let (traced, _) = target.measure(from, from + opts.seconds)?;
        let mut row = measure(runtime, "jax", &server, readings)?;
        server.stop()?;
        row.rate = (untraced, traced);
        row.unit = "steps";
        row.sample_hz = DEFAULT_HZ;
        row.binary = binary;
        rows.push(row);
    }
    Ok(())
}

/// The stand-in driver's launch loop (`cuda_workload --bench-seconds`).
struct LaunchLoop<'a> {
    lib_dir: &'a Path,
    workload: &'a Path,
    /// ns of its own work between two launches.
    gap_ns: u64,
    /// More of its flags: which driver calls make a launch.
    calls: &'a [&'a str],
}

/// Runs `cuda_workload --bench-seconds` for the run's seconds, calling `at`
/// before its launches start and once they are over; its launches per
/// second.
fn cuda_rate(
    launches: &LaunchLoop<'_>,
    opts: &Options,
    mut at: impl FnMut(Phase) -> Result<()>,
) -> Result<f64> {
    let mut child = harness::pinned(launches.workload, opts.target_cpu)
        .args(["--bench-seconds", &opts.seconds.to_string()])
        .args(["--bench-gap-ns", &launches.gap_ns.to_string()])
        .args(launches.calls)
        .env("LD_LIBRARY_PATH", launches.lib_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting cuda_workload")?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    let started: serde_json::Value =
        serde_json::from_str(&line).with_context(|| format!("start line {line:?}"))?;
    let pid = started["pid"].as_u64().context("no pid")? as u32;
    let result = (|| {
        at(Phase::Stopped(pid))?;
        stdin.write_all(b"go\n")?;
        line.clear();
        stdout.read_line(&mut line)?;
        at(Phase::Ran)
    })();
    if result.is_err() {
        let _ = child.kill();
    }
    let status = child.wait()?;
    result?;
    util::check_status("cuda_workload", status)?;
    let v: serde_json::Value =
        serde_json::from_str(&line).with_context(|| format!("result line {line:?}"))?;
    let num = |k: &str| v[k].as_f64().with_context(|| format!("no {k} in {line:?}"));
    Ok(num("launches")? / num("elapsed_s")?.max(1e-3))
}

/// Where a run is when [`target_rate`] calls back.
enum Phase {
    /// The target (this pid) is stopped, before the run.
    Stopped(u32),
    /// The run's seconds are over; the target still runs.
    Ran,
}

/// Runs the target for the run's seconds, calling `at` while it is stopped
/// before the run and once the run is over; its round trips per second.
fn target_rate(
    fixture: &Path,
    mode: &str,
    opts: &Options,
    mut at: impl FnMut(Phase) -> Result<()>,
) -> Result<f64> {
    let mut cmd = harness::pinned(fixture, opts.target_cpu);
    cmd.args(["--mode", mode]);
    let workload = Workload::start(cmd)?;
    let (_, stopped) = harness::while_stopped(workload.pid, || at(Phase::Stopped(workload.pid)))?;
    std::thread::sleep(Duration::from_secs_f64(opts.seconds));
    let measured = at(Phase::Ran);
    let counters = workload.stop()?;
    measured?;
    let round_trips = counters["round_trips"].as_f64().context("round_trips")?;
    let elapsed = counters["elapsed_s"].as_f64().context("elapsed_s")?;
    Ok(round_trips / (elapsed - stopped.as_secs_f64()).max(1e-3))
}

/// ebtrace's cost over the run, what it holds, and one snapshot.
fn measure(
    runtime: &tokio::runtime::Runtime,
    mode: &'static str,
    server: &Server,
    readings: CpuReadings,
) -> Result<Row> {
    let pid = server.child.id();
    let (cpu_start, started) = readings.ticks;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_s = (ticks(pid).0 - cpu_start) as f64 / 100.0;
    let cpu_percent = 100.0 * cpu_s / elapsed;
    let (settled_ns, settled_at) = readings
        .settled
        .join()
        .map_err(|_| anyhow::anyhow!("the CPU reading thread panicked"))?;
    let steady_ns = harness::process_cpu_ns(pid).saturating_sub(settled_ns);
    let steady_percent = 100.0 * steady_ns as f64 / 1e9 / settled_at.elapsed().as_secs_f64();
    let start_ms = (cpu_s - steady_percent / 100.0 * elapsed).max(0.0) * 1e3;
    let metrics = server.http_get("/metrics")?;
    let metric = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    let (held, forgotten) = (
        metric("ebtrace_recorder_records"),
        metric("ebtrace_recorder_forgotten_records_total"),
    );
    let rss_kib = status_kib(pid, "VmRSS").unwrap_or(0);
    // Resets VmHWM: the peak from here on is the snapshot's.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")?;
    let asked = Instant::now();
    let response = runtime.block_on(async {
        let mut client = ProfilerServiceClient::connect(format!("http://{}", server.addr))
            .await?
            .max_decoding_message_size(usize::MAX);
        let r = client
            .get_snapshot(GetSnapshotRequest {
                snapshot_session_id: "bench".into(),
            })
            .await?;
        anyhow::Ok(r.into_inner())
    })?;
    let snapshot = asked.elapsed();
    let peak_rss_kib = status_kib(pid, "VmHWM").unwrap_or(0);
    let data = &response.tool_data.first().context("no tool_data")?.data;
    let space = XSpace::decode(data.as_slice())?;
    let events = harness::xspace_events(&space);
    say(format!(
        "recorder {mode}: ebtrace {cpu_percent:.2}% CPU ({steady_percent:.2}% steady, {start_ms:.0} ms one-off), {held} records held, snapshot in {:.0} ms ({events} events)",
        snapshot.as_secs_f64() * 1e3
    ));
    Ok(Row {
        mode,
        unit: "round trips",
        binary: "built",
        sample_hz: "",
        rate: (0.0, 0.0),
        cpu_percent,
        steady_percent,
        start_ms,
        rss_kib,
        peak_rss_kib,
        held,
        forgotten,
        snapshot,
        server_ms: (|| {
            let logged = |key| server.logged_ms("ebtrace: session bench ", 0, key);
            Some((logged("timeline ")?, logged("built ")?, logged("encoded ")?))
        })(),
        events,
        bytes: data.len(),
    })
}

/// A process's user + system CPU ticks now, and when they were read.
fn ticks(pid: u32) -> (u64, Instant) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<u64> = stat
        .rfind(')')
        .map(|i| &stat[i + 2..])
        .unwrap_or_default()
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let t = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    (t, Instant::now())
}

/// ebtrace's steady CPU for each unit of the target's rate (a launch, a
/// round trip, a step), in ns: between two binaries, a target that ran
/// faster under one gave it more to record, which its CPU share alone
/// hides.
fn per_unit_ns(steady_percent: f64, rate: f64) -> f64 {
    if rate > 0.0 {
        steady_percent / 100.0 * 1e9 / rate
    } else {
        0.0
    }
}

fn render(rows: &[Row], opts: &Options) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## Flight recorder: `ebtrace serve --retain {}s`\n",
        opts.retain.as_secs()
    );
    let _ = writeln!(
        md,
        "- each target pinned to {}, {} s untraced, then {} s with the recorder on (default \
         `--retain-memory` 256 MiB); then one `GetSnapshot`\n",
        opts.target_cpu
            .map_or("no CPU".to_string(), |c| format!("CPU {c}")),
        opts.seconds,
        opts.seconds
    );
    let _ = writeln!(
        md,
        "| target | stack samples | binary | rate untraced | with the recorder | ratio | ebtrace CPU over the run (% of one CPU) | steady, from {} s on | steady, per unit of the target's rate | one-off start | ebtrace RSS | records held / forgotten | GetSnapshot answered in | server ms: timeline / XSpace built / encoded | peak RSS while answering | events | XSpace |",
        settle(opts).as_secs_f64()
    );
    let _ = writeln!(
        md,
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} Hz | {} | {:.0} {}/s | {:.0}/s | {:.2} | {:.2}% | {:.2}% | {:.1} ns | {:.0} ms | {:.0} MiB | {} / {} | {:.0} ms | {} | {:.0} MiB | {} | {:.1} MB |",
            r.mode,
            r.sample_hz,
            r.binary,
            r.rate.0,
            r.unit,
            r.rate.1,
            harness::ratio(r.rate.1, r.rate.0),
            r.cpu_percent,
            r.steady_percent,
            per_unit_ns(r.steady_percent, r.rate.1),
            r.start_ms,
            r.rss_kib as f64 / 1024.0,
            r.held,
            r.forgotten,
            r.snapshot.as_secs_f64() * 1e3,
            r.server_ms
                .map_or("n/a".to_string(), |(t, b, e)| format!("{t} / {b} / {e}")),
            r.peak_rss_kib as f64 / 1024.0,
            r.events,
            r.bytes as f64 / 1e6
        );
    }
    md
}
