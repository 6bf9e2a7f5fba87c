//! CUDA driver API tracing of a real process that `dlopen`s a stand-in
//! `libcuda.so.1` (same symbols and signatures as the driver's), checked
//! against the workload's own log of every call it made, and opened in XProf.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    time::Duration,
};

use ebtrace_proto::tensorflow::profiler::{XPlane, XSpace};
use ebtrace_tests::{
    TempDir, await_line,
    cuda::{
        CodePatches, CudaWorkload, cxxfilt, driver_code_patches, uprobes_of_links,
        wait_until_restored,
    },
    fixture::SchedWorkload,
    loaded_bpf_program_names, record, require_root, serial, signal, spawn_record_with_env,
    xplane_files, xprof,
    xspace::{self, Event, Stat, count_named, gpu_event_count, line_events, plane, plane_stats},
};
use serde_json::Value;

const ITERS: u64 = 50;

/// One capture of the CUDA workload.
struct Traced {
    space: XSpace,
    file: PathBuf,
    /// The workload's report: tids, handles and every call it made.
    report: Value,
    stdout: String,
    stderr: String,
}

/// ebtrace's environment that makes it link the driver probes one
/// perf-event link per function, as on kernels without uprobe_multi.
const PERF_LINKS: &[(&str, &str)] = &[("EBTRACE_UPROBE_LINKS", "perf")];

/// Starts the workload, attaches ebtrace (with `env`), lets the workload
/// run its calls and waits for both to end (ebtrace stops when the
/// workload exits).
fn trace_workload(args: &[&str], env: &[(&str, &str)]) -> Traced {
    let workload = CudaWorkload::start(args);
    let logdir = TempDir::new("cuda");
    let pid = workload.pid.to_string();
    let ebtrace = await_line(
        spawn_record_with_env(&pid, "60s", &logdir, &[], env),
        "probes attached",
    );
    let report = workload.run(Duration::from_secs(60));
    let out = ebtrace.wait(Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ebtrace failed: {stderr}\n{stdout}");
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    // Keep the file past the TempDir for XProf.
    let file = std::env::temp_dir().join(format!(
        "ebtrace-cuda-{}-{}.xplane.pb",
        std::process::id(),
        workload_tag(args)
    ));
    std::fs::copy(&files[0], &file).expect("copy trace");
    Traced {
        space: xspace::load(&files[0]),
        file,
        report,
        stdout,
        stderr,
    }
}

fn workload_tag(args: &[&str]) -> String {
    args.join("").replace('-', "")
}

fn tid(report: &Value, thread: &str) -> u32 {
    report["tids"][thread].as_u64().expect("tid") as u32
}

fn handle(report: &Value, name: &str) -> String {
    report["handles"][name]
        .as_str()
        .expect("handle")
        .to_string()
}

/// The driver-call spans of a thread (sched events have other names).
fn cuda_spans(host: &XPlane, tid: u32) -> Vec<Event> {
    line_events(host, i64::from(tid))
        .into_iter()
        .filter(|e| e.name.starts_with("cu"))
        .collect()
}

fn str_stat<'a>(e: &'a Event, name: &str) -> Option<&'a str> {
    e.stats.get(name).map(Stat::as_str)
}

fn dims(v: &Value) -> String {
    let d: Vec<String> = v
        .as_array()
        .expect("dims")
        .iter()
        .map(|x| x.as_u64().expect("dim").to_string())
        .collect();
    d.join(",")
}

/// What a kernel should be called: demangled by c++filt, or unresolved
/// when it was looked up before the capture.
fn expected_kernel(report: &Value, mangled: &str) -> String {
    if mangled == "_Z11early_touchPf" {
        format!("<unresolved {}>", handle(report, "early"))
    } else {
        cxxfilt(mangled)
    }
}

