//! ebtrace on a real jax process (jax and jaxlib 0.10.2 from PyPI, CPU
//! backend, installed into `.venv` by `cargo xtask setup`), TraceMe through
//! uprobes (`--traceme uprobe`): jaxlib's own TraceMe recorder, found in its
//! local `.symtab` symbols, switched on from outside, read back, and
//! switched off again. The agent route is tested in `agent.rs`.

use std::{process::Command, time::Duration};

use ebtrace_tests::{
    TempDir,
    killed::kill_mid_capture,
    python::{jax_python, jaxlib_trace_level_address, start_jax},
    record, require_root, serial, signal,
    traceme::read_i32,
    viewer, xplane_files,
    xspace::{self, Stat, assert_lines_nest, line_events, plane},
};

const XPROF_EVENTS: &str = r#"
import json, os, shutil, sys, tempfile
from xprof.convert import raw_to_tool_data as r
d = tempfile.mkdtemp()
src = os.path.join(d, os.path.basename(sys.argv[1]))
shutil.copy(sys.argv[1], src)
data, _ = r.xspace_to_tool_data([src], "trace_viewer@", {})
shutil.rmtree(d)
counts = {}
for e in json.loads(data)["traceEvents"]:
    if e.get("ph") == "X" and e.get("tid") == int(sys.argv[2]):
        counts[e["name"]] = counts.get(e["name"], 0) + 1
print(json.dumps(counts))
"#;

