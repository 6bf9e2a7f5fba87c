//! Building and running the C fixture workloads in `tests/fixtures/`.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Child, ChildStdout, Command, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::Duration,
};

use crate::workspace_root;

/// Compiles `tests/fixtures/<name>.c` into `target/fixtures/<name>` (once
/// per test process; `cc` rebuilds only if the source is newer).
pub fn build_c(name: &str) -> PathBuf {
    let root = workspace_root();
    let src = root.join("tests/fixtures").join(format!("{name}.c"));
    let out_dir = root.join("target/fixtures");
    std::fs::create_dir_all(&out_dir).expect("create target/fixtures");
    let bin = out_dir.join(name);
    let fresh = match (std::fs::metadata(&src), std::fs::metadata(&bin)) {
        (Ok(s), Ok(b)) => b.modified().ok() >= s.modified().ok(),
        _ => false,
    };
    if !fresh {
        // Build to a unique name and rename: tests may build concurrently.
        let tmp = out_dir.join(format!("{name}.{}.tmp", std::process::id()));
        let status = Command::new("cc")
            .args(["-O2", "-g", "-Wall", "-pthread", "-o"])
            .arg(&tmp)
            .arg(&src)
            .status()
            .expect("run cc (install gcc)");
        assert!(status.success(), "compiling {} failed", src.display());
        std::fs::rename(&tmp, &bin).expect("rename fixture");
    }
    bin
}

/// Compiles `tests/fixtures/<name>.c` into the shared object
/// `target/fixtures/<file_name>`.
pub fn build_c_shared(name: &str, file_name: &str) -> PathBuf {
    let root = workspace_root();
    let src = root.join("tests/fixtures").join(format!("{name}.c"));
    let out_dir = root.join("target/fixtures");
    std::fs::create_dir_all(&out_dir).expect("create target/fixtures");
    let lib = out_dir.join(file_name);
    let tmp = out_dir.join(format!("{file_name}.{}.tmp", std::process::id()));
    let status = Command::new("cc")
        .args(["-O2", "-Wall", "-shared", "-fPIC", "-o"])
        .arg(&tmp)
        .arg(&src)
        .status()
        .expect("run cc (install gcc)");
    assert!(status.success(), "compiling {} failed", src.display());
    std::fs::rename(&tmp, &lib).expect("rename shared fixture");
    lib
}

/// A running `sched_workload`, killed when dropped.
pub struct SchedWorkload {
    pub child: Child,
    pub pid: u32,
    /// Thread name -> tid, as the fixture reported them.
    pub threads: BTreeMap<String, u32>,
    /// Counter name -> address of its `long` in the fixture's memory.
    pub counter_addrs: BTreeMap<String, u64>,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl SchedWorkload {
    /// Starts the fixture with `args` and waits for its start line.
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// Like [`SchedWorkload::start`], with both threads on CPU 0: a
    /// ping-pong then switches as fast as one CPU can, whatever a wake-up
    /// across CPUs costs on the machine (on some virtual machines it makes
    /// the unpinned ping-pong 7 times slower).
    pub fn start_on_cpu0(args: &[&str]) -> Self {
        Self::spawn(
            Command::new("taskset")
                .args(["-c", "0"])
                .arg(build_c("sched_workload"))
                .args(args),
        )
    }

    /// Like [`SchedWorkload::start`], with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let bin = build_c("sched_workload");
        Self::spawn(Command::new(bin).args(args).envs(env.iter().copied()))
    }

