//! Every user-fixable failure exits with code 2, says what to do in one
//! line, and leaves nothing behind.

use std::process::Command;

use ebtrace_tests::{TempDir, ebtrace_bin, require_root, run_ebtrace, serial, xplane_files};

/// Asserts exit code 2, a single line on stderr containing every needle,
/// and an untouched log directory.
fn assert_clean_failure(out: &std::process::Output, needles: &[&str], logdir: &TempDir) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    for n in needles {
        assert!(lines[0].contains(n), "{n:?} not in {:?}", lines[0]);
    }
    assert!(
        xplane_files(logdir.path()).is_empty(),
        "a trace was written"
    );
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn logdir_arg(dir: &TempDir) -> String {
    dir.path().join("logs").to_string_lossy().into_owned()
}

#[test]
fn unknown_pid() {
    let dir = TempDir::new("err-pid");
    // pid_max is at most 2^22: this pid cannot exist.
    let out = run_ebtrace(&["-p", "4194999", "-d", "1s", "--logdir", &logdir_arg(&dir)]);
    assert_clean_failure(&out, &["no process with pid 4194999"], &dir);
    assert!(
        !dir.path().join("logs").exists(),
        "logdir created for nothing"
    );
}

#[test]
fn invalid_durations() {
    let dir = TempDir::new("err-dur");
    let me = std::process::id().to_string();
    for bad in ["2parsecs", "0s", "-1s", ""] {
        let duration = format!("--duration={bad}");
        let out = run_ebtrace(&["-p", &me, &duration, "--logdir", &logdir_arg(&dir)]);
        assert_clean_failure(&out, &["--duration"], &dir);
    }
}

#[test]
fn missing_pid_argument() {
    let dir = TempDir::new("err-args");
    let out = run_ebtrace(&["-d", "1s", "--logdir", &logdir_arg(&dir)]);
    assert_clean_failure(&out, &["--pid"], &dir);
}

#[test]
fn not_root() {
    if !require_root("not_root (needs root to drop to an unprivileged user)") {
        return;
    }
    let dir = TempDir::new("err-root");
    let me = std::process::id().to_string();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(ebtrace_bin())
        .args([
            "-p",
            &me,
            "-d",
            "1s",
            "--logdir",
            "/tmp/ebtrace-never-written",
        ])
        .output()
        .expect("run setpriv (util-linux)");
    assert_clean_failure(&out, &["CAP_BPF", "CAP_PERFMON", "sudo"], &dir);
    assert!(!std::path::Path::new("/tmp/ebtrace-never-written").exists());
}

#[test]
fn kernel_without_the_tracepoints() {
    if !require_root("kernel_without_the_tracepoints") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("err-tp");
    let me = std::process::id().to_string();
    let out = Command::new(ebtrace_bin())
        .env("EBTRACE_TRACEFS", dir.path().join("no-tracefs"))
        .args(["-p", &me, "-d", "1s", "--logdir", &logdir_arg(&dir)])
        .output()
        .expect("spawn ebtrace");
    assert_clean_failure(&out, &["tracepoint sched:sched_switch not found"], &dir);
}

#[test]
fn unwritable_logdir() {
    if !require_root("unwritable_logdir") {
        return;
    }
    let dir = TempDir::new("err-logdir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let me = std::process::id().to_string();
    let out = run_ebtrace(&["-p", &me, "-d", "1s", "--logdir", file.to_str().unwrap()]);
    assert_clean_failure(&out, &["cannot write traces under", "--logdir"], &dir);
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory");
}
