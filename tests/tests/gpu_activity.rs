//! What the GPU ran, recorded through ebtrace's agent and CUPTI, in a CUDA
//! process ebtrace attaches to mid-run: the stand-in driver simulates a
//! GPU and the stand-in `libcupti.so.12` writes records in the real
//! layouts. Checked against the stand-in CUPTI's own log of every record
//! it produced (`STANDIN_CUPTI_LOG`).

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    time::Duration,
};

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{
    TempDir, agent_threads,
    cuda::{CudaWorkload, cxxfilt},
    record, require_root, serial, signal, spawn_attached, spawn_record, wait_for_agent_threads,
    wait_for_ebtrace_exits, xplane_files,
    xspace::{
        self, Event, Stat, gpu_event_count, gpu_planes, line_events, plane, plane_stats,
        profile_window,
    },
};
use serde_json::Value;

/// A workload that keeps launching for longer than any capture here.
const LONG_RUN: &[&str] = &["--iters", "100000000"];

/// The workload with `args` after [`LONG_RUN`] and `env`, launching for
/// 300 ms already (its kernels looked up before any capture).
fn launching(args: &[&str], env: &[(&str, &str)]) -> CudaWorkload {
    let mut all = LONG_RUN.to_vec();
    all.extend_from_slice(args);
    let mut workload = CudaWorkload::start_with_cupti(&all, env);
    workload.go();
    std::thread::sleep(Duration::from_millis(300));
    workload
}

/// One record the stand-in CUPTI produced.
struct Logged {
    kind: u64,
    correlation: u64,
    start: i64,
    end: i64,
    recorded: bool,
}

fn read_log(path: &Path) -> Vec<Logged> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| Logged {
            kind: v["kind"].as_u64().unwrap(),
            correlation: v["correlationId"].as_u64().unwrap(),
            start: v["start"].as_i64().unwrap(),
            end: v["end"].as_i64().unwrap(),
            recorded: v["recorded"].as_bool().unwrap(),
        })
        .collect()
}

/// The kernel events of every GPU plane, with their CUPTI correlation id.
fn kernels(space: &XSpace) -> Vec<(u64, Event)> {
    let mut out = Vec::new();
    for p in gpu_planes(space) {
        for line in &p.lines {
            for e in line_events(p, line.id) {
                if e.stats.contains_key("kernel_details") {
                    let id = e.stats["cupti_correlation_id"].as_u64();
                    out.push((id, e));
                }
            }
        }
    }
    out
}

/// The host plane's driver call spans by correlation id.
fn launches(space: &XSpace) -> HashMap<u64, Event> {
    let host = plane(space, "/host:CPU");
    host.lines
        .iter()
        .flat_map(|l| line_events(host, l.id))
        .filter(|e| e.name.starts_with("cuLaunch"))
        .filter_map(|e| {
            let id = e.stats.get("correlation_id").map(Stat::as_u64)?;
            Some((id, e))
        })
        .collect()
}

/// Records a running workload for `duration`; its stderr and trace.
fn capture(pid: u32, duration: &str, extra: &[&str]) -> (String, XSpace) {
    let logdir = TempDir::new("gpu-activity");
    let out = record(&pid.to_string(), duration, &logdir, extra);
    let stderr =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ebtrace failed:\n{stderr}");
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{stderr}");
    (stderr, xspace::load(&files[0]))
}

