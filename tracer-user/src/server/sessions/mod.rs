//! The session hub: the one thread that owns the watched processes, the
//! probes and every profiling session. gRPC methods send it [`Command`]s
//! and await the answer; nothing else touches this state.
//!
//! Overlapping sessions share probes: a session joins a running
//! [`Capture`] with the same probe families and the same targets (started
//! no longer ago than twice the longest allowed capture, which bounds the
//! records one capture holds), or starts one a little before its requested
//! start. The hub drains every capture on one tick and assembles each
//! session's timeline for its own [`Window`] from the capture's
//! [`Capture::sources`] with [`timeline::assemble`] (the first session's
//! thread states are built while it records: [`Capture::stream_window`]);
//! a capture with no session left is paused and kept for the next session
//! that asks for the same probes on the same processes (`--keep-probes`):
//! its programs stay attached but record nothing
//! ([`Capture::pause`]), so the next window opens without attaching.
//! Past that time, or once the watched processes change, it is dropped,
//! which detaches its probes.
//! Turning a timeline into the response (XSpace encoding, saving) and
//! detaching (the kernel waits for an RCU grace period per program, tens
//! of milliseconds each) happen on worker threads, so draining and the
//! next attach go on meanwhile. While the hub itself attaches a capture or
//! builds a session's timeline, which can take seconds with an agent in
//! the target, a thread of its own keeps the flight recorder drained
//! ([`Hub::while_recording`]).
//!
//! - [`handle`]: the commands and the gRPC side's handle;
//! - [`kept`]: probes kept between captures;
//! - [`flight`]: the flight recorder's commands and its tick.

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use super::{
    admission::Slot,
    response::{self, Delivered},
    validate::SessionSpec,
    watch::Watched,
};
use crate::{
    capture::{Capture, CaptureOptions, ProbeFamilies, flight_recorder::FlightRecorder},
    clock::{self, ClockSync},
    procfs::TargetProcess,
    timeline::{self, Sources, Timeline, Window},
};

mod flight;
mod handle;
mod kept;

pub use handle::{Command, HubConfig, HubHandle, Reply, SessionError};

/// How often running captures are drained.
const TICK: Duration = Duration::from_millis(50);
/// How long before a session's requested start its probes are attached
/// (attaching takes a few tens of milliseconds).
const ATTACH_LEAD_NS: u64 = 250_000_000;
/// Longest the hub sleeps with nothing running.
const IDLE_WAIT: Duration = Duration::from_secs(1);
/// How long after the last session the hub trims the allocator once more
/// (responses are freed by the gRPC side after they were sent).
const TRIM_AFTER_IDLE: Duration = Duration::from_secs(2);
/// Captures detached in the background at once; past this the hub
/// detaches itself, which slows it down instead of piling them up.
const MAX_DETACHING: usize = 8;

/// Starts the hub thread.
pub fn spawn(config: HubConfig) -> std::io::Result<(HubHandle, JoinHandle<()>)> {
    let (commands, inbox) = mpsc::channel();
    let recorder_wanted = config.record_from_start;
    let watched = Watched::new(config.watch.clone());
    let published = watched.now();
    let hub = Hub {
        inbox,
        watched,
        config,
        waiting: Vec::new(),
        running: Vec::new(),
        kept: None,
        recorder: None,
        recorder_spec: None,
        recorder_wanted,
        delivering: Vec::new(),
        unanswered: Arc::default(),
        detaching: Vec::new(),
        trim_at: None,
        shutting_down: false,
    };
    let thread = std::thread::Builder::new()
        .name("ebtrace-hub".into())
        .spawn(move || hub.run())?;
    Ok((
        HubHandle {
            commands,
            watched: published,
        },
        thread,
    ))
}

struct Session {
    spec: SessionSpec,
    reply: Reply,
    /// Its caller's place ([`super::admission`]), given back with it.
    _slot: Slot,
    received: Instant,
    /// Requested start, monotonic ns.
    start_ns: u64,
    duration_ns: u64,
    /// Its window once it has joined a capture (monotonic ns).
    window: Option<(u64, u64)>,
    terminated: bool,
}

/// Probes shared by the sessions inside it. `capture` is `None` when the
/// sessions asked for no probe family at all (host_tracer_level 0 today):
/// their traces are empty, and nothing is attached for them.
struct Running {
    capture: Option<Capture>,
    families: ProbeFamilies,
    targets: Vec<TargetProcess>,
    started_ns: u64,
    clock: ClockSync,
    sessions: Vec<Session>,
}

