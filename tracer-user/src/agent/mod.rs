//! The in-process agent, from ebtrace's side: load it into a target
//! ([`inject`]), run the framework's own profiler session
//! through it, collect the session's XSpace, take the agent out again.
//!
//! The wire protocol is `tracer_agent::protocol`. Everything the agent
//! sends comes from inside the target and is read with limits.

mod channel;
mod error;
pub mod inject;
mod kernel_names;
mod preloaded;
mod route;
mod torch_abi;

pub use channel::abandon_every_answer;
pub use error::AgentError;
pub use kernel_names::{KernelNameStats, KernelNaming, kernel_name_stats};
pub use route::{AgentStart, TorchOps, TraceMeRoute, start_agent_sessions};

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use tracer_agent::protocol::{self, SessionLevels, StartRequest};

use channel::Channel;
use inject::{InjectReport, Injected};

use crate::collect::agent::{AgentRecording, tsl_thread_id};

/// The agent library (built from `tracer-agent` by the build script).
pub static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libebtrace_agent.so"));
/// The library's entry point.
pub const ATTACH: &str = tracer_agent::ATTACH_SYMBOL;

/// How long a session in the target goes on without word from ebtrace
/// (`StartRequest::lease_ms`): a capture renews it several times a second
/// ([`AgentSession::keep_alive`]), and ebtrace may be attaching its probes
/// for a while after the START. A hung ebtrace's session ends by then; a
/// dead one's at once (its socket closes).
const SESSION_LEASE: Duration = Duration::from_secs(60);

/// What the agent records in a target, as its [`protocol::STARTED`] said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Started {
    /// The framework session, e.g. `jax 0.10.2 ProfilerSession`.
    pub framework: Option<String>,
    /// The device activity source, e.g. `CUPTI 12.8 activity: kernels, ...`.
    pub device: Option<String>,
    /// PyTorch's ops recording.
    pub ops: Option<String>,
    /// Sources that did not start, and why.
    pub notes: Vec<String>,
}

impl Started {
    fn parse(payload: &[u8]) -> Self {
        let mut started = Started::default();
        for line in String::from_utf8_lossy(payload).lines() {
            let (source, text) = line.split_once('\t').unwrap_or(("", line));
            let text = text.to_string();
            match source {
                protocol::SOURCE_FRAMEWORK => started.framework = Some(text),
                protocol::SOURCE_DEVICE => started.device = Some(text),
                protocol::SOURCE_OPS => started.ops = Some(text),
                _ => started.notes.push(text),
            }
        }
        started
    }
}

/// What ebtrace's agent records in a target: the framework's profiler
/// session, the GPU's activity, or both.
pub struct AgentSession {
    /// The target process.
    pub pid: u32,
    levels: SessionLevels,
    control: Channel,
    injected: Option<Injected>,
    /// What records.
    pub started: Started,
    /// How the agent was loaded.
    pub load: InjectReport,
    /// Why a listener on the preloaded agent's socket was not trusted (the
    /// agent was loaded instead).
    pub untrusted_listener: Option<String>,
    /// Kernel tid → `pthread_self()` of the target's threads.
    thread_pointers: HashMap<u32, u64>,
    /// The threads' ids in the target's own pid namespace → kernel tids,
    /// where they differ.
    namespace_tids: HashMap<u32, u32>,
    /// Kernel tid → when that thread started: its pointer, once read,
    /// holds as long as the thread (a thread is stopped to read it, which
    /// some of the program's calls would notice).
    thread_starts: HashMap<u32, u64>,
    /// While the framework's session runs: the target's resident bytes
    /// when it started, and when.
    framework_since: Option<(u64, Instant)>,
    /// When the framework's session first started, in clock ticks since
    /// boot: processes forked since inherit its gate.
    framework_began: Option<u64>,
    /// STOP_FRAMEWORK was sent and its answer not read yet: the agent
    /// converts what the framework's session holds meanwhile.
    framework_stopping: bool,
    /// The most [`Self::framework_growth`] has seen since the framework's
    /// session started.
    framework_peak: u64,
    /// A request went unanswered: the agent's thread may be waiting for
    /// the program (for Python's GIL), and later frames cannot be matched
    /// to requests.
    unanswered: bool,
    closed: bool,
}

