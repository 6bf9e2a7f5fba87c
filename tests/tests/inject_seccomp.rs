//! The loader against targets under seccomp filters: an allowlist whose
//! default fails every other call with `EPERM`, as the default profiles of
//! podman, Docker and containerd (Kubernetes' `RuntimeDefault`) are
//! written, or kills the process, as systemd's `SystemCallFilter=` does;
//! and a filter that kills for one call the load needs. The target's own
//! counters (`tests/fixtures/inject_target.c`) say whether any of its calls
//! failed or any result it computed changed. And the same program in a
//! real container, under podman's own default profile.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use ebtrace_tests::{
    fixture,
    inject::{Library, Target, agent_traces, inject_check, inject_check_once},
    podman::{BASE, ensure_base, host_limits, podman, run, tools_present},
    pyenv::{pyenv_root, python_fixture},
    record, require_root, serial,
    serve::ServeProcess,
    torch::op_lines,
    workspace_root, xplane_files, xprof,
    xspace::{self, line_events, plane},
};

/// A container running the fixture; removed when dropped.
struct Container {
    name: String,
}

impl Container {
    /// Runs `command` in a container of the base image, under the
    /// runtime's default seccomp profile, with the host's directories
    /// `read_only` mounted at the same paths; returns it with the
    /// command's pid on this host and its start line.
    fn start(name: &str, read_only: &[&Path], command: &[&str]) -> (Self, u32, String) {
        let _ = podman().args(["rm", "-f", name]).output();
        let mut cmd = podman();
        cmd.args(["run", "-d", "--name", name]).args(host_limits());
        for dir in read_only {
            cmd.args(["-v", &format!("{0}:{0}:ro", dir.display())]);
        }
        run(cmd.arg(BASE).args(command));
        let container = Container { name: name.into() };
        let line = container.line(0);
        let out = run(podman().args(["inspect", "-f", "{{.State.Pid}}", name]));
        let pid = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("the container's pid");
        (container, pid, line)
    }

    /// Line `n` (from 0) of what the command printed, waiting for it.
    fn line(&self, n: usize) -> String {
        let began = Instant::now();
        loop {
            let out = run(podman().args(["logs", &self.name]));
            if let Some(line) = String::from_utf8_lossy(&out.stdout).lines().nth(n) {
                return line.to_string();
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "no line {n} from {}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman().args(["rm", "-f", "-t", "0", &self.name]).output();
    }
}

/// In a podman container under podman's default profile (default action
/// `ERRNO(ENOSYS)`), 20 loads and unloads of ebtrace's agent from the host
/// in a row: no sleep of the program fails, no result it computes changes,
/// and it keeps running with nothing of the agent left.
#[test]
fn a_program_in_a_container_is_unharmed_through_the_loads() {
    if !require_root("a_program_in_a_container_is_unharmed_through_the_loads") {
        return;
    }
    if !tools_present() {
        return;
    }
    let _serial = serial();
    ensure_base();
    let fixture = fixture::build_c("inject_target");
    let dir = fixture.parent().expect("target/fixtures");
    let (container, pid, line) = Container::start(
        "ebtrace-test-inject",
        &[dir],
        &[fixture.to_str().expect("UTF-8"), "sleep-and-spin"],
    );
    let target = Target::started_elsewhere(pid, &line);
    assert_eq!(target.status("Seccomp"), "2", "no profile applied");
    inject_check(pid, 20, Library::Agent);
    target.wait_progress(3);
    assert_eq!(
        target.errors(),
        0,
        "a sleep failed or a checksum came out wrong"
    );
    assert_eq!(target.status("TracerPid"), "0");
    assert!(agent_traces(pid).is_empty(), "{:?}", agent_traces(pid));
    drop(container);
}

/// Ten load/unload cycles of the loader's probe and of ebtrace's agent,
/// under an allowlist with each default action: the filter never sees a
/// call ebtrace made up (a skipped syscall is number -1, on no list), so
/// no sleep of the program fails, no register of it changes, and it lives.
#[test]
fn an_allowlist_filter_leaves_the_program_unharmed_through_the_loads() {
    if !require_root("an_allowlist_filter_leaves_the_program_unharmed_through_the_loads") {
        return;
    }
    let _serial = serial();
    for action in ["errno", "kill"] {
        for library in [Library::Probe, Library::Agent] {
            let target = Target::start_with_args(&["allowlist", action], &[]);
            assert_eq!(
                target.status("Seccomp"),
                "2",
                "{action}: no filter installed"
            );
            inject_check(target.pid, 10, library);
            target.wait_progress(3);
            assert_eq!(
                target.errors(),
                0,
                "{action}, {library:?}: a sleep failed or a checksum came out wrong"
            );
            assert_eq!(target.status("TracerPid"), "0", "{action}, {library:?}");
            assert!(
                agent_traces(target.pid).is_empty(),
                "{action}, {library:?}: {:?}",
                agent_traces(target.pid)
            );
        }
    }
}

/// An allowlist without `memfd_create`, failing it with `EPERM`: the
/// load would fail half-way in the program, so it is refused with one
/// line before any call is made, and the program goes on.
#[test]
fn an_allowlist_without_a_call_the_load_needs_refuses_the_load() {
    if !require_root("an_allowlist_without_a_call_the_load_needs_refuses_the_load") {
        return;
    }
    let _serial = serial();
    let target = Target::start_with_args(&["allowlist", "errno", "no-memfd"], &[]);
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "pid {} runs under a seccomp filter that fails the memfd_create() call",
            target.pid
        )),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    target.wait_progress(3);
    assert_eq!(target.errors(), 0);
    assert_eq!(target.status("TracerPid"), "0");
}