impl Running {
    fn pids(&self) -> BTreeSet<u32> {
        self.targets.iter().map(|t| t.pid).collect()
    }
}

struct Hub {
    inbox: mpsc::Receiver<Command>,
    config: HubConfig,
    watched: Watched,
    /// Sessions whose start is still ahead.
    waiting: Vec<Session>,
    running: Vec<Running>,
    /// The paused capture kept for the next session, and since when.
    kept: Option<(Running, Instant)>,
    /// The flight recorder, while on.
    recorder: Option<FlightRecorder>,
    /// The request its snapshots answer (host name, delivery), while on.
    recorder_spec: Option<SessionSpec>,
    /// Whether it should be on (started, or asked for at start-up): it is
    /// started again when the watched processes change.
    recorder_wanted: bool,
    /// Workers turning finished timelines into responses.
    delivering: Vec<JoinHandle<()>>,
    /// Sessions of those workers whose answer has not gone out yet: a
    /// worker goes on freeing the timeline after it answered, and a
    /// client that asks again at once is not refused for it.
    unanswered: Arc<AtomicUsize>,
    /// Workers dropping (detaching) captures nobody uses any more.
    detaching: Vec<JoinHandle<()>>,
    /// When to give freed memory back once idle (after a session ended).
    trim_at: Option<Instant>,
    shutting_down: bool,
}

impl Hub {
    fn run(mut self) {
        loop {
            let wait = self.next_wait();
            match self.inbox.recv_timeout(wait) {
                Ok(command) => self.handle(command),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => self.shutting_down = true,
            }
            self.step();
            if self.shutting_down {
                break;
            }
        }
        for worker in self.delivering.drain(..).chain(self.detaching.drain(..)) {
            let _ = worker.join();
        }
    }