/// Writes the agent library to `path` (`ebtrace agent-library`).
pub fn write_library(path: &std::path::Path) -> crate::error::Result<()> {
    std::fs::write(path, LIBRARY)
        .map_err(|e| crate::error::Error::io(format!("writing {}", path.display()), e))?;
    println!("{}", path.display());
    Ok(())
}

/// Reads a [`protocol::KERNEL_NAMES`] answer to a request for `handles`:
/// a u32 length per handle, then the names; `None` if it is malformed.
fn parse_kernel_names(handles: &[u64], payload: &[u8]) -> Option<Vec<(u64, String)>> {
    let (lengths, mut names) = payload.split_at_checked(4 * handles.len())?;
    let mut out = Vec::new();
    for (handle, len) in handles.iter().zip(lengths.chunks_exact(4)) {
        let len = u32::from_le_bytes(len.try_into().ok()?) as usize;
        let (name, rest) = names.split_at_checked(len)?;
        names = rest;
        if !name.is_empty() {
            out.push((*handle, String::from_utf8_lossy(name).into_owned()));
        }
    }
    names.is_empty().then_some(out)
}

impl AgentSession {
    /// Starts recording in `pid` at `levels` (the framework's own profiler
    /// session, the GPU's activity), through the agent it was started with
    /// or else one loaded now. The error is one line saying why nothing
    /// records (a loaded agent is taken out again).
    pub fn start(pid: u32, levels: SessionLevels) -> Result<Self, AgentError> {
        let mut session = Self::connect(pid)?;
        session.levels = levels;
        session.started = session.start_session()?;
        session.read_thread_pointers();
        Ok(session)
    }

    /// Reaches the agent in `pid` (the one it was started with, or one
    /// loaded now) without starting anything: for requests that need no
    /// session ([`Self::name_kernels`]).
    pub fn connect(pid: u32) -> Result<Self, AgentError> {
        Self::connect_waiting(pid, true)
    }

    /// [`Self::connect`] for a question that can wait for a later try (a
    /// flight recorder's snapshot naming kernels): where another agent
    /// runs in `pid` (a capture's, or one stopping after its ebtrace
    /// ended), it fails at once rather than wait seconds for that one.
    pub fn connect_unless_busy(pid: u32) -> Result<Self, AgentError> {
        Self::connect_waiting(pid, false)
    }

    fn connect_waiting(pid: u32, wait: bool) -> Result<Self, AgentError> {
        let (preloaded, untrusted_listener) = match preloaded::connect(pid) {
            Ok(found) => (found, None),
            Err(why) => (None, Some(why)),
        };
        let (injected, control) = match preloaded {
            Some(control) => (None, control),
            None if !wait && inject::agent_thread_running(pid) => {
                return Err(AgentError::Busy { pid });
            }
            None => {
                let (injected, control) =
                    inject::load(pid, LIBRARY, ATTACH).map_err(|source| AgentError::Load {
                        source,
                        listener: untrusted_listener.clone(),
                    })?;
                (Some(injected), Channel::new(control, pid))
            }
        };
        let load = injected.as_ref().map(|i| i.report).unwrap_or_default();
        let mut session = AgentSession {
            pid,
            levels: SessionLevels {
                host: 0,
                python: 0,
                device: 0,
                ops: 0,
                op_fields: 0,
            },
            control,
            injected,
            started: Started::default(),
            load,
            untrusted_listener,
            thread_pointers: HashMap::new(),
            namespace_tids: HashMap::new(),
            thread_starts: HashMap::new(),
            framework_since: None,
            framework_began: None,
            framework_stopping: false,
            framework_peak: 0,
            unanswered: false,
            closed: false,
        };
        if session.injected.is_some() {
            // A preloaded agent's greeting was read as it was proven.
            session.greeting()?;
        }
        Ok(session)
    }

    /// Reads a loaded agent's [`protocol::HELLO`]: this protocol, from
    /// `pid`.
    fn greeting(&mut self) -> Result<(), AgentError> {
        let answer = self.control.greeting().map_err(AgentError::Channel);
        self.unanswered |= answer.is_err();
        answer.map(|_| ())
    }

