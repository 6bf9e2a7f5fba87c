//! The kernel's settings and clocks, and what `/proc` says about ebtrace's
//! own process.

use std::fs;

use rustix::time::ClockId;

use super::proc_root;

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of CPU times
/// in `/proc`.
pub fn clock_ticks_per_second() -> u64 {
    match rustix::param::clock_ticks_per_second() {
        // 0, or -1 from the C library: the kernel's USER_HZ everywhere.
        ticks if ticks == 0 || ticks > i64::MAX as u64 => 100,
        ticks => ticks,
    }
}

/// Now, in the clock ticks since boot that [`super::start_time_ticks`]
/// counts in.
pub fn boot_ticks_now() -> u64 {
    let ts = rustix::time::clock_gettime(ClockId::Boottime);
    let hz = clock_ticks_per_second();
    ts.tv_sec as u64 * hz + ts.tv_nsec as u64 * hz / 1_000_000_000
}

/// A number a file under `/proc/sys` holds (`kernel/pid_max`, say).
pub fn sysctl_number(name: &str) -> Option<u64> {
    fs::read_to_string(proc_root().join("sys").join(name))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The running kernel's release (`/proc/sys/kernel/osrelease`); empty where
/// it cannot be read.
pub fn kernel_release() -> String {
    fs::read_to_string(proc_root().join("sys/kernel/osrelease"))
        .map(|r| r.trim().to_string())
        .unwrap_or_default()
}

/// User plus system CPU time of this process, in seconds (`/proc/self/stat`).
pub fn own_cpu_seconds() -> Option<f64> {
    let stat = fs::read_to_string(proc_root().join("self/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) as f64 / clock_ticks_per_second() as f64)
}

/// Effective capability set of this process (`CapEff` in `/proc/self/status`).
pub fn effective_capabilities() -> u64 {
    fs::read_to_string(proc_root().join("self/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// Whether a seccomp filter is in force on this process (`Seccomp: 2`).
pub fn seccomp_filtered() -> bool {
    fs::read_to_string(proc_root().join("self/status")).is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .is_some_and(|v| v.trim() == "2")
    })
}

/// Sets how readily the OOM killer picks this process
/// (`/proc/self/oom_score_adj`, -1000 never to 1000 first); lowering it
/// needs `CAP_SYS_RESOURCE`.
pub fn set_own_oom_score_adj(score: i32) -> std::io::Result<()> {
    fs::write(proc_root().join("self/oom_score_adj"), score.to_string())
}
