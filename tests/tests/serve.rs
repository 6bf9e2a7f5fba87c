//! `ebtrace serve` against real fixture processes, spoken to over real
//! gRPC on loopback: the recorded client requests, the request fields it
//! honours, concurrency, cancellation, shutdown, path safety, and leaks.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, MonitorRequest, ProfileRequest, StopContinuousProfilingRequest,
    TerminateRequest, profile_options::AdvancedConfigValue,
    profile_options::advanced_config_value::Value, profiler::XSpace,
};
use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    fixture::{SchedWorkload, build_c_shared},
    require_root, serial,
    serve::{
        ServeProcess, block_on, event_count, now_ns, real_request, request, with_advanced,
        xspace_of,
    },
    slow_link, xplane_files,
    xspace::{self, gpu_event_count, line_events, plane, plane_stats},
};
use tonic::Code;

const HOST_CPU: &str = "/host:CPU";

fn pid_arg(w: &SchedWorkload) -> String {
    w.pid.to_string()
}

/// Window length of a trace, ns.
fn window_ns(space: &XSpace) -> u64 {
    let (start, stop) = xspace::profile_window(space);
    stop - start
}

fn thread_lines(space: &XSpace) -> BTreeSet<i64> {
    plane(space, HOST_CPU)
        .lines
        .iter()
        .map(|l| l.id)
        .filter(|id| *id < 0xFFFF_0000)
        .collect()
}

fn advanced_pid(pid: u32) -> AdvancedConfigValue {
    AdvancedConfigValue {
        value: Some(Value::Int64Value(pid.into())),
    }
}

#[test]
fn recorded_client_requests_get_the_fixture_threads_back() {
    if !require_root("recorded_client_requests_get_the_fixture_threads_back") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;
        for name in [
            "profile_request_jax_collect_profile.bin",
            "profile_request_tf_client.bin",
            "profile_request_xprof_web_capture.bin",
        ] {
            let (_, req) = real_request(name);
            let saved_by_server = std::path::Path::new(&req.repository_root).join(&req.session_id);
            let existed = saved_by_server.exists();
            let asked = Instant::now();
            let response = client
                .profile(req.clone())
                .await
                .unwrap_or_else(|s| panic!("{name}: {s}"))
                .into_inner();
            let took = asked.elapsed();
            assert!(!response.empty_trace, "{name}: empty_trace");
            assert!(response.xspace.is_none(), "{name}: inline xspace");
            let space = xspace_of(&response);
            assert!(event_count(&space) > 0, "{name}");
            // The recorded start lies in the past: the capture starts at once
            // and lasts the requested 1000 ms.
            let window = window_ns(&space);
            assert!(
                (950e6..1200e6).contains(&(window as f64)),
                "{name}: {window}"
            );
            assert!(took >= Duration::from_millis(1000), "{name}: {took:?}");
            let host = plane(&space, HOST_CPU);
            xspace::assert_lines_nest(host);
            for thread in ["cpu-burner", "sleeper-10ms", "ping", "pong"] {
                let tid = i64::from(workload.tid(thread));
                let line = host
                    .lines
                    .iter()
                    .find(|l| l.id == tid)
                    .unwrap_or_else(|| panic!("{name}: no line for {thread}"));
                assert_eq!(line.name, thread);
            }
            let burner = line_events(host, workload.tid("cpu-burner").into());
            let running = xspace::sum_named(&burner, "Running");
            assert!(
                running > 0.2 * window as f64,
                "{name}: burner ran {running} ns"
            );
            let env = plane_stats(plane(&space, "Task Environment"));
            assert_eq!(env["ebtrace_pids"].as_str(), workload.pid.to_string());
            // Without --allow-write-under the server writes nothing itself.
            assert_eq!(
                saved_by_server.exists(),
                existed,
                "{name}: server wrote a file"
            );
        }
        // XProf's recorded request switches the flight recorder on; a
        // snapshot then holds the fixture's threads.
        let (_, continuous) = real_request("start_continuous_profiling_request_xprof.bin");
        client
            .start_continuous_profiling(continuous)
            .await
            .expect("StartContinuousProfiling");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let snapshot = client
            .get_snapshot(GetSnapshotRequest {
                snapshot_session_id: "recorded".into(),
            })
            .await
            .expect("GetSnapshot")
            .into_inner();
        let space = xspace_of(&snapshot);
        let host = plane(&space, HOST_CPU);
        let burner = line_events(host, workload.tid("cpu-burner").into());
        assert!(burner.iter().any(|e| e.name == "Running"));
        client
            .stop_continuous_profiling(StopContinuousProfilingRequest {})
            .await
            .expect("StopContinuousProfiling");
    });
}

