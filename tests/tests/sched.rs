//! Scheduling capture of a real fixture process, checked against the
//! kernel's own per-thread accounting (`/proc/.../schedstat`) and the
//! fixture's counters.

use std::{collections::HashSet, time::Duration};

use ebtrace_tests::{
    TempDir,
    fixture::{SchedWorkload, SchedstatSampler},
    loaded_bpf_program_names, record, require_root, serial, spawn_record, spawn_record_with_env,
    wait_with_deadline, xplane_files,
    xspace::{self, Event, line_events, plane, sum_named},
};

const CPU_LINE_BASE: i64 = 0xFFFF_0000;

fn one_trace(dir: &TempDir) -> ebtrace_proto::tensorflow::profiler::XSpace {
    let files = xplane_files(dir.path());
    assert_eq!(files.len(), 1, "expected one trace, found {files:?}");
    let space = xspace::load(&files[0]);
    let file_name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(file_name, format!("{}.xplane.pb", space.hostnames[0]));
    assert!(
        files[0]
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .ends_with("plugins/profile"),
        "{files:?}"
    );
    space
}

/// Switches and wake-ups through raw tracepoints (where the kernel has
/// BTF; checked against the route ebtrace names).
#[test]
fn thread_states_match_schedstat_and_fixture() {
    if !require_root("thread_states_match_schedstat_and_fixture") {
        return;
    }
    let raw = std::path::Path::new("/sys/kernel/btf/vmlinux").exists();
    let route = if raw {
        "scheduling: raw tracepoints"
    } else {
        "scheduling: classic tracepoints"
    };
    thread_states_match(&[], route);
}

/// The same, through the classic tracepoints, as on kernels without BTF.
#[test]
fn thread_states_match_schedstat_and_fixture_through_classic_tracepoints() {
    if !require_root("thread_states_match_schedstat_and_fixture_through_classic_tracepoints") {
        return;
    }
    thread_states_match(
        &[("EBTRACE_SCHED_TRACEPOINTS", "classic")],
        "scheduling: classic tracepoints (EBTRACE_SCHED_TRACEPOINTS=classic)",
    );
}

