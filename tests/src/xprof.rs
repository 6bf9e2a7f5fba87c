//! XProf itself (the `xprof` package from PyPI) converting a trace to its
//! trace viewer's JSON and its framework op stats, summarized for
//! assertions.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The module the conversions use.
pub const XPROF_MODULE: &str = "xprof.convert.raw_to_tool_data";

/// The Python that has `xprof` installed, or `None` to skip (unless
/// `EBTRACE_REQUIRE_INTEROP=1`, where a skip is a failure).
pub fn python() -> Option<PathBuf> {
    python_with(&[XPROF_MODULE])
}

/// `EBTRACE_PYTHON` if it can import every module, or `None` to skip
/// (unless `EBTRACE_REQUIRE_INTEROP=1`, where a skip is a failure).
pub fn python_with(modules: &[&str]) -> Option<PathBuf> {
    let required = std::env::var("EBTRACE_REQUIRE_INTEROP").as_deref() == Ok("1");
    let python = std::env::var_os("EBTRACE_PYTHON").map(PathBuf::from);
    let import = format!("import {}", modules.join(", "));
    let ok = python.as_ref().is_some_and(|p| {
        Command::new(p)
            .args(["-c", &import])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    match (ok, required) {
        (true, _) => python,
        (false, true) => {
            panic!("EBTRACE_PYTHON={python:?} cannot `{import}` (run `cargo xtask setup`)")
        }
        (false, false) => {
            eprintln!("skipping: set EBTRACE_PYTHON to a Python that can `{import}`");
            None
        }
    }
}

/// Converts with `xspace_to_tool_data(..., "trace_viewer@")` and prints:
/// process names by pid (and their thread counts, which decide whether the
/// trace viewer opens them, in `thread_counts`), thread names by "pid/tid"
/// (and by "tid" alone in `rows`, with the pid in `row_pids`),
/// complete-event counts by "pid/tid/name" (and by "tid/name" in
/// `row_events`), and per flow category the flow ids that leave
/// (`flow_out`) and enter (`flow_in`) events.
const SUMMARIZE: &str = r#"
import json, shutil, sys, tempfile, os
from xprof.convert import raw_to_tool_data as r
# xprof writes side files next to its input: convert a copy.
d = tempfile.mkdtemp()
src = os.path.join(d, os.path.basename(sys.argv[1]))
shutil.copy(sys.argv[1], src)
data, content_type = r.xspace_to_tool_data([src], "trace_viewer@", {})
shutil.rmtree(d)
j = json.loads(data)
out = {"processes": {}, "thread_counts": {}, "threads": {}, "events": {}, "flows": {},
       "rows": {}, "row_pids": {}, "row_events": {}}
for e in j["traceEvents"]:
    ph = e.get("ph")
    if ph == "M" and e.get("name") == "process_name":
        out["processes"][str(e["pid"])] = e["args"]["name"]
        out["thread_counts"][str(e["pid"])] = e.get("thread_count")
    elif ph == "M" and e.get("name") == "thread_name":
        out["threads"][str(e["pid"]) + "/" + str(e["tid"])] = e["args"]["name"]
        out["rows"][str(e["tid"])] = e["args"]["name"]
        out["row_pids"][str(e["tid"])] = e["pid"]
    elif ph == "X":
        key = str(e["pid"]) + "/" + str(e["tid"]) + "/" + e["name"]
        out["events"][key] = out["events"].get(key, 0) + 1
        row = str(e["tid"]) + "/" + e["name"]
        out["row_events"][row] = out["row_events"].get(row, 0) + 1
    if "bind_id" in e:
        f = out["flows"].setdefault(e.get("cat", ""), {"out": [], "in": []})
        if e.get("flow_out"):
            f["out"].append(e["bind_id"])
        if e.get("flow_in"):
            f["in"].append(e["bind_id"])
print(json.dumps(out))
"#;

/// The trace viewer's view of `xplane`, summarized (see [`SUMMARIZE`]).
pub fn trace_viewer_summary(python: &Path, xplane: &Path) -> serde_json::Value {
    converted(python, SUMMARIZE, xplane)
}

/// What `script`, run on `xplane`, prints as JSON on its last line.
fn converted(python: &Path, script: &str, xplane: &Path) -> serde_json::Value {
    converted_with(python, script, xplane, &[])
}

/// [`converted`], with `args` after the xplane's path.
fn converted_with(python: &Path, script: &str, xplane: &Path, args: &[&str]) -> serde_json::Value {
    let conv = Command::new(python)
        .args(["-c", script])
        .arg(xplane)
        .args(args)
        .output()
        .expect("run python");
    assert!(
        conv.status.success(),
        "xprof failed: {}",
        String::from_utf8_lossy(&conv.stderr)
    );
    let stdout = String::from_utf8_lossy(&conv.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("bad output {stdout}: {e}"))
}

/// Checks that XProf shows the `sched_workload` fixture's threads in
/// `xplane`, with the burner running and the sleeper's 10 ms blocks (the
/// capture is at least a second long).
pub fn assert_shows_sched_workload(
    python: &Path,
    xplane: &Path,
    workload: &crate::fixture::SchedWorkload,
) {
    let json = trace_viewer_summary(python, xplane);
    for name in ["cpu-burner", "sleeper-10ms", "ping", "pong"] {
        let tid = workload.tid(name).to_string();
        let shown = json["rows"][&tid]
            .as_str()
            .unwrap_or_else(|| panic!("no row for {name}: {json}"));
        assert!(shown.starts_with(name), "row {shown:?} for {name}");
    }
    let count = |thread: &str, event: &str| {
        json["row_events"][format!("{}/{event}", workload.tid(thread))]
            .as_u64()
            .unwrap_or(0)
    };
    assert!(count("cpu-burner", "Running") >= 1, "{json}");
    assert!(count("sleeper-10ms", "Blocked") >= 50, "{json}");
}

/// What `xprof.profile_plugin`'s capture route (the web UI's "Capture
/// profile" button) calls, with its defaults: levels 2/1/0, delay 0,
/// `num_retry` 0 (one attempt). argv: address, logdir, host level,
/// attempts.
pub const CAPTURE_BUTTON: &str = r#"
import json, sys
from xprof.convert import _pywrap_profiler_plugin
addr, logdir, host_level, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
options = {"host_tracer_level": host_level, "device_tracer_level": 1,
           "python_tracer_level": 0, "delay_ms": 0}
try:
    _pywrap_profiler_plugin.trace(addr, logdir, "", True, 1000, attempts, options)
    print(json.dumps({"ok": True}))
except Exception as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"#;

/// Converts with `xspace_to_tool_data(..., TOOL, {})` (argv: xplane, TOOL)
/// and prints its table's rows, each as an object of column id to value.
const TOOL_ROWS: &str = r#"
import json, shutil, sys, tempfile, os
from xprof.convert import raw_to_tool_data as r
d = tempfile.mkdtemp()
src = os.path.join(d, os.path.basename(sys.argv[1]))
shutil.copy(sys.argv[1], src)
data, content_type = r.xspace_to_tool_data([src], sys.argv[2], {})
shutil.rmtree(d)
j = json.loads(data)
table = j[0] if isinstance(j, list) else j
cols = [c["id"] for c in table["cols"]]
print(json.dumps([dict(zip(cols, [c.get("v") if c else None for c in row["c"]]))
                  for row in table["rows"]]))
"#;

/// The rows of XProf's `tool` table for `xplane`.
fn tool_rows(python: &Path, tool: &str, xplane: &Path) -> Vec<serde_json::Value> {
    match converted_with(python, TOOL_ROWS, xplane, &[tool]) {
        serde_json::Value::Array(rows) => rows,
        other => panic!("{tool}: not rows: {other}"),
    }
}

/// A host op row of XProf's framework op stats.
#[derive(Debug)]
pub struct HostOpRow {
    pub operation: String,
    pub op_type: String,
    pub occurrences: f64,
    /// µs.
    pub total_time: f64,
    /// µs.
    pub total_self_time: f64,
}

/// The host ops of XProf's framework op stats for `xplane`.
pub fn framework_host_ops(python: &Path, xplane: &Path) -> Vec<HostOpRow> {
    tool_rows(python, "framework_op_stats", xplane)
        .iter()
        .filter(|r| r["host_or_device"] == "Host")
        .map(|r| HostOpRow {
            operation: r["operation"].as_str().unwrap_or_default().to_string(),
            op_type: r["type"].as_str().unwrap_or_default().to_string(),
            occurrences: r["occurrences"].as_f64().unwrap_or(0.0),
            total_time: r["total_time"].as_f64().unwrap_or(0.0),
            total_self_time: r["total_self_time"].as_f64().unwrap_or(0.0),
        })
        .collect()
}

/// The rows of XProf's kernel stats for `xplane`: the op each kernel ran
/// for, and how often.
pub fn kernel_ops(python: &Path, xplane: &Path) -> Vec<(String, f64)> {
    tool_rows(python, "kernel_stats", xplane)
        .iter()
        .map(|r| {
            (
                r["op_name"].as_str().unwrap_or_default().to_string(),
                r["occurrences"].as_f64().unwrap_or(0.0),
            )
        })
        .collect()
}

/// Converts with `xspace_to_tool_data(..., "overview_page", {})` and prints
/// its step-time table's rows and average step time (ms).
const OVERVIEW_STEPS: &str = r#"
import json, shutil, sys, tempfile, os
from xprof.convert import raw_to_tool_data as r
d = tempfile.mkdtemp()
src = os.path.join(d, os.path.basename(sys.argv[1]))
shutil.copy(sys.argv[1], src)
data, content_type = r.xspace_to_tool_data([src], "overview_page", {})
shutil.rmtree(d)
steps = json.loads(data)[1]
print(json.dumps({"steps": len(steps.get("rows", [])),
                  "average_ms": float(steps.get("p", {}).get("steptime_ms_average", 0))}))
"#;

/// The steps XProf's overview page finds in `xplane`: how many, and
/// their average time in ms.
pub fn overview_steps(python: &Path, xplane: &Path) -> (usize, f64) {
    let v = converted(python, OVERVIEW_STEPS, xplane);
    (
        v["steps"].as_u64().unwrap_or(0) as usize,
        v["average_ms"].as_f64().unwrap_or(0.0),
    )
}

/// Runs jax's capture client, `python -m jax.collect_profile PORT
/// DURATION_MS --log_dir LOGDIR --no_perfetto_link`, against a server on
/// this machine, to its end (at most 2 minutes).
pub fn collect_profile(
    python: &Path,
    port: &str,
    duration_ms: u64,
    logdir: &Path,
) -> std::process::Output {
    let child = Command::new(python)
        .args(["-m", "jax.collect_profile", port, &duration_ms.to_string()])
        .arg("--log_dir")
        .arg(logdir)
        .arg("--no_perfetto_link")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run jax.collect_profile");
    crate::wait_with_deadline(child, std::time::Duration::from_secs(120))
}
