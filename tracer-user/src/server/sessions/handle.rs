//! The gRPC side's end of the session hub: the [`Command`]s it accepts,
//! the [`HubHandle`] that sends them and awaits the answers, and why a
//! session could not run ([`SessionError`]).

use std::{fmt, sync::Arc, sync::mpsc, time::Duration};

use ebtrace_proto::tensorflow::ProfileResponse;
use tokio::sync::oneshot;

use crate::{
    attach::{ProbeSet, ProbeSetConfig},
    capture::flight_recorder::Retention,
    metrics::Metrics,
    procfs::TargetProcess,
    server::{
        admission::Slot,
        validate::SessionSpec,
        watch::{WatchMode, WatchedNow},
        write_guard::WriteGuard,
    },
};

/// Where the hub sends a session's response, or why there is none.
pub type Reply = oneshot::Sender<Result<ProfileResponse, SessionError>>;

/// What the gRPC methods ask of the hub.
pub enum Command {
    /// Run a session and answer with its trace.
    Profile {
        /// The session asked for.
        spec: SessionSpec,
        /// Receives its response.
        reply: Reply,
        /// Its caller's place, held until the session is done with.
        slot: Slot,
    },
    /// End every session with this id now; answers how many there were.
    Terminate {
        /// The `session_id` of the sessions to end.
        session_id: String,
        /// Only those of this owner; `None`: anyone's.
        owner: Option<String>,
        /// Receives how many sessions were ended.
        reply: oneshot::Sender<usize>,
    },
    /// Switches the flight recorder on (as this request asks) if it is off.
    StartRecorder {
        /// The request, with the tracer levels to record.
        spec: SessionSpec,
        /// Receives whether the recorder could start.
        reply: oneshot::Sender<Result<(), SessionError>>,
    },
    /// Switches the flight recorder off; answers whether it was on.
    StopRecorder {
        /// Receives whether it was on.
        reply: oneshot::Sender<bool>,
    },
    /// Answers with what the flight recorder kept.
    Snapshot {
        /// The session id the snapshot's trace is written under.
        snapshot_id: String,
        /// Who asked (for the server's log).
        client: String,
        /// Receives the snapshot's response.
        reply: Reply,
        /// Its caller's place, held until the snapshot is dropped.
        slot: Slot,
    },
    /// Finish every session with what it has, detach, stop.
    Shutdown,
}

/// Why a session could not run; the service maps each to a gRPC status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionError {
    /// The server already runs as many sessions as it may.
    Busy {
        /// The most it runs at once (`--max-sessions`).
        limit: usize,
    },
    /// No process is watched; says why.
    NothingWatched(String),
    /// The request names a process the server does not watch.
    PidNotWatched {
        /// The pid asked for.
        pid: u32,
        /// The pids watched.
        watched: Vec<u32>,
    },
    /// Attaching the probes failed: the error, as text.
    Attach(String),
    /// Building or writing the response failed: the error, as text.
    Response(String),
    /// `GetSnapshot` while the flight recorder is off.
    RecorderOff,
    /// `--retain-memory` leaves the flight recorder no room: what to do.
    NoRoom(String),
    /// The server is shutting down.
    ShuttingDown,
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionError::Busy { limit } => write!(
                f,
                "{limit} captures are already in progress, the most this server runs at once \
                 (ebtrace serve --max-sessions); retry when one has finished"
            ),
            SessionError::NothingWatched(why) => f.write_str(why),
            SessionError::PidNotWatched { pid, watched } => write!(
                f,
                "pid {pid} is not watched by this server (watching: {})",
                watched
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            SessionError::Attach(e) => write!(f, "attaching the probes failed: {e}"),
            SessionError::Response(e) | SessionError::NoRoom(e) => f.write_str(e),
            SessionError::RecorderOff => f.write_str(
                "the flight recorder is off: call StartContinuousProfiling first, or start \
                 ebtrace serve with --retain",
            ),
            SessionError::ShuttingDown => f.write_str("the server is shutting down"),
        }
    }
}

