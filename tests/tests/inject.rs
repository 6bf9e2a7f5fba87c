//! The in-process agent loader (`ebtrace inject-check`) against real
//! processes: a target thread taken over while blocked in `read`, in
//! `nanosleep`, or spinning, must see nothing of it; repeated loads leave
//! nothing behind; and an ebtrace killed at any moment leaves the target
//! running, untraced, and ready for the next load.
//!
//! The library loaded is `tests/fixtures/inject_probe.c` (it answers a
//! byte with that byte + 1), so that the loader is tested alone.

use std::time::{Duration, Instant};

use ebtrace_tests::{
    fixture,
    inject::{
        Library, Target, agent_traces, check_args, footprint, inject_check, inject_check_once,
        proc_state,
    },
    require_root, run_ebtrace, serial, signal, spawn_ebtrace,
};

const MODES: [&str; 3] = ["read", "sleep", "spin"];

/// The thread taken over in each state (blocked in read, in nanosleep, or
/// running) sees no EINTR, no short sleep, no lost read, no changed
/// register, and goes on.
#[test]
fn loaded_and_unloaded_in_every_thread_state_unnoticed() {
    if !require_root("loaded_and_unloaded_in_every_thread_state_unnoticed") {
        return;
    }
    let _serial = serial();
    for (mode, library) in MODES
        .into_iter()
        .flat_map(|m| [(m, Library::Agent), (m, Library::Probe)])
    {
        let target = Target::start(mode);
        let cycles = inject_check(target.pid, 5, library);
        for c in &cycles {
            // The fixture's one thread is the one that made the calls.
            assert_eq!(c["tid"].as_u64(), Some(target.pid as u64), "{mode}: {c}");
        }
        target.wait_progress(5);
        target.assert_untouched(mode);
    }
}

/// A thread taken over while inside malloc (its arena locked) would wait
/// for itself in the loader's first allocation: it is taken only where it
/// holds no lock of the C library, and goes on unharmed. The thread
/// blocked in `epoll_wait` is never taken over, and stopping it to read its
/// `pthread_self()` does not end its wait with EINTR.
#[test]
fn a_thread_busy_in_malloc_is_taken_over_outside_it() {
    if !require_root("a_thread_busy_in_malloc_is_taken_over_outside_it") {
        return;
    }
    let _serial = serial();
    let target = Target::start("malloc");
    let cycles = inject_check(target.pid, 30, Library::Agent);
    for c in &cycles {
        assert_eq!(c["tid"].as_u64(), Some(target.pid as u64), "{c}");
        assert_eq!(c["threads"].as_u64(), Some(2), "{c}");
    }
    assert_stopped_outside(target.pid, &cycles, &["libc.so", "ld-linux"]);
    target.wait_progress(5);
    assert_eq!(target.errors(), 0, "the program saw the takeover");
    assert_eq!(target.status("TracerPid"), "0");
    assert!(agent_traces(target.pid).is_empty());
}

/// The same with tcmalloc preloaded in place of the C library's malloc:
/// the busy thread spends its time in tcmalloc, whose locks the loader's
/// own allocations would meet, and is never taken over there.
#[test]
fn a_thread_busy_in_a_preloaded_malloc_is_taken_over_outside_it() {
    if !require_root("a_thread_busy_in_a_preloaded_malloc_is_taken_over_outside_it") {
        return;
    }
    let _serial = serial();
    let tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";
    assert!(
        std::path::Path::new(tcmalloc).exists(),
        "{tcmalloc} is missing: install the Debian package libtcmalloc-minimal4 \
         (`cargo xtask setup` does)"
    );
    let target = Target::start_with("malloc", &[("LD_PRELOAD", tcmalloc)]);
    assert!(
        !exec_ranges(target.pid, &["libtcmalloc"]).is_empty(),
        "tcmalloc is not mapped in the target"
    );
    let cycles = inject_check(target.pid, 30, Library::Agent);
    for c in &cycles {
        assert_eq!(c["tid"].as_u64(), Some(target.pid as u64), "{c}");
    }
    assert_stopped_outside(target.pid, &cycles, &["libc.so", "ld-linux", "libtcmalloc"]);
    target.wait_progress(5);
    assert_eq!(target.errors(), 0, "the program saw the takeover");
    assert_eq!(target.status("TracerPid"), "0");
    assert!(agent_traces(target.pid).is_empty());
}