    fn in_progress(&mut self) -> usize {
        self.delivering.retain(|w| !w.is_finished());
        self.waiting.len()
            + self.running.iter().map(|r| r.sessions.len()).sum::<usize>()
            + self.unanswered.load(Ordering::Acquire)
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Profile { spec, reply, slot } => {
                if let Err(e) = self.admit(&spec) {
                    eprintln!("ebtrace: refused a capture for {}: {e}", spec.client);
                    let _ = reply.send(Err(e));
                    return;
                }
                let (now_mono, now_wall) = (clock::monotonic_ns(), clock::realtime_ns());
                let start_ns = match spec.start_wall_ns {
                    Some(wall) if wall > now_wall => now_mono + (wall - now_wall),
                    _ => now_mono,
                };
                self.waiting.push(Session {
                    duration_ns: spec.duration.as_nanos() as u64,
                    spec,
                    reply,
                    _slot: slot,
                    received: Instant::now(),
                    start_ns,
                    window: None,
                    terminated: false,
                });
            }
            Command::Terminate {
                session_id,
                owner,
                reply,
            } => {
                let mut n = 0;
                let all = self
                    .waiting
                    .iter_mut()
                    .chain(self.running.iter_mut().flat_map(|r| r.sessions.iter_mut()));
                let theirs = |s: &&mut Session| {
                    s.spec.session_id == session_id
                        && owner.as_ref().is_none_or(|o| *o == s.spec.owner)
                };
                for s in all.filter(theirs) {
                    s.terminated = true;
                    n += 1;
                }
                let _ = reply.send(n);
            }
            Command::StartRecorder { .. }
            | Command::StopRecorder { .. }
            | Command::Snapshot { .. } => self.handle_recorder(command),
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// Checks what depends on the hub's state: room, and the targets.
    fn admit(&mut self, spec: &SessionSpec) -> Result<(), SessionError> {
        if self.shutting_down {
            return Err(SessionError::ShuttingDown);
        }
        let limit = self.config.max_sessions;
        if self.in_progress() >= limit {
            return Err(SessionError::Busy { limit });
        }
        self.watched.refresh();
        let watched = self.watched.targets();
        if watched.is_empty() {
            return Err(SessionError::NothingWatched(self.watched.why_empty()));
        }
        for &pid in spec.pids.iter().flatten() {
            if !self.watched.contains(pid) {
                return Err(SessionError::PidNotWatched {
                    pid,
                    watched: watched.iter().map(|t| t.pid).collect(),
                });
            }
        }
        Ok(())
    }

    fn next_wait(&self) -> Duration {
        let now = clock::monotonic_ns();
        let mut deadlines: Vec<u64> = self
            .waiting
            .iter()
            .map(|s| s.start_ns.saturating_sub(ATTACH_LEAD_NS))
            .collect();
        deadlines.extend(
            self.running
                .iter()
                .flat_map(|r| &r.sessions)
                .filter_map(|s| s.window.map(|(_, stop)| stop)),
        );
        let mut wait = deadlines
            .into_iter()
            .min()
            .map_or(IDLE_WAIT, |d| Duration::from_nanos(d.saturating_sub(now)));
        if self.running.iter().any(|r| r.capture.is_some()) {
            wait = wait.min(TICK);
        }
        if let Some(r) = &self.recorder {
            wait = wait.min(r.drain_period());
        }
        let kept_until = self
            .kept
            .as_ref()
            .map(|(_, since)| *since + self.config.keep_probes);
        for at in self
            .watched
            .next_scan()
            .into_iter()
            .chain(self.trim_at)
            .chain(kept_until)
        {
            wait = wait.min(at.saturating_duration_since(Instant::now()));
        }
        wait.min(IDLE_WAIT)
    }

    fn step(&mut self) {
        self.watched.refresh();
        self.run_recorder();
        self.forget_cancelled();
        self.start_due_sessions();
        for r in &mut self.running {
            if let Some(c) = r.capture.as_mut() {
                c.poll(Duration::ZERO);
            }
        }
        self.finish_due_sessions();
        // A capture nobody uses any more is dropped: that detaches it.
        let (idle, busy): (Vec<Running>, Vec<Running>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|r| r.sessions.is_empty());
        self.running = busy;
        for r in idle {
            self.keep_or_detach(r);
            self.trim_at = Some(Instant::now() + TRIM_AFTER_IDLE);
        }
        self.expire_kept();
        if self.trim_at.is_some_and(|at| at <= Instant::now()) {
            if self.in_progress() == 0 {
                self.trim_at = None;
                release_free_memory();
            } else {
                self.trim_at = Some(Instant::now() + TRIM_AFTER_IDLE);
            }
        }
        if self.shutting_down {
            for s in self.waiting.drain(..) {
                let _ = s.reply.send(Err(SessionError::ShuttingDown));
            }
        }
    }

    /// Sessions whose client went away (cancelled, deadline) are dropped
    /// with everything they held.
    fn forget_cancelled(&mut self) {
        let gone = |s: &Session| {
            let closed = s.reply.is_closed();
            if closed {
                eprintln!(
                    "ebtrace: session {} for {}: the client went away; capture dropped",
                    s.spec.session_id.escape_debug(),
                    s.spec.client
                );
            }
            !closed
        };
        self.waiting.retain(gone);
        for r in &mut self.running {
            r.sessions.retain(gone);
        }
    }

    fn start_due_sessions(&mut self) {
        let now = clock::monotonic_ns();
        let (due, later): (Vec<Session>, Vec<Session>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|s| {
                s.terminated || self.shutting_down || s.start_ns <= now + ATTACH_LEAD_NS
            });
        self.waiting = later;
        for mut s in due {
            if s.terminated || self.shutting_down {
                // Ended before it began: nothing was recorded.
                let sources = Sources::new(
                    now,
                    ClockSync::measure(),
                    processes(&self.watched.targets()),
                );
                let why = Some(end_reason(&s, self.shutting_down));
                let tl = timeline::assemble(sources, &Window::between(now, now), 0, why);
                self.deliver(s, tl, Duration::ZERO);
                continue;
            }
            let index = match self.joinable(&s).or_else(|| self.resume_kept(&s)) {
                Some(i) => i,
                None => match self.while_recording(|hub| hub.start_capture(s.spec.families)) {
                    Ok(i) => i,
                    Err(e) => {
                        eprintln!("ebtrace: session {}: {e}", s.spec.session_id.escape_debug());
                        let _ = s.reply.send(Err(e));
                        continue;
                    }
                },
            };
            let r = &mut self.running[index];
            let start = s.start_ns.max(r.started_ns);
            let stop = start + s.duration_ns;
            s.window = Some((start, stop));
            // The first window of a capture that began for it is built
            // while it is recorded: its answer waits for less.
            if let Some(capture) = r.capture.as_mut().filter(|_| r.sessions.is_empty()) {
                capture.stream_window(&session_window(&s, start, stop));
            }
            r.sessions.push(s);
        }
    }

    /// A running capture this session can share.
    fn joinable(&self, s: &Session) -> Option<usize> {
        let pids: BTreeSet<u32> = self.watched.targets().iter().map(|t| t.pid).collect();
        let span = 2 * self.config.max_duration.as_nanos() as u64;
        self.running.iter().position(|r| {
            r.families == s.spec.families
                && r.pids() == pids
                && s.start_ns + s.duration_ns <= r.started_ns + span
        })
    }

    fn start_capture(&mut self, families: ProbeFamilies) -> Result<usize, SessionError> {
        let targets = self.watched.targets();
        if targets.is_empty() {
            return Err(SessionError::NothingWatched(self.watched.why_empty()));
        }
        let (capture, started_ns) = if families.is_empty() {
            (None, clock::monotonic_ns())
        } else {
            let options = CaptureOptions {
                probe: self.config.probe.clone(),
                families,
                ..CaptureOptions::default()
            };
            let c = Capture::start(targets.clone(), &options)
                .map_err(|e| SessionError::Attach(e.to_string()))?;
            eprintln!(
                "ebtrace: probes attached in {} ms",
                c.attach_time.as_millis()
            );
            for note in &c.notes {
                eprintln!("ebtrace: {note}");
            }
            let start = c.start_ns();
            (Some(c), start)
        };
        self.running.push(Running {
            capture,
            families,
            targets,
            started_ns,
            clock: ClockSync::measure(),
            sessions: Vec::new(),
        });
        Ok(self.running.len() - 1)
    }

    fn finish_due_sessions(&mut self) {
        let now = clock::monotonic_ns();
        let mut due: Vec<(usize, Session)> = Vec::new();
        for (index, r) in self.running.iter_mut().enumerate() {
            let alive: BTreeSet<u32> = r
                .targets
                .iter()
                .filter(|t| t.is_alive())
                .map(|t| t.pid)
                .collect();
            let (done, keep): (Vec<Session>, Vec<Session>) =
                std::mem::take(&mut r.sessions).into_iter().partition(|s| {
                    let (_, stop) = s.window.expect("running sessions have a window");
                    let traced_alive = match &s.spec.pids {
                        Some(pids) => pids.iter().any(|p| alive.contains(p)),
                        None => !alive.is_empty(),
                    };
                    now >= stop || s.terminated || self.shutting_down || !traced_alive
                });
            r.sessions = keep;
            due.extend(done.into_iter().map(|s| (index, s)));
        }
        if due.is_empty() {
            return;
        }
        // Building a session's timeline (and asking its agents) can take
        // seconds: the flight recorder goes on meanwhile.
        let finished = self.while_recording(|hub| {
            let shutting_down = hub.shutting_down;
            due.into_iter()
                .map(|(index, s)| {
                    let r = &mut hub.running[index];
                    let (start, stop) = s.window.expect("running sessions have a window");
                    let early = (now < stop).then(|| end_reason(&s, shutting_down));
                    let stop = now.min(stop).max(start);
                    let building = Instant::now();
                    let tl = session_timeline(r, &s, start, stop, early);
                    (s, tl, building.elapsed())
                })
                .collect::<Vec<_>>()
        });
        for (s, tl, built_in) in finished {
            self.deliver(s, tl, built_in);
        }
    }

    /// Drops `probes` (a capture, the flight recorder) on a worker thread:
    /// detaching waits for the kernel.
    fn detach<T: Send + 'static>(&mut self, probes: T) {
        self.detaching.retain(|w| !w.is_finished());
        if self.detaching.len() >= MAX_DETACHING {
            drop(probes);
            return;
        }
        match std::thread::Builder::new()
            .name("ebtrace-detach".into())
            .spawn(move || {
                drop(probes);
                release_free_memory();
            }) {
            Ok(handle) => self.detaching.push(handle),
            Err(e) => eprintln!("ebtrace: cannot start a worker thread: {e}"),
        }
    }