/// How `ebtrace serve`'s session hub runs.
pub struct HubConfig {
    /// How target processes are chosen.
    pub watch: WatchMode,
    /// The most sessions run at once (`--max-sessions`).
    pub max_sessions: usize,
    /// The longest session allowed; captures are shared for at most twice this.
    pub max_duration: Duration,
    /// How the eBPF object is loaded.
    pub probe: ProbeSetConfig,
    /// The set loaded at start to check the kernel, kept for the flight
    /// recorder's first start (`--retain`) rather than loaded again.
    pub checked_probes: Option<ProbeSet>,
    /// The directory the server may write traces under, if any (`--allow-write-under`).
    pub guard: Option<Arc<WriteGuard>>,
    /// How long the probes of a finished capture stay attached, paused,
    /// for the next session (zero: detached at once).
    pub keep_probes: Duration,
    /// Counts answered captures for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// What the flight recorder keeps.
    pub retention: Retention,
    /// Whether the flight recorder runs from the start (`--retain`).
    pub record_from_start: bool,
    /// This machine's name, for the flight recorder's snapshots.
    pub hostname: String,
}

/// The gRPC side's end of the hub.
#[derive(Clone)]
pub struct HubHandle {
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) watched: WatchedNow,
}

impl HubHandle {
    /// Runs a session, holding `slot` until it is done with; resolves
    /// when its response is ready. Dropping the future (the client went
    /// away) ends the session and frees it.
    pub async fn profile(
        &self,
        spec: SessionSpec,
        slot: Slot,
    ) -> Result<ProfileResponse, SessionError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Profile { spec, reply, slot })
            .map_err(|_| SessionError::ShuttingDown)?;
        answer.await.map_err(|_| SessionError::ShuttingDown)?
    }

    /// Ends every session with `session_id` (of `owner`, if given) now,
    /// each answered with what it recorded; resolves to how many there
    /// were.
    pub async fn terminate(
        &self,
        session_id: String,
        owner: Option<String>,
    ) -> Result<usize, SessionError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Terminate {
                session_id,
                owner,
                reply,
            })
            .map_err(|_| SessionError::ShuttingDown)?;
        answer.await.map_err(|_| SessionError::ShuttingDown)
    }

    /// Switches the flight recorder on, recording as `spec` asks, if it is off.
    pub async fn start_recorder(&self, spec: SessionSpec) -> Result<(), SessionError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::StartRecorder { spec, reply })
            .map_err(|_| SessionError::ShuttingDown)?;
        answer.await.map_err(|_| SessionError::ShuttingDown)?
    }

    /// Switches the flight recorder off; resolves to whether it was on.
    pub async fn stop_recorder(&self) -> Result<bool, SessionError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::StopRecorder { reply })
            .map_err(|_| SessionError::ShuttingDown)?;
        answer.await.map_err(|_| SessionError::ShuttingDown)
    }

    /// Answers with what the flight recorder kept, as the session
    /// `snapshot_id` for `client`, holding `slot` until the snapshot is
    /// dropped.
    pub async fn snapshot(
        &self,
        snapshot_id: String,
        client: String,
        slot: Slot,
    ) -> Result<ProfileResponse, SessionError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Snapshot {
                snapshot_id,
                client,
                reply,
                slot,
            })
            .map_err(|_| SessionError::ShuttingDown)?;
        answer.await.map_err(|_| SessionError::ShuttingDown)?
    }

    /// The processes watched now, as of the hub's last look (never
    /// waiting for a hub busy with a capture).
    pub fn targets(&self) -> Result<Vec<TargetProcess>, SessionError> {
        self.watched.get().ok_or(SessionError::ShuttingDown)
    }

    /// Asks the hub to finish every session with what it has, detach and stop; does not wait.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }
}