#[test]
fn tracer_levels_zero_run_no_probe_and_answer_empty() {
    if !require_root("tracer_levels_zero_run_no_probe_and_answer_empty") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;
        assert_eq!(server.probe_fds(), 0);
        let mut req = request(600);
        // Host data (scheduler, TraceMe) and device data (CUDA) both off.
        req.opts.as_mut().unwrap().host_tracer_level = 0;
        req.opts.as_mut().unwrap().device_tracer_level = 0;
        let call = tokio::spawn(async move { client.profile(req).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(server.probe_fds(), 0, "probes were attached");
        let response = call.await.unwrap().unwrap().into_inner();
        assert!(response.empty_trace);
        let space = xspace_of(&response);
        assert_eq!(event_count(&space), 0);

        // The same with probes: not empty, and they were attached meanwhile.
        let mut client = server.client().await;
        let call = tokio::spawn(async move { client.profile(request(1000)).await });
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(server.probe_fds() > 0, "no probes attached");
        let response = call.await.unwrap().unwrap().into_inner();
        assert!(!response.empty_trace);
    });
}

#[test]
fn start_timestamp_is_waited_for_and_terminate_ends_early() {
    if !require_root("start_timestamp_is_waited_for_and_terminate_ends_early") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;

        let mut req = request(300);
        let start = now_ns() + 700_000_000;
        req.opts.as_mut().unwrap().start_timestamp_ns = start;
        let asked = Instant::now();
        let space = xspace_of(&client.profile(req).await.unwrap().into_inner());
        assert!(
            asked.elapsed() >= Duration::from_millis(1000),
            "{:?}",
            asked.elapsed()
        );
        let (begin, end) = xspace::profile_window(&space);
        assert!(
            // Never early; late only by what attaching takes on a busy machine.
            begin >= start - 2_000_000 && begin < start + 1_000_000_000,
            "window starts {} ms after the requested start",
            (begin as f64 - start as f64) / 1e6
        );
        assert!((290e6..400e6).contains(&((end - begin) as f64)));

        // A 20 s capture, terminated after about a second.
        let mut req = request(20_000);
        req.session_id = "terminate-me".into();
        let mut long_client = server.client().await;
        let asked = Instant::now();
        let call = tokio::spawn(async move { long_client.profile(req).await });
        tokio::time::sleep(Duration::from_millis(1000)).await;
        client
            .terminate(TerminateRequest {
                session_id: "terminate-me".into(),
            })
            .await
            .expect("terminate");
        let response = call.await.unwrap().expect("profile").into_inner();
        assert!(
            asked.elapsed() < Duration::from_secs(4),
            "{:?}",
            asked.elapsed()
        );
        assert!(!response.empty_trace);
        let space = xspace_of(&response);
        // It ended early: well before the 20 s asked for (the window opens once
        // the probes are attached, which may take a while on a busy machine).
        assert!((1.0..2500e6).contains(&(window_ns(&space) as f64)));
        assert!(
            space.warnings.iter().any(|w| w.contains("Terminate")),
            "{:?}",
            space.warnings
        );
        let unknown = client
            .terminate(TerminateRequest {
                session_id: "no-such-session".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(unknown.code(), Code::NotFound);
    });
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    if !require_root("bad_requests_are_refused_with_a_reason") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&[
            "--pid",
            &pid_arg(&workload),
            "--max-duration",
            "5s",
            "--max-start-delay",
            "10s",
        ]);
        let mut client = server.client().await;
        let mut far = request(100);
        far.opts.as_mut().unwrap().start_timestamp_ns = now_ns() + 60_000_000_000;
        let mut zero = request(0);
        zero.opts.as_mut().unwrap().duration_ms = 0;
        let cases: Vec<(ProfileRequest, &str)> = vec![
            (zero, "duration is 0"),
            (request(6000), "--max-duration"),
            (far, "--max-start-delay"),
            (
                with_advanced(request(100), "pid", advanced_pid(1)),
                "pid 1 is not watched",
            ),
            (
                with_advanced(
                    request(100),
                    "pid",
                    AdvancedConfigValue {
                        value: Some(Value::StringValue("12,twelve".into())),
                    },
                ),
                "not a pid",
            ),
        ];
        for (req, needle) in cases {
            let asked = Instant::now();
            let status = client.profile(req).await.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{status}");
            assert!(
                status.message().contains(needle),
                "{needle:?} not in {status}"
            );
            assert!(asked.elapsed() < Duration::from_millis(500), "refused late");
        }
        let status = client
            .monitor(MonitorRequest {
                duration_ms: 0,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(server.probe_fds(), 0);
        // Still serving.
        let ok = client
            .profile(with_advanced(
                request(200),
                "pid",
                advanced_pid(workload.pid),
            ))
            .await
            .expect("a valid request after bad ones");
        assert!(!ok.into_inner().empty_trace);
    });
}

