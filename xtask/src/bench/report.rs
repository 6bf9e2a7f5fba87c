//! The benchmark's Markdown report.

use std::{fmt::Write as _, path::Path, process::Command, time::Duration};

use super::{
    Config, Options, Run,
    harness::{self, Configuration as _},
};
use crate::util::{median, stdout_of};

/// What the numbers were measured on.
pub struct Environment {
    date: String,
    kernel: String,
    cpus: usize,
    cpu_model: String,
    virtual_machine: bool,
    ebtrace_version: String,
    bpftrace_version: String,
    /// Source revision the binaries were built from (`-dirty`: with local changes).
    revision: String,
    opts: Options,
}

impl Environment {
    /// The machine and tool lines of a report's header.
    pub fn header_lines(&self) -> String {
        format!(
            "- machine: {} CPUs ({}), {}, kernel {}\n- tools: {} ({}), {}\n",
            self.cpus,
            self.cpu_model,
            if self.virtual_machine {
                "virtual machine"
            } else {
                "no hypervisor flag"
            },
            self.kernel,
            self.ebtrace_version,
            self.revision,
            self.bpftrace_version
        )
    }

    pub fn date(&self) -> &str {
        &self.date
    }

    pub fn virtual_machine(&self) -> bool {
        self.virtual_machine
    }

    pub fn target_cpu(&self) -> Option<usize> {
        self.opts.target_cpu
    }

    pub fn probe(root: &Path, ebtrace: &Path, bpftrace_version: &str, opts: Options) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        Environment {
            date: stdout_of(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))
                .unwrap_or_default(),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model: field("model name").unwrap_or_else(|| "unknown CPU".into()),
            virtual_machine: field("flags")
                .is_some_and(|f| f.split(' ').any(|x| x == "hypervisor")),
            ebtrace_version: stdout_of(Command::new(ebtrace).arg("--version")).unwrap_or_default(),
            bpftrace_version: bpftrace_version.to_string(),
            revision: stdout_of(
                Command::new("git")
                    .arg("-C")
                    .arg(root)
                    .args(["describe", "--always", "--dirty"]),
            )
            .unwrap_or_else(|| "unknown revision".into()),
            opts,
        }
    }
}

/// 1234567.8 → "1,234,568".
pub(super) fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn run_label(r: &Run) -> String {
    let route = if r.config == Config::EbtraceClassic {
        ", classic tracepoints"
    } else {
        ""
    };
    match r.round {
        Some(n) => format!("round {}{route}", n + 1),
        None => format!("long ({:.0} s){route}", r.seconds),
    }
}

pub fn render(env: &Environment, runs: &[Run], took: Duration) -> String {
    let mut md = String::new();
    let o = &env.opts;
    let _ = writeln!(md, "## Scheduling benchmark ({})\n", env.date);
    let _ = writeln!(
        md,
        "- machine: {} CPUs ({}), {}, kernel {}",
        env.cpus,
        env.cpu_model,
        if env.virtual_machine {
            "virtual machine"
        } else {
            "no hypervisor flag"
        },
        env.kernel
    );
    let _ = writeln!(
        md,
        "- tools: {} ({}), {}",
        env.ebtrace_version, env.revision, env.bpftrace_version
    );
    let _ = writeln!(
        md,
        "- target: `sched_workload --mode pingpong`, two threads bouncing one byte through \
         two pipes as fast as they can; {} rounds of untraced / ebtrace / bpftrace (order \
         rotated each round), {} s each, then one {} s ebtrace capture; took {:.0} s",
        o.rounds,
        o.seconds,
        o.long_seconds,
        took.as_secs_f64()
    );
    let _ = writeln!(
        md,
        "- {}",
        match o.target_cpu {
            Some(cpu) => format!(
                "target pinned to CPU {cpu} (ping and pong share it; unpinned, the scheduler \
                 flips between one-CPU and two-CPU placements whose rates differ 5x); the \
                 tracers are not pinned"
            ),
            None => "target not pinned (rates vary with the scheduler's placement)".into(),
        }
    );
    let _ = writeln!(
        md,
        "- each run: the target starts, is stopped (SIGSTOP) once it has named its threads, the \
         tracer starts and attaches, the target continues for the run's seconds; its round-trip \
         rate excludes the stopped time"
    );
    if env.virtual_machine {
        let _ = writeln!(
            md,
            "\n> Measured in a VM, where every probe hit costs several times what it costs on \
             bare metal. Absolute slow-downs are inflated: compare the ratios, ebtrace against \
             bpftrace in the same run."
        );
    }

    overhead(&mut md, runs);
    event_rate(&mut md, runs);
    memory(&mut md, runs);
    attach(&mut md, runs);
    md
}

