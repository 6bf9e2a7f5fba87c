//! `cargo bench -p tracer-user --bench pipeline`: what turning scheduler
//! records into an encoded XSpace costs, without the kernel: a synthetic
//! ping-pong (two threads of one process waking each other on one CPU, the
//! serve benchmark's target) of `EBTRACE_BENCH_RECORDS` records (default
//! 1,000,000), through the same stages a capture runs: sorting the records,
//! the scheduling timeline, span nesting, its window (as `ebtrace record`
//! applies it: no `max_events`) and the XSpace sink, then the Perfetto sink
//! (`--perfetto`) on the same timeline.
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
    timeline::{CaptureStats, Cuts, InitialState, SchedTimelineBuilder, Window, nest},
};
use tracer_common::{RecordHeader, RecordKind, SchedSwitch, SchedWakeup};

const PID: u32 = 1000;
const PING: u32 = 1001;
const PONG: u32 = 1002;
const START_NS: u64 = 1_000_000_000;
/// `prev_state` of a task that blocked in an interruptible sleep.
const SLEEPING: u64 = 0x1;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Four records per round trip: each thread wakes the other, then blocks
/// and switches to it.
fn ping_pong(records: usize) -> Vec<Record> {
    let switch = |ts, prev, next| {
        Record::Switch(SchedSwitch {
            header: RecordHeader::new(RecordKind::SchedSwitch, 40, 0, ts),
            prev_tid: prev,
            prev_tgid: PID,
            next_tid: next,
            next_tgid: PID,
            prev_state: SLEEPING,
        })
    };
    let wakeup = |ts, tid, waker| {
        Record::Wakeup(SchedWakeup {
            header: RecordHeader::new(RecordKind::SchedWakeup, 40, 0, ts),
            tid,
            tgid: PID,
            waker_tid: waker,
            waker_tgid: PID,
            target_cpu: 0,
            flags: 0,
        })
    };
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

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it once, small.
    let testing = !std::env::args().any(|a| a == "--bench");
    let n = if testing {
        10_000
    } else {
        env_or("EBTRACE_BENCH_RECORDS", 1_000_000)
    };
    let rounds = if testing {
        1
    } else {
        env_or("EBTRACE_BENCH_ROUNDS", 5)
    };
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

    let (mut sort, mut timeline, mut window, mut xspace) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut perfetto = Vec::new();
    let (mut events, mut bytes, mut perfetto_bytes) = (0, 0, 0);
    let clocks = PerfettoClocks {
        boot_minus_mono_ns: 0,
    };
    for _ in 0..rounds {
        let mut records = source.clone();
        let t0 = Instant::now();
        records.sort_by_key(Record::ts);
        let t1 = Instant::now();
        let mut builder = SchedTimelineBuilder::new(
            START_NS,
            stop_ns,
            [(PID, "pingpong".to_string())],
            initial.clone(),
        );
        for r in &records {
            builder.push(r);
        }
        let mut tl = builder.finish(
            ClockSync::from_offset(0),
            &HashMap::new(),
            CaptureStats::default(),
        );
        for t in tl.threads.values_mut() {
            nest(&mut t.spans, Cuts::Marked);
        }
        let t2 = Instant::now();
        Window::between(START_NS, stop_ns).apply(&mut tl);
        let t3 = Instant::now();
        let encoded = timeline_to_xspace_bytes(&tl, "bench-host");
        let t4 = Instant::now();
        events = tl.event_count();
        bytes = encoded.len();
        drop(encoded);
        let mut out = Vec::new();
        let t5 = Instant::now();
        let written = write_timeline(&tl, clocks, &mut out).expect("writing to a Vec");
        perfetto.push(t5.elapsed());
        perfetto_bytes = written.bytes as usize;
        sort.push(t1 - t0);
        timeline.push(t2 - t1);
        window.push(t3 - t2);
        xspace.push(t4 - t3);
    }
    let (sort, timeline, window, xspace) = (
        median(sort),
        median(timeline),
        median(window),
        median(xspace),
    );
    let perfetto = median(perfetto);
    let per = |d: Duration, k: usize| d.as_nanos() as f64 / k.max(1) as f64;
    println!(
        "pipeline: {n} records -> {events} events, XSpace {:.1} MB (median of {rounds})",
        bytes as f64 / 1e6
    );
    println!(
        "  sort records     {:>8.1} ms  {:>6.1} ns/record",
        sort.as_secs_f64() * 1e3,
        per(sort, n)
    );
    println!(
        "  timeline         {:>8.1} ms  {:>6.1} ns/record",
        timeline.as_secs_f64() * 1e3,
        per(timeline, n)
    );
    println!(
        "  window           {:>8.1} ms  {:>6.1} ns/record",
        window.as_secs_f64() * 1e3,
        per(window, n)
    );
    println!(
        "  XSpace (encoded) {:>8.1} ms  {:>6.1} ns/event",
        xspace.as_secs_f64() * 1e3,
        per(xspace, events)
    );
    println!(
        "  total            {:>8.1} ms",
        (sort + timeline + window + xspace).as_secs_f64() * 1e3
    );
    println!(
        "  Perfetto (--perfetto, same timeline) {:>8.1} ms  {:>6.1} ns/event, {:.1} MB",
        perfetto.as_secs_f64() * 1e3,
        per(perfetto, events),
        perfetto_bytes as f64 / 1e6
    );
    assert!(events > 0 && bytes > 0 && perfetto_bytes > 0);
}
