//! `CudaTimelineBuilder`: CUDA driver calls become spans on the calling
//! thread, and the work they submit becomes events on per-stream lines of
//! the GPU it went to.
//!
//! Device events are **host-observed**: each spans the driver call that
//! submitted the work, not the GPU's execution, which only CUPTI can time.
//! Each submission gets a correlation id shared by its host span and its
//! device event, from which XProf draws the launch arrows.
//!
//! What the driver API reveals, and so what this module knows:
//! - kernel names, from the `cuModuleGetFunction` / `cuLibraryGetKernel`
//!   lookups seen during the capture (`cuKernelGetFunction` carries a
//!   kernel's name to its function); a handle looked up before is named
//!   `<unresolved 0x…>`;
//! - a context's device, from `cuCtxCreate*`, `cuDevicePrimaryCtxRetain`
//!   and `cuCtxGetDevice`; a thread's current context from
//!   `cuCtxSetCurrent` / `cuCtxPushCurrent` / `cuCtxPopCurrent` /
//!   `cuCtxGetCurrent` / `cuCtxCreate`; a stream's context from
//!   `cuStreamCreate*` on a thread with a known context, or
//!   `cuStreamGetCtx`. Work whose device stays unknown is shown on GPU 0
//!   and says so in its `device_ordinal_source` stat.
//!
//! Records must be fed in return-time order (the header time).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    num::NonZeroU64,
    sync::Arc,
};

use rustc_hash::FxHashMap;
use tracer_common::cuda::{CudaCall, CudaSymbol, flags};

use super::{Cuts, SharedTexts, Span, Stat, StatName, Stats, Value, nest};
use crate::{
    collect::Record,
    cuda_api::{self, CopyKind, DriverFunction, Memory, MemsetExtent, Op},
};

/// The `result` of a call recorded at its entry only
/// ([`cuda_api::DriverFunction::entry_only`]): it shows as an instant.
const ENTRY_ONLY_RESULT: &str = "not recorded (probed at entry only)";

/// `CU_STREAM_LEGACY`: the context's legacy default stream, by name.
const STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, by name.
const STREAM_PER_THREAD: u64 = 0x2;

/// Work submitted to one GPU, as the host saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceTrack {
    /// The CUDA device ordinal.
    pub ordinal: u32,
    /// Lines by stream id.
    pub streams: BTreeMap<i64, StreamTrack>,
}

impl DeviceTrack {
    /// How many of its streams are timed by `timing`, and their events.
    pub fn count_timed(&self, timing: StreamTiming) -> (usize, usize) {
        self.streams
            .values()
            .filter(|s| s.timing == timing)
            .fold((0, 0), |(streams, events), s| {
                (streams + 1, events + s.events.len())
            })
    }
}

/// One stream's submissions, in order; events never overlap.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamTrack {
    /// 0 for the legacy default stream, then 1, 2, ... in order of first use.
    pub id: i64,
    /// The process whose work it holds.
    pub pid: u32,
    /// What the stream is: its handle, or which default stream.
    pub label: String,
    /// Where its events' times come from.
    pub timing: StreamTiming,
    /// The work submitted, in order.
    pub events: Vec<Span>,
}

/// Where a stream's event times come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamTiming {
    /// Each event spans the driver call that submitted the work.
    #[default]
    HostObserved,
    /// The device's own start and end of the work (CUPTI activity).
    Device,
}

/// Which stream a submission went to, within one process and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum StreamKey {
    Legacy,
    PerThread(u32),
    Handle(u64),
}

#[derive(Clone, Debug)]
struct Symbol {
    /// Demangled where possible.
    name: Arc<str>,
    mangled: Option<Arc<str>>,
}

/// How a submission's device was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum OrdinalSource {
    Context,
    Thread,
    Unknown,
}

impl OrdinalSource {
    fn describe(self) -> &'static str {
        match self {
            OrdinalSource::Context => "context",
            OrdinalSource::Thread => "cuCtxGetDevice on the calling thread",
            OrdinalSource::Unknown => "unknown (context set before the capture); shown on GPU 0",
        }
    }
}

/// The CUDA part of a timeline.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CudaTimeline {
    /// Host spans by tid, with the thread's pid; they nest.
    pub spans: FxHashMap<u32, (u32, Vec<Span>)>,
    /// GPUs by ordinal, with the work submitted to them.
    pub devices: BTreeMap<u32, DeviceTrack>,
    /// Driver calls in the window.
    pub calls: u64,
}

impl CudaTimeline {
    /// Adds the spans to their threads and the GPUs to `timeline`.
    pub fn add_to(self, timeline: &mut super::Timeline) {
        for (tid, (pid, spans)) in self.spans {
            let track = timeline
                .threads
                .entry(tid)
                .or_insert_with(|| super::ThreadTrack {
                    tid,
                    pid,
                    name: format!("thread {tid}"),
                    slices: Vec::new(),
                    marks: Vec::new(),
                    spans: Vec::new(),
                    counters: super::ThreadCounters::default(),
                });
            // Moved, not copied, onto a thread with no spans yet.
            if track.spans.is_empty() {
                track.spans = spans;
            } else {
                track.spans.extend(spans);
            }
            track
                .spans
                .sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
        }
        timeline.devices.extend(self.devices);
        timeline.stats.records += self.calls;
    }
}

