//! Scheduling as Perfetto models it: per-CPU ftrace bundles of
//! `sched_switch` and `sched_waking` events for the traced threads.
//!
//! Every CPU slice of a traced thread is switched in at its start and out
//! at its end, with the state the thread's next slice says it left in.
//! Time on a CPU that no traced thread used is switched to pid 0, which
//! Perfetto draws as an empty CPU track: ebtrace does not record other
//! tasks.

use std::io::{self, Write};

use ebtrace_proto::perfetto::protos::{
    FtraceEvent, FtraceEventBundle, SchedSwitchFtraceEvent, SchedWakingFtraceEvent, TracePacket,
    ftrace_event, trace_packet,
};

use super::{PacketWriter, PerfettoClocks};
use crate::timeline::{RunnableCause, TaskState, ThreadState, ThreadTrack, Timeline};

/// Events per bundle: bounds what is buffered.
const BUNDLE_EVENTS: usize = 4096;
/// The default `SCHED_OTHER` priority as ftrace reports it.
const PRIO: i32 = 120;

/// `prev_state` bits as the kernel reports them (and Perfetto decodes):
/// 0 is runnable (preempted).
fn prev_state(state: ThreadState) -> i64 {
    match state {
        ThreadState::Blocked { state } => match state {
            TaskState::Sleeping | TaskState::Unknown => 0x01,
            TaskState::DiskSleep => 0x02,
            TaskState::Stopped => 0x04,
            TaskState::TracingStop => 0x08,
            TaskState::Dead => 0x10,
            TaskState::Parked => 0x40,
            TaskState::Idle => 0x80,
        },
        ThreadState::Running { .. }
        | ThreadState::Sampled { .. }
        | ThreadState::Runnable { .. }
        | ThreadState::Unknown => 0,
    }
}

/// The state `thread` was in right from `ts_ns`, if a slice starts there.
fn state_from(thread: &ThreadTrack, ts_ns: u64) -> Option<ThreadState> {
    let i = thread.slices.partition_point(|s| s.start_ns < ts_ns);
    thread
        .slices
        .get(i)
        .filter(|s| s.start_ns == ts_ns)
        .map(|s| s.state())
}

/// The CPU `thread` ran on at `ts_ns`, if it was running.
fn cpu_at(thread: &ThreadTrack, ts_ns: u64) -> Option<u32> {
    let i = thread.slices.partition_point(|s| s.end_ns <= ts_ns);
    thread.slices.get(i)?.state().on_cpu()
}

/// The CPU `thread` ran on next after `ts_ns`.
fn next_cpu(thread: &ThreadTrack, ts_ns: u64) -> Option<u32> {
    let i = thread.slices.partition_point(|s| s.start_ns < ts_ns);
    thread.slices[i..].iter().find_map(|s| s.state().on_cpu())
}

struct Bundler<'a, W: Write> {
    w: &'a mut PacketWriter<W>,
    cpu: u32,
    events: Vec<FtraceEvent>,
}

impl<W: Write> Bundler<'_, W> {
    fn push(&mut self, event: FtraceEvent) -> io::Result<()> {
        self.events.push(event);
        if self.events.len() >= BUNDLE_EVENTS {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.events.is_empty() {
            return Ok(());
        }
        let event = std::mem::take(&mut self.events);
        self.w.packet(TracePacket {
            data: Some(trace_packet::Data::FtraceEvents(FtraceEventBundle {
                cpu: Some(self.cpu),
                event,
            })),
            optional_trusted_packet_sequence_id: Some(
                trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(
                    super::SEQUENCE_ID + 1 + self.cpu,
                ),
            ),
            ..Default::default()
        })
    }
}

/// Writes the traced threads' scheduling: every CPU's switches, then the
/// wake-ups.
pub(super) fn write_sched<W: Write>(
    w: &mut PacketWriter<W>,
    timeline: &Timeline,
    clocks: PerfettoClocks,
) -> io::Result<()> {
    w.stats.sched_switches = write_switches(w, timeline, clocks)?;
    w.stats.sched_wakings = write_wakings(w, timeline, clocks)?;
    Ok(())
}

/// `sched_switch` events as ftrace writes them, for the threads of a
/// timeline.
struct Switches<'a> {
    timeline: &'a Timeline,
    clocks: PerfettoClocks,
}

