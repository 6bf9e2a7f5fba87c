//! Reading back the XSpace files ebtrace writes, with names resolved.

use std::{
    collections::{BTreeSet, HashMap},
    path::Path,
};

use ebtrace_proto::tensorflow::profiler::{XPlane, XSpace, x_event, x_stat};
use prost::Message as _;

pub fn load(path: &Path) -> XSpace {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    XSpace::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("decode {}: {e}", path.display()))
}

pub fn plane<'a>(space: &'a XSpace, name: &str) -> &'a XPlane {
    space
        .planes
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no plane {name}"))
}

/// A decoded stat value.
#[derive(Clone, Debug, PartialEq)]
pub enum Stat {
    I64(i64),
    U64(u64),
    F64(f64),
    Str(String),
    Bytes(Vec<u8>),
}

impl Stat {
    pub fn as_i64(&self) -> i64 {
        match self {
            Stat::I64(v) => *v,
            Stat::U64(v) => *v as i64,
            other => panic!("not an integer: {other:?}"),
        }
    }
    pub fn as_u64(&self) -> u64 {
        match self {
            Stat::U64(v) => *v,
            Stat::I64(v) => *v as u64,
            other => panic!("not an integer: {other:?}"),
        }
    }
    pub fn as_str(&self) -> &str {
        match self {
            Stat::Str(s) => s,
            other => panic!("not a string: {other:?}"),
        }
    }
}

/// An event with its name and stats resolved, times in ns from profile start.
#[derive(Clone, Debug)]
pub struct Event {
    pub name: String,
    pub start_ns: f64,
    pub duration_ns: f64,
    pub stats: HashMap<String, Stat>,
}

impl Event {
    pub fn end_ns(&self) -> f64 {
        self.start_ns + self.duration_ns
    }
}

fn stat_value(plane: &XPlane, v: &Option<x_stat::Value>) -> Stat {
    match v.as_ref().expect("stat has a value") {
        x_stat::Value::DoubleValue(d) => Stat::F64(*d),
        x_stat::Value::Uint64Value(u) => Stat::U64(*u),
        x_stat::Value::Int64Value(i) => Stat::I64(*i),
        x_stat::Value::StrValue(s) => Stat::Str(s.clone()),
        x_stat::Value::BytesValue(b) => Stat::Bytes(b.clone()),
        x_stat::Value::RefValue(r) => Stat::Str(plane.stat_metadata[&(*r as i64)].name.clone()),
    }
}

/// Plane-level stats by name.
pub fn plane_stats(plane: &XPlane) -> HashMap<String, Stat> {
    plane
        .stats
        .iter()
        .map(|s| {
            (
                plane.stat_metadata[&s.metadata_id].name.clone(),
                stat_value(plane, &s.value),
            )
        })
        .collect()
}

/// Events of line `line_id` on `plane`, in file order.
pub fn line_events(plane: &XPlane, line_id: i64) -> Vec<Event> {
    let line = plane
        .lines
        .iter()
        .find(|l| l.id == line_id)
        .unwrap_or_else(|| panic!("no line {line_id} on {}", plane.name));
    line.events
        .iter()
        .map(|e| {
            let md = plane
                .event_metadata
                .get(&e.metadata_id)
                .unwrap_or_else(|| panic!("event metadata {} missing", e.metadata_id));
            let offset_ps = match e.data {
                Some(x_event::Data::OffsetPs(o)) => o,
                other => panic!("event without offset: {other:?}"),
            };
            Event {
                name: md.name.clone(),
                start_ns: (line.timestamp_ns as f64) + offset_ps as f64 / 1000.0,
                duration_ns: e.duration_ps as f64 / 1000.0,
                stats: e
                    .stats
                    .iter()
                    .map(|s| {
                        let name = plane
                            .stat_metadata
                            .get(&s.metadata_id)
                            .unwrap_or_else(|| panic!("stat metadata {} missing", s.metadata_id))
                            .name
                            .clone();
                        (name, stat_value(plane, &s.value))
                    })
                    .collect(),
            }
        })
        .collect()
}

/// The summed duration of the events named `name` (e.g. a thread's
/// `Running` time), ns.
pub fn sum_named(events: &[Event], name: &str) -> f64 {
    events
        .iter()
        .filter(|e| e.name == name)
        .map(|e| e.duration_ns)
        .sum()
}

/// Checks that the events of every line nest: none partially overlaps another.
pub fn assert_lines_nest(plane: &XPlane) {
    for line in &plane.lines {
        let events = line_events(plane, line.id);
        let mut open: Vec<f64> = Vec::new();
        for e in &events {
            while open.last().is_some_and(|&end| end <= e.start_ns) {
                open.pop();
            }
            if let Some(&end) = open.last() {
                assert!(
                    e.end_ns() <= end + 1e-3,
                    "line {} ({}): event {} [{}, {}] partially overlaps its parent ending at {end}",
                    line.id,
                    line.name,
                    e.name,
                    e.start_ns,
                    e.end_ns()
                );
            }
            open.push(e.end_ns());
        }
    }
}

/// `profile_start_time` and `profile_stop_time` (epoch ns).
pub fn profile_window(space: &XSpace) -> (u64, u64) {
    let env = plane_stats(plane(space, "Task Environment"));
    (
        env["profile_start_time"].as_u64(),
        env["profile_stop_time"].as_u64(),
    )
}

/// How many events named `name` `plane` has, on all its lines.
pub fn count_named(plane: &XPlane, name: &str) -> usize {
    plane
        .lines
        .iter()
        .flat_map(|l| line_events(plane, l.id))
        .filter(|e| e.name == name)
        .count()
}

/// The GPU planes (`/device:GPU:N`) of `space`.
pub fn gpu_planes(space: &XSpace) -> impl Iterator<Item = &XPlane> {
    space
        .planes
        .iter()
        .filter(|p| p.name.starts_with("/device:GPU:"))
}

/// Events on all GPU planes of `space`.
pub fn gpu_event_count(space: &XSpace) -> usize {
    gpu_planes(space)
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len())
        .sum()
}

/// The links between events that a viewer draws as arrows: wake-up flows
/// (the `flow` stat, by direction) and CUDA correlation ids (on the host
/// plane's driver calls, on the GPU planes' submitted work).
#[derive(Clone, Debug, Default)]
pub struct Links {
    pub flows_out: BTreeSet<u64>,
    pub flows_in: BTreeSet<u64>,
    pub calls: BTreeSet<u64>,
    pub submitted: BTreeSet<u64>,
}

/// Every link in `space`.
pub fn links(space: &XSpace) -> Links {
    let mut out = Links::default();
    for plane in &space.planes {
        let device = plane.name.starts_with("/device:GPU:");
        let names: HashMap<i64, &str> = plane
            .stat_metadata
            .values()
            .map(|m| (m.id, m.name.as_str()))
            .collect();
        for e in plane.lines.iter().flat_map(|l| &l.events) {
            for s in &e.stats {
                let Some(x_stat::Value::Uint64Value(v)) = s.value else {
                    continue;
                };
                match names.get(&s.metadata_id) {
                    Some(&"flow") if v & 3 == 2 => out.flows_out.insert(v >> 2),
                    Some(&"flow") if v & 3 == 1 => out.flows_in.insert(v >> 2),
                    Some(&"correlation_id") if device => out.submitted.insert(v),
                    Some(&"correlation_id") => out.calls.insert(v),
                    _ => false,
                };
            }
        }
    }
    out
}
