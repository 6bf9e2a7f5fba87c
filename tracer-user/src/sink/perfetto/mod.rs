//! Perfetto's native trace format (`perfetto_trace.pb`), written from the
//! timeline.
//!
//! Perfetto's UI draws CPU tracks, per-thread state tracks and wake-up
//! arrows from ftrace `sched_switch` / `sched_waking` events, so the
//! scheduling slices go out as those ([`sched`]); TraceMe spans and driver
//! calls become track events on their threads, GPU stream work becomes
//! track events on one track per stream, linked to its launch by a flow.
//! CPU stack samples also go out as `PerfSample`s with interned callstacks
//! ([`samples`]), which Perfetto's UI draws as a CPU profile.
//!
//! The trace is written packet by packet (each a one-packet `Trace`, which
//! concatenates into one valid `Trace`): nothing but the current ftrace
//! bundle and the samples' interning tables (one entry per distinct stack
//! and frame) are kept, the timeline is only read.
//!
//! Timestamps are `CLOCK_BOOTTIME`, the clock Perfetto assumes for ftrace;
//! a clock snapshot ties it to `CLOCK_MONOTONIC` (the records' clock) and
//! `CLOCK_REALTIME`, so the trace lines up with other traces of the host.

pub mod convert;
mod samples;
mod sched;

use std::io::{self, Write};

use ebtrace_proto::perfetto::protos::{
    BuiltinClock, ClockSnapshot, DebugAnnotation, ProcessDescriptor, ThreadDescriptor, Trace,
    TracePacket, TrackDescriptor, TrackEvent, clock_snapshot, debug_annotation, trace_packet,
    track_descriptor, track_event,
};
use prost::Message as _;

use crate::{
    clock::{ClockId, now_ns},
    timeline::{CORRELATION_STAT, FlowEnd, Span, StatName, Timeline, Value},
};

/// File name written next to the `.xplane.pb`.
pub const FILE_NAME: &str = "perfetto_trace.pb";

/// The one packet sequence the track events are written on.
const SEQUENCE_ID: u32 = 1;

/// Track uuids: a kind in the top byte keeps the id spaces apart.
fn process_uuid(pid: u32) -> u64 {
    1 << 56 | u64::from(pid)
}
fn thread_uuid(tid: u32) -> u64 {
    2 << 56 | u64::from(tid)
}
fn device_uuid(ordinal: u32) -> u64 {
    3 << 56 | u64::from(ordinal)
}
fn stream_uuid(ordinal: u32, stream: i64) -> u64 {
    4 << 56 | u64::from(ordinal) << 32 | (stream as u64 & 0xffff_ffff)
}
/// Flow from a driver call to the stream work it submitted.
fn launch_flow(correlation: u64) -> u64 {
    1 << 62 | correlation
}

/// How the capture's monotonic clock maps to the clocks Perfetto knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerfettoClocks {
    /// `CLOCK_BOOTTIME` - `CLOCK_MONOTONIC` (time spent suspended), ns.
    pub boot_minus_mono_ns: u64,
}

impl PerfettoClocks {
    /// Reads the offset now; valid for a capture the host did not suspend in.
    pub fn measure() -> Self {
        let mono = now_ns(ClockId::Monotonic);
        let boot = now_ns(ClockId::Boottime);
        PerfettoClocks {
            boot_minus_mono_ns: boot.saturating_sub(mono),
        }
    }

    fn boot(&self, monotonic_ns: u64) -> u64 {
        monotonic_ns + self.boot_minus_mono_ns
    }
}

/// What a written trace holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerfettoStats {
    /// Trace packets written.
    pub packets: u64,
    /// `sched_switch` events in the ftrace bundles.
    pub sched_switches: u64,
    /// `sched_waking` events in the ftrace bundles.
    pub sched_wakings: u64,
    /// Track events (slice begins and ends, instants).
    pub track_events: u64,
    /// `PerfSample`s (CPU stack samples with their callstacks).
    pub perf_samples: u64,
    /// Encoded size of the trace.
    pub bytes: u64,
}

/// Writes packets as one-packet `Trace` messages, reusing one buffer.
struct PacketWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
    sequence_started: bool,
    /// Clock of the track events' timestamps; `None` is the trace's
    /// (boot time).
    clock_id: Option<u32>,
    stats: PerfettoStats,
}

