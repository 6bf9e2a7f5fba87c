//! `cargo bench -p tracer-user --bench unwind`: what unwinding one sampled
//! user stack costs ebtrace. A thread of this benchmark, `EBTRACE_BENCH_DEPTH`
//! calls deep (default 30), copies its registers and the top of its stack
//! as the sampling program copies a sampled thread's (16 KiB from the stack
//! pointer up, in 1 KiB pieces up to the first that cannot be read), and
//! [`StackUnwinder`] unwinds the copy:
//!
//! - **first**: a new unwinder: the process's mappings read, its objects
//!   opened, then the stack unwound;
//! - **again**: the same copy unwound `EBTRACE_BENCH_UNWINDS` times (default
//!   20,000) by that unwinder, whose rule cache now knows the addresses (a
//!   hot loop sampled over and over);
//! - **new unwinder each time**: the mappings read and objects opened for
//!   every stack, the cost a sample of a process seen for the first time
//!   pays (median of `EBTRACE_BENCH_ROUNDS`, default 20).

use std::{fs::File, hint::black_box, os::unix::fs::FileExt as _, time::Instant};

use ebtrace::symbols::unwind::{StackUnwinder, UserStack};
use tracer_common::stack::{STACK_COPY_BYTES, STACK_COPY_CHUNK};

use common::{env_or, median};

mod common;

/// This thread's registers and stack, copied as the sampling program
/// copies a sampled thread's.
struct Copy {
    ip: u64,
    sp: u64,
    bp: u64,
    bytes: Vec<u8>,
}

#[inline(never)]
fn copy_own_stack() -> Copy {
    let (ip, sp, bp): (u64, u64, u64);
    // SAFETY: reads three registers into locals; touches no memory.
    unsafe {
        std::arch::asm!(
            "lea {ip}, [rip]",
            "mov {sp}, rsp",
            "mov {bp}, rbp",
            ip = out(reg) ip,
            sp = out(reg) sp,
            bp = out(reg) bp,
        );
    }
    // Through /proc/self/mem, which fails where nothing is mapped (as the
    // program's reads do) where a plain read would fault.
    let mem = File::open("/proc/self/mem").expect("open /proc/self/mem");
    let mut bytes = vec![0; STACK_COPY_BYTES];
    let mut copied = 0;
    for piece in bytes.chunks_mut(STACK_COPY_CHUNK) {
        if mem.read_exact_at(piece, sp + copied as u64).is_err() {
            break;
        }
        copied += piece.len();
    }
    bytes.truncate(copied);
    Copy { ip, sp, bp, bytes }
}

#[inline(never)]
fn at_depth(depth: usize) -> Copy {
    let copy = if depth == 0 {
        copy_own_stack()
    } else {
        at_depth(depth - 1)
    };
    // Keeps the call from becoming a jump: every level is a frame.
    black_box(depth);
    copy
}

fn main() {
    let depth = env_or("EBTRACE_BENCH_DEPTH", 30);
    let unwinds = env_or("EBTRACE_BENCH_UNWINDS", 20_000).max(1);
    let rounds = env_or("EBTRACE_BENCH_ROUNDS", 20).max(1);
    let copy = std::thread::spawn(move || at_depth(depth))
        .join()
        .expect("copy a stack");
    let stack = UserStack {
        ip: copy.ip,
        sp: copy.sp,
        bp: copy.bp,
        bytes: &copy.bytes,
    };
    let pid = std::process::id();

    let mut unwinder = StackUnwinder::default();
    let started = Instant::now();
    let unwound = unwinder.unwind(pid, &stack).expect("this process unwinds");
    let first = started.elapsed();
    assert!(
        unwound.frames.len() > depth,
        "{} frames of a stack {depth} calls deep",
        unwound.frames.len()
    );

    let started = Instant::now();
    for _ in 0..unwinds {
        black_box(unwinder.unwind(pid, black_box(&stack)));
    }
    let again = started.elapsed() / unwinds as u32;

    let fresh = median(
        (0..rounds)
            .map(|_| {
                let mut unwinder = StackUnwinder::default();
                let started = Instant::now();
                black_box(unwinder.unwind(pid, &stack));
                started.elapsed()
            })
            .collect(),
    );

    println!(
        "unwind: a stack {depth} calls deep, {} bytes copied, {} frames ({})",
        copy.bytes.len(),
        unwound.frames.len(),
        if unwound.complete {
            "to the outermost"
        } else {
            "cut"
        }
    );
    println!("  first (maps read, objects opened): {first:?}");
    println!("  again, rules cached:               {again:?} per stack ({unwinds} stacks)");
    println!("  new unwinder each time:            {fresh:?} (median of {rounds})");
}
