//! The XSpace sink: the timeline model as an XProf `XSpace`.
//!
//! Layout (conventions from TSL's `xplane_schema`):
//! - `/host:CPU`: one line per traced thread (id = tid, name = thread name)
//!   and one per CPU that ran a traced thread (id = [`CPU_LINE_BASE`] + cpu,
//!   above any tid the kernel hands out and below XProf's derived-line ids).
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
//! CUDA calls) are laid above them, and [`split_at`] cuts a state slice at
//! every span boundary so both fit on one line.

use std::collections::HashMap;

use ebtrace_proto::tensorflow::profiler::{
    XEvent, XEventMetadata, XLine, XPlane, XSpace, XStat, XStatMetadata, x_event, x_stat,
};
use prost::Message as _;

use crate::timeline::{DeviceTrack, MarkKind, RunnableCause, ThreadState, Timeline};

pub const HOST_CPU_PLANE: &str = "/host:CPU";
pub const TASK_ENV_PLANE: &str = "Task Environment";
/// Prefix of the GPU planes; the device ordinal follows.
pub const GPU_PLANE_PREFIX: &str = "/device:GPU:";
/// Says, on each GPU plane, what its times are.
pub const HOST_OBSERVED_TIMING: &str = "host-observed: each event spans the driver call that \
     submitted the work, not its execution on the GPU (which needs CUPTI)";
/// First line id of the per-CPU lines (pid_max is at most 2^22).
pub const CPU_LINE_BASE: i64 = 0xFFFF_0000;

/// XProf flow stat: 2-bit direction, 56-bit id, 6-bit context type.
pub fn flow_stat_value(id: u64, direction: FlowDirection) -> u64 {
    const GENERIC_CONTEXT: u64 = 0;
    (direction as u64) | ((id & ((1 << 56) - 1)) << 2) | (GENERIC_CONTEXT << 58)
}

#[derive(Clone, Copy, Debug)]
#[repr(u64)]
pub enum FlowDirection {
    In = 1,
    Out = 2,
}

/// Stat values are the timeline's values.
pub use crate::timeline::Value as StatValue;

impl From<StatValue> for x_stat::Value {
    fn from(v: StatValue) -> Self {
        match v {
            StatValue::I64(v) => x_stat::Value::Int64Value(v),
            StatValue::U64(v) => x_stat::Value::Uint64Value(v),
            StatValue::F64(v) => x_stat::Value::DoubleValue(v),
            StatValue::Str(v) => x_stat::Value::StrValue(v),
        }
    }
}

/// Builds one `XPlane`, numbering event and stat metadata from 1 like
/// TSL's `XPlaneBuilder` and interning them by name. String stat values are
/// interned too and written as `ref_value`, as TSL does, so an event costs
/// no allocation per string. Lines are encoded as soon as they are added:
/// a capture's events never exist twice in memory.
pub struct XPlaneBuilder {
    plane: XPlane,
    events_by_name: HashMap<String, i64>,
    stats_by_name: HashMap<String, i64>,
    /// Encoded `lines` fields (field 3), in order.
    lines: Vec<u8>,
}

impl XPlaneBuilder {
    pub fn new(id: i64, name: &str) -> Self {
        XPlaneBuilder {
            plane: XPlane {
                id,
                name: name.to_string(),
                ..Default::default()
            },
            events_by_name: HashMap::new(),
            stats_by_name: HashMap::new(),
            lines: Vec::new(),
        }
    }

    pub fn event_metadata(&mut self, name: &str) -> i64 {
        if let Some(&id) = self.events_by_name.get(name) {
            return id;
        }
        let id = self.events_by_name.len() as i64 + 1;
        self.plane.event_metadata.insert(
            id,
            XEventMetadata {
                id,
                name: name.to_string(),
                ..Default::default()
            },
        );
        self.events_by_name.insert(name.to_string(), id);
        id
    }

    pub fn stat_metadata(&mut self, name: &str) -> i64 {
        if let Some(&id) = self.stats_by_name.get(name) {
            return id;
        }
        let id = self.stats_by_name.len() as i64 + 1;
        self.plane.stat_metadata.insert(
            id,
            XStatMetadata {
                id,
                name: name.to_string(),
                ..Default::default()
            },
        );
        self.stats_by_name.insert(name.to_string(), id);
        id
    }

    pub fn stat(&mut self, name: &str, value: StatValue) -> XStat {
        let value = match value {
            StatValue::Str(s) => x_stat::Value::RefValue(self.stat_metadata(&s) as u64),
            other => other.into(),
        };
        XStat {
            metadata_id: self.stat_metadata(name),
            value: Some(value),
        }
    }

