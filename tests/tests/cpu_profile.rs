//! `ebtrace serve --http`: `/debug/pprof/profile?seconds=N`, a CPU profile
//! of the watched processes from stack samples, as pprof. Checked against
//! the fixture's own source (which function burns the CPU, which lines
//! are inlined), against `/proc` (how much CPU it used), and read by Go's
//! own `go tool pprof` (Debian's `golang-go`).

use std::{
    io::BufRead,
    net::SocketAddr,
    process::Command,
    time::{Duration, Instant},
};

use ebtrace_proto::perftools::profiles::Profile;
use ebtrace_tests::{
    TempDir,
    fixture::{Hotspot, SchedWorkload, build_c, build_c_shared},
    http, loaded_bpf_program_names, record, require_root, serial,
    serve::ServeProcess,
    signal, spawn_attached, spawn_record, xplane_files,
    xspace::{self, line_events, plane},
};

/// The next line the fixture prints, as JSON.
fn read_json_line(from: &mut impl BufRead) -> serde_json::Value {
    let mut line = String::new();
    from.read_line(&mut line).expect("a line from the fixture");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

/// The fixture, and `ebtrace serve` watching it with `--http`, and its
/// HTTP address.
fn serve_hotspot() -> (Hotspot, ServeProcess, SocketAddr) {
    let fixture = Hotspot::start();
    let server =
        ServeProcess::loopback(&["--pid", &fixture.pid.to_string(), "--http", "127.0.0.1:0"]);
    let addr = server.http_addr();
    (fixture, server, addr)
}

/// CPU time (user + system) of `pid` so far, in ns (`/proc/PID/stat`,
/// 100 ticks a second).
fn cpu_ns(pid: u32) -> i64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<i64> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    (fields[11] + fields[12]) * 10_000_000
}

/// The 1-based lines of the fixture's source that contain `needle`.
fn source_lines(needle: &str) -> Vec<i64> {
    let src = ebtrace_tests::workspace_root().join("tests/fixtures/cpu_hotspot.c");
    std::fs::read_to_string(src)
        .unwrap()
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains(needle))
        .map(|(i, _)| i as i64 + 1)
        .collect()
}

/// Each sample's stack as function names (innermost first, inlined
/// functions included), with its thread label and its two values.
fn stacks(p: &Profile) -> Vec<(Vec<String>, String, Vec<i64>)> {
    let s = |i: i64| p.string_table[i as usize].clone();
    p.sample
        .iter()
        .map(|sample| {
            let names = sample
                .location_id
                .iter()
                .flat_map(|id| {
                    let loc = &p.location[*id as usize - 1];
                    assert_eq!(loc.id, *id);
                    loc.line.iter().map(|l| {
                        let f = &p.function[l.function_id as usize - 1];
                        s(f.name)
                    })
                })
                .collect();
            let thread = sample
                .label
                .iter()
                .find(|l| s(l.key) == "thread")
                .map(|l| s(l.str))
                .unwrap_or_default();
            (names, thread, sample.value.clone())
        })
        .collect()
}