#[test]
fn overlapping_captures_share_one_set_of_probes_up_to_the_limit() {
    if !require_root("overlapping_captures_share_one_set_of_probes_up_to_the_limit") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&[
            "--pid",
            &pid_arg(&workload),
            "--max-sessions",
            "2",
            "--max-sessions-per-caller",
            "3",
            "--keep-probes",
            "0",
        ]);
        let mut a_client = server.client().await;
        let mut b_client = server.client().await;
        let mut c_client = server.client().await;
        let a_sent = now_ns();
        let a = tokio::spawn(async move { a_client.profile(request(1500)).await });
        tokio::time::sleep(Duration::from_millis(400)).await;
        let one_capture_fds = server.probe_fds();
        assert!(one_capture_fds > 0);
        let b_sent = now_ns();
        let b = tokio::spawn(async move { b_client.profile(request(1500)).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            server.probe_fds(),
            one_capture_fds,
            "a second set of probes"
        );
        let c = c_client.profile(request(100)).await.unwrap_err();
        assert_eq!(c.code(), Code::ResourceExhausted, "{c}");
        assert!(
            c.message().contains("(ebtrace serve --max-sessions)"),
            "{c}"
        );

        let a = xspace_of(&a.await.unwrap().expect("a").into_inner());
        let b = xspace_of(&b.await.unwrap().expect("b").into_inner());
        let (a_start, a_stop) = xspace::profile_window(&a);
        let (b_start, b_stop) = xspace::profile_window(&b);
        // Each has its own 1.5 s window, about 0.4 s apart.
        for (start, stop) in [(a_start, a_stop), (b_start, b_stop)] {
            assert!((1450e6..1700e6).contains(&((stop - start) as f64)));
        }
        // a's window opens once its probes are attached; b joins them, so its
        // window opens as soon as it asks (or, on a machine so busy that
        // attaching took longer than the 300 ms between the requests, with
        // a's).
        assert!(
            a_start >= a_sent && a_start <= b_start,
            "a: {a_sent} {a_start}, b: {b_start}"
        );
        let b_delay = b_start as f64 - b_sent as f64;
        assert!(
            (0.0..500e6).contains(&b_delay),
            "b opened {b_delay} ns after it asked"
        );
        assert_eq!(thread_lines(&a), thread_lines(&b));
        // a's thread states were built while it recorded, b's from the
        // records at its end: where the windows overlap they are the same
        // (the threads that switch often; the CPU burner may run throughout).
        // Times in a trace are relative to its window's start.
        for thread in ["sleeper-10ms", "ping", "pong"] {
            let tid = workload.tid(thread).into();
            let inside = |space: &XSpace, window_start: u64| -> Vec<(String, i64, i64)> {
                line_events(plane(space, HOST_CPU), tid)
                    .into_iter()
                    .map(|e| {
                        let start = window_start as i64 + e.start_ns.round() as i64;
                        (e.name, start, e.duration_ns.round() as i64)
                    })
                    .filter(|(_, start, duration)| {
                        *start > b_start as i64 && start + duration < a_stop as i64
                    })
                    .collect()
            };
            let (in_a, in_b) = (inside(&a, a_start), inside(&b, b_start));
            assert!(
                in_a.len() > 10,
                "{thread}: {} events where the windows overlap",
                in_a.len()
            );
            assert_eq!(in_a.len(), in_b.len(), "{thread}");
            for (x, y) in in_a.iter().zip(&in_b) {
                let same = x.0 == y.0 && (x.1 - y.1).abs() <= 2 && (x.2 - y.2).abs() <= 2;
                assert!(same, "{thread}: {x:?} in a, {y:?} in b");
            }
        }
        assert!(
            server.wait_detached(Duration::from_secs(10)),
            "probes left attached"
        );
    });
}