/// Builds a [`CudaTimeline`] from driver-call and kernel-name records fed in return-time order.
#[derive(Default)]
pub struct CudaTimelineBuilder {
    start_ns: u64,
    stop_ns: u64,
    /// `(pid, CUfunction or CUkernel)` → name.
    symbols: FxHashMap<(u32, u64), Symbol>,
    /// `(pid, CUdevice)` → ordinal, from `cuDeviceGet`.
    device_ordinals: FxHashMap<(u32, u64), u32>,
    /// `(pid, CUcontext)` → device ordinal.
    ctx_device: FxHashMap<(u32, u64), u32>,
    /// tid → context stack (last = current).
    thread_ctx: FxHashMap<u32, Vec<u64>>,
    /// tid → device of its current context, when only `cuCtxGetDevice` said.
    thread_device: FxHashMap<u32, u32>,
    /// `(pid, CUstream)` → context.
    stream_ctx: FxHashMap<(u32, u64), u64>,
    /// `(ordinal, pid, stream)` → line id and label.
    stream_ids: FxHashMap<(u32, u32, StreamKey), (i64, Arc<str>)>,
    /// Correlation ids given out so far (they are numbered from 1).
    correlations: u64,
    /// The texts of stats and span names, one copy each.
    texts: SharedTexts,
    /// Launch details by process, function handle and configuration.
    launch_details: FxHashMap<(u32, u64, LaunchConfig), LaunchDetails>,
    /// A launch's call's stats but its correlation, by its details, result,
    /// stream line and device; and its work's, by its details, stream
    /// line, function, thread, process and how its device was found. The
    /// details are kept with them: their address is in the key.
    call_groups: FxHashMap<(usize, u32, usize, u32), SharedGroup>,
    work_groups: FxHashMap<(usize, usize, u16, u32, u32, OrdinalSource), SharedGroup>,
    out: CudaTimeline,
}

/// Splits a word holding two `unsigned int` struct fields.
fn halves(word: u64) -> (u64, u64) {
    (word & 0xffff_ffff, word >> 32)
}

/// A name copied by the probe: up to the NUL, marked when cut short.
fn symbol_from(rec: &CudaSymbol) -> Option<Symbol> {
    let len = (rec.len as usize).min(rec.name.len());
    let bytes = &rec.name[..len];
    let bytes = &bytes[..bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len())];
    if bytes.is_empty() {
        return None;
    }
    let raw = String::from_utf8_lossy(bytes).into_owned();
    if rec.truncated != 0 {
        return Some(Symbol {
            name: format!("{raw}…").into(),
            mangled: Some(raw.into()),
        });
    }
    Some(symbol_named(raw))
}

/// A whole symbol name, demangled where it is mangled.
fn symbol_named(raw: String) -> Symbol {
    match demangle(&raw) {
        Some(name) => Symbol {
            name: name.into(),
            mangled: Some(raw.into()),
        },
        None => Symbol {
            name: raw.into(),
            mangled: None,
        },
    }
}

/// The function (or kernel) handle a launch call runs; `None` for the
/// other calls.
fn launched_function(rec: &CudaCall, function: &DriverFunction) -> Option<u64> {
    match function.op {
        Op::Launch => Some(rec.args[0]),
        Op::LaunchEx => Some(rec.args[1]),
        _ => None,
    }
}

/// The function handles that successful launches among `records` ran and
/// no symbol record among them names, by process: the kernels the
/// program looked up before the capture.
pub fn unnamed_kernels(records: impl IntoIterator<Item = Record>) -> BTreeMap<u32, BTreeSet<u64>> {
    let mut named = HashSet::new();
    let mut launched: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for r in records {
        match &r {
            Record::CudaSymbol(s) if symbol_from(s).is_some() => {
                named.insert((s.tgid, s.handle));
            }
            Record::CudaCall(c) if c.result == 0 => {
                if let Some(f) = cuda_api::function(c.function)
                    .and_then(|function| launched_function(c, function))
                {
                    launched.entry(c.tgid).or_default().insert(f);
                }
            }
            _ => {}
        }
    }
    for (pid, handles) in &mut launched {
        handles.retain(|h| *h != 0 && !named.contains(&(*pid, *h)));
    }
    launched.retain(|_, handles| !handles.is_empty());
    launched
}

/// Demangles an Itanium C++ name (`_Z...`); `None` for C names.
pub fn demangle(name: &str) -> Option<String> {
    if !name.starts_with("_Z") {
        return None;
    }
    cpp_demangle::Symbol::new(name).ok()?.demangle().ok()
}

fn copy_name(kind: &str) -> String {
    match kind {
        "HtoD" => "MemcpyH2D",
        "DtoH" => "MemcpyD2H",
        "DtoD" => "MemcpyD2D",
        "Peer" => "MemcpyP2P",
        _ => "Memcpy",
    }
    .to_string()
}

/// Direction of a 2D/3D copy from its `CUmemorytype`s.
fn struct_direction(src: u64, dst: u64) -> &'static str {
    let side = |t: u64| match t {
        1 => 'H',
        2 | 4 => 'D',
        3 => 'A',
        _ => '?',
    };
    match (side(src), side(dst)) {
        ('H', 'D') | ('H', 'A') => "HtoD",
        ('D', 'H') | ('A', 'H') => "DtoH",
        ('D', 'D') | ('D', 'A') | ('A', 'D') | ('A', 'A') => "DtoD",
        ('H', 'H') => "HtoH",
        _ => "unknown",
    }
}

/// What a call submitted to a stream.
struct Work {
    name: Arc<str>,
    stream: u64,
    stats: Stats,
}

/// Stats that spans share, and the launch details they were made from.
struct SharedGroup {
    _details: Arc<[Stat]>,
    stats: Arc<[Stat]>,
}

/// A launch's grid and block dimensions and dynamic shared memory bytes.
type LaunchConfig = ([u32; 3], [u32; 3], u64);

/// The stats every launch of one kernel with one configuration carries,
/// on its call and on its work, and the kernel's name they were made with.
struct LaunchDetails {
    name: Arc<str>,
    stats: Arc<[Stat]>,
}

impl CudaTimelineBuilder {
    /// `start_ns..stop_ns` is the capture window (monotonic ns).
    pub fn new(start_ns: u64, stop_ns: u64) -> Self {
        CudaTimelineBuilder {
            start_ns,
            stop_ns,
            ..Default::default()
        }
    }

