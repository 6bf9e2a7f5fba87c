//! What processes have mapped, their memory, and how much of the machine's
//! they use.

use std::{fs, os::unix::fs::FileExt as _};

use super::{proc_root, process_dir};

/// The text of `/proc/PID/maps`: what `pid` has mapped, line by line.
pub fn maps_text(pid: u32) -> std::io::Result<String> {
    fs::read_to_string(process_dir(pid).join("maps"))
}

/// The mapping of `pid` that holds `address`: its start, file offset,
/// device, inode and path, as `/proc/PID/maps` lists them.
pub fn mapping_at(pid: u32, address: u64) -> Option<(u64, u64, String, u64, String)> {
    let maps = maps_text(pid).ok()?;
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (start, end) = parts.next()?.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        if !(start..end).contains(&address) {
            return None;
        }
        let _perms = parts.next()?;
        let offset = u64::from_str_radix(parts.next()?, 16).ok()?;
        let device = parts.next()?.to_string();
        let inode = parts.next()?.parse().ok()?;
        let path = parts.next().unwrap_or("").to_string();
        Some((start, offset, device, inode, path))
    })
}

/// `pid`'s memory as a file to read and write at addresses
/// (`/proc/PID/mem`: the rights ptrace needs over `pid`).
pub fn memory_file(pid: u32) -> std::io::Result<fs::File> {
    fs::File::options()
        .read(true)
        .write(true)
        .open(process_dir(pid).join("mem"))
}

/// Reads `out.len()` bytes of `pid`'s memory at `address`
/// (`/proc/PID/mem`: the rights ptrace needs over `pid`).
pub fn read_memory(pid: u32, address: u64, out: &mut [u8]) -> std::io::Result<()> {
    let mem = fs::File::open(process_dir(pid).join("mem"))?;
    mem.read_exact_at(out, address)
}

/// A process's memory, open for reading at addresses (`/proc/PID/mem`,
/// opened once: a reader of many small objects, such as Python's code
/// objects, would otherwise open it for each).
#[derive(Debug)]
pub struct ProcessMemory {
    file: fs::File,
}

impl ProcessMemory {
    /// Opens `pid`'s memory for reading (the rights ptrace needs over `pid`).
    pub fn open(pid: u32) -> std::io::Result<Self> {
        let file = fs::File::open(process_dir(pid).join("mem"))?;
        Ok(ProcessMemory { file })
    }

    /// Fills `out` from `address`; false if any of it cannot be read (not
    /// mapped, or the process has exited).
    pub fn read(&self, address: u64, out: &mut [u8]) -> bool {
        self.file.read_exact_at(out, address).is_ok()
    }
}

/// Writes `bytes` into `pid`'s memory at `address` in one write, returning
/// how many it wrote (`/proc/PID/mem`, opened for writing only).
pub fn write_memory(pid: u32, address: u64, bytes: &[u8]) -> std::io::Result<usize> {
    let mem = fs::File::options()
        .write(true)
        .open(process_dir(pid).join("mem"))?;
    mem.write_at(bytes, address)
}

/// Resident memory of a process in bytes (`/proc/PID/statm`).
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = fs::read_to_string(process_dir(pid).join("statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * rustix::param::page_size() as u64)
}

/// The memory the machine has available for new work, in bytes
/// (`MemAvailable` of `/proc/meminfo`).
pub fn mem_available_bytes() -> Option<u64> {
    let meminfo = fs::read_to_string(proc_root().join("meminfo")).ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// ebtrace's own resident memory in bytes (0 where `/proc` says nothing).
pub fn own_resident_bytes() -> usize {
    resident_bytes(std::process::id()).unwrap_or(0) as usize
}
