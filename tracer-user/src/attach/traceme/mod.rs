//! `TraceMeProbe`: TraceMe events from unmodified jaxlib / TensorFlow /
//! libtpu processes.
//!
//! For every traced process: [`discover()`] finds each loaded object that
//! carries a TraceMe recorder; a uprobe on its `TraceMeRecorder::Record`
//! (one program per C++ string layout, scoped to that process) copies
//! every event; [`level`] switches recording on where no profiler session
//! in the process has it on, and back off at the end. A process without a
//! recorder is simply traced without TraceMe events.

pub mod cell;
pub mod discover;
pub mod facts;
pub mod guard;
mod left_behind;
mod recorder_symbols;
pub mod switch;

use std::{num::NonZeroU32, path::Path};

use aya::programs::{UProbe, uprobe::UProbeScope};
pub use discover::{Discovery, PythonGate, Recorder, discover};
pub use recorder_symbols::StringLayout;
pub use switch::{LevelState, TraceLevelSwitch};

/// Puts the TraceMe gates back in the processes forked from `pid` since
/// `since` (clock ticks since boot) while a framework's profiler session
/// ran in it at `level`: a child inherits the session's gate on and has no
/// session to switch it off (threads, the agent's among them, are not
/// forked), so it would record into its memory for ever. The gates are
/// looked for only where such a child exists. One line per gate put back.
pub fn restore_children_of_session(pid: u32, since: u64, level: u32) -> Vec<String> {
    if crate::procfs::descendants_since(pid, since).is_empty() {
        return Vec::new();
    }
    let Ok(found) = discover(pid) else {
        return Vec::new();
    };
    let off = i64::from(switch::DISABLED);
    found
        .recorders
        .iter()
        .filter_map(|r| {
            let address = r.trace_level_address?;
            let cell = cell::Cell::trace_level(pid, address);
            let children = switch::put_back_in_children(cell, since, i64::from(level), off);
            switch::describe_children(pid, address, off, &children)
        })
        .collect()
}
use tracer_common::traceme::{names, stat};

use super::ProbeSet;
use crate::error::{Error, Result};

/// How long a TraceMe that passed the level check just before the level
/// was restored may take to reach `Record` (a preempted thread).
const IN_FLIGHT_GRACE: std::time::Duration = std::time::Duration::from_millis(20);

/// Run at every start, whatever is traced, before any probe is attached:
/// cleans up after ebtraces that died and whose guard died too (see
/// [`switch::sweep_markers`]), printing one line per gate put back, and
/// starts this run's [`guard`].
pub fn prepare_gates() {
    for line in switch::sweep_markers(std::path::Path::new(switch::MARKER_DIR)) {
        eprintln!("ebtrace: {line}");
    }
    // A failure shows again, with its consequence, when a gate is to be set.
    let _ = guard::start();
}

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceMeOptions {
    /// ProfileOptions' `host_tracer_level`: 0 collects no TraceMe events;
    /// 1 critical, 2 info (the default), 3 verbose.
    pub level: u32,
    /// Stop switching recording on after this many events (the target
    /// keeps every event ebtrace makes it record until a session of its
    /// own drains them).
    pub max_events: u64,
}

impl Default for TraceMeOptions {
    fn default() -> Self {
        TraceMeOptions {
            level: 2,
            max_events: 1_000_000,
        }
    }
}

/// Kernel-side TraceMe counters, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceMeProbeStats {
    /// Uprobe hits in a traced process.
    pub hits: u64,
    /// Events whose `Event` could not be read: not recorded.
    pub event_unreadable: u64,
    /// Events recorded without their name (its memory could not be read).
    pub name_unreadable: u64,
}

/// One attached recorder and the switch of its trace level.
#[derive(Debug)]
pub struct AttachedRecorder {
    /// The recorder found.
    pub recorder: Recorder,
    /// `None` when the object has no `g_trace_level` to switch.
    pub switch: Option<TraceLevelSwitch>,
}