#[test]
fn jax_traceme_events_appear_and_the_level_is_restored() {
    if !require_root("jax_traceme_events_appear_and_the_level_is_restored") {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let workload = start_jax(&python, &[]);
    let level_at = jaxlib_trace_level_address(workload.pid);
    assert_eq!(
        read_i32(workload.pid, level_at),
        -1,
        "no session in the process"
    );

    let dir = TempDir::new("traceme-jax");
    let pid = workload.pid.to_string();
    let out = record(&pid, "2s", &dir, &["--traceme", "uprobe"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("TraceMe recorder in libjax_common.so (tsl::profiler, libstdc++;"),
        "{stderr}"
    );
    assert!(stderr.contains("level 2 set by ebtrace"), "{stderr}");
    assert_eq!(read_i32(workload.pid, level_at), -1, "level not restored");
    signal(workload.pid, libc::SIGTERM);

    let files = xplane_files(dir.path());
    assert_eq!(files.len(), 1);
    let space = xspace::load(&files[0]);
    let host = plane(&space, "/host:CPU");
    assert_lines_nest(host);
    // The Python thread: its steps, with their step_num, around jaxlib's
    // dispatch and execution events, beside its scheduling.
    let main = line_events(host, workload.pid.into());
    let steps: Vec<_> = main.iter().filter(|e| e.name == "ebtrace_step").collect();
    assert!(steps.len() >= 50, "{} steps", steps.len());
    let nums: Vec<i64> = steps.iter().map(|e| e.stats["step_num"].as_i64()).collect();
    assert!(
        nums.windows(2).all(|w| w[1] == w[0] + 1),
        "step_num not consecutive: {nums:?}"
    );
    assert!(matches!(steps[0].stats["step_num"], Stat::I64(_)));
    // StepTraceAnnotation around each: the same steps, marked `_r=1`.
    let train: Vec<i64> = main
        .iter()
        .filter(|e| e.name == "train")
        .map(|e| e.stats["step_num"].as_i64())
        .collect();
    assert!(
        train.len() + 1 >= steps.len() && train.iter().all(|n| nums.contains(n)),
        "StepTraceAnnotation steps {train:?} vs TraceAnnotation steps {nums:?}"
    );
    let inside = steps
        .iter()
        .filter(|s| {
            main.iter().any(|e| {
                e.name == "PjitFunction(step)"
                    && e.start_ns >= s.start_ns
                    && e.end_ns() <= s.end_ns()
            })
        })
        .count();
    assert!(
        inside * 10 >= steps.len() * 9,
        "{inside} of {} steps hold a dispatch",
        steps.len()
    );
    assert!(main.iter().any(|e| e.name == "Running"));

    let all: Vec<String> = host
        .lines
        .iter()
        .flat_map(|l| line_events(host, l.id))
        .map(|e| e.name)
        .collect();
    let count = |pred: &dyn Fn(&str) -> bool| all.iter().filter(|n| pred(n)).count();
    assert!(
        count(&|n| n.contains("PjRtLoadedExecutable::Execute")) >= 50,
        "no PjRt execution events"
    );
    assert!(count(&|n| n.starts_with("ThunkExecutor::Execute")) >= 50);
    assert!(
        count(&|n| n == "PjRtCpuClient::Compile" || n == "backend_compile_and_load") >= 1,
        "no compilation events"
    );

    // XProf's own trace viewer shows them on the Python thread.
    let conv = Command::new(&python)
        .args(["-c", XPROF_EVENTS])
        .arg(&files[0])
        .arg(&pid)
        .output()
        .expect("run xprof");
    assert!(
        conv.status.success(),
        "{}",
        String::from_utf8_lossy(&conv.stderr)
    );
    let stdout = String::from_utf8_lossy(&conv.stdout);
    let shown: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(
        shown["ebtrace_step"].as_u64(),
        Some(steps.len() as u64),
        "{shown}"
    );
    assert!(
        shown["PjitFunction(step)"].as_u64().unwrap_or(0) >= 50,
        "{shown}"
    );
}

/// Eight XLA host devices, as multi-device CPU setups run: XLA gives them
/// their threads, so the process has more threads (29 on a 2-core machine,
/// more on larger ones) than XProf's trace viewer opens a process with.
const EIGHT_HOST_DEVICES: (&str, &str) = ("XLA_FLAGS", "--xla_force_host_platform_device_count=8");

#[test]
fn xprof_opens_a_jax_capture_with_its_threads_shown() {
    if !require_root("xprof_opens_a_jax_capture_with_its_threads_shown") {
        return;
    }
    opens_with_its_threads_shown("uprobe");
}

/// The same through the agent, whose framework session leaves more of the
/// pool threads running a little (and adds its own thread).
#[test]
fn xprof_opens_an_agent_capture_of_jax_with_its_threads_shown() {
    if !require_root("xprof_opens_an_agent_capture_of_jax_with_its_threads_shown") {
        return;
    }
    opens_with_its_threads_shown("agent");
}

/// A 2 s capture of a jax process with more threads than the trace viewer
/// opens a process with, TraceMe through `route`, opens in XProf with
/// `/host:CPU` expanded on its threads.
fn opens_with_its_threads_shown(route: &str) {
    let Some(python) = jax_python() else {
        return;
    };
    let Some(chromium) = viewer::chromium() else {
        return;
    };
    let _serial = serial();
    let workload = start_jax(&python, &[EIGHT_HOST_DEVICES]);
    let threads = std::fs::read_dir(format!("/proc/{}/task", workload.pid))
        .expect("list the workload's threads")
        .count();
    assert!(
        threads as u64 > viewer::TRACE_VIEWER_OPEN_MAX_THREADS,
        "the workload has only {threads} threads"
    );
    viewer::assert_capture_opens_with_threads_shown(
        &python,
        &chromium,
        workload.pid,
        &["--traceme", route],
        &format!("jax-{route}"),
    );
}

#[test]
fn a_killed_ebtrace_leaves_jax_as_it_found_it() {
    if !require_root("a_killed_ebtrace_leaves_jax_as_it_found_it") {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let workload = start_jax(&python, &[]);
    let pid = workload.pid;
    let level_at = jaxlib_trace_level_address(pid);
    let after = kill_mid_capture(
        pid,
        &["--max-events", "1000000000", "--traceme", "uprobe"],
        "TraceMe recorder in libjax_common.so",
        || i64::from(read_i32(pid, level_at)),
        -1,
        Duration::from_secs(1),
    );
    // jaxlib's recorder grew while recording was on, and stopped.
    after.assert_restored_and_quiet("level 2 set by ebtrace", 256 << 10, 4);
    signal(pid, libc::SIGTERM);
}
