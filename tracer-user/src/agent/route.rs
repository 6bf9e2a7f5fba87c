//! Which route each target's TraceMe events take: the agent (the
//! framework's own profiler session, run inside the target) where it
//! works, else uprobes; and one line per target saying which and why.

use tracer_agent::protocol::{OP_SEQUENCE, OP_SHAPES, SessionLevels};

use super::{
    AgentSession,
    torch_abi::{self, NO_PYTORCH},
};
use crate::procfs::TargetProcess;

/// How a target's TraceMe events are collected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceMeRoute {
    /// Through the agent where it works (a jax or TensorFlow process),
    /// else through uprobes.
    #[default]
    Auto,
    /// Only through the agent: the framework's own profiler session, run
    /// inside the target (TraceMe at in-process cost, XLA's metadata and
    /// device planes).
    Agent,
    /// Only through uprobes on the TraceMe recorder: nothing is loaded
    /// into the target.
    Uprobe,
    /// No TraceMe events.
    Off,
}

/// Whether `pid`, with `maps` its mappings, runs a framework the agent
/// can drive: the reason if not.
fn framework_in(pid: u32, maps: &str) -> std::result::Result<(), String> {
    let exe = crate::procfs::executable(pid);
    let python = maps.contains("libpython")
        || exe
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("python"));
    let framework = ["jaxlib", "_pywrap_tensorflow", "libtensorflow"]
        .iter()
        .any(|lib| maps.contains(lib));
    match (python, framework) {
        (true, true) => Ok(()),
        (false, _) => Err("not a Python process".into()),
        (true, false) => Err("no jax or TensorFlow loaded".into()),
    }
}

/// Whether a process with mappings `maps` has loaded something whose
/// device work the agent can record: the CUDA driver (CUPTI) or a PJRT
/// plugin (its own profiler).
fn device_in(maps: &str) -> bool {
    ["/libcuda.so", "libtpu", "pjrt", "xla_cuda_plugin"]
        .iter()
        .any(|lib| maps.contains(lib))
}

/// What each target's agent records, and the lines saying so.
pub struct AgentStart {
    /// The sessions started.
    pub sessions: Vec<AgentSession>,
    /// Targets whose TraceMe events the uprobes collect.
    pub uprobe_pids: Vec<u32>,
    /// Lines for the summary: which route each target's TraceMe events take, and why.
    pub notes: Vec<String>,
}

impl AgentStart {
    /// A framework process whose session the agent could not start: its
    /// TraceMe events go to the uprobes under `auto`, else nowhere.
    fn traceme_without_agent(&mut self, pid: u32, route: TraceMeRoute, why: &str) {
        if route == TraceMeRoute::Auto {
            self.notes.push(format!(
                "pid {pid}: TraceMe through uprobes, not the agent: {why}"
            ));
            self.uprobe_pids.push(pid);
        } else {
            self.notes
                .push(format!("pid {pid}: no TraceMe events: the agent: {why}"));
        }
    }
}

/// What of PyTorch's ops a capture asks the agent for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchOps {
    /// How many in a million RecordFunctions (0: none).
    pub millionths: u32,
    /// Each ATen op's input shapes too.
    pub shapes: bool,
}

