//! XProf itself (the `xprof` package from PyPI) opens what ebtrace writes
//! and shows the traced threads.

use std::{path::PathBuf, process::Output, time::Duration};

use ebtrace_proto::tensorflow::profiler::XSpace;
use ebtrace_tests::{
    TempDir, fixture::SchedWorkload, record, require_root, run_ebtrace, serial,
    serve::ServeProcess, xplane_files, xprof,
};
use prost::Message as _;

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

/// A log directory on a file system of its own, unmounted when dropped.
struct Tmpfs {
    dir: TempDir,
}

impl Tmpfs {
    fn mount(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(status.success(), "mount: {status}");
        Tmpfs { dir }
    }

    /// Fills it up but for `room` bytes.
    fn fill_leaving(&self, room: u64) {
        use std::os::unix::ffi::OsStrExt as _;
        let path = std::ffi::CString::new(self.dir.path().as_os_str().as_bytes()).unwrap();
        // SAFETY: a zeroed statvfs is a valid out-parameter for statvfs.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `stat` is writable.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut stat) }, 0);
        let free = stat.f_bavail * stat.f_frsize;
        // Written, not sparse: a hole takes no room.
        let mut left = free - room;
        let zeros = vec![0u8; 1 << 20];
        let mut filler =
            std::io::BufWriter::new(std::fs::File::create(self.dir.path().join("filler")).unwrap());
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            std::io::Write::write_all(&mut filler, &zeros[..n]).unwrap();
            left -= n as u64;
        }
        std::io::Write::flush(&mut filler).unwrap();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

/// A disk that fills up while the trace is written: the planes that fit
/// are kept whole, XProf opens the file and shows the threads, and the
/// trace and the exit line say it is partial.
#[test]
fn xprof_opens_what_a_full_disk_kept() {
    if !require_root("xprof_opens_what_a_full_disk_kept") {
        return;
    }
    let Some(python) = xprof::python() else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    std::thread::sleep(Duration::from_millis(100));
    let disk = Tmpfs::mount("full-disk");
    let pid = workload.pid.to_string();
    let (out, whole) = write_on_a_filling_disk(&disk, |logdir, extra| {
        record(&pid, "1s", logdir, &[&["-q"], extra].concat())
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let file = assert_partial(&disk, &whole, &stderr);
    assert!(
        !file.with_file_name("perfetto_trace.pb").exists(),
        "a Perfetto trace on a full disk"
    );
    xprof::assert_shows_sched_workload(&python, &file, &workload);
}

/// The same of a trace a server sent to `ebtrace capture`: the planes that
/// fit are kept whole, then the server's Task Environment, warnings and
/// host name; XProf opens it.
#[test]
fn xprof_opens_what_a_full_disk_kept_of_a_servers_trace() {
    if !require_root("xprof_opens_what_a_full_disk_kept_of_a_servers_trace") {
        return;
    }
    let Some(python) = xprof::python() else {
        return;
    };
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let server = ServeProcess::loopback(&["--pid", &workload.pid.to_string()]);
    let address = format!("127.0.0.1:{}", server.port());
    let disk = Tmpfs::mount("full-disk-remote");
    let (out, whole) = write_on_a_filling_disk(&disk, |logdir, _| {
        let logdir = logdir.path().to_str().unwrap();
        run_ebtrace(&["capture", &address, "-d", "1s", "--logdir", logdir])
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("1 of 1 traces were written in part"),
        "{stderr}"
    );
    let file = assert_partial(&disk, &whole, &stderr);
    let kept = XSpace::decode(std::fs::read(&file).unwrap().as_slice()).unwrap();
    assert_eq!(kept.hostnames, whole.hostnames);
    xprof::assert_shows_sched_workload(&python, &file, &workload);
}

/// Writes a trace with `write` (given the log directory and the flags
/// that ask for more than the XSpace) onto `disk` once with room, then
/// with room for its first plane and part of the rest, that room moved (a
/// few times at most) where a trace turns out to fit whole or to have no
/// room for its first plane (a capture takes about as much again). The
/// failing write, and the whole trace.
fn write_on_a_filling_disk(
    disk: &Tmpfs,
    write: impl Fn(&TempDir, &[&str]) -> Output,
) -> (Output, XSpace) {
    let logdir = &disk.dir;
    let out = write(logdir, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let whole = xplane_files(logdir.path()).remove(0);
    let space = XSpace::decode(std::fs::read(&whole).unwrap().as_slice()).unwrap();
    assert_eq!(space.planes[0].name, "/host:CPU");
    let (mut first, mut all) = (
        space.planes[0].encoded_len() as u64,
        space.encoded_len() as u64,
    );
    for _ in 0..5 {
        std::fs::remove_dir_all(logdir.path().join("plugins")).unwrap();
        let _ = std::fs::remove_file(logdir.path().join("filler"));
        disk.fill_leaving((first + all) / 2);
        let out = write(logdir, &["--perfetto"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            all = all * 3 / 4;
        } else if stderr.contains("holds only part of it (none of its planes") {
            first = first * 5 / 4;
        } else {
            return (out, space);
        }
    }
    panic!("no room found that takes part of a trace");
}

/// Checks that `disk` holds one trace, part of `whole`, from its first
/// plane to the Task Environment, that it says it is partial and that
/// `stderr` does; returns its path.
fn assert_partial(disk: &Tmpfs, whole: &XSpace, stderr: &str) -> PathBuf {
    assert!(
        stderr.contains("the disk filled up while the trace was written")
            && stderr.contains("holds only part of it (/host:CPU,"),
        "{stderr}"
    );
    let mut files = xplane_files(disk.dir.path());
    assert_eq!(files.len(), 1, "{stderr}");
    let kept = XSpace::decode(std::fs::read(&files[0]).unwrap().as_slice()).unwrap();
    let names: Vec<&str> = kept.planes.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names.first(), Some(&"/host:CPU"), "{names:?}");
    assert_eq!(names.last(), Some(&"Task Environment"), "{names:?}");
    assert!(names.len() < whole.planes.len(), "{names:?}");
    assert!(
        kept.warnings
            .iter()
            .any(|w| w.starts_with("partial trace:")),
        "{:?}",
        kept.warnings
    );
    files.remove(0)
}
