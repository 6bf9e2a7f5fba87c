//! The TraceMe fixture (`tests/fixtures/traceme/`): a stand-in for TSL's
//! TraceMe recorder built as shared libraries with each C++ toolchain, the
//! program that drives them, and reading its own log of recorded events.

use std::{
    io::{BufRead as _, BufReader},
    os::unix::fs::FileExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{TempDir, workspace_root};

/// How a fixture library is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toolchain {
    /// g++ and libstdc++; `tsl::profiler`; the recorder's symbols exported
    /// and the library stripped, so they are in `.dynsym` only.
    Gcc,
    /// clang++ and libc++ (`std::__1`, default string layout); the older
    /// `tensorflow::profiler` names; symbols local to `.symtab` (as jaxlib).
    Libcxx,
    /// clang++ and libc++ with its alternate string layout in a private ABI
    /// namespace (`std::__u`, as libtpu); `tsl::profiler`; local symbols.
    LibcxxAlternate,
}

impl Toolchain {
    pub const ALL: [Toolchain; 3] = [
        Toolchain::Gcc,
        Toolchain::Libcxx,
        Toolchain::LibcxxAlternate,
    ];

    pub fn tag(self) -> &'static str {
        match self {
            Toolchain::Gcc => "gcc",
            Toolchain::Libcxx => "libcxx",
            Toolchain::LibcxxAlternate => "libcxx-alt",
        }
    }

    /// How ebtrace and the fixture name the string layout.
    pub fn layout(self) -> &'static str {
        match self {
            Toolchain::Gcc => "libstdc++",
            Toolchain::Libcxx => "libc++",
            Toolchain::LibcxxAlternate => "libc++ alternate layout",
        }
    }

    fn compiler(self) -> Vec<&'static str> {
        match self {
            Toolchain::Gcc => vec!["g++", "-DTM_EXPORT_TSL=1"],
            Toolchain::Libcxx => vec!["clang++", "-stdlib=libc++", "-DTM_NAMESPACE=tensorflow"],
            Toolchain::LibcxxAlternate => vec![
                "clang++",
                "-stdlib=libc++",
                "-D_LIBCPP_ABI_UNSTABLE",
                "-D_LIBCPP_ABI_NAMESPACE=__u",
                "-D_LIBCPP_DISABLE_EXTERN_TEMPLATE",
                "-Wl,--no-undefined",
            ],
        }
    }
}

fn fixture_dir() -> PathBuf {
    workspace_root().join("tests/fixtures/traceme")
}

fn newest_source() -> std::time::SystemTime {
    std::fs::read_dir(fixture_dir())
        .expect("fixture sources")
        .flatten()
        .filter_map(|e| e.metadata().ok()?.modified().ok())
        .max()
        .expect("sources exist")
}

fn out_dir() -> PathBuf {
    let d = workspace_root().join("target/fixtures/traceme");
    std::fs::create_dir_all(&d).expect("create target/fixtures/traceme");
    d
}

fn is_fresh(out: &Path) -> bool {
    std::fs::metadata(out)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t >= newest_source())
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds (if needed) the fixture library for `toolchain`, with a
/// frame-pointer prologue on `Record` like the real one.
pub fn build_library(toolchain: Toolchain) -> PathBuf {
    let lib = out_dir().join(format!("libtraceme-{}.so", toolchain.tag()));
    if is_fresh(&lib) {
        return lib;
    }
    let tmp = lib.with_extension(format!("{}.tmp", std::process::id()));
    let src = fixture_dir();
    let compiler = toolchain.compiler();
    run(Command::new(compiler[0])
        .args(&compiler[1..])
        .args([
            "-std=c++17",
            "-O2",
            "-fno-omit-frame-pointer",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-fvisibility-inlines-hidden",
            "-o",
        ])
        .arg(&tmp)
        .arg(src.join("tsl_profiler.cc"))
        .arg(src.join("workload.cc")));
    if toolchain == Toolchain::Gcc {
        run(Command::new("strip").arg("--strip-all").arg(&tmp));
    }
    std::fs::rename(&tmp, &lib).expect("rename fixture library");
    lib
}

/// Builds (if needed) the driver program.
pub fn build_program() -> PathBuf {
    let bin = out_dir().join("traceme_workload");
    if is_fresh(&bin) {
        return bin;
    }
    let tmp = bin.with_extension(format!("{}.tmp", std::process::id()));
    run(Command::new("cc")
        .args(["-O2", "-Wall", "-pthread", "-o"])
        .arg(&tmp)
        .arg(fixture_dir().join("traceme_workload.c"))
        .arg("-ldl"));
    std::fs::rename(&tmp, &bin).expect("rename fixture program");
    bin
}

/// One event the fixture's recorder queued (its own log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedEvent {
    pub lib: String,
    pub tid: u32,
    pub start: i64,
    pub end: i64,
    pub name: String,
}

/// A library loaded by the running fixture.
#[derive(Clone, Debug)]
pub struct LoadedLib {
    pub name: String,
    pub trace_level_addr: u64,
    pub abi: String,
}

/// A running `traceme_workload`, killed when dropped.
pub struct TraceMeWorkload {
    child: Child,
    pub pid: u32,
    /// Thread name -> tid.
    pub threads: std::collections::BTreeMap<String, u32>,
    pub libs: Vec<LoadedLib>,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
    dump: PathBuf,
    _dir: TempDir,
}