/// Starts, through the agent, the framework's own profiler session in
/// every target the TraceMe route allows, with `device_activity` the
/// device's activity (CUPTI, or a PJRT plugin's profiler) in every process
/// with a GPU or TPU runtime loaded, and PyTorch's ops in every PyTorch
/// process whose callback layout checks out, `torch_ops.millionths` in a
/// million of them (0: none); returns those
/// sessions, the pids left to the TraceMe uprobes, and lines saying which
/// route each target got.
pub fn start_agent_sessions(
    targets: &[TargetProcess],
    level: u32,
    route: TraceMeRoute,
    device_activity: bool,
    torch_ops: TorchOps,
) -> AgentStart {
    let mut out = AgentStart {
        sessions: Vec::new(),
        uprobe_pids: Vec::new(),
        notes: Vec::new(),
    };
    let traceme = level > 0 && route != TraceMeRoute::Off;
    for t in targets {
        let pid = t.pid;
        let maps =
            crate::procfs::maps_text(pid).map_err(|e| format!("cannot read /proc/{pid}/maps: {e}"));
        let framework = if !traceme || route == TraceMeRoute::Uprobe {
            Err(String::new())
        } else {
            maps.as_deref()
                .map_err(Clone::clone)
                .and_then(|m| framework_in(pid, m))
        };
        let device = device_activity && maps.as_deref().is_ok_and(device_in);
        let torch = match &maps {
            _ if torch_ops.millionths == 0 => Err(String::new()),
            Ok(m) => torch_abi::check(pid, m),
            Err(why) => Err(why.clone()),
        };
        if let Err(why) = &torch
            && why != NO_PYTORCH
            && !why.is_empty()
        {
            out.notes.push(format!("pid {pid}: no PyTorch ops: {why}"));
        }
        if traceme && framework.is_err() {
            match (route, &framework) {
                (TraceMeRoute::Agent, Err(why)) => out
                    .notes
                    .push(format!("pid {pid}: no TraceMe events: the agent: {why}")),
                // A process with no framework in it needs no line here:
                // the uprobe route says it found no recorder.
                _ => out.uprobe_pids.push(pid),
            }
        }
        if framework.is_err() && !device && torch.is_err() {
            continue;
        }
        let levels = SessionLevels {
            host: if framework.is_ok() { level } else { 0 },
            python: 0,
            device: u32::from(device_activity),
            ops: if torch.is_ok() {
                torch_ops.millionths
            } else {
                0
            },
            // Shapes are read through the members the sequence number's
            // check covers.
            op_fields: match &torch {
                Ok(abi) if abi.sequence_numbers && torch_ops.shapes => OP_SEQUENCE | OP_SHAPES,
                Ok(abi) if abi.sequence_numbers => OP_SEQUENCE,
                _ => 0,
            },
        };
        match AgentSession::start(pid, levels) {
            Ok(s) => {
                if let Some(listener) = &s.untrusted_listener {
                    out.notes.push(format!("pid {pid}: {listener}"));
                }
                let how = if s.preloaded() {
                    "the agent it was started with".to_string()
                } else {
                    format!(
                        "agent loaded in {:.1?}, one thread kept from its code for {:.1?}",
                        s.load.total, s.load.thread_diverted
                    )
                };
                let started = &s.started;
                match &started.framework {
                    Some(f) => out.notes.push(format!(
                        "pid {pid}: TraceMe through ebtrace's agent: {f} ({how})"
                    )),
                    None if framework.is_ok() => {
                        let why = started.notes.first().map_or("", String::as_str);
                        out.traceme_without_agent(pid, route, why);
                    }
                    None => {}
                }
                match (&started.ops, &torch) {
                    (Some(ops), Ok(abi)) => out.notes.push(format!(
                        "pid {pid}: {ops}, PyTorch {} ({how})",
                        abi.version.as_deref().unwrap_or("of unknown version")
                    )),
                    (None, Ok(_)) => {
                        let why = started
                            .notes
                            .iter()
                            .find(|n| n.starts_with("PyTorch ops"))
                            .map_or("the agent did not say why", String::as_str);
                        out.notes.push(format!("pid {pid}: no {why}"));
                    }
                    _ => {}
                }
                match &started.device {
                    Some(d) => out
                        .notes
                        .push(format!("pid {pid}: device activity: {d} ({how})")),
                    None if device && started.framework.is_none() => {
                        let why = started.notes.last().map_or("", String::as_str);
                        out.notes
                            .push(format!("pid {pid}: device activity not recorded: {why}"));
                    }
                    None => {}
                }
                out.sessions.push(s);
            }
            Err(why) => {
                if torch.is_ok() {
                    out.notes.push(format!("pid {pid}: no PyTorch ops: {why}"));
                }
                if framework.is_ok() {
                    out.traceme_without_agent(pid, route, &why.to_string());
                }
                if device {
                    out.notes.push(format!(
                        "pid {pid}: device activity not recorded ({why}); GPU lines show \
                         the work as the host submitted it"
                    ));
                }
            }
        }
    }
    out
}