    /// Names kernels as the driver inside their process named them
    /// (by `(pid, handle)`), where no symbol record of the capture does.
    pub fn add_driver_names(&mut self, names: &HashMap<(u32, u64), String>) {
        for (&key, raw) in names {
            self.symbols
                .entry(key)
                .or_insert_with(|| symbol_named(raw.clone()));
        }
    }

    /// Notes the kernel name a `cuModuleGetFunction` or `cuLibraryGetKernel` lookup gave its
    /// handle.
    pub fn push_symbol(&mut self, rec: &CudaSymbol) {
        if let Some(symbol) = symbol_from(rec) {
            self.symbols.insert((rec.tgid, rec.handle), symbol);
        }
    }

    fn current_ctx(&self, tid: u32) -> Option<u64> {
        self.thread_ctx.get(&tid).and_then(|s| s.last().copied())
    }

    fn ordinal_of_device(&self, pid: u32, device: u64) -> u32 {
        // A CUdevice is its ordinal in every driver so far; cuDeviceGet confirms.
        self.device_ordinals
            .get(&(pid, device))
            .copied()
            .unwrap_or(device as u32)
    }

    fn kernel_name(&mut self, pid: u32, handle: u64) -> (Arc<str>, Option<Arc<str>>) {
        match self.symbols.get(&(pid, handle)) {
            Some(s) => (Arc::clone(&s.name), s.mangled.clone()),
            None => (
                self.texts.format(format_args!("<unresolved {handle:#x}>")),
                None,
            ),
        }
    }

    fn hex(&mut self, v: u64) -> Value {
        self.texts.hex(v)
    }

    fn dims(&mut self, [x, y, z]: [u32; 3]) -> Value {
        Value::Str(self.texts.format(format_args!("{x},{y},{z}")))
    }

    /// The stats of a launch of `f` with `config` in process `pid`, shared
    /// with the launches before it of the same (made again when the
    /// kernel's name changed since), and the kernel's name.
    fn launch_details(
        &mut self,
        pid: u32,
        f: u64,
        config: LaunchConfig,
    ) -> (Arc<str>, Arc<[Stat]>) {
        let (name, mangled) = self.kernel_name(pid, f);
        if let Some(d) = self.launch_details.get(&(pid, f, config))
            && Arc::ptr_eq(&d.name, &name)
        {
            return (Arc::clone(&d.name), Arc::clone(&d.stats));
        }
        let (grid, block, shared) = config;
        let mut stats = Vec::with_capacity(6);
        stats.extend([
            ("kernel".into(), Value::Str(Arc::clone(&name))),
            ("grid".into(), self.dims(grid)),
            ("block".into(), self.dims(block)),
            ("shared_memory_bytes".into(), Value::U64(shared)),
        ]);
        if let Some(m) = mangled {
            stats.push(("mangled_name".into(), Value::Str(m)));
        }
        stats.push(("function_handle".into(), self.hex(f)));
        let stats: Arc<[Stat]> = stats.into();
        let details = LaunchDetails {
            name: Arc::clone(&name),
            stats: Arc::clone(&stats),
        };
        self.launch_details.insert((pid, f, config), details);
        (name, stats)
    }

    /// The device of work on `stream` submitted by `tid`.
    fn ordinal(&self, pid: u32, tid: u32, stream: u64) -> (u32, OrdinalSource) {
        let ctx = match stream {
            0 | STREAM_LEGACY | STREAM_PER_THREAD => self.current_ctx(tid),
            s => self
                .stream_ctx
                .get(&(pid, s))
                .copied()
                .or_else(|| self.current_ctx(tid)),
        };
        if let Some(ordinal) = ctx.and_then(|c| self.ctx_device.get(&(pid, c))) {
            return (*ordinal, OrdinalSource::Context);
        }
        if let Some(ordinal) = self.thread_device.get(&tid) {
            return (*ordinal, OrdinalSource::Thread);
        }
        (0, OrdinalSource::Unknown)
    }

    /// Updates what is known about contexts, streams and names.
    fn learn(&mut self, rec: &CudaCall, function: &DriverFunction) {
        let (pid, tid, a, out) = (rec.tgid, rec.tid, rec.args, rec.out_value);
        match function.op {
            Op::DeviceGet => {
                self.device_ordinals
                    .insert((pid, out & 0xffff_ffff), a[1] as u32);
            }
            Op::CtxCreate { device } => {
                let ordinal = self.ordinal_of_device(pid, a[device] & 0xffff_ffff);
                self.ctx_device.insert((pid, out), ordinal);
                self.thread_ctx.entry(tid).or_default().push(out);
            }
            Op::PrimaryCtxRetain => {
                let ordinal = self.ordinal_of_device(pid, a[1] & 0xffff_ffff);
                self.ctx_device.insert((pid, out), ordinal);
            }
            Op::CtxSetCurrent => {
                let stack = self.thread_ctx.entry(tid).or_default();
                stack.pop();
                if a[0] != 0 {
                    stack.push(a[0]);
                }
                self.thread_device.remove(&tid);
            }
            Op::CtxPushCurrent => {
                self.thread_ctx.entry(tid).or_default().push(a[0]);
                self.thread_device.remove(&tid);
            }
            Op::CtxPopCurrent => {
                self.thread_ctx.entry(tid).or_default().pop();
                self.thread_device.remove(&tid);
            }
            Op::CtxGetCurrent => {
                let stack = self.thread_ctx.entry(tid).or_default();
                if stack.last() != Some(&out) {
                    stack.pop();
                    if out != 0 {
                        stack.push(out);
                    }
                }
            }
            Op::CtxGetDevice => {
                let ordinal = self.ordinal_of_device(pid, out & 0xffff_ffff);
                match self.current_ctx(tid) {
                    Some(ctx) => {
                        self.ctx_device.insert((pid, ctx), ordinal);
                    }
                    None => {
                        self.thread_device.insert(tid, ordinal);
                    }
                }
            }
            Op::CtxDestroy => {
                self.ctx_device.remove(&(pid, a[0]));
            }
            Op::StreamCreate => {
                if let Some(ctx) = self.current_ctx(tid) {
                    self.stream_ctx.insert((pid, out), ctx);
                }
            }
            Op::StreamGetCtx => {
                self.stream_ctx.insert((pid, a[0]), out);
            }
            Op::StreamDestroy => {
                self.stream_ctx.remove(&(pid, a[0]));
            }
            Op::KernelGetFunction => {
                if let Some(symbol) = self.symbols.get(&(pid, a[1])).cloned() {
                    self.symbols.insert((pid, out), symbol);
                }
            }
            _ => {}
        }
    }

