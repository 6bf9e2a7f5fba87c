//! `CudaProbe`: entry and return uprobes on the CUDA driver functions of
//! each traced process's `libcuda.so.1` (see `tracer-ebpf/src/cuda.rs`).
//!
//! Probes are scoped to the traced process (`UProbeScope::OneProcess`), so
//! other processes using the same library pay nothing. A process without
//! the driver is reported in one line and the other probes go on.
//!
//! The probe owns its links because releasing them is slow: the kernel
//! destroys each uprobe perf event under a global mutex and waits for an
//! RCU tasks-trace grace period there (about 0.1 s per link on a VM, so
//! seconds for a real driver's ~200 links). They are released from many
//! threads at once (a sequential release also waits for each grace period
//! to start) and, at the end of a capture, in the background, after the
//! programs were told to ignore the targets.

use std::num::NonZeroU32;

use aya::{
    maps::{MapData, PerCpuArray},
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeScope},
    },
};
use tracer_common::cuda::{cookie, names, shape, stat};

use super::{
    ProbeSet,
    libcuda::{self, Library, Source, Unprobeable},
};
use crate::{
    cuda_api::{FUNCTIONS, Shape},
    error::{Error, Result},
    procfs::TargetProcess,
};

/// The driver library of one traced process and what was attached to it.
#[derive(Clone, Debug)]
pub struct CudaTarget {
    pub pid: u32,
    pub library: Library,
    /// Functions with both probes attached.
    pub probed: usize,
    /// Functions exported but not probed, with the reason.
    pub skipped: Vec<(String, String)>,
}

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

pub struct CudaProbe {
    stats: PerCpuArray<MapData, u64>,
    links: Vec<UProbeLink>,
    pub targets: Vec<CudaTarget>,
}

/// Messages for the user about processes whose driver calls are not traced.
pub type Warnings = Vec<String>;

impl CudaProbe {
    /// Attaches to the driver library of every target that has one (or
    /// would load one). Returns `None` when no target has any; warnings
    /// name the processes left out.
    pub fn attach(
        set: &mut ProbeSet,
        targets: &[TargetProcess],
    ) -> Result<(Option<CudaProbe>, Warnings)> {
        let mut warnings = Vec::new();
        let found: Vec<(u32, Library)> = targets
            .iter()
            .filter_map(|t| match libcuda::locate(t.pid) {
                Some(lib) => Some((t.pid, lib)),
                None => {
                    warnings.push(format!(
                        "pid {} ({}) has not loaded {} and none is on its library path \
                         (LD_LIBRARY_PATH, ld.so.cache, /usr/lib...): its CUDA driver calls are \
                         not traced",
                        t.pid,
                        t.name,
                        libcuda::SONAME
                    ));
                    None
                }
            })
            .collect();
        if found.is_empty() {
            return Ok((None, warnings));
        }
        for program in [
            shape::REGISTERS,
            shape::STACK,
            shape::LAUNCH_CONFIG,
            shape::MEMCPY2D,
            shape::MEMCPY3D,
            shape::RETURN,
        ] {
            uprobe(set, program)
                .load()
                .map_err(|source| Error::Attach {
                    what: format!("program {program} (verifier)"),
                    source: Box::new(source),
                })?;
        }
        let mut attached = Vec::new();
        let mut links = Vec::new();
        for (pid, library) in found {
            match attach_library(set, pid, &library, &mut links) {
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
            }),
            warnings,
        ))
    }

    /// Detaches every probe, releasing the links concurrently.
    pub fn detach(&mut self) {
        super::links::release(std::mem::take(&mut self.links));
    }

    /// Starts detaching every probe on another thread and returns at once;
    /// the process's exit waits for the rest.
    pub fn detach_in_background(&mut self) -> std::thread::JoinHandle<()> {
        let links = std::mem::take(&mut self.links);
        std::thread::spawn(move || super::links::release(links))
    }

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

/// One line per target saying what is traced, for the user.
pub fn describe(target: &CudaTarget) -> String {
    let how = match &target.library.source {
        Source::Mapped => "loaded".to_string(),
        Source::LoaderSearch { via } => {
            format!("not loaded yet, found via {via}: a later dlopen is covered")
        }
    };
    format!(
        "pid {}: probing {} CUDA driver functions in {} ({how}){}",
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

fn attach_library(
    set: &mut ProbeSet,
    pid: u32,
    library: &Library,
    links: &mut Vec<UProbeLink>,
) -> Result<CudaTarget> {
    let wanted: Vec<&str> = FUNCTIONS.iter().map(|f| f.name).collect();
    let offsets = libcuda::function_offsets(&library.attach_path, &wanted)
        .map_err(|e| Error::io(format!("reading {}", library.path.display()), e))?;
    let pid_nz = NonZeroU32::new(pid).expect("a target pid is not 0");
    let mut target = CudaTarget {
        pid,
        library: library.clone(),
        probed: 0,
        skipped: Vec::new(),
    };
    for (id, function) in FUNCTIONS.iter().enumerate() {
        let offset = match offsets.get(function.name) {
            None => continue,
            Some(Err(Unprobeable::LockPrefix)) => {
                target.skipped.push((
                    function.name.to_string(),
                    "first instruction has a lock prefix".into(),
                ));
                continue;
            }
            Some(Ok(offset)) => *offset,
        };
        let cookie = cookie::encode(id as u16, function.out_arg(), function.name_arg());
        let mut attach = |set: &mut ProbeSet, program: &str| {
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(offset),
                cookie: Some(cookie),
            };
            let probe = uprobe(set, program);
            let id = probe.attach(point, &library.attach_path, UProbeScope::OneProcess(pid_nz))?;
            links.push(probe.take_link(id)?);
            Ok::<(), aya::programs::ProgramError>(())
        };
        // The entry first: a return without its entry is counted, never misread.
        let entry: Shape = function.shape();
        let result = attach(set, entry.program()).and_then(|()| attach(set, shape::RETURN));
        match result {
            Ok(()) => target.probed += 1,
            Err(e) => target
                .skipped
                .push((function.name.to_string(), e.to_string())),
        }
    }
    Ok(target)
}
