//! PyTorch's ops through ebtrace's agent (RecordFunction callbacks
//! registered for the capture), checked against PyTorch's own profiler run
//! in the same process right after, and against the loop's own log of its
//! steps (`torch_ops_loop.py`); and what is left in the target afterwards.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ebtrace_tests::{
    TempDir, agent_threads, record,
    serve::ServeProcess,
    spawn_record,
    torch::{
        FLOW_STAT, OpKey, Profiled, SCOPE_STAT, SEQUENCE_STAT, SHAPES_STAT, STEP, ask, key_of,
        loop_for, median_step_ns, op_lines, op_spans, per_step, read_profiled,
    },
    wait_for_ebtrace_exits, wait_with_deadline, xplane_files,
    xprof::{self, python_with},
    xspace::{self, Event},
};

/// Every op of a step, each as often as torch.profiler counts it in the
/// same process (within 1%), on as many threads; each train_step range one
/// of the loop's own steps, and every step the loop ran inside the capture
/// one range; nothing of the agent left after.
#[test]
fn ops_per_step_match_pytorchs_own_profiler() {
    let Some((_turn, mut workload)) = loop_for("ops_per_step_match_pytorchs_own_profiler") else {
        return;
    };
    let pid = workload.pid;
    let logdir = TempDir::new("torch-ops");
    let out = record(&pid.to_string(), "2s", &logdir, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stderr}{stdout}");
    assert!(
        stderr.contains(&format!(
            "pid {pid}: PyTorch ops through RecordFunction callbacks"
        )) && stderr.contains("; sequence numbers at byte ")
            && !stderr.contains("beside the program's own"),
        "{stderr}"
    );
    assert!(
        stdout.contains("record_function ranges on the thread lines"),
        "{stdout}"
    );
    let (report, profiled) = ask(&mut workload);
    let loop_steps = report.steps;
    assert!(!report.has_callbacks, "a callback stayed registered");
    assert_eq!(profiled.steps, 5.0);
    assert_eq!(agent_threads(pid), 0, "the agent's thread stayed");

    let lines = op_lines(&logdir);
    let main = i64::from(workload.start_line["tid"].as_u64().expect("tid") as u32);
    let ops = &lines[&main];
    let (steps, counts) = per_step(ops);
    assert!(steps.len() >= 100, "{} train_step ranges", steps.len());

    // Per step, the same ops as torch.profiler's, as many times.
    assert_same_per_step(&counts, &profiled.counts);
    assert!(
        counts.keys().any(|(scope, _)| scope == "backward_function")
            && counts.contains_key(&("function".into(), "aten::addmm".into()))
            && counts.contains_key(&("user_scope".into(), "Optimizer.step#SGD.step".into())),
        "{counts:?}"
    );
    // Each on as many threads as torch.profiler saw it on: the main thread
    // (autograd runs CPU work on the thread that called backward).
    for (key, threads) in &profiled.threads {
        let on: Vec<i64> = lines
            .iter()
            .filter(|(_, ops)| ops.iter().any(|e| key_of(e) == *key))
            .map(|(line, _)| *line)
            .collect();
        assert_eq!(on.len() as u64, *threads, "{key:?} on lines {on:?}");
    }

    // Each train_step range within one of the loop's steps (the loop's
    // clock reads bracket it); every step the loop ran between the first
    // and the last range is one.
    let slack_ns = 50_000.0;
    for s in &steps {
        assert!(
            loop_steps
                .iter()
                .any(|(a, b)| a - slack_ns <= s.start_ns && s.end_ns() <= b + slack_ns),
            "a train_step range from {} to {} is none of the loop's steps",
            s.start_ns,
            s.end_ns()
        );
    }
    let (first, last) = (steps[0].start_ns, steps[steps.len() - 1].end_ns());
    let ran = loop_steps
        .iter()
        .filter(|(a, b)| first - slack_ns <= *a && *b <= last + slack_ns)
        .count();
    assert_eq!(ran, steps.len(), "the loop ran {ran} steps in that time");

    let arrows = assert_sequence_numbers(ops, &steps, &profiled);
    assert_xprof_arrows(&logdir, arrows);
    assert_framework_op_stats(&logdir);
    assert_xprof_steps(&logdir, &steps, &loop_steps);
}

