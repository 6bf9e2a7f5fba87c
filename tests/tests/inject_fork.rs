//! A target that forks while ebtrace's agent runs in it, as a PyTorch
//! `DataLoader` starts its workers or a pool grows
//! (`tests/fixtures/python/fork_on_signal.py`). The child must not keep
//! the agent, its memfd or its socket once the capture is over, must be
//! loadable itself, and loading into it must not end the parent's live
//! session (whose socket it shares).

use std::time::Duration;

use ebtrace_tests::{
    TempDir,
    inject::{Library, agent_traces, inject_check, wait_for_agent},
    pyenv::{cpython, python_fixture},
    python::PythonWorkload,
    require_root, serial, signal, spawn_ebtrace, spawn_record, wait_with_deadline, xprof,
};

/// The target's descriptors that are sockets: the fixture opens none.
fn sockets(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.starts_with("socket:"))
        .collect()
}

/// Starts the fixture and an `inject-check` that keeps the agent loaded
/// in it for `hold`; returns both once the agent is loaded.
fn loaded_for(hold: &str) -> (PythonWorkload, std::process::Child) {
    let parent =
        PythonWorkload::start_script(&cpython(12), &python_fixture("fork_on_signal.py"), &[], &[]);
    let pid = parent.pid.to_string();
    let first = spawn_ebtrace(&["inject-check", "--pid", &pid, "--hold", hold]);
    wait_for_agent(parent.pid, Duration::from_secs(20));
    (parent, first)
}

/// Asks the fixture for a child; its pid.
fn fork_child(parent: &mut PythonWorkload) -> u32 {
    parent.signal(libc::SIGUSR1);
    parent.next_line()["child"].as_u64().expect("a child's pid") as u32
}

fn assert_finished(first: std::process::Child) {
    let out = wait_with_deadline(first, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "the parent's cycle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A child forked mid-capture holds nothing of the agent once the capture
/// ends, and can be loaded into and unloaded again.
#[test]
fn a_child_forked_mid_capture_is_left_clean() {
    if !require_root("a_child_forked_mid_capture_is_left_clean") {
        return;
    }
    let _serial = serial();
    let (mut parent, first) = loaded_for("2s");
    let child = fork_child(&mut parent);
    assert!(!agent_traces(child).is_empty(), "the child holds no copy");
    assert_finished(first);
    assert!(agent_traces(parent.pid).is_empty());
    assert!(
        agent_traces(child).is_empty(),
        "the child kept the agent: {:?}",
        agent_traces(child)
    );
    assert!(sockets(child).is_empty(), "{:?}", sockets(child));
    inject_check(child, 2, Library::Agent);
    assert!(agent_traces(child).is_empty());
}

/// Loading into a child while the parent's session runs leaves the
/// parent's session working: the child's copy of their shared socket is
/// closed, never shut down.
#[test]
fn loading_into_a_child_leaves_the_parents_session_alone() {
    if !require_root("loading_into_a_child_leaves_the_parents_session_alone") {
        return;
    }
    let _serial = serial();
    let (mut parent, first) = loaded_for("4s");
    let child = fork_child(&mut parent);
    inject_check(child, 1, Library::Agent);
    assert_finished(first);
    assert!(agent_traces(parent.pid).is_empty());
    assert!(agent_traces(child).is_empty(), "{:?}", agent_traces(child));
}

/// Starts the PyTorch fixture `script` and `ebtrace --pid` on it for
/// `duration`; returns both (and the capture's directory) once the agent
/// is loaded and has had time to register its callbacks.
fn recording_ops(
    python: &std::path::Path,
    script: &str,
    duration: &str,
) -> (PythonWorkload, std::process::Child, TempDir) {
    let parent = PythonWorkload::start_script(python, &python_fixture(script), &[], &[]);
    let logdir = TempDir::new("fork-torch");
    let capture = spawn_record(&parent.pid.to_string(), duration, &logdir, &[]);
    wait_for_agent(parent.pid, Duration::from_secs(30));
    // The agent registers the callbacks once loaded.
    std::thread::sleep(Duration::from_millis(500));
    (parent, capture, logdir)
}

/// The capture ended well and recorded PyTorch's ops.
fn assert_recorded_ops(capture: std::process::Child) {
    let out = wait_with_deadline(capture, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("PyTorch ops through RecordFunction callbacks"),
        "{stderr}"
    );
}

/// A PyTorch worker forked while ebtrace records its parent's ops (as a
/// `DataLoader` starts its workers): once the capture is over the worker
/// has no RecordFunction callback left, as PyTorch's own
/// `at::hasCallbacks()` says, so its ops cost what they cost untraced; and
/// nothing of the agent.
#[test]
fn a_pytorch_worker_forked_mid_capture_keeps_no_callback() {
    if !require_root("a_pytorch_worker_forked_mid_capture_keeps_no_callback") {
        return;
    }
    let Some(python) = xprof::python_with(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let (mut parent, capture, _logdir) = recording_ops(&python, "torch_fork_loop.py", "3s");
    let child = fork_child(&mut parent);
    assert_recorded_ops(capture);
    signal(child, libc::SIGUSR2);
    let report = parent.next_line();
    assert_eq!(report["pid"].as_u64(), Some(u64::from(child)), "{report}");
    assert_eq!(
        report["has_callbacks"], false,
        "the worker kept the callbacks: {report}"
    );
    assert!(agent_traces(child).is_empty(), "{:?}", agent_traces(child));
}

/// A `DataLoader(num_workers=2)` started mid-capture (its workers forked,
/// and kept): once the capture is over, each worker, asked from inside,
/// has no RecordFunction callback registered, holds nothing of the agent,
/// and can be loaded into and unloaded again.
#[test]
fn dataloader_workers_started_mid_capture_keep_nothing_of_it() {
    if !require_root("dataloader_workers_started_mid_capture_keep_nothing_of_it") {
        return;
    }
    let Some(python) = xprof::python_with(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let (mut parent, capture, _logdir) = recording_ops(&python, "torch_dataloader.py", "4s");
    parent.signal(libc::SIGUSR1);
    let workers: Vec<u32> = parent.next_line()["workers"]
        .as_array()
        .expect("the workers")
        .iter()
        .map(|w| w.as_u64().expect("a pid") as u32)
        .collect();
    assert_eq!(workers.len(), 2, "{workers:?}");
    assert_recorded_ops(capture);
    parent.signal(libc::SIGUSR2);
    let items = parent.next_line();
    for item in items["items"].as_array().expect("the items") {
        assert_eq!(item[1], 0, "a worker kept the callbacks: {items}");
    }
    for worker in workers {
        assert!(
            agent_traces(worker).is_empty(),
            "{:?}",
            agent_traces(worker)
        );
        inject_check(worker, 1, Library::Agent);
        assert!(agent_traces(worker).is_empty());
    }
}