/// Whether a traced call matches one logged call's function, result and
/// arguments.
fn matches(report: &Value, thread: &str, entry: &Value, e: &Event) -> bool {
    let args = &entry["args"];
    let result = entry["result"].as_i64().expect("result");
    if e.name != entry["function"].as_str().unwrap() {
        return false;
    }
    match e.stats.get("result_code") {
        Some(code) if code.as_i64() != result => return false,
        Some(_) => {}
        // Probed at its entry only: an instant, its result unknown (the
        // workload's calls of those functions succeed).
        None => {
            assert_eq!(
                str_stat(e, "result"),
                Some("not recorded (probed at entry only)"),
                "{e:?}"
            );
            assert_eq!(e.duration_ns, 0.0, "{e:?}");
            if result != 0 {
                return false;
            }
        }
    }
    if let Some(kernel) = args["kernel"].as_str() {
        let same = str_stat(e, "kernel") == Some(expected_kernel(report, kernel).as_str())
            && str_stat(e, "grid") == Some(dims(&args["grid"]).as_str())
            && str_stat(e, "block") == Some(dims(&args["block"]).as_str())
            && e.stats["shared_memory_bytes"].as_u64() == args["shared"].as_u64().unwrap();
        if !same {
            return false;
        }
    }
    if let Some(bytes) = args["bytes"].as_u64()
        && e.stats.get("bytes").map(Stat::as_u64) != Some(bytes)
    {
        return false;
    }
    if let Some(stream) = args["stream"].as_str()
        && result == 0
    {
        let shown = str_stat(e, "stream").unwrap_or_default();
        let ok = match stream {
            "legacy" => shown.starts_with("legacy default"),
            "per-thread" => {
                shown == format!("per-thread default stream of tid {}", tid(report, thread))
            }
            s => shown == handle(report, s),
        };
        if !ok {
            return false;
        }
    }
    true
}

/// Every call the workload logged is in the trace, on its thread, with its
/// arguments and result, and the trace has no other driver call.
fn check_calls(t: &Traced) {
    let host = plane(&t.space, "/host:CPU");
    xspace::assert_lines_nest(host);
    let calls = t.report["calls"].as_array().expect("calls");
    for thread in ["main", "launcher-0", "launcher-1"] {
        let spans = cuda_spans(host, tid(&t.report, thread));
        let mut expected: BTreeMap<&str, u64> = BTreeMap::new();
        for c in calls.iter().filter(|c| c["thread"] == thread) {
            *expected.entry(c["function"].as_str().unwrap()).or_default() +=
                c["count"].as_u64().unwrap();
        }
        let mut traced: BTreeMap<&str, u64> = BTreeMap::new();
        for s in &spans {
            *traced.entry(s.name.as_str()).or_default() += 1;
        }
        assert_eq!(traced, expected, "driver calls of {thread}");
        for c in calls.iter().filter(|c| c["thread"] == thread) {
            let found = spans
                .iter()
                .filter(|s| matches(&t.report, thread, c, s))
                .count() as u64;
            assert_eq!(found, c["count"].as_u64().unwrap(), "{thread}: {c}");
        }
    }
}

/// Event names per line of a GPU plane.
fn stream_lines(gpu: &XPlane) -> BTreeMap<i64, BTreeMap<String, u64>> {
    gpu.lines
        .iter()
        .map(|l| {
            let mut names = BTreeMap::new();
            for e in line_events(gpu, l.id) {
                *names.entry(e.name).or_default() += 1;
            }
            (l.id, names)
        })
        .collect()
}

fn counts(items: &[(&str, u64)]) -> BTreeMap<String, u64> {
    items.iter().map(|(n, c)| (n.to_string(), *c)).collect()
}

