//! `SchedProbe`: the scheduler tracepoints, filtered in the kernel to the
//! traced processes (see `tracer-ebpf/src/sched.rs` for the membership rules).
//!
//! Switches and wake-ups, the events that fire hundreds of thousands of
//! times a second, go through raw tracepoints where the kernel's BTF
//! describes `task_struct` and the tracepoints' arguments: the kernel then
//! formats no record for them, which costs the traced program less per
//! event. Elsewhere (or with `EBTRACE_SCHED_TRACEPOINTS=classic`) the
//! classic tracepoints write the same records.

use std::sync::OnceLock;

use aya::programs::{RawTracePoint, TracePoint};

use super::{
    ProbeSet,
    btf::{BtfError, TaskOffsets},
};
use crate::error::{Error, Result};

/// Set to `classic` to record switches and wake-ups through the classic
/// tracepoints, as on kernels without BTF (to compare, or to work around a
/// kernel's).
pub const TRACEPOINTS_ENV: &str = "EBTRACE_SCHED_TRACEPOINTS";

/// Raw tracepoints that replace the classic ones of the same name.
const RAW_PROGRAMS: [(&str, &str); 3] = [
    ("raw_sched_switch", "sched_switch"),
    ("raw_sched_waking", "sched_waking"),
    ("raw_sched_wakeup_new", "sched_wakeup_new"),
];

/// How switches and wake-ups are recorded.
#[derive(Clone, Debug)]
pub enum SchedRoute {
    /// Raw tracepoints reading `task_struct` at these offsets.
    Raw(TaskOffsets),
    /// Classic tracepoints, and why not raw ones.
    Classic(String),
}

impl SchedRoute {
    /// Raw tracepoints where the kernel's BTF allows them (unless
    /// [`TRACEPOINTS_ENV`] asks for the classic ones).
    pub fn for_this_kernel() -> Self {
        if std::env::var(TRACEPOINTS_ENV).is_ok_and(|v| v == "classic") {
            return SchedRoute::Classic(format!("{TRACEPOINTS_ENV}=classic"));
        }
        // The running kernel's types do not change: its BTF (megabytes,
        // a noticeable part of a capture's start) is read for the first
        // capture only.
        static FROM_BTF: OnceLock<SchedRoute> = OnceLock::new();
        FROM_BTF.get_or_init(Self::from_kernel_btf).clone()
    }

    fn from_kernel_btf() -> Self {
        match TaskOffsets::from_kernel() {
            Ok(offsets) => SchedRoute::Raw(offsets),
            Err(BtfError::Read { path, source }) => {
                SchedRoute::Classic(format!("no kernel BTF ({path}: {source})"))
            }
            Err(e) => SchedRoute::Classic(format!("kernel BTF: {e}")),
        }
    }

    /// One line for the capture's notes.
    pub fn describe(&self) -> String {
        match self {
            SchedRoute::Raw(_) => "scheduling: raw tracepoints".to_string(),
            SchedRoute::Classic(why) => format!("scheduling: classic tracepoints ({why})"),
        }
    }
}

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

    /// Attaches the scheduling tracepoints, switches and wake-ups by the
    /// set's [`SchedRoute`]; returns the line that names it.
    pub fn attach_scheduling(set: &mut ProbeSet) -> Result<String> {
        let raw = matches!(set.sched_route(), SchedRoute::Raw(_));
        for p in SCHED_PROGRAMS {
            match RAW_PROGRAMS.iter().find(|(_, name)| *name == p.2) {
                Some(&(prog, name)) if raw => Self::attach_raw(set, prog, name)?,
                _ => Self::attach_one(set, p)?,
            }
        }
        Ok(set.sched_route().describe())
    }

    fn attach_raw(set: &mut ProbeSet, prog: &str, name: &str) -> Result<()> {
        let tp: &mut RawTracePoint = set
            .ebpf()
            .program_mut(prog)
            .expect("program is in the object")
            .try_into()
            .expect("program is a raw tracepoint");
        tp.load().map_err(|source| Error::Attach {
            what: format!("program {prog} (verifier)"),
            source: Box::new(source),
        })?;
        let link = tp
            .attach(name)
            .and_then(|id| tp.take_link(id))
            .map_err(|source| Error::Attach {
                what: format!("raw tracepoint {name}"),
                source: Box::new(source),
            })?;
        set.keep_link(link);
        Ok(())
    }
}