#[test]
fn pprof_profile_names_the_hot_function_and_go_tool_pprof_reads_it() {
    if !require_root("pprof_profile_names_the_hot_function_and_go_tool_pprof_reads_it") {
        return;
    }
    let _serial = serial();
    let (fixture, _server, addr) = serve_hotspot();

    let cpu_before = cpu_ns(fixture.pid);
    let response = http::get(addr, "/debug/pprof/profile?seconds=2&hz=499");
    let cpu_used = cpu_ns(fixture.pid) - cpu_before;
    assert_eq!(response.status, 200, "{}", response.text());
    let profile = response.pprof();

    // Header: samples and CPU time, one period per sample.
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let types: Vec<_> = profile
        .sample_type
        .iter()
        .map(|t| (s(t.r#type), s(t.unit)))
        .collect();
    assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
    assert_eq!(profile.period, 1_000_000_000 / 499);
    assert!(
        profile.duration_nanos >= 1_900_000_000,
        "{}",
        profile.duration_nanos
    );

    // The CPU time the samples stand for is the CPU time /proc counted
    // over the request (which began a little before and ended a little
    // after the sampling).
    let stacks = stacks(&profile);
    let sampled: i64 = stacks.iter().map(|(_, _, v)| v[1]).sum();
    let ratio = sampled as f64 / cpu_used as f64;
    assert!(
        (0.7..=1.15).contains(&ratio),
        "samples stand for {sampled} ns of CPU, /proc counted {cpu_used} ns"
    );
    for (_, _, v) in &stacks {
        assert_eq!(v[1], v[0] * profile.period);
    }

    // The hot thread's samples are in the hot function, labelled with
    // its thread name; some in the inlined helper, at its lines.
    let hot: Vec<_> = stacks
        .iter()
        .filter(|(names, _, _)| names.iter().any(|n| n == "ebtrace_hot_spin"))
        .collect();
    let hot_samples: i64 = hot.iter().map(|(_, _, v)| v[0]).sum();
    let all_samples: i64 = stacks.iter().map(|(_, _, v)| v[0]).sum();
    assert!(
        hot_samples * 10 >= all_samples * 8,
        "{hot_samples} of {all_samples} samples in ebtrace_hot_spin"
    );
    assert!(hot.iter().all(|(_, thread, _)| thread == "hot-spinner"));
    assert!(profile.sample.iter().any(|sample| {
        sample
            .label
            .iter()
            .any(|l| s(l.key) == "tid" && l.num == i64::from(fixture.hot_tid))
    }));
    let mix_lines = source_lines("x ^= x");
    let inlined = profile.location.iter().find(|loc| {
        let names: Vec<_> = loc
            .line
            .iter()
            .map(|l| s(profile.function[l.function_id as usize - 1].name))
            .collect();
        names == ["mix_step", "ebtrace_hot_spin"] && mix_lines.contains(&loc.line[0].line)
    });
    let inlined = inlined.unwrap_or_else(|| {
        panic!(
            "no location of mix_step (lines {mix_lines:?}) inlined into ebtrace_hot_spin: {:?}",
            profile.location
        )
    });
    let file = s(profile.function[inlined.line[0].function_id as usize - 1].filename);
    assert!(file.ends_with("tests/fixtures/cpu_hotspot.c"), "{file}");

    // The reader's time is in the kernel: its kernel frames are named.
    assert!(
        stacks
            .iter()
            .any(|(names, thread, _)| thread == "zero-reader"
                && names.iter().any(|n| n == "vfs_read")),
        "no kernel stack through vfs_read in the zero-reader's samples"
    );

    // Go's own pprof reads it and puts the hot function on top.
    if let Some((rows, text)) = http::go_pprof_top(&response.body) {
        let top = rows.first().map(|r| r.function.as_str());
        assert_eq!(top, Some("ebtrace_hot_spin"), "go tool pprof -top:\n{text}");
    }
}

/// Whether `function` in `binary` sets up a frame pointer (`mov
/// %rsp,%rbp`), by objdump's disassembly.
fn keeps_frame_pointer(binary: &std::path::Path, function: &str) -> bool {
    let out = Command::new("objdump")
        .arg("-d")
        .arg(format!("--disassemble={function}"))
        .arg(binary)
        .output()
        .expect("run objdump");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("<{function}>:")), "{text}");
    text.contains("mov    %rsp,%rbp")
}

/// The functions of `names` (a stack, innermost first) from `function` out.
fn callers_from<'a>(names: &'a [String], function: &str) -> Option<&'a [String]> {
    let at = names.iter().position(|n| n == function)?;
    Some(&names[at..])
}