    /// Hands a finished session to a worker that builds and sends its
    /// response.
    fn deliver(&mut self, session: Session, timeline: Timeline, built_in: Duration) {
        let guard = self.config.guard.clone();
        let metrics = Arc::clone(&self.config.metrics);
        let unanswered = Unanswered::count(&self.unanswered);
        let worker = std::thread::Builder::new()
            .name("ebtrace-deliver".into())
            .spawn(move || {
                let encoding = Instant::now();
                let result = response::respond(&timeline, &session.spec, guard.as_deref());
                let timing = (built_in, encoding.elapsed());
                // Counted before the answer goes out: a client that scrapes
                // /metrics once answered sees it.
                metrics.server.add_capture(timeline.stats.dropped);
                let reply = match result {
                    Ok((response, delivered)) => {
                        log_delivered(&session, &timeline, &delivered, timing);
                        Ok(response)
                    }
                    Err(e) => {
                        eprintln!(
                            "ebtrace: session {}: {e}",
                            session.spec.session_id.escape_debug()
                        );
                        Err(SessionError::Response(e))
                    }
                };
                // Given back before the answer goes: sending copies its
                // XSpace once more, which must not come on top of the
                // timeline it was made from.
                drop(timeline);
                release_free_memory();
                let _ = session.reply.send(reply);
                // In progress until its memory is given back: the flight
                // recorder measures ebtrace's own only when none is.
                drop(unanswered);
            });
        match worker {
            Ok(handle) => self.delivering.push(handle),
            Err(e) => eprintln!("ebtrace: cannot start a worker thread: {e}"),
        }
    }
}

