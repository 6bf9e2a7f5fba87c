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

/// Starts the workload on the stand-in plugin, lets it run steps, records
/// it for `duration` with `extra` flags; returns ebtrace's stderr, the
/// trace's TPU events (realtime ns) and what the plugin logged.
fn trace(
    args: &[&str],
    extra: &[&str],
) -> (
    String,
    Vec<LoggedEvent>,
    Vec<LoggedEvent>,
    Vec<serde_json::Value>,
    serde_json::Value,
) {
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
    let (start_wall, _) = profile_window(&space);
    let traced = tpu_events(&space)
        .into_iter()
        .map(|e| LoggedEvent {
            start_ns: e.start_ns + start_wall as i64,
            end_ns: e.end_ns + start_wall as i64,
            ..e
        })
        .collect();
    let (calls, logged) = read_log(&log);
    (stderr, traced, logged, calls, report)
}

#[test]
fn the_plugins_own_profiler_records_the_tpu_and_is_taken_out() {
    if !require_root("the_plugins_own_profiler_records_the_tpu_and_is_taken_out") {
        return;
    }
    let _serial = serial();
    let (stderr, traced, logged, calls, report) = trace(&[], &[]);
    assert!(
        stderr.contains("device activity: PJRT plugin profiler of"),
        "{stderr}"
    );
    assert!(report["ops"].as_u64().unwrap() > 0, "{report}");

    // Every event in the trace is one the plugin recorded, at its time
    // (to the µs: realtime → monotonic → realtime), except those cut at
    // the window's edges.
    let (first, last) = (traced.first().unwrap(), traced.last().unwrap());
    for e in &traced {
        let found = logged.iter().any(|l| {
            l.kind == e.kind
                && l.name == e.name
                && (l.start_ns - e.start_ns).abs() <= 1_000
                && ((l.end_ns - e.end_ns).abs() <= 1_000 || e == first || e == last)
        });
        assert!(found, "not recorded by the plugin: {e:?}");
    }
    // Every op the plugin recorded inside the trace's span of events is in it.
    let inside: Vec<_> = logged
        .iter()
        .filter(|l| l.kind == "op" && l.start_ns > first.start_ns && l.end_ns < last.start_ns)
        .collect();
    let traced_inside = traced
        .iter()
        .filter(|e| e.kind == "op" && e.start_ns > first.start_ns && e.end_ns < last.start_ns)
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
    let (stderr, traced, _, _, report) = trace(&["--own-profiler"], &[]);
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