#[test]
fn stacks_of_code_built_without_frame_pointers_reach_the_thread_start() {
    if !require_root("stacks_of_code_built_without_frame_pointers_reach_the_thread_start") {
        return;
    }
    let _serial = serial();
    // The fixture is built as C usually is (-O2: no frame pointers), so
    // the kernel's frame-pointer walk cannot get past its functions.
    let binary = build_c("cpu_hotspot");
    for function in [
        "ebtrace_hot_spin",
        "hot_main",
        "ebtrace_read_zero",
        "reader_main",
    ] {
        assert!(
            !keeps_frame_pointer(&binary, function),
            "{function} keeps a frame pointer: this test needs code without"
        );
    }
    let (_fixture, _server, addr) = serve_hotspot();
    let response = http::get(addr, "/debug/pprof/profile?seconds=2&hz=499");
    assert_eq!(response.status, 200, "{}", response.text());
    let stacks = stacks(&response.pprof());

    // Every thread runs its start routine, which its thread function calls
    // (the fixture's source): the unwound stacks show that chain, down to
    // glibc's thread start.
    let chain = |thread: &str, leaf: &str, caller: &str| {
        let samples: Vec<_> = stacks.iter().filter(|(_, t, _)| t == thread).collect();
        let count = |stacks: &[&(Vec<String>, String, Vec<i64>)]| -> i64 {
            stacks.iter().map(|(_, _, v)| v[0]).sum()
        };
        let whole: Vec<_> = samples
            .iter()
            .copied()
            .filter(|(names, _, _)| {
                callers_from(names, leaf).is_some_and(|c| {
                    c.get(1).is_some_and(|n| n == caller) && c.iter().any(|n| n == "start_thread")
                })
            })
            .collect();
        (count(&whole), count(&samples), samples)
    };
    let (whole, all, hot) = chain("hot-spinner", "ebtrace_hot_spin", "hot_main");
    assert!(
        all >= 200 && whole * 100 >= all * 95,
        "{whole} of {all} hot-spinner samples go ebtrace_hot_spin <- hot_main <- start_thread: {:?}",
        hot.iter()
            .take(5)
            .map(|(names, _, _)| names)
            .collect::<Vec<_>>()
    );
    // The reader is mostly in the kernel: its user stack is the one it
    // entered the kernel with, below the kernel's frames.
    let (whole, all, reader) = chain("zero-reader", "ebtrace_read_zero", "reader_main");
    assert!(
        all > 0 && whole * 100 >= all * 80,
        "{whole} of {all} zero-reader samples go ebtrace_read_zero <- reader_main <- start_thread: {:?}",
        reader
            .iter()
            .take(5)
            .map(|(names, _, _)| names)
            .collect::<Vec<_>>()
    );
    assert!(
        reader
            .iter()
            .any(|(names, _, _)| callers_from(names, "vfs_read")
                .is_some_and(|c| c.iter().any(|n| n == "ebtrace_read_zero"))),
        "no zero-reader stack from vfs_read down to ebtrace_read_zero"
    );
}

#[test]
fn pprof_requests_that_make_no_sense_get_one_line() {
    if !require_root("pprof_requests_that_make_no_sense_get_one_line") {
        return;
    }
    let _serial = serial();
    let (_fixture, server, addr) = serve_hotspot();
    for path in [
        "/debug/pprof/profile?seconds=0",
        "/debug/pprof/profile?seconds=abc",
        "/debug/pprof/profile?hz=100000",
    ] {
        let r = http::get(addr, path);
        assert_eq!(r.status, 400, "{path}");
        assert_eq!(r.text().lines().count(), 1, "{}", r.text());
    }

    // One profile at a time for one caller: a second one, asked while the
    // first runs, is refused; the first is answered.
    let first = std::thread::spawn(move || http::get(addr, "/debug/pprof/profile?seconds=2"));
    std::thread::sleep(Duration::from_millis(500));
    let second = http::get(addr, "/debug/pprof/profile?seconds=1");
    assert_eq!(second.status, 429, "{}", second.text());
    assert_eq!(first.join().unwrap().status, 200);

    // Nothing of the sampling is left attached once answered.
    assert!(
        server.wait_detached(Duration::from_secs(5)),
        "probes still attached after the profile"
    );
}

