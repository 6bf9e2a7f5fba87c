//! The PJRT fixtures: a stand-in PJRT plugin with a profiler extension and
//! a "TPU 0" (`tests/fixtures/pjrt_plugin_standin.c`), and a workload that
//! loads it as jax loads a plugin and runs steps of ops on it
//! (`tests/fixtures/pjrt_workload.c`).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use crate::{gated::Gated, workspace_root};

fn newer(src: &Path, out: &Path) -> bool {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    match (mtime(src), mtime(out)) {
        (Some(s), Some(o)) => s > o,
        _ => true,
    }
}

/// Runs `cc args -o out src`, writing `out` atomically (tests build
/// concurrently).
fn cc(args: &[&str], src: &Path, out: &Path, libs: &[&str]) {
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    let status = Command::new("cc")
        .args(args)
        .arg("-o")
        .arg(&tmp)
        .arg(src)
        .args(libs)
        .status()
        .expect("run cc (install gcc)");
    assert!(status.success(), "compiling {} failed", src.display());
    std::fs::rename(&tmp, out).expect("rename fixture");
}

/// Builds the stand-in plugin into `target/fixtures/pjrt/pjrt_plugin_standin.so`
/// and the workload into `target/fixtures/pjrt_workload`; returns both.
pub fn build() -> (PathBuf, PathBuf) {
    let root = workspace_root();
    let fixtures = root.join("tests/fixtures");
    let dir = root.join("target/fixtures/pjrt");
    std::fs::create_dir_all(&dir).expect("create target/fixtures/pjrt");
    let plugin = dir.join("pjrt_plugin_standin.so");
    let plugin_src = fixtures.join("pjrt_plugin_standin.c");
    if newer(&plugin_src, &plugin) {
        cc(
            &[
                "-O2",
                "-g",
                "-Wall",
                "-fPIC",
                "-shared",
                "-fvisibility=hidden",
            ],
            &plugin_src,
            &plugin,
            &["-pthread"],
        );
    }
    let workload = root.join("target/fixtures/pjrt_workload");
    let workload_src = fixtures.join("pjrt_workload.c");
    if newer(&workload_src, &workload) {
        cc(
            &["-O2", "-g", "-Wall", "-pthread"],
            &workload_src,
            &workload,
            &["-ldl"],
        );
    }
    (plugin, workload)
}

/// A running `pjrt_workload`, waiting for its start signal; killed when
/// dropped.
pub struct PjrtWorkload {
    process: Gated,
    pub pid: u32,
    /// The stand-in plugin it loaded.
    pub plugin: PathBuf,
}

impl PjrtWorkload {
    /// Starts the workload on the stand-in plugin with `args` and `env`
    /// (e.g. `STANDIN_PJRT_LOG`), and waits for its pid line.
    pub fn start(args: &[&str], env: &[(&str, &Path)]) -> Self {
        let (plugin, bin) = build();
        let mut cmd = Command::new(bin);
        cmd.arg(&plugin)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v.as_os_str())));
        let process = Gated::start(cmd, "pjrt_workload");
        let pid = process.pid;
        PjrtWorkload {
            process,
            pid,
            plugin,
        }
    }

    /// Lets it run steps.
    pub fn go(&mut self) {
        self.process.go();
    }

    /// Tells it to stop (end of stdin), waits for it and returns its report.
    pub fn stop(mut self, deadline: Duration) -> serde_json::Value {
        self.process.close_stdin();
        self.process.report(deadline)
    }
}

/// One event the stand-in logged (`STANDIN_PJRT_LOG`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedEvent {
    /// `"op"` (line "XLA Ops") or `"step"` (line "Steps").
    pub kind: String,
    pub name: String,
    /// CLOCK_REALTIME ns.
    pub start_ns: i64,
    pub end_ns: i64,
}