    fn spawn(command: &mut Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start sched_workload");
        let stdout: ChildStdout = child.stdout.take().expect("piped");
        let mut reader = BufReader::new(stdout);
        let mut first = String::new();
        reader.read_line(&mut first).expect("read start line");
        let v: serde_json::Value = serde_json::from_str(&first)
            .unwrap_or_else(|e| panic!("bad start line {first:?}: {e}"));
        let pid = v["pid"].as_u64().expect("pid") as u32;
        let threads = v["threads"]
            .as_object()
            .expect("threads")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().expect("tid") as u32))
            .collect();
        let counter_addrs = v["counters"]
            .as_object()
            .expect("counters")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().expect("address")))
            .collect();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(line);
            }
        });
        SchedWorkload {
            child,
            pid,
            threads,
            counter_addrs,
            lines,
            reader: Some(reader),
        }
    }

    pub fn tid(&self, name: &str) -> u32 {
        self.threads[name]
    }

    pub fn counter_addr(&self, name: &str) -> u64 {
        self.counter_addrs[name]
    }

    /// The current value of one of the fixture's counters.
    pub fn counter(&self, name: &str) -> u64 {
        let mem =
            std::fs::File::open(format!("/proc/{}/mem", self.pid)).expect("open /proc/PID/mem");
        read_counter(&mem, self.counter_addr(name))
    }

    /// Waits for a JSON line from the fixture that has `key`.
    pub fn wait_line(&self, key: &str, deadline: Duration) -> Option<serde_json::Value> {
        let start = std::time::Instant::now();
        while start.elapsed() < deadline {
            let found = self.lines.lock().expect("lock").iter().find_map(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .filter(|v| v.get(key).is_some())
            });
            if found.is_some() {
                return found;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Asks the fixture to stop and returns its final counters.
    pub fn stop(mut self) -> serde_json::Value {
        crate::signal(self.pid, libc::SIGTERM);
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let lines = self.lines.lock().expect("lock");
        let last = lines.last().expect("final counters line");
        serde_json::from_str(last).expect("counters JSON")
    }

    /// Waits for the fixture to exit on its own.
    pub fn wait_exit(&mut self, deadline: Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < deadline {
            if self.child.try_wait().expect("try_wait").is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

impl Drop for SchedWorkload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Samples `/proc/PID/task/TID/schedstat` (on-CPU ns), and optionally some
/// of the fixture's own `long` counters (read through `/proc/PID/mem`), with
/// wall-clock timestamps, in the background, so a test can read the values
/// at any instant of a capture window by interpolation.
pub struct SchedstatSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: Option<JoinHandle<Vec<Sample>>>,
}

/// One sampling instant.
struct Sample {
    wall_ns: u64,
    schedstat: BTreeMap<u32, Schedstat>,
    /// Values of the sampled counters, in the order their addresses were given.
    counters: Vec<u64>,
    /// Steal time of all CPUs so far (`/proc/stat`), in ticks.
    steal_ticks: u64,
}

/// `/proc/PID/task/TID/schedstat`: on-CPU ns and number of times run.
#[derive(Clone, Copy, Debug)]
pub struct Schedstat {
    pub on_cpu_ns: u64,
    pub timeslices: u64,
}

/// Time the hypervisor gave this machine's CPUs to others, so far: the
/// `steal` column of `/proc/stat`'s first line, in ticks.
fn read_steal_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .next()
        .and_then(|cpu| cpu.split_whitespace().nth(8))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Reads an 8-byte counter at `addr` through an open `/proc/PID/mem`.
fn read_counter(mem: &std::fs::File, addr: u64) -> u64 {
    use std::os::unix::fs::FileExt as _;
    let mut b = [0u8; 8];
    mem.read_exact_at(&mut b, addr)
        .expect("read a fixture counter");
    u64::from_ne_bytes(b)
}

pub fn read_schedstat(pid: u32, tid: u32) -> Option<Schedstat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    let mut f = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    let on_cpu_ns = f.next()??;
    let _wait = f.next()??;
    let timeslices = f.next()??;
    Some(Schedstat {
        on_cpu_ns,
        timeslices,
    })
}

impl SchedstatSampler {
    /// Samples the `tids` of `pid` and the 8-byte counters at
    /// `counter_addrs` in its memory, every `every`.
    pub fn start(pid: u32, tids: Vec<u32>, counter_addrs: Vec<u64>, every: Duration) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open /proc/PID/mem");
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let before = crate::realtime_ns();
                let schedstat = tids
                    .iter()
                    .filter_map(|&t| read_schedstat(pid, t).map(|v| (t, v)))
                    .collect();
                let counters = counter_addrs
                    .iter()
                    .map(|&addr| read_counter(&mem, addr))
                    .collect();
                let steal_ticks = read_steal_ticks();
                let after = crate::realtime_ns();
                samples.push(Sample {
                    wall_ns: before / 2 + after / 2,
                    schedstat,
                    counters,
                    steal_ticks,
                });
                std::thread::sleep(every);
            }
            samples
        });
        SchedstatSampler {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops sampling; returns a lookup of on-CPU ns at a wall-clock time.
    pub fn finish(mut self) -> SchedstatSeries {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        SchedstatSeries(self.handle.take().expect("once").join().expect("sampler"))
    }
}

