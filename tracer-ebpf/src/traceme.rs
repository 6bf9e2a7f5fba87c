//! TraceMe: uprobes on `TraceMeRecorder::Record(Event&&)` in the traced
//! processes' jaxlib / TensorFlow / libtpu objects.
//!
//! `Record` receives every finished TraceMe, so one probe sees them all;
//! its first argument points at the `Event {std::string name; int64
//! start_time; int64 end_time;}`. The string's layout depends on the C++
//! library the object was built with, so there is one program per layout
//! and user space attaches the one that fits each object. Everything is
//! read with `bpf_probe_read_user`; nothing in the target is written.

use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated::bpf_probe_read_user as probe_read_user_raw},
    macros::{map, uprobe},
    maps::PerCpuArray,
    programs::ProbeContext,
};
use tracer_common::{
    RecordKind, TraceMeRecord,
    traceme::{FLAG_NAME_UNREADABLE, NAME_CAP, stat, traceme_record_size},
};

use crate::{current, emit_bytes, header, is_recording};

/// One record being assembled per CPU (too big for the BPF stack).
#[map]
static TRACEME_SCRATCH: PerCpuArray<TraceMeRecord> = PerCpuArray::with_max_entries(1, 0);

#[map]
static TRACEME_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

#[inline(always)]
fn bump(index: u32) {
    if let Some(v) = TRACEME_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, programs do not migrate while running.
        unsafe { *v += 1 };
    }
}

#[derive(Clone, Copy)]
enum Layout {
    /// `{char* data; size_t size; char sso[16]}`; times at +0x20/+0x28.
    Libstdcxx,
    /// libc++ default: long `{cap|1; size; data}`, short `{size<<1; chars}`;
    /// times at +0x18/+0x20.
    Libcxx,
    /// libc++ alternate: long `{data; size; cap|1<<63}`, short `{chars[23];
    /// size}`; times at +0x18/+0x20.
    LibcxxAlternate,
}

#[uprobe]
pub fn traceme_record_libstdcxx(ctx: ProbeContext) -> u32 {
    record(&ctx, Layout::Libstdcxx);
    0
}

#[uprobe]
pub fn traceme_record_libcxx(ctx: ProbeContext) -> u32 {
    record(&ctx, Layout::Libcxx);
    0
}

#[uprobe]
pub fn traceme_record_libcxx_alt(ctx: ProbeContext) -> u32 {
    record(&ctx, Layout::LibcxxAlternate);
    0
}

/// The string's characters and length, and the event's two times.
struct EventView {
    data: u64,
    len: u64,
    start_time: i64,
    end_time: i64,
}

#[inline(always)]
fn read_event(event: u64, layout: Layout) -> Option<EventView> {
    match layout {
        Layout::Libstdcxx => {
            // SAFETY: reads target memory through the checked helper.
            let w = unsafe { bpf_probe_read_user(event as *const [u64; 6]) }.ok()?;
            Some(EventView {
                data: w[0],
                len: w[1],
                start_time: w[4] as i64,
                end_time: w[5] as i64,
            })
        }
        Layout::Libcxx => {
            // SAFETY: as above.
            let w = unsafe { bpf_probe_read_user(event as *const [u64; 5]) }.ok()?;
            let (data, len) = if w[0] & 1 != 0 {
                (w[2], w[1])
            } else {
                (event + 1, (w[0] & 0xff) >> 1)
            };
            Some(EventView {
                data,
                len,
                start_time: w[3] as i64,
                end_time: w[4] as i64,
            })
        }
        Layout::LibcxxAlternate => {
            // SAFETY: as above.
            let w = unsafe { bpf_probe_read_user(event as *const [u64; 5]) }.ok()?;
            let (data, len) = if w[2] >> 63 != 0 {
                (w[0], w[1])
            } else {
                (event, (w[2] >> 56) & 0x7f)
            };
            Some(EventView {
                data,
                len,
                start_time: w[3] as i64,
                end_time: w[4] as i64,
            })
        }
    }
}

#[inline(always)]
fn record(ctx: &ProbeContext, layout: Layout) {
    let (tid, tgid) = current();
    if !is_recording(tgid) {
        return;
    }
    bump(stat::HITS);
    let Some(event) = ctx.arg::<u64>(0) else {
        return;
    };
    let Some(view) = read_event(event, layout) else {
        bump(stat::EVENT_UNREADABLE);
        return;
    };
    let Some(scratch) = TRACEME_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // The uprobe fires with the instruction pointer at the probed address.
    // SAFETY: ctx.regs points at the probe's saved registers.
    let site = unsafe { (*ctx.regs).rip };
    let copied = if view.len > NAME_CAP as u64 {
        NAME_CAP as u32
    } else {
        view.len as u32
    };
    // SAFETY: scratch is this CPU's slot; `copied` <= NAME_CAP bytes fit.
    let name_ok = unsafe {
        probe_read_user_raw(
            (*scratch).name.as_mut_ptr().cast(),
            copied,
            view.data as *const core::ffi::c_void,
        )
    } == 0;
    let copied = if name_ok {
        copied as usize
    } else {
        bump(stat::NAME_UNREADABLE);
        0
    };
    let size = traceme_record_size(copied);
    // SAFETY: as above; the fixed fields precede the name.
    unsafe {
        (*scratch).header = header(RecordKind::TraceMe, size);
        (*scratch).tid = tid;
        (*scratch).tgid = tgid;
        (*scratch).site = site;
        (*scratch).start_time = view.start_time;
        (*scratch).end_time = view.end_time;
        (*scratch).name_len = view.len.min(u32::MAX as u64) as u32;
        (*scratch).copied = copied as u16;
        (*scratch).flags = if name_ok { 0 } else { FLAG_NAME_UNREADABLE };
    }
    if size <= size_of::<TraceMeRecord>() {
        // SAFETY: `size` bytes of the scratch record are initialized.
        emit_bytes(unsafe { core::slice::from_raw_parts(scratch.cast::<u8>(), size) });
    }
}
