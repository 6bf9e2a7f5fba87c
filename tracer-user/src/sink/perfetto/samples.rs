//! CPU stack samples as Perfetto's CPU profile: each sample instant on a
//! thread line ([`cpu_samples`]) also goes out as a `PerfSample` whose
//! interned callstack Perfetto's UI aggregates into a flame graph.
//!
//! The instant stays too: Perfetto draws it on the thread's slice track,
//! named after the sample's function, with the stack as text to read as in
//! XProf, and the `PerfSample` on a callstack track of its own, where it
//! feeds the flame graph; no track shows a sample twice.
//!
//! The timeline keeps a sample's stack only as the text of its
//! [`STACK_STAT`] (one copy per distinct stack, shared by its samples), so
//! the frames are read back from that text, once per distinct stack. Each
//! line becomes one frame, named by the line as written (Python's `file:line`
//! and the `(inlined)` mark included, as XProf shows them); the text keeps
//! no modules nor addresses, so frames lie in one of two synthetic mappings,
//! the kernel's or user space's.
//!
//! [`cpu_samples`]: crate::timeline::cpu_samples

use std::{
    io::{self, Write},
    sync::Arc,
};

use ebtrace_proto::perfetto::protos::{
    Callstack, Frame, InternedData, InternedString, Mapping, PerfSample, TracePacket, frame,
    profiling, trace_packet,
};
use rustc_hash::FxHashMap;

use super::{PacketWriter, PerfettoClocks};
use crate::timeline::{
    ThreadTrack, Timeline, Value,
    cpu_samples::{STACK_STAT, UNKNOWN_FRAME},
};

/// The packet sequence of the samples and of the interned data they name:
/// its own, as interning ids are per sequence (the track events are on
/// `SEQUENCE_ID`, the ftrace bundles on those just above it, one per CPU).
pub(super) const SAMPLES_SEQUENCE_ID: u32 = 1 << 31;

/// How [`STACK_STAT`] marks a kernel frame.
const KERNEL_MARK: &str = " [k]";
/// How [`STACK_STAT`] marks an inlined frame (after [`KERNEL_MARK`]).
const INLINED_MARK: &str = " (inlined)";

/// Synthetic mappings, and their paths' iids in `mapping_paths`.
const USER_MAPPING: u64 = 1;
const KERNEL_MAPPING: u64 = 2;

/// The frames of a [`STACK_STAT`] text, innermost first, each with whether
/// it is a kernel frame. An empty stack reads as one unknown frame, so that
/// its sample still counts in the profile.
pub(super) fn stack_frames(text: &str) -> impl Iterator<Item = (&str, bool)> {
    let frames = if text.is_empty() { UNKNOWN_FRAME } else { text };
    frames.lines().map(|line| {
        let marked = line.strip_suffix(INLINED_MARK).unwrap_or(line);
        (line, marked.ends_with(KERNEL_MARK))
    })
}

/// What the samples' sequence has interned so far: iids are handed out
/// the first time a sample needs them, so the tables grow with distinct
/// stacks and frames only.
#[derive(Default)]
struct Interner {
    /// By stack text.
    callstacks: FxHashMap<Arc<str>, u64>,
    /// By line; a line is one function name and one frame, sharing an iid.
    frames: FxHashMap<Box<str>, u64>,
    started: bool,
}

impl Interner {
    /// The callstack iid of `text`, adding to `new` what it interns.
    fn callstack(&mut self, text: &Arc<str>, new: &mut InternedData) -> u64 {
        if let Some(&iid) = self.callstacks.get(text) {
            return iid;
        }
        let mut frame_ids: Vec<u64> = stack_frames(text)
            .map(|(line, kernel)| self.frame(line, kernel, new))
            .collect();
        // Perfetto reads a callstack from its root.
        frame_ids.reverse();
        let iid = self.callstacks.len() as u64 + 1;
        new.callstacks.push(Callstack {
            iid: Some(iid),
            frame_ids,
        });
        self.callstacks.insert(Arc::clone(text), iid);
        iid
    }

