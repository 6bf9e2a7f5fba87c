//! `cargo bench -p tracer-user --bench driver_calls`: what a snapshot of
//! CUDA driver calls costs, in time and in memory, without the kernel: a
//! synthetic launch loop (one thread calling `cuLaunchKernel` on a stream
//! of its own, then `cuStreamSynchronize` every 100 launches) of
//! `EBTRACE_BENCH_CALLS` calls (default 60,000, about what the flight
//! recorder's default `--retain-memory` holds), from the records as the
//! recorder holds them to an encoded XSpace: decoding them,
//! `timeline::assemble` (the call on its thread, the work on its stream's
//! line) and the XSpace sink.
//!
//! Prints the median time of `EBTRACE_BENCH_ROUNDS` rounds (default 5) per
//! stage, and the most heap the snapshot took beyond the held records,
//! per call: what `DRIVER_RECORD_SLOTS` accounts for in the flight
//! recorder's `--retain-memory`.

use std::{
    collections::{HashMap, VecDeque},
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use ebtrace::{
    clock::ClockSync,
    collect::{EncodedRecords, Record},
    cuda_api,
    sink::xspace::timeline_to_xspace_bytes,
    timeline::{InitialState, RecordInput, Sources, Window, assemble},
};
use tracer_common::{
    RecordHeader, RecordKind,
    cuda::{CUDA_NAME_LEN, CudaCall, CudaSymbol},
};

use common::{
    heap::{Counting, PEAK, heap_from_here},
    median, size_and_rounds,
};

mod common;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const PID: u32 = 2000;
const TID: u32 = 2001;
const START_NS: u64 = 1_000_000_000;
const STREAM: u64 = 0x5555_0000_1000;
const FUNCTION: u64 = 0x5555_0000_2000;
const KERNEL: &str = "_Z6vecAddPKfS0_Pfi";

fn function_id(name: &str) -> u16 {
    cuda_api::function_id(name).unwrap_or_else(|| panic!("{name} is not a probed driver function"))
}

fn call(function: u16, start_ns: u64, end_ns: u64, args: [u64; 6], extra: [u64; 8]) -> CudaCall {
    CudaCall {
        header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 0, end_ns),
        tid: TID,
        tgid: PID,
        start_ns,
        function,
        flags: 0,
        result: 0,
        args,
        extra,
        out_value: 0,
    }
}

/// The kernel's name as the probes copy it, then `calls` launches with a
/// synchronization after every 100: about 2 µs apart, as a launch loop
/// under the probes makes them.
fn launch_loop(calls: usize) -> EncodedRecords {
    let mut held = EncodedRecords::default();
    let mut name = CudaSymbol {
        header: RecordHeader::new(RecordKind::CudaSymbol, size_of::<CudaSymbol>(), 0, START_NS),
        tid: TID,
        tgid: PID,
        handle: FUNCTION,
        len: KERNEL.len() as u32 + 1,
        truncated: 0,
        name: [0; CUDA_NAME_LEN],
    };
    name.name[..KERNEL.len()].copy_from_slice(KERNEL.as_bytes());
    assert!(held.push(&Record::CudaSymbol(Box::new(name))));
    let (launch, sync) = (
        function_id("cuLaunchKernel"),
        function_id("cuStreamSynchronize"),
    );
    let mut ts = START_NS + 1_000;
    for i in 0..calls {
        let record = if i % 100 == 99 {
            call(sync, ts, ts + 1_500, [STREAM, 0, 0, 0, 0, 0], [0; 8])
        } else {
            // grid 16x1x1, block 256x1x1, no shared memory, on STREAM.
            let args = [FUNCTION, 16, 1, 1, 256, 1];
            call(launch, ts, ts + 1_500, args, [1, 0, STREAM, 0, 0, 0, 0, 0])
        };
        assert!(held.push(&Record::CudaCall(Box::new(record))));
        ts += 2_000;
    }
    held
}

fn main() {
    // As the `ebtrace` binary allocates.
    ebtrace::large_buffers_from_mmap();
    let (n, rounds) = size_and_rounds("EBTRACE_BENCH_CALLS", 60_000, 1_000);
    let held = launch_loop(n);
    let stop_ns = START_NS + 2_000 * (n as u64 + 1);
    let window = Window::between(START_NS, stop_ns);
    let initial: HashMap<u32, InitialState> = [(
        TID,
        InitialState {
            pid: PID,
            name: "launcher".into(),
            state: 'R',
            cpu: 0,
        },
    )]
    .into_iter()
    .collect();

    let no_samples = VecDeque::new();
    let (mut assembly, mut xspace) = (Vec::new(), Vec::new());
    // The heap's peak while the timeline is built, then while the XSpace is.
    let (mut timeline_peaks, mut peaks) = (Vec::new(), Vec::new());
    let (mut events, mut bytes) = (0, 0);
    for _ in 0..rounds {
        let before = heap_from_here();
        let t0 = Instant::now();
        let sources = Sources {
            initial: initial.clone(),
            records: RecordInput::Held {
                records: &held,
                samples: &no_samples,
            },
            ..Sources::new(
                START_NS,
                ClockSync::from_offset(0),
                vec![(PID, "launch-loop".to_string())],
            )
        };
        let tl = assemble(sources, &window, 0, None);
        let t1 = Instant::now();
        timeline_peaks.push(PEAK.load(Ordering::Relaxed) - before);
        heap_from_here();
        let encoded = timeline_to_xspace_bytes(&tl, "bench-host");
        let t2 = Instant::now();
        peaks.push(PEAK.load(Ordering::Relaxed) - before);
        events = tl.event_count();
        bytes = encoded.len();
        drop(encoded);
        drop(tl);
        assembly.push(t1 - t0);
        xspace.push(t2 - t1);
    }
    let (assembly, xspace) = (median(assembly), median(xspace));
    let timeline_peak = timeline_peaks.iter().copied().max().unwrap_or(0);
    let peak = peaks.iter().copied().max().unwrap_or(0).max(timeline_peak);
    let per = |d: Duration| d.as_nanos() as f64 / n.max(1) as f64;
    println!(
        "driver calls: {n} calls -> {events} events, XSpace {:.1} MB (median of {rounds})",
        bytes as f64 / 1e6
    );
    println!(
        "  decoded + timeline::assemble {:>8.1} ms  {:>7.1} ns/call",
        assembly.as_secs_f64() * 1e3,
        per(assembly)
    );
    println!(
        "  XSpace (encoded)             {:>8.1} ms  {:>7.1} ns/call",
        xspace.as_secs_f64() * 1e3,
        per(xspace)
    );
    println!(
        "  heap at the peak, beyond the held records: {:.1} MB, {} bytes/call \
         (the timeline's peak: {} bytes/call)",
        peak as f64 / 1e6,
        peak / n.max(1),
        timeline_peak / n.max(1)
    );
    assert!(events >= n && bytes > 0);
}
