//! Thread states and marks as a timeline stores them: eight bytes each.
//! A capture's slices and marks are the bulk of its memory, and as enums
//! a woken state (peer and flow) or a wake-up mark takes sixteen.
//!
//! One `u64`: the variant in the low bits, then its fields. A wake-up's
//! peer takes [`PeerId::BITS`], its flow id the high 32 bits (0: none).
//! Every value has one encoding, so equal values compare equal packed.

use super::{FlowId, MarkKind, PeerId, RunnableCause, TaskState, ThreadState};

/// A [`ThreadState`] in eight bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PackedState(u64);

const RUNNING: u64 = 0;
const PREEMPTED: u64 = 1;
const YIELDED: u64 = 2;
const WOKEN: u64 = 3;
const CREATED: u64 = 4;
const AT_START: u64 = 5;
const BLOCKED: u64 = 6;
const UNKNOWN: u64 = 7;
const STATE_TAG_BITS: u32 = 3;
/// Above [`RUNNING`]'s tag: on a CPU as its stack samples show
/// ([`ThreadState::Sampled`]).
const SAMPLED_BIT: u64 = 1 << STATE_TAG_BITS;

/// Every task state, in declaration order: a packed one is its index.
const TASK_STATES: [TaskState; 8] = [
    TaskState::Sleeping,
    TaskState::DiskSleep,
    TaskState::Stopped,
    TaskState::TracingStop,
    TaskState::Dead,
    TaskState::Parked,
    TaskState::Idle,
    TaskState::Unknown,
];

/// A peer and a flow id above a tag of `tag_bits`.
fn link(tag: u64, tag_bits: u32, peer: PeerId, flow_id: Option<FlowId>) -> u64 {
    tag | u64::from(peer.get()) << tag_bits | u64::from(flow_id.map_or(0, FlowId::get)) << 32
}

fn peer(packed: u64, tag_bits: u32) -> PeerId {
    PeerId::from_bits((packed >> tag_bits) as u32)
}

fn flow(packed: u64) -> Option<FlowId> {
    FlowId::new(high(packed))
}

/// `value` in the high 32 bits above `tag`.
fn with_high(tag: u64, value: u32) -> u64 {
    tag | u64::from(value) << 32
}

/// A field in the high 32 bits.
fn high(packed: u64) -> u32 {
    (packed >> 32) as u32
}

impl PackedState {
    pub fn new(state: ThreadState) -> Self {
        PackedState(match state {
            ThreadState::Running { cpu } => with_high(RUNNING, cpu),
            ThreadState::Sampled { cpu } => with_high(RUNNING | SAMPLED_BIT, cpu),
            ThreadState::Runnable { cause } => match cause {
                RunnableCause::Preempted => PREEMPTED,
                RunnableCause::Yielded => YIELDED,
                RunnableCause::Woken { waker, flow_id } => {
                    link(WOKEN, STATE_TAG_BITS, waker, flow_id)
                }
                RunnableCause::Created => CREATED,
                RunnableCause::AtStart => AT_START,
            },
            ThreadState::Blocked { state } => with_high(BLOCKED, state as u32),
            ThreadState::Unknown => UNKNOWN,
        })
    }

    #[inline]
    pub fn get(self) -> ThreadState {
        let p = self.0;
        let runnable = |cause| ThreadState::Runnable { cause };
        match p & ((1 << STATE_TAG_BITS) - 1) {
            RUNNING if p & SAMPLED_BIT != 0 => ThreadState::Sampled { cpu: high(p) },
            RUNNING => ThreadState::Running { cpu: high(p) },
            PREEMPTED => runnable(RunnableCause::Preempted),
            YIELDED => runnable(RunnableCause::Yielded),
            WOKEN => runnable(RunnableCause::Woken {
                waker: peer(p, STATE_TAG_BITS),
                flow_id: flow(p),
            }),
            CREATED => runnable(RunnableCause::Created),
            AT_START => runnable(RunnableCause::AtStart),
            BLOCKED => ThreadState::Blocked {
                state: TASK_STATES[high(p) as usize % TASK_STATES.len()],
            },
            _ => ThreadState::Unknown,
        }
    }
}

impl std::fmt::Debug for PackedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

/// A [`MarkKind`] in eight bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PackedMark(u64);

const WAKEUP: u64 = 0;
const THREAD_CREATED: u64 = 1;
const PROCESS_FORKED: u64 = 2;
const EXITED: u64 = 3;
const MARK_TAG_BITS: u32 = 2;

impl PackedMark {
    pub fn new(kind: MarkKind) -> Self {
        PackedMark(match kind {
            MarkKind::Wakeup { woken, flow_id } => link(WAKEUP, MARK_TAG_BITS, woken, flow_id),
            MarkKind::ThreadCreated { tid } => with_high(THREAD_CREATED, tid),
            MarkKind::ProcessForked { pid } => with_high(PROCESS_FORKED, pid),
            MarkKind::Exited => EXITED,
        })
    }

    #[inline]
    pub fn get(self) -> MarkKind {
        let p = self.0;
        match p & ((1 << MARK_TAG_BITS) - 1) {
            WAKEUP => MarkKind::Wakeup {
                woken: peer(p, MARK_TAG_BITS),
                flow_id: flow(p),
            },
            THREAD_CREATED => MarkKind::ThreadCreated { tid: high(p) },
            PROCESS_FORKED => MarkKind::ProcessForked { pid: high(p) },
            _ => MarkKind::Exited,
        }
    }
}

impl std::fmt::Debug for PackedMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers() -> [PeerId; 3] {
        [0, 1, (1 << PeerId::BITS) - 1].map(|i| PeerId::new(i).unwrap())
    }

    fn flows() -> [Option<FlowId>; 3] {
        [None, FlowId::new(1), FlowId::new(u32::MAX)]
    }

    #[test]
    fn every_state_reads_back_as_packed() {
        let mut states = vec![ThreadState::Unknown];
        for cpu in [0, 1, u32::MAX] {
            states.push(ThreadState::Running { cpu });
            states.push(ThreadState::Sampled { cpu });
        }
        for state in TASK_STATES {
            states.push(ThreadState::Blocked { state });
        }
        let mut causes = vec![
            RunnableCause::Preempted,
            RunnableCause::Yielded,
            RunnableCause::Created,
            RunnableCause::AtStart,
        ];
        for waker in peers() {
            for flow_id in flows() {
                causes.push(RunnableCause::Woken { waker, flow_id });
            }
        }
        states.extend(
            causes
                .into_iter()
                .map(|cause| ThreadState::Runnable { cause }),
        );
        for (i, &state) in states.iter().enumerate() {
            let packed = PackedState::new(state);
            assert_eq!(packed.get(), state);
            // Different states never share an encoding.
            for &other in &states[..i] {
                assert_ne!(PackedState::new(other), packed, "{other:?} and {state:?}");
            }
        }
    }

    #[test]
    fn every_mark_reads_back_as_packed() {
        let mut kinds = vec![MarkKind::Exited];
        for id in [0, 1, u32::MAX] {
            kinds.push(MarkKind::ThreadCreated { tid: id });
            kinds.push(MarkKind::ProcessForked { pid: id });
        }
        for woken in peers() {
            for flow_id in flows() {
                kinds.push(MarkKind::Wakeup { woken, flow_id });
            }
        }
        for (i, &kind) in kinds.iter().enumerate() {
            let packed = PackedMark::new(kind);
            assert_eq!(packed.get(), kind);
            for &other in &kinds[..i] {
                assert_ne!(PackedMark::new(other), packed, "{other:?} and {kind:?}");
            }
        }
    }
}
