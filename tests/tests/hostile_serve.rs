//! Every hostile target at once, beside a well-behaved process, under one
//! `serve --discover` with its flight recorder on: a loader cache that is
//! a FIFO or `/dev/zero`, a library truncated while mapped, a 1 TiB mapping
//! named like the C library, 65,536 code objects with 1 MiB line tables, a
//! program posing as its own agent that floods its answers or sends a
//! 100 MiB plane of empty events, and an agent held stopped. Any user can
//! start each of them where `--discover` finds it. The server answers a
//! capture of all of them on time, `/metrics` and `GetSnapshot` keep
//! answering, its memory stays within what it states, one line says what
//! each lost, and every process runs on.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use ebtrace_tests::{
    TempDir, cuda,
    fixture::{SchedWorkload, build_c_shared, read_schedstat},
    hostile::{SilencedAgent, Target, launching, wait_for_agent_thread},
    http, mkfifo,
    pyenv::{self, python_fixture},
    python::PythonWorkload,
    require_root, serial,
    serve::{ServeProcess, block_on, request, xspace_of},
    xspace::{self, line_events, plane},
};

/// What the flight recorder may take (`--retain-memory`, MiB).
const RETAIN_MIB: u64 = 256;

/// A copy of `library` at `dir/jaxlib/libjax_stub.so`: a process mapping
/// it looks like one that imported JAX, whose CUDA driver ebtrace then
/// looks for through the process's loader cache.
fn jaxlib_stub(library: &Path, dir: &Path) -> PathBuf {
    let jaxlib = dir.join("jaxlib");
    std::fs::create_dir_all(&jaxlib).unwrap();
    let copy = jaxlib.join("libjax_stub.so");
    std::fs::copy(library, &copy).unwrap();
    copy
}

/// Waits until `server` watches `pid`.
fn wait_watched(server: &ServeProcess, pid: u32, what: &str) {
    assert!(
        server
            .wait_line(&format!("watching pid {pid} "), Duration::from_secs(20))
            .is_some(),
        "{what} (pid {pid}) was not discovered: {:?}",
        server.lines()
    );
}

/// The time the control's `cpu-burner` ran in `space`, in ns.
fn burner_running_ns(
    space: &ebtrace_proto::tensorflow::profiler::XSpace,
    control: &SchedWorkload,
) -> f64 {
    let host = plane(space, "/host:CPU");
    let burner = line_events(host, control.tid("cpu-burner").into());
    xspace::sum_named(&burner, "Running")
}

