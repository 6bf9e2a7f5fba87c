//! `ebtrace serve`'s flight recorder: `StartContinuousProfiling`,
//! `GetSnapshot` and `StopContinuousProfiling` from XProf's own client,
//! what a snapshot holds (what happened before it was asked for), and the
//! bounds on what it keeps.

use std::{
    collections::HashMap,
    path::Path,
    process::{Command, Output, Stdio},
    time::Duration,
};

use ebtrace_proto::tensorflow::{GetSnapshotRequest, profiler::XSpace};
use ebtrace_tests::{
    TempDir, agent_threads,
    cuda::{CudaWorkload, cxxfilt},
    fixture::{SchedWorkload, build_c_shared, read_schedstat},
    http,
    python::{jax_python, start_jax_with},
    require_root, serial,
    serve::{ServeProcess, block_on, request, xspace_of},
    signal, wait_with_deadline, xplane_files, xprof,
    xspace::{self, Stat, line_events, plane, profile_window},
};
use tonic::Code;

const HOST_CPU: &str = "/host:CPU";

/// The value of the metric `name` in a `/metrics` body.
fn metric(body: &str, name: &str) -> u64 {
    http::metric(body, name) as u64
}

/// Waits for a line of the server's stderr holding `needle`.
fn expect_line(server: &ServeProcess, needle: &str) {
    assert!(
        server.wait_line(needle, Duration::from_secs(10)).is_some(),
        "no line with {needle:?}: {:?}",
        server.lines()
    );
}

/// A `--discover` flight recorder keeping the last `retain`, kept on by a
/// process that maps a library named like the CUDA driver (which exports
/// nothing ebtrace probes); and that library, which makes any process
/// preloading it one the recorder takes on.
fn discovering_recorder(retain: &str) -> (SchedWorkload, ServeProcess, std::path::PathBuf) {
    let stub = build_c_shared("runtime_stub", "libcuda.so.1");
    let keeper = SchedWorkload::start_with_env(&[], &[("LD_PRELOAD", stub.to_str().unwrap())]);
    let server = ServeProcess::loopback(&[
        "--discover",
        "--discover-interval",
        "200ms",
        "--retain",
        retain,
    ]);
    expect_line(&server, "flight recorder on");
    (keeper, server, stub)
}

/// Starts a sched_workload that preloads `stub` (so that `--discover`
/// watches it) and waits until `server`'s recorder records it.
fn start_recorded(server: &ServeProcess, stub: &Path) -> SchedWorkload {
    let workload = SchedWorkload::start_with_env(&[], &[("LD_PRELOAD", stub.to_str().unwrap())]);
    expect_line(server, &format!("recording pid {} ", workload.pid));
    workload
}

fn run_python(python: &Path, script: &str) -> Output {
    let child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    wait_with_deadline(child, Duration::from_secs(120))
}

#[test]
fn xprof_snapshot_holds_what_happened_before_it_was_asked() {
    if !require_root("xprof_snapshot_holds_what_happened_before_it_was_asked") {
        return;
    }
    let Some(python) = xprof::python() else {
        return;
    };
    let _serial = serial();
    // late-starter: created 2 s after the start, runs 200 ms, exits.
    let workload = SchedWorkload::start(&["--late-thread-ms", "2000"]);
    // More samples than the recorder's default takes: 200 ms at 19 Hz
    // is 3 or 4 of them.
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        "--retain-sample-hz",
        "99",
    ]);
    let addr = format!("127.0.0.1:{}", server.port());
    let logdir = TempDir::new("snapshot");
    let start = format!(
        "import xprof.convert._pywrap_profiler_plugin as p\n\
         p.start_continuous_profiling('{addr}', {{}})\n"
    );
    let out = run_python(&python, &start);
    assert!(out.status.success(), "{out:?}\n{:?}", server.lines());
    assert!(server.probe_fds() > 0, "no probes for the flight recorder");

    let late = workload
        .wait_line("late_tid", Duration::from_secs(10))
        .expect("the fixture started its late thread");
    let late_tid = late["late_tid"].as_i64().unwrap();
    // It has exited by the time the snapshot is asked for.
    std::thread::sleep(Duration::from_millis(600));
    let snapshot = format!(
        "import xprof.convert._pywrap_profiler_plugin as p\n\
         p.get_snapshot('{addr}', {:?})\n",
        logdir.path().to_str().unwrap()
    );
    let out = run_python(&python, &snapshot);
    assert!(out.status.success(), "{out:?}\n{:?}", server.lines());
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");

    let space = xspace::load(&files[0]);
    let host = plane(&space, HOST_CPU);
    let events = line_events(host, late_tid);
    assert!(
        events.iter().any(|e| e.name == "Thread exit"),
        "the late thread's exit is not in the snapshot"
    );
    let running = xspace::sum_named(&events, "Running");
    assert!(
        (150e6..260e6).contains(&running),
        "the late thread ran {running} ns (200 ms of CPU)"
    );
    // Its CPU stacks were sampled (99 times a second) while it
    // ran: a tick for each 10 ms on a CPU, most in its own function.
    let samples: Vec<_> = events
        .iter()
        .filter_map(|e| e.stats.get("cpu_sample_stack"))
        .map(|s| s.as_str())
        .collect();
    let expected = running * 99.0 / 1e9;
    assert!(
        (0.7 * expected..=1.3 * expected).contains(&(samples.len() as f64)),
        "{} samples of the late thread, {expected:.0} expected",
        samples.len()
    );
    let in_own_function = samples
        .iter()
        .filter(|s| s.contains("late_starter"))
        .count();
    assert!(
        in_own_function * 2 >= samples.len(),
        "{in_own_function} of {} samples name late_starter: {samples:?}",
        samples.len()
    );
    // The snapshot covers from the recorder's start up to the request.
    let (begin, end) = profile_window(&space);
    let covered = (end - begin) as f64;
    assert!((2.0e9..30.5e9).contains(&covered), "{covered} ns");
    // XProf reads it.
    xprof::assert_shows_sched_workload(&python, &files[0], &workload);

    let stop = format!(
        "import xprof.convert._pywrap_profiler_plugin as p\n\
         p.stop_continuous_profiling('{addr}')\n\
         try:\n    p.get_snapshot('{addr}', '/nonexistent')\n\
         except Exception as e:\n    print('after stop:', e)\n"
    );
    let out = run_python(&python, &stop);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("after stop: FAILED_PRECONDITION") && stdout.contains("flight recorder"),
        "{stdout}"
    );
    assert!(
        server.wait_detached(Duration::from_secs(10)),
        "the flight recorder's probes are still attached after StopContinuousProfiling"
    );
}

