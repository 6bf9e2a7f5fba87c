//! The hub's side of the flight recorder: the commands that switch it on
//! and off and take snapshots, and keeping it going on every tick.

use std::{collections::BTreeSet, sync::atomic::Ordering, time::Duration, time::Instant};

use super::{Command, Hub, Session, SessionError, TRIM_AFTER_IDLE};
use crate::{
    capture::flight_recorder::{FlightRecorder, FlightRecorderError},
    collect::{DrainStop, StopOnDrop},
    server::validate::SessionSpec,
};

impl Hub {
    /// `StartRecorder`, `StopRecorder` and `Snapshot`.
    pub(super) fn handle_recorder(&mut self, command: Command) {
        match command {
            Command::StartRecorder { spec, reply } => {
                self.recorder_wanted = true;
                let started = match &self.recorder {
                    Some(_) => Ok(()),
                    None => self.start_recorder(spec),
                };
                let _ = reply.send(started);
            }
            Command::StopRecorder { reply } => {
                self.recorder_wanted = false;
                self.recorder_spec = None;
                let was_on = self.recorder.take().map(|r| {
                    eprintln!(
                        "ebtrace: flight recorder off ({} records held, {} forgotten)",
                        r.held(),
                        r.forgotten
                    );
                    self.retire_recorder(r);
                    self.trim_at = Some(Instant::now() + TRIM_AFTER_IDLE);
                });
                let _ = reply.send(was_on.is_some());
            }
            Command::Snapshot {
                snapshot_id,
                client,
                reply,
                slot,
            } => match self.recorder.as_mut() {
                None => {
                    let _ = reply.send(Err(SessionError::RecorderOff));
                }
                Some(r) => {
                    let building = Instant::now();
                    let timeline = r.snapshot(None);
                    let mut spec = self
                        .recorder_spec
                        .clone()
                        .unwrap_or_else(|| SessionSpec::flight_recorder(&self.config.hostname));
                    spec.session_id = snapshot_id;
                    spec.client = client;
                    spec.duration = Duration::from_nanos(timeline.duration_ns());
                    let session = Session {
                        duration_ns: timeline.duration_ns(),
                        spec,
                        reply,
                        _slot: slot,
                        received: building,
                        start_ns: 0,
                        window: None,
                        terminated: false,
                    };
                    self.deliver(session, timeline, building.elapsed());
                    // Until then the recorder does not measure ebtrace's
                    // memory: the snapshot's would read as ebtrace's own.
                    self.trim_at = Some(Instant::now() + TRIM_AFTER_IDLE);
                }
            },
            _ => unreachable!("only the flight recorder's commands come here"),
        }
    }

    /// Detaches a recorder that stops: what it held is gone from
    /// `/metrics`, what it forgot stays counted.
    fn retire_recorder(&mut self, mut r: FlightRecorder) {
        let counters = &self.config.metrics.server;
        counters
            .recorder_forgotten
            .fetch_add(r.newly_forgotten(), Ordering::Relaxed);
        counters.recorder_held.store(0, Ordering::Relaxed);
        counters.recorder_limit.store(0, Ordering::Relaxed);
        self.config.metrics.add_activity(&r.take_activity());
        self.detach(r);
    }

    /// Runs `work`, which may take a while (a capture's probes attached,
    /// its timeline built, its agents asked), while another thread keeps
    /// the flight recorder going: on a busy target its ring buffer fills
    /// in a fraction of a second, and the hub drains it only between
    /// steps. `work` finds the hub without its recorder.
    pub(super) fn while_recording<T>(&mut self, work: impl FnOnce(&mut Hub) -> T) -> T {
        let Some(mut recorder) = self.recorder.take() else {
            return work(self);
        };
        let done = DrainStop::new();
        let out = std::thread::scope(|scope| {
            let recording = std::thread::Builder::new()
                .name("ebtrace-recorder".into())
                .spawn_scoped(scope, || {
                    while !done.is_stopped() {
                        done.wait(recorder.drain_period());
                        recorder.tick();
                    }
                });
            if let Err(e) = &recording {
                eprintln!("ebtrace: flight recorder: cannot start a thread to drain it: {e}");
            }
            // Stopped however the work ends: a panic must not leave the
            // scope waiting for the thread.
            let stop = StopOnDrop(&done);
            let out = work(self);
            drop(stop);
            if let Ok(recording) = recording
                && recording.join().is_err()
            {
                eprintln!("ebtrace: flight recorder: its thread panicked while the hub was busy");
            }
            out
        });
        self.recorder = Some(recorder);
        out
    }

    /// Starts the flight recorder on every watched process.
    pub(super) fn start_recorder(&mut self, spec: SessionSpec) -> Result<(), SessionError> {
        self.watched.refresh();
        let targets = self.watched.targets();
        if targets.is_empty() {
            return Err(SessionError::NothingWatched(self.watched.why_empty()));
        }
        let recorder = FlightRecorder::start(
            targets,
            &self.config.probe,
            self.config.checked_probes.take(),
            self.config.retention,
        )
        .map_err(|e| match e {
            FlightRecorderError::Attach(e) => SessionError::Attach(e.to_string()),
            FlightRecorderError::NoRoom(what) => SessionError::NoRoom(what),
        })?;
        self.config.metrics.start_counting_activity();
        self.recorder = Some(recorder);
        self.recorder_spec = Some(spec);
        Ok(())
    }

    /// Keeps the flight recorder going: drains it, forgets what is too
    /// old, and records the processes watched since it started from now
    /// on. A process that exited stays in it until its records are too
    /// old: its last seconds are what a snapshot is asked for after a
    /// crash, unless a new process takes its pid (then what it kept of the
    /// old one is forgotten and the new one recorded). Once nothing is
    /// watched and nothing is held, its probes are detached.
    pub(super) fn run_recorder(&mut self) {
        let watched = self.watched.targets();
        let pids: BTreeSet<u32> = watched.iter().map(|t| t.pid).collect();
        // Nothing in progress, and the memory of the last given back.
        let quiet = self.trim_at.is_none() && self.in_progress() == 0;
        if let Some(r) = self.recorder.as_mut()
            && !self.shutting_down
        {
            r.forget_gone(&pids);
            r.forget_reused(&pids);
            r.take_on(watched);
            if quiet {
                r.measure_memory();
            }
            r.tick();
            let counters = &self.config.metrics.server;
            counters
                .recorder_held
                .store(r.held() as u64, Ordering::Relaxed);
            counters
                .recorder_limit
                .store(r.max_records() as u64, Ordering::Relaxed);
            counters
                .recorder_forgotten
                .fetch_add(r.newly_forgotten(), Ordering::Relaxed);
            self.config.metrics.add_activity(&r.take_activity());
            if !pids.is_empty() || r.held() > 0 {
                return;
            }
        }
        let old = self.recorder.take();
        let spec = self.recorder_spec.take();
        if let Some(r) = old {
            if pids.is_empty() && !self.shutting_down {
                eprintln!(
                    "ebtrace: flight recorder paused: no process is watched and what it held \
                     is older than --retain; it starts again with the next watched process"
                );
            }
            self.retire_recorder(r);
        }
        if !self.recorder_wanted || self.shutting_down || pids.is_empty() {
            return;
        }
        let spec = spec.unwrap_or_else(|| SessionSpec::flight_recorder(&self.config.hostname));
        if let Err(e) = self.start_recorder(spec) {
            eprintln!("ebtrace: the flight recorder could not start: {e}");
            self.recorder_wanted = false;
        }
    }
}