    fn frame(&mut self, line: &str, kernel: bool, new: &mut InternedData) -> u64 {
        if let Some(&iid) = self.frames.get(line) {
            return iid;
        }
        let iid = self.frames.len() as u64 + 1;
        new.function_names.push(InternedString {
            iid: Some(iid),
            str: Some(line.as_bytes().to_vec()),
        });
        new.frames.push(Frame {
            iid: Some(iid),
            function_name_id: Some(iid),
            mapping_id: Some(if kernel { KERNEL_MAPPING } else { USER_MAPPING }),
            // The text keeps no addresses; frames differ by name.
            rel_pc: Some(0),
            kind_field: kernel.then_some(frame::KindField::Kind(frame::Kind::Kernel as i32)),
        });
        self.frames.insert(line.into(), iid);
        iid
    }
}

/// The interned data the first packet of the sequence carries: the
/// mappings every frame lies in.
fn mappings() -> InternedData {
    let path = |iid, name: &str| InternedString {
        iid: Some(iid),
        str: Some(name.as_bytes().to_vec()),
    };
    let mapping = |iid| Mapping {
        iid: Some(iid),
        path_string_ids: vec![iid],
    };
    InternedData {
        mapping_paths: vec![
            path(USER_MAPPING, "[user]"),
            path(KERNEL_MAPPING, "[kernel]"),
        ],
        mappings: vec![mapping(USER_MAPPING), mapping(KERNEL_MAPPING)],
        ..Default::default()
    }
}

/// Writes a `PerfSample` for every CPU stack sample on the threads' lines.
pub(super) fn write_samples<W: Write>(
    w: &mut PacketWriter<W>,
    timeline: &Timeline,
    clocks: PerfettoClocks,
) -> io::Result<()> {
    let mut interner = Interner::default();
    for thread in timeline.threads.values() {
        for span in &thread.spans {
            if span.end_ns != span.start_ns {
                continue;
            }
            let Some(Value::Str(text)) = span.stats.get(STACK_STAT) else {
                continue;
            };
            let first = !std::mem::replace(&mut interner.started, true);
            let mut interned = if first {
                mappings()
            } else {
                InternedData::default()
            };
            let callstack_iid = interner.callstack(text, &mut interned);
            let kernel = stack_frames(text).next().is_some_and(|(_, k)| k);
            let mut flags = trace_packet::SequenceFlags::SeqNeedsIncrementalState as u32;
            if first {
                flags |= trace_packet::SequenceFlags::SeqIncrementalStateCleared as u32;
            }
            let ts = clocks.boot(span.start_ns);
            w.packet(TracePacket {
                timestamp: Some(ts),
                timestamp_clock_id: w.clock_id,
                data: Some(trace_packet::Data::PerfSample(PerfSample {
                    cpu: Some(cpu_at(thread, span.start_ns)),
                    pid: Some(thread.pid),
                    tid: Some(thread.tid),
                    cpu_mode: Some(if kernel {
                        profiling::CpuMode::ModeKernel
                    } else {
                        profiling::CpuMode::ModeUser
                    } as i32),
                    callstack_iid: Some(callstack_iid),
                })),
                optional_trusted_packet_sequence_id: Some(
                    trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(
                        SAMPLES_SEQUENCE_ID,
                    ),
                ),
                interned_data: (interned != InternedData::default()).then_some(interned),
                sequence_flags: Some(flags),
                first_packet_on_sequence: first.then_some(true),
            })?;
            w.stats.perf_samples += 1;
        }
    }
    Ok(())
}

/// The CPU `thread` ran on at `ts` (0 where its state then is not known).
fn cpu_at(thread: &ThreadTrack, ts: u64) -> u32 {
    let from = thread.slices.partition_point(|s| s.end_ns < ts);
    thread.slices[from..]
        .iter()
        .take_while(|s| s.start_ns <= ts)
        .find_map(|s| s.state().on_cpu())
        .unwrap_or(0)
}