    /// A string stat as `ref_value`, without allocating once both names are
    /// interned (the hot path: one or more per scheduling event).
    pub fn stat_ref(&mut self, name: &str, value: &str) -> XStat {
        XStat {
            metadata_id: self.stat_metadata(name),
            value: Some(x_stat::Value::RefValue(self.stat_metadata(value) as u64)),
        }
    }

    pub fn stat_i64(&mut self, name: &str, value: i64) -> XStat {
        XStat {
            metadata_id: self.stat_metadata(name),
            value: Some(x_stat::Value::Int64Value(value)),
        }
    }

    pub fn stat_u64(&mut self, name: &str, value: u64) -> XStat {
        XStat {
            metadata_id: self.stat_metadata(name),
            value: Some(x_stat::Value::Uint64Value(value)),
        }
    }

    /// An event whose stats are already built.
    pub fn event_with_stats(
        &mut self,
        name: &str,
        offset_ps: i64,
        duration_ps: i64,
        stats: Vec<XStat>,
    ) -> XEvent {
        XEvent {
            metadata_id: self.event_metadata(name),
            duration_ps,
            stats,
            data: Some(x_event::Data::OffsetPs(offset_ps)),
        }
    }

    pub fn add_plane_stat(&mut self, name: &str, value: StatValue) {
        let stat = self.stat(name, value);
        self.plane.stats.push(stat);
    }

    pub fn event(
        &mut self,
        name: &str,
        offset_ps: i64,
        duration_ps: i64,
        stats: Vec<(&str, StatValue)>,
    ) -> XEvent {
        let stats = stats.into_iter().map(|(n, v)| self.stat(n, v)).collect();
        XEvent {
            metadata_id: self.event_metadata(name),
            duration_ps,
            stats,
            data: Some(x_event::Data::OffsetPs(offset_ps)),
        }
    }

    /// Adds a line; its events are sorted so that parents precede children.
    pub fn add_line(&mut self, id: i64, name: &str, display_name: &str, mut events: Vec<XEvent>) {
        events.sort_by_key(|e| (offset_ps(e), std::cmp::Reverse(e.duration_ps)));
        let line = XLine {
            id,
            name: name.to_string(),
            display_name: display_name.to_string(),
            timestamp_ns: 0,
            events,
            ..Default::default()
        };
        prost::encoding::message::encode(3, &line, &mut self.lines);
    }

    /// Appends the plane to `out` as field `field` of the enclosing message.
    /// Protobuf allows a message's fields in any order and repeated fields
    /// in pieces, so the pre-encoded lines follow the rest of the plane.
    pub fn encode_as_field(self, field: u32, out: &mut Vec<u8>) {
        let head = self.plane.encode_to_vec();
        prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, out);
        prost::encoding::encode_varint((head.len() + self.lines.len()) as u64, out);
        out.extend_from_slice(&head);
        out.extend_from_slice(&self.lines);
    }
}

fn offset_ps(e: &XEvent) -> i64 {
    match e.data {
        Some(x_event::Data::OffsetPs(o)) => o,
        _ => 0,
    }
}

/// Cuts `[start, end)` at every boundary strictly inside it.
pub fn split_at(start: u64, end: u64, sorted_boundaries: &[u64]) -> Vec<(u64, u64)> {
    let first = sorted_boundaries.partition_point(|&b| b <= start);
    let mut pieces = Vec::new();
    let mut from = start;
    for &b in sorted_boundaries[first..].iter().take_while(|&&b| b < end) {
        if b > from {
            pieces.push((from, b));
            from = b;
        }
    }
    pieces.push((from, end));
    pieces
}

fn state_event_name(state: &ThreadState) -> &'static str {
    match state {
        ThreadState::Running { .. } => "Running",
        ThreadState::Runnable { .. } => "Runnable",
        ThreadState::Blocked { .. } => "Blocked",
        ThreadState::Unknown => "Unknown",
    }
}

