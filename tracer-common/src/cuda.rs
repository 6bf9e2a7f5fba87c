//! Records of the CUDA driver API probes (uprobes on `libcuda.so.1`).
//!
//! The eBPF side knows nothing about individual driver functions: each
//! probe is attached with a cookie ([`cookie`]) that names the function (an
//! index into userspace's table) and which of its arguments is an
//! out-pointer or a name to read. Entry probes save the raw arguments; the
//! return probe writes one [`CudaCall`] per completed call, which userspace
//! decodes by the function's signature.

/// Names of the maps the CUDA programs define.
pub mod names {
    /// Per-CPU outcome counters of the CUDA probes, indexed by [`super::stat`].
    pub const CUDA_STATS: &str = "CUDA_STATS";
}

/// Indices into the per-CPU `CUDA_STATS` array.
pub mod stat {
    /// Calls whose entry could not be saved (no slot in `CUDA_PENDING`): lost.
    pub const PENDING_FULL: u32 = 0;
    /// Returns without a saved entry (entered before the probe was attached).
    pub const UNPAIRED_RETURNS: u32 = 1;
    /// Symbol names longer than [`super::CUDA_NAME_LEN`] - 1 bytes, cut short.
    pub const NAMES_TRUNCATED: u32 = 2;
    /// Number of counters.
    pub const COUNT: u32 = 3;
}

/// Capacity of `CUDA_PENDING`: one slot per thread and driver function it
/// calls, all threads; the least recently used are forgotten first.
pub const MAX_PENDING_CALLS: u32 = 32_768;

/// Bytes of a kernel name the probes copy, terminating NUL included.
pub const CUDA_NAME_LEN: usize = 1024;

/// Which entry program saves a function's arguments. The programs are
/// `cuda_enter_<shape>` in the eBPF object.
pub mod shape {
    /// The six register arguments only.
    pub const REGISTERS: &str = "cuda_enter_registers";
    /// Registers plus the first [`super::STACK_WORDS`] stack arguments
    /// (`cuLaunchKernel` has eleven arguments).
    pub const STACK: &str = "cuda_enter_stack";
    /// Registers plus the fields of the `CUlaunchConfig` argument 0 points to.
    pub const LAUNCH_CONFIG: &str = "cuda_enter_launch_config";
    /// Registers plus the fields of the `CUDA_MEMCPY2D` argument 0 points to.
    pub const MEMCPY2D: &str = "cuda_enter_memcpy2d";
    /// Registers plus the fields of the `CUDA_MEMCPY3D` argument 0 points to.
    pub const MEMCPY3D: &str = "cuda_enter_memcpy3d";
    /// The one return program shared by every function.
    pub const RETURN: &str = "cuda_return";
}

/// Stack words saved by the `STACK` shape: arguments 7, 8, 9 (x86-64 SysV).
pub const STACK_WORDS: usize = 3;

/// Byte offsets of the 8-byte words the struct shapes read, in
/// [`CudaCall::extra`] order. Both sides use these tables.
pub mod layout {
    /// `CUlaunchConfig`: gridDimX|Y, gridDimZ|blockDimX, blockDimY|Z,
    /// sharedMemBytes|pad, hStream.
    pub const LAUNCH_CONFIG: [usize; 5] = [0, 8, 16, 24, 32];
    /// `CUDA_MEMCPY2D`: srcMemoryType, srcDevice, dstMemoryType, dstDevice,
    /// WidthInBytes, Height.
    pub const MEMCPY2D: [usize; 6] = [16, 32, 72, 88, 112, 120];
    /// `CUDA_MEMCPY3D`: srcMemoryType, srcDevice, dstMemoryType, dstDevice,
    /// WidthInBytes, Height, Depth.
    pub const MEMCPY3D: [usize; 7] = [32, 48, 120, 136, 176, 184, 192];
}