#[test]
fn record_lays_stack_samples_on_the_thread_lines_where_the_threads_ran() {
    if !require_root("record_lays_stack_samples_on_the_thread_lines_where_the_threads_ran") {
        return;
    }
    let _serial = serial();
    let fixture = Hotspot::start();
    let logdir = TempDir::new("cpu-samples");
    let hz = 199.0;
    let out = record(
        &fixture.pid.to_string(),
        "2s",
        &logdir,
        &["--sample-hz", "199"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("CPU stack samples on the thread lines"),
        "{stdout}"
    );
    let space = xspace::load(&xplane_files(logdir.path())[0]);
    let host = plane(&space, "/host:CPU");
    xspace::assert_lines_nest(host);

    // The hot thread: as many samples as its time on a CPU (from the
    // scheduler's tracepoints, another probe) makes ticks, each in the hot
    // function or the one inlined into it, and each inside one of its
    // running intervals. A switch the kernel does not report (on this
    // kernel, `bpftrace` misses the same ones) leaves an interval whose
    // state is unknown; the thread's own samples narrow it, and the part
    // they show on a CPU is "Running" with a reason: it starts or ends at
    // one of the thread's samples. (A run both of whose switches went
    // unreported hides in a Runnable interval; its samples show it.)
    let hot = line_events(host, i64::from(fixture.hot_tid));
    let sampled = |r: &&xspace::Event| r.name == "Running" && r.stats.contains_key("reason");
    let within = |state: &str, t: f64| {
        hot.iter()
            .any(|r| r.name == state && r.start_ns - 1e3 <= t && t <= r.end_ns() + 1e3)
    };
    let on_cpu_ns = xspace::sum_named(&hot, "Running");
    let unknown_ns = xspace::sum_named(&hot, "Unknown");
    let samples: Vec<_> = hot
        .iter()
        .filter(|e| e.stats.contains_key("cpu_sample_stack"))
        .collect();
    let (fewest, most) = (
        0.8 * on_cpu_ns * hz / 1e9,
        1.2 * (on_cpu_ns + unknown_ns) * hz / 1e9,
    );
    assert!(
        (fewest..=most).contains(&(samples.len() as f64)),
        "{} samples on the hot thread, {fewest:.0} to {most:.0} expected from {on_cpu_ns} ns \
         on a CPU and {unknown_ns} ns unknown",
        samples.len()
    );
    let in_reported = |t: f64| {
        hot.iter().any(|r| {
            r.name == "Running" && !sampled(&r) && r.start_ns - 1e3 <= t && t <= r.end_ns() + 1e3
        })
    };
    for s in &samples {
        assert_eq!(s.duration_ns, 0.0);
        assert!(
            ["ebtrace_hot_spin", "mix_step"].contains(&s.name.as_str()),
            "{}",
            s.name
        );
        // (Or in an unknown interval the capture's end cut: what ended it
        // is not known, so it is not narrowed.)
        assert!(
            within("Running", s.start_ns) || within("Unknown", s.start_ns),
            "a sample at {} ns lies outside the thread's running intervals; the line around \
             it: {:?}; the trace's notes: {:?}",
            s.start_ns,
            hot.iter()
                .filter(|e| e.name != s.name
                    && e.end_ns() >= s.start_ns - 5e6
                    && e.start_ns <= s.start_ns + 5e6)
                .map(|e| (e.name.as_str(), e.start_ns, e.end_ns()))
                .collect::<Vec<_>>(),
            stdout
        );
    }
    // Samples cut the states they lie on into pieces: join them again.
    let joined = |pieces: &mut dyn Iterator<Item = &xspace::Event>| {
        let mut out: Vec<(f64, f64)> = Vec::new();
        for r in pieces {
            match out.last_mut() {
                Some(last) if (r.start_ns - last.1).abs() <= 1e3 => last.1 = r.end_ns(),
                _ => out.push((r.start_ns, r.end_ns())),
            }
        }
        out
    };
    let by_samples = joined(&mut hot.iter().filter(sampled));
    for &(start, end) in &by_samples {
        assert!(
            samples
                .iter()
                .any(|s| (s.start_ns - start).abs() <= 1e3 || (s.start_ns - end).abs() <= 1e3),
            "a running interval taken from the samples, {start} to {end} ns, neither starts nor \
             ends at a sample"
        );
    }
    // Each such interval, and each left unknown, stands for a transition
    // the kernel did not report, as the summary counts them.
    let unreported: usize = stdout
        .lines()
        .find_map(|l| {
            l.strip_suffix(
                " scheduler transitions were not reported by the kernel; \
             those intervals show as Unknown",
            )
        })
        .map_or(0, |n| n.trim().parse().unwrap());
    let unexplained = joined(&mut hot.iter().filter(|e| e.name == "Unknown" || sampled(e))).len();
    assert!(
        unexplained <= unreported,
        "{unexplained} stretches of the hot thread are unknown or taken from its samples, but \
         the kernel left only {unreported} transitions unreported: {stdout}"
    );
    let reported = samples.iter().filter(|s| in_reported(s.start_ns)).count();
    assert!(
        2 * reported >= samples.len(),
        "only {reported} of {} samples lie in running intervals the kernel reported: {stdout}",
        samples.len()
    );
    assert!(
        samples.iter().any(|s| {
            let stack = s.stats["cpu_sample_stack"].as_str();
            s.name == "mix_step"
                && stack.starts_with("mix_step ")
                && stack.contains("cpu_hotspot.c:")
                && stack.contains("(inlined)")
        }),
        "no sample in the inlined mix_step with its file and line"
    );

    // The reader's samples show its kernel stack.
    let reader = line_events(host, i64::from(fixture.reader_tid));
    assert!(
        reader.iter().any(|e| e
            .stats
            .get("cpu_sample_stack")
            .is_some_and(|s| s.as_str().contains("vfs_read [k]"))),
        "no sample of the reader in vfs_read"
    );
}

#[test]
fn a_process_that_exits_mid_capture_keeps_its_stacks_named() {
    if !require_root("a_process_that_exits_mid_capture_keeps_its_stacks_named") {
        return;
    }
    let _serial = serial();
    let mut fixture = Hotspot::start();
    let logdir = TempDir::new("cpu-samples-exit");
    let ebtrace = spawn_attached(
        &fixture.pid.to_string(),
        "3s",
        &logdir,
        &["--sample-hz", "199"],
    );
    // Killed a second into the window: its stacks are symbolized after it
    // is gone.
    std::thread::sleep(Duration::from_secs(1));
    fixture.child.kill().unwrap();
    fixture.child.wait().unwrap();
    let out = ebtrace.wait(Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let space = xspace::load(&xplane_files(logdir.path())[0]);
    let hot = line_events(plane(&space, "/host:CPU"), i64::from(fixture.hot_tid));
    let samples: Vec<_> = hot
        .iter()
        .filter(|e| e.stats.contains_key("cpu_sample_stack"))
        .collect();
    // At least half a second of spinning was sampled.
    assert!(samples.len() > 100, "{} samples", samples.len());
    for s in &samples {
        let stack = s.stats["cpu_sample_stack"].as_str();
        // A tick may land while the killed thread is already in the
        // kernel's exit path, its user memory gone: only kernel frames.
        if stack.contains("do_exit [k]") {
            continue;
        }
        assert!(
            ["ebtrace_hot_spin", "mix_step"].contains(&s.name.as_str()),
            "{}: {stack}",
            s.name,
        );
    }
}

/// Whether the sampling program is loaded in the kernel now.
fn sampling_loaded() -> bool {
    loaded_bpf_program_names().iter().any(|n| n == "cpu_sample")
}

#[test]
fn a_killed_server_leaves_no_sampling_behind() {
    if !require_root("a_killed_server_leaves_no_sampling_behind") {
        return;
    }
    let _serial = serial();
    let (fixture, mut server, addr) = serve_hotspot();
    assert!(!sampling_loaded(), "a sampling program is loaded already");
    // The answer never comes: the server is killed while it samples.
    let asking = std::thread::spawn(move || {
        std::panic::catch_unwind(|| http::get(addr, "/debug/pprof/profile?seconds=60")).ok()
    });
    let start = Instant::now();
    while !sampling_loaded() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "sampling never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    let start = Instant::now();
    while sampling_loaded() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the sampling program outlived the killed server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = asking.join();
    // The target runs on, untouched: its hot thread still burns CPU.
    let before = cpu_ns(fixture.pid);
    std::thread::sleep(Duration::from_millis(300));
    assert!(cpu_ns(fixture.pid) - before >= 100_000_000);
}

#[test]
fn a_library_loaded_while_the_recorder_runs_gets_its_names() {
    if !require_root("a_library_loaded_while_the_recorder_runs_gets_its_names") {
        return;
    }
    let _serial = serial();
    let late_lib = build_c_shared("late_spin", "libebtrace_late_spin.so");
    let mut fixture = Hotspot::start_with(&["--late-lib", late_lib.to_str().unwrap()]);
    let server = ServeProcess::loopback(&[
        "--pid",
        &fixture.pid.to_string(),
        "--retain",
        "30s",
        "--retain-sample-hz",
        "199",
    ]);
    assert!(
        server
            .wait_line("flight recorder on", Duration::from_secs(30))
            .is_some(),
        "{:?}",
        server.lines()
    );
    // The hot thread's samples have been named by now: the recorder has
    // read the process's mappings, and the library is in none of them.
    std::thread::sleep(Duration::from_secs(2));
    signal(fixture.pid, libc::SIGUSR1);
    let late_tid = read_json_line(&mut fixture.stdout)["late_tid"]
        .as_u64()
        .expect("late_tid") as u32;
    std::thread::sleep(Duration::from_secs(3));

    let space = server.snapshot("late-library");
    let late = line_events(plane(&space, "/host:CPU"), i64::from(late_tid));
    let samples: Vec<_> = late
        .iter()
        .filter(|e| e.stats.contains_key("cpu_sample_stack"))
        .collect();
    // Three seconds of spinning at 199 Hz.
    assert!(samples.len() > 200, "{} samples", samples.len());
    let named = samples
        .iter()
        .filter(|s| s.name == "ebtrace_late_spin")
        .count();
    assert!(
        named * 100 >= samples.len() * 95,
        "{named} of {} samples named ebtrace_late_spin; others: {:?}",
        samples.len(),
        samples
            .iter()
            .filter(|s| s.name != "ebtrace_late_spin")
            .take(5)
            .map(|s| (&s.name, s.stats["cpu_sample_stack"].as_str()))
            .collect::<Vec<_>>()
    );
}

/// The flight recorder samples at a rate of its own, low by default as it
/// samples for as long as it runs (a CPU profile asks for its own), and
/// not at all at 0: the samples on the hot thread's line against the time
/// the same snapshot says it ran.
#[test]
fn the_recorder_samples_at_its_own_rate_and_not_at_all_at_zero() {
    if !require_root("the_recorder_samples_at_its_own_rate_and_not_at_all_at_zero") {
        return;
    }
    let _serial = serial();
    let fixture = Hotspot::start();
    let pid = fixture.pid.to_string();
    for (rate, hz) in [(None, 19.0), (Some("0"), 0.0)] {
        let mut args = vec!["--pid", &pid, "--retain", "30s"];
        args.extend(
            rate.map(|r| ["--retain-sample-hz", r])
                .into_iter()
                .flatten(),
        );
        let server = ServeProcess::loopback(&args);
        assert!(
            server
                .wait_line("flight recorder on", Duration::from_secs(30))
                .is_some(),
            "{:?}",
            server.lines()
        );
        assert_eq!(sampling_loaded(), hz > 0.0, "at {hz} Hz");
        std::thread::sleep(Duration::from_secs(3));
        let space = server.snapshot("recorder-rate");
        let hot = line_events(plane(&space, "/host:CPU"), i64::from(fixture.hot_tid));
        let running = xspace::sum_named(&hot, "Running");
        assert!(running > 1e9, "the hot thread ran {running} ns");
        let samples = hot
            .iter()
            .filter(|e| e.stats.contains_key("cpu_sample_stack"))
            .count() as f64;
        let expected = running * hz / 1e9;
        assert!(
            (0.7 * expected..=1.3 * expected).contains(&samples),
            "{samples} samples at {hz} Hz over {running} ns on a CPU, {expected:.0} expected"
        );
    }
}

/// `--off-cpu-min`: each wait of the sleeper (10 ms in `clock_nanosleep`,
/// called from its `sleeper` function) carries the stack it waited in,
/// over exactly the Blocked state the scheduler's tracepoints recorded
/// (another probe); shorter waits, the ping-pong's, carry none; the
/// fixture's own count of sleeps bounds the number. Without the flag,
/// nothing is taken, and nothing stays loaded after the capture.
#[test]
fn record_lays_off_cpu_stacks_over_the_waits_they_explain() {
    if !require_root("record_lays_off_cpu_stacks_over_the_waits_they_explain") {
        return;
    }
    let _serial = serial();
    let fixture = SchedWorkload::start(&[]);
    let logdir = TempDir::new("off-cpu");
    let slept_before = fixture.counter("sleeps");
    let out = record(
        &fixture.pid.to_string(),
        "2s",
        &logdir,
        &["--off-cpu-min", "5ms"],
    );
    let slept = fixture.counter("sleeps") - slept_before;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("off-CPU stacks on the thread lines"),
        "{stdout}"
    );
    assert!(
        !loaded_bpf_program_names().contains(&"off_cpu_stack".to_string()),
        "the off-CPU program stayed loaded after the capture"
    );
    let space = xspace::load(&xplane_files(logdir.path())[0]);
    let host = plane(&space, "/host:CPU");
    xspace::assert_lines_nest(host);

    let waited = |e: &&xspace::Event| e.name.starts_with("waited in ");
    let sleeper = line_events(host, i64::from(fixture.tid("sleeper-10ms")));
    let spans: Vec<&xspace::Event> = sleeper.iter().filter(waited).collect();
    // A wait the window's start cut short is as long as the probe saw it.
    let window_start = sleeper
        .iter()
        .map(|e| e.start_ns)
        .fold(f64::INFINITY, f64::min);
    let long_blocks: Vec<&xspace::Event> = sleeper
        .iter()
        .filter(|e| {
            e.name == "Blocked"
                && (e.duration_ns >= 5e6 || (e.start_ns - window_start).abs() <= 1e3)
        })
        .collect();
    assert!(
        spans.len() >= 150 && spans.len() as u64 <= slept,
        "{} off-CPU stacks on the sleeper, which slept {slept} times during the capture: {stdout}",
        spans.len()
    );
    // The window's end may cut a wait: its stack is taken after it. A
    // sleeper preempted between its switch-in and its call's return (the
    // burner spins beside it) has its stack left out: a few.
    assert!(
        spans.len() + 2 + long_blocks.len() / 20 >= long_blocks.len()
            && spans.len() <= long_blocks.len(),
        "{} off-CPU stacks for {} waits of 5 ms or more; over shorter ones: {:?}",
        spans.len(),
        long_blocks.len(),
        spans
            .iter()
            .filter(|s| !long_blocks
                .iter()
                .any(|b| (b.start_ns - s.start_ns).abs() <= 1e3))
            .map(|s| (s.start_ns - window_start, s.duration_ns))
            .collect::<Vec<_>>()
    );
    for s in &spans {
        assert_eq!(s.name, "waited in clock_nanosleep");
        assert!(
            long_blocks
                .iter()
                .any(|b| (b.start_ns - s.start_ns).abs() <= 1e3
                    && (b.end_ns() - s.end_ns()).abs() <= 1e3),
            "an off-CPU stack from {} to {} ns is not over one of the sleeper's waits",
            s.start_ns,
            s.end_ns()
        );
        let stack = s.stats["off_cpu_stack"].as_str();
        assert!(
            stack.contains("clock_nanosleep")
                && stack
                    .lines()
                    .any(|l| l.starts_with("sleeper ") && l.contains("sched_workload.c:")),
            "the stack of a sleep:\n{stack}"
        );
    }
    // The ping-pong waits about a millisecond at a time, in a sleep, a
    // poll or a read: a stack there belongs to a wait the machine's load
    // made long, and it lies over one.
    for name in ["ping", "pong"] {
        let line = line_events(host, i64::from(fixture.tid(name)));
        for s in line.iter().filter(waited) {
            assert!(
                [
                    "waited in clock_nanosleep",
                    "waited in poll",
                    "waited in read"
                ]
                .contains(&s.name.as_str()),
                "{name}: {}",
                s.name
            );
            let blocked = line
                .iter()
                .find(|b| b.name == "Blocked" && (b.start_ns - s.start_ns).abs() <= 1e3)
                .unwrap_or_else(|| panic!("{name}: an off-CPU stack over no wait"));
            let runnable_after = line
                .iter()
                .find(|r| r.name == "Runnable" && (r.start_ns - blocked.end_ns()).abs() <= 1e3)
                .map_or(0.0, |r| r.duration_ns);
            assert!(
                blocked.duration_ns + runnable_after >= 4.9e6,
                "{name}: a stack for a wait of {} ns",
                blocked.duration_ns + runnable_after
            );
        }
    }
    let burner = line_events(host, i64::from(fixture.tid("cpu-burner")));
    assert!(!burner.iter().any(|e| waited(&e)), "the burner never waits");

    // A capture killed while it takes them leaves nothing behind, and the
    // fixture sleeps on.
    let logdir = TempDir::new("off-cpu-killed");
    let mut killed = spawn_record(
        &fixture.pid.to_string(),
        "60s",
        &logdir,
        &["--off-cpu-min", "5ms"],
    );
    let off_cpu_loaded = || {
        loaded_bpf_program_names()
            .iter()
            .any(|n| n == "off_cpu_stack")
    };
    let start = Instant::now();
    while !off_cpu_loaded() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the off-CPU program never loaded"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    killed.kill().expect("SIGKILL the capture");
    let _ = killed.wait();
    let start = Instant::now();
    while off_cpu_loaded() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the off-CPU program outlived the killed capture"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = fixture.counter("sleeps");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        fixture.counter("sleeps") - before >= 10,
        "the fixture stopped sleeping"
    );

    // Not asked for: none taken.
    let logdir = TempDir::new("off-cpu-none");
    let out = record(&fixture.pid.to_string(), "1s", &logdir, &[]);
    assert!(out.status.success());
    let space = xspace::load(&xplane_files(logdir.path())[0]);
    let sleeper = line_events(
        plane(&space, "/host:CPU"),
        i64::from(fixture.tid("sleeper-10ms")),
    );
    assert!(
        sleeper.iter().any(|e| e.name == "Blocked") && !sleeper.iter().any(|e| waited(&e)),
        "off-CPU stacks taken without --off-cpu-min"
    );
}
