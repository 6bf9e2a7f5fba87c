//! ebtrace on a real TensorFlow process (tensorflow-cpu 2.21 from PyPI,
//! installed into `.venv` by `cargo xtask setup`) running TensorFlow's own
//! documented step marker, `tf.profiler.experimental.Trace("Train",
//! step_num=step, _r=1)`. Those Python-level TraceMes pass two gates:
//! TSL's `g_trace_level` in `libtensorflow_framework.so.2` and
//! `xla::profiler::traceme_enabled` in `lib_pywrap_tensorflow_common.so`.
//! ebtrace must switch both on, and both back, also when it is killed.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use ebtrace_tests::{
    TempDir,
    killed::kill_mid_capture,
    record, require_root, serial, signal,
    traceme::read_i32,
    workspace_root, xplane_files,
    xprof::python_with,
    xspace::{self, Stat, assert_lines_nest, line_events, plane},
};

/// The running TensorFlow workload, stopped when dropped.
struct TfWorkload {
    child: Child,
    pid: u32,
}

impl TfWorkload {
    fn start(python: &Path) -> Self {
        let mut child = Command::new(python)
            .arg(workspace_root().join("tests/fixtures/traceme/tf_workload.py"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the TensorFlow workload");
        let mut first = String::new();
        BufReader::new(child.stdout.as_mut().expect("piped"))
            .read_line(&mut first)
            .expect("read start line");
        let v: serde_json::Value = serde_json::from_str(&first)
            .unwrap_or_else(|e| panic!("bad start line {first:?}: {e}"));
        TfWorkload {
            pid: v["pid"].as_u64().expect("pid") as u32,
            child,
        }
    }
}

impl Drop for TfWorkload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where `symbol` of the mapped object whose path ends in `suffix` is in
/// `pid`, found with binutils' `nm -D` (not ebtrace's own lookup): its
/// value plus the address the object's first page is mapped at.
fn exported_address(pid: u32, suffix: &str, symbol: &str) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let (start, path) = maps
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 6 && f[5].ends_with(suffix) && f[2] == "00000000").then(|| {
                let start = u64::from_str_radix(f[0].split('-').next().unwrap(), 16).unwrap();
                (start, f[5].to_string())
            })
        })
        .unwrap_or_else(|| panic!("{suffix} is not mapped"));
    let nm = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&path)
        .output()
        .expect("run nm");
    let vaddr = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .find(|l| l.ends_with(&format!(" {symbol}")))
        .and_then(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
        .unwrap_or_else(|| panic!("{symbol} not in nm -D of {path}"));
    start + vaddr
}

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
    let workload = TfWorkload::start(&python);
    let pid = workload.pid;
    let level_at = exported_address(pid, "/libtensorflow_framework.so.2", LEVEL);
    let gate_at = exported_address(pid, "/lib_pywrap_tensorflow_common.so", PYTHON_GATE);
    assert_eq!(read_i32(pid, level_at), -1, "no session in the process");
    assert_eq!(read_u8(pid, gate_at), 0);

    let dir = TempDir::new("traceme-tf");
    let out = record(&pid.to_string(), "2s", &dir, &[]);
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
        &[],
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
