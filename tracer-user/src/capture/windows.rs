//! What a capture hands over to be shown: its [`Sources`] for
//! [`timeline::assemble`], or a window assembled while the ring buffer
//! goes on being drained; and the one window whose scheduling is built
//! while it is recorded.

use std::{collections::HashMap, time::Duration};

use super::{Capture, traceme_findings};
use crate::{
    collect::{Collector, DrainStop, EncodedRecords, Record, StopOnDrop},
    metrics::activity::ActivityTally,
    timeline::{
        self, RecordInput, Sources, Timeline, TraceMeInput, Window, streamed::StreamedScheduling,
    },
};

/// How long the draining thread of [`Capture::assemble_while_draining`]
/// waits between drains at most.
const DRAIN_WHILE_BUILDING: Duration = Duration::from_millis(20);

/// Whether the thread states `streamed` builds are `window`'s (see
/// [`Capture::streamed_for`]).
fn streamed_fits(streamed: &StreamedScheduling, window: Option<&Window>) -> bool {
    match (streamed.window(), window) {
        ((_, None), _) => true,
        ((start, Some(stop)), Some(w)) => (w.start_ns, w.stop_ns) == (start, stop),
        (_, None) => false,
    }
}

impl Capture {
    /// Builds the scheduler records of `window` into thread states as they
    /// arrive, so that [`Self::assemble_while_draining`] of that window has
    /// only the last ones left to build (and, for a window of every
    /// process with `max_events`, none past where the trace will end). The
    /// records are still kept for other windows. Only for a window that
    /// starts when the capture (or its [`Self::resume`]) did, before
    /// anything was drained; other windows are left alone.
    pub fn stream_window(&mut self, window: &Window) {
        let fits = self.streamed.is_none()
            && self.families.sched
            && self.held.is_empty()
            && self.stack_samples.is_empty()
            && window.start_ns == self.start_ns
            && window.stop_ns > window.start_ns;
        if fits {
            let processes = self.targets.iter().map(|t| (t.pid, t.name.clone()));
            let streamed = StreamedScheduling::until(
                window.start_ns,
                window.stop_ns,
                processes,
                self.initial.clone(),
            );
            let max_events = window.max_events.filter(|_| window.pids.is_none());
            self.streamed = Some(streamed.at_most(max_events));
        }
    }