#[test]
fn every_kernel_cupti_recorded_is_on_its_gpu_joined_to_its_launch() {
    if !require_root("every_kernel_cupti_recorded_is_on_its_gpu_joined_to_its_launch") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("cupti-log");
    let log = dir.path().join("cupti.log");
    // A driver call ends as each capture stops: its record, written after
    // the window, is not counted as dropped from it.
    let workload = launching(
        &[],
        &[
            ("STANDIN_CUPTI_LOG", log.to_str().unwrap()),
            ("STANDIN_CUPTI_CALL_ENDS_AT_UNSUBSCRIBE", "1"),
        ],
    );
    let (stderr, space) = capture(workload.pid, "700ms", &[]);
    assert!(
        stderr.contains(
            "device activity: CUPTI 12.8 activity: kernels, copies, memsets, driver calls"
        ),
        "{stderr}"
    );
    assert_eq!(
        agent_threads(workload.pid),
        0,
        "the agent's thread outlived ebtrace"
    );

    let (start_wall, stop_wall) = profile_window(&space);
    let (start_wall, stop_wall) = (start_wall as i64, stop_wall as i64);
    let logged: HashMap<u64, Logged> = read_log(&log)
        .into_iter()
        .filter(|l| l.kind == 10 && l.recorded)
        .map(|l| (l.correlation, l))
        .collect();
    let traced = kernels(&space);
    let launches = launches(&space);
    assert!(
        traced.len() > 100,
        "too few kernels to judge: {}",
        traced.len()
    );

    // Every kernel in the trace is one CUPTI recorded, timed as the device
    // ran it (the GPU clock here is CLOCK_REALTIME), after its launch began.
    let mut joined = 0;
    for (id, e) in &traced {
        let l = &logged[id];
        let start = start_wall + e.start_ns as i64;
        assert!(
            (start - l.start).abs() < 50_000,
            "{} starts {start}, CUPTI says {}",
            e.name,
            l.start
        );
        if start > start_wall + 1000 && e.end_ns() < (stop_wall - start_wall) as f64 - 1000.0 {
            assert!(
                (e.duration_ns - (l.end - l.start) as f64).abs() <= 1.0,
                "{}: {} ns, CUPTI says {}",
                e.name,
                e.duration_ns,
                l.end - l.start
            );
        }
        let link = e.stats.get("correlation_id").map(Stat::as_u64);
        if let Some(launch) = link.and_then(|link| launches.get(&link)) {
            joined += 1;
            assert!(
                launch.start_ns <= e.start_ns,
                "{} ran {} ns before its launch {:?}",
                e.name,
                launch.start_ns - e.start_ns,
                launch.stats.get("kernel").map(Stat::as_str)
            );
            // Looked up before ebtrace attached, named from CUPTI's record.
            let named = launch.stats["kernel"].as_str();
            assert!(!named.starts_with("<unresolved"), "{named}");
            assert_eq!(named, e.name);
        }
    }
    // Launches inside the window are all joined (only the edges may miss).
    assert!(
        joined + 4 >= traced.len(),
        "{joined} of {} kernels joined",
        traced.len()
    );

    // Every kernel CUPTI recorded well inside the window is in the trace.
    let inside = logged
        .values()
        .filter(|l| l.start > start_wall + 50_000 && l.end < stop_wall - 50_000)
        .count();
    let traced_ids: HashSet<u64> = traced.iter().map(|(id, _)| *id).collect();
    let missing = logged
        .values()
        .filter(|l| l.start > start_wall + 50_000 && l.end < stop_wall - 50_000)
        .filter(|l| !traced_ids.contains(&l.correlation))
        .count();
    assert!(inside > 100, "{inside}");
    assert_eq!(missing, 0, "{missing} of {inside} kernels missing");

    // The GPU planes say their times are the device's.
    for p in gpu_planes(&space) {
        let timing = plane_stats(p)["ebtrace_timing"].as_str().to_string();
        assert!(timing.starts_with("device:"), "{}: {timing}", p.name);
        for line in &p.lines {
            assert!(!line.display_name.contains("host-observed"), "{line:?}");
        }
    }
    assert!(
        stderr.contains("(timed by the GPU, from CUPTI)"),
        "{stderr}"
    );
    assert!(!stderr.contains("host-observed"), "{stderr}");

    // Names as c++filt demangles them.
    let vec_add = cxxfilt("_Z6vecAddPKfS0_Pfi");
    assert!(
        traced.iter().any(|(_, e)| e.name == vec_add),
        "no {vec_add}"
    );

    // CUPTI was left as found: a second capture subscribes again. Its
    // --json summary counts what its trace holds.
    wait_for_ebtrace_exits();
    let (again, space) = capture(workload.pid, "300ms", &["--json"]);
    assert!(again.contains("device activity: CUPTI 12.8"), "{again}");
    let json: Value = again
        .lines()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary in {again}"));
    let gpu_events = gpu_event_count(&space);
    let gpus = json["gpus"].as_array().unwrap();
    assert!(gpus.iter().all(|g| g["timing"] == "device"), "{json}");
    let summed: u64 = gpus.iter().map(|g| g["events"].as_u64().unwrap()).sum();
    assert_eq!(summed, gpu_events as u64, "{json}");
    let process = &json["processes"][0];
    assert_eq!(process["pid"].as_u64(), Some(u64::from(workload.pid)));
    assert!(
        process["agent"]["device_activity"]
            .as_str()
            .is_some_and(|d| d.starts_with("CUPTI 12.8")),
        "{process}"
    );
    assert!(process["cuda_probes"]["functions"].as_u64().unwrap() > 0);
    // CUPTI's kernels as merged: those in the trace, and those that ran
    // between the window's end and the last collection (milliseconds, more
    // on a loaded machine).
    let activity = &process["gpu_activity"];
    let merged = activity["kernels"].as_u64().unwrap() as f64;
    let in_trace = kernels(&space).len() as f64;
    assert!(in_trace > 100.0, "{in_trace}");
    assert!(
        merged >= in_trace && merged <= 2.0 * in_trace,
        "{in_trace} kernels in the trace, {activity}"
    );
    assert_eq!(activity["dropped"].as_u64(), Some(0), "{activity}");
}

