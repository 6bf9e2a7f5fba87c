//! `cargo bench -p tracer-user --bench cpu_samples`: what laying CPU stack
//! samples on their thread's line costs a snapshot, in time and in memory.
//! `EBTRACE_BENCH_SAMPLES` samples (default 100,000: 30 s of about 35
//! busy CPUs at 99 Hz) of one thread of this process, 24 frames deep, go
//! through `narrow_unknown` (which checks the thread's states against its
//! own samples) and `add_cpu_samples`, as a snapshot lays them. Their stacks are
//! 2,000 address stacks over 40 libc functions: 500 call chains, each
//! sampled at four addresses of its innermost function, as a busy
//! function is. The addresses are named before the rounds, as a running
//! recorder has named them when a snapshot comes.
//!
//! Prints the median time of `EBTRACE_BENCH_ROUNDS` rounds (default 5),
//! the most heap a round took, and what the thread's line keeps of it,
//! per sample.

use std::{
    collections::{BTreeMap, HashSet},
    sync::atomic::Ordering,
    time::Instant,
};

use ebtrace::{
    clock::ClockSync,
    collect::StackSample,
    symbols::stacks::StackSymbolizer,
    timeline::{
        CaptureStats, StateSlice, ThreadCounters, ThreadState, ThreadTrack, Timeline, Value,
        cpu_samples::{STACK_STAT, add_cpu_samples, narrow_unknown},
    },
};
use tracer_common::{RecordHeader, RecordKind};

use common::{
    heap::{Counting, IN_USE, PEAK, heap_from_here},
    median, size_and_rounds,
};

mod common;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const TID: u32 = 3001;
const START_NS: u64 = 1_000_000_000;
const SAMPLE_GAP_NS: u64 = 10_000;
const DEPTH: usize = 24;
const CHAINS: usize = 500;
/// Addresses sampled in each chain's innermost function.
const ADDRESSES: usize = 4;

/// 40 functions of libc, where this process's samples land.
fn functions() -> [u64; 40] {
    [
        libc::write as *const () as u64,
        libc::read as *const () as u64,
        libc::close as *const () as u64,
        libc::open as *const () as u64,
        libc::getpid as *const () as u64,
        libc::strlen as *const () as u64,
        libc::strcmp as *const () as u64,
        libc::malloc as *const () as u64,
        libc::free as *const () as u64,
        libc::calloc as *const () as u64,
        libc::realloc as *const () as u64,
        libc::qsort as *const () as u64,
        libc::bsearch as *const () as u64,
        libc::abs as *const () as u64,
        libc::atoi as *const () as u64,
        libc::strtol as *const () as u64,
        libc::fopen as *const () as u64,
        libc::fclose as *const () as u64,
        libc::fread as *const () as u64,
        libc::fwrite as *const () as u64,
        libc::printf as *const () as u64,
        libc::snprintf as *const () as u64,
        libc::time as *const () as u64,
        libc::clock_gettime as *const () as u64,
        libc::nanosleep as *const () as u64,
        libc::usleep as *const () as u64,
        libc::sched_yield as *const () as u64,
        libc::pthread_self as *const () as u64,
        libc::pthread_mutex_lock as *const () as u64,
        libc::pthread_mutex_unlock as *const () as u64,
        libc::epoll_wait as *const () as u64,
        libc::poll as *const () as u64,
        libc::select as *const () as u64,
        libc::mmap as *const () as u64,
        libc::munmap as *const () as u64,
        libc::mprotect as *const () as u64,
        libc::socket as *const () as u64,
        libc::connect as *const () as u64,
        libc::send as *const () as u64,
        libc::recv as *const () as u64,
    ]
}

/// Address stack `k`, innermost first: chain `k % CHAINS`, sampled at
/// its innermost function's address `k / CHAINS`.
fn stack(k: usize, functions: &[u64; 40]) -> Box<[u64]> {
    let chain = k % CHAINS;
    (0..DEPTH)
        .map(|depth| {
            let f = functions[(chain * 7 + depth * 13 + chain / 40 * depth) % functions.len()];
            match depth {
                0 => f + (k / CHAINS) as u64,
                // A return address: its call is just before it.
                _ => f + 8,
            }
        })
        .collect()
}