    /// Asks the CUDA driver inside the target for the names of kernels by
    /// their function (or kernel) handles; handles it does not know are
    /// left out.
    pub fn name_kernels(&mut self, handles: &[u64]) -> Result<HashMap<u64, String>, AgentError> {
        let mut names = HashMap::new();
        for batch in handles.chunks(protocol::MAX_NAMED_KERNELS) {
            let request: Vec<u8> = batch.iter().flat_map(|h| h.to_le_bytes()).collect();
            self.send(protocol::NAME_KERNELS, &request)?;
            match self.receive()? {
                (protocol::KERNEL_NAMES, p) => {
                    let answer = parse_kernel_names(batch, &p).ok_or(AgentError::Malformed {
                        pid: self.pid,
                        what: "malformed kernel names",
                    })?;
                    names.extend(answer);
                }
                (protocol::FAILED, p) => return Err(AgentError::refused(&p)),
                (kind, _) => {
                    return Err(AgentError::OutOfTurn {
                        request: "NAME_KERNELS",
                        kind,
                    });
                }
            }
        }
        Ok(names)
    }

    fn start_session(&mut self) -> Result<Started, AgentError> {
        let start = StartRequest {
            levels: self.levels,
            lease_ms: SESSION_LEASE.as_millis() as u32,
        };
        self.send(protocol::START, &start.encode())?;
        match self.receive()? {
            (protocol::STARTED, p) => {
                let started = Started::parse(&p);
                if started.framework.is_some() && self.framework_began.is_none() {
                    // One tick of slack: the clock ticks are coarse.
                    self.framework_began = Some(crate::procfs::boot_ticks_now().saturating_sub(1));
                }
                self.framework_since = started
                    .framework
                    .as_ref()
                    .and_then(|_| crate::procfs::resident_bytes(self.pid))
                    .map(|bytes| (bytes, Instant::now()));
                Ok(started)
            }
            (protocol::FAILED, p) => Err(AgentError::refused(&p)),
            (kind, _) => Err(AgentError::OutOfTurn {
                request: "START",
                kind,
            }),
        }
    }

    /// Renews the session's lease (see [`SESSION_LEASE`]), where nothing
    /// else was asked of the agent lately.
    pub fn keep_alive(&mut self) -> Result<(), AgentError> {
        if self.framework_stopping {
            // The stop renewed the lease; the agent answers it first.
            return Ok(());
        }
        if self.unanswered {
            return Err(AgentError::Unanswered);
        }
        self.send(protocol::PING, &[])?;
        match self.receive()? {
            (protocol::PONG, _) => Ok(()),
            (protocol::FAILED, p) => Err(AgentError::refused(&p)),
            (kind, _) => Err(AgentError::OutOfTurn {
                request: "PING",
                kind,
            }),
        }
    }

    /// Tells the agent that the capture window opens now: the device
    /// activity it recorded while ebtrace attached its probes is dropped.
    pub fn open_window(&mut self) -> Result<(), AgentError> {
        self.send(protocol::WINDOW_OPEN, &[])?;
        match self.receive()? {
            (protocol::WINDOW_OPENED, _) => Ok(()),
            (protocol::FAILED, p) => Err(AgentError::refused(&p)),
            (kind, _) => Err(AgentError::OutOfTurn {
                request: "WINDOW_OPEN",
                kind,
            }),
        }
    }

    /// Takes the device activity recorded so far (CUPTI's completed
    /// buffers), the session recording on.
    pub fn collect_device_activity(&mut self) -> Result<Vec<Vec<u8>>, AgentError> {
        if self.framework_stopping {
            // Taken with the stop's answer, or at the capture's end.
            return Ok(Vec::new());
        }
        self.send(protocol::COLLECT, &[])?;
        let mut batches = Vec::new();
        loop {
            match self.receive()? {
                (protocol::DEVICE_ACTIVITY, p) => batches.push(p),
                (protocol::COLLECTED, why) if why.is_empty() => return Ok(batches),
                (protocol::COLLECTED, why) => return Err(AgentError::refused(&why)),
                (protocol::FAILED, p) => return Err(AgentError::refused(&p)),
                (kind, _) => {
                    return Err(AgentError::OutOfTurn {
                        request: "COLLECT",
                        kind,
                    });
                }
            }
        }
    }

