//! A finished session's timeline as a `ProfileResponse`: the XSpace in
//! `tool_data { name: "xplane.pb" }` (TSL's clients then write
//! `<repository_root>/<session_id>/<host>.xplane.pb` themselves, on their
//! own machine) or inline in `xspace` when the request set `emit_xspace`;
//! `empty_trace` exactly when no line of any plane has an event (TSL's
//! `IsEmpty`); and, where the operator allowed it, a copy saved by the
//! server.

use ebtrace_proto::tensorflow::{ProfileResponse, ProfileToolData, profiler::XSpace};
use prost::Message as _;

use super::{
    validate::{Delivery, SessionSpec},
    write_guard::WriteGuard,
};
use crate::{sink::xspace, timeline::Timeline};

/// The tool name TSL's clients save as `<host>.xplane.pb`.
pub const XPLANE_TOOL: &str = "xplane.pb";

/// What the server's log says about a delivered session.
#[derive(Clone, Debug)]
pub struct Delivered {
    /// Time to build the XSpace and to encode it.
    pub built: std::time::Duration,
    pub encoded: std::time::Duration,
    pub events: usize,
    pub bytes: usize,
    pub empty: bool,
    pub saved: Option<std::path::PathBuf>,
}

/// TSL's `IsEmpty(XSpace)`: no line of any plane has an event.
pub fn is_empty(space: &XSpace) -> bool {
    space
        .planes
        .iter()
        .all(|p| p.lines.iter().all(|l| l.events.is_empty()))
}

/// Builds the response; saving fails the session (the client is told why)
/// rather than answering as if the file were there.
pub fn respond(
    timeline: &Timeline,
    spec: &SessionSpec,
    guard: Option<&WriteGuard>,
) -> Result<(ProfileResponse, Delivered), String> {
    // The timeline knows whether any line will have an event: no need to
    // decode what the sink encodes.
    let events = timeline.event_count();
    let empty = events == 0;
    let building = std::time::Instant::now();
    let bytes = xspace::timeline_to_xspace_bytes(timeline, &spec.hostname);
    let built = building.elapsed();
    let mut delivered = Delivered {
        built,
        encoded: std::time::Duration::ZERO,
        events,
        bytes: bytes.len(),
        empty,
        saved: None,
    };
    let response = match spec.delivery {
        Delivery::Inline => {
            let encoding = std::time::Instant::now();
            let space = XSpace::decode(bytes.as_slice())
                .map_err(|e| format!("re-reading the XSpace failed: {e}"))?;
            delivered.encoded = encoding.elapsed();
            ProfileResponse {
                tool_data: vec![],
                empty_trace: empty,
                xspace: Some(space),
            }
        }
        Delivery::ToolData => {
            if let (Some(destination), Some(guard), false) = (&spec.save_to, guard, empty) {
                let path = guard.write(destination, &bytes).map_err(|e| {
                    format!(
                        "saving the trace to {} failed: {e}",
                        guard.path_of(destination).display()
                    )
                })?;
                delivered.saved = Some(path);
            }
            ProfileResponse {
                tool_data: vec![ProfileToolData {
                    name: XPLANE_TOOL.into(),
                    data: bytes,
                }],
                empty_trace: empty,
                xspace: None,
            }
        }
    };
    Ok((response, delivered))
}
