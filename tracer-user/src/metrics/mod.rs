//! Prometheus metrics of the watched processes and of ebtrace itself,
//! served by `ebtrace serve --http ADDR` at `/metrics`.
//!
//! - [`totals`]: what each watched process did, read from `/proc` at each
//!   scrape (no probe needed, so it costs the targets nothing);
//! - [`activity`]: CUDA launches and synchronizing waits, counted from the
//!   flight recorder's records while it runs;
//! - [`exposition`]: the Prometheus text format;
//! - the HTTP listener is `server::http`.
//!
//! Everything but [`activity`] is read when Prometheus scrapes.

pub mod activity;
pub mod exposition;
pub mod totals;

use std::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use crate::procfs::{self, TargetProcess};
use activity::{ActivityTally, ProcessActivity};
use exposition::{Exposition, Kind};
use totals::{ProcessTotals, Totals};

/// Counters the session hub keeps for `/metrics`.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Captures answered (with a trace or an error).
    pub captures: AtomicU64,
    /// Records the captures lost (ring buffer full, probe maps full).
    pub records_dropped: AtomicU64,
    /// Records the flight recorder holds now.
    pub recorder_held: AtomicU64,
    /// Records the flight recorder forgot (too old, or past its memory).
    pub recorder_forgotten: AtomicU64,
    /// Scheduler records the flight recorder keeps at most now.
    pub recorder_limit: AtomicU64,
    /// Requests refused because their caller may not make them.
    pub requests_refused: AtomicU64,
    /// Listeners on addresses other than loopback (`--insecure-listen`).
    pub unauthenticated_listeners: AtomicU64,
    /// Requests refused because their caller, or all callers, had as
    /// much of that work in progress as they may (RESOURCE_EXHAUSTED, 429).
    pub requests_not_admitted: AtomicU64,
    /// TLS connections refused: no client certificate, one the client CA
    /// did not sign, or a handshake that failed or stalled.
    pub tls_handshakes_refused: AtomicU64,
}

impl ServerCounters {
    /// Counts a capture answered, and the records it lost.
    pub fn add_capture(&self, dropped: u64) {
        self.captures.fetch_add(1, Ordering::Relaxed);
        self.records_dropped.fetch_add(dropped, Ordering::Relaxed);
    }
}

/// The state `/metrics` reads from.
#[derive(Debug, Default)]
pub struct Metrics {
    totals: Mutex<Totals>,
    /// What the flight recorder counted, per process.
    activity: Mutex<ActivityTally>,
    /// Whether a flight recorder has counted: until then the probe-based
    /// series are left out rather than shown as zeros.
    activity_counted: AtomicBool,
    /// What the session hub counted.
    pub server: ServerCounters,
}

/// A per-process metric: name, help, kind, value.
type ProcessMetric = (&'static str, &'static str, Kind, fn(&ProcessTotals) -> f64);

const PER_PROCESS: [ProcessMetric; 5] = [
    (
        "ebtrace_process_cpu_seconds_total",
        "CPU time (user and system) of the process, exited threads included.",
        Kind::Counter,
        |p| p.cpu_ns as f64 / 1e9,
    ),
    (
        "ebtrace_process_runqueue_wait_seconds_total",
        "Time the process's threads were runnable but waited for a CPU (schedstat).",
        Kind::Counter,
        |p| p.sum.runqueue_wait_ns as f64 / 1e9,
    ),
    (
        "ebtrace_process_voluntary_switches_total",
        "Context switches where a thread of the process blocked or yielded.",
        Kind::Counter,
        |p| p.sum.voluntary_switches as f64,
    ),
    (
        "ebtrace_process_involuntary_switches_total",
        "Context switches where a thread of the process was preempted.",
        Kind::Counter,
        |p| p.sum.involuntary_switches as f64,
    ),
    (
        "ebtrace_process_threads",
        "Threads the process has now.",
        Kind::Gauge,
        |p| p.threads as f64,
    ),
];

/// A per-process metric counted from probes: name, help, value.
type ActivityMetric = (&'static str, &'static str, fn(&ProcessActivity) -> f64);

const PER_PROCESS_ACTIVITY: [ActivityMetric; 2] = [
    (
        "ebtrace_process_cuda_launches_total",
        "Successful CUDA kernel and graph launches, counted while the flight recorder runs.",
        |a| a.cuda_launches as f64,
    ),
    (
        "ebtrace_process_cuda_sync_wait_seconds_total",
        "Time threads spent in cuStreamSynchronize, cuCtxSynchronize and cuEventSynchronize, \
         counted while the flight recorder runs.",
        |a| a.cuda_sync_wait_ns as f64 / 1e9,
    ),
];

impl Metrics {
    /// A flight recorder started: the probe-based series are shown from
    /// now on.
    pub fn start_counting_activity(&self) {
        self.activity_counted.store(true, Ordering::Relaxed);
    }

    /// Adds what a flight recorder counted.
    pub fn add_activity(&self, counted: &ActivityTally) {
        self.activity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(counted);
    }