impl AttachedRecorder {
    /// One line about it, for the user.
    pub fn describe(&self) -> String {
        let r = &self.recorder;
        let level = match &self.switch {
            Some(s) => s.state().describe(),
            None => "no g_trace_level symbol: observing only".to_string(),
        };
        let symbols = if r.cached {
            format!("symbols remembered from an earlier search of {}", r.symbols)
        } else {
            format!("{} symbols searched in {:.0?}", r.symbols, r.lookup_time)
        };
        format!(
            "pid {}: TraceMe recorder in {} ({}::profiler, {}; {symbols}, \
             {} mapped files in {:.0?}); {level}",
            r.pid,
            r.file_name(),
            r.namespace,
            r.layout.describe(),
            r.objects,
            r.search_time,
        )
    }
}

/// A process's Python TraceMe gate and its switch.
#[derive(Debug)]
pub struct AttachedPythonGate {
    /// The gate found.
    pub gate: PythonGate,
    /// `None` until recording is switched on; never engaged where ebtrace
    /// did not switch the process's level on itself.
    pub switch: Option<TraceLevelSwitch>,
    /// Times a session of the process's own cleared it under ebtrace.
    pub cleared: u64,
}

impl AttachedPythonGate {
    /// One line for the capture summary on what became of the gate.
    pub fn describe(&self) -> String {
        let g = &self.gate;
        let state = match self.switch.as_ref().map(TraceLevelSwitch::state) {
            None => "left alone (ebtrace did not switch this process's level on)".to_string(),
            Some(LevelState::Enabled { .. }) => "set by ebtrace".to_string(),
            Some(LevelState::Restored { .. }) => "set by ebtrace, restored".to_string(),
            Some(LevelState::InProcess { .. }) => "already set by the process".to_string(),
            Some(other) => other.describe(),
        };
        let mut line = format!(
            "pid {}: Python TraceMe gate xla::profiler::traceme_enabled in {}: {state}",
            g.pid,
            g.file_name()
        );
        if self.cleared > 0 {
            line.push_str(&format!(
                "; a profiler session of the process's own cleared it {} times, ebtrace set it again",
                self.cleared
            ));
        }
        line
    }
}

/// The TraceMe probe family.
#[derive(Debug, Default)]
pub struct TraceMeProbe {
    /// The recorders attached, every target's.
    pub recorders: Vec<AttachedRecorder>,
    /// The Python TraceMe gates found, every target's.
    pub python_gates: Vec<AttachedPythonGate>,
    /// Lines for the user: what was found, or why nothing was.
    pub notes: Vec<String>,
    /// Events seen so far, and whether enabling stopped early.
    events: u64,
    max_events: u64,
    /// Events earlier windows and captures left in these targets, which
    /// count against `max_events` too (see [`left_behind`]).
    earlier_events: u64,
    /// Of `events`, those already added to the targets' counts.
    noted_events: u64,
    level: i32,
    stopped_early: bool,
    warnings: Vec<String>,
    /// Resident memory of each process ebtrace switched recording on in,
    /// when it did, and when it switched it off again.
    resident: std::collections::BTreeMap<u32, (u64, Option<u64>)>,
}

/// What [`TraceMeProbe::discover`] found in each process.
pub type Discovered = Vec<(u32, std::io::Result<Discovery>)>;

impl TraceMeProbe {
    /// Looks for the recorders of every process in `pids`: the slow part of
    /// attaching (reading their mapped files), which needs no probe set and
    /// so can run while the probes load. Nothing when `options` asks for no
    /// TraceMe events.
    pub fn discover(pids: &[u32], options: &TraceMeOptions) -> Discovered {
        if options.level == 0 {
            return Vec::new();
        }
        pids.iter().map(|&pid| (pid, discover(pid))).collect()
    }

