//! Each ATen op's input shapes, read from its arguments as PyTorch boxed
//! them for the callbacks, as torch.profiler's `record_shapes` gives them
//! (`[[64, 256], [256], []]`: a list per argument, empty for one that is no
//! plain tensor).
//!
//! PyTorch's own reader (`torch::profiler::impl::inputSizes`) can throw (a
//! nested tensor, symbolic sizes), and nothing may unwind through the
//! agent; so the agent reads the tensors itself, only where the code of
//! that reader and of `TensorImpl::sizes_custom`, in the very libraries the
//! process runs, reads them at the offsets used here:
//!
//! - an argument (`c10::IValue`, 16 bytes) is a tensor when its tag, at
//!   byte 8, is 1; its payload is then the `TensorImpl*`, or PyTorch's
//!   undefined tensor;
//! - byte 0xa6 of a `TensorImpl` holds its sizes policy (bits 2-3, above 1:
//!   custom sizes, nested tensors among them) and whether its sizes are
//!   symbolic (bit 4): such tensors get an empty list, as torch.profiler's
//!   own encoder gives them;
//! - its dimensions' count is at 0x38, its sizes at 0x40: in place up to 5
//!   of them, else behind a pointer there.

/// `torch::profiler::impl::inputSizes(const at::RecordFunction&, bool)`.
pub const INPUT_SIZES: &core::ffi::CStr =
    c"_ZN5torch8profiler4impl10inputSizesERKN2at14RecordFunctionEb";
/// `c10::TensorImpl::sizes_custom() const`, in `libc10.so`.
pub const SIZES_CUSTOM: &core::ffi::CStr = c"_ZNK3c1010TensorImpl12sizes_customEv";
/// `c10::UndefinedTensorImpl::_singleton`, in `libc10.so`.
pub const UNDEFINED_TENSOR: &core::ffi::CStr = c"_ZN3c1019UndefinedTensorImpl10_singletonE";

/// Bytes of `inputSizes`'s code searched.
pub const INPUT_SIZES_BYTES: usize = 1024;
/// Bytes of `sizes_custom`'s code searched.
pub const SIZES_CUSTOM_BYTES: usize = 256;

/// What `inputSizes` must do: test an argument's tag against 1, read the
/// sizes policy, read the dimensions' count and keep up to 5 in place.
const INPUT_SIZES_CODE: [&[u8]; 3] = [
    &[0x41, 0x8b, 0x46, 0x08, 0x83, 0xf8, 0x01],
    &[
        0x0f, 0xb6, 0x87, 0xa6, 0, 0, 0, 0xc0, 0xe8, 0x02, 0x83, 0xe0, 0x03, 0x3c, 0x01,
    ],
    &[0x4c, 0x8b, 0x6f, 0x38, 0x49, 0x83, 0xfd, 0x05],
];
/// What `sizes_custom` must do: test the symbolic bit, read the count,
/// and take the sizes in place or behind the pointer.
const SIZES_CUSTOM_CODE: [&[u8]; 4] = [
    &[0xf6, 0x87, 0xa6, 0, 0, 0, 0x10],
    &[0x48, 0x8b, 0x57, 0x38, 0x48, 0x83, 0xfa, 0x05],
    &[0x48, 0x8d, 0x47, 0x40],
    &[0x48, 0x8b, 0x47, 0x40],
];

const TAG_AT: usize = 8;
const TAG_TENSOR: u32 = 1;
const IVALUE_BYTES: usize = 16;
const FLAGS_AT: usize = 0xa6;
const DIMS_AT: usize = 0x38;
const SIZES_AT: usize = 0x40;
const MAX_INLINE_DIMS: u64 = 5;
/// Arguments and dimensions read at most (more: the text says `...`).
const MAX_ARGS: usize = 32;
const MAX_DIMS: u64 = 16;

/// Whether the code of `inputSizes` and `sizes_custom` reads tensors as
/// [`write`] does; the error says which does not.
pub fn check(input_sizes: &[u8], sizes_custom: &[u8]) -> Result<(), &'static str> {
    let has = |code: &[u8], part: &[u8]| code.windows(part.len()).any(|w| w == part);
    if !INPUT_SIZES_CODE.iter().all(|p| has(input_sizes, p)) {
        return Err("inputSizes does not read tensors as the agent does");
    }
    if !SIZES_CUSTOM_CODE.iter().all(|p| has(sizes_custom, p)) {
        return Err("TensorImpl::sizes_custom does not read sizes as the agent does");
    }
    Ok(())
}

/// A fixed buffer the text is written into.
pub struct ShapesText {
    buf: [u8; crate::op_records::MAX_NAME_LEN],
    len: usize,
}

impl ShapesText {
    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn number(&mut self, mut v: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }

    /// The text, or `None` if it did not fit.
    pub fn bytes(&self) -> Option<&[u8]> {
        (self.len < self.buf.len()).then_some(&self.buf[..self.len])
    }
}

