//! `ProbeSet`: the loaded eBPF object with its shared maps (events ring,
//! target membership, outcome counters). Each probe family (`sched`, ...)
//! loads and attaches its own programs on it; dropping or detaching the
//! set detaches every program at once.

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, PerCpuArray},
};
use tracer_common::{names, python::PythonProcess, stat};

use super::{
    EBPF_OBJECT,
    btf::task_fsbase_offset,
    links::{OwnedLink, release},
    sched::SchedRoute,
    uprobe_multi,
};
use crate::{
    collect::{RingError, RingReader},
    error::{Error, Result},
};

/// How a [`ProbeSet`] is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSetConfig {
    /// Ring buffer size in bytes (a power of two, at least one page).
    pub ring_bytes: u32,
    /// Whether `sched_process_exit` has the `group_dead` field.
    pub exit_has_group_dead: bool,
    /// Whether off-CPU stacks may be taken: their per-thread array then
    /// has a slot for every tid (8 bytes each), else one.
    pub off_cpu_stacks: bool,
    /// Which driver calls that submit work carry the stack they were made
    /// from (a stack sample at the call's entry: a few microseconds each).
    pub launch_stacks: LaunchStacks,
}

/// Which driver calls that submit work carry the stack they were made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchStacks {
    /// None.
    Off,
    /// Every one.
    Every,
    /// At most this many a second on each CPU: what an always-on capture
    /// can afford whatever the launch rate.
    PerCpuPerSecond(u32),
}

impl LaunchStacks {
    /// Whether any call carries its stack.
    pub fn any(self) -> bool {
        self.gap_ns() != tracer_common::stack::NO_LAUNCH_STACKS
    }

    /// The probe's gap between two stacks on one CPU (see
    /// `tracer_common::stack::names::LAUNCH_STACK_GAP_NS`).
    fn gap_ns(self) -> u64 {
        match self {
            LaunchStacks::Off | LaunchStacks::PerCpuPerSecond(0) => {
                tracer_common::stack::NO_LAUNCH_STACKS
            }
            LaunchStacks::Every => 0,
            LaunchStacks::PerCpuPerSecond(n) => 1_000_000_000 / u64::from(n),
        }
    }
}

impl Default for ProbeSetConfig {
    fn default() -> Self {
        ProbeSetConfig {
            ring_bytes: 16 * 1024 * 1024,
            exit_has_group_dead: true,
            off_cpu_stacks: false,
            launch_stacks: LaunchStacks::Off,
        }
    }
}

/// Outcome counters summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeStats {
    /// Records submitted to the ring buffer.
    pub submitted: u64,
    /// Records lost because the ring buffer was full.
    pub dropped_ringbuf_full: u64,
    /// New threads that could not be tracked: their tid is past the tracked-thread array.
    pub dropped_track_full: u64,
    /// Submits that woke the reader because the ring buffer was filling up.
    pub forced_wakeups: u64,
    /// Program runs the kernel skipped because another BPF program (or a
    /// BPF syscall of some process) was active on that CPU.
    pub missed_by_kernel: u64,
    /// Events a probe family lost in its own maps (e.g. CUDA calls whose
    /// entry could not be saved), filled in by the capture.
    pub dropped_by_family: u64,
}

impl ProbeStats {
    /// All records lost, every way.
    pub fn dropped(&self) -> u64 {
        self.dropped_ringbuf_full
            + self.dropped_track_full
            + self.missed_by_kernel
            + self.dropped_by_family
    }
}

/// The kernel's `pid_max`: one more than the largest thread id (the
/// smallest the kernel allows where it cannot be read).
fn pid_max() -> u32 {
    crate::procfs::sysctl_number("kernel/pid_max")
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(tracer_common::MAX_TRACKED_TIDS)
        .max(tracer_common::MAX_TRACKED_TIDS)
}

/// The loaded eBPF object, its shared maps and the links of every family attached to it.
pub struct ProbeSet {
    /// Programs and the membership maps; dropping it unloads them.
    ebpf: Option<Ebpf>,
    /// The families' links, released together by [`ProbeSet::detach`].
    links: Vec<OwnedLink>,
    events: Option<RingReader>,
    stats: PerCpuArray<MapData, u64>,
    /// A descriptor of every map by name, kept from before the families
    /// took theirs, for the programs loaded for multi-uprobe links.
    map_fds: Vec<(String, OwnedFd)>,
    /// Programs loaded for multi-uprobe links (see [`uprobe_multi`]).
    multi: uprobe_multi::Programs,
    /// How switches and wake-ups are recorded.
    sched_route: SchedRoute,
    /// What it was loaded with.
    config: ProbeSetConfig,
}

