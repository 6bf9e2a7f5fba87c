//! Probes kept between captures: a capture with no session left is
//! paused and kept for the next session that wants the same probes on the
//! same processes (`--keep-probes`).

use std::{collections::BTreeSet, time::Instant};

use super::{Hub, Running, Session};
use crate::clock::ClockSync;

impl Hub {
    /// Records again with the kept probes, if they are the ones this
    /// session needs; otherwise they are detached (one set is kept at most).
    pub(super) fn resume_kept(&mut self, s: &Session) -> Option<usize> {
        let (mut r, _) = self.kept.take()?;
        let pids: BTreeSet<u32> = self.watched.targets().iter().map(|t| t.pid).collect();
        if r.families != s.spec.families || r.pids() != pids {
            self.detach(r);
            return None;
        }
        let capture = r
            .capture
            .as_mut()
            .expect("only captures with probes are kept");
        if let Err(why) = capture.resume() {
            eprintln!("ebtrace: the kept probes cannot record again ({why}); attaching new ones");
            self.detach(r);
            return None;
        }
        eprintln!(
            "ebtrace: probes kept from the last capture, recording again in {} ms",
            capture.attach_time.as_millis()
        );
        r.started_ns = capture.start_ns();
        r.clock = ClockSync::measure();
        self.running.push(r);
        Some(self.running.len() - 1)
    }

    /// A capture nobody uses any more: paused and kept for the next
    /// session where `--keep-probes` allows and it took no off-CPU
    /// stacks, else detached.
    pub(super) fn keep_or_detach(&mut self, mut r: Running) {
        // Off-CPU stacks' tracepoint slows every system call on the
        // machine down for as long as it is attached, paused or not.
        let keep = !self.shutting_down
            && !self.config.keep_probes.is_zero()
            && r.families.off_cpu_min.is_zero();
        let Some(capture) = r.capture.as_mut().filter(|_| keep) else {
            self.detach(r);
            return;
        };
        if let Err(e) = capture.pause() {
            eprintln!("ebtrace: pausing the probes failed ({e}); detaching them");
            self.detach(r);
            return;
        }
        if let Some((older, _)) = self.kept.replace((r, Instant::now())) {
            self.detach(older);
        }
    }

    /// Detaches the kept probes once they have waited long enough, the
    /// watched processes changed, or the server stops.
    pub(super) fn expire_kept(&mut self) {
        let Some((r, since)) = &self.kept else {
            return;
        };
        let pids: BTreeSet<u32> = self.watched.targets().iter().map(|t| t.pid).collect();
        if self.shutting_down || since.elapsed() >= self.config.keep_probes || r.pids() != pids {
            let (r, _) = self.kept.take().expect("checked above");
            self.detach(r);
        }
    }
}