pub struct SchedstatSeries(Vec<Sample>);

impl SchedstatSeries {
    /// On-CPU ns of `tid` at wall time `t` (linear interpolation).
    pub fn at(&self, tid: u32, t: u64) -> u64 {
        self.interpolate(t, |s| s.schedstat.get(&tid).map(|v| v.on_cpu_ns))
    }

    /// At most how long the hypervisor stopped this machine's CPUs while
    /// sampling, in ns: 0 if it reported none, else what it reported, plus
    /// the tick each CPU's count may hide. On a CPU it stopped, the thread
    /// that was running stays switched in, so a trace shows it running,
    /// while schedstat (the scheduler's task clock) leaves that time out.
    pub fn steal_bound_ns(&self) -> u64 {
        const TICK_NS: u64 = 10_000_000;
        let (Some(first), Some(last)) = (self.0.first(), self.0.last()) else {
            return 0;
        };
        let ticks = last.steal_ticks.saturating_sub(first.steal_ticks);
        if ticks == 0 {
            return 0;
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        (ticks + cpus) * TICK_NS
    }

    /// Times `tid` was switched in, up to wall time `t` (interpolated).
    pub fn timeslices_at(&self, tid: u32, t: u64) -> u64 {
        self.interpolate(t, |s| s.schedstat.get(&tid).map(|v| v.timeslices))
    }

    /// Value of the `i`-th sampled counter at wall time `t` (interpolated).
    pub fn counter_at(&self, i: usize, t: u64) -> u64 {
        self.interpolate(t, |s| s.counters.get(i).copied())
    }

    fn interpolate(&self, t: u64, field: impl Fn(&Sample) -> Option<u64>) -> u64 {
        let pts: Vec<(u64, u64)> = self
            .0
            .iter()
            .filter_map(|s| field(s).map(|v| (s.wall_ns, v)))
            .collect();
        assert!(pts.len() >= 2, "too few samples");
        assert!(
            pts[0].0 <= t && t <= pts[pts.len() - 1].0,
            "time {t} outside sampled range {}..{}",
            pts[0].0,
            pts[pts.len() - 1].0
        );
        let i = pts
            .partition_point(|(ts, _)| *ts <= t)
            .clamp(1, pts.len() - 1);
        let ((t0, v0), (t1, v1)) = (pts[i - 1], pts[i]);
        if t1 == t0 {
            return v0;
        }
        v0 + ((v1 - v0) as f64 * (t - t0) as f64 / (t1 - t0) as f64) as u64
    }

    pub fn samples(&self) -> usize {
        self.0.len()
    }
}

/// A running `cpu_hotspot` (a thread spinning in `ebtrace_hot_spin`, one
/// reading `/dev/zero`), killed when dropped.
pub struct Hotspot {
    pub child: Child,
    /// Kept open: the fixture may print more.
    pub stdout: BufReader<ChildStdout>,
    pub pid: u32,
    pub hot_tid: u32,
    pub reader_tid: u32,
}

impl Hotspot {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// With the fixture's arguments `args`; waits for its first line.
    pub fn start_with(args: &[&str]) -> Self {
        let mut child = Command::new(build_c("cpu_hotspot"))
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start cpu_hotspot");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("a line from the fixture");
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        let id = |key: &str| v[key].as_u64().unwrap_or_else(|| panic!("no {key}: {v}")) as u32;
        Hotspot {
            pid: id("pid"),
            hot_tid: id("hot_tid"),
            reader_tid: id("reader_tid"),
            child,
            stdout,
        }
    }
}

impl Drop for Hotspot {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
