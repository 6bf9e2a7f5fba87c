//! CUDA driver API uprobes: one entry program per argument shape, one
//! return program for all.
//!
//! Each attach point carries a cookie (`tracer_common::cuda::cookie`) that
//! names the function and the arguments to dereference, so these programs
//! need not know the driver's functions. An entry saves the raw arguments
//! (and, for functions that take a struct or more than six arguments, the
//! words that matter) under `tid << 32 | function`; the return writes one
//! `CudaCall` with both times, the `CUresult` and the out-pointer's target,
//! plus a `CudaSymbol` after a successful kernel lookup. A function whose
//! return tells nothing worth a second uprobe (setting the current
//! context: a few ns of work, called several times a step) has no return
//! probe: its entry writes the `CudaCall` at once. A function never
//! calls itself, so one slot per thread and function is enough even when
//! the driver calls one exported function from another.
//!
//! A call that submits work (a launch, a copy, a memset) also writes the
//! stack it was made from at its entry, as a stack sample marked
//! `FLAG_LAUNCH` whose time is the call's start, as `LAUNCH_STACK_GAP_NS`
//! says: every call, none, or at most one per gap on each CPU. The entry
//! program tail-calls `cuda_launch_stack` for it, so that the stack walk
//! is verified once rather than in each entry program.
//!
//! A slot outlives its call: the return marks it free (`start_ns` 0) and
//! the thread's next call of the function writes it again in place. A
//! lookup the verifier inlines costs a fraction of the insert and delete
//! each call took otherwise (hundreds of ns in a uprobe). The map is an
//! LRU one, so the slots of threads that are gone are forgotten first when
//! it fills.

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext as _,
    helpers::{
        bpf_ktime_get_ns, bpf_probe_read_user,
        generated::{bpf_get_attach_cookie, bpf_probe_read_user_str},
    },
    macros::{map, uprobe, uretprobe},
    maps::{LruHashMap, PerCpuArray, ProgramArray},
    programs::{ProbeContext, RetProbeContext},
};
use tracer_common::{
    RecordKind,
    cuda::{
        CUDA_NAME_LEN, CudaCall, CudaCallWritten, CudaSymbol, EXTRA_WORDS, MAX_PENDING_CALLS,
        PACKED_LAUNCH_WORDS, PendingCall, REGISTER_ARGS, STACK_WORDS, cookie, extra_words, flags,
        layout, pack_launch, stat,
    },
    stack::{FLAG_LAUNCH, NO_LAUNCH_STACKS},
};

use crate::{
    EVENTS, bump, count_submit,
    cpu_sample::{StackOf, write_stack},
    current, header, is_target, records_driver_calls,
};

#[map]
static CUDA_PENDING: LruHashMap<u64, PendingCall> =
    LruHashMap::with_max_entries(MAX_PENDING_CALLS, 0);

#[map]
static CUDA_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

/// See `tracer_common::stack::names::LAUNCH_STACK_GAP_NS`.
#[unsafe(no_mangle)]
static LAUNCH_STACK_GAP_NS: u64 = NO_LAUNCH_STACKS;

/// See `tracer_common::stack::names::LAUNCH_STACK_LAST_NS`.
#[map]
static LAUNCH_STACK_LAST_NS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// See `tracer_common::stack::names::LAUNCH_STACK_JUMP`.
#[map]
static LAUNCH_STACK_JUMP: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Whether a call that submits work at `now_ns` carries its stack: always,
/// never, or if this CPU took none for the gap. If so, `now_ns` is left for
/// the stack program as the record's time.
#[inline(always)]
fn take_launch_stack(now_ns: u64) -> bool {
    // SAFETY: a global read-only after load.
    let gap = unsafe { core::ptr::read_volatile(&LAUNCH_STACK_GAP_NS) };
    if gap == NO_LAUNCH_STACKS {
        return false;
    }
    let Some(last) = LAUNCH_STACK_LAST_NS.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot; programs do not migrate while running.
    unsafe {
        if gap != 0 && now_ns.wrapping_sub(*last) < gap {
            return false;
        }
        *last = now_ns;
    }
    true
}

