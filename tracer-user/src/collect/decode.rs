//! Bytes from the ring buffer to typed records: the only place that
//! reinterprets kernel-written memory.

use tracer_common::{
    ProcessFork, RecordHeader, RecordKind, SchedSwitch, SchedWakeup, TaskExit, TaskNew, TaskRename,
    TraceMeRecord,
    cuda::{
        CudaCall, CudaSymbol, EXTRA_WORDS, PACKED_LAUNCH_WORDS, REGISTER_ARGS, flags, unpack_launch,
    },
    stack::{
        FLAG_KERNEL_UNREADABLE, FLAG_OFF_CPU, FLAG_USER_UNREADABLE, MAX_FRAMES, STACK_COPY_BYTES,
        StackSampleRecord, StackSampleWithCopy,
    },
    traceme::{FLAG_NAME_UNREADABLE, TRACEME_PREFIX, traceme_record_size},
};

/// One record from the kernel, decoded. Large, rare records are boxed so
/// that the frequent scheduler records stay small.
#[derive(Clone, Debug)]
pub enum Record {
    /// A `sched_switch` involving a traced thread.
    Switch(SchedSwitch),
    /// A wake-up of a traced thread.
    Wakeup(SchedWakeup),
    // Boxed, as the rare records below: a record's size is its largest
    // variant's, and captures hold millions of switches and wake-ups.
    /// A thread created by a traced thread.
    TaskNew(Box<TaskNew>),
    /// A process forked by a traced thread.
    Fork(ProcessFork),
    /// A traced thread's exit.
    Exit(Box<TaskExit>),
    /// A traced thread's new name.
    Rename(Box<TaskRename>),
    /// A CUDA driver call.
    CudaCall(Box<CudaCall>),
    /// A kernel handle and the name it was looked up by.
    CudaSymbol(Box<CudaSymbol>),
    /// Boxed: it is much larger than the others and much rarer.
    TraceMe(Box<TraceMeEvent>),
    /// A CPU stack sample or an off-CPU stack.
    StackSample(Box<StackSample>),
}

/// A CPU stack sample: where a thread of a traced process was when the
/// sampling clock of its CPU ticked.
#[derive(Clone, Debug)]
pub struct StackSample {
    /// Kind, size, CPU and time of the record.
    pub header: RecordHeader,
    /// The sampled thread.
    pub tid: u32,
    /// Its process.
    pub tgid: u32,
    /// User-space instruction addresses, innermost first (every one past
    /// the first is a return address).
    pub user: Box<[u64]>,
    /// Kernel instruction addresses, innermost first.
    pub kernel: Box<[u64]>,
    /// The user stack could not be read (a kernel thread, or unwinding failed).
    pub user_unreadable: bool,
    /// The kernel stack could not be read.
    pub kernel_unreadable: bool,
    /// 0 for a tick of the sampling clock. Otherwise the stack was taken as
    /// the system call the thread waited in returned (an off-CPU stack:
    /// where it waited), after this many microseconds off the CPU.
    pub off_cpu_us: u32,
    /// With [`Self::off_cpu_us`]: the number of the system call the thread
    /// waited in.
    pub syscall: u32,
}

impl StackSample {
    /// Whether this is the stack of a thread that waited in a system call,
    /// not a sample of a thread on a CPU.
    pub fn is_off_cpu(&self) -> bool {
        self.off_cpu_us != 0
    }
}

/// A `TraceMeRecorder::Record(Event&&)` call as the uprobe saw it.
#[derive(Clone, Debug)]
pub struct TraceMeEvent {
    /// Kind, size, CPU and time of the record.
    pub header: RecordHeader,
    /// The thread that recorded the event.
    pub tid: u32,
    /// Its process.
    pub tgid: u32,
    /// Address of the probed `Record`: which recorder (loaded object).
    pub site: u64,
    /// `Event::start_time`, as the target wrote it (wall-clock epoch ns,
    /// or minus an activity's id at its end).
    pub start_time: i64,
    /// `Event::end_time`, as the target wrote it (wall-clock epoch ns, or
    /// minus an activity's id at its start).
    pub end_time: i64,
    /// The name, or its first `NAME_CAP` bytes (invalid UTF-8 replaced).
    pub name: String,
    /// The name was longer than what was copied.
    pub truncated: bool,
    /// Length in bytes of the whole name in the target.
    pub name_len: u32,
    /// The name's memory could not be read; `name` is empty.
    pub name_unreadable: bool,
}

impl Record {
    /// The header the record starts with.
    pub fn header(&self) -> &RecordHeader {
        match self {
            Record::Switch(r) => &r.header,
            Record::Wakeup(r) => &r.header,
            Record::TaskNew(r) => &r.header,
            Record::Fork(r) => &r.header,
            Record::Exit(r) => &r.header,
            Record::Rename(r) => &r.header,
            Record::CudaCall(r) => &r.header,
            Record::CudaSymbol(r) => &r.header,
            Record::TraceMe(r) => &r.header,
            Record::StackSample(r) => &r.header,
        }
    }

