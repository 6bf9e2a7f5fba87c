//! `Monitor`: a human-readable summary of the watched processes over a
//! window, from `/proc` read at both ends of it (no probes attached). What
//! needs probes (driver calls, TraceMe events) is written as n/a, never as
//! zero.

use std::{fmt::Write as _, time::Duration};

use crate::procfs::{ProcessCounters, TargetProcess, clock_ticks_per_second};

/// One process's counters at both ends of the window.
pub struct Sample {
    /// The process id.
    pub pid: u32,
    /// Its name (`comm`).
    pub name: String,
    /// Its counters at the start of the window; none if it had exited.
    pub before: Option<ProcessCounters>,
    /// Its counters at the end; none if it had exited.
    pub after: Option<ProcessCounters>,
}

/// Reads every target's counters now.
pub fn read(targets: &[TargetProcess]) -> Vec<Option<ProcessCounters>> {
    targets.iter().map(TargetProcess::counters).collect()
}

/// Renders the summary; `header` (e.g. a timestamp) goes first if given.
pub fn render(samples: &[Sample], window: Duration, header: Option<String>) -> String {
    let secs = window.as_secs_f64().max(1e-3);
    let ticks = clock_ticks_per_second() as f64;
    let mut out = String::new();
    if let Some(h) = header {
        let _ = writeln!(out, "{h}");
    }
    let _ = writeln!(
        out,
        "ebtrace monitor: {} watched process(es) over {:.0} ms",
        samples.len(),
        secs * 1e3
    );
    for s in samples {
        let (Some(b), Some(a)) = (s.before, s.after) else {
            let _ = writeln!(
                out,
                "pid {} ({}): exited during the window; no figures",
                s.pid, s.name
            );
            continue;
        };
        let rate = |x: u64, y: u64| y.saturating_sub(x) as f64 / secs;
        let cpu = rate(b.cpu_ticks, a.cpu_ticks) / ticks * 100.0;
        let vol = rate(b.voluntary_switches, a.voluntary_switches);
        let invol = rate(b.involuntary_switches, a.involuntary_switches);
        let _ = writeln!(
            out,
            "pid {} ({}): {} threads\n  CPU use: {cpu:.1}% of one core\n  context switches: \
             {:.0}/s ({vol:.0}/s voluntary, {invol:.0}/s involuntary; live threads)\n  \
             kernel launches: n/a (Monitor reads /proc only; a Profile capture has them)\n  \
             TraceMe events: n/a (Monitor reads /proc only; a Profile capture has them)",
            s.pid,
            s.name,
            a.threads,
            vol + invol,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_over_the_window_and_na_for_missing_sources() {
        let c = |ticks, v, i| ProcessCounters {
            cpu_ticks: ticks,
            voluntary_switches: v,
            involuntary_switches: i,
            threads: 3,
        };
        let hz = clock_ticks_per_second();
        let samples = [
            Sample {
                pid: 7,
                name: "python".into(),
                before: Some(c(0, 100, 10)),
                after: Some(c(hz, 2100, 210)),
            },
            Sample {
                pid: 8,
                name: "gone".into(),
                before: Some(c(0, 0, 0)),
                after: None,
            },
        ];
        let text = render(&samples, Duration::from_secs(2), Some("T".into()));
        assert!(text.starts_with("T\n"), "{text}");
        assert!(text.contains("CPU use: 50.0% of one core"), "{text}");
        assert!(text.contains("context switches: 1100/s (1000/s voluntary, 100/s involuntary"));
        assert!(text.contains("kernel launches: n/a"));
        assert!(text.contains("TraceMe events: n/a"));
        assert!(text.contains("pid 8 (gone): exited"));
    }
}
