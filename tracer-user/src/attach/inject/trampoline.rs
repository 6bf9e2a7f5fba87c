//! The trampoline: a page of machine code in the target through which the
//! hijacked thread calls one function and then restores its own state and
//! returns to its own code, by itself.
//!
//! ebtrace only points the thread at the trampoline and waits for the
//! marker syscall that follows the call; if ebtrace dies at any moment, the
//! thread still finishes the call, restores every register (the general
//! ones and the FPU/vector state) and goes on where it was interrupted.
//!
//! The mapping is [`MAPPING_LEN`] bytes: page 0 is the code (R-X), the rest
//! data (RW-): the function and arguments of the call, its result, the
//! thread's registers, scratch room for strings, and the XSAVE area.

/// Length of the mapping made in the target.
pub const MAPPING_LEN: u64 = 64 * 1024;
/// The code page.
pub const CODE_LEN: u64 = 4096;

/// Offsets in the mapping.
pub const FN: u64 = CODE_LEN;
pub const ARGS: u64 = FN + 8;
pub const RESULT: u64 = ARGS + 6 * 8;
/// rflags, then the registers of [`SAVED_GPRS`], then rsp and rip.
pub const SAVED: u64 = RESULT + 8;
pub const SAVED_RSP: u64 = SAVED + 8 * (1 + SAVED_GPRS.len() as u64);
pub const SAVED_RIP: u64 = SAVED_RSP + 8;
/// Room for the strings and out-parameters of calls.
pub const SCRATCH: u64 = CODE_LEN + 1024;
pub const SCRATCH_LEN: u64 = 3 * 1024;
/// The XSAVE area (64-byte aligned), 16 KiB.
pub const XAREA: u64 = 2 * CODE_LEN;
const _: () = assert!(XAREA + 16 * 1024 <= MAPPING_LEN && SAVED_RIP + 8 <= SCRATCH);

/// x86-64 register numbers (as in ModRM/REX encodings).
const RAX: u8 = 0;
const RCX: u8 = 1;
const RDX: u8 = 2;
const RBX: u8 = 3;
const RSP: u8 = 4;
const RBP: u8 = 5;
const RSI: u8 = 6;
const RDI: u8 = 7;

/// The registers saved and restored by the trampoline (rsp and rip apart),
/// in their order in the data area.
pub const SAVED_GPRS: [u8; 15] = [
    RAX, RBX, RCX, RDX, RSI, RDI, RBP, 8, 9, 10, 11, 12, 13, 14, 15,
];

/// The XSAVE component mask: everything except AMX (tile config and
/// data), which the called code never uses and which may be disabled for
/// the process (XFD), where XSAVE/XRSTOR of it would fault.
const XSAVE_MASK_LO: u32 = !((1 << 17) | (1 << 18));
const XSAVE_MASK_HI: u32 = u32::MAX;

/// A builder of the code page, with RIP-relative addressing resolved
/// against offsets in the mapping.
struct Code(Vec<u8>);

impl Code {
    /// Appends `op` followed by the disp32 from the end of the instruction
    /// to `target` (an offset in the mapping).
    fn rip_rel(&mut self, op: &[u8], target: u64) {
        self.0.extend_from_slice(op);
        let next = (self.0.len() + 4) as i64;
        let disp = i32::try_from(target as i64 - next).expect("target within the mapping");
        self.0.extend_from_slice(&disp.to_le_bytes());
    }

    /// `mov target(%rip), %reg`
    fn load(&mut self, reg: u8, target: u64) {
        self.rip_rel(
            &[0x48 | ((reg >> 3) << 2), 0x8b, ((reg & 7) << 3) | 5],
            target,
        );
    }

    /// `mov %reg, target(%rip)`
    fn store(&mut self, reg: u8, target: u64) {
        self.rip_rel(
            &[0x48 | ((reg >> 3) << 2), 0x89, ((reg & 7) << 3) | 5],
            target,
        );
    }

    /// `mov $mask_lo,%eax; mov $mask_hi,%edx`, then the 64-bit
    /// XSAVE-family instruction `/ext` of XAREA.
    fn xstate(&mut self, ext: u8) {
        self.0.push(0xb8);
        self.0.extend_from_slice(&XSAVE_MASK_LO.to_le_bytes());
        self.0.push(0xba);
        self.0.extend_from_slice(&XSAVE_MASK_HI.to_le_bytes());
        self.rip_rel(&[0x48, 0x0f, 0xae, (ext << 3) | 5], XAREA);
    }
}

