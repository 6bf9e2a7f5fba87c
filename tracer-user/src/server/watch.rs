//! The processes `ebtrace serve` watches: the `--pid` list, or with
//! `--discover` every process that maps one of the ML runtime libraries in
//! [`RUNTIME_LIBRARIES`], found by reading `/proc/*/maps` every interval
//! (so processes started later are picked up too). Processes that exit are
//! dropped. What the hub watches is also published ([`WatchedNow`]), so
//! that `/metrics` and a request's permission check never wait for a hub
//! busy with a capture.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::procfs::TargetProcess;

/// What `--discover` looks for in a mapped file's path: the file name
/// starts with one of these, or the file is a shared object inside a
/// `jaxlib/` directory.
pub const RUNTIME_LIBRARIES: &[&str] = &[
    // The CUDA driver (every CUDA framework loads it).
    "libcuda.so",
    // TensorFlow's runtime, as a library or as its Python extension.
    "libtensorflow_framework.so",
    "libtensorflow_cc.so",
    "_pywrap_tensorflow_internal.so",
    // The TPU runtime.
    "libtpu.so",
];

/// The mapped runtime library that makes a process worth watching, if any
/// (from the text of `/proc/PID/maps`).
pub fn runtime_library(maps: &str) -> Option<&str> {
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            let name = path.rsplit('/').next().unwrap_or(path);
            RUNTIME_LIBRARIES.iter().any(|lib| name.starts_with(lib))
                || (path.contains("/jaxlib/") && name.contains(".so"))
        })
}

/// How targets are chosen.
#[derive(Clone, Debug)]
pub enum WatchMode {
    /// Exactly these processes (checked at start-up).
    Pids(Vec<TargetProcess>),
    /// Processes mapping a runtime library, rescanned every interval.
    Discover {
        /// Time between scans.
        interval: Duration,
    },
}

/// The processes `ebtrace serve` watches, chosen as its [`WatchMode`] says.
pub struct Watched {
    mode: WatchMode,
    procs: BTreeMap<u32, TargetProcess>,
    last_scan: Option<Instant>,
    now: WatchedNow,
}

/// The watched processes as of the hub's last look, readable from any
/// thread without waiting for the hub; none once the hub has stopped.
#[derive(Clone, Default)]
pub struct WatchedNow(Arc<Mutex<Option<Vec<TargetProcess>>>>);

impl WatchedNow {
    /// Those still running; `None` once the hub has stopped.
    pub fn get(&self) -> Option<Vec<TargetProcess>> {
        let targets = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let running = targets.as_ref()?.iter().filter(|t| t.is_alive());
        Some(running.cloned().collect())
    }

    fn set(&self, targets: Option<Vec<TargetProcess>>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = targets;
    }
}

impl Watched {
    /// Watches as `mode` says; a discovering one scans for processes at once.
    pub fn new(mode: WatchMode) -> Self {
        let procs = match &mode {
            WatchMode::Pids(targets) => targets.iter().map(|t| (t.pid, t.clone())).collect(),
            WatchMode::Discover { .. } => BTreeMap::new(),
        };
        let mut w = Watched {
            mode,
            procs,
            last_scan: None,
            now: WatchedNow::default(),
        };
        w.refresh();
        w.now.set(Some(w.targets()));
        w
    }

    /// What it watches, published as it changes.
    pub fn now(&self) -> WatchedNow {
        self.now.clone()
    }

    /// When the next discovery scan is due, if discovering.
    pub fn next_scan(&self) -> Option<Instant> {
        match (&self.mode, self.last_scan) {
            (WatchMode::Discover { interval }, Some(last)) => Some(last + *interval),
            (WatchMode::Discover { .. }, None) => Some(Instant::now()),
            _ => None,
        }
    }