/// The attach cookie: bits 0..16 the function's index in userspace's table;
/// bits 16..20 one plus the index of an out-pointer argument whose target
/// the return probe reads (0: none); bits 20..24 one plus the index of a
/// `const char *` name argument copied on success (0: none); bit 24 set
/// when the function has no return probe: its entry probe writes the
/// [`CudaCall`] itself ([`flags::ENTRY_ONLY`]); bits 25..29 how many
/// words of [`CudaCall::extra`] its entry program fills; bits 29..32 how
/// many arguments the function takes in registers (at most six). The
/// record carries those arguments and words, no more
/// ([`CudaCall::written_size`]).
pub mod cookie {
    /// Bits of the function's index.
    pub const FUNCTION_MASK: u64 = 0xffff;
    /// Shift of the out-pointer argument's field (one plus its index).
    pub const OUT_SHIFT: u32 = 16;
    /// Shift of the name argument's field (one plus its index).
    pub const NAME_SHIFT: u32 = 20;
    /// Set when the function has no return probe.
    pub const ENTRY_ONLY: u64 = 1 << 24;
    /// Shift of the count of [`super::CudaCall::extra`] words.
    pub const EXTRA_SHIFT: u32 = 25;
    /// Shift of the count of register arguments.
    pub const ARGS_SHIFT: u32 = 29;
    /// Set when the function submits work to a GPU (a launch, a copy, a
    /// memset): its calls carry the stack they were made from.
    pub const SUBMITS: u64 = 1 << 32;

    /// The cookie of a function probed at its entry and return: its index
    /// `function`, the register arguments and extra words its record
    /// carries, and its out-pointer and name arguments, if any.
    pub const fn encode(
        function: u16,
        args: usize,
        extra_words: usize,
        out_arg: Option<u8>,
        name_arg: Option<u8>,
    ) -> u64 {
        let out = match out_arg {
            Some(i) => i as u64 + 1,
            None => 0,
        };
        let name = match name_arg {
            Some(i) => i as u64 + 1,
            None => 0,
        };
        function as u64
            | (out & 0xf) << OUT_SHIFT
            | (name & 0xf) << NAME_SHIFT
            | (extra_words as u64 & 0xf) << EXTRA_SHIFT
            | (args as u64 & 0x7) << ARGS_SHIFT
    }

    /// The cookie of a function probed at its entry only (it has neither
    /// an out-pointer nor a name to read after the call).
    pub const fn encode_entry_only(function: u16, args: usize, extra_words: usize) -> u64 {
        encode(function, args, extra_words, None, None) | ENTRY_ONLY
    }

    /// How many of the six register arguments the function's record
    /// carries.
    pub const fn args(cookie: u64) -> usize {
        let n = ((cookie >> ARGS_SHIFT) & 0x7) as usize;
        if n > super::REGISTER_ARGS {
            super::REGISTER_ARGS
        } else {
            n
        }
    }

    /// How many words of [`super::CudaCall::extra`] the function's record
    /// carries (at most 8).
    pub const fn extra_words(cookie: u64) -> usize {
        let n = ((cookie >> EXTRA_SHIFT) & 0xf) as usize;
        if n > super::EXTRA_WORDS {
            super::EXTRA_WORDS
        } else {
            n
        }
    }

    /// The function's index in userspace's table.
    pub const fn function(cookie: u64) -> u16 {
        (cookie & FUNCTION_MASK) as u16
    }

    /// Whether the function is probed at its entry only.
    pub const fn entry_only(cookie: u64) -> bool {
        cookie & ENTRY_ONLY != 0
    }

    /// Whether the function submits work to a GPU.
    pub const fn submits(cookie: u64) -> bool {
        cookie & SUBMITS != 0
    }

    /// Index of the out-pointer argument, if any.
    pub const fn out_arg(cookie: u64) -> Option<usize> {
        match (cookie >> OUT_SHIFT) & 0xf {
            0 => None,
            n => Some(n as usize - 1),
        }
    }

    /// Index of the name argument, if any.
    pub const fn name_arg(cookie: u64) -> Option<usize> {
        match (cookie >> NAME_SHIFT) & 0xf {
            0 => None,
            n => Some(n as usize - 1),
        }
    }
}