#[test]
fn a_discovering_server_outlasts_every_hostile_target_at_once() {
    if !require_root("a_discovering_server_outlasts_every_hostile_target_at_once") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("hostile-serve");
    let stub = build_c_shared("runtime_stub", "libcuda.so.1");
    let preload = [("LD_PRELOAD", stub.to_str().unwrap())];
    let (lib_dir, _) = cuda::build();
    let libcuda = lib_dir.join("libcuda.so.1");
    let libcuda = libcuda.to_str().unwrap();
    let jaxlib = jaxlib_stub(&stub, dir.path());
    let fifo = dir.path().join("ld.so.cache");
    mkfifo(&fifo);
    for sub in ["truncated", "huge"] {
        std::fs::create_dir(dir.path().join(sub)).unwrap();
    }

    let control = SchedWorkload::start_with_env(&[], &preload);
    let mut targets = vec![
        (
            "a FIFO as its loader cache",
            Target::with_loader_cache(&fifo, Some(&jaxlib)),
        ),
        (
            "/dev/zero as its loader cache",
            Target::with_loader_cache(Path::new("/dev/zero"), Some(&jaxlib)),
        ),
        (
            "a library truncated while mapped",
            Target::with_truncated_library(&stub, &dir.path().join("truncated/libcuda.so.1")),
        ),
        (
            "a 1 TiB mapping named libc.so.6",
            Target::with_huge_c_library_mapping(&dir.path().join("huge"), &preload),
        ),
        (
            "an agent flooding its answers",
            Target::fake_agent(0, &["flood", libcuda]),
        ),
        (
            "an agent sending a 100 MiB plane",
            Target::fake_agent(0, &["plane", libcuda]),
        ),
    ];
    let mut many_codes = PythonWorkload::start_script(
        &pyenv::cpython(12),
        &python_fixture("many_codes.py"),
        &[],
        &preload,
    );
    let silent = launching();

    let server = ServeProcess::loopback(&[
        "--discover",
        "--discover-interval",
        "200ms",
        "--retain",
        "30s",
        "--retain-memory",
        &RETAIN_MIB.to_string(),
        "--http",
        "127.0.0.1:0",
    ]);
    wait_watched(&server, control.pid, "the control");
    for (what, target) in &targets {
        wait_watched(&server, target.pid, what);
    }
    wait_watched(&server, many_codes.pid, "many code objects");
    wait_watched(&server, silent.pid, "the agent held stopped");
    assert!(
        server
            .wait_line("flight recorder on", Duration::from_secs(20))
            .is_some(),
        "{:?}",
        server.lines()
    );
    let metrics_at = server.http_addr();

    let burner_on_cpu = || {
        read_schedstat(control.pid, control.tid("cpu-burner"))
            .expect("the control's schedstat")
            .on_cpu_ns as f64
    };
    let before_capture = burner_on_cpu();
    let (answer, took, slowest_scrape) = block_on(async {
        let mut client = server.client().await;
        let asked = Instant::now();
        let capture = tokio::spawn(async move { client.profile(request(4_000)).await });
        wait_for_agent_thread(silent.pid);
        let silenced = SilencedAgent::of(silent.pid);
        let mut slowest = Duration::ZERO;
        while !capture.is_finished() && asked.elapsed() < Duration::from_secs(60) {
            let scraped = Instant::now();
            let body =
                tokio::task::spawn_blocking(move || http::get(metrics_at, "/metrics").text())
                    .await
                    .unwrap();
            assert!(body.contains("ebtrace_"), "{body}");
            slowest = slowest.max(scraped.elapsed());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let answer = tokio::time::timeout(Duration::from_secs(1), capture)
            .await
            .unwrap_or_else(|_| panic!("no answer in 60 s: {:?}", server.lines()))
            .unwrap()
            .expect("the capture is answered");
        let took = asked.elapsed();
        drop(silenced);
        (answer.into_inner(), took, slowest)
    });
    let after_capture = burner_on_cpu();
    let lines = server.lines();
    // 4 s, the agent held stopped 10 s, and the loads.
    assert!(took < Duration::from_secs(30), "{took:?}: {lines:?}");
    // No target's agent ever holds /metrics.
    assert!(
        slowest_scrape < Duration::from_secs(2),
        "/metrics took {slowest_scrape:?}: {lines:#?}"
    );
    // The control's part of the 4 s: about what the kernel says it ran in
    // that share of the time the capture took.
    let space = xspace_of(&answer);
    let ran = burner_running_ns(&space, &control);
    let expected = (after_capture - before_capture) * 4.0 / took.as_secs_f64();
    assert!(
        ran > 0.5 * expected,
        "the control's cpu-burner ran {ran} ns of the capture; about {expected} expected"
    );

    // One line says what each that lost its part lost.
    let said = |needle: String| {
        let n = lines.iter().filter(|l| l.contains(&needle)).count();
        assert_eq!(n, 1, "{needle:?} said {n} times: {lines:?}");
    };
    said(format!(
        "the agent in pid {} sent more than 256 MiB",
        targets[4].1.pid
    ));
    said("silent for 10 s in answer to COLLECT".to_string());

    // The flight recorder kept recording meanwhile: the span its snapshot
    // holds (what --retain-memory keeps of all these processes) shows the
    // control, which never sleeps, running or runnable all along.
    let snapshot = server.snapshot("after-hostile");
    let host = plane(&snapshot, "/host:CPU");
    let burner = line_events(host, control.tid("cpu-burner").into());
    let span = burner.iter().map(|e| e.end_ns()).fold(0.0, f64::max)
        - burner.iter().map(|e| e.start_ns).fold(f64::MAX, f64::min);
    let known = xspace::sum_named(&burner, "Running") + xspace::sum_named(&burner, "Runnable");
    assert!(
        span > 2e9 && known > 0.9 * span,
        "the control's cpu-burner was running or runnable {known} ns of the {span} ns the \
         snapshot holds: {:?}",
        snapshot.warnings
    );

    // The recorder's memory, an answer at its bound, the plane's bytes,
    // and the code objects' and names' bounds.
    let peak_mib = server.peak_rss_kib() >> 10;
    let bound = RETAIN_MIB + 256 + 100 + 128;
    assert!(
        peak_mib < bound,
        "the server's resident memory peaked at {peak_mib} MiB (bound {bound}): {}",
        server.largest_mappings(8)
    );
    for (what, target) in &mut targets {
        assert!(target.alive(), "{what} died");
    }
    assert!(
        many_codes.wait_exit(Duration::ZERO).is_none(),
        "many code objects died"
    );
    println!("answered in {took:?}, /metrics at most {slowest_scrape:?}, peak {peak_mib} MiB");
}