    /// Drops processes that exited; discovers new ones when a scan is due.
    pub fn refresh(&mut self) {
        let gone: Vec<u32> = self
            .procs
            .values()
            .filter(|t| !t.is_alive())
            .map(|t| t.pid)
            .collect();
        let mut changed = !gone.is_empty();
        for pid in gone {
            if let Some(t) = self.procs.remove(&pid) {
                eprintln!(
                    "ebtrace: pid {} ({}) exited; no longer watched",
                    t.pid, t.name
                );
            }
        }
        if self.next_scan().is_some_and(|due| due <= Instant::now()) {
            self.last_scan = Some(Instant::now());
            changed |= self.discover();
        }
        if changed {
            self.now.set(Some(self.targets()));
        }
    }

    /// Whether it found a process to watch.
    fn discover(&mut self) -> bool {
        let mut found = false;
        let me = std::process::id();
        for pid in crate::procfs::process_ids() {
            if pid == me || self.procs.contains_key(&pid) {
                continue;
            }
            // Kernel threads and processes that went away read as empty.
            let Ok(maps) = crate::procfs::maps_text(pid) else {
                continue;
            };
            let Some(library) = runtime_library(&maps) else {
                continue;
            };
            if let Ok(t) = TargetProcess::open(pid)
                && t.pid == pid
            {
                eprintln!(
                    "ebtrace: watching pid {} ({}): it maps {library}",
                    t.pid, t.name
                );
                self.procs.insert(pid, t);
                found = true;
            }
        }
        found
    }

    /// The watched processes, as of the last refresh.
    pub fn targets(&self) -> Vec<TargetProcess> {
        self.procs.values().cloned().collect()
    }

    /// Whether `pid` is watched, as of the last refresh.
    pub fn contains(&self, pid: u32) -> bool {
        self.procs.contains_key(&pid)
    }

    /// Why nothing is watched, for the client.
    pub fn why_empty(&self) -> String {
        match &self.mode {
            WatchMode::Pids(t) => format!(
                "every process this server watches has exited (pid {})",
                t.iter()
                    .map(|t| t.pid.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            WatchMode::Discover { .. } => format!(
                "no process is watched yet: ebtrace serve --discover has found none that maps {} \
                 or a jaxlib/ library",
                RUNTIME_LIBRARIES.join(", ")
            ),
        }
    }
}

impl Drop for Watched {
    /// The hub has stopped (or panicked): nothing is watched any more.
    fn drop(&mut self) {
        self.now.set(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_runtime_libraries_only() {
        let line = |path: &str| format!("7f00-7f01 r-xp 00000000 fe:01 42 {path}\n");
        for (path, hit) in [
            ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", true),
            ("/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", true),
            (
                "/venv/lib/python3.11/site-packages/jaxlib/libjax_common.so",
                true,
            ),
            ("/venv/lib/python3.11/site-packages/jaxlib/_jax.so", true),
            (
                "/venv/site-packages/tensorflow/libtensorflow_framework.so.2",
                true,
            ),
            (
                "/venv/site-packages/tensorflow/python/_pywrap_tensorflow_internal.so",
                true,
            ),
            ("/venv/site-packages/libtpu/libtpu.so", true),
            ("/usr/lib/x86_64-linux-gnu/libcudart.so.12", false),
            ("/usr/lib/x86_64-linux-gnu/libc.so.6", false),
            ("/venv/site-packages/jaxlib/version.py", false),
            ("/home/me/libcuda_notes.txt", false),
            ("[heap]", false),
        ] {
            assert_eq!(runtime_library(&line(path)).is_some(), hit, "{path}");
        }
        assert_eq!(runtime_library("7f00-7f01 rw-p 00000000 00:00 0\n"), None);
    }

    #[test]
    fn pids_mode_keeps_live_processes() {
        let me = TargetProcess::open(std::process::id()).unwrap();
        let w = Watched::new(WatchMode::Pids(vec![me.clone()]));
        assert!(w.contains(me.pid));
        assert_eq!(w.targets().len(), 1);
        assert!(w.next_scan().is_none());
        let now = w.now();
        assert_eq!(now.get().map(|t| t.len()), Some(1));
        drop(w);
        assert!(now.get().is_none(), "still published after the hub stopped");
    }
}