    /// `CLOCK_MONOTONIC` time of the record, in ns.
    pub fn ts(&self) -> u64 {
        self.header().ts_ns
    }

    /// A `sched_switch` record as the probes write it: on `cpu`, from
    /// `prev` to `next` (tid, tgid; tgid 0 for a task not traced). For
    /// feeding [`crate::timeline`] without the kernel (tests, benchmarks).
    pub fn sched_switch(
        ts_ns: u64,
        cpu: u32,
        prev: (u32, u32),
        prev_state: u64,
        next: (u32, u32),
    ) -> Record {
        let mut header = RecordHeader::new(
            RecordKind::SchedSwitch,
            size_of::<SchedSwitch>(),
            cpu,
            ts_ns,
        );
        header.detail = prev_state as u16;
        Record::Switch(SchedSwitch {
            header,
            prev_tid: prev.0,
            prev_tgid: prev.1,
            next_tid: next.0,
            next_tgid: next.1,
        })
    }

    /// A `sched_waking` record as the probes write it, on CPU 0: `waker`
    /// woke `woken` (tid, tgid each).
    pub fn sched_waking(ts_ns: u64, woken: (u32, u32), waker: (u32, u32)) -> Record {
        Record::Wakeup(SchedWakeup {
            header: RecordHeader::new(RecordKind::SchedWakeup, size_of::<SchedWakeup>(), 0, ts_ns),
            tid: woken.0,
            tgid: woken.1,
            waker_tid: waker.0,
            waker_tgid: waker.1,
        })
    }

    /// A driver call of function `function` (an index of
    /// [`crate::cuda_api`]'s table) as the probes write it, on CPU 0: by
    /// `thread` (tid, tgid) from `start_ns` to `end_ns`, succeeded, with
    /// `args`, the rest zero.
    pub fn driver_call(
        function: u16,
        (start_ns, end_ns): (u64, u64),
        thread: (u32, u32),
        args: [u64; 6],
    ) -> Record {
        Record::CudaCall(Box::new(CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 0, end_ns),
            tid: thread.0,
            tgid: thread.1,
            start_ns,
            function,
            flags: 0,
            result: 0,
            args,
            extra: [0; 8],
            out_value: 0,
        }))
    }
}

/// Why a ring-buffer item is not a record.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Shorter than a record header: its length in bytes.
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    /// The header names no known kind.
    #[error("unknown record kind {0}")]
    UnknownKind(u16),
    /// The size in the header is not its kind's, or the item is shorter.
    #[error("record kind {kind:?} claims {claimed} bytes, expected {expected}, got {got}")]
    Size {
        /// The record's kind.
        kind: RecordKind,
        /// The size in its header, in bytes.
        claimed: usize,
        /// The size of its kind, in bytes.
        expected: usize,
        /// The item's length, in bytes.
        got: usize,
    },
}

/// A record of `kind` claims its size in its header: it must be the
/// size of that kind, and the ring buffer's item must hold it.
fn check_size(
    bytes: &[u8],
    kind: RecordKind,
    claimed: usize,
    expected: usize,
) -> Result<(), DecodeError> {
    if claimed != expected || bytes.len() < expected {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected,
            got: bytes.len(),
        });
    }
    Ok(())
}

