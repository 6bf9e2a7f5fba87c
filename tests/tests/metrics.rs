//! `ebtrace serve --http`: Prometheus metrics of the watched processes,
//! checked against `/proc`, against `promtool check metrics`, and scraped
//! by a real Prometheus server (Debian's `prometheus` package).

use std::{
    io::Write as _,
    net::SocketAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    debian_tool,
    fixture::SchedWorkload,
    http,
    prometheus::Prometheus,
    require_root, serial,
    serve::{ServeProcess, block_on, request},
};

/// `ebtrace serve --pid PID --http 127.0.0.1:0`, and its HTTP address.
fn serve_with_metrics(pid: u32) -> (ServeProcess, SocketAddr) {
    let server = ServeProcess::loopback(&["--pid", &pid.to_string(), "--http", "127.0.0.1:0"]);
    let addr = server.http_addr();
    (server, addr)
}

/// `GET path`: (status, content type, body).
fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let response = http::get(addr, path);
    let content_type = response
        .header("content-type")
        .unwrap_or_default()
        .to_string();
    (response.status, content_type, response.text())
}

/// The value of `name` for `pid` in an exposition.
fn sample(body: &str, name: &str, pid: u32) -> Option<f64> {
    let labels = format!("pid=\"{pid}\"");
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&labels))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// What `/proc` says of `pid` now: its CPU seconds (`stat`: utime +
/// stime, in the 100 ticks a second `/proc` always uses) and its live
/// threads' voluntary context switches (`status`).
fn proc_totals(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<u64> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let cpu = (fields[11] + fields[12]) as f64 / 100.0;
    let mut voluntary = 0u64;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    for entry in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(entry.path().join("status")) {
            voluntary += s
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .map_or(0, |v| v.trim().parse::<u64>().unwrap());
        }
    }
    (cpu, voluntary)
}

#[test]
fn metrics_agree_with_proc_and_pass_promtool() {
    if !require_root("metrics_agree_with_proc_and_pass_promtool") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let (server, addr) = serve_with_metrics(workload.pid);
    std::thread::sleep(Duration::from_millis(500));

    let before = proc_totals(workload.pid);
    let (status, content_type, body) = get(addr, "/metrics");
    let after = proc_totals(workload.pid);
    assert_eq!(status, 200, "{body}");
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    // The fixture's threads all live through the test: /proc's sums
    // bracket what ebtrace read between the two readings.
    let cpu = sample(&body, "ebtrace_process_cpu_seconds_total", workload.pid).expect(&body);
    assert!(
        before.0 - 0.001 <= cpu && cpu <= after.0 + 0.001,
        "on-CPU {cpu} s, /proc {} .. {} s",
        before.0,
        after.0
    );
    // cpu-burner spins: at least ~0.3 s of CPU since the start.
    assert!(cpu > 0.3, "{cpu}");
    let voluntary = sample(
        &body,
        "ebtrace_process_voluntary_switches_total",
        workload.pid,
    )
    .expect(&body) as u64;
    assert!(
        before.1 <= voluntary && voluntary <= after.1,
        "voluntary {voluntary}, /proc {} .. {}",
        before.1,
        after.1
    );
    assert_eq!(
        sample(&body, "ebtrace_process_threads", workload.pid),
        Some(5.0),
        "{body}"
    );
    assert!(body.contains("ebtrace_watched_processes 1"), "{body}");
    assert!(body.contains("ebtrace_resident_memory_bytes "), "{body}");

    let (status, _, _) = get(addr, "/nothing");
    assert_eq!(status, 404);

    // A capture is counted once answered.
    assert!(body.contains("ebtrace_captures_total 0\n"), "{body}");
    block_on(async {
        let mut client = server.client().await;
        client.profile(request(200)).await.expect("a capture");
    });
    let (_, _, after_capture) = get(addr, "/metrics");
    assert!(
        after_capture.contains("ebtrace_captures_total 1\n"),
        "{after_capture}"
    );

    // The probe-based series need the flight recorder.
    assert!(!body.contains("ebtrace_process_cuda_"), "{body}");
    promtool_accepts(&body);
}

