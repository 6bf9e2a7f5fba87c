//! The real profiler clients from PyPI against `ebtrace serve` watching an
//! unmodified fixture process: `python -m jax.collect_profile`, and the
//! function behind XProf's "Capture profile" button. Then XProf converts
//! what they wrote.

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    time::Duration,
};

use ebtrace_tests::{
    TempDir, fixture::SchedWorkload, require_root, serial, serve::ServeProcess, wait_with_deadline,
    xplane_files, xprof,
};

/// Runs a Python command with a deadline, stdout and stderr captured.
fn run_python(python: &Path, args: &[&str], deadline: Duration) -> Output {
    let child = Command::new(python)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    wait_with_deadline(child, deadline)
}

#[test]
fn jax_collect_profile_captures_an_unmodified_process() {
    if !require_root("jax_collect_profile_captures_an_unmodified_process") {
        return;
    }
    let Some(python) =
        xprof::python_with(&["jax.collect_profile", "xprof.convert.raw_to_tool_data"])
    else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let server = ServeProcess::loopback(&["--pid", &workload.pid.to_string()]);
    let logdir = TempDir::new("serve-jax");
    let port = server.port().to_string();
    let out = run_python(
        &python,
        &[
            "-m",
            "jax.collect_profile",
            &port,
            "1000",
            "--log_dir",
            logdir.path().to_str().unwrap(),
            "--no_perfetto_link",
        ],
        Duration::from_secs(120),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "jax.collect_profile failed: {stdout}\n{}\nserver: {:?}",
        String::from_utf8_lossy(&out.stderr),
        server.lines()
    );
    assert!(stdout.contains("Dumped profiling information"), "{stdout}");
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let file = &files[0];
    assert_eq!(
        file.file_name().unwrap().to_str().unwrap(),
        format!("127.0.0.1_{port}.xplane.pb")
    );
    let run = file.parent().unwrap();
    assert!(
        run.parent().unwrap().ends_with("plugins/profile"),
        "{file:?}"
    );
    // jax read the file back and converted it itself.
    assert!(run.join("remote.trace.json.gz").exists());
    xprof::assert_shows_sched_workload(&python, file, &workload);
    assert_eq!(server.count_lines("ebtrace: session "), 1);
}

#[test]
fn clients_succeed_against_a_server_allowed_to_write_elsewhere() {
    if !require_root("clients_succeed_against_a_server_allowed_to_write_elsewhere") {
        return;
    }
    let Some(python) = xprof::python_with(&[
        "jax.collect_profile",
        "xprof.convert._pywrap_profiler_plugin",
        "xprof.convert.raw_to_tool_data",
    ]) else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let scratch = TempDir::new("serve-elsewhere");
    let allowed = scratch.path().join("srv-xprof-logs");
    std::fs::create_dir_all(&allowed).unwrap();
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        "--allow-write-under",
        allowed.to_str().unwrap(),
    ]);
    let port = server.port().to_string();

    // jax.collect_profile, its log directory outside the allowed one.
    let mine = scratch.path().join("mine");
    let out = run_python(
        &python,
        &[
            "-m",
            "jax.collect_profile",
            &port,
            "1000",
            "--log_dir",
            mine.to_str().unwrap(),
            "--no_perfetto_link",
        ],
        Duration::from_secs(120),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "jax.collect_profile failed: {stdout}\n{}\nserver: {:?}",
        String::from_utf8_lossy(&out.stderr),
        server.lines()
    );
    let files = xplane_files(&mine);
    assert_eq!(files.len(), 1, "{files:?}");
    xprof::assert_shows_sched_workload(&python, &files[0], &workload);

    // XProf's capture button, likewise.
    let theirs = scratch.path().join("theirs");
    let out = run_python(
        &python,
        &[
            "-c",
            xprof::CAPTURE_BUTTON,
            &format!("localhost:{port}"),
            theirs.to_str().unwrap(),
            "2",
            "1",
        ],
        Duration::from_secs(120),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(r#""ok": true"#), "{stdout} {:?}", out);
    assert_eq!(xplane_files(&theirs).len(), 1);

    // One capture each (no retry), and the server wrote nothing itself.
    assert_eq!(server.count_lines("ebtrace: session "), 2);
    assert_eq!(
        server.count_lines("not saved on this server"),
        2,
        "{:?}",
        server.lines()
    );
    assert!(
        server
            .lines()
            .iter()
            .any(|l| l.contains(&format!("{:?}", mine.join("plugins/profile")))),
        "{:?}",
        server.lines()
    );
    assert_eq!(std::fs::read_dir(&allowed).unwrap().count(), 0);
}

#[test]
fn xprof_capture_button_captures_and_retries_on_empty_traces() {
    if !require_root("xprof_capture_button_captures_and_retries_on_empty_traces") {
        return;
    }
    let Some(python) = xprof::python_with(&[
        "xprof.convert._pywrap_profiler_plugin",
        "xprof.convert.raw_to_tool_data",
    ]) else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let server = ServeProcess::loopback(&["--pid", &workload.pid.to_string()]);
    let logdir = TempDir::new("serve-xprof");
    // The address as a person types it into the dialog.
    let addr = format!("localhost:{}", server.port());
    let capture = |host_level: &str, attempts: &str| -> serde_json::Value {
        let out = run_python(
            &python,
            &[
                "-c",
                xprof::CAPTURE_BUTTON,
                &addr,
                logdir.path().to_str().unwrap(),
                host_level,
                attempts,
            ],
            Duration::from_secs(120),
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(stdout.lines().last().unwrap_or(""))
            .unwrap_or_else(|e| panic!("bad output {stdout:?} ({e}): {:?}", out))
    };

    let result = capture("2", "1");
    assert_eq!(result["ok"], true, "{result}");
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        files[0].file_name().unwrap().to_str().unwrap(),
        format!("localhost_{}.xplane.pb", server.port())
    );
    xprof::assert_shows_sched_workload(&python, &files[0], &workload);

    // host_tracer_level 0: no probe runs, every answer is an empty trace,
    // and the client retries each of its attempts, then gives up with
    // TSL's own message, having written nothing.
    let result = capture("0", "3");
    assert_eq!(result["ok"], false, "{result}");
    let error = result["error"].as_str().unwrap();
    assert!(error.contains("No trace event was collected"), "{error}");
    assert_eq!(server.count_lines("empty trace"), 3, "{:?}", server.lines());
    assert_eq!(xplane_files(logdir.path()).len(), 1);
}