    /// Everything recorded so far, for [`timeline::assemble`]: drained
    /// records, and what the agents recorded, collected now. The capture
    /// goes on running: overlapping windows can share one set of probes.
    pub fn sources(&mut self) -> Sources<'_> {
        self.sources_and_collector(None, true).0
    }

    /// [`timeline::assemble`] of `window` from what is held so far, while
    /// another thread goes on draining the ring buffer: a large window
    /// (a flight recorder's snapshot) takes long enough to build that the
    /// ring would fill meanwhile, and so can asking the agents first. What
    /// it drained is taken in after each;
    /// the records a capture holds as the probes wrote them are held so
    /// from the start, as they take a fraction of their decoded size.
    pub fn assemble_while_draining(
        &mut self,
        window: &Window,
        dropped: u64,
        ended_early: Option<String>,
    ) -> Timeline {
        // Thread states still built as records arrive need them decoded.
        let hold = self
            .streamed
            .as_ref()
            .is_none_or(|s| streamed_fits(s, Some(window)));
        // The agents are asked first (a framework's recording, the names
        // of kernels looked up before the probes came): loading an agent
        // into a target takes a while, and one that does not answer
        // holds the question for seconds.
        let batch = std::mem::take(&mut self.drained);
        let mut questions = self.agent_questions_apart();
        let asked = DrainStop::new();
        let (mut drained, arrived, tally) = std::thread::scope(|scope| {
            let draining = scope.spawn(|| drain_until(questions.1, &asked, hold, batch));
            // Stopped however asking ends: a panic must not leave the
            // scope waiting for the draining thread.
            let stop = StopOnDrop(&asked);
            questions.0.collect_framework(true);
            questions.0.name_kernels();
            drop(stop);
            draining.join().expect("the draining thread does not panic")
        });
        self.keep_drained(&mut drained, arrived, &tally);
        let batch = std::mem::take(&mut self.drained);
        let (sources, collector) = self.sources_and_collector(Some(window), false);
        let built = DrainStop::new();
        let (timeline, (mut drained, arrived, tally)) = std::thread::scope(|scope| {
            let draining = scope.spawn(|| drain_until(collector, &built, hold, batch));
            let stop = StopOnDrop(&built);
            let timeline = timeline::assemble(sources, window, dropped, ended_early);
            drop(stop);
            let drained = draining.join().expect("the draining thread does not panic");
            (timeline, drained)
        });
        self.keep_drained(&mut drained, arrived, &tally);
        timeline
    }

    /// Takes in what [`drain_until`] drained: `arrived`, held as written,
    /// after the records held, and `drained`, the others, leaving it
    /// empty for the next drain.
    fn keep_drained(
        &mut self,
        drained: &mut Vec<Record>,
        arrived: EncodedRecords,
        tally: &ActivityTally,
    ) {
        self.held.append(arrived);
        self.activity.add(tally);
        self.take_in(drained);
        self.drained = std::mem::take(drained);
    }

    /// The thread states built while recording, where they are `window`'s:
    /// a capture's one window (`window` unknown here), or the window
    /// [`Self::stream_window`] was given. Other windows take the records.
    fn streamed_for(&mut self, window: Option<&Window>) -> Option<StreamedScheduling> {
        let streamed = self.streamed.as_ref()?;
        if streamed_fits(streamed, window) {
            self.streamed.take()
        } else {
            None
        }
    }

    /// [`Self::sources`] for `window`, and the collector, which they do
    /// not borrow; with `ask_agents`, what the agents recorded and the
    /// kernel names they give are asked for first.
    fn sources_and_collector(
        &mut self,
        window: Option<&Window>,
        ask_agents: bool,
    ) -> (Sources<'_>, &mut Collector) {
        let streamed = self.streamed_for(window);
        if ask_agents {
            self.collect_framework(true);
            self.name_kernels();
        }
        let mut names = HashMap::new();
        for t in &self.targets {
            for (tid, stat) in t.threads() {
                names.insert(tid, stat.comm);
            }
        }
        let traceme_events = self.traceme_events.make_contiguous();
        let traceme = (!self.traceme.recorders.is_empty()).then(|| {
            let mut notes = traceme_findings(&self.traceme);
            notes.extend(self.traceme.left_in_targets());
            TraceMeInput {
                events: traceme_events,
                notes,
            }
        });
        // Once older records are forgotten, the threads' states when the
        // capture began no longer lead up to the first record kept.
        let initial = if self.forgot {
            HashMap::new()
        } else {
            self.initial.clone()
        };
        let sources = Sources {
            start_ns: self.start_ns,
            clock: self.clock,
            processes: self
                .targets
                .iter()
                .map(|t| (t.pid, t.name.clone()))
                .collect(),
            initial,
            names,
            scheduling: self.families.sched,
            tracked_from: self.tracked_from.clone(),
            records: RecordInput::Held {
                records: &self.held,
                samples: &self.stack_samples,
            },
            streamed,
            malformed: self.collector.malformed(),
            driver_kernel_names: Some(&self.kernel_naming.found),
            traceme,
            warnings: self.traceme.warnings().to_vec(),
            recordings: &self.recordings,
            device_batches: &self.collected,
            stacks: self.stacks.as_mut(),
        };
        (sources, &mut self.collector)
    }
}

/// Drains `collector` until `stop`, at most [`DRAIN_WHILE_BUILDING`]
/// apart: the records a capture holds as the probes wrote them (with
/// `hold`) into an [`EncodedRecords`] of their own, the driver calls among
/// them counted, and the others into `batch`.
fn drain_until(
    collector: &mut Collector,
    stop: &DrainStop,
    hold: bool,
    mut batch: Vec<Record>,
) -> (Vec<Record>, EncodedRecords, ActivityTally) {
    let mut arrived = EncodedRecords::default();
    let mut tally = ActivityTally::default();
    while !stop.is_stopped() {
        collector.wait_unless_stopped(DRAIN_WHILE_BUILDING, stop);
        if hold {
            collector.drain_holding(&mut arrived, &mut batch, |call| tally.count_call(call));
        } else {
            collector.drain(&mut batch);
        }
    }
    (batch, arrived, tally)
}