impl<W: Write> PacketWriter<W> {
    fn new(out: W, clock_id: Option<u32>) -> Self {
        PacketWriter {
            out,
            buf: Vec::with_capacity(64 * 1024),
            sequence_started: false,
            clock_id,
            stats: PerfettoStats::default(),
        }
    }

    fn packet(&mut self, packet: TracePacket) -> io::Result<()> {
        self.buf.clear();
        Trace {
            packet: vec![packet],
        }
        .encode(&mut self.buf)
        .expect("a Vec grows as needed");
        self.out.write_all(&self.buf)?;
        self.stats.packets += 1;
        self.stats.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// A packet on the track-event sequence.
    fn sequenced(&mut self, ts_ns: Option<u64>, data: trace_packet::Data) -> io::Result<()> {
        let first = !std::mem::replace(&mut self.sequence_started, true);
        self.packet(TracePacket {
            timestamp: ts_ns,
            timestamp_clock_id: ts_ns.and(self.clock_id),
            data: Some(data),
            optional_trusted_packet_sequence_id: Some(
                trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(SEQUENCE_ID),
            ),
            interned_data: None,
            sequence_flags: first
                .then_some(trace_packet::SequenceFlags::SeqIncrementalStateCleared as u32),
            first_packet_on_sequence: first.then_some(true),
        })
    }

    fn track(&mut self, descriptor: TrackDescriptor) -> io::Result<()> {
        self.sequenced(None, trace_packet::Data::TrackDescriptor(descriptor))
    }

    fn event(&mut self, ts_ns: u64, event: TrackEvent) -> io::Result<()> {
        self.stats.track_events += 1;
        self.sequenced(Some(ts_ns), trace_packet::Data::TrackEvent(event))
    }
}

/// Writes `timeline` as a Perfetto trace to `out`.
pub fn write_timeline<W: Write>(
    timeline: &Timeline,
    clocks: PerfettoClocks,
    out: W,
) -> io::Result<PerfettoStats> {
    let mut w = PacketWriter::new(out, None);
    let t0 = timeline.start_ns;
    let clock = |id: BuiltinClock, ts: u64| clock_snapshot::Clock {
        clock_id: Some(id as u32),
        timestamp: Some(ts),
    };
    w.packet(TracePacket {
        timestamp: Some(clocks.boot(t0)),
        data: Some(trace_packet::Data::ClockSnapshot(ClockSnapshot {
            clocks: vec![
                clock(BuiltinClock::Boottime, clocks.boot(t0)),
                clock(BuiltinClock::Monotonic, t0),
                clock(BuiltinClock::Realtime, timeline.clock.to_wall_ns(t0)),
            ],
            primary_trace_clock: Some(BuiltinClock::Boottime as i32),
        })),
        ..Default::default()
    })?;

    write_descriptors(&mut w, timeline)?;
    for thread in timeline.threads.values() {
        write_spans(
            &mut w,
            clocks,
            thread_uuid(thread.tid),
            &thread.spans,
            false,
        )?;
    }
    samples::write_samples(&mut w, timeline, clocks)?;
    for device in timeline.devices.values() {
        for stream in device.streams.values() {
            let uuid = stream_uuid(device.ordinal, stream.id);
            write_spans(&mut w, clocks, uuid, &stream.events, true)?;
        }
    }
    sched::write_sched(&mut w, timeline, clocks)?;
    w.out.flush()?;
    Ok(w.stats)
}

/// Encodes the whole trace into memory.
pub fn timeline_to_perfetto_bytes(timeline: &Timeline, clocks: PerfettoClocks) -> Vec<u8> {
    let mut bytes = Vec::new();
    write_timeline(timeline, clocks, &mut bytes).expect("writing to a Vec does not fail");
    bytes
}

fn write_descriptors<W: Write>(w: &mut PacketWriter<W>, timeline: &Timeline) -> io::Result<()> {
    let name = |n: &str| Some(track_descriptor::StaticOrDynamicName::Name(n.to_string()));
    for process in timeline.processes.values() {
        w.track(TrackDescriptor {
            uuid: Some(process_uuid(process.pid)),
            process: Some(ProcessDescriptor {
                pid: Some(process.pid as i32),
                process_name: Some(process.name.clone()),
            }),
            ..Default::default()
        })?;
    }
    for thread in timeline.threads.values() {
        w.track(TrackDescriptor {
            uuid: Some(thread_uuid(thread.tid)),
            parent_uuid: Some(process_uuid(thread.pid)),
            thread: Some(ThreadDescriptor {
                pid: Some(thread.pid as i32),
                tid: Some(thread.tid as i32),
                thread_name: Some(thread.name.clone()),
            }),
            ..Default::default()
        })?;
    }
    for device in timeline.devices.values() {
        w.track(TrackDescriptor {
            uuid: Some(device_uuid(device.ordinal)),
            static_or_dynamic_name: name(&format!("GPU {}", device.ordinal)),
            ..Default::default()
        })?;
        for stream in device.streams.values() {
            w.track(TrackDescriptor {
                uuid: Some(stream_uuid(device.ordinal, stream.id)),
                parent_uuid: Some(device_uuid(device.ordinal)),
                static_or_dynamic_name: name(&format!("Stream #{} {}", stream.id, stream.label)),
                ..Default::default()
            })?;
        }
    }
    Ok(())
}

/// Writes nested spans (sorted by start, longest first, as
/// `timeline::nest` leaves them) as begin/end pairs on one track.
/// Spans carrying a `correlation_id` start a flow on a thread and end it
/// on a stream (`device` true); an arrow's ends ([`Value::Flow`]) start
/// and end theirs.
fn write_spans<W: Write>(
    w: &mut PacketWriter<W>,
    clocks: PerfettoClocks,
    track: u64,
    spans: &[Span],
    device: bool,
) -> io::Result<()> {
    let end = |w: &mut PacketWriter<W>, ts: u64| {
        w.event(
            clocks.boot(ts),
            TrackEvent {
                r#type: Some(track_event::Type::SliceEnd as i32),
                track_uuid: Some(track),
                ..Default::default()
            },
        )
    };
    let mut open: Vec<u64> = Vec::new();
    for span in spans {
        while let Some(&e) = open.last().filter(|&&e| e <= span.start_ns) {
            end(w, e)?;
            open.pop();
        }
        let flow = span.correlation.map(|c| launch_flow(c.get()));
        let (mut flow_ids, mut terminating_flow_ids) = (Vec::new(), Vec::new());
        match flow {
            Some(f) if device => terminating_flow_ids.push(f),
            Some(f) => flow_ids.push(f),
            None => {}
        }
        for (_, value) in span.stats.iter() {
            match value {
                Value::Flow(id, FlowEnd::From) => flow_ids.push(*id),
                Value::Flow(id, FlowEnd::To) => terminating_flow_ids.push(*id),
                _ => {}
            }
        }
        let instant = span.end_ns == span.start_ns;
        w.event(
            clocks.boot(span.start_ns),
            TrackEvent {
                r#type: Some(if instant {
                    track_event::Type::Instant
                } else {
                    track_event::Type::SliceBegin
                } as i32),
                track_uuid: Some(track),
                name_field: Some(track_event::NameField::Name(span.name.to_string())),
                debug_annotations: span
                    .stats
                    .iter()
                    .filter_map(annotation)
                    .chain(
                        span.correlation.and_then(|c| {
                            annotation(&(CORRELATION_STAT.into(), Value::U64(c.get())))
                        }),
                    )
                    .collect(),
                flow_ids,
                terminating_flow_ids,
                ..Default::default()
            },
        )?;
        if !instant {
            open.push(span.end_ns);
        }
    }
    while let Some(e) = open.pop() {
        end(w, e)?;
    }
    Ok(())
}

/// A stat as an argument of its event; none for an arrow's end, which is
/// a flow of the event.
fn annotation((name, value): &(StatName, Value)) -> Option<DebugAnnotation> {
    use debug_annotation::Value as V;
    Some(DebugAnnotation {
        name_field: Some(debug_annotation::NameField::Name(name.to_string())),
        value: Some(match value {
            Value::I64(v) => V::IntValue(*v),
            Value::U64(v) => V::UintValue(*v),
            Value::F64(v) => V::DoubleValue(*v),
            Value::Str(v) => V::StringValue(v.to_string()),
            Value::Flow(..) => return None,
        }),
    })
}

#[cfg(test)]
mod tests;
