//! Who ebtrace trusts as a target's agent, and who the agent trusts as
//! ebtrace: a listener posing as a program's preloaded agent is ignored; a
//! program (or a genuine agent in a hostile one) that floods its answers
//! loses its own part of the capture and no more; a preloaded agent serves
//! only a peer that proves it may read the program, ends a session nobody
//! stops, and never faults on wild kernel handles.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::net::{SocketAddr, UnixStream},
    path::Path,
    process::{Child, Command},
    time::Duration,
};

use ebtrace_tests::{
    TempDir, agent_threads, cuda, ebtrace_bin,
    hostile::{Target, start_system_python},
    python::{jax_python, start_jax},
    record, require_root, serial, signal, spawn_record, xplane_files,
    xspace::{self, line_events, plane},
};
use tracer_agent::protocol::{self, Header, Hello, SessionLevels, StartRequest};

/// The uid of `nobody`, an unprivileged user.
const NOBODY: u32 = 65534;

/// The agent library, written out for `LD_PRELOAD`.
fn agent_library(dir: &TempDir) -> String {
    let library = dir.path().join("libebtrace_agent.so");
    let out = Command::new(ebtrace_bin())
        .arg("agent-library")
        .arg(&library)
        .output()
        .expect("run ebtrace agent-library");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    library.to_str().unwrap().to_string()
}

/// A client of a preloaded agent, speaking its protocol as a peer would.
struct Peer {
    stream: UnixStream,
}

impl Peer {
    fn connect(pid: u32) -> (Peer, Hello) {
        use std::os::linux::net::SocketAddrExt as _;
        let mut name = [0u8; 64];
        let len = protocol::abstract_socket_name(pid, &mut name);
        let addr = SocketAddr::from_abstract_name(&name[..len]).unwrap();
        let stream = UnixStream::connect_addr(&addr).expect("the agent listens");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut peer = Peer { stream };
        let (kind, payload) = peer.receive().expect("a greeting");
        assert_eq!(kind, protocol::HELLO);
        (peer, Hello::decode(&payload).expect("a v2 greeting"))
    }

    /// Connects and proves, as ebtrace does, by reading the challenge out
    /// of the program's memory.
    fn proven(pid: u32) -> Peer {
        let (mut peer, hello) = Peer::connect(pid);
        assert_ne!(hello.challenge, 0, "a preloaded agent asks for a proof");
        let mut proof = [0u8; protocol::CHALLENGE_LEN];
        let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&mem, &mut proof, hello.challenge).unwrap();
        assert_eq!(peer.ask(protocol::PROVE, &proof).0, protocol::PROVEN);
        peer
    }

    fn send(&mut self, kind: u32, payload: &[u8]) -> std::io::Result<()> {
        let header = Header {
            kind,
            len: payload.len() as u32,
        };
        self.stream.write_all(&header.encode())?;
        self.stream.write_all(payload)
    }

    fn receive(&mut self) -> std::io::Result<(u32, Vec<u8>)> {
        let mut h = [0u8; protocol::HEADER_LEN];
        self.stream.read_exact(&mut h)?;
        let header = Header::decode(&h);
        let mut payload = vec![0; header.len as usize];
        self.stream.read_exact(&mut payload)?;
        Ok((header.kind, payload))
    }

    fn ask(&mut self, kind: u32, payload: &[u8]) -> (u32, Vec<u8>) {
        self.send(kind, payload).expect("send a request");
        self.receive().expect("an answer")
    }

    /// Whether the agent closed the connection (instead of answering).
    fn closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.stream.read(&mut byte) {
            Ok(n) => n == 0,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

#[test]
fn a_listener_posing_as_a_program_s_agent_is_ignored() {
    if !require_root("a_listener_posing_as_a_program_s_agent_is_ignored") {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let workload = start_jax(&python, &[]);
    let pid = workload.pid;
    // Any user can bind an abstract socket name: nobody takes the one
    // ebtrace looks for, before ebtrace comes.
    let impostor = Target::fake_agent(NOBODY, &["impostor", &pid.to_string()]);
    let impostor_pid = impostor.pid;

    let logs = TempDir::new("agent-impostor");
    let out = record(&pid.to_string(), "2s", &logs, &["--traceme", "agent"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "@ebtrace-agent.{pid} is held by pid {impostor_pid} (uid {NOBODY}), not the \
             program itself: ignored, ebtrace's agent is loaded instead"
        )),
        "{stderr}"
    );
    // The real session, through an agent loaded now; nothing the impostor
    // would have answered.
    assert!(
        stderr.contains("ProfilerSession (agent loaded in"),
        "{stderr}"
    );
    assert!(!stderr.contains("impostor"), "{stderr}");
    let space = xspace::load(&xplane_files(logs.path())[0]);
    assert!(space.planes.iter().all(|p| p.name != "/host:impostor"));
    let steps = line_events(plane(&space, "/host:CPU"), pid.into())
        .iter()
        .filter(|e| e.name == "ebtrace_step")
        .count();
    assert!(steps >= 50, "{steps} steps");
}

/// How a finished child ended, what it printed (stdout, then stderr) and
/// its peak resident memory, from the kernel's rusage.
fn wait_with_peak_rss(mut child: Child) -> (std::process::ExitStatus, String, u64) {
    let pid = child.id() as i32;
    let mut printed = String::new();
    let stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let mut stderr = stderr;
        stderr.read_to_string(&mut text).unwrap();
        text
    });
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut printed)
        .unwrap();
    printed.push_str(&errors.join().unwrap());
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid out buffer.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, with valid out pointers.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(rc, pid);
    use std::os::unix::process::ExitStatusExt as _;
    (
        std::process::ExitStatus::from_raw(status),
        printed,
        usage.ru_maxrss as u64 * 1024,
    )
}