    /// Stops the session and returns what it recorded; with `restart`, a
    /// new session starts right away (a long capture served in windows).
    pub fn collect(&mut self, restart: bool) -> Result<AgentRecording, AgentError> {
        // A framework's session stopped early answers first.
        let early = self.finish_framework_stop();
        let mut recording = self.stop_with(protocol::STOP, "STOP")?;
        match early {
            Some(Ok(early)) => {
                recording.xspaces.splice(0..0, early.xspaces);
                recording
                    .device_activity
                    .splice(0..0, early.device_activity);
                recording.torch_ops.splice(0..0, early.torch_ops);
                recording.problem = recording.problem.or(early.problem);
                recording.target_growth = recording.target_growth.max(early.target_growth);
            }
            Some(Err(why)) => recording.problem = recording.problem.or(Some(why.to_string())),
            None => {}
        }
        // What was recorded is kept even if the next session cannot start
        // (the process may have started one of its own meanwhile).
        if restart && let Err(why) = self.start_session() {
            log::warn!("pid {}: the next session did not start: {why}", self.pid);
        }
        Ok(recording)
    }

    /// Asks the agent to stop the framework's session alone, without
    /// waiting for what it recorded: converting that takes the agent
    /// seconds for millions of events, and the capture goes on meanwhile
    /// ([`Self::finish_framework_stop`] takes it); the GPU's activity goes
    /// on recording.
    pub fn begin_framework_stop(&mut self) -> Result<(), AgentError> {
        self.read_thread_pointers();
        self.framework_growth();
        self.framework_since = None;
        self.send(protocol::STOP_FRAMEWORK, &[])?;
        self.framework_stopping = true;
        Ok(())
    }

    /// What the framework's session recorded, where
    /// [`Self::begin_framework_stop`] stopped it and its answer is still to
    /// be read (waiting for it).
    pub fn finish_framework_stop(&mut self) -> Option<Result<AgentRecording, AgentError>> {
        if !std::mem::take(&mut self.framework_stopping) {
            return None;
        }
        Some(self.gather_recording("STOP_FRAMEWORK"))
    }

    /// Whether the framework's session is being stopped: the agent answers
    /// nothing else until it is.
    pub fn framework_stopping(&self) -> bool {
        self.framework_stopping
    }

    /// While the framework's session runs: how much the target's resident
    /// memory grew since it started (what the framework's recorder holds,
    /// and anything else the program allocated), and how long ago that was.
    pub fn framework_growth(&mut self) -> Option<(u64, Duration)> {
        let (since, at) = self.framework_since?;
        let now = crate::procfs::resident_bytes(self.pid)?;
        let grown = now.saturating_sub(since);
        self.framework_peak = self.framework_peak.max(grown);
        Some((grown, at.elapsed()))
    }

    /// Sends `request` (a stop) and gathers the recording it answers with.
    fn stop_with(
        &mut self,
        request: u32,
        name: &'static str,
    ) -> Result<AgentRecording, AgentError> {
        self.read_thread_pointers();
        self.framework_growth();
        self.framework_since = None;
        self.send(request, &[])?;
        self.gather_recording(name)
    }

    /// Reads the answer to a stop (`name`) and what it brought.
    fn gather_recording(&mut self, name: &'static str) -> Result<AgentRecording, AgentError> {
        let (mut xspaces, mut device_activity, mut problem) = (Vec::new(), Vec::new(), None);
        let mut torch_ops = Vec::new();
        loop {
            match self.receive()? {
                (protocol::XSPACE, p) => xspaces.push(p),
                (protocol::DEVICE_ACTIVITY, p) => device_activity.push(p),
                (protocol::TORCH_OPS, p) => torch_ops.push(p),
                (protocol::STOPPED, why)
                    if xspaces.is_empty()
                        && device_activity.is_empty()
                        && torch_ops.is_empty()
                        && !why.is_empty() =>
                {
                    return Err(AgentError::refused(&why));
                }
                (protocol::STOPPED, why) => {
                    if !why.is_empty() {
                        problem = Some(String::from_utf8_lossy(&why).into_owned());
                    }
                    break;
                }
                (protocol::FAILED, p) => return Err(AgentError::refused(&p)),
                (kind, _) => {
                    return Err(AgentError::OutOfTurn {
                        request: name,
                        kind,
                    });
                }
            }
        }
        Ok(AgentRecording {
            pid: self.pid,
            xspaces,
            device_activity,
            torch_ops,
            problem,
            threads: self
                .thread_pointers
                .iter()
                .map(|(&tid, &pointer)| (tsl_thread_id(pointer), tid))
                .chain(
                    self.namespace_tids
                        .iter()
                        .map(|(&inside, &tid)| (i64::from(inside), tid)),
                )
                .collect(),
            namespace_tids: self.namespace_tids.clone(),
            target_growth: std::mem::take(&mut self.framework_peak),
        })
    }

