//! What a decoded driver call shows: the stats of its span, and the work
//! it submitted to a stream with that work's name and stats. Every launch
//! of one kernel with one configuration shares one copy of its details.

use std::sync::Arc;

use tracer_common::cuda::CudaCall;

use super::CudaTimelineBuilder;
use crate::{
    cuda_api::{
        CallArgs, CopyKind, KernelLaunch, LaunchConfig, LinearCopy, Memory, MemoryType, Memset,
        Stream, StructCopy,
    },
    timeline::{Stat, StatName, Stats, Value},
};

/// What a call submitted to a stream.
pub(super) struct Work {
    /// The event's name.
    pub(super) name: Arc<str>,
    /// The stream it went to.
    pub(super) stream: Stream,
    /// The event's stats, before those of its line and submitter.
    pub(super) stats: Stats,
}

/// The stats every launch of one kernel with one configuration carries,
/// on its call and on its work, and the kernel's name they were made with.
pub(super) struct LaunchDetails {
    name: Arc<str>,
    stats: Arc<[Stat]>,
}

/// Whether a successful call with `args` submits work, which
/// `CudaTimelineBuilder::describe` gives its work.
pub(super) fn submits_work(args: &CallArgs) -> bool {
    matches!(
        args,
        CallArgs::Launch(_)
            | CallArgs::GraphLaunch { .. }
            | CallArgs::Memcpy(_)
            | CallArgs::MemcpyStruct(_)
            | CallArgs::Memset(_)
            | CallArgs::StreamWaitEvent { .. }
    )
}

impl CudaTimelineBuilder {
    /// The call's own stats, and the work it submitted to a stream if any.
    pub(super) fn describe(&mut self, rec: &CudaCall, args: &CallArgs) -> (Stats, Option<Work>) {
        match *args {
            CallArgs::Launch(launch) => self.describe_launch(rec.tgid, launch),
            CallArgs::GraphLaunch { graph_exec, stream } => {
                let details = vec![("graph_exec".into(), self.hex(graph_exec))];
                self.with_work(details, "Graph launch", stream)
            }
            CallArgs::Memcpy(copy) => self.describe_copy(copy),
            CallArgs::MemcpyStruct(copy) => self.describe_struct_copy(copy),
            CallArgs::Memset(memset) => self.describe_memset(memset),
            CallArgs::StreamWaitEvent { stream, event } => {
                let details = vec![("event".into(), self.hex(event))];
                self.with_work(details, "StreamWaitEvent", stream)
            }
            _ => (self.call_stats(rec, args).into(), None),
        }
    }

    /// A call whose work has `details` as its stats, as the call has:
    /// work named `name` on `stream`.
    fn with_work(
        &mut self,
        details: Vec<Stat>,
        name: &str,
        stream: Stream,
    ) -> (Stats, Option<Work>) {
        let work = Work {
            name: self.texts.get(name),
            stream,
            stats: details.clone().into(),
        };
        (details.into(), Some(work))
    }

    fn describe_launch(&mut self, pid: u32, launch: KernelLaunch) -> (Stats, Option<Work>) {
        // The call's and the work's stats are made from these details in
        // `push_call`.
        let (name, details) = self.launch_details(pid, launch.function, launch.config);
        let call = Stats::shared_then(Arc::clone(&details), Vec::new());
        let work = Work {
            name,
            stream: launch.stream,
            stats: Stats::shared_then(details, Vec::new()),
        };
        (call, Some(work))
    }

    fn describe_copy(&mut self, copy: LinearCopy) -> (Stats, Option<Work>) {
        let direction = match copy.kind {
            CopyKind::HtoD => "HtoD",
            CopyKind::DtoH => "DtoH",
            CopyKind::DtoD => "DtoD",
            CopyKind::Peer => "Peer",
            CopyKind::Inferred | CopyKind::FromStruct => "inferred by the driver",
        };
        let details = vec![
            ("bytes".into(), Value::U64(copy.bytes)),
            ("direction".into(), self.texts.value(direction)),
            ("async".into(), Value::I64(i64::from(copy.asynchronous))),
            ("dst".into(), self.hex(copy.dst)),
            ("src".into(), self.hex(copy.src)),
        ];
        self.with_work(details, copy_name(direction), copy.stream)
    }

    fn describe_struct_copy(&mut self, copy: StructCopy) -> (Stats, Option<Work>) {
        let direction = struct_direction(copy.src_memory, copy.dst_memory);
        let details = vec![
            ("bytes".into(), Value::U64(copy.bytes())),
            ("direction".into(), self.texts.value(direction)),
            ("async".into(), Value::I64(i64::from(copy.asynchronous))),
            ("width_bytes".into(), Value::U64(copy.width_bytes)),
            ("height".into(), Value::U64(copy.height)),
            ("depth".into(), Value::U64(copy.depth)),
        ];
        self.with_work(details, copy_name(direction), copy.stream)
    }

    fn describe_memset(&mut self, memset: Memset) -> (Stats, Option<Work>) {
        let details = vec![
            ("bytes".into(), Value::U64(memset.bytes())),
            ("element_bytes".into(), Value::U64(memset.element_bytes)),
            ("async".into(), Value::I64(i64::from(memset.asynchronous))),
            ("dst".into(), self.hex(memset.dst)),
        ];
        self.with_work(details, "Memset", memset.stream)
    }