#[test]
fn each_cupti_release_is_read_by_its_layout() {
    if !require_root("each_cupti_release_is_read_by_its_layout") {
        return;
    }
    let _serial = serial();
    for (version, release) in [("130001", "13.0"), ("130101", "13.1"), ("140000", "14.0")] {
        wait_for_ebtrace_exits();
        let workload = launching(&[], &[("STANDIN_CUPTI_VERSION", version)]);
        let (stderr, space) = capture(workload.pid, "500ms", &[]);
        assert!(
            stderr.contains(&format!("CUPTI {release} activity")),
            "{stderr}"
        );
        let traced = kernels(&space);
        assert!(!traced.is_empty(), "{version}: no kernels\n{stderr}");
        let reduce = cxxfilt("_Z9reduceSumPKfPfj");
        assert!(
            traced.iter().any(|(_, e)| e.name == reduce),
            "{version}: no {reduce}"
        );
        for (_, e) in &traced {
            let details = e.stats["kernel_details"].as_str();
            assert!(details.starts_with("regs:32 "), "{version}: {details}");
        }
    }
}

#[test]
fn a_program_holding_cupti_is_left_alone() {
    if !require_root("a_program_holding_cupti_is_left_alone") {
        return;
    }
    let _serial = serial();
    let workload = CudaWorkload::start_with_cupti(&["--own-cupti"], &[]);
    let logdir = TempDir::new("own-cupti");
    let ebtrace = spawn_attached(&workload.pid.to_string(), "60s", &logdir, &[]);
    let report = workload.run(Duration::from_secs(60));
    let out = ebtrace.wait(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("device activity not recorded") && stderr.contains("another CUPTI client"),
        "{stderr}"
    );
    // The program's own subscription got every kernel it launched.
    let submitted: u64 = ["0", "1"]
        .iter()
        .map(|d| report["submitted"][d]["kernels"].as_u64().unwrap())
        .sum();
    assert_eq!(
        report["cupti"]["own_kernel_records"].as_u64(),
        Some(submitted),
        "{report}"
    );
    // The GPU lines show the work as the host submitted it.
    let files = xplane_files(logdir.path());
    let space = xspace::load(&files[0]);
    assert!(space.planes.iter().any(|p| p.name == "/device:GPU:0"));
}

/// Records `pid` with the agent and kills ebtrace with SIGKILL 300 ms
/// after the agent's thread appeared in the target.
fn kill_mid_capture(pid: u32, logdir: &str) {
    let logdir = TempDir::new(logdir);
    let mut ebtrace = spawn_record(&pid.to_string(), "60s", &logdir, &[]);
    wait_for_agent_threads(pid, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(300));
    signal(ebtrace.id(), libc::SIGKILL);
    let _ = ebtrace.wait();
}

/// Waits up to `within` for the agent's thread in `pid` to end after
/// `what` did.
fn wait_for_agent_threads_to_end(pid: u32, within: Duration, what: &str) {
    let deadline = std::time::Instant::now() + within;
    while agent_threads(pid) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent's thread outlived {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_ebtrace_leaves_cupti_free() {
    if !require_root("a_killed_ebtrace_leaves_cupti_free") {
        return;
    }
    let _serial = serial();
    let mut workload = CudaWorkload::start_with_cupti(LONG_RUN, &[]);
    workload.go();
    kill_mid_capture(workload.pid, "killed-cupti");
    wait_for_agent_threads_to_end(workload.pid, Duration::from_secs(2), "ebtrace");
    // The process runs on, and CUPTI's subscription was released.
    let (stderr, space) = capture(workload.pid, "300ms", &[]);
    assert!(stderr.contains("device activity: CUPTI"), "{stderr}");
    assert!(!kernels(&space).is_empty());
}

