//! `ebtrace inject-check`: loads the agent into a process, exchanges a
//! ping with it and unloads it, a number of times, printing one JSON line
//! per cycle with the timings. It exists for the tests and for diagnosing
//! the loader on a machine (hidden from `--help`).

use std::{
    io::{Read as _, Write as _},
    path::Path,
    time::Duration,
};

use super::{AGENT_DETACH, InjectReport};

/// The agent's entry point.
pub const AGENT_ATTACH: &str = "ebtrace_agent_attach";

fn micros(d: Duration) -> u128 {
    d.as_micros()
}

fn report_json(r: &InjectReport) -> String {
    format!(
        "{{\"thread_diverted_us\":{},\"total_us\":{}}}",
        micros(r.thread_diverted),
        micros(r.total)
    )
}

/// Runs `cycles` load/ping/unload cycles on `pid` with the library at
/// `library`; returns the process exit code.
pub fn run(pid: u32, cycles: u32, library: Option<&Path>) -> i32 {
    let Some(path) = library else {
        eprintln!("ebtrace inject-check: error: this build embeds no agent; pass --library PATH");
        return crate::error::EXIT_USAGE;
    };
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "ebtrace inject-check: error: reading {}: {e}",
                path.display()
            );
            return crate::error::EXIT_USAGE;
        }
    };
    for cycle in 0..cycles {
        match one_cycle(pid, &bytes, cycle) {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("ebtrace inject-check: error: cycle {cycle}: {e}");
                return crate::error::EXIT_FAILURE;
            }
        }
    }
    0
}

fn one_cycle(pid: u32, library: &[u8], cycle: u32) -> Result<String, Box<dyn std::error::Error>> {
    let (injected, mut sock) = super::load(pid, library, AGENT_ATTACH)?;
    let tid = injected.tid;
    let load = injected.report;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let ping = (cycle % 200) as u8;
    sock.write_all(&[ping])?;
    let mut pong = [0u8];
    sock.read_exact(&mut pong)?;
    if pong[0] != ping.wrapping_add(1) {
        return Err(format!("the agent answered {} to ping {ping}", pong[0]).into());
    }
    // Tells the agent to finish (it stops at end of file).
    drop(sock);
    let unload = injected.unload(AGENT_DETACH)?;
    Ok(format!(
        "{{\"cycle\":{cycle},\"pid\":{pid},\"tid\":{tid},\"load\":{},\"unload\":{}}}",
        report_json(&load),
        report_json(&unload)
    ))
}