    /// Attaches the uprobes of the recorders [`Self::discover`] found.
    /// Recording is not switched on yet: see [`enable`](Self::enable).
    pub fn attach(set: &mut ProbeSet, found: Discovered, options: TraceMeOptions) -> Result<Self> {
        let mut probe = TraceMeProbe {
            max_events: options.max_events,
            level: options.level.min(i32::MAX as u32) as i32,
            ..TraceMeProbe::default()
        };
        if options.level == 0 {
            return Ok(probe);
        }
        for (pid, found) in found {
            let found = match found {
                Ok(found) => found,
                Err(e) => {
                    probe.notes.push(format!(
                        "pid {pid}: cannot look for a TraceMe recorder (/proc/{pid}/maps: {e}): \
                         no TraceMe events from it"
                    ));
                    continue;
                }
            };
            for object in &found.python_gates_in_python {
                probe.notes.push(format!(
                    "pid {pid}: {object} gates Python TraceMes (tf.profiler.experimental.Trace) in \
                     a Python variable that cannot be set from outside (TensorFlow 2.20 or older): \
                     those events are missing unless a profiler session of the process's own runs"
                ));
            }
            probe
                .python_gates
                .extend(
                    found
                        .python_gates
                        .into_iter()
                        .map(|gate| AttachedPythonGate {
                            gate,
                            switch: None,
                            cleared: 0,
                        }),
                );
            for u in &found.unusable {
                probe.notes.push(format!(
                    "pid {pid}: TraceMe recorder in {} not usable: {}",
                    u.object, u.reason
                ));
            }
            if found.recorders.is_empty() {
                probe.notes.push(format!(
                    "pid {pid}: no TraceMe recorder (jaxlib, TensorFlow or libtpu) loaded in its {} \
                     mapped files: no TraceMe events from it",
                    found.objects
                ));
            }
            for recorder in found.recorders {
                match attach_one(set, &recorder) {
                    Ok(()) => probe.recorders.push(AttachedRecorder {
                        recorder,
                        switch: None,
                    }),
                    Err(e) => probe.notes.push(format!(
                        "pid {pid}: cannot probe the TraceMe recorder in {}: {e}",
                        recorder.file_name()
                    )),
                }
            }
        }
        probe.earlier_events = probe.left_in_targets_before();
        Ok(probe)
    }

    /// What earlier captures left in this probe's targets (see
    /// [`left_behind`]).
    fn left_in_targets_before(&self) -> u64 {
        let dir = Path::new(switch::MARKER_DIR);
        let pids: std::collections::BTreeSet<u32> =
            self.recorders.iter().map(|r| r.recorder.pid).collect();
        pids.into_iter()
            .map(|pid| left_behind::read(dir, pid))
            .sum()
    }

    /// Adds the events recorded since the last call to the counts of the
    /// targets recording was switched on in.
    fn note_left_in_targets(&mut self) {
        let new = self.events.saturating_sub(self.noted_events);
        self.noted_events = self.events;
        for pid in self.resident.keys() {
            left_behind::add(Path::new(switch::MARKER_DIR), *pid, new);
        }
    }

    /// Switches recording on in every recorder that has it off, unless
    /// earlier captures left as many events in the targets as
    /// `--max-events` allows.
    pub fn enable(&mut self) {
        if self.earlier_events >= self.max_events && !self.recorders.is_empty() {
            self.stopped_early = true;
            self.warnings.push(format!(
                "TraceMe recording not switched on: earlier captures already left {} TraceMe \
                 events in the traced processes' memory, which --max-events ({}) bounds for all \
                 captures of a process together; a profiler session of the process's own frees \
                 them (or raise --max-events)",
                self.earlier_events, self.max_events
            ));
            return;
        }
        for r in &mut self.recorders {
            if let Some(address) = r.recorder.trace_level_address {
                let pid = r.recorder.pid;
                let switch = TraceLevelSwitch::engage(pid, address, self.level);
                if matches!(switch.state(), LevelState::Enabled { .. }) {
                    let now = crate::procfs::resident_bytes(pid).unwrap_or(0);
                    self.resident.entry(pid).or_insert((now, None));
                }
                r.switch = Some(switch);
            }
        }
        // The Python gate after the level, and only where ebtrace took the
        // level itself: otherwise a session of the process's own runs, and
        // it set the gate already.
        let enabled: Vec<u32> = self.resident.keys().copied().collect();
        for g in &mut self.python_gates {
            if enabled.contains(&g.gate.pid) {
                g.switch = Some(TraceLevelSwitch::engage_flag(g.gate.pid, g.gate.address));
            }
        }
        for r in &self.recorders {
            if let Some(address) = r.recorder.filter_bitmap_address
                && let Some(w) = check_filter(r.recorder.pid, address)
            {
                self.warnings.push(w);
            }
        }
    }

