//! The CPython interpreters under pyenv (the machine image's 3.10 to
//! 3.13, and 3.14 that `cargo xtask setup` adds) and py-spy, the
//! independent reader of Python stacks the tests compare ebtrace with. A
//! missing interpreter fails the test that needs it, with what to
//! install: the Python stacks are checked on every version.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use crate::{
    TempDir, record, workspace_root, xplane_files,
    xspace::{self, Event, line_events, plane},
};

/// The CPython minor versions ebtrace reads, each checked by the tests.
pub const MINORS: [u8; 5] = [10, 11, 12, 13, 14];

/// Where pyenv keeps its interpreters: `pyenv root`, else `$PYENV_ROOT`,
/// else `~/.pyenv`.
pub fn pyenv_root() -> PathBuf {
    let from_pyenv = Command::new("pyenv")
        .arg("root")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    from_pyenv
        .or_else(|| std::env::var_os("PYENV_ROOT").map(PathBuf::from))
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".pyenv")
        })
}

/// CPython 3.`minor` under pyenv (its newest patch release), if there.
pub fn installed_cpython(minor: u8) -> Option<PathBuf> {
    let versions = pyenv_root().join("versions");
    let prefix = format!("3.{minor}.");
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(&versions)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let patch = name.to_str()?.strip_prefix(&prefix)?.parse().ok()?;
            Some((patch, e.path()))
        })
        .collect();
    found.sort();
    let (_, dir) = found.pop()?;
    Some(dir.join(format!("bin/python3.{minor}"))).filter(|p| p.exists())
}

/// CPython 3.`minor` under pyenv; panics, saying what to install, if it
/// is not there.
pub fn cpython(minor: u8) -> PathBuf {
    installed_cpython(minor).unwrap_or_else(|| {
        panic!(
            "CPython 3.{minor} not found under {}: the Python stack tests run on every \
             version ebtrace reads; `cargo xtask setup` installs 3.14, pyenv the others \
             (`pyenv install 3.{minor}`)",
            pyenv_root().join("versions").display()
        )
    })
}

/// py-spy, installed into the venv by `cargo xtask setup`.
pub fn py_spy() -> PathBuf {
    let path = workspace_root().join(".venv/bin/py-spy");
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask setup`",
        path.display()
    );
    path
}

/// A Python fixture of `tests/fixtures/python`.
pub fn python_fixture(script: &str) -> PathBuf {
    workspace_root().join("tests/fixtures/python").join(script)
}

/// One Python frame as a stack's text shows it: `function file:line`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyFrame {
    pub function: String,
    pub file: String,
    pub line: u32,
}

/// Whether a line of a stack's text is a Python frame (`function
/// file.py:line`) rather than a native one.
pub fn is_python_line(line: &str) -> bool {
    line.contains(".py:")
}

/// The Python frames of a stack's text (one frame a line, innermost
/// first), in order.
pub fn python_frames(stack: &str) -> Vec<PyFrame> {
    stack
        .lines()
        .filter_map(|l| {
            let (function, place) = l.rsplit_once(' ')?;
            let (file, line) = place.rsplit_once(':')?;
            let line = line.parse().ok()?;
            file.ends_with(".py").then(|| PyFrame {
                function: function.to_string(),
                file: file.to_string(),
                line,
            })
        })
        .collect()
}

/// The lines of each `def` of a script: from the `def` line to the line
/// before the next top-level statement.
pub fn function_lines(script: &Path) -> Vec<(String, std::ops::RangeInclusive<u32>)> {
    let text = std::fs::read_to_string(script).expect("read the script");
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.trim_start().strip_prefix("def ") else {
            continue;
        };
        let indent = l.len() - l.trim_start().len();
        let name = rest.split('(').next().unwrap_or_default().to_string();
        let end = lines[i + 1..]
            .iter()
            .position(|n| !n.trim().is_empty() && n.len() - n.trim_start().len() <= indent)
            .map_or(lines.len(), |p| i + 1 + p);
        out.push((name, (i as u32 + 1)..=(end as u32)));
    }
    out
}

/// Runs ebtrace on `pid` for `duration` with `args`; its JSON summary.
pub fn record_json(pid: u32, duration: &str, logdir: &TempDir, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = record(&pid.to_string(), duration, logdir, &all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"))
}

/// The events of thread `tid` in the trace of `logdir` that carry `stat`
/// (a sample's stack, an off-CPU stack).
pub fn sampled_events(logdir: &TempDir, tid: u32, stat: &str) -> Vec<Event> {
    let space = xspace::load(&xplane_files(logdir.path())[0]);
    let host = plane(&space, "/host:CPU");
    line_events(host, i64::from(tid))
        .into_iter()
        .filter(|e| e.stats.contains_key(stat))
        .collect()
}
