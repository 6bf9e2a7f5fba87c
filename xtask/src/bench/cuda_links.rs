//! Part c of the CUDA benchmark: attaching and releasing the driver probes,
//! one `uprobe_multi` link per program (ebtrace's default where the kernel
//! has them) against one perf-event link per function and program
//! (`EBTRACE_UPROBE_LINKS=perf`, what older kernels get).
//!
//! Per round and way of linking, on a `cuda_workload` that has loaded the
//! stand-in driver and waits (so nothing but the probes changes):
//! - **attach**: from spawning ebtrace to its `probes attached` line;
//! - **release when killed**: from SIGKILL to ebtrace reaped (its exit
//!   closes the links, so this is what releasing them costs);
//! - **attach right after**: a capture started as soon as a previous one
//!   has ended normally, while the child that one forked releases its
//!   links in the background.

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::{Result, bail};

use super::{
    harness::{self, Configuration},
    tracer::Traced,
};
use crate::util::median;

/// How ebtrace links the driver probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Links {
    Multi,
    Perf,
}

impl Configuration for Links {
    const ALL: &'static [Links] = &[Links::Perf, Links::Multi];

    fn label(self) -> &'static str {
        match self {
            Links::Multi => "one uprobe_multi link per program",
            Links::Perf => "one perf-event link per function and program",
        }
    }
}

impl Links {
    /// What ebtrace's CUDA probe line says for this way.
    fn said(self) -> &'static str {
        match self {
            Links::Multi => " uprobe_multi links",
            Links::Perf => " perf-event uprobe links",
        }
    }
}

#[derive(Clone, Debug)]
pub struct LinkRun {
    pub links: Links,
    /// How many links ebtrace made (from its CUDA probe line).
    pub count: u64,
    pub attach: Duration,
    pub release_killed: Duration,
    pub attach_after: Duration,
}

/// One round for `links` on the waiting workload `pid`.
pub fn run(ebtrace: &Path, pid: u32, links: Links, scratch: &Path) -> Result<LinkRun> {
    let spawn = |tag: &str, duration: &str| -> Result<Traced> {
        let mut cmd = harness::ebtrace_command(ebtrace, pid, duration, &scratch.join(tag));
        cmd.args(["--no-agent", "--no-device-activity"]);
        if links == Links::Perf {
            cmd.env("EBTRACE_UPROBE_LINKS", "perf");
        }
        harness::spawn_ebtrace(cmd, harness::attached, Duration::from_secs(120))
    };
    // The line naming the links comes right after the attached one.
    let attached = |t: &mut Traced| -> Result<(Duration, u64)> {
        let at = t.last_mark().expect("a mark");
        let line = t.wait_line(
            |l| l.contains("CUDA driver functions in"),
            Duration::from_secs(10),
        )?;
        let count = line
            .split(", through ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok());
        match count {
            Some(n) if line.contains(links.said()) => Ok((at, n)),
            _ => bail!("expected{} in {line:?}", links.said()),
        }
    };

    let mut first = spawn("quiet", "120s")?;
    let (attach, count) = attached(&mut first)?;
    let release_killed = first.kill_and_reap()?;

    let mut previous = spawn("previous", "500ms")?;
    attached(&mut previous)?;
    harness::finish_ebtrace(&mut previous)?;
    let mut next = spawn("next", "120s")?;
    let (attach_after, _) = attached(&mut next)?;
    // Its links, and by then the previous one's, are released before the
    // next round starts.
    next.kill_and_reap()?;
    Ok(LinkRun {
        links,
        count,
        attach,
        release_killed,
        attach_after,
    })
}

/// Part c of the report.
pub fn render(md: &mut String, runs: &[LinkRun]) {
    let _ = writeln!(
        md,
        "\n### c. Attaching and releasing the driver probes\n\n\
         The workload has loaded the driver and waits; `--no-agent --no-device-activity`. \
         Medians, each round in brackets.\n\n\
         | links | attach | release when killed | attach right after a capture |\n\
         |---|---:|---:|---:|"
    );
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let column = |links: Links, f: &dyn Fn(&LinkRun) -> Duration| -> (f64, String) {
        let v: Vec<f64> = runs
            .iter()
            .filter(|r| r.links == links)
            .map(|r| ms(&f(r)))
            .collect();
        (median(&v), harness::median_each(&v, 0, "ms"))
    };
    type Pick = fn(&LinkRun) -> Duration;
    let picks: [Pick; 3] = [|r| r.attach, |r| r.release_killed, |r| r.attach_after];
    let mut medians = Vec::new();
    for &links in Links::ALL {
        let count = runs
            .iter()
            .find(|r| r.links == links)
            .map_or(0, |r| r.count);
        let cells: Vec<(f64, String)> = picks.iter().map(|p| column(links, p)).collect();
        let _ = writeln!(
            md,
            "| {} ({count} links) | {} |",
            links.label(),
            cells
                .iter()
                .map(|c| c.1.as_str())
                .collect::<Vec<_>>()
                .join(" | ")
        );
        medians.push(cells.iter().map(|c| c.0).collect::<Vec<_>>());
    }
    if let [perf, multi] = &medians[..] {
        let ratios: Vec<String> = perf
            .iter()
            .zip(multi)
            .map(|(p, m)| format!("{:.1}x", harness::ratio(*p, m.max(0.001))))
            .collect();
        let _ = writeln!(md, "| perf-event / uprobe_multi | {} |", ratios.join(" | "));
    }
}
