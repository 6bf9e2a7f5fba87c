//! The jax part of the TraceMe benchmark: one jax process
//! (`jax_workload.py --bench`), measured in interleaved windows of equal
//! length, order rotated each round: untraced, under ebtrace's agent route
//! (jax's own `ProfilerSession` run inside it by ebtrace), inside jax's own
//! session started by the process itself, under ebtrace's uprobe route, and
//! under ebtrace with its scheduling probes only. Plus the memory jaxlib's
//! recorder keeps for events switched on from outside, and what starting
//! ebtrace takes until its window opens.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        mpsc::{self, Receiver},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{
    harness::{self, Configuration, Summary},
    tracer::Traced,
};
use crate::util::{self, say, signal};

mod report;
pub use report::{render, render_memory};

/// Seconds of each measurement window.
pub const SECONDS: u64 = 3;
/// The side of the matrices the jax loop's steps multiply by default.
pub const DEFAULT_MATRIX: u32 = 64;
/// Pause between two windows, so that one configuration's teardown does not
/// run into the next one's window.
const SETTLE: Duration = Duration::from_secs(1);
/// How long jax's own session runs before its window opens: about what the
/// agent's session runs before ebtrace's window opens (probes attaching),
/// so that neither window holds a session's first moments.
const SESSION_LEAD: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    Untraced,
    Agent,
    Session,
    Uprobe,
    SchedOnly,
}

impl Configuration for Config {
    const ALL: &'static [Config] = &[
        Config::Untraced,
        Config::Agent,
        Config::Session,
        Config::Uprobe,
        Config::SchedOnly,
    ];

    fn label(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::Agent => "agent",
            Config::Session => "jax session",
            Config::Uprobe => "uprobe",
            Config::SchedOnly => "sched only",
        }
    }
}

impl Config {
    fn describe(self) -> &'static str {
        match self {
            Config::Untraced => "untraced",
            Config::Agent => {
                "ebtrace, agent route (`--traceme agent`: jax's ProfilerSession run by the agent, \
                 + scheduling probes)"
            }
            Config::Session => {
                "jax's own session (`jax.profiler.start_trace`, host tracer level 2, no Python \
                 tracer)"
            }
            Config::Uprobe => {
                "ebtrace, uprobe route (`--traceme uprobe`: level 2 switched on from outside, \
                 `Record` probed, + scheduling probes)"
            }
            Config::SchedOnly => "ebtrace `--traceme off` (scheduling probes only)",
        }
    }

    /// ebtrace's `--traceme` for the ebtrace configurations.
    fn route(self) -> Option<&'static str> {
        match self {
            Config::Agent => Some("agent"),
            Config::Uprobe => Some("uprobe"),
            Config::SchedOnly => Some("off"),
            Config::Untraced | Config::Session => None,
        }
    }
}

/// What one ebtrace capture of the jax process reported.
#[derive(Clone, Debug, Default)]
pub struct Capture {
    /// From spawning ebtrace to its `tracing pid` line (the window opening).
    pub spawn_to_window: Duration,
    /// ebtrace's own attach time.
    pub attach: Option<Duration>,
    /// The agent route's load time and the time a thread of the target was
    /// kept from its code while the agent was injected.
    pub agent_load: Option<Duration>,
    pub thread_kept: Option<Duration>,
    /// Events of the uprobe route (`TraceMe: N events recorded`) and of the
    /// framework's own session (`... K events on the thread lines`).
    pub traceme_events: Option<u64>,
    pub session_events: Option<u64>,
    /// The line saying how ebtrace found the recorder (uprobe route), or
    /// which session the agent ran.
    pub route_line: Option<String>,
}

/// One window of one configuration.
#[derive(Clone, Debug)]
pub struct Window {
    pub config: Config,
    pub round: usize,
    pub steps_per_s: f64,
    /// On-CPU ns of all the target's threads per step.
    pub cpu_ns_per_step: f64,
    pub capture: Option<Capture>,
}

/// The jax measurement.
#[derive(Clone, Debug)]
pub struct JaxRun {
    pub rounds: usize,
    /// The side of the matrices its steps multiplied.
    pub matrix: u32,
    pub windows: Vec<Window>,
    /// RSS growth over an untraced window and over an uprobe-route window
    /// before any session ran in the process, and that window's events.
    pub rss_control_kib: i64,
    pub rss_traced_kib: i64,
    pub memory_events: u64,
}

/// A progress line of the workload: its CLOCK_MONOTONIC time, its step
/// count, and the CPU time of all its threads when the line arrived.
#[derive(Clone, Copy, Debug)]
struct Sample {
    time: f64,
    steps: f64,
    cpu_ns: u64,
}