fn read<T: Copy>(bytes: &[u8], kind: RecordKind, claimed: usize) -> Result<T, DecodeError> {
    check_size(bytes, kind, claimed, size_of::<T>())?;
    // SAFETY: length checked; T is a plain #[repr(C)] record; unaligned read.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// The header every record starts with, if `bytes` hold one.
fn header(bytes: &[u8]) -> Option<RecordHeader> {
    if bytes.len() < size_of::<RecordHeader>() {
        return None;
    }
    // SAFETY: length checked above; unaligned read of a plain record.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

/// Decodes one ring-buffer item.
pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    let header = header(bytes).ok_or(DecodeError::Short(bytes.len()))?;
    let kind = RecordKind::from_u16(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    let size = usize::from(header.size);
    Ok(match kind {
        RecordKind::SchedSwitch => Record::Switch(read(bytes, kind, size)?),
        RecordKind::SchedWakeup => Record::Wakeup(read(bytes, kind, size)?),
        RecordKind::TaskNew => Record::TaskNew(Box::new(read(bytes, kind, size)?)),
        RecordKind::ProcessFork => Record::Fork(read(bytes, kind, size)?),
        RecordKind::TaskExit => Record::Exit(Box::new(read(bytes, kind, size)?)),
        RecordKind::TaskRename => Record::Rename(Box::new(read(bytes, kind, size)?)),
        RecordKind::CudaCall => Record::CudaCall(Box::new(read_driver_call(bytes, size)?)),
        RecordKind::CudaSymbol => Record::CudaSymbol(Box::new(read(bytes, kind, size)?)),
        RecordKind::TraceMe => Record::TraceMe(Box::new(read_traceme(bytes, size)?)),
        RecordKind::StackSample => Record::StackSample(Box::new(read_stack_sample(bytes, size)?)),
    })
}

/// The length of the record `bytes` holds if it is one a collector keeps
/// as the probes wrote it: a scheduler record (a switch, a wake-up, a new
/// task, a fork, an exit, a rename) or a CUDA driver record (a call, a
/// kernel's name). `None` for any other kind, and for bytes [`decode`]
/// would refuse (it says why).
#[inline]
pub fn held_record_len(bytes: &[u8]) -> Option<usize> {
    let header = header(bytes)?;
    // Switches and wake-ups are most of a flood: told apart by two
    // comparisons rather than a jump through a table of every kind.
    const COMMON: usize = size_of::<SchedSwitch>();
    const _: () = assert!(size_of::<SchedWakeup>() == COMMON);
    if (header.kind == RecordKind::SchedSwitch as u16
        || header.kind == RecordKind::SchedWakeup as u16)
        && usize::from(header.size) == COMMON
    {
        return (bytes.len() >= COMMON).then_some(COMMON);
    }
    let expected = match RecordKind::from_u16(header.kind)? {
        RecordKind::SchedSwitch => size_of::<SchedSwitch>(),
        RecordKind::SchedWakeup => size_of::<SchedWakeup>(),
        RecordKind::TaskNew => size_of::<TaskNew>(),
        RecordKind::ProcessFork => size_of::<ProcessFork>(),
        RecordKind::TaskExit => size_of::<TaskExit>(),
        RecordKind::TaskRename => size_of::<TaskRename>(),
        RecordKind::CudaCall => {
            let size = usize::from(header.size);
            return (CudaCall::words_of_size(size).is_some() && bytes.len() >= size)
                .then_some(size);
        }
        RecordKind::CudaSymbol => size_of::<CudaSymbol>(),
        _ => return None,
    };
    (usize::from(header.size) == expected && bytes.len() >= expected).then_some(expected)
}

/// What the metrics count of a driver call ([`crate::metrics`]): read
/// out of the record in place, as a flood of launches would otherwise
/// copy each whole record once more only to count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverCallCounted {
    /// The calling process.
    pub tgid: u32,
    /// Index of the function in [`crate::cuda_api`]'s table.
    pub function: u16,
    /// The `CUresult` returned.
    pub result: u32,
    /// Entry time (`CLOCK_MONOTONIC` ns).
    pub start_ns: u64,
    /// Return time (`CLOCK_MONOTONIC` ns).
    pub end_ns: u64,
}

impl From<&CudaCall> for DriverCallCounted {
    fn from(call: &CudaCall) -> Self {
        DriverCallCounted {
            tgid: call.tgid,
            function: call.function,
            result: call.result,
            start_ns: call.start_ns,
            end_ns: call.header.ts_ns,
        }
    }
}

/// What the metrics count of the driver call `bytes` hold, if they hold
/// one.
#[inline]
pub fn driver_call_counted(bytes: &[u8]) -> Option<DriverCallCounted> {
    let header = header(bytes)?;
    let size = usize::from(header.size);
    if header.kind != RecordKind::CudaCall as u16
        || CudaCall::words_of_size(size).is_none()
        || bytes.len() < size
    {
        return None;
    }
    fn field<T: Copy>(bytes: &[u8], offset: usize) -> T {
        assert!(offset + size_of::<T>() <= CudaCall::FIXED_SIZE);
        // SAFETY: inside the record, whose length was checked; an
        // unaligned read of a plain integer.
        unsafe { std::ptr::read_unaligned(bytes.as_ptr().add(offset).cast::<T>()) }
    }
    Some(DriverCallCounted {
        tgid: field(bytes, std::mem::offset_of!(CudaCall, tgid)),
        function: field(bytes, std::mem::offset_of!(CudaCall, function)),
        result: field(bytes, std::mem::offset_of!(CudaCall, result)),
        start_ns: field(bytes, std::mem::offset_of!(CudaCall, start_ns)),
        end_ns: header.ts_ns,
    })
}

/// Appends `record` to `out` as the probes write it, which [`decode`]
/// reads back. False, and nothing written, for the records of variable
/// size (stack samples, TraceMe events).
pub fn encode(record: &Record, out: &mut Vec<u8>) -> bool {
    match record {
        Record::Switch(r) => out.extend_from_slice(bytes_of(r)),
        Record::Wakeup(r) => out.extend_from_slice(bytes_of(r)),
        Record::TaskNew(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::Fork(r) => out.extend_from_slice(bytes_of(r)),
        Record::Exit(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::Rename(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::CudaCall(r) => encode_driver_call(r, out),
        Record::CudaSymbol(r) => out.extend_from_slice(bytes_of(&**r)),
        Record::TraceMe(_) | Record::StackSample(_) => return false,
    }
    true
}

/// A driver call as the probes write it: the arguments its flags count (or
/// up to the last that is not 0, if that is further), then its extra words
/// up to the last that is not 0 (the others decode as 0).
fn encode_driver_call(call: &CudaCall, out: &mut Vec<u8>) {
    let carried = |words: &[u64]| words.iter().rposition(|&w| w != 0).map_or(0, |i| i + 1);
    let args = flags::args(call.flags)
        .max(carried(&call.args))
        .min(REGISTER_ARGS);
    let extra = carried(&call.extra);
    let mut fixed = *call;
    fixed.header.size = CudaCall::written_size(args + extra) as u16;
    fixed.flags = flags::with_args(call.flags, args);
    out.extend_from_slice(&bytes_of(&fixed)[..CudaCall::FIXED_SIZE]);
    for word in call.args[..args].iter().chain(&call.extra[..extra]) {
        out.extend_from_slice(&word.to_le_bytes());
    }
}

/// A driver call carries the fixed part and as many words as its size
/// says: the arguments its flags count, then its extra words; the fields
/// not carried read as 0.
fn read_driver_call(bytes: &[u8], claimed: usize) -> Result<CudaCall, DecodeError> {
    let too_short = || DecodeError::Size {
        kind: RecordKind::CudaCall,
        claimed,
        expected: size_of::<CudaCall>(),
        got: bytes.len(),
    };
    let Some(words) = CudaCall::words_of_size(claimed).filter(|_| bytes.len() >= claimed) else {
        return Err(too_short());
    };
    let mut call = std::mem::MaybeUninit::<CudaCall>::zeroed();
    // SAFETY: the fixed part of a `CudaCall` (`claimed` is at least that
    // long, checked above) copied over a zeroed one: all of its fields are
    // plain integers, for which any bytes are a value.
    let mut call = unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            call.as_mut_ptr().cast::<u8>(),
            CudaCall::FIXED_SIZE,
        );
        call.assume_init()
    };
    let mut carried = bytes[CudaCall::FIXED_SIZE..claimed]
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
    if call.flags & flags::PACKED_LAUNCH != 0 {
        if words != PACKED_LAUNCH_WORDS {
            return Err(too_short());
        }
        let mut packed = [0; PACKED_LAUNCH_WORDS];
        for (slot, word) in packed.iter_mut().zip(carried) {
            *slot = word;
        }
        let (args, stack) = unpack_launch(&packed);
        call.args = args;
        call.extra[..stack.len()].copy_from_slice(&stack);
        call.flags = flags::with_args(call.flags & !flags::PACKED_LAUNCH, REGISTER_ARGS);
        return Ok(call);
    }
    let args = flags::args(call.flags);
    if args > REGISTER_ARGS || args > words || words - args > EXTRA_WORDS {
        return Err(too_short());
    }
    for (slot, word) in call.args[..args].iter_mut().zip(&mut carried) {
        *slot = word;
    }
    for (slot, word) in call.extra.iter_mut().zip(carried) {
        *slot = word;
    }
    Ok(call)
}

fn bytes_of<T: aya::Pod>(record: &T) -> &[u8] {
    // SAFETY: a `Pod` record is plain `#[repr(C)]` data without implicit
    // padding: every one of its bytes is initialized.
    unsafe { std::slice::from_raw_parts((record as *const T).cast::<u8>(), size_of::<T>()) }
}

/// A stack sample keeps only the frames the kernel filled in; the copy
/// of the user stack behind it is read by [`user_stack`].
fn read_stack_sample(bytes: &[u8], claimed: usize) -> Result<StackSample, DecodeError> {
    let kind = RecordKind::StackSample;
    check_size(bytes, kind, claimed, size_of::<StackSampleWithCopy>())?;
    let r: StackSampleRecord = read(bytes, kind, size_of::<StackSampleRecord>())?;
    let frames = |n: u32| (n as usize).min(MAX_FRAMES);
    Ok(StackSample {
        header: r.header,
        tid: r.tid,
        tgid: r.tgid,
        user: r.user[..frames(r.user_frames)].into(),
        kernel: r.kernel[..frames(r.kernel_frames)].into(),
        user_unreadable: r.flags & FLAG_USER_UNREADABLE != 0,
        kernel_unreadable: r.flags & FLAG_KERNEL_UNREADABLE != 0,
        off_cpu_us: if r.flags & FLAG_OFF_CPU != 0 {
            r.off_cpu_us.max(1)
        } else {
            0
        },
        syscall: r.syscall,
    })
}

/// The user registers and stack bytes a stack sample record carries
/// (`bytes` decoded as a [`Record::StackSample`]), if it copied any.
#[cfg(target_arch = "x86_64")]
pub fn user_stack(bytes: &[u8]) -> Option<crate::symbols::unwind::UserStack<'_>> {
    if bytes.len() < size_of::<StackSampleWithCopy>() {
        return None;
    }
    // SAFETY: length checked; a plain #[repr(C)] record; unaligned read.
    let r: StackSampleRecord = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let len = (r.stack_len as usize).min(STACK_COPY_BYTES);
    if len == 0 {
        return None;
    }
    let stack = &bytes[size_of::<StackSampleRecord>()..][..len];
    let [ip, sp, bp] = r.user_regs;
    Some(crate::symbols::unwind::UserStack {
        ip,
        sp,
        bp,
        bytes: stack,
    })
}

/// A TraceMe record is its fixed part plus the copied name, rounded up to
/// 8 bytes: both sizes must agree.
fn read_traceme(bytes: &[u8], claimed: usize) -> Result<TraceMeEvent, DecodeError> {
    let kind = RecordKind::TraceMe;
    let full = size_of::<TraceMeRecord>();
    if claimed < TRACEME_PREFIX || claimed > full || bytes.len() < claimed {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected: TRACEME_PREFIX,
            got: bytes.len(),
        });
    }
    // Only the fixed part is copied out; the name is read in place.
    let mut fixed = std::mem::MaybeUninit::<TraceMeRecord>::uninit();
    let p = fixed.as_mut_ptr();
    // SAFETY: `bytes` holds at least TRACEME_PREFIX bytes, which cover every
    // field before `name`; only those fields are read, through raw pointers.
    let (header, tid, tgid, site, start_time, end_time, name_len, copied, flags) = unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast::<u8>(), TRACEME_PREFIX);
        (
            (&raw const (*p).header).read(),
            (&raw const (*p).tid).read(),
            (&raw const (*p).tgid).read(),
            (&raw const (*p).site).read(),
            (&raw const (*p).start_time).read(),
            (&raw const (*p).end_time).read(),
            (&raw const (*p).name_len).read(),
            usize::from((&raw const (*p).copied).read()),
            (&raw const (*p).flags).read(),
        )
    };
    if traceme_record_size(copied) != claimed {
        return Err(DecodeError::Size {
            kind,
            claimed,
            expected: traceme_record_size(copied),
            got: bytes.len(),
        });
    }
    let name_unreadable = flags & FLAG_NAME_UNREADABLE != 0;
    Ok(TraceMeEvent {
        header,
        tid,
        tgid,
        site,
        start_time,
        end_time,
        name: String::from_utf8_lossy(&bytes[TRACEME_PREFIX..TRACEME_PREFIX + copied]).into_owned(),
        truncated: !name_unreadable && name_len as usize > copied,
        name_len,
        name_unreadable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T>(v: &T) -> Vec<u8> {
        // SAFETY: reading the bytes of a plain record.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    /// Captures hold millions of records: one costs what a switch costs.
    #[test]
    fn a_record_is_a_switch_and_its_tag() {
        assert!(size_of::<Record>() <= size_of::<SchedSwitch>() + 8);
    }

    #[test]
    fn decodes_a_switch() {
        let mut rec = SchedSwitch {
            header: RecordHeader::new(RecordKind::SchedSwitch, size_of::<SchedSwitch>(), 1, 99),
            prev_tid: 10,
            prev_tgid: 10,
            next_tid: 11,
            next_tgid: 0,
        };
        rec.header.detail = tracer_common::PREEMPTED as u16;
        let Record::Switch(got) = decode(&bytes_of(&rec)).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((got.prev_tid, got.next_tid, got.header.ts_ns), (10, 11, 99));
        assert_eq!(
            (got.header.cpu, got.prev_state()),
            (1, tracer_common::PREEMPTED)
        );
    }

    /// What the metrics read of a driver call in place is what decoding
    /// the whole call gives; any other record, or a call of another size,
    /// gives nothing.
    #[test]
    fn a_driver_call_is_counted_from_its_bytes_as_decoded() {
        let call = CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 3, 9_000),
            tid: 41,
            tgid: 40,
            start_ns: 8_500,
            function: 17,
            flags: flags::with_args(!flags::PACKED_LAUNCH, 6),
            result: 700,
            args: [u64::MAX; 6],
            extra: [u64::MAX; 8],
            out_value: u64::MAX,
        };
        let bytes = bytes_of(&call);
        let Record::CudaCall(decoded) = decode(&bytes).unwrap() else {
            panic!("wrong kind")
        };
        let counted = driver_call_counted(&bytes).unwrap();
        assert_eq!(counted, DriverCallCounted::from(&*decoded));
        assert_eq!(
            (counted.tgid, counted.function, counted.result),
            (40, 17, 700)
        );
        assert_eq!((counted.start_ns, counted.end_ns), (8_500, 9_000));
        assert_eq!(driver_call_counted(&bytes[..bytes.len() - 1]), None);
        let switch = SchedSwitch {
            header: RecordHeader::new(RecordKind::SchedSwitch, size_of::<SchedSwitch>(), 1, 99),
            prev_tid: 10,
            prev_tgid: 10,
            next_tid: 11,
            next_tgid: 0,
        };
        assert_eq!(driver_call_counted(&bytes_of(&switch)), None);
    }

    /// A call written with only the arguments its function takes and the
    /// extra words its shape fills (a `cuLaunchKernelEx` carries four and
    /// five) decodes with the others 0, is held and counted at its own
    /// length, and encodes back to the same bytes.
    #[test]
    fn a_driver_call_carries_only_its_functions_words() {
        let mut call = CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, CudaCall::written_size(9), 1, 20),
            tid: 2,
            tgid: 2,
            start_ns: 10,
            function: 5,
            flags: flags::with_args(0, 4),
            result: 0,
            args: [1, 2, 0, 4, 0, 0],
            extra: [7, 8, 9, 10, 11, 0, 0, 0],
            out_value: 12,
        };
        let mut written = bytes_of(&call)[..CudaCall::FIXED_SIZE].to_vec();
        for w in [1u64, 2, 0, 4, 7, 8, 9, 10, 11] {
            written.extend_from_slice(&w.to_le_bytes());
        }
        // What follows a record in the ring is not part of it.
        let mut in_ring = written.clone();
        in_ring.extend_from_slice(&[0xff; 64]);
        let Record::CudaCall(decoded) = decode(&in_ring).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((decoded.args, decoded.extra), (call.args, call.extra));
        assert_eq!((decoded.out_value, decoded.start_ns), (12, 10));
        assert_eq!(held_record_len(&in_ring), Some(written.len()));
        assert_eq!(driver_call_counted(&in_ring).unwrap().start_ns, 10);
        let mut encoded = Vec::new();
        assert!(encode(&Record::CudaCall(decoded), &mut encoded));
        assert_eq!(encoded, written);

        // A call made without saying how many arguments it carries keeps
        // those that are not 0.
        call.flags = 0;
        let mut encoded = Vec::new();
        assert!(encode(&Record::CudaCall(Box::new(call)), &mut encoded));
        let Record::CudaCall(decoded) = decode(&encoded).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((decoded.args, decoded.extra), (call.args, call.extra));

        // A size between two whole words, one cut short, or more
        // arguments than the record or a call has, is refused.
        let torn = [
            (CudaCall::written_size(9) - 4, written.len(), 4),
            (written.len(), written.len() - 1, 4),
            (CudaCall::written_size(3), CudaCall::written_size(3), 4),
            (written.len(), written.len(), 7),
        ];
        for (size, len, args) in torn {
            let mut bytes = written.clone();
            bytes.truncate(len);
            let mut header = call.header;
            header.size = size as u16;
            bytes[..size_of::<RecordHeader>()].copy_from_slice(&bytes_of(&header));
            let at = std::mem::offset_of!(CudaCall, flags);
            bytes[at..at + 2].copy_from_slice(&flags::with_args(0, args).to_le_bytes());
            assert!(decode(&bytes).is_err(), "{size} {len} {args}");
            if len < size || size % 8 != 0 {
                assert_eq!(held_record_len(&bytes), None, "{size} {len}");
                assert_eq!(driver_call_counted(&bytes), None, "{size} {len}");
            }
        }
    }

    /// A launch written packed decodes to its arguments and stack words,
    /// as if written whole, and encodes whole; one packed into any other
    /// number of words is refused.
    #[test]
    fn a_packed_launch_decodes_as_a_whole_one() {
        let args = [0x7f00_1234_5678, 16, 2, 1, 256, 1];
        let mut extra = [0; 8];
        extra[..3].copy_from_slice(&[4, 1024, 0x5555_0000_1000]);
        let call = CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, CudaCall::written_size(6), 1, 20),
            tid: 2,
            tgid: 2,
            start_ns: 10,
            function: 0,
            flags: flags::with_args(flags::PACKED_LAUNCH, 6),
            result: 0,
            args: [0; 6],
            extra: [0; 8],
            out_value: 0,
        };
        let mut written = bytes_of(&call)[..CudaCall::FIXED_SIZE].to_vec();
        for w in tracer_common::cuda::pack_launch(&args, &extra) {
            written.extend_from_slice(&w.to_le_bytes());
        }
        assert_eq!(written.len(), 96);
        assert_eq!(held_record_len(&written), Some(96));
        let Record::CudaCall(decoded) = decode(&written).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((decoded.args, decoded.extra), (args, extra));
        assert_eq!(decoded.flags, flags::with_args(0, 6));
        let mut whole = Vec::new();
        assert!(encode(&Record::CudaCall(decoded.clone()), &mut whole));
        let Record::CudaCall(again) = decode(&whole).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((again.args, again.extra), (args, extra));

        let mut short = written[..88].to_vec();
        let mut header = call.header;
        header.size = 88;
        short[..size_of::<RecordHeader>()].copy_from_slice(&bytes_of(&header));
        assert!(decode(&short).is_err());
    }

    /// A wake-up's target CPU and whether it is a new task's share the
    /// header's `detail`, each read back as written.
    #[test]
    fn decodes_a_wakeup_of_a_new_task_and_its_target_cpu() {
        for (cpu, new) in [
            (0, false),
            (0, true),
            (5, true),
            (4095, false),
            (32767, true),
        ] {
            let mut rec = SchedWakeup {
                header: RecordHeader::new(RecordKind::SchedWakeup, size_of::<SchedWakeup>(), 3, 7),
                tid: 1,
                tgid: 1,
                waker_tid: 2,
                waker_tgid: 2,
            };
            rec.header.detail = SchedWakeup::detail(cpu, new);
            let Record::Wakeup(got) = decode(&bytes_of(&rec)).unwrap() else {
                panic!("wrong kind")
            };
            assert_eq!((got.target_cpu(), got.is_new()), (cpu, new));
            assert_eq!((got.header.cpu, got.waker_tid), (3, 2));
        }
    }

    #[test]
    fn rejects_bad_sizes_and_kinds() {
        let mut rec = SchedWakeup {
            header: RecordHeader::new(RecordKind::SchedWakeup, 8, 0, 0),
            tid: 1,
            tgid: 1,
            waker_tid: 2,
            waker_tgid: 2,
        };
        assert!(matches!(
            decode(&bytes_of(&rec)),
            Err(DecodeError::Size { .. })
        ));
        rec.header.kind = 77;
        assert_eq!(
            decode(&bytes_of(&rec)).unwrap_err(),
            DecodeError::UnknownKind(77)
        );
        assert_eq!(decode(&[0u8; 3]).unwrap_err(), DecodeError::Short(3));
    }

    fn traceme_bytes(name: &[u8], name_len: u32) -> Vec<u8> {
        let size = traceme_record_size(name.len());
        let mut rec = TraceMeRecord {
            header: RecordHeader::new(RecordKind::TraceMe, size, 0, 5),
            tid: 7,
            tgid: 6,
            site: 0x1000,
            start_time: 100,
            end_time: 200,
            name_len,
            copied: name.len() as u16,
            flags: 0,
            name: [0; tracer_common::traceme::NAME_CAP],
        };
        rec.name[..name.len()].copy_from_slice(name);
        bytes_of(&rec)[..size].to_vec()
    }

    #[test]
    fn decodes_variable_size_traceme_records() {
        let Record::TraceMe(ev) = decode(&traceme_bytes(b"step#step_num=3#", 16)).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!(ev.name, "step#step_num=3#");
        assert_eq!((ev.tid, ev.tgid, ev.site), (7, 6, 0x1000));
        assert_eq!((ev.start_time, ev.end_time, ev.header.ts_ns), (100, 200, 5));
        assert!(!ev.truncated && !ev.name_unreadable);

        let Record::TraceMe(cut) = decode(&traceme_bytes(b"abc", 5000)).unwrap() else {
            panic!("wrong kind")
        };
        assert!(cut.truncated);
        assert_eq!(cut.name_len, 5000);

        // A size that disagrees with the copied length is refused.
        let mut bad = traceme_bytes(b"abcdefghij", 10);
        bad[2] = 56;
        bad.truncate(56);
        assert!(matches!(decode(&bad), Err(DecodeError::Size { .. })));
    }

    #[test]
    fn decodes_a_stack_sample_and_keeps_only_filled_frames() {
        let mut rec = Box::new(StackSampleWithCopy {
            sample: StackSampleRecord {
                header: RecordHeader::new(
                    RecordKind::StackSample,
                    size_of::<StackSampleWithCopy>(),
                    1,
                    42,
                ),
                tid: 8,
                tgid: 7,
                user_frames: 2,
                kernel_frames: 0,
                flags: FLAG_KERNEL_UNREADABLE,
                off_cpu_us: 0,
                user: [0xdead; MAX_FRAMES],
                kernel: [0; MAX_FRAMES],
                user_regs: [0x1000, 0x7ff0, 0x7ff8],
                stack_len: 16,
                syscall: 0,
            },
            stack: [0xab; STACK_COPY_BYTES],
        });
        rec.sample.user[1] = 0xbeef;
        let bytes = bytes_of(&*rec);
        let Record::StackSample(s) = decode(&bytes).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!((s.tid, s.tgid, s.header.ts_ns), (8, 7, 42));
        assert_eq!(&*s.user, &[0xdead, 0xbeef]);
        assert!(s.kernel.is_empty() && s.kernel_unreadable && !s.user_unreadable);
        let stack = user_stack(&bytes).expect("a copied stack");
        assert_eq!((stack.ip, stack.sp, stack.bp), (0x1000, 0x7ff0, 0x7ff8));
        assert_eq!(stack.bytes, &[0xab; 16]);

        // A frame count past the array, or a copy longer than the buffer,
        // is cut to it, never read beyond.
        rec.sample.user_frames = u32::MAX;
        rec.sample.stack_len = u32::MAX;
        let bytes = bytes_of(&*rec);
        let Record::StackSample(s) = decode(&bytes).unwrap() else {
            panic!("wrong kind")
        };
        assert_eq!(s.user.len(), MAX_FRAMES);
        assert_eq!(user_stack(&bytes).unwrap().bytes.len(), STACK_COPY_BYTES);

        // Without a copy, there is nothing to unwind.
        rec.sample.stack_len = 0;
        assert!(user_stack(&bytes_of(&*rec)).is_none());
        assert!(!s.is_off_cpu());

        // An off-CPU stack says how long its thread waited, and in which
        // system call; a sample's fields there are not read.
        rec.sample.flags = FLAG_OFF_CPU;
        rec.sample.off_cpu_us = 12_000;
        rec.sample.syscall = 202;
        let Record::StackSample(s) = decode(&bytes_of(&*rec)).unwrap() else {
            panic!("wrong kind")
        };
        assert!(s.is_off_cpu());
        assert_eq!((s.off_cpu_us, s.syscall), (12_000, 202));
        rec.sample.flags = 0;
        let Record::StackSample(s) = decode(&bytes_of(&*rec)).unwrap() else {
            panic!("wrong kind")
        };
        assert!(!s.is_off_cpu());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Whatever the ring buffer holds, decoding answers.
        #[test]
        fn any_bytes_decode_or_are_refused(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1200),
            kind in 0u16..12,
            size in proptest::prelude::any::<u16>(),
        ) {
            let _ = decode(&bytes);
            // The same bytes behind a header of a real kind and any size.
            let mut framed = bytes_of(&RecordHeader::new(RecordKind::SchedSwitch, 0, 0, 0));
            framed[..2].copy_from_slice(&kind.to_ne_bytes());
            framed[2..4].copy_from_slice(&size.to_ne_bytes());
            framed.extend_from_slice(&bytes);
            let _ = decode(&framed);
        }

        /// A TraceMe record whose target wrote any name and any lengths:
        /// decoded as written when its sizes agree, refused otherwise.
        #[test]
        fn traceme_records_from_a_hostile_target(
            name in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..=1024),
            name_len in proptest::prelude::any::<u32>(),
            copied in proptest::prelude::any::<u16>(),
            flags in proptest::prelude::any::<u16>(),
            keep in 0usize..1200,
        ) {
            let mut bytes = traceme_bytes(&name, name_len);
            let copied_at = std::mem::offset_of!(TraceMeRecord, copied);
            let flags_at = std::mem::offset_of!(TraceMeRecord, flags);
            bytes[flags_at..flags_at + 2].copy_from_slice(&flags.to_ne_bytes());
            let honest = decode(&bytes);
            let Ok(Record::TraceMe(ev)) = honest else {
                panic!("a well-formed record was refused: {honest:?}");
            };
            proptest::prop_assert_eq!(&ev.name, &String::from_utf8_lossy(&name));
            let unreadable = flags & FLAG_NAME_UNREADABLE != 0;
            proptest::prop_assert_eq!(ev.name_unreadable, unreadable);
            proptest::prop_assert_eq!(ev.truncated, !unreadable && name_len as usize > name.len());

            // A lying `copied`, or a record cut short: never read past it.
            bytes[copied_at..copied_at + 2].copy_from_slice(&copied.to_ne_bytes());
            bytes.truncate(keep);
            if let Ok(Record::TraceMe(ev)) = decode(&bytes) {
                // Invalid UTF-8 bytes become three-byte replacement characters.
                proptest::prop_assert!(ev.name.len() <= 3 * usize::from(copied));
                proptest::prop_assert!(usize::from(copied) <= tracer_common::traceme::NAME_CAP);
                proptest::prop_assert_eq!(
                    traceme_record_size(usize::from(copied)),
                    usize::from(ev.header.size)
                );
            }
        }
    }
}