    /// Switches recording on again after [`Self::restore`], for a new
    /// window of the same probes: counts and warnings start over.
    pub fn rearm(&mut self) {
        self.note_left_in_targets();
        self.earlier_events = self.left_in_targets_before();
        self.events = 0;
        self.noted_events = 0;
        self.stopped_early = false;
        self.warnings.clear();
        self.resident.clear();
        for r in &mut self.recorders {
            r.switch = None;
        }
        for g in &mut self.python_gates {
            g.switch = None;
            g.cleared = 0;
        }
        self.enable();
    }

    /// A profiler session of the process's own that stops clears the
    /// Python gate whoever set it, while ebtrace still holds the level (a
    /// session cannot start while ebtrace holds it): set it again.
    fn keep_python_gates(&mut self) {
        for g in &mut self.python_gates {
            if let Some(s) = &g.switch
                && matches!(s.state(), LevelState::Enabled { .. })
                && s.cell().read().ok() == Some(0)
                && s.cell().write(1).is_ok()
            {
                g.cleared += 1;
            }
        }
    }

    /// Puts the Python gates back before the levels: a session of the
    /// process's own that starts once the level is free sets its gate, and
    /// must not find it cleared afterwards.
    fn restore_python_gates(&mut self, early: bool) {
        for g in &mut self.python_gates {
            if let Some(s) = g.switch.as_mut()
                && let Some(w) = s.restore(early)
            {
                self.warnings.push(w);
            }
        }
    }

    /// Notes resident memory where recording was just switched off.
    fn measure_left_behind(&mut self) {
        for (pid, (_, after)) in &mut self.resident {
            if after.is_none() {
                *after = crate::procfs::resident_bytes(*pid);
            }
        }
    }

    /// One line per process ebtrace made record: what stays in its memory.
    pub fn left_in_targets(&self) -> Vec<String> {
        let events = self.events;
        self.resident
            .iter()
            .map(|(pid, (before, after))| {
                let growth = match after {
                    Some(after) => format!(
                        "its resident memory grew by {:.1} MiB while recording was on",
                        (*after as f64 - *before as f64) / (1024.0 * 1024.0)
                    ),
                    None => "recording is still on".to_string(),
                };
                format!(
                    "pid {pid}: the TraceMe events recorded while ebtrace had recording on \
                     ({events} in this capture) stay in its memory until a profiler session of \
                     its own drains them; {growth} (--max-events bounds this)"
                )
            })
            .collect()
    }

    /// Counts `new_events` events; past `max_events`, stops enabling.
    pub fn count_events(&mut self, new_events: u64) {
        self.events += new_events;
        if !self.stopped_early {
            self.keep_python_gates();
        }
        let left = self.earlier_events.saturating_add(self.events);
        if left >= self.max_events && !self.stopped_early {
            self.stopped_early = true;
            self.restore_python_gates(true);
            let mut restored = false;
            for r in &mut self.recorders {
                if let Some(s) = r.switch.as_mut()
                    && matches!(s.state(), LevelState::Enabled { .. })
                {
                    restored = true;
                    if let Some(w) = s.restore(true) {
                        self.warnings.push(w);
                    }
                }
            }
            if restored {
                self.measure_left_behind();
                self.note_left_in_targets();
                self.warnings.push(format!(
                    "TraceMe recording switched off after {} events ({} more left by earlier \
                     captures; --max-events {} bounds them together); later events are missing",
                    self.events, self.earlier_events, self.max_events
                ));
            }
        }
    }