/// A thread blocked in `recv` on a socket with a receive timeout is ended
/// with EINTR by any stop (the kernel does not restart it): stopped to read
/// its `pthread_self()` at every load and unload, it replays the call and
/// the program never sees the EINTR.
#[test]
fn a_receive_with_a_timeout_never_sees_the_stops() {
    if !require_root("a_receive_with_a_timeout_never_sees_the_stops") {
        return;
    }
    let _serial = serial();
    let target = Target::start("recv");
    let cycles = inject_check(target.pid, 20, Library::Agent);
    for c in &cycles {
        // The thread in recv is never the one taken over.
        assert_ne!(c["tid"].as_u64(), Some(target.pid as u64), "{c}");
        assert_eq!(c["threads"].as_u64(), Some(2), "{c}");
    }
    target.wait_progress(5);
    assert_eq!(
        target.errors(),
        0,
        "the program saw EINTR, or lost a number"
    );
    assert_eq!(target.status("TracerPid"), "0");
    assert!(agent_traces(target.pid).is_empty());
}

/// A thread waiting in `io_uring_enter` for a completion is ended with
/// EINTR by any stop, as `recv` with a timeout is: it replays the call and
/// the program never sees the EINTR.
#[test]
fn an_io_uring_wait_never_sees_the_stops() {
    if !require_root("an_io_uring_wait_never_sees_the_stops") {
        return;
    }
    let _serial = serial();
    let target = Target::start("io-uring");
    inject_check(target.pid, 10, Library::Agent);
    target.wait_progress(5);
    assert_eq!(target.errors(), 0, "the io_uring wait saw EINTR");
    assert_eq!(target.status("TracerPid"), "0");
}

/// A `connect` with a send timeout is ended with EINTR by any stop, and
/// cannot be issued again as it was (the kernel does not restart it): the
/// thread waiting in it is never stopped, not even to read its
/// `pthread_self()`, so the program sees each connect time out.
#[test]
fn a_connect_with_a_timeout_is_never_stopped() {
    if !require_root("a_connect_with_a_timeout_is_never_stopped") {
        return;
    }
    let _serial = serial();
    let target = Target::start("connect");
    let cycles = inject_check(target.pid, 10, Library::Agent);
    for c in &cycles {
        assert_ne!(c["tid"].as_u64(), Some(target.pid as u64), "{c}");
    }
    target.wait_progress(5);
    assert_eq!(target.errors(), 0, "a connect or a sleep was cut short");
    assert_eq!(target.status("TracerPid"), "0");
}

/// A thread that runs 200 us, then waits 1 ms in a `connect` with a send
/// timeout, again and again: seen running, it is often in the `connect` by
/// the time it stops. On a Unix-domain socket the interrupted `connect` is
/// issued again, so the program sees each one time out, and no sleep of
/// its other thread is cut short.
#[test]
fn a_connect_entered_as_the_thread_is_stopped_still_times_out() {
    if !require_root("a_connect_entered_as_the_thread_is_stopped_still_times_out") {
        return;
    }
    let _serial = serial();
    let target = Target::start("connect-after-spin");
    inject_check(target.pid, 10, Library::Agent);
    target.wait_progress(5);
    assert_eq!(target.errors(), 0, "a connect or a sleep was cut short");
    assert_eq!(target.status("TracerPid"), "0");
}

/// A preloaded allocator that none of ebtrace's lists knows, holding its
/// own lock while it sleeps: the thread is always inside it, and taken
/// over there it would wait for itself in the loader's first allocation,
/// for ever. Its stack shows the allocator, so it is never taken over
/// there; the program goes on.
#[test]
fn a_thread_inside_an_unknown_preloaded_allocator_is_never_taken_over_there() {
    if !require_root("a_thread_inside_an_unknown_preloaded_allocator_is_never_taken_over_there") {
        return;
    }
    let _serial = serial();
    let slow = fixture::build_c_shared("slow_malloc", "libslow_malloc.so");
    let target = Target::start_with("slow-malloc", &[("LD_PRELOAD", slow.to_str().unwrap())]);
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    // Outside the allocator the thread spends a few microseconds in 50 ms:
    // the load is refused, rarely made there.
    if !ok {
        assert!(
            stderr.contains("with an allocator on its stack"),
            "{stderr}"
        );
    }
    target.wait_progress(3);
    assert_eq!(target.errors(), 0);
    assert_eq!(target.status("TracerPid"), "0");
    assert!(agent_traces(target.pid).is_empty());
}