/// Bits of [`CudaCall::flags`].
pub mod flags {
    /// Written at the call's entry, by a function probed there only: the
    /// call took no time as recorded, and its `result` is not known (0).
    pub const ENTRY_ONLY: u16 = 1;
    /// A `cuLaunchKernel` (or its cooperative and per-thread kin) whose
    /// 32-bit arguments, the grid and block dimensions and the shared
    /// memory bytes, are packed two to a word ([`super::pack_launch`]): six
    /// words rather than its six register arguments and three stack words.
    pub const PACKED_LAUNCH: u16 = 2;
    /// Bits 8..11: how many of [`super::CudaCall::args`] the record
    /// carries (the function's register arguments); the others read as 0.
    pub const ARGS_SHIFT: u16 = 8;
    /// The bits that hold the argument count.
    pub const ARGS_MASK: u16 = 0x7 << ARGS_SHIFT;

    /// `flags` saying the record carries `args` arguments.
    pub const fn with_args(flags: u16, args: usize) -> u16 {
        (flags & !ARGS_MASK) | ((args as u16) << ARGS_SHIFT & ARGS_MASK)
    }

    /// How many arguments a record with `flags` carries (possibly more
    /// than it can: the decoder checks).
    pub const fn args(flags: u16) -> usize {
        ((flags & ARGS_MASK) >> ARGS_SHIFT) as usize
    }
}

/// Arguments passed in registers (x86-64 SysV: rdi, rsi, rdx, rcx, r8, r9).
pub const REGISTER_ARGS: usize = 6;

/// Words of a [`flags::PACKED_LAUNCH`] record.
pub const PACKED_LAUNCH_WORDS: usize = 6;

/// A `cuLaunchKernel`'s register arguments (function, grid x, y, z, block
/// x, y) and stack words (block z, shared memory bytes, stream) in
/// [`PACKED_LAUNCH_WORDS`] words: the function, the seven 32-bit values two
/// to a word (the low half first), the stream. The registers' and stack
/// slots' upper halves are not the caller's to set and are left out.
#[inline(always)]
pub fn pack_launch(
    args: &[u64; REGISTER_ARGS],
    extra: &[u64; EXTRA_WORDS],
) -> [u64; PACKED_LAUNCH_WORDS] {
    let pair = |low: u64, high: u64| (low & 0xffff_ffff) | (high << 32);
    [
        args[0],
        pair(args[1], args[2]),
        pair(args[3], args[4]),
        pair(args[5], extra[0]),
        extra[1] & 0xffff_ffff,
        extra[2],
    ]
}

/// The arguments and stack words [`pack_launch`] packed, each 32-bit value
/// zero-extended.
pub fn unpack_launch(
    words: &[u64; PACKED_LAUNCH_WORDS],
) -> ([u64; REGISTER_ARGS], [u64; STACK_WORDS]) {
    let low = |w: u64| w & 0xffff_ffff;
    let high = |w: u64| w >> 32;
    (
        [
            words[0],
            low(words[1]),
            high(words[1]),
            low(words[2]),
            high(words[2]),
            low(words[3]),
        ],
        [high(words[3]), low(words[4]), words[5]],
    )
}

/// Words of stack arguments or struct fields a call can carry.
pub const EXTRA_WORDS: usize = 8;

/// Words of [`PendingCall::extra`] each entry program fills.
pub mod extra_words {
    /// [`super::shape::REGISTERS`]: none.
    pub const REGISTERS: usize = 0;
    /// [`super::shape::STACK`]: the stack arguments.
    pub const STACK: usize = super::STACK_WORDS;
    /// [`super::shape::LAUNCH_CONFIG`]: the words of [`super::layout::LAUNCH_CONFIG`].
    pub const LAUNCH_CONFIG: usize = super::layout::LAUNCH_CONFIG.len();
    /// [`super::shape::MEMCPY2D`]: the words of [`super::layout::MEMCPY2D`].
    pub const MEMCPY2D: usize = super::layout::MEMCPY2D.len();
    /// [`super::shape::MEMCPY3D`]: the words of [`super::layout::MEMCPY3D`].
    pub const MEMCPY3D: usize = super::layout::MEMCPY3D.len();
}

