//! `--perfetto`: the Perfetto trace written beside the XSpace, read back
//! with Perfetto's own schema and checked against the XSpace of the same
//! capture.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::Duration,
};

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    fixture::{Hotspot, SchedWorkload},
    perfetto, record, require_root, run_ebtrace, serial, spawn_attached,
    traceme::{Toolchain, TraceMeWorkload},
    workspace_root, xplane_files,
    xspace::{self, gpu_planes, line_events, plane},
};
use serde_json::Value;

/// Names the scheduler part of the XSpace uses on thread lines.
const SCHED_EVENTS: [&str; 8] = [
    "Running",
    "Runnable",
    "Blocked",
    "Unknown",
    "Wakeup",
    "Thread created",
    "Process forked",
    "Thread exit",
];

const BOOTTIME: &str = "6";
const MONOTONIC: &str = "3";
const REALTIME: &str = "1";

/// Records `pid` with `--perfetto`; returns the XSpace and the Perfetto file.
fn capture(pid: u32, duration: &str, dir: &TempDir) -> (XSpace, PathBuf) {
    capture_with(pid, duration, dir, &[])
}

/// [`capture`] with more of ebtrace's flags.
fn capture_with(pid: u32, duration: &str, dir: &TempDir, extra: &[&str]) -> (XSpace, PathBuf) {
    let args = [&["--perfetto"], extra].concat();
    let out = record(&pid.to_string(), duration, dir, &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ebtrace failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = xplane_files(dir.path());
    assert_eq!(files.len(), 1, "expected one trace, found {files:?}");
    let pb = files[0].with_file_name("perfetto_trace.pb");
    assert!(pb.exists(), "no {} beside the XSpace", pb.display());
    assert!(
        stdout.contains(&pb.display().to_string()),
        "the Perfetto file is not named in {stdout}"
    );
    (xspace::load(&files[0]), pb)
}

fn count(summary: &Value, key: &str, tid: u32) -> u64 {
    summary[key][tid.to_string()].as_u64().unwrap_or(0)
}

#[test]
fn scheduling_threads_and_clocks_match_the_xspace() {
    if !require_root("scheduling_threads_and_clocks_match_the_xspace") {
        return;
    }
    let Some(python) = perfetto::python() else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    std::thread::sleep(Duration::from_millis(200));
    let dir = TempDir::new("perfetto-sched");
    let (space, pb) = capture(workload.pid, "1s", &dir);
    let threads = workload.threads.clone();
    workload.stop();
    let summary = perfetto::summarize(&python, &pb);

    let host = plane(&space, "/host:CPU");
    for name in ["cpu-burner", "sleeper-10ms", "ping", "pong"] {
        let tid = threads[name];
        let thread = &summary["threads"][tid.to_string()];
        assert_eq!(thread["name"], name, "{summary}");
        assert_eq!(thread["pid"], workload_pid(&threads, &summary, tid));
        // Each time the XSpace shows the thread running, Perfetto has it
        // switched in.
        let runs = line_events(host, tid.into())
            .iter()
            .filter(|e| e.name == "Running")
            .count() as u64;
        assert!(runs > 0, "{name} never ran");
        assert_eq!(count(&summary, "switch_in", tid), runs, "{name}");
        let woken = line_events(host, tid.into())
            .iter()
            .filter(|e| e.name == "Runnable" && e.stats.contains_key("waker_tid"))
            .count() as u64;
        assert_eq!(count(&summary, "wakings", tid), woken, "{name}");
    }
    assert!(count(&summary, "wakings", threads["ping"]) > 0);
    assert_eq!(summary["unbalanced"], 0);

    // The clock snapshot ties boot time to the wall clock at the start of
    // the capture window the XSpace states.
    let clocks = &summary["clocks"];
    for id in [BOOTTIME, MONOTONIC, REALTIME] {
        assert!(clocks[id].is_u64(), "clock {id} missing: {clocks}");
    }
    let (start, _) = xspace::profile_window(&space);
    let realtime = clocks[REALTIME].as_u64().unwrap();
    assert!(
        realtime.abs_diff(start) < 1_000_000,
        "snapshot realtime {realtime}, XSpace start {start}"
    );
    assert!(clocks[BOOTTIME].as_u64() >= clocks[MONOTONIC].as_u64());
}

/// The pid the summary's process descriptors give the thread's process.
fn workload_pid(
    threads: &std::collections::BTreeMap<String, u32>,
    summary: &Value,
    tid: u32,
) -> Value {
    let pid = summary["threads"][tid.to_string()]["pid"].clone();
    assert!(
        summary["processes"][pid.to_string()].is_string(),
        "no process descriptor for {pid} ({threads:?})"
    );
    pid
}

#[test]
fn traceme_spans_keep_their_names() {
    if !require_root("traceme_spans_keep_their_names") {
        return;
    }
    let Some(python) = perfetto::python() else {
        return;
    };
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    std::thread::sleep(Duration::from_millis(100));
    let dir = TempDir::new("perfetto-traceme");
    let (space, pb) = capture(workload.pid, "1s", &dir);
    let tids: Vec<u32> = workload.threads.values().copied().collect();
    workload.stop();
    let summary = perfetto::summarize(&python, &pb);

    let host = plane(&space, "/host:CPU");
    let mut total = 0;
    for tid in tids {
        if !host.lines.iter().any(|l| l.id == i64::from(tid)) {
            continue;
        }
        let mut want: HashMap<String, u64> = HashMap::new();
        for e in line_events(host, tid.into()) {
            if !SCHED_EVENTS.contains(&e.name.as_str()) {
                *want.entry(e.name).or_default() += 1;
            }
        }
        let got: HashMap<String, u64> =
            serde_json::from_value(summary["spans"][tid.to_string()].clone()).unwrap_or_default();
        assert_eq!(got, want, "TraceMe spans of thread {tid}");
        total += want.values().sum::<u64>();
    }
    assert!(total > 0, "the fixture recorded no TraceMe spans");
    assert_eq!(summary["unbalanced"], 0);
}

#[test]
fn converting_a_jaxlib_xspace_keeps_its_threads_and_events() {
    let Some(python) = perfetto::python() else {
        return;
    };
    let input = workspace_root().join("tests/fixtures/real/jax_cpu_matmul.xplane.pb");
    let dir = TempDir::new("perfetto-convert");
    let output = dir.path().join("out.pb");
    let out = run_ebtrace(&[
        "convert",
        input.to_str().unwrap(),
        "--to",
        "perfetto",
        "-o",
        output.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "convert failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = perfetto::summarize(&python, &output);

    let space = xspace::load(&input);
    let mut want: HashMap<String, u64> = HashMap::new();
    for plane in &space.planes {
        for line in &plane.lines {
            let name = if line.display_name.is_empty() {
                &line.name
            } else {
                &line.display_name
            };
            *want.entry(format!("{}/{name}", plane.name)).or_default() += line.events.len() as u64;
        }
    }
    want.retain(|_, n| *n > 0);
    assert!(want.keys().any(|k| k.starts_with("/host:CPU/")), "{want:?}");
    let got: HashMap<String, u64> = serde_json::from_value(summary["named"].clone()).unwrap();
    assert_eq!(got, want);
    assert_eq!(summary["unbalanced"], 0);
}

#[test]
fn gpu_stream_work_is_linked_to_its_launches() {
    if !require_root("gpu_stream_work_is_linked_to_its_launches") {
        return;
    }
    let Some(python) = perfetto::python() else {
        return;
    };
    let _serial = serial();
    let workload = CudaWorkload::start(&[]);
    let dir = TempDir::new("perfetto-cuda");
    let ebtrace = spawn_attached(&workload.pid.to_string(), "60s", &dir, &["--perfetto"]);
    workload.run(Duration::from_secs(60));
    let out = ebtrace.wait(Duration::from_secs(180));
    let seen = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ebtrace failed: {seen}");
    let files = xplane_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let space = xspace::load(&files[0]);
    let summary = perfetto::summarize(&python, &files[0].with_file_name("perfetto_trace.pb"));

    // Every kernel or copy the XSpace shows on a GPU ends a flow that
    // starts on a driver call.
    let mut device_work = 0u64;
    let mut device_events = 0u64;
    for p in gpu_planes(&space) {
        for line in &p.lines {
            for e in line_events(p, line.id) {
                device_events += 1;
                device_work += u64::from(e.stats.contains_key("correlation_id"));
            }
        }
    }
    assert!(device_work > 0, "the workload submitted no GPU work");
    // (flow id, track) pairs.
    let flows = |key: &str| -> Vec<(u64, String)> {
        summary[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f[0].as_u64().unwrap(), f[1].as_str().unwrap().to_string()))
            .collect()
    };
    let (from, into) = (flows("flow_out"), flows("flow_in"));
    assert_eq!(into.len() as u64, device_work);
    assert!(
        into.iter().all(
            |(_, track)| track.starts_with("GPU 0/Stream") || track.starts_with("GPU 1/Stream")
        ),
        "{into:?}"
    );
    assert!(
        from.iter().all(|(_, track)| track.starts_with("tid:")),
        "{from:?}"
    );
    let launches: HashSet<u64> = from.into_iter().map(|(id, _)| id).collect();
    assert!(
        into.iter().all(|(id, _)| launches.contains(id)),
        "{summary}"
    );
    let on_streams: u64 = summary["named"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("GPU "))
        .map(|(_, n)| n.as_u64().unwrap())
        .sum();
    assert_eq!(on_streams, device_events);
}

/// Each thread has a `PerfSample` for each sample instant the XSpace lays
/// on its line, in the same order, whose callstack read from its root is
/// the instant's stack text read from its last line; kernel frames lie in
/// the kernel's mapping.
#[test]
fn cpu_samples_carry_the_xspace_stacks_as_callstacks() {
    if !require_root("cpu_samples_carry_the_xspace_stacks_as_callstacks") {
        return;
    }
    let Some(python) = perfetto::python() else {
        return;
    };
    let _serial = serial();
    let fixture = Hotspot::start();
    let dir = TempDir::new("perfetto-samples");
    let (space, pb) = capture_with(fixture.pid, "2s", &dir, &["--sample-hz", "99"]);
    let (hot_tid, reader_tid) = (fixture.hot_tid, fixture.reader_tid);
    drop(fixture);
    let summary = perfetto::summarize(&python, &pb);
    assert_eq!(summary["interning_errors"], serde_json::json!([]));
    let sequences = summary["perf_sequences"].as_array().unwrap();
    assert_eq!(sequences.len(), 1, "{sequences:?}");
    assert!(
        !summary["track_event_sequences"]
            .as_array()
            .unwrap()
            .contains(&sequences[0])
    );

    let host = plane(&space, "/host:CPU");
    let mut leaves: HashMap<u32, Vec<String>> = HashMap::new();
    let mut total = 0;
    for line in &host.lines {
        let mut want: Vec<(f64, Vec<(String, String)>)> = line_events(host, line.id)
            .into_iter()
            .filter(|e| e.duration_ns == 0.0)
            .filter_map(|e| {
                let text = e.stats.get("cpu_sample_stack")?.as_str();
                let frames = text
                    .lines()
                    .rev()
                    .map(|l| {
                        let kernel = l.trim_end_matches(" (inlined)").ends_with(" [k]");
                        let mapping = if kernel { "[kernel]" } else { "[user]" };
                        (l.to_string(), mapping.to_string())
                    })
                    .collect();
                Some((e.start_ns, frames))
            })
            .collect();
        want.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut got: Vec<(u64, Vec<(String, String)>)> =
            serde_json::from_value(summary["perf_samples"][line.id.to_string()].clone())
                .unwrap_or_default();
        got.sort_by_key(|g| g.0);
        assert_eq!(got.len(), want.len(), "samples of thread {}", line.id);
        for (i, ((_, got), (_, want))) in got.iter().zip(&want).enumerate() {
            assert_eq!(got, want, "sample {i} of thread {}", line.id);
        }
        let tid = line.id as u32;
        leaves.insert(
            tid,
            got.into_iter()
                .filter_map(|(_, frames)| frames.last().map(|f| f.0.clone()))
                .collect(),
        );
        total += want.len();
    }
    let perf_threads = summary["perf_samples"].as_object().unwrap().len();
    assert_eq!(
        perf_threads,
        leaves.values().filter(|l| !l.is_empty()).count()
    );
    assert!(total > 0, "no samples");

    // The hot thread's samples end in the hot function (or the one
    // inlined into it); the reader's show the kernel.
    let hot = &leaves[&hot_tid];
    let in_hot = hot
        .iter()
        .filter(|l| l.starts_with("ebtrace_hot_spin") || l.starts_with("mix_step"))
        .count();
    assert!(hot.len() >= 50, "{} samples of the hot thread", hot.len());
    assert!(10 * in_hot >= 9 * hot.len(), "{hot:?}");
    assert!(
        leaves[&reader_tid].iter().any(|l| l.ends_with(" [k]")),
        "{:?}",
        leaves[&reader_tid]
    );
}