fn samples(n: usize) -> Vec<StackSample> {
    let functions = functions();
    let stacks: Vec<Box<[u64]>> = (0..CHAINS * ADDRESSES)
        .map(|k| stack(k, &functions))
        .collect();
    (0..n)
        .map(|i| StackSample {
            header: RecordHeader::new(
                RecordKind::StackSample,
                0,
                0,
                START_NS + i as u64 * SAMPLE_GAP_NS,
            ),
            tid: TID,
            tgid: std::process::id(),
            user: stacks[i * 7919 % stacks.len()].clone(),
            kernel: Box::new([]),
            user_unreadable: false,
            kernel_unreadable: false,
            off_cpu_us: 0,
            syscall: 0,
            python: Default::default(),
            launch: false,
        })
        .collect()
}

/// A timeline of the one thread, running throughout.
fn timeline(stop_ns: u64) -> Timeline {
    let thread = ThreadTrack {
        tid: TID,
        pid: std::process::id(),
        name: "busy".into(),
        slices: vec![StateSlice::new(
            START_NS,
            stop_ns,
            ThreadState::Running { cpu: 0 },
        )],
        marks: Vec::new(),
        spans: Vec::new(),
        counters: ThreadCounters::default(),
    };
    Timeline {
        start_ns: START_NS,
        stop_ns,
        clock: ClockSync::from_offset(0),
        processes: BTreeMap::new(),
        threads: [(TID, thread)].into(),
        peers: Vec::new(),
        devices: BTreeMap::new(),
        carried_planes: Vec::new(),
        stats: CaptureStats::default(),
    }
}

fn main() {
    ebtrace::large_buffers_from_mmap();
    let (n, rounds) = size_and_rounds("EBTRACE_BENCH_SAMPLES", 100_000, 1_000);
    let samples = samples(n);
    let refs: Vec<&StackSample> = samples.iter().collect();
    let stop_ns = START_NS + n as u64 * SAMPLE_GAP_NS;
    let window = (START_NS, stop_ns);
    let mut symbolizer = StackSymbolizer::default();
    for s in &samples {
        symbolizer.note_stack(s.stack());
    }
    let mut warm = timeline(stop_ns);
    add_cpu_samples(&mut warm, &refs, window, &mut symbolizer);
    let texts: HashSet<String> = warm.threads[&TID]
        .spans
        .iter()
        .filter_map(|s| match s.stats.get(STACK_STAT) {
            Some(Value::Str(text)) => Some(text.to_string()),
            _ => None,
        })
        .collect();
    drop(warm);

    let (mut times, mut peaks, mut kept) = (Vec::new(), Vec::new(), Vec::new());
    let mut narrowing = Vec::new();
    for _ in 0..rounds {
        let mut tl = timeline(stop_ns);
        let t0 = Instant::now();
        let narrowed = narrow_unknown(&mut tl, &refs);
        narrowing.push(t0.elapsed());
        assert_eq!(narrowed.contradicted + narrowed.unknown, 0);
        let before = heap_from_here();
        let t0 = Instant::now();
        let laid = add_cpu_samples(&mut tl, &refs, window, &mut symbolizer);
        times.push(t0.elapsed());
        peaks.push(PEAK.load(Ordering::Relaxed) - before);
        kept.push(IN_USE.load(Ordering::Relaxed).saturating_sub(before));
        assert_eq!(laid.samples as usize, n);
        drop(tl);
    }
    let time = median(times);
    let narrowing = median(narrowing);
    let per = |bytes: usize| bytes / n.max(1);
    println!(
        "cpu samples: {n} samples of {} address stacks, {} stack texts (median of {rounds})",
        CHAINS * ADDRESSES,
        texts.len()
    );
    println!(
        "  narrow_unknown                 {:>8.1} ms  {:>7.1} ns/sample",
        narrowing.as_secs_f64() * 1e3,
        narrowing.as_nanos() as f64 / n.max(1) as f64
    );
    println!(
        "  add_cpu_samples                {:>8.1} ms  {:>7.1} ns/sample",
        time.as_secs_f64() * 1e3,
        time.as_nanos() as f64 / n.max(1) as f64
    );
    println!(
        "  heap at the peak: {} bytes/sample; kept on the thread's line: {} bytes/sample",
        per(peaks.into_iter().max().unwrap_or(0)),
        per(kept.into_iter().max().unwrap_or(0))
    );
}
