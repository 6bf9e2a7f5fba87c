//! TraceMe events from a process that carries TSL's TraceMe recorder,
//! checked event by event against the recorder's own log: the fixture
//! (`tests/fixtures/traceme/`) mirrors TSL's ABI with each C++ library, and
//! dumps every event its recorders queued when it exits.

use std::{
    collections::{BTreeMap, HashMap},
    io::{BufRead as _, BufReader},
    process::Output,
    time::{Duration, Instant},
};

use ebtrace_proto::tensorflow::profiler::{XPlane, XSpace};
use ebtrace_tests::{
    TempDir,
    fixture::SchedWorkload,
    killed::{guards_of, kill_mid_capture},
    record, require_root, run_ebtrace, serial,
    serve::{ServeProcess, block_on, request, xspace_of},
    signal, spawn_record, spawn_record_with_env,
    traceme::{ExpectedSpan, LoggedEvent, Toolchain, TraceMeWorkload, expected_spans, read_i32},
    wait_with_deadline, xplane_files,
    xspace::{self, Event, Stat, assert_lines_nest, line_events, plane},
};

/// Names the scheduler part of the trace uses on thread lines.
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

/// Bytes of a name ebtrace copies.
const NAME_CAP: usize = 1024;

fn trace(dir: &TempDir) -> XSpace {
    let files = xplane_files(dir.path());
    assert_eq!(files.len(), 1, "expected one trace, found {files:?}");
    xspace::load(&files[0])
}