fn state_stats(plane: &mut XPlaneBuilder, state: &ThreadState) -> Vec<XStat> {
    match *state {
        ThreadState::Running { cpu } => vec![plane.stat_i64("cpu", cpu.into())],
        ThreadState::Runnable { cause } => match cause {
            RunnableCause::Woken {
                waker_tid,
                waker_pid,
                flow_id,
            } => vec![
                plane.stat_ref("cause", "woken"),
                plane.stat_i64("waker_tid", waker_tid.into()),
                plane.stat_i64("waker_pid", waker_pid.into()),
                plane.stat_u64("flow", flow_stat_value(flow_id, FlowDirection::In)),
            ],
            RunnableCause::Preempted => vec![plane.stat_ref("cause", "preempted")],
            RunnableCause::Yielded => vec![plane.stat_ref("cause", "yielded")],
            RunnableCause::Created => vec![plane.stat_ref("cause", "new thread")],
            RunnableCause::AtStart => vec![plane.stat_ref("cause", "runnable at capture start")],
        },
        ThreadState::Blocked { state } => vec![plane.stat_ref("prev_state", state.describe())],
        ThreadState::Unknown => vec![plane.stat_ref(
            "reason",
            "the kernel reported no scheduler event for this interval",
        )],
    }
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
    let start = timeline.start_ns;
    let ps = |ns: u64| (ns.saturating_sub(start) as i64) * 1000;
    let mut host = XPlaneBuilder::new(0, HOST_CPU_PLANE);

    for t in timeline.threads.values() {
        let mut events = Vec::with_capacity(t.slices.len() + t.marks.len() + t.spans.len());
        // Spans sit above the states: cut each state at every span edge.
        let mut edges: Vec<u64> = t
            .spans
            .iter()
            .flat_map(|s| [s.start_ns, s.end_ns])
            .collect();
        edges.sort_unstable();
        edges.dedup();
        for s in &t.slices {
            let name = state_event_name(&s.state);
            if edges.is_empty() {
                let stats = state_stats(&mut host, &s.state);
                let (from, to) = (ps(s.start_ns), ps(s.end_ns));
                events.push(host.event_with_stats(name, from, to - from, stats));
                continue;
            }
            for (from, to) in split_at(s.start_ns, s.end_ns, &edges) {
                let stats = state_stats(&mut host, &s.state);
                events.push(host.event_with_stats(name, ps(from), ps(to) - ps(from), stats));
            }
        }
        for span in &t.spans {
            let stats = span
                .stats
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect();
            events.push(host.event(
                &span.name,
                ps(span.start_ns),
                ps(span.end_ns) - ps(span.start_ns),
                stats,
            ));
        }
        for m in &t.marks {
            let (name, stats) = match m.kind {
                MarkKind::Wakeup { tid, pid, flow_id } => (
                    "Wakeup",
                    vec![
                        host.stat_i64("woken_tid", tid.into()),
                        host.stat_i64("woken_pid", pid.into()),
                        host.stat_u64("flow", flow_stat_value(flow_id, FlowDirection::Out)),
                    ],
                ),
                MarkKind::ThreadCreated { tid } => {
                    ("Thread created", vec![host.stat_i64("tid", tid.into())])
                }
                MarkKind::ProcessForked { pid } => (
                    "Process forked",
                    vec![host.stat_i64("child_pid", pid.into())],
                ),
                MarkKind::Exited => ("Thread exit", vec![]),
            };
            events.push(host.event_with_stats(name, ps(m.ts_ns), 0, stats));
        }
        let process = timeline
            .processes
            .get(&t.pid)
            .map_or(String::new(), |p| p.name.clone());
        let display = format!("{} [{}] ({} {})", t.name, t.tid, process, t.pid);
        host.add_line(t.tid.into(), &t.name, &display, events);
    }

    for (cpu, slices) in &timeline.cpus {
        let events = slices
            .iter()
            .map(|s| {
                let stats = vec![
                    host.stat_i64("tid", s.tid.into()),
                    host.stat_i64("pid", s.pid.into()),
                ];
                let (from, to) = (ps(s.start_ns), ps(s.end_ns));
                match timeline.threads.get(&s.tid) {
                    Some(t) => host.event_with_stats(&t.name, from, to - from, stats),
                    None => {
                        host.event_with_stats(&format!("thread {}", s.tid), from, to - from, stats)
                    }
                }
            })
            .collect();
        let name = format!("CPU {cpu}");
        host.add_line(CPU_LINE_BASE + i64::from(*cpu), &name, &name, events);
    }

    let devices = timeline
        .devices
        .values()
        .map(|d| device_plane(d, &ps))
        .collect::<Vec<_>>();

    let mut env = XPlaneBuilder::new(1, TASK_ENV_PLANE);
    env.add_plane_stat(
        "profile_start_time",
        StatValue::U64(timeline.clock.to_wall_ns(timeline.start_ns)),
    );
    env.add_plane_stat(
        "profile_stop_time",
        StatValue::U64(timeline.clock.to_wall_ns(timeline.stop_ns)),
    );
    env.add_plane_stat(
        "ebtrace_version",
        StatValue::Str(env!("CARGO_PKG_VERSION").into()),
    );
    env.add_plane_stat("ebtrace_records", StatValue::U64(timeline.stats.records));
    env.add_plane_stat(
        "ebtrace_dropped_records",
        StatValue::U64(timeline.stats.dropped),
    );
    env.add_plane_stat(
        "ebtrace_unreported_transitions",
        StatValue::U64(timeline.stats.inconsistencies),
    );
    let pids = timeline
        .processes
        .keys()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    env.add_plane_stat("ebtrace_pids", StatValue::Str(pids));

    let mut warnings = Vec::new();
    if timeline.stats.dropped > 0 {
        warnings.push(format!(
            "ebtrace: {} records were dropped (ring buffer full); this trace is partial",
            timeline.stats.dropped
        ));
    }
    if timeline.stats.inconsistencies > 0 {
        warnings.push(format!(
            "ebtrace: {} scheduler transitions were not reported by the kernel; \
             the intervals they leave unexplained are marked Unknown",
            timeline.stats.inconsistencies
        ));
    }
    if let Some(why) = &timeline.stats.ended_early {
        warnings.push(format!("ebtrace: capture ended early: {why}"));
    }
    warnings.extend(
        timeline
            .stats
            .warnings
            .iter()
            .map(|w| format!("ebtrace: {w}")),
    );
    let mut out = XSpace {
        planes: vec![],
        errors: vec![],
        warnings,
        hostnames: vec![hostname.to_string()],
    }
    .encode_to_vec();
    host.encode_as_field(1, &mut out);
    for device in devices {
        device.encode_as_field(1, &mut out);
    }
    env.encode_as_field(1, &mut out);
    out
}

