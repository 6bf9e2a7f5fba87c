//! The loader against targets under seccomp filters: an allowlist whose
//! default fails every other call with `EPERM`, as the default profiles of
//! podman, Docker and containerd (Kubernetes' `RuntimeDefault`) are
//! written, or kills the process, as systemd's `SystemCallFilter=` does;
//! and a filter that kills for one call the load needs. The target's own
//! counters (`tests/fixtures/inject_target.c`) say whether any of its calls
//! failed or any result it computed changed. And the same program in a
//! real container, under podman's own default profile.

use std::time::{Duration, Instant};

use ebtrace_tests::{
    fixture,
    inject::{Library, Target, agent_traces, inject_check, inject_check_once},
    podman::{BASE, ensure_base, host_limits, podman, run, tools_present},
    require_root, serial,
};

/// A container running the fixture; removed when dropped.
struct Container {
    name: String,
}

impl Container {
    /// Runs `inject_target args` in a container of the base image, under
    /// the runtime's default seccomp profile; returns it with the
    /// fixture's pid on this host and its start line.
    fn start(name: &str, args: &[&str]) -> (Self, u32, String) {
        let _ = podman().args(["rm", "-f", name]).output();
        let fixture = fixture::build_c("inject_target");
        let dir = fixture.parent().expect("target/fixtures");
        run(podman()
            .args(["run", "-d", "--name", name])
            .args(host_limits())
            .args(["-v", &format!("{}:/fixture:ro", dir.display())])
            .arg(BASE)
            .arg("/fixture/inject_target")
            .args(args));
        let container = Container { name: name.into() };
        let began = Instant::now();
        let line = loop {
            let out = run(podman().args(["logs", name]));
            let logs = String::from_utf8_lossy(&out.stdout).into_owned();
            if let Some(line) = logs.lines().next() {
                break line.to_string();
            }
            assert!(began.elapsed() < Duration::from_secs(30), "no start line");
            std::thread::sleep(Duration::from_millis(50));
        };
        let out = run(podman().args(["inspect", "-f", "{{.State.Pid}}", name]));
        let pid = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("the container's pid");
        (container, pid, line)
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
    let (container, pid, line) = Container::start("ebtrace-test-inject", &["sleep-and-spin"]);
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
