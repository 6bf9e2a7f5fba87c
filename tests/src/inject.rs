//! `tests/fixtures/inject_target.c` and `ebtrace inject-check` as the
//! loader's tests drive them: a target whose counters tell whether being
//! taken over changed what it saw, and the load/unload cycles run on it.

use std::{
    collections::BTreeMap,
    io::BufRead as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use crate::{fixture, spawn_ebtrace, wait_with_deadline};

/// A running `inject_target`, killed when dropped if this process started it.
pub struct Target {
    /// The fixture, where this process started it.
    child: Option<Child>,
    pub pid: u32,
    counters: BTreeMap<String, u64>,
}

impl Target {
    pub fn start(mode: &str) -> Self {
        Self::start_with(mode, &[])
    }

    /// [`Self::start`] with `env` added to the target's environment.
    pub fn start_with(mode: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with_args(&[mode], env)
    }

    /// [`Self::start_with`], the fixture's whole command line `args`.
    pub fn start_with_args(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(fixture::build_c("inject_target"))
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start inject_target");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("start line");
        let v: serde_json::Value = serde_json::from_str(&line).expect("start line JSON");
        let pid = v["pid"].as_u64().expect("pid") as u32;
        Self::running(pid, &line, Some(child))
    }

    /// The fixture started elsewhere (in a container, say) as `pid` here,
    /// its start line `line`; it is not killed when dropped.
    pub fn started_elsewhere(pid: u32, line: &str) -> Self {
        Self::running(pid, line, None)
    }

    fn running(pid: u32, line: &str, child: Option<Child>) -> Self {
        let v: serde_json::Value = serde_json::from_str(line).expect("start line JSON");
        let counters = v["counters"]
            .as_object()
            .expect("counters")
            .iter()
            .map(|(k, a)| (k.clone(), a.as_u64().expect("address")))
            .collect();
        let target = Target {
            pid,
            child,
            counters,
        };
        target.wait_progress(3);
        target
    }

    pub fn counter(&self, name: &str) -> u64 {
        use std::os::unix::fs::FileExt as _;
        let mem = std::fs::File::open(format!("/proc/{}/mem", self.pid)).expect("open mem");
        let mut b = [0u8; 8];
        mem.read_exact_at(&mut b, self.counters[name])
            .expect("read a counter");
        u64::from_ne_bytes(b)
    }

    /// Waits until `progress` has grown by `more` (the target goes on).
    pub fn wait_progress(&self, more: u64) {
        let start = self.counter("progress");
        let began = Instant::now();
        while self.counter("progress") < start + more {
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "pid {} made no progress ({} after {start}); {}",
                self.pid,
                self.counter("progress"),
                proc_state(self.pid)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn errors(&self) -> u64 {
        self.counter("errors")
    }

    pub fn status(&self, key: &str) -> String {
        status_field(self.pid, key)
    }

    /// Asserts the program saw nothing (its error counter is 0), is traced
    /// by no one, and holds nothing of the agent; `what` names the case.
    pub fn assert_untouched(&self, what: &str) {
        assert_eq!(self.errors(), 0, "{what}: the program saw the takeover");
        assert_eq!(self.status("TracerPid"), "0", "{what}");
        let traces = agent_traces(self.pid);
        assert!(traces.is_empty(), "{what}: {traces:?}");
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn status_field(pid: u32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

pub fn proc_state(pid: u32) -> String {
    format!(
        "State {:?}, TracerPid {:?}",
        status_field(pid, "State"),
        status_field(pid, "TracerPid")
    )
}

pub fn probe_library() -> &'static PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| fixture::build_c_shared("inject_probe", "libinject_probe.so"))
}

/// Which library `inject-check` loads.
#[derive(Clone, Copy, Debug)]
pub enum Library {
    /// ebtrace's own agent, embedded in the binary.
    Agent,
    /// The loader probe (tests/fixtures/inject_probe.c).
    Probe,
}

pub fn check_args(pid: u32, cycles: u32, library: Library) -> Vec<String> {
    let mut args = vec![
        "inject-check".into(),
        "--pid".into(),
        pid.to_string(),
        "--cycles".into(),
        cycles.to_string(),
    ];
    if let Library::Probe = library {
        args.push("--library".into());
        args.push(probe_library().to_str().expect("UTF-8 path").into());
    }
    args
}

/// Runs `cycles` load/ping/unload cycles; returns one JSON value a cycle.
pub fn inject_check(pid: u32, cycles: u32, library: Library) -> Vec<serde_json::Value> {
    let args = check_args(pid, cycles, library);
    let child = spawn_ebtrace(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // A takeover that deadlocks the target never ends.
    let out = wait_with_deadline(child, Duration::from_secs(120));
    assert!(
        out.status.success(),
        "inject-check ({library:?}) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), cycles as usize);
    lines
}

/// Lines of /proc/PID/maps, open descriptors, and VmRSS in KiB.
pub fn footprint(pid: u32) -> (usize, usize, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("maps")
        .lines()
        .count();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .count();
    let rss = status_field(pid, "VmRSS")
        .trim_end_matches("kB")
        .trim()
        .parse()
        .expect("VmRSS");
    (maps, fds, rss)
}

/// What the agent leaves in the target while loaded: its memfd, and the
/// library mapped from it.
pub fn agent_traces(pid: u32) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.contains("ebtrace-agent"))
        .collect();
    found.extend(
        std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .expect("maps")
            .lines()
            .filter(|l| l.contains("ebtrace-agent"))
            .map(str::to_string),
    );
    found
}

/// Runs `inject-check` for one cycle; returns its exit status and stderr,
/// failing if it takes longer than `deadline` (a takeover that deadlocked).
pub fn inject_check_once(pid: u32, deadline: Duration) -> (bool, String) {
    let args = check_args(pid, 1, Library::Agent);
    let child = spawn_ebtrace(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let out = wait_with_deadline(child, deadline);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until ebtrace's agent is loaded in `pid` (its memfd or its
/// mapping shows), failing after `within`.
pub fn wait_for_agent(pid: u32, within: Duration) {
    let began = Instant::now();
    while agent_traces(pid).is_empty() {
        assert!(began.elapsed() < within, "never loaded");
        std::thread::sleep(Duration::from_millis(10));
    }
}
