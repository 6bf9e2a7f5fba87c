//! What the agent records between a START and a STOP: the framework's own
//! profiler session, the device's activity and PyTorch's ops, each where
//! the process allows it.
//!
//! Never two device tracers at once: the framework's session starts
//! first, and where it traces the GPU itself (jax with its CUDA plugin) it
//! holds CUPTI, so ebtrace's own CUPTI recording steps aside. Without a
//! framework session, a loaded PJRT plugin's own profiler (libtpu, the
//! XLA CUDA plugin) records the device; only where there is none does
//! ebtrace record CUPTI itself (the plugin's GPU tracer is CUPTI too).

use crate::{
    cupti, pjrt,
    protocol::{self, SessionLevels},
    python::{Session, Text},
    torch_ops,
};

/// The sources recording for ebtrace.
pub struct Sources {
    framework: Option<Session>,
    plugin: Option<pjrt::PluginSession>,
    cupti: Option<cupti::Recording>,
    ops: Option<torch_ops::Recording>,
}

impl Sources {
    /// Starts every source `levels` asks for that the process allows. The
    /// text holds the [`protocol::STARTED`] lines; the error, why nothing
    /// started.
    #[allow(clippy::result_large_err)]
    pub fn start(levels: &SessionLevels) -> Result<(Sources, Text), Text> {
        let mut lines = Text::new("");
        let mut sources = Sources {
            framework: None,
            plugin: None,
            cupti: None,
            ops: None,
        };
        let mut first_failure = None;
        if levels.host > 0 {
            match Session::start(levels) {
                Ok((s, what)) => {
                    line(&mut lines, protocol::SOURCE_FRAMEWORK, what.as_bytes());
                    sources.framework = Some(s);
                }
                Err(why) => {
                    line(&mut lines, protocol::SOURCE_NOTE, why.as_bytes());
                    first_failure = Some(why);
                }
            }
        }
        let mut plugin_failure = None;
        if levels.device > 0 && sources.framework.is_none() {
            match pjrt::PluginSession::start(levels) {
                Ok(Some((p, what))) => {
                    line(&mut lines, protocol::SOURCE_DEVICE, what.as_bytes());
                    sources.plugin = Some(p);
                }
                Ok(None) => {}
                Err(why) => plugin_failure = Some(why),
            }
        }
        if levels.device > 0 && sources.plugin.is_none() {
            match cupti::Recording::start() {
                Ok((r, what)) => {
                    line(&mut lines, protocol::SOURCE_DEVICE, what.as_bytes());
                    sources.cupti = Some(r);
                }
                // The framework's own session traces the GPU, if it can.
                Err(_) if sources.framework.is_some() => {}
                // A plugin that is there but cannot record says more than
                // a process without CUDA.
                Err(_) if plugin_failure.is_some() => {
                    let why = plugin_failure.take().expect("checked");
                    line(&mut lines, protocol::SOURCE_NOTE, why.as_bytes());
                    first_failure.get_or_insert(why);
                }
                Err(why) => {
                    line(&mut lines, protocol::SOURCE_NOTE, why.as_bytes());
                    first_failure.get_or_insert(why);
                }
            }
        }
        if levels.ops > 0 {
            match torch_ops::Recording::start(levels.ops, levels.op_fields) {
                Ok((r, what)) => {
                    line(&mut lines, protocol::SOURCE_OPS, what.as_bytes());
                    sources.ops = Some(r);
                }
                Err(why) => {
                    line(&mut lines, protocol::SOURCE_NOTE, why.as_bytes());
                    first_failure.get_or_insert(why);
                }
            }
        }
        if sources.framework.is_none()
            && sources.plugin.is_none()
            && sources.cupti.is_none()
            && sources.ops.is_none()
        {
            return Err(first_failure.unwrap_or_else(|| Text::new("nothing to record")));
        }
        Ok((sources, lines))
    }

    /// The capture window opens: what the device recorded until now is
    /// forgotten (the framework's and the plugin's sessions keep theirs:
    /// ebtrace cuts their events to the window).
    pub fn open_window(&mut self) {
        if let Some(r) = &mut self.cupti {
            r.discard_until_now();
        }
    }

    /// Hands over what the device recorded so far, recording on (CUPTI:
    /// its completed buffers; the sessions' own profilers keep theirs to
    /// the stop). Returns why something could not be handed over.
    pub fn collect(&mut self, mut deliver: impl FnMut(u32, &[u8])) -> Option<Text> {
        self.cupti
            .as_mut()
            .and_then(|r| r.collect(|batch| deliver(protocol::DEVICE_ACTIVITY, batch)))
    }

    /// Stops the framework's session alone, handing its XSpace to
    /// `deliver`; returns why it did not stop cleanly.
    pub fn stop_framework(&mut self, mut deliver: impl FnMut(u32, &[u8])) -> Option<Text> {
        self.framework
            .take()
            .and_then(|s| s.stop(|xspace| deliver(protocol::XSPACE, xspace)))
    }

    /// Stops every source for no one: the framework's session is let go
    /// without converting what it holds (which takes seconds for millions
    /// of events, and memory), the others are stopped and their records
    /// dropped.
    pub fn discard(self) {
        if let Some(s) = self.framework {
            s.discard();
        }
        if let Some(p) = self.plugin {
            let _ = p.stop(|_| {});
        }
        if let Some(r) = self.cupti {
            let _ = r.stop(|_| {});
        }
        if let Some(r) = self.ops {
            r.discard();
        }
    }

    /// Stops every source, handing what each recorded to `deliver` as
    /// `(frame kind, payload)`; returns why a source did not stop cleanly.
    pub fn stop(self, mut deliver: impl FnMut(u32, &[u8])) -> Option<Text> {
        let mut why = None;
        if let Some(s) = self.framework {
            why = s.stop(|xspace| deliver(protocol::XSPACE, xspace));
        }
        if let Some(p) = self.plugin
            && let Some(w) = p.stop(|xspace| deliver(protocol::XSPACE, xspace))
        {
            why.get_or_insert(w);
        }
        if let Some(r) = self.cupti
            && let Some(w) = r.stop(|batch| deliver(protocol::DEVICE_ACTIVITY, batch))
        {
            why.get_or_insert(w);
        }
        if let Some(r) = self.ops {
            r.stop(|ops| deliver(protocol::TORCH_OPS, ops));
        }
        why
    }
}

/// Appends the line `source\ttext` to `lines`.
fn line(lines: &mut Text, source: &str, text: &[u8]) {
    if !lines.as_bytes().is_empty() {
        lines.push(b"\n");
    }
    lines.push(source.as_bytes());
    lines.push(b"\t");
    lines.push(text);
}