/// Every op of `ours` as often a step as in `theirs` (torch.profiler's),
/// within 1%.
fn assert_same_per_step(ours: &HashMap<OpKey, f64>, theirs: &HashMap<OpKey, f64>) {
    let mut keys: Vec<&OpKey> = ours.keys().chain(theirs.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut mismatches = Vec::new();
    for key in keys {
        let a = ours.get(key).copied().unwrap_or(0.0);
        let b = theirs.get(key).copied().unwrap_or(0.0);
        if (a - b).abs() > 0.01 * a.max(b) {
            mismatches.push(format!("{key:?}: {a} a step, torch.profiler {b}"));
        }
    }
    assert!(mismatches.is_empty(), "{mismatches:#?}");
}

/// The ops inside `steps` carry sequence numbers where torch.profiler's
/// do, as often a step; each backward function shares its number with the
/// forward ops torch.profiler pairs it with, and has an arrow from one.
fn assert_sequence_numbers(ops: &[Event], steps: &[&Event], profiled: &Profiled) -> usize {
    let numbered: Vec<Event> = ops
        .iter()
        .filter(|e| e.stats.contains_key(SEQUENCE_STAT))
        .cloned()
        .chain(steps.iter().map(|s| (*s).clone()))
        .collect();
    let (_, per_step_numbered) = per_step(&numbered);
    assert_same_per_step(&per_step_numbered, &profiled.numbered);
    let mut by_number: HashMap<u64, Vec<&Event>> = HashMap::new();
    for e in numbered.iter().filter(|e| e.name != STEP) {
        by_number
            .entry(e.stats[SEQUENCE_STAT].as_u64())
            .or_default()
            .push(e);
    }
    let mut forward_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for named in by_number.values() {
        let scope_of = |e: &&Event| e.stats[SCOPE_STAT].as_str().to_string();
        let forward = named.iter().filter(|e| scope_of(e) == "function");
        let forward: BTreeSet<String> = forward.map(|e| e.name.clone()).collect();
        for e in named.iter().filter(|e| scope_of(e) == "backward_function") {
            forward_of
                .entry(e.name.clone())
                .or_default()
                .extend(forward.iter().cloned());
        }
    }
    assert!(
        forward_of
            .get("AddmmBackward0")
            .is_some_and(|f| f.contains("aten::addmm")),
        "{forward_of:#?}"
    );
    assert_eq!(forward_of, profiled.forward_of);

    // Each numbered backward function inside a step has an arrow (XProf's
    // `flow` stat) from one of the forward ops torch.profiler pairs it with
    // (AccumulateGrad, made of no op, has no number).
    let arrow = |e: &Event, direction: u64| {
        let v = e.stats.get(FLOW_STAT)?.as_u64();
        (v & 3 == direction).then_some((v >> 2) & ((1 << 56) - 1))
    };
    let sources: HashMap<u64, &Event> =
        ops.iter().filter_map(|e| Some((arrow(e, 2)?, e))).collect();
    let inside = |e: &Event| {
        let i = steps.partition_point(|s| s.start_ns <= e.start_ns);
        i > 0 && e.end_ns() <= steps[i - 1].end_ns()
    };
    let backward = ops
        .iter()
        .filter(|e| e.stats[SCOPE_STAT].as_str() == "backward_function" && inside(e))
        .filter(|e| e.stats.contains_key(SEQUENCE_STAT));
    let mut linked = 0;
    for e in backward {
        let id = arrow(e, 1).unwrap_or_else(|| panic!("{} at {} has no arrow", e.name, e.start_ns));
        let source = sources.get(&id).expect("an arrow from nowhere");
        assert!(
            profiled.forward_of[&e.name].contains(&source.name),
            "an arrow from {} to {}",
            source.name,
            e.name
        );
        linked += 1;
    }
    assert!(linked >= steps.len(), "{linked} arrows");
    linked
}

/// `--torch-op-shapes`: each ATen op inside a step carries its input
/// shapes, and per step each op comes with each list of shapes as often
/// as torch.profiler's `record_shapes` records it in the same process.
#[test]
fn input_shapes_match_pytorchs_own_profiler() {
    let Some((_turn, mut workload)) = loop_for("input_shapes_match_pytorchs_own_profiler") else {
        return;
    };
    let pid = workload.pid;
    let logdir = TempDir::new("torch-ops-shapes");
    let out = record(&pid.to_string(), "1s", &logdir, &["--torch-op-shapes"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("; ATen ops' input shapes"), "{stderr}");
    let (report, profiled) = ask(&mut workload);
    assert!(!report.has_callbacks, "a callback stayed registered");

    let main = i64::from(workload.start_line["tid"].as_u64().expect("tid") as u32);
    let lines = op_lines(&logdir);
    let ops = &lines[&main];
    let mut shaped: Vec<Event> = ops
        .iter()
        .filter(|e| e.stats[SCOPE_STAT].as_str() == "function")
        .map(|e| {
            let shapes = e.stats.get(SHAPES_STAT).map_or("(none)", |s| s.as_str());
            let mut e = e.clone();
            e.stats
                .insert(SCOPE_STAT.into(), xspace::Stat::Str(shapes.into()));
            e
        })
        .collect();
    shaped.extend(ops.iter().filter(|e| e.name == STEP).cloned());
    let (steps, per_step_shapes) = per_step(&shaped);
    assert!(steps.len() >= 50, "{} train_step ranges", steps.len());
    // per_step keys by (its scope stat, name): here (shapes, name).
    let ours: HashMap<OpKey, f64> = per_step_shapes
        .into_iter()
        .map(|((shapes, name), n)| ((name, shapes), n))
        .collect();
    assert!(
        ours.contains_key(&(
            "aten::addmm".into(),
            "[[256], [64, 256], [256, 256], [], []]".into()
        )),
        "{ours:#?}"
    );
    assert_same_per_step(&ours, &profiled.shapes);
}

/// XProf's trace viewer draws at least `arrows` arrows, each from an
/// event to another.
fn assert_xprof_arrows(logdir: &TempDir, arrows: usize) {
    let Some(python) = xprof::python() else {
        return;
    };
    let files = xplane_files(logdir.path());
    let json = xprof::trace_viewer_summary(&python, &files[0]);
    let ids = |f: &serde_json::Value| -> BTreeSet<u64> {
        f.as_array()
            .expect("ids")
            .iter()
            .filter_map(|v| v.as_u64())
            .collect()
    };
    let flows = &json["flows"][""];
    let (out, into) = (ids(&flows["out"]), ids(&flows["in"]));
    let drawn = out.intersection(&into).count();
    assert!(drawn >= arrows, "XProf draws {drawn} arrows of {arrows}");
}

/// XProf's overview page takes the train_step ranges (`steps`) as the
/// program's steps, as long on average as the loop's own log says its
/// steps in that time were.
fn assert_xprof_steps(logdir: &TempDir, steps: &[&Event], loop_steps: &[(f64, f64)]) {
    let Some(python) = xprof::python() else {
        return;
    };
    let files = xplane_files(logdir.path());
    let (found, average_ms) = xprof::overview_steps(&python, &files[0]);
    // XProf leaves out a first and last step it may see only in part.
    assert!(
        (steps.len() - 2..=steps.len()).contains(&found),
        "XProf found {found} steps in {} train_step ranges",
        steps.len()
    );
    let (first, last) = (steps[0].start_ns, steps[steps.len() - 1].end_ns());
    let logged: Vec<f64> = loop_steps
        .iter()
        .filter(|(a, b)| first - 50_000.0 <= *a && *b <= last + 50_000.0)
        .map(|(a, b)| (b - a) / 1e6)
        .collect();
    let logged_ms = logged.iter().sum::<f64>() / logged.len() as f64;
    // The page gives tenths of a millisecond.
    assert!(
        (average_ms - logged_ms).abs() < 0.1 * logged_ms + 0.05,
        "XProf's average step {average_ms} ms, the loop's {logged_ms} ms"
    );
}

/// XProf's framework op stats of the trace in `logdir` count each op (its
/// name's `::` a `.`) as often as the trace holds it, and take its
/// children's time from its own: a `train_step`'s self time is what its
/// ops leave.
fn assert_framework_op_stats(logdir: &TempDir) {
    let Some(python) = xprof::python() else {
        return;
    };
    let files = xplane_files(logdir.path());
    let space = xspace::load(&files[0]);
    let mut in_trace: HashMap<String, f64> = HashMap::new();
    for e in op_spans(&space) {
        *in_trace.entry(e.name).or_default() += 1.0;
    }
    let rows = xprof::framework_host_ops(&python, &files[0]);
    let row = |operation: &str| {
        rows.iter()
            .find(|r| r.operation == operation)
            .unwrap_or_else(|| panic!("no {operation} in XProf's framework op stats: {rows:#?}"))
    };
    for (name, operation) in [
        ("aten::addmm", "aten.addmm"),
        ("AddmmBackward0", "AddmmBackward0"),
        ("Optimizer.step#SGD.step", "Optimizer.step#SGD.step"),
        (STEP, STEP),
    ] {
        let r = row(operation);
        assert_eq!(Some(&r.occurrences), in_trace.get(name), "{r:?}");
        assert_eq!(r.op_type, operation, "{r:?}");
        assert!(r.total_self_time <= r.total_time, "{r:?}");
    }
    let step = row(STEP);
    assert!(
        step.total_self_time < 0.5 * step.total_time,
        "the steps' ops are not taken from their time: {step:?}"
    );
}

/// `--torch-op-sampling 0.1`: about a tenth of the ops the loop ran in
/// the window, by its own step log and torch.profiler's ops a step.
#[test]
fn a_sampled_capture_records_its_share_of_ops() {
    let Some((_turn, mut workload)) = loop_for("a_sampled_capture_records_its_share_of_ops") else {
        return;
    };
    let pid = workload.pid;
    let logdir = TempDir::new("torch-ops-sampled");
    let out = record(
        &pid.to_string(),
        "2s",
        &logdir,
        &["--torch-op-sampling", "0.1"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("; 100000 in a million RecordFunctions, drawn by PyTorch"),
        "{stderr}"
    );
    let (report, profiled) = ask(&mut workload);
    let files = xplane_files(logdir.path());
    let space = xspace::load(&files[0]);
    let (start, stop) = xspace::profile_window(&space);
    let recorded = op_spans(&space).len() as f64;
    let steps = report
        .steps
        .iter()
        .filter(|(a, b)| start as f64 <= *a && *b <= stop as f64)
        .count() as f64;
    // Its ops, and its train_step range.
    let per_step = profiled.counts.values().sum::<f64>() + 1.0;
    let share = recorded / (steps * per_step);
    assert!(
        (0.09..0.11).contains(&share),
        "{recorded} of {steps} steps' {per_step} ops each: a share of {share}"
    );
}

/// ebtrace killed mid-capture: the callbacks are gone within a second (the
/// agent's thread, which removes them before it ends, is gone, and PyTorch
/// says it has no callback), and PyTorch's own profiler, run by the program
/// during the capture and after it, records every op of its steps.
#[test]
fn a_killed_ebtrace_leaves_no_callback_behind() {
    let Some((_turn, mut workload)) = loop_for("a_killed_ebtrace_leaves_no_callback_behind") else {
        return;
    };
    let pid = workload.pid;
    // The reference: what the profiler records before any capture.
    let (before, reference) = ask(&mut workload);
    assert!(!before.has_callbacks);
    let logdir = TempDir::new("torch-ops-killed");
    let capture = ebtrace_tests::await_line(
        spawn_record(&pid.to_string(), "60s", &logdir, &[]),
        "PyTorch ops through RecordFunction callbacks",
    );
    // The program's own profiler, while ebtrace's callbacks run: left
    // alone, it records as much as without them.
    let (during, profiled_during) = ask(&mut workload);
    assert!(during.has_callbacks, "no callback while ebtrace records");
    assert_eq!(profiled_during.counts, reference.counts);

    let killed_at = Instant::now();
    capture.kill();
    while agent_threads(pid) > 0 {
        assert!(
            killed_at.elapsed() < Duration::from_secs(1),
            "the agent still ran a second after ebtrace was killed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (after, profiled_after) = ask(&mut workload);
    assert!(
        !after.has_callbacks,
        "PyTorch still has a RecordFunction callback after the agent ended"
    );
    assert_eq!(profiled_after.counts, reference.counts);
    assert!(after.steps.len() > 10, "the loop stopped");
    // Its rate kept over the second after: the median step within half
    // again of the one before the capture (bound for this VM's drift; a
    // callback left behind is what `has_callbacks` tells).
    std::thread::sleep(Duration::from_secs(1));
    let (later, _) = ask(&mut workload);
    let (was, is) = (median_step_ns(&before), median_step_ns(&later));
    assert!(
        is < was * 1.5,
        "a step took {was:.0} ns before the capture, {is:.0} ns after the kill"
    );
    wait_for_ebtrace_exits();
}

/// A hundred captures one after another: the trampoline PyTorch calls is
/// made once and found again (the target's code and file mappings stay the
/// same), its memory stays flat, each capture has the ops, and PyTorch is
/// left with no callback and its own profiler recording every op.
#[test]
fn captures_in_a_row_leave_the_target_as_they_found_it() {
    let Some((_turn, mut workload)) =
        loop_for("captures_in_a_row_leave_the_target_as_they_found_it")
    else {
        return;
    };
    let pid = workload.pid;
    let (_, reference) = ask(&mut workload);
    let maps = || std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    // What a loaded library or code would add (the loop's own heap grows
    // by anonymous data mappings).
    let code_and_files = || {
        maps()
            .lines()
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(5).is_some_and(|path| path.starts_with('/'))
                    || f.get(1).is_some_and(|p| p.contains('x'))
            })
            .map(str::to_string)
            .collect::<Vec<String>>()
    };
    let resident_kib = || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .expect("status")
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .expect("VmRSS")
    };
    let mut after_first = None;
    for i in 0..100 {
        let logdir = TempDir::new("torch-ops-again");
        let out = record(&pid.to_string(), "100ms", &logdir, &[]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines = op_lines(&logdir);
        assert!(
            lines.values().flatten().any(|e| e.name == "aten::addmm"),
            "capture {i} has no ops"
        );
        let mapped = code_and_files();
        let resident = resident_kib();
        let trampoline = maps().lines().filter(|l| l.starts_with("5eb7a")).count();
        assert_eq!(
            trampoline,
            2,
            "capture {i}: the trampoline's pages:\n{}",
            maps()
        );
        match after_first {
            None => after_first = Some((mapped, resident)),
            Some((ref first_mapped, ref first_resident)) => {
                let gone: Vec<&String> = first_mapped
                    .iter()
                    .filter(|m| !mapped.contains(m))
                    .collect();
                let new: Vec<&String> = mapped
                    .iter()
                    .filter(|m| !first_mapped.contains(m))
                    .collect();
                assert!(
                    gone.is_empty() && new.is_empty(),
                    "capture {i}: mappings changed: gone {gone:#?}, new {new:#?}"
                );
                assert!(
                    resident < *first_resident + 16 * 1024,
                    "capture {i}: {resident} KiB resident, {first_resident} after the first"
                );
            }
        }
    }
    let (after, profiled) = ask(&mut workload);
    assert!(!after.has_callbacks, "a callback stayed registered");
    assert_eq!(profiled.counts, reference.counts);
}

/// `ebtrace serve` on the PyTorch process: jax's `collect_profile` and
/// XProf's "Capture profile" each get its ops in their answer, as many a
/// step as torch.profiler counts.
#[test]
fn profiler_clients_of_ebtrace_serve_get_the_ops() {
    let Some(python) = python_with(&[
        "torch",
        "jax.collect_profile",
        "xprof.convert._pywrap_profiler_plugin",
    ]) else {
        return;
    };
    let Some((_turn, mut workload)) = loop_for("profiler_clients_of_ebtrace_serve_get_the_ops")
    else {
        return;
    };
    let pid = workload.pid;
    let (_, reference) = ask(&mut workload);
    let main = i64::from(workload.start_line["tid"].as_u64().expect("tid") as u32);
    let server = ServeProcess::loopback(&["--pid", &pid.to_string()]);
    let port = server.port().to_string();
    let clients: [(&str, Vec<String>); 2] = [
        (
            "jax.collect_profile",
            vec![
                "-m".into(),
                "jax.collect_profile".into(),
                port.clone(),
                "2000".into(),
            ],
        ),
        (
            "XProf's Capture profile",
            vec![
                "-c".into(),
                xprof::CAPTURE_BUTTON.into(),
                format!("localhost:{port}"),
            ],
        ),
    ];
    for (client, args) in clients {
        let logdir = TempDir::new("torch-ops-serve");
        let mut cmd = Command::new(&python);
        cmd.args(&args);
        if client == "jax.collect_profile" {
            cmd.arg("--log_dir")
                .arg(logdir.path())
                .arg("--no_perfetto_link");
        } else {
            cmd.arg(logdir.path()).args(["2", "1"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the client");
        let out = wait_with_deadline(child, Duration::from_secs(120));
        assert!(
            out.status.success(),
            "{client}: {}{}\nserver: {:?}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            server.lines()
        );
        let lines = op_lines(&logdir);
        let ops = lines
            .get(&main)
            .unwrap_or_else(|| panic!("{client}: no ops on the main thread: {:?}", server.lines()));
        let (steps, counts) = per_step(ops);
        assert!(
            steps.len() >= 50,
            "{client}: {} train_step ranges",
            steps.len()
        );
        for key in [
            ("function".to_string(), "aten::addmm".to_string()),
            ("backward_function".into(), "AddmmBackward0".into()),
            ("user_scope".into(), "Optimizer.step#SGD.step".into()),
        ] {
            assert_eq!(
                counts.get(&key),
                reference.counts.get(&key),
                "{client}: {key:?} over {} steps\nserver: {:?}",
                steps.len(),
                server.lines()
            );
        }
        let asked = Instant::now();
        while agent_threads(pid) > 0 {
            assert!(
                asked.elapsed() < Duration::from_secs(10),
                "{client}: the agent stayed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `ebtrace serve`'s flight recorder loads nothing into a PyTorch process
/// (its ops are taken by captures, which hand them over when they stop):
/// no agent, no callback, no op in a snapshot; a capture served beside it
/// then gets the ops, and leaves nothing behind either.
#[test]
fn the_flight_recorder_leaves_pytorch_alone() {
    let Some(python) = python_with(&["torch", "jax.collect_profile"]) else {
        return;
    };
    let Some((_turn, mut workload)) = loop_for("the_flight_recorder_leaves_pytorch_alone") else {
        return;
    };
    let pid = workload.pid;
    let server = ServeProcess::loopback(&["--pid", &pid.to_string(), "--retain", "30s"]);
    assert!(
        server
            .wait_line("flight recorder on", Duration::from_secs(30))
            .is_some(),
        "{:?}",
        server.lines()
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(agent_threads(pid), 0, "{:?}", server.lines());
    let (report, _) = ask(&mut workload);
    assert!(!report.has_callbacks, "{:?}", server.lines());
    let space = server.snapshot("torch-ops-recorder");
    assert_eq!(op_spans(&space).len(), 0, "ops in the recorder's snapshot");

    let logdir = TempDir::new("torch-ops-beside-recorder");
    let port = server.port().to_string();
    let out = xprof::collect_profile(&python, &port, 1000, logdir.path());
    assert!(
        out.status.success(),
        "{}\nserver: {:?}",
        String::from_utf8_lossy(&out.stderr),
        server.lines()
    );
    let main = i64::from(workload.start_line["tid"].as_u64().expect("tid") as u32);
    let lines = op_lines(&logdir);
    let (steps, _) = per_step(lines.get(&main).map_or(&[][..], Vec::as_slice));
    assert!(steps.len() >= 20, "{} train_step ranges", steps.len());
    let asked = Instant::now();
    while agent_threads(pid) > 0 {
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "the agent stayed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (report, _) = ask(&mut workload);
    assert!(!report.has_callbacks, "a callback stayed after the capture");
}

/// A program whose own torch.profiler runs when ebtrace starts: ebtrace
/// says so, records beside it, every op, and the program's profile is as
/// complete as without ebtrace.
#[test]
fn a_programs_own_profiler_is_left_alone() {
    let Some((_turn, mut workload)) = loop_for("a_programs_own_profiler_is_left_alone") else {
        return;
    };
    let pid = workload.pid;
    let (_, reference) = ask(&mut workload);
    workload.signal(libc::SIGUSR2);
    std::thread::sleep(Duration::from_millis(500));
    let logdir = TempDir::new("torch-ops-beside");
    let out = record(&pid.to_string(), "1s", &logdir, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("; beside the program's own torch.profiler, left as it is"),
        "{stderr}"
    );
    std::thread::sleep(Duration::from_millis(300));
    workload.signal(libc::SIGUSR2);
    let own = read_profiled(&mut workload);
    assert!(
        own.steps >= 100.0,
        "{} steps in the program's profile",
        own.steps
    );
    assert_eq!(own.counts, reference.counts);
    assert_eq!(own.numbered, reference.numbered);

    let main = i64::from(workload.start_line["tid"].as_u64().expect("tid") as u32);
    let lines = op_lines(&logdir);
    let (steps, counts) = per_step(&lines[&main]);
    assert!(steps.len() >= 50, "{} train_step ranges", steps.len());
    assert_eq!(counts, reference.counts);
}
