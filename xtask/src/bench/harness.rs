//! What the benchmark suites share: their configurations in rotated order,
//! stopping a target while a tracer attaches, starting ebtrace and reading
//! its `--json` summary, and the figures of their Markdown tables.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use super::tracer::Traced;
use crate::util::{median, signal};

/// The ways of running a target that a suite compares.
pub trait Configuration: Copy + PartialEq + 'static {
    /// Every configuration, in the order of the first round.
    const ALL: &'static [Self];
    /// A short name for progress lines.
    fn label(self) -> &'static str;
}

/// Each round runs every configuration once, the order rotated round by
/// round so that none always runs first (on a warmer or colder machine).
pub fn rotated<C: Configuration>(rounds: usize) -> impl Iterator<Item = (usize, C)> {
    (0..rounds).flat_map(|round| {
        (0..C::ALL.len()).map(move |i| (round, C::ALL[(round + i) % C::ALL.len()]))
    })
}

/// The target untraced, under ebtrace (with the stacks of its launches,
/// the default, and without), and under an equivalent bpftrace program:
/// the CUDA suite's configurations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tracer {
    Untraced,
    Ebtrace,
    EbtraceNoLaunchStacks,
    Bpftrace,
}

impl Configuration for Tracer {
    const ALL: &'static [Tracer] = &[
        Tracer::Untraced,
        Tracer::Ebtrace,
        Tracer::EbtraceNoLaunchStacks,
        Tracer::Bpftrace,
    ];

    fn label(self) -> &'static str {
        match self {
            Tracer::Untraced => "untraced",
            Tracer::Ebtrace => "ebtrace",
            Tracer::EbtraceNoLaunchStacks => "ebtrace-no-stacks",
            Tracer::Bpftrace => "bpftrace",
        }
    }
}

/// `program`, pinned to `cpu` through taskset if one is given (taskset
/// execs it, so the pid is the program's).
pub fn pinned(program: &Path, cpu: Option<usize>) -> Command {
    match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string()]).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// Stops `pid` (SIGSTOP), runs `attach` (start a tracer and wait until it
/// is attached), and lets `pid` continue (SIGCONT), whether `attach`
/// succeeded or not. Returns what `attach` gave and how long `pid` was
/// stopped: time to take out of the target's own elapsed time.
pub fn while_stopped<T>(pid: u32, attach: impl FnOnce() -> Result<T>) -> Result<(T, Duration)> {
    signal(pid, libc::SIGSTOP);
    let stopped_at = Instant::now();
    let attached = attach();
    signal(pid, libc::SIGCONT);
    let stopped = stopped_at.elapsed();
    Ok((attached?, stopped))
}

/// `ebtrace --pid PID --duration DURATION --logdir LOGDIR --json`.
pub fn ebtrace_command(ebtrace: &Path, pid: u32, duration: &str, logdir: &Path) -> Command {
    let mut cmd = Command::new(ebtrace);
    cmd.args(["--pid", &pid.to_string(), "--duration", duration])
        .arg("--logdir")
        .arg(logdir)
        .arg("--json");
    cmd
}

/// The line ebtrace prints when every probe is attached and its window
/// opens: `ebtrace: tracing pid ... (probes attached in ...)`.
pub fn attached(line: &str) -> bool {
    line.starts_with("ebtrace: tracing pid") && line.contains("probes attached")
}

/// Spawns ebtrace and waits for the line `ready` accepts (usually
/// [`attached`]); the time it came is the [`Traced::last_mark`].
pub fn spawn_ebtrace(
    cmd: Command,
    ready: impl Fn(&str) -> bool,
    timeout: Duration,
) -> Result<Traced> {
    let mut t = Traced::spawn(cmd)?;
    t.wait_line(ready, timeout)?;
    Ok(t)
}