/// The stack of a driver call that submits work, at its entry: tail-called
/// by the entry program (its context is the entry's), so that the stack
/// walk and its Python frames are verified once, not in each entry program.
#[uprobe]
pub fn cuda_launch_stack(ctx: ProbeContext) -> u32 {
    let (tid, tgid) = current();
    let Some(at_ns) = LAUNCH_STACK_LAST_NS.get(0).copied() else {
        return 0;
    };
    // SAFETY: a uprobe context holds the user registers at the probed instruction.
    let regs = unsafe { &*ctx.regs };
    let what = StackOf {
        regs: Some([regs.rip, regs.rsp, regs.rbp]),
        kernel: false,
        flags: FLAG_LAUNCH,
        off_cpu_us: 0,
        syscall: 0,
        at_ns,
    };
    // SAFETY: a uprobe's context is what `bpf_get_stack` takes.
    unsafe { write_stack(ctx.as_ptr(), tid, tgid, &what) };
    0
}

#[inline(always)]
fn cuda_bump(index: u32) {
    if let Some(v) = CUDA_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, programs do not migrate while running.
        unsafe { *v += 1 };
    }
}

#[inline(always)]
fn pending_key(tid: u32, cookie: u64) -> u64 {
    (u64::from(tid) << 32) | u64::from(cookie::function(cookie))
}

#[inline(always)]
fn read_user_u64(addr: u64) -> u64 {
    if addr == 0 {
        return 0;
    }
    // SAFETY: the helper checks the address; a fault yields an error.
    unsafe { bpf_probe_read_user(addr as *const u64) }.unwrap_or(0)
}

/// Reads the 8-byte words at `base + offsets[i]` into `extra[i]`.
#[inline(always)]
fn gather<const N: usize>(base: u64, offsets: &[usize; N]) -> [u64; 8] {
    let mut extra = [0u64; 8];
    let mut i = 0;
    while i < N && i < extra.len() {
        extra[i] = read_user_u64(base.wrapping_add(offsets[i] as u64));
        i += 1;
    }
    extra
}

/// Saves the call's arguments until its return.
#[inline(always)]
fn enter(ctx: &ProbeContext, extra: impl FnOnce(&[u64; 6], u64) -> [u64; 8]) -> u32 {
    let (tid, tgid) = current();
    if !records_driver_calls(tgid) {
        return 0;
    }
    // SAFETY: a uprobe context holds the user registers at the probed instruction.
    let regs = unsafe { &*ctx.regs };
    let args = [regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9];
    // SAFETY: plain helper calls on our own context.
    let (cookie, start_ns) = unsafe { (bpf_get_attach_cookie(ctx.as_ptr()), bpf_ktime_get_ns()) };
    let pending = PendingCall {
        start_ns,
        extra: extra(&args, regs.rsp),
        args,
    };
    let stack = cookie::submits(cookie) && take_launch_stack(start_ns);
    if cookie::entry_only(cookie) {
        submit_call(tid, tgid, cookie, &pending, 0, 0, flags::ENTRY_ONLY);
    } else {
        let key = pending_key(tid, cookie);
        match CUDA_PENDING.get_ptr_mut(key) {
            // SAFETY: a live map value; only this thread reads or writes the
            // slots under its tid.
            Some(slot) => unsafe { *slot = pending },
            None => {
                if CUDA_PENDING.insert(key, pending, 0).is_err() {
                    cuda_bump(stat::PENDING_FULL);
                }
            }
        }
    }
    if stack {
        // Last: a tail call does not come back. If it fails (no program
        // in the array), the call goes without its stack.
        // SAFETY: the program in the array is `cuda_launch_stack`, of this
        // program's type, which takes this context.
        unsafe { LAUNCH_STACK_JUMP.tail_call(ctx, 0) };
    }
    0
}

#[uprobe]
pub fn cuda_enter_registers(ctx: ProbeContext) -> u32 {
    enter(&ctx, |_, _| [0; 8])
}

/// Arguments 7.. of an x86-64 call sit above the return address; they are
/// read in one copy (each helper call costs about 70 ns in a uprobe).
#[uprobe]
pub fn cuda_enter_stack(ctx: ProbeContext) -> u32 {
    enter(&ctx, |_, sp| {
        let mut extra = [0u64; 8];
        // SAFETY: the helper checks the address; a fault yields an error.
        if let Ok(words) = unsafe { bpf_probe_read_user((sp + 8) as *const [u64; STACK_WORDS]) } {
            let mut i = 0;
            while i < STACK_WORDS {
                extra[i] = words[i];
                i += 1;
            }
        }
        extra
    })
}

#[uprobe]
pub fn cuda_enter_launch_config(ctx: ProbeContext) -> u32 {
    enter(&ctx, |args, _| gather(args[0], &layout::LAUNCH_CONFIG))
}

#[uprobe]
pub fn cuda_enter_memcpy2d(ctx: ProbeContext) -> u32 {
    enter(&ctx, |args, _| gather(args[0], &layout::MEMCPY2D))
}