impl TraceMeWorkload {
    /// Starts the program with one library per toolchain in `libs` and the
    /// extra `args`; waits for its start line.
    pub fn start(libs: &[Toolchain], args: &[&str]) -> Self {
        let program = build_program();
        let dir = TempDir::new("traceme-fixture");
        let dump = dir.path().join("events.jsonl");
        let mut cmd = Command::new(program);
        for t in libs {
            cmd.arg("--lib")
                .arg(format!("{}={}", t.tag(), build_library(*t).display()));
        }
        let mut child = cmd
            .args(args)
            .arg("--dump")
            .arg(&dump)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start traceme_workload");
        let mut reader = BufReader::new(child.stdout.take().expect("piped"));
        let mut first = String::new();
        reader.read_line(&mut first).expect("read start line");
        let v: serde_json::Value = serde_json::from_str(&first)
            .unwrap_or_else(|e| panic!("bad start line {first:?}: {e}"));
        let threads = v["threads"]
            .as_object()
            .expect("threads")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().expect("tid") as u32))
            .collect();
        let libs = v["libs"]
            .as_object()
            .expect("libs")
            .iter()
            .map(|(k, v)| LoadedLib {
                name: k.clone(),
                trace_level_addr: v["trace_level_addr"].as_u64().expect("address"),
                abi: v["abi"].as_str().expect("abi").to_string(),
            })
            .collect();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(line);
            }
        });
        TraceMeWorkload {
            pid: v["pid"].as_u64().expect("pid") as u32,
            child,
            threads,
            libs,
            lines,
            reader: Some(reader),
            dump,
            _dir: dir,
        }
    }

    pub fn tid(&self, name: &str) -> u32 {
        self.threads[name]
    }

    pub fn lib(&self, toolchain: Toolchain) -> &LoadedLib {
        self.libs
            .iter()
            .find(|l| l.name == toolchain.tag())
            .expect("library loaded")
    }

    /// `g_trace_level` of a loaded library, read from `/proc/PID/mem`.
    pub fn trace_level(&self, toolchain: Toolchain) -> i32 {
        read_i32(self.pid, self.lib(toolchain).trace_level_addr)
    }

    /// The latest progress count (iterations or burst events).
    pub fn progress(&self) -> u64 {
        self.lines
            .lock()
            .expect("lock")
            .iter()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["progress"].as_u64())
            .unwrap_or(0)
    }

    /// Waits until the progress count moves past `after`.
    pub fn wait_progress(&self, after: u64, deadline: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < deadline {
            if self.progress() > after {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Has the program fork a child that runs TraceMe steps (SIGUSR1);
    /// returns the child's pid.
    pub fn fork_child(&self, deadline: Duration) -> u32 {
        crate::signal(self.pid, libc::SIGUSR1);
        let start = Instant::now();
        loop {
            let forked = self.lines.lock().expect("lock").iter().find_map(|l| {
                serde_json::from_str::<serde_json::Value>(l).ok()?["forked"].as_u64()
            });
            if let Some(pid) = forked {
                return pid as u32;
            }
            assert!(start.elapsed() < deadline, "the workload did not fork");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Stops the program (SIGTERM); returns its final counters and the
    /// events its recorders queued.
    pub fn stop(mut self) -> (serde_json::Value, Vec<LoggedEvent>) {
        crate::signal(self.pid, libc::SIGTERM);
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "traceme_workload failed: {status}");
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let counters = {
            let lines = self.lines.lock().expect("lock");
            serde_json::from_str(lines.last().expect("final line")).expect("counters JSON")
        };
        let text = std::fs::read_to_string(&self.dump).expect("event dump");
        let events = text
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("event JSON");
                LoggedEvent {
                    lib: v["lib"].as_str().expect("lib").to_string(),
                    tid: v["tid"].as_u64().expect("tid") as u32,
                    start: v["start"].as_i64().expect("start"),
                    end: v["end"].as_i64().expect("end"),
                    name: v["name"].as_str().expect("name").to_string(),
                }
            })
            .collect();
        (counters, events)
    }
}

impl Drop for TraceMeWorkload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads an `int` from another process's memory.
pub fn read_i32(pid: u32, address: u64) -> i32 {
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open /proc/PID/mem");
    let mut buf = [0u8; 4];
    mem.read_exact_at(&mut buf, address)
        .expect("read /proc/PID/mem");
    i32::from_ne_bytes(buf)
}

/// A span as TSL's host tracer would make it from the logged events.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ExpectedSpan {
    pub tid: u32,
    pub start: i64,
    pub end: i64,
    /// The recorded name, metadata included.
    pub raw_name: String,
    pub lib: String,
}

/// Pairs activity starts and ends (by library and id; the span goes to the
/// thread that ended it), keeps complete events and instants, and drops
/// whatever is not wholly inside `[start, stop]` (epoch ns).
pub fn expected_spans(events: &[LoggedEvent], start: i64, stop: i64) -> Vec<ExpectedSpan> {
    let starts: std::collections::HashMap<(&str, i64), &LoggedEvent> = events
        .iter()
        .filter(|e| e.start > 0 && e.end < 0)
        .map(|e| ((e.lib.as_str(), -e.end), e))
        .collect();
    let mut out: Vec<ExpectedSpan> = events
        .iter()
        .filter_map(|e| {
            if e.start > 0 && e.end > 0 {
                Some(ExpectedSpan {
                    tid: e.tid,
                    start: e.start,
                    end: e.end,
                    raw_name: e.name.clone(),
                    lib: e.lib.clone(),
                })
            } else if e.start < 0 && e.end > 0 {
                let s = starts.get(&(e.lib.as_str(), -e.start))?;
                Some(ExpectedSpan {
                    tid: e.tid,
                    start: s.start,
                    end: e.end,
                    raw_name: s.name.clone(),
                    lib: e.lib.clone(),
                })
            } else {
                None
            }
        })
        .filter(|s| s.start >= start && s.end <= stop)
        .collect();
    out.sort();
    out
}