/// The work on each GPU's streams, and the correlation between each
/// submission and its host call.
fn check_devices(t: &Traced, early: bool) {
    let vec_add = cxxfilt("_Z6vecAddPKfS0_Pfi");
    let reduce = cxxfilt("_Z9reduceSumPKfPfj");
    let gpu0 = plane(&t.space, "/device:GPU:0");
    let gpu1 = plane(&t.space, "/device:GPU:1");
    assert_eq!((gpu0.id, gpu1.id), (0, 1));
    for gpu in [gpu0, gpu1] {
        xspace::assert_lines_nest(gpu);
        assert!(
            plane_stats(gpu)["ebtrace_timing"]
                .as_str()
                .starts_with("host-observed"),
        );
        for line in &gpu.lines {
            assert_eq!(line.name, format!("Stream #{}", line.id));
            assert!(line.display_name.contains("host-observed"), "{line:?}");
        }
    }
    let mut s0 = vec![
        ("MemcpyH2D", ITERS),
        (vec_add.as_str(), ITERS),
        ("MemcpyD2H", ITERS),
    ];
    let early_name = format!("<unresolved {}>", handle(&t.report, "early"));
    if early {
        s0.push((early_name.as_str(), 1));
    }
    let expected0 = BTreeMap::from([
        (0, counts(&[("Memset", 1), (vec_add.as_str(), 1)])),
        (1, counts(&s0)),
    ]);
    assert_eq!(stream_lines(gpu0), expected0);
    let display = |gpu: &XPlane, id: i64| {
        gpu.lines
            .iter()
            .find(|l| l.id == id)
            .unwrap()
            .display_name
            .clone()
    };
    assert!(display(gpu0, 1).contains(&handle(&t.report, "s0")));
    assert!(display(gpu0, 0).contains("legacy default stream"));
    let expected1 = BTreeMap::from([
        (0, counts(&[("MemcpyP2P", 1)])),
        (
            1,
            counts(&[
                ("Memset", ITERS),
                (reduce.as_str(), ITERS),
                ("StreamWaitEvent", 1),
                ("Graph launch", 1),
            ]),
        ),
        (2, counts(&[(reduce.as_str(), ITERS)])),
    ]);
    assert_eq!(stream_lines(gpu1), expected1);
    assert!(display(gpu1, 1).contains(&handle(&t.report, "s1")));
    assert!(display(gpu1, 2).contains(&format!(
        "per-thread default stream of tid {}",
        tid(&t.report, "launcher-1")
    )));

    // Each submission and its host call share a correlation id.
    let host = plane(&t.space, "/host:CPU");
    let mut submitted: HashMap<u64, Event> = HashMap::new();
    for thread in ["launcher-0", "launcher-1"] {
        for s in cuda_spans(host, tid(&t.report, thread)) {
            if let Some(id) = s.stats.get("correlation_id") {
                assert!(submitted.insert(id.as_u64(), s).is_none());
            }
        }
    }
    let mut device_events = 0;
    for gpu in [gpu0, gpu1] {
        for line in &gpu.lines {
            for e in line_events(gpu, line.id) {
                device_events += 1;
                let id = e.stats["correlation_id"].as_u64();
                let call = submitted
                    .get(&id)
                    .unwrap_or_else(|| panic!("no host call for {e:?}"));
                if let Some(kernel) = str_stat(call, "kernel") {
                    assert_eq!(kernel, e.name);
                }
                assert!(
                    e.start_ns >= call.start_ns - 1e-3 && e.end_ns() <= call.end_ns() + 1e-3,
                    "{e:?} outside {call:?}"
                );
            }
        }
    }
    assert_eq!(device_events, submitted.len());
}

fn check_clean(t: &Traced) {
    assert!(t.stdout.contains(" 0 dropped"), "{}", t.stdout);
    assert!(t.space.warnings.iter().all(|w| !w.contains("dropped")));
}

