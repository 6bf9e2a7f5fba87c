//! Launch stacks where ebtrace runs always on: `serve`'s flight recorder
//! takes the stacks of driver calls that submit work at a bounded rate
//! (`--launch-stacks-per-s`, per CPU), whatever the program's launch rate,
//! and each one it takes names the workload's launching function.

use std::time::Duration;

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{
    cuda::CudaWorkload,
    require_root, serial,
    serve::{ServeProcess, block_on, request},
    xspace::{Event, line_events, plane},
};

/// The rate the test asks for: far below the workload's launch rate.
const PER_CPU_PER_S: u64 = 50;

/// The driver calls of `space` that submit work, each with its launch
/// stack where it has one.
fn submissions(space: &XSpace) -> Vec<Event> {
    let host = plane(space, "/host:CPU");
    host.lines
        .iter()
        .flat_map(|l| line_events(host, l.id))
        .filter(|e| {
            e.stats.contains_key("result")
                && ["cuLaunch", "cuMemcpy", "cuMemset"]
                    .iter()
                    .any(|p| e.name.starts_with(p))
        })
        .collect()
}

#[test]
fn the_flight_recorder_takes_launch_stacks_at_its_bounded_rate() {
    if !require_root("the_flight_recorder_takes_launch_stacks_at_its_bounded_rate") {
        return;
    }
    let _serial = serial();
    // 50,000 launches a second, a framework's pace: the recorder's memory
    // holds seconds of them.
    let mut workload = CudaWorkload::start(&["--bench-seconds", "60", "--bench-gap-ns", "20000"]);
    workload.go();
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        "--retain-memory",
        "96",
        "--ring-buffer-mib",
        "4",
        "--launch-stacks-per-s",
        &PER_CPU_PER_S.to_string(),
    ]);
    block_on(async {
        let mut client = server.client().await;
        client
            .start_continuous_profiling(request(2000))
            .await
            .expect("StartContinuousProfiling");
    });
    assert!(
        server
            .wait_line("flight recorder on", Duration::from_secs(10))
            .is_some(),
        "{:?}",
        server.lines()
    );
    std::thread::sleep(Duration::from_secs(3));
    let space = server.snapshot("launch-stacks");

    let calls = submissions(&space);
    let stacked: Vec<&Event> = calls
        .iter()
        .filter(|e| e.stats.contains_key("launch_stack"))
        .collect();
    let first = calls.iter().map(|e| e.start_ns).fold(f64::MAX, f64::min);
    let last = calls.iter().map(|e| e.start_ns).fold(0.0, f64::max);
    let seconds = (last - first) / 1e9;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    // The per-CPU gap lets one stack through at each CPU's first call, then
    // one a gap: a bound of the rate times the window, plus one per CPU.
    let bound = (PER_CPU_PER_S as f64 * seconds.ceil() + 1.0) as u64 * cpus;
    assert!(
        calls.len() as u64 > 10 * bound,
        "{} submissions in {seconds:.1} s: too few to show a bound of {bound}",
        calls.len()
    );
    assert!(
        (stacked.len() as u64) <= bound,
        "{} launch stacks in {seconds:.1} s on {cpus} CPUs, over {PER_CPU_PER_S} a second per CPU",
        stacked.len()
    );
    // One thread launches: it runs on some CPU all the time.
    assert!(
        stacked.len() as f64 >= PER_CPU_PER_S as f64 * seconds * 0.5,
        "{} launch stacks in {seconds:.1} s",
        stacked.len()
    );
    for call in stacked {
        let stack = call.stats["launch_stack"].as_str();
        assert!(stack.starts_with(&call.name), "{}: {stack}", call.name);
        assert!(
            stack.lines().any(|l| l.starts_with("bench_thread")),
            "{}: {stack}",
            call.name
        );
    }
}