/// `promtool check metrics` passes on `body` (where Debian's promtool is
/// installed).
fn promtool_accepts(body: &str) {
    let Some(promtool) = debian_tool("promtool") else {
        return;
    };
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    check
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_flight_recorder_counts_cuda_launches_and_sync_waits_as_the_workload_does() {
    if !require_root("the_flight_recorder_counts_cuda_launches_and_sync_waits_as_the_workload_does")
    {
        return;
    }
    let _serial = serial();
    // --early: the driver is loaded before the recorder attaches (and
    // --discover watches the processes that map it). --own-cupti: the
    // program profiles itself, which runs the stand-in GPU: the
    // synchronizing calls wait for its work.
    let args = ["--early", "--own-cupti", "--iters", "300", "--linger"];
    let first = CudaWorkload::start_with_cupti(&args, &[]);
    let server = ServeProcess::loopback(&[
        "--discover",
        "--discover-interval",
        "200ms",
        "--retain",
        "30s",
        "--http",
        "127.0.0.1:0",
    ]);
    let addr = server.http_addr();
    assert!(
        server
            .wait_line("flight recorder on", Duration::from_secs(10))
            .is_some(),
        "{:?}",
        server.lines()
    );
    // A process started once the recorder runs is taken on, its driver
    // probed from then.
    let later = CudaWorkload::start_with_cupti(&args, &[]);
    assert!(
        server
            .wait_line(
                &format!("recording pid {} ", later.pid),
                Duration::from_secs(10)
            )
            .is_some(),
        "{:?}",
        server.lines()
    );
    for mut workload in [first, later] {
        let pid = workload.pid;
        let launches = |body: &str| sample(body, "ebtrace_process_cuda_launches_total", pid);
        let waited = |body: &str| sample(body, "ebtrace_process_cuda_sync_wait_seconds_total", pid);
        let (_, _, body) = get(addr, "/metrics");
        assert_eq!(launches(&body), Some(0.0), "{body}");

        // The workload's own account: its successful launch calls (a
        // launch with a zero grid fails and is not counted), and the time
        // it spent inside the synchronizing calls.
        let report = workload.run_and_linger(Duration::from_secs(60));
        let expected: u64 = report["calls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| {
                let f = c["function"].as_str().unwrap();
                c["result"] == 0 && (f.starts_with("cuLaunch") || f.starts_with("cuGraphLaunch"))
            })
            .map(|c| c["count"].as_u64().unwrap())
            .sum();
        assert!(expected >= 900, "{report}");
        let deadline = Instant::now() + Duration::from_secs(5);
        let body = loop {
            let (_, _, body) = get(addr, "/metrics");
            if launches(&body) == Some(expected as f64) || Instant::now() > deadline {
                break body;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(launches(&body), Some(expected as f64), "pid {pid}: {body}");
        // ebtrace times each call from inside it (entry to return probe):
        // a little less than the workload, which also counts the probes'
        // traps.
        let own = report["sync_wait_ns"].as_f64().unwrap() / 1e9;
        let seen = waited(&body).expect(&body);
        assert!(own > 0.0, "{report}");
        assert!(
            seen <= own + 1e-4 && seen >= 0.5 * own,
            "pid {pid}: ebtrace {seen} s in synchronizing calls, the workload {own} s"
        );
        promtool_accepts(&body);
    }
    assert_eq!(
        server.count_lines("flight recorder on"),
        1,
        "the recorder started again for the new process: {:?}",
        server.lines()
    );
}

#[test]
fn a_real_prometheus_scrapes_the_watched_process() {
    if !require_root("a_real_prometheus_scrapes_the_watched_process") {
        return;
    }
    let Some(prometheus) = debian_tool("prometheus") else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let (_server, metrics) = serve_with_metrics(workload.pid);
    let dir = TempDir::new("prometheus");
    let prom = Prometheus::start(&prometheus, dir.path(), metrics, "");

    // The fixture's cpu-burner spins on one CPU: its process runs about
    // one CPU-second per second (less when the machine is busy).
    let query = format!(
        "rate(ebtrace_process_cpu_seconds_total{{pid=\"{}\"}}[4s])",
        workload.pid
    );
    let rate = prom
        .wait_value(&query, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("no {query} in Prometheus: {}", prom.log()));
    assert!((0.3..=2.05).contains(&rate), "{query} = {rate}");
    let up = prom.wait_value("up{job=\"ebtrace\"}", Duration::from_secs(5));
    assert_eq!(up, Some(1.0));
    // ping and pong block on each other every millisecond.
    let query = format!(
        "rate(ebtrace_process_voluntary_switches_total{{pid=\"{}\"}}[4s])",
        workload.pid
    );
    let switches = prom
        .wait_value(&query, Duration::from_secs(10))
        .expect(&query);
    assert!(switches > 200.0, "{query} = {switches}");
}