/// Each call that submits work carries the stack it was made from: the
/// driver's entry point, then the workload's function that called it.
/// Where the driver was loaded after the capture started (`loaded_later`)
/// and the workload exits within milliseconds, before ebtrace drains its
/// first records, no mapping of the driver was ever seen: its entry point
/// may stay a bare address.
fn check_launch_stacks(t: &Traced, loaded_later: bool) {
    let host = plane(&t.space, "/host:CPU");
    let submitting = |name: &str| {
        ["cuLaunch", "cuMemcpy", "cuMemset"]
            .iter()
            .any(|p| name.starts_with(p))
    };
    let calls = cuda_spans(host, tid(&t.report, "launcher-0"));
    let submissions: Vec<&Event> = calls.iter().filter(|e| submitting(&e.name)).collect();
    assert!(
        submissions.len() as u64 >= ITERS,
        "{} submissions",
        submissions.len()
    );
    for call in submissions {
        let stack = str_stat(call, "launch_stack")
            .unwrap_or_else(|| panic!("{} has no launch_stack: {:?}", call.name, call.stats));
        let named = stack.starts_with(&call.name);
        assert!(
            named || (loaded_later && stack.starts_with("0x")),
            "{}: {stack}",
            call.name
        );
        assert!(
            stack.lines().any(|l| l.starts_with("launcher0 ")),
            "{}: {stack}",
            call.name
        );
    }
    assert!(
        calls
            .iter()
            .filter(|e| !submitting(&e.name))
            .all(|e| !e.stats.contains_key("launch_stack"))
    );
}

#[test]
fn driver_calls_and_gpu_streams_match_the_workloads_log() {
    if !require_root("driver_calls_and_gpu_streams_match_the_workloads_log") {
        return;
    }
    let _serial = serial();
    let t = trace_workload(&["--early", "--iters", &ITERS.to_string()], &[]);
    assert!(
        t.stderr
            .lines()
            .any(|l| l.contains("cuda-lib/libcuda.so.1 (loaded)") && l.contains("probing")),
        "{}",
        t.stderr
    );
    check_clean(&t);
    check_calls(&t);
    check_devices(&t, true);

    check_launch_stacks(&t, false);

    // The failed launch reached no GPU.
    let host = plane(&t.space, "/host:CPU");
    let failed: Vec<Event> = cuda_spans(host, tid(&t.report, "launcher-0"))
        .into_iter()
        .filter(|e| e.stats.get("result_code").is_some_and(|c| c.as_i64() != 0))
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        str_stat(&failed[0], "result"),
        Some("CUDA_ERROR_INVALID_VALUE")
    );
    assert!(!failed[0].stats.contains_key("correlation_id"));

    // XProf shows the GPU planes with their streams, and the launch flows.
    if let Some(python) = xprof::python() {
        let view = xprof::trace_viewer_summary(&python, &t.file);
        let processes = view["processes"].as_object().expect("processes");
        let gpu_pid = processes
            .iter()
            .find(|(_, name)| name.as_str().unwrap_or_default().contains("/device:GPU:1"))
            .map(|(pid, _)| pid.clone())
            .unwrap_or_else(|| panic!("no GPU 1 process in {processes:?}"));
        // XProf numbers the rows itself; find the stream's by its name.
        let threads = view["threads"].as_object().expect("threads");
        let row = threads
            .iter()
            .find(|(k, v)| {
                k.starts_with(&format!("{gpu_pid}/"))
                    && v.as_str()
                        .unwrap_or_default()
                        .starts_with("Stream #2 (per-thread")
            })
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| panic!("no stream 2 row in {threads:?}"));
        let reduce = cxxfilt("_Z9reduceSumPKfPfj");
        assert_eq!(
            view["events"][format!("{row}/{reduce}")].as_u64(),
            Some(ITERS),
            "{view}"
        );
        // XProf drew one launch arrow per submission, host to device.
        let launches = &view["flows"]["gpu_launch"];
        let ids = |dir: &str| -> Vec<u64> {
            let mut v: Vec<u64> = launches[dir]
                .as_array()
                .unwrap_or_else(|| panic!("no gpu_launch flows in {}", view["flows"]))
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            v.sort_unstable();
            v
        };
        let submissions = gpu_event_count(&t.space);
        assert_eq!(ids("out").len(), submissions);
        assert_eq!(ids("out"), ids("in"));
    }
    let _ = std::fs::remove_file(&t.file);
}

