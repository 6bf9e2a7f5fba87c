//! `CudaProbe`: entry and return uprobes on the CUDA driver functions of
//! each traced process's `libcuda.so.1` (see `tracer-ebpf/src/cuda.rs`).
//!
//! Probes are scoped to the traced process, so other processes using the
//! same library pay nothing. A process without the driver is reported in
//! one line and the other probes go on.
//!
//! Where the kernel has them (see [`uprobe_multi`]), each program is put on
//! all of a library's functions with one multi-uprobe link: an entry link
//! per argument shape, then one return link. Otherwise, or if the kernel
//! refuses such a link, each function gets a perf-event link per program.
//! Releasing those is slow: the kernel destroys each uprobe perf event
//! under a global mutex and waits for an RCU tasks-trace grace period
//! there (about 0.1 s per link on a VM, so seconds for a real driver's
//! ~200 links), and blocks the next capture's attach meanwhile. The probe
//! owns its links; at the end of a capture they are released in the
//! background, after the programs were told to ignore the targets.

use std::num::NonZeroU32;

use aya::{
    maps::{MapData, PerCpuArray, ProgramArray},
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
    },
};
use tracer_common::{
    cuda::{names, shape, stat},
    stack::names as stack_names,
};

use super::{
    ProbeSet,
    libcuda::{self, Library, Source, Unprobeable},
    links::OwnedLink,
    uprobe_multi,
};
use crate::{
    cuda_api::{DriverCalls, FUNCTIONS, Shape},
    error::{Error, Result},
    procfs::TargetProcess,
};

/// The driver library of one traced process and what was attached to it.
#[derive(Clone, Debug)]
pub struct CudaTarget {
    /// The process.
    pub pid: u32,
    /// Its driver library.
    pub library: Library,
    /// Functions probed: with both probes attached, or the entry probe
    /// only ([`Self::entry_only`] of them).
    pub probed: usize,
    /// Functions of those probed at their entry only.
    pub entry_only: usize,
    /// Functions exported but not probed, with the reason.
    pub skipped: Vec<(String, String)>,
    /// How the probes are linked.
    pub links: Links,
}

/// How the driver probes of one library are linked to its functions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Links {
    /// One multi-uprobe link per program (this many).
    Multi(usize),
    /// One perf-event link per function and program (this many), and why
    /// not multi-uprobe links.
    Perf(usize, String),
}

/// Set to `perf` to link the driver probes one perf-event link per
/// function, as on kernels without multi-uprobe links (to compare, or to
/// work around a kernel's).
pub const LINKS_ENV: &str = "EBTRACE_UPROBE_LINKS";

/// The CUDA driver programs: one entry program per argument shape, and the
/// return program.
const PROGRAMS: [&str; 6] = [
    shape::REGISTERS,
    shape::STACK,
    shape::LAUNCH_CONFIG,
    shape::MEMCPY2D,
    shape::MEMCPY3D,
    shape::RETURN,
];

/// What the CUDA probes lost, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaProbeStats {
    /// Calls lost because the table of calls in flight was full.
    pub pending_full: u64,
    /// Returns of calls entered before the probes were attached (harmless).
    pub unpaired_returns: u64,
    /// Kernel names cut at `CUDA_NAME_LEN` bytes.
    pub names_truncated: u64,
}

/// The CUDA driver uprobes of a capture: their links and counters.
pub struct CudaProbe {
    stats: PerCpuArray<MapData, u64>,
    /// Each link with the process it probes.
    links: Vec<(u32, OwnedLink)>,
    /// The processes attached to.
    pub targets: Vec<CudaTarget>,
    /// The functions probed.
    calls: DriverCalls,
}

/// What attaching to the targets' driver libraries tells the user: lines
/// about processes that have no driver to probe (a CPU-only process is
/// not a problem), and warnings about those whose driver could not be
/// probed.
#[derive(Debug, Default)]
pub struct CudaMessages {
    /// Processes with no CUDA driver, loaded or to load.
    pub notes: Vec<String>,
    /// Processes whose driver could not be probed.
    pub warnings: Vec<String>,
}

impl CudaProbe {
    /// Attaches to the driver library of every target that has one (or
    /// would load one). Returns `None` when no target has any; the
    /// messages name the processes left out.
    pub fn attach(
        set: &mut ProbeSet,
        targets: &[TargetProcess],
        calls: DriverCalls,
    ) -> Result<(Option<CudaProbe>, CudaMessages)> {
        let mut links = Vec::new();
        let (attached, messages) = attach_targets(set, targets, calls, &mut links);
        if attached.is_empty() {
            return Ok((None, messages));
        }
        let stats = set
            .ebpf()
            .take_map(names::CUDA_STATS)
            .and_then(|m| PerCpuArray::try_from(m).ok())
            .ok_or_else(|| Error::Map {
                name: names::CUDA_STATS,
                source: Box::new(aya::maps::MapError::InvalidName {
                    name: names::CUDA_STATS.to_string(),
                }),
            })?;
        Ok((
            Some(CudaProbe {
                stats,
                links,
                targets: attached,
                calls,
            }),
            messages,
        ))
    }