fn run_capture(pid: u32, dir: &TempDir, extra: &[&str]) -> Output {
    let pid = pid.to_string();
    let mut args = vec!["-p", &pid, "--logdir", dir.path().to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = run_ebtrace(&args);
    assert!(
        out.status.success(),
        "ebtrace failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A TraceMe span read back from the trace, in epoch ns.
#[derive(Debug)]
struct Got {
    tid: u32,
    start: i64,
    end: i64,
    /// How much ebtrace cut to make it nest (`ebtrace_clipped_ns`).
    clipped: i64,
    event: Event,
}

fn traceme_spans(space: &XSpace, tids: impl IntoIterator<Item = u32>) -> Vec<Got> {
    let host = plane(space, "/host:CPU");
    let (start, _) = xspace::profile_window(space);
    let mut out = Vec::new();
    for tid in tids {
        if !host.lines.iter().any(|l| l.id == i64::from(tid)) {
            continue;
        }
        for e in line_events(host, tid.into()) {
            if SCHED_EVENTS.contains(&e.name.as_str()) {
                continue;
            }
            let s = start as i64 + e.start_ns.round() as i64;
            let clipped = e.stats.get("ebtrace_clipped_ns").map_or(0, Stat::as_i64);
            out.push(Got {
                tid,
                start: s,
                end: s + e.duration_ns.round() as i64,
                clipped,
                event: e,
            });
        }
    }
    out.sort_by_key(|g| (g.tid, g.start, g.end + g.clipped, g.event.name.clone()));
    out
}

/// The name TSL shows for a recorded name, and its metadata as text.
fn split_name(raw: &str) -> (String, Vec<(String, String)>) {
    if raw.len() > NAME_CAP {
        let cut = &raw[..NAME_CAP];
        let name = cut.split('#').next().unwrap().to_string();
        return (name, Vec::new());
    }
    match raw.strip_suffix('#').and_then(|b| b.split_once('#')) {
        Some((name, meta)) => (
            name.to_string(),
            meta.split(',')
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap();
                    (k.to_string(), v.to_string())
                })
                .collect(),
        ),
        None => (raw.to_string(), Vec::new()),
    }
}

/// Checks that the trace holds exactly the spans the log implies, with
/// their names, stats and times; returns how many per library.
fn assert_matches_log(
    space: &XSpace,
    log: &[LoggedEvent],
    tids: &BTreeMap<String, u32>,
) -> BTreeMap<String, usize> {
    let (start, stop) = xspace::profile_window(space);
    let expected: Vec<ExpectedSpan> = expected_spans(log, start as i64, stop as i64);
    let got = traceme_spans(space, tids.values().copied());
    let mut expected = expected;
    expected.sort_by(|a, b| {
        let (na, _) = split_name(&a.raw_name);
        let (nb, _) = split_name(&b.raw_name);
        (a.tid, a.start, a.end, na).cmp(&(b.tid, b.start, b.end, nb))
    });
    assert_eq!(
        got.len(),
        expected.len(),
        "trace has {} TraceMe spans, the fixture's log implies {}",
        got.len(),
        expected.len()
    );
    let mut per_lib = BTreeMap::new();
    for (g, x) in got.iter().zip(&expected) {
        let (name, meta) = split_name(&x.raw_name);
        assert_eq!(
            (g.tid, g.start, g.end + g.clipped, g.event.name.as_str()),
            (x.tid, x.start, x.end, name.as_str()),
            "span differs from the logged event {x:?}"
        );
        for (k, v) in &meta {
            let stat = g
                .event
                .stats
                .get(k)
                .unwrap_or_else(|| panic!("{name}: no stat {k} in {:?}", g.event.stats));
            let same = match stat {
                Stat::I64(i) => v.parse::<i64>() == Ok(*i),
                Stat::U64(u) => v.parse::<i64>().is_err() && v.parse::<u64>() == Ok(*u),
                Stat::F64(f) => v.parse::<u64>().is_err() && v.parse::<f64>() == Ok(*f),
                Stat::Str(s) => v.parse::<f64>().is_err() && s == v,
                Stat::Bytes(_) => false,
            };
            assert!(same, "{name}: stat {k} = {stat:?}, logged {v:?}");
        }
        if x.raw_name.len() > NAME_CAP {
            assert_eq!(
                g.event.stats["ebtrace_name_truncated_from"].as_i64(),
                x.raw_name.len() as i64
            );
        }
        *per_lib.entry(x.lib.clone()).or_insert(0) += 1;
    }
    per_lib
}

fn names_on(space: &XSpace, tids: impl IntoIterator<Item = u32>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for g in traceme_spans(space, tids) {
        *counts.entry(g.event.name).or_insert(0) += 1;
    }
    counts
}

#[test]
fn traceme_events_match_the_recorders_own_log() {
    if !require_root("traceme_events_match_the_recorders_own_log") {
        return;
    }
    let _serial = serial();
    // One process, three recorders (libstdc++, libc++, libc++ alternate),
    // as a Python process holds jaxlib's and libtpu's.
    let workload = TraceMeWorkload::start(&Toolchain::ALL, &[]);
    for t in Toolchain::ALL {
        assert_eq!(workload.lib(t).abi, t.layout(), "fixture built as intended");
        assert_eq!(workload.trace_level(t), -1);
    }
    std::thread::sleep(Duration::from_millis(100));
    let dir = TempDir::new("traceme");
    let out = run_capture(workload.pid, &dir, &["-d", "1s"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "(tsl::profiler, libstdc++;",
        "(tensorflow::profiler, libc++;",
        "(tsl::profiler, libc++ alternate layout;",
    ] {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    }
    assert_eq!(
        stderr.matches("level 2 set by ebtrace").count(),
        3,
        "{stderr}"
    );
    for t in Toolchain::ALL {
        assert_eq!(workload.trace_level(t), -1, "{t:?} level not restored");
    }
    let tids = workload.threads.clone();
    let (_, log) = workload.stop();

    // Every Record call happened while probed (before the level was
    // switched on there was none; it is switched off before detaching).
    assert!(
        stdout.contains(&format!("TraceMe: {} events recorded", log.len())),
        "{} logged; {stdout}",
        log.len()
    );
    assert!(stdout.contains(", 0 dropped"), "{stdout}");
    let space = trace(&dir);
    let host = plane(&space, "/host:CPU");
    assert_lines_nest(host);
    let per_lib = assert_matches_log(&space, &log, &tids);
    for t in Toolchain::ALL {
        let n = per_lib.get(t.tag()).copied().unwrap_or(0);
        assert!(n > 2_000, "{n} spans from the {t:?} recorder");
    }

    let names = names_on(&space, tids.values().copied());
    for present in [
        "train_step",
        "matmul",
        "info_detail",
        "host_compute",
        "async_copy",
        "checkpoint",
        "cross_thread",
    ] {
        assert!(
            names.get(present).copied().unwrap_or(0) > 0,
            "no {present}: {names:?}"
        );
    }
    assert!(
        !names.contains_key("verbose_detail"),
        "level 3 event at level 2"
    );
    assert!(
        names
            .keys()
            .any(|n| n.starts_with("long_name_xxx") && n.len() == NAME_CAP)
    );

    let got = traceme_spans(&space, tids.values().copied());
    let main = tids["tm-main"];
    assert!(
        got.iter()
            .any(|g| g.tid == main && g.event.name == "cross_thread")
    );
    for g in got.iter().filter(|g| g.event.name == "checkpoint") {
        assert_eq!(g.end, g.start, "instant");
    }
    // The activity that ends inside a scope begun after it is cut at that
    // scope's start; the scope keeps its full extent. A thread's last copy
    // is left out: the window may end between its end and its scope's end,
    // and then the scope is not in the trace and the copy is whole.
    let mut copies: Vec<_> = got
        .iter()
        .filter(|g| g.event.name == "async_copy")
        .collect();
    copies.sort_by_key(|g| (g.tid, g.start));
    let last_of_thread = |i: usize| {
        copies
            .get(i + 1)
            .is_none_or(|next| next.tid != copies[i].tid)
    };
    let checked: Vec<_> = (0..copies.len())
        .filter(|&i| !last_of_thread(i))
        .map(|i| copies[i])
        .collect();
    assert!(!checked.is_empty(), "no async_copy to check");
    for copy in checked {
        assert!(copy.clipped > 0, "{copy:?}");
        assert!(
            got.iter().any(|h| h.tid == copy.tid
                && h.event.name == "host_compute"
                && h.start == copy.end
                && h.clipped == 0),
            "{copy:?}"
        );
        assert_eq!(copy.event.stats["bytes"], Stat::I64(4096));
    }
    let step = got.iter().find(|g| g.event.name == "train_step").unwrap();
    assert_eq!(step.event.stats["loss"], Stat::F64(0.25));
    assert_eq!(step.event.stats["phase"], Stat::Str("warm".into()));
    assert_eq!(step.event.stats["big"], Stat::U64(u64::MAX));
    // The scheduling view is still there, beside the spans.
    let worker = line_events(host, tids["tm-worker-0"].into());
    assert!(worker.iter().any(|e| e.name == "Running"));
    assert!(worker.iter().any(|e| e.name == "Blocked"));
}

/// The recorders' cache files in `cache` (objects without one are
/// remembered too, as `recorder none`).
fn cached_recorders(cache: &TempDir) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(cache.path().join("traceme"))
        .expect("the cache directory was made")
        .map(|e| e.unwrap().path())
        .filter(|p| {
            std::fs::read_to_string(p).is_ok_and(|t| {
                t.lines()
                    .any(|l| l.starts_with("recorder tsl") || l.starts_with("recorder tensorflow"))
            })
        })
        .collect()
}

#[test]
fn recorder_symbols_are_remembered_and_a_bad_memory_is_searched_again() {
    if !require_root("recorder_symbols_are_remembered_and_a_bad_memory_is_searched_again") {
        return;
    }
    let _serial = serial();
    let cache = TempDir::new("traceme-cache");
    let env = [("EBTRACE_CACHE_DIR", cache.path().to_str().unwrap())];
    let workload = TraceMeWorkload::start(&Toolchain::ALL, &[]);
    std::thread::sleep(Duration::from_millis(100));
    let pid = workload.pid.to_string();
    let capture = |tag: &str| {
        let dir = TempDir::new(tag);
        let out = spawn_record_with_env(&pid, "1s", &dir, &[], &env)
            .wait_with_output()
            .expect("ebtrace runs");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "ebtrace failed: {stderr}");
        (stderr, dir)
    };
    const SEARCHED: &str = " symbols searched in ";
    const REMEMBERED: &str = "symbols remembered from an earlier search of ";

    let (first, _) = capture("traceme-first");
    assert_eq!(first.matches(SEARCHED).count(), 3, "{first}");
    assert_eq!(cached_recorders(&cache).len(), 3);

    let (second, second_dir) = capture("traceme-second");
    assert_eq!(second.matches(REMEMBERED).count(), 3, "{second}");
    assert_eq!(second.matches(SEARCHED).count(), 0, "{second}");

    // A remembered address that is not the object's code is not probed:
    // the object is searched again and the cache mended.
    for file in cached_recorders(&cache) {
        let text = std::fs::read_to_string(&file).unwrap();
        let bad: Vec<String> = text
            .lines()
            .map(|l| match l.strip_prefix("recorder ") {
                Some(r) => {
                    let mut f: Vec<&str> = r.split(' ').collect();
                    f[2] = "0x8";
                    format!("recorder {}", f.join(" "))
                }
                None => l.to_string(),
            })
            .collect();
        std::fs::write(&file, bad.join("\n") + "\n").unwrap();
    }
    let (third, third_dir) = capture("traceme-third");
    assert_eq!(third.matches(SEARCHED).count(), 3, "{third}");
    for file in cached_recorders(&cache) {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(!text.contains(" 0x8 "), "{text}");
    }

    let tids = workload.threads.clone();
    let (_, log) = workload.stop();
    for dir in [&second_dir, &third_dir] {
        let per_lib = assert_matches_log(&trace(dir), &log, &tids);
        for t in Toolchain::ALL {
            let n = per_lib.get(t.tag()).copied().unwrap_or(0);
            assert!(n > 1_000, "{n} spans from the {t:?} recorder");
        }
    }
}