/// Records the scheduling fixture with `env` and checks every thread's
/// states against schedstat and the fixture's own counters; `route` is the
/// line ebtrace must name its route with.
fn thread_states_match(env: &[(&str, &str)], route: &str) {
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    std::thread::sleep(Duration::from_millis(200));
    let names = ["cpu-burner", "sleeper-10ms", "ping", "pong"];
    let tids: Vec<u32> = names.iter().map(|n| workload.tid(n)).collect();
    // The fixture's own counters, sampled with schedstat, tell how many
    // round trips and sleeps fell inside the capture window.
    let counters = vec![
        workload.counter_addr("round_trips"),
        workload.counter_addr("ping_waits"),
        workload.counter_addr("sleeps"),
    ];
    let sampler = SchedstatSampler::start(
        workload.pid,
        tids.clone(),
        counters,
        Duration::from_millis(2),
    );
    std::thread::sleep(Duration::from_millis(50));

    let logdir = TempDir::new("sched");
    let pid = workload.pid.to_string();
    let out = spawn_record_with_env(&pid, "2s", &logdir, &["--json"], env)
        .wait_with_output()
        .expect("ebtrace runs");
    std::thread::sleep(Duration::from_millis(50));
    let series = sampler.finish();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ebtrace failed: {stderr}\n{stdout}");
    assert!(stderr.contains(route), "{route:?} not in {stderr}");
    // A process without a CUDA driver or a TraceMe recorder is not a
    // problem: each is said in a plain line, and no line claims that only
    // scheduling is traced (stacks, say, may be too).
    let no_driver = format!(
        "pid {} (sched_workload): no libcuda.so.1 loaded or on its library path",
        workload.pid
    );
    assert!(stderr.contains(&no_driver), "{no_driver:?} not in {stderr}");
    assert!(
        !stderr.contains("warning:") && !stderr.contains("scheduling only"),
        "{stderr}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let records = &summary["records"];
    for lost in [
        "ring_buffer_full",
        "thread_map_full",
        "probe_maps_full",
        "malformed",
    ] {
        assert_eq!(records[lost], 0, "{lost}: {records}");
    }
    // The kernel skips a tracepoint's program when it fires while another
    // BPF program runs on that CPU (an interrupt during one): rare, counted
    // and said, never silent; the states around it show as Unknown.
    assert!(
        records["missed_by_kernel"].as_u64().is_some_and(|n| n <= 2),
        "{records}"
    );
    let threads = workload.threads.clone();
    let tid_of = |name: &str| threads[name];
    let counters = workload.stop();
    assert!(counters["round_trips"].as_i64().unwrap() > 0);

    let space = one_trace(&logdir);
    let (start, stop) = xspace::profile_window(&space);
    let window = (stop - start) as f64;
    assert!(
        (1.9e9..2.5e9).contains(&window),
        "window {window} ns for a 2 s capture"
    );
    let host = plane(&space, "/host:CPU");
    xspace::assert_lines_nest(host);

    for (name, &tid) in names.iter().zip(&tids) {
        let line = host
            .lines
            .iter()
            .find(|l| l.id == i64::from(tid))
            .unwrap_or_else(|| panic!("no line for {name} ({tid})"));
        assert_eq!(line.name, *name);
        let events = line_events(host, line.id);
        let on_cpu = sum_named(&events, "Running");
        let runnable = sum_named(&events, "Runnable");
        let unknown = sum_named(&events, "Unknown");
        let kernel = (series.at(tid, stop) - series.at(tid, start)) as f64;
        let runs = events
            .iter()
            .filter(|e| e.name == "Running" && e.start_ns > 0.0)
            .count() as f64;
        // schedstat lags a running thread by up to a tick, and 0.5 ms
        // covers sampling at the edges of tiny totals.
        let slack = 0.5e6;
        // Time the hypervisor took the CPU from a running thread is in the
        // trace's Running and not in schedstat.
        let stolen = series.steal_bound_ns() as f64;
        // At each switch, the kernel charges the thread before the switch's
        // tracepoint fires: the time between, the probe's own run included
        // (longer through a classic tracepoint), is in the trace's Running
        // and not in schedstat. A thread that runs thousands of short turns
        // (ping-pong) adds it up to a ms or two on a loaded machine.
        let per_switch = 500.0 * runs;
        let report = format!(
            "{name}: trace {:.3} ms on CPU in {runs} turns ({:.3} runnable, {:.3} unknown), \
             schedstat {:.3} ms, steal at most {:.0} ms",
            on_cpu / 1e6,
            runnable / 1e6,
            unknown / 1e6,
            kernel / 1e6,
            stolen / 1e6
        );
        if *name == "cpu-burner" {
            // An interval the kernel reported no switch for is Unknown:
            // the burner ran for some of it, or none.
            assert!(on_cpu <= 1.05 * kernel + stolen + slack, "{report}");
            assert!(kernel <= 1.05 * (on_cpu + unknown) + slack, "{report}");
        } else {
            // When a wake-up preempts the current task the kernel skips
            // the next run-queue clock update, so schedstat starts counting
            // at the wake-up: it may include part of the runnable wait, but
            // never less than the time between switch-in and switch-out.
            assert!(
                kernel + stolen >= 0.95 * on_cpu - slack - per_switch,
                "{report}"
            );
            assert!(
                kernel <= 1.05 * (on_cpu + runnable + unknown) + slack,
                "{report}"
            );
        }
        // And the number of times it ran agrees with the kernel's count.
        let unknowns = events.iter().filter(|e| e.name == "Unknown").count() as f64;
        let kernel_runs =
            series.timeslices_at(tid, stop) as f64 - series.timeslices_at(tid, start) as f64;
        assert!(
            (runs - kernel_runs).abs() <= 0.02 * kernel_runs + unknowns + 2.0,
            "{name}: {runs} switch-ins traced ({unknowns} unknown intervals), schedstat {kernel_runs}"
        );
        // States partition the window.
        let covered = on_cpu + runnable + sum_named(&events, "Blocked") + unknown;
        assert!(
            (covered - window).abs() < 1e6,
            "{name}: states cover {covered} of {window} ns"
        );
    }

    let burner = line_events(host, i64::from(tid_of("cpu-burner")));
    assert!(
        sum_named(&burner, "Running") > 0.5 * window,
        "the CPU burner should run most of the time"
    );

    let in_window = |i: usize| (series.counter_at(i, stop) - series.counter_at(i, start)) as f64;
    let (round_trips, ping_waits, sleeps_done) = (in_window(0), in_window(1), in_window(2));

    // The sleeper blocks once per sleep the fixture counted, for at least
    // the 10 ms asked and at most the sleeps' mean period.
    let sleeper = line_events(host, i64::from(tid_of("sleeper-10ms")));
    let mut sleeps: Vec<f64> = sleeper
        .iter()
        .filter(|e| e.name == "Blocked" && e.stats["prev_state"].as_str().starts_with('S'))
        .map(|e| e.duration_ns)
        .collect();
    sleeps.sort_by(f64::total_cmp);
    assert!(
        sleeps_done >= 20.0,
        "the fixture slept only {sleeps_done} times"
    );
    assert!(
        (sleeps.len() as f64 - sleeps_done).abs() <= 0.02 * sleeps_done + 3.0,
        "{} sleeps traced, the fixture counted {sleeps_done}",
        sleeps.len()
    );
    let median = sleeps[sleeps.len() / 2];
    let mean_period = window / sleeps_done;
    assert!(
        median >= 9.5e6 && median <= 1.1 * mean_period,
        "median sleep {:.3} ms, expected 10 ms to {:.3} ms",
        median / 1e6,
        mean_period / 1e6
    );

    // Ping wakes pong once per round trip; pong wakes ping each time ping
    // slept waiting for the reply (the fixture counts both; ping's by its
    // own voluntary switches around the wait). Each wake-up has a flow
    // from waker to woken.
    // Ping waits only for a reply not there yet: where pong, woken, runs at
    // once on ping's CPU (preempting it), the reply is there before ping
    // reads, and ping may hardly wait at all. The count checked below is
    // the fixture's, however small.
    assert!(round_trips >= 50.0, "only {round_trips} round trips");
    for (waker, woken, expected) in [("ping", "pong", round_trips), ("pong", "ping", ping_waits)] {
        let (waker_tid, woken_tid) = (tid_of(waker), tid_of(woken));
        let woken_events = line_events(host, i64::from(woken_tid));
        let wakeups: Vec<&Event> = woken_events
            .iter()
            .filter(|e| {
                e.name == "Runnable"
                    && e.stats.get("cause").map(|c| c.as_str()) == Some("woken")
                    && e.stats["waker_tid"].as_i64() == i64::from(waker_tid)
            })
            .collect();
        // A timer interrupt landing while the other thread runs is also
        // recorded with it as the waker, hence the small excess allowed.
        let n = wakeups.len() as f64;
        assert!(
            n >= 0.95 * expected - 3.0 && n <= 1.05 * expected + 3.0,
            "{woken} woken by {waker} {n} times, the fixture counted {expected}"
        );
        // A wake-up whose other end fell outside the window has lost its
        // flow (the window prunes dangling links): at most one per edge.
        let out_flows: HashSet<u64> = line_events(host, i64::from(waker_tid))
            .iter()
            .filter(|e| e.name == "Wakeup" && e.stats["woken_tid"].as_i64() == i64::from(woken_tid))
            .filter_map(|e| e.stats.get("flow").map(|f| f.as_u64()))
            .map(|f| {
                assert_eq!(f & 3, 2, "waker side is an outgoing flow");
                f >> 2
            })
            .collect();
        let matched = wakeups
            .iter()
            .filter(|e| {
                e.stats.get("flow").map(|f| f.as_u64()).is_some_and(|f| {
                    assert_eq!(f & 3, 1, "woken side is an incoming flow");
                    out_flows.contains(&(f >> 2))
                })
            })
            .count();
        assert!(
            matched + 1 >= wakeups.len(),
            "{matched} of {} wake-ups of {woken} have their flow",
            wakeups.len()
        );
    }

    // Per-CPU lines, on their own plane, mirror the threads' running
    // slices.
    assert!(host.lines.iter().all(|l| l.id < CPU_LINE_BASE));
    let cpus = plane(&space, "/host:CPU per CPU");
    let burner_tid = i64::from(tid_of("cpu-burner"));
    let on_cpu_lines: f64 = cpus
        .lines
        .iter()
        .flat_map(|l| {
            assert!(l.id >= CPU_LINE_BASE, "{}", l.id);
            assert!(l.name.starts_with("CPU "), "{}", l.name);
            line_events(cpus, l.id)
        })
        .filter(|e| e.stats["tid"].as_i64() == burner_tid)
        .map(|e| e.duration_ns)
        .sum();
    assert!((on_cpu_lines - sum_named(&burner, "Running")).abs() < 1.0);
}

/// `--json` prints one object on stdout saying what the trace holds: its
/// path, window and record count as the XSpace states them, the target
/// and its threads as the fixture names them, and per thread the totals
/// that the thread's line in the trace adds up to.
#[test]
fn json_summary_agrees_with_the_trace_it_describes() {
    if !require_root("json_summary_agrees_with_the_trace_it_describes") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    std::thread::sleep(Duration::from_millis(100));
    let logdir = TempDir::new("json");
    let pid = workload.pid.to_string();
    let out = record(&pid, "1s", &logdir, &["--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ebtrace failed: {stderr}\n{stdout}");
    let threads = workload.threads.clone();
    drop(workload);
    assert_eq!(
        stdout.lines().count(),
        1,
        "one JSON line on stdout: {stdout}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    // The summary for people moved to stderr.
    assert!(stderr.contains(" records captured, "), "{stderr}");

    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(json["trace"].as_str(), files[0].to_str(), "{json}");
    assert!(json["perfetto_trace"].is_null());
    let space = one_trace(&logdir);

    let (start, stop) = xspace::profile_window(&space);
    let window = &json["window"];
    assert_eq!(window["start_unix_ns"].as_u64(), Some(start), "{window}");
    assert_eq!(window["stop_unix_ns"].as_u64(), Some(stop), "{window}");
    let duration = window["duration_ns"].as_u64().unwrap();
    assert_eq!(duration, stop - start);
    assert_eq!(json["requested_duration_ns"].as_u64(), Some(1_000_000_000));
    assert!(
        (0.95e9..2.0e9).contains(&(duration as f64)),
        "window {duration} ns for a 1 s capture"
    );
    assert!(json["attach_ns"].as_u64().unwrap() > 0, "{json}");
    assert!(json["ended_early"].is_null(), "{json}");

    let env = xspace::plane_stats(plane(&space, "Task Environment"));
    let records = &json["records"];
    assert_eq!(
        records["captured"].as_u64(),
        Some(env["ebtrace_records"].as_u64())
    );
    assert!(records["captured"].as_u64().unwrap() > 1000, "{records}");
    assert_eq!(records["dropped"].as_u64(), Some(0), "{records}");
    assert_eq!(
        json["unreported_transitions"].as_u64(),
        Some(env["ebtrace_unreported_transitions"].as_u64())
    );

    let processes = json["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 1, "{json}");
    assert_eq!(
        processes[0]["pid"].as_u64(),
        Some(u64::from(pid.parse::<u32>().unwrap()))
    );
    assert_eq!(processes[0]["name"], "sched_workload");
    assert_eq!(processes[0]["exited"], false);

    // Every thread of the summary has its line in the trace, and the other
    // way round; the fixture's own threads are among them, by their names.
    let host = plane(&space, "/host:CPU");
    let blocked = space
        .planes
        .iter()
        .find(|p| p.name == "/host:CPU threads blocked throughout");
    let json_threads = json["threads"].as_array().unwrap();
    let line_ids: HashSet<i64> = host
        .lines
        .iter()
        .chain(blocked.into_iter().flat_map(|p| &p.lines))
        .map(|l| l.id)
        .collect();
    let json_tids: HashSet<i64> = json_threads
        .iter()
        .map(|t| t["tid"].as_i64().unwrap())
        .collect();
    assert_eq!(json_tids, line_ids);
    assert_eq!(
        processes[0]["threads"].as_u64(),
        Some(json_tids.len() as u64)
    );
    for (name, tid) in &threads {
        let t = json_threads
            .iter()
            .find(|t| t["tid"].as_u64() == Some(u64::from(*tid)))
            .unwrap_or_else(|| panic!("no thread {name} ({tid}) in {json}"));
        assert_eq!(t["name"].as_str(), Some(&name[..name.len().min(15)]));
    }
    for t in json_threads {
        let tid = t["tid"].as_i64().unwrap();
        let on = if host.lines.iter().any(|l| l.id == tid) {
            host
        } else {
            blocked.unwrap()
        };
        let events = line_events(on, tid);
        let n = |k: &str| t[k].as_u64().unwrap() as f64;
        let count =
            |pred: &dyn Fn(&Event) -> bool| events.iter().filter(|e| pred(e)).count() as f64;
        let report = format!(
            "{t} against its line's events ({} Unknown)",
            count(&|e| e.name == "Unknown")
        );
        for (key, state) in [
            ("on_cpu_ns", "Running"),
            ("runnable_ns", "Runnable"),
            ("blocked_ns", "Blocked"),
            ("unknown_ns", "Unknown"),
        ] {
            assert!(
                (n(key) - sum_named(&events, state)).abs() <= 1.0,
                "{key}: {report}"
            );
        }
        // Each switch-out ends a Running interval and each wake-up starts a
        // Runnable one, but an interval the next event ends in the same
        // nanosecond is empty and not written, and the window's edges cut.
        let switches = n("voluntary_switches") + n("involuntary_switches");
        let runs = count(&|e| e.name == "Running");
        let woken = count(&|e| {
            e.name == "Runnable" && ["woken", "new thread"].contains(&e.stats["cause"].as_str())
        });
        for (key, counted, seen) in [
            ("switches", switches, runs),
            ("wakeups", n("wakeups"), woken),
        ] {
            assert!(
                seen <= counted + 1.0 && counted <= 1.03 * seen + 2.0,
                "{key}: {seen} intervals, {report}"
            );
        }
    }
    let ping = json_threads
        .iter()
        .find(|t| t["name"] == "ping")
        .expect("ping");
    assert!(ping["wakeups"].as_u64().unwrap() > 20, "{ping}");
}

#[test]
fn threads_created_during_the_capture_are_followed() {
    if !require_root("threads_created_during_the_capture_are_followed") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&["--late-thread-ms", "700"]);
    let logdir = TempDir::new("late");
    let pid = workload.pid.to_string();
    let out = record(&pid, "2s", &logdir, &["-q"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let late = workload
        .wait_line("late_tid", Duration::from_secs(1))
        .expect("fixture started its late thread");
    let late_tid = late["late_tid"].as_i64().unwrap();
    drop(workload);

    let space = one_trace(&logdir);
    let host = plane(&space, "/host:CPU");
    xspace::assert_lines_nest(host);
    let line = host
        .lines
        .iter()
        .find(|l| l.id == late_tid)
        .expect("a line for the thread created mid-capture");
    assert_eq!(line.name, "late-starter");
    let events = line_events(host, late_tid);
    let on_cpu = sum_named(&events, "Running");
    let unknown = sum_named(&events, "Unknown");
    // It burns exactly 200 ms of CPU time (CLOCK_THREAD_CPUTIME_ID); time
    // the kernel reported no switch for is Unknown, and may be on a CPU.
    assert!(
        on_cpu < 215e6 && on_cpu + unknown >= 190e6,
        "late thread ran {:.1} ms ({:.1} ms Unknown)",
        on_cpu / 1e6,
        unknown / 1e6
    );
    assert!(events.iter().any(|e| e.name == "Thread exit"));
    // Its life starts at creation, not at the window start.
    let first = events.iter().map(|e| e.start_ns).fold(f64::MAX, f64::min);
    assert!(first > 300e6, "late thread's first event at {first} ns");
    let main_events = line_events(host, i64::from(pid.parse::<u32>().unwrap()));
    assert!(
        main_events
            .iter()
            .any(|e| e.name == "Thread created" && e.stats["tid"].as_i64() == late_tid),
        "creation is marked on the creating thread"
    );
}

#[test]
fn a_target_exiting_mid_capture_keeps_the_trace() {
    if !require_root("a_target_exiting_mid_capture_keeps_the_trace") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&["--seconds", "1"]);
    let burner = workload.tid("cpu-burner");
    let logdir = TempDir::new("exit");
    let pid = workload.pid.to_string();
    let started = std::time::Instant::now();
    let child = spawn_record(&pid, "30s", &logdir, &[]);
    let out = wait_with_deadline(child, Duration::from_secs(10));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "capture did not end with the target"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("every traced process exited"), "{stdout}");
    drop(workload);

    let space = one_trace(&logdir);
    assert!(
        space.warnings.iter().any(|w| w.contains("ended early")),
        "{:?}",
        space.warnings
    );
    let (start, stop) = xspace::profile_window(&space);
    assert!(stop - start < 3_000_000_000);
    let host = plane(&space, "/host:CPU");
    let events = line_events(host, i64::from(burner));
    assert!(
        sum_named(&events, "Running") > 100e6,
        "burner ran before exiting"
    );
    assert!(events.iter().any(|e| e.name == "Thread exit"));
}

#[test]
fn ctrl_c_ends_the_capture_and_writes_the_trace() {
    if !require_root("ctrl_c_ends_the_capture_and_writes_the_trace") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let logdir = TempDir::new("sigint");
    let pid = workload.pid.to_string();
    let mut child = spawn_record(&pid, "60s", &logdir, &[]);
    // Wait until it says it is attached, then interrupt after one second.
    let stderr = child.stderr.take().unwrap();
    let mut reader = std::io::BufReader::new(stderr);
    let mut first = String::new();
    std::io::BufRead::read_line(&mut reader, &mut first).unwrap();
    assert!(first.contains("probes attached"), "{first}");
    std::thread::sleep(Duration::from_secs(1));
    ebtrace_tests::signal(child.id(), libc::SIGINT);
    let out = wait_with_deadline(child, Duration::from_secs(10));
    assert!(out.status.success(), "exit status {:?}", out.status);
    drop(workload);

    let space = one_trace(&logdir);
    let (start, stop) = xspace::profile_window(&space);
    let window = (stop - start) as f64;
    assert!((0.9e9..2.5e9).contains(&window), "window {window}");
    assert!(space.warnings.iter().any(|w| w.contains("interrupted")));
    let host = plane(&space, "/host:CPU");
    assert!(host.lines.len() >= 5);
}

#[test]
fn the_probes_are_released_after_ebtrace_exits() {
    if !require_root("the_probes_are_released_after_ebtrace_exits") {
        return;
    }
    let _serial = serial();
    // The switch program, raw or classic (the kernel keeps 15 characters
    // of a name).
    let ours = |names: Vec<String>| {
        names
            .iter()
            .filter(|n| *n == "sched_switch" || *n == "raw_sched_switc")
            .count()
    };
    let before = ours(loaded_bpf_program_names());
    let workload = SchedWorkload::start(&[]);
    let logdir = TempDir::new("released");
    let mut child = spawn_record(&workload.pid.to_string(), "3s", &logdir, &["-q"]);
    let started = std::time::Instant::now();
    while ours(loaded_bpf_program_names()) == before {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "ebtrace's sched_switch program never showed up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(child.wait().unwrap().success());
    // The trace is written; what is left is released in the background.
    let exited = std::time::Instant::now();
    while ours(loaded_bpf_program_names()) > before {
        assert!(
            exited.elapsed() < Duration::from_secs(10),
            "ebtrace's programs are still loaded 10 s after it exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!one_trace(&logdir).planes.is_empty());
}