    /// The text exposition of every metric, for `targets` (the processes
    /// watched now).
    pub fn render(&self, targets: &[TargetProcess]) -> String {
        let processes = self
            .totals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .refresh(targets);
        let mut e = Exposition::default();
        for (name, help, kind, value) in PER_PROCESS {
            e.family(name, help, kind);
            for p in &processes {
                let pid = p.pid.to_string();
                e.sample(name, &[("pid", &pid), ("name", &p.name)], value(p));
            }
        }
        if self.activity_counted.load(Ordering::Relaxed) {
            let mut activity = self.activity.lock().unwrap_or_else(|e| e.into_inner());
            activity.retain(|pid| processes.iter().any(|p| p.pid == pid));
            for (name, help, value) in PER_PROCESS_ACTIVITY {
                e.family(name, help, Kind::Counter);
                for p in &processes {
                    let pid = p.pid.to_string();
                    let counted = activity.of(p.pid);
                    e.sample(name, &[("pid", &pid), ("name", &p.name)], value(&counted));
                }
            }
        }
        let names = crate::symbols::python::names::name_stats();
        let codes = crate::symbols::python::frames::code_stats();
        let kernel_names = crate::agent::kernel_name_stats();
        let own: [(&str, &str, Kind, f64); 19] = [
            (
                "ebtrace_watched_processes",
                "Processes ebtrace watches now.",
                Kind::Gauge,
                processes.len() as f64,
            ),
            (
                "ebtrace_captures_total",
                "Captures ebtrace answered.",
                Kind::Counter,
                self.server.captures.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_records_dropped_total",
                "Records the captures lost (ring buffer or probe maps full).",
                Kind::Counter,
                self.server.records_dropped.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_recorder_records",
                "Records the flight recorder holds now.",
                Kind::Gauge,
                self.server.recorder_held.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_recorder_records_limit",
                "Scheduler records the flight recorder keeps at most now: what --retain-memory \
                 leaves beside ebtrace's own memory (a CUDA driver call or a stack sample counts \
                 for several).",
                Kind::Gauge,
                self.server.recorder_limit.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_recorder_forgotten_records_total",
                "Records the flight recorder forgot: older than --retain, or past --retain-memory.",
                Kind::Counter,
                self.server.recorder_forgotten.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_requests_refused_total",
                "Requests refused because their caller may not make them (PERMISSION_DENIED, \
                 HTTP 403).",
                Kind::Counter,
                self.server.requests_refused.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_requests_not_admitted_total",
                "Requests refused because their caller, or all callers together, had as much \
                 of that work in progress as they may (RESOURCE_EXHAUSTED, HTTP 429).",
                Kind::Counter,
                self.server.requests_not_admitted.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_tls_handshakes_refused_total",
                "TLS connections refused: no client certificate, one the client CA did not \
                 sign, or a handshake that failed or did not finish in time.",
                Kind::Counter,
                self.server.tls_handshakes_refused.load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_unauthenticated_listeners",
                "Listeners on addresses other than loopback, where anyone who reaches them may \
                 capture, read and control (--insecure-listen).",
                Kind::Gauge,
                self.server
                    .unauthenticated_listeners
                    .load(Ordering::Relaxed) as f64,
            ),
            (
                "ebtrace_python_frame_names",
                "Names of Python frames (function, file, line) ebtrace keeps for the stacks it \
                 holds.",
                Kind::Gauge,
                names.names as f64,
            ),
            (
                "ebtrace_python_frame_name_bytes",
                "Memory those names take (at most 64 MiB).",
                Kind::Gauge,
                names.bytes as f64,
            ),
            (
                "ebtrace_python_frame_names_forgotten_total",
                "Names of Python frames forgotten to make room: unused longer than any stack \
                 holding them is kept.",
                Kind::Counter,
                names.forgotten as f64,
            ),
            (
                "ebtrace_python_code_object_bytes",
                "Memory the code objects read from the watched processes take (at most 64 MiB).",
                Kind::Gauge,
                codes.bytes as f64,
            ),
            (
                "ebtrace_python_code_objects_forgotten_total",
                "Code objects forgotten to make room; they are read again when sampled.",
                Kind::Counter,
                codes.forgotten as f64,
            ),
            (
                "ebtrace_cuda_kernel_name_bytes",
                "Memory the names of kernels asked of the CUDA drivers in the watched processes \
                 take (at most 32 MiB a capture).",
                Kind::Gauge,
                kernel_names.bytes as f64,
            ),
            (
                "ebtrace_cuda_kernel_names_forgotten_total",
                "Kernel names forgotten (no held record launches them any more) or not kept \
                 (past a capture's 32 MiB).",
                Kind::Counter,
                kernel_names.forgotten as f64,
            ),
            (
                "ebtrace_cpu_seconds_total",
                "CPU time ebtrace itself used (user and system).",
                Kind::Counter,
                procfs::own_cpu_seconds().unwrap_or(0.0),
            ),
            (
                "ebtrace_resident_memory_bytes",
                "ebtrace's resident memory.",
                Kind::Gauge,
                procfs::own_resident_bytes() as f64,
            ),
        ];
        for (name, help, kind, value) in own {
            e.family(name, help, kind);
            e.sample(name, &[], value);
        }
        e.finish()
    }
}
