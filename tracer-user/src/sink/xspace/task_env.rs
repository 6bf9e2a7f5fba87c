//! The capture's own facts in the XSpace: the `Task Environment` plane (the
//! window, ebtrace's version, record counts, the traced pids) and the
//! warnings about what the trace lacks.

use super::{StatValue, TASK_ENV_PLANE, XPlaneBuilder};
use crate::timeline::Timeline;

/// The `Task Environment` plane of `timeline`.
pub(super) fn task_environment_plane(timeline: &Timeline) -> XPlaneBuilder {
    let mut env = XPlaneBuilder::new(1, TASK_ENV_PLANE);
    env.add_plane_stat(
        "profile_start_time",
        &StatValue::U64(timeline.clock.to_wall_ns(timeline.start_ns)),
    );
    env.add_plane_stat(
        "profile_stop_time",
        &StatValue::U64(timeline.clock.to_wall_ns(timeline.stop_ns)),
    );
    env.add_plane_stat(
        "ebtrace_version",
        &StatValue::Str(env!("CARGO_PKG_VERSION").into()),
    );
    env.add_plane_stat("ebtrace_records", &StatValue::U64(timeline.stats.records));
    env.add_plane_stat(
        "ebtrace_dropped_records",
        &StatValue::U64(timeline.stats.dropped),
    );
    env.add_plane_stat(
        "ebtrace_unreported_transitions",
        &StatValue::U64(timeline.stats.inconsistencies),
    );
    let pids = timeline
        .processes
        .keys()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    env.add_plane_stat("ebtrace_pids", &StatValue::Str(pids.into()));
    env
}

/// The XSpace's warnings: records dropped, transitions not reported, an
/// early end, then the timeline's own warnings.
pub(super) fn trace_warnings(timeline: &Timeline) -> Vec<String> {
    let mut warnings = Vec::new();
    if timeline.stats.dropped > 0 {
        warnings.push(format!(
            "ebtrace: {} records were dropped (ring buffer full); this trace is partial",
            timeline.stats.dropped
        ));
    }
    if timeline.stats.inconsistencies > 0 {
        warnings.push(format!(
            "ebtrace: {} scheduler transitions were not reported by the kernel; \
             the intervals they leave unexplained are marked Unknown",
            timeline.stats.inconsistencies
        ));
    }
    if let Some(why) = &timeline.stats.ended_early {
        warnings.push(format!("ebtrace: capture ended early: {why}"));
    }
    warnings.extend(
        timeline
            .stats
            .warnings
            .iter()
            .map(|w| format!("ebtrace: {w}")),
    );
    warnings
}
