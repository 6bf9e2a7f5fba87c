//! The end-of-capture summary printed to the terminal.

use std::fmt::Write as _;

use crate::{
    attach::ProbeStats,
    timeline::{StreamTiming, Timeline},
};

fn ms(ns: u64) -> String {
    format!("{:.1}ms", ns as f64 / 1e6)
}

/// Renders per-thread totals and the capture's accounting.
pub fn render(timeline: &Timeline, probe: &ProbeStats) -> String {
    let window = timeline.duration_ns().max(1);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>8}  {:<16} {:>10} {:>6} {:>10} {:>10} {:>6} {:>6} {:>7}",
        "TID", "THREAD", "ON-CPU", "CPU%", "RUNQ-WAIT", "BLOCKED", "VOL", "INVOL", "WAKEUPS"
    );
    let mut threads: Vec<_> = timeline.threads.values().collect();
    threads.sort_by_key(|t| std::cmp::Reverse(t.counters.on_cpu_ns));
    for t in threads {
        let c = &t.counters;
        let _ = writeln!(
            out,
            "{:>8}  {:<16} {:>10} {:>5.1}% {:>10} {:>10} {:>6} {:>6} {:>7}",
            t.tid,
            t.name,
            ms(c.on_cpu_ns),
            100.0 * c.on_cpu_ns as f64 / window as f64,
            ms(c.runnable_ns),
            ms(c.blocked_ns),
            c.voluntary_switches,
            c.involuntary_switches,
            c.wakeups,
        );
    }
    let _ = writeln!(
        out,
        "window {}; {} records captured, {} dropped{}",
        ms(timeline.duration_ns()),
        timeline.stats.records,
        probe.dropped() + timeline.stats.malformed,
        if probe.dropped() + timeline.stats.malformed > 0 {
            " (raise --ring-buffer-mib; the trace is partial)"
        } else {
            ""
        }
    );
    if timeline.stats.inconsistencies > 0 {
        let _ = writeln!(
            out,
            "{} scheduler transitions were not reported by the kernel; those intervals show as Unknown",
            timeline.stats.inconsistencies
        );
    }
    for (ordinal, device) in &timeline.devices {
        for (timing, what) in [
            (StreamTiming::HostObserved, "submissions"),
            (StreamTiming::Device, "events"),
        ] {
            let (streams, events) = device.count_timed(timing);
            if streams == 0 {
                continue;
            }
            let source = match timing {
                StreamTiming::HostObserved => "host-observed",
                StreamTiming::Device => "timed by the GPU, from CUPTI",
            };
            let _ = writeln!(
                out,
                "GPU {ordinal}: {events} {what} on {streams} streams ({source})"
            );
        }
    }
    for note in &timeline.stats.notes {
        let _ = writeln!(out, "{note}");
    }
    for warning in &timeline.stats.warnings {
        let _ = writeln!(out, "warning: {warning}");
    }
    if let Some(why) = &timeline.stats.ended_early {
        let _ = writeln!(out, "capture ended early: {why}");
    }
    out
}
