//! Which GPU a submission went to: what the driver calls said about
//! devices, contexts, each thread's current context and each stream's
//! context.

use rustc_hash::FxHashMap;

use crate::cuda_api::{CallArgs, Stream};

/// How a submission's device was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum OrdinalSource {
    Context,
    Thread,
    Unknown,
}

impl OrdinalSource {
    /// The source in words, as a stat shows it.
    pub(super) fn describe(self) -> &'static str {
        match self {
            OrdinalSource::Context => "context",
            OrdinalSource::Thread => "cuCtxGetDevice on the calling thread",
            OrdinalSource::Unknown => "unknown (context set before the capture); shown on GPU 0",
        }
    }
}

/// What successful driver calls said about devices, contexts and streams.
#[derive(Default)]
pub(super) struct Contexts {
    /// `(pid, CUdevice)` → ordinal, from `cuDeviceGet`.
    device_ordinals: FxHashMap<(u32, u32), u32>,
    /// `(pid, CUcontext)` → device ordinal.
    ctx_device: FxHashMap<(u32, u64), u32>,
    /// tid → context stack (last = current).
    thread_ctx: FxHashMap<u32, Vec<u64>>,
    /// tid → device of its current context, when only `cuCtxGetDevice` said.
    thread_device: FxHashMap<u32, u32>,
    /// `(pid, CUstream)` → context.
    stream_ctx: FxHashMap<(u32, u64), u64>,
}

impl Contexts {
    /// Notes what a successful call by `tid` of process `pid` said.
    pub(super) fn learn(&mut self, pid: u32, tid: u32, args: &CallArgs) {
        match *args {
            CallArgs::DeviceGet { device, ordinal } => {
                self.device_ordinals.insert((pid, device), ordinal);
            }
            CallArgs::CtxCreate { device, context } => {
                let ordinal = self.ordinal_of_device(pid, device);
                self.ctx_device.insert((pid, context), ordinal);
                self.thread_ctx.entry(tid).or_default().push(context);
            }
            CallArgs::PrimaryCtxRetain { device, context } => {
                let ordinal = self.ordinal_of_device(pid, device);
                self.ctx_device.insert((pid, context), ordinal);
            }
            CallArgs::CtxSetCurrent { context } => {
                let stack = self.thread_ctx.entry(tid).or_default();
                stack.pop();
                if context != 0 {
                    stack.push(context);
                }
                self.thread_device.remove(&tid);
            }
            CallArgs::CtxPushCurrent { context } => {
                self.thread_ctx.entry(tid).or_default().push(context);
                self.thread_device.remove(&tid);
            }
            CallArgs::CtxPopCurrent { .. } => {
                self.thread_ctx.entry(tid).or_default().pop();
                self.thread_device.remove(&tid);
            }
            CallArgs::CtxGetCurrent { context } => {
                let stack = self.thread_ctx.entry(tid).or_default();
                if stack.last() != Some(&context) {
                    stack.pop();
                    if context != 0 {
                        stack.push(context);
                    }
                }
            }
            CallArgs::CtxGetDevice { device } => self.learn_thread_device(pid, tid, device),
            CallArgs::CtxDestroy { context } => {
                self.ctx_device.remove(&(pid, context));
            }
            CallArgs::StreamCreate { stream } => {
                if let Some(ctx) = self.current_ctx(tid) {
                    self.stream_ctx.insert((pid, stream), ctx);
                }
            }
            CallArgs::StreamGetCtx { stream, context } => {
                self.stream_ctx.insert((pid, stream), context);
            }
            CallArgs::StreamDestroy { stream } => {
                self.stream_ctx.remove(&(pid, stream));
            }
            _ => {}
        }
    }

    /// `cuCtxGetDevice` on `tid`: the device of its current context, or
    /// of the thread while its context is not known.
    fn learn_thread_device(&mut self, pid: u32, tid: u32, device: u32) {
        let ordinal = self.ordinal_of_device(pid, device);
        match self.current_ctx(tid) {
            Some(ctx) => {
                self.ctx_device.insert((pid, ctx), ordinal);
            }
            None => {
                self.thread_device.insert(tid, ordinal);
            }
        }
    }

    fn current_ctx(&self, tid: u32) -> Option<u64> {
        self.thread_ctx.get(&tid).and_then(|s| s.last().copied())
    }

    fn ordinal_of_device(&self, pid: u32, device: u32) -> u32 {
        // A CUdevice is its ordinal in every driver so far; cuDeviceGet confirms.
        self.device_ordinals
            .get(&(pid, device))
            .copied()
            .unwrap_or(device)
    }

    /// The device of work on `stream` submitted by `tid` of process `pid`.
    pub(super) fn ordinal(&self, pid: u32, tid: u32, stream: Stream) -> (u32, OrdinalSource) {
        let ctx = match stream {
            Stream::LegacyDefault | Stream::PerThreadDefault => self.current_ctx(tid),
            Stream::Handle(s) => self
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
}
