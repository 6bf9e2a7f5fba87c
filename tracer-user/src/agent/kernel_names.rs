//! Names for the kernels a program looked up before ebtrace attached (its
//! launches carry only a function handle): asked of the CUDA driver inside
//! the process, through the agent's session there, or through an agent
//! loaded for that question alone.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::{AgentError, AgentSession};
use crate::collect::agent::DriverKernelNames;

/// Asks the CUDA driver in each process for kernel names, once per handle.
#[derive(Default)]
pub struct KernelNaming {
    /// The names learnt so far, and what the user should know about them.
    pub found: DriverKernelNames,
    /// Handles the driver answered for, named or not: not asked again.
    answered: HashSet<(u32, u64)>,
    /// Handles asked for at least once, answered or not (for `counts`).
    tried: HashSet<(u32, u64)>,
}

impl KernelNaming {
    /// Asks for the names of `unnamed` handles the driver did not answer
    /// for before, per process: through its session in `sessions`, else
    /// (with `may_load_agent`, and while it runs) through an agent loaded
    /// now. Handles whose question failed (another ebtrace's agent was in
    /// the process, say) are asked again at the next call: a flight
    /// recorder's next snapshot names them.
    pub fn ask(
        &mut self,
        unnamed: BTreeMap<u32, BTreeSet<u64>>,
        sessions: &mut [AgentSession],
        may_load_agent: bool,
    ) {
        for (pid, handles) in unnamed {
            let handles: Vec<u64> = handles
                .into_iter()
                .filter(|h| !self.answered.contains(&(pid, *h)))
                .collect();
            if handles.is_empty() {
                continue;
            }
            let answer = match sessions.iter_mut().find(|s| s.pid == pid) {
                // Busy converting: asked again at the next collection.
                Some(session) if session.framework_stopping() => continue,
                Some(session) => session.name_kernels(&handles),
                None if may_load_agent
                    && !super::channel::answers_abandoned()
                    && crate::procfs::is_alive(pid) =>
                {
                    AgentSession::connect_unless_busy(pid).and_then(|mut visit| {
                        let names = visit.name_kernels(&handles);
                        visit
                            .close()
                            .map_err(|e| AgentError::TakeOut(Box::new(e)))?;
                        names
                    })
                }
                None => continue,
            };
            let counts = self.found.counts.entry(pid).or_default();
            for h in &handles {
                counts.asked += u64::from(self.tried.insert((pid, *h)));
            }
            let (line, failed) = match answer {
                Ok(names) => {
                    self.answered.extend(handles.iter().map(|h| (pid, *h)));
                    counts.named += names.len() as u64;
                    let line = format!(
                        "pid {pid}: {} of {} kernels launched with handles looked up before \
                         the capture named by the CUDA driver (cuFuncGetName)",
                        names.len(),
                        handles.len()
                    );
                    self.found
                        .names
                        .extend(names.into_iter().map(|(h, name)| ((pid, h), name)));
                    (line, false)
                }
                Err(why) => (
                    format!(
                        "pid {pid}: {} kernels launched with handles looked up before the \
                         capture stay <unresolved>: {why}",
                        handles.len()
                    ),
                    true,
                ),
            };
            // A question failing the same way at every snapshot of a
            // recorder that runs for days is said once.
            if !(failed && self.found.notes.contains(&line)) {
                self.found.notes.push(line);
            }
        }
    }
}
