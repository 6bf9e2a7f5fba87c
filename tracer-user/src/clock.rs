//! `ClockSync`: the one place where kernel timestamps become wall-clock time.
//!
//! eBPF records carry `bpf_ktime_get_ns()` (`CLOCK_MONOTONIC`); XProf wants
//! wall-clock epoch nanoseconds (TraceMe uses `CLOCK_REALTIME` too). The
//! offset between the clocks is measured by bracketing one monotonic read
//! between two realtime reads and keeping the tightest of several tries.

pub use rustix::time::ClockId;

/// Reads a clock in nanoseconds.
pub fn now_ns(clock: ClockId) -> u64 {
    let ts = rustix::time::clock_gettime(clock);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `CLOCK_MONOTONIC` now, in the time base of eBPF records.
pub fn monotonic_ns() -> u64 {
    now_ns(ClockId::Monotonic)
}

/// `CLOCK_REALTIME` now, nanoseconds since the Unix epoch.
pub fn realtime_ns() -> u64 {
    now_ns(ClockId::Realtime)
}

/// Offset from `CLOCK_MONOTONIC` to `CLOCK_REALTIME`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSync {
    /// realtime - monotonic, in ns.
    offset_ns: i64,
    /// Width of the bracket the offset was read in: its uncertainty.
    uncertainty_ns: u64,
}

impl ClockSync {
    /// Measures the offset now (a few microseconds).
    pub fn measure() -> Self {
        let mut best: Option<ClockSync> = None;
        for _ in 0..16 {
            let before = realtime_ns();
            let mono = monotonic_ns();
            let after = realtime_ns();
            let width = after.saturating_sub(before);
            let mid = before + width / 2;
            let candidate = ClockSync {
                offset_ns: mid as i64 - mono as i64,
                uncertainty_ns: width,
            };
            if best.is_none_or(|b| candidate.uncertainty_ns < b.uncertainty_ns) {
                best = Some(candidate);
            }
        }
        best.expect("at least one sample")
    }

    /// A fixed offset (for replaying recorded data and for tests).
    pub const fn from_offset(offset_ns: i64) -> Self {
        ClockSync {
            offset_ns,
            uncertainty_ns: 0,
        }
    }

    /// Another clock read at the same instant as `monotonic_ns`, e.g.
    /// CUPTI's GPU timestamps, which the agent pairs with the target's
    /// `CLOCK_MONOTONIC`: [`Self::to_monotonic_ns`] then maps that clock.
    pub const fn pairing(other_ns: u64, monotonic_ns: u64) -> Self {
        ClockSync {
            offset_ns: (other_ns as i64).wrapping_sub(monotonic_ns as i64),
            uncertainty_ns: 0,
        }
    }

    /// Converts a monotonic timestamp (eBPF record time) to epoch ns.
    pub fn to_wall_ns(&self, monotonic_ns: u64) -> u64 {
        (monotonic_ns as i64).wrapping_add(self.offset_ns) as u64
    }

    /// Converts an epoch-ns timestamp (e.g. a TraceMe time, which the
    /// traced process writes: any value) to monotonic ns.
    pub fn to_monotonic_ns(&self, wall_ns: u64) -> u64 {
        (wall_ns as i64).wrapping_sub(self.offset_ns) as u64
    }

    /// How far the offset may be off, in ns: the width of the bracket it was read in.
    pub fn uncertainty_ns(&self) -> u64 {
        self.uncertainty_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_offset_maps_now_to_now() {
        let sync = ClockSync::measure();
        let wall = sync.to_wall_ns(monotonic_ns());
        let real = realtime_ns();
        assert!(
            real.abs_diff(wall) < 5_000_000,
            "off by {} ns",
            real.abs_diff(wall)
        );
        assert!(sync.uncertainty_ns() < 1_000_000);
    }

    #[test]
    fn conversions_round_trip() {
        let sync = ClockSync::from_offset(1_700_000_000_000_000_000);
        assert_eq!(sync.to_monotonic_ns(sync.to_wall_ns(12_345)), 12_345);
    }
}
