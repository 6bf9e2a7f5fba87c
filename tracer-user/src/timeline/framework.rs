//! What a framework's own profiler session recorded inside a target (its
//! XSpace, fetched by the agent), merged into the timeline:
//!
//! - the `/host:CPU` plane's events (TraceMe ranges, Python calls) become
//!   spans on the traced threads' lines, above ebtrace's scheduling
//!   states. TSL names a thread's line by its own thread id, libstdc++'s
//!   hash of the thread's `pthread_t`; [`ThreadIds`] maps those to kernel
//!   tids. A line whose thread ebtrace cannot name is dropped and counted;
//! - the other planes (`/host:metadata` with XLA's HLO protos, device
//!   planes) are carried as they are, their times moved onto the timeline's
//!   monotonic clock; the framework's `Task Environment` gives way to
//!   ebtrace's own.
//!
//! TSL writes times relative to its session's start
//! (`profile_start_time`, wall-clock ns); [`ClockSync`] maps them to
//! monotonic time. Everything read here comes from the target: any value.

use std::{collections::HashMap, sync::Arc};

use ebtrace_proto::{
    tensorflow::profiler::{XPlane, XStat, XStatMetadata, x_event::Data, x_stat},
    xspace_parts::{self, PartError},
};
use prost::Message as _;

use super::{
    Span, StatName, Timeline, Value,
    cuda::StreamTiming,
    stats::{Stat, Stats},
};
use crate::{clock::ClockSync, collect::agent::ThreadIds};

/// The plane of host threads in TSL's XSpaces.
pub const HOST_PLANE: &str = "/host:CPU";
/// TSL's plane of capture-wide facts; ebtrace writes its own.
pub const TASK_ENVIRONMENT_PLANE: &str = "Task Environment";

/// A plane of the framework's carried into the trace, its lines'
/// `timestamp_ns` in monotonic ns.
#[derive(Clone, Debug, PartialEq)]
pub struct CarriedPlane {
    /// The process whose session recorded it.
    pub pid: u32,
    /// The plane.
    pub plane: XPlane,
}

/// What became of a framework XSpace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameworkMerge {
    /// Events laid on thread lines as spans.
    pub spans: u64,
    /// Host lines whose thread ebtrace could not name.
    pub unnamed_lines: u64,
    /// Events on those lines.
    pub unnamed_events: u64,
    /// Planes carried over as they are.
    pub planes: u64,
    /// How much the process grew at most while the session recorded, in
    /// bytes.
    pub target_growth: u64,
    /// Events left out: decoded, they would have taken more than what
    /// was left of the capture's [`DecodeBudget`].
    pub events_over_budget: u64,
}

/// The most memory the framework sessions' XSpaces of one capture take
/// once decoded (spans, carried planes), in bytes. What the agents send is
/// bounded on the wire (1 GiB a capture), but an empty event, two bytes
/// there, decodes into tens.
pub const MAX_DECODED_FRAMEWORK_BYTES: usize = 512 << 20;

/// What is left of [`MAX_DECODED_FRAMEWORK_BYTES`] for one capture: each
/// plane (and host line) is weighed before it is decoded, and left out
/// when it would take more.
#[derive(Debug)]
pub struct DecodeBudget {
    left: usize,
}

impl Default for DecodeBudget {
    fn default() -> Self {
        DecodeBudget::new(MAX_DECODED_FRAMEWORK_BYTES)
    }
}

impl DecodeBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize) -> Self {
        DecodeBudget { left: bytes }
    }

    /// Takes `bytes` of it, if that much is left.
    fn take(&mut self, bytes: usize) -> bool {
        let fits = bytes <= self.left;
        if fits {
            self.left -= bytes;
        }
        fits
    }
}

/// How many events the plane encoded in `plane` holds.
fn events_of(plane: &[u8]) -> Result<u64, PartError> {
    xspace_parts::lines(plane).try_fold(0, |n, line| {
        Ok(n + xspace_parts::line_shape(line?)?.events as u64)
    })
}