#[test]
fn probes_stay_attached_across_sessions_and_record_nothing_between() {
    if !require_root("probes_stay_attached_across_sessions_and_record_nothing_between") {
        return;
    }
    let _serial = serial();
    block_on(async {
        // Between the two sessions the fixture keeps switching and waking
        // (ping and pong), and creates a thread that runs 200 ms and exits.
        let workload = SchedWorkload::start(&["--late-thread-ms", "4000"]);
        let server =
            ServeProcess::loopback(&["--pid", &pid_arg(&workload), "--keep-probes", "10s"]);
        let mut client = server.client().await;
        let first = client.profile(request(500)).await.expect("first capture");
        assert!(!first.into_inner().empty_trace);
        assert!(
            workload
                .wait_line("late_tid", Duration::from_millis(5))
                .is_none(),
            "the late thread started before the first capture ended"
        );
        let links = server.link_ids();
        assert!(!links.is_empty(), "probes detached after the first capture");
        let submitted = server.records_submitted();
        assert!(submitted > 0);

        let late = workload
            .wait_line("late_tid", Duration::from_secs(8))
            .expect("the fixture started its late thread");
        let late_tid = late["late_tid"].as_i64().unwrap();
        // It burns 200 ms of CPU: on a loaded machine that takes longer.
        let task = format!("/proc/{}/task/{late_tid}", workload.pid);
        let waited = Instant::now();
        while std::path::Path::new(&task).exists() {
            assert!(
                waited.elapsed() < Duration::from_secs(20),
                "the late thread never ended"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            server.records_submitted(),
            submitted,
            "records written while no capture was running"
        );

        let second = client.profile(request(500)).await.expect("second capture");
        assert_eq!(server.link_ids(), links, "probes attached again");
        assert!(server.records_submitted() > submitted);
        server.assert_probes_kept();
        let space = xspace_of(&second.into_inner());
        let host = plane(&space, HOST_CPU);
        // ping pauses 1 ms per round trip: hundreds of runs in 500 ms.
        let ping = line_events(host, workload.tid("ping").into());
        let runs = ping.iter().filter(|e| e.name == "Running").count();
        assert!(runs > 100, "ping ran {runs} times in the second capture");
        assert!(
            !thread_lines(&space).contains(&late_tid),
            "a thread that lived only between the captures is in the second"
        );

        // Many short captures on the same probes hold nothing over.
        let fds = server.open_fds();
        for _ in 0..20 {
            let r = client.profile(request(20)).await.expect("profile");
            assert!(!r.into_inner().empty_trace);
        }
        assert_eq!(server.open_fds(), fds, "descriptors leaked");
        assert_eq!(server.link_ids(), links);
        // Kept no longer than --keep-probes.
        assert!(
            server.wait_detached(Duration::from_secs(30)),
            "probes still attached long after --keep-probes"
        );
    });
}

#[test]
fn a_cancelled_capture_frees_its_probes() {
    if !require_root("a_cancelled_capture_frees_its_probes") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload), "--keep-probes", "0"]);
        let mut client = server.client().await;
        let call = tokio::spawn(async move { client.profile(request(20_000)).await });
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(server.probe_fds() > 0);
        // Dropping the call resets the HTTP/2 stream: the client cancels.
        call.abort();
        assert!(
            server.wait_detached(Duration::from_secs(10)),
            "probes left attached"
        );
        assert!(
            server
                .wait_line("the client went away", Duration::from_secs(5))
                .is_some()
        );
        let mut client = server.client().await;
        let next = client.profile(request(200)).await.expect("next capture");
        assert!(!next.into_inner().empty_trace);
    });
}

