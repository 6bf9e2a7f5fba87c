//! The files of a process as `/proc` shows them (its executable, root,
//! environment, mappings and open descriptors), and the descriptors
//! ebtrace holds of processes.

use std::{
    fs,
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use rustix::process::{Pid, PidfdFlags, Resource};

use super::process_dir;

/// The executable `pid` runs (`/proc/PID/exe`); empty where it cannot be
/// read.
pub fn executable(pid: u32) -> PathBuf {
    fs::read_link(process_dir(pid).join("exe")).unwrap_or_default()
}

/// A path to ebtrace's own executable (`/proc/self/exe`) that opens the
/// file it runs even if that file was replaced or deleted since.
pub fn own_executable() -> &'static Path {
    Path::new("/proc/self/exe")
}

/// The file `pid` has mapped from `start` to `end`, openable from here even
/// once deleted (`/proc/PID/map_files/START-END`).
pub fn mapped_file(pid: u32, start: u64, end: u64) -> PathBuf {
    process_dir(pid)
        .join("map_files")
        .join(format!("{start:x}-{end:x}"))
}

/// `pid`'s environment as it started (`/proc/PID/environ`): `NAME=value`
/// entries, each ended by a NUL. Empty where it cannot be read.
pub fn environment(pid: u32) -> Vec<u8> {
    fs::read(process_dir(pid).join("environ")).unwrap_or_default()
}

/// The descriptors `pid` holds and the file each names (`/proc/PID/fd`),
/// in no particular order; a descriptor closed while this reads is left
/// out.
pub fn descriptor_targets(pid: u32) -> std::io::Result<Vec<(i32, PathBuf)>> {
    Ok(fs::read_dir(process_dir(pid).join("fd"))?
        .flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse().ok()?;
            Some((fd, fs::read_link(e.path()).ok()?))
        })
        .collect())
}

/// The program's entry point in `pid` (`AT_ENTRY` of `/proc/PID/auxv`).
pub fn entry_point(pid: u32) -> Option<u64> {
    const AT_ENTRY: u64 = 9;
    let auxv = std::fs::read(process_dir(pid).join("auxv")).ok()?;
    auxv.chunks_exact(16).find_map(|pair| {
        let key = u64::from_ne_bytes(pair[..8].try_into().ok()?);
        let value = u64::from_ne_bytes(pair[8..].try_into().ok()?);
        (key == AT_ENTRY).then_some(value)
    })
}

/// What ebtrace's own descriptor `fd` names (`/proc/self/fd/FD`).
pub fn own_descriptor_target(fd: std::os::fd::RawFd) -> std::io::Result<PathBuf> {
    std::fs::read_link(
        process_dir(std::process::id())
            .join("fd")
            .join(fd.to_string()),
    )
}

/// A pidfd of process `pid` (Linux 5.3+).
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // The kernel's answer for a pid no process can have.
    let pid = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or(rustix::io::Errno::INVAL)?;
    Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
}

/// `fd` moved above the descriptors the process holds now (to the lowest
/// free one from 64 below its limit, or from 4032 where the limit is
/// higher), where an exiting process releases it first: its files are
/// released the highest-numbered first, and each BPF link or perf event
/// released waits for an RCU grace period, so that a socket opened among
/// the probes' descriptors would close only tens or hundreds of
/// milliseconds after a SIGKILL. Left where it is where none is free.
pub fn released_first_at_exit(fd: OwnedFd) -> OwnedFd {
    // No soft limit (infinity) counts as above 4096.
    let limit = rustix::process::getrlimit(Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let floor = limit.min(4096).saturating_sub(64);
    if floor <= fd.as_raw_fd() as u64 {
        return fd;
    }
    // `fd` closes as it drops, once moved.
    match rustix::io::fcntl_dupfd_cloexec(&fd, floor as i32) {
        Ok(moved) => moved,
        Err(_) => fd,
    }
}

/// Whether descriptor `fd` of `pid` is a Unix-domain socket: the name the
/// kernel gives the socket's protocol (`system.sockprotoname`, `UNIX` or
/// `UNIX-STREAM` for one, `TCP`, `TCPv6` or `UDP` for others). `false`
/// where it cannot be read.
pub fn is_unix_socket(pid: u32, fd: i32) -> bool {
    let path = process_dir(pid).join("fd").join(fd.to_string());
    let mut name = [0u8; 32];
    match rustix::fs::getxattr(&path, "system.sockprotoname", &mut name) {
        Ok(len) => {
            let name = name[..len].strip_suffix(b"\0").unwrap_or(&name[..len]);
            name == b"UNIX" || name.starts_with(b"UNIX-")
        }
        Err(_) => false,
    }
}