/// A library's constructor that never returns holds the loader's lock for
/// ever, so the agent's `dlopen` on any other thread waits for ever: the
/// call is abandoned after a few seconds, the thread put back where it was
/// (its sleeps go on, unshortened), and the error says why. The thread in
/// the constructor is never taken over.
#[test]
fn a_load_that_waits_for_ever_is_abandoned_and_the_thread_put_back() {
    if !require_root("a_load_that_waits_for_ever_is_abandoned_and_the_thread_put_back") {
        return;
    }
    let _serial = serial();
    let stuck = fixture::build_c_shared("stuck_constructor", "libstuck_constructor.so");
    let target = Target::start_with_args(&["stuck-constructor", stuck.to_str().unwrap()], &[]);
    let began = Instant::now();
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "dlopen() in pid {} did not return in 5 s",
            target.pid
        )),
        "{stderr}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "{:?}",
        began.elapsed()
    );
    target.wait_progress(5);
    assert_eq!(target.errors(), 0, "the program saw the takeover");
    assert_eq!(target.status("TracerPid"), "0");
    // The load's memfd and socket were closed again.
    assert!(
        agent_traces(target.pid).is_empty(),
        "{:?}",
        agent_traces(target.pid)
    );
}

/// The fixture in mode `allocator-held`, its threads started.
fn allocator_held_target() -> Target {
    let slow = fixture::build_c_shared("slow_malloc", "libslow_malloc.so");
    let target = Target::start_with("allocator-held", &[("LD_PRELOAD", slow.to_str().unwrap())]);
    target.wait_progress(5);
    target
}

/// Has the fixture's `allocator-held` thread hold the preloaded
/// allocator's lock for `seconds`.
fn hold_allocator(pid: u32, seconds: i32) {
    let value = libc::sigval {
        sival_ptr: seconds as usize as *mut libc::c_void,
    };
    // SAFETY: a signal with a value to a process of ours.
    let r = unsafe { libc::sigqueue(pid as i32, libc::SIGUSR1, value) };
    assert_eq!(r, 0, "sigqueue: {}", std::io::Error::last_os_error());
}

/// A `dlopen` made for the agent takes the loader's lock, then allocates:
/// while another thread holds the allocator's lock (a preloaded allocator
/// paging in under its lock, say) the call waits there, holding the
/// loader's. Pulled out of it, the thread would keep the loader's lock for
/// ever and every later `dlopen` of the program would wait for it; so the
/// call is waited for, past the usual timeout, and the load goes on once
/// the allocator is free. The program's threads keep loading libraries.
#[test]
fn a_call_that_holds_the_loader_lock_is_waited_for_never_pulled_out() {
    if !require_root("a_call_that_holds_the_loader_lock_is_waited_for_never_pulled_out") {
        return;
    }
    let _serial = serial();
    let target = allocator_held_target();
    hold_allocator(target.pid, 9);
    let began = Instant::now();
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("it would keep that lock for ever, so it is waited for"),
        "the load did not wait on the allocator: {stderr}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "{:?}",
        began.elapsed()
    );
    // Both of the program's threads load libraries again.
    target.wait_progress(20);
    target.assert_untouched("allocator held 9 s");
}

/// The same call, its wait longer than ebtrace gives it: ebtrace ends with
/// one line, leaving the thread to finish the call by itself (the
/// trampoline then puts it back in its own code), and the next load takes
/// out what that call left.
#[test]
fn a_call_that_holds_the_loader_lock_too_long_is_left_to_finish_by_itself() {
    if !require_root("a_call_that_holds_the_loader_lock_too_long_is_left_to_finish_by_itself") {
        return;
    }
    let _serial = serial();
    let target = allocator_held_target();
    let hold = Instant::now();
    hold_allocator(target.pid, 28);
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("was left to finish it by itself"),
        "{stderr}"
    );
    assert!(
        hold.elapsed() < Duration::from_secs(27),
        "{:?}",
        hold.elapsed()
    );
    assert_eq!(target.status("TracerPid"), "0");
    // Once the allocator is free, the call ends and the program goes on.
    std::thread::sleep(Duration::from_secs(28).saturating_sub(hold.elapsed()));
    target.wait_progress(20);
    assert_eq!(target.errors(), 0, "the program saw the takeover");
    let (ok, stderr) = inject_check_once(target.pid, Duration::from_secs(60));
    assert!(ok, "{stderr}");
    target.wait_progress(5);
    target.assert_untouched("allocator held 28 s, then loaded again");
}

