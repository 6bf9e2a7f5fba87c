//! `SchedProbe`: the scheduler tracepoints, filtered in the kernel to the
//! traced processes (see `tracer-ebpf/src/sched.rs` for the membership rules).

use aya::programs::TracePoint;

use super::ProbeSet;
use crate::error::{Error, Result};

/// Tracepoints attached after the thread-creation one, in this order.
const SCHED_PROGRAMS: [(&str, &str, &str); 6] = [
    ("sched_switch", "sched", "sched_switch"),
    ("sched_waking", "sched", "sched_waking"),
    ("sched_wakeup_new", "sched", "sched_wakeup_new"),
    ("sched_process_fork", "sched", "sched_process_fork"),
    ("sched_process_exit", "sched", "sched_process_exit"),
    ("task_rename", "task", "task_rename"),
];
const NEWTASK_PROGRAM: (&str, &str, &str) = ("task_newtask", "task", "task_newtask");

/// The scheduler probe family.
pub struct SchedProbe;

impl SchedProbe {
    fn attach_one(set: &mut ProbeSet, (prog, category, name): (&str, &str, &str)) -> Result<()> {
        let tp: &mut TracePoint = set
            .ebpf()
            .program_mut(prog)
            .expect("program is in the object")
            .try_into()
            .expect("program is a tracepoint");
        tp.load().map_err(|source| Error::Attach {
            what: format!("program {prog} (verifier)"),
            source: Box::new(source),
        })?;
        let link = tp
            .attach(category, name)
            .and_then(|id| tp.take_link(id))
            .map_err(|source| Error::Attach {
                what: format!("tracepoint {category}:{name}"),
                source: Box::new(source),
            })?;
        set.keep_link(link);
        Ok(())
    }

    /// Starts following thread creation. Attach this before listing the
    /// existing threads, so that none created in between is missed.
    pub fn attach_thread_creation(set: &mut ProbeSet) -> Result<()> {
        Self::attach_one(set, NEWTASK_PROGRAM)
    }

    /// Attaches the scheduling tracepoints.
    pub fn attach_scheduling(set: &mut ProbeSet) -> Result<()> {
        for p in SCHED_PROGRAMS {
            Self::attach_one(set, p)?;
        }
        Ok(())
    }
}