    /// The call's own stats, and the work it submitted to a stream if any.
    fn describe(&mut self, rec: &CudaCall, function: &DriverFunction) -> (Stats, Option<Work>) {
        let (pid, a, x, out) = (rec.tgid, rec.args, rec.extra, rec.out_value);
        let mut stats: Vec<(StatName, Value)> = Vec::new();
        let dims = |x: u64, y: u64, z: u64| [x as u32, y as u32, z as u32];
        let work = match function.op {
            Op::Launch | Op::LaunchEx => {
                let f = launched_function(rec, function).unwrap_or(0);
                let (config, stream) = if function.op == Op::Launch {
                    let config = (
                        dims(a[1], a[2], a[3]),
                        dims(a[4], a[5], x[0]),
                        x[1] & 0xffff_ffff,
                    );
                    (config, x[2])
                } else {
                    let (gx, gy) = halves(x[0]);
                    let (gz, bx) = halves(x[1]);
                    let (by, bz) = halves(x[2]);
                    let config = (dims(gx, gy, gz), dims(bx, by, bz), halves(x[3]).0);
                    (config, x[4])
                };
                // The call's and the work's stats are made from these
                // details in `push_call`.
                let (name, details) = self.launch_details(pid, f, config);
                let call = Stats::shared_then(Arc::clone(&details), Vec::new());
                let work = Work {
                    name,
                    stream,
                    stats: Stats::shared_then(details, Vec::new()),
                };
                return (call, Some(work));
            }
            Op::GraphLaunch => {
                put(&mut stats, "graph_exec", self.hex(a[0]));
                Some(Work {
                    name: self.texts.get("Graph launch"),
                    stream: a[1],
                    stats: vec![("graph_exec".into(), self.hex(a[0]))].into(),
                })
            }
            Op::Memcpy {
                kind,
                bytes,
                stream,
            } => {
                let direction = match kind {
                    CopyKind::HtoD => "HtoD",
                    CopyKind::DtoH => "DtoH",
                    CopyKind::DtoD => "DtoD",
                    CopyKind::Peer => "Peer",
                    CopyKind::Inferred | CopyKind::FromStruct => "inferred by the driver",
                };
                let (dst, src) = match kind {
                    CopyKind::Peer => (a[0], a[2]),
                    _ => (a[0], a[1]),
                };
                let details = vec![
                    ("bytes".into(), Value::U64(a[bytes])),
                    ("direction".into(), self.texts.value(direction)),
                    ("async".into(), Value::I64(i64::from(stream.is_some()))),
                    ("dst".into(), self.hex(dst)),
                    ("src".into(), self.hex(src)),
                ];
                stats.extend(details.iter().cloned());
                Some(Work {
                    name: self.texts.get(&copy_name(direction)),
                    stream: stream.map_or(0, |i| a[i]),
                    stats: details.into(),
                })
            }
            Op::MemcpyStruct { three_d, stream } => {
                let (depth, width, height) = if three_d {
                    (x[6], x[4], x[5])
                } else {
                    (1, x[4], x[5])
                };
                let direction = struct_direction(x[0], x[2]);
                let details = vec![
                    (
                        "bytes".into(),
                        Value::U64(width.saturating_mul(height).saturating_mul(depth)),
                    ),
                    ("direction".into(), self.texts.value(direction)),
                    ("async".into(), Value::I64(i64::from(stream.is_some()))),
                    ("width_bytes".into(), Value::U64(width)),
                    ("height".into(), Value::U64(height)),
                    ("depth".into(), Value::U64(depth)),
                ];
                stats.extend(details.iter().cloned());
                Some(Work {
                    name: self.texts.get(&copy_name(direction)),
                    stream: stream.map_or(0, |i| a[i]),
                    stats: details.into(),
                })
            }
            Op::Memset {
                element_bytes,
                extent,
                stream,
            } => {
                let elements = match extent {
                    MemsetExtent::Linear => a[2],
                    MemsetExtent::Pitched => a[3].saturating_mul(a[4]),
                };
                let details = vec![
                    (
                        "bytes".into(),
                        Value::U64(elements.saturating_mul(element_bytes)),
                    ),
                    ("element_bytes".into(), Value::U64(element_bytes)),
                    ("async".into(), Value::I64(i64::from(stream.is_some()))),
                    ("dst".into(), self.hex(a[0])),
                ];
                stats.extend(details.iter().cloned());
                Some(Work {
                    name: self.texts.get("Memset"),
                    stream: stream.map_or(0, |i| a[i]),
                    stats: details.into(),
                })
            }
            Op::Alloc { memory, stream } => {
                let bytes = match memory {
                    Memory::DevicePitched => a[2].saturating_mul(a[3]),
                    _ => a[1],
                };
                put(&mut stats, "bytes", Value::U64(bytes));
                put(&mut stats, "memory", self.texts.value(memory_name(memory)));
                if rec.result == 0 {
                    put(&mut stats, "address", self.hex(out));
                }
                if let Some(i) = stream {
                    put(&mut stats, "stream", self.stream_value(a[i], function));
                }
                None
            }
            Op::Free { memory, stream } => {
                put(&mut stats, "address", self.hex(a[0]));
                put(&mut stats, "memory", self.texts.value(memory_name(memory)));
                if let Some(i) = stream {
                    put(&mut stats, "stream", self.stream_value(a[i], function));
                }
                None
            }
            Op::StreamSynchronize => {
                put(&mut stats, "stream", self.stream_value(a[0], function));
                None
            }
            Op::EventSynchronize => {
                put(&mut stats, "event", self.hex(a[0]));
                None
            }
            Op::StreamWaitEvent => {
                put(&mut stats, "event", self.hex(a[1]));
                Some(Work {
                    name: self.texts.get("StreamWaitEvent"),
                    stream: a[0],
                    stats: vec![("event".into(), self.hex(a[1]))].into(),
                })
            }
            Op::CtxSynchronize => None,
            Op::DeviceGet => {
                put(&mut stats, "ordinal", Value::I64(i64::from(a[1] as i32)));
                None
            }
            Op::CtxCreate { device } => {
                put(
                    &mut stats,
                    "device",
                    Value::I64(i64::from(a[device] as i32)),
                );
                put(&mut stats, "context", self.hex(out));
                None
            }
            Op::PrimaryCtxRetain => {
                put(&mut stats, "device", Value::I64(i64::from(a[1] as i32)));
                put(&mut stats, "context", self.hex(out));
                None
            }
            Op::CtxSetCurrent | Op::CtxPushCurrent | Op::CtxDestroy => {
                put(&mut stats, "context", self.hex(a[0]));
                None
            }
            Op::CtxPopCurrent | Op::CtxGetCurrent => {
                put(&mut stats, "context", self.hex(out));
                None
            }
            Op::CtxGetDevice => {
                put(&mut stats, "device", Value::I64(i64::from(out as i32)));
                None
            }
            Op::StreamCreate => {
                put(&mut stats, "stream", self.hex(out));
                None
            }
            Op::StreamGetCtx => {
                put(&mut stats, "stream", self.hex(a[0]));
                put(&mut stats, "context", self.hex(out));
                None
            }
            Op::StreamDestroy => {
                put(&mut stats, "stream", self.hex(a[0]));
                None
            }
            Op::GetFunction => {
                if rec.result == 0 {
                    let (name, _) = self.kernel_name(pid, out);
                    put(&mut stats, "kernel", Value::Str(name));
                    put(&mut stats, "handle", self.hex(out));
                }
                None
            }
            Op::KernelGetFunction => {
                let (name, _) = self.kernel_name(pid, a[1]);
                put(&mut stats, "kernel", Value::Str(name));
                put(&mut stats, "kernel_handle", self.hex(a[1]));
                put(&mut stats, "function_handle", self.hex(out));
                None
            }
        };
        (stats.into(), work)
    }