    /// Attaches to the driver library of `targets` too (processes a running
    /// capture takes on); returns the messages [`Self::attach`] does for
    /// them.
    pub fn add(&mut self, set: &mut ProbeSet, targets: &[TargetProcess]) -> CudaMessages {
        let (attached, messages) = attach_targets(set, targets, self.calls, &mut self.links);
        self.targets.extend(attached);
        messages
    }

    /// Detaches the probes of `pid`, which exited, on another thread (a
    /// long-running capture, such as the flight recorder, would otherwise
    /// keep them, and their descriptors, for every process that came and
    /// went).
    pub fn release_target(&mut self, pid: u32) {
        let (gone, kept) = std::mem::take(&mut self.links)
            .into_iter()
            .partition(|(p, _)| *p == pid);
        self.links = kept;
        self.targets.retain(|t| t.pid != pid);
        let gone: Vec<OwnedLink> = gone.into_iter().map(|(_, l)| l).collect();
        if !gone.is_empty() {
            let released = std::thread::Builder::new()
                .name("ebtrace-release".into())
                .spawn(move || super::links::release(gone));
            // No thread to spare: released here, slower.
            if let Err(e) = released {
                eprintln!("ebtrace: releasing the probes of pid {pid} here: {e}");
            }
        }
    }

    /// Detaches every probe, releasing the links concurrently.
    pub fn detach(&mut self) {
        super::links::release(self.take_links());
    }

    /// Starts detaching every probe on another thread and returns at once;
    /// the process's exit waits for the rest.
    pub fn detach_in_background(&mut self) -> std::thread::JoinHandle<()> {
        let links = self.take_links();
        std::thread::spawn(move || super::links::release(links))
    }

    fn take_links(&mut self) -> Vec<OwnedLink> {
        let links = std::mem::take(&mut self.links);
        links.into_iter().map(|(_, l)| l).collect()
    }

    /// What the probes lost so far, summed over CPUs.
    pub fn stats(&self) -> Result<CudaProbeStats> {
        let sum = |index: u32| -> Result<u64> {
            let values = self.stats.get(&index, 0).map_err(|e| Error::Map {
                name: names::CUDA_STATS,
                source: Box::new(e),
            })?;
            Ok(values.iter().sum())
        };
        Ok(CudaProbeStats {
            pending_full: sum(stat::PENDING_FULL)?,
            unpaired_returns: sum(stat::UNPAIRED_RETURNS)?,
            names_truncated: sum(stat::NAMES_TRUNCATED)?,
        })
    }
}

/// Attaches to the driver library of every target of `targets` that has
/// one (or would load one), keeping the links in `links`: the targets
/// probed, and messages naming the processes left out.
fn attach_targets(
    set: &mut ProbeSet,
    targets: &[TargetProcess],
    calls: DriverCalls,
    links: &mut Vec<(u32, OwnedLink)>,
) -> (Vec<CudaTarget>, CudaMessages) {
    let mut messages = CudaMessages::default();
    let found: Vec<(u32, Library)> = targets
        .iter()
        .filter_map(|t| match libcuda::locate(t.pid) {
            Some(lib) => Some((t.pid, lib)),
            None => {
                messages.notes.push(format!(
                    "pid {} ({}): no {} loaded or on its library path (LD_LIBRARY_PATH, \
                     ld.so.cache, /usr/lib...): no CUDA driver calls to trace",
                    t.pid,
                    t.name,
                    libcuda::SONAME
                ));
                None
            }
        })
        .collect();
    if found.is_empty() {
        return (Vec::new(), messages);
    }
    let warnings = &mut messages.warnings;
    let no_multi = why_not_multi(set);
    if let Err(e) = set_launch_stack_program(set, no_multi.is_none()) {
        warnings.push(format!("launch stacks: {e}; driver calls go without them"));
    }
    let mut attached = Vec::new();
    for (pid, library) in found {
        let mut made = Vec::new();
        let attached_library =
            attach_library(set, pid, &library, calls, no_multi.as_deref(), &mut made);
        links.extend(made.into_iter().map(|l| (pid, l)));
        match attached_library {
            Ok(target) if target.probed > 0 => attached.push(target),
            Ok(target) => warnings.push(format!(
                "pid {pid}: {} exports none of the CUDA driver functions ebtrace probes{}",
                library.path.display(),
                describe_skips(&target.skipped)
            )),
            Err(e) => warnings.push(format!(
                "pid {pid}: cannot probe {}: {e}; its CUDA driver calls are not traced",
                library.path.display()
            )),
        }
    }
    (attached, messages)
}

