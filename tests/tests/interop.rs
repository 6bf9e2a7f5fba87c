//! XProf itself (the `xprof` package from PyPI) opens what ebtrace writes
//! and shows the traced threads.

use std::{path::PathBuf, process::Command, time::Duration};

use ebtrace_tests::{
    TempDir, fixture::SchedWorkload, require_root, run_ebtrace, serial, xplane_files,
};

/// The Python that has `xprof` installed, or `None` to skip (unless
/// `EBTRACE_REQUIRE_INTEROP=1`, where a skip is a failure).
fn xprof_python() -> Option<PathBuf> {
    let required = std::env::var("EBTRACE_REQUIRE_INTEROP").as_deref() == Ok("1");
    let python = std::env::var_os("EBTRACE_PYTHON").map(PathBuf::from);
    let ok = python.as_ref().is_some_and(|p| {
        Command::new(p)
            .args(["-c", "import xprof.convert.raw_to_tool_data"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    match (ok, required) {
        (true, _) => python,
        (false, true) => {
            panic!("EBTRACE_PYTHON={python:?} cannot import xprof (run `cargo xtask setup`)")
        }
        (false, false) => {
            eprintln!("skipping: set EBTRACE_PYTHON to a Python with xprof (cargo xtask setup)");
            None
        }
    }
}

const CONVERT: &str = r#"
import json, shutil, sys, tempfile, os
from xprof.convert import raw_to_tool_data as r
# xprof writes side files next to its input: convert a copy.
d = tempfile.mkdtemp()
src = os.path.join(d, os.path.basename(sys.argv[1]))
shutil.copy(sys.argv[1], src)
data, content_type = r.xspace_to_tool_data([src], "trace_viewer@", {})
shutil.rmtree(d)
j = json.loads(data)
out = {"threads": {}, "events": {}}
for e in j["traceEvents"]:
    if e.get("ph") == "M" and e.get("name") == "thread_name":
        out["threads"][str(e["tid"])] = e["args"]["name"]
    elif e.get("ph") == "X":
        key = str(e["tid"]) + "/" + e["name"]
        out["events"][key] = out["events"].get(key, 0) + 1
print(json.dumps(out))
"#;

#[test]
fn xprof_converts_the_trace_to_trace_viewer_json() {
    if !require_root("xprof_converts_the_trace_to_trace_viewer_json") {
        return;
    }
    let Some(python) = xprof_python() else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    std::thread::sleep(Duration::from_millis(100));
    let logdir = TempDir::new("interop");
    let pid = workload.pid.to_string();
    let out = run_ebtrace(&[
        "-p",
        &pid,
        "-d",
        "1s",
        "-q",
        "--logdir",
        logdir.path().to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1);

    let conv = Command::new(&python)
        .args(["-c", CONVERT])
        .arg(&files[0])
        .output()
        .expect("run python");
    assert!(
        conv.status.success(),
        "xprof failed: {}",
        String::from_utf8_lossy(&conv.stderr)
    );
    let stdout = String::from_utf8_lossy(&conv.stdout);
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap())
        .unwrap_or_else(|e| panic!("bad output {stdout}: {e}"));
    for name in ["cpu-burner", "sleeper-10ms", "ping", "pong"] {
        let tid = workload.tid(name).to_string();
        let shown = json["threads"][&tid]
            .as_str()
            .unwrap_or_else(|| panic!("no row for {name}: {json}"));
        assert!(shown.starts_with(name), "row {shown:?} for {name}");
    }
    let burner = workload.tid("cpu-burner");
    assert!(
        json["events"][format!("{burner}/Running")]
            .as_u64()
            .unwrap_or(0)
            >= 1
    );
    let sleeper = workload.tid("sleeper-10ms");
    assert!(
        json["events"][format!("{sleeper}/Blocked")]
            .as_u64()
            .unwrap_or(0)
            >= 50,
        "{json}"
    );
}
