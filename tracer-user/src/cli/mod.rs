//! Command-line interface: every flag is defined and documented here
//! (those of `serve` in [`serve`]); [`record`] runs a capture with progress
//! and summary, [`serve`] the ProfilerService.

pub mod capture;
pub mod convert;
pub mod json;
pub mod record;
pub mod serve;
pub mod summary;

use std::{path::PathBuf, sync::Mutex, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::agent::TraceMeRoute;

/// eBPF-assisted tracer for ML workloads: attaches to running processes and
/// writes XProf (XSpace) timelines of their threads.
#[derive(Debug, Parser)]
#[command(
    name = "ebtrace",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Example: sudo ebtrace --pid 1234 --duration 2s\n\
                  View: xprof --logdir ./ebtrace-logs (or tensorboard --logdir ./ebtrace-logs)"
)]
pub struct Cli {
    /// The subcommand; none runs `record` with the flags below.
    #[command(subcommand)]
    pub command: Option<Command>,

    /// `record`'s flags, given without the subcommand's name.
    #[command(flatten)]
    pub record: RecordArgs,
}

// A `concat!` doc, which clap does not read: a literal one would become
// the help text of the command this type is part of.
#[doc = concat!("The subcommands of `ebtrace`.")]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Record running processes into an XSpace (the default command).
    Record(RecordArgs),
    /// Serve TensorFlow's gRPC ProfilerService for running processes, so
    /// that jax.collect_profile, tf.profiler and XProf's "Capture profile"
    /// can capture them.
    Serve(Box<serve::ServeArgs>),
    /// Ask `ebtrace serve` on several hosts at once for a capture (or a
    /// flight-recorder snapshot), over TLS with a client certificate, and
    /// write one run with a trace per host.
    Capture(capture::CaptureArgs),
    /// Convert a trace already written (e.g. an .xplane.pb from ebtrace or
    /// from jax's own profiler) to another format.
    Convert(convert::ConvertArgs),
    /// Write ebtrace's in-process agent library to PATH, for programs that
    /// start with it: `LD_PRELOAD=PATH EBTRACE_AGENT=listen python train.py`
    /// waits, idle, for an ebtrace to connect (no ptrace needed then).
    AgentLibrary {
        /// Where to write the library.
        path: PathBuf,
    },
    /// Internal: the process that puts back the TraceMe gates ebtrace
    /// switched on if ebtrace dies without doing it (started by ebtrace).
    #[command(name = "restore-guard", hide = true)]
    RestoreGuard {
        /// The lifeline ebtrace holds (a memfd descriptor).
        #[arg(long = "lifeline-fd")]
        lifeline_fd: Option<i32>,
    },
    /// Internal, for the tests and for diagnosis: loads the in-process
    /// agent into a process, pings it and unloads it, N times, printing one
    /// JSON line of timings per cycle.
    #[command(name = "inject-check", hide = true)]
    InjectCheck {
        /// The process to load the agent into.
        #[arg(long)]
        pid: u32,
        /// Load/ping/unload cycles.
        #[arg(long, default_value_t = 1)]
        cycles: u32,
        /// A library to load instead of the agent ebtrace embeds (pinged
        /// with one byte, answered plus one).
        #[arg(long, value_name = "PATH")]
        library: Option<PathBuf>,
        /// How long each cycle keeps the library loaded after the ping.
        #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration_or_zero)]
        hold: Duration,
    },
}