/// a. Round trips per second under each configuration.
fn overhead(md: &mut String, runs: &[Run]) {
    let _ = writeln!(md, "\n### a. Overhead on the target\n");
    let _ = writeln!(
        md,
        "| configuration | round trips/s (median) | each round | vs untraced |"
    );
    let _ = writeln!(md, "|---|---:|---|---:|");
    let rates = |c: Config| -> Vec<f64> {
        runs.iter()
            .filter(|r| r.config == c && r.round.is_some())
            .map(|r| r.round_trips_per_s)
            .collect()
    };
    let base = median(&rates(Config::Untraced));
    for &c in Config::ALL {
        let v = rates(c);
        let what = match c {
            Config::Untraced => "untraced",
            Config::Ebtrace => {
                "ebtrace (records every switch and wakeup of the target; raw tracepoints)"
            }
            Config::EbtraceClassic => "ebtrace, classic tracepoints (the same records)",
            Config::EbtraceKept => {
                "ebtrace serve between captures (probes kept attached, recording nothing)"
            }
            Config::Bpftrace => "bpftrace (counts the same switches and wakeups per CPU)",
        };
        let each: Vec<String> = v.iter().map(|x| thousands(*x)).collect();
        let _ = writeln!(
            md,
            "| {what} | {} | {} | {:.2} |",
            thousands(median(&v)),
            each.join(" / "),
            harness::ratio(median(&v), base)
        );
    }
    let bt: Vec<_> = runs
        .iter()
        .filter_map(|r| Some((r, r.bpftrace.as_ref()?)))
        .collect();
    if !bt.is_empty() {
        let per_rt = |n: fn(&super::BpftraceRun) -> u64| {
            let v: Vec<f64> = bt
                .iter()
                .map(|(r, b)| n(b) as f64 / (r.round_trips_per_s * r.seconds))
                .collect();
            median(&v)
        };
        let _ = writeln!(
            md,
            "\nbpftrace saw {:.2} switches and {:.2} wakeups per round trip (median): the events \
             both tracers handle.",
            per_rt(|b| b.switches),
            per_rt(|b| b.wakeups)
        );
        // What each event handled costs the target: the time added per
        // round trip, over the events in a round trip.
        let events_per_rt = per_rt(|b| b.switches) + per_rt(|b| b.wakeups);
        let spread = spread(&rates(Config::Untraced));
        let cost = |c: Config| added_cost(median(&rates(c)), base, spread, events_per_rt);
        let bpftrace = cost(Config::Bpftrace);
        let _ = writeln!(
            md,
            "\n| configuration | added ns per event | vs bpftrace |\n|---|---:|---:|"
        );
        for c in [
            Config::Ebtrace,
            Config::EbtraceClassic,
            Config::EbtraceKept,
            Config::Bpftrace,
        ] {
            let (added, versus) = match (cost(c), &bpftrace) {
                (Ok(ns), Ok(bt)) => (
                    format!("{ns:.0}"),
                    format!("{:.2}", harness::ratio(ns, *bt)),
                ),
                (Ok(ns), Err(_)) => (format!("{ns:.0}"), "not resolved".to_string()),
                (Err(why), _) => (why, "not resolved".to_string()),
            };
            let _ = writeln!(md, "| {} | {added} | {versus} |", c.label());
        }
    }
}

/// Half the range of `values` over their median: the spread of a rate
/// between rounds, as a fraction.
fn spread(values: &[f64]) -> f64 {
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    if values.is_empty() {
        return 0.0;
    }
    (max - min) / 2.0 / median(values).max(1e-9)
}

/// The ns a tracer adds to each event it handles, from the round-trip rate
/// it left (`traced`) and the untraced one (`base`, whose rounds spread by
/// `spread`); or, where the slowdown is within that spread, why it is not
/// resolved and what would resolve it.
fn added_cost(traced: f64, base: f64, spread: f64, events_per_rt: f64) -> Result<f64, String> {
    let slowdown = 1.0 - traced / base.max(1e-9);
    if slowdown <= spread {
        let how = if traced > base {
            "traced ran faster than untraced"
        } else {
            "the slowdown is within the noise"
        };
        return Err(format!(
            "not resolved ({how}; spread ±{:.0}%: more rounds or a quieter machine)",
            spread * 100.0
        ));
    }
    Ok((1.0 / traced - 1.0 / base) * 1e9 / events_per_rt)
}