#[test]
fn retained_records_stay_within_their_memory_and_every_forgotten_one_is_counted() {
    if !require_root("retained_records_stay_within_their_memory_and_every_forgotten_one_is_counted")
    {
        return;
    }
    let _serial = serial();
    // ping-pong makes hundreds of thousands of records a second; 96 MiB
    // hold ebtrace itself (about 15 MiB with a 4 MiB ring buffer, 45 once
    // it read the symbols of the objects stack samples are in) and about
    // 200,000 records with what a snapshot of them takes.
    let workload = SchedWorkload::start_on_cpu0(&["--mode", "pingpong"]);
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        "--keep-probes",
        "0",
        "--retain",
        "60s",
        "--retain-memory",
        "96",
        "--ring-buffer-mib",
        "4",
        "--http",
        "127.0.0.1:0",
    ]);
    let metrics_at = server.http_addr();
    expect_line(&server, "flight recorder on");
    std::thread::sleep(Duration::from_secs(2));
    // Stopped, the target makes no more records: what the probes wrote
    // is what the recorder holds plus what it forgot.
    signal(workload.pid, libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(500));
    let body = http::get(metrics_at, "/metrics").text();
    let (held, forgotten) = (
        metric(&body, "ebtrace_recorder_records"),
        metric(&body, "ebtrace_recorder_forgotten_records_total"),
    );
    let submitted = server.records_submitted();
    let held_at_most = metric(&body, "ebtrace_recorder_records_limit");
    assert!(
        held <= held_at_most && held_at_most < 96 * 1024 * 1024 / 200,
        "{held} records held, at most {held_at_most}, in 96 MiB"
    );
    assert!(forgotten > 100_000, "{forgotten} forgotten");
    assert_eq!(
        held + forgotten,
        submitted,
        "held {held}, forgotten {forgotten}"
    );
    let rss_mib = server.rss_kib() / 1024;
    assert!(
        rss_mib < 96,
        "ebtrace holds {rss_mib} MiB, over --retain-memory 96"
    );

    // The snapshot holds the newest records: the last moments of ping
    // and pong. Its window starts with them, not 60 s back with the
    // forgotten seconds shown as idle, and it says why.
    let space = server.snapshot("bounded");
    let host = plane(&space, HOST_CPU);
    let (start, stop) = profile_window(&space);
    for thread in ["ping", "pong"] {
        let events = line_events(host, workload.tid(thread).into());
        assert!(
            events.iter().any(|e| e.name == "Running"),
            "no {thread} in the snapshot"
        );
        // They switch every few µs: each runs in the window's first ms
        // (a line that starts with what was forgotten shows it as unknown).
        let first = events
            .iter()
            .filter(|e| e.name == "Running")
            .map(|e| e.start_ns)
            .fold(f64::MAX, f64::min);
        assert!(
            first < 1e6,
            "{thread} first runs {:.3} s into a window of {:.3} s",
            first / 1e9,
            (stop - start) as f64 / 1e9
        );
    }
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains("--retain-memory 96 MiB holds the last")),
        "{:?}",
        space.warnings
    );
    signal(workload.pid, libc::SIGCONT);

    // A normal capture works beside the recorder.
    block_on(async {
        let mut client = server.client().await;
        let r = client.profile(request(300)).await.expect("a capture");
        assert!(!r.into_inner().empty_trace);
    });

    // Stopping it detaches its probes (the capture's were detached when
    // it ended: --keep-probes 0).
    block_on(async {
        let mut client = server.client().await;
        client
            .stop_continuous_profiling(ebtrace_proto::tensorflow::StopContinuousProfilingRequest {})
            .await
            .expect("stop");
        let status = client
            .get_snapshot(GetSnapshotRequest::default())
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
    });
    assert!(server.wait_detached(Duration::from_secs(10)));
    // It holds nothing now; what it forgot stays counted (a counter).
    let body = http::get(metrics_at, "/metrics").text();
    assert_eq!(metric(&body, "ebtrace_recorder_records"), 0);
    assert!(metric(&body, "ebtrace_recorder_forgotten_records_total") >= forgotten);
}