    /// Stops everything the agent started and unloads it (nothing to do,
    /// and no error, where the target has exited and taken it along).
    pub fn close(mut self) -> Result<InjectReport, AgentError> {
        self.shut_down()
    }

    /// When the framework's session first started (clock ticks since boot)
    /// and the TraceMe level it ran at; none if it never ran.
    pub fn framework_began(&self) -> Option<(u64, u32)> {
        self.framework_began.map(|at| (at, self.levels.host))
    }

    /// Whether the target has exited (its agent with it).
    pub fn target_exited(&self) -> bool {
        !crate::procfs::is_alive(self.pid)
    }

    /// What the agent records, for messages: `the framework's profiler
    /// session`, `GPU activity`, or both.
    pub fn what_records(&self) -> &'static str {
        match (&self.started.framework, &self.started.device) {
            (Some(_), Some(_)) => "the framework's profiler session and GPU activity",
            (None, Some(_)) => "GPU activity",
            _ => "the framework's profiler session",
        }
    }

    /// Whether the agent was there from the program's start.
    pub fn preloaded(&self) -> bool {
        self.injected.is_none()
    }

    fn shut_down(&mut self) -> Result<InjectReport, AgentError> {
        if self.closed {
            return Ok(InjectReport::default());
        }
        self.closed = true;
        let Some(injected) = self.injected.take() else {
            // A preloaded agent stays; closing the socket ends the session.
            return Ok(InjectReport::default());
        };
        // A stop under way is answered before anything else.
        let _ = self.finish_framework_stop();
        // BYE means the agent's thread is done with Python: unloading never
        // waits for the GIL. Without it, that thread may still wait for the
        // GIL, which the thread the unload takes over may hold: the unload
        // would wait for ever. The library is left instead, inert once its
        // thread ends (the socket closes with this session), and the next
        // ebtrace takes it out.
        let bye = self.send(protocol::SHUTDOWN, &[]).and_then(|()| {
            if self.unanswered {
                // It did not answer before: it will not say goodbye now.
                return Err(AgentError::Unanswered);
            }
            self.receive()
        });
        if let Err(why) = bye {
            if self.target_exited() {
                return Ok(InjectReport::default());
            }
            return Err(AgentError::LeftLoaded {
                pid: self.pid,
                why: Box::new(why),
            });
        }
        let failed = match injected.unload(inject::AGENT_DETACH) {
            Ok(report) => return Ok(report),
            // A target that exited took its agent with it.
            Err(_) if self.target_exited() => return Ok(InjectReport::default()),
            Err(e) => e,
        };
        // What the failed unload left (the library, or only its memfd) is
        // taken out as if a killed ebtrace had left it.
        match inject::unload_leftovers(self.pid, inject::AGENT_DETACH) {
            Ok(_) => {
                log::warn!(
                    "pid {}: the agent was taken out at the second try ({failed})",
                    self.pid
                );
                Ok(InjectReport::default())
            }
            Err(again) => Err(AgentError::NotTakenOut {
                first: failed,
                again,
            }),
        }
    }

    /// Notes each live thread's `pthread_self()`, so that the framework's
    /// thread ids can be named (threads that end before the session stops
    /// are known from the earlier reading).
    fn read_thread_pointers(&mut self) {
        let start_of = |tid: u32| crate::procfs::start_time_ticks(tid);
        let starts = &self.thread_starts;
        let known = |tid: u32| starts.get(&tid).is_some_and(|s| start_of(tid) == Some(*s));
        match inject::thread_pointers(self.pid, known) {
            Ok(found) => {
                for &tid in found.keys() {
                    if let Some(started) = start_of(tid) {
                        self.thread_starts.insert(tid, started);
                    }
                    match crate::procfs::namespace_tid(self.pid, tid) {
                        Some(inside) if inside != tid => {
                            self.namespace_tids.insert(inside, tid);
                        }
                        _ => {}
                    }
                }
                self.thread_pointers.extend(found);
            }
            Err(_) if self.target_exited() => {}
            Err(e) => log::warn!("pid {}: threads not named: {e}", self.pid),
        }
    }

    fn send(&mut self, kind: u32, payload: &[u8]) -> Result<(), AgentError> {
        if self.unanswered {
            // Whatever comes now could be the answer to the earlier request.
            return Err(AgentError::Unanswered);
        }
        self.control
            .send(request_name(kind), kind, payload)
            .map_err(AgentError::Channel)
    }

    fn receive(&mut self) -> Result<(u32, Vec<u8>), AgentError> {
        let answer = self.control.receive().map_err(AgentError::Channel);
        // Whatever comes later could be the answer to this request.
        self.unanswered |= answer.is_err();
        answer
    }
}

