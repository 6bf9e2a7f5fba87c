//! Python frames in a sampled user stack: each frame the stack program
//! read is named (function, file, line) from its code object, in the
//! process's memory while it runs, and the named frames take the place of
//! the native eval-loop frame that ran them, so that C and C++ frames of
//! extensions stay between them in order.
//!
//! A named frame stands in the user stack as a tagged value, not an
//! address ([`is_python_frame`]); [`python_symbol`] names it from
//! [`names`], kept once for every capture.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rustc_hash::FxHashMap;
use tracer_common::python::{
    FRAME_ENTRY, FRAME_SHIM, PYTHON_INNER_FRAMES, PYTHON_TRUNCATED, PYTHON_UNREADABLE,
    PythonFrameRecord,
};

use super::{
    code::{Code, CodeError},
    names::{self, Marker},
    runtime::PythonRuntime,
};
use crate::{
    procfs::ProcessMemory,
    symbols::stacks::{Frame, Symbol, lookup_address},
};

/// The high bits of a user stack entry that is a Python frame: no user
/// address has them (x86-64 user space ends at 2^47).
const TAG: u64 = 0xe000_0000_0000_0000;
const TAG_MASK: u64 = 0xffff_0000_0000_0000;

/// Most code objects remembered per process; past it they are read again.
const MAX_CODES: usize = 1 << 16;
/// Most bytes the code objects remembered take, every process's together
/// (a line table may take 1 MiB): past it a process's are read again.
const MAX_CODE_BYTES: u64 = 64 << 20;
/// Bytes of code objects read a second at most, on average (a second's
/// worth may be read at once): a process that shows ever new, large code
/// objects (65,536 of them with 1 MiB line tables, say) costs ebtrace a
/// bounded share of a CPU, its other frames marked [`Marker::NotRead`].
const CODE_READ_BYTES_PER_S: u64 = 64 << 20;
/// What the code objects remembered take now, every process's together.
static CODE_BYTES: AtomicU64 = AtomicU64::new(0);
/// Code objects forgotten to make room, since ebtrace started.
static CODES_FORGOTTEN: AtomicU64 = AtomicU64::new(0);

/// What the code objects remembered take, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodeStats {
    /// Bytes they take now.
    pub bytes: u64,
    /// Code objects forgotten to make room, since ebtrace started.
    pub forgotten: u64,
}

/// What the code objects remembered take now.
pub fn code_stats() -> CodeStats {
    CodeStats {
        bytes: CODE_BYTES.load(Ordering::Relaxed),
        forgotten: CODES_FORGOTTEN.load(Ordering::Relaxed),
    }
}
/// How soon a process whose interpreter was not found is looked at again
/// (its samples may have outlived it, and a new process reuse its pid).
const FIND_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// The tagged entry of `frame`, used `now`.
fn entry_of(frame: Frame, now: Instant) -> u64 {
    TAG | names::id_of(frame, now)
}

fn marker_entry(marker: Marker) -> u64 {
    TAG | marker as u64
}

/// Whether a user stack entry is a Python frame, not an address.
pub fn is_python_frame(entry: u64) -> bool {
    entry & TAG_MASK == TAG
}

/// Whether a Python frame entry is a [`Marker`]: a frame that could not be named.
pub fn is_marker(entry: u64) -> bool {
    is_python_frame(entry) && entry & !TAG_MASK < Marker::ALL.len() as u64
}

/// The name of a Python frame entry (empty for anything else).
pub fn python_symbol(entry: u64) -> Arc<Symbol> {
    if !is_python_frame(entry) {
        return Arc::default();
    }
    names::symbol_of(entry & !TAG_MASK)
}

