//! What a traced process controls cannot hang ebtrace or make it read
//! what it should not. Each target runs in a mount namespace of its own,
//! as any user can make one, where a file ebtrace reads is something
//! else: a FIFO or a device where its loader cache belongs; or its agent
//! stops answering. The capture still ends on time and writes its trace.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    hostile::{SilencedAgent, Target, launching, wait_for_agent_thread},
    inject::inject_check_once,
    mkfifo,
    pyenv::{self, python_fixture},
    python::PythonWorkload,
    require_root, serial,
    serve::{ServeProcess, block_on, request, timed_metrics_scrape, try_status_kib},
    signal, spawn_record, wait_with_deadline, xplane_files,
};

/// `ebtrace --pid` of `target` for 1 s ends within 20 s and writes a trace.
fn capture_ends_with_a_trace(target: &Target, what: &str) {
    let logdir = TempDir::new("hostile");
    let started = Instant::now();
    let child = spawn_record(&target.pid.to_string(), "1s", &logdir, &[]);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what}: ebtrace ended with {} after {:?}: {stderr}",
        out.status,
        started.elapsed()
    );
    assert_eq!(xplane_files(logdir.path()).len(), 1, "{what}: {stderr}");
}

#[test]
fn a_fifo_for_a_loader_cache_does_not_hang_a_capture() {
    if !require_root("a_fifo_for_a_loader_cache_does_not_hang_a_capture") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("hostile-fifo");
    let fifo = dir.path().join("ld.so.cache");
    mkfifo(&fifo);
    let target = Target::with_loader_cache(&fifo, None);
    capture_ends_with_a_trace(&target, "a FIFO as /etc/ld.so.cache");
}

#[test]
fn a_device_for_a_loader_cache_is_not_read() {
    if !require_root("a_device_for_a_loader_cache_is_not_read") {
        return;
    }
    let _serial = serial();
    let target = Target::with_loader_cache(Path::new("/dev/zero"), None);
    capture_ends_with_a_trace(&target, "/dev/zero as /etc/ld.so.cache");
}

/// An agent that stops answering mid-capture: Ctrl-C stops the capture,
/// and a second Ctrl-C writes the trace without what the agent still had,
/// within 2 s, saying so. The target runs on, and the next capture of it
/// gets its GPU activity again.
#[test]
fn a_second_ctrl_c_writes_the_trace_without_a_silent_agent() {
    if !require_root("a_second_ctrl_c_writes_the_trace_without_a_silent_agent") {
        return;
    }
    let _serial = serial();
    let workload = launching();
    let pid = workload.pid;
    let logdir = TempDir::new("silent-agent");
    let ebtrace = spawn_record(&pid.to_string(), "60s", &logdir, &[]);
    wait_for_agent_thread(pid);
    let silenced = SilencedAgent::of(pid);
    signal(ebtrace.id(), libc::SIGINT);
    std::thread::sleep(Duration::from_millis(1000));
    signal(ebtrace.id(), libc::SIGINT);
    let out = wait_with_deadline(ebtrace, Duration::from_secs(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("was abandoned: ebtrace was told to stop at once"),
        "{stdout}{stderr}"
    );
    assert_eq!(xplane_files(logdir.path()).len(), 1, "{stderr}");
    drop(silenced);

    // What the killed capture left is taken out by the next one.
    let logdir = TempDir::new("after-silent-agent");
    let out = wait_with_deadline(
        spawn_record(&pid.to_string(), "300ms", &logdir, &[]),
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("device activity: CUPTI"), "{stderr}");
}

/// A server told to stop while an agent it waits for is silent: the
/// capture in progress is answered, the agent's part abandoned after 10 s,
/// and the server is gone soon after.
#[test]
fn a_server_told_to_stop_does_not_wait_for_a_silent_agent() {
    if !require_root("a_server_told_to_stop_does_not_wait_for_a_silent_agent") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = launching();
        let mut server = ServeProcess::loopback(&["--pid", &workload.pid.to_string()]);
        let mut client = server.client().await;
        let capture = tokio::spawn(async move { client.profile(request(30_000)).await });
        wait_for_agent_thread(workload.pid);
        let silenced = SilencedAgent::of(workload.pid);
        let told = Instant::now();
        let status = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(25));
        let took = told.elapsed();
        assert!(status.success(), "{status}: {:?}", server.lines());
        assert!(
            took < Duration::from_secs(15),
            "{took:?}: {:?}",
            server.lines()
        );
        assert_eq!(
            server.count_lines("what the agents have still to hand over is abandoned"),
            1,
            "{:?}",
            server.lines()
        );
        let answered = capture
            .await
            .unwrap()
            .expect("the capture in progress is answered");
        assert!(!answered.into_inner().tool_data.is_empty());
        drop(silenced);
    });
}

/// A mapping of 1 TiB, executable, of a 4 KiB file named like the C
/// library (any process can make one): the load searches it for the C
/// library's code no further than a real one's size, and goes on.
#[test]
fn a_huge_mapping_named_like_the_c_library_is_read_within_bounds() {
    if !require_root("a_huge_mapping_named_like_the_c_library_is_read_within_bounds") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("hostile-huge-map");
    let mut target = Target::with_huge_c_library_mapping(dir.path(), &[]);
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(ok, "{stderr}");
    assert!(target.alive());
}