/// A call saved by an entry probe until its return.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PendingCall {
    /// Entry time (`CLOCK_MONOTONIC` ns); 0 marks the slot free, its call
    /// returned.
    pub start_ns: u64,
    /// The six register arguments: rdi, rsi, rdx, rcx, r8, r9.
    pub args: [u64; REGISTER_ARGS],
    /// Stack arguments or struct fields, per the function's shape.
    pub extra: [u64; EXTRA_WORDS],
}

/// One completed driver call; the header's `ts_ns` is the return time (the
/// entry time for a call written at its entry, [`flags::ENTRY_ONLY`]).
///
/// The probes write the fixed part, then only the arguments the function
/// takes in registers ([`flags::args`] says how many), then only the words
/// of `extra` its shape fills (none for most functions, three for
/// `cuLaunchKernel`), one after the other: the header's `size` says how
/// many words there are ([`CudaCall::written_size`]), and the fields not
/// written read as 0. A `cuStreamSynchronize` then takes 56 bytes of the
/// ring (64 with the ring's own header, one cache line) rather than 96
/// (104). A `cuLaunchKernel` is packed ([`flags::PACKED_LAUNCH`]): 96
/// bytes rather than 120.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CudaCall {
    /// Its `size` says how many words follow ([`CudaCall::words_of_size`]).
    pub header: crate::RecordHeader,
    /// Calling thread.
    pub tid: u32,
    /// Thread group of `tid`: a process whose driver calls are recorded.
    pub tgid: u32,
    /// Entry time (`CLOCK_MONOTONIC` ns).
    pub start_ns: u64,
    /// Index of the function in userspace's table (from the cookie).
    pub function: u16,
    /// [`flags`] bits.
    pub flags: u16,
    /// The `CUresult` returned.
    pub result: u32,
    /// The 8 bytes the out-pointer argument points to after the call (0 if
    /// the function has none or they could not be read).
    pub out_value: u64,
    /// The register arguments, as many as [`flags::args`] says; with
    /// [`flags::PACKED_LAUNCH`], the packed words ([`unpack_launch`]).
    pub args: [u64; REGISTER_ARGS],
    /// The stack arguments or struct fields the function's shape saved
    /// ([`PendingCall::extra`]).
    pub extra: [u64; EXTRA_WORDS],
}

impl CudaCall {
    /// Bytes of a record before its words.
    pub const FIXED_SIZE: usize = core::mem::offset_of!(CudaCall, args);

    /// Most words a record carries: every argument and every extra word.
    pub const MAX_WORDS: usize = REGISTER_ARGS + EXTRA_WORDS;

    /// The size of a record carrying `words` words (arguments, then extra
    /// words).
    pub const fn written_size(words: usize) -> usize {
        Self::FIXED_SIZE + words * 8
    }

    /// How many words a record of `size` bytes carries, if a [`CudaCall`]
    /// can have that size.
    pub const fn words_of_size(size: usize) -> Option<usize> {
        if size < Self::FIXED_SIZE || size > core::mem::size_of::<CudaCall>() {
            return None;
        }
        let words = size - Self::FIXED_SIZE;
        if words.is_multiple_of(8) {
            Some(words / 8)
        } else {
            None
        }
    }
}

/// What the probes reserve in the ring for a call carrying `W` words: the
/// fixed part of a [`CudaCall`], then the words.
#[repr(C)]
pub struct CudaCallWritten<const W: usize> {
    /// The fields of a [`CudaCall`] before its `args`.
    pub fixed: [u64; CudaCall::FIXED_SIZE / 8],
    /// The register arguments the record carries, then its extra words.
    pub words: [u64; W],
}