/// The running jax workload.
pub(super) struct Target {
    child: Child,
    pub(super) pid: u32,
    samples: Arc<Mutex<Vec<Sample>>>,
    /// `{"session": ...}` lines.
    sessions: Receiver<String>,
    reader: Option<JoinHandle<()>>,
}

impl Target {
    pub(super) fn start(
        python: &Path,
        fixture: &Path,
        cpu: Option<usize>,
        matrix: u32,
    ) -> Result<Self> {
        let mut child = harness::pinned(python, cpu)
            .arg(fixture)
            .args(["--bench", "--bench-matrix", &matrix.to_string()])
            .env("JAX_PLATFORMS", "cpu")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the jax workload")?;
        let stdout = child.stdout.take().expect("piped");
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (pid_tx, pid_rx) = mpsc::channel();
        let (session_tx, sessions) = mpsc::channel();
        let shared = Arc::clone(&samples);
        let reader = thread::spawn(move || {
            let mut pid = None;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if let (Some(pid), Some(steps), Some(time)) =
                    (pid, v["steps"].as_f64(), v["time"].as_f64())
                {
                    let cpu_ns = harness::process_cpu_ns(pid);
                    shared.lock().expect("not poisoned").push(Sample {
                        time,
                        steps,
                        cpu_ns,
                    });
                } else if let Some(p) = v["pid"].as_u64() {
                    pid = Some(p as u32);
                    let _ = pid_tx.send(p as u32);
                } else if let Some(s) = v["session"].as_str() {
                    let _ = session_tx.send(s.to_string());
                }
            }
        });
        let pid = pid_rx
            .recv_timeout(Duration::from_secs(120))
            .context("the jax workload never printed its pid")?;
        Ok(Target {
            child,
            pid,
            samples,
            sessions,
            reader: Some(reader),
        })
    }

    /// Steps per second and CPU ns per step between the first and the last
    /// progress line stamped within `[from, to]` (CLOCK_MONOTONIC seconds).
    /// Waits until `to` has passed.
    pub(super) fn measure(&self, from: f64, to: f64) -> Result<(f64, f64)> {
        sleep_until(to + 0.05);
        let samples = self.samples.lock().expect("not poisoned");
        let inside: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.time >= from && s.time <= to)
            .collect();
        match (inside.first(), inside.last()) {
            (Some(a), Some(b)) if b.steps > a.steps && b.time > a.time => Ok((
                (b.steps - a.steps) / (b.time - a.time),
                b.cpu_ns.saturating_sub(a.cpu_ns) as f64 / (b.steps - a.steps),
            )),
            _ => bail!(
                "the jax workload reported no progress between {from:.3} and {to:.3} \
                 (CLOCK_MONOTONIC s)"
            ),
        }
    }

    /// Waits for the workload's `{"session": state}` line.
    fn session(&self, state: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(300);
        while Instant::now() < deadline {
            if let Ok(s) = self.sessions.recv_timeout(Duration::from_millis(100))
                && s == state
            {
                return Ok(());
            }
        }
        bail!("the jax workload's profiler session never {state}")
    }

    fn rss_kib(&self) -> Result<i64> {
        let kib = harness::status_kib(self.pid, "VmRSS").context("VmRSS")?;
        Ok(kib as i64)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        signal(self.pid, libc::SIGTERM);
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

struct Bench<'a> {
    ebtrace: &'a Path,
    logdir: PathBuf,
    target: &'a Target,
}

impl Bench<'_> {
    /// One window of `config`; for ebtrace, its capture window.
    fn window(&self, config: Config, round: usize) -> Result<Window> {
        let length = SECONDS as f64;
        let (from, capture) = match config {
            Config::Untraced => (monotonic_s(), None),
            Config::Session => {
                signal(self.target.pid, libc::SIGUSR1);
                self.target.session("started")?;
                thread::sleep(SESSION_LEAD);
                (monotonic_s(), None)
            }
            _ => {
                let route = config.route().expect("an ebtrace configuration");
                let (from, ebtrace) = self.ebtrace(route)?;
                (from, Some(ebtrace))
            }
        };
        let (steps_per_s, cpu_ns_per_step) = self.target.measure(from, from + length)?;
        let capture = match (config, capture) {
            (Config::Session, _) => {
                // Stopping collects and writes the session's trace: after
                // the window, as ebtrace's collection is.
                signal(self.target.pid, libc::SIGUSR2);
                self.target.session("stopped")?;
                None
            }
            (_, Some(mut ebtrace)) => Some(self.finish(&mut ebtrace)?),
            _ => None,
        };
        Ok(Window {
            config,
            round,
            steps_per_s,
            cpu_ns_per_step,
            capture,
        })
    }

    /// Starts ebtrace on the target; returns when its window opened
    /// (CLOCK_MONOTONIC seconds) and the running ebtrace.
    fn ebtrace(&self, route: &str) -> Result<(f64, Traced)> {
        let spawned = monotonic_s();
        let duration = format!("{SECONDS}s");
        let mut cmd =
            harness::ebtrace_command(self.ebtrace, self.target.pid, &duration, &self.logdir);
        // The agent's own bound (a quarter of the memory available) is left
        // as a user gets it; the uprobe route's, in events, is raised.
        cmd.args(["--traceme", route]);
        if route == "uprobe" {
            cmd.args(["--max-events", "100000000"]);
        }
        let t = harness::spawn_ebtrace(cmd, harness::attached, Duration::from_secs(120))?;
        let opened = t.last_mark().expect("a line was awaited");
        Ok((spawned + opened.as_secs_f64(), t))
    }

    fn finish(&self, t: &mut Traced) -> Result<Capture> {
        let spawn_to_window = t.last_mark().expect("a line was awaited");
        let done = harness::finish_ebtrace(t)?;
        let _ = std::fs::remove_dir_all(&self.logdir);
        let mut c = capture_of(&done.summary, self.target.pid);
        c.spawn_to_window = spawn_to_window;
        Ok(c)
    }
}

