//! The BPF system calls the benchmarks make on ebtrace's programs and maps
//! from outside it: the kernel's run-time statistics of its programs, and
//! switching a traced process's Python frames off and on again under a
//! running ebtrace (its entry in the `PYTHON_PROCESSES` map), so that one
//! capture measures its stack program both ways, interleaved.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use anyhow::{Context as _, Result, bail};

use super::jax::monotonic_s;

/// `bpf(2)` commands and arguments the kernel's uapi header defines.
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_ENABLE_STATS: libc::c_long = 32;
const BPF_STATS_RUN_TIME: u32 = 0;
/// `BPF_PROG_TYPE_PERF_EVENT`: the type of ebtrace's stack program, its
/// only one of that type.
const PERF_EVENT_PROGRAM: &str = "7";
/// `BPF_MAP_TYPE_HASH`.
const HASH_MAP: &str = "1";
/// The map of the processes whose Python frames the stack programs walk,
/// as the kernel names it (`BPF_OBJ_NAME_LEN` less its NUL).
const PYTHON_PROCESSES: &[u8] = b"PYTHON_PROCESSE";

/// `bpf(cmd, attr)`.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<i64> {
    // SAFETY: `attr` is a `union bpf_attr` member of the size given, laid
    // out as the kernel's uapi header has it for `cmd`.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>()) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The kernel's BPF run-time statistics, on while this is held: a
/// `BPF_ENABLE_STATS` file descriptor, which the kernel counts as one more
/// user of `kernel.bpf_stats_enabled` and lets go of when it is closed,
/// even if xtask is killed. The sysctl itself is never changed.
pub struct BpfStats {
    _enabled: OwnedFd,
}

impl BpfStats {
    pub fn enable() -> Result<Self> {
        /// `union bpf_attr`'s `enable_stats`.
        #[repr(C)]
        struct EnableStats {
            kind: u32,
        }
        let mut attr = EnableStats {
            kind: BPF_STATS_RUN_TIME,
        };
        let fd = bpf(BPF_ENABLE_STATS, &mut attr)
            .context("bpf(BPF_ENABLE_STATS) (the kernel's BPF run-time statistics)")?;
        // SAFETY: a descriptor the kernel just opened for this process and
        // that nothing else owns.
        let enabled = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(BpfStats { _enabled: enabled })
    }
}

/// The fdinfo fields of each of `pid`'s descriptors: (fd, text).
fn fdinfos(pid: u32) -> Result<Vec<(i32, String)>> {
    let dir = format!("/proc/{pid}/fdinfo");
    Ok(std::fs::read_dir(&dir)
        .with_context(|| format!("listing {dir}"))?
        .flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse().ok()?;
            Some((fd, std::fs::read_to_string(e.path()).ok()?))
        })
        .collect())
}

/// Field `name` of an fdinfo text.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// The kernel's statistics of ebtrace's stack program at one moment.
#[derive(Clone, Copy, Debug)]
pub struct ProgStats {
    pub at: f64,
    pub run_time_ns: u64,
    pub run_cnt: u64,
}

impl ProgStats {
    /// Reads them from the fdinfo of the program's descriptors in
    /// `ebtrace_pid`: those whose `prog_type` is the perf_event one.
    pub fn read(ebtrace_pid: u32) -> Result<Self> {
        let at = monotonic_s();
        let mut found: Vec<(u64, u64, u64)> = fdinfos(ebtrace_pid)?
            .iter()
            .filter(|(_, info)| field(info, "prog_type") == Some(PERF_EVENT_PROGRAM))
            .filter_map(|(_, info)| {
                let num = |name: &str| field(info, name)?.parse::<u64>().ok();
                Some((num("prog_id")?, num("run_time_ns")?, num("run_cnt")?))
            })
            .collect();
        found.sort_unstable();
        found.dedup();
        match found[..] {
            [(_, run_time_ns, run_cnt)] => Ok(ProgStats {
                at,
                run_time_ns,
                run_cnt,
            }),
            _ => bail!(
                "expected one perf_event program among ebtrace's descriptors (pid \
                 {ebtrace_pid}), found {found:?} (prog_id, run_time_ns, run_cnt)"
            ),
        }
    }