    /// The stats of a call that submits no work.
    fn call_stats(&mut self, rec: &CudaCall, args: &CallArgs) -> Vec<Stat> {
        let mut stats: Vec<Stat> = Vec::new();
        match *args {
            CallArgs::Alloc {
                memory,
                bytes,
                address,
                stream,
            } => {
                put(&mut stats, "bytes", Value::U64(bytes));
                put(&mut stats, "memory", self.texts.value(memory_name(memory)));
                if rec.result == 0 {
                    put(&mut stats, "address", self.hex(address));
                }
                if let Some(stream) = stream {
                    put(&mut stats, "stream", self.stream_value(stream));
                }
            }
            CallArgs::Free {
                memory,
                address,
                stream,
            } => {
                put(&mut stats, "address", self.hex(address));
                put(&mut stats, "memory", self.texts.value(memory_name(memory)));
                if let Some(stream) = stream {
                    put(&mut stats, "stream", self.stream_value(stream));
                }
            }
            CallArgs::StreamSynchronize { stream } => {
                put(&mut stats, "stream", self.stream_value(stream));
            }
            CallArgs::EventSynchronize { event } => put(&mut stats, "event", self.hex(event)),
            CallArgs::GetFunction { handle } if rec.result == 0 => {
                let (name, _) = self.kernel_name(rec.tgid, handle);
                put(&mut stats, "kernel", Value::Str(name));
                put(&mut stats, "handle", self.hex(handle));
            }
            CallArgs::KernelGetFunction { kernel, function } => {
                let (name, _) = self.kernel_name(rec.tgid, kernel);
                put(&mut stats, "kernel", Value::Str(name));
                put(&mut stats, "kernel_handle", self.hex(kernel));
                put(&mut stats, "function_handle", self.hex(function));
            }
            _ => self.context_stats(&mut stats, args),
        }
        stats
    }

    /// The stats of a call about devices, contexts or streams.
    fn context_stats(&mut self, stats: &mut Vec<Stat>, args: &CallArgs) {
        // A `CUdevice` and an ordinal are C `int`s.
        let int = |word: u32| Value::I64(i64::from(word as i32));
        match *args {
            CallArgs::DeviceGet { ordinal, .. } => put(stats, "ordinal", int(ordinal)),
            CallArgs::CtxCreate { device, context }
            | CallArgs::PrimaryCtxRetain { device, context } => {
                put(stats, "device", int(device));
                put(stats, "context", self.hex(context));
            }
            CallArgs::CtxSetCurrent { context }
            | CallArgs::CtxPushCurrent { context }
            | CallArgs::CtxDestroy { context }
            | CallArgs::CtxPopCurrent { context }
            | CallArgs::CtxGetCurrent { context } => put(stats, "context", self.hex(context)),
            CallArgs::CtxGetDevice { device } => put(stats, "device", int(device)),
            CallArgs::StreamCreate { stream } | CallArgs::StreamDestroy { stream } => {
                put(stats, "stream", self.hex(stream));
            }
            CallArgs::StreamGetCtx { stream, context } => {
                put(stats, "stream", self.hex(stream));
                put(stats, "context", self.hex(context));
            }
            _ => {}
        }
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
        let mut stats = Vec::with_capacity(6);
        stats.extend([
            ("kernel".into(), Value::Str(Arc::clone(&name))),
            ("grid".into(), self.dims(config.grid)),
            ("block".into(), self.dims(config.block)),
            (
                "shared_memory_bytes".into(),
                Value::U64(u64::from(config.shared_memory_bytes)),
            ),
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

    /// A stream argument in words: a handle, or which default stream.
    fn stream_value(&mut self, stream: Stream) -> Value {
        let text = match stream {
            Stream::PerThreadDefault => self.texts.get("per-thread default"),
            Stream::LegacyDefault => self.texts.get("legacy default"),
            Stream::Handle(h) => self.texts.format(format_args!("{h:#x}")),
        };
        Value::Str(text)
    }

    fn hex(&mut self, v: u64) -> Value {
        self.texts.hex(v)
    }

    fn dims(&mut self, [x, y, z]: [u32; 3]) -> Value {
        Value::Str(self.texts.format(format_args!("{x},{y},{z}")))
    }
}

/// The name of the work of a copy in `direction`.
fn copy_name(direction: &str) -> &'static str {
    match direction {
        "HtoD" => "MemcpyH2D",
        "DtoH" => "MemcpyD2H",
        "DtoD" => "MemcpyD2D",
        "Peer" => "MemcpyP2P",
        _ => "Memcpy",
    }
}

/// Direction of a 2D/3D copy from where its sides are.
fn struct_direction(src: MemoryType, dst: MemoryType) -> &'static str {
    let side = |t: MemoryType| match t {
        MemoryType::Host => 'H',
        MemoryType::Device | MemoryType::Unified => 'D',
        MemoryType::Array => 'A',
        MemoryType::Unknown => '?',
    };
    match (side(src), side(dst)) {
        ('H', 'D') | ('H', 'A') => "HtoD",
        ('D', 'H') | ('A', 'H') => "DtoH",
        ('D', 'D') | ('D', 'A') | ('A', 'D') | ('A', 'A') => "DtoD",
        ('H', 'H') => "HtoH",
        _ => "unknown",
    }
}

fn put(stats: &mut Vec<Stat>, name: &'static str, value: Value) {
    stats.push((StatName::from(name), value));
}

fn memory_name(memory: Memory) -> &'static str {
    match memory {
        Memory::Device => "device",
        Memory::DevicePitched => "device (pitched)",
        Memory::Managed => "managed",
        Memory::Host => "page-locked host",
    }
}