#[test]
fn levels_follow_host_tracer_level_and_sessions_are_only_observed() {
    if !require_root("levels_follow_host_tracer_level_and_sessions_are_only_observed") {
        return;
    }
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let critical = TempDir::new("traceme-l1");
    run_capture(
        workload.pid,
        &critical,
        &["-d", "500ms", "--host-tracer-level", "1"],
    );
    assert_eq!(workload.trace_level(Toolchain::Gcc), -1);
    let verbose = TempDir::new("traceme-l3");
    run_capture(
        workload.pid,
        &verbose,
        &["-d", "500ms", "--host-tracer-level", "3"],
    );
    assert_eq!(workload.trace_level(Toolchain::Gcc), -1);
    let off = TempDir::new("traceme-l0");
    let out = run_capture(
        workload.pid,
        &off,
        &["-d", "300ms", "--host-tracer-level", "0"],
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains("TraceMe"));
    let tids = workload.threads.clone();
    let (_, log) = workload.stop();

    let space = trace(&critical);
    assert_matches_log(&space, &log, &tids);
    let names = names_on(&space, tids.values().copied());
    assert!(names.contains_key("train_step"));
    assert!(!names.contains_key("info_detail") && !names.contains_key("verbose_detail"));
    let space = trace(&verbose);
    assert_matches_log(&space, &log, &tids);
    let names = names_on(&space, tids.values().copied());
    assert!(names.contains_key("info_detail") && names.contains_key("verbose_detail"));
    assert!(names_on(&trace(&off), tids.values().copied()).is_empty());

    // A process with its own session at level 3: ebtrace (asking for 2)
    // only observes, and sees what the session records.
    let session = TraceMeWorkload::start(&[Toolchain::Libcxx], &["--in-process-level", "3"]);
    assert_eq!(session.trace_level(Toolchain::Libcxx), 3);
    let dir = TempDir::new("traceme-session");
    let out = run_capture(session.pid, &dir, &["-d", "500ms"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a profiler session in the process has level 3; observing only"),
        "{stderr}"
    );
    assert_eq!(
        session.trace_level(Toolchain::Libcxx),
        3,
        "ebtrace wrote a session's level"
    );
    let tids = session.threads.clone();
    let (_, log) = session.stop();
    let space = trace(&dir);
    assert_matches_log(&space, &log, &tids);
    assert!(names_on(&space, tids.values().copied()).contains_key("verbose_detail"));
}

/// Starts a long capture and waits until ebtrace says it switched the level on.
fn start_long_capture(pid: u32, dir: &TempDir) -> (std::process::Child, Vec<String>) {
    let pid = pid.to_string();
    let mut child = spawn_record(&pid, "60s", dir, &[]);
    let stderr = child.stderr.take().unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        let done = line.contains("TraceMe recorder in");
        lines.push(line);
        if done {
            break;
        }
    }
    (child, lines)
}