#[test]
fn a_process_that_dies_is_kept_until_its_records_are_too_old() {
    if !require_root("a_process_that_dies_is_kept_until_its_records_are_too_old") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        // Long enough that its records are still there when the snapshot
        // comes, on a machine slow to notice the exit.
        "--retain",
        "6s",
        "--keep-probes",
        "0",
    ]);
    expect_line(&server, "flight recorder on");
    let (pid, burner) = (workload.pid, workload.tid("cpu-burner"));
    let on_cpu = || {
        read_schedstat(pid, burner)
            .expect("the burner's schedstat")
            .on_cpu_ns
    };
    let before = on_cpu();
    std::thread::sleep(Duration::from_millis(700));
    // What the kernel says it ran while recorded (the CPU it gets depends
    // on what else this machine runs).
    let ran = on_cpu() - before;
    assert!(ran > 100_000_000, "the burner ran only {ran} ns");
    drop(workload);
    assert!(
        server
            .wait_line(
                &format!("pid {pid} (sched_workload) exited"),
                Duration::from_secs(10)
            )
            .is_some(),
        "{:?}",
        server.lines()
    );
    // Its last moments are in a snapshot asked for after it died.
    let snapshot = || {
        block_on(async {
            let mut client = server.client().await;
            client
                .get_snapshot(GetSnapshotRequest {
                    snapshot_session_id: "after-death".into(),
                })
                .await
                .map(|r| xspace_of(&r.into_inner()))
        })
    };
    let space = snapshot().expect("a snapshot after the process died");
    let running = xspace::sum_named(
        &line_events(plane(&space, HOST_CPU), burner.into()),
        "Running",
    );
    assert!(
        running > 0.9 * ran as f64,
        "cpu-burner ran {running} ns in the snapshot, {ran} ns by its schedstat"
    );
    // Once they are older than --retain, the recorder lets its probes go.
    assert!(
        server.wait_detached(Duration::from_secs(15)),
        "{:?}",
        server.lines()
    );
    assert_eq!(
        server.count_lines("flight recorder paused"),
        1,
        "{:?}",
        server.lines()
    );
    let status = snapshot().unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
}