/// Merges the XSpace `bytes` that process `pid`'s framework recorded, a
/// plane and an event at a time, each weighed against `budget` first.
/// Malformed bytes end the merge with the error; what came before them
/// stays merged and counted.
pub fn merge_framework_space(
    timeline: &mut Timeline,
    pid: u32,
    bytes: &[u8],
    threads: &ThreadIds,
    budget: &mut DecodeBudget,
) -> (FrameworkMerge, Result<(), PartError>) {
    let mut merge = FrameworkMerge::default();
    let mut space = Space {
        timeline,
        pid,
        threads,
        budget,
        merge: &mut merge,
    };
    let merged = space.merge_planes(bytes);
    (merge, merged)
}

/// One XSpace being merged.
struct Space<'a> {
    timeline: &'a mut Timeline,
    pid: u32,
    threads: &'a ThreadIds,
    budget: &'a mut DecodeBudget,
    merge: &'a mut FrameworkMerge,
}

impl Space<'_> {
    fn merge_planes(&mut self, bytes: &[u8]) -> Result<(), PartError> {
        // The planes up to the first malformed one are merged all the same.
        let mut planes = Vec::new();
        let mut malformed = None;
        for plane in xspace_parts::planes(bytes) {
            match plane.and_then(|p| Ok((p, xspace_parts::plane_name(p)?))) {
                Ok(named) => planes.push(named),
                Err(e) => {
                    malformed = Some(e);
                    break;
                }
            }
        }
        let base_wall_ns = match self.session_start(&planes)? {
            Some(base) => base,
            // Cut before its start time (TSL writes it last): no event can
            // be placed.
            None => match malformed {
                Some(e) => return Err(e),
                None => 0,
            },
        };
        let time = TimeBase {
            base_wall_ns,
            clock: self.timeline.clock,
        };
        for (plane, name) in planes {
            match name.as_str() {
                HOST_PLANE => self.add_host_plane(plane, &time)?,
                TASK_ENVIRONMENT_PLANE => {}
                _ => self.carry(plane, &time)?,
            }
        }
        malformed.map_or(Ok(()), Err)
    }

    /// When the session started (wall-clock ns), from its `Task
    /// Environment` plane's stats; only that plane's head is decoded.
    fn session_start(&mut self, planes: &[(&[u8], String)]) -> Result<Option<u64>, PartError> {
        let Some((environment, _)) = planes
            .iter()
            .find(|(_, name)| name == TASK_ENVIRONMENT_PLANE)
        else {
            return Ok(None);
        };
        if !self
            .budget
            .take(xspace_parts::decoded_head_bytes(environment)?)
        {
            return Ok(None);
        }
        let (head, _) = xspace_parts::plane_without_lines(environment)?;
        Ok(plane_stat_u64(&head, "profile_start_time"))
    }

    /// Carries a plane other than the host's into the trace as it is, its
    /// times moved onto the timeline's clock, if the budget has room.
    fn carry(&mut self, plane: &[u8], time: &TimeBase) -> Result<(), PartError> {
        if !self.budget.take(xspace_parts::decoded_plane_bytes(plane)?) {
            self.merge.events_over_budget += events_of(plane)?;
            return Ok(());
        }
        let mut plane = XPlane::decode(plane)?;
        for line in &mut plane.lines {
            line.timestamp_ns = time.line_start(line.timestamp_ns) as i64;
        }
        if let Some(ordinal) = gpu_ordinal(&plane.name) {
            give_way_on_gpu(self.timeline, self.pid, ordinal);
        }
        self.timeline.carried_planes.push(CarriedPlane {
            pid: self.pid,
            plane,
        });
        self.merge.planes += 1;
        Ok(())
    }

    /// Lays the host plane's events on the named threads' lines, an event
    /// at a time, each if the budget has room.
    fn add_host_plane(&mut self, plane: &[u8], time: &TimeBase) -> Result<(), PartError> {
        if !self.budget.take(xspace_parts::decoded_head_bytes(plane)?) {
            self.merge.events_over_budget += events_of(plane)?;
            return Ok(());
        }
        let (plane, lines) = xspace_parts::plane_without_lines(plane)?;
        // One name per metadata id, shared by its events.
        let mut names: HashMap<i64, Arc<str>> = HashMap::new();
        for line in lines {
            let (line, count, events) = xspace_parts::line_without_events(line)?;
            let Some(&tid) = self.threads.get(&line.id) else {
                self.merge.unnamed_lines += 1;
                self.merge.unnamed_events += count as u64;
                continue;
            };
            let line_start = time.line_start(line.timestamp_ns);
            let track = self
                .timeline
                .thread_track(tid, self.pid, || line.name.clone());
            // Millions of spans on one line: grown by doubling, the vector
            // would hold up to twice their room, and three times while it
            // moves. No more is reserved than the budget has room for.
            track
                .spans
                .reserve_exact(count.min(self.budget.left / size_of::<Span>()));
            for (seen, event) in events.enumerate() {
                let event = event?;
                let Some(Data::OffsetPs(offset_ps)) = event.data else {
                    continue;
                };
                let start_ns = line_start.saturating_add_signed(offset_ps / 1000);
                let end_ns = start_ns.saturating_add(event.duration_ps.max(0) as u64 / 1000);
                let metadata = plane.event_metadata.get(&event.metadata_id);
                let stats: Stats = metadata
                    .into_iter()
                    .flat_map(|m| &m.stats)
                    .chain(&event.stats)
                    .filter_map(|s| stat(&plane.stat_metadata, s))
                    .collect();
                // Each span weighed as it is laid: a line past the budget
                // keeps its first events, and the rest are counted.
                if !self
                    .budget
                    .take(size_of::<Span>() + stats.len() * size_of::<Stat>())
                {
                    self.merge.events_over_budget += (count - seen) as u64;
                    break;
                }
                let name = names
                    .entry(event.metadata_id)
                    .or_insert_with(|| match metadata {
                        Some(m) if !m.display_name.is_empty() => m.display_name.as_str().into(),
                        Some(m) => m.name.as_str().into(),
                        None => "".into(),
                    })
                    .clone();
                track.spans.push(Span {
                    start_ns,
                    end_ns,
                    name,
                    stats,
                    correlation: None,
                });
                self.merge.spans += 1;
            }
        }
        Ok(())
    }
}