#[test]
fn serve_switches_recording_off_between_captures_on_kept_probes() {
    if !require_root("serve_switches_recording_off_between_captures_on_kept_probes") {
        return;
    }
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let server =
        ServeProcess::loopback(&["--pid", &workload.pid.to_string(), "--keep-probes", "30s"]);
    block_on(async {
        let mut client = server.client().await;
        for capture in ["first", "second"] {
            let response = client.profile(request(600)).await.expect(capture);
            let space = xspace_of(&response.into_inner());
            let host = plane(&space, "/host:CPU");
            let steps = host
                .lines
                .iter()
                .flat_map(|l| line_events(host, l.id))
                .filter(|e| e.name == "train_step")
                .count();
            assert!(steps > 0, "{capture}: no TraceMe event");
            // Between captures the probes stay, recording in the target
            // does not.
            assert_eq!(workload.trace_level(Toolchain::Gcc), -1, "{capture}");
        }
    });
    server.assert_probes_kept();
    workload.stop();
}

#[test]
fn sigterm_mid_capture_restores_the_level() {
    if !require_root("sigterm_mid_capture_restores_the_level") {
        return;
    }
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::LibcxxAlternate], &[]);
    let dir = TempDir::new("traceme-sigterm");
    let (child, lines) = start_long_capture(workload.pid, &dir);
    assert!(
        lines.last().unwrap().contains("level 2 set by ebtrace"),
        "{lines:?}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(workload.trace_level(Toolchain::LibcxxAlternate), 2);
    signal(child.id(), libc::SIGTERM);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    assert!(out.status.success(), "{:?}", out.status);
    assert_eq!(workload.trace_level(Toolchain::LibcxxAlternate), -1);
    let tids = workload.threads.clone();
    let (_, log) = workload.stop();
    let space = trace(&dir);
    assert!(space.warnings.iter().any(|w| w.contains("interrupted")));
    let per_lib = assert_matches_log(&space, &log, &tids);
    assert!(per_lib["libcxx-alt"] > 0);
}