#[test]
fn a_watched_process_exiting_ends_the_capture_with_its_data() {
    if !require_root("a_watched_process_exiting_ends_the_capture_with_its_data") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&["--seconds", "1.2"]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;
        let asked = Instant::now();
        let response = client
            .profile(request(10_000))
            .await
            .expect("profile")
            .into_inner();
        assert!(
            asked.elapsed() < Duration::from_secs(4),
            "{:?}",
            asked.elapsed()
        );
        assert!(!response.empty_trace);
        let space = xspace_of(&response);
        assert!(
            space.warnings.iter().any(|w| w.contains("exited")),
            "{:?}",
            space.warnings
        );
        let host = plane(&space, HOST_CPU);
        let burner = line_events(host, workload.tid("cpu-burner").into());
        assert!(burner.iter().any(|e| e.name == "Thread exit"));
        // Nothing is left to watch now: the next request says so.
        let status = client.profile(request(100)).await.unwrap_err();
        assert_eq!(status.code(), Code::FailedPrecondition, "{status}");
        assert!(status.message().contains("exited"), "{status}");
    });
}

#[test]
fn monitor_summarizes_the_watched_processes() {
    if !require_root("monitor_summarizes_the_watched_processes") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;
        let round_trips_before = workload.counter("round_trips");
        let asked = Instant::now();
        let data = client
            .monitor(MonitorRequest {
                duration_ms: 600,
                monitoring_level: 1,
                timestamp: true,
            })
            .await
            .expect("monitor")
            .into_inner()
            .data;
        let elapsed = asked.elapsed();
        let round_trips = workload.counter("round_trips") - round_trips_before;
        assert!(elapsed >= Duration::from_millis(600));
        assert!(
            data.contains(&format!("pid {} (sched_workload): 5 threads", workload.pid)),
            "{data}"
        );
        // The burner spins: the process uses a good part of a core.
        let cpu: f64 = data
            .split("CPU use: ")
            .nth(1)
            .and_then(|s| s.split('%').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no CPU figure in {data}"));
        assert!(cpu > 30.0, "{data}");
        // Per round trip, ping sleeps and pong waits for it: two voluntary
        // switches at least (the fixture counts the round trips).
        let round_trips_per_s = round_trips as f64 / elapsed.as_secs_f64();
        assert!(round_trips_per_s > 50.0, "{round_trips} round trips");
        let switches: f64 = data
            .split("context switches: ")
            .nth(1)
            .and_then(|s| s.split('/').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no switch figure in {data}"));
        assert!(
            switches >= 1.6 * round_trips_per_s,
            "{round_trips_per_s:.0} round trips/s; {data}"
        );
        assert!(data.contains("kernel launches: n/a"), "{data}");
        assert!(data.contains("TraceMe events: n/a"), "{data}");
    });
}

#[test]
fn sigterm_answers_the_capture_in_flight_and_exits_zero() {
    if !require_root("sigterm_answers_the_capture_in_flight_and_exits_zero") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let mut server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;
        let call = tokio::spawn(async move { client.profile(request(20_000)).await });
        tokio::time::sleep(Duration::from_millis(800)).await;
        let status = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
        assert_eq!(status.code(), Some(0), "{:?}", server.lines());
        let response = call
            .await
            .unwrap()
            .expect("an answer, not an error")
            .into_inner();
        assert!(!response.empty_trace);
        let space = xspace_of(&response);
        assert!(
            space.warnings.iter().any(|w| w.contains("shutting down")),
            "{:?}",
            space.warnings
        );
        assert!(
            server
                .lines()
                .iter()
                .any(|l| l.contains("every probe is detached"))
        );
    });
}

/// A server told to stop while its answer is on its way to a client on a
/// slow link (1 MB/s): the client gets all of it.
#[test]
fn a_slow_client_gets_the_whole_answer_of_a_server_told_to_stop() {
    if !require_root("a_slow_client_gets_the_whole_answer_of_a_server_told_to_stop") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let mut server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = slow_link::client(server.addrs[0]).await;
        let call = tokio::spawn(async move { client.profile(request(20_000)).await });
        tokio::time::sleep(Duration::from_secs(4)).await;
        let status = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(30));
        assert_eq!(status.code(), Some(0), "{:?}", server.lines());
        let response = call.await.unwrap().expect("the whole answer").into_inner();
        let bytes = response
            .tool_data
            .iter()
            .map(|t| t.data.len())
            .sum::<usize>();
        assert!(
            bytes > 1 << 20,
            "{bytes} bytes: too little to be on its way at the end"
        );
        assert!(event_count(&xspace_of(&response)) > 0);
    });
}