/// `N` of a `/device:GPU:N` plane.
fn gpu_ordinal(name: &str) -> Option<u32> {
    name.strip_prefix("/device:GPU:")?.parse().ok()
}

/// A framework's session timed `pid`'s work on GPU `ordinal` itself (jax's
/// CUDA plugin runs CUPTI): its plane replaces the streams of `pid` that
/// ebtrace saw submitted from the host there, which would otherwise make a
/// second plane of the same name.
fn give_way_on_gpu(timeline: &mut Timeline, pid: u32, ordinal: u32) {
    let Some(device) = timeline.devices.get_mut(&ordinal) else {
        return;
    };
    device
        .streams
        .retain(|_, s| s.pid != pid || s.timing != StreamTiming::HostObserved);
    if device.streams.is_empty() {
        timeline.devices.remove(&ordinal);
    }
}

/// Maps a session's relative times to monotonic ns.
struct TimeBase {
    base_wall_ns: u64,
    clock: ClockSync,
}

impl TimeBase {
    fn line_start(&self, line_timestamp_ns: i64) -> u64 {
        let wall = (self.base_wall_ns as i64).saturating_add(line_timestamp_ns);
        self.clock.to_monotonic_ns(wall.max(0) as u64)
    }
}

/// Keeps the carried events `inside` accepts, cut as it says (the
/// window's rule for every track).
pub(super) fn clip_carried(
    planes: &mut [CarriedPlane],
    inside: &impl Fn(u64, u64) -> Option<(u64, u64)>,
) {
    for line in planes.iter_mut().flat_map(|p| &mut p.plane.lines) {
        let line_start = line.timestamp_ns.max(0) as u64;
        line.events.retain_mut(|e| {
            let Some(Data::OffsetPs(offset_ps)) = e.data else {
                return true;
            };
            let start = line_start.saturating_add_signed(offset_ps / 1000);
            let end = start.saturating_add(e.duration_ps.max(0) as u64 / 1000);
            let Some((a, b)) = inside(start, end) else {
                return false;
            };
            e.data = Some(Data::OffsetPs(offset_ps + (a - start) as i64 * 1000));
            if b - a != end - start {
                e.duration_ps = (b - a) as i64 * 1000;
            }
            true
        });
    }
}

