//! A finished session's timeline as a `ProfileResponse`: the XSpace in
//! `tool_data { name: "xplane.pb" }` (TSL's clients then write
//! `<repository_root>/<session_id>/<host>.xplane.pb` themselves, on their
//! own machine) or inline in `xspace` when the request set `emit_xspace`;
//! `empty_trace` exactly when no line of any plane has an event (TSL's
//! `IsEmpty`); and, where the operator allowed it, a copy saved by the
//! server. That copy is extra: when it cannot be made, the client still
//! gets its trace and the server's log says why there is no copy.

use ebtrace_proto::tensorflow::{ProfileResponse, ProfileToolData, profiler::XSpace};
use prost::Message as _;

use super::{
    validate::{Delivery, ServerCopy, SessionSpec},
    write_guard::WriteGuard,
};
use crate::{sink::xspace, timeline::Timeline};

/// The tool name TSL's clients save as `<host>.xplane.pb`.
pub const XPLANE_TOOL: &str = "xplane.pb";

/// What the server's log says about a delivered session.
#[derive(Clone, Debug)]
pub struct Delivered {
    /// Time to build the encoded XSpace.
    pub built: std::time::Duration,
    /// Time to decode it into the response's `xspace` (inline delivery only).
    pub encoded: std::time::Duration,
    /// Events in the trace.
    pub events: usize,
    /// Size of the encoded XSpace.
    pub bytes: usize,
    /// No line has an event.
    pub empty: bool,
    /// Where the server saved its own copy, if it did.
    pub saved: Option<std::path::PathBuf>,
    /// Why a copy the request asked the server for was not saved.
    pub not_saved: Option<String>,
}

/// TSL's `IsEmpty(XSpace)`: no line of any plane has an event.
pub fn is_empty(space: &XSpace) -> bool {
    space
        .planes
        .iter()
        .all(|p| p.lines.iter().all(|l| l.events.is_empty()))
}

/// Builds the response, and the server's copy where there is to be one.
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
        not_saved: None,
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
            // Clients save no empty trace: neither does the server.
            match (&spec.server_copy, guard) {
                _ if empty => {}
                (ServerCopy::Save(destination), Some(guard)) => {
                    match guard.write(destination, &bytes) {
                        Ok(path) => delivered.saved = Some(path),
                        Err(e) => {
                            delivered.not_saved = Some(format!(
                                "writing {} failed: {e}",
                                guard.path_of(destination).display()
                            ))
                        }
                    }
                }
                (ServerCopy::Refused(why), _) => delivered.not_saved = Some(why.clone()),
                (ServerCopy::NotAsked | ServerCopy::Save(_), _) => {}
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
