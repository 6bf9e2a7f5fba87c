//! Names for the kernels a program looked up before ebtrace attached (its
//! launches carry only a function handle): asked of the CUDA driver inside
//! the process, through the agent's session there, or through an agent
//! loaded for that question alone.
//!
//! The driver's answers come from the target, and a flight recorder asks
//! for days: what is kept is bounded. Names of handles that no record held
//! launches any more are forgotten, one name is kept to
//! [`MAX_NAME_BYTES`], all of them to [`MAX_NAMES_BYTES`], and a process's
//! lines to [`NOTES_PER_PROCESS`]; the bytes and the names forgotten are on
//! `/metrics` ([`kernel_name_stats`]).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::atomic::{AtomicU64, Ordering},
};

use super::{AgentError, AgentSession};
use crate::collect::agent::DriverKernelNames;

/// The most of one kernel's name kept, in bytes (the longest templated
/// names the CUDA libraries make take a few KiB).
pub const MAX_NAME_BYTES: usize = 16 << 10;
/// The most the names of one capture take, in bytes.
pub const MAX_NAMES_BYTES: usize = 32 << 20;
/// The lines kept per process: the latest, each said once.
const NOTES_PER_PROCESS: usize = 4;

/// Bytes of kernel names every capture keeps now.
static NAME_BYTES: AtomicU64 = AtomicU64::new(0);
/// Names forgotten or never kept, since ebtrace started.
static NAMES_FORGOTTEN: AtomicU64 = AtomicU64::new(0);

/// The kernel names ebtrace keeps, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelNameStats {
    /// Bytes of names kept now, all captures together.
    pub bytes: u64,
    /// Names forgotten (their launches no longer held) or not kept (past
    /// [`MAX_NAMES_BYTES`]), since ebtrace started.
    pub forgotten: u64,
}

/// [`KernelNameStats`] now.
pub fn kernel_name_stats() -> KernelNameStats {
    KernelNameStats {
        bytes: NAME_BYTES.load(Ordering::Relaxed),
        forgotten: NAMES_FORGOTTEN.load(Ordering::Relaxed),
    }
}

/// What the driver in a process answered: names by handle, or why not.
type DriverAnswer = Result<HashMap<u64, String>, AgentError>;

/// Asks the CUDA driver in each process for kernel names, once per handle.
#[derive(Default)]
pub struct KernelNaming {
    /// The names learnt so far, and what the user should know about them.
    pub found: DriverKernelNames,
    /// Handles the driver answered for, named or not: not asked again.
    answered: HashSet<(u32, u64)>,
    /// Handles asked for at least once, answered or not (for `counts`).
    tried: HashSet<(u32, u64)>,
    /// Bytes of the names in `found`.
    bytes: usize,
    /// The lines said of each process, oldest first (`found.notes`, all
    /// of them).
    notes: BTreeMap<u32, Vec<String>>,
}

