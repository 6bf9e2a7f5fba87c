//! Python workloads of real frameworks (jax, TensorFlow) from the venv of
//! `cargo xtask setup`, and where their libraries' symbols sit in them.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, ChildStdout, Command, Stdio},
};

use ebtrace_proto::tensorflow::profiler::{XSpace, x_event, x_stat};

use crate::{workspace_root, xprof};

/// The venv Python with jax and xprof, or `None` to skip (a failure when
/// `EBTRACE_REQUIRE_INTEROP=1`).
pub fn jax_python() -> Option<std::path::PathBuf> {
    xprof::python_with(&["jax", "jaxlib", xprof::XPROF_MODULE])
}

/// The jax workload (`jax_workload.py`) on the CPU backend, with `env`.
pub fn start_jax(python: &Path, env: &[(&str, &str)]) -> PythonWorkload {
    let mut all = vec![("JAX_PLATFORMS", "cpu")];
    all.extend_from_slice(env);
    PythonWorkload::start(python, "jax_workload.py", &all)
}

/// The jax workload on the CPU backend with the arguments `args` (a mode
/// such as `--flood`).
pub fn start_jax_with(python: &Path, args: &[&str]) -> PythonWorkload {
    PythonWorkload::start_with(python, "jax_workload.py", args, &[("JAX_PLATFORMS", "cpu")])
}

/// A running `tests/fixtures/traceme/<script>`, killed when dropped. The
/// script prints `{"pid": N}` once warmed up.
pub struct PythonWorkload {
    child: Child,
    stdout: BufReader<ChildStdout>,
    pub pid: u32,
    /// What the script printed first.
    pub start_line: serde_json::Value,
}

impl PythonWorkload {
    /// Starts `script` with `python` and extra environment `env`; waits for
    /// its start line.
    pub fn start(python: &Path, script: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(python, script, &[], env)
    }

    /// Like [`Self::start`], with the script's arguments `args`.
    pub fn start_with(python: &Path, script: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let path = workspace_root().join("tests/fixtures/traceme").join(script);
        Self::start_script(python, &path, args, env)
    }

    /// The script at `path`, with `args` and extra environment `env`;
    /// waits for its start line (`{"pid": N, ...}`, kept in [`Self::start_line`]).
    pub fn start_script(python: &Path, path: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let script = path.display();
        let mut child = Command::new(python)
            .arg(path)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {script}: {e}"));
        let mut first = String::new();
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        stdout.read_line(&mut first).expect("read start line");
        let v: serde_json::Value = serde_json::from_str(&first)
            .unwrap_or_else(|e| panic!("bad start line of {script} {first:?}: {e}"));
        PythonWorkload {
            pid: v["pid"].as_u64().expect("pid") as u32,
            child,
            stdout,
            start_line: v,
        }
    }
}

impl PythonWorkload {
    /// The next JSON line the script prints (it blocks until one comes).
    pub fn next_line(&mut self) -> serde_json::Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read a line");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }

    /// Sends the script `signal`.
    pub fn signal(&self, signal: i32) {
        // SAFETY: a signal to the child, which this owns and has not reaped.
        assert_eq!(unsafe { libc::kill(self.pid as i32, signal) }, 0);
    }

    /// Waits up to `deadline` for the workload to exit by itself; its exit
    /// status, or `None` if it still runs.
    pub fn wait_exit(&mut self, deadline: std::time::Duration) -> Option<std::process::ExitStatus> {
        let began = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the workload") {
                return Some(status);
            }
            if began.elapsed() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for PythonWorkload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Address of jaxlib's `g_trace_level` in `pid` (a local `.symtab` symbol).
pub fn jaxlib_trace_level_address(pid: u32) -> u64 {
    symbol_address(
        pid,
        "/libjax_common.so",
        "_ZN3tsl8profiler8internal13g_trace_levelE",
    )
}

/// Address of `symbol` (mangled) of the object mapped in `pid` whose path
/// ends in `suffix`, found with binutils' `nm` (not with ebtrace's own
/// lookup): its value in the file plus the address the object's first page
/// (file offset 0, virtual address 0) is mapped at. Looks in `.symtab`,
/// then in `.dynsym`.
pub fn symbol_address(pid: u32, suffix: &str, symbol: &str) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let (start, path) = maps
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 6 && f[5].ends_with(suffix) && f[2] == "00000000").then(|| {
                let start = u64::from_str_radix(f[0].split('-').next().unwrap(), 16).unwrap();
                (start, f[5].to_string())
            })
        })
        .unwrap_or_else(|| panic!("{suffix} is not mapped in {pid}"));
    let in_table = |dynamic: bool| {
        let mut nm = Command::new("nm");
        if dynamic {
            nm.arg("-D");
        }
        let out = nm
            .arg("--defined-only")
            .arg(&path)
            .output()
            .expect("run nm");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.ends_with(&format!(" {symbol}")))
            .and_then(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
    };
    let vaddr = in_table(false)
        .or_else(|| in_table(true))
        .unwrap_or_else(|| panic!("{symbol} not in nm's output for {path}"));
    start + vaddr
}

/// What a trace holds of the scopes `jax_workload.py --flood` entered on
/// its main thread (line `pid` of `/host:CPU`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloodCount {
    /// "flood" and "flood_mark" events on the line.
    pub scopes: u64,
    /// "flood_mark" events: each carries the number of scopes the fixture
    /// entered before it.
    pub marks: u64,
    /// Scopes between the first and the last mark that the fixture entered
    /// and the trace lacks (negative: more in the trace than entered).
    pub missing: i64,
}

/// Counts the flood's scopes in `space` against the fixture's own counts.
pub fn flood_count(space: &XSpace, pid: u32) -> FloodCount {
    let host = crate::xspace::plane(space, "/host:CPU");
    let name_of = |id: i64| host.event_metadata.get(&id).map(|m| m.name.as_str());
    let n_id = host
        .stat_metadata
        .values()
        .find(|m| m.name == "n")
        .map(|m| m.id);
    let Some(line) = host.lines.iter().find(|l| l.id == i64::from(pid)) else {
        return FloodCount {
            scopes: 0,
            marks: 0,
            missing: 0,
        };
    };
    // (start in ps, the mark's count if a mark)
    let mut scopes: Vec<(i64, Option<i64>)> = Vec::new();
    for e in &line.events {
        let Some(x_event::Data::OffsetPs(at)) = e.data else {
            continue;
        };
        match name_of(e.metadata_id) {
            Some("flood") => scopes.push((at, None)),
            Some("flood_mark") => {
                let n = e
                    .stats
                    .iter()
                    .find(|s| Some(s.metadata_id) == n_id)
                    .and_then(|s| match s.value {
                        Some(x_stat::Value::Int64Value(v)) => Some(v),
                        Some(x_stat::Value::Uint64Value(v)) => i64::try_from(v).ok(),
                        _ => None,
                    })
                    .expect("a flood mark without its count");
                scopes.push((at, Some(n)));
            }
            _ => {}
        }
    }
    scopes.sort_by_key(|s| s.0);
    let marks: Vec<(usize, i64)> = scopes
        .iter()
        .enumerate()
        .filter_map(|(i, (_, n))| n.map(|n| (i, n)))
        .collect();
    let missing = marks
        .windows(2)
        .map(|w| (w[1].1 - w[0].1) - (w[1].0 - w[0].0) as i64)
        .sum();
    FloodCount {
        scopes: scopes.len() as u64,
        marks: marks.len() as u64,
        missing,
    }
}