// A `concat!` doc, which clap does not read: a literal one would become
// the help text of the command this type is part of.
#[doc = concat!("The flags of `ebtrace record`.")]
#[derive(Debug, Clone, Args)]
pub struct RecordArgs {
    /// Process to trace (repeat or comma-separate for several). A thread id
    /// selects its whole process. Threads started during the capture are
    /// followed.
    #[arg(
        short = 'p',
        long = "pid",
        value_name = "PID",
        required = true,
        value_delimiter = ','
    )]
    pub pids: Vec<u32>,

    /// How long to record, e.g. 500ms, 2s, 1m. Ctrl-C stops earlier and
    /// still writes the trace.
    #[arg(short = 'd', long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
    pub duration: Duration,

    /// Log directory; the trace goes to
    /// DIR/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>.xplane.pb.
    #[arg(long, value_name = "DIR", default_value = "ebtrace-logs")]
    pub logdir: PathBuf,

    /// Kernel ring buffer size in MiB (a power of two). Raise it if the
    /// summary reports dropped records.
    #[arg(long, value_name = "MIB", default_value_t = 16, value_parser = parse_ring_mib)]
    pub ring_buffer_mib: u32,

    /// Also sample the targets' CPU stacks this many times a second per
    /// CPU, and show each sample on its thread's line, named after its
    /// innermost function, with the whole stack (0: no samples).
    #[arg(long, value_name = "HZ", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=crate::attach::cpu_sample::MAX_HZ as i64))]
    pub sample_hz: u32,

    /// Also take the user stack of a thread that waited in a system call
    /// (a sleep, a lock's futex, a read, a poll) for at least DURATION, as
    /// the call returns, and show it over the wait on its thread's line,
    /// named after the call: where it waited. While they are taken, every
    /// system call on the machine is slower (about 100 ns a call on a
    /// 2-core VM).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub off_cpu_min: Option<Duration>,

    /// Native frames only in the stacks of CPython targets. By default a
    /// CPython target's stacks (3.10 to 3.14) show the Python functions,
    /// files and lines each thread ran, where the interpreter ran them.
    #[arg(long)]
    pub no_python_frames: bool,

    /// CUDA driver calls without the stacks they were made from. By
    /// default each call that submits work (a launch, a copy, a memset)
    /// carries its stack, native and Python, in its `launch_stack` stat:
    /// which line launched a kernel. It costs a few microseconds a call.
    #[arg(long)]
    pub no_launch_stacks: bool,

    /// TraceMe events of jaxlib / TensorFlow / libtpu targets, at this
    /// level (ProfileOptions' host_tracer_level): 0 none, 1 critical,
    /// 2 info, 3 verbose. A target with no profiler session of its own is
    /// switched to this level for the capture and back off after it; one
    /// with a session is only observed, at the session's level.
    #[arg(long, value_name = "LEVEL", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(0..=3))]
    pub host_tracer_level: u32,

    /// How TraceMe events are collected. auto: through ebtrace's agent,
    /// loaded into a jax or TensorFlow process without a restart, which
    /// runs the framework's own profiler session (TraceMe at in-process
    /// cost, XLA's metadata, device planes) and is taken out after; else
    /// through uprobes. agent: only the agent. uprobe: only uprobes
    /// (nothing is loaded into the target). off: none.
    #[arg(long, value_enum, value_name = "ROUTE", default_value_t = TraceMeRoute::Auto)]
    pub traceme: TraceMeRoute,

    /// Never load ebtrace's agent into a target (same as --traceme
    /// uprobe, --no-device-activity and --no-torch-ops).
    #[arg(long, conflicts_with = "traceme")]
    pub no_agent: bool,

    /// Do not record what the GPU ran. By default ebtrace's agent records
    /// it in every CUDA process through CUPTI (kernels, copies and memsets
    /// as the device timed them, each joined to the driver call that
    /// submitted it); without it the GPU lines show the work as the host
    /// submitted it.
    #[arg(long)]
    pub no_device_activity: bool,

    /// Do not record PyTorch's ops. By default ebtrace's agent registers
    /// RecordFunction callbacks in every PyTorch process for the capture
    /// (removed at its end): each ATen op, backward function and
    /// record_function range becomes a span on its thread's line.
    #[arg(long)]
    pub no_torch_ops: bool,

    /// Record each of PyTorch's ops (and backward functions and
    /// record_function ranges) with this chance, 0 to 1, drawn by PyTorch
    /// as its own sampled observers are: PyTorch then skips most ops
    /// without building their RecordFunction, which costs the program less
    /// than every op, though not in proportion (see BENCHMARKS.md). Counts
    /// in the trace are then a sample: about P times the program's.
    #[arg(long, value_name = "P", value_parser = parse_op_sampling)]
    pub torch_op_sampling: Option<u32>,

    /// Record each ATen op's input shapes (the `input_shapes` stat, as
    /// torch.profiler's record_shapes gives them). PyTorch then boxes every
    /// op's arguments for the callbacks, which costs each op more.
    #[arg(long)]
    pub torch_op_shapes: bool,

    /// Switch TraceMe recording off again after this many events, on the
    /// uprobe route: the target's recorder keeps every event it records in
    /// memory until a profiler session drains it (jaxlib: about 140 bytes
    /// each). Through the agent, --max-target-growth-mib bounds it.
    #[arg(long, value_name = "N", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_events: u64,

    /// Stop the framework's profiler session that ebtrace's agent runs in a
    /// target once the target grew by this many MiB since it started,
    /// keeping what it recorded (it holds every event in memory until it
    /// stops). Default: a quarter of the memory available when the capture
    /// starts, at least 1024.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_target_growth_mib: Option<u64>,

    /// Also write Perfetto's native trace, perfetto_trace.pb, beside the
    /// .xplane.pb (open it in ui.perfetto.dev): CPU tracks, thread states
    /// and wake-ups drawn the way Perfetto draws its own captures.
    #[arg(long)]
    pub perfetto: bool,

    /// Print only the trace's path (and the Perfetto trace's, with
    /// --perfetto): no progress, no summary.
    #[arg(short, long)]
    pub quiet: bool,

    /// Print the summary as one JSON object on stdout instead (trace
    /// paths, window, attach time, records and drops per source,
    /// per-process and per-thread facts, notes, warnings); the summary for
    /// people goes to stderr then, unless --quiet.
    #[arg(long)]
    pub json: bool,
}

