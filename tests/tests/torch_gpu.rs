//! PyTorch ops that launch GPU work (`torch_launcher.py`: a custom op
//! launching on the stand-in driver, CUPTI recording what the simulated
//! GPU ran): each kernel carries the op whose driver call launched it,
//! checked against the host spans' own nesting, the program's count of its
//! launches, and XProf's kernel stats.

use std::{collections::HashMap, time::Duration};

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{
    TempDir, agent_threads,
    cuda::{build, library_path_with_cupti},
    pyenv::python_fixture,
    python::PythonWorkload,
    record, require_root, serial, xplane_files,
    xprof::{self, python_with},
    xspace::{self, Event, Stat, gpu_planes, line_events, plane},
};

/// The op the fixture's kernels are launched from.
const OP: &str = "ebtrace_test::scale";
/// The stat naming a device event's launching op.
const LAUNCHING_OP_STAT: &str = "torch_op";

/// The device events of every GPU plane, by their correlation id.
fn device_events(space: &XSpace) -> Vec<(u64, Event)> {
    gpu_planes(space)
        .flat_map(|p| p.lines.iter().flat_map(move |l| line_events(p, l.id)))
        .filter_map(|e| Some((e.stats.get("correlation_id")?.as_u64(), e)))
        .collect()
}

/// The host plane's events, line by line.
fn host_lines(space: &XSpace) -> Vec<Vec<Event>> {
    let host = plane(space, "/host:CPU");
    host.lines.iter().map(|l| line_events(host, l.id)).collect()
}

/// A capture of `torch_launcher.py` run with `library_path`: its pid,
/// ebtrace's output, the trace and the kernels the program launched during
/// the capture.
struct Captured {
    workload: PythonWorkload,
    output: String,
    xplane: std::path::PathBuf,
    space: XSpace,
    launched: usize,
    _logdir: TempDir,
}

fn capture_launcher(python: &std::path::Path, library_path: &str) -> Captured {
    let mut workload = PythonWorkload::start_script(
        python,
        &python_fixture("torch_launcher.py"),
        &[],
        &[("LD_LIBRARY_PATH", library_path)],
    );
    let pid = workload.pid.to_string();
    workload.signal(libc::SIGUSR1);
    let _ = workload.next_line();
    let logdir = TempDir::new("torch-gpu");
    let out = record(&pid, "2s", &logdir, &[]);
    let output =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ebtrace failed:\n{output}");
    workload.signal(libc::SIGUSR1);
    let report = workload.next_line();
    let launched = report["launched"].as_array().expect("launched").len();
    let files = xplane_files(logdir.path());
    let space = xspace::load(&files[0]);
    Captured {
        workload,
        output,
        xplane: files[0].clone(),
        space,
        launched,
        _logdir: logdir,
    }
}

