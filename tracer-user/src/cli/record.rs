//! `ebtrace record` (the default command): attach, record with a progress
//! bar, write the XSpace, print where it went.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressStyle};

use super::{RecordArgs, json, summary};
use crate::{
    agent::TraceMeRoute,
    attach::{LaunchStacks, ProbeSetConfig, TraceMeOptions},
    capture::{Capture, CaptureOptions, ProbeFamilies, check_privileges, open_targets},
    error::{Error, Result},
    sink::{
        logdir, perfetto,
        xspace::{self, file::Written},
    },
};

/// How often the loop wakes to drain and to check the stop conditions.
const TICK: Duration = Duration::from_millis(50);

/// Runs `ebtrace record`: attaches, records, writes the trace and prints
/// the summary.
pub fn run(args: &RecordArgs) -> Result<()> {
    let targets = open_targets(&args.pids)?;
    check_privileges()?;
    crate::attach::traceme::prepare_gates();
    logdir::check_writable(&args.logdir)?;
    if args.json {
        super::start_keeping_logged_warnings();
    }
    let stop = stop_on_signals()?;
    crate::symbols::python::names::keep_names_for(args.duration);
    let options = capture_options(args);
    let session = logdir::session_name(chrono::Local::now());
    let mut capture = Capture::start(targets, &options)?;
    let started = Instant::now();
    let start = announce(&mut capture, args);
    let bar = progress_bar(args);
    let ended_early = record_until_done(&mut capture, args, started, &stop, &bar);
    bar.finish_and_clear();
    // From here on a signal abandons the agents' answers.
    if stop.swap(true, Ordering::SeqCst) && capture.has_agents() {
        eprintln!(
            "ebtrace: stopping; taking what the agents recorded (Ctrl-C again writes the trace \
             without it)"
        );
    }

    let (timeline, probe_stats, probes) = capture.finish(ended_early)?;
    let host = xspace::local_hostname();
    let summary = summary::render(&timeline, &probe_stats);
    let json_summary = start.map(|start| {
        let asked = json::Asked {
            logdir: args.logdir.clone(),
            requested: args.duration,
            max_events: args.max_events,
        };
        let logged = super::take_logged_warnings();
        json::Summary::new(start, &timeline, &probe_stats, asked, logged)
    });
    let (path, written) = logdir::write_run_with(&args.logdir, &session, &host, |file| {
        xspace::file::write_trace_file(
            file.get_mut(),
            |out| xspace::write_planes(&timeline, out),
            |more| xspace::closing_part(&timeline, &host, more),
        )
    })?;
    let partial = match written {
        Written::Whole => None,
        Written::Partial { kept, why } => Some(Error::partial_trace(path.clone(), &kept, why)),
    };
    // A disk that did not take the XSpace takes no Perfetto trace either.
    let perfetto_bytes = (args.perfetto && partial.is_none()).then(|| {
        perfetto::timeline_to_perfetto_bytes(&timeline, perfetto::PerfettoClocks::measure())
    });
    drop(timeline);
    let perfetto_path = perfetto_bytes
        .map(|bytes| write_perfetto(&path, &bytes))
        .transpose()?;
    let human = report_for_people(args, &summary, &path, perfetto_path.as_deref());
    match json_summary {
        // Scripts read stdout: people get theirs on stderr.
        Some(json) => {
            eprint!("{human}");
            let json = json.written_to(path.clone(), perfetto_path.clone());
            println!("{}", json.to_line());
        }
        None => print!("{human}"),
    }
    // The trace is out: the probes are released in the background.
    probes.release_after_exit();
    partial.map_or(Ok(()), Err)
}

/// Ctrl-C, SIGTERM and a closed terminal end the capture; the trace is
/// still written and the targets' TraceMe levels are restored. One more,
/// once the capture is ending, abandons what the agents have still to
/// hand over: the trace is written without it.
fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        let stop = Arc::clone(&stop);
        let on_signal = move || {
            if stop.swap(true, Ordering::SeqCst) {
                crate::agent::abandon_every_answer();
            }
        };
        // SAFETY: the handler only swaps and stores atomics, which is
        // async-signal-safe.
        unsafe { signal_hook::low_level::register(sig, on_signal) }
            .map_err(|e| crate::error::Error::io("installing signal handlers", e))?;
    }
    Ok(stop)
}

