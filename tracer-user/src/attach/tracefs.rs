//! Finding tracefs and checking that the kernel's tracepoints are the ones
//! the eBPF programs were written for.

use std::{
    fs,
    path::{Path, PathBuf},
};

use rustix::mount::MountFlags;
use tracer_common::TRACEPOINT_FIELDS;

use crate::error::{Error, Result};

/// Overrides where tracefs is looked for (odd systems; tests of the error path).
pub const TRACEFS_ENV: &str = "EBTRACE_TRACEFS";

const CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

fn has_events(root: &Path) -> bool {
    root.join("events").is_dir()
}

/// Returns the tracefs mount, mounting it at `/sys/kernel/tracing` when no
/// candidate is mounted (distributions without systemd's automount).
pub fn locate() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(TRACEFS_ENV) {
        return Ok(PathBuf::from(path));
    }
    if let Some(found) = CANDIDATES.iter().map(Path::new).find(|p| has_events(p)) {
        return Ok(found.to_path_buf());
    }
    let target = Path::new(CANDIDATES[0]);
    mount_tracefs(target).map_err(|source| Error::TracefsMount {
        path: target.to_path_buf(),
        source,
    })?;
    Ok(target.to_path_buf())
}

fn mount_tracefs(target: &Path) -> std::io::Result<()> {
    Ok(rustix::mount::mount(
        "nodev",
        target,
        "tracefs",
        MountFlags::empty(),
        None,
    )?)
}

/// Offset of `field` in a tracefs `format` file, if the field exists.
pub fn field_offset(format: &str, field: &str) -> Option<usize> {
    format.lines().find_map(|line| {
        let decl = line.trim().strip_prefix("field:")?;
        let (decl, rest) = decl.split_once(';')?;
        let name = decl.split_whitespace().last()?;
        let name = name.split('[').next()?;
        if name != field {
            return None;
        }
        let offset = rest.trim().strip_prefix("offset:")?.split(';').next()?;
        offset.trim().parse().ok()
    })
}

/// What the kernel's tracepoints look like, as far as the programs care.
#[derive(Debug, Clone)]
pub struct TracepointCheck {
    /// `sched_process_exit` reports `group_dead` (Linux 6.9+).
    pub exit_has_group_dead: bool,
}

/// Checks every tracepoint field the eBPF programs read.
pub fn check_tracepoints(tracefs: &Path) -> Result<TracepointCheck> {
    let mut formats: Vec<(String, String, String)> = Vec::new();
    for &(category, name, field, expected) in TRACEPOINT_FIELDS {
        let format = match formats.iter().find(|(c, n, _)| c == category && n == name) {
            Some((_, _, f)) => f.clone(),
            None => {
                let path = tracefs
                    .join("events")
                    .join(category)
                    .join(name)
                    .join("format");
                let f = fs::read_to_string(&path).map_err(|_| Error::MissingTracepoint {
                    category: category.into(),
                    name: name.into(),
                    tracefs: tracefs.to_path_buf(),
                })?;
                formats.push((category.into(), name.into(), f.clone()));
                f
            }
        };
        match field_offset(&format, field) {
            Some(found) if found == expected => {}
            found => {
                return Err(Error::TracepointLayout {
                    category: category.into(),
                    name: name.into(),
                    field: field.into(),
                    found: found.map_or("is missing".into(), |o| format!("is at offset {o}")),
                    expected,
                });
            }
        }
    }
    let exit_format = fs::read_to_string(tracefs.join("events/sched/sched_process_exit/format"))
        .unwrap_or_default();
    Ok(TracepointCheck {
        exit_has_group_dead: field_offset(&exit_format, "group_dead")
            == Some(tracer_common::tp::EXIT_GROUP_DEAD),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SWITCH: &str = "name: sched_switch
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:long prev_state;\toffset:32;\tsize:8;\tsigned:1;
";

    #[test]
    fn finds_field_offsets() {
        assert_eq!(field_offset(SWITCH, "prev_pid"), Some(24));
        assert_eq!(field_offset(SWITCH, "prev_comm"), Some(8));
        assert_eq!(field_offset(SWITCH, "prev_state"), Some(32));
        assert_eq!(field_offset(SWITCH, "next_pid"), None);
    }

    #[test]
    fn missing_tracefs_names_the_tracepoint() {
        let err = check_tracepoints(Path::new("/nonexistent-tracefs")).unwrap_err();
        assert!(err.to_string().contains("sched:sched_switch"), "{err}");
    }
}