    /// A stream argument in words: a handle, or which default stream.
    fn stream_value(&mut self, stream: u64, function: &DriverFunction) -> Value {
        let text = match stream {
            0 if function.per_thread_stream() => self.texts.get("per-thread default"),
            0 | STREAM_LEGACY => self.texts.get("legacy default"),
            STREAM_PER_THREAD => self.texts.get("per-thread default"),
            h => self.texts.format(format_args!("{h:#x}")),
        };
        Value::Str(text)
    }

    /// Feeds one driver call (records in return-time order).
    pub fn push_call(&mut self, rec: &CudaCall) {
        let Some(function) = cuda_api::function(rec.function) else {
            return;
        };
        let ok = rec.result == 0;
        if ok {
            self.learn(rec, function);
        }
        let end = rec.header.ts_ns;
        if end < self.start_ns || rec.start_ns > self.stop_ns {
            return;
        }
        let (start, end) = (
            rec.start_ns.max(self.start_ns),
            end.min(self.stop_ns).max(rec.start_ns.max(self.start_ns)),
        );
        self.out.calls += 1;
        let (stats, work) = self.describe(rec, function);
        // A launch's details are shared: so are the stats its call and its
        // work have in common with others; their correlation is their own.
        // Those stats are made only for a new group.
        let details = stats.shared().cloned();
        let mut work_line = None;
        let mut correlation = None;
        if let Some(work) = work.filter(|_| ok) {
            self.correlations += 1;
            correlation = NonZeroU64::new(self.correlations);
            let (ordinal, source) = self.ordinal(rec.tgid, rec.tid, work.stream);
            let key = match work.stream {
                0 if function.per_thread_stream() => StreamKey::PerThread(rec.tid),
                0 | STREAM_LEGACY => StreamKey::Legacy,
                STREAM_PER_THREAD => StreamKey::PerThread(rec.tid),
                h => StreamKey::Handle(h),
            };
            let (line, label) = self.stream_line(ordinal, rec.tgid, key, work.stream);
            let work_tail = |texts: &mut SharedTexts| {
                vec![
                    ("stream".into(), Value::Str(Arc::clone(&label))),
                    ("submitted_by".into(), texts.value(function.name)),
                    ("tid".into(), Value::I64(i64::from(rec.tid))),
                    ("pid".into(), Value::I64(i64::from(rec.tgid))),
                    (
                        "device_ordinal_source".into(),
                        texts.value(source.describe()),
                    ),
                ]
            };
            let device_stats = match &details {
                Some(details) => {
                    let key = (
                        details_key(details),
                        text_key(&label),
                        rec.function,
                        rec.tid,
                        rec.tgid,
                        source,
                    );
                    let group = shared_group(&mut self.work_groups, key, details, || {
                        work_tail(&mut self.texts)
                    });
                    Stats::shared_then(group, Vec::new())
                }
                None => {
                    let mut stats = work.stats;
                    stats.reserve_exact(5);
                    stats.extend(work_tail(&mut self.texts));
                    stats
                }
            };
            self.out
                .devices
                .get_mut(&ordinal)
                .and_then(|d| d.streams.get_mut(&line))
                .expect("stream_line created the line")
                .events
                .push(Span {
                    start_ns: start,
                    end_ns: end,
                    name: work.name,
                    stats: device_stats,
                    correlation,
                });
            work_line = Some((label, ordinal));
        }
        let entry_only = rec.flags & flags::ENTRY_ONLY != 0;
        let call_tail = |texts: &mut SharedTexts| {
            let mut tail = Vec::with_capacity(4);
            if entry_only {
                tail.push(("result".into(), texts.value(ENTRY_ONLY_RESULT)));
            } else {
                let result = match cuda_api::result_name(rec.result) {
                    Some(name) => texts.get(name),
                    None => texts.format(format_args!("CUresult {}", rec.result)),
                };
                tail.extend([
                    (
                        "result_code".into(),
                        Value::I64(i64::from(rec.result as i32)),
                    ),
                    ("result".into(), Value::Str(result)),
                ]);
            }
            if let Some((label, ordinal)) = &work_line {
                tail.extend([
                    ("stream".into(), Value::Str(Arc::clone(label))),
                    ("device_ordinal".into(), Value::I64(i64::from(*ordinal))),
                ]);
            }
            tail
        };
        let stats = match &details {
            Some(details) => {
                let (line, ordinal) = work_line
                    .as_ref()
                    .map_or((0, u32::MAX), |(label, o)| (text_key(label), *o));
                // An entry-only call's result is not known: not a success.
                let result = if entry_only { u32::MAX } else { rec.result };
                let key = (details_key(details), result, line, ordinal);
                let group = shared_group(&mut self.call_groups, key, details, || {
                    call_tail(&mut self.texts)
                });
                Stats::shared_then(group, Vec::new())
            }
            None => {
                let mut stats = stats;
                // Exactly: a flight recorder's snapshot holds many thousands of calls.
                stats.reserve_exact(4);
                stats.extend(call_tail(&mut self.texts));
                stats
            }
        };
        let name = self.texts.get(function.name);
        self.out
            .spans
            .entry(rec.tid)
            .or_insert_with(|| (rec.tgid, Vec::new()))
            .1
            .push(Span {
                start_ns: start,
                end_ns: end,
                name,
                stats,
                correlation,
            });
    }