impl Switches<'_> {
    /// The name of thread `tid`, empty if the timeline has none.
    fn comm(&self, tid: u32) -> String {
        self.timeline
            .threads
            .get(&tid)
            .map_or_else(String::new, |t| t.name.clone())
    }

    /// A switch on `cpu` at `ts` from `prev` (tid and `prev_state`) to
    /// `next`; `None` for either is the CPU's idle task.
    fn event(&self, cpu: u32, ts: u64, prev: Option<(u32, i64)>, next: Option<u32>) -> FtraceEvent {
        // pid 0 is what ftrace calls the idle task of each CPU.
        FtraceEvent {
            timestamp: Some(self.clocks.boot(ts)),
            pid: Some(prev.map_or(0, |p| p.0)),
            event: Some(ftrace_event::Event::SchedSwitch(SchedSwitchFtraceEvent {
                prev_comm: Some(prev.map_or_else(|| format!("swapper/{cpu}"), |p| self.comm(p.0))),
                prev_pid: Some(prev.map_or(0, |p| p.0 as i32)),
                prev_prio: Some(PRIO),
                prev_state: Some(prev.map_or(0, |p| p.1)),
                next_comm: Some(next.map_or_else(|| format!("swapper/{cpu}"), |n| self.comm(n))),
                next_pid: Some(next.map_or(0, |n| n as i32)),
                next_prio: Some(PRIO),
            })),
        }
    }
}

/// Writes each CPU's switches in bundles of its own; returns how many.
fn write_switches<W: Write>(
    w: &mut PacketWriter<W>,
    timeline: &Timeline,
    clocks: PerfettoClocks,
) -> io::Result<u64> {
    let switch = Switches { timeline, clocks };
    let mut switches = 0;
    let lines = timeline.cpu_lines();
    for (cpu, slices) in lines.iter() {
        let mut b = Bundler {
            w: &mut *w,
            cpu,
            events: Vec::new(),
        };
        let mut prev_end: Option<(u64, u32)> = None;
        let mut slices = slices.peekable();
        while let Some(slice) = slices.next() {
            // Switched in from the previous traced thread, or from idle.
            if prev_end.is_none_or(|(end, _)| end != slice.start_ns) {
                b.push(switch.event(cpu, slice.start_ns, None, Some(slice.tid)))?;
                switches += 1;
            }
            let Some(thread) = timeline.threads.get(&slice.tid) else {
                prev_end = None;
                continue;
            };
            // A thread still on the CPU when the capture stopped stays there.
            let Some(after) = state_from(thread, slice.end_ns) else {
                prev_end = None;
                continue;
            };
            let next = slices
                .peek()
                .filter(|n| n.start_ns == slice.end_ns)
                .map(|n| n.tid);
            b.push(switch.event(
                cpu,
                slice.end_ns,
                Some((slice.tid, prev_state(after))),
                next,
            ))?;
            switches += 1;
            prev_end = Some((slice.end_ns, slice.tid));
        }
        b.flush()?;
    }
    Ok(switches)
}

/// Writes the wake-ups: on the waker's CPU when it is a traced thread that
/// was running, else on the CPU the woken thread ran on next. Returns how
/// many.
fn write_wakings<W: Write>(
    w: &mut PacketWriter<W>,
    timeline: &Timeline,
    clocks: PerfettoClocks,
) -> io::Result<u64> {
    let mut wakings = 0;
    let mut bundles: std::collections::BTreeMap<u32, Vec<FtraceEvent>> = Default::default();
    for thread in timeline.threads.values() {
        for slice in &thread.slices {
            let waker = match slice.state() {
                ThreadState::Runnable {
                    cause: RunnableCause::Woken { waker, .. },
                } => timeline.peer(waker).tid,
                ThreadState::Runnable {
                    cause: RunnableCause::Created,
                } => 0,
                _ => continue,
            };
            let target = next_cpu(thread, slice.start_ns);
            let cpu = timeline
                .threads
                .get(&waker)
                .and_then(|t| cpu_at(t, slice.start_ns))
                .or(target)
                .unwrap_or(0);
            let events = bundles.entry(cpu).or_default();
            events.push(FtraceEvent {
                timestamp: Some(clocks.boot(slice.start_ns)),
                pid: Some(waker),
                event: Some(ftrace_event::Event::SchedWaking(SchedWakingFtraceEvent {
                    comm: Some(thread.name.clone()),
                    pid: Some(thread.tid as i32),
                    prio: Some(PRIO),
                    success: Some(1),
                    target_cpu: Some(target.unwrap_or(cpu) as i32),
                })),
            });
            wakings += 1;
            if events.len() >= BUNDLE_EVENTS {
                let events = std::mem::take(events);
                Bundler {
                    w: &mut *w,
                    cpu,
                    events,
                }
                .flush()?;
            }
        }
    }
    for (cpu, events) in bundles {
        Bundler {
            w: &mut *w,
            cpu,
            events,
        }
        .flush()?;
    }
    Ok(wakings)
}
