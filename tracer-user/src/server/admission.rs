//! How much work one caller, and all callers together, may have in
//! progress: captures, flight-recorder snapshots and CPU profiles. A
//! caller past its own limit is refused at once; work past the server's
//! total waits its turn (boundedly), so one caller asking fifty times
//! holds one place and every other caller is still served. A [`Slot`] is
//! held by the work itself, not by the request: a client that hangs up
//! does not free it before the snapshot it asked for is built and
//! dropped, or its CPU profile's sampling has stopped.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::caller::Caller;

/// Work the server does for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Work {
    /// A capture (Profile).
    Capture,
    /// A flight-recorder snapshot (GetSnapshot): the recorder's records
    /// copied into a trace, which `--retain-memory` has room for once.
    Snapshot,
    /// A CPU profile (`/debug/pprof/profile`).
    CpuProfile,
}

impl Work {
    fn plural(self) -> &'static str {
        match self {
            Work::Capture => "captures",
            Work::Snapshot => "snapshots",
            Work::CpuProfile => "CPU profiles",
        }
    }
}

/// The limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Captures one caller may have in progress (`--max-sessions-per-caller`);
    /// the total is the hub's `--max-sessions`.
    pub captures_per_caller: usize,
    /// How long work waits for its turn behind other callers' before it
    /// is refused.
    pub wait: Duration,
}

/// Snapshots built at once, and per caller: the flight recorder's memory
/// budget has room for one.
const SNAPSHOTS_AT_ONCE: usize = 1;
/// CPU profiles taken at once, and per caller.
const CPU_PROFILES_AT_ONCE: usize = 1;

/// Why work was not admitted: one line saying what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotAdmitted {
    /// The caller already has as much of this work in progress as it may.
    CallerLimit {
        /// The work.
        work: Work,
        /// The caller's limit.
        limit: usize,
    },
    /// Other callers' work did not end in time.
    Waited {
        /// The work.
        work: Work,
        /// How long it waited.
        waited: Duration,
    },
}

impl fmt::Display for NotAdmitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            NotAdmitted::CallerLimit {
                work: Work::Capture,
                limit,
            } => write!(
                f,
                "this caller already has {limit} captures in progress, the most one caller may \
                 (ebtrace serve --max-sessions-per-caller); retry when one has finished"
            ),
            NotAdmitted::CallerLimit { work, limit } => write!(
                f,
                "this caller already has {limit} of its {} in progress, the most one caller \
                 may; ask again when it is answered",
                work.plural()
            ),
            NotAdmitted::Waited { work, waited } => write!(
                f,
                "other callers' {} did not end within {}s; ask again later",
                work.plural(),
                waited.as_secs()
            ),
        }
    }
}

/// Who holds what.
pub struct Admission {
    limits: AdmissionLimits,
    held: Mutex<HashMap<(Work, String), usize>>,
    snapshots: Arc<Semaphore>,
    cpu_profiles: Arc<Semaphore>,
}

/// A place for one piece of work, given back when dropped.
pub struct Slot {
    admission: Arc<Admission>,
    key: (Work, String),
    _turn: Option<OwnedSemaphorePermit>,
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slot({:?} for {})", self.key.0, self.key.1)
    }
}

impl Admission {
    /// No work in progress yet.
    pub fn new(limits: AdmissionLimits) -> Arc<Self> {
        Arc::new(Admission {
            limits,
            held: Mutex::default(),
            snapshots: Arc::new(Semaphore::new(SNAPSHOTS_AT_ONCE)),
            cpu_profiles: Arc::new(Semaphore::new(CPU_PROFILES_AT_ONCE)),
        })
    }

    /// A place for `work` of `caller`'s, once there is one; refused at
    /// once past the caller's own limit, and after [`AdmissionLimits::wait`]
    /// when others' work holds every place.
    pub async fn admit(self: &Arc<Self>, caller: &Caller, work: Work) -> Result<Slot, NotAdmitted> {
        let (limit, turns) = match work {
            Work::Capture => (self.limits.captures_per_caller, None),
            Work::Snapshot => (SNAPSHOTS_AT_ONCE, Some(&self.snapshots)),
            Work::CpuProfile => (CPU_PROFILES_AT_ONCE, Some(&self.cpu_profiles)),
        };
        let key = (work, caller.identity());
        {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            let count = held.entry(key.clone()).or_default();
            if *count >= limit {
                return Err(NotAdmitted::CallerLimit { work, limit });
            }
            *count += 1;
        }
        // Counted from here: dropped while waiting, it is given back.
        let mut slot = Slot {
            admission: Arc::clone(self),
            key,
            _turn: None,
        };
        if let Some(turns) = turns {
            let wait = self.limits.wait;
            match tokio::time::timeout(wait, Arc::clone(turns).acquire_owned()).await {
                Ok(Ok(permit)) => slot._turn = Some(permit),
                _ => return Err(NotAdmitted::Waited { work, waited: wait }),
            }
        }
        Ok(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self
            .admission
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::caller::{Authority, Who};

    fn caller(uid: u32) -> Caller {
        Authority::default().judge(Who::Local { uid })
    }

    /// One caller gets one snapshot at a time; another waits for the
    /// place and gets it once the first is given back, even if the first
    /// caller keeps asking.
    #[tokio::test]
    async fn one_caller_holds_one_place_and_the_next_waits_its_turn() {
        let admission = Admission::new(AdmissionLimits {
            captures_per_caller: 2,
            wait: Duration::from_secs(5),
        });
        let (a, b) = (caller(1000), caller(1001));
        let first = admission.admit(&a, Work::Snapshot).await.unwrap();
        assert_eq!(
            admission.admit(&a, Work::Snapshot).await.unwrap_err(),
            NotAdmitted::CallerLimit {
                work: Work::Snapshot,
                limit: 1
            }
        );
        let waiting = tokio::spawn({
            let admission = Arc::clone(&admission);
            async move { admission.admit(&b, Work::Snapshot).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(first);
        waiting.await.unwrap().unwrap();
        // Captures have no total here (the hub keeps it): per caller only.
        let one = admission.admit(&a, Work::Capture).await.unwrap();
        let _two = admission.admit(&a, Work::Capture).await.unwrap();
        assert!(admission.admit(&a, Work::Capture).await.is_err());
        drop(one);
        assert!(admission.admit(&a, Work::Capture).await.is_ok());
        assert!(admission.held.lock().unwrap().len() <= 1);
    }

    #[tokio::test]
    async fn work_that_waits_too_long_is_refused() {
        let admission = Admission::new(AdmissionLimits {
            captures_per_caller: 1,
            wait: Duration::from_millis(50),
        });
        let _held = admission.admit(&caller(1), Work::CpuProfile).await.unwrap();
        let refused = admission.admit(&caller(2), Work::CpuProfile).await;
        assert!(matches!(refused, Err(NotAdmitted::Waited { .. })));
        // The refused caller holds nothing.
        assert_eq!(admission.held.lock().unwrap().len(), 1);
    }
}