/// Reads what ebtrace's summary says about its capture of `pid`.
fn capture_of(summary: &Summary, pid: u32) -> Capture {
    let process = summary.process(pid);
    // The agent's load counts for the agent route only: in the others it
    // may have been loaded for the device alone.
    let agent = process
        .filter(|p| p.traceme_route.as_deref() == Some("agent"))
        .and_then(|p| p.agent.as_ref());
    let duration = |ns: Option<u64>| ns.map(Duration::from_nanos);
    Capture {
        spawn_to_window: Duration::ZERO,
        attach: Some(summary.attach()),
        agent_load: duration(agent.and_then(|a| a.load_ns)),
        thread_kept: duration(agent.and_then(|a| a.thread_kept_ns)),
        traceme_events: summary.traceme.as_ref().map(|t| t.events),
        session_events: process
            .and_then(|p| p.framework_session.as_ref())
            .map(|f| f.events),
        route_line: summary
            .last_note(|n| {
                n.contains("TraceMe through ebtrace's agent: ") || n.contains("TraceMe recorder in")
            })
            .map(str::to_string),
    }
}

/// Runs the jax measurement. Skipped without jax in `.venv` (`cargo xtask
/// setup` installs it).
pub fn run(
    root: &Path,
    ebtrace: &Path,
    scratch: &Path,
    target_cpu: Option<usize>,
    rounds: usize,
    matrix: u32,
) -> Result<Option<JaxRun>> {
    let python = root.join(".venv/bin/python");
    if !util::succeeds(Command::new(&python).args(["-c", "import jax"])) {
        say("no jax in .venv: skipping the jaxlib measurements (run `cargo xtask setup`)");
        return Ok(None);
    }
    let target = Target::start(
        &python,
        &root.join("tests/fixtures/traceme/jax_workload.py"),
        target_cpu,
        matrix,
    )?;
    let bench = Bench {
        ebtrace,
        logdir: scratch.join("jax-logs"),
        target: &target,
    };
    thread::sleep(Duration::from_secs(2));

    // The recorder's memory, before any session in the process has run (a
    // session's freed queue would be reused and hide the growth).
    let rss0 = target.rss_kib()?;
    bench.window(Config::Untraced, 0)?;
    let rss1 = target.rss_kib()?;
    thread::sleep(SETTLE);
    let rss2 = target.rss_kib()?;
    let memory = bench.window(Config::Uprobe, 0)?;
    let rss3 = target.rss_kib()?;
    let memory_events = memory
        .capture
        .and_then(|c| c.traceme_events)
        .context("no `TraceMe: N events recorded` line from the uprobe route")?;
    if memory_events == 0 {
        bail!("ebtrace recorded no TraceMe events from jax");
    }
    thread::sleep(SETTLE);

    let mut windows = Vec::new();
    for (round, config) in harness::rotated::<Config>(rounds) {
        let w = bench.window(config, round)?;
        say(format!(
            "jax round {}/{rounds} {:<11} {:>6.0} steps/s, {:>6.1} CPU µs per step",
            round + 1,
            config.label(),
            w.steps_per_s,
            w.cpu_ns_per_step / 1e3
        ));
        windows.push(w);
        thread::sleep(SETTLE);
    }
    Ok(Some(JaxRun {
        rounds,
        matrix,
        windows,
        rss_control_kib: rss1 - rss0,
        rss_traced_kib: rss3 - rss2,
        memory_events,
    }))
}

/// CLOCK_MONOTONIC in seconds: the clock of Python's `time.monotonic()`,
/// which stamps the workload's progress lines.
pub(super) fn monotonic_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn sleep_until(t: f64) {
    let left = t - monotonic_s();
    if left > 0.0 {
        thread::sleep(Duration::from_secs_f64(left));
    }
}
