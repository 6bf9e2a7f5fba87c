//! `ebtrace serve` asks who is calling before it serves a request: a user
//! other than root on this machine may capture and read only the processes
//! it could trace itself (its own uid, dumpable, not set-id), and control
//! nothing of the server; root gets everything. The other user is a real
//! process of uid 65534 (a client built with the tests, copied where that
//! user may run it), told apart by the kernel's socket table alone.

use std::{collections::BTreeSet, os::unix::fs::PermissionsExt as _, path::Path, process::Command};

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{
    callers::{Client, NOBODY, ProcessOfNobody},
    fixture::SchedWorkload,
    require_root, serial,
    serve::ServeProcess,
};

/// The thread ids of `pid`.
fn tids(pid: u32) -> BTreeSet<i64> {
    std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join("task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

fn thread_lines(space: &XSpace) -> BTreeSet<i64> {
    ebtrace_tests::xspace::plane(space, "/host:CPU")
        .lines
        .iter()
        .map(|l| l.id)
        .filter(|id| *id < 0xFFFF_0000)
        .collect()
}

#[test]
fn another_user_captures_only_its_own_processes_and_controls_nothing() {
    if !require_root("another_user_captures_only_its_own_processes_and_controls_nothing") {
        return;
    }
    let _serial = serial();
    let roots = SchedWorkload::start(&[]);
    let theirs = ProcessOfNobody::start();
    let watched = format!("{},{}", roots.pid, theirs.pid());
    let server = ServeProcess::loopback(&[
        "--pid",
        &watched,
        "--retain",
        "10s",
        "--http",
        "127.0.0.1:0",
    ]);
    let metrics = "http:/metrics";
    let client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));

    // Its own process: captured, and nothing of root's is in the trace.
    assert_eq!(client.ask(NOBODY, &server, "profile"), "OK");
    let lines = thread_lines(&client.trace());
    assert!(lines.contains(&i64::from(theirs.pid())), "{lines:?}");
    let root_tids = tids(roots.pid);
    assert!(
        lines.is_disjoint(&root_tids),
        "{lines:?} holds root's {root_tids:?}"
    );

    // Root's process, asked for by name: refused, saying by which rule.
    let refused = client.ask(NOBODY, &server, &format!("profile:{}", roots.pid));
    assert!(
        refused.starts_with(
            "PermissionDenied: uid 65534 may capture only processes it could trace itself"
        ),
        "{refused}"
    );
    assert!(
        refused.contains(&format!("pid {} runs as uid 0", roots.pid)),
        "{refused}"
    );
    // The flight recorder holds root's process: neither read nor stopped.
    for method in ["snapshot", "stop-recorder"] {
        let refused = client.ask(NOBODY, &server, method);
        assert!(
            refused.starts_with("PermissionDenied: uid 65534 may"),
            "{method}: {refused}"
        );
    }
    // Nor the metrics, which hold root's process.
    let http = server.http_addr();
    let refused = client.ask_at(NOBODY, &http.to_string(), metrics);
    assert!(
        refused.starts_with("403 uid 65534 may read only processes"),
        "{refused}"
    );
    // Root is served all of it, and the refusals were counted.
    assert_eq!(
        client.ask(0, &server, &format!("profile:{}", roots.pid)),
        "OK"
    );
    let lines = thread_lines(&client.trace());
    assert!(
        lines.is_superset(&root_tids),
        "{lines:?} lacks {root_tids:?}"
    );
    assert_eq!(client.ask(0, &server, "snapshot"), "OK");
    let text = ebtrace_tests::http::get(http, "/metrics").text();
    assert!(
        text.contains("\nebtrace_requests_refused_total 4\n"),
        "{text}"
    );
}

/// A server that watches only root's processes: the other user's capture is
/// refused outright.
#[test]
fn another_users_capture_of_roots_processes_is_refused() {
    if !require_root("another_users_capture_of_roots_processes_is_refused") {
        return;
    }
    let _serial = serial();
    let roots = SchedWorkload::start(&[]);
    let server = ServeProcess::loopback(&["--pid", &roots.pid.to_string()]);
    let client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let refused = client.ask(NOBODY, &server, "profile");
    assert_eq!(
        refused,
        "PermissionDenied: uid 65534 may capture only processes it could trace itself (its own \
         uid, dumpable, not set-id), and none of the watched processes is one"
    );
    assert!(!client.trace_path().exists());
    assert!(
        server
            .lines()
            .iter()
            .any(|l| l.contains("refused Profile from uid 65534")),
        "{:?}",
        server.lines()
    );
}

/// `--insecure-listen` lets a listener on every address start (without it
/// `serve` refuses at start: see `serve.rs`), with a warning at start and
/// a gauge on `/metrics`.
#[test]
fn an_insecure_listener_is_allowed_only_when_asked_and_says_so() {
    if !require_root("an_insecure_listener_is_allowed_only_when_asked_and_says_so") {
        return;
    }
    let _serial = serial();
    let me = std::process::id().to_string();
    let server = ServeProcess::start(
        &[
            "--bind",
            "0.0.0.0:0",
            "--insecure-listen",
            "--http",
            "127.0.0.1:0",
            "--pid",
            &me,
        ],
        1,
    );
    let warned = server.lines().iter().any(|l| {
        l.starts_with("ebtrace: warning: 0.0.0.0:")
            && l.contains("is not a loopback address (--insecure-listen)")
    });
    assert!(warned, "{:?}", server.lines());
    let text = ebtrace_tests::http::get(server.http_addr(), "/metrics").text();
    assert!(
        text.contains("\nebtrace_unauthenticated_listeners 1\n"),
        "{text}"
    );
}