impl Drop for ProbeSet {
    fn drop(&mut self) {
        self.detach();
    }
}

impl ProbeSet {
    /// Creates the maps; programs are loaded by the families that use them.
    pub fn load(config: &ProbeSetConfig) -> Result<Self> {
        if EBPF_OBJECT.is_empty() {
            return Err(Error::NoEbpfObject);
        }
        let threshold = u64::from(config.ring_bytes / 4);
        let group_dead = u32::from(config.exit_has_group_dead);
        let sched_route = SchedRoute::for_this_kernel();
        let offsets = match &sched_route {
            SchedRoute::Raw(o) => [o.pid, o.exit_state, o.cpu],
            SchedRoute::Classic(_) => [0; 3],
        };
        let mut ebpf = EbpfLoader::new()
            .override_global(names::WAKEUP_THRESHOLD, &threshold, true)
            .override_global(names::EXIT_HAS_GROUP_DEAD, &group_dead, true)
            .override_global(names::TASK_PID_OFFSET, &offsets[0], true)
            .override_global(names::TASK_EXIT_STATE_OFFSET, &offsets[1], true)
            .override_global(names::TASK_CPU_OFFSET, &offsets[2], true)
            .override_global(
                tracer_common::stack::names::LAUNCH_STACK_GAP_NS,
                &config.launch_stacks.gap_ns(),
                true,
            )
            .override_global(
                tracer_common::python::names::TASK_FSBASE_OFFSET,
                &task_fsbase_offset().unwrap_or(0),
                true,
            )
            .map_max_entries(names::EVENTS, config.ring_bytes)
            .map_max_entries(names::TRACKED_TIDS, pid_max())
            .map_max_entries(
                tracer_common::stack::names::BLOCKED_AT_US,
                if config.off_cpu_stacks { pid_max() } else { 1 },
            )
            .map_max_entries(names::RECORDING_TGIDS, pid_max().div_ceil(64))
            .map_max_entries(names::DRIVER_CALL_TGIDS, pid_max().div_ceil(64))
            .load(EBPF_OBJECT)
            .map_err(|e| Error::load(e, crate::procfs::seccomp_filtered))?;
        let map_fds = ebpf
            .maps()
            .map(|(name, map)| Ok((name.to_string(), map_fd(map).try_clone_to_owned()?)))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::io("duplicating the eBPF maps' descriptors".to_string(), e))?;
        let events = match take_map(&mut ebpf, names::EVENTS)? {
            Map::RingBuf(data) => RingReader::new(data),
            _ => Err(RingError::NotARing),
        }
        .map_err(|e| Error::Map {
            name: names::EVENTS,
            source: Box::new(e),
        })?;
        let stats = take_map(&mut ebpf, names::STATS)
            .and_then(|m| PerCpuArray::try_from(m).map_err(|e| map_err(names::STATS, e)))?;
        Ok(ProbeSet {
            ebpf: Some(ebpf),
            links: Vec::new(),
            events: Some(events),
            stats,
            map_fds,
            multi: uprobe_multi::Programs::default(),
            sched_route,
            config: config.clone(),
        })
    }

    /// What it was loaded with.
    pub fn config(&self) -> &ProbeSetConfig {
        &self.config
    }

    /// How this set records switches and wake-ups.
    pub fn sched_route(&self) -> &SchedRoute {
        &self.sched_route
    }

    /// Loads `names` for multi-uprobe links (once per set), sharing the
    /// maps of the programs aya loads.
    pub fn load_multi(
        &mut self,
        names: &[&str],
    ) -> std::result::Result<(), uprobe_multi::LoadError> {
        self.multi = uprobe_multi::Programs::load(EBPF_OBJECT, &self.map_fds, names)?;
        Ok(())
    }

    /// Puts `program`, loaded by [`ProbeSet::load_multi`], at `index` of
    /// the program array `map`, for the programs loaded with it to
    /// tail-call.
    pub fn set_multi_jump(&self, map: &str, index: u32, program: &str) -> io::Result<()> {
        let map = self
            .map_fds
            .iter()
            .find(|(name, _)| name == map)
            .map(|(_, fd)| fd.as_fd())
            .ok_or_else(|| io::Error::other(format!("no map {map}")))?;
        let program = self
            .multi_program(program)
            .ok_or_else(|| io::Error::other(format!("program {program} is not loaded")))?;
        uprobe_multi::set_jump(map, index, program)
    }

    /// A program loaded by [`ProbeSet::load_multi`].
    pub fn multi_program(&self, name: &str) -> Option<BorrowedFd<'_>> {
        self.multi.get(name)
    }

    /// The loaded object, for probe families to load and attach programs.
    pub fn ebpf(&mut self) -> &mut Ebpf {
        self.ebpf
            .as_mut()
            .expect("probe is attached until detach()")
    }

    /// Adds a process (thread group) to trace: its threads are followed
    /// and their scheduling recorded; its driver calls wait for
    /// [`Self::open_window`].
    pub fn add_target(&mut self, tgid: u32) -> Result<()> {
        self.set_target(tgid, Some(tracer_common::target::FOLLOWED))?;
        self.set_bit(names::RECORDING_TGIDS, tgid, true)
    }

    /// Opens the capture window of a process added with [`Self::add_target`]:
    /// its driver calls are recorded from now on.
    pub fn open_window(&mut self, tgid: u32) -> Result<()> {
        self.set_bit(names::DRIVER_CALL_TGIDS, tgid, true)
    }

    /// Stops recording a process while the programs stay attached: its
    /// threads are still followed (new ones tracked, exited ones
    /// forgotten), but nothing is written to the ring buffer.
    pub fn pause_target(&mut self, tgid: u32) -> Result<()> {
        self.set_bit(names::DRIVER_CALL_TGIDS, tgid, false)?;
        self.set_bit(names::RECORDING_TGIDS, tgid, false)
    }

    /// Records a paused process again (its driver calls from the next
    /// [`Self::open_window`]).
    pub fn resume_target(&mut self, tgid: u32) -> Result<()> {
        self.set_bit(names::RECORDING_TGIDS, tgid, true)
    }

    /// Stops tracing a process: programs still attached ignore it.
    pub fn remove_target(&mut self, tgid: u32) -> Result<()> {
        self.set_bit(names::DRIVER_CALL_TGIDS, tgid, false)?;
        self.set_bit(names::RECORDING_TGIDS, tgid, false)?;
        self.set_python(tgid, None)?;
        self.set_target(tgid, None)
    }

    /// Sets (or with `None` removes) the `TARGET_TGIDS` bits of `tgid`.
    fn set_target(&mut self, tgid: u32, bits: Option<u32>) -> Result<()> {
        let mut map = self.u32_map(names::TARGET_TGIDS)?;
        match bits {
            Some(bits) => map.insert(tgid, bits, 0),
            None => map.remove(&tgid),
        }
        .map_err(|e| map_err(names::TARGET_TGIDS, e))
    }

    /// Sets or clears the bit of `tgid` in the bitmap of tgids `name`
    /// (`RECORDING_TGIDS`, `DRIVER_CALL_TGIDS`). Only this process writes
    /// the bitmaps, so read-modify-write is safe.
    fn set_bit(&mut self, name: &'static str, tgid: u32, on: bool) -> Result<()> {
        let map = self.ebpf().map_mut(name).expect("map is in the object");
        let mut bitmap: Array<&mut MapData, u64> =
            Array::try_from(map).map_err(|e| map_err(name, e))?;
        let (index, bit) = (tgid / 64, 1u64 << (tgid % 64));
        let word = bitmap.get(&index, 0).map_err(|e| map_err(name, e))?;
        let word = if on { word | bit } else { word & !bit };
        bitmap.set(index, word, 0).map_err(|e| map_err(name, e))
    }

    /// Has the stack programs read the Python frames of `tgid`'s threads
    /// (`None`: no more).
    pub fn set_python(&mut self, tgid: u32, walk: Option<PythonProcess>) -> Result<()> {
        let name = tracer_common::python::names::PYTHON_PROCESSES;
        let map = self.ebpf().map_mut(name).expect("map is in the object");
        let mut map: HashMap<&mut MapData, u32, PythonProcess> =
            HashMap::try_from(map).map_err(|e| map_err(name, e))?;
        match walk {
            Some(walk) => map.insert(tgid, walk, 0),
            // A process that runs no Python has no entry to remove.
            None => match map.remove(&tgid) {
                Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
                {
                    Ok(())
                }
                other => other,
            },
        }
        .map_err(|e| map_err(name, e))
    }

    /// Marks existing threads as members of a traced process.
    pub fn track_threads(&mut self, tgid: u32, tids: impl IntoIterator<Item = u32>) -> Result<()> {
        let map = self
            .ebpf()
            .map_mut(names::TRACKED_TIDS)
            .expect("map is in the object");
        let mut tracked: Array<&mut MapData, u32> =
            Array::try_from(map).map_err(|e| map_err(names::TRACKED_TIDS, e))?;
        for tid in tids {
            tracked
                .set(tid, tgid, 0)
                .map_err(|e| map_err(names::TRACKED_TIDS, e))?;
        }
        Ok(())
    }

    /// One of the object's `u32 → u32` hash maps.
    fn u32_map(&mut self, name: &'static str) -> Result<HashMap<&mut MapData, u32, u32>> {
        HashMap::try_from(self.ebpf().map_mut(name).expect("map is in the object"))
            .map_err(|e| map_err(name, e))
    }

    /// Keeps a family's link, to be released with the others.
    pub fn keep_link(&mut self, link: impl Into<OwnedLink>) {
        self.links.push(link.into());
    }

    /// Detaches and unloads every program, the links released in parallel
    /// (see [`links`](super::links)). The ring buffer stays readable, so
    /// what was submitted before can still be drained.
    pub fn detach(&mut self) {
        release(std::mem::take(&mut self.links));
        self.ebpf = None;
        self.multi = uprobe_multi::Programs::default();
        self.map_fds.clear();
    }

    /// Hands over the ring buffer to a collector (once).
    pub fn take_events(&mut self) -> RingReader {
        self.events.take().expect("events taken once")
    }

    /// Sum of the kernel's `recursion_misses` over our programs.
    fn missed_by_kernel(&self) -> u64 {
        let Some(ebpf) = self.ebpf.as_ref() else {
            return 0;
        };
        ebpf.programs()
            .filter_map(|(_, p)| p.fd().ok())
            .map(|fd| fd.as_fd().as_raw_fd())
            .chain(self.multi.fds().map(|fd| fd.as_raw_fd()))
            .map(|fd| prog_recursion_misses(fd).unwrap_or(0))
            .sum()
    }

    /// The outcome counters so far, summed over CPUs; `dropped_by_family` is left 0.
    pub fn stats(&self) -> Result<ProbeStats> {
        let sum = |index: u32| -> Result<u64> {
            let values = self
                .stats
                .get(&index, 0)
                .map_err(|e| map_err(names::STATS, e))?;
            Ok(values.iter().sum())
        };
        Ok(ProbeStats {
            submitted: sum(stat::SUBMITTED)?,
            dropped_ringbuf_full: sum(stat::DROPPED_RINGBUF_FULL)?,
            dropped_track_full: sum(stat::DROPPED_TRACK_FULL)?,
            forced_wakeups: sum(stat::FORCED_WAKEUPS)?,
            missed_by_kernel: self.missed_by_kernel(),
            dropped_by_family: 0,
        })
    }
}