#[test]
fn with_discover_the_recorder_takes_on_a_process_started_after_the_daemon() {
    if !require_root("with_discover_the_recorder_takes_on_a_process_started_after_the_daemon") {
        return;
    }
    let _serial = serial();
    let (first, server, stub) = discovering_recorder("30s");
    let preload = [("LD_PRELOAD", stub.to_str().unwrap())];
    let watching = |pid: u32| {
        server
            .wait_line(
                &format!("watching pid {pid} (sched_workload)"),
                Duration::from_secs(10),
            )
            .unwrap_or_else(|| panic!("pid {pid} not discovered: {:?}", server.lines()))
    };
    watching(first.pid);
    expect_line(&server, "flight recorder on");
    // The recorder holds a while of the first process when the second
    // appears: it takes the second on and keeps what it holds.
    std::thread::sleep(Duration::from_secs(1));
    let later = SchedWorkload::start_with_env(&[], &preload);
    watching(later.pid);
    assert!(
        server
            .wait_line(
                &format!("recording pid {} (sched_workload) too", later.pid),
                Duration::from_secs(10)
            )
            .is_some(),
        "{:?}",
        server.lines()
    );
    std::thread::sleep(Duration::from_secs(1));
    let space = server.snapshot("discovered");
    let host = plane(&space, HOST_CPU);
    let mut first_seen_ns = Vec::new();
    for (which, workload) in [("first", &first), ("later", &later)] {
        let burner = line_events(host, workload.tid("cpu-burner").into());
        let running = xspace::sum_named(&burner, "Running");
        assert!(
            running > 100e6,
            "the {which} process's cpu-burner ran {running} ns in the snapshot"
        );
        first_seen_ns.push(burner.iter().map(|e| e.start_ns).fold(f64::MAX, f64::min));
    }
    assert_eq!(
        server.count_lines("flight recorder on"),
        1,
        "the recorder started again for the new process: {:?}",
        server.lines()
    );
    // The first process's line goes back to before the second appeared;
    // the second's starts when it was taken on, not before.
    let (first_from, later_from) = (first_seen_ns[0], first_seen_ns[1]);
    assert!(
        later_from - first_from > 800e6,
        "the first process is seen from {first_from} ns, the later one from {later_from} ns"
    );

    // A process that dies stays in what the recorder keeps: its last
    // seconds are what a snapshot after a crash is for. The other one goes
    // on being recorded.
    let (first_pid, first_burner) = (first.pid, first.tid("cpu-burner"));
    let started = server.count_lines("flight recorder on");
    drop(first);
    assert!(
        server
            .wait_line(
                &format!("pid {first_pid} (sched_workload) exited"),
                Duration::from_secs(10)
            )
            .is_some(),
        "{:?}",
        server.lines()
    );
    std::thread::sleep(Duration::from_millis(500));
    let space = server.snapshot("after-exit");
    let host = plane(&space, HOST_CPU);
    let before_exit = xspace::sum_named(&line_events(host, first_burner.into()), "Running");
    assert!(
        before_exit > 100e6,
        "the exited process's cpu-burner ran {before_exit} ns in the snapshot"
    );
    // Event times count from the snapshot's start.
    let (start, stop) = profile_window(&space);
    let burner = line_events(host, later.tid("cpu-burner").into());
    let latest_end = burner.iter().map(|e| e.end_ns()).fold(0.0, f64::max);
    let unseen_ms = ((stop - start) as f64 - latest_end) / 1e6;
    assert!(
        unseen_ms < 300.0,
        "the live process was last seen {unseen_ms} ms before the snapshot ended"
    );
    assert_eq!(
        server.count_lines("flight recorder on"),
        started,
        "the recorder started again when a process exited: {:?}",
        server.lines()
    );
}

/// `--retain-memory` bounds ebtrace's memory while the recorder runs: on
/// a target making far more records than that holds, the server's
/// resident memory at its peak, while a snapshot is built and sent, stays
/// within it, ebtrace's own (its ring buffer, the symbols stack samples
/// are named from) included.
#[test]
fn a_snapshot_is_built_within_the_retained_memory() {
    if !require_root("a_snapshot_is_built_within_the_retained_memory") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&["--mode", "pingpong", "--seconds", "60"]);
    let records = snapshot_within_the_retained_memory(workload.pid, "capped");
    assert!(records > 50_000, "{records} records in the snapshot");
}

/// The same bound on a process that calls the driver flat out: a driver
/// call takes far more of a snapshot than a scheduler record (its spans on
/// the thread and on the GPU's stream line, and their stats).
#[test]
fn a_snapshot_of_driver_calls_is_built_within_the_retained_memory() {
    if !require_root("a_snapshot_of_driver_calls_is_built_within_the_retained_memory") {
        return;
    }
    let _serial = serial();
    let mut workload = CudaWorkload::start(&["--bench-seconds", "60"]);
    workload.go();
    let records = snapshot_within_the_retained_memory(workload.pid, "capped-driver");
    assert!(records > 5_000, "{records} records in the snapshot");
}

/// Fills a 96 MiB recorder with `pid`'s records, takes a snapshot and
/// checks the server's peak memory meanwhile; the snapshot's records.
fn snapshot_within_the_retained_memory(pid: u32, id: &str) -> u64 {
    const CAP_MIB: u64 = 96;
    let server = ServeProcess::loopback(&[
        "--pid",
        &pid.to_string(),
        "--keep-probes",
        "0",
        "--retain-memory",
        &CAP_MIB.to_string(),
        "--ring-buffer-mib",
        "4",
        "--http",
        "127.0.0.1:0",
    ]);
    block_on(async {
        let mut client = server.client().await;
        client
            .start_continuous_profiling(request(2000))
            .await
            .expect("StartContinuousProfiling");
    });
    expect_line(&server, "flight recorder on");
    // Full: it forgets the oldest records to keep the newest.
    server.wait_recorder_full(Duration::from_secs(30));
    let holding = server.rss_kib();
    server.reset_peak_rss();
    let space = server.snapshot(id);
    let peak = server.peak_rss_kib();
    let records =
        xspace::plane_stats(plane(&space, "Task Environment"))["ebtrace_records"].as_u64();
    eprintln!("RSS holding {holding} KiB, peak {peak} KiB; {records} records in the snapshot");
    assert!(
        peak <= CAP_MIB * 1024,
        "the server took {peak} KiB at its peak, over --retain-memory {CAP_MIB} MiB (holding \
         {holding} KiB before): {records} records in the snapshot; largest mappings:\n{}",
        server.largest_mappings(8)
    );
    records
}