/// An agent that falls silent while a server's capture runs never holds
/// the server's `/metrics` (it reads what the server watches without
/// asking the server's hub, and the agents are asked on threads of their
/// own); it is asked nothing more after 10 s, one line says so, and the
/// capture ends on time.
#[test]
fn a_silent_agent_never_holds_a_servers_metrics() {
    if !require_root("a_silent_agent_never_holds_a_servers_metrics") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = launching();
        let server =
            ServeProcess::loopback(&["--pid", &workload.pid.to_string(), "--http", "127.0.0.1:0"]);
        let metrics_at = server.http_addr();
        let mut client = server.client().await;
        let asked = Instant::now();
        let capture = tokio::spawn(async move { client.profile(request(20_000)).await });
        wait_for_agent_thread(workload.pid);
        let silenced = SilencedAgent::of(workload.pid);
        let mut slowest = Duration::ZERO;
        while asked.elapsed() < Duration::from_secs(18) {
            slowest = slowest.max(timed_metrics_scrape(metrics_at).await);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(
            slowest < Duration::from_secs(2),
            "/metrics took {slowest:?}"
        );
        // Building the timeline of 20 s of launches as fast as the stand-in
        // driver takes them takes as long again, and longer under load.
        let answered = tokio::time::timeout(Duration::from_secs(120), capture)
            .await
            .expect("the capture is answered")
            .unwrap()
            .expect("the capture is answered");
        assert!(!answered.into_inner().tool_data.is_empty());
        // The window ends on time: what the answer took beyond building
        // the timeline is the window itself and little more (the silence
        // fell inside the window).
        let delivered = server
            .wait_line("ms after the request; timeline ", Duration::from_secs(5))
            .expect("the session's line");
        let (after_request, timeline) = answer_times(&delivered);
        assert!(
            after_request.saturating_sub(timeline) < Duration::from_secs(25),
            "{delivered}"
        );
        assert_eq!(
            server.count_lines("silent for 10 s in answer to COLLECT"),
            1,
            "{:?}",
            server.lines()
        );
        drop(silenced);
    });
}

/// Two targets whose GPU stopped answering as the window opens (their
/// CUPTI's flush never returns): the window opens after one 10 s silence,
/// not one for each, a line names each, and the trace is written.
#[test]
fn agents_silent_as_the_window_opens_hold_its_start_once_together() {
    if !require_root("agents_silent_as_the_window_opens_hold_its_start_once_together") {
        return;
    }
    let _serial = serial();
    let hung = [("STANDIN_CUPTI_FLUSH_HANGS", "1")];
    let workloads: Vec<_> = (0..2)
        .map(|_| {
            let mut w = CudaWorkload::start_with_cupti(&["--iters", "100000000"], &hung);
            w.go();
            w
        })
        .collect();
    let pids = format!("{},{}", workloads[0].pid, workloads[1].pid);
    let logdir = TempDir::new("hostile-window");
    let started = Instant::now();
    let child = spawn_record(&pids, "1s", &logdir, &[]);
    let out = wait_with_deadline(child, Duration::from_secs(90));
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    for w in &workloads {
        let said = format!("pid {}: opening the window: no answer", w.pid);
        assert_eq!(stderr.matches(&said).count(), 1, "{said}: {stderr}");
    }
    assert_eq!(
        stderr
            .matches("silent for 10 s in answer to WINDOW_OPEN")
            .count(),
        2,
        "{stderr}"
    );
    assert!(took < Duration::from_secs(18), "{took:?}: {stderr}");
    assert!(!xplane_files(logdir.path()).is_empty(), "{stderr}");
}

/// The times a server's session line gives: how long after the request
/// it was answered, and how long its timeline took to build.
fn answer_times(line: &str) -> (Duration, Duration) {
    let ms_before = |tail: &str| -> Duration {
        let at = line
            .find(tail)
            .unwrap_or_else(|| panic!("{tail:?} in {line}"));
        let digits = line[..at]
            .rsplit(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap();
        Duration::from_millis(digits.parse().unwrap_or_else(|_| panic!("{line}")))
    };
    (ms_before(" ms after the request"), ms_before(" ms, XSpace"))
}

/// A process that shows ever new code objects, each with a line table of
/// 1 MiB (65,536 of them, 128 deep on 8 threads): the capture ends on
/// time, ebtrace's memory stays within what it keeps for code objects,
/// and the frames it had no time to read say so.
#[test]
fn ever_new_large_code_objects_cost_a_bounded_capture() {
    if !require_root("ever_new_large_code_objects_cost_a_bounded_capture") {
        return;
    }
    let _serial = serial();
    let workload = PythonWorkload::start_script(
        &pyenv::cpython(12),
        &python_fixture("many_codes.py"),
        &[],
        &[],
    );
    let logdir = TempDir::new("many-codes");
    let mut ebtrace = spawn_record(
        &workload.pid.to_string(),
        "3s",
        &logdir,
        &["--sample-hz", "99"],
    );
    // ebtrace alone takes about 100 MiB; code objects 64 MiB more.
    const MOST_KIB: u64 = 400 << 10;
    let started = Instant::now();
    let mut peak_kib = 0;
    while ebtrace.try_wait().unwrap().is_none() {
        peak_kib = peak_kib.max(try_status_kib(ebtrace.id(), "VmRSS:").unwrap_or(0));
        if peak_kib > MOST_KIB || started.elapsed() > Duration::from_secs(60) {
            let _ = ebtrace.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = started.elapsed();
    let out = wait_with_deadline(ebtrace, Duration::from_secs(5));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(peak_kib <= MOST_KIB, "{peak_kib} KiB after {took:?}");
    assert!(out.status.success(), "{}: {stderr}", out.status);
    assert!(took < Duration::from_secs(20), "{took:?}: {stderr}");
    let trace = std::fs::read(&xplane_files(logdir.path())[0]).unwrap();
    let holds = |text: &str| trace.windows(text.len()).any(|w| w == text.as_bytes());
    assert!(
        holds("[python frame: not read, too many new code objects]"),
        "no frame marked as not read"
    );
    assert!(holds("many_codes.py"), "no frame named");
}