/// The copies of the agent `pid` maps (distinct memfds), and the memfds it
/// holds open.
fn agent_copies(pid: u32) -> (usize, usize) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut inodes: Vec<&str> = maps
        .lines()
        .filter(|l| l.contains("/memfd:ebtrace-agent"))
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    inodes.sort_unstable();
    inodes.dedup();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().contains("memfd:ebtrace-agent"))
        })
        .count();
    (inodes.len(), open)
}

/// CUPTI keeps the callbacks the agent gave it, so the agent stays mapped
/// once a capture that used CUPTI unloaded it: later captures, one after a
/// killed ebtrace among them, start that copy again, record every kind as
/// the first did, and leave one copy in the process, not one each, though
/// the program's free descriptors move on between them (the loader knows
/// a copy by the descriptor it was loaded from).
#[test]
fn captures_in_a_row_leave_one_copy_of_the_agent() {
    if !require_root("captures_in_a_row_leave_one_copy_of_the_agent") {
        return;
    }
    let _serial = serial();
    let workload = launching(&[], &[]);
    let pid = workload.pid;
    for round in 0..4 {
        signal(pid, libc::SIGUSR2);
        if round == 2 {
            kill_mid_capture(pid, "killed-between-captures");
            wait_for_agent_threads_to_end(pid, Duration::from_secs(5), "ebtrace");
        }
        let (stderr, space) = capture(pid, "300ms", &[]);
        assert!(
            stderr.contains("device activity: CUPTI 12.8 activity: kernels"),
            "round {round}: {stderr}"
        );
        let traced = kernels(&space);
        assert!(!traced.is_empty(), "round {round}: no kernels\n{stderr}");
        let launched = launches(&space);
        let joined = traced
            .iter()
            .filter_map(|(_, e)| e.stats.get("correlation_id").map(Stat::as_u64))
            .filter(|link| launched.contains_key(link))
            .count();
        assert!(
            joined + 4 >= traced.len(),
            "round {round}: {joined} of {} kernels joined to their launch",
            traced.len()
        );
        assert_eq!(agent_copies(pid), (1, 0), "round {round}");
        assert_eq!(agent_threads(pid), 0, "round {round}");
    }
}

/// How a capture of the agent's ends.
#[derive(Clone, Copy)]
enum CaptureEnd {
    Normally,
    Killed,
}

/// After a capture that ends as `end`, the program starts a profiler session
/// of its own (as torch.profiler does): its own buffers must receive every
/// kernel it launches, although a kernel was still running when the agent
/// stopped (CUPTI writes that record late, into a buffer it then keeps).
fn program_profiles_itself_after(end: CaptureEnd) {
    let mut workload = launching(&["--profile-late"], &[("STANDIN_CUPTI_LATE_KERNEL", "1")]);
    match end {
        CaptureEnd::Normally => {
            let (stderr, space) = capture(workload.pid, "500ms", &[]);
            assert!(!kernels(&space).is_empty(), "{stderr}");
        }
        CaptureEnd::Killed => kill_mid_capture(workload.pid, "killed-then-profiled"),
    }
    wait_for_agent_threads_to_end(workload.pid, Duration::from_secs(5), "the capture");
    signal(workload.pid, libc::SIGUSR1);
    let profiled = &workload.next_line(Duration::from_secs(60))["profiled"];
    let launched = profiled["kernels"].as_u64().expect("kernels");
    assert!(launched >= 99, "{profiled}");
    assert_eq!(profiled["foreign_buffers"].as_u64(), Some(0), "{profiled}");
    assert_eq!(
        profiled["own_kernel_records"].as_u64(),
        Some(launched),
        "{profiled}"
    );
}

#[test]
fn a_program_profiling_itself_after_a_capture_gets_every_kernel() {
    if !require_root("a_program_profiling_itself_after_a_capture_gets_every_kernel") {
        return;
    }
    let _serial = serial();
    program_profiles_itself_after(CaptureEnd::Normally);
}

#[test]
fn a_program_profiling_itself_after_ebtrace_was_killed_gets_every_kernel() {
    if !require_root("a_program_profiling_itself_after_ebtrace_was_killed_gets_every_kernel") {
        return;
    }
    let _serial = serial();
    program_profiles_itself_after(CaptureEnd::Killed);
}