/// The stand-in's log: its profiler calls (JSON objects with `"call"`)
/// and the events it recorded.
pub fn read_log(path: &Path) -> (Vec<serde_json::Value>, Vec<LoggedEvent>) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut calls = Vec::new();
    let mut events = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("bad log line {line:?}: {e}"));
        if v.get("call").is_some() {
            calls.push(v);
        } else {
            events.push(LoggedEvent {
                kind: v["event"].as_str().expect("event").to_string(),
                name: v["name"].as_str().expect("name").to_string(),
                start_ns: v["start_ns"].as_i64().expect("start_ns"),
                end_ns: v["end_ns"].as_i64().expect("end_ns"),
            });
        }
    }
    (calls, events)
}

/// The events of a `/device:TPU:0` plane as the stand-in logs them
/// (`"op"` from line "XLA Ops", `"step"` from "Steps"), in line order.
pub fn tpu_events(space: &ebtrace_proto::tensorflow::profiler::XSpace) -> Vec<LoggedEvent> {
    use ebtrace_proto::tensorflow::profiler::x_event::Data;
    let Some(plane) = space.planes.iter().find(|p| p.name == "/device:TPU:0") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in &plane.lines {
        let kind = match line.name.as_str() {
            "XLA Ops" => "op",
            "Steps" => "step",
            other => panic!("unexpected line {other:?}"),
        };
        for e in &line.events {
            let Some(Data::OffsetPs(offset)) = e.data else {
                panic!("event without offset_ps on {}", line.name);
            };
            let start_ns = line.timestamp_ns + offset / 1000;
            out.push(LoggedEvent {
                kind: kind.to_string(),
                name: plane.event_metadata[&e.metadata_id].name.clone(),
                start_ns,
                end_ns: start_ns + e.duration_ps / 1000,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ebtrace_proto::tensorflow::profiler::XSpace;
    use prost::Message as _;

    /// The stand-in's XSpace, collected by the workload's own profiler,
    /// decodes with the repository's types and holds exactly the events
    /// its log recorded.
    #[test]
    fn standin_xspace_matches_its_log() {
        let dir = crate::TempDir::new("pjrt-standin");
        let log = dir.path().join("standin.log");
        let xspace = dir.path().join("own.xplane.pb");
        let mut w = PjrtWorkload::start(
            &[
                "--own-profiler",
                "--own-xspace",
                xspace.to_str().expect("UTF-8"),
            ],
            &[("STANDIN_PJRT_LOG", &log)],
        );
        w.go();
        let start = std::time::Instant::now();
        while read_log(&log).1.len() < 20 {
            assert!(start.elapsed() < Duration::from_secs(30), "no steps ran");
            std::thread::sleep(Duration::from_millis(10));
        }
        let report = w.stop(Duration::from_secs(30));
        let (calls, logged) = read_log(&log);
        let space = XSpace::decode(std::fs::read(&xspace).expect("own XSpace").as_slice())
            .expect("the stand-in's XSpace decodes");
        assert_eq!(space.planes.len(), 1);
        assert_eq!(space.planes[0].name, "/device:TPU:0");
        assert_eq!(space.planes[0].id, 0);

        let mut from_xspace = tpu_events(&space);
        let mut from_log = logged.clone();
        from_xspace.sort_by_key(|e| (e.kind.clone(), e.start_ns));
        from_log.sort_by_key(|e| (e.kind.clone(), e.start_ns));
        assert_eq!(from_xspace, from_log);

        let count = |kind: &str| logged.iter().filter(|e| e.kind == kind).count() as u64;
        assert_eq!(count("op"), report["ops"].as_u64().expect("ops"));
        assert_eq!(count("step"), report["steps"].as_u64().expect("steps"));
        let (t0, t1) = (
            report["start_ns"].as_i64().expect("start_ns"),
            report["end_ns"].as_i64().expect("end_ns"),
        );
        assert!(
            logged
                .iter()
                .all(|e| t0 <= e.start_ns && e.start_ns <= e.end_ns && e.end_ns <= t1)
        );
        assert_eq!(calls[0]["call"], "create");
        assert_eq!(calls[0]["device_tracer_level"], 1);
    }
}