/// glibc's `setresuid()` in a multithreaded program signals every thread
/// and waits until each has run its handler, which acts only on a signal
/// its own process sent: a thread held while the signal came must get it
/// back with its own sender, or the program waits for ever. The thread
/// waiting inside `setresuid()` holds the lock starting a thread takes: it
/// is never the one taken over, or the agent's start would wait for it.
#[test]
fn a_set_id_call_in_another_thread_goes_on_through_the_takeovers() {
    if !require_root("a_set_id_call_in_another_thread_goes_on_through_the_takeovers") {
        return;
    }
    let _serial = serial();
    let target = Target::start("setxid");
    inject_check(target.pid, 30, Library::Agent);
    target.wait_progress(50);
    assert_eq!(target.errors(), 0, "the program saw the takeover");
    assert_eq!(target.status("TracerPid"), "0");
}

/// A thread taken over may hold a `dlopen` error it has not read yet, or
/// the message `dlerror()` gave it: the loader's own `dl*` calls reset and
/// free both. After every load and unload the error is still there and the
/// message intact.
#[test]
fn a_dlopen_error_the_program_holds_survives_the_takeovers() {
    if !require_root("a_dlopen_error_the_program_holds_survives_the_takeovers") {
        return;
    }
    let _serial = serial();
    let target = Target::start("dlerror");
    let cycles = inject_check(target.pid, 20, Library::Agent);
    assert!(
        cycles
            .iter()
            .any(|c| c["tid"].as_u64() == Some(target.pid as u64)),
        "the thread holding the error was never taken over: {cycles:?}"
    );
    target.wait_progress(10);
    assert_eq!(
        target.errors(),
        0,
        "the program lost its dlopen error, or read a freed message"
    );
    assert_eq!(target.status("TracerPid"), "0");
}

/// The executable mappings in `pid` of the objects whose file name starts
/// with one of `names`, as `/proc/PID/maps` lists them.
fn exec_ranges(pid: u32, names: &[&str]) -> Vec<(u64, u64, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("maps")
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = *f.get(5)?;
            let file = path.rsplit('/').next()?;
            if !f[1].contains('x') || !names.iter().any(|n| file.starts_with(n)) {
                return None;
            }
            let (a, b) = f[0].split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
                file.to_string(),
            ))
        })
        .collect()
}

/// No load or unload of `cycles` took a thread over while it ran code of
/// the objects named (a wait blocked in the C library is fine).
fn assert_stopped_outside(pid: u32, cycles: &[serde_json::Value], names: &[&str]) {
    let ranges = exec_ranges(pid, names);
    assert!(!ranges.is_empty(), "none of {names:?} is mapped in {pid}");
    let (mut in_code, mut in_waits) = (0, 0);
    for c in cycles {
        for phase in ["load", "unload"] {
            let stopped = &c[phase]["stopped"];
            let Some(ip) = stopped["ip"].as_u64() else {
                assert!(stopped["wait"].is_i64(), "{c}");
                in_waits += 1;
                continue;
            };
            in_code += 1;
            if let Some((_, _, file)) = ranges.iter().find(|(a, b, _)| (*a..*b).contains(&ip)) {
                panic!("the {phase} of cycle {c} took the thread over inside {file}");
            }
        }
    }
    eprintln!("taken over in its own code {in_code} times, in a wait {in_waits} times");
}

fn median_us(cycles: &[serde_json::Value], phase: &str, field: &str) -> u64 {
    let mut v: Vec<u64> = cycles
        .iter()
        .map(|c| c[phase][field].as_u64().expect("a duration"))
        .collect();
    v.sort_unstable();
    v[v.len() / 2]
}

