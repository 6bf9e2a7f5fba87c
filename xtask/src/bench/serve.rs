//! `cargo xtask bench --serve`: how `ebtrace serve` answers a 2 s capture
//! request. For each round a gRPC client asks, like `jax.collect_profile`
//! does (start now, `max_events` 1,000,000), for 2 s of the fixture; the
//! bench records the time from sending to the whole response received
//! minus the 2 s asked for, the events and bytes of the XSpace that came
//! back, the server's own breakdown (timeline, XSpace encoding), and the
//! server's resident memory idle and at its peak during the request.
//! With `--against PATH`, an earlier binary answers the same requests on
//! the same target right after the one built here, row by row.
//! Results go to stdout and `target/bench/serve.md`.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ebtrace_proto::tensorflow::{
    ProfileOptions, ProfileRequest, profiler::XSpace,
    profiler_service_client::ProfilerServiceClient,
};
use prost::Message as _;

use super::harness::{self, status_kib};
use crate::{
    setup,
    util::{self, Workload, median, say, signal},
};

/// The capture length the target is stated for.
const CAPTURE_MS: u64 = 2000;
/// What TSL's clients send.
const CLIENT_MAX_EVENTS: u64 = 1_000_000;

#[derive(Clone, Debug)]
pub struct Options {
    pub rounds: usize,
    pub target_cpu: Option<usize>,
    /// An earlier ebtrace binary to measure beside the one built here.
    pub against: Option<PathBuf>,
}

/// One answered request.
struct Answer {
    mode: &'static str,
    /// Which binary answered: "built" or "against".
    binary: &'static str,
    /// Whether the probes were kept from the previous request (else
    /// attached for this one).
    kept: bool,
    max_events: u64,
    /// Response received minus the requested duration.
    overhead: Duration,
    events: usize,
    bytes: usize,
    cut_by_max_events: bool,
    /// From the server's log: timeline, XSpace built, XSpace encoded (ms).
    server_ms: Option<(u64, u64, u64)>,
    /// From the server's log: time to attach the probes (ms).
    attach_ms: Option<u64>,
    /// From the server's log: request received to response handed to gRPC,
    /// minus the requested duration (ms).
    server_overhead_ms: Option<u64>,
    peak_rss_kib: u64,
}