/// `ebtrace serve --retain-memory 1 ARGS`, refused: the exit status, its
/// one line, and the size that line says to give.
fn least_retain_memory(args: &[&str]) -> (Option<i32>, String, u64) {
    let refused = Command::new(ebtrace_tests::ebtrace_bin())
        .args(["serve", "--bind", "127.0.0.1:0", "--retain-memory", "1"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("spawn ebtrace");
    let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    let least = stderr
        .split("give --retain-memory ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no size to give in {stderr}"));
    (refused.status.code(), stderr, least)
}

/// A `--retain-memory` that leaves no room beside ebtrace itself is
/// refused at once with the size to give, and that size works.
#[test]
fn a_retain_memory_without_room_for_records_is_refused_with_one_that_has_it() {
    if !require_root("a_retain_memory_without_room_for_records_is_refused_with_one_that_has_it") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&["--mode", "pingpong", "--seconds", "30"]);
    let pid = workload.pid.to_string();
    let (status, stderr, suggested) = least_retain_memory(&["--pid", &pid, "--retain", "10s"]);
    assert_eq!(status, Some(2), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    // The 16 MiB ring buffer, 16 MiB for records and 32 for symbols.
    assert!(suggested >= 16 + 16 + 32, "{stderr}");

    let given = suggested.to_string();
    let server =
        ServeProcess::loopback(&["--pid", &pid, "--retain", "10s", "--retain-memory", &given]);
    expect_line(&server, "flight recorder on");
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        server.rss_kib() <= suggested * 1024,
        "ebtrace took {} KiB with --retain-memory {suggested}",
        server.rss_kib()
    );
    assert_eq!(
        server.count_lines("itself now takes"),
        0,
        "{:?}",
        server.lines()
    );
}

/// ebtrace's own memory grows once it reads the symbols of a jax
/// process's libraries, past what a `--retain-memory` that was enough at
/// the start leaves for records: the recorder says so once, keeps a few
/// records all the same, and a snapshot still shows the process.
#[test]
fn a_recorder_outgrown_by_ebtraces_own_memory_says_so_once_and_keeps_a_few_records() {
    if !require_root(
        "a_recorder_outgrown_by_ebtraces_own_memory_says_so_once_and_keeps_a_few_records",
    ) {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let workload = start_jax_with(&python, &["--bench"]);
    let pid = workload.pid.to_string();
    let common = ["--pid", &pid, "--retain", "30s", "--ring-buffer-mib", "4"];
    let least = least_retain_memory(&common).2.to_string();
    let mut args = vec!["--retain-memory", least.as_str(), "--http", "127.0.0.1:0"];
    args.extend(common);
    let server = ServeProcess::loopback(&args);
    let metrics_at = server.http_addr();
    expect_line(&server, "flight recorder on");
    assert!(
        server
            .wait_line("itself now takes", Duration::from_secs(20))
            .is_some(),
        "ebtrace's own memory with jax's symbols fit in --retain-memory {least}: {:?}",
        server.lines()
    );
    std::thread::sleep(Duration::from_secs(3));
    let body = http::get(metrics_at, "/metrics").text();
    let (held, limit) = (
        metric(&body, "ebtrace_recorder_records"),
        metric(&body, "ebtrace_recorder_records_limit"),
    );
    // What 4 MiB hold, a record counted with its share of a snapshot.
    assert!(
        (10_000..30_000).contains(&limit) && held <= limit + limit / 10,
        "{held} records held, at most {limit}"
    );
    let space = server.snapshot("squeezed");
    let host = plane(&space, HOST_CPU);
    assert!(
        host.lines
            .iter()
            .any(|l| !line_events(host, l.id).is_empty()),
        "nothing of jax in the snapshot"
    );
    assert_eq!(
        server.count_lines("itself now takes"),
        1,
        "{:?}",
        server.lines()
    );
}

/// A snapshot of a busy target holds millions of records and takes a
/// while to build: the ring buffer goes on being drained meanwhile, so
/// what the target does then is kept (a small ring would fill within the
/// build otherwise, and most of it would be lost).
#[test]
fn nothing_is_dropped_while_a_large_snapshot_is_built() {
    if !require_root("nothing_is_dropped_while_a_large_snapshot_is_built") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start_on_cpu0(&["--mode", "pingpong", "--seconds", "60"]);
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        "--retain",
        "30s",
        "--retain-memory",
        "512",
        "--ring-buffer-mib",
        "4",
    ]);
    expect_line(&server, "flight recorder on");
    std::thread::sleep(Duration::from_secs(5));
    let dropped = dropped_records;
    let large = server.snapshot("large");
    let records =
        xspace::plane_stats(plane(&large, "Task Environment"))["ebtrace_records"].as_u64();
    assert!(records > 1_000_000, "{records} records in the snapshot");
    // Left undrained while it is built, the 4 MiB ring holds a fraction
    // of what the ping-pong makes meanwhile, and most of the rest is lost.
    // A stall of this 2-core machine (the target has one CPU to itself)
    // can still cost a few tens of thousands.
    let few = records / 20;
    let before = dropped(&large);
    assert!(before < few, "{before} records dropped before the snapshot");
    // Drops while it was built would show in the next one.
    std::thread::sleep(Duration::from_millis(300));
    let next = server.snapshot("next");
    let lost = dropped(&next) - before;
    assert!(
        lost < few,
        "{lost} records dropped while a snapshot of {records} was built"
    );
    drop(workload);
}

