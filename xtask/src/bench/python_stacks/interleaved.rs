//! What Python frames add to the stack program's cost, measured
//! interleaved: one ebtrace capture of one target, its Python frames
//! switched off and on again every [`PHASE`] (its entry in the map the
//! program reads, see [`PythonFramesSwitch`]), the program's run time read
//! at each switch. The machine's speed drifts over seconds, so runs a
//! round apart disagree by more than the frames cost; two phases half a
//! second apart see the same machine, and the ratio of each pair is what
//! the frames add. ebtrace runs on the other CPUs, so that its own work
//! (naming the frames, more of it with them on) does not share the
//! target's CPU and caches.

use std::{fmt::Write as _, process::Command, thread, time::Duration};

use anyhow::Result;

use super::{Bench, HZ, Target, WARM_UP, raw_summary};
use crate::{
    bench::{
        bpf::{BpfStats, ProgStats, PythonFramesSwitch},
        harness,
    },
    util::{self, median},
};

/// How long each phase, with and without the frames, lasts.
const PHASE: Duration = Duration::from_millis(500);

/// The program's time per second of each pair of phases.
pub(super) struct Interleaved {
    /// (with Python frames, without), ns of program time a second.
    pub pairs: Vec<(f64, f64)>,
    /// The target's samples a second over the capture.
    pub samples_per_s: f64,
}

impl Interleaved {
    /// What the frames add in each pair, in percent.
    fn added(&self) -> Vec<f64> {
        self.pairs
            .iter()
            .map(|(with, without)| (with / without - 1.0) * 100.0)
            .collect()
    }
}

impl Bench {
    /// One capture of a fresh target with Python frames, switched off and
    /// on for `seconds`.
    pub(super) fn interleaved(&self, seconds: f64) -> Result<Interleaved> {
        let target = Target::start(&self.python, &self.fixture, self.target_cpu)?;
        thread::sleep(WARM_UP);
        let _stats = BpfStats::enable()?;
        let logdir = self.scratch.join(format!("interleaved-{}", target.pid));
        let duration = format!("{}s", seconds.ceil() + 2.0);
        let mut cmd = harness::ebtrace_command(&self.ebtrace, target.pid, &duration, &logdir);
        cmd.args(["--sample-hz", HZ]);
        let mut t = harness::spawn_ebtrace(cmd, harness::attached, Duration::from_secs(60))?;
        if let Some(cpus) = self.target_cpu.and_then(other_cpus) {
            let pid = t.pid().to_string();
            let pin = Command::new("taskset")
                .args(["-a", "-p", "-c", &cpus, &pid])
                .output()?;
            util::check_status("taskset", pin.status)?;
        }
        let switch = PythonFramesSwitch::find(t.pid(), target.pid)?;
        let pairs = (seconds / (2.0 * PHASE.as_secs_f64())).ceil() as usize;
        let mut phases = Vec::with_capacity(pairs);
        for _ in 0..pairs {
            let with = phase(t.pid())?;
            switch.off()?;
            let without = phase(t.pid());
            switch.on()?;
            phases.push((with, without?));
        }
        harness::finish_ebtrace(&mut t)?;
        let _ = std::fs::remove_dir_all(&logdir);
        let summary = raw_summary(t.stdout())?;
        let window_s = summary["window"]["duration_ns"].as_f64().unwrap_or(0.0) / 1e9;
        let samples = summary["cpu_samples"].as_u64().unwrap_or(0);
        Ok(Interleaved {
            pairs: phases,
            samples_per_s: samples as f64 / window_s.max(1e-9),
        })
    }
}

/// The CPUs other than `cpu`, as taskset lists them; `None` if it is the only one.
fn other_cpus(cpu: usize) -> Option<String> {
    let online = std::thread::available_parallelism().map_or(1, |n| n.get());
    let others: Vec<String> = (0..online)
        .filter(|&c| c != cpu)
        .map(|c| c.to_string())
        .collect();
    (!others.is_empty()).then(|| others.join(","))
}

/// The stack program's time a second over one [`PHASE`].
fn phase(ebtrace_pid: u32) -> Result<f64> {
    let first = ProgStats::read(ebtrace_pid)?;
    thread::sleep(PHASE);
    let last = ProgStats::read(ebtrace_pid)?;
    let (ns, _) = last.since(&first)?;
    Ok(ns / (last.at - first.at))
}

/// The report's section on the interleaved capture.
pub(super) fn render(md: &mut String, run: &Interleaved) {
    let mut added = run.added();
    added.sort_by(f64::total_cmp);
    let quartile = |q: f64| added[((added.len() - 1) as f64 * q).round() as usize];
    let per_sample = |f: fn(&(f64, f64)) -> f64| {
        let v: Vec<f64> = run.pairs.iter().map(f).collect();
        median(&v) / run.samples_per_s.max(1.0)
    };
    let (with, without) = (per_sample(|p| p.0), per_sample(|p| p.1));
    let _ = writeln!(
        md,
        "\n### e. Python frames' cost, interleaved\n\nOne capture at {HZ} Hz, the target's \
         Python frames switched off and on every {} ms (its entry in the map the stack program \
         reads), {} pairs of phases, ebtrace itself on the other CPUs; the program's time in \
         each phase, and what the frames add in each pair.\n\n| | ns a sample (median) |\n|---|---:|\n| with Python frames | \
         {with:.0} |\n| without | {without:.0} |\n",
        PHASE.as_millis(),
        run.pairs.len()
    );
    if added.is_empty() {
        return;
    }
    let (low, mid, high) = (quartile(0.25), quartile(0.5), quartile(0.75));
    let _ = writeln!(
        md,
        "**Python frames add {mid:.0}%** to what native sampling costs in the kernel \
         (the median pair; interquartile range {low:.0}% to {high:.0}%)."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_and_their_quartiles() {
        let run = Interleaved {
            pairs: vec![
                (1500.0, 1000.0),
                (1100.0, 1000.0),
                (1300.0, 1000.0),
                (2400.0, 2000.0),
                (2800.0, 2000.0),
            ],
            samples_per_s: 100.0,
        };
        let added: Vec<i64> = run.added().iter().map(|a| a.round() as i64).collect();
        assert_eq!(added, [50, 10, 30, 20, 40]);
        let mut md = String::new();
        render(&mut md, &run);
        assert!(md.contains("| with Python frames | 15 |"), "{md}");
        assert!(md.contains("| without | 10 |"), "{md}");
        assert!(md.contains("**Python frames add 30%**"), "{md}");
        assert!(md.contains("interquartile range 20% to 40%"), "{md}");
    }
}