    /// Puts every level ebtrace switched on back to -1, then gives the
    /// TraceMes already past the gate time to reach `Record` while the
    /// probes are still attached.
    pub fn restore(&mut self) {
        self.restore_python_gates(false);
        let mut restored = false;
        for r in &mut self.recorders {
            if let Some(s) = r.switch.as_mut() {
                restored |= matches!(s.state(), LevelState::Enabled { .. });
                if let Some(w) = s.restore(false) {
                    self.warnings.push(w);
                }
            }
        }
        if restored {
            self.measure_left_behind();
            std::thread::sleep(IN_FLIGHT_GRACE);
        }
        self.note_left_in_targets();
    }

    /// Events counted since the capture (or its last resume) started.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Adds a problem the trace should mention.
    pub fn warn(&mut self, warning: String) {
        self.warnings.push(warning);
    }

    /// Problems the trace should mention.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The kernel-side counters.
    pub fn stats(set: &mut ProbeSet) -> TraceMeProbeStats {
        let Some(map) = set.ebpf().map(names::STATS) else {
            return TraceMeProbeStats::default();
        };
        let Ok(array) = aya::maps::PerCpuArray::<_, u64>::try_from(map) else {
            return TraceMeProbeStats::default();
        };
        let sum = |i: u32| array.get(&i, 0).map_or(0, |v| v.iter().sum());
        TraceMeProbeStats {
            hits: sum(stat::HITS),
            event_unreadable: sum(stat::EVENT_UNREADABLE),
            name_unreadable: sum(stat::NAME_UNREADABLE),
        }
    }
}

/// A warning if `g_trace_filter_bitmap` (all ones unless a session of the
/// process's own set a filter mask, which outlives that session) keeps
/// TraceMes out.
fn check_filter(pid: u32, address: u64) -> Option<String> {
    let mut bytes = [0u8; 8];
    crate::procfs::read_memory(pid, address, &mut bytes).ok()?;
    match u64::from_ne_bytes(bytes) {
        u64::MAX => None,
        0 => Some(format!(
            "pid {pid}: its TraceMe filter (g_trace_filter_bitmap) is 0, set by an earlier \
             profiler session of its own: it records no TraceMe at all"
        )),
        mask => Some(format!(
            "pid {pid}: its TraceMe filter (g_trace_filter_bitmap) is {mask:#x}, set by an \
             earlier profiler session of its own: TraceMes outside that mask are missing"
        )),
    }
}

fn attach_one(set: &mut ProbeSet, recorder: &Recorder) -> Result<()> {
    let name = recorder.layout.program();
    let program: &mut UProbe = set
        .ebpf()
        .program_mut(name)
        .expect("program is in the object")
        .try_into()
        .expect("program is a uprobe");
    if program.fd().is_err() {
        program.load().map_err(|source| Error::Attach {
            what: format!("program {name} (verifier)"),
            source: Box::new(source),
        })?;
    }
    let pid = NonZeroU32::new(recorder.pid).expect("pids are non-zero");
    let link = program
        .attach(
            recorder.record_offset,
            &recorder.open_path,
            UProbeScope::OneProcess(pid),
        )
        .and_then(|id| program.take_link(id))
        .map_err(|source| Error::Attach {
            what: format!(
                "uprobe on TraceMeRecorder::Record in {} of pid {}",
                recorder.object, recorder.pid
            ),
            source: Box::new(source),
        })?;
    set.keep_link(link);
    Ok(())
}