/// A program under a seccomp filter that kills it for `memfd_create`, as a
/// sandbox might: the load is refused with one line before any call is
/// made, and the program goes on.
#[test]
fn a_seccomp_filter_that_would_kill_the_program_refuses_the_load() {
    if !require_root("a_seccomp_filter_that_would_kill_the_program_refuses_the_load") {
        return;
    }
    let _serial = serial();
    let target = Target::start("seccomp");
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "pid {} runs under a seccomp filter that would kill it (or stop it) for the \
             memfd_create() call",
            target.pid
        )),
        "{stderr}"
    );
    target.wait_progress(5);
    assert_eq!(target.errors(), 0);
    assert_eq!(target.status("TracerPid"), "0");
}

/// A PyTorch program in a podman container under podman's default
/// profile, recorded from the host 20 times in a row with `ebtrace --pid`
/// (each capture loads the agent for PyTorch's ops and takes it out): the
/// program's own counts show no failed sleep and no wrong sum, it keeps
/// running, and each capture recorded its ops, on the line of the thread
/// that ran them (the agent names threads by their ids in the container's
/// pid namespace).
#[test]
fn a_pytorch_program_in_a_container_is_unharmed_through_20_captures() {
    if !require_root("a_pytorch_program_in_a_container_is_unharmed_through_20_captures") {
        return;
    }
    if !tools_present() {
        return;
    }
    let _serial = serial();
    ensure_base();
    let venv = workspace_root().join(".venv");
    let script = python_fixture("torch_checked_loop.py");
    let python = venv.join("bin/python");
    let (container, pid, _) = Container::start(
        "ebtrace-test-torch",
        &[&venv, &pyenv_root(), script.parent().expect("the fixtures")],
        &[
            python.to_str().expect("UTF-8"),
            script.to_str().expect("UTF-8"),
        ],
    );
    for capture in 0..20 {
        let logdir = ebtrace_tests::TempDir::new("container-torch");
        let out = record(&pid.to_string(), "1s", &logdir, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "capture {capture}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "pid {pid}: PyTorch ops through RecordFunction callbacks"
            )),
            "capture {capture}: {stderr}"
        );
        let lines = op_lines(&logdir);
        let on_main = lines.get(&i64::from(pid)).map_or(0, Vec::len);
        assert!(
            on_main > 100,
            "capture {capture}: {on_main} ops on the main thread's line, of {:?}",
            lines
                .iter()
                .map(|(l, ops)| (l, ops.len()))
                .collect::<Vec<_>>()
        );
    }
    ebtrace_tests::signal(pid, libc::SIGUSR1);
    let counts: serde_json::Value =
        serde_json::from_str(&container.line(1)).expect("the counts' line");
    assert!(counts["steps"].as_u64() > Some(1000), "{counts}");
    assert_eq!(counts["wrong"], 0, "a sum came out wrong: {counts}");
    assert_eq!(counts["failed"], 0, "a sleep failed: {counts}");
    assert!(agent_traces(pid).is_empty(), "{:?}", agent_traces(pid));
}

/// A jax program in a podman container under podman's default profile,
/// captured 20 times in a row through `ebtrace serve` by jax's own client
/// (`jax.collect_profile`), each capture loading the agent for jax's
/// TraceMe session: every capture holds the program's steps on its main
/// thread's line, and the program runs on.
#[test]
fn a_jax_program_in_a_container_is_captured_20_times_through_serve() {
    if !require_root("a_jax_program_in_a_container_is_captured_20_times_through_serve") {
        return;
    }
    if !tools_present() {
        return;
    }
    let Some(python) = xprof::python_with(&["jax", "jax.collect_profile"]) else {
        return;
    };
    let _serial = serial();
    ensure_base();
    let venv = workspace_root().join(".venv");
    let script = workspace_root().join("tests/fixtures/traceme/jax_workload.py");
    let (container, pid, _) = Container::start(
        "ebtrace-test-jax",
        &[&venv, &pyenv_root(), script.parent().expect("the fixtures")],
        &[
            venv.join("bin/python").to_str().expect("UTF-8"),
            script.to_str().expect("UTF-8"),
        ],
    );
    let server = ServeProcess::loopback(&["--pid", &pid.to_string()]);
    let port = server.port().to_string();
    for capture in 0..20 {
        let logdir = ebtrace_tests::TempDir::new("container-jax");
        let out = xprof::collect_profile(&python, &port, 500, logdir.path());
        assert!(
            out.status.success(),
            "capture {capture}: {}\nserver: {:?}",
            String::from_utf8_lossy(&out.stderr),
            server.lines()
        );
        let files = xplane_files(logdir.path());
        assert_eq!(files.len(), 1, "capture {capture}: {files:?}");
        let space = xspace::load(&files[0]);
        let main = line_events(plane(&space, "/host:CPU"), pid.into());
        let steps = main.iter().filter(|e| e.name == "ebtrace_step").count();
        assert!(
            steps >= 5,
            "capture {capture}: {steps} steps on the main thread's line"
        );
    }
    assert!(
        container.line(0).contains("\"pid\""),
        "the program's start line"
    );
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the program ended"
    );
}
