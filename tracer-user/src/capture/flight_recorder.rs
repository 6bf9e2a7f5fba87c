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
//! its own drains them. So are PyTorch's ops: nothing is loaded into a
//! target for the recorder. A process that exits stays in it until its
//! records are too old (then nothing of it is kept): its last seconds are
//! what a snapshot after a crash is for. A process watched after it
//! started is recorded from then on, alongside the others. `ebtrace
//! serve` runs it and answers `GetSnapshot` with [`FlightRecorder::snapshot`].

use std::{
    collections::{BTreeMap, BTreeSet, btree_map::Entry},
    time::{Duration, Instant},
};

use tracer_common::SchedSwitch;

use super::{Capture, CaptureOptions, ProbeFamilies};
use crate::{
    agent::TraceMeRoute,
    attach::{ProbeSet, ProbeSetConfig},
    clock,
    cuda_api::DriverCalls,
    metrics::activity::ActivityTally,
    procfs::TargetProcess,
    timeline::{EventLimitFrom, Timeline, Window},
};

/// How much the flight recorder keeps.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    /// The last this long.
    pub window: Duration,
    /// At most this many bytes of ebtrace's resident memory while it
    /// records: what ebtrace takes without it, the records it holds and a
    /// snapshot built from them.
    pub memory_bytes: usize,
    /// CPU stack samples a second per CPU it records (0: none).
    pub cpu_sample_hz: u32,
}

/// What a snapshot takes while it is built and sent, per record held,
/// beside the record: its share of the thread states and of the XSpace
/// they make (about 2.7 events and 80 bytes of XSpace per scheduler
/// record), with room to spare. Measured on a flat-out ping-pong
/// (BENCHMARKS.md, "Flight recorder").
const SNAPSHOT_BYTES_PER_RECORD: usize = 160;

/// The memory a record takes, held and in a snapshot: held as the probes
/// wrote it (a scheduler record's size), and its share of the snapshot (a
/// snapshot decodes the records one at a time, as it builds from them).
const RECORD_BYTES: usize = size_of::<SchedSwitch>() + SNAPSHOT_BYTES_PER_RECORD;

/// The least room for records and a snapshot of them that a
/// `--retain-memory` must leave beside what ebtrace takes without them
/// (about 80,000 scheduler records).
const MIN_RECORD_ROOM: usize = 16 * 1024 * 1024;

/// What a recorder squeezed by ebtrace's own memory still keeps room for,
/// past `--retain-memory`, so that a snapshot shows the last moments.
const SQUEEZED_RECORD_ROOM: usize = MIN_RECORD_ROOM / 4;

/// What reading the symbols of the objects stack samples land in adds to
/// ebtrace's memory, about (the kernel's symbol table, libc's debug
/// information: 25 to 30 MiB here; a large library's take more, which the
/// recorder measures as they come).
const SYMBOLS_MEMORY: usize = 32 * 1024 * 1024;

/// How often the recorder measures what ebtrace takes beside it.
const MEASURE_PERIOD: Duration = Duration::from_secs(1);

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
    /// [`Self::memory_bytes`] beside the `beside` bytes ebtrace takes
    /// without them; however much that is, at least what
    /// [`SQUEEZED_RECORD_ROOM`] holds.
    fn max_records(&self, beside: usize) -> usize {
        self.memory_bytes
            .saturating_sub(beside)
            .max(SQUEEZED_RECORD_ROOM)
            / RECORD_BYTES
    }

    /// Whether [`Self::memory_bytes`] leaves [`MIN_RECORD_ROOM`] beside
    /// `resident` bytes, what ebtrace takes without records with its ring
    /// buffer of `ring_bytes` mapped, and beside the symbols it reads once
    /// stack samples come ([`SYMBOLS_MEMORY`]); what to do otherwise.
    pub fn check_room(&self, resident: usize, ring_bytes: usize) -> Result<(), String> {
        let symbols = if self.cpu_sample_hz > 0 {
            SYMBOLS_MEMORY
        } else {
            0
        };
        let needed = resident + symbols + MIN_RECORD_ROOM;
        if self.memory_bytes >= needed {
            return Ok(());
        }
        const MIB: usize = 1024 * 1024;
        Err(format!(
            "--retain-memory {} MiB leaves the flight recorder no room for records: ebtrace \
             itself takes {} MiB here, {} of them its ring buffer, and about {} more once it \
             has read the symbols its stack samples are named from; give --retain-memory {} or \
             more (or a smaller --ring-buffer-mib)",
            self.memory_bytes / MIB,
            resident.div_ceil(MIB),
            ring_bytes / MIB,
            symbols / MIB,
            needed.div_ceil(8 * MIB) * 8
        ))
    }
}