/// What a capture of a program posing as its own agent left behind.
struct HostileAnswer {
    pid: u32,
    printed: String,
    /// ebtrace's peak resident memory, in bytes.
    peak: u64,
    space: ebtrace_proto::tensorflow::profiler::XSpace,
    program: Target,
}

/// Records, for `duration`, a program that loaded the stand-in driver and
/// listens as its own agent (so it passes every check of who it is), then
/// answers as `fake_agent.py`'s `mode` says. Checks what every such capture
/// must keep: ebtrace succeeds, the program's own threads are written, and
/// the program lives on.
fn record_hostile_answer(mode: &str, duration: &str) -> HostileAnswer {
    let (lib_dir, _) = cuda::build();
    let libcuda = lib_dir.join("libcuda.so.1");
    let mut program = Target::fake_agent(0, &[mode, libcuda.to_str().unwrap()]);
    let pid = program.pid;
    let logs = TempDir::new(&format!("agent-{mode}"));
    let child = spawn_record(&pid.to_string(), duration, &logs, &[]);
    let (status, printed, peak) = wait_with_peak_rss(child);
    assert!(status.success(), "{printed}");
    let space = xspace::load(&xplane_files(logs.path())[0]);
    let host = plane(&space, "/host:CPU");
    assert!(
        host.lines.iter().any(|l| l.id == i64::from(pid)),
        "no line for pid {pid}"
    );
    assert!(program.alive(), "the program lives on");
    HostileAnswer {
        pid,
        printed,
        peak,
        space,
        program,
    }
}

#[test]
fn a_program_flooding_its_answers_loses_its_own_part_and_no_more() {
    if !require_root("a_program_flooding_its_answers_loses_its_own_part_and_no_more") {
        return;
    }
    let _serial = serial();
    // It answers the request for its GPU activity with 32 MiB frames that
    // never end.
    let answer = record_hostile_answer("flood", "3s");
    let line = format!(
        "the agent in pid {} sent more than 256 MiB in answer to COLLECT: what it sent is \
         dropped and its part of the capture ends here",
        answer.pid
    );
    assert!(answer.printed.contains(&line), "{}", answer.printed);
    // What ebtrace held never passed the answer's bound by much.
    assert!(
        answer.peak < (256 << 20) + (384 << 20),
        "ebtrace's resident memory peaked at {} MiB",
        answer.peak >> 20
    );
    drop(answer.program);
}

