//! `ebtrace serve` asks who is calling before it serves a request: a user
//! other than root on this machine may capture and read only the processes
//! it could trace itself (its own uid, dumpable, not set-id), and control
//! nothing of the server; root gets everything. The other user is a real
//! process of uid 65534 (a client built with the tests, copied where that
//! user may run it), told apart by the kernel's socket table alone.

use std::{
    collections::BTreeSet,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command},
};

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{TempDir, fixture::SchedWorkload, require_root, serial, serve::ServeProcess};
use prost::Message as _;

const NOBODY: u32 = 65534;

/// The client, where uid 65534 may run it and write next to it.
struct Client {
    dir: TempDir,
    bin: PathBuf,
}

impl Client {
    fn new() -> Self {
        let dir = TempDir::new("callers");
        let bin = dir.path().join("profiler_client");
        std::fs::copy(env!("CARGO_BIN_EXE_profiler_client"), &bin).expect("copy the client");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        Client { dir, bin }
    }

    /// The client's one line for `method` asked of `server` as `uid`.
    fn ask(&self, uid: u32, server: &ServeProcess, method: &str) -> String {
        self.ask_at(uid, &server.addrs[0].to_string(), method)
    }

    /// The same, of the listener at `addr` (`HOST:PORT` or `unix:PATH`).
    fn ask_at(&self, uid: u32, addr: &str, method: &str) -> String {
        let out = self.trace_path();
        let _ = std::fs::remove_file(&out);
        let output = Command::new(&self.bin)
            .args([addr, method, out.to_str().unwrap()])
            .uid(uid)
            .gid(uid)
            .output()
            .expect("run the client");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    fn trace_path(&self) -> PathBuf {
        self.dir.path().join("trace.xplane.pb")
    }

    fn trace(&self) -> XSpace {
        XSpace::decode(std::fs::read(self.trace_path()).unwrap().as_slice()).unwrap()
    }
}

/// A process of uid 65534 that wakes 200 times a second, killed when
/// dropped.
struct ProcessOfNobody(Child);

impl ProcessOfNobody {
    fn start() -> Self {
        let child = Command::new("python3")
            .args(["-c", "import time\nwhile True: time.sleep(0.005)"])
            .current_dir("/")
            .uid(NOBODY)
            .gid(NOBODY)
            .spawn()
            .expect("start python3 as uid 65534");
        ProcessOfNobody(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for ProcessOfNobody {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

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
    let client = Client::new();

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
    let client = Client::new();
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
    let client = Client::new();
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