    /// The line of a stream on a device (created on first use): its id and label.
    fn stream_line(
        &mut self,
        ordinal: u32,
        pid: u32,
        key: StreamKey,
        handle: u64,
    ) -> (i64, Arc<str>) {
        if let Some((id, label)) = self.stream_ids.get(&(ordinal, pid, key)) {
            return (*id, Arc::clone(label));
        }
        let device = self
            .out
            .devices
            .entry(ordinal)
            .or_insert_with(|| DeviceTrack {
                ordinal,
                streams: BTreeMap::new(),
            });
        let next = device.streams.keys().max().map_or(1, |m| m + 1).max(1);
        // Line 0 is the first process's legacy stream; another process's
        // legacy stream on the same device is a stream of its own.
        let id = match key {
            StreamKey::Legacy if !device.streams.contains_key(&0) => 0,
            _ => next,
        };
        let label = match key {
            StreamKey::Legacy => format!("legacy default stream of pid {pid}"),
            StreamKey::PerThread(tid) => format!("per-thread default stream of tid {tid}"),
            StreamKey::Handle(_) => format!("{handle:#x}"),
        };
        device.streams.entry(id).or_insert_with(|| StreamTrack {
            id,
            pid,
            label: label.clone(),
            timing: StreamTiming::HostObserved,
            events: Vec::new(),
        });
        let label: Arc<str> = label.into();
        self.stream_ids
            .insert((ordinal, pid, key), (id, Arc::clone(&label)));
        (id, label)
    }

    /// Host spans nest, device events follow each other on their stream.
    pub fn finish(mut self) -> CudaTimeline {
        for (_, spans) in self.out.spans.values_mut() {
            nest(spans, Cuts::Silent);
        }
        for device in self.out.devices.values_mut() {
            for stream in device.streams.values_mut() {
                serialize(&mut stream.events);
            }
        }
        self.out
    }
}

/// A key part that tells launch details apart while they are alive.
fn details_key(details: &Arc<[Stat]>) -> usize {
    Arc::as_ptr(details).cast::<u8>() as usize
}

/// A key part that tells shared texts apart while they are alive (a
/// stream's label lives as long as the builder).
fn text_key(text: &Arc<str>) -> usize {
    Arc::as_ptr(text).cast::<u8>() as usize
}

/// `details` then what `more` makes (only for a new group), shared by the
/// spans whose `key` is the same.
fn shared_group<K: std::hash::Hash + Eq>(
    groups: &mut FxHashMap<K, SharedGroup>,
    key: K,
    details: &Arc<[Stat]>,
    more: impl FnOnce() -> Vec<Stat>,
) -> Arc<[Stat]> {
    let group = groups.entry(key).or_insert_with(|| SharedGroup {
        _details: Arc::clone(details),
        stats: details
            .iter()
            .cloned()
            .chain(more())
            .collect::<Vec<_>>()
            .into(),
    });
    Arc::clone(&group.stats)
}

fn put(stats: &mut Vec<(StatName, Value)>, name: &'static str, value: Value) {
    stats.push((name.into(), value));
}

fn memory_name(memory: Memory) -> &'static str {
    match memory {
        Memory::Device => "device",
        Memory::DevicePitched => "device (pitched)",
        Memory::Managed => "managed",
        Memory::Host => "page-locked host",
    }
}

