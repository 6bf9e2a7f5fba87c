//! What `deploy/` ships, run for real: the capabilities the systemd unit
//! and the Kubernetes DaemonSet grant are enough for every part of
//! `ebtrace serve` (probes, uprobes, the agent, the flight recorder, CPU
//! profiles and metrics), and
//! two servers on two hosts (network namespaces) are captured by one
//! XProf call, one file per host in one run directory.

use std::{
    collections::BTreeSet,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use ebtrace_proto::tensorflow::GetSnapshotRequest;
use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    deploy::{daemonset_capabilities, deploy_file},
    fixture::SchedWorkload,
    http, require_root, run_ebtrace, serial,
    serve::{ServeProcess, block_on, request, xspace_of},
    wait_with_deadline, xplane_files, xprof,
    xspace::{count_named, plane},
};

/// The capabilities the systemd unit keeps, without their `CAP_`.
fn unit_capabilities(key: &str) -> BTreeSet<String> {
    deploy_file("systemd/ebtrace.service")
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in the unit"))
        .split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_string())
        .collect()
}

#[test]
fn the_deployed_capabilities_are_enough_for_every_part_of_serve() {
    if !require_root("the_deployed_capabilities_are_enough_for_every_part_of_serve") {
        return;
    }
    let caps = daemonset_capabilities();
    assert_eq!(
        caps,
        ["BPF", "PERFMON", "SYS_PTRACE"].map(String::from).into(),
        "the DaemonSet's capabilities changed: check them here"
    );
    assert_eq!(unit_capabilities("CapabilityBoundingSet="), caps);
    assert_eq!(unit_capabilities("AmbientCapabilities="), caps);
    let _serial = serial();

    // Root's uid with only those capabilities, as both deployments run it.
    let bounding = format!(
        "--bounding-set=-all,{}",
        caps.iter()
            .map(|c| format!("+{}", c.to_lowercase()))
            .collect::<Vec<_>>()
            .join(",")
    );
    let wrapper = ["setpriv", bounding.as_str(), "--inh-caps=-all", "--"];
    let mut workload = CudaWorkload::start(&["--bench-seconds", "30"]);
    let pid = workload.pid.to_string();
    let server = ServeProcess::start_under(
        &wrapper,
        &[
            "--bind",
            "127.0.0.1:0",
            "--pid",
            &pid,
            "--retain",
            "10s",
            "--http",
            "127.0.0.1:0",
        ],
        1,
    );
    workload.go();
    std::thread::sleep(Duration::from_millis(300));
    // The CPU profile and the metrics counted from the recorder's probes.
    let response = http::get(server.http_addr(), "/debug/pprof/profile?seconds=1");
    assert_eq!(response.status, 200, "{}", response.text());
    let profile = response.pprof();
    assert!(profile.sample.len() > 5, "{} samples", profile.sample.len());
    let metrics = http::get(server.http_addr(), "/metrics").text();
    let launches = metrics
        .lines()
        .find(|l| {
            l.starts_with("ebtrace_process_cuda_launches_total{")
                && l.contains(&format!("pid=\"{pid}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no launches counted: {metrics}"));
    assert!(launches > 100.0, "{launches} launches counted");
    let (capture, snapshot) = block_on(async {
        let mut client = server.client().await;
        let capture = client.profile(request(500)).await.expect("a capture");
        let snapshot = client
            .get_snapshot(GetSnapshotRequest::default())
            .await
            .expect("a snapshot");
        (
            xspace_of(&capture.into_inner()),
            xspace_of(&snapshot.into_inner()),
        )
    });
    for (what, space) in [("capture", &capture), ("snapshot", &snapshot)] {
        let host = plane(space, "/host:CPU");
        let launches = count_named(host, "cuLaunchKernel");
        assert!(launches > 100, "{what}: {launches} driver calls traced");
    }
    let lines = server.lines();
    assert!(
        !lines.iter().any(|l| l.contains("Operation not permitted")),
        "{lines:?}"
    );
}

/// A host of its own: a network namespace joined to this one by a veth
/// pair, `10.211.N.1` here and `10.211.N.2` there. Removed when dropped.
struct Host {
    name: String,
    addr: String,
}

impl Host {
    fn new(n: u32) -> Self {
        let name = format!("ebtrace-test-{n}");
        let (here, there) = (format!("ebt{n}h"), format!("ebt{n}t"));
        let _ = run(&["ip", "netns", "del", &name]);
        let _ = run(&["ip", "link", "del", &here]);
        for args in [
            vec!["ip", "netns", "add", &name],
            vec![
                "ip", "link", "add", &here, "type", "veth", "peer", "name", &there,
            ],
            vec!["ip", "link", "set", &there, "netns", &name],
            vec![
                "ip",
                "addr",
                "add",
                &format!("10.211.{n}.1/24"),
                "dev",
                &here,
            ],
            vec!["ip", "link", "set", &here, "up"],
        ] {
            run(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
        let addr = format!("10.211.{n}.2");
        for args in [
            vec!["ip", "addr", "add", &format!("{addr}/24"), "dev", &there],
            vec!["ip", "link", "set", &there, "up"],
            vec!["ip", "link", "set", "lo", "up"],
        ] {
            let mut inside = vec!["ip", "netns", "exec", &name];
            inside.extend(args);
            run(&inside).unwrap_or_else(|e| panic!("{inside:?}: {e}"));
        }
        Host { name, addr }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn one_xprof_call_captures_two_hosts_into_one_run() {
    if !require_root("one_xprof_call_captures_two_hosts_into_one_run") {
        return;
    }
    let Some(python) = xprof::python() else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let pid = workload.pid.to_string();
    let hosts = [Host::new(1), Host::new(2)];
    let servers: Vec<ServeProcess> = hosts
        .iter()
        .map(|h| {
            ServeProcess::start_under(
                &["ip", "netns", "exec", &h.name],
                &[
                    "--bind",
                    &format!("{}:6009", h.addr),
                    "--insecure-listen",
                    "--pid",
                    &pid,
                ],
                1,
            )
        })
        .collect();
    let logdir = TempDir::new("two-hosts");
    let addrs = hosts
        .iter()
        .map(|h| format!("{}:6009", h.addr))
        .collect::<Vec<_>>()
        .join(",");
    let script = format!(
        "import xprof.convert._pywrap_profiler_plugin as p\n\
         p.trace({addrs:?}, {:?}, '', True, 1000, 1, {{}})\n",
        logdir.path().to_str().unwrap()
    );
    let child = Command::new(&python)
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    let out = wait_with_deadline(child, Duration::from_secs(120));
    assert!(
        out.status.success(),
        "{}\n{:?}",
        String::from_utf8_lossy(&out.stderr),
        servers.iter().map(ServeProcess::lines).collect::<Vec<_>>()
    );
    let expected: BTreeSet<String> = hosts
        .iter()
        .map(|h| format!("{}_6009.xplane.pb", h.addr))
        .collect();
    assert_one_run_of(logdir.path(), &expected, &python, &workload);

    // `ebtrace capture` of the same two servers writes the same layout.
    let ours = TempDir::new("two-hosts-capture");
    let captured = run_ebtrace(&[
        "capture",
        &addrs,
        "--duration",
        "1s",
        "--logdir",
        ours.path().to_str().unwrap(),
    ]);
    assert!(
        captured.status.success(),
        "{}",
        String::from_utf8_lossy(&captured.stderr)
    );
    assert_one_run_of(ours.path(), &expected, &python, &workload);
}

/// `logdir` holds one run, of the files `expected`, each of which XProf
/// shows `workload` in.
fn assert_one_run_of(
    logdir: &Path,
    expected: &BTreeSet<String>,
    python: &Path,
    workload: &SchedWorkload,
) {
    let files = xplane_files(logdir);
    let runs: BTreeSet<&Path> = files.iter().filter_map(|f| f.parent()).collect();
    assert_eq!(runs.len(), 1, "{files:?}");
    let names: BTreeSet<String> = files
        .iter()
        .filter_map(|f| Some(f.file_name()?.to_str()?.to_string()))
        .collect();
    assert_eq!(&names, expected);
    for file in &files {
        xprof::assert_shows_sched_workload(python, file, workload);
    }
}