/// A stat as a timeline value; bytes (serialized protos) are left out.
fn stat(metadata: &HashMap<i64, XStatMetadata>, s: &XStat) -> Option<(StatName, Value)> {
    let name = metadata.get(&s.metadata_id)?.name.clone();
    let value = match s.value.as_ref()? {
        x_stat::Value::DoubleValue(v) => Value::F64(*v),
        x_stat::Value::Uint64Value(v) => Value::U64(*v),
        x_stat::Value::Int64Value(v) => Value::I64(*v),
        x_stat::Value::StrValue(v) => Value::Str(v.as_str().into()),
        x_stat::Value::RefValue(id) => {
            Value::Str(metadata.get(&(*id as i64))?.name.as_str().into())
        }
        x_stat::Value::BytesValue(_) => return None,
    };
    Some((name.into(), value))
}

fn plane_stat_u64(plane: &XPlane, name: &str) -> Option<u64> {
    let id = plane.stat_metadata.values().find(|m| m.name == name)?.id;
    plane
        .stats
        .iter()
        .find(|s| s.metadata_id == id)
        .and_then(|s| match s.value {
            Some(x_stat::Value::Uint64Value(v)) => Some(v),
            Some(x_stat::Value::Int64Value(v)) => u64::try_from(v).ok(),
            _ => None,
        })
}

#[cfg(test)]
mod tests {

    use ebtrace_proto::tensorflow::profiler::{XEvent, XEventMetadata, XLine, XSpace};

    use super::*;
    use crate::timeline::Window;

