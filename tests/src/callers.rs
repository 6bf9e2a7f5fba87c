//! Clients of `ebtrace serve` run as another user than root: a
//! ProfilerService client built with the tests, copied where uid 65534 may
//! run it, and a process of that user to watch.

use std::{
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::PathBuf,
    process::{Child, Command},
};

use ebtrace_proto::tensorflow::profiler::XSpace;
use prost::Message as _;

use crate::{TempDir, serve::ServeProcess};

/// The uid of `nobody`.
pub const NOBODY: u32 = 65534;

/// The client, where uid 65534 may run it and write next to it.
pub struct Client {
    /// Where it lives and writes.
    pub dir: TempDir,
    bin: PathBuf,
}

impl Client {
    /// The client built at `built` (a test's
    /// `env!("CARGO_BIN_EXE_profiler_client")`), copied.
    pub fn new(built: &str) -> Self {
        let dir = TempDir::new("callers");
        let bin = dir.path().join("profiler_client");
        std::fs::copy(built, &bin).expect("copy the client");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        Client { dir, bin }
    }

    /// The client's one line for `method` asked of `server` as `uid`.
    pub fn ask(&self, uid: u32, server: &ServeProcess, method: &str) -> String {
        self.ask_at(uid, &server.addrs[0].to_string(), method)
    }

    /// The same, of the listener at `addr` (`HOST:PORT` or `unix:PATH`).
    pub fn ask_at(&self, uid: u32, addr: &str, method: &str) -> String {
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

    /// Where it writes a Profile's trace.
    pub fn trace_path(&self) -> PathBuf {
        self.dir.path().join("trace.xplane.pb")
    }

    /// The trace it wrote.
    pub fn trace(&self) -> XSpace {
        XSpace::decode(std::fs::read(self.trace_path()).unwrap().as_slice()).unwrap()
    }
}

/// A process of uid 65534 that wakes 200 times a second, killed when
/// dropped.
pub struct ProcessOfNobody(Child);

impl ProcessOfNobody {
    /// Starts it.
    pub fn start() -> Self {
        let child = Command::new("python3")
            .args(["-c", "import time\nwhile True: time.sleep(0.005)"])
            .current_dir("/")
            .uid(NOBODY)
            .gid(NOBODY)
            .spawn()
            .expect("start python3 as uid 65534");
        ProcessOfNobody(child)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for ProcessOfNobody {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