#[test]
fn the_server_saves_only_inside_the_allowed_directory() {
    if !require_root("the_server_saves_only_inside_the_allowed_directory") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let scratch = TempDir::new("serve-write");
        let allowed = scratch.path().join("allowed");
        let outside = scratch.path().join("outside");
        std::fs::create_dir_all(&allowed).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        // Files the server creates take the allowed directory's owner.
        std::os::unix::fs::chown(&allowed, Some(65534), Some(65534)).unwrap();
        std::os::unix::fs::symlink(&outside, allowed.join("link-out")).unwrap();
        let server = ServeProcess::loopback(&[
            "--pid",
            &pid_arg(&workload),
            "--allow-write-under",
            allowed.to_str().unwrap(),
        ]);
        let mut client = server.client().await;

        let root = allowed.join("logs/plugins/profile");
        let mut req = request(200);
        req.repository_root = root.to_string_lossy().into_owned();
        req.session_id = "2026_11_22_01_02_03".into();
        req.host_name = "127.0.0.1:6009".into();
        let response = client.profile(req).await.expect("allowed").into_inner();
        let file = root.join("2026_11_22_01_02_03/127.0.0.1_6009.xplane.pb");
        assert_eq!(std::fs::read(&file).unwrap(), response.tool_data[0].data);
        for p in [&file, &root, &allowed.join("logs")] {
            use std::os::unix::fs::MetadataExt as _;
            assert_eq!(
                std::fs::metadata(p).unwrap().uid(),
                65534,
                "{}",
                p.display()
            );
        }

        // Anywhere else the server writes nothing, says so, and still
        // answers: the client saves the trace itself, as it would without
        // --allow-write-under.
        let a = allowed.to_str().unwrap();
        let escapes = [
            (format!("{a}/../outside/plugins/profile"), "run", "h:1"),
            (format!("{a}/link-out/plugins/profile"), "run", "h:1"),
            (outside.to_string_lossy().into_owned(), "run", "h:1"),
            (format!("{a}/logs"), "..", "h:1"),
            (format!("{a}/logs"), "run", "../../h"),
            ("logs/relative".to_string(), "run", "h:1"),
        ];
        for (i, (root, session, host)) in escapes.iter().enumerate() {
            let mut req = request(200);
            req.repository_root = root.clone();
            req.session_id = session.to_string();
            req.host_name = host.to_string();
            let response = client
                .profile(req)
                .await
                .unwrap_or_else(|s| panic!("{root} {session} {host}: {s}"))
                .into_inner();
            assert!(!response.empty_trace);
            assert!(event_count(&xspace_of(&response)) > 0);
            let said = Instant::now();
            while server.count_lines("not saved on this server") <= i {
                assert!(
                    said.elapsed() < Duration::from_secs(5),
                    "{root} {session} {host}: {:?}",
                    server.lines()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        assert!(xplane_files(&outside).is_empty());
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert_eq!(xplane_files(&allowed), vec![file]);

        // A server that was not allowed a directory writes nothing.
        drop(server);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload)]);
        let mut client = server.client().await;
        let mut req = request(200);
        req.repository_root = outside
            .join("plugins/profile")
            .to_string_lossy()
            .into_owned();
        client.profile(req).await.expect("profile");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    });
}

/// Checks that every arrow a trace's events draw has both its ends.
fn assert_links_have_both_ends(space: &XSpace, what: &str) {
    let links = xspace::links(space);
    assert_eq!(links.flows_out, links.flows_in, "{what}: wake-up flows");
    assert_eq!(links.calls, links.submitted, "{what}: correlation ids");
}