#[test]
fn a_killed_ebtrace_has_the_level_restored_within_a_second() {
    if !require_root("a_killed_ebtrace_has_the_level_restored_within_a_second") {
        return;
    }
    let _serial = serial();
    let mut workload = TraceMeWorkload::start(&[Toolchain::Gcc], &["--mode", "burst"]);
    let (pid, level_at) = (workload.pid, workload.lib(Toolchain::Gcc).trace_level_addr);
    let after = kill_mid_capture(
        pid,
        &["--max-events", "1000000000"],
        "TraceMe recorder in",
        || i64::from(read_i32(pid, level_at)),
        -1,
        Duration::from_millis(500),
    );
    after.assert_restored_and_quiet("level 2 set by ebtrace", 1 << 20, 10);
    assert!(workload.is_running());
    assert!(no_marker_names(pid), "a marker of pid {pid} is left");
    workload.stop();
}

/// True if no marker under /run/ebtrace names `pid`.
fn no_marker_names(pid: u32) -> bool {
    std::fs::read_dir("/run/ebtrace").map_or(true, |entries| {
        !entries.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&format!("traceme-{pid}-")))
        })
    })
}

#[test]
fn a_level_left_on_by_a_killed_ebtrace_and_guard_is_restored_by_any_next_start() {
    if !require_root("a_level_left_on_by_a_killed_ebtrace_and_guard_is_restored_by_any_next_start")
    {
        return;
    }
    let _serial = serial();
    let mut workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let dir = TempDir::new("traceme-sigkill");
    let (mut child, _) = start_long_capture(workload.pid, &dir);
    kill_with_its_guard(&mut child, &workload);
    assert!(xplane_files(dir.path()).is_empty());

    // Any next ebtrace, whatever it traces, puts it back at its start.
    assert_any_next_ebtrace_puts_the_gate_back(&workload);
    assert!(no_marker_names(workload.pid));
    assert!(workload.is_running());
    workload.stop();
}