/// One line per target saying what is traced, for the user.
pub fn describe(target: &CudaTarget) -> String {
    let how = match &target.library.source {
        Source::Mapped => "loaded".to_string(),
        Source::LoaderSearch { via } => {
            format!("not loaded yet, found via {via}: a later dlopen is covered")
        }
    };
    let links = match &target.links {
        Links::Multi(n) => format!("{n} uprobe_multi links"),
        Links::Perf(n, why) => format!("{n} perf-event uprobe links (no uprobe_multi: {why})"),
    };
    let entry_only = match target.entry_only {
        0 => String::new(),
        n => format!(" ({n} of them at their entry only)"),
    };
    format!(
        "pid {}: probing {} CUDA driver functions in {} ({how}), through {links}{entry_only}{}",
        target.pid,
        target.probed,
        target.library.path.display(),
        describe_skips(&target.skipped)
    )
}

fn describe_skips(skipped: &[(String, String)]) -> String {
    if skipped.is_empty() {
        return String::new();
    }
    let list: Vec<String> = skipped
        .iter()
        .map(|(f, why)| format!("{f}: {why}"))
        .collect();
    format!("; not probed: {}", list.join(", "))
}

fn uprobe<'a>(set: &'a mut ProbeSet, program: &str) -> &'a mut UProbe {
    set.ebpf()
        .program_mut(program)
        .expect("program is in the object")
        .try_into()
        .expect("program is a uprobe")
}

impl Drop for CudaProbe {
    fn drop(&mut self) {
        self.detach();
    }
}

/// Puts the program that writes launch stacks where the entry programs
/// tail-call it, if the set takes them: its copy loaded for multi-uprobe
/// links (`multi`), or aya's, loaded once per probe set.
fn set_launch_stack_program(set: &mut ProbeSet, multi: bool) -> Result<()> {
    if !set.config().launch_stacks.any() {
        return Ok(());
    }
    let program = stack_names::LAUNCH_STACK_PROGRAM;
    let jump = stack_names::LAUNCH_STACK_JUMP;
    if multi {
        return set
            .set_multi_jump(jump, 0, program)
            .map_err(|e| Error::io(format!("putting {program} in {jump}"), e));
    }
    let probe = uprobe(set, program);
    if probe.fd().is_ok() {
        return Ok(());
    }
    probe.load().map_err(|source| Error::Attach {
        what: format!("program {program} (verifier)"),
        source: Box::new(source),
    })?;
    let fd = probe
        .fd()
        .and_then(|fd| fd.try_clone().map_err(Into::into))
        .map_err(|source| Error::Attach {
            what: format!("program {program}"),
            source: Box::new(source),
        })?;
    let map_error = |source| Error::Map {
        name: jump,
        source: Box::new(source),
    };
    let map = set.ebpf().map_mut(jump).ok_or_else(|| {
        map_error(aya::maps::MapError::InvalidName {
            name: jump.to_string(),
        })
    })?;
    ProgramArray::try_from(map)
        .and_then(|mut array| array.set(0, &fd, 0))
        .map_err(map_error)
}

/// Chooses, once per capture, between multi-uprobe links (`None`, the
/// programs loaded for them) and perf-event links (why not multi).
fn why_not_multi(set: &mut ProbeSet) -> Option<String> {
    if std::env::var_os(LINKS_ENV).is_some_and(|v| v == "perf") {
        return Some(format!("{LINKS_ENV}=perf"));
    }
    if let Some(why) = uprobe_multi::kernel_unfit(&crate::procfs::kernel_release()) {
        return Some(why);
    }
    let mut programs = PROGRAMS.to_vec();
    if set.config().launch_stacks.any() {
        programs.push(stack_names::LAUNCH_STACK_PROGRAM);
    }
    set.load_multi(&programs).err().map(|e| e.to_string())
}

/// One probed function: where, and what its programs are told.
struct Point {
    name: &'static str,
    offset: u64,
    cookie: u64,
    entry: &'static str,
    /// No return probe ([`crate::cuda_api::DriverFunction::entry_only`]).
    entry_only: bool,
}