/// A running `ebtrace serve` and its log.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) addr: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// `ebtrace serve --pid PID` on a loopback port, with `extra` flags.
    pub(super) fn start(ebtrace: &Path, pid: u32, extra: &[&str]) -> Result<Self> {
        let mut child = Command::new(ebtrace)
            .args(["serve", "--pid", &pid.to_string(), "--bind", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting ebtrace serve")?;
        let stderr = child.stderr.take().expect("piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(line);
            }
        });
        let started = Instant::now();
        loop {
            let addr = lines.lock().expect("lock").iter().find_map(|l| {
                l.strip_prefix("ebtrace: serving tensorflow.ProfilerService on ")
                    .and_then(|a| a.parse().ok())
            });
            if let Some(addr) = addr {
                return Ok(Server { child, addr, lines });
            }
            if started.elapsed() > Duration::from_secs(60) || child.try_wait()?.is_some() {
                bail!(
                    "ebtrace serve did not start: {:?}",
                    lines.lock().expect("lock")
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn rss_kib(&self) -> u64 {
        status_kib(self.child.id(), "VmRSS").unwrap_or(0)
    }

    /// The `n`-th number after `key` in the log lines that start with
    /// `prefix` (waits a little for the line).
    pub(super) fn logged_ms(&self, prefix: &str, n: usize, key: &str) -> Option<u64> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let found = self
                .lines
                .lock()
                .expect("lock")
                .iter()
                .filter(|l| l.starts_with(prefix))
                .nth(n)
                .cloned();
            if let Some(line) = found {
                return line
                    .split(key)
                    .nth(1)?
                    .split(" ms")
                    .next()?
                    .trim()
                    .parse()
                    .ok();
            }
            if Instant::now() > deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for a log line containing `needle`.
    pub(super) fn wait_line(&self, needle: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let found = self
                .lines
                .lock()
                .expect("lock")
                .iter()
                .find(|l| l.contains(needle))
                .cloned();
            if let Some(line) = found {
                return Ok(line);
            }
            if Instant::now() > deadline {
                bail!(
                    "ebtrace serve never said {needle:?}: {:?}",
                    self.lines.lock().expect("lock")
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// GET `path` from its `--http` listener; the body.
    pub(super) fn http_get(&self, path: &str) -> Result<String> {
        use std::io::{Read as _, Write as _};
        let line = self.wait_line("metrics on http://", Duration::from_secs(5))?;
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|a| a.strip_suffix("/metrics"))
            .context("no metrics address")?;
        let mut stream = std::net::TcpStream::connect(addr)?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response
            .split_once("\r\n\r\n")
            .map_or(String::new(), |(_, body)| body.to_string()))
    }

    pub(super) fn stop(mut self) -> Result<()> {
        signal(self.child.id(), libc::SIGTERM);
        let status = self.child.wait()?;
        if !status.success() {
            bail!("ebtrace serve exited with {status}");
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `ebtrace serve` whose probes one short capture attached and which now
/// keeps them, paused, for the next: what its idle cost is measured with.
pub struct KeptProbes(Server);

impl KeptProbes {
    pub fn start(ebtrace: &Path, pid: u32) -> Result<Self> {
        let server = Server::start(ebtrace, pid, &["--keep-probes", "1h"])?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let url = format!("http://{}", server.addr);
        let mut short = request(1000);
        short.duration_ms = 100;
        if let Some(o) = short.opts.as_mut() {
            o.duration_ms = 100;
        }
        runtime.block_on(async {
            let mut client = ProfilerServiceClient::connect(url)
                .await?
                .max_decoding_message_size(usize::MAX);
            client.profile(short).await?;
            anyhow::Ok(())
        })?;
        Ok(KeptProbes(server))
    }

    pub fn stop(self) -> Result<()> {
        self.0.stop()
    }
}

fn realtime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn request(max_events: u64) -> ProfileRequest {
    ProfileRequest {
        duration_ms: CAPTURE_MS,
        max_events,
        tools: vec!["xplane.pb".into()],
        opts: Some(ProfileOptions {
            host_tracer_level: 2,
            device_tracer_level: 1,
            python_tracer_level: 1,
            version: 1,
            start_timestamp_ns: realtime_ns(),
            duration_ms: CAPTURE_MS,
            ..Default::default()
        }),
        session_id: "bench".into(),
        host_name: "127.0.0.1:6009".into(),
        ..Default::default()
    }
}

/// Asks for one capture, sampling the server's RSS meanwhile.
fn ask(
    runtime: &tokio::runtime::Runtime,
    server: &Server,
    (mode, kept, binary): (&'static str, bool, &'static str),
    max_events: u64,
    n: usize,
) -> Result<Answer> {
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let pid = server.child.id();
    let sampler = {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak));
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(kib) = status_kib(pid, "VmRSS") {
                    peak.fetch_max(kib, Ordering::Relaxed);
                }
                thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let url = format!("http://{}", server.addr);
    let sent = Instant::now();
    let response = runtime.block_on(async {
        let mut client = ProfilerServiceClient::connect(url)
            .await?
            .max_decoding_message_size(usize::MAX);
        let response = client.profile(request(max_events)).await?;
        anyhow::Ok(response.into_inner())
    })?;
    let elapsed = sent.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let data = &response
        .tool_data
        .first()
        .context("no tool_data in the response")?
        .data;
    let space = XSpace::decode(data.as_slice()).context("decoding the XSpace")?;
    let events = harness::xspace_events(&space);
    Ok(Answer {
        mode,
        binary,
        kept,
        max_events,
        overhead: elapsed.saturating_sub(Duration::from_millis(CAPTURE_MS)),
        events,
        bytes: data.len(),
        cut_by_max_events: space.warnings.iter().any(|w| w.contains("max_events")),
        server_ms: (|| {
            let session = |key| server.logged_ms("ebtrace: session ", n, key);
            Some((
                session("timeline ")?,
                session("built ")?,
                session("encoded ")?,
            ))
        })(),
        // "probes attached in N ms", or "probes kept ..., recording again in N ms".
        attach_ms: server.logged_ms("ebtrace: probes ", n, " in "),
        server_overhead_ms: server
            .logged_ms("ebtrace: session ", n, "answered ")
            .map(|ms| ms.saturating_sub(CAPTURE_MS)),
        peak_rss_kib: peak.load(Ordering::Relaxed),
    })
}

pub fn run(root: &Path, opts: Options) -> Result<()> {
    util::require_root("bench --serve")?;
    setup::run_setup(root, setup::Options::default())?;
    let ebtrace = util::build_release(root)?;
    let mut binaries: Vec<(&'static str, PathBuf)> = vec![("built", ebtrace.clone())];
    if let Some(against) = &opts.against {
        if !against.is_file() {
            bail!("--against {}: no such file", against.display());
        }
        binaries.push(("against", against.clone()));
    }
    let fixture = util::build_fixture();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let load_before = loadavg();
    let started = Instant::now();
    let mut answers = Vec::new();
    let mut idle = Vec::new();
    // pingpong: as many scheduler events as the fixture can make (the 1M
    // events case, once with the clients' max_events and once without);
    // mixed: a light load.
    for (mode, limits) in [
        ("pingpong", &[CLIENT_MAX_EVENTS, 0][..]),
        ("mixed", &[CLIENT_MAX_EVENTS][..]),
    ] {
        // Probes attached for each request (--keep-probes 0), then kept
        // between requests (the default), after one request that attaches
        // them and is not counted.
        for kept in [false, true] {
            let workload = start_workload(&fixture, mode, opts.target_cpu)?;
            let keep = if kept { "1h" } else { "0" };
            for (binary, bin) in &binaries {
                let server = Server::start(bin, workload.pid, &["--keep-probes", keep])?;
                thread::sleep(Duration::from_secs(1));
                let idle_before = server.rss_kib();
                let mut n = 0;
                if kept {
                    ask(&runtime, &server, (mode, kept, binary), limits[0], n)?;
                    n += 1;
                }
                for &max_events in limits {
                    for round in 0..opts.rounds {
                        let a = ask(&runtime, &server, (mode, kept, binary), max_events, n)?;
                        n += 1;
                        say(format!(
                            "{mode} {binary} kept={kept} max_events={max_events} round {}: +{:.0} ms, {} events, {:.1} MB, peak RSS {:.0} MiB",
                            round + 1,
                            a.overhead.as_secs_f64() * 1e3,
                            a.events,
                            a.bytes as f64 / 1e6,
                            a.peak_rss_kib as f64 / 1024.0
                        ));
                        answers.push(a);
                    }
                }
                // Detaching finishes in the background; give it a moment.
                thread::sleep(Duration::from_secs(2));
                if !kept {
                    idle.push((mode, *binary, idle_before, server.rss_kib()));
                }
                server.stop()?;
            }
            workload.stop()?;
        }
    }
    let load = (load_before, loadavg());
    let md = render(
        root,
        &ebtrace,
        &answers,
        &idle,
        &opts,
        started.elapsed(),
        load,
    );
    harness::write_report(root, "serve.md", &md)
}

/// The 1-minute load average: other work on the machine skews every
/// figure here, so the report states it.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn start_workload(fixture: &Path, mode: &str, cpu: Option<usize>) -> Result<Workload> {
    let mut cmd = harness::pinned(fixture, cpu);
    cmd.args(["--mode", mode]);
    Workload::start(cmd)
}

fn render(
    root: &Path,
    ebtrace: &Path,
    answers: &[Answer],
    idle: &[(&str, &str, u64, u64)],
    opts: &Options,
    took: Duration,
    load: (String, String),
) -> String {
    let stdout = |cmd: &mut Command| util::stdout_of(cmd).unwrap_or_default();
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## ebtrace serve: answering a 2 s capture ({})\n",
        stdout(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))
    );
    let _ = writeln!(
        md,
        "- {} ({}), kernel {}, {} CPUs; target pinned to {}; {} rounds per row; took {:.0} s",
        stdout(Command::new(ebtrace).arg("--version")),
        stdout(
            Command::new("git")
                .arg("-C")
                .arg(root)
                .args(["describe", "--always", "--dirty"])
        ),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        thread::available_parallelism().map_or(0, |n| n.get()),
        opts.target_cpu
            .map_or("no CPU".to_string(), |c| format!("CPU {c}")),
        opts.rounds,
        took.as_secs_f64()
    );
    let _ = writeln!(
        md,
        "- 1-minute load average {} at the start, {} at the end (other work on the machine slows \
         every step below)",
        load.0, load.1
    );
    let _ = writeln!(
        md,
        "- each request: a gRPC `Profile` of 2000 ms starting now, as `jax.collect_profile` sends it; \
         \"answer - 2 s\" is from sending the request to having the whole response, minus 2000 ms; \
         probes \"attached\": for each request (`--keep-probes 0`), \"kept\": from the request \
         before (the default; the first request, which attaches them, is not counted)\n"
    );
    if let Some(against) = &opts.against {
        let _ = writeln!(
            md,
            "- binary \"built\": this tree; \"against\": {} ({}), on the same target right after\n",
            against.display(),
            stdout(Command::new(against).arg("--version"))
        );
    }
    let _ = writeln!(
        md,
        "| target | binary | probes | max_events | answer - 2 s (median, each) | of which in the server (median) | events in the XSpace | XSpace size | server ms (median): attach or resume / timeline / XSpace built / encoded | peak RSS during the request |"
    );
    let _ = writeln!(md, "|---|---|---|---:|---|---:|---:|---:|---|---:|");
    let mut keys: Vec<(&str, bool, u64, &str)> = answers
        .iter()
        .map(|a| (a.mode, a.kept, a.max_events, a.binary))
        .collect();
    keys.sort();
    keys.dedup();
    for (mode, kept, max_events, binary) in keys {
        let rows: Vec<&Answer> = answers
            .iter()
            .filter(|a| {
                (a.mode, a.kept, a.max_events, a.binary) == (mode, kept, max_events, binary)
            })
            .collect();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let each = harness::each(&rows.iter().map(|a| ms(a.overhead)).collect::<Vec<_>>(), 0);
        let med =
            |f: &dyn Fn(&Answer) -> f64| median(&rows.iter().map(|a| f(a)).collect::<Vec<_>>());
        let server = if rows
            .iter()
            .all(|a| a.server_ms.is_some() && a.attach_ms.is_some())
        {
            format!(
                "{:.0} / {:.0} / {:.0} / {:.0}",
                med(&|a| a.attach_ms.unwrap_or(0) as f64),
                med(&|a| a.server_ms.map_or(0.0, |s| s.0 as f64)),
                med(&|a| a.server_ms.map_or(0.0, |s| s.1 as f64)),
                med(&|a| a.server_ms.map_or(0.0, |s| s.2 as f64))
            )
        } else {
            "n/a".into()
        };
        let _ = writeln!(
            md,
            "| {mode} | {binary} | {} | {} | **{:.0} ms** ({}) | {:.0} ms | {:.0}{} | {:.1} MB | {server} | {:.0} MiB |",
            if kept { "kept" } else { "attached" },
            if max_events == 0 {
                "none".to_string()
            } else {
                max_events.to_string()
            },
            med(&|a| ms(a.overhead)),
            each,
            med(&|a| a.server_overhead_ms.unwrap_or(0) as f64),
            med(&|a| a.events as f64),
            if rows.iter().any(|a| a.cut_by_max_events) {
                " (cut at max_events)"
            } else {
                ""
            },
            med(&|a| a.bytes as f64) / 1e6,
            med(&|a| a.peak_rss_kib as f64) / 1024.0,
        );
    }
    let _ = writeln!(
        md,
        "\n| target | binary | RSS idle before the requests | RSS idle after them |"
    );
    let _ = writeln!(md, "|---|---|---:|---:|");
    for (mode, binary, before, after) in idle {
        let _ = writeln!(
            md,
            "| {mode} | {binary} | {:.1} MiB | {:.1} MiB |",
            *before as f64 / 1024.0,
            *after as f64 / 1024.0
        );
    }
    md
}