/// Reads `bpf_prog_info.recursion_misses` (Linux 5.12+), which aya does not
/// expose: runs the kernel skipped since a BPF program or a BPF syscall was
/// already active on that CPU. Those are records lost without a trace.
fn prog_recursion_misses(fd: std::os::fd::RawFd) -> Option<u64> {
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const RECURSION_MISSES_OFFSET: usize = 208;
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut info = [0u64; 32];
    let attr = InfoAttr {
        bpf_fd: fd as u32,
        info_len: size_of_val(&info) as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: attr points at a buffer of info_len bytes that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &attr as *const InfoAttr,
            size_of::<InfoAttr>(),
        )
    };
    (rc == 0 && attr.info_len as usize > RECURSION_MISSES_OFFSET)
        .then(|| info[RECURSION_MISSES_OFFSET / 8])
}

/// The descriptor of any kind of map (aya 0.14 offers no accessor).
fn map_fd(map: &Map) -> BorrowedFd<'_> {
    use Map::*;
    let (Array(m)
    | ArrayOfMaps(m)
    | BloomFilter(m)
    | CgroupArray(m)
    | CgroupStorage(m)
    | CgrpStorage(m)
    | CpuMap(m)
    | DevMap(m)
    | DevMapHash(m)
    | HashMap(m)
    | HashOfMaps(m)
    | InodeStorage(m)
    | LpmTrie(m)
    | LruHashMap(m)
    | PerCpuArray(m)
    | PerCpuCgroupStorage(m)
    | PerCpuHashMap(m)
    | PerCpuLruHashMap(m)
    | PerfEventArray(m)
    | ProgramArray(m)
    | Queue(m)
    | ReusePortSockArray(m)
    | RingBuf(m)
    | SockHash(m)
    | SockMap(m)
    | SkStorage(m)
    | Stack(m)
    | StackTraceMap(m)
    | Unsupported(m)
    | XskMap(m)) = map;
    m.fd().as_fd()
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map> {
    ebpf.take_map(name).ok_or_else(|| Error::Map {
        name,
        source: Box::new(aya::maps::MapError::InvalidName {
            name: name.to_string(),
        }),
    })
}

fn map_err(name: &'static str, e: aya::maps::MapError) -> Error {
    Error::Map {
        name,
        source: Box::new(e),
    }
}
