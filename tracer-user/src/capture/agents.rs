//! The capture's side of ebtrace's agents: what their sessions recorded
//! (framework XSpaces, GPU activity), collected while and after recording,
//! and the kernel names asked of the driver inside the targets
//! ([`crate::timeline::assemble`] lays all of it on the timeline).

use std::{
    thread::JoinHandle,
    time::{Duration, Instant},
};

use super::Capture;
use crate::attach::restore_children_of_session;
use crate::{
    agent::{AgentError, AgentSession, KernelNaming},
    attach::TraceMeProbe,
    collect::{Collector, EncodedRecords, agent::AgentRecording},
};

/// How often the agents are asked for what the GPUs ran while a capture
/// records: what a target that exits takes with it.
const DEVICE_COLLECTION_PERIOD: Duration = Duration::from_millis(250);

/// Sessions and the device activity they handed over, by pid.
type RoundAnswers = (Vec<AgentSession>, Vec<(u32, Vec<u8>)>);

/// A round of collecting what the GPUs ran, asked of every agent at once
/// on threads of their own: a silent agent holds its own question (for as
/// long as its silence is allowed), never the others', the capture's
/// drain of the ring buffer or a server's hub. The other agents are told
/// that ebtrace is still there, which renews their sessions' leases. A
/// round in progress is waited for when dropped: its sessions take the
/// agents out of the targets then.
#[derive(Default)]
pub(super) struct DeviceRound(Option<JoinHandle<RoundAnswers>>);

impl DeviceRound {
    fn start(mut sessions: Vec<AgentSession>) -> Self {
        if sessions.is_empty() {
            return DeviceRound(None);
        }
        let round = std::thread::Builder::new()
            .name("ebtrace-gpu-collect".into())
            .spawn(move || {
                let collected = ask_each(&mut sessions, collect_from, |pid, why| {
                    log::warn!("pid {pid}: collecting GPU activity: {why}");
                    Vec::new()
                });
                (sessions, collected.into_iter().flatten().collect())
            });
        match round {
            Ok(round) => DeviceRound(Some(round)),
            // No thread to ask on: the sessions are lost with it (they
            // take the agents out as they drop); said once.
            Err(e) => {
                log::warn!("collecting GPU activity: no thread to ask the agents on: {e}");
                DeviceRound(None)
            }
        }
    }

    pub(super) fn is_running(&self) -> bool {
        self.0.is_some()
    }

    fn has_ended(&self) -> bool {
        self.0.as_ref().is_some_and(JoinHandle::is_finished)
    }

    fn join(&mut self) -> Option<RoundAnswers> {
        let round = self.0.take()?;
        match round.join() {
            Ok(answers) => Some(answers),
            Err(_) => {
                log::warn!("collecting GPU activity: the thread asking the agents panicked");
                None
            }
        }
    }
}

impl Drop for DeviceRound {
    fn drop(&mut self) {
        self.join();
    }
}

/// Asks every agent in `sessions` one question at once, each on a thread
/// of its own: a silent agent holds its own answer, for as long as its
/// silence is allowed, never the others'. `unasked` answers for an agent
/// whose question could not be asked (no thread, or a thread that
/// panicked), given why. The answers come in the order of `sessions`.
pub(super) fn ask_each<T: Send>(
    sessions: &mut [AgentSession],
    ask: impl Fn(&mut AgentSession) -> T + Sync,
    unasked: impl Fn(u32, String) -> T,
) -> Vec<T> {
    let ask = &ask;
    std::thread::scope(|scope| {
        let asked: Vec<_> = sessions
            .iter_mut()
            .map(|session| {
                let pid = session.pid;
                let thread = std::thread::Builder::new()
                    .name("ebtrace-agent".into())
                    .spawn_scoped(scope, move || ask(session));
                (pid, thread)
            })
            .collect();
        asked
            .into_iter()
            .map(|(pid, thread)| match thread {
                Ok(thread) => thread
                    .join()
                    .unwrap_or_else(|_| unasked(pid, "the thread asking it panicked".into())),
                Err(e) => unasked(pid, format!("no thread to ask it on: {e}")),
            })
            .collect()
    })
}

/// Takes what the GPUs ran so far from `session`'s agent if it records
/// it (the agent's buffers are bounded, and a target that exits takes only
/// the last period's records with it); renews its lease if not.
fn collect_from(session: &mut AgentSession) -> Vec<(u32, Vec<u8>)> {
    if session.started.device.is_none() {
        if let Err(why) = session.keep_alive() {
            log::debug!("pid {}: renewing the agent's lease: {why}", session.pid);
        }
        return Vec::new();
    }
    match session.collect_device_activity() {
        Ok(batches) => return batches.into_iter().map(|b| (session.pid, b)).collect(),
        // Said once: the agent is asked nothing more.
        Err(AgentError::Unanswered) => {}
        Err(why) if session.target_exited() => {
            log::debug!("pid {}: collecting GPU activity: {why}", session.pid)
        }
        Err(why) => log::warn!("pid {}: collecting GPU activity: {why}", session.pid),
    }
    Vec::new()
}

