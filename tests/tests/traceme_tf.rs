//! ebtrace on a real TensorFlow process (tensorflow-cpu 2.21 from PyPI,
//! installed into `.venv` by `cargo xtask setup`) running TensorFlow's own
//! documented step marker, `tf.profiler.experimental.Trace("Train",
//! step_num=step, _r=1)`. Those Python-level TraceMes pass two gates:
//! TSL's `g_trace_level` in `libtensorflow_framework.so.2` and
//! `xla::profiler::traceme_enabled` in `lib_pywrap_tensorflow_common.so`.
//! ebtrace must switch both on, and both back, also when it is killed.

use std::time::Duration;

use ebtrace_tests::{
    TempDir,
    killed::kill_mid_capture,
    python::{PythonWorkload, symbol_address},
    record, require_root, serial, signal,
    traceme::read_i32,
    viewer, xplane_files,
    xprof::python_with,
    xspace::{self, Stat, assert_lines_nest, line_events, plane},
};

fn read_u8(pid: u32, address: u64) -> u8 {
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open mem");
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&mem, &mut b, address).expect("read mem");
    b[0]
}

const LEVEL: &str = "_ZN3tsl8profiler8internal13g_trace_levelE";
const PYTHON_GATE: &str = "_ZN3xla8profiler15traceme_enabledE";

#[test]
fn tensorflow_trace_steps_appear_and_both_gates_are_restored_even_after_sigkill() {
    if !require_root("tensorflow_trace_steps_appear_and_both_gates_are_restored_even_after_sigkill")
    {
        return;
    }
    let Some(python) = python_with(&["tensorflow"]) else {
        return;
    };
    let _serial = serial();
    let workload = PythonWorkload::start(&python, "tf_workload.py", &[]);
    let pid = workload.pid;
    let level_at = symbol_address(pid, "/libtensorflow_framework.so.2", LEVEL);
    let gate_at = symbol_address(pid, "/lib_pywrap_tensorflow_common.so", PYTHON_GATE);
    assert_eq!(read_i32(pid, level_at), -1, "no session in the process");
    assert_eq!(read_u8(pid, gate_at), 0);

    let dir = TempDir::new("traceme-tf");
    let out = record(&pid.to_string(), "2s", &dir, &["--traceme", "uprobe"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "Python TraceMe gate xla::profiler::traceme_enabled in \
             lib_pywrap_tensorflow_common.so: set by ebtrace"
        ),
        "{stderr}"
    );
    assert_eq!(read_u8(pid, gate_at), 0, "Python gate not restored");
    assert_eq!(read_i32(pid, level_at), -1, "level not restored");

    let files = xplane_files(dir.path());
    assert_eq!(files.len(), 1);
    let space = xspace::load(&files[0]);
    let host = plane(&space, "/host:CPU");
    assert_lines_nest(host);
    // TensorFlow's documented step marker, on the Python thread, with its
    // step_num, around the tf.function call it times.
    let main = line_events(host, pid.into());
    let steps: Vec<_> = main.iter().filter(|e| e.name == "Train").collect();
    assert!(steps.len() >= 50, "{} Train steps", steps.len());
    let nums: Vec<i64> = steps.iter().map(|e| e.stats["step_num"].as_i64()).collect();
    assert!(
        nums.windows(2).all(|w| w[1] == w[0] + 1),
        "step_num not consecutive: {nums:?}"
    );
    assert!(matches!(steps[0].stats["step_num"], Stat::I64(_)));
    let calls = main
        .iter()
        .filter(|e| e.name == "train_step" && e.stats.contains_key("tf_function_call"))
        .count();
    assert!(calls + 2 >= steps.len(), "{calls} tf.function calls");

    // Killed mid-capture: the guard puts both gates back.
    let after = kill_mid_capture(
        pid,
        &["--traceme", "uprobe"],
        "Python TraceMe gate",
        || i64::from(read_u8(pid, gate_at)),
        0,
        Duration::from_millis(300),
    );
    assert!(
        after.stderr.last().unwrap().contains("set by ebtrace"),
        "{:?}",
        after.stderr
    );
    assert!(
        after.restored_in.is_some(),
        "Python gate still set 1 s after ebtrace's SIGKILL"
    );
    assert_eq!(read_i32(pid, level_at), -1, "level left on after SIGKILL");
    signal(pid, libc::SIGTERM);
}

/// A 2 s capture of a `tf.function` loop opens in XProf with TensorFlow's
/// threads shown, as TensorFlow's own capture does.
#[test]
fn xprof_opens_a_tensorflow_capture_with_its_threads_shown() {
    if !require_root("xprof_opens_a_tensorflow_capture_with_its_threads_shown") {
        return;
    }
    let Some(python) = python_with(&["tensorflow", ebtrace_tests::xprof::XPROF_MODULE]) else {
        return;
    };
    let Some(chromium) = viewer::chromium() else {
        return;
    };
    let _serial = serial();
    let workload = PythonWorkload::start(&python, "tf_workload.py", &[]);
    viewer::assert_capture_opens_with_threads_shown(
        &python,
        &chromium,
        workload.pid,
        &[],
        "tensorflow",
    );
}
