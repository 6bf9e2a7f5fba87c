//! Which route each target's TraceMe events take: the agent (the
//! framework's own profiler session, run inside the target) where it
//! works, else uprobes; and one line per target saying which and why.

use tracer_agent::protocol::SessionLevels;

use super::FrameworkSession;
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

/// Whether `pid` runs a framework the agent can drive: the reason if not.
fn framework_in(pid: u32) -> std::result::Result<(), String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| format!("cannot read /proc/{pid}/maps: {e}"))?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
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

/// Starts the framework's own profiler session in every target the route
/// and the agent allow; returns those sessions, the pids left to the
/// TraceMe uprobes, and one line per target saying which route it got.
pub fn start_framework_sessions(
    targets: &[TargetProcess],
    level: u32,
    route: TraceMeRoute,
) -> (Vec<FrameworkSession>, Vec<u32>, Vec<String>) {
    let (mut sessions, mut uprobes, mut notes) = (Vec::new(), Vec::new(), Vec::new());
    if level == 0 || route == TraceMeRoute::Off {
        return (sessions, uprobes, notes);
    }
    let levels = SessionLevels {
        host: level,
        python: 0,
        device: 1,
    };
    for t in targets {
        let pid = t.pid;
        if route == TraceMeRoute::Uprobe {
            uprobes.push(pid);
            continue;
        }
        // A process with no framework in it needs no line here: the
        // uprobe route says it found no recorder.
        if let Err(why) = framework_in(pid) {
            match route {
                TraceMeRoute::Auto => uprobes.push(pid),
                _ => notes.push(format!("pid {pid}: no TraceMe events: the agent: {why}")),
            }
            continue;
        }
        match FrameworkSession::start(pid, levels) {
            Ok(s) => {
                let how = if s.preloaded() {
                    "the agent it was started with".to_string()
                } else {
                    format!(
                        "agent loaded in {:.1?}, one thread kept from its code for {:.1?}",
                        s.load.total, s.load.thread_diverted
                    )
                };
                notes.push(format!(
                    "pid {pid}: TraceMe through ebtrace's agent: {} ({how})",
                    s.framework
                ));
                sessions.push(s);
            }
            Err(why) if route == TraceMeRoute::Auto => {
                notes.push(format!(
                    "pid {pid}: TraceMe through uprobes, not the agent: {why}"
                ));
                uprobes.push(pid);
            }
            Err(why) => notes.push(format!("pid {pid}: no TraceMe events: the agent: {why}")),
        }
    }
    (sessions, uprobes, notes)
}