impl Capture {
    /// Stops the framework session of each target that grew, since it
    /// started, past [`CaptureOptions::framework_memory`]: the framework
    /// keeps every event in the target's memory until its session stops,
    /// and a flood of them could exhaust it. The stop is asked for and not
    /// waited for (the agent converts what the session holds meanwhile):
    /// the capture's window and its other sources go on as asked. What the
    /// session recorded is kept; the GPU's activity goes on recording.
    ///
    /// [`CaptureOptions::framework_memory`]: super::CaptureOptions::framework_memory
    pub(super) fn bound_framework_sessions(&mut self) {
        let budget = self.framework_memory;
        for session in &mut self.framework {
            let Some((grown, after)) = session.framework_growth() else {
                continue;
            };
            if grown <= budget {
                continue;
            }
            let pid = session.pid;
            match session.begin_framework_stop() {
                Ok(()) => self.traceme.warn(format!(
                    "pid {pid}: the framework's profiler session grew the process by {} MiB in \
                     {:.1} s, past the {} MiB it may take (--max-target-growth-mib): ebtrace \
                     stopped it there to spare the process's memory, and the TraceMe events after \
                     that are missing",
                    grown >> 20,
                    after.as_secs_f64(),
                    budget >> 20,
                )),
                Err(why) => self.traceme.warn(format!(
                    "pid {pid}: stopping the framework's profiler session early: {why}"
                )),
            }
        }
    }

    /// Collects what the framework sessions recorded so far; with
    /// `restart`, each session goes on recording in a new one.
    pub(super) fn collect_framework(&mut self, restart: bool) {
        self.agent_questions_apart().0.collect_framework(restart);
    }

    /// Takes in the last round of collecting what the GPUs ran, if it has
    /// ended, and starts the next when it is due.
    pub(super) fn collect_device_activity(&mut self) {
        if self.device_round.is_running() && !self.device_round.has_ended() {
            return;
        }
        self.end_device_round();
        if self.last_collection.elapsed() >= DEVICE_COLLECTION_PERIOD {
            self.last_collection = Instant::now();
            self.device_round = DeviceRound::start(std::mem::take(&mut self.framework));
        }
    }

    /// Waits for the round of collecting what the GPUs ran, if one is in
    /// progress, and takes its sessions and answers back: done before the
    /// agents are asked anything else.
    pub(super) fn end_device_round(&mut self) {
        if let Some((sessions, collected)) = self.device_round.join() {
            self.framework = sessions;
            self.collected.extend(collected);
        }
    }

    /// Asks the driver inside the targets for the names of the kernels
    /// launched so far by handles no symbol record names.
    pub(super) fn name_kernels(&mut self) {
        self.agent_questions_apart().0.name_kernels();
    }

    /// What asking the agents takes of the capture, and its collector
    /// apart: another thread may drain that meanwhile.
    pub(super) fn agent_questions_apart(&mut self) -> (AgentQuestions<'_>, &mut Collector) {
        self.end_device_round();
        let Capture {
            framework,
            recordings,
            traceme,
            kernel_naming,
            held,
            families,
            agent_for_devices,
            collector,
            ..
        } = self;
        let questions = AgentQuestions {
            framework,
            recordings,
            traceme,
            kernel_naming,
            held,
            cuda: families.cuda,
            may_load_agent: *agent_for_devices,
        };
        (questions, collector)
    }
}

/// The parts of a [`Capture`] its agents' answers go to. The answers can
/// take seconds (an agent loaded into a target to name its kernels, one
/// that is slow to answer), so a flight recorder's snapshot asks them while
/// another thread drains the ring buffer, which these parts leave out.
pub(super) struct AgentQuestions<'a> {
    framework: &'a mut Vec<AgentSession>,
    recordings: &'a mut Vec<AgentRecording>,
    traceme: &'a mut TraceMeProbe,
    kernel_naming: &'a mut KernelNaming,
    held: &'a EncodedRecords,
    cuda: bool,
    may_load_agent: bool,
}

impl AgentQuestions<'_> {
    /// [`Capture::collect_framework`].
    pub(super) fn collect_framework(&mut self, restart: bool) {
        for session in self.framework.iter_mut() {
            match session.collect(restart) {
                Ok(r) => self.recordings.push(r),
                Err(_) if session.target_exited() => self.traceme.warn(format!(
                    "pid {}: exited during the capture: {} recorded inside it since the last \
                     collection is lost with it; the rest of the trace is kept",
                    session.pid,
                    session.what_records()
                )),
                Err(why) => self.traceme.warn(format!(
                    "pid {}: {}: {why}",
                    session.pid,
                    session.what_records()
                )),
            }
        }
    }

    /// [`Capture::name_kernels`].
    pub(super) fn name_kernels(&mut self) {
        if !self.cuda {
            return;
        }
        let unnamed = crate::timeline::cuda::unnamed_kernels(self.held.driver_records_iter());
        self.kernel_naming
            .ask(unnamed, self.framework, self.may_load_agent);
    }
}

/// Takes the agent out of its process and puts back the TraceMe gate in
/// the children forked while the framework's session ran there; the lines
/// that say what went wrong or was put back.
pub(super) fn take_out(session: AgentSession) -> Vec<String> {
    let pid = session.pid;
    let began = session.framework_began();
    let mut lines = Vec::new();
    if let Err(why) = session.close() {
        lines.push(format!("pid {pid}: taking the agent out: {why}"));
    }
    if let Some((since, level)) = began {
        lines.extend(restore_children_of_session(pid, since, level));
    }
    lines
}