/// What ebtrace's `--json` summary says, as far as the suites read it.
#[derive(Clone, Debug, Deserialize)]
pub struct Summary {
    pub window: SummaryWindow,
    pub attach_ns: u64,
    pub records: SummaryRecords,
    pub processes: Vec<SummaryProcess>,
    pub traceme: Option<SummaryTraceMe>,
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryWindow {
    pub duration_ns: u64,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryRecords {
    pub captured: u64,
    pub dropped: u64,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryProcess {
    pub pid: u32,
    pub traceme_route: Option<String>,
    pub agent: Option<SummaryAgent>,
    pub framework_session: Option<SummaryFramework>,
    pub gpu_activity: Option<SummaryGpuActivity>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryAgent {
    pub load_ns: Option<u64>,
    pub thread_kept_ns: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryFramework {
    pub events: u64,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryGpuActivity {
    pub kernels: u64,
    pub copies: u64,
    pub memsets: u64,
    pub dropped: u64,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SummaryTraceMe {
    pub events: u64,
}

impl Summary {
    /// Reads the summary from ebtrace's stdout lines.
    pub fn from_stdout<S: AsRef<str>>(stdout: &[S]) -> Result<Self> {
        let line = stdout
            .iter()
            .map(AsRef::as_ref)
            .find(|l| l.starts_with('{'))
            .with_context(|| {
                let lines: Vec<&str> = stdout.iter().map(AsRef::as_ref).collect();
                format!("no --json summary on ebtrace's stdout: {lines:?}")
            })?;
        serde_json::from_str(line).with_context(|| format!("ebtrace's --json summary {line:?}"))
    }

    pub fn window_s(&self) -> f64 {
        self.window.duration_ns as f64 / 1e9
    }

    pub fn attach(&self) -> Duration {
        Duration::from_nanos(self.attach_ns)
    }

    /// What the summary says about `pid`.
    pub fn process(&self, pid: u32) -> Option<&SummaryProcess> {
        self.processes.iter().find(|p| p.pid == pid)
    }

    /// The last note that `pick` accepts.
    pub fn last_note(&self, pick: impl Fn(&str) -> bool) -> Option<&str> {
        self.notes.iter().map(String::as_str).rfind(|n| pick(n))
    }
}

/// An ebtrace whose targets have exited, done.
pub struct Finished {
    pub summary: Summary,
    pub peak_rss_kib: u64,
}

/// Waits for ebtrace to end by itself (its duration passed or its targets
/// exited) and reads its summary.
pub fn finish_ebtrace(t: &mut Traced) -> Result<Finished> {
    let peak_rss_kib = t.wait_exit(Duration::from_secs(300))?;
    Ok(Finished {
        summary: Summary::from_stdout(t.stdout())?,
        peak_rss_kib,
    })
}

/// Runs ebtrace (a [`ebtrace_command`]) to its end and reads its summary.
pub fn run_ebtrace(mut cmd: Command) -> Result<Summary> {
    let out = cmd.output().context("running ebtrace")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "ebtrace failed ({}): {}{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Summary::from_stdout(&stdout.lines().collect::<Vec<_>>())
}

/// A field of `/proc/PID/status` given in kB (`VmRSS`, `VmHWM`).
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| {
            let value = l.strip_prefix(field)?.strip_prefix(':')?;
            value.trim().trim_end_matches("kB").trim().parse().ok()
        })
}

/// The rounds' values of one measure, `a / b / c`, each with `digits`
/// decimals.
pub fn each(values: &[f64], digits: usize) -> String {
    values
        .iter()
        .map(|x| format!("{x:.digits$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `median unit (a / b / c)`: the median of the rounds, then each round.
pub fn median_each(values: &[f64], digits: usize, unit: &str) -> String {
    format!(
        "{:.digits$} {unit} ({})",
        median(values),
        each(values, digits)
    )
}

/// `a / b`, with `b` kept off zero.
pub fn ratio(a: f64, b: f64) -> f64 {
    a / b.max(1e-9)
}

/// Prints a report and writes it to `target/bench/NAME`.
pub fn write_report(root: &Path, name: &str, md: &str) -> Result<()> {
    println!();
    print!("{md}");
    let out = root.join("target/bench").join(name);
    std::fs::create_dir_all(out.parent().expect("has a parent"))?;
    std::fs::write(&out, md).with_context(|| format!("writing {}", out.display()))?;
    println!("\nwritten to {}", out.display());
    Ok(())
}

/// Events on every line of every plane of `space`.
pub fn xspace_events(space: &ebtrace_proto::tensorflow::profiler::XSpace) -> usize {
    space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len())
        .sum()
}

/// On-CPU time of all threads of `pid` so far (`/proc/PID/task/*/schedstat`).
pub fn process_cpu_ns(pid: u32) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Abc {
        A,
        B,
        C,
    }

    impl Configuration for Abc {
        const ALL: &'static [Abc] = &[Abc::A, Abc::B, Abc::C];
        fn label(self) -> &'static str {
            "abc"
        }
    }

    #[test]
    fn rounds_rotate_the_order() {
        use Abc::*;
        let order: Vec<(usize, Abc)> = rotated(3).collect();
        assert_eq!(
            order,
            [
                (0, A),
                (0, B),
                (0, C),
                (1, B),
                (1, C),
                (1, A),
                (2, C),
                (2, A),
                (2, B)
            ]
        );
    }

    #[test]
    fn figures() {
        assert_eq!(each(&[1.0, 2.25, 3.5], 1), "1.0 / 2.2 / 3.5");
        assert_eq!(
            median_each(&[30.0, 10.0, 20.0], 0, "ms"),
            "20 ms (30 / 10 / 20)"
        );
        assert_eq!(ratio(3.0, 0.0), 3.0e9);
    }

    #[test]
    fn summary_of_a_capture() {
        let stdout = [
            r#"{"trace":"/l/x.xplane.pb","window":{"start_unix_ns":1,"stop_unix_ns":2,"duration_ns":2000000000},"attach_ns":53000000,"records":{"captured":7,"dropped":3},"processes":[{"pid":9,"traceme_route":"agent","agent":{"load_ns":5000000,"thread_kept_ns":null},"framework_session":{"events":12},"gpu_activity":null}],"traceme":null,"notes":["a","b x","c x"]}"#,
        ];
        let s = Summary::from_stdout(&stdout).unwrap();
        assert_eq!(s.window_s(), 2.0);
        assert_eq!(s.attach(), Duration::from_millis(53));
        assert_eq!((s.records.captured, s.records.dropped), (7, 3));
        let p = s.process(9).unwrap();
        assert_eq!(p.agent.as_ref().unwrap().load_ns, Some(5_000_000));
        assert_eq!(p.framework_session.as_ref().unwrap().events, 12);
        assert_eq!(s.last_note(|n| n.ends_with(" x")), Some("c x"));
        assert!(Summary::from_stdout(&["trace: x"]).is_err());
    }
}