/// Why the flight recorder could not start.
#[derive(Debug, thiserror::Error)]
pub enum FlightRecorderError {
    /// Attaching its probes failed.
    #[error(transparent)]
    Attach(#[from] crate::error::Error),
    /// `--retain-memory` leaves it no room: what to do.
    #[error("{0}")]
    NoRoom(String),
}

/// The flight recorder: a capture of the watched processes that keeps only the last `--retain` of
/// what it recorded.
pub struct FlightRecorder {
    capture: Capture,
    pids: BTreeSet<u32>,
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
    /// What ebtrace takes beside the records it holds, in bytes: the
    /// lesser of the last two of [`Self::measure_memory`]'s readings, so
    /// that memory on its way back to the system when one was taken does
    /// not make it forget records.
    beside: usize,
    /// The last reading, and when it was taken.
    last_reading: (usize, Instant),
    /// Whether it said that ebtrace itself took so much of
    /// `--retain-memory` that it kept no more than the least it does.
    said_squeezed: bool,
}

impl FlightRecorder {
    /// Attaches its probes to `targets`: scheduling and CUDA driver calls,
    /// whatever tracer levels a request names (XProf's client asks for
    /// continuous profiling with `host_tracer_level` 0, meant for the
    /// device buffers of TPUs).
    pub fn start(
        targets: Vec<TargetProcess>,
        probe: &ProbeSetConfig,
        loaded: Option<ProbeSet>,
        retention: Retention,
    ) -> Result<Self, FlightRecorderError> {
        let families = ProbeFamilies {
            sched: true,
            cuda: true,
            traceme_level: 0,
            cpu_sample_hz: retention.cpu_sample_hz,
            // Off-CPU stacks slow every system call on the machine down
            // while taken: not for an always-on recorder.
            off_cpu_min: Duration::ZERO,
            python_frames: true,
        };
        let options = CaptureOptions {
            probe: probe.clone(),
            families,
            route: TraceMeRoute::Off,
            no_device_activity: true,
            // The agent hands PyTorch's ops over when a capture stops: for
            // the recorder's life its callbacks would cost every op and
            // fill their buffer. Captures served beside it take them.
            no_torch_ops: true,
            // A snapshot's kernels have names: the programs looked most of
            // theirs up before the recorder started.
            name_kernels_with_agent: true,
            // Those names make the runtime's lookup before each launch
            // worth nothing to a snapshot: it is not probed.
            driver_calls: DriverCalls::AlwaysOn,
            ..CaptureOptions::default()
        };
        let pids = targets.iter().map(|t| t.pid).collect();
        let capture = Capture::start_with(targets, &options, loaded)?;
        let beside = crate::procfs::own_resident_bytes();
        retention
            .check_room(beside, probe.ring_bytes as usize)
            .map_err(FlightRecorderError::NoRoom)?;
        eprintln!(
            "ebtrace: flight recorder on: keeping the last {} of pid {} (at most {} records: \
             with a snapshot of them and ebtrace's own {} MiB, {} MiB; probes attached in {} ms)",
            humantime::format_duration(retention.window),
            pids_list(&pids),
            retention.max_records(beside),
            beside.div_ceil(1024 * 1024),
            retention.memory_bytes / (1024 * 1024),
            capture.attach_time.as_millis()
        );
        Ok(FlightRecorder {
            capture,
            pids,
            retention,
            forgotten: 0,
            reported: 0,
            gone: BTreeMap::new(),
            left_out: BTreeSet::new(),
            last_drain: None,
            drain_period: DRAIN_PERIOD_MIN,
            beside,
            last_reading: (beside, Instant::now()),
            said_squeezed: false,
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
        self.forgotten += self.capture.forget_before(cutoff, self.max_records());
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

    /// Records it holds at most now.
    pub fn max_records(&self) -> usize {
        self.retention.max_records(self.beside)
    }

    /// Measures what ebtrace takes beside the records it holds (at most
    /// every [`MEASURE_PERIOD`]), which [`Self::max_records`] leaves out of
    /// `--retain-memory`: the symbols of the objects its stack samples are
    /// in, another capture's probes kept for the next. Only called while
    /// no capture or snapshot is in progress, and their memory given back:
    /// theirs would read as ebtrace's own.
    pub fn measure_memory(&mut self) {
        let (last, at) = self.last_reading;
        if at.elapsed() < MEASURE_PERIOD {
            return;
        }
        let reading = crate::procfs::own_resident_bytes().saturating_sub(self.capture.held_bytes());
        self.beside = reading.min(last);
        self.last_reading = (reading, Instant::now());
        // Said once: a reading that goes up and down about the line would
        // say it again and again.
        let squeezed = self.retention.memory_bytes < self.beside + MIN_RECORD_ROOM;
        if squeezed && !self.said_squeezed {
            eprintln!(
                "ebtrace: flight recorder: ebtrace itself now takes {} MiB of --retain-memory {} \
                 MiB (the symbols of the targets' objects among them): it keeps at most {} \
                 records, and may take more than --retain-memory; give it a larger one",
                self.beside.div_ceil(1024 * 1024),
                self.retention.memory_bytes / (1024 * 1024),
                self.max_records()
            );
            self.said_squeezed = true;
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
        let asked = now
            .saturating_sub(self.retention.window.as_nanos() as u64)
            .max(self.capture.start_ns());
        // Past a full --retain-memory the oldest records went: the window
        // starts where what it holds is whole, not with empty seconds.
        let start = asked.max(self.capture.complete_since_ns());
        let window = Window {
            start_ns: start,
            stop_ns: now,
            pids: None,
            max_events,
            max_events_from: EventLimitFrom::Request,
        };
        let dropped = self.capture.probe_stats().map_or(0, |p| p.dropped());
        let mut tl = self.capture.assemble_while_draining(&window, dropped, None);
        if start > asked {
            tl.stats.warnings.push(format!(
                "flight recorder: --retain-memory {} MiB holds the last {:.1} s of the {} asked \
                 for with --retain: it forgot older records to stay within it (a larger \
                 --retain-memory keeps more)",
                self.retention.memory_bytes / (1024 * 1024),
                (now - start) as f64 / 1e9,
                humantime::format_duration(self.retention.window)
            ));
        }
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

    fn retention(memory_mib: usize, cpu_sample_hz: u32) -> Retention {
        Retention {
            window: Duration::from_secs(30),
            memory_bytes: memory_mib * MIB,
            cpu_sample_hz,
        }
    }

    /// What ebtrace takes beside the records comes out of
    /// `--retain-memory`: the records and a snapshot of them fill the rest,
    /// and a squeezed recorder still keeps a few.
    #[test]
    fn records_fill_what_ebtrace_itself_leaves_of_the_memory() {
        let r = retention(256, 99);
        let alone = r.max_records(0);
        assert_eq!(alone, 256 * MIB / RECORD_BYTES);
        let beside = r.max_records(100 * MIB);
        assert_eq!(beside, 156 * MIB / RECORD_BYTES);
        assert!(beside * RECORD_BYTES + 100 * MIB <= 256 * MIB);
        let squeezed = r.max_records(300 * MIB);
        assert_eq!(squeezed, SQUEEZED_RECORD_ROOM / RECORD_BYTES);
        assert!(squeezed > 10_000, "{squeezed}");
    }

    /// Too little memory is refused with a size that leaves room, which
    /// itself passes the check (with room for symbols when stack samples
    /// are on).
    #[test]
    fn too_little_memory_is_refused_with_a_size_that_has_room() {
        let resident = 44 * MIB + 123;
        let room = |memory_mib, hz| retention(memory_mib, hz).check_room(resident, 16 * MIB);
        assert!(room(93, 99).is_ok());
        assert!(room(61, 0).is_ok());
        let why = room(92, 99).unwrap_err();
        assert!(
            why.contains("takes 45 MiB here, 16 of them its ring buffer"),
            "{why}"
        );
        let suggested = |why: &str| -> usize {
            why.split("give --retain-memory ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        let with_symbols = suggested(&why);
        assert_eq!(with_symbols % 8, 0, "{why}");
        assert!(room(with_symbols, 99).is_ok());
        let without = suggested(&room(60, 0).unwrap_err());
        assert!(without < with_symbols && room(without, 0).is_ok());
    }

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
