//! What a traced process controls cannot hang ebtrace or make it read
//! what it should not. Each target runs in a mount namespace of its own,
//! as any user can make one, where a file ebtrace reads is something
//! else: a FIFO or a device where its loader cache belongs. The capture
//! still ends on time and writes its trace.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use ebtrace_tests::{
    TempDir, require_root, serial, spawn_record, wait_with_deadline, xplane_files,
};

/// A sleeping process whose `/etc/ld.so.cache` is `cache` (bind-mounted
/// over it in a mount namespace of its own); killed when dropped.
struct Hostile(Child);

impl Hostile {
    fn with_cache(cache: &Path) -> Self {
        let script = format!(
            "mount --bind {} /etc/ld.so.cache && exec sleep 600",
            cache.display()
        );
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare");
        let pid = child.id();
        // Ready once `sleep` runs in the new namespace.
        let start = Instant::now();
        while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default() != "sleep\n"
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the target did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Hostile(child)
    }

    fn pid(&self) -> String {
        self.0.id().to_string()
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ebtrace --pid` of `target` for 1 s ends within 20 s and writes a trace.
fn capture_ends_with_a_trace(target: &Hostile, what: &str) {
    let logdir = TempDir::new("hostile");
    let started = Instant::now();
    let child = spawn_record(&target.pid(), "1s", &logdir, &[]);
    let out = wait_with_deadline(child, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what}: ebtrace ended with {} after {:?}: {stderr}",
        out.status,
        started.elapsed()
    );
    assert_eq!(xplane_files(logdir.path()).len(), 1, "{what}: {stderr}");
}

#[test]
fn a_fifo_for_a_loader_cache_does_not_hang_a_capture() {
    if !require_root("a_fifo_for_a_loader_cache_does_not_hang_a_capture") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("hostile-fifo");
    let fifo = dir.path().join("ld.so.cache");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let target = Hostile::with_cache(&fifo);
    capture_ends_with_a_trace(&target, "a FIFO as /etc/ld.so.cache");
}

#[test]
fn a_device_for_a_loader_cache_is_not_read() {
    if !require_root("a_device_for_a_loader_cache_is_not_read") {
        return;
    }
    let _serial = serial();
    let target = Hostile::with_cache(Path::new("/dev/zero"));
    capture_ends_with_a_trace(&target, "/dev/zero as /etc/ld.so.cache");
}
