//! Helpers for ebtrace's integration tests.
//!
//! The tests run the real `ebtrace` binary against real fixture processes
//! and decode the XSpace it writes. Tests that need root (every test that
//! loads BPF) call [`require_root`]: without root they print why and pass,
//! unless `EBTRACE_REQUIRE_BPF=1` (set by `cargo xtask test`), where a skip
//! is a failure.

pub mod callers;
pub mod cuda;
pub mod deploy;
pub mod fixture;
pub mod gated;
pub mod hostile;
pub mod http;
pub mod inject;
pub mod killed;
pub mod perfetto;
pub mod pjrt;
pub mod podman;
pub mod prometheus;
pub mod pyenv;
pub mod python;
pub mod serve;
pub mod slow_link;
pub mod tls;
pub mod torch;
pub mod traceme;
pub mod viewer;
pub mod xprof;
pub mod xspace;

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

/// Root of the workspace.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// True if this process may load BPF. Otherwise prints why the calling test
/// is skipped, or panics when `EBTRACE_REQUIRE_BPF=1`.
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("EBTRACE_REQUIRE_BPF").as_deref() == Ok("1") {
        panic!("{test}: needs root to load BPF, and EBTRACE_REQUIRE_BPF=1 forbids skipping");
    }
    eprintln!("skipping {test}: needs root to load BPF (run `sudo cargo xtask test`)");
    false
}

/// `/usr/bin/NAME` or `/usr/sbin/NAME`, a tool a Debian package installs
/// (`cargo xtask setup` installs them); `None`, and the test is skipped,
/// if it is missing, unless `EBTRACE_REQUIRE_INTEROP=1`.
pub fn debian_tool(name: &str) -> Option<PathBuf> {
    let found = ["/usr/bin", "/usr/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|path| path.exists());
    if found.is_some() {
        return found;
    }
    assert!(
        std::env::var("EBTRACE_REQUIRE_INTEROP").as_deref() != Ok("1"),
        "{name} is missing (run `cargo xtask setup`)"
    );
    eprintln!("skipping: {name} is missing (run `cargo xtask setup`)");
    None
}

/// Serializes the tests that trace: on two cores, parallel captures would
/// disturb each other's timing. It also waits for the ebtrace processes
/// of earlier tests to be gone (see [`wait_for_ebtrace_exits`]): an
/// exiting ebtrace leaves its probe links to a child that releases them in
/// the background, and the kernel attaches new uprobes only after it.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    wait_for_ebtrace_exits();
    guard
}

/// Waits (up to a minute) until no process of the ebtrace binary under
/// test runs, the background release of earlier probe links included.
pub fn wait_for_ebtrace_exits() {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ebtrace_processes().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Threads of `pid` named `ebtrace-agent`: the agent's own, and any a
/// library it drives (CUPTI) started from it.
pub fn agent_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("comm"))
                        .is_ok_and(|c| c.starts_with("ebtrace-agent"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Waits up to `within` for an agent's thread to run in `pid`.
pub fn wait_for_agent_threads(pid: u32, within: Duration) {
    let deadline = Instant::now() + within;
    while agent_threads(pid) == 0 {
        assert!(Instant::now() < deadline, "the agent never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Makes a FIFO at `path`.
pub fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(made.success(), "mkfifo {}", path.display());
}

/// The processes named `ebtrace`, running (not zombies) and started less
/// than a minute ago: an exiting ebtrace and the child releasing its
/// links, never a stray long-lived one. By name, because a process
/// releasing its descriptors on exit has no `exe` link.
pub fn ebtrace_processes() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // SAFETY: a plain libc query.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|u| u.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let Some((name, rest)) = stat.rsplit_once(") ") else {
                return false;
            };
            // Fields after the name: state is the 3rd of stat, starttime the 22nd.
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let started = fields.get(19).and_then(|t| t.parse::<f64>().ok());
            name.ends_with(" (ebtrace")
                && fields.first() != Some(&"Z")
                && started.is_some_and(|t| uptime - t / ticks < 60.0)
        })
        .collect()
}

/// The ebtrace binary under test: `EBTRACE_BIN`, else the one cargo built
/// next to this test executable.
pub fn ebtrace_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("EBTRACE_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join("ebtrace");
    assert!(
        bin.exists(),
        "{} not found: build it first (`cargo build -p tracer-user`) or set EBTRACE_BIN",
        bin.display()
    );
    bin
}

/// A fresh, empty temporary directory, removed when dropped (unless made
/// with [`TempDir::kept`]).
pub struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("ebtrace-test-{tag}-{}-{n}", std::process::id()));
        Self::fresh(p, false)
    }

    /// The directory `base/tag`, emptied, and kept after the test for a
    /// person to look at (`base`: the test's `CARGO_TARGET_TMPDIR`).
    pub fn kept(base: &str, tag: &str) -> Self {
        Self::fresh(Path::new(base).join(tag), true)
    }

    fn fresh(path: PathBuf, keep: bool) -> Self {
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path, keep }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Every `*.xplane.pb` below `dir`.
pub fn xplane_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(xplane_files(&p));
        } else if p.to_string_lossy().ends_with(".xplane.pb") {
            out.push(p);
        }
    }
    out
}