/// The capture the command line asks for.
fn capture_options(args: &RecordArgs) -> CaptureOptions {
    CaptureOptions {
        probe: ProbeSetConfig {
            ring_bytes: args.ring_buffer_mib * 1024 * 1024,
            launch_stacks: if args.no_launch_stacks {
                LaunchStacks::Off
            } else {
                LaunchStacks::Every
            },
            ..ProbeSetConfig::default()
        },
        families: ProbeFamilies {
            traceme_level: args.host_tracer_level,
            cpu_sample_hz: args.sample_hz,
            off_cpu_min: args.off_cpu_min.unwrap_or_default(),
            python_frames: !args.no_python_frames,
            ..ProbeFamilies::default()
        },
        traceme: TraceMeOptions {
            level: args.host_tracer_level,
            max_events: args.max_events,
        },
        route: if args.no_agent {
            TraceMeRoute::Uprobe
        } else {
            args.traceme
        },
        no_device_activity: args.no_agent || args.no_device_activity,
        no_torch_ops: args.no_agent || args.no_torch_ops,
        torch_op_millionths: args.torch_op_sampling,
        torch_op_shapes: args.torch_op_shapes,
        framework_memory: args.max_target_growth_mib.map(|mib| mib << 20),
        name_kernels_with_agent: !args.no_agent,
        one_window: true,
        ..CaptureOptions::default()
    }
}

/// Prints what is traced, the notes and the warnings of the attach; with
/// `--json`, keeps them for the summary.
fn announce(capture: &mut Capture, args: &RecordArgs) -> Option<json::Start> {
    let names: Vec<String> = capture
        .targets()
        .iter()
        .map(|t| format!("{} ({})", t.pid, t.name))
        .collect();
    eprintln!(
        "ebtrace: tracing pid {} for {} (probes attached in {:.0?}); Ctrl-C stops early",
        names.join(", "),
        humantime::format_duration(args.duration),
        capture.attach_time,
    );
    let mut notes = capture.notes.clone();
    notes.extend(capture.traceme_notes());
    for note in &capture.notes {
        eprintln!("ebtrace: {note}");
    }
    for warning in &capture.warnings {
        eprintln!("ebtrace: warning: {warning}");
    }
    for note in &notes[capture.notes.len()..] {
        eprintln!("ebtrace: {note}");
    }
    let warnings = capture.warnings.clone();
    args.json.then(|| json::Start::of(capture, notes, warnings))
}

/// The bar that shows the capture's progress (hidden with `--quiet`).
fn progress_bar(args: &RecordArgs) -> ProgressBar {
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.duration.as_millis() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} recording [{bar:30}] {elapsed_precise} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Polls the capture until its duration is up, a signal came or every
/// target exited; says why if it ended before its duration.
fn record_until_done(
    capture: &mut Capture,
    args: &RecordArgs,
    started: Instant,
    stop: &AtomicBool,
    bar: &ProgressBar,
) -> Option<String> {
    loop {
        let elapsed = started.elapsed();
        if stop.load(Ordering::Relaxed) {
            return Some("interrupted".to_string());
        }
        if elapsed >= args.duration {
            return None;
        }
        let status = capture.poll(TICK.min(args.duration - elapsed));
        bar.set_position(started.elapsed().as_millis() as u64);
        bar.set_message(format!("{} records", status.records));
        if status.alive == 0 {
            return Some("every traced process exited".to_string());
        }
    }
}

/// Writes the Perfetto trace beside the XSpace at `xspace`; returns its
/// path.
fn write_perfetto(xspace: &Path, bytes: &[u8]) -> Result<PathBuf> {
    let p = xspace.with_file_name(perfetto::FILE_NAME);
    logdir::write_atomically(&p, bytes)
        .map_err(|e| crate::error::Error::io(format!("writing {}", p.display()), e))?;
    Ok(p)
}

/// What people are told at the end: the summary and where the traces
/// went, only their paths with `--quiet`, nothing with `--quiet --json`.
fn report_for_people(
    args: &RecordArgs,
    summary: &str,
    path: &Path,
    perfetto_path: Option<&Path>,
) -> String {
    let mut human = String::new();
    if !args.quiet {
        human.push_str(summary);
        human.push_str(&format!("trace: {}\n", path.display()));
        if let Some(p) = perfetto_path {
            human.push_str(&format!(
                "trace: {}   (open in https://ui.perfetto.dev)\n",
                p.display()
            ));
        }
        human.push_str(&format!(
            "view:  xprof --logdir {0}   (or: tensorboard --logdir {0})\n",
            args.logdir.display()
        ));
    } else if !args.json {
        human.push_str(&format!("{}\n", path.display()));
        if let Some(p) = perfetto_path {
            human.push_str(&format!("{}\n", p.display()));
        }
    }
    human
}