#[test]
fn each_kernel_carries_the_op_that_launched_it() {
    if !require_root("each_kernel_carries_the_op_that_launched_it") {
        return;
    }
    let Some(python) = python_with(&["torch"]) else {
        return;
    };
    let _turn = serial();
    let (lib_dir, _) = build();
    let Captured {
        workload,
        output: stderr,
        xplane,
        space,
        launched,
        _logdir: _trace_kept,
    } = capture_launcher(&python, &library_path_with_cupti(&lib_dir));
    assert!(
        stderr.contains("device activity: CUPTI 12.8 activity"),
        "{stderr}"
    );

    // The host's view: each launch's innermost op, by correlation id.
    let mut op_of_launch: HashMap<u64, String> = HashMap::new();
    // The launches the uprobes saw (their spans carry the launch's stack).
    let mut with_stack = std::collections::HashSet::new();
    for line in host_lines(&space) {
        let ops: Vec<&Event> = line
            .iter()
            .filter(|e| e.stats.contains_key("torch_scope"))
            .collect();
        for call in line.iter().filter(|e| e.name.starts_with("cu")) {
            let Some(id) = call.stats.get("correlation_id").map(Stat::as_u64) else {
                continue;
            };
            if call.stats.contains_key("launch_stack") {
                with_stack.insert(id);
            }
            let innermost = ops
                .iter()
                .filter(|o| o.start_ns <= call.start_ns && call.end_ns() <= o.end_ns())
                .max_by(|a, b| a.start_ns.total_cmp(&b.start_ns));
            if let Some(op) = innermost {
                op_of_launch.insert(id, op.name.clone());
            }
        }
    }

    let events = device_events(&space);
    let kernels: Vec<&(u64, Event)> = events
        .iter()
        .filter(|(_, e)| e.stats.contains_key("kernel_details"))
        .collect();
    // Every kernel came from the op, launched by the program during the
    // capture; only one whose op began before the window is not named.
    assert!(
        kernels.len() >= 20 && kernels.len() <= launched,
        "{} kernels in the trace, {launched} launched during the capture\n{stderr}",
        kernels.len()
    );
    let mut named = 0;
    for (id, kernel) in &kernels {
        let Some(op) = kernel.stats.get(LAUNCHING_OP_STAT).map(Stat::as_str) else {
            continue;
        };
        named += 1;
        assert_eq!(op, OP, "kernel {id}");
        assert_eq!(
            op_of_launch.get(id).map(String::as_str),
            Some(OP),
            "kernel {id}"
        );
        assert_eq!(
            kernel.stats.get("tf_op").map(Stat::as_str),
            Some("ebtrace_test.scale:")
        );
    }
    assert!(
        named + 2 >= kernels.len(),
        "{named} of {} kernels named\n{stderr}",
        kernels.len()
    );
    // Each joined to the span the uprobes made of its launch, though a
    // rare launch's stack takes the uprobe tens of µs.
    let joined = kernels
        .iter()
        .filter(|(id, _)| with_stack.contains(id))
        .count();
    assert!(
        joined + 2 >= kernels.len(),
        "{joined} of {} kernels joined to their launch's span\n{stderr}",
        kernels.len()
    );
    // The copies were made outside any op: none is named.
    let copies: Vec<_> = events
        .iter()
        .filter(|(_, e)| e.stats.contains_key("memcpy_details"))
        .collect();
    assert!(copies.len() >= 50, "{} copies\n{stderr}", copies.len());
    for (id, copy) in copies {
        assert!(
            !copy.stats.contains_key(LAUNCHING_OP_STAT),
            "copy {id} named {:?}",
            copy.stats.get(LAUNCHING_OP_STAT).map(Stat::as_str)
        );
    }

    // XProf's kernel stats say which op ran the kernel.
    let rows = xprof::kernel_ops(&python, &xplane);
    let by_op: HashMap<&str, usize> = rows
        .iter()
        .map(|(op, n)| (op.as_str(), *n as usize))
        .collect();
    assert_eq!(by_op.get("ebtrace_test.scale"), Some(&named), "{rows:?}");

    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(agent_threads(workload.pid), 0);
}

/// PyTorch's own CUPTI is CUDA 13's; on a CUDA 12 driver (the stand-in's)
/// it would recurse until the thread's stack is gone. ebtrace leaves it
/// alone, says why, and names the host-observed kernels after their op;
/// the program lives on.
#[test]
fn a_cupti_newer_than_the_driver_is_left_alone() {
    if !require_root("a_cupti_newer_than_the_driver_is_left_alone") {
        return;
    }
    let Some(python) = python_with(&["torch"]) else {
        return;
    };
    let _turn = serial();
    let (lib_dir, _) = build();
    let mut captured = capture_launcher(&python, &lib_dir.display().to_string());
    let output = &captured.output;
    assert!(
        output.contains(
            "the process's CUPTI (libcupti.so.13) needs a CUDA 13 driver and its driver is \
             CUDA 12.8: CUPTI is left alone, only host-observed GPU work is shown"
        ),
        "{output}"
    );
    let kernels: Vec<Event> = device_events(&captured.space)
        .into_iter()
        .map(|(_, e)| e)
        .filter(|e| e.name.contains("vecAdd"))
        .collect();
    assert!(kernels.len() >= 20, "{} kernels\n{output}", kernels.len());
    let named = kernels
        .iter()
        .filter(|e| e.stats.get(LAUNCHING_OP_STAT).map(Stat::as_str) == Some(OP))
        .count();
    assert!(
        named + 2 >= kernels.len(),
        "{named} of {} named\n{output}",
        kernels.len()
    );
    // It still runs and launches.
    std::thread::sleep(Duration::from_millis(200));
    captured.workload.signal(libc::SIGUSR1);
    let report = captured.workload.next_line();
    assert!(!report["launched"].as_array().expect("launched").is_empty());
}