/// Runs `ebtrace` with `args` to completion.
pub fn run_ebtrace(args: &[&str]) -> Output {
    Command::new(ebtrace_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("spawn ebtrace")
}

/// The arguments of a capture: `-p PID -d DURATION`, `extra`, `--logdir DIR`.
fn capture_args<'a>(
    pid: &'a str,
    duration: &'a str,
    logdir: &'a TempDir,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec!["-p", pid, "-d", duration];
    args.extend_from_slice(extra);
    args.extend(["--logdir", logdir.path().to_str().expect("UTF-8 temp path")]);
    args
}

/// Runs a capture of `pid` into `logdir` to its end (see [`capture_args`]).
pub fn record(pid: &str, duration: &str, logdir: &TempDir, extra: &[&str]) -> Output {
    run_ebtrace(&capture_args(pid, duration, logdir, extra))
}

/// Starts a capture of `pid` into `logdir`, stdout and stderr piped.
pub fn spawn_record(pid: &str, duration: &str, logdir: &TempDir, extra: &[&str]) -> Child {
    spawn_ebtrace(&capture_args(pid, duration, logdir, extra))
}

/// [`spawn_record`] with `env` added to ebtrace's environment.
pub fn spawn_record_with_env(
    pid: &str,
    duration: &str,
    logdir: &TempDir,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Child {
    spawn_ebtrace_with_env(&capture_args(pid, duration, logdir, extra), env)
}

/// Starts `ebtrace` with `args`, stdout and stderr piped.
pub fn spawn_ebtrace(args: &[&str]) -> Child {
    spawn_ebtrace_with_env(args, &[])
}

/// [`spawn_ebtrace`] with `env` added to ebtrace's environment.
pub fn spawn_ebtrace_with_env(args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(ebtrace_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ebtrace")
}

/// A running ebtrace whose stderr is read to its end in the background
/// (so it never blocks writing it), returned once a given line came.
pub struct AttachedCapture {
    child: Child,
    /// The stderr lines up to and with the awaited one.
    pub lines: Vec<String>,
    reader: std::thread::JoinHandle<Vec<String>>,
}

/// Starts a capture of `pid` into `logdir` and returns once ebtrace says
/// its probes are attached (the window is open).
pub fn spawn_attached(
    pid: &str,
    duration: &str,
    logdir: &TempDir,
    extra: &[&str],
) -> AttachedCapture {
    await_line(
        spawn_record(pid, duration, logdir, extra),
        "probes attached",
    )
}

/// Returns once `ebtrace` (started with stderr piped) has written a line
/// containing `awaited`; kills it and panics if none comes within a minute.
pub fn await_line(mut child: Child, awaited: &str) -> AttachedCapture {
    let stderr = BufReader::new(child.stderr.take().expect("piped"));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            seen.push(line);
        }
        seen
    });
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &String| l.contains(awaited)) {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => lines.push(line),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "ebtrace did not say {awaited:?}: {:?}",
                    reader.join().unwrap_or_default()
                );
            }
        }
    }
    AttachedCapture {
        child,
        lines,
        reader,
    }
}

impl AttachedCapture {
    /// ebtrace's pid.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits for ebtrace to end (killing it past `deadline`); its output
    /// with the whole stderr.
    pub fn wait(self, deadline: Duration) -> Output {
        let mut out = wait_with_deadline(self.child, deadline);
        out.stderr = self
            .reader
            .join()
            .expect("stderr reader")
            .join("\n")
            .into_bytes();
        out
    }

    /// Kills ebtrace with SIGKILL; its exit status.
    pub fn kill(mut self) -> std::process::ExitStatus {
        signal(self.child.id(), libc::SIGKILL);
        let status = self.child.wait().expect("wait for ebtrace");
        let _ = self.reader.join();
        status
    }
}

/// Waits for a child with a deadline; kills it and panics past the deadline.
pub fn wait_with_deadline(mut child: Child, deadline: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!(
                "process still running after {deadline:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends a signal to a process.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(pid as i32, sig) };
}

/// `CLOCK_REALTIME` now, epoch ns (the clock of XSpace start/stop times).
pub fn realtime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Names of the BPF programs loaded in the kernel now (what `bpftool prog`
/// lists; the kernel keeps 15 characters of a name).
pub fn loaded_bpf_program_names() -> Vec<String> {
    aya::programs::loaded_programs()
        .flatten()
        .filter_map(|p| p.name_as_str().map(str::to_string))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process named `ebtrace` is seen until it has exited and been reaped.
    #[test]
    fn ebtrace_processes_are_found_by_name() {
        let dir = TempDir::new("named");
        let bin = dir.path().join("ebtrace");
        std::fs::copy("/bin/sleep", &bin).expect("copy sleep");
        let mut child = Command::new(&bin).arg("30").spawn().expect("run it");
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !ebtrace_processes().contains(&pid) {
            assert!(Instant::now() < deadline, "{pid} not found");
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().expect("kill");
        child.wait().expect("reap");
        assert!(!ebtrace_processes().contains(&pid));
    }
}
