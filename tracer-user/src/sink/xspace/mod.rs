//! The XSpace sink: the timeline model as an XProf `XSpace`.
//!
//! Layout (conventions from TSL's `xplane_schema`):
//! - `/host:CPU`: one line per traced thread (id = tid, name = thread name),
//!   except those blocked through the whole capture, which have the same
//!   lines on [`BLOCKED_THREADS_PLANE`], and, past the 20 lines the trace
//!   viewer opens a process with, those without spans that ran least, on
//!   [`LEAST_RUN_THREADS_PLANE`].
//! - [`PER_CPU_PLANE`]: one line per CPU that ran a traced thread (id =
//!   [`CPU_LINE_BASE`] + cpu, above any tid the kernel hands out and below
//!   XProf's derived-line ids).
//! - `/device:GPU:<ordinal>` (plane id = ordinal): one line per stream (id =
//!   stream id, named `Stream #<id>`) with the work the host submitted to
//!   it; host-observed times, as the plane's `ebtrace_timing` stat says.
//! - `Task Environment`: `profile_start_time` / `profile_stop_time` (epoch
//!   ns) and ebtrace's capture accounting.
//!
//! Line timestamps are relative to the profile start (absolute epoch values
//! overflow XProf's trace viewer). Events on a line must nest and never
//! partially overlap: scheduling states partition a thread's time, so they
//! are leaves; instants sit inside them; spans from other sources (TraceMe,
//! CUDA calls) are laid above them, and a state slice is cut at every span
//! boundary so both fit on one line.

use std::io::{self, Cursor};

use ebtrace_proto::tensorflow::profiler::{XPlane, XSpace, x_event};
use prost::Message as _;

use crate::timeline::{DeviceTrack, Span, StreamTiming, Timeline};
use chunked::Chunked;

/// The plane of the traced threads' lines.
pub const HOST_CPU_PLANE: &str = "/host:CPU";
/// The per-CPU lines. XProf's trace viewer (2.22.3 and later) shows every
/// plane whose name starts with `/host:CPU` as a process, in name order.
pub const PER_CPU_PLANE: &str = "/host:CPU per CPU";
/// The lines of the threads that stayed blocked through the whole capture:
/// apart, they leave `/host:CPU` under the trace viewer's 20 lines past
/// which it opens a process collapsed.
pub const BLOCKED_THREADS_PLANE: &str = "/host:CPU threads blocked throughout";
/// The lines of the threads without events that ran least, where
/// `/host:CPU` would have had more lines than the trace viewer opens.
pub const LEAST_RUN_THREADS_PLANE: &str = "/host:CPU threads that ran least";
/// The plane of capture-wide facts: the window, ebtrace's version, record counts, the traced pids,
/// warnings.
pub const TASK_ENV_PLANE: &str = "Task Environment";
/// Prefix of the GPU planes; the device ordinal follows.
pub const GPU_PLANE_PREFIX: &str = "/device:GPU:";
/// Says, on a GPU plane whose lines are all host-observed, what its times are.
pub const HOST_OBSERVED_TIMING: &str = "host-observed: each event spans the driver call that \
     submitted the work, not its execution on the GPU (which needs CUPTI)";
/// Says it on a GPU plane whose lines the device timed.
pub const DEVICE_TIMING: &str = "device: each event starts and ends when the GPU ran the work, \
     as CUPTI's activity records say";
/// Says it on a GPU plane with both kinds of lines.
pub const MIXED_TIMING: &str = "mixed: lines marked host-observed span the driver calls that \
     submitted the work; the others are the GPU's own times (CUPTI)";
/// First line id of the per-CPU lines (pid_max is at most 2^22).
pub const CPU_LINE_BASE: i64 = 0xFFFF_0000;

/// XProf flow stat: 2-bit direction, 56-bit id, 6-bit context type.
pub fn flow_stat_value(id: u64, direction: FlowDirection) -> u64 {
    const GENERIC_CONTEXT: u64 = 0;
    (direction as u64) | ((id & ((1 << 56) - 1)) << 2) | (GENERIC_CONTEXT << 58)
}

/// Which end of an XProf flow (arrow) an event is.
#[derive(Clone, Copy, Debug)]
#[repr(u64)]
pub enum FlowDirection {
    /// The arrow ends at this event.
    In = 1,
    /// The arrow starts at this event.
    Out = 2,
}

mod chunked;
pub mod file;
mod host;
mod plane;
pub mod received;
mod task_env;
mod wire;

pub use plane::{PlaneOut, PlaneStream, SharedGroups, SharedStats, XPlaneBuilder};
pub use wire::{
    EncodeEvent, Encoded, EventStats, LineEvent, LineOut, Stat, encode_event, encode_line,
};