#[test]
fn a_program_sending_a_plane_of_empty_events_loses_that_plane_and_no_more() {
    if !require_root("a_program_sending_a_plane_of_empty_events_loses_that_plane_and_no_more") {
        return;
    }
    let _serial = serial();
    // It answers the capture with one 100 MiB plane of empty events, two
    // bytes each: decoded whole, they would take over 2.5 GiB.
    let answer = record_hostile_answer("plane", "2s");
    let events = (100u64 << 20) / 2;
    let line = format!(
        "pid {}: {events} events of the framework's session left out: decoded, they would \
         take more than the 512 MiB a capture keeps of its frameworks' sessions",
        answer.pid
    );
    assert!(answer.printed.contains(&line), "{}", answer.printed);
    assert!(
        answer
            .space
            .planes
            .iter()
            .all(|p| p.name != "/device:flood")
    );
    // The plane's bytes were held, never what they decode into.
    assert!(
        answer.peak < (100 << 20) + (384 << 20),
        "ebtrace's resident memory peaked at {} MiB",
        answer.peak >> 20
    );
}

/// A program that loads the stand-in CUDA driver and idles, started with
/// the agent preloaded.
fn start_preloaded_driver_program(preload: &str, libcuda: &Path) -> Target {
    let source = format!(
        "import ctypes, json, os, time\n\
         ctypes.CDLL({libcuda:?})\n\
         print(json.dumps({{'pid': os.getpid()}}), flush=True)\n\
         while True: time.sleep(0.05)\n"
    );
    let mut python = Command::new("/usr/bin/python3");
    python
        .arg("-c")
        .arg(source)
        .env("LD_PRELOAD", preload)
        .env("EBTRACE_AGENT", "listen");
    start_system_python(python)
}