#[test]
fn max_events_bounds_the_answer_across_thread_and_gpu_tracks() {
    if !require_root("max_events_bounds_the_answer_across_thread_and_gpu_tracks") {
        return;
    }
    let _serial = serial();
    block_on(async {
        // Launches as fast as the stand-in driver takes them: about as many
        // GPU stream events as driver calls on the launching thread.
        let mut cuda = CudaWorkload::start(&["--bench-seconds", "120"]);
        cuda.go();
        // Four at once from one caller: more than a caller gets by default.
        let server = ServeProcess::loopback(&[
            "--pid",
            &cuda.pid.to_string(),
            "--max-sessions-per-caller",
            "4",
        ]);
        let mut client = server.client().await;
        let whole = xspace_of(
            &client
                .profile(request(300))
                .await
                .expect("profile")
                .into_inner(),
        );
        let total = event_count(&whole);
        let on_gpu = gpu_event_count(&whole);
        assert!(on_gpu > 1000, "{on_gpu} GPU events of {total}");
        assert_links_have_both_ends(&whole, "whole window");

        // Limits below the count of the thread lines alone, between it and
        // the total, and near the total, asked at once (one set of probes).
        let limits = [1, 300, 2 * total / 5, 3 * total / 4];
        let mut calls = Vec::new();
        for max in limits {
            let mut client = server.client().await;
            let mut req = request(300);
            req.max_events = max as u64;
            calls.push(tokio::spawn(
                async move { (max, client.profile(req).await) },
            ));
        }
        for call in calls {
            let (max, answer) = call.await.unwrap();
            let response = answer.unwrap_or_else(|s| panic!("max_events {max}: {s}"));
            let space = xspace_of(&response.into_inner());
            let events = event_count(&space);
            assert!(events <= max, "max_events {max}: {events} events");
            let cut = space.warnings.iter().any(|w| w.contains("max_events"));
            assert!(cut || max > 300, "max_events {max}: {:?}", space.warnings);
            for p in &space.planes {
                xspace::assert_lines_nest(p);
            }
            assert_links_have_both_ends(&space, &format!("max_events {max}"));
        }
        // Still serving.
        let after = client.profile(request(100)).await.expect("a capture after");
        assert!(!after.into_inner().empty_trace);
    });
}

#[test]
fn ipv6_loopback_and_several_listeners() {
    if !require_root("ipv6_loopback_and_several_listeners") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::start(
            &[
                "--pid",
                &pid_arg(&workload),
                "--bind",
                "[::1]:0",
                "--bind",
                "127.0.0.1:0",
            ],
            2,
        );
        assert!(server.addrs[0].is_ipv6() && server.addrs[1].is_ipv4());
        let mut client = server.client().await;
        let response = client.profile(request(200)).await.expect("over ::1");
        assert!(!response.into_inner().empty_trace);
    });
}

#[test]
fn discover_follows_processes_that_map_a_runtime_library() {
    if !require_root("discover_follows_processes_that_map_a_runtime_library") {
        return;
    }
    let _serial = serial();
    block_on(async {
        // A real shared object named like the CUDA driver, preloaded into one
        // fixture process: that one maps "libcuda.so.1", the other does not.
        let stub = build_c_shared("runtime_stub", "libcuda.so.1");
        let server = ServeProcess::loopback(&["--discover", "--discover-interval", "200ms"]);
        let mapped = SchedWorkload::start_with_env(&[], &[("LD_PRELOAD", stub.to_str().unwrap())]);
        let plain = SchedWorkload::start(&[]);
        let line = server
            .wait_line(
                &format!("watching pid {} (sched_workload)", mapped.pid),
                Duration::from_secs(5),
            )
            .unwrap_or_else(|| panic!("not discovered: {:?}", server.lines()));
        assert!(line.contains("libcuda.so.1"), "{line}");
        let mut client = server.client().await;
        let space = xspace_of(
            &client
                .profile(with_advanced(request(300), "pid", advanced_pid(mapped.pid)))
                .await
                .expect("profile")
                .into_inner(),
        );
        let lines = thread_lines(&space);
        assert!(lines.contains(&mapped.tid("cpu-burner").into()));
        assert!(!lines.contains(&plain.tid("cpu-burner").into()));
        let status = client
            .profile(with_advanced(request(300), "pid", advanced_pid(plain.pid)))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("not watched"), "{status}");
        // Without a pid the capture covers every discovered process (other
        // processes on this machine may map such libraries too).
        let space = xspace_of(&client.profile(request(300)).await.unwrap().into_inner());
        assert!(thread_lines(&space).contains(&mapped.tid("ping").into()));
        assert!(!thread_lines(&space).contains(&plain.tid("ping").into()));
    });
}

