//! The flight recorder: one capture of every watched process that goes on
//! until it is stopped, keeping only the last `--retain` of what it
//! recorded, and no more than fits with a snapshot of it in
//! `--retain-memory`, so that `GetSnapshot` can answer with what already
//! happened.
//!
//! It records scheduling, CUDA driver calls and (at `--sample-hz`) CPU
//! stacks, whatever the request's tracer levels say. TraceMe events are
//! left out: switching a framework's recording on for good would make the
//! target keep every event in its own memory until a profiler session of
//! its own drains them. A process that exits stays in it until its
//! records are too old (then nothing of it is kept): its last seconds are
//! what a snapshot after a crash is for. A process watched after it started is recorded from
//! then on, alongside the others.

use std::{
    collections::{BTreeMap, BTreeSet, btree_map::Entry},
    time::{Duration, Instant},
};

use tracer_common::SchedSwitch;

use super::{sessions::SessionError, validate::SessionSpec};
use crate::{
    agent::TraceMeRoute,
    attach::{ProbeSet, ProbeSetConfig},
    capture::{Capture, CaptureOptions, ProbeFamilies},
    clock,
    collect::Record,
    metrics::activity::ActivityTally,
    procfs::TargetProcess,
    timeline::{Timeline, Window},
};

/// How much the flight recorder keeps.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    /// The last this long.
    pub window: Duration,
    /// At most this many bytes of records and of a snapshot built from
    /// them.
    pub memory_bytes: usize,
    /// CPU stack samples a second per CPU it records (0: none).
    pub cpu_sample_hz: u32,
}

/// What a snapshot takes while it is built and sent, per record held,
/// beside the record: its share of the thread states and of the XSpace
/// they make (about 2.7 events and 80 bytes of XSpace per scheduler
/// record), with room to spare. Measured on a flat-out ping-pong
/// (BENCHMARKS.md, "Flight recorder").
const SNAPSHOT_BYTES_PER_RECORD: usize = 200;

/// The shortest and the longest time between two drains of the
/// recorder's ring buffer. Each drain costs the same few system calls and
/// wake-ups however little it reads, a noticeable part of an always-on
/// recorder's CPU: it drains as seldom as the ring allows. Only a flood
/// that fills a fifth of the ring in less than 50 ms is drained more often
/// than that (1.2 million switches a second in the default 16 MiB ring):
/// records it would drop otherwise.
const DRAIN_PERIOD_MIN: Duration = Duration::from_millis(10);
const DRAIN_PERIOD_MAX: Duration = Duration::from_millis(250);

impl Retention {
    /// Records held at most, so that they and a snapshot of them fit in
    /// [`Self::memory_bytes`]: a record is held as the probes wrote it (a
    /// scheduler record's size), and decoded while a snapshot is built.
    fn max_records(&self) -> usize {
        let per_record = size_of::<SchedSwitch>() + size_of::<Record>() + SNAPSHOT_BYTES_PER_RECORD;
        (self.memory_bytes / per_record).max(1)
    }
}

pub struct FlightRecorder {
    capture: Capture,
    pids: BTreeSet<u32>,
    /// The snapshots' request: host name, delivery, probe families.
    pub spec: SessionSpec,
    retention: Retention,
    /// Records and TraceMe events forgotten since it started.
    pub forgotten: u64,
    /// How many of those [`Self::newly_forgotten`] has reported.
    reported: u64,
    /// Processes it no longer records (they exited), and when it saw them
    /// gone; their records stay until they are older than `--retain`.
    gone: BTreeMap<u32, u64>,
    /// Processes it could not take on ([`Self::take_on`]).
    left_out: BTreeSet<u32>,
    /// When it last drained, and what the ring had given by then.
    last_drain: Option<(Instant, u64)>,
    /// When to drain next, after the last drain ([`Self::drain_period`]).
    drain_period: Duration,
}