/// Warnings the library logs, kept for `--json` once
/// [`start_keeping_logged_warnings`] is called (a server never does: its
/// log would grow without end).
static LOGGED_WARNINGS: Mutex<Option<Vec<String>>> = Mutex::new(None);

/// From now on, keeps the warnings the library logs.
pub fn start_keeping_logged_warnings() {
    if let Ok(mut w) = LOGGED_WARNINGS.lock() {
        w.get_or_insert_with(Vec::new);
    }
}

/// Keeps a warning the library logged, if asked to (ebtrace's logger
/// calls this).
pub fn keep_logged_warning(line: String) {
    if let Ok(mut w) = LOGGED_WARNINGS.lock()
        && let Some(kept) = w.as_mut()
    {
        kept.push(line);
    }
}

/// The warnings kept so far, taken.
pub fn take_logged_warnings() -> Vec<String> {
    LOGGED_WARNINGS
        .lock()
        .ok()
        .and_then(|mut w| w.as_mut().map(std::mem::take))
        .unwrap_or_default()
}

/// Parses a human duration; zero is refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d =
        humantime::parse_duration(s.trim()).map_err(|e| format!("{e} (use e.g. 500ms, 2s, 1m)"))?;
    if d.is_zero() {
        return Err("must be longer than zero".into());
    }
    Ok(d)
}

/// Like [`parse_duration`], but zero (`0`, `0s`) is allowed.
pub fn parse_duration_or_zero(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{e} (use e.g. 0, 30s, 5m)"))
}

pub(crate) fn parse_ring_mib(s: &str) -> Result<u32, String> {
    let v: u32 = s.parse().map_err(|e| format!("{e}"))?;
    if !v.is_power_of_two() || v > 1024 {
        return Err("must be a power of two between 1 and 1024".into());
    }
    Ok(v)
}