#[uprobe]
pub fn cuda_enter_memcpy3d(ctx: ProbeContext) -> u32 {
    enter(&ctx, |args, _| gather(args[0], &layout::MEMCPY3D))
}

#[uretprobe]
pub fn cuda_return(ctx: RetProbeContext) -> u32 {
    let (tid, tgid) = current();
    // SAFETY: plain helper call on our own context.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let key = pending_key(tid, cookie);
    let pending = match CUDA_PENDING.get_ptr_mut(key) {
        // SAFETY: a live map value, this thread's own (see `enter`).
        Some(slot) if unsafe { (*slot).start_ns } != 0 => slot,
        _ => {
            if is_target(tgid) {
                cuda_bump(stat::UNPAIRED_RETURNS);
            }
            return 0;
        }
    };
    let result: u64 = ctx.ret();
    let result = result as u32;
    // SAFETY: `pending` points into a live map value, this thread's own.
    let args = unsafe { (*pending).args };
    let out_value = match cookie::out_arg(cookie) {
        Some(i) if i < args.len() => read_user_u64(args[i]),
        _ => 0,
    };
    // SAFETY: as above.
    submit_call(
        tid,
        tgid,
        cookie,
        unsafe { &*pending },
        result,
        out_value,
        0,
    );
    // SAFETY: as above; the slot is free for the thread's next call.
    unsafe { (*pending).start_ns = 0 };
    if let Some(i) = cookie::name_arg(cookie)
        && i < args.len()
        && result == 0
    {
        emit_symbol(tid, tgid, out_value, args[i]);
    }
    0
}

/// Writes one [`CudaCall`]: at its return, or at its entry for a function
/// probed there only (then the header's time is the entry's). It carries
/// as many arguments as the function takes in registers and as many extra
/// words as its shape fills, both from the cookie.
#[inline(always)]
fn submit_call(
    tid: u32,
    tgid: u32,
    cookie: u64,
    call: &PendingCall,
    result: u32,
    out_value: u64,
    call_flags: u16,
) {
    use extra_words::{LAUNCH_CONFIG as LAUNCH, MEMCPY2D as M2D, MEMCPY3D as M3D, STACK};
    let a = (tid, tgid, cookie, call, result, out_value, call_flags);
    // A reservation's size must be a constant, and so must the copies the
    // verifier proves in bounds: one branch per number of register
    // arguments and extra words a function's record carries (and direct
    // calls: BPF has no indirect ones).
    match (cookie::args(cookie), cookie::extra_words(cookie)) {
        (0, 0) => submit_sized::<0, 0, 0>(a),
        (1, 0) => submit_sized::<1, 0, 1>(a),
        (2, 0) => submit_sized::<2, 0, 2>(a),
        (3, 0) => submit_sized::<3, 0, 3>(a),
        (4, 0) => submit_sized::<4, 0, 4>(a),
        (5, 0) => submit_sized::<5, 0, 5>(a),
        (6, 0) => submit_sized::<6, 0, 6>(a),
        // `cuLaunchKernel`: six registers, three stack words, packed.
        (6, STACK) => submit_launch(a),
        // `cuLaunchKernelEx`: four registers, the launch config's fields.
        (4, LAUNCH) => submit_sized::<4, LAUNCH, { 4 + LAUNCH }>(a),
        // The 2D and 3D copies: the struct, and a stream for the async ones.
        (1, M2D) => submit_sized::<1, M2D, { 1 + M2D }>(a),
        (2, M2D) => submit_sized::<2, M2D, { 2 + M2D }>(a),
        (1, M3D) => submit_sized::<1, M3D, { 1 + M3D }>(a),
        (2, M3D) => submit_sized::<2, M3D, { 2 + M3D }>(a),
        _ => submit_sized::<6, EXTRA_WORDS, { CudaCall::MAX_WORDS }>(a),
    }
}

/// What [`submit_call`] writes a record of.
type CallParts<'a> = (u32, u32, u64, &'a PendingCall, u32, u64, u16);