#[test]
fn a_preloaded_agent_serves_only_a_peer_that_proves_it_may_read_the_program() {
    if !require_root("a_preloaded_agent_serves_only_a_peer_that_proves_it_may_read_the_program") {
        return;
    }
    let _serial = serial();
    let (lib_dir, _) = cuda::build();
    let dir = TempDir::new("agent-proof");
    let preload = agent_library(&dir);
    let mut program = start_preloaded_driver_program(&preload, &lib_dir.join("libcuda.so.1"));
    let pid = program.pid;
    assert_eq!(agent_threads(pid), 1, "the agent listens");

    // A request before any proof: the agent hangs up, answering nothing.
    // (The agent may hang up before the payload is sent.)
    let (mut peer, _) = Peer::connect(pid);
    let _ = peer.send(protocol::NAME_KERNELS, &1u64.to_le_bytes());
    assert!(peer.closed(), "served a peer that did not prove itself");
    // A wrong proof: the same.
    let (mut peer, _) = Peer::connect(pid);
    let _ = peer.send(protocol::PROVE, &[0x5a; protocol::CHALLENGE_LEN]);
    assert!(peer.closed(), "served a peer with a wrong proof");
    // A proof never sent: the agent gives up, and serves the next peer.
    let (mut silent, _) = Peer::connect(pid);
    let waited = std::time::Instant::now();
    assert!(silent.closed());
    assert!(
        waited.elapsed() < Duration::from_secs(10),
        "{:?}",
        waited.elapsed()
    );

    // Wild kernel handles, from a proven peer: none reaches the driver
    // where it would fault, and the program lives on.
    let mut peer = Peer::proven(pid);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let heap = maps
        .lines()
        .find(|l| l.ends_with("[heap]"))
        .and_then(|l| u64::from_str_radix(l.split('-').next()?, 16).ok())
        .expect("a heap");
    let handles = [1u64, 0xdead_0000_0000, u64::MAX - 7, heap, 0x7fff_ffff_f000];
    let request: Vec<u8> = handles.iter().flat_map(|h| h.to_le_bytes()).collect();
    let (kind, answer) = peer.ask(protocol::NAME_KERNELS, &request);
    assert_eq!(
        kind,
        protocol::KERNEL_NAMES,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    for (i, h) in handles.iter().enumerate() {
        let len = u32::from_le_bytes(answer[4 * i..4 * i + 4].try_into().unwrap());
        if *h != heap {
            assert_eq!(len, 0, "a name for wild handle {h:#x}");
        }
    }
    assert_eq!(peer.ask(protocol::PING, &[]).0, protocol::PONG);
    assert!(program.alive(), "the program died");
}

#[test]
fn a_session_nobody_stops_ends_when_its_lease_runs_out() {
    if !require_root("a_session_nobody_stops_ends_when_its_lease_runs_out") {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let dir = TempDir::new("agent-lease");
    let preload = agent_library(&dir);
    let workload = start_jax(
        &python,
        &[("LD_PRELOAD", &preload), ("EBTRACE_AGENT", "listen")],
    );
    let pid = workload.pid;
    let start = StartRequest {
        levels: SessionLevels {
            host: 2,
            python: 0,
            device: 0,
            ops: 0,
            op_fields: 0,
        },
        lease_ms: 1_500,
    };
    // A peer starts jax's session, then says nothing past the lease.
    let mut peer = Peer::proven(pid);
    let (kind, why) = peer.ask(protocol::START, &start.encode());
    assert_eq!(kind, protocol::STARTED, "{}", String::from_utf8_lossy(&why));
    std::thread::sleep(Duration::from_secs(3));
    let (kind, why) = peer.ask(protocol::STOP, &[]);
    assert_eq!(kind, protocol::FAILED);
    assert!(
        String::from_utf8_lossy(&why).contains("no word from ebtrace for the session's lease"),
        "{}",
        String::from_utf8_lossy(&why)
    );
    // jax's own profiler is free again: a new session starts (jax allows
    // one at a time) and records the program's steps.
    let (kind, why) = peer.ask(protocol::START, &start.encode());
    assert_eq!(kind, protocol::STARTED, "{}", String::from_utf8_lossy(&why));
    // A peer that speaks within the lease keeps its session.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(peer.ask(protocol::PING, &[]).0, protocol::PONG);
    }
    peer.send(protocol::STOP, &[]).unwrap();
    let mut xspaces = 0;
    loop {
        match peer.receive().expect("the stop's answer") {
            (protocol::XSPACE, _) => xspaces += 1,
            (protocol::STOPPED, _) => break,
            (kind, p) => panic!("frame {kind}: {}", String::from_utf8_lossy(&p)),
        }
    }
    assert_eq!(xspaces, 1);
    drop(peer);
    signal(pid, libc::SIGTERM);
}

/// A program that exits (Python finalizing) while the agent's session runs
/// in it: it exits as it would untraced, promptly and with its own status,
/// and ebtrace writes what it recorded.
#[test]
fn a_program_exiting_during_a_capture_exits_as_it_would() {
    if !require_root("a_program_exiting_during_a_capture_exits_as_it_would") {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let mut workload = start_jax(&python, &[]);
    let pid = workload.pid;
    let logs = TempDir::new("agent-exiting");
    let mut capture = spawn_record(&pid.to_string(), "20s", &logs, &["--traceme", "agent"]);
    let mut stderr = BufReader::new(capture.stderr.take().unwrap());
    let mut seen = Vec::new();
    for line in stderr.by_ref().lines().map_while(Result::ok) {
        let started = line.contains("TraceMe through ebtrace's agent");
        seen.push(line);
        if started {
            break;
        }
    }
    assert!(
        seen.iter().any(|l| l.contains("ProfilerSession")),
        "{seen:?}"
    );
    let rest = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    std::thread::sleep(Duration::from_millis(500));
    // Its SIGTERM handler ends its loop: Python finalizes and exits 0.
    signal(pid, libc::SIGTERM);
    let status = workload.wait_exit(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "the program did not exit cleanly: {status:?}"
    );
    let out = ebtrace_tests::wait_with_deadline(capture, Duration::from_secs(60));
    let rest = rest.join().unwrap();
    assert!(out.status.success(), "{seen:?}\n{rest}");
    assert_eq!(xplane_files(logs.path()).len(), 1, "{rest}");
}