/// Stat values are the timeline's values.
pub use crate::timeline::Value as StatValue;

/// Queues a span (its stats interned) on the plane's current line.
fn push_span(plane: &mut XPlaneBuilder, span: &Span, ps: &impl Fn(u64) -> i64) {
    let id = plane.span_metadata(&span.name);
    let start = ps(span.start_ns);
    plane.push_span_event(id, start, ps(span.end_ns) - start, span);
}

/// Host name to record in the XSpace (XProf matches it to the file name).
pub fn local_hostname() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Converts a timeline into an XSpace for `hostname` (decoded form; sinks
/// that only write should use [`timeline_to_xspace_bytes`]).
pub fn timeline_to_xspace(timeline: &Timeline, hostname: &str) -> XSpace {
    XSpace::decode(timeline_to_xspace_bytes(timeline, hostname).as_slice())
        .expect("we encode valid XSpaces")
}

/// Converts a timeline into an encoded XSpace for `hostname`.
pub fn timeline_to_xspace_bytes(timeline: &Timeline, hostname: &str) -> Vec<u8> {
    // Room for all of it at once (an event takes about 30 bytes): growing
    // a buffer of tens of MB by doubling copies it each time.
    let mut out = Cursor::new(Vec::with_capacity(32 * timeline.event_count_bound()));
    write_xspace(timeline, hostname, &mut out).expect("a Vec grows as needed");
    out.into_inner()
}

/// Writes `timeline` as an encoded XSpace for `hostname` to `out`, each
/// line as it is made: the trace is never held whole.
pub fn write_xspace<W: PlaneOut>(
    timeline: &Timeline,
    hostname: &str,
    out: &mut W,
) -> io::Result<()> {
    write_planes(timeline, out)?;
    out.write_all(&closing_part(timeline, hostname, &[]))
}

/// Writes the planes of `timeline`'s XSpace to `out`, the most looked at
/// first, saying where each ends ([`PlaneOut::part_done`]); the XSpace
/// ends with [`closing_part`].
pub fn write_planes<W: PlaneOut>(timeline: &Timeline, out: &mut W) -> io::Result<()> {
    let start = timeline.start_ns;
    let ps = |ns: u64| (ns.saturating_sub(start) as i64) * 1000;
    // The per-CPU lines and the GPU planes are encoded beside the
    // threads' lines, on a thread of their own, and written in their
    // places: a snapshot of a launch loop has as many events on its GPU
    // plane as calls on its threads. They are copied a chunk at a time,
    // each freed once copied: a flight recorder's snapshot must stay
    // within its memory.
    let (per_cpu, devices) = std::thread::scope(|scope| {
        let beside = std::thread::Builder::new()
            .name("ebtrace-xspace".into())
            .spawn_scoped(scope, || {
                let mut per_cpu = Chunked::default();
                host::write_per_cpu_lines(timeline, &ps, &mut per_cpu)?;
                let mut devices = Vec::new();
                for device in timeline.devices.values() {
                    let mut plane = Chunked::default();
                    write_device_plane(device, &ps, &mut plane)?;
                    devices.push((format!("{GPU_PLANE_PREFIX}{}", device.ordinal), plane));
                }
                io::Result::Ok((per_cpu, devices))
            })
            .expect("a thread to encode the per-CPU and GPU planes");
        host::write_threads_plane(timeline, &ps, out)?;
        out.part_done(HOST_CPU_PLANE)?;
        beside
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })?;
    per_cpu.write_into(out)?;
    out.part_done(PER_CPU_PLANE)?;
    host::write_blocked_plane(timeline, &ps, out)?;
    out.part_done(BLOCKED_THREADS_PLANE)?;
    host::write_least_run_plane(timeline, &ps, out)?;
    out.part_done(LEAST_RUN_THREADS_PLANE)?;
    for (name, plane) in devices {
        plane.write_into(out)?;
        out.part_done(&name)?;
    }
    write_carried_planes(timeline, out)
}

/// What an XSpace of `timeline` ends with, after its planes: the Task
/// Environment plane, the trace's warnings and then `more`, the host name.
pub fn closing_part(timeline: &Timeline, hostname: &str, more: &[String]) -> Vec<u8> {
    let mut warnings = task_env::trace_warnings(timeline);
    warnings.extend_from_slice(more);
    let mut closing = task_env::task_environment_plane(timeline).into_field(1);
    XSpace {
        planes: vec![],
        errors: vec![],
        warnings,
        hostnames: vec![hostname.to_string()],
    }
    .encode(&mut closing)
    .expect("a Vec grows as needed");
    closing
}

/// Writes the planes carried from the frameworks' own sessions, their
/// times relative to the trace's start.
fn write_carried_planes<W: PlaneOut>(timeline: &Timeline, out: &mut W) -> io::Result<()> {
    let mut carried = Vec::new();
    for plane in &timeline.carried_planes {
        carried.clear();
        XSpace {
            planes: vec![relative_to(&plane.plane, timeline.start_ns)],
            ..XSpace::default()
        }
        .encode(&mut carried)
        .expect("a Vec grows as needed");
        out.write_all(&carried)?;
        out.part_done(&plane.plane.name)?;
    }
    Ok(())
}

/// A carried plane with its times made relative to the trace's start, as
/// every plane of the trace has them (a line starting before it keeps its
/// events' times by moving them).
fn relative_to(plane: &XPlane, start_ns: u64) -> XPlane {
    let mut plane = plane.clone();
    for line in &mut plane.lines {
        let relative = line.timestamp_ns.saturating_sub(start_ns as i64);
        line.timestamp_ns = relative.max(0);
        if relative < 0 {
            let shift_ps = relative.saturating_mul(1000);
            for e in &mut line.events {
                if let Some(x_event::Data::OffsetPs(o)) = &mut e.data {
                    *o = o.saturating_add(shift_ps);
                }
            }
        }
    }
    plane
}

/// Writes a GPU plane: one line per stream, events as recorded (they
/// neither overlap nor nest on a stream).
fn write_device_plane<W: PlaneOut>(
    device: &DeviceTrack,
    ps: &impl Fn(u64) -> i64,
    out: &mut W,
) -> io::Result<()> {
    let mut plane = XPlaneBuilder::new(
        i64::from(device.ordinal),
        &format!("{GPU_PLANE_PREFIX}{}", device.ordinal),
    );
    plane.add_plane_stat("device_ordinal", &StatValue::I64(device.ordinal.into()));
    let timed_by = |t| device.streams.values().any(|s| s.timing == t);
    let timing = match (
        timed_by(StreamTiming::HostObserved),
        timed_by(StreamTiming::Device),
    ) {
        (true, true) => MIXED_TIMING,
        (false, true) => DEVICE_TIMING,
        _ => HOST_OBSERVED_TIMING,
    };
    plane.add_plane_stat("ebtrace_timing", &StatValue::Str(timing.into()));
    let mut lines = PlaneStream::begin(out, 1)?;
    for stream in device.streams.values() {
        let stats = stream
            .events
            .iter()
            .map(|e| e.stats.own().len() + usize::from(e.correlation.is_some()))
            .sum();
        plane.reserve_exact(stream.events.len(), stats);
        for e in &stream.events {
            push_span(&mut plane, e, ps);
        }
        let name = format!("Stream #{}", stream.id);
        let display = match stream.timing {
            StreamTiming::HostObserved => format!("{name} ({}; host-observed)", stream.label),
            StreamTiming::Device => format!("{name} ({})", stream.label),
        };
        lines.line(|out| plane.finish_line_into(out, stream.id, &name, &display))?;
    }
    lines.end(plane)
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use ebtrace_proto::tensorflow::profiler::{XEvent, x_event, x_stat};

    use super::*;
    use crate::{
        clock::ClockSync,
        timeline::{CaptureStats, StateSlice, TaskState, ThreadCounters, ThreadState, ThreadTrack},
    };

    fn offset_ps(e: &XEvent) -> i64 {
        match e.data {
            Some(x_event::Data::OffsetPs(o)) => o,
            _ => 0,
        }
    }

    /// Written to a file, as `record` writes it, `tl` reads as it does in
    /// memory, as `serve` answers (where lines are encoded in place).
    fn assert_file_and_memory_agree(tl: &Timeline) {
        let path = std::env::temp_dir().join(format!(
            "ebtrace-xspace-{}-{}.pb",
            std::process::id(),
            tl.threads.len()
        ));
        let mut file = io::BufWriter::new(std::fs::File::create(&path).unwrap());
        write_xspace(tl, "host", &mut file).unwrap();
        file.into_inner().unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        // Metadata maps are encoded in no set order: compare what they say.
        let read = |bytes: &[u8]| XSpace::decode(bytes).expect("an XSpace");
        assert_eq!(read(&on_disk), read(&timeline_to_xspace_bytes(tl, "host")));
    }

    #[test]
    fn flow_bits() {
        assert_eq!(flow_stat_value(5, FlowDirection::Out), (5 << 2) | 2);
        assert_eq!(flow_stat_value(5, FlowDirection::In) & 3, 1);
    }

    #[test]
    fn builds_relative_lines_and_task_environment() {
        let slices = vec![
            StateSlice::new(1_000, 1_500, ThreadState::Running { cpu: 1 }),
            StateSlice::new(
                1_500,
                2_000,
                ThreadState::Blocked {
                    state: TaskState::Sleeping,
                },
            ),
        ];
        let mut threads = BTreeMap::new();
        threads.insert(
            42,
            ThreadTrack {
                tid: 42,
                pid: 42,
                name: "worker".into(),
                slices,
                marks: vec![],
                spans: vec![crate::timeline::Span {
                    start_ns: 1_200,
                    end_ns: 1_700,
                    name: "step".into(),
                    stats: vec![("step_num".into(), StatValue::I64(3))].into(),
                    correlation: None,
                }],
                counters: ThreadCounters::default(),
            },
        );
        let tl = window_of(threads, 1_000_000);
        assert_file_and_memory_agree(&tl);
        let xs = timeline_to_xspace(&tl, "host");
        assert_eq!(xs.hostnames, vec!["host"]);
        let cpu = &xs.planes[0];
        assert_eq!(cpu.name, HOST_CPU_PLANE);
        let line = &cpu.lines[0];
        assert_eq!(
            (line.id, line.name.as_str(), line.timestamp_ns),
            (42, "worker", 0)
        );
        let names: HashMap<i64, &str> = cpu
            .event_metadata
            .values()
            .map(|m| (m.id, m.name.as_str()))
            .collect();
        let ev: Vec<(&str, i64, i64)> = line
            .events
            .iter()
            .map(|e| (names[&e.metadata_id], offset_ps(e), e.duration_ps))
            .collect();
        // The span sits above the states, which are cut at its edges.
        assert_eq!(
            ev,
            vec![
                ("Running", 0, 200_000),
                ("step", 200_000, 500_000),
                ("Running", 200_000, 300_000),
                ("Blocked", 500_000, 200_000),
                ("Blocked", 700_000, 300_000),
            ]
        );
        let env = xs.planes.iter().find(|p| p.name == TASK_ENV_PLANE).unwrap();
        let stat_names: HashMap<i64, &str> = env
            .stat_metadata
            .values()
            .map(|m| (m.id, m.name.as_str()))
            .collect();
        let start = env
            .stats
            .iter()
            .find(|s| stat_names[&s.metadata_id] == "profile_start_time")
            .unwrap();
        assert_eq!(start.value, Some(x_stat::Value::Uint64Value(1_001_000)));
    }

    /// A timeline of `threads` over [1000, 2000) ns, its clock `offset_ns`
    /// from the wall clock.
    fn window_of(threads: BTreeMap<u32, ThreadTrack>, offset_ns: i64) -> Timeline {
        Timeline {
            start_ns: 1_000,
            stop_ns: 2_000,
            clock: ClockSync::from_offset(offset_ns),
            processes: BTreeMap::new(),
            peers: Vec::new(),
            threads,
            devices: BTreeMap::new(),
            carried_planes: Vec::new(),
            stats: CaptureStats::default(),
        }
    }

    fn thread(tid: u32, slices: Vec<StateSlice>) -> ThreadTrack {
        ThreadTrack {
            tid,
            pid: 7,
            name: format!("t{tid}"),
            slices,
            marks: vec![],
            spans: vec![],
            counters: ThreadCounters::default(),
        }
    }

    /// A stretch on a CPU taken from the samples is "Running" with its CPU
    /// and a reason, on the thread's line and on its CPU's.
    #[test]
    fn running_seen_in_samples_says_so() {
        let mut threads = BTreeMap::new();
        threads.insert(
            7,
            thread(
                7,
                vec![
                    StateSlice::new(1_000, 1_400, ThreadState::Unknown),
                    StateSlice::new(1_400, 2_000, ThreadState::Sampled { cpu: 2 }),
                ],
            ),
        );
        let tl = window_of(threads, 0);
        assert_file_and_memory_agree(&tl);
        let xs = timeline_to_xspace(&tl, "host");
        let host = &xs.planes[0];
        let text = |id: i64| host.stat_metadata[&id].name.as_str();
        let events: Vec<(&str, Vec<(&str, String)>)> = host.lines[0]
            .events
            .iter()
            .map(|e| {
                let stats = e
                    .stats
                    .iter()
                    .map(|s| {
                        let value = match s.value {
                            Some(x_stat::Value::RefValue(r)) => text(r as i64).to_string(),
                            Some(x_stat::Value::Int64Value(v)) => v.to_string(),
                            ref other => format!("{other:?}"),
                        };
                        (text(s.metadata_id), value)
                    })
                    .collect();
                (host.event_metadata[&e.metadata_id].name.as_str(), stats)
            })
            .collect();
        assert_eq!(events[0].0, "Unknown");
        assert_eq!(events[1].0, "Running");
        assert_eq!(events[1].1[0], ("cpu", "2".to_string()));
        assert_eq!(events[1].1[1].0, "reason");
        assert!(events[1].1[1].1.contains("stack samples"), "{events:?}");
        let per_cpu = xs.planes.iter().find(|p| p.name == PER_CPU_PLANE).unwrap();
        assert_eq!(per_cpu.lines[0].id, CPU_LINE_BASE + 2);
        assert_eq!(per_cpu.lines[0].events.len(), 1);
    }

    #[test]
    fn past_twenty_active_threads_those_without_events_that_ran_least_move() {
        let running = |tid: u32| {
            let mut t = thread(
                tid,
                vec![StateSlice::new(
                    1_000,
                    2_000,
                    ThreadState::Running { cpu: 0 },
                )],
            );
            t.counters.on_cpu_ns = u64::from(tid);
            t
        };
        let mut threads: BTreeMap<u32, ThreadTrack> = (1..=24).map(|t| (t, running(t))).collect();
        // Ran least, but with an event: it stays.
        threads
            .get_mut(&1)
            .unwrap()
            .spans
            .push(crate::timeline::Span {
                start_ns: 1_200,
                end_ns: 1_700,
                name: "step".into(),
                stats: Vec::new().into(),
                correlation: None,
            });
        // ebtrace's own thread goes first, however much it ran.
        let mut agent = running(99);
        agent.name = "ebtrace-agent".into();
        agent.counters.on_cpu_ns = 1_000;
        threads.insert(99, agent);
        let tl = window_of(threads, 0);
        assert_file_and_memory_agree(&tl);
        let xs = timeline_to_xspace(&tl, "host");
        let tids = |name: &str| -> Vec<i64> {
            let plane = xs.planes.iter().find(|p| p.name == name).unwrap();
            let mut ids: Vec<i64> = plane.lines.iter().map(|l| l.id).collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(tids(LEAST_RUN_THREADS_PLANE), [2, 3, 4, 5, 99]);
        let shown = tids(HOST_CPU_PLANE);
        assert_eq!(shown.len(), 20);
        assert_eq!(shown[..2], [1, 6]);
    }

    #[test]
    fn idle_threads_and_cpus_get_planes_of_their_own() {
        let slice = |start_ns, end_ns, state| StateSlice::new(start_ns, end_ns, state);
        let blocked = ThreadState::Blocked {
            state: TaskState::DiskSleep,
        };
        let mut threads = BTreeMap::new();
        threads.insert(
            7,
            thread(
                7,
                vec![
                    slice(1_000, 1_500, ThreadState::Running { cpu: 3 }),
                    slice(1_500, 2_000, blocked),
                ],
            ),
        );
        threads.insert(8, thread(8, vec![slice(1_000, 2_000, blocked)]));
        let tl = window_of(threads, 0);
        assert_file_and_memory_agree(&tl);
        let xs = timeline_to_xspace(&tl, "host");
        let names: Vec<&str> = xs.planes.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                HOST_CPU_PLANE,
                PER_CPU_PLANE,
                BLOCKED_THREADS_PLANE,
                TASK_ENV_PLANE
            ]
        );
        let lines = |i: usize| -> Vec<(i64, &str)> {
            xs.planes[i]
                .lines
                .iter()
                .map(|l| (l.id, l.display_name.as_str()))
                .collect()
        };
        assert_eq!(lines(0), [(7, "t7 [7] ( 7)")]);
        assert_eq!(lines(1), [(CPU_LINE_BASE + 3, "CPU 3")]);
        assert_eq!(lines(2), [(8, "t8 [8] ( 7)")]);
        // The idle thread keeps its state, with its stats.
        let idle = &xs.planes[2];
        let event = &idle.lines[0].events[0];
        assert_eq!(
            (offset_ps(event), event.duration_ps),
            (0, 1_000_000),
            "spans the capture"
        );
        let name = |id: &i64| idle.event_metadata[id].name.as_str();
        assert_eq!(name(&event.metadata_id), "Blocked");
        let stat = &event.stats[0];
        assert_eq!(idle.stat_metadata[&stat.metadata_id].name, "prev_state");
        let Some(x_stat::Value::RefValue(text)) = stat.value else {
            panic!("{stat:?}");
        };
        assert_eq!(
            idle.stat_metadata[&(text as i64)].name,
            TaskState::DiskSleep.describe()
        );
    }
}
