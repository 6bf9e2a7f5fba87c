//! The jax part's sections of the TraceMe report.

use std::{fmt::Write as _, time::Duration};

use super::{Capture, Config, JaxRun, SECONDS, SESSION_LEAD, SETTLE, Window};
use crate::{
    bench::{
        harness::{Configuration as _, each, median_each},
        report::thousands,
    },
    util::median,
};

/// The jaxlib line of the memory section.
pub fn render_memory(md: &mut String, j: &JaxRun) {
    let net = (j.rss_traced_kib - j.rss_control_kib) as f64 * 1024.0;
    let _ = writeln!(
        md,
        "- jaxlib 0.10.2 (`jax_workload.py --bench`, a 64x64 jitted step in a TraceAnnotation, \
         back to back): RSS grew {} KiB in {SECONDS} s untraced and {} KiB in {SECONDS} s of \
         ebtrace's uprobe route that recorded {} events: **{:.0} MB per million events** (names \
         longer than 15 bytes add a heap string each). That memory stays until a profiler \
         session in the process drains it; `--max-events` (default 1,000,000) bounds it.",
        j.rss_control_kib,
        j.rss_traced_kib,
        thousands(j.memory_events as f64),
        net / j.memory_events as f64
    );
}

/// The jaxlib section.
pub fn render(md: &mut String, j: &JaxRun) {
    let _ = writeln!(
        md,
        "\n#### d. jaxlib: ebtrace's agent route against jax's own session\n"
    );
    let _ = writeln!(
        md,
        "One `jax_workload.py --bench --bench-matrix {m}` process ({m}x{m} matmul steps); {} \
         rounds of {SECONDS} s windows of the {} \
         configurations, order rotated each round, {} s apart. For ebtrace the window is its \
         capture window (from its `tracing pid` line on, for `--duration {SECONDS}s`), not its \
         attach or teardown; jax's own session is started by the process (SIGUSR1) {:.1} s \
         before its window and stopped (SIGUSR2) after it. Steps per second of wall time \
         between the first and last progress line in the window (the workload's own counter); \
         **slowdown** = the round's untraced rate / this rate (median of the rounds); on-CPU \
         time of all the target's threads per step (`/proc/PID/task/*/schedstat`, the agent's \
         and the session's threads included).\n",
        j.rounds,
        Config::ALL.len(),
        SETTLE.as_secs(),
        SESSION_LEAD.as_secs_f64(),
        m = j.matrix,
    );
    let _ = writeln!(
        md,
        "| configuration | steps/s (median) | slowdown (median) | each round | CPU µs per step (median) | each round |"
    );
    let _ = writeln!(md, "|---|---:|---:|---|---:|---|");
    let of = |c: Config| -> Vec<&Window> { j.windows.iter().filter(|w| w.config == c).collect() };
    let slowdowns = |c: Config| -> Vec<f64> {
        of(c)
            .iter()
            .filter_map(|w| {
                let base = of(Config::Untraced)
                    .into_iter()
                    .find(|u| u.round == w.round)?;
                Some(base.steps_per_s / w.steps_per_s.max(1e-9))
            })
            .collect()
    };
    for &c in Config::ALL {
        let rates: Vec<f64> = of(c).iter().map(|w| w.steps_per_s).collect();
        let cpu: Vec<f64> = of(c).iter().map(|w| w.cpu_ns_per_step / 1e3).collect();
        let slow = slowdowns(c);
        let _ = writeln!(
            md,
            "| {} | {:.0} | {:.2}x | {} | {:.1} | {} |",
            c.describe(),
            median(&rates),
            median(&slow),
            each(&slow, 2),
            median(&cpu),
            each(&cpu, 1)
        );
    }
    let agent = median(&slowdowns(Config::Agent));
    let session = median(&slowdowns(Config::Session));
    let uprobe = median(&slowdowns(Config::Uprobe));
    let sched = median(&slowdowns(Config::SchedOnly));
    let cpu = |c: Config| median(&of(c).iter().map(|w| w.cpu_ns_per_step).collect::<Vec<_>>());
    let _ = writeln!(
        md,
        "\n**Agent route against jax's own session: {:.2}x its cost** (slowdown {agent:.2}x \
         against {session:.2}x; target ≤ 1.10x) and {:.2}x the uprobe route's ({uprobe:.2}x). \
         By CPU time per step: {:.2}x jax's own session's, {:.2}x the uprobe route's. \
         ebtrace's scheduling probes alone: slowdown {sched:.2}x, {:.1} CPU µs per step \
         (untraced {:.1}).",
        agent / session,
        agent / uprobe,
        cpu(Config::Agent) / cpu(Config::Session),
        cpu(Config::Agent) / cpu(Config::Uprobe),
        cpu(Config::SchedOnly) / 1e3,
        cpu(Config::Untraced) / 1e3,
    );
    let _ = writeln!(md, "\n#### e. Starting ebtrace on the jax process\n");
    let _ = writeln!(
        md,
        "Medians over the rounds (each round in brackets). *To window*: wall time from spawning \
         `ebtrace` to its `tracing pid` line, when the window opens; *attached*: ebtrace's own \
         `probes attached in`; *agent loaded*, *thread kept*: from its `TraceMe through \
         ebtrace's agent` line (the time one thread of the target was kept from its own code \
         while the agent was injected).\n"
    );
    let _ = writeln!(
        md,
        "| route | to window | attached | agent loaded | thread kept | events recorded per step |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|");
    for c in [Config::Agent, Config::Uprobe, Config::SchedOnly] {
        let caps: Vec<(&Window, &Capture)> = of(c)
            .into_iter()
            .filter_map(|w| Some((w, w.capture.as_ref()?)))
            .collect();
        let ms = |f: &dyn Fn(&Capture) -> Option<Duration>| -> String {
            let v: Vec<f64> = caps
                .iter()
                .filter_map(|(_, cap)| Some(f(cap)?.as_secs_f64() * 1e3))
                .collect();
            if v.is_empty() {
                return "–".to_string();
            }
            median_each(&v, 1, "ms")
        };
        let per_step: Vec<f64> = caps
            .iter()
            .filter_map(|(w, cap)| {
                let events = cap.session_events.or(cap.traceme_events)? as f64;
                // Events over the whole capture; steps over the window's
                // progress lines, scaled to its length.
                Some(events / (w.steps_per_s * SECONDS as f64).max(1.0))
            })
            .collect();
        let _ = writeln!(
            md,
            "| `--traceme {}` | {} | {} | {} | {} | {} |",
            c.route().expect("an ebtrace configuration"),
            ms(&|cap| Some(cap.spawn_to_window)),
            ms(&|cap| cap.attach),
            ms(&|cap| cap.agent_load),
            ms(&|cap| cap.thread_kept),
            if per_step.is_empty() {
                "–".to_string()
            } else {
                format!("{:.1}", median(&per_step))
            }
        );
    }
    let _ = writeln!(md);
    for c in [Config::Agent, Config::Uprobe] {
        if let Some(line) = of(c)
            .iter()
            .rev()
            .find_map(|w| w.capture.as_ref()?.route_line.clone())
        {
            let _ = writeln!(md, "- `--traceme {}`: `{line}`", c.route().unwrap_or(""));
        }
    }
}