    /// An XSpace jaxlib's own ProfilerSession wrote (see its README).
    fn jax_space() -> Vec<u8> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/real/jax_cpu_matmul.xplane.pb"
        );
        std::fs::read(path).expect("the jaxlib XSpace fixture")
    }

    fn empty_timeline(clock: ClockSync) -> Timeline {
        Timeline::empty(0, u64::MAX / 2, clock)
    }

    /// TSL's `Task Environment` plane of a session that started at
    /// `start` (wall-clock ns).
    fn environment_started_at(start: u64) -> XPlane {
        XPlane {
            name: TASK_ENVIRONMENT_PLANE.into(),
            stat_metadata: [(
                1,
                XStatMetadata {
                    id: 1,
                    name: "profile_start_time".into(),
                    ..Default::default()
                },
            )]
            .into(),
            stats: vec![XStat {
                metadata_id: 1,
                value: Some(x_stat::Value::Uint64Value(start)),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn host_events_become_spans_of_the_named_threads_and_the_rest_is_carried() {
        let bytes = jax_space();
        let space = XSpace::decode(bytes.as_slice()).unwrap();
        let host = space.planes.iter().find(|p| p.name == HOST_PLANE).unwrap();
        let start = plane_stat_u64(
            space
                .planes
                .iter()
                .find(|p| p.name == TASK_ENVIRONMENT_PLANE)
                .unwrap(),
            "profile_start_time",
        )
        .unwrap();
        // Name every line but the first.
        let threads: ThreadIds = host
            .lines
            .iter()
            .skip(1)
            .enumerate()
            .map(|(i, l)| (l.id, 1000 + i as u32))
            .collect();
        // Monotonic time 1 s before the session started.
        let clock = ClockSync::from_offset(start as i64 - 1_000_000_000);
        let mut tl = empty_timeline(clock);
        let (merge, merged) =
            merge_framework_space(&mut tl, 7, &bytes, &threads, &mut DecodeBudget::default());
        merged.unwrap();

        let events: u64 = host.lines.iter().map(|l| l.events.len() as u64).sum();
        assert_eq!(merge.unnamed_lines, 1);
        assert_eq!(merge.unnamed_events, host.lines[0].events.len() as u64);
        assert_eq!(merge.spans + merge.unnamed_events, events);
        let line = &host.lines[1];
        let track = &tl.threads[&1000];
        assert_eq!((track.pid, track.spans.len()), (7, line.events.len()));
        let first = &line.events[0];
        let Some(Data::OffsetPs(offset_ps)) = first.data else {
            panic!("an offset")
        };
        let span = &track.spans[0];
        assert_eq!(
            span.start_ns,
            1_000_000_000 + line.timestamp_ns as u64 + offset_ps as u64 / 1000
        );
        assert_eq!(span.end_ns - span.start_ns, first.duration_ps as u64 / 1000);
        assert_eq!(*span.name, *host.event_metadata[&first.metadata_id].name);

        // Everything but the host plane and TSL's Task Environment rides
        // along, on the monotonic clock.
        let carried: Vec<&str> = tl
            .carried_planes
            .iter()
            .map(|p| p.plane.name.as_str())
            .collect();
        let expected: Vec<&str> = space
            .planes
            .iter()
            .map(|p| p.name.as_str())
            .filter(|n| *n != HOST_PLANE && *n != TASK_ENVIRONMENT_PLANE)
            .collect();
        assert_eq!(carried, expected);
        assert!(carried.contains(&"/host:metadata"));
    }

    /// A GPU plane of the session replaces what ebtrace saw submitted to
    /// that GPU by the same process from the host, and nothing else.
    #[test]
    fn planes_past_the_budget_are_weighed_and_left_out_undecoded() {
        let bytes = jax_space();
        let space = XSpace::decode(bytes.as_slice()).unwrap();
        let events = |p: &XPlane| p.lines.iter().map(|l| l.events.len() as u64).sum::<u64>();
        // Nothing fits: every event is counted, none laid or carried.
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        let mut none = DecodeBudget::new(0);
        let (merge, merged) =
            merge_framework_space(&mut tl, 7, &bytes, &ThreadIds::new(), &mut none);
        merged.unwrap();
        let all: u64 = space
            .planes
            .iter()
            .filter(|p| p.name != TASK_ENVIRONMENT_PLANE)
            .map(events)
            .sum();
        assert!(all > 0);
        assert_eq!(merge.events_over_budget, all);
        assert!(tl.carried_planes.is_empty() && tl.threads.is_empty());
        // A plane of a million empty events (2 MB sent, over 50 MB decoded)
        // beside the session's own: it alone is left out of 32 MiB.
        let mut flooded = space.clone();
        flooded.planes.push(XPlane {
            name: "/device:flood".into(),
            lines: vec![XLine {
                events: vec![XEvent::default(); 1_000_000],
                ..Default::default()
            }],
            ..Default::default()
        });
        let bytes = flooded.encode_to_vec();
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        let mut budget = DecodeBudget::new(32 << 20);
        let (merge, merged) =
            merge_framework_space(&mut tl, 7, &bytes, &ThreadIds::new(), &mut budget);
        merged.unwrap();
        assert_eq!(merge.events_over_budget, 1_000_000);
        assert_eq!(merge.planes as usize, space.planes.len() - 2);
        assert!(
            tl.carried_planes
                .iter()
                .all(|p| p.plane.name != "/device:flood")
        );
    }

    /// A host line past what the budget has left keeps its first events,
    /// as many as fit, and counts the rest: a dense loop's session is cut,
    /// never lost whole.
    #[test]
    fn a_host_line_past_the_budget_keeps_its_first_events() {
        let events: Vec<XEvent> = (0..1000)
            .map(|i| XEvent {
                metadata_id: 1,
                data: Some(Data::OffsetPs(i * 1000)),
                duration_ps: 500,
                ..Default::default()
            })
            .collect();
        let host = XPlane {
            name: HOST_PLANE.into(),
            event_metadata: [(
                1,
                XEventMetadata {
                    id: 1,
                    name: "step".into(),
                    ..Default::default()
                },
            )]
            .into(),
            lines: vec![XLine {
                id: 42,
                events,
                ..Default::default()
            }],
            ..Default::default()
        };
        let head = xspace_parts::decoded_head_bytes(&host.encode_to_vec()).unwrap();
        let space = XSpace {
            planes: vec![host],
            ..Default::default()
        };
        let threads: ThreadIds = [(42, 4242)].into_iter().collect();
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        let mut budget = DecodeBudget::new(head + 400 * size_of::<Span>());
        let (merge, merged) =
            merge_framework_space(&mut tl, 7, &space.encode_to_vec(), &threads, &mut budget);
        merged.unwrap();
        assert_eq!((merge.spans, merge.events_over_budget), (400, 600));
        let spans = &tl.threads[&4242].spans;
        assert_eq!(spans.len(), 400);
        assert_eq!(spans[399].start_ns, 399);
    }

    #[test]
    fn a_sessions_gpu_plane_replaces_the_host_observed_streams_of_its_process() {
        use ebtrace_proto::tensorflow::profiler::XPlane;

        use crate::timeline::cuda::{DeviceTrack, StreamTrack};

        let stream = |id: i64, pid: u32, timing: StreamTiming| StreamTrack {
            id,
            pid,
            label: String::new(),
            timing,
            events: Vec::new(),
        };
        let device = |ordinal: u32, streams: Vec<StreamTrack>| DeviceTrack {
            ordinal,
            streams: streams.into_iter().map(|s| (s.id, s)).collect(),
        };
        let mut space = XSpace::decode(jax_space().as_slice()).unwrap();
        space.planes.push(XPlane {
            id: 100,
            name: "/device:GPU:0".into(),
            ..Default::default()
        });
        let bytes = space.encode_to_vec();
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        tl.devices.insert(
            0,
            device(
                0,
                vec![
                    stream(1, 7, StreamTiming::HostObserved),
                    stream(2, 8, StreamTiming::HostObserved),
                    stream(3, 7, StreamTiming::Device),
                ],
            ),
        );
        tl.devices
            .insert(1, device(1, vec![stream(1, 7, StreamTiming::HostObserved)]));
        let (_, merged) = merge_framework_space(
            &mut tl,
            7,
            &bytes,
            &ThreadIds::new(),
            &mut DecodeBudget::default(),
        );
        merged.unwrap();
        let kept: Vec<(i64, u32)> = tl.devices[&0]
            .streams
            .values()
            .map(|s| (s.id, s.pid))
            .collect();
        assert_eq!(kept, vec![(2, 8), (3, 7)]);
        assert_eq!(tl.devices[&1].streams.len(), 1);

        // Nothing left of the GPU: no plane of ebtrace's for it.
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        tl.devices
            .insert(0, device(0, vec![stream(1, 7, StreamTiming::HostObserved)]));
        let (_, merged) = merge_framework_space(
            &mut tl,
            7,
            &bytes,
            &ThreadIds::new(),
            &mut DecodeBudget::default(),
        );
        merged.unwrap();
        assert!(tl.devices.is_empty());
        assert!(
            tl.carried_planes
                .iter()
                .any(|p| p.plane.name == "/device:GPU:0")
        );
    }

    /// A session cut short (TSL writes its start time last) merges
    /// nothing it could not place; one with a malformed event keeps the
    /// events before it, and says so.
    #[test]
    fn a_malformed_space_keeps_only_what_it_can_place() {
        use ebtrace_proto::tensorflow::profiler::{XEvent, XLine};
        use prost::encoding::{WireType, encode_key, encode_varint};

        let bytes = jax_space();
        for cut in (1..bytes.len()).step_by(bytes.len() / 97 + 1) {
            let mut tl = empty_timeline(ClockSync::from_offset(0));
            let (merge, merged) = merge_framework_space(
                &mut tl,
                7,
                &bytes[..cut],
                &ThreadIds::new(),
                &mut DecodeBudget::default(),
            );
            assert!(merged.is_err(), "cut at {cut} of {}", bytes.len());
            assert_eq!((merge.spans, merge.planes), (0, 0), "cut at {cut}");
            assert!(tl.carried_planes.is_empty());
        }

        // A line of three events whose second does not decode.
        let event = |at: i64| XEvent {
            data: Some(Data::OffsetPs(at * 1000)),
            duration_ps: 1000,
            ..Default::default()
        };
        let mut line = XLine {
            id: 5,
            ..Default::default()
        }
        .encode_to_vec();
        let field = |out: &mut Vec<u8>, number: u32, payload: &[u8]| {
            encode_key(number, WireType::LengthDelimited, out);
            encode_varint(payload.len() as u64, out);
            out.extend_from_slice(payload);
        };
        field(&mut line, 4, &event(10).encode_to_vec());
        field(&mut line, 4, &[0x22, 0x09, 0x00]);
        field(&mut line, 4, &event(30).encode_to_vec());
        let environment = environment_started_at(1_000_000);
        let mut host = XPlane {
            name: HOST_PLANE.into(),
            ..Default::default()
        }
        .encode_to_vec();
        field(&mut host, 3, &line);
        let mut space = Vec::new();
        field(&mut space, 1, &environment.encode_to_vec());
        field(&mut space, 1, &host);

        let mut tl = empty_timeline(ClockSync::from_offset(0));
        let threads: ThreadIds = [(5, 1005)].into();
        let (merge, merged) =
            merge_framework_space(&mut tl, 7, &space, &threads, &mut DecodeBudget::default());
        assert!(merged.is_err());
        assert_eq!(merge.spans, 1);
        let span = &tl.threads[&1005].spans[0];
        assert_eq!((span.start_ns, span.end_ns), (1_000_010, 1_000_011));
    }

    /// A framework's host events keep the correlation ids its own GPU
    /// plane (carried as it is) links them by: ebtrace's links between
    /// its driver calls and their work are another thing, which the window
    /// removes when one end is missing.
    #[test]
    fn a_frameworks_own_correlation_ids_are_kept() {
        use ebtrace_proto::tensorflow::profiler::{XEvent, XLine};

        let correlation = |plane_stat: i64| XStat {
            metadata_id: plane_stat,
            value: Some(x_stat::Value::Uint64Value(5)),
        };
        let plane = |name: &str, line: i64| XPlane {
            name: name.into(),
            stat_metadata: [(
                9,
                XStatMetadata {
                    id: 9,
                    name: "correlation_id".into(),
                    ..Default::default()
                },
            )]
            .into(),
            lines: vec![XLine {
                id: line,
                timestamp_ns: 1_000,
                events: vec![XEvent {
                    data: Some(Data::OffsetPs(10_000)),
                    duration_ps: 5_000,
                    stats: vec![correlation(9)],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let environment = environment_started_at(1_000_000);
        let space = XSpace {
            planes: vec![environment, plane(HOST_PLANE, 5), plane("/device:GPU:0", 1)],
            ..Default::default()
        }
        .encode_to_vec();
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        let (merge, merged) = merge_framework_space(
            &mut tl,
            7,
            &space,
            &[(5, 1005)].into(),
            &mut DecodeBudget::default(),
        );
        merged.unwrap();
        assert_eq!((merge.spans, merge.planes), (1, 1));
        Window::between(0, u64::MAX / 2).apply(&mut tl);
        let span = &tl.threads[&1005].spans[0];
        assert_eq!(span.stats.get("correlation_id"), Some(&Value::U64(5)));
        assert_eq!(span.correlation, None, "not one of ebtrace's links");
    }

    #[test]
    fn the_window_cuts_carried_events_like_every_other_track() {
        let mut plane = XPlane {
            name: "/device:TEST:0".into(),
            ..XPlane::default()
        };
        plane
            .lines
            .push(ebtrace_proto::tensorflow::profiler::XLine {
                timestamp_ns: 1_000,
                events: [(0, 100), (400, 200), (900, 300)]
                    .into_iter()
                    .map(|(at, len)| ebtrace_proto::tensorflow::profiler::XEvent {
                        data: Some(Data::OffsetPs(at * 1000)),
                        duration_ps: len * 1000,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            });
        let mut tl = empty_timeline(ClockSync::from_offset(0));
        tl.carried_planes.push(CarriedPlane { pid: 7, plane });
        Window::between(1_450, 2_000).apply(&mut tl);
        let kept: Vec<(i64, i64)> = tl.carried_planes[0].plane.lines[0]
            .events
            .iter()
            .map(|e| match e.data {
                Some(Data::OffsetPs(o)) => (o / 1000, e.duration_ps / 1000),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(kept, vec![(450, 150), (900, 100)]);
    }
}
