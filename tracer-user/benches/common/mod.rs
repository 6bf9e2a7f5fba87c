//! What the benchmarks share: their settings from the environment, their
//! medians, and an allocator that counts the heap ([`heap`]).

use std::time::Duration;

#[allow(
    dead_code,
    reason = "each benchmark builds this module; not all of them use it"
)]
pub mod heap;

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