#[test]
fn a_driver_loaded_after_attach_is_traced() {
    if !require_root("a_driver_loaded_after_attach_is_traced") {
        return;
    }
    let _serial = serial();
    // Both ways of linking the probes: one uprobe_multi link per program
    // (the default here) and one perf-event link per function and program.
    for (env, links) in [
        (&[][..], "uprobe_multi links"),
        (PERF_LINKS, "perf-event uprobe links"),
    ] {
        let t = trace_workload(&["--iters", &ITERS.to_string()], env);
        assert!(
            t.stderr.lines().any(|l| l.contains(
                "cuda-lib/libcuda.so.1 (not loaded yet, found via LD_LIBRARY_PATH: a later dlopen \
                 is covered), through "
            ) && l.contains(links)),
            "{}",
            t.stderr
        );
        check_clean(&t);
        check_calls(&t);
        check_devices(&t, false);
        // Taken by the program the entry programs tail-call, whichever
        // way they are linked.
        check_launch_stacks(&t, true);
        let _ = std::fs::remove_file(&t.file);
    }
}

/// How many functions the `probing N CUDA driver functions` line says are
/// probed, how many of them at their entry only, and the line.
fn functions_probed(stderr: &[String]) -> (u64, u64, &str) {
    let line = stderr
        .iter()
        .find(|l| l.contains("CUDA driver functions in"))
        .unwrap_or_else(|| panic!("no CUDA probe line: {stderr:?}"));
    let n = line
        .split("probing ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {line:?}"));
    let entry_only = match line.split_once(" of them at their entry only") {
        Some((before, _)) => before
            .rsplit('(')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no entry-only count in {line:?}")),
        None => 0,
    };
    (n, entry_only, line)
}

