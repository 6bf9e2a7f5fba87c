//! The other threads a thread's states and marks name (who woke it, whom
//! it woke), each held once per timeline: a wake-up then names its peer
//! in a few bits instead of a tid and a pid, which keeps a thread state
//! in eight bytes (see [`super::packed`]).

use rustc_hash::FxHashMap;

/// A thread named by a wake-up, traced or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Peer {
    /// Its thread id.
    pub tid: u32,
    /// Its process id.
    pub pid: u32,
}

/// A [`Peer`]'s number in its timeline's [`Timeline::peers`](super::Timeline::peers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(u32);

impl PeerId {
    /// Bits a packed state or mark keeps for a peer.
    pub(super) const BITS: u32 = 29;
    const MAX: u32 = (1 << Self::BITS) - 1;

    /// The `index`th peer of a table; `None` past what a packed state holds.
    pub fn new(index: usize) -> Option<Self> {
        u32::try_from(index)
            .ok()
            .filter(|&i| i <= Self::MAX)
            .map(PeerId)
    }

    /// Its index in [`Timeline::peers`](super::Timeline::peers).
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// From the bits [`get`](Self::get) gave (masked to [`Self::BITS`]).
    pub(super) fn from_bits(bits: u32) -> Self {
        PeerId(bits & Self::MAX)
    }

    pub(super) fn get(self) -> u32 {
        self.0
    }
}

/// The thread `id` numbers in `peers` (tid and pid 0 if `id` is not
/// from that table).
pub fn peer_in(peers: &[Peer], id: PeerId) -> Peer {
    peers.get(id.index()).copied().unwrap_or_default()
}

/// Numbers peers as a timeline is built: the same thread, the same number.
#[derive(Debug, Default)]
pub struct PeerTable {
    peers: Vec<Peer>,
    ids: FxHashMap<Peer, PeerId>,
    /// The last peer numbered per slot of its tid's low bits: a wake-up
    /// names one of a few threads most of the time, each twice (as the
    /// woken and as the waker).
    recent: [Option<(Peer, PeerId)>; RECENT],
}

/// Slots of [`PeerTable::recent`].
const RECENT: usize = 32;

impl PeerTable {
    /// The number of `peer`, given on first sight. Past 2^29 distinct
    /// threads (a hundred times Linux's whole pid space, and gigabytes of
    /// table) later ones share the last number.
    pub fn id(&mut self, peer: Peer) -> PeerId {
        if let Some((seen, id)) = self.recent[peer.tid as usize % RECENT]
            && seen == peer
        {
            return id;
        }
        let id = *self.ids.entry(peer).or_insert_with(|| {
            let id = PeerId::new(self.peers.len()).unwrap_or(PeerId(PeerId::MAX));
            if id.index() == self.peers.len() {
                self.peers.push(peer);
            }
            id
        });
        self.recent[peer.tid as usize % RECENT] = Some((peer, id));
        id
    }

    /// The peers, in the order of their numbers.
    pub fn into_peers(self) -> Vec<Peer> {
        self.peers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_thread_gets_the_same_number() {
        let mut table = PeerTable::default();
        let a = table.id(Peer { tid: 7, pid: 7 });
        let b = table.id(Peer { tid: 8, pid: 7 });
        // A tid the kernel handed to another process since.
        let c = table.id(Peer { tid: 7, pid: 9 });
        assert_eq!(table.id(Peer { tid: 7, pid: 7 }), a);
        assert_eq!([a.index(), b.index(), c.index()], [0, 1, 2]);
        let peers = table.into_peers();
        assert_eq!(peers[c.index()], Peer { tid: 7, pid: 9 });
    }

    #[test]
    fn numbers_stop_where_packed_states_do() {
        assert!(PeerId::new((1 << 29) - 1).is_some());
        assert!(PeerId::new(1 << 29).is_none());
    }
}