/// The shapes of the `len` arguments at `args`; `undefined` is PyTorch's
/// undefined tensor.
///
/// # Safety
/// `args` points at `len` live `c10::IValue`s laid out as [`check`]
/// found, whose tensors are live, in a start callback.
pub unsafe fn write(args: *const u8, len: usize, undefined: usize) -> ShapesText {
    let mut text = ShapesText {
        buf: [0; crate::op_records::MAX_NAME_LEN],
        len: 0,
    };
    text.push(b"[");
    for i in 0..len.min(MAX_ARGS) {
        if i > 0 {
            text.push(b", ");
        }
        text.push(b"[");
        // SAFETY: argument `i` of the caller's; a tensor's implementation
        // is live while its argument is.
        unsafe {
            let arg = args.add(i * IVALUE_BYTES);
            let tag = arg.add(TAG_AT).cast::<u32>().read_unaligned();
            let tensor = arg.cast::<usize>().read_unaligned();
            if tag == TAG_TENSOR && tensor != 0 && tensor != undefined {
                let tensor = tensor as *const u8;
                let flags = *tensor.add(FLAGS_AT);
                let plain = (flags >> 2) & 3 <= 1 && flags & 0x10 == 0;
                let dims = tensor.add(DIMS_AT).cast::<u64>().read_unaligned();
                if plain && dims <= MAX_DIMS {
                    let sizes = if dims <= MAX_INLINE_DIMS {
                        tensor.add(SIZES_AT).cast::<i64>()
                    } else {
                        tensor.add(SIZES_AT).cast::<*const i64>().read_unaligned()
                    };
                    for d in 0..dims as usize {
                        if d > 0 {
                            text.push(b", ");
                        }
                        text.number(sizes.add(d).read_unaligned().max(0) as u64);
                    }
                }
            }
        }
        text.push(b"]");
    }
    if len > MAX_ARGS {
        text.push(b", ...");
    }
    text.push(b"]");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in `TensorImpl` with `dims` sizes (in place up to 5).
    fn tensor(sizes: &[i64], flags: u8) -> (Vec<u8>, Vec<i64>) {
        let mut t = vec![0u8; 0x100];
        let outside = sizes.to_vec();
        t[FLAGS_AT] = flags;
        t[DIMS_AT..DIMS_AT + 8].copy_from_slice(&(sizes.len() as u64).to_le_bytes());
        if sizes.len() as u64 <= MAX_INLINE_DIMS {
            for (i, s) in sizes.iter().enumerate() {
                t[SIZES_AT + 8 * i..][..8].copy_from_slice(&s.to_le_bytes());
            }
        } else {
            let p = outside.as_ptr() as usize;
            t[SIZES_AT..SIZES_AT + 8].copy_from_slice(&p.to_le_bytes());
        }
        (t, outside)
    }

    fn arg(payload: usize, tag: u32) -> [u8; 16] {
        let mut a = [0u8; 16];
        a[..8].copy_from_slice(&payload.to_le_bytes());
        a[8..12].copy_from_slice(&tag.to_le_bytes());
        a
    }

    #[test]
    fn shapes_read_as_torch_profiler_writes_them() {
        let (matrix, _m) = tensor(&[64, 256], 0);
        let (scalar, _s) = tensor(&[], 0);
        let (big, _b) = tensor(&[1, 2, 3, 4, 5, 6], 0);
        let (nested, _n) = tensor(&[3, 4], 2 << 2);
        let (symbolic, _y) = tensor(&[3, 4], 0x10);
        let undefined = 0x1000usize;
        let args: Vec<u8> = [
            arg(matrix.as_ptr() as usize, TAG_TENSOR),
            arg(scalar.as_ptr() as usize, TAG_TENSOR),
            arg(big.as_ptr() as usize, TAG_TENSOR),
            arg(undefined, TAG_TENSOR),
            arg(7, 4),
            arg(nested.as_ptr() as usize, TAG_TENSOR),
            arg(symbolic.as_ptr() as usize, TAG_TENSOR),
        ]
        .concat();
        // SAFETY: the stand-ins above, alive until the end.
        let text = unsafe { write(args.as_ptr(), 7, undefined) };
        assert_eq!(
            core::str::from_utf8(text.bytes().unwrap()).unwrap(),
            "[[64, 256], [], [1, 2, 3, 4, 5, 6], [], [], [], []]"
        );
        // SAFETY: no argument.
        let none = unsafe { write(args.as_ptr(), 0, undefined) };
        assert_eq!(none.bytes(), Some(&b"[]"[..]));
    }

    #[test]
    fn code_that_reads_tensors_otherwise_turns_shapes_off() {
        let input_sizes: Vec<u8> = INPUT_SIZES_CODE.concat();
        let sizes_custom: Vec<u8> = SIZES_CUSTOM_CODE.concat();
        assert_eq!(check(&input_sizes, &sizes_custom), Ok(()));
        let mut moved = input_sizes.clone();
        moved[input_sizes.len() - 5] = 0x40;
        assert!(check(&moved, &sizes_custom).is_err());
        assert!(check(&input_sizes, &[]).is_err());
    }
}