/// Which instructions save the FPU/vector state.
#[derive(Clone, Copy, Debug)]
pub enum FpSave {
    /// XSAVE64/XRSTOR64 (every CPU with AVX).
    Xsave,
    /// FXSAVE64/FXRSTOR64 (x87 and SSE only), where XSAVE is missing.
    Fxsave,
}

impl FpSave {
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("xsave") {
            return FpSave::Xsave;
        }
        FpSave::Fxsave
    }
}

/// The trampoline's code, and the offset just past its marker `syscall`
/// (where the thread stops at the marker's syscall-entry).
pub fn code(fp: FpSave) -> (Vec<u8>, u64) {
    let (save, restore) = match fp {
        FpSave::Xsave => (4, 5),
        FpSave::Fxsave => (0, 1),
    };
    let mut c = Code(Vec::with_capacity(256));
    c.xstate(save);
    // The ABI wants the direction flag clear at a call.
    c.0.push(0xfc);
    for (i, reg) in [RDI, RSI, RDX, RCX, 8, 9].into_iter().enumerate() {
        c.load(reg, ARGS + 8 * i as u64);
    }
    c.rip_rel(&[0xff, 0x15], FN); // call *fn(%rip)
    c.store(RAX, RESULT);
    c.xstate(restore);
    // Marker: getpid, harmless whether or not ebtrace is still watching.
    c.0.extend_from_slice(&[0xb8, 39, 0, 0, 0, 0x0f, 0x05]);
    let marker_end = c.0.len() as u64;
    // Restore: flags first (popfq through a stack pointed at the saved
    // rflags), then the registers with moves, which leave flags alone.
    c.rip_rel(&[0x48, 0x8d, 0x25], SAVED); // lea saved_rflags(%rip), %rsp
    c.0.push(0x9d); // popfq
    for (i, &reg) in SAVED_GPRS.iter().enumerate() {
        c.load(reg, SAVED + 8 * (1 + i as u64));
    }
    c.load(RSP, SAVED_RSP);
    c.rip_rel(&[0xff, 0x25], SAVED_RIP); // jmp *saved_rip(%rip)
    (c.0, marker_end)
}

/// The thread's registers as the trampoline's data area holds them.
pub fn saved_block(regs: &super::ptrace::Regs) -> Vec<u8> {
    let gpr = |reg: u8| match reg {
        RAX => regs.rax,
        RBX => regs.rbx,
        RCX => regs.rcx,
        RDX => regs.rdx,
        RSI => regs.rsi,
        RDI => regs.rdi,
        RBP => regs.rbp,
        8 => regs.r8,
        9 => regs.r9,
        10 => regs.r10,
        11 => regs.r11,
        12 => regs.r12,
        13 => regs.r13,
        14 => regs.r14,
        _ => regs.r15,
    };
    std::iter::once(regs.eflags)
        .chain(SAVED_GPRS.iter().map(|&r| gpr(r)))
        .chain([regs.rsp, regs.rip])
        .flat_map(u64::to_le_bytes)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The encodings, checked against the assembler's for the same
    /// instructions at the same offsets.
    #[test]
    fn code_matches_the_assembler() {
        let (code, marker_end) = code(FpSave::Xsave);
        let head: &[u8] = &[
            0xb8, 0xff, 0xff, 0xf9, 0xff, // mov $0xfff9ffff,%eax
            0xba, 0xff, 0xff, 0xff, 0xff, // mov $-1,%edx
            0x48, 0x0f, 0xae, 0x25, 0xee, 0x1f, 0x00,
            0x00, // xsave64 XAREA, next insn at 0x12
            0xfc, // cld
            0x48, 0x8b, 0x3d, 0xee, 0x0f, 0x00,
            0x00, // mov ARGS(%rip),%rdi, next insn at 0x1a
        ];
        assert_eq!(&code[..head.len()], head);
        // mov 0x1030(%rip),%r9 (the 6th argument): REX.WR.
        let r9 = 0x13 + 5 * 7;
        assert_eq!(&code[r9..r9 + 3], &[0x4c, 0x8b, 0x0d]);
        assert_eq!(
            &code[marker_end as usize - 7..marker_end as usize],
            &[0xb8, 39, 0, 0, 0, 0x0f, 0x05]
        );
        // Ends with jmp *saved_rip(%rip).
        let jmp = code.len() - 6;
        assert_eq!(&code[jmp..jmp + 2], &[0xff, 0x25]);
        let disp = i32::from_le_bytes(code[jmp + 2..].try_into().unwrap()) as i64;
        assert_eq!(code.len() as i64 + disp, SAVED_RIP as i64);
        assert!((code.len() as u64) < CODE_LEN);
        assert_eq!(XAREA % 64, 0);
    }
}