/// A process that comes and goes while the recorder runs leaves no probe
/// behind: the recorder of a fleet sees many, for days.
#[test]
fn the_driver_probes_of_a_process_that_exits_are_let_go() {
    if !require_root("the_driver_probes_of_a_process_that_exits_are_let_go") {
        return;
    }
    let _serial = serial();
    let (keeper, server, _) = discovering_recorder("30s");
    let before = server.probe_fds();
    for round in 0..2 {
        let mut driver_user =
            CudaWorkload::start_with_cupti(&["--early", "--iters", "20", "--linger"], &[]);
        let pid = driver_user.pid;
        expect_line(&server, &format!("recording pid {pid} "));
        driver_user.run_and_linger(Duration::from_secs(30));
        let with = server.probe_fds();
        assert!(
            with > before,
            "round {round}: {with} links with pid {pid}, {before} before"
        );
        drop(driver_user);
        assert!(
            server
                .wait_line(
                    &format!("pid {pid} (cuda_workload) exited"),
                    Duration::from_secs(10)
                )
                .is_some(),
            "{:?}",
            server.lines()
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while server.probe_fds() > before && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(
            server.probe_fds(),
            before,
            "round {round}: the probes of pid {pid} stayed after it exited"
        );
    }
    assert_eq!(
        server.count_lines("flight recorder on"),
        1,
        "{:?}",
        server.lines()
    );
    drop(keeper);
}

/// A program looks its kernels up at its start, before any recorder: a
/// snapshot names them through the driver inside the program (ebtrace's
/// agent, loaded for that question and taken out again).
#[test]
fn a_snapshot_names_kernels_looked_up_before_the_recorder_started() {
    if !require_root("a_snapshot_names_kernels_looked_up_before_the_recorder_started") {
        return;
    }
    let _serial = serial();
    let mut workload = CudaWorkload::start(&["--iters", "100000000"]);
    workload.go();
    std::thread::sleep(Duration::from_millis(300));
    let pid = workload.pid;
    let server = small_recorder(pid);
    expect_line(&server, "flight recorder on");
    std::thread::sleep(Duration::from_millis(500));
    for round in 0..2 {
        let space = server.snapshot(&format!("named-{round}"));
        assert_kernels_named(&space, &format!("round {round}"));
        // The agent is out again: no thread of it, nothing of it mapped.
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("its maps");
        assert!(!maps.contains("ebtrace-agent"), "round {round}:\n{maps}");
        assert_eq!(agent_threads(pid), 0, "round {round}");
    }
}

/// A snapshot taken while a capture's agent is in the process cannot load
/// one of its own to name kernels; the next snapshot, after that capture,
/// names them.
#[test]
fn kernels_a_snapshot_could_not_name_are_named_by_the_next() {
    if !require_root("kernels_a_snapshot_could_not_name_are_named_by_the_next") {
        return;
    }
    let _serial = serial();
    let mut workload = CudaWorkload::start_with_cupti(&["--iters", "100000000"], &[]);
    workload.go();
    std::thread::sleep(Duration::from_millis(300));
    let pid = workload.pid;
    let server = small_recorder(pid);
    expect_line(&server, "flight recorder on");
    let unresolved = |space: &XSpace| {
        launched_kernels(space)
            .iter()
            .filter(|k| k.starts_with("<unresolved"))
            .count()
    };
    let during = std::thread::scope(|scope| {
        let capture = scope.spawn(|| {
            block_on(async {
                let mut client = server.client().await;
                client.profile(request(3000)).await.expect("a capture")
            })
        });
        let waiting = std::time::Instant::now();
        while agent_threads(pid) == 0 {
            assert!(
                waiting.elapsed() < Duration::from_secs(20),
                "the capture's agent never came"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let during = server.snapshot("during");
        capture.join().expect("the capture");
        during
    });
    assert!(
        unresolved(&during) > 0,
        "named with another agent in the process"
    );
    // It did not wait for the capture's agent to go, which loading one
    // would have (5 s).
    let answered_ms = server
        .lines()
        .iter()
        .find_map(|l| {
            let (_, rest) = l.split_once("(answered ")?;
            rest.split_once(" ms")?.0.parse::<u64>().ok()
        })
        .expect("the server says when it answered the snapshot");
    assert!(
        answered_ms < 4000,
        "the snapshot taken beside another agent was answered after {answered_ms} ms"
    );
    let waiting = std::time::Instant::now();
    while agent_threads(pid) > 0 {
        assert!(
            waiting.elapsed() < Duration::from_secs(20),
            "the agent stayed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = server.snapshot("after");
    assert_kernels_named(&after, "the snapshot after the capture");
    assert_eq!(unresolved(&after), 0);
    // The hub spent seconds on the capture (its agent, its timeline) and
    // on the first snapshot's question to an agent that did not answer;
    // the recorder was drained meanwhile. Left undrained, its 4 MiB ring
    // overflowed within 0.1 s and millions of the launches' records were
    // lost; a few could still go in a stall of this machine.
    let lost = dropped_records(&after);
    assert!(
        lost < 100_000,
        "{lost} records dropped while the hub served the capture and the first snapshot"
    );
}

/// The records the probes dropped so far, as a snapshot says.
fn dropped_records(space: &XSpace) -> u64 {
    xspace::plane_stats(plane(space, "Task Environment"))["ebtrace_dropped_records"].as_u64()
}

/// A flight recorder of `pid`'s last 10 s in 96 MiB, with a 4 MiB ring.
fn small_recorder(pid: u32) -> ServeProcess {
    ServeProcess::loopback(&[
        "--pid",
        &pid.to_string(),
        "--retain",
        "10s",
        "--retain-memory",
        "96",
        "--ring-buffer-mib",
        "4",
    ])
}

/// The driver calls of a snapshot: (name, stats) of each on the host plane
/// (calls, not the stack samples that landed in one).
fn driver_calls(space: &XSpace) -> Vec<(String, HashMap<String, Stat>)> {
    let host = plane(space, HOST_CPU);
    host.lines
        .iter()
        .flat_map(|l| line_events(host, l.id))
        .filter(|e| e.name.starts_with("cu") && e.stats.contains_key("result"))
        .map(|e| (e.name, e.stats))
        .collect()
}

/// The kernel each successful launch in `space` names.
fn launched_kernels(space: &XSpace) -> Vec<String> {
    driver_calls(space)
        .into_iter()
        .filter(|(name, stats)| {
            name.starts_with("cuLaunch") && stats.get("result_code").map(Stat::as_i64) == Some(0)
        })
        .map(|(_, stats)| stats["kernel"].as_str().to_string())
        .collect()
}

/// Every successful launch of the stand-in workload in `space` is named
/// after one of its two kernels, and there are some.
fn assert_kernels_named(space: &XSpace, what: &str) {
    let expected = [cxxfilt("_Z6vecAddPKfS0_Pfi"), cxxfilt("_Z9reduceSumPKfPfj")];
    let kernels = launched_kernels(space);
    assert!(kernels.len() > 10, "{what}: {kernels:?}");
    for k in &kernels {
        assert!(expected.contains(k), "{what}: {k} is not one it launched");
    }
}

/// The CUDA runtime looks a kernel's function up before each launch
/// (`cuKernelGetFunction`); the recorder does not probe that lookup, and
/// still names what is launched through it. Setting the current context is
/// probed at its entry only: an instant without a result.
#[test]
fn the_recorder_names_kernels_without_probing_the_per_launch_lookup() {
    if !require_root("the_recorder_names_kernels_without_probing_the_per_launch_lookup") {
        return;
    }
    let _serial = serial();
    let mut workload = CudaWorkload::start(&["--iters", "2000", "--linger"]);
    let server = small_recorder(workload.pid);
    expect_line(&server, "flight recorder on");
    // Its lookups by name and by kernel, then its launches, while recorded.
    let report = workload.run_and_linger(Duration::from_secs(60));
    let logged = |name: &str| -> u64 {
        report["calls"]
            .as_array()
            .expect("calls")
            .iter()
            .filter(|c| c["function"] == name)
            .map(|c| c["count"].as_u64().expect("count"))
            .sum()
    };
    let space = server.snapshot("lookups");
    assert_kernels_named(&space, "snapshot");
    let calls = driver_calls(&space);
    let count = |name: &str| calls.iter().filter(|(n, _)| n == name).count() as u64;
    for name in ["cuLibraryGetKernel", "cuLaunchKernelEx", "cuCtxSetCurrent"] {
        assert_eq!(count(name), logged(name), "{name}");
    }
    assert_eq!(logged("cuKernelGetFunction"), 1);
    assert_eq!(count("cuKernelGetFunction"), 0, "the per-launch lookup");
    let set_current: Vec<_> = calls
        .iter()
        .filter(|(n, _)| n == "cuCtxSetCurrent")
        .collect();
    assert_eq!(set_current.len(), 1, "launcher-0 sets its context once");
    let (_, stats) = set_current[0];
    assert!(!stats.contains_key("result_code"), "{stats:?}");
    assert_eq!(
        stats["result"].as_str(),
        "not recorded (probed at entry only)"
    );
}

/// Once the records of a process that exited are older than `--retain`,
/// the recorder keeps nothing of it: not even its pid among the
/// snapshot's processes (a recorder that runs for days sees many come and
/// go).
#[test]
fn a_process_whose_records_are_all_too_old_is_forgotten() {
    if !require_root("a_process_whose_records_are_all_too_old_is_forgotten") {
        return;
    }
    let _serial = serial();
    let (keeper, server, stub) = discovering_recorder("2s");
    let brief = start_recorded(&server, &stub);
    let pid = brief.pid;
    let pids = || {
        let space = server.snapshot("pids");
        let env = xspace::plane_stats(plane(&space, "Task Environment"));
        env["ebtrace_pids"].as_str().to_string()
    };
    std::thread::sleep(Duration::from_millis(500));
    drop(brief);
    assert!(
        server
            .wait_line(
                &format!("pid {pid} (sched_workload) exited"),
                Duration::from_secs(10)
            )
            .is_some(),
        "{:?}",
        server.lines()
    );
    let listed = |pids: &str, pid: u32| pids.split(',').any(|p| p == pid.to_string());
    let just_after = pids();
    assert!(listed(&just_after, pid), "{just_after}");
    std::thread::sleep(Duration::from_secs(3));
    let later = pids();
    assert!(!listed(&later, pid), "pid {pid} is still held: {later}");
    assert!(listed(&later, keeper.pid), "{later}");
}

/// Starts a sched_workload that preloads `env`'s library with pid `pid`,
/// which must be free: the kernel hands out the pid after the one written
/// to `ns_last_pid`, unless another process is created in between (then
/// it tries again).
fn start_on_pid(pid: u32, env: &[(&str, &str)]) -> SchedWorkload {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("write /proc/sys/kernel/ns_last_pid (root, in the initial pid namespace)");
        let w = SchedWorkload::start_with_env(&[], env);
        if w.pid == pid {
            return w;
        }
    }
    panic!("no process got pid {pid} in 50 tries");
}

#[test]
fn a_new_process_on_a_recorded_pid_is_recorded_and_the_rest_kept() {
    if !require_root("a_new_process_on_a_recorded_pid_is_recorded_and_the_rest_kept") {
        return;
    }
    let _serial = serial();
    let (keeper, server, stub) = discovering_recorder("30s");
    let old = start_recorded(&server, &stub);
    let pid = old.pid;
    std::thread::sleep(Duration::from_millis(500));
    drop(old);
    expect_line(&server, &format!("pid {pid} (sched_workload) exited"));

    let reused_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as f64;
    let new = start_on_pid(pid, &[("LD_PRELOAD", stub.to_str().unwrap())]);
    expect_line(&server, &format!("pid {pid} now belongs to a new process"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.count_lines(&format!("recording pid {pid} ")) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the new process was not recorded: {:?}",
            server.lines()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(700));
    let space = server.snapshot("reused");
    assert_eq!(
        server.count_lines("flight recorder on"),
        1,
        "the recorder started again: {:?}",
        server.lines()
    );
    let start = profile_window(&space).0 as f64;
    let host = plane(&space, HOST_CPU);
    // What it held of the others from before stays.
    let sleeper = line_events(host, keeper.tid("sleeper-10ms").into());
    assert!(
        sleeper
            .iter()
            .any(|e| start + e.start_ns < reused_at - 300e6),
        "the keeper's line starts at the reuse: {:?}",
        sleeper.first()
    );
    // The new process's lines hold the new process only: nothing from
    // before it started (the old one's threads had the same tids).
    for name in ["cpu-burner", "sleeper-10ms", "ping", "pong"] {
        let tid = new.tid(name);
        let events: Vec<_> = space
            .planes
            .iter()
            .filter(|p| {
                p.name.starts_with(HOST_CPU) && p.lines.iter().any(|l| l.id == i64::from(tid))
            })
            .flat_map(|p| line_events(p, tid.into()))
            .collect();
        assert!(!events.is_empty(), "no line for {name} ({tid})");
        let first = events
            .iter()
            .map(|e| start + e.start_ns)
            .fold(f64::INFINITY, f64::min);
        assert!(
            first >= reused_at,
            "{name} ({tid}) has an event {} ms before the new process started",
            (reused_at - first) / 1e6
        );
    }
    let burner = line_events(host, new.tid("cpu-burner").into());
    assert!(xspace::sum_named(&burner, "Running") > 100e6, "{burner:?}");
}