/// 100 load/unload cycles leave the target's mappings, descriptors and
/// resident memory as they were.
#[test]
fn hundred_cycles_leave_nothing_behind() {
    if !require_root("hundred_cycles_leave_nothing_behind") {
        return;
    }
    let _serial = serial();
    let target = Target::start("read");
    // The first cycle may leave what glibc keeps for reuse (a cached
    // thread stack, grown heap): measure after it.
    inject_check(target.pid, 1, Library::Agent);
    let before = footprint(target.pid);
    let cycles = inject_check(target.pid, 100, Library::Agent);
    let after = footprint(target.pid);
    assert_eq!(after.0, before.0, "mappings (lines of /proc/PID/maps) grew");
    assert_eq!(after.1, before.1, "open descriptors grew");
    assert!(
        after.2 <= before.2 + 512,
        "VmRSS grew from {} to {} KiB",
        before.2,
        after.2
    );
    assert_eq!(target.errors(), 0);
    target.wait_progress(3);
    eprintln!(
        "median over 100 cycles: load diverted {} us, total {} us; unload diverted {} us, total {} us",
        median_us(&cycles, "load", "thread_diverted_us"),
        median_us(&cycles, "load", "total_us"),
        median_us(&cycles, "unload", "thread_diverted_us"),
        median_us(&cycles, "unload", "total_us"),
    );
}

/// A small deterministic generator for the kill delays (seed printed).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// `ebtrace inject-check` SIGKILLed at random moments of repeated
/// load/unload cycles: the target is never left stopped or traced, never
/// sees the takeover, and the next load takes out what was left loaded.
#[test]
fn killed_loader_leaves_the_target_running_and_untraced() {
    if !require_root("killed_loader_leaves_the_target_running_and_untraced") {
        return;
    }
    let _serial = serial();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as u64;
    eprintln!("kill delays seed {seed}");
    let mut rng = Lcg(seed);
    for mode in MODES {
        let target = Target::start(mode);
        let args = check_args(target.pid, 1000, Library::Agent);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for round in 0..20 {
            let mut child = spawn_ebtrace(&args);
            std::thread::sleep(Duration::from_millis(1 + rng.below(40)));
            signal(child.id(), libc::SIGKILL);
            let _ = child.wait();
            let began = Instant::now();
            loop {
                let state = target.status("State");
                let traced = target.status("TracerPid") != "0";
                if !traced && !state.starts_with('t') && !state.starts_with('T') {
                    break;
                }
                assert!(
                    began.elapsed() < Duration::from_secs(1),
                    "{mode} round {round}: target left {}",
                    proc_state(target.pid)
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(
                target.errors(),
                0,
                "{mode} round {round}: the program saw the takeover"
            );
        }
        target.wait_progress(5);
        assert_eq!(target.errors(), 0, "{mode}");
        // The next load cleans up what the killed ones left loaded.
        inject_check(target.pid, 1, Library::Agent);
        assert!(
            agent_traces(target.pid).is_empty(),
            "{mode}: left behind {:?}",
            agent_traces(target.pid)
        );
        target.wait_progress(3);
        assert_eq!(target.errors(), 0, "{mode}");
    }
}

/// The errors name the cause: a process already traced by someone else
/// (say, a debugger) and one that does not exist.
#[test]
fn refusals_say_why() {
    if !require_root("refusals_say_why") {
        return;
    }
    let _serial = serial();
    let target = Target::start("sleep");
    // This test process plays the debugger.
    // SAFETY: PTRACE_SEIZE of our own child; no pointers involved.
    let seized = unsafe { libc::ptrace(libc::PTRACE_SEIZE, target.pid as libc::pid_t, 0, 0) };
    assert_eq!(seized, 0, "seize: {}", std::io::Error::last_os_error());
    let args = check_args(target.pid, 1, Library::Agent);
    let out = run_ebtrace(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        // TracerPid names the tracing thread.
        // SAFETY: gettid has no preconditions.
        stderr.contains(&format!("already traced by pid {}", unsafe {
            libc::gettid()
        })),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    drop(target);

    let mut args = check_args(1, 1, Library::Agent);
    args[2] = (u32::MAX / 2).to_string();
    let out = run_ebtrace(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no process with pid"), "{stderr}");
}