/// `--bind unix:PATH`: any local user may connect to the socket, and each
/// is told apart by the kernel's credentials of the connection; a socket a
/// killed server left is taken over, a live server's never.
#[test]
fn a_unix_socket_tells_its_callers_apart() {
    if !require_root("a_unix_socket_tells_its_callers_apart") {
        return;
    }
    let _serial = serial();
    let roots = SchedWorkload::start(&[]);
    let theirs = ProcessOfNobody::start();
    let client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let path = client.dir.path().join("ebtrace.sock");
    let bind = format!("unix:{}", path.display());
    let watched = format!("{},{}", roots.pid, theirs.pid());
    let serve = || ServeProcess::start(&["--bind", &bind, "--pid", &watched], 1);
    let server = serve();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o666, "{mode:o}");

    assert_eq!(client.ask_at(NOBODY, &bind, "profile"), "OK");
    let lines = thread_lines(&client.trace());
    assert!(lines.contains(&i64::from(theirs.pid())), "{lines:?}");
    assert!(lines.is_disjoint(&tids(roots.pid)), "{lines:?}");
    let refused = client.ask_at(NOBODY, &bind, "stop-recorder");
    assert!(
        refused.starts_with("PermissionDenied: uid 65534 may not control"),
        "{refused}"
    );
    assert_eq!(
        client.ask_at(0, &bind, &format!("profile:{}", roots.pid)),
        "OK"
    );

    // A second server on the same socket is refused while the first lives.
    let second = Command::new(ebtrace_tests::ebtrace_bin())
        .args(["serve", "--bind", &bind, "--pid", &watched])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {bind}")),
        "{stderr}"
    );
    // Killed, the first leaves its socket: the next server takes it over.
    drop(server);
    assert!(path.exists());
    let _next = serve();
    assert_eq!(client.ask_at(NOBODY, &bind, "profile"), "OK");
}

/// `--socket-group`: the Unix socket is the group's (mode 0660), so only
/// root and its members may connect; an unknown group stops the server at
/// start with one line.
#[test]
fn a_socket_group_keeps_the_unix_socket_to_its_members() {
    use std::os::unix::fs::MetadataExt as _;
    if !require_root("a_socket_group_keeps_the_unix_socket_to_its_members") {
        return;
    }
    let _serial = serial();
    let client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let path = client.dir.path().join("group.sock");
    let bind = format!("unix:{}", path.display());
    let me = std::process::id().to_string();
    // `daemon` (gid 1) is in every Debian base system, and nobody is not
    // in it.
    let _server = ServeProcess::start(
        &["--bind", &bind, "--socket-group", "daemon", "--pid", &me],
        1,
    );
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!((meta.gid(), meta.mode() & 0o777), (1, 0o660));
    let connect_as = |groups: &str| {
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                &format!("--groups={groups}"),
            ])
            .args(["/usr/bin/python3", "-c"])
            .arg(format!(
                "import socket; socket.socket(socket.AF_UNIX).connect({:?})",
                path.display().to_string()
            ))
            .output()
            .unwrap()
    };
    let member = connect_as("1");
    assert!(
        member.status.success(),
        "{}",
        String::from_utf8_lossy(&member.stderr)
    );
    let stranger = connect_as("65534");
    assert!(
        String::from_utf8_lossy(&stranger.stderr).contains("PermissionError"),
        "{}",
        String::from_utf8_lossy(&stranger.stderr)
    );

    let unknown = Command::new(ebtrace_tests::ebtrace_bin())
        .args([
            "serve",
            "--bind",
            &bind,
            "--socket-group",
            "no-such-group-here",
        ])
        .args(["--pid", &me])
        .output()
        .unwrap();
    assert_eq!(unknown.status.code(), Some(2));
    let text = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.contains("groupadd --system no-such-group-here"),
        "{text}"
    );
}

/// A user may end its own captures with `Terminate`, never another's.
#[test]
fn a_user_terminates_its_own_capture_and_no_one_elses() {
    if !require_root("a_user_terminates_its_own_capture_and_no_one_elses") {
        return;
    }
    let _serial = serial();
    let roots = SchedWorkload::start(&[]);
    let theirs = ProcessOfNobody::start();
    let watched = format!("{},{}", roots.pid, theirs.pid());
    let server = ServeProcess::loopback(&["--pid", &watched]);
    let roots_client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let their_client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let addr = server.addrs[0].to_string();
    let started = std::time::Instant::now();
    let roots_capture = {
        let addr = addr.clone();
        std::thread::spawn(move || roots_client.ask_at(0, &addr, "session:roots"))
    };
    let their_capture = {
        let addr = addr.clone();
        std::thread::spawn(move || their_client.ask_at(NOBODY, &addr, "session:theirs"))
    };
    // Both captures under way.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let client = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let refused = client.ask_at(NOBODY, &addr, "terminate:roots");
    assert!(
        refused.starts_with("NotFound: no capture of uid 65534's with session_id \"roots\""),
        "{refused}"
    );
    assert_eq!(client.ask_at(NOBODY, &addr, "terminate:theirs"), "OK");
    assert_eq!(their_capture.join().unwrap(), "OK");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(8),
        "the capture was not ended early"
    );
    // Root's ran its whole 10 s.
    assert_eq!(roots_capture.join().unwrap(), "OK");
    assert!(started.elapsed() >= std::time::Duration::from_secs(10));
}