/// A request's name, for messages.
fn request_name(kind: u32) -> &'static str {
    match kind {
        protocol::PING => "PING",
        protocol::START => "START",
        protocol::STOP => "STOP",
        protocol::SHUTDOWN => "SHUTDOWN",
        protocol::WINDOW_OPEN => "WINDOW_OPEN",
        protocol::NAME_KERNELS => "NAME_KERNELS",
        protocol::COLLECT => "COLLECT",
        protocol::STOP_FRAMEWORK => "STOP_FRAMEWORK",
        protocol::PROVE => "PROVE",
        _ => "a request",
    }
}

impl Drop for AgentSession {
    fn drop(&mut self) {
        if let Err(why) = self.shut_down() {
            log::warn!("pid {}: unloading the agent: {why}", self.pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// The dynamic symbols of the agent library, as binutils' `objdump -T`
    /// lists them (not ebtrace's own ELF reader).
    fn dynamic_symbols() -> String {
        let path = std::env::temp_dir().join(format!("ebtrace-agent-{}.so", std::process::id()));
        std::fs::write(&path, LIBRARY).unwrap();
        let out = Command::new("objdump").arg("-T").arg(&path).output();
        std::fs::remove_file(&path).unwrap();
        let out = out.expect("objdump (binutils) runs");
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn kernel_names_are_read_within_their_frame() {
        let mut p = Vec::new();
        for len in [3u32, 0, 2] {
            p.extend(len.to_le_bytes());
        }
        p.extend(b"abcxy");
        assert_eq!(
            parse_kernel_names(&[1, 2, 3], &p),
            Some(vec![(1, "abc".into()), (3, "xy".into())])
        );
        // Short, long, or lengths past the end: refused, never a panic.
        assert_eq!(parse_kernel_names(&[1, 2, 3], &p[..p.len() - 1]), None);
        assert_eq!(
            parse_kernel_names(&[1, 2, 3], &[p.as_slice(), b"z"].concat()),
            None
        );
        assert_eq!(parse_kernel_names(&[1, 2, 3, 4], &p), None);
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend(b"abc");
        assert_eq!(parse_kernel_names(&[1], &huge), None);
    }

    proptest::proptest! {
        #[test]
        fn any_kernel_names_answer_is_read_without_panic(
            handles in proptest::collection::vec(proptest::num::u64::ANY, 0..8),
            payload in proptest::collection::vec(proptest::num::u8::ANY, 0..128),
        ) {
            let _ = parse_kernel_names(&handles, &payload);
        }
    }

    #[test]
    fn the_agent_loads_into_glibc_2_28_and_exports_its_entry_points() {
        let symbols = dynamic_symbols();
        // No reference asks for a glibc newer than 2.28 (unversioned ones
        // bind to whatever the target's C library has).
        for line in symbols.lines().filter(|l| l.contains("GLIBC_2.")) {
            let version = line.split("GLIBC_2.").nth(1).unwrap();
            let minor: u32 = version
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(minor <= 28, "needs a newer glibc: {line}");
        }
        for export in [ATTACH, inject::AGENT_DETACH] {
            assert!(
                symbols
                    .lines()
                    .any(|l| l.contains(".text") && l.ends_with(export)),
                "{export} not exported:\n{symbols}"
            );
        }
        // The Python API is looked up at run time, never linked.
        assert!(!symbols.contains("Py"), "{symbols}");
    }
}
