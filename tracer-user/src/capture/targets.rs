//! The processes a capture records: opening them, and, for a capture that
//! goes on for long (the flight recorder), taking on a process that
//! appears, letting go of one that exited, and forgetting it once its
//! records are too old.

use std::collections::HashMap;

use super::Capture;
use crate::{
    attach::{CudaProbe, ProbeSet, cuda, read_python_frames},
    clock::monotonic_ns,
    error::Result,
    procfs::TargetProcess,
    timeline::InitialState,
};

/// Opens every target pid (fails on the first unknown one).
pub fn open_targets(pids: &[u32]) -> Result<Vec<TargetProcess>> {
    let mut targets: Vec<TargetProcess> = Vec::new();
    for &pid in pids {
        let t = TargetProcess::open(pid)?;
        if !targets.iter().any(|o| o.pid == t.pid) {
            targets.push(t);
        }
    }
    Ok(targets)
}

impl Capture {
    /// Records `target` too from now on (a process the flight recorder's
    /// `--discover` found after it started): what was recorded of the
    /// others stays. Returns what the user should know, one line each.
    pub fn add_target(&mut self, target: TargetProcess) -> Result<Vec<String>> {
        let pid = target.pid;
        if self.targets.iter().any(|t| t.pid == pid) {
            return Ok(Vec::new());
        }
        self.probe.add_target(pid)?;
        let added = (|| -> Result<Vec<String>> {
            let one = std::slice::from_ref(&target);
            let initial = track_threads(&mut self.probe, one)?;
            let mut notes = Vec::new();
            if self.families.cuda {
                let messages = match &mut self.cuda {
                    Some(cuda) => cuda.add(&mut self.probe, one),
                    None => {
                        let (cuda, messages) =
                            CudaProbe::attach(&mut self.probe, one, self.options.driver_calls)?;
                        self.cuda = cuda;
                        messages
                    }
                };
                notes.extend(messages.notes.into_iter().chain(messages.warnings));
                let probed = self.cuda.iter().flat_map(|c| &c.targets);
                notes.extend(probed.filter(|c| c.pid == pid).map(cuda::describe));
            }
            if self.stacks.is_some() && self.families.python_frames {
                notes.extend(read_python_frames(&mut self.probe, one)?);
            }
            self.probe.open_window(pid)?;
            self.initial.extend(initial);
            Ok(notes)
        })();
        match added {
            Ok(notes) => {
                self.tracked_from.push((pid, monotonic_ns()));
                self.targets.push(target);
                Ok(notes)
            }
            Err(e) => {
                let _ = self.probe.remove_target(pid);
                Err(e)
            }
        }
    }

    /// Stops recording target `pid`, which has exited, so that a process
    /// that reuses its pid is not recorded, and lets its driver probes go;
    /// what it recorded stays.
    pub fn forget_target(&mut self, pid: u32) -> Result<()> {
        if let Some(cuda) = &mut self.cuda {
            cuda.release_target(pid);
        }
        self.collector.forget_process(pid);
        self.probe.remove_target(pid)
    }

    /// Forgets all it knows of target `pid`, which exited (see
    /// [`Self::forget_target`]) and whose records are all forgotten: its
    /// threads, the names of its code. A flight recorder would otherwise
    /// keep them for every process that came and went.
    pub fn drop_target(&mut self, pid: u32) {
        self.targets.retain(|t| t.pid != pid);
        self.initial.retain(|_, thread| thread.pid != pid);
        self.tracked_from.retain(|(p, _)| *p != pid);
        if let Some(stacks) = &mut self.stacks {
            stacks.forget_process(pid);
        }
    }
}

/// Follows the threads `targets` have now and notes how `/proc` shows
/// them: thread creation must be followed already, so that a thread
/// created in between is seen by one or the other.
pub(super) fn track_threads(
    probe: &mut ProbeSet,
    targets: &[TargetProcess],
) -> Result<HashMap<u32, InitialState>> {
    let mut initial = HashMap::new();
    for t in targets {
        let threads = t.threads();
        probe.track_threads(t.pid, threads.keys().copied())?;
        for (tid, stat) in threads {
            initial.insert(
                tid,
                InitialState {
                    pid: t.pid,
                    name: stat.comm,
                    state: stat.state,
                    cpu: stat.cpu,
                },
            );
        }
    }
    Ok(initial)
}
