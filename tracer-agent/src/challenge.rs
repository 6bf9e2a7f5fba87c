//! The preloaded agent's proof of its peer: a fresh random challenge per
//! connection, kept in the program's memory, whose address the
//! [`protocol::HELLO`] gives. Only a peer that may read the program's
//! memory (`/proc/PID/mem`: root with `CAP_SYS_PTRACE`, or the program's
//! user where ptrace is allowed) can send it back, and such a peer could
//! load the agent itself anyway. So root in another container that shares
//! only the network namespace (Kubernetes' `hostNetwork`) cannot drive the
//! agent.

use core::sync::atomic::{AtomicU8, Ordering};

use crate::{
    agent::Read,
    protocol::{self, CHALLENGE_LEN, Header},
    sys,
};

/// The current connection's challenge; zeros between connections.
static CHALLENGE: [AtomicU8; CHALLENGE_LEN] = [const { AtomicU8::new(0) }; CHALLENGE_LEN];

/// Draws a new challenge; returns its address, or `None` when the kernel
/// gives no randomness (the connection is then refused).
pub fn fresh() -> Option<u64> {
    let mut bytes = [0u8; CHALLENGE_LEN];
    // SAFETY: a valid buffer of the length given.
    let n = unsafe { sys::getrandom(bytes.as_mut_ptr().cast(), CHALLENGE_LEN, 0) };
    if n != CHALLENGE_LEN as isize || bytes.iter().all(|b| *b == 0) {
        return None;
    }
    for (slot, b) in CHALLENGE.iter().zip(bytes) {
        slot.store(b, Ordering::Relaxed);
    }
    Some(CHALLENGE.as_ptr() as u64)
}

/// Waits up to [`protocol::PROOF_TIMEOUT_MS`] for a [`protocol::PROVE`]
/// frame read with `read(buf, deadline)`; true if it holds the challenge.
/// The challenge is cleared either way: each one proves once.
pub fn await_proof(mut read: impl FnMut(&mut [u8], u64) -> Read) -> bool {
    let deadline =
        sys::monotonic_ns().saturating_add(u64::from(protocol::PROOF_TIMEOUT_MS) * 1_000_000);
    let mut h = [0u8; protocol::HEADER_LEN];
    let mut proof = [0u8; CHALLENGE_LEN];
    let proven = read(&mut h, deadline) == Read::Done
        && Header::decode(&h)
            == (Header {
                kind: protocol::PROVE,
                len: CHALLENGE_LEN as u32,
            })
        && read(&mut proof, deadline) == Read::Done
        && matches(&proof);
    for slot in &CHALLENGE {
        slot.store(0, Ordering::Relaxed);
    }
    proven
}

/// Whether `proof` is the challenge, in time independent of where they
/// differ.
fn matches(proof: &[u8; CHALLENGE_LEN]) -> bool {
    let differ = CHALLENGE.iter().zip(proof).fold(0u8, |acc, (slot, p)| {
        acc | (slot.load(Ordering::Relaxed) ^ p)
    });
    differ == 0
}