impl FlightRecorder {
    /// Attaches its probes to `targets`: scheduling and CUDA driver calls,
    /// whatever tracer levels `spec` names (XProf's client asks for
    /// continuous profiling with `host_tracer_level` 0, meant for the
    /// device buffers of TPUs).
    pub fn start(
        targets: Vec<TargetProcess>,
        spec: SessionSpec,
        probe: &ProbeSetConfig,
        loaded: Option<ProbeSet>,
        retention: Retention,
    ) -> Result<Self, SessionError> {
        let families = ProbeFamilies {
            sched: true,
            cuda: true,
            traceme_level: 0,
            cpu_sample_hz: retention.cpu_sample_hz,
        };
        let options = CaptureOptions {
            probe: probe.clone(),
            families,
            route: TraceMeRoute::Off,
            no_device_activity: true,
            ..CaptureOptions::default()
        };
        let pids = targets.iter().map(|t| t.pid).collect();
        let capture = Capture::start_with(targets, &options, loaded)
            .map_err(|e| SessionError::Attach(e.to_string()))?;
        eprintln!(
            "ebtrace: flight recorder on: keeping the last {} of pid {} (at most {} records: \
             with a snapshot of them, {} MiB; probes attached in {} ms)",
            humantime::format_duration(retention.window),
            pids_list(&pids),
            retention.max_records(),
            retention.memory_bytes / (1024 * 1024),
            capture.attach_time.as_millis()
        );
        Ok(FlightRecorder {
            capture,
            pids,
            spec,
            retention,
            forgotten: 0,
            reported: 0,
            gone: BTreeMap::new(),
            left_out: BTreeSet::new(),
            last_drain: None,
            drain_period: DRAIN_PERIOD_MIN,
        })
    }

    /// Forgets what it holds of the processes it recorded until they
    /// exited whose pids processes of `watched` now have (new processes
    /// reusing them), so that [`Self::take_on`] records the new ones from
    /// now on, beside the others.
    pub fn forget_reused(&mut self, watched: &BTreeSet<u32>) {
        let reused: Vec<u32> = self
            .gone
            .keys()
            .filter(|pid| watched.contains(pid))
            .copied()
            .collect();
        if !reused.is_empty() {
            // The old process's last records (its threads' exits) may
            // still be in the ring buffer: once drained after this they
            // would read as the new process's.
            self.capture.poll(Duration::ZERO);
        }
        for pid in reused {
            self.gone.remove(&pid);
            self.pids.remove(&pid);
            self.forgotten += self.capture.forget_process(pid);
            self.capture.drop_target(pid);
            eprintln!(
                "ebtrace: flight recorder: pid {pid} now belongs to a new process: what it \
                 held of the one that exited is forgotten"
            );
        }
    }

    /// Records the processes of `watched` it does not record yet, from
    /// now on; what it holds of the others stays. A process it cannot
    /// record is said once and left out.
    pub fn take_on(&mut self, watched: Vec<TargetProcess>) {
        // A pid left out that is no longer watched may be a new process
        // when it is watched again.
        self.left_out
            .retain(|pid| watched.iter().any(|t| t.pid == *pid));
        for target in watched {
            let (pid, name) = (target.pid, target.name.clone());
            if self.pids.contains(&pid) || self.left_out.contains(&pid) {
                continue;
            }
            match self.capture.add_target(target) {
                Ok(notes) => {
                    eprintln!("ebtrace: flight recorder: recording pid {pid} ({name}) too");
                    for note in notes {
                        eprintln!("ebtrace: {note}");
                    }
                    self.pids.insert(pid);
                }
                Err(e) => {
                    eprintln!("ebtrace: flight recorder: cannot record pid {pid} ({name}): {e}");
                    self.left_out.insert(pid);
                }
            }
        }
    }

    /// Records forgotten since the last call: what `/metrics` adds to its
    /// counter, which goes on across recorders (a counter that went back
    /// to 0 when the recorder starts again on new processes would read as
    /// a reset).
    pub fn newly_forgotten(&mut self) -> u64 {
        let n = self.forgotten - self.reported;
        self.reported = self.forgotten;
        n
    }

    /// Stops recording the processes it records that are not `watched`
    /// any more (they exited), so that a process reusing a pid is not
    /// recorded. What they recorded stays until it is too old.
    pub fn forget_gone(&mut self, watched: &BTreeSet<u32>) {
        let now = clock::monotonic_ns();
        for &pid in self.pids.difference(watched) {
            if let Entry::Vacant(gone) = self.gone.entry(pid) {
                gone.insert(now);
                if let Err(e) = self.capture.forget_target(pid) {
                    eprintln!("ebtrace: flight recorder: pid {pid} exited; its probes: {e}");
                }
            }
        }
    }

    /// Drains the probes and forgets what is older than the retention.
    pub fn tick(&mut self) {
        self.capture.poll(Duration::ZERO);
        self.pace();
        let cutoff = clock::monotonic_ns().saturating_sub(self.retention.window.as_nanos() as u64);
        self.forgotten += self
            .capture
            .forget_before(cutoff, self.retention.max_records());
        // Every record of a process gone before the cutoff is forgotten:
        // so is the process.
        let expired: Vec<u32> = self
            .gone
            .iter()
            .filter(|(_, gone_ns)| **gone_ns < cutoff)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in expired {
            self.gone.remove(&pid);
            self.pids.remove(&pid);
            self.capture.drop_target(pid);
        }
    }