#[test]
fn a_target_killed_while_ebtrace_stops_leaves_no_probe_behind() {
    if !require_root("a_target_killed_while_ebtrace_stops_leaves_no_probe_behind") {
        return;
    }
    let _serial = serial();
    // The driver programs (the kernel keeps 15 characters of a name).
    let ours = || {
        loaded_bpf_program_names()
            .iter()
            .filter(|n| n.starts_with("cuda_"))
            .count()
    };
    let before = ours();
    // The window ends 1 s after the probes attached; the target dies as
    // ebtrace stops recording, writes the trace and releases ~2 x 40
    // uprobes, through each kind of link.
    for (env, after_window_ms) in [
        (&[][..], 0),
        (&[][..], 60),
        (PERF_LINKS, 0),
        (PERF_LINKS, 60),
    ] {
        let what = format!("{env:?}, killed {after_window_ms} ms after the window");
        let mut workload = CudaWorkload::start(&["--bench-seconds", "30"]);
        let pid = workload.pid;
        let logdir = TempDir::new("cuda-exit-stop");
        let ebtrace = await_line(
            spawn_record_with_env(
                &pid.to_string(),
                "1s",
                &logdir,
                &["--no-agent", "--no-device-activity"],
                env,
            ),
            "probes attached",
        );
        workload.go();
        std::thread::sleep(Duration::from_millis(1000 + after_window_ms));
        signal(pid, libc::SIGKILL);
        let out = ebtrace.wait(Duration::from_secs(60));
        assert!(out.status.success(), "{what}: {out:?}");
        let files = xplane_files(logdir.path());
        assert_eq!(files.len(), 1, "{what}: {files:?}");
        let space = xspace::load(&files[0]);
        let host = plane(&space, "/host:CPU");
        let launches = count_named(host, "cuLaunchKernel");
        assert!(launches > 100, "{what}: {launches} launches in the trace");
    }
    let released = std::time::Instant::now();
    while ours() > before {
        assert!(
            released.elapsed() < Duration::from_secs(20),
            "ebtrace's driver programs are still loaded 20 s after it exited"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_driver_probes_leave_the_target_when_ebtrace_ends_or_is_killed() {
    if !require_root("the_driver_probes_leave_the_target_when_ebtrace_ends_or_is_killed") {
        return;
    }
    let _serial = serial();
    // Loaded, and waiting: nothing else changes its code.
    let workload = CudaWorkload::start(&["--early", "--iters", "1"]);
    let pid = workload.pid;
    assert_eq!(driver_code_patches(pid), Default::default());
    for (env, killed) in [(&[][..], false), (&[][..], true), (PERF_LINKS, true)] {
        let what = format!(
            "{} links, ebtrace {}",
            if env.is_empty() {
                "uprobe_multi"
            } else {
                "perf-event"
            },
            if killed { "killed" } else { "exited" }
        );
        let logdir = TempDir::new("cuda-release");
        let duration = if killed { "120s" } else { "1s" };
        let ebtrace = await_line(
            spawn_record_with_env(
                &pid.to_string(),
                duration,
                &logdir,
                &["--no-agent", "--no-device-activity"],
                env,
            ),
            "CUDA driver functions in",
        );
        let (n, entry_only, line) = functions_probed(&ebtrace.lines);
        assert!(n > 30, "{line}");
        // cuCtxSetCurrent and cuStreamWaitEvent, of the stand-in's exports.
        assert_eq!(entry_only, 2, "{line}");
        let returning = n - entry_only;
        // What the kernel says ebtrace holds, then what ebtrace says.
        let links = uprobes_of_links(ebtrace.id());
        if env.is_empty() {
            assert_eq!(links.get("uprobe_multi"), Some(&n), "{what}: {links:?}");
            assert_eq!(
                links.get("uretprobe_multi"),
                Some(&returning),
                "{what}: {links:?}"
            );
            assert!(line.contains(" uprobe_multi links"), "{line}");
        } else {
            assert_eq!(links.get("perf uprobe"), Some(&n), "{what}: {links:?}");
            assert_eq!(
                links.get("perf uretprobe"),
                Some(&returning),
                "{what}: {links:?}"
            );
            assert!(
                line.contains(&format!(" {} perf-event uprobe links", n + returning)),
                "{line}"
            );
        }
        // One int3 per function, in this process's copy of the code.
        let patches = driver_code_patches(pid);
        assert_eq!(
            patches,
            CodePatches {
                differing: n as usize,
                int3: n as usize
            },
            "{what}: {line}"
        );
        if killed {
            let status = ebtrace.kill();
            assert_eq!(
                std::os::unix::process::ExitStatusExt::signal(&status),
                Some(libc::SIGKILL)
            );
        } else {
            let out = ebtrace.wait(Duration::from_secs(60));
            assert!(out.status.success(), "{what}: {out:?}");
        }
        wait_until_restored(pid, &what);
    }
}

/// Whether this machine has a real driver on the loader's default path.
fn system_has_libcuda() -> bool {
    std::process::Command::new("/sbin/ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1"))
}

/// A process that never loaded the driver (a CPU-only one) is not a
/// problem: one plain line says so, and the rest is traced.
#[test]
fn a_process_without_the_driver_gets_one_note_and_the_rest_is_traced() {
    if !require_root("a_process_without_the_driver_gets_one_note_and_the_rest_is_traced") {
        return;
    }
    if system_has_libcuda() {
        eprintln!("skipping: this machine has a libcuda.so.1 on the loader's path");
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let logdir = TempDir::new("nocuda");
    let pid = workload.pid.to_string();
    let out = record(&pid, "300ms", &logdir, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let mentions: Vec<&str> = stderr.lines().filter(|l| l.contains("libcuda")).collect();
    assert_eq!(mentions.len(), 1, "{stderr}");
    assert!(
        mentions[0].starts_with(&format!(
            "ebtrace: pid {pid} (sched_workload): no libcuda.so.1 "
        )),
        "{}",
        mentions[0]
    );
    assert!(!stderr.contains("warning:"), "{stderr}");
    let files = xplane_files(logdir.path());
    let space = xspace::load(&files[0]);
    let host = plane(&space, "/host:CPU");
    let burner = workload.tid("cpu-burner");
    assert!(
        line_events(host, i64::from(burner))
            .iter()
            .any(|e| e.name == "Running")
    );
    assert!(
        !space
            .planes
            .iter()
            .any(|p| p.name.starts_with("/device:GPU"))
    );
}
