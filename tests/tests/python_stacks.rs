//! Python frames in the stacks ebtrace samples, on real CPython processes
//! of every version it reads (3.10 to 3.14 under pyenv, each required): which
//! function and line of the script, nested as the script nests them, and
//! where the time went as py-spy (PyPI), reading the same process after,
//! sees it.

use std::{collections::HashMap, path::Path, time::Duration};

use ebtrace_tests::{
    TempDir, http,
    pyenv::{self, PyFrame, function_lines, is_python_line, python_fixture, python_frames},
    python::PythonWorkload,
    record, require_root, serial,
    serve::ServeProcess,
    xplane_files,
    xspace::{self, Event, line_events, plane},
};

/// The share of `leaves` (innermost Python function of each sample) that
/// is each function.
fn shares(leaves: &[String]) -> HashMap<String, f64> {
    let mut counts: HashMap<String, f64> = HashMap::new();
    for l in leaves {
        *counts.entry(l.clone()).or_default() += 1.0;
    }
    let n = leaves.len().max(1) as f64;
    counts.values_mut().for_each(|c| *c /= n);
    counts
}

/// What py-spy (`record --format raw`) sees of `pid` in `seconds` at 99 Hz:
/// the innermost Python function of each of the main thread's samples.
fn py_spy_leaves(pid: u32, seconds: u32, out: &Path) -> Vec<String> {
    let status = std::process::Command::new(pyenv::py_spy())
        .args(["record", "--pid", &pid.to_string(), "--rate", "99"])
        .args([
            "--duration",
            &seconds.to_string(),
            "--format",
            "raw",
            "--output",
        ])
        .arg(out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run py-spy");
    assert!(status.success(), "py-spy record failed: {status}");
    let text = std::fs::read_to_string(out).expect("py-spy's output");
    // Each line: `frame;frame;...;frame count`, outermost first, each frame
    // `function (file:line)`.
    let mut leaves = Vec::new();
    for line in text.lines() {
        let Some((stack, count)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some(leaf) = stack.rsplit(';').next() else {
            continue;
        };
        let function = leaf.split(" (").next().unwrap_or(leaf).to_string();
        for _ in 0..count.parse::<usize>().unwrap_or(0) {
            leaves.push(function.clone());
        }
    }
    leaves
}

/// The nesting `nested_work.py` runs its work in, outermost last.
const NESTING: [&str; 3] = ["outer_step", "main", "<module>"];

/// Whether `frames` (innermost first) nest as the script does, each line
/// inside its function.
fn nests_as_the_script(frames: &[PyFrame], script: &Path) -> bool {
    let lines = function_lines(script);
    let in_function = |f: &PyFrame| {
        f.function == "<module>"
            || lines
                .iter()
                .any(|(name, range)| *name == f.function && range.contains(&f.line))
    };
    let names: Vec<&str> = frames.iter().map(|f| f.function.as_str()).collect();
    let nested = match names.as_slice() {
        [leaf, rest @ ..] if ["inner_hot", "cold_leaf"].contains(leaf) => rest == NESTING,
        all => all == NESTING,
    };
    nested
        && frames.iter().all(in_function)
        && frames
            .iter()
            .all(|f| Path::new(&f.file).file_name() == script.file_name())
}

/// On CPython 3.`minor`: nearly every sample of the script's thread holds
/// its functions nested as the script nests them, each at a line of its
/// own function, named after the innermost; and the time each function
/// takes agrees with py-spy's reading of the same process.
fn samples_name_the_scripts_lines(minor: u8) {
    let test = format!("python_3_{minor}_samples_name_the_scripts_lines");
    if !require_root(&test) {
        return;
    }
    let _serial = serial();
    let script = python_fixture("nested_work.py");
    let workload = PythonWorkload::start_script(&pyenv::cpython(minor), &script, &[], &[]);
    let logdir = TempDir::new("python-stacks");
    let summary = pyenv::record_json(workload.pid, "3s", &logdir, &["--sample-hz", "99"]);
    let notes = summary["notes"].to_string();
    assert!(
        notes.contains(&format!("Python 3.{minor}")),
        "no line about the interpreter: {notes}"
    );
    let samples = pyenv::sampled_events(&logdir, workload.pid, "cpu_sample_stack");
    assert!(
        samples.len() >= 150,
        "{} samples in 3 s at 99 Hz",
        samples.len()
    );
    let mut leaves = Vec::new();
    let mut well_nested = 0;
    let mut native_below = 0;
    for s in &samples {
        let stack = s.stats["cpu_sample_stack"].as_str();
        let frames = python_frames(stack);
        if nests_as_the_script(&frames, &script) {
            well_nested += 1;
            // The Python frames stand where the eval loop ran them, above
            // the native frames that started the interpreter (not after
            // `_start`, where a stack whose eval frames were not found
            // would put them).
            native_below += u64::from(stack.lines().last().is_some_and(|l| !is_python_line(l)));
            // In the interpreter's own code (or its C runtime), a sample is
            // named after the innermost Python frame.
            let named_after_python = s.name == frames[0].function;
            let native_above = stack.lines().next().is_some_and(|l| !is_python_line(l));
            assert!(named_after_python || native_above, "{}:\n{stack}", s.name);
            // Every native frame is named, or placed in its object where
            // that is stripped (Debian's 3.14): none is a bare address.
            assert!(
                !stack.lines().any(|l| l.starts_with("0x")),
                "3.{minor}: a bare address in\n{stack}"
            );
        }
        leaves.extend(frames.first().map(|f| f.function.clone()));
    }
    let share = well_nested as f64 / samples.len() as f64;
    assert!(
        share >= 0.9,
        "3.{minor}: {well_nested} of {} samples nest as the script does; one that does \
         not:\n{}",
        samples.len(),
        samples
            .iter()
            .map(|s| s.stats["cpu_sample_stack"].as_str())
            .find(|st| !nests_as_the_script(&python_frames(st), &script))
            .unwrap_or_default()
    );
    assert!(
        native_below * 10 >= well_nested * 9,
        "3.{minor}: {native_below} of {well_nested} stacks have native frames below their \
         Python frames; one that has not:\n{}",
        samples
            .iter()
            .map(|s| s.stats["cpu_sample_stack"].as_str())
            .find(|st| st.lines().last().is_some_and(is_python_line))
            .unwrap_or_default()
    );
    let python = &summary["python_stacks"];
    assert!(
        python["stacks_with_python"].as_u64().unwrap() >= well_nested,
        "{python}"
    );
    assert_eq!(python["unreadable_frames"], 0, "{python}");

    let py_spy = py_spy_leaves(workload.pid, 3, &logdir.path().join("py-spy.txt"));
    assert!(py_spy.len() >= 150, "py-spy took {} samples", py_spy.len());
    let (ours, theirs) = (shares(&leaves), shares(&py_spy));
    for function in ["inner_hot", "cold_leaf", "outer_step"] {
        let (a, b) = (
            ours.get(function).copied().unwrap_or(0.0),
            theirs.get(function).copied().unwrap_or(0.0),
        );
        assert!(
            (a - b).abs() <= 0.10,
            "3.{minor}: {function} has {:.0}% of ebtrace's samples and {:.0}% of py-spy's \
             (ebtrace {ours:?}, py-spy {theirs:?})",
            a * 100.0,
            b * 100.0
        );
    }
}

#[test]
fn python_3_10_samples_name_the_scripts_lines() {
    samples_name_the_scripts_lines(10);
}

#[test]
fn python_3_11_samples_name_the_scripts_lines() {
    samples_name_the_scripts_lines(11);
}

#[test]
fn python_3_12_samples_name_the_scripts_lines() {
    samples_name_the_scripts_lines(12);
}

#[test]
fn python_3_13_samples_name_the_scripts_lines() {
    samples_name_the_scripts_lines(13);
}

#[test]
fn python_3_14_samples_name_the_scripts_lines() {
    samples_name_the_scripts_lines(14);
}

/// Two interpreters of different layouts (3.10's frames and 3.13's, whose
/// offsets come from `_Py_DebugOffsets`) in one capture: each process has
/// its own line saying which Python it runs, and its own samples nest as
/// the script does, read with its own layout.
#[test]
fn two_interpreters_in_one_capture_each_read_with_its_own_layout() {
    if !require_root("two_interpreters_in_one_capture_each_read_with_its_own_layout") {
        return;
    }
    let _serial = serial();
    let script = python_fixture("nested_work.py");
    let workloads: Vec<(u8, PythonWorkload)> = [10, 13]
        .into_iter()
        .map(|minor| {
            let python = pyenv::cpython(minor);
            (
                minor,
                PythonWorkload::start_script(&python, &script, &[], &[]),
            )
        })
        .collect();
    let pids: Vec<String> = workloads.iter().map(|(_, w)| w.pid.to_string()).collect();
    let logdir = TempDir::new("python-two");
    let out = record(
        &pids.join(","),
        "3s",
        &logdir,
        &["--json", "--sample-hz", "99"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let notes: Vec<&str> = summary["notes"]
        .as_array()
        .expect("notes")
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    for (minor, workload) in &workloads {
        let pid = format!("pid {} ", workload.pid);
        let version = format!("Python 3.{minor}");
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with(&pid) && n.contains(&version)),
            "no line about {pid}running 3.{minor}: {notes:?}"
        );
        let samples = pyenv::sampled_events(&logdir, workload.pid, "cpu_sample_stack");
        // Two CPU-bound processes share the CPUs with ebtrace.
        assert!(samples.len() >= 60, "3.{minor}: {} samples", samples.len());
        let nested = samples
            .iter()
            .filter(|s| {
                nests_as_the_script(
                    &python_frames(s.stats["cpu_sample_stack"].as_str()),
                    &script,
                )
            })
            .count();
        assert!(
            nested * 10 >= samples.len() * 9,
            "3.{minor}: {nested} of {} samples nest as the script does",
            samples.len()
        );
    }
}

/// Each thread gets its own Python stack: the spinning one in its samples,
/// and, over their waits, the sleeping one (`time.sleep`) and the one
/// blocked in a native read, each in the function that waits. On 3.10
/// (no `native_thread_id`, threads told apart by their thread pointers
/// only), 3.13 (`_Py_DebugOffsets`) and 3.14 (Debian's build, with
/// another C library's thread data).
#[test]
fn each_thread_has_its_own_python_stack_on_and_off_the_cpu() {
    if !require_root("each_thread_has_its_own_python_stack_on_and_off_the_cpu") {
        return;
    }
    let _serial = serial();
    for minor in [10, 13, 14] {
        let script = python_fixture("threads_work.py");
        let workload = PythonWorkload::start_script(&pyenv::cpython(minor), &script, &[], &[]);
        let tid = |name: &str| workload.start_line[name].as_u64().expect("tid") as u32;
        let logdir = TempDir::new("python-threads");
        pyenv::record_json(
            workload.pid,
            "2s",
            &logdir,
            &["--sample-hz", "99", "--off-cpu-min", "20ms"],
        );
        let spinner = pyenv::sampled_events(&logdir, tid("spinner"), "cpu_sample_stack");
        assert!(
            spinner.len() >= 50,
            "3.{minor}: {} spinner samples",
            spinner.len()
        );
        for s in &spinner {
            let frames = python_frames(s.stats["cpu_sample_stack"].as_str());
            assert_eq!(
                frames.first().map(|f| f.function.as_str()),
                Some("spin_in_python"),
                "3.{minor}: {:?}",
                s.stats["cpu_sample_stack"]
            );
        }
        // 3.10's time.sleep waits in select, later ones in clock_nanosleep.
        for (thread, function, calls) in [
            (
                "sleeper",
                "sleep_in_python",
                &["clock_nanosleep", "select"][..],
            ),
            ("reader", "blocked_in_read", &["read"][..]),
        ] {
            let waits = pyenv::sampled_events(&logdir, tid(thread), "off_cpu_stack");
            let named = waits.iter().find(|w| {
                let frames = python_frames(w.stats["off_cpu_stack"].as_str());
                frames.first().map(|f| f.function.as_str()) == Some(function)
            });
            let Some(wait) = named else {
                panic!(
                    "3.{minor}: no wait of the {thread} thread in {function}: {:?}",
                    waits
                        .iter()
                        .map(|w| &w.stats["off_cpu_stack"])
                        .collect::<Vec<_>>()
                );
            };
            assert!(
                calls.iter().any(|c| wait.name.contains(c)),
                "3.{minor}: {}",
                wait.name
            );
            assert!(wait.duration_ns > 0.0);
        }
        drop(workload);
    }
}

/// A process that corrupts its own frame chain (a link to a fake frame
/// whose code is unmapped and whose own link loops back to itself): the
/// capture ends on time, its frames are marked and counted unreadable,
/// nothing is named after the junk, and the honest thread beside it, and
/// the corrupt thread's own frame, are still named.
#[test]
fn a_corrupt_frame_chain_is_marked_and_counted_not_followed() {
    if !require_root("a_corrupt_frame_chain_is_marked_and_counted_not_followed") {
        return;
    }
    let _serial = serial();
    let script = python_fixture("hostile_frames.py");
    let workload = PythonWorkload::start_script(&pyenv::cpython(11), &script, &[], &[]);
    let tid = |name: &str| workload.start_line[name].as_u64().expect("tid") as u32;
    let logdir = TempDir::new("python-hostile");
    let began = std::time::Instant::now();
    let summary = pyenv::record_json(workload.pid, "2s", &logdir, &["--sample-hz", "99"]);
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "{:?}",
        began.elapsed()
    );
    let python = &summary["python_stacks"];
    assert!(
        python["unreadable_frames"].as_u64().unwrap() > 0,
        "{python}"
    );
    let liar = pyenv::sampled_events(&logdir, tid("liar"), "cpu_sample_stack");
    let honest = pyenv::sampled_events(&logdir, tid("honest"), "cpu_sample_stack");
    assert!(
        liar.len() >= 30 && honest.len() >= 30,
        "{} and {}",
        liar.len(),
        honest.len()
    );
    for s in &liar {
        let stack = s.stats["cpu_sample_stack"].as_str();
        // Named after its Python frame, unless the tick found the thread
        // in native code below it (taking the GIL back, say).
        let native_above = stack.lines().next().is_some_and(|l| !is_python_line(l));
        let leaf = python_frames(stack).into_iter().next().map(|f| f.function);
        assert_eq!(leaf.as_deref(), Some("spin_on_a_lie"), "{stack}");
        assert!(
            s.name == "spin_on_a_lie" || native_above,
            "{}:\n{stack}",
            s.name
        );
        assert!(stack.contains("[unreadable python frame]"), "{stack}");
        let marked = stack.lines().filter(|l| l.starts_with('[')).count();
        assert!(marked <= 2, "a loop shows once, not per turn: {stack}");
    }
    for s in &honest {
        let frames = python_frames(s.stats["cpu_sample_stack"].as_str());
        let names: Vec<&str> = frames.iter().map(|f| f.function.as_str()).collect();
        assert_eq!(
            names,
            [
                "spin_honestly",
                "Thread.run",
                "Thread._bootstrap_inner",
                "Thread._bootstrap"
            ]
        );
    }
}

/// Code objects freed and their memory reused while sampled: a fixture
/// compiles a fresh function each round and drops it a few milliseconds
/// later, odd rounds' called from one function and even rounds' from
/// another. The frame a caller called is marked (its code object was gone
/// or reused when ebtrace read it) or named rightly: its parity matches the
/// caller's, its line lies within it. Never after another function.
#[test]
fn a_code_object_freed_and_reused_is_never_named_after_another() {
    if !require_root("a_code_object_freed_and_reused_is_never_named_after_another") {
        return;
    }
    let _serial = serial();
    let script = python_fixture("reused_code.py");
    let workload = PythonWorkload::start_script(&pyenv::cpython(11), &script, &[], &[]);
    let logdir = TempDir::new("python-reused-code");
    pyenv::record_json(workload.pid, "2s", &logdir, &["--sample-hz", "99"]);
    let samples = pyenv::sampled_events(&logdir, workload.pid, "cpu_sample_stack");
    let (mut named, mut marked) = (0, 0);
    for s in &samples {
        let stack = s.stats["cpu_sample_stack"].as_str();
        let lines: Vec<&str> = stack.lines().collect();
        let Some(at) = lines
            .iter()
            .position(|l| l.starts_with("run_odd ") || l.starts_with("run_even "))
        else {
            continue;
        };
        let Some(called) = at.checked_sub(1).map(|i| lines[i]) else {
            continue;
        };
        if called.starts_with("[python frame") {
            marked += 1;
            continue;
        }
        let Some(frame) = python_frames(called).pop() else {
            continue;
        };
        let k: u32 = frame
            .function
            .strip_prefix("generated_")
            .and_then(|k| k.parse().ok())
            .unwrap_or_else(|| panic!("not a generated function: {stack}"));
        named += 1;
        assert!(frame.file.ends_with("generated.py"), "{stack}");
        assert!(
            (k + 1..=k + 5).contains(&frame.line),
            "line {} is not generated_{k}'s: {stack}",
            frame.line
        );
        let caller = if k % 2 == 1 { "run_odd " } else { "run_even " };
        assert!(lines[at].starts_with(caller), "{stack}");
    }
    assert!(
        named + marked >= 30,
        "{named} named and {marked} marked of {} samples",
        samples.len()
    );
}

/// `/debug/pprof/profile` of a CPython process: its locations name the
/// script's functions with their files and lines, and Go's own `go tool
/// pprof -top` lists them, the hot one under most of the time.
#[test]
fn pprof_profiles_name_python_functions_and_go_tool_pprof_lists_them() {
    if !require_root("pprof_profiles_name_python_functions_and_go_tool_pprof_lists_them") {
        return;
    }
    let _serial = serial();
    let script = python_fixture("nested_work.py");
    let workload = PythonWorkload::start_script(&pyenv::cpython(12), &script, &[], &[]);
    let server =
        ServeProcess::loopback(&["--pid", &workload.pid.to_string(), "--http", "127.0.0.1:0"]);
    let response = http::get(server.http_addr(), "/debug/pprof/profile?seconds=2&hz=99");
    assert_eq!(response.status, 200, "{}", response.text());
    let profile = response.pprof();
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let lines = function_lines(&script);
    let inner_hot = &lines
        .iter()
        .find(|(name, _)| name == "inner_hot")
        .unwrap()
        .1;
    let named = profile.location.iter().any(|loc| {
        loc.line.iter().any(|l| {
            let f = &profile.function[l.function_id as usize - 1];
            s(f.name) == "inner_hot"
                && s(f.filename).ends_with("nested_work.py")
                && inner_hot.contains(&(l.line as u32))
        })
    });
    assert!(
        named,
        "no location of inner_hot at one of its lines {inner_hot:?}"
    );

    // Every Python frame named is among the names `/metrics` says are
    // kept; the code objects they were read from went with the capture.
    let script_frames: std::collections::BTreeSet<(&str, i64)> = profile
        .location
        .iter()
        .flat_map(|loc| &loc.line)
        .filter_map(|l| {
            let f = &profile.function[l.function_id as usize - 1];
            s(f.filename)
                .ends_with("nested_work.py")
                .then(|| (s(f.name), l.line))
        })
        .collect();
    let metrics = http::get(server.http_addr(), "/metrics").text();
    let gauge = |name: &str| http::metric(&metrics, name);
    assert!(
        gauge("ebtrace_python_frame_names") >= script_frames.len() as f64,
        "{script_frames:?}: {metrics}"
    );
    assert_eq!(gauge("ebtrace_python_code_object_bytes"), 0.0, "{metrics}");

    // Go's pprof lists the Python functions, the hot one under most of the
    // time (the interpreter's own functions inside it have the most in
    // themselves).
    if let Some((rows, text)) = http::go_pprof_top(&response.body) {
        let cum = |f: &str| rows.iter().find(|r| r.function == f).map(|r| r.cum_pct);
        assert!(
            cum("inner_hot").is_some_and(|c| c >= 50.0),
            "go tool pprof -top:\n{text}"
        );
        assert!(cum("cold_leaf").is_some(), "go tool pprof -top:\n{text}");
    }
}

/// `cuda_launcher.py` on CPython 3.`minor`, the stand-in driver on its
/// library path; and the script's path.
fn start_cuda_launcher(minor: u8) -> (PythonWorkload, std::path::PathBuf) {
    let (lib_dir, _) = ebtrace_tests::cuda::build();
    let script = python_fixture("cuda_launcher.py");
    let library_path = lib_dir.display().to_string();
    let env = [("LD_LIBRARY_PATH", library_path.as_str())];
    let workload = PythonWorkload::start_script(&pyenv::cpython(minor), &script, &[], &env);
    (workload, script)
}

/// A CUDA launch made from Python (through ctypes, on the stand-in
/// driver): each launch's span carries the stack it was made from, with
/// the Python function that launched it and its caller, in order, below
/// the driver's entry point and the native frames of ctypes.
#[test]
fn a_launch_from_python_carries_the_python_line_that_made_it() {
    if !require_root("a_launch_from_python_carries_the_python_line_that_made_it") {
        return;
    }
    let _serial = serial();
    let (workload, script) = start_cuda_launcher(12);
    let logdir = TempDir::new("python-launches");
    let summary = pyenv::record_json(workload.pid, "2s", &logdir, &[]);
    let notes = summary["notes"].to_string();
    assert!(notes.contains("launch stacks"), "{notes}");
    let space = xspace::load(&xplane_files(logdir.path())[0]);
    let host = plane(&space, "/host:CPU");
    let launches: Vec<Event> = line_events(host, i64::from(workload.pid))
        .into_iter()
        .filter(|e| e.name == "cuLaunchKernel")
        .collect();
    assert!(launches.len() >= 40, "{} launches in 2 s", launches.len());
    let lines = function_lines(&script);
    let launch_line = &lines
        .iter()
        .find(|(n, _)| n == "launch_from_python")
        .unwrap()
        .1;
    for launch in &launches {
        let stack = launch.stats["launch_stack"].as_str();
        assert!(stack.starts_with("cuLaunchKernel"), "{stack}");
        let frames = python_frames(stack);
        let names: Vec<&str> = frames.iter().map(|f| f.function.as_str()).collect();
        assert_eq!(
            names,
            ["launch_from_python", "step", "main", "<module>"],
            "{stack}"
        );
        assert!(launch_line.contains(&frames[0].line), "{stack}");
        let first_python = stack.lines().position(is_python_line).unwrap();
        assert!(
            stack
                .lines()
                .take(first_python)
                .any(|l| l.starts_with("ffi_call")),
            "ctypes' native frames stand between the driver and Python: {stack}"
        );
    }
}

/// `/debug/pprof/profile` of a process that launches from Python: beside
/// CPU time, a `launches` value counts the launches made from each stack,
/// and the stack holds the launching Python function.
#[test]
fn pprof_counts_launches_by_the_stack_they_were_made_from() {
    if !require_root("pprof_counts_launches_by_the_stack_they_were_made_from") {
        return;
    }
    let _serial = serial();
    let workload = start_cuda_launcher(13).0;
    let server =
        ServeProcess::loopback(&["--pid", &workload.pid.to_string(), "--http", "127.0.0.1:0"]);
    let response = http::get(server.http_addr(), "/debug/pprof/profile?seconds=2&hz=99");
    assert_eq!(response.status, 200, "{}", response.text());
    let profile = response.pprof();
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let types: Vec<&str> = profile.sample_type.iter().map(|t| s(t.r#type)).collect();
    assert_eq!(types, ["samples", "cpu", "launches"]);
    let function_names = |sample: &ebtrace_proto::perftools::profiles::Sample| -> Vec<String> {
        sample
            .location_id
            .iter()
            .flat_map(|id| &profile.location[*id as usize - 1].line)
            .map(|l| s(profile.function[l.function_id as usize - 1].name).to_string())
            .collect()
    };
    let launches: i64 = profile
        .sample
        .iter()
        .filter(|sample| sample.value[2] > 0)
        .inspect(|sample| {
            let names = function_names(sample);
            assert_eq!(
                names.first().map(String::as_str),
                Some("cuLaunchKernel"),
                "{names:?}"
            );
            assert!(names.iter().any(|n| n == "launch_from_python"), "{names:?}");
        })
        .map(|sample| sample.value[2])
        .sum();
    assert!(
        (40..=110).contains(&launches),
        "{launches} launches in 2 s, one every 20 ms"
    );
}
