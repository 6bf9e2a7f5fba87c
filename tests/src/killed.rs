//! Killing ebtrace in the middle of a capture, the way a user, the OOM
//! killer or a closed terminal would, and watching what it leaves in the
//! target.

use std::{
    io::{BufRead as _, BufReader},
    os::unix::process::CommandExt as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::{TempDir, ebtrace_bin};

/// What a target went through around ebtrace's SIGKILL.
#[derive(Debug)]
pub struct AfterKill {
    /// ebtrace's stderr up to the point it was killed.
    pub stderr: Vec<String>,
    /// From the SIGKILL until the gate read its off value again (`None`:
    /// not within the deadline).
    pub restored_in: Option<Duration>,
    /// The target's resident memory growth over `window` while recording
    /// was on, and over the same time once the gate was back off.
    pub growth_recording: i64,
    pub growth_after: i64,
    /// The guard ebtrace had started.
    pub guards: Vec<u32>,
}

impl AfterKill {
    /// Asserts that ebtrace said `set` last before the kill, that the gate
    /// was restored within the deadline, and that the target's memory grew
    /// by more than `min_growth` bytes while recording and by less than
    /// 1/`ratio` of that afterwards (its recorder stopped queueing).
    /// And that the guard did its job and exited.
    pub fn assert_restored_and_quiet(&self, set: &str, min_growth: i64, ratio: i64) {
        assert_eq!(self.guards.len(), 1, "one guard per ebtrace: {self:?}");
        assert!(
            self.stderr.last().is_some_and(|l| l.contains(set)),
            "{:?}",
            self.stderr
        );
        assert!(
            self.restored_in.is_some(),
            "gate not restored 1 s after ebtrace's SIGKILL: {self:?}"
        );
        eprintln!("{self:?}");
        assert!(
            self.growth_recording > min_growth,
            "resident memory grew only {} bytes while recording",
            self.growth_recording
        );
        assert!(
            self.growth_after * ratio < self.growth_recording,
            "still growing after the restore: {} bytes (recording: {})",
            self.growth_after,
            self.growth_recording
        );
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.guards.iter().any(|g| is_running(*g)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !self.guards.iter().any(|g| is_running(*g)),
            "the guard outlived its job: {self:?}"
        );
    }
}

/// Resident memory of `pid` in bytes.
pub fn resident_bytes(pid: u32) -> i64 {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).expect("statm");
    let pages: i64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn growth_over(pid: u32, window: Duration) -> i64 {
    let before = resident_bytes(pid);
    std::thread::sleep(window);
    resident_bytes(pid) - before
}

/// Starts `ebtrace -p PID -d 60s EXTRA` in a process group of its own,
/// waits until its stderr has a line containing `ready`, measures the
/// target's memory growth over `window`, then SIGKILLs the whole group (a
/// closed terminal signals the group too) and polls `gate` until it reads
/// `off` (1 s deadline), then measures the growth over `window` again.
pub fn kill_mid_capture(
    pid: u32,
    extra: &[&str],
    ready: &str,
    gate: impl Fn() -> i64,
    off: i64,
    window: Duration,
) -> AfterKill {
    let logdir = TempDir::new("killed");
    let pid_arg = pid.to_string();
    let mut child = Command::new(ebtrace_bin())
        .args(["-p", &pid_arg, "-d", "60s"])
        .args(extra)
        .arg("--logdir")
        .arg(logdir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn ebtrace");
    let group = child.id() as i32;
    let mut stderr = Vec::new();
    for line in BufReader::new(child.stderr.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        let done = line.contains(ready);
        stderr.push(line);
        if done {
            break;
        }
    }
    assert!(
        stderr.last().is_some_and(|l| l.contains(ready)),
        "ebtrace never said {ready:?}: {stderr:?}"
    );
    let growth_recording = growth_over(pid, window);
    let guards = guards_of(child.id());
    // SAFETY: plain syscall; the group is the one ebtrace leads.
    unsafe { libc::kill(-group, libc::SIGKILL) };
    let killed = Instant::now();
    let mut restored_in = None;
    while killed.elapsed() < Duration::from_secs(1) {
        if gate() == off {
            restored_in = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // The kernel takes a while to release a dead ebtrace's BPF links.
    let _ = child.wait();
    // TraceMes that had passed the gate just before still land.
    std::thread::sleep(Duration::from_millis(100));
    let growth_after = growth_over(pid, window);
    AfterKill {
        stderr,
        restored_in,
        growth_recording,
        growth_after,
        guards,
    }
}

/// The `ebtrace restore-guard` processes `ebtrace_pid` started.
pub fn guards_of(ebtrace_pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let (Ok(cmdline), Ok(stat)) = (
            std::fs::read(format!("/proc/{pid}/cmdline")),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
        ) else {
            continue;
        };
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if parent == Some(ebtrace_pid) && cmdline.split(|b| *b == 0).any(|a| a == b"restore-guard")
        {
            found.push(pid);
        }
    }
    found
}

/// True while `pid` runs (a zombie has exited).
pub fn is_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z")
    })
}
