//! A process with a PJRT plugin loaded (no framework, no Python): ebtrace's
//! agent runs the plugin's own profiler through its profiler extension and
//! the trace carries the plugin's `/device:TPU:0` plane. Checked against
//! the stand-in plugin's own log of every event it recorded.

use std::time::Duration;

use ebtrace_tests::{
    TempDir,
    pjrt::{LoggedEvent, PjrtWorkload, read_log, tpu_events},
    record, require_root, serial, xplane_files,
    xspace::{self, profile_window},
};

/// One capture of the stand-in plugin's workload.
struct Traced {
    stderr: String,
    /// The trace's TPU events (realtime ns).
    traced: Vec<LoggedEvent>,
    /// The events the plugin logged.
    logged: Vec<LoggedEvent>,
    /// The plugin's profiler calls.
    calls: Vec<serde_json::Value>,
    /// The workload's own report.
    report: serde_json::Value,
    /// The capture window (realtime ns).
    window: (i64, i64),
}

/// Starts the workload on the stand-in plugin, lets it run steps and
/// records it for 2 s with `extra` flags.
fn trace(args: &[&str], extra: &[&str]) -> Traced {
    let dir = TempDir::new("pjrt-log");
    let log = dir.path().join("plugin.log");
    let mut workload = PjrtWorkload::start(args, &[("STANDIN_PJRT_LOG", &log)]);
    workload.go();
    let logdir = TempDir::new("pjrt");
    let out = record(&workload.pid.to_string(), "2s", &logdir, extra);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ebtrace failed:\n{stderr}");
    let report = workload.stop(Duration::from_secs(30));
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "one trace: {stderr}");
    let space = xspace::load(&files[0]);
    let (start_wall, stop_wall) = profile_window(&space);
    let traced = tpu_events(&space)
        .into_iter()
        .map(|e| LoggedEvent {
            start_ns: e.start_ns + start_wall as i64,
            end_ns: e.end_ns + start_wall as i64,
            ..e
        })
        .collect();
    let (calls, logged) = read_log(&log);
    Traced {
        stderr,
        traced,
        logged,
        calls,
        report,
        window: (start_wall as i64, stop_wall as i64),
    }
}

#[test]
fn the_plugins_own_profiler_records_the_tpu_and_is_taken_out() {
    if !require_root("the_plugins_own_profiler_records_the_tpu_and_is_taken_out") {
        return;
    }
    let _serial = serial();
    let Traced {
        stderr,
        traced,
        logged,
        calls,
        report,
        window,
    } = trace(&[], &[]);
    assert!(
        stderr.contains("device activity: PJRT plugin profiler of"),
        "{stderr}"
    );
    assert!(report["ops"].as_u64().unwrap() > 0, "{report}");

    // Every event in the trace is one the plugin recorded, at its time
    // (to the µs: realtime → monotonic → realtime), except where the
    // window's edges cut it.
    let (window_start, window_stop) = window;
    let at = |edge: i64, t: i64| (t - edge).abs() <= 2_000;
    for e in &traced {
        let found = logged.iter().any(|l| {
            l.kind == e.kind
                && l.name == e.name
                && ((l.start_ns - e.start_ns).abs() <= 1_000 || at(window_start, e.start_ns))
                && ((l.end_ns - e.end_ns).abs() <= 1_000 || at(window_stop, e.end_ns))
        });
        assert!(found, "not recorded by the plugin: {e:?}");
    }
    // Every op the plugin recorded inside the span of the trace's ops is in it.
    let ops = || traced.iter().filter(|e| e.kind == "op");
    let first = ops().map(|e| e.start_ns).min().unwrap();
    let last = ops().map(|e| e.start_ns).max().unwrap();
    let inside: Vec<_> = logged
        .iter()
        .filter(|l| l.kind == "op" && l.start_ns > first && l.end_ns < last)
        .collect();
    let traced_inside = ops()
        .filter(|e| e.start_ns > first && e.end_ns < last)
        .count();
    assert!(inside.len() > 100, "too few ops to judge: {}", inside.len());
    assert_eq!(traced_inside, inside.len());

    // The profiler ebtrace created was stopped and destroyed.
    let count = |call: &str| calls.iter().filter(|c| c["call"] == call).count();
    assert_eq!(count("create"), 1, "{calls:?}");
    assert_eq!(count("destroy"), 1, "{calls:?}");
    assert_eq!(count("stop"), 1, "{calls:?}");
}

#[test]
fn a_program_running_its_own_plugin_profiler_is_left_alone() {
    if !require_root("a_program_running_its_own_plugin_profiler_is_left_alone") {
        return;
    }
    let _serial = serial();
    let Traced {
        stderr,
        traced,
        report,
        ..
    } = trace(&["--own-profiler"], &[]);
    assert!(
        stderr.contains("device activity not recorded")
            && stderr.contains("runs a profiler session of its own"),
        "{stderr}"
    );
    assert!(traced.is_empty(), "{traced:?}");
    // Its own session still completes and collects.
    assert!(
        report["own_profiler_bytes"].as_u64().unwrap() > 0,
        "{report}"
    );
}
