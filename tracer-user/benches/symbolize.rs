//! `cargo bench -p tracer-user --bench symbolize`: what naming sampled
//! stacks costs in a large library, as a snapshot or a pprof profile of a
//! jax process does. The Python named by `EBTRACE_BENCH_PYTHON` imports
//! jax and waits; `EBTRACE_BENCH_ADDRESSES` addresses (default 2,000)
//! spread over the largest library it maps (jaxlib's `libjax_common.so`)
//! are named through [`StackSymbolizer`], as sampled addresses are:
//!
//! - **first batch**: a new symbolizer, every address new;
//! - **next batch**: the same symbolizer, as many addresses it has not seen
//!   (a later snapshot of the same process: blazesym reads the library
//!   again, as it lives for one batch);
//! - **cached**: the first batch's addresses again.
//!
//! Prints the median of `EBTRACE_BENCH_ROUNDS` rounds (default 3) of each.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    time::Instant,
};

use ebtrace::symbols::{
    maps::read_maps,
    stacks::{Space, StackSymbolizer},
};

use common::{env_or, median};

mod common;

fn main() {
    let Some(python) = std::env::var_os("EBTRACE_BENCH_PYTHON") else {
        eprintln!(
            "symbolize: set EBTRACE_BENCH_PYTHON to a Python that has jax to run this benchmark"
        );
        return;
    };
    let count = env_or("EBTRACE_BENCH_ADDRESSES", 2_000).max(1);
    let rounds = env_or("EBTRACE_BENCH_ROUNDS", 3).max(1);
    let mut child = Command::new(&python)
        .args([
            "-c",
            "import sys, jax; print(1, flush=True); sys.stdin.read()",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start Python");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("Python imported jax");
    let pid = child.id();
    // The largest object it has mapped executable: jaxlib's.
    let maps = read_maps(pid).expect("the child's maps");
    let mut sizes: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for m in maps
        .iter()
        .filter(|m| m.perms.contains('x') && m.path.starts_with('/'))
    {
        *sizes.entry(m.path.as_str()).or_default() += m.end - m.start;
    }
    let (file, _) = sizes
        .into_iter()
        .max_by_key(|(_, size)| *size)
        .expect("an executable mapping");
    let code: Vec<(u64, u64)> = maps
        .iter()
        .filter(|m| m.perms.contains('x') && m.path == file)
        .map(|m| (m.start, m.end))
        .collect();
    let text: u64 = code.iter().map(|(s, e)| e - s).sum();
    println!(
        "{file}: {:.1} MB of code; {count} addresses a batch, {rounds} rounds",
        text as f64 / 1e6
    );
    // Addresses spread evenly over the code; `shift` moves every one.
    let addresses = |shift: u64| -> Vec<u64> {
        let step = text / count as u64;
        (0..count as u64)
            .map(|i| {
                let mut at = i * step + shift;
                let mut found = 0;
                for (s, e) in &code {
                    if at < e - s {
                        found = s + at;
                        break;
                    }
                    at -= e - s;
                }
                found
            })
            .collect()
    };
    let space = Space::Process(pid);
    let (mut first, mut next, mut cached) = (Vec::new(), Vec::new(), Vec::new());
    let mut named = 0;
    for _ in 0..rounds {
        let mut symbolizer = StackSymbolizer::default();
        let batch = addresses(0);
        let t = Instant::now();
        symbolizer.resolve(space, batch.iter().copied());
        first.push(t.elapsed());
        named = batch
            .iter()
            .filter(|a| !symbolizer.get(space, **a).frames.is_empty())
            .count();
        let t = Instant::now();
        symbolizer.resolve(space, addresses(8));
        next.push(t.elapsed());
        let t = Instant::now();
        symbolizer.resolve(space, batch.iter().copied());
        cached.push(t.elapsed());
    }
    println!("named: {named} of {count}");
    println!("| batch | median | per address |");
    println!("|---|---:|---:|");
    for (what, times) in [("first", first), ("next", next), ("cached", cached)] {
        let m = median(times);
        println!(
            "| {what} | {:.1} ms | {:.1} us |",
            m.as_secs_f64() * 1e3,
            m.as_secs_f64() * 1e6 / count as f64
        );
    }
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
}