/// Whether an object (by path) holds the interpreter itself: its frames
/// are the interpreter's own work for the Python frame they run under.
pub fn is_interpreter_object(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libpython3.")
        || name == "python"
        || name == "python3"
        || name
            .strip_prefix("python3.")
            .is_some_and(|minor| minor.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether an object (by path) is the C runtime the interpreter calls into
/// for its own work (allocation, copies, thread-local state): its frames
/// between the interpreter's and a Python frame are that frame's work too.
pub fn is_c_runtime_object(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    ["libc.so", "libm.so", "ld-linux", "libpthread.so"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// `user` (native addresses, innermost first) with each frame `in_eval`
/// replaced by the next group of `python` (entries, innermost first, each
/// group ending at an entry frame); groups left over go at the outer end.
fn interleave(user: &[u64], python: &[(u64, bool)], in_eval: impl Fn(u64) -> bool) -> Vec<u64> {
    let mut groups = python.split_inclusive(|(_, entry)| *entry);
    let mut out = Vec::with_capacity(user.len() + python.len());
    for (depth, &address) in user.iter().enumerate() {
        let group = if in_eval(lookup_address(depth, address)) {
            groups.next()
        } else {
            None
        };
        match group {
            Some(frames) => out.extend(frames.iter().map(|(e, _)| *e)),
            None => out.push(address),
        }
    }
    out.extend(groups.flatten().map(|(e, _)| *e));
    out
}

/// A process whose Python frames are named.
struct NamedProcess {
    runtime: PythonRuntime,
    memory: ProcessMemory,
    codes: FxHashMap<(u64, u32), Result<Arc<Code>, CodeError>>,
    /// What `codes` takes, counted in [`CODE_BYTES`].
    code_bytes: u64,
}

impl Drop for NamedProcess {
    fn drop(&mut self) {
        CODE_BYTES.fetch_sub(self.code_bytes, Ordering::Relaxed);
    }
}

/// What [`PythonFrames::mix`] made of one stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mixed {
    /// Python frames named.
    pub named: u32,
    /// Frames marked instead (see [`Marker`]).
    pub unreadable: u32,
    /// Frames of a deep chain left out between its ends, marked once.
    pub left_out: u32,
}

/// Names Python frames and puts them in their stacks.
#[derive(Default)]
pub struct PythonFrames {
    /// Each process seen: its interpreter, or when none was found.
    processes: FxHashMap<u32, Result<NamedProcess, Instant>>,
    /// What may still be read of code objects now.
    reads: ReadBudget,
}

/// Bytes of code objects that may be read: [`CODE_READ_BYTES_PER_S`], a
/// second's worth at most saved up.
#[derive(Debug)]
struct ReadBudget {
    left: i64,
    at: Option<Instant>,
}

impl Default for ReadBudget {
    fn default() -> Self {
        ReadBudget {
            left: CODE_READ_BYTES_PER_S as i64,
            at: None,
        }
    }
}

impl ReadBudget {
    /// Whether a code object may be read `now` (its bytes are then spent,
    /// the last read taking the budget below zero).
    fn may_read(&mut self, now: Instant) -> bool {
        let earned = self.at.map_or(0, |at| {
            let elapsed = now.saturating_duration_since(at).as_micros() as u64;
            elapsed.saturating_mul(CODE_READ_BYTES_PER_S) / 1_000_000
        });
        self.at = Some(now);
        let most = CODE_READ_BYTES_PER_S as i64;
        self.left = self
            .left
            .saturating_add(earned.min(most as u64) as i64)
            .min(most);
        self.left > 0
    }

    fn spend(&mut self, bytes: usize) {
        self.left = self.left.saturating_sub(bytes as i64);
    }
}

impl PythonFrames {
    /// `user` (native addresses, innermost first) with each eval-loop
    /// frame replaced by the Python frames it ran: those of `python` up to
    /// the next entry frame. Python frames left over (a native stack cut
    /// short) go at its outer end. Where `left_out` frames of a deep chain
    /// were not kept, a marker stands for them after the first
    /// [`PYTHON_INNER_FRAMES`] of `python`.
    pub fn mix(
        &mut self,
        pid: u32,
        user: &[u64],
        python: &[PythonFrameRecord],
        flags: u32,
        left_out: u32,
    ) -> (Vec<u64>, Mixed) {
        let Some(process) = process_of(&mut self.processes, pid) else {
            return (user.to_vec(), Mixed::default());
        };
        let mut mixed = Mixed {
            left_out,
            ..Mixed::default()
        };
        let mut named = process.name_chain(python, &mut self.reads, &mut mixed);
        let end = if flags & PYTHON_TRUNCATED != 0 {
            Some(Marker::Truncated)
        } else if flags & PYTHON_UNREADABLE != 0 {
            Some(Marker::Unreadable)
        } else {
            None
        };
        if let Some(marker) = end {
            mixed.unreadable += 1;
            named.push((marker_entry(marker), true));
        }
        let runtime = &process.runtime;
        let out = interleave(user, &named, |address| runtime.in_eval(address));
        (out, mixed)
    }

    /// Forgets process `pid`, which exited.
    pub fn forget_process(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }
}

/// The process `pid`, its interpreter found the first time it is asked
/// for (`None`: it has none ebtrace reads).
fn process_of(
    processes: &mut FxHashMap<u32, Result<NamedProcess, Instant>>,
    pid: u32,
) -> Option<&mut NamedProcess> {
    let known = processes.get(&pid);
    if known.is_none_or(|p| matches!(p, Err(at) if at.elapsed() >= FIND_AGAIN_AFTER)) {
        let found = PythonRuntime::find(pid)
            .ok()
            .flatten()
            .and_then(|runtime| {
                Some(NamedProcess {
                    memory: ProcessMemory::open(pid).ok()?,
                    runtime,
                    codes: FxHashMap::default(),
                    code_bytes: 0,
                })
            })
            .ok_or_else(Instant::now);
        processes.insert(pid, found);
    }
    processes.get_mut(&pid)?.as_mut().ok()
}

impl NamedProcess {
    /// The tagged entry naming `frame`.
    /// The entries of `python`'s frames, innermost first, each marked
    /// whether it ends a C call of the eval loop, counted into `mixed`;
    /// a marker stands for the frames [`Mixed::left_out`] says were left
    /// out, unless the frames on both sides of them are one run of junk.
    fn name_chain(
        &mut self,
        python: &[PythonFrameRecord],
        reads: &mut ReadBudget,
        mixed: &mut Mixed,
    ) -> Vec<(u64, bool)> {
        let now = Instant::now();
        let mut named: Vec<(u64, bool)> = Vec::with_capacity(python.len() + 2);
        let left_out = marker_entry(Marker::LeftOut);
        for (i, f) in python.iter().enumerate() {
            if i == PYTHON_INNER_FRAMES && mixed.left_out > 0 {
                named.push((left_out, false));
            }
            if f.flags & FRAME_SHIM != 0 {
                // It ends the C call of the frame before it.
                if let Some((_, entry)) = named.last_mut() {
                    *entry = true;
                }
                continue;
            }
            let entry = self.entry(f, now, reads);
            if is_marker(entry) {
                mixed.unreadable += 1;
                // A chain that loops through junk runs on across the frames
                // left out: they count as its, and it shows once.
                if let [.., (before, _), (gap, _)] = named[..]
                    && gap == left_out
                    && before == entry
                {
                    named.pop();
                    mixed.unreadable += std::mem::take(&mut mixed.left_out);
                }
                // A run of them shows once.
                if let Some(last) = named.last_mut().filter(|(e, _)| *e == entry) {
                    last.1 |= f.flags & FRAME_ENTRY != 0;
                    continue;
                }
            } else {
                mixed.named += 1;
            }
            named.push((entry, f.flags & FRAME_ENTRY != 0));
        }
        named
    }

    fn entry(&mut self, frame: &PythonFrameRecord, now: Instant, reads: &mut ReadBudget) -> u64 {
        let code = match self.code(frame, now, reads) {
            Ok(code) => code,
            Err(CodeError::Unreadable) => return marker_entry(Marker::Unreadable),
            Err(CodeError::Changed) => return marker_entry(Marker::Changed),
            Err(CodeError::Malformed(_)) => return marker_entry(Marker::Malformed),
            Err(CodeError::NotRead) => return marker_entry(Marker::NotRead),
        };
        let line = code.line_at(&self.runtime.layout, frame.code, frame.instruction);
        entry_of(
            Frame {
                function: code.name.clone(),
                file: Some(code.file.clone()),
                line: line.or(Some(code.first_line)),
            },
            now,
        )
    }

    /// The code object of `frame`, read once while it lives and there is
    /// room for it.
    fn code(
        &mut self,
        frame: &PythonFrameRecord,
        now: Instant,
        reads: &mut ReadBudget,
    ) -> Result<Arc<Code>, CodeError> {
        let key = (frame.code, frame.first_line);
        if let Some(known) = self.codes.get(&key) {
            return known.clone();
        }
        if !reads.may_read(now) {
            return Err(CodeError::NotRead);
        }
        let read = Code::read(
            &self.memory,
            &self.runtime.layout,
            &self.runtime.types,
            frame.code,
            frame.first_line,
        )
        .map(Arc::new);
        // An object not read now may be read at the next sample.
        if matches!(read, Err(CodeError::Unreadable)) {
            return read;
        }
        let bytes = read.as_ref().map_or(0, |code| code.bytes() as u64);
        reads.spend(bytes as usize);
        let over = |more: u64| CODE_BYTES.load(Ordering::Relaxed) + more > MAX_CODE_BYTES;
        if self.codes.len() >= MAX_CODES || over(bytes) {
            self.forget_codes();
        }
        if !over(bytes) {
            self.codes.insert(key, read.clone());
            self.code_bytes += bytes;
            CODE_BYTES.fetch_add(bytes, Ordering::Relaxed);
        }
        read
    }

    /// Forgets the code objects read: they are read again when sampled.
    fn forget_codes(&mut self) {
        CODES_FORGOTTEN.fetch_add(self.codes.len() as u64, Ordering::Relaxed);
        CODE_BYTES.fetch_sub(self.code_bytes, Ordering::Relaxed);
        self.codes.clear();
        self.code_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_entries_are_no_user_address_and_name_their_frame() {
        let frame = Frame {
            function: "inner_hot".into(),
            file: Some("work.py".into()),
            line: Some(5),
        };
        let now = Instant::now();
        let entry = entry_of(frame.clone(), now);
        assert!(is_python_frame(entry) && !is_marker(entry));
        assert_eq!(entry_of(frame.clone(), now), entry);
        assert_eq!(python_symbol(entry).frames, vec![frame]);
        assert!(!is_python_frame(0x7fff_ffff_f000));
        assert!(is_marker(marker_entry(Marker::Changed)));
        assert!(python_symbol(0x1234).frames.is_empty());
    }

    /// Each eval-loop frame gives way to the Python frames its call ran,
    /// native frames stay between them, and what the native stack lacks
    /// room for goes at its outer end.
    #[test]
    fn python_frames_take_the_place_of_the_eval_frames_that_ran_them() {
        let eval = |a: u64| (0x100..0x200).contains(&a);
        // innermost: native leaf, eval, extension, eval, main.
        let user = [0x900, 0x150, 0x700, 0x160, 0x800];
        let (a, b, c, d) = (TAG | 10, TAG | 11, TAG | 12, TAG | 13);
        let python = [(a, false), (b, true), (c, true), (d, true)];
        assert_eq!(
            interleave(&user, &python, eval),
            [0x900, a, b, 0x700, c, 0x800, d],
        );
        assert_eq!(interleave(&user, &[], eval), user);
        // A native stack with no eval frame (not unwound): all at the end.
        assert_eq!(interleave(&[0x900], &python, eval), [0x900, a, b, c, d]);
        // A return address one past the end of the eval loop is in it.
        assert_eq!(interleave(&[0x900, 0x200], &[(a, true)], eval), [0x900, a]);
    }

    #[test]
    fn interpreter_objects_are_told_by_name() {
        for yes in [
            "/usr/lib/libpython3.11.so.1.0",
            "/opt/py/bin/python3.13",
            "python3",
        ] {
            assert!(is_interpreter_object(yes), "{yes}");
        }
        for no in [
            "/x/libtorch_cpu.so",
            "/x/python3.11-config",
            "pythonista.so",
        ] {
            assert!(!is_interpreter_object(no), "{no}");
        }
        assert!(is_c_runtime_object(
            "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        ));
        assert!(is_c_runtime_object("/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!is_c_runtime_object("/x/libcublas.so.12"));
    }
}