/// ebtrace in a container, as the DaemonSet runs it: `/run` its own, only
/// `/run/ebtrace` the node's (a hostPath). Killed with its guard at once (a
/// container's OOM kill takes the whole group), it leaves its marker on the
/// node, and an ebtrace outside the container puts the gate back.
#[test]
fn a_gate_left_on_by_a_killed_container_is_put_back_from_the_node_s_markers() {
    if !require_root("a_gate_left_on_by_a_killed_container_is_put_back_from_the_node_s_markers") {
        return;
    }
    let _serial = serial();
    let mut workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let dir = TempDir::new("traceme-container");
    let keep = TempDir::new("traceme-container-markers");
    std::fs::create_dir_all("/run/ebtrace").unwrap();
    // A mount namespace with a fresh /run, the node's /run/ebtrace bound
    // into it, then ebtrace itself (the same pid, through the execs).
    let script = format!(
        "mount --bind /run/ebtrace {keep} && mount -t tmpfs run /run && mkdir /run/ebtrace \
         && mount --bind {keep} /run/ebtrace && exec \"$0\" \"$@\"",
        keep = keep.path().display()
    );
    let mut child = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .arg(ebtrace_tests::ebtrace_bin())
        .args(["-p", &workload.pid.to_string(), "-d", "60s", "--logdir"])
        .arg(dir.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run unshare (util-linux)");
    let stderr = child.stderr.take().unwrap();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        if line.contains("TraceMe recorder in") {
            break;
        }
    }
    kill_with_its_guard(&mut child, &workload);

    assert_any_next_ebtrace_puts_the_gate_back(&workload);
    assert!(workload.is_running());
    workload.stop();
}

/// A process forked while ebtrace had recording on inherits the gate on,
/// and nothing of its own would switch it off: it would record into its
/// memory for ever. The capture's end puts it back in the child too.
#[test]
fn a_child_forked_during_a_capture_has_its_gate_put_back() {
    if !require_root("a_child_forked_during_a_capture_has_its_gate_put_back") {
        return;
    }
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let address = workload.lib(Toolchain::Gcc).trace_level_addr;
    let dir = TempDir::new("traceme-fork");
    let capture = spawn_record(&workload.pid.to_string(), "2s", &dir, &[]);
    let began = Instant::now();
    while workload.trace_level(Toolchain::Gcc) != 2 {
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "recording never on"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let child = workload.fork_child(Duration::from_secs(5));
    assert_eq!(
        read_i32(child, address),
        2,
        "the child inherited the gate on"
    );
    let out = wait_with_deadline(capture, Duration::from_secs(60));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(workload.trace_level(Toolchain::Gcc), -1);
    assert_eq!(read_i32(child, address), -1, "the child records for ever");
    assert!(
        printed.contains(&format!("put back to -1 in its child {child}")),
        "{printed}"
    );
    workload.stop();
}

/// SIGKILLs the capture `child` and its guard at once (nothing of
/// ebtrace's then runs to restore the level), and checks the level it
/// switched on in `workload` is left on.
fn kill_with_its_guard(child: &mut std::process::Child, workload: &TraceMeWorkload) {
    let guards = guards_of(child.id());
    assert_eq!(guards.len(), 1, "one guard per ebtrace: {guards:?}");
    signal(guards[0], libc::SIGKILL);
    signal(child.id(), libc::SIGKILL);
    let _ = child.wait();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(workload.trace_level(Toolchain::Gcc), 2, "level left on");
}

/// An ebtrace started now, tracing something else, puts back the gate a
/// killed one left on in `workload`, and says so.
fn assert_any_next_ebtrace_puts_the_gate_back(workload: &TraceMeWorkload) {
    let mut other = std::process::Command::new("sleep")
        .arg("5")
        .spawn()
        .expect("sleep");
    let next = TempDir::new("traceme-after-kill");
    let out = record(&other.id().to_string(), "100ms", &next, &[]);
    let _ = other.kill();
    let _ = other.wait();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("pid {}: TraceMe gate", workload.pid))
            && stderr.contains("by an ebtrace that died"),
        "{stderr}"
    );
    assert_eq!(workload.trace_level(Toolchain::Gcc), -1);
}

