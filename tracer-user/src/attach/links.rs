//! Releasing probe links. Closing a tracepoint or uprobe link waits for an
//! RCU grace period (tens of milliseconds); one after the other, seven
//! scheduler links took half a second and two hundred driver uprobes ten
//! seconds or more. Released from many threads at once, the waits overlap
//! (except where the kernel serializes them: perf-event uprobes, hence
//! [`uprobe_multi`](super::uprobe_multi) links for the driver).

use std::os::fd::IntoRawFd as _;

use aya::programs::{
    perf_event::PerfEventLink, raw_trace_point::RawTracePointLink, trace_point::TracePointLink,
    uprobe::UProbeLink,
};
use rustix::io::Errno;

use super::uprobe_multi;

/// Threads that release links together.
const RELEASE_THREADS: usize = 64;

/// A link ebtrace owns: dropping it detaches the program.
pub enum OwnedLink {
    /// A tracepoint program's link.
    TracePoint(TracePointLink),
    /// A raw tracepoint program's link.
    RawTracePoint(RawTracePointLink),
    /// A uprobe's link.
    UProbe(UProbeLink),
    /// A multi-uprobe link: one program on many offsets.
    UProbeMulti(uprobe_multi::Link),
    /// A perf-event program's link (CPU stack sampling).
    PerfEvent(PerfEventLink),
}

impl From<PerfEventLink> for OwnedLink {
    fn from(link: PerfEventLink) -> Self {
        OwnedLink::PerfEvent(link)
    }
}

impl From<TracePointLink> for OwnedLink {
    fn from(link: TracePointLink) -> Self {
        OwnedLink::TracePoint(link)
    }
}

impl From<RawTracePointLink> for OwnedLink {
    fn from(link: RawTracePointLink) -> Self {
        OwnedLink::RawTracePoint(link)
    }
}

impl From<UProbeLink> for OwnedLink {
    fn from(link: UProbeLink) -> Self {
        OwnedLink::UProbe(link)
    }
}

impl From<uprobe_multi::Link> for OwnedLink {
    fn from(link: uprobe_multi::Link) -> Self {
        OwnedLink::UProbeMulti(link)
    }
}

/// Releases `links` from up to [`RELEASE_THREADS`] threads at once and
/// returns when all are released.
pub fn release<L: Send>(links: Vec<L>) {
    if links.is_empty() {
        return;
    }
    let per_thread = links.len().div_ceil(RELEASE_THREADS);
    let mut links = links.into_iter();
    std::thread::scope(|scope| {
        loop {
            let chunk: Vec<L> = links.by_ref().take(per_thread).collect();
            if chunk.is_empty() {
                break;
            }
            scope.spawn(move || drop(chunk));
        }
    });
}

/// Lets this process exit without waiting for the kernel to release its
/// probe links: a forked child keeps a reference to every open descriptor,
/// waits for this process to exit (so that its own references go first,
/// cheaply), then exits, and the kernel releases the links in the child,
/// in the background. Call it last, after the trace is written. If fork
/// fails, this process's exit releases them itself.
pub fn release_after_exit() {
    let Ok((read_end, write_end)) = rustix::pipe::pipe() else {
        return;
    };
    // SAFETY: fork; the child below makes only plain syscalls, which are
    // async-signal-safe, as a child of a multithreaded process requires.
    if unsafe { libc::fork() } != 0 {
        // This process (or a failed fork): the write end stays open until
        // it exits.
        let _ = write_end.into_raw_fd();
        return;
    }
    // The child. Out of the terminal's session and off stdio: nobody waits
    // for it.
    drop(write_end);
    let _ = rustix::process::setsid();
    for fd in 0..=2 {
        // SAFETY: the standard descriptors, which nothing in this child
        // uses again.
        unsafe { libc::close(fd) };
    }
    let mut byte = [0u8];
    while rustix::io::read(&read_end, &mut byte) == Err(Errno::INTR) {}
    // SAFETY: ends the child at once, running nothing of the parent's
    // (no exit handlers, no destructors).
    unsafe { libc::_exit(0) }
}
