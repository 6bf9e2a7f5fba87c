//! What `/proc` says of this test's own process and its children, against
//! what the standard library and the kernel's interfaces say.

use std::{
    fs,
    os::{fd::AsRawFd as _, unix::fs::FileExt as _},
    path::Path,
};

use super::*;
use crate::error::Error;

#[test]
fn a_descriptor_released_first_sits_above_the_others_and_closes_on_exec() {
    let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let before = ours.as_raw_fd();
    let moved = released_first_at_exit(ours.into());
    let highest_other = fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&fd| fd != moved.as_raw_fd())
        .max()
        .unwrap();
    assert!(moved.as_raw_fd() > before && moved.as_raw_fd() > highest_other);
    let flags = rustix::io::fcntl_getfd(&moved).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
}

/// What `/proc` says of this test's own process, against what the
/// standard library and the kernel's interfaces say.
#[test]
fn this_process_read_through_proc() {
    let pid = std::process::id();
    assert_eq!(executable(pid), std::env::current_exe().unwrap());
    assert!(maps_text(pid).unwrap().contains("[stack]"));
    let main = thread_name(pid, pid).unwrap();
    assert!(!main.is_empty() && !main.ends_with('\n'), "{main:?}");
    assert_eq!(process_name(pid).unwrap(), main);
    assert!(thread_status_field(pid, pid, "Tgid").is_some_and(|t| t == pid.to_string()));
    assert_eq!(tracer_of(pid), None);
    assert!(sysctl_number("kernel/pid_max").is_some_and(|n| n >= 301));
    // SAFETY: an all-zero `utsname` is valid (arrays of bytes).
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname fills the struct it is given.
    let rc = unsafe { libc::uname(&mut uts) };
    assert_eq!(rc, 0);
    // SAFETY: uname NUL-terminates its fields.
    let release = unsafe { std::ffi::CStr::from_ptr(uts.release.as_ptr()) };
    assert_eq!(kernel_release(), release.to_str().unwrap());
    assert!(own_cpu_seconds().is_some());
}

/// The files, threads and counters `/proc` shows of this test's process.
#[test]
fn this_process_files_and_threads_read_through_proc() {
    let pid = std::process::id();
    let file = fs::File::open(own_executable()).unwrap();
    let targets = descriptor_targets(pid).unwrap();
    assert!(
        targets.contains(&(file.as_raw_fd(), executable(pid))),
        "{targets:?}"
    );
    assert!(is_listed(pid) && thread_is_listed(pid, pid));
    assert!(!thread_is_listed(pid, 4_194_305 + 7));
    assert!(thread_syscall(pid, pid).is_some());
    assert!(thread_syscall_number(pid, pid).is_some());
    assert!(thread_schedstat(pid, pid).is_some());
    assert!(thread_context_switches(pid, pid).is_some_and(|s| s.voluntary > 0));
    let environment = environment(pid);
    assert!(environment.is_empty() || environment.ends_with(&[0]));
    assert!(
        environment
            .split(|&b| b == 0)
            .filter(|entry| !entry.is_empty())
            .all(|entry| entry.contains(&b'='))
    );
    let mut bytes = [0u8; 8];
    let value = 0x1234_5678_9abc_def0_u64;
    let address = std::hint::black_box(&raw const value) as u64;
    memory_file(pid)
        .unwrap()
        .read_exact_at(&mut bytes, address)
        .unwrap();
    assert_eq!(u64::from_ne_bytes(bytes), value);
    let (start, ..) = mapping_at(pid, address).unwrap();
    assert!(start <= address);
    assert_eq!(
        mapped_file(pid, 0x1000, 0xa000),
        Path::new(&format!("/proc/{pid}/map_files/1000-a000"))
    );
    assert!(boot_ticks_now() >= start_time_ticks(pid).unwrap());
}

#[test]
fn parses_stat_with_odd_comm() {
    let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 \
                55 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
    let stat = parse_stat(line).unwrap();
    assert_eq!(stat.tid, 4242);
    assert_eq!(stat.comm, "a (b) c");
    assert_eq!(stat.state, 'S');
    assert_eq!(stat.cpu, 1);
}

#[test]
fn opens_self_and_lists_own_threads() {
    let me = std::process::id();
    let target = TargetProcess::open(me).unwrap();
    assert_eq!(target.pid, me);
    assert!(target.threads().contains_key(&me));
    assert!(target.is_alive());
    let started = start_time_ticks(me).unwrap();
    assert!(started > 0);
    assert_eq!(start_time_ticks(me), Some(started));
}

/// Gone once it exited, before it is reaped (a zombie), as `/proc`
/// says; and not alive again when reaped.
#[test]
fn a_child_that_exits_is_gone_while_still_a_zombie() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let target = TargetProcess::open(child.id()).unwrap();
    assert!(target.exit_fd.is_some(), "no pidfd on this kernel");
    assert!(target.is_alive());
    child.kill().unwrap();
    let gone = std::time::Instant::now();
    while target.is_alive() {
        assert!(gone.elapsed().as_secs() < 10, "still alive after SIGKILL");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!is_alive(child.id()), "/proc still shows it running");
    child.wait().unwrap();
    assert!(!target.is_alive());
}

#[test]
fn counters_of_self_grow_with_work() {
    let me = TargetProcess::open(std::process::id()).unwrap();
    let before = me.counters().unwrap();
    let t = std::time::Instant::now();
    let mut x = 0u64;
    while t.elapsed() < std::time::Duration::from_millis(60) {
        x = std::hint::black_box(x.wrapping_add(1));
    }
    std::thread::sleep(std::time::Duration::from_millis(5));
    let after = me.counters().unwrap();
    assert!(after.cpu_ticks > before.cpu_ticks, "{before:?} {after:?}");
    assert!(after.voluntary_switches > before.voluntary_switches);
    assert!(after.threads >= 1);
}

#[test]
fn unknown_pid_is_reported() {
    // pid_max is at most 2^22, so this pid cannot exist.
    let err = TargetProcess::open(4_194_305 + 7).unwrap_err();
    assert!(matches!(err, Error::NoSuchProcess { .. }));
}

#[test]
fn unix_domain_sockets_are_told_from_the_others() {
    let me = std::process::id();
    let (stream, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let datagram = std::os::unix::net::UnixDatagram::unbound().unwrap();
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let file = fs::File::open("/proc/self/stat").unwrap();
    assert!(is_unix_socket(me, stream.as_raw_fd()));
    assert!(is_unix_socket(me, datagram.as_raw_fd()));
    assert!(!is_unix_socket(me, tcp.as_raw_fd()));
    assert!(!is_unix_socket(me, udp.as_raw_fd()));
    assert!(!is_unix_socket(me, file.as_raw_fd()));
    assert!(!is_unix_socket(me, i32::MAX));
}