/// A `CUfunction` / `CUkernel` handle and the name it was looked up by
/// (`cuModuleGetFunction`, `cuLibraryGetKernel`), sent when the lookup
/// succeeds.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CudaSymbol {
    /// Written as the lookup returns.
    pub header: crate::RecordHeader,
    /// Thread that made the lookup.
    pub tid: u32,
    /// Thread group of `tid`.
    pub tgid: u32,
    /// The handle the lookup wrote through its out-pointer.
    pub handle: u64,
    /// Bytes copied, terminating NUL included (0: unreadable).
    pub len: u32,
    /// 1 if the name did not fit and was cut short.
    pub truncated: u32,
    /// The name: `len` bytes copied, the last a NUL.
    pub name: [u8; CUDA_NAME_LEN],
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: `PendingCall` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for PendingCall {}
    // SAFETY: `CudaCall` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for CudaCall {}
    // SAFETY: `CudaSymbol` is plain `#[repr(C)]` data without implicit padding.
    unsafe impl aya::Pod for CudaSymbol {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_are_padded_to_8_bytes() {
        assert_eq!(size_of::<PendingCall>(), 120);
        assert_eq!(size_of::<CudaCall>(), 160);
        assert_eq!(CudaCall::FIXED_SIZE, 48);
        assert_eq!(size_of::<CudaCallWritten<9>>(), CudaCall::written_size(9));
        assert_eq!(
            size_of::<CudaCallWritten<{ CudaCall::MAX_WORDS }>>(),
            size_of::<CudaCall>()
        );
        assert_eq!(size_of::<CudaSymbol>(), 40 + CUDA_NAME_LEN);
    }

    #[test]
    fn a_record_size_tells_its_words() {
        for n in 0..=CudaCall::MAX_WORDS {
            assert_eq!(CudaCall::words_of_size(CudaCall::written_size(n)), Some(n));
        }
        for size in [0, 47, 49, 100, 161, 168] {
            assert_eq!(CudaCall::words_of_size(size), None, "{size}");
        }
    }

    #[test]
    fn flags_carry_the_argument_count_beside_the_other_bits() {
        for n in 0..=REGISTER_ARGS {
            let f = flags::with_args(flags::ENTRY_ONLY, n);
            assert_eq!(flags::args(f), n);
            assert_eq!(f & flags::ENTRY_ONLY, flags::ENTRY_ONLY);
            assert_eq!(flags::args(flags::with_args(f, 2)), 2);
        }
    }

    #[test]
    fn a_launch_packs_and_unpacks_its_32_bit_arguments() {
        let garbage = 0xdead_beef_0000_0000;
        let args = [
            0x7f00_1234_5678,
            garbage | 16,
            garbage | 2,
            1,
            256,
            garbage | 1,
        ];
        let mut extra = [0; EXTRA_WORDS];
        extra[..3].copy_from_slice(&[garbage | 4, garbage | 1024, 0x5555_0000_1000]);
        let (a, x) = unpack_launch(&pack_launch(&args, &extra));
        assert_eq!(a, [0x7f00_1234_5678, 16, 2, 1, 256, 1]);
        assert_eq!(x, [4, 1024, 0x5555_0000_1000]);
    }

    #[test]
    fn cookies_round_trip() {
        let c = cookie::encode(513, 6, 3, Some(0), Some(2));
        assert_eq!(cookie::function(c), 513);
        assert_eq!(cookie::out_arg(c), Some(0));
        assert_eq!(cookie::name_arg(c), Some(2));
        assert_eq!(cookie::extra_words(c), 3);
        assert_eq!(cookie::args(c), 6);
        assert!(!cookie::entry_only(c));
        let c = cookie::encode(7, 0, 8, None, None);
        assert_eq!((cookie::out_arg(c), cookie::name_arg(c)), (None, None));
        assert_eq!(cookie::extra_words(c), 8);
        assert_eq!(cookie::args(c), 0);
        let c = cookie::encode_entry_only(513, 1, 0);
        assert_eq!(cookie::function(c), 513);
        assert!(cookie::entry_only(c));
        assert_eq!((cookie::out_arg(c), cookie::name_arg(c)), (None, None));
        assert_eq!((cookie::args(c), cookie::extra_words(c)), (1, 0));
        // More than a record has are read as all of them.
        assert_eq!(cookie::extra_words(cookie::encode(1, 0, 15, None, None)), 8);
        assert_eq!(cookie::args(cookie::encode(1, 7, 0, None, None)), 6);
    }
}
