//! Moments where no code may run in a target, met by the loader with one
//! line within its deadline and the target left as it was: a process
//! stopped with SIGSTOP, one whose cgroup is frozen, one another ebtrace
//! is loading into, and a thread whose stack cannot be unwound. Each refusal is checked against the fixture's
//! own counters after it runs again.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use ebtrace_tests::{
    inject::{Target, agent_traces, inject_check_once, wait_for_agent},
    require_root, serial, signal, spawn_ebtrace, wait_with_deadline,
};

/// How long a refusal may take: no call is attempted.
const REFUSED_WITHIN: Duration = Duration::from_secs(5);

/// Runs one load cycle on `target`, which must be refused with the one
/// line that holds `says`, within [`REFUSED_WITHIN`], and leave no agent
/// of its own (`another_loaded`: another ebtrace's stays).
fn assert_refused(target: &Target, says: &str, another_loaded: bool) {
    let began = Instant::now();
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(!ok, "loaded: {stderr}");
    assert!(
        began.elapsed() < REFUSED_WITHIN,
        "took {:?}: {stderr}",
        began.elapsed()
    );
    assert!(stderr.contains(says), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert_eq!(
        agent_traces(target.pid).is_empty(),
        !another_loaded,
        "{:?}",
        agent_traces(target.pid)
    );
}

/// A SIGSTOPped process: nothing is run in it, and once continued it goes
/// on as if nothing had happened.
#[test]
fn a_stopped_process_is_refused_and_left_stopped() {
    if !require_root("a_stopped_process_is_refused_and_left_stopped") {
        return;
    }
    let _serial = serial();
    let target = Target::start("sleep-and-spin");
    signal(target.pid, libc::SIGSTOP);
    let began = Instant::now();
    while !target.status("State").starts_with('T') {
        assert!(began.elapsed() < Duration::from_secs(5), "never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_refused(
        &target,
        &format!(
            "pid {} is stopped (SIGSTOP or a job-control stop)",
            target.pid
        ),
        false,
    );
    assert_eq!(target.status("TracerPid"), "0");
    assert!(target.status("State").starts_with('T'), "it was continued");
    signal(target.pid, libc::SIGCONT);
    target.wait_progress(3);
    assert_eq!(target.errors(), 0);
}

/// A cgroup v2 directory made for one test; thawed and removed when
/// dropped.
struct FrozenCgroup {
    dir: PathBuf,
}

impl FrozenCgroup {
    /// Moves `pid` into a new cgroup and freezes it.
    fn around(pid: u32) -> Self {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let mount = mountinfo
            .lines()
            .find(|l| l.contains(" - cgroup2 "))
            .and_then(|l| l.split_whitespace().nth(4))
            .expect("a cgroup2 mount");
        let dir = PathBuf::from(mount).join(format!("ebtrace-test-frozen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a cgroup");
        let cgroup = FrozenCgroup { dir };
        std::fs::write(cgroup.dir.join("cgroup.procs"), pid.to_string()).expect("move");
        std::fs::write(cgroup.dir.join("cgroup.freeze"), "1").expect("freeze");
        let began = Instant::now();
        while !cgroup.frozen() {
            assert!(began.elapsed() < Duration::from_secs(5), "never frozen");
            std::thread::sleep(Duration::from_millis(5));
        }
        cgroup
    }

    fn frozen(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.events"))
            .unwrap_or_default()
            .lines()
            .any(|l| l == "frozen 1")
    }

    fn thaw(&self) {
        std::fs::write(self.dir.join("cgroup.freeze"), "0").expect("thaw");
    }
}

impl Drop for FrozenCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("cgroup.freeze"), "0");
        // Its processes go back to the root cgroup, then it can go.
        if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            let root = self.dir.parent().expect("the mount").join("cgroup.procs");
            for pid in procs.lines() {
                let _ = std::fs::write(&root, pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A process in a frozen cgroup (`cgroup.freeze`): its threads would take
/// the calls only once thawed, so the load would wait for the thaw and
/// then time out. It is refused at once, and goes on unharmed once thawed.
#[test]
fn a_process_in_a_frozen_cgroup_is_refused() {
    if !require_root("a_process_in_a_frozen_cgroup_is_refused") {
        return;
    }
    let _serial = serial();
    let target = Target::start("sleep-and-spin");
    let cgroup = FrozenCgroup::around(target.pid);
    assert_refused(
        &target,
        &format!("pid {} is in the frozen cgroup /", target.pid),
        false,
    );
    assert_eq!(target.status("TracerPid"), "0");
    assert!(cgroup.frozen(), "it was thawed");
    cgroup.thaw();
    target.wait_progress(3);
    assert_eq!(target.errors(), 0);
}

/// Two ebtraces on one process: while the first keeps its agent loaded,
/// the second says who holds the process, at once, and leaves the first's
/// agent alone (it would have taken it for a killed ebtrace's leftover and
/// unloaded it), so the first unloads its own as usual.
#[test]
fn a_second_ebtrace_on_one_process_says_so_and_leaves_the_first_alone() {
    if !require_root("a_second_ebtrace_on_one_process_says_so_and_leaves_the_first_alone") {
        return;
    }
    let _serial = serial();
    let target = Target::start("sleep-and-spin");
    let pid = target.pid.to_string();
    let first = spawn_ebtrace(&["inject-check", "--pid", &pid, "--hold", "4s"]);
    let first_pid = first.id();
    wait_for_agent(target.pid, Duration::from_secs(20));
    assert_refused(
        &target,
        &format!("pid {pid} is being captured by another ebtrace (pid {first_pid})"),
        true,
    );
    let out = wait_with_deadline(first, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "the first ebtrace's cycle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(agent_traces(target.pid).is_empty());
    target.wait_progress(3);
    assert_eq!(target.errors(), 0);
}

/// A thread whose stack cannot be unwound (it runs on memory with no
/// frames in it): what lies beyond the frames read may hold the loader's
/// lock or an allocator's, so it is never taken over, and the load ends
/// after its wait with the one line that says why.
#[test]
fn a_stack_that_cannot_be_unwound_is_never_taken_over() {
    if !require_root("a_stack_that_cannot_be_unwound_is_never_taken_over") {
        return;
    }
    let _serial = serial();
    let target = Target::start("alien-stack");
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(!ok, "loaded: {stderr}");
    assert!(
        stderr.contains("with a stack that could not be unwound to its outermost frame"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(agent_traces(target.pid).is_empty());
    assert_eq!(target.status("TracerPid"), "0");
    target.wait_progress(3);
    assert_eq!(target.errors(), 0);
}
