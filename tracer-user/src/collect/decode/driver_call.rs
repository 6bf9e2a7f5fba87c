//! CUDA driver call records: decoded from the words they carry, written
//! back in as few, and counted for the metrics in place.

use tracer_common::{
    RecordKind,
    cuda::{CudaCall, EXTRA_WORDS, PACKED_LAUNCH_WORDS, REGISTER_ARGS, flags, unpack_launch},
};

use super::{DecodeError, bytes_of, header};

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

/// A driver call as the probes write it: the arguments its flags count (or
/// up to the last that is not 0, if that is further), then its extra words
/// up to the last that is not 0 (the others decode as 0).
pub(super) fn encode_driver_call(call: &CudaCall, out: &mut Vec<u8>) {
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
pub(super) fn read_driver_call(bytes: &[u8], claimed: usize) -> Result<CudaCall, DecodeError> {
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
