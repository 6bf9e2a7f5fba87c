//! XProf itself (the `xprof` package from PyPI) opens what ebtrace writes
//! and shows the traced threads.

use std::time::Duration;

use ebtrace_tests::{
    TempDir, fixture::SchedWorkload, record, require_root, serial, xplane_files, xprof,
};

#[test]
fn xprof_converts_the_trace_to_trace_viewer_json() {
    if !require_root("xprof_converts_the_trace_to_trace_viewer_json") {
        return;
    }
    let Some(python) = xprof::python() else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    std::thread::sleep(Duration::from_millis(100));
    let logdir = TempDir::new("interop");
    let pid = workload.pid.to_string();
    let out = record(&pid, "1s", &logdir, &["-q"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1);

    xprof::assert_shows_sched_workload(&python, &files[0], &workload);
}