/// Work on one stream runs in submission order: an event that starts
/// before the previous one ends is moved to start at that end.
fn serialize(events: &mut [Span]) {
    events.sort_by_key(|e| (e.start_ns, e.end_ns));
    let mut last_end = 0;
    for e in events.iter_mut() {
        e.start_ns = e.start_ns.max(last_end);
        e.end_ns = e.end_ns.max(e.start_ns);
        last_end = e.end_ns;
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind, cuda::CUDA_NAME_LEN};

    use super::*;

    const PID: u32 = 50;

    fn id(name: &str) -> u16 {
        cuda_api::function_id(name).unwrap_or_else(|| panic!("{name} not in the table"))
    }

    fn call(
        name: &str,
        tid: u32,
        t: (u64, u64),
        args: &[u64],
        extra: &[u64],
        out: u64,
    ) -> CudaCall {
        let mut a = [0; 6];
        a[..args.len()].copy_from_slice(args);
        let mut x = [0; 8];
        x[..extra.len()].copy_from_slice(extra);
        CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, 160, 0, t.1),
            tid,
            tgid: PID,
            start_ns: t.0,
            function: id(name),
            flags: 0,
            result: 0,
            args: a,
            extra: x,
            out_value: out,
        }
    }

    fn symbol(handle: u64, name: &str) -> CudaSymbol {
        let mut rec = CudaSymbol {
            header: RecordHeader::new(RecordKind::CudaSymbol, 40 + CUDA_NAME_LEN, 0, 0),
            tid: 1,
            tgid: PID,
            handle,
            len: name.len() as u32 + 1,
            truncated: 0,
            name: [0; CUDA_NAME_LEN],
        };
        rec.name[..name.len()].copy_from_slice(name.as_bytes());
        rec
    }

    fn stat<'a>(span: &'a Span, name: &str) -> &'a Value {
        span.stats
            .get(name)
            .unwrap_or_else(|| panic!("no stat {name} in {span:?}"))
    }

    #[test]
    fn launch_on_a_created_stream_of_device_1() {
        let mut b = CudaTimelineBuilder::new(100, 10_000);
        b.push_call(&call("cuDeviceGet", 7, (100, 110), &[0, 1], &[], 1));
        b.push_call(&call(
            "cuCtxCreate_v2",
            7,
            (120, 130),
            &[0, 0, 1],
            &[],
            0xc1,
        ));
        b.push_call(&call("cuStreamCreate", 7, (140, 150), &[0, 0], &[], 0x5a));
        b.push_symbol(&symbol(0xf00, "_Z6vecAddPKfS0_Pfi"));
        b.push_call(&call(
            "cuLaunchKernel",
            7,
            (200, 260),
            &[0xf00, 16, 2, 1, 256, 1],
            &[1, 48, 0x5a],
            0,
        ));
        let tl = b.finish();
        let spans = &tl.spans[&7].1;
        let launch = spans.iter().find(|s| &*s.name == "cuLaunchKernel").unwrap();
        assert_eq!(
            stat(launch, "kernel"),
            &Value::Str("vecAdd(float const*, float const*, float*, int)".into())
        );
        assert_eq!(stat(launch, "grid"), &Value::Str("16,2,1".into()));
        assert_eq!(stat(launch, "block"), &Value::Str("256,1,1".into()));
        assert_eq!(stat(launch, "shared_memory_bytes"), &Value::U64(48));
        assert_eq!(launch.correlation, NonZeroU64::new(1));
        let gpu1 = &tl.devices[&1];
        let line = &gpu1.streams[&1];
        assert_eq!(line.label, "0x5a");
        assert_eq!(line.events.len(), 1);
        assert_eq!((line.events[0].start_ns, line.events[0].end_ns), (200, 260));
        assert_eq!(line.events[0].correlation, NonZeroU64::new(1));
        assert_eq!(
            stat(&line.events[0], "device_ordinal_source"),
            &Value::Str("context".into())
        );
        assert_eq!(tl.calls, 5 - 1);
    }

    #[test]
    fn unknown_handles_and_failed_launches_are_honest() {
        let mut b = CudaTimelineBuilder::new(0, 10_000);
        let mut failed = call(
            "cuLaunchKernel_ptsz",
            3,
            (10, 20),
            &[0xabc, 0, 1, 1, 1, 1],
            &[1, 0, 0],
            0,
        );
        failed.result = 1;
        b.push_call(&failed);
        b.push_call(&call(
            "cuLaunchKernel_ptsz",
            3,
            (30, 40),
            &[0xabc, 1, 1, 1, 1, 1],
            &[1, 0, 0],
            0,
        ));
        let tl = b.finish();
        let spans = &tl.spans[&3].1;
        assert_eq!(
            stat(&spans[0], "result"),
            &Value::Str("CUDA_ERROR_INVALID_VALUE".into())
        );
        assert_eq!(
            stat(&spans[0], "kernel"),
            &Value::Str("<unresolved 0xabc>".into())
        );
        assert_eq!(spans[0].correlation, None);
        // Only the successful launch reached the GPU: the per-thread stream of tid 3.
        let gpu0 = &tl.devices[&0];
        assert_eq!(gpu0.streams.len(), 1);
        let line = gpu0.streams.values().next().unwrap();
        assert_eq!(line.label, "per-thread default stream of tid 3");
        assert_eq!(line.events.len(), 1);
        assert_eq!(
            stat(&line.events[0], "device_ordinal_source"),
            &Value::Str(OrdinalSource::Unknown.describe().into())
        );
    }

    #[test]
    fn launch_config_and_memcpy_struct_words_decode() {
        let mut b = CudaTimelineBuilder::new(0, 10_000);
        b.push_call(&call(
            "cuLaunchKernelEx",
            4,
            (1, 2),
            &[0x7000, 0xf1],
            &[8 | 2 << 32, 1 | 128 << 32, 1 | 1 << 32, 1024, 0x77],
            0,
        ));
        b.push_call(&call(
            "cuMemcpy2DAsync_v2",
            4,
            (3, 4),
            &[0x7100, 0x77],
            &[1, 0, 2, 0xd0, 64, 3],
            0,
        ));
        let tl = b.finish();
        let spans = &tl.spans[&4].1;
        assert_eq!(stat(&spans[0], "grid"), &Value::Str("8,2,1".into()));
        assert_eq!(stat(&spans[0], "block"), &Value::Str("128,1,1".into()));
        assert_eq!(stat(&spans[0], "shared_memory_bytes"), &Value::U64(1024));
        assert_eq!(stat(&spans[1], "bytes"), &Value::U64(192));
        assert_eq!(stat(&spans[1], "direction"), &Value::Str("HtoD".into()));
        let line = &tl.devices[&0].streams[&1];
        let names: Vec<&str> = line.events.iter().map(|e| &*e.name).collect();
        assert_eq!(names, ["<unresolved 0xf1>", "MemcpyH2D"]);
    }

    #[test]
    fn legacy_streams_of_two_processes_get_two_lines() {
        let mut b = CudaTimelineBuilder::new(0, 100);
        let mut other = call("cuMemsetD32_v2", 9, (3, 4), &[0xd0, 0, 16], &[], 0);
        other.tgid = PID + 1;
        b.push_call(&call("cuMemsetD32_v2", 8, (1, 2), &[0xd0, 0, 16], &[], 0));
        b.push_call(&other);
        let tl = b.finish();
        let labels: Vec<(i64, &str)> = tl.devices[&0]
            .streams
            .values()
            .map(|s| (s.id, s.label.as_str()))
            .collect();
        assert_eq!(
            labels,
            [
                (0, "legacy default stream of pid 50"),
                (1, "legacy default stream of pid 51")
            ]
        );
    }

    #[test]
    fn kernel_names_carry_over_to_functions_and_get_cut_marks() {
        let mut b = CudaTimelineBuilder::new(0, 100);
        b.push_symbol(&symbol(0x10, "plain_c_kernel"));
        b.push_call(&call(
            "cuKernelGetFunction",
            1,
            (1, 2),
            &[0, 0x10],
            &[],
            0x20,
        ));
        let mut cut = symbol(0x30, "_Z3fooi");
        cut.truncated = 1;
        b.push_symbol(&cut);
        assert_eq!(&*b.kernel_name(PID, 0x20).0, "plain_c_kernel");
        assert_eq!(&*b.kernel_name(PID, 0x30).0, "_Z3fooi…");
    }

    #[test]
    fn overlapping_work_on_a_stream_is_made_to_follow() {
        let work = |start_ns, end_ns, name: &str| Span {
            start_ns,
            end_ns,
            name: name.into(),
            stats: Stats::default(),
            correlation: None,
        };
        let mut events = vec![work(20, 50, "b"), work(10, 50, "a"), work(60, 70, "c")];
        serialize(&mut events);
        let got: Vec<(&str, u64, u64)> = events
            .iter()
            .map(|e| (&*e.name, e.start_ns, e.end_ns))
            .collect();
        assert_eq!(got, vec![("a", 10, 50), ("b", 50, 50), ("c", 60, 70)]);
    }

    /// A driver call as a hostile (or buggy) process may make it: any
    /// function, any arguments, any result, times around the window.
    fn any_call() -> impl proptest::strategy::Strategy<Value = CudaCall> {
        use proptest::prelude::*;
        let small = prop_oneof![0u64..4, any::<u64>()];
        (
            (1u32..4, 0u64..12_000, 0u64..3_000),
            0..cuda_api::FUNCTIONS.len() as u16 + 2,
            prop_oneof![Just(0u32), any::<u32>()],
            proptest::array::uniform6(small.clone()),
            proptest::array::uniform8(small.clone()),
            small,
        )
            .prop_map(
                |((tid, start, len), function, result, args, extra, out)| CudaCall {
                    header: RecordHeader::new(RecordKind::CudaCall, 160, 0, start + len),
                    tid,
                    tgid: PID,
                    start_ns: start,
                    function,
                    flags: 0,
                    result,
                    args,
                    extra,
                    out_value: out,
                },
            )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Whatever calls the target makes, host spans nest, each stream's
        /// work follows itself, and the window keeps everything inside it.
        #[test]
        fn any_calls_make_a_well_formed_timeline(
            mut calls in proptest::collection::vec(any_call(), 0..60),
        ) {
            calls.sort_by_key(|c| c.header.ts_ns);
            let mut b = CudaTimelineBuilder::new(1_000, 10_000);
            for c in &calls {
                b.push_call(c);
            }
            let cuda = b.finish();
            for (_, spans) in cuda.spans.values() {
                for (i, a) in spans.iter().enumerate() {
                    for x in &spans[i + 1..] {
                        let apart = a.end_ns <= x.start_ns || x.end_ns <= a.start_ns;
                        let nested = (a.start_ns <= x.start_ns && x.end_ns <= a.end_ns)
                            || (x.start_ns <= a.start_ns && a.end_ns <= x.end_ns);
                        proptest::prop_assert!(apart || nested, "{a:?} / {x:?}");
                    }
                }
            }
            for stream in cuda.devices.values().flat_map(|d| d.streams.values()) {
                proptest::prop_assert!(stream.events.windows(2).all(|w| w[0].end_ns <= w[1].start_ns));
                proptest::prop_assert!(stream.events.iter().all(|e| e.start_ns <= e.end_ns));
            }
            let mut tl = crate::timeline::Timeline {
                start_ns: 1_000,
                stop_ns: 10_000,
                clock: crate::clock::ClockSync::from_offset(0),
                processes: BTreeMap::new(),
                threads: BTreeMap::new(),
                peers: Vec::new(),
                devices: BTreeMap::new(),
                carried_planes: Vec::new(),
                stats: Default::default(),
            };
            cuda.add_to(&mut tl);
            crate::timeline::Window::between(1_000, 10_000).apply(&mut tl);
            for e in tl.device_events() {
                proptest::prop_assert!(1_000 <= e.start_ns && e.end_ns <= 10_000);
            }
        }
    }
}