#[test]
fn two_hundred_captures_leak_no_descriptor_and_little_memory() {
    if !require_root("two_hundred_captures_leak_no_descriptor_and_little_memory") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let server = ServeProcess::loopback(&["--pid", &pid_arg(&workload), "--keep-probes", "0"]);
        let mut client = server.client().await;
        let mut capture = async |n: usize| {
            for _ in 0..n {
                let r = client.profile(request(20)).await.expect("profile");
                assert!(!r.into_inner().empty_trace);
            }
        };
        capture(20).await;
        assert!(server.wait_detached(Duration::from_secs(10)));
        let (fds, rss) = (server.open_fds(), server.rss_kib());
        let started = Instant::now();
        capture(200).await;
        assert!(server.wait_detached(Duration::from_secs(10)));
        assert_eq!(server.open_fds(), fds, "descriptors leaked");
        let after = server.rss_kib_settled(rss + 8 * 1024, Duration::from_secs(10));
        let grown = after as i64 - rss as i64;
        assert!(
            grown < 8 * 1024,
            "RSS grew by {grown} KiB over 200 captures (from {rss} KiB); largest mappings:\n{}",
            server.largest_mappings(8)
        );
        eprintln!(
            "200 captures in {:.1?}; RSS {rss} -> {} KiB",
            started.elapsed(),
            server.rss_kib()
        );
        assert_eq!(server.count_lines("ebtrace: session "), 220);
    });
}

#[test]
fn command_line_errors_exit_2_with_one_line() {
    let check = |args: &[&str], needle: &str| {
        let out = std::process::Command::new(ebtrace_tests::ebtrace_bin())
            .arg("serve")
            .args(args)
            .output()
            .expect("run ebtrace");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    };
    check(&[], "--pid");
    check(&["--pid", "4194999"], "no process with pid 4194999");
    check(
        &["-p", "1", "--bind", "localhost:6009"],
        "not an IP address",
    );
    check(&["--discover", "--pid", "1"], "cannot be used with");
    let me = std::process::id().to_string();
    for flag in ["--bind", "--http"] {
        check(
            &["-p", &me, flag, "0.0.0.0:0"],
            &format!(
                "{flag} 0.0.0.0:0 is not a loopback address, and ebtrace cannot tell who asks"
            ),
        );
    }
    if !require_root("command_line_errors_exit_2_with_one_line (privileged part)") {
        return;
    }
    check(
        &["-p", &me, "--allow-write-under", "/nonexistent/ebtrace"],
        "--allow-write-under",
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    check(&["-p", &me, "--bind", &addr], "cannot listen on");
}

/// `serve --off-cpu-min`: a capture lays the sleeper's waits with their
/// stacks, and its probes are detached at its end rather than kept (their
/// tracepoint slows every system call on the machine), while the flight
/// recorder beside it takes none.
#[test]
fn captures_take_off_cpu_stacks_and_do_not_keep_their_probes() {
    if !require_root("captures_take_off_cpu_stacks_and_do_not_keep_their_probes") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let server = ServeProcess::loopback(&[
        "--pid",
        &pid_arg(&workload),
        "--keep-probes",
        "5m",
        "--off-cpu-min",
        "5ms",
    ]);
    block_on(async {
        let mut client = server.client().await;
        let answer = client.profile(request(1000)).await.expect("capture");
        let space = xspace_of(&answer.into_inner());
        let sleeper = line_events(plane(&space, HOST_CPU), workload.tid("sleeper-10ms").into());
        let waits = sleeper
            .iter()
            .filter(|e| e.name == "waited in clock_nanosleep")
            .count();
        assert!(waits >= 70, "{waits} off-CPU stacks on the sleeper in 1 s");
        assert!(
            server.wait_detached(Duration::from_secs(10)),
            "the probes of a capture with off-CPU stacks were kept"
        );

        // The flight recorder, started by the client, takes none.
        client
            .start_continuous_profiling(request(1000))
            .await
            .expect("recorder on");
        tokio::time::sleep(Duration::from_millis(1500)).await;
    });
    let snapshot = server.snapshot("off-cpu");
    let sleeper = line_events(
        plane(&snapshot, HOST_CPU),
        workload.tid("sleeper-10ms").into(),
    );
    assert!(
        sleeper.iter().any(|e| e.name == "Blocked")
            && !sleeper.iter().any(|e| e.name.starts_with("waited in ")),
        "the flight recorder took off-CPU stacks"
    );
}
