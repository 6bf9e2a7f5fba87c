//! `ebtrace convert FILE.xplane.pb --to perfetto`: an XSpace already
//! written (by ebtrace or by jaxlib / TensorFlow's own profiler) as a
//! Perfetto trace.
//!
//! Each plane becomes a track named after it, each of its lines a child
//! track named after the line (for host planes, the thread), each event a
//! slice on its line's track, with XSpace's wall-clock timestamps
//! (`CLOCK_REALTIME`). Event stats are not carried over, and scheduling
//! states stay slices: Perfetto's CPU and thread-state tracks need the
//! timeline, which `--perfetto` writes at capture time.

use std::{
    collections::HashMap,
    io::{self, Write},
};

use ebtrace_proto::{
    perfetto::protos::{
        BuiltinClock, ClockSnapshot, TracePacket, TrackDescriptor, clock_snapshot, trace_packet,
        track_descriptor,
    },
    tensorflow::profiler::{XPlane, XSpace, x_event},
};

use super::{PacketWriter, PerfettoClocks, PerfettoStats, write_spans};
use crate::timeline::{Cuts, Span, Stats, nest};

fn plane_uuid(plane: usize) -> u64 {
    5 << 56 | plane as u64
}
fn line_uuid(plane: usize, line: usize) -> u64 {
    6 << 56 | (plane as u64) << 32 | line as u64
}

/// Writes `space` as a Perfetto trace to `out`.
pub fn write_xspace<W: Write>(space: &XSpace, out: W) -> io::Result<PerfettoStats> {
    let realtime = BuiltinClock::Realtime as u32;
    let mut w = PacketWriter::new(out, Some(realtime));
    let first_ns = space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.timestamp_ns)
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0) as u64;
    w.packet(TracePacket {
        timestamp: Some(first_ns),
        timestamp_clock_id: Some(realtime),
        data: Some(trace_packet::Data::ClockSnapshot(ClockSnapshot {
            clocks: vec![clock_snapshot::Clock {
                clock_id: Some(realtime),
                timestamp: Some(first_ns),
            }],
            primary_trace_clock: Some(BuiltinClock::Realtime as i32),
        })),
        ..Default::default()
    })?;
    let name = |n: String| Some(track_descriptor::StaticOrDynamicName::Name(n));
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 0,
    };
    let mut spans = Vec::new();
    for (p, plane) in space.planes.iter().enumerate() {
        if plane.lines.is_empty() {
            continue;
        }
        w.track(TrackDescriptor {
            uuid: Some(plane_uuid(p)),
            static_or_dynamic_name: name(plane.name.clone()),
            ..Default::default()
        })?;
        let names = event_names(plane);
        for (l, line) in plane.lines.iter().enumerate() {
            let line_name = if line.display_name.is_empty() {
                &line.name
            } else {
                &line.display_name
            };
            w.track(TrackDescriptor {
                uuid: Some(line_uuid(p, l)),
                parent_uuid: Some(plane_uuid(p)),
                static_or_dynamic_name: name(line_name.clone()),
                ..Default::default()
            })?;
            // One line's events at a time, made to nest as the timeline's.
            spans.clear();
            let base_ps = i128::from(line.timestamp_ns) * 1000;
            spans.extend(line.events.iter().map(|e| {
                let offset_ps = match e.data {
                    Some(x_event::Data::OffsetPs(o)) => o,
                    _ => 0,
                };
                let start_ps = base_ps + i128::from(offset_ps);
                let start_ns = (start_ps / 1000).clamp(0, i128::from(u64::MAX)) as u64;
                let duration_ns = (e.duration_ps.max(0) / 1000) as u64;
                Span {
                    start_ns,
                    end_ns: start_ns.saturating_add(duration_ns),
                    name: names
                        .get(&e.metadata_id)
                        .map_or_else(|| "".into(), |n| n.as_str().into()),
                    stats: Stats::default(),
                    correlation: None,
                }
            }));
            nest(&mut spans, Cuts::Marked);
            write_spans(&mut w, clocks, line_uuid(p, l), &spans, false)?;
        }
    }
    w.out.flush()?;
    Ok(w.stats)
}

/// Event names by metadata id (the display name where there is one).
fn event_names(plane: &XPlane) -> HashMap<i64, String> {
    plane
        .event_metadata
        .iter()
        .map(|(&id, m)| {
            let n = if m.display_name.is_empty() {
                &m.name
            } else {
                &m.display_name
            };
            (id, n.clone())
        })
        .collect()
}