/// b. Records per second of capture window, and drops.
fn event_rate(md: &mut String, runs: &[Run]) {
    let _ = writeln!(md, "\n### b. Scheduling event rate recorded by ebtrace\n");
    let _ = writeln!(
        md,
        "| run | window | records | records/s | dropped |\n|---|---:|---:|---:|---:|"
    );
    let mut best_clean: Option<f64> = None;
    let mut dropping = Vec::new();
    for r in runs {
        let Some(e) = &r.ebtrace else { continue };
        let rate = e.records as f64 / e.window_s.max(1e-9);
        let _ = writeln!(
            md,
            "| {} | {:.2} s | {} | {} | {} |",
            run_label(r),
            e.window_s,
            thousands(e.records as f64),
            thousands(rate),
            thousands(e.dropped as f64)
        );
        if e.dropped == 0 {
            best_clean = Some(best_clean.map_or(rate, |b: f64| b.max(rate)));
        } else {
            dropping.push(rate);
        }
    }
    match best_clean {
        Some(b) => {
            let _ = writeln!(
                md,
                "\nHighest rate with zero drops: **{} records/s** (default 16 MiB ring buffer). \
                 This is what the target produced, not a ceiling found by pushing ebtrace.",
                thousands(b)
            );
        }
        None => {
            let _ = writeln!(md, "\nEvery ebtrace run dropped records.");
        }
    }
    if !dropping.is_empty() {
        let rates: Vec<String> = dropping.iter().map(|x| thousands(*x)).collect();
        let _ = writeln!(md, "Drops seen at: {} records/s.", rates.join(", "));
    }
}

/// c. Peak RSS against records held.
fn memory(md: &mut String, runs: &[Run]) {
    let _ = writeln!(md, "\n### c. Peak RSS of ebtrace\n");
    let _ = writeln!(
        md,
        "| run | records | peak RSS | MiB per million records |\n|---|---:|---:|---:|"
    );
    let caps: Vec<_> = runs
        .iter()
        .filter_map(|r| Some((r, r.ebtrace.as_ref()?)))
        .collect();
    for (r, e) in &caps {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} MiB | {:.1} |",
            run_label(r),
            thousands(e.records as f64),
            mib(e.peak_rss_kib),
            mib(e.peak_rss_kib) / (e.records as f64 / 1e6).max(1e-9)
        );
    }
    // The marginal cost, between the smallest and the largest capture,
    // leaves out the fixed part (binary, eBPF object, ring buffer mapping).
    let smallest = caps.iter().min_by_key(|(_, e)| e.records);
    let largest = caps.iter().max_by_key(|(_, e)| e.records);
    // Only meaningful when the captures differ enough in size.
    if let (Some((_, s)), Some((_, l))) = (smallest, largest)
        && l.records as f64 >= 1.5 * s.records as f64
    {
        let slope =
            (mib(l.peak_rss_kib) - mib(s.peak_rss_kib)) / ((l.records - s.records) as f64 / 1e6);
        let _ = writeln!(
            md,
            "\nMarginal: **{slope:.1} MiB per million records** (largest against smallest capture)."
        );
    }
}

/// d. From spawn to probes attached.
fn attach(md: &mut String, runs: &[Run]) {
    let _ = writeln!(md, "\n### d. Time to attach\n");
    let _ = writeln!(
        md,
        "| measure | median | min | max | runs |\n|---|---:|---:|---:|---:|"
    );
    let row = |md: &mut String, what: &str, v: Vec<f64>| {
        if v.is_empty() {
            return;
        }
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        let _ = writeln!(
            md,
            "| {what} | {:.0} ms | {min:.0} ms | {max:.0} ms | {} |",
            median(&v),
            v.len()
        );
    };
    let eb: Vec<_> = runs.iter().filter_map(|r| r.ebtrace.as_ref()).collect();
    let bt: Vec<_> = runs.iter().filter_map(|r| r.bpftrace.as_ref()).collect();
    row(
        md,
        "ebtrace: spawn → \"probes attached\" line (wall clock)",
        eb.iter().map(|e| ms(e.spawn_to_attached)).collect(),
    );
    row(
        md,
        "ebtrace: attach time it prints",
        eb.iter().map(|e| ms(e.reported_attach)).collect(),
    );
    row(
        md,
        "bpftrace: spawn → \"Attaching N probes...\"",
        bt.iter().map(|b| ms(b.spawn_to_attaching)).collect(),
    );
    row(
        md,
        "bpftrace: spawn → BEGIN fired (probes attached)",
        bt.iter().map(|b| ms(b.spawn_to_ready)).collect(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cost_within_the_noise_is_not_resolved() {
        let untraced = [100_000.0, 96_000.0, 104_000.0];
        let s = spread(&untraced);
        assert!((s - 0.04).abs() < 1e-9);
        let faster = added_cost(110_000.0, 100_000.0, s, 4.0).unwrap_err();
        assert!(
            faster.contains("traced ran faster than untraced"),
            "{faster}"
        );
        assert!(faster.contains("±4%"), "{faster}");
        let within = added_cost(97_000.0, 100_000.0, s, 4.0).unwrap_err();
        assert!(within.contains("within the noise"), "{within}");
        // 10 µs a round trip untraced, 12.5 µs traced: 2.5 µs over 4 events.
        let ns = added_cost(80_000.0, 100_000.0, s, 4.0).unwrap();
        assert!((ns - 625.0).abs() < 1e-6, "{ns}");
    }
}
