//! `cargo xtask demo`: trace the fixture (with `--gpu`, a GPU workload)
//! for two seconds and prove that XProf can open the result.

use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use ebtrace_tests::cuda::CudaWorkload;

use crate::{
    setup,
    util::{self, Workload, say},
};

/// Converts an `.xplane.pb` the way XProf's trace viewer does and prints
/// what it found. XProf writes `*.SSTABLE` caches next to its input, so it
/// converts a copy in a temporary directory and leaves the log dir alone.
const CONVERT_PY: &str = r#"
import collections, json, os, shutil, sys, tempfile
from xprof.convert import raw_to_tool_data as r

src = sys.argv[1]
with tempfile.TemporaryDirectory() as d:
    copy = os.path.join(d, os.path.basename(src))
    shutil.copy(src, copy)
    data, ctype = r.xspace_to_tool_data([copy], "trace_viewer@", {})
if isinstance(data, bytes):
    data = data.decode()
events = json.loads(data)["traceEvents"]
meta = [e for e in events if e.get("ph") == "M"]
timed = [e for e in events if e.get("ph") != "M"]
threads = [e["args"]["name"] for e in meta if e.get("name") == "thread_name"]
names = collections.Counter(e.get("name") for e in timed)
print(f"xprof: {len(timed)} trace events on {len(threads)} lines ({ctype})")
print("xprof: lines: " + ", ".join(threads))
print("xprof: events: " + ", ".join(f"{n} x{c}" for n, c in names.most_common(8)))
if not timed:
    sys.exit("xprof found no trace events")
"#;

/// A PyTorch loop that keeps an NVIDIA GPU busy, for `demo --gpu` on a
/// machine with one: prints its pid, then multiplies until stopped.
const TORCH_LOOP_PY: &str = r#"
import json, os, torch
a = torch.randn(2048, 2048, device="cuda")
print(json.dumps({"pid": os.getpid()}), flush=True)
while True:
    (a @ a).relu_().sum().item()
"#;

pub fn run_demo(root: &Path, gpu: bool) -> Result<()> {
    util::require_root("demo")?;
    setup::run_setup(root, setup::Options::default())?;
    let ebtrace = util::build_release(root)?;
    if gpu {
        return gpu_demo(root, &ebtrace);
    }
    let fixture = util::build_fixture();

    say("starting the fixture: sched_workload --mode mixed (runs until stopped)");
    let mut cmd = Command::new(&fixture);
    cmd.args(["--mode", "mixed"]);
    let workload = Workload::start(cmd)?;
    let tids: Vec<String> = workload
        .tids
        .iter()
        .map(|(n, t)| format!("{n}={t}"))
        .collect();
    say(format!(
        "fixture pid {} threads {}",
        workload.pid,
        tids.join(" ")
    ));
    let traced = trace(root, &ebtrace, workload.pid);
    let counters = workload.stop();
    let trace = traced?;
    if let Ok(c) = counters {
        say(format!("fixture counters: {c}"));
    }
    check_and_show(root, &trace)
}

/// `demo --gpu`: a real GPU loop where there is a GPU, else the stand-ins.
fn gpu_demo(root: &Path, ebtrace: &Path) -> Result<()> {
    let torch = Command::new("python3")
        .args([
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if torch {
        say("a GPU and PyTorch are here: starting a PyTorch matmul loop (runs until stopped)");
        let mut child = Command::new("python3")
            .args(["-c", TORCH_LOOP_PY])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting python3")?;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("piped")),
            &mut line,
        )?;
        let pid = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v["pid"].as_u64())
            .with_context(|| format!("the PyTorch loop printed {line:?}, not its pid"))?;
        std::thread::sleep(std::time::Duration::from_secs(2));
        let traced = trace(root, ebtrace, pid as u32);
        let _ = child.kill();
        let _ = child.wait();
        return check_and_show(root, &traced?);
    }
    say(
        "no GPU with PyTorch here: starting the stand-in CUDA workload (simulated GPU, \
         stand-in CUPTI with the real record layouts; runs until stopped)",
    );
    let mut workload = CudaWorkload::start_with_cupti(&["--iters", "100000000"], &[]);
    workload.go();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let trace = trace(root, ebtrace, workload.pid)?;
    drop(workload);
    check_and_show(root, &trace)
}

/// Traces `pid` for 2 s into ./ebtrace-logs; the trace's path.
fn trace(root: &Path, ebtrace: &Path, pid: u32) -> Result<String> {
    // Relative logdir, run from the repo root: the printed paths and the
    // viewing command then read the same from there.
    let mut cmd = Command::new(ebtrace);
    cmd.current_dir(root)
        .args(["--pid", &pid.to_string()])
        .args(["--duration", "2s", "--logdir", "ebtrace-logs"])
        // Where the threads waited, too: the sleeper's 10 ms sleeps.
        .args(["--off-cpu-min", "5ms"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    say(format!("$ {}", util::display(&cmd)));
    let out = cmd.output().context("starting ebtrace")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    util::check_status("ebtrace", out.status)?;
    Ok(stdout
        .lines()
        .find_map(|l| l.strip_prefix("trace: "))
        .context("ebtrace printed no `trace: <path>` line")?
        .trim()
        .to_string())
}

/// Checks that XProf converts `trace` and says how to view it.
fn check_and_show(root: &Path, trace: &str) -> Result<()> {
    say("checking that XProf can read the trace (trace_viewer@ conversion)");
    let python = root.join(".venv/bin/python");
    let conv = Command::new(&python)
        .current_dir(root)
        .args(["-c", CONVERT_PY, trace])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    print!("{}", String::from_utf8_lossy(&conv.stdout));
    if !conv.status.success() {
        // XProf's C++ logging is noisy: show it only when it failed.
        eprint!("{}", String::from_utf8_lossy(&conv.stderr));
        bail!("XProf could not convert {trace}");
    }

    println!();
    println!("trace: {}", root.join(trace).display());
    println!("view it (from {}):", root.display());
    println!(
        "  .venv/bin/xprof --logdir ebtrace-logs --port 8791   # then open http://localhost:8791/"
    );
    println!(
        "  (or: tensorboard --logdir ebtrace-logs, with the tensorboard-plugin-profile package)"
    );
    Ok(())
}
