//! What the benchmarks share: their settings from the environment, their
//! medians, and an allocator that counts the heap.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

/// The number in the environment variable `name`, or `default`.
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How much a benchmark runs, and how many rounds: `cargo bench` passes
/// `--bench`, and the environment variable `size_name` (else `full`) and
/// `EBTRACE_BENCH_ROUNDS` (else 5) say; `cargo test --benches` runs one
/// round of `small`, to check it still works.
#[allow(
    dead_code,
    reason = "each benchmark builds this module; not all of them use it"
)]
pub fn size_and_rounds(size_name: &str, full: usize, small: usize) -> (usize, usize) {
    if std::env::args().any(|a| a == "--bench") {
        (env_or(size_name, full), env_or("EBTRACE_BENCH_ROUNDS", 5))
    } else {
        (small, 1)
    }
}

/// The median of `times` (not empty).
pub fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// The system allocator, counting the bytes in use and their peak: a
/// benchmark that measures memory makes it its global allocator.
#[allow(
    dead_code,
    reason = "each benchmark builds this module; not all of them use it"
)]
pub struct Counting;

/// Bytes allocated and not freed.
#[allow(
    dead_code,
    reason = "each benchmark builds this module; not all of them use it"
)]
pub static IN_USE: AtomicUsize = AtomicUsize::new(0);
/// The most [`IN_USE`] reached since [`heap_from_here`].
#[allow(
    dead_code,
    reason = "each benchmark builds this module; not all of them use it"
)]
pub static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; the counters
// only watch.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = IN_USE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

/// The heap in use now, from which [`PEAK`] counts again.
#[allow(
    dead_code,
    reason = "each benchmark builds this module; not all of them use it"
)]
pub fn heap_from_here() -> usize {
    let now = IN_USE.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}