/// [`submit_call`] for a function whose record carries `A` register
/// arguments, then `E` extra words: `W` words in all.
#[inline(always)]
fn submit_sized<const A: usize, const E: usize, const W: usize>(parts: CallParts<'_>) {
    const { assert!(A + E == W && A <= 6 && E <= EXTRA_WORDS) };
    let Some(mut entry) = EVENTS.reserve::<CudaCallWritten<W>>(0) else {
        bump(tracer_common::stat::DROPPED_RINGBUF_FULL);
        return;
    };
    let call = parts.3;
    let rec = entry.as_mut_ptr().cast::<CudaCall>();
    // SAFETY: `rec` is a reserved record of `CudaCall::written_size(W)`
    // bytes: the fixed fields and `W` words after them, each written
    // through the raw pointer (no reference to the whole `CudaCall`,
    // which is longer) before the submit.
    unsafe {
        write_fixed(rec, size_of::<CudaCallWritten<W>>(), parts, A, 0);
        let words = (&raw mut (*rec).args).cast::<u64>();
        let mut i = 0;
        while i < A {
            words.add(i).write(call.args[i]);
            i += 1;
        }
        let mut k = 0;
        while k < E {
            words.add(A + k).write(call.extra[k]);
            k += 1;
        }
    }
    entry.submit(count_submit());
}

/// [`submit_call`] for a `cuLaunchKernel`, its 32-bit arguments two to a
/// word ([`flags::PACKED_LAUNCH`]): the most frequent record of a launch
/// loop in 96 bytes rather than 120.
#[inline(always)]
fn submit_launch(parts: CallParts<'_>) {
    let Some(mut entry) = EVENTS.reserve::<CudaCallWritten<PACKED_LAUNCH_WORDS>>(0) else {
        bump(tracer_common::stat::DROPPED_RINGBUF_FULL);
        return;
    };
    let call = parts.3;
    let words = pack_launch(&call.args, &call.extra);
    let rec = entry.as_mut_ptr().cast::<CudaCall>();
    let size = size_of::<CudaCallWritten<PACKED_LAUNCH_WORDS>>();
    // SAFETY: `rec` is a reserved record of
    // `CudaCall::written_size(PACKED_LAUNCH_WORDS)` bytes: the fixed fields
    // and the packed words after them, each written through the raw
    // pointer before the submit.
    unsafe {
        write_fixed(rec, size, parts, REGISTER_ARGS, flags::PACKED_LAUNCH);
        (&raw mut (*rec).args)
            .cast::<[u64; PACKED_LAUNCH_WORDS]>()
            .write(words);
    }
    entry.submit(count_submit());
}

/// Writes the fixed part of a [`CudaCall`] of `size` bytes carrying
/// `args` register arguments, with `more_flags` beside the call's own.
///
/// # Safety
///
/// `rec` points to a reserved record of at least
/// [`CudaCall::FIXED_SIZE`] bytes.
#[inline(always)]
unsafe fn write_fixed(
    rec: *mut CudaCall,
    size: usize,
    (tid, tgid, cookie, call, result, out_value, call_flags): CallParts<'_>,
    args: usize,
    more_flags: u16,
) {
    // SAFETY: the fixed fields lie within the record (the caller's
    // promise), each written through the raw pointer.
    unsafe {
        (*rec).header = header(RecordKind::CudaCall, size);
        if call_flags & flags::ENTRY_ONLY != 0 {
            (*rec).header.ts_ns = call.start_ns;
        }
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).start_ns = call.start_ns;
        (*rec).function = cookie::function(cookie);
        (*rec).flags = flags::with_args(call_flags | more_flags, args);
        (*rec).result = result;
        (*rec).out_value = out_value;
    }
}

/// Sends a looked-up handle with its name, copied straight into the ring
/// (the name does not fit on the BPF stack).
#[inline(always)]
fn emit_symbol(tid: u32, tgid: u32, handle: u64, name: u64) {
    let Some(mut entry) = EVENTS.reserve::<CudaSymbol>(0) else {
        bump(tracer_common::stat::DROPPED_RINGBUF_FULL);
        return;
    };
    let rec = entry.as_mut_ptr();
    // SAFETY: `rec` is a reserved record of the right size; the helper
    // writes at most CUDA_NAME_LEN bytes into `name`.
    unsafe {
        (*rec).header = header(RecordKind::CudaSymbol, size_of::<CudaSymbol>());
        (*rec).tid = tid;
        (*rec).tgid = tgid;
        (*rec).handle = handle;
        let copied = bpf_probe_read_user_str(
            (*rec).name.as_mut_ptr().cast::<c_void>(),
            CUDA_NAME_LEN as u32,
            name as *const c_void,
        );
        (*rec).len = if copied > 0 { copied as u32 } else { 0 };
        // A full buffer is a cut name unless the NUL fell on its last byte.
        let cut = copied as usize == CUDA_NAME_LEN
            && bpf_probe_read_user((name + CUDA_NAME_LEN as u64 - 1) as *const u8).unwrap_or(0)
                != 0;
        (*rec).truncated = u32::from(cut);
        if cut {
            cuda_bump(stat::NAMES_TRUNCATED);
        }
    }
    entry.submit(count_submit());
}