    /// How long until the ring buffer should be drained again: when it
    /// would be a fifth full at the rate it filled since the last drain
    /// (the probes wake a reader at a quarter), within [`DRAIN_PERIOD_MIN`]
    /// and [`DRAIN_PERIOD_MAX`]. At the longest, a 16 MiB ring takes a jump
    /// from nothing to 1M records a second without dropping any.
    pub fn drain_period(&self) -> Duration {
        self.drain_period
    }

    fn pace(&mut self) {
        let now = Instant::now();
        let usage = self.capture.ring_usage();
        if let Some((then, read)) = self.last_drain {
            self.drain_period = drain_period(
                usage.read.saturating_sub(read),
                now.duration_since(then),
                usage.size,
            );
        }
        self.last_drain = Some((now, usage.read));
    }

    /// The timeline of the last `--retain`, up to now.
    pub fn snapshot(&mut self, max_events: Option<usize>) -> Timeline {
        self.tick();
        let now = clock::monotonic_ns();
        let start = now
            .saturating_sub(self.retention.window.as_nanos() as u64)
            .max(self.capture.start_ns());
        let window = Window {
            start_ns: start,
            stop_ns: now,
            pids: None,
            max_events,
        };
        let dropped = self.capture.probe_stats().map_or(0, |p| p.dropped());
        let mut tl = self.capture.assemble_while_draining(&window, dropped, None);
        if self.forgotten > 0 {
            tl.stats.notes.push(format!(
                "flight recorder: {} older records forgotten so far (--retain {}, \
                 --retain-memory {} MiB)",
                self.forgotten,
                humantime::format_duration(self.retention.window),
                self.retention.memory_bytes / (1024 * 1024)
            ));
        }
        tl
    }

    /// What the watched processes did since the last call, for `/metrics`.
    pub fn take_activity(&mut self) -> ActivityTally {
        self.capture.take_activity()
    }

    /// Records held now.
    pub fn held(&self) -> usize {
        self.capture.held()
    }
}

/// When a ring of `ring_size` bytes that took `read` bytes in `elapsed`
/// would be a fifth full, within [`DRAIN_PERIOD_MIN`] and
/// [`DRAIN_PERIOD_MAX`].
fn drain_period(read: u64, elapsed: Duration, ring_size: usize) -> Duration {
    let bytes_per_s = read as f64 / elapsed.as_secs_f64().max(1e-3);
    Duration::try_from_secs_f64(ring_size as f64 / 5.0 / bytes_per_s.max(1.0))
        .unwrap_or(DRAIN_PERIOD_MAX)
        .clamp(DRAIN_PERIOD_MIN, DRAIN_PERIOD_MAX)
}

fn pids_list(pids: &BTreeSet<u32>) -> String {
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    /// A quiet target is drained at the longest period, a flood as often
    /// as its ring needs, and never so seldom that the fill of the last
    /// period, kept up, would pass a fifth of the ring.
    #[test]
    fn the_ring_is_drained_as_seldom_as_its_fill_allows() {
        let second = Duration::from_secs(1);
        assert_eq!(drain_period(0, second, 16 * MIB), DRAIN_PERIOD_MAX);
        assert_eq!(drain_period(300_000, second, 16 * MIB), DRAIN_PERIOD_MAX);
        // 550k records a second of 40 bytes in the ring: 22 MB/s.
        let flood = drain_period(22_000_000, second, 16 * MIB);
        assert!(
            flood > DRAIN_PERIOD_MIN && flood < DRAIN_PERIOD_MAX,
            "{flood:?}"
        );
        assert!(22_000_000.0 * flood.as_secs_f64() <= (16 * MIB) as f64 / 5.0 * 1.000_001);
        // The same flood in a 4 MiB ring: more often, still a fifth.
        let small_ring = drain_period(22_000_000, second, 4 * MIB);
        assert!(small_ring < flood / 2, "{small_ring:?}");
        assert!(22_000_000.0 * small_ring.as_secs_f64() <= (4 * MIB) as f64 / 5.0 * 1.000_001);
        // A flood past what any period keeps under a fifth: as often as
        // allowed.
        assert_eq!(drain_period(200_000_000, second, 4 * MIB), DRAIN_PERIOD_MIN);
        // A first period of no time at all reads as a flood, not a quiet one.
        assert_eq!(
            drain_period(1 << 20, Duration::ZERO, 16 * MIB),
            DRAIN_PERIOD_MIN
        );
    }
}
