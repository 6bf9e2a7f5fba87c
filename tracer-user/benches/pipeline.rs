//! `cargo bench -p tracer-user --bench pipeline`: what turning scheduler
//! records into an encoded XSpace costs, without the kernel: a synthetic
//! ping-pong (two threads of one process waking each other on one CPU, the
//! serve benchmark's target) of `EBTRACE_BENCH_RECORDS` records (default
//! 1,000,000), through the path every capture takes: `timeline::assemble`
//! (sorting the records, the scheduling timeline, span nesting, the window
//! as `ebtrace record` applies it: no `max_events`), then the XSpace sink,
//! then the Perfetto sink (`--perfetto`) on the same timeline.
//!
//! Prints the median of `EBTRACE_BENCH_ROUNDS` rounds (default 5) per stage.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use ebtrace::{
    clock::ClockSync,
    collect::Record,
    sink::{
        perfetto::{PerfettoClocks, write_timeline},
        xspace::timeline_to_xspace_bytes,
    },
    timeline::{InitialState, RecordInput, Sources, Window, assemble},
};

use common::{median, size_and_rounds};

mod common;

const PID: u32 = 1000;
const PING: u32 = 1001;
const PONG: u32 = 1002;
const START_NS: u64 = 1_000_000_000;
/// `prev_state` of a task that blocked in an interruptible sleep.
const SLEEPING: u64 = 0x1;

/// Four records per round trip: each thread wakes the other, then blocks
/// and switches to it.
fn ping_pong(records: usize) -> Vec<Record> {
    let switch = |ts, prev, next| Record::sched_switch(ts, 0, (prev, PID), SLEEPING, (next, PID));
    let wakeup = |ts, tid, waker| Record::sched_waking(ts, (tid, PID), (waker, PID));
    let mut out = Vec::with_capacity(records);
    let mut ts = START_NS + 1_000;
    while out.len() + 4 <= records {
        out.push(wakeup(ts, PONG, PING));
        out.push(switch(ts + 300, PING, PONG));
        out.push(wakeup(ts + 900, PING, PONG));
        out.push(switch(ts + 1_200, PONG, PING));
        ts += 2_000;
    }
    // The ring buffer delivers records nearly, not exactly, in time order:
    // a real 2 s ping-pong capture had one record out of place in 258k.
    for pair in out.chunks_mut(100_000) {
        pair.swap(0, 1);
    }
    out
}

fn main() {
    // As the `ebtrace` binary allocates.
    ebtrace::large_buffers_from_mmap();
    let (n, rounds) = size_and_rounds("EBTRACE_BENCH_RECORDS", 1_000_000, 10_000);
    let source = ping_pong(n);
    let stop_ns = source.iter().map(Record::ts).max().unwrap_or(START_NS) + 1_000;
    let initial: HashMap<u32, InitialState> = [(PING, 'R'), (PONG, 'S')]
        .into_iter()
        .map(|(tid, state)| {
            let name = if tid == PING { "ping" } else { "pong" };
            let s = InitialState {
                pid: PID,
                name: name.into(),
                state,
                cpu: 0,
            };
            (tid, s)
        })
        .collect();

    let (mut assembly, mut xspace, mut perfetto) = (Vec::new(), Vec::new(), Vec::new());
    let (mut events, mut bytes, mut perfetto_bytes) = (0, 0, 0);
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 0,
    };
    let window = Window::between(START_NS, stop_ns);
    for _ in 0..rounds {
        let sources = Sources {
            initial: initial.clone(),
            scheduling: true,
            records: RecordInput::Decoded(source.clone()),
            ..Sources::new(
                START_NS,
                ClockSync::from_offset(0),
                vec![(PID, "pingpong".to_string())],
            )
        };
        let t0 = Instant::now();
        let tl = assemble(sources, &window, 0, None);
        let t1 = Instant::now();
        let encoded = timeline_to_xspace_bytes(&tl, "bench-host");
        let t2 = Instant::now();
        events = tl.event_count();
        bytes = encoded.len();
        drop(encoded);
        let mut out = Vec::new();
        let t3 = Instant::now();
        let written = write_timeline(&tl, clocks, &mut out).expect("writing to a Vec");
        perfetto.push(t3.elapsed());
        perfetto_bytes = written.bytes as usize;
        assembly.push(t1 - t0);
        xspace.push(t2 - t1);
    }
    let (assembly, xspace, perfetto) = (median(assembly), median(xspace), median(perfetto));
    let per = |d: Duration, k: usize| d.as_nanos() as f64 / k.max(1) as f64;
    println!(
        "pipeline: {n} records -> {events} events, XSpace {:.1} MB (median of {rounds})",
        bytes as f64 / 1e6
    );
    println!(
        "  timeline::assemble {:>8.1} ms  {:>6.1} ns/record",
        assembly.as_secs_f64() * 1e3,
        per(assembly, n)
    );
    println!(
        "  XSpace (encoded)   {:>8.1} ms  {:>6.1} ns/event",
        xspace.as_secs_f64() * 1e3,
        per(xspace, events)
    );
    println!(
        "  total              {:>8.1} ms",
        (assembly + xspace).as_secs_f64() * 1e3
    );
    println!(
        "  Perfetto (--perfetto, same timeline) {:>8.1} ms  {:>6.1} ns/event, {:.1} MB",
        perfetto.as_secs_f64() * 1e3,
        per(perfetto, events),
        perfetto_bytes as f64 / 1e6
    );
    assert!(events > 0 && bytes > 0 && perfetto_bytes > 0);
}
