//! The decoding of every record family, and of hostile bytes.

use tracer_common::{
    RecordHeader, RecordKind, SchedSwitch, SchedWakeup, TraceMeRecord,
    cuda::{CudaCall, flags},
    python::{
        FRAME_ENTRY, MAX_PYTHON_FRAMES, MAX_PYTHON_WALK, PYTHON_INNER_FRAMES, PYTHON_WALKED,
        PythonFrameRecord, PythonStack, python_slot,
    },
    stack::{
        FLAG_KERNEL_UNREADABLE, FLAG_OFF_CPU, MAX_FRAMES, STACK_COPY_BYTES, StackSampleRecord,
        StackSampleWithCopy,
    },
    traceme::{FLAG_NAME_UNREADABLE, traceme_record_size},
};

use super::{
    DecodeError, DriverCallCounted, Record, decode, driver_call_counted, encode, held_record_len,
    user_stack,
};

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

/// A stack sample whose Python chain, `depth` deep, was written as the
/// program writes it: frame `i`'s code is `i`.
fn sample_of_a_python_chain(depth: usize) -> Box<StackSampleWithCopy> {
    // SAFETY: plain integers, all zeros a valid record.
    let mut rec: Box<StackSampleWithCopy> = Box::new(unsafe { std::mem::zeroed() });
    rec.sample.header = RecordHeader::new(
        RecordKind::StackSample,
        size_of::<StackSampleWithCopy>(),
        0,
        1,
    );
    let python = &mut rec.sample.python;
    for i in 0..depth.min(MAX_PYTHON_WALK) {
        python.frames[python_slot(i)].code = i as u64;
    }
    python.len = depth.min(MAX_PYTHON_FRAMES) as u32;
    python.depth = depth as u32;
    python.flags = PYTHON_WALKED;
    rec
}

#[test]
fn a_python_chain_deeper_than_a_record_keeps_both_ends_in_order() {
    for depth in [
        0,
        1,
        95,
        96,
        97,
        127,
        128,
        129,
        159,
        160,
        161,
        400,
        MAX_PYTHON_WALK,
    ] {
        let rec = sample_of_a_python_chain(depth);
        let Record::StackSample(s) = decode(&bytes_of(&*rec)).unwrap() else {
            panic!("wrong kind")
        };
        let codes: Vec<u64> = s.python.read.iter().map(|f| f.code).collect();
        let kept = depth.min(MAX_PYTHON_FRAMES);
        let outer_from = depth - (kept - kept.min(PYTHON_INNER_FRAMES));
        let expected: Vec<u64> = (0..kept.min(PYTHON_INNER_FRAMES))
            .chain(outer_from..depth)
            .map(|i| i as u64)
            .collect();
        assert_eq!(codes, expected, "{depth}");
        assert_eq!(s.python.left_out as usize, depth - kept, "{depth}");
    }
    // A depth the walk cannot reach is taken as its most.
    let mut rec = sample_of_a_python_chain(MAX_PYTHON_WALK);
    rec.sample.python.depth = u32::MAX;
    let Record::StackSample(s) = decode(&bytes_of(&*rec)).unwrap() else {
        panic!("wrong kind")
    };
    assert_eq!(
        s.python.left_out as usize,
        MAX_PYTHON_WALK - MAX_PYTHON_FRAMES
    );
    assert_eq!(s.python.read.len(), MAX_PYTHON_FRAMES);
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
            python: PythonStack {
                len: 1,
                flags: PYTHON_WALKED,
                depth: 1,
                _pad: 0,
                frames: [PythonFrameRecord {
                    code: 0x5000,
                    instruction: 0x5100,
                    first_line: 12,
                    flags: FRAME_ENTRY,
                }; MAX_PYTHON_FRAMES],
            },
        },
        stack: [0xab; STACK_COPY_BYTES],
    });
    rec.sample.user[1] = 0xbeef;
    let bytes = bytes_of(&*rec);
    let Record::StackSample(s) = decode(&bytes).unwrap() else {
        panic!("wrong kind")
    };
    assert_eq!(s.python.read.len(), 1, "only the frames the walk filled");
    assert_eq!(s.python.read[0].code, 0x5000);
    assert_eq!(s.python.flags, PYTHON_WALKED);
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