#[test]
fn a_process_exiting_mid_capture_keeps_the_rest_of_the_trace() {
    if !require_root("a_process_exiting_mid_capture_keeps_the_rest_of_the_trace") {
        return;
    }
    let _serial = serial();
    let mut workload = CudaWorkload::start_with_cupti(LONG_RUN, &[]);
    workload.go();
    let logdir = TempDir::new("exiting");
    let ebtrace = spawn_attached(&workload.pid.to_string(), "60s", &logdir, &[]);
    std::thread::sleep(Duration::from_millis(500));
    signal(workload.pid, libc::SIGKILL);
    let out = ebtrace.wait(Duration::from_secs(120));
    assert!(out.status.success(), "{out:?}");
    let out =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{out}");
    let space = xspace::load(&files[0]);
    assert!(out.contains("device activity: CUPTI"), "{out}");
    // One line says what was lost, and why; nothing else about the agent.
    let lost: Vec<&str> = out.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(lost.len(), 1, "{out}");
    assert!(
        lost[0].contains("exited during the capture: GPU activity recorded inside it"),
        "{out}"
    );
    assert!(
        out.contains("capture ended early: every traced process exited"),
        "{out}"
    );
    // The host side of the capture is all there.
    let host = plane(&space, "/host:CPU");
    let calls = host
        .lines
        .iter()
        .flat_map(|l| line_events(host, l.id))
        .filter(|e| e.name.starts_with("cuLaunch"))
        .count();
    assert!(calls > 100, "{calls} launches");
}

#[test]
fn kernels_looked_up_before_the_capture_are_named_by_the_driver_without_cupti() {
    if !require_root("kernels_looked_up_before_the_capture_are_named_by_the_driver_without_cupti") {
        return;
    }
    let _serial = serial();
    // The program holds CUPTI, so its records cannot name anything; its
    // threads look their kernels up before ebtrace attaches.
    let workload = launching(&["--own-cupti"], &[]);
    let launch_kernels = |space: &XSpace| -> Vec<String> {
        let host = plane(space, "/host:CPU");
        host.lines
            .iter()
            .flat_map(|l| line_events(host, l.id))
            .filter(|e| e.name.starts_with("cuLaunch") && e.stats["result_code"].as_i64() == 0)
            .map(|e| e.stats["kernel"].as_str().to_string())
            .collect()
    };

    // Without the agent, the launches carry handles only.
    let (out, space) = capture(workload.pid, "300ms", &["--no-agent"]);
    let kernels = launch_kernels(&space);
    assert!(kernels.len() > 10, "{out}");
    assert!(
        kernels.iter().all(|k| k.starts_with("<unresolved 0x")),
        "{kernels:?}"
    );

    wait_for_ebtrace_exits();
    let (out, space) = capture(workload.pid, "300ms", &[]);
    assert!(out.contains("another CUPTI client"), "{out}");
    let kernels = launch_kernels(&space);
    assert!(kernels.len() > 10, "{out}");
    let expected = [cxxfilt("_Z6vecAddPKfS0_Pfi"), cxxfilt("_Z9reduceSumPKfPfj")];
    for k in &kernels {
        assert!(expected.contains(k), "{k} is not one the program launched");
    }
    assert!(
        out.contains("3 of 3 kernels launched with handles looked up before the capture named by the CUDA driver (cuFuncGetName)"),
        "{out}"
    );
}

#[test]
fn a_capture_longer_than_the_agents_buffers_loses_no_gpu_activity() {
    if !require_root("a_capture_longer_than_the_agents_buffers_loses_no_gpu_activity") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("cupti-log-long");
    let log = dir.path().join("cupti.log");
    let workload = launching(&[], &[("STANDIN_CUPTI_LOG", log.to_str().unwrap())]);
    // Three seconds of this workload are well over the agent's 64 MiB of
    // CUPTI buffers: only collecting while recording keeps them all.
    let (out, space) = capture(workload.pid, "3s", &[]);
    assert!(!out.contains("CUPTI dropped"), "{out}");
    let (start_wall, stop_wall) = profile_window(&space);
    let (start_wall, stop_wall) = (start_wall as i64, stop_wall as i64);
    let traced: HashSet<u64> = kernels(&space).into_iter().map(|(id, _)| id).collect();
    assert!(traced.len() > 10_000, "{} kernels", traced.len());
    // Every kernel CUPTI recorded well inside the window is in the trace,
    // from its first second to its last.
    let inside: Vec<Logged> = read_log(&log)
        .into_iter()
        .filter(|l| l.kind == 10 && l.recorded)
        .filter(|l| l.start > start_wall + 50_000 && l.end < stop_wall - 50_000)
        .collect();
    let missing: Vec<&Logged> = inside
        .iter()
        .filter(|l| !traced.contains(&l.correlation))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of the {} kernels CUPTI recorded in the window are missing, the first {:.0} ms \
         and the last {:.0} ms into it",
        missing.len(),
        inside.len(),
        missing.first().map_or(0, |l| l.start - start_wall) as f64 / 1e6,
        missing.last().map_or(0, |l| l.start - start_wall) as f64 / 1e6,
    );
}