impl Drop for KernelNaming {
    fn drop(&mut self) {
        NAME_BYTES.fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

impl KernelNaming {
    /// Asks for the names of `unnamed` handles (every unnamed handle the
    /// held records launch) the driver did not answer for before, per
    /// process: through its session in `sessions`, else (with
    /// `may_load_agent`, and while it runs) through an agent loaded now.
    /// Handles whose question failed (another ebtrace's agent was in the
    /// process, say) are asked again at the next call: a flight recorder's
    /// next snapshot names them. What was learnt of handles not in
    /// `unnamed` is forgotten.
    pub fn ask(
        &mut self,
        unnamed: BTreeMap<u32, BTreeSet<u64>>,
        sessions: &mut [AgentSession],
        may_load_agent: bool,
    ) {
        self.ask_with(unnamed, |pid, handles| {
            match sessions.iter_mut().find(|s| s.pid == pid) {
                // Busy converting: asked again at the next collection.
                Some(session) if session.framework_stopping() => None,
                Some(session) => Some(session.name_kernels(handles)),
                None if may_load_agent
                    && !super::channel::answers_abandoned()
                    && crate::procfs::is_alive(pid) =>
                {
                    Some(
                        AgentSession::connect_unless_busy(pid).and_then(|mut visit| {
                            let names = visit.name_kernels(handles);
                            visit
                                .close()
                                .map_err(|e| AgentError::TakeOut(Box::new(e)))?;
                            names
                        }),
                    )
                }
                None => None,
            }
        });
    }

    /// [`Self::ask`], asking the driver in a process through `ask` (`None`:
    /// not asked now).
    fn ask_with(
        &mut self,
        unnamed: BTreeMap<u32, BTreeSet<u64>>,
        mut ask: impl FnMut(u32, &[u64]) -> Option<DriverAnswer>,
    ) {
        self.forget_all_but(&unnamed);
        for (pid, handles) in unnamed {
            let handles: Vec<u64> = handles
                .into_iter()
                .filter(|h| !self.answered.contains(&(pid, *h)))
                .collect();
            if handles.is_empty() {
                continue;
            }
            let Some(answer) = ask(pid, &handles) else {
                continue;
            };
            let counts = self.found.counts.entry(pid).or_default();
            for h in &handles {
                counts.asked += u64::from(self.tried.insert((pid, *h)));
            }
            let line = match answer {
                Ok(names) => {
                    self.answered.extend(handles.iter().map(|h| (pid, *h)));
                    let (named, not_kept) = self.keep(pid, names);
                    let mut line = format!(
                        "pid {pid}: {named} of {} kernels launched with handles looked up before \
                         the capture named by the CUDA driver (cuFuncGetName)",
                        handles.len()
                    );
                    if not_kept > 0 {
                        line.push_str(&format!(
                            "; {not_kept} more names stay <unresolved>: the capture keeps at \
                             most {} MiB of kernel names",
                            MAX_NAMES_BYTES >> 20
                        ));
                    }
                    line
                }
                Err(why) => format!(
                    "pid {pid}: {} kernels launched with handles looked up before the capture \
                     stay <unresolved>: {why}",
                    handles.len()
                ),
            };
            self.say(pid, line);
        }
        self.found.notes = self.notes.values().flatten().cloned().collect();
    }

    /// Keeps what the driver in `pid` named, within the bounds: how many
    /// names were kept, and how many were not for want of room.
    fn keep(&mut self, pid: u32, names: HashMap<u64, String>) -> (u64, u64) {
        let (mut named, mut not_kept) = (0, 0);
        for (handle, mut name) in names {
            if name.len() > MAX_NAME_BYTES {
                let mut end = MAX_NAME_BYTES;
                while !name.is_char_boundary(end) {
                    end -= 1;
                }
                name.truncate(end);
            }
            if self.bytes + name.len() > MAX_NAMES_BYTES {
                not_kept += 1;
                continue;
            }
            self.add_bytes(name.len());
            if let Some(old) = self.found.names.insert((pid, handle), name) {
                self.sub_bytes(old.len());
            }
            named += 1;
        }
        self.found.counts.entry(pid).or_default().named += named;
        NAMES_FORGOTTEN.fetch_add(not_kept, Ordering::Relaxed);
        (named, not_kept)
    }

    /// Says `line` of `pid` (a line said before is not said again: a
    /// question failing the same way at every snapshot of a recorder that
    /// runs for days), keeping the process's latest lines.
    fn say(&mut self, pid: u32, line: String) {
        let lines = self.notes.entry(pid).or_default();
        if lines.contains(&line) {
            return;
        }
        if lines.len() == NOTES_PER_PROCESS {
            lines.remove(0);
        }
        lines.push(line);
    }

    /// Forgets what was learnt of the handles `unnamed` does not hold (no
    /// held record launches them any more), and of processes it does not
    /// name.
    fn forget_all_but(&mut self, unnamed: &BTreeMap<u32, BTreeSet<u64>>) {
        let held = |(pid, h): &(u32, u64)| unnamed.get(pid).is_some_and(|hs| hs.contains(h));
        self.answered.retain(held);
        self.tried.retain(held);
        let mut forgotten = (0, 0);
        self.found.names.retain(|key, name| {
            let keep = held(key);
            if !keep {
                forgotten.0 += 1;
                forgotten.1 += name.len();
            }
            keep
        });
        self.sub_bytes(forgotten.1);
        NAMES_FORGOTTEN.fetch_add(forgotten.0, Ordering::Relaxed);
        self.found.counts.retain(|pid, _| unnamed.contains_key(pid));
        self.notes.retain(|pid, _| unnamed.contains_key(pid));
    }

    fn add_bytes(&mut self, n: usize) {
        self.bytes += n;
        NAME_BYTES.fetch_add(n as u64, Ordering::Relaxed);
    }

    fn sub_bytes(&mut self, n: usize) {
        self.bytes -= n;
        NAME_BYTES.fetch_sub(n as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launched(pid: u32, handles: std::ops::Range<u64>) -> BTreeMap<u32, BTreeSet<u64>> {
        BTreeMap::from([(pid, handles.collect())])
    }

    /// A driver that names every handle `kernel_<handle>` padded to `len`.
    fn driver(len: usize) -> impl FnMut(u32, &[u64]) -> Option<DriverAnswer> {
        move |_, handles| {
            Some(Ok(handles
                .iter()
                .map(|h| {
                    let name = format!("kernel_{h}");
                    let padding = "_".repeat(len.saturating_sub(name.len()));
                    (*h, name + &padding)
                })
                .collect()))
        }
    }

    #[test]
    fn names_of_handles_no_record_launches_any_more_are_forgotten() {
        let mut naming = KernelNaming::default();
        // A recorder's snapshots, each of records launching new handles
        // (the older records forgotten), for as long as it runs.
        for round in 0..50 {
            naming.ask_with(launched(7, round * 1000..(round + 1) * 1000), driver(10));
        }
        assert_eq!(naming.found.names.len(), 1000);
        assert_eq!(naming.answered.len(), 1000);
        assert_eq!(naming.tried.len(), 1000);
        assert!(naming.found.names.contains_key(&(7, 49_500)));
        let held: usize = naming.found.names.values().map(String::len).sum();
        assert_eq!(naming.bytes, held);
        assert!(
            naming.found.notes.len() <= NOTES_PER_PROCESS,
            "{:?}",
            naming.found.notes
        );
        // A process that no longer launches anything held is forgotten.
        naming.ask_with(launched(8, 0..3), driver(10));
        assert_eq!(naming.found.names.len(), 3);
        assert!(naming.found.counts.keys().eq([&8]));
        assert!(naming.found.notes.iter().all(|l| l.starts_with("pid 8:")));
    }

    #[test]
    fn names_are_kept_within_their_bytes() {
        let mut naming = KernelNaming::default();
        // 3,000 names of 1 MiB each: cut to 16 KiB, 2,048 of them fill 32 MiB.
        naming.ask_with(launched(7, 0..3000), driver(1 << 20));
        assert!(naming.bytes <= MAX_NAMES_BYTES, "{}", naming.bytes);
        assert_eq!(naming.found.names.len(), MAX_NAMES_BYTES / MAX_NAME_BYTES);
        assert!(
            naming
                .found
                .names
                .values()
                .all(|n| n.len() == MAX_NAME_BYTES)
        );
        let line = &naming.found.notes[0];
        assert!(
            line.contains("2048 of 3000 kernels") && line.contains("952 more names stay"),
            "{line}"
        );
        assert!(kernel_name_stats().bytes >= naming.bytes as u64);
        let before = kernel_name_stats().bytes;
        drop(naming);
        // Other tests keep a few KiB meanwhile.
        assert!(kernel_name_stats().bytes + (MAX_NAMES_BYTES as u64 / 2) <= before);
    }

    #[test]
    fn a_question_failing_the_same_way_is_said_once_and_asked_again() {
        let mut naming = KernelNaming::default();
        let mut asked = 0;
        for _ in 0..5 {
            naming.ask_with(launched(7, 0..2), |_, _| {
                asked += 1;
                Some(Err(AgentError::Unanswered))
            });
        }
        assert_eq!(asked, 5);
        assert_eq!(naming.found.notes.len(), 1, "{:?}", naming.found.notes);
        assert_eq!(naming.found.counts[&7].asked, 2);
    }
}