/// A GPU plane: one line per stream, events as recorded (they neither
/// overlap nor nest on a stream).
fn device_plane(device: &DeviceTrack, ps: &impl Fn(u64) -> i64) -> XPlaneBuilder {
    let mut plane = XPlaneBuilder::new(
        i64::from(device.ordinal),
        &format!("{GPU_PLANE_PREFIX}{}", device.ordinal),
    );
    plane.add_plane_stat("device_ordinal", StatValue::I64(device.ordinal.into()));
    plane.add_plane_stat(
        "ebtrace_timing",
        StatValue::Str(HOST_OBSERVED_TIMING.into()),
    );
    for stream in device.streams.values() {
        let events = stream
            .events
            .iter()
            .map(|e| {
                let stats = e
                    .stats
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.clone()))
                    .collect();
                plane.event(
                    &e.name,
                    ps(e.start_ns),
                    ps(e.end_ns) - ps(e.start_ns),
                    stats,
                )
            })
            .collect();
        let name = format!("Stream #{}", stream.id);
        let display = format!("{name} ({}; host-observed)", stream.label);
        plane.add_line(stream.id, &name, &display, events);
    }
    plane
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use super::*;
    use crate::{
        clock::ClockSync,
        timeline::{CaptureStats, StateSlice, TaskState, ThreadCounters, ThreadTrack},
    };

    #[test]
    fn split_cuts_only_inside() {
        assert_eq!(split_at(10, 20, &[]), vec![(10, 20)]);
        assert_eq!(split_at(10, 20, &[5, 10, 20, 25]), vec![(10, 20)]);
        assert_eq!(
            split_at(10, 20, &[12, 12, 15]),
            vec![(10, 12), (12, 15), (15, 20)]
        );
    }

    #[test]
    fn flow_bits() {
        assert_eq!(flow_stat_value(5, FlowDirection::Out), (5 << 2) | 2);
        assert_eq!(flow_stat_value(5, FlowDirection::In) & 3, 1);
    }

    #[test]
    fn builds_relative_lines_and_task_environment() {
        let slices = vec![
            StateSlice {
                start_ns: 1_000,
                end_ns: 1_500,
                state: ThreadState::Running { cpu: 1 },
            },
            StateSlice {
                start_ns: 1_500,
                end_ns: 2_000,
                state: ThreadState::Blocked {
                    state: TaskState::Sleeping,
                },
            },
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
                    stats: vec![("step_num".into(), StatValue::I64(3))],
                }],
                counters: ThreadCounters::default(),
            },
        );
        let tl = Timeline {
            start_ns: 1_000,
            stop_ns: 2_000,
            clock: ClockSync::from_offset(1_000_000),
            processes: BTreeMap::new(),
            threads,
            cpus: BTreeMap::new(),
            devices: BTreeMap::new(),
            stats: CaptureStats::default(),
        };
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
        let env = &xs.planes[1];
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
}