/// `--torch-op-sampling`'s chance, as millionths (at least one).
fn parse_op_sampling(text: &str) -> std::result::Result<u32, String> {
    let p: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number: give a chance such as 0.01"))?;
    if !(p > 0.0 && p <= 1.0) {
        return Err(format!(
            "{text} is not a chance above 0 and at most 1: give e.g. 0.01 for one op in a hundred"
        ));
    }
    Ok(((p * 1e6).round() as u32).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("2 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn default_command_and_pids() {
        let cli = Cli::try_parse_from(["ebtrace", "-p", "1,2", "--pid", "3", "-d", "1s"]).unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.record.pids, vec![1, 2, 3]);
        assert_eq!(cli.record.duration, Duration::from_secs(1));
        assert!(!cli.record.json);
        let cli = Cli::try_parse_from(["ebtrace", "record", "-p", "7"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Record(ref r)) if r.pids == vec![7]));
        assert!(Cli::try_parse_from(["ebtrace"]).is_err());
        let cli = Cli::try_parse_from(["ebtrace", "-p", "7", "--json", "-q"]).unwrap();
        assert!(cli.record.json && cli.record.quiet);
    }

    #[test]
    fn op_sampling_is_a_chance() {
        assert_eq!(parse_op_sampling("1"), Ok(1_000_000));
        assert_eq!(parse_op_sampling("0.01"), Ok(10_000));
        assert_eq!(parse_op_sampling("1e-9"), Ok(1));
        for bad in ["0", "1.5", "-0.1", "NaN", "inf", "often"] {
            assert!(parse_op_sampling(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn logged_warnings_are_kept_only_once_asked() {
        keep_logged_warning("before".into());
        assert!(take_logged_warnings().is_empty());
        start_keeping_logged_warnings();
        keep_logged_warning("after".into());
        assert_eq!(take_logged_warnings(), vec!["after".to_string()]);
        assert!(take_logged_warnings().is_empty());
    }

    #[test]
    fn serve_flags() {
        let cli = Cli::try_parse_from(["ebtrace", "serve", "--pid", "7,8"]).unwrap();
        let Some(Command::Serve(s)) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(s.pids, vec![7, 8]);
        assert_eq!(s.binds, vec!["127.0.0.1:6009".parse().unwrap()]);
        assert!(!s.discover);
        let cli = Cli::try_parse_from([
            "ebtrace",
            "serve",
            "--discover",
            "--bind",
            "[::1]:7000",
            "--bind",
            "127.0.0.1:0",
        ])
        .unwrap();
        let Some(Command::Serve(s)) = cli.command else {
            panic!("not serve")
        };
        assert!(s.discover);
        assert_eq!(s.binds.len(), 2);
        assert!(Cli::try_parse_from(["ebtrace", "serve"]).is_err());
        assert!(Cli::try_parse_from(["ebtrace", "serve", "--discover", "-p", "1"]).is_err());
        assert!(
            Cli::try_parse_from(["ebtrace", "serve", "-p", "1", "--bind", "localhost:1"]).is_err()
        );
    }

    #[test]
    fn traceme_flags() {
        let cli = Cli::try_parse_from(["ebtrace", "-p", "1"]).unwrap();
        assert_eq!(
            (cli.record.host_tracer_level, cli.record.max_events),
            (2, 1_000_000)
        );
        let cli = Cli::try_parse_from([
            "ebtrace",
            "-p",
            "1",
            "--host-tracer-level",
            "0",
            "--max-events",
            "5",
        ])
        .unwrap();
        assert_eq!(
            (cli.record.host_tracer_level, cli.record.max_events),
            (0, 5)
        );
        assert!(Cli::try_parse_from(["ebtrace", "-p", "1", "--host-tracer-level", "4"]).is_err());
        assert!(Cli::try_parse_from(["ebtrace", "-p", "1", "--max-events", "0"]).is_err());
    }
}
