//! Processes that turn what ebtrace reads of them against it, shared by
//! the hostile tests of `ebtrace --pid` and of `serve --discover`: a loader
//! cache that is a FIFO or a device, a library truncated while mapped, a
//! huge mapping named like the C library, a program posing as its own
//! agent, and an agent whose thread is held stopped.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{cuda::CudaWorkload, wait_for_agent_threads, workspace_root};

/// A hostile process, killed and reaped when dropped.
pub struct Target {
    child: Child,
    pub pid: u32,
}

impl Target {
    /// `sleep 600` whose `/etc/ld.so.cache` is `cache`, bind-mounted over
    /// it in a mount namespace of its own (as any user can make one with a
    /// user namespace), preloading `preload` if given: a library there is
    /// mapped before the loader reads its cache.
    pub fn with_loader_cache(cache: &Path, preload: Option<&Path>) -> Self {
        let assignment = preload
            .map(|p| format!("LD_PRELOAD={} ", p.display()))
            .unwrap_or_default();
        let script = format!(
            "mount --bind {} /etc/ld.so.cache && {assignment}exec sleep 600",
            cache.display()
        );
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare");
        let target = Target::of(child);
        // Ready once `sleep` runs in the new namespace, with the preloaded
        // library mapped.
        let preloaded = preload.map(|p| p.to_str().expect("a UTF-8 path").to_owned());
        target.wait_until("the target did not start", |pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
            comm == "sleep\n" && preloaded.as_ref().is_none_or(|p| maps.contains(p))
        });
        target
    }

    /// `sleep 600` preloading a copy of `library` made at `copy`, which is
    /// then truncated to nothing while the process maps it.
    pub fn with_truncated_library(library: &Path, copy: &Path) -> Self {
        std::fs::copy(library, copy).expect("copy the library");
        let child = Command::new("sleep")
            .arg("600")
            .env("LD_PRELOAD", copy)
            .stdin(Stdio::null())
            .spawn()
            .expect("sleep");
        let target = Target::of(child);
        let name = copy.to_str().expect("a UTF-8 path").to_owned();
        // Truncated only once `sleep` sleeps: the loader, still relocating,
        // would fault on the library's pages and kill it.
        target.wait_until("the program never slept with the library mapped", |pid| {
            let mapped = std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .is_ok_and(|m| m.contains(&name));
            let syscall = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
            let sleeping = matches!(
                syscall.split_whitespace().next(),
                Some(n) if n == libc::SYS_clock_nanosleep.to_string() || n == libc::SYS_nanosleep.to_string()
            );
            mapped && sleeping
        });
        std::fs::File::options()
            .write(true)
            .open(copy)
            .and_then(|f| f.set_len(0))
            .expect("truncate the library");
        target
    }

    /// The system's CPython mapping 1 TiB, executable, of a 4 KiB file
    /// named `libc.so.6` it writes in `dir`, with `env`.
    pub fn with_huge_c_library_mapping(dir: &Path, env: &[(&str, &str)]) -> Self {
        let fake = dir.join("libc.so.6");
        std::fs::write(&fake, vec![0xc3u8; 4096]).unwrap();
        let script = format!(
            "import ctypes, json, os, sys, time\n\
             libc = ctypes.CDLL(None, use_errno=True)\n\
             libc.mmap.restype = ctypes.c_void_p\n\
             libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n\
             fd = os.open({:?}, os.O_RDONLY)\n\
             at = libc.mmap(None, 1 << 40, 5, 2 | 0x4000, fd, 0)\n\
             assert at not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()\n\
             print(json.dumps({{'pid': os.getpid()}}), flush=True)\n\
             while True: time.sleep(0.01)\n",
            fake.to_str().unwrap()
        );
        let mut python = Command::new("/usr/bin/python3");
        python.args(["-c", &script]).envs(env.iter().copied());
        start_system_python(python)
    }

    /// `tests/fixtures/agent/fake_agent.py` run by the system's CPython (no
    /// packages needed) as `uid`, with `args`; answered once it listens.
    pub fn fake_agent(uid: u32, args: &[&str]) -> Self {
        use std::os::unix::process::CommandExt as _;
        let script = workspace_root().join("tests/fixtures/agent/fake_agent.py");
        let source = std::fs::read_to_string(&script).expect("read fake_agent.py");
        let mut python = Command::new("/usr/bin/python3");
        python.arg("-c").arg(source).args(args).uid(uid);
        start_system_python(python)
    }

    fn of(child: Child) -> Self {
        let pid = child.id();
        Target { child, pid }
    }

    fn wait_until(&self, failure: &str, ready: impl Fn(u32) -> bool) {
        let start = Instant::now();
        while !ready(self.pid) {
            assert!(start.elapsed() < Duration::from_secs(10), "{failure}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `python` (the system's CPython running a script that prints
/// `{"pid": N}` first); answered once it printed that.
pub fn start_system_python(mut python: Command) -> Target {
    let mut child = python
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start /usr/bin/python3");
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped"))
        .read_line(&mut first)
        .expect("its first line");
    let line: serde_json::Value = serde_json::from_str(&first).expect("a JSON line");
    let pid = line["pid"].as_u64().expect("pid") as u32;
    Target { child, pid }
}

/// The agent's threads in `pid`, held stopped by this test (as a target
/// that stops its agent's thread would hold it) until dropped.
pub struct SilencedAgent(Vec<i32>);

impl SilencedAgent {
    pub fn of(pid: u32) -> Self {
        let mut held = Vec::new();
        for entry in std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
        {
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            if !comm.starts_with("ebtrace-agent") {
                continue;
            }
            let tid: i32 = entry.file_name().to_str().unwrap().parse().unwrap();
            // SAFETY: plain ptrace requests on a thread of a child process.
            unsafe {
                assert_eq!(
                    libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0),
                    0,
                    "seize {tid}"
                );
                assert_eq!(libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0), 0);
                let mut status = 0;
                assert_eq!(libc::waitpid(tid, &mut status, libc::__WALL), tid);
            }
            held.push(tid);
        }
        assert!(!held.is_empty(), "no agent thread in {pid}");
        SilencedAgent(held)
    }
}

impl Drop for SilencedAgent {
    fn drop(&mut self) {
        for &tid in &self.0 {
            // SAFETY: lets go of a thread this test seized.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0) };
        }
    }
}

/// A CUDA program launching for longer than any capture here, CUPTI
/// there for an agent.
pub fn launching() -> CudaWorkload {
    let mut workload = CudaWorkload::start_with_cupti(&["--iters", "100000000"], &[]);
    workload.go();
    workload
}

/// Waits for the agent's thread in `pid`, and 500 ms more.
pub fn wait_for_agent_thread(pid: u32) {
    wait_for_agent_threads(pid, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
}
