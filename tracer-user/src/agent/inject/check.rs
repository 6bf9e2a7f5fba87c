//! `ebtrace inject-check`: loads the agent into a process, exchanges a
//! ping with it, reads every thread's `pthread_self()` as an agent session
//! does, and unloads it, a number of times, printing one JSON line per
//! cycle with the timings and the number of threads read. It exists for the tests and for diagnosing
//! the loader on a machine (hidden from `--help`). With `--library`, the
//! library given is loaded instead and pinged with one byte, which it
//! answers plus one (the tests' loader probe). `--hold` keeps each load
//! in place that long after the ping, as a capture would.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use super::{AGENT_DETACH, InjectReport, StopPoint};

/// The agent's entry point.
pub const AGENT_ATTACH: &str = tracer_agent::ATTACH_SYMBOL;

fn micros(d: Duration) -> u128 {
    d.as_micros()
}

fn report_json(r: &InjectReport) -> String {
    let stopped = match r.stopped {
        Some(StopPoint::Wait { syscall }) => format!("{{\"wait\":{syscall}}}"),
        Some(StopPoint::Code { ip }) => format!("{{\"ip\":{ip}}}"),
        None => "null".to_string(),
    };
    format!(
        "{{\"thread_diverted_us\":{},\"total_us\":{},\"stopped\":{stopped}}}",
        micros(r.thread_diverted),
        micros(r.total)
    )
}

/// Runs `cycles` load/ping/unload cycles on `pid` with the library at
/// `library`, each loaded for `hold` after its ping; returns the process
/// exit code.
pub fn run(pid: u32, cycles: u32, library: Option<&Path>, hold: Duration) -> i32 {
    let bytes = match library.map(std::fs::read) {
        None => crate::agent::LIBRARY.to_vec(),
        Some(Ok(b)) => b,
        Some(Err(e)) => {
            eprintln!(
                "ebtrace inject-check: error: reading {}: {e}",
                library.unwrap_or(Path::new("")).display()
            );
            return crate::error::EXIT_USAGE;
        }
    };
    let (ping, bye): (Ping, Ping) = if library.is_some() {
        (ping_probe, |_, _| Ok(()))
    } else {
        (ping_agent, bye_agent)
    };
    for cycle in 0..cycles {
        match one_cycle(pid, &bytes, cycle, [ping, bye], hold) {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("ebtrace inject-check: error: cycle {cycle}: {e}");
                return crate::error::EXIT_FAILURE;
            }
        }
    }
    0
}

/// How a cycle checks that the library it loaded answers.
type Ping = fn(&mut UnixStream, u32) -> Result<(), Box<dyn std::error::Error>>;

fn one_cycle(
    pid: u32,
    library: &[u8],
    cycle: u32,
    [ping, bye]: [Ping; 2],
    hold: Duration,
) -> Result<String, Box<dyn std::error::Error>> {
    let (injected, mut sock) = super::load(pid, library, AGENT_ATTACH)?;
    let tid = injected.tid;
    let load = injected.report;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    ping(&mut sock, cycle)?;
    let threads = super::thread_pointers(pid, |_| false)?.len();
    // The agent's thread serves its session meanwhile, as in a capture.
    std::thread::sleep(hold);
    bye(&mut sock, cycle)?;
    // Tells the library to finish (it stops at end of file).
    drop(sock);
    let unload = injected.unload(AGENT_DETACH)?;
    Ok(format!(
        "{{\"cycle\":{cycle},\"pid\":{pid},\"tid\":{tid},\"threads\":{threads},\"load\":{},\"unload\":{}}}",
        report_json(&load),
        report_json(&unload)
    ))
}

/// The loader probe: one byte, answered plus one.
fn ping_probe(sock: &mut UnixStream, cycle: u32) -> Result<(), Box<dyn std::error::Error>> {
    let ping = (cycle % 200) as u8;
    sock.write_all(&[ping])?;
    let mut pong = [0u8];
    sock.read_exact(&mut pong)?;
    if pong[0] != ping.wrapping_add(1) {
        return Err(format!("the library answered {} to ping {ping}", pong[0]).into());
    }
    Ok(())
}

/// The agent: its greeting, PING → PONG.
fn ping_agent(sock: &mut UnixStream, _cycle: u32) -> Result<(), Box<dyn std::error::Error>> {
    expect_frame(sock, tracer_agent::protocol::HELLO)?;
    exchange(
        sock,
        tracer_agent::protocol::PING,
        tracer_agent::protocol::PONG,
    )
}

/// The agent: SHUTDOWN → BYE, which ends its thread.
fn bye_agent(sock: &mut UnixStream, _cycle: u32) -> Result<(), Box<dyn std::error::Error>> {
    exchange(
        sock,
        tracer_agent::protocol::SHUTDOWN,
        tracer_agent::protocol::BYE,
    )
}

fn exchange(
    sock: &mut UnixStream,
    request: u32,
    answer: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    let header = tracer_agent::protocol::Header {
        kind: request,
        len: 0,
    };
    sock.write_all(&header.encode())?;
    expect_frame(sock, answer)
}

/// Reads one frame of the agent's, which must be of `kind`.
fn expect_frame(sock: &mut UnixStream, kind: u32) -> Result<(), Box<dyn std::error::Error>> {
    use tracer_agent::protocol::{self, Header};
    let mut h = [0u8; protocol::HEADER_LEN];
    sock.read_exact(&mut h)?;
    let header = Header::decode(&h);
    let mut payload = vec![0; header.len.min(4096) as usize];
    sock.read_exact(&mut payload)?;
    if header.kind != kind {
        return Err(format!("the agent sent frame {} for {kind}", header.kind).into());
    }
    Ok(())
}