/// One session counted in [`Hub::unanswered`] until this is dropped (also
/// when its worker could not start).
struct Unanswered(Arc<AtomicUsize>);

impl Unanswered {
    fn count(unanswered: &Arc<AtomicUsize>) -> Self {
        unanswered.fetch_add(1, Ordering::AcqRel);
        Unanswered(Arc::clone(unanswered))
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Gives the memory of a finished session back to the system: the
/// allocator keeps freed pages of worker threads' arenas otherwise, and an
/// idle server would hold hundreds of MiB after a big capture.
fn release_free_memory() {
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe { libc::malloc_trim(0) };
}

fn end_reason(s: &Session, shutting_down: bool) -> String {
    if shutting_down {
        "the server is shutting down".into()
    } else if s.terminated {
        format!(
            "Terminate({}) was received",
            s.spec.session_id.escape_debug()
        )
    } else {
        "every traced process exited".into()
    }
}

/// The session's window of a running capture: its pids, at most its
/// `max_events` events.
fn session_timeline(
    r: &mut Running,
    s: &Session,
    start: u64,
    stop: u64,
    ended_early: Option<String>,
) -> Timeline {
    let window = session_window(s, start, stop);
    match r.capture.as_mut() {
        Some(capture) => {
            let dropped = capture.probe_stats().map(|p| p.dropped()).unwrap_or(0);
            capture.assemble_while_draining(&window, dropped, ended_early)
        }
        // No family was asked for: the window, its processes, no probe data.
        None => {
            let sources = Sources::new(r.started_ns, r.clock, processes(&r.targets));
            timeline::assemble(sources, &window, 0, ended_early)
        }
    }
}

/// What the session shows of `start..stop`: its pids, at most its
/// `max_events` events.
fn session_window(s: &Session, start: u64, stop: u64) -> Window {
    Window {
        start_ns: start,
        stop_ns: stop,
        pids: s.spec.pids.clone(),
        max_events: s.spec.max_events,
        max_events_from: s.spec.max_events_from,
    }
}

/// The traced processes as [`Sources`] lists them.
fn processes(targets: &[TargetProcess]) -> Vec<(u32, String)> {
    targets.iter().map(|t| (t.pid, t.name.clone())).collect()
}

/// One line per answered session; `timing` is (timeline built in, response
/// built in).
fn log_delivered(s: &Session, tl: &Timeline, d: &Delivered, timing: (Duration, Duration)) {
    let mut line = format!(
        "ebtrace: session {} for {}: {:.0} ms window, {} events, {} bytes",
        s.spec.session_id.escape_debug(),
        s.spec.client,
        tl.duration_ns() as f64 / 1e6,
        d.events,
        d.bytes
    );
    if d.empty {
        line.push_str(", empty trace");
    }
    if let Some(p) = &d.saved {
        line.push_str(&format!(", saved to {}", p.display()));
    }
    if let Some(why) = &d.not_saved {
        line.push_str(&format!(
            ", not saved on this server ({why}; the client saves it from the response)"
        ));
    }
    if let Some(why) = &tl.stats.ended_early {
        line.push_str(&format!("; ended early: {why}"));
    }
    line.push_str(&format!(
        " (answered {} ms after the request; timeline {} ms, XSpace {} ms: built {} ms, \
         encoded {} ms)",
        s.received.elapsed().as_millis(),
        timing.0.as_millis(),
        timing.1.as_millis(),
        d.built.as_millis(),
        d.encoded.as_millis()
    ));
    eprintln!("{line}");
}