#[test]
fn max_events_switches_recording_off_early() {
    if !require_root("max_events_switches_recording_off_early") {
        return;
    }
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let dir = TempDir::new("traceme-max");
    let out = run_capture(workload.pid, &dir, &["-d", "1s", "--max-events", "2000"]);
    assert_eq!(workload.trace_level(Toolchain::Gcc), -1);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("restored to -1 early (--max-events reached)"),
        "{stdout}"
    );
    let tids = workload.threads.clone();
    let (_, log) = workload.stop();
    // Recording stopped within one drain interval of the limit.
    assert!(
        (2_000..8_000).contains(&log.len()),
        "{} events recorded",
        log.len()
    );
    let space = trace(&dir);
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains("--max-events 2000")),
        "{:?}",
        space.warnings
    );
    assert_matches_log(&space, &log, &tids);
}

/// The events a capture leaves queued in the target stay there until a
/// session of its own drains them: `--max-events` bounds what all captures
/// of the process leave together, however many there are.
#[test]
fn max_events_bounds_all_captures_of_a_process_together() {
    if !require_root("max_events_bounds_all_captures_of_a_process_together") {
        return;
    }
    let _serial = serial();
    let workload = TraceMeWorkload::start(&[Toolchain::Gcc], &[]);
    let mut refused_at = None;
    for capture in 0..50 {
        let dir = TempDir::new("traceme-max-total");
        let out = run_capture(workload.pid, &dir, &["-d", "100ms", "--max-events", "5000"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        if stdout.contains("TraceMe recording not switched on: earlier captures already left") {
            refused_at = Some(capture);
            break;
        }
    }
    assert_eq!(workload.trace_level(Toolchain::Gcc), -1);
    let (_, log) = workload.stop();
    let refused_at = refused_at.expect("every capture switched recording on");
    assert!(refused_at >= 1, "the first capture was refused");
    // What the recorder itself logged, over all captures: the bound, and
    // at most one drain interval's events past it.
    assert!(
        (5_000..11_000).contains(&log.len()),
        "{} events recorded over {refused_at} captures",
        log.len()
    );
}

#[test]
fn a_process_without_traceme_gets_one_info_line() {
    if !require_root("a_process_without_traceme_gets_one_info_line") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let dir = TempDir::new("traceme-none");
    let out = run_capture(workload.pid, &dir, &["-d", "300ms"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let info: Vec<&str> = stderr.lines().filter(|l| l.contains("TraceMe")).collect();
    assert_eq!(info.len(), 1, "{stderr}");
    assert!(info[0].contains("no TraceMe recorder"), "{}", info[0]);
    drop(workload);
    let space = trace(&dir);
    let host: &XPlane = plane(&space, "/host:CPU");
    assert!(host.lines.iter().any(|l| l.events.len() > 1));
}