#[test]
fn a_program_finalizing_cupti_mid_capture_costs_only_the_records_after() {
    if !require_root("a_program_finalizing_cupti_mid_capture_costs_only_the_records_after") {
        return;
    }
    let _serial = serial();
    let workload = launching(&["--finalize-late"], &[]);
    let logdir = TempDir::new("finalized");
    let ebtrace = spawn_attached(&workload.pid.to_string(), "2s", &logdir, &[]);
    // As jax does when its own session ends: cuptiFinalize, mid-capture.
    std::thread::sleep(Duration::from_millis(700));
    signal(workload.pid, libc::SIGUSR1);
    let out = ebtrace.wait(Duration::from_secs(120));
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("another CUPTI client finalized CUPTI during the capture"),
        "{text}"
    );
    // What CUPTI recorded before is there; the program runs on.
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{text}");
    let before = kernels(&xspace::load(&files[0])).len();
    assert!(before > 100, "{before} kernels\n{text}");
    assert!(
        std::fs::read_to_string(format!("/proc/{}/stat", workload.pid))
            .is_ok_and(|s| !s.contains(") Z ")),
        "the program died"
    );
    // CUPTI can be had again.
    wait_for_ebtrace_exits();
    let (again, space) = capture(workload.pid, "300ms", &[]);
    assert!(again.contains("device activity: CUPTI"), "{again}");
    assert!(!kernels(&space).is_empty(), "{again}");
}

/// A program launching 50 kernels a second fills no CUPTI buffer in a
/// capture: what the flushes hand over (a buffer's few records) is in the
/// trace, every kernel CUPTI recorded well inside the window.
#[test]
fn a_slow_launcher_s_kernels_are_all_in_the_trace() {
    if !require_root("a_slow_launcher_s_kernels_are_all_in_the_trace") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("cupti-log");
    let log = dir.path().join("cupti.log");
    let mut workload = CudaWorkload::start_with_cupti(
        &["--bench-seconds", "60", "--bench-gap-ns", "20000000"],
        &[("STANDIN_CUPTI_LOG", log.to_str().unwrap())],
    );
    workload.go();
    std::thread::sleep(Duration::from_millis(300));
    let (stderr, space) = capture(workload.pid, "1s", &[]);
    let (start_wall, stop_wall) = profile_window(&space);
    let (start_wall, stop_wall) = (start_wall as i64, stop_wall as i64);
    let inside: Vec<u64> = read_log(&log)
        .into_iter()
        .filter(|l| l.kind == 10 && l.recorded)
        .filter(|l| l.start > start_wall + 50_000 && l.end < stop_wall - 50_000)
        .map(|l| l.correlation)
        .collect();
    assert!(
        inside.len() >= 20,
        "{} kernels logged\n{stderr}",
        inside.len()
    );
    let traced: std::collections::HashSet<u64> =
        kernels(&space).into_iter().map(|(id, _)| id).collect();
    let missing = inside.iter().filter(|id| !traced.contains(id)).count();
    assert_eq!(
        missing,
        0,
        "{missing} of {} kernels CUPTI recorded inside the window are not in the trace\n{stderr}",
        inside.len()
    );
    // Each joined to the span the uprobes made of its launch (which holds
    // its stack), though a launch made this rarely finds cold caches.
    let launches = launches(&space);
    let inside: std::collections::HashSet<u64> = inside.into_iter().collect();
    let unjoined = kernels(&space)
        .iter()
        .filter(|(id, _)| inside.contains(id))
        .filter(|(_, kernel)| {
            !kernel
                .stats
                .get("correlation_id")
                .and_then(|link| launches.get(&link.as_u64()))
                .is_some_and(|l| l.stats.contains_key("launch_stack"))
        })
        .count();
    assert_eq!(unjoined, 0, "{unjoined} launches not joined\n{stderr}");
}