    /// The program's time (ns) and runs from `earlier` to this reading.
    pub fn since(&self, earlier: &ProgStats) -> Result<(f64, f64)> {
        let ns = self.run_time_ns.saturating_sub(earlier.run_time_ns) as f64;
        let runs = self.run_cnt.saturating_sub(earlier.run_cnt) as f64;
        if ns == 0.0 || runs == 0.0 {
            bail!(
                "the stack program's statistics did not move ({earlier:?} to {self:?}): are the \
                 kernel's BPF statistics on?"
            );
        }
        Ok((ns, runs))
    }
}

/// A copy of one of another process's descriptors (`pidfd_getfd`, which
/// needs ptrace rights over it: root).
fn descriptor_of(pid: u32, fd: i32) -> Result<OwnedFd> {
    // SAFETY: plain system calls; each descriptor they return is owned here.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0);
        if pidfd < 0 {
            bail!("pidfd_open({pid}): {}", std::io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let copy = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if copy < 0 {
            bail!(
                "pidfd_getfd({pid}, {fd}): {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(OwnedFd::from_raw_fd(copy as i32))
    }
}

/// `union bpf_attr` for the map element commands.
#[repr(C)]
struct MapElement {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// A traced process's entry in a running ebtrace's `PYTHON_PROCESSES` map:
/// removed, the stack programs take its stacks without Python frames;
/// put back, with them again.
pub struct PythonFramesSwitch {
    map: OwnedFd,
    pid: u32,
    /// The entry ebtrace wrote, as the kernel gave it.
    value: Vec<u8>,
}

impl PythonFramesSwitch {
    /// Finds the map among `ebtrace_pid`'s descriptors and `pid`'s entry.
    pub fn find(ebtrace_pid: u32, pid: u32) -> Result<Self> {
        for (fd, info) in fdinfos(ebtrace_pid)? {
            if field(&info, "map_type") != Some(HASH_MAP) {
                continue;
            }
            let value_size: usize = field(&info, "value_size")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let map = descriptor_of(ebtrace_pid, fd)?;
            if map_name(&map)? != PYTHON_PROCESSES {
                continue;
            }
            let mut switch = PythonFramesSwitch {
                map,
                pid,
                value: vec![0; value_size],
            };
            let value = switch.value.as_mut_ptr() as u64;
            let mut attr = switch.element(value);
            bpf(BPF_MAP_LOOKUP_ELEM, &mut attr)
                .with_context(|| format!("pid {pid} is not in ebtrace's PYTHON_PROCESSES"))?;
            return Ok(switch);
        }
        bail!("no PYTHON_PROCESSES map among ebtrace's (pid {ebtrace_pid}) descriptors")
    }

    fn element(&self, value: u64) -> MapElement {
        MapElement {
            map_fd: self.map.as_raw_fd() as u32,
            _pad: 0,
            key: &raw const self.pid as u64,
            value,
            flags: 0,
        }
    }

    /// Python frames off: the entry removed.
    pub fn off(&self) -> Result<()> {
        let mut attr = self.element(0);
        bpf(BPF_MAP_DELETE_ELEM, &mut attr).context("removing the Python process entry")?;
        Ok(())
    }

    /// Python frames on: the entry written back.
    pub fn on(&self) -> Result<()> {
        let mut attr = self.element(self.value.as_ptr() as u64);
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr).context("writing the Python process entry back")?;
        Ok(())
    }
}

/// The name the kernel has for map `fd`.
fn map_name(fd: &OwnedFd) -> Result<Vec<u8>> {
    /// `union bpf_attr`'s `info`.
    #[repr(C)]
    struct InfoByFd {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    /// The head of `struct bpf_map_info`, up to its name.
    #[repr(C)]
    #[derive(Default)]
    struct MapInfo {
        kind: u32,
        id: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        name: [u8; 16],
    }
    let mut info = MapInfo::default();
    let mut attr = InfoByFd {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<MapInfo>() as u32,
        info: &raw mut info as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).context("bpf(BPF_OBJ_GET_INFO_BY_FD)")?;
    let len = info.name.iter().position(|&b| b == 0).unwrap_or(16);
    Ok(info.name[..len].to_vec())
}