fn attach_library(
    set: &mut ProbeSet,
    pid: u32,
    library: &Library,
    calls: DriverCalls,
    no_multi: Option<&str>,
    links: &mut Vec<OwnedLink>,
) -> Result<CudaTarget> {
    let wanted: Vec<&str> = FUNCTIONS
        .iter()
        .filter(|f| calls.probes(f))
        .map(|f| f.name)
        .collect();
    let offsets = libcuda::function_offsets(&library.attach_path, &wanted)
        .map_err(|e| Error::io(format!("reading {}", library.path.display()), e))?;
    let mut target = CudaTarget {
        pid,
        library: library.clone(),
        probed: 0,
        entry_only: 0,
        skipped: Vec::new(),
        links: Links::Multi(0),
    };
    let mut points = Vec::new();
    for (id, function) in FUNCTIONS.iter().enumerate() {
        if !calls.probes(function) {
            continue;
        }
        match offsets.get(function.name) {
            None => {}
            Some(Err(Unprobeable::LockPrefix)) => target.skipped.push((
                function.name.to_string(),
                "first instruction has a lock prefix".into(),
            )),
            Some(Ok(offset)) => {
                let entry: Shape = function.shape();
                points.push(Point {
                    name: function.name,
                    offset: *offset,
                    cookie: function.cookie(id as u16),
                    entry: entry.program(),
                    entry_only: function.entry_only(),
                });
            }
        }
    }
    let why_perf = match no_multi {
        Some(why) => why.to_string(),
        None => match attach_multi(set, pid, library, &points) {
            Ok(multi) => {
                target.probed = points.len();
                target.entry_only = points.iter().filter(|p| p.entry_only).count();
                target.links = Links::Multi(multi.len());
                links.extend(multi.into_iter().map(OwnedLink::from));
                return Ok(target);
            }
            Err(e) => format!("the kernel refused the link: {e}"),
        },
    };
    let before = links.len();
    attach_perf(set, pid, library, &points, &mut target, links)?;
    target.links = Links::Perf(links.len() - before, why_perf);
    Ok(target)
}

/// One multi-uprobe link per entry program, then the return link: a
/// return is never seen before its entry is in place. All or nothing.
fn attach_multi(
    set: &ProbeSet,
    pid: u32,
    library: &Library,
    points: &[Point],
) -> std::io::Result<Vec<uprobe_multi::Link>> {
    let mut links = Vec::new();
    let mut link = |program: &str, points: &[&Point], kind| {
        if points.is_empty() {
            return Ok(());
        }
        let fd = set
            .multi_program(program)
            .expect("every CUDA program is loaded for multi-uprobe links");
        let offsets: Vec<u64> = points.iter().map(|p| p.offset).collect();
        let cookies: Vec<u64> = points.iter().map(|p| p.cookie).collect();
        let made = uprobe_multi::attach(fd, &library.attach_path, &offsets, &cookies, pid, kind)?;
        links.push(made);
        Ok::<(), std::io::Error>(())
    };
    for program in &PROGRAMS[..PROGRAMS.len() - 1] {
        let group: Vec<&Point> = points.iter().filter(|p| p.entry == *program).collect();
        link(program, &group, uprobe_multi::Kind::Entry)?;
    }
    let returning: Vec<&Point> = points.iter().filter(|p| !p.entry_only).collect();
    link(shape::RETURN, &returning, uprobe_multi::Kind::Return)?;
    Ok(links)
}

/// A perf-event link per function and program, the entry first; a
/// function whose links fail is reported in `target.skipped`.
fn attach_perf(
    set: &mut ProbeSet,
    pid: u32,
    library: &Library,
    points: &[Point],
    target: &mut CudaTarget,
    links: &mut Vec<OwnedLink>,
) -> Result<()> {
    for program in PROGRAMS {
        let probe = uprobe(set, program);
        if probe.fd().is_err() {
            probe.load().map_err(|source| Error::Attach {
                what: format!("program {program} (verifier)"),
                source: Box::new(source),
            })?;
        }
    }
    let pid_nz = NonZeroU32::new(pid).expect("a target pid is not 0");
    for point in points {
        let mut attach = |set: &mut ProbeSet, program: &str| {
            let attach_point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(point.offset),
                cookie: Some(point.cookie),
            };
            let probe = uprobe(set, program);
            let id = probe.attach(
                attach_point,
                &library.attach_path,
                UProbeScope::OneProcess(pid_nz),
            )?;
            links.push(probe.take_link(id)?.into());
            Ok::<(), aya::programs::ProgramError>(())
        };
        // The entry first: a return without its entry is counted, never misread.
        let result = attach(set, point.entry).and_then(|()| match point.entry_only {
            true => Ok(()),
            false => attach(set, shape::RETURN),
        });
        match result {
            Ok(()) => {
                target.probed += 1;
                target.entry_only += usize::from(point.entry_only);
            }
            Err(e) => target.skipped.push((point.name.to_string(), e.to_string())),
        }
    }
    Ok(())
}
