//! The trampoline: a few hundred bytes of machine code through which the
//! hijacked thread calls one function and then restores its own state and
//! returns to its own code, by itself.
//!
//! ebtrace only points the thread at the trampoline (with a data block on
//! the thread's own stack) and waits for the marker syscall that follows
//! the call; if ebtrace dies at any moment, the thread still finishes the
//! call, restores every register (the general ones, flags, and the
//! FPU/vector state) and goes on where it was interrupted.
//!
//! No memory is mapped for it: the code is written into the unused tail of
//! the last page of a library's executable segment (a private copy of that
//! page, in the target only), and the data lives below the thread's stack
//! pointer (past the red zone). So there is nothing to unmap, and no moment
//! at which the thread is made to run a bare syscall that ebtrace's death
//! would leave it stranded after.
//!
//! The data block, at a 64-byte aligned address `D`, in 8-byte slots:
//! the function, its six arguments, its result, the 15 general registers
//! of [`SAVED_GPRS`], then an `iretq` frame (rip, cs, rflags, rsp, ss) and
//! scratch room for the strings and out-parameters of calls. The XSAVE
//! area lies just below `D`, and the callee's stack below that.

pub const ARGS: u64 = 8;
pub const RESULT: u64 = 56;
const GPRS: u64 = 64;
const IRET: u64 = GPRS + 8 * SAVED_GPRS.len() as u64;
/// Room for the strings and out-parameters of calls.
pub const SCRATCH: u64 = IRET + 5 * 8;
pub const SCRATCH_LEN: u64 = 1024;
/// The whole data block.
pub const BLOCK_LEN: u64 = SCRATCH + SCRATCH_LEN;
/// Bytes left alone below the thread's stack pointer (the red zone is 128).
const BELOW_RSP: u64 = 256;

/// x86-64 register numbers (as in ModRM/REX encodings).
const RAX: u8 = 0;
const RCX: u8 = 1;
const RDX: u8 = 2;
const RBX: u8 = 3;
const RSP: u8 = 4;
const RBP: u8 = 5;
const RSI: u8 = 6;
const RDI: u8 = 7;

/// The registers saved and restored by the trampoline (rsp, rip and
/// rflags go through the `iretq` frame), in their order in the block.
const SAVED_GPRS: [u8; 15] = [
    RAX, RBX, RCX, RDX, RSI, RDI, RBP, 8, 9, 10, 11, 12, 13, 14, 15,
];

/// The XSAVE component mask: everything except AMX (tile config and
/// data), which the called code never uses and which may be disabled for
/// the process (XFD), where XSAVE/XRSTOR of it would fault.
const XSAVE_MASK_LO: u32 = !((1 << 17) | (1 << 18));
const XSAVE_MASK_HI: u32 = u32::MAX;

/// Which instructions save the FPU/vector state, and the size of the area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FpSave {
    /// XSAVE64/XRSTOR64 of an area of this many bytes.
    Xsave(u32),
    /// FXSAVE64/FXRSTOR64 (x87 and SSE only), where XSAVE is missing.
    Fxsave,
}

impl FpSave {
    /// What this CPU (the target's too) has.
    pub fn detect() -> Self {
        if std::arch::is_x86_feature_detected!("xsave") {
            // CPUID leaf 0xD exists where XSAVE does; EBX is the area size
            // for the features enabled in XCR0.
            let size = std::arch::x86_64::__cpuid_count(0xd, 0).ebx;
            return FpSave::Xsave(size.max(576));
        }
        FpSave::Fxsave
    }

    /// How far below the data block the XSAVE header starts (0 with
    /// FXSAVE, which has none).
    pub fn header_below_block(self) -> u64 {
        match self {
            FpSave::Xsave(_) => self.area() - 512,
            FpSave::Fxsave => 0,
        }
    }

    /// Bytes reserved below the data block, a multiple of 64.
    fn area(self) -> u64 {
        match self {
            FpSave::Xsave(size) => u64::from(size).next_multiple_of(64),
            FpSave::Fxsave => 512,
        }
    }
}

/// Where a call's data block goes, below the thread's stack pointer `rsp`.
pub fn block_at(rsp: u64) -> u64 {
    (rsp - BELOW_RSP - BLOCK_LEN) & !63
}

struct Code(Vec<u8>);

impl Code {
    fn rex_w(reg: u8) -> u8 {
        0x48 | ((reg >> 3) << 2)
    }

    /// `op` with a `disp(%rbx)` memory operand and `reg` in ModRM.reg.
    fn rbx(&mut self, op: &[u8], reg: u8, disp: i32) {
        self.0.extend_from_slice(op);
        if let Ok(d8) = i8::try_from(disp) {
            self.0.push(0x40 | ((reg & 7) << 3) | RBX);
            self.0.push(d8 as u8);
        } else {
            self.0.push(0x80 | ((reg & 7) << 3) | RBX);
            self.0.extend_from_slice(&disp.to_le_bytes());
        }
    }

    /// `mov $mask_lo,%eax; mov $mask_hi,%edx`, then the 64-bit
    /// XSAVE-family instruction `/ext` of the area at `disp(%rbx)`.
    fn xstate(&mut self, ext: u8, disp: i32) {
        self.0.push(0xb8);
        self.0.extend_from_slice(&XSAVE_MASK_LO.to_le_bytes());
        self.0.push(0xba);
        self.0.extend_from_slice(&XSAVE_MASK_HI.to_le_bytes());
        self.rbx(&[0x48, 0x0f, 0xae], ext, disp);
    }
}

/// `getpid`, the marker where a thread's filters cannot be read.
pub const GETPID: u32 = 39;

/// The trampoline's code for `fp`, and the offset just past its marker
/// `syscall` (where the thread stops at the marker's syscall-entry), whose
/// number is `marker` (see [`super::seccomp::marker_syscall`]). It uses no
/// absolute address: every copy with one marker is the same bytes, and the
/// offsets are the same whatever the marker.
pub fn code(fp: FpSave, marker: u32) -> (Vec<u8>, u64) {
    let (save, restore) = match fp {
        FpSave::Xsave(_) => (4, 5),
        FpSave::Fxsave => (0, 1),
    };
    let area = -i32::try_from(fp.area()).expect("XSAVE area size");
    let mut c = Code(Vec::with_capacity(192));
    c.0.extend_from_slice(&[0x48, 0x89, 0xe3]); // mov %rsp,%rbx: the block
    c.xstate(save, area);
    c.rbx(&[0x48, 0x8d], RSP, area); // lea area(%rbx),%rsp
    c.0.push(0xfc); // cld: the ABI wants it clear at a call
    for (i, reg) in [RDI, RSI, RDX, RCX, 8, 9].into_iter().enumerate() {
        c.rbx(&[Code::rex_w(reg), 0x8b], reg, (ARGS + 8 * i as u64) as i32);
    }
    c.0.extend_from_slice(&[0xff, 0x13]); // call *(%rbx)
    debug_assert_eq!(c.0.len() as u64, call_return(fp));
    c.rbx(&[0x48, 0x89], RAX, RESULT as i32); // mov %rax,result(%rbx)
    c.xstate(restore, area);
    // Marker: a syscall without effects that the thread's seccomp filters
    // let run, harmless whether or not ebtrace is still watching.
    c.0.push(0xb8); // mov $marker,%eax
    c.0.extend_from_slice(&marker.to_le_bytes());
    c.0.extend_from_slice(&[0x0f, 0x05]); // syscall
    let marker_end = c.0.len() as u64;
    // Restore: the registers (rbx last among them is fine: they are read
    // through rsp), then rip, cs, rflags, rsp and ss at once.
    c.rbx(&[0x48, 0x8d], RSP, IRET as i32); // lea iret(%rbx),%rsp
    for (i, &reg) in SAVED_GPRS.iter().enumerate() {
        let disp = (GPRS + 8 * i as u64) as i64 - IRET as i64;
        // mov disp8(%rsp),%reg
        c.0.extend_from_slice(&[Code::rex_w(reg), 0x8b, 0x44 | ((reg & 7) << 3), 0x24]);
        c.0.push(i8::try_from(disp).expect("disp8") as u8);
    }
    c.0.extend_from_slice(&[0x48, 0xcf]); // iretq
    (c.0, marker_end)
}

/// Offset in the code of the return address its call pushes.
pub fn call_return(fp: FpSave) -> u64 {
    // mov %rsp,%rbx; xsave; lea; cld; six loads; the call.
    let disp = |d: u64| if d <= 128 { 1 } else { 4 };
    let area = disp(fp.area());
    3 + (10 + 4 + area) + (3 + area) + 1 + 6 * 4 + 2
}

/// Where, relative to a block at `D`, its call's return address lies.
pub fn return_slot_below_block(fp: FpSave) -> u64 {
    fp.area() + 8
}

/// The `cs` and `ss` slots of a block's `iretq` frame (offsets).
pub const IRET_CS: u64 = IRET + 8;
pub const IRET_SS: u64 = IRET + 32;

/// The data block of one call of `f(args)` that returns to `regs`.
pub fn block(regs: &super::ptrace::Regs, f: u64, args: &[u64]) -> Vec<u8> {
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
    let mut fn_args = [0u64; 7];
    fn_args[0] = f;
    fn_args[1..=args.len()].copy_from_slice(args);
    fn_args
        .into_iter()
        .chain([0]) // result
        .chain(SAVED_GPRS.iter().map(|&r| gpr(r)))
        .chain([regs.rip, regs.cs, regs.eflags, regs.rsp, regs.ss])
        .flat_map(u64::to_le_bytes)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The encodings, checked against the assembler's for the same
    /// instructions.
    #[test]
    fn code_matches_the_assembler() {
        let (code, marker_end) = code(FpSave::Xsave(0x1000), 39);
        let head: &[u8] = &[
            0x48, 0x89, 0xe3, // mov %rsp,%rbx
            0xb8, 0xff, 0xff, 0xf9, 0xff, // mov $0xfff9ffff,%eax
            0xba, 0xff, 0xff, 0xff, 0xff, // mov $-1,%edx
            0x48, 0x0f, 0xae, 0xa3, 0x00, 0xf0, 0xff, 0xff, // xsave64 -0x1000(%rbx)
            0x48, 0x8d, 0xa3, 0x00, 0xf0, 0xff, 0xff, // lea -0x1000(%rbx),%rsp
            0xfc, // cld
            0x48, 0x8b, 0x7b, 0x08, // mov 0x8(%rbx),%rdi
        ];
        assert_eq!(&code[..head.len()], head);
        let r8 = head.len() + 3 * 4;
        assert_eq!(&code[r8..r8 + 4], &[0x4c, 0x8b, 0x43, 0x28]); // mov 0x28(%rbx),%r8
        let call = r8 + 8;
        assert_eq!(&code[call..call + 6], &[0xff, 0x13, 0x48, 0x89, 0x43, 0x38]);
        assert_eq!(call_return(FpSave::Xsave(0x1000)), call as u64 + 2);
        assert_eq!(
            super::code(FpSave::Fxsave, 39).0[call_return(FpSave::Fxsave) as usize - 2],
            0xff
        );
        let m = marker_end as usize;
        assert_eq!(&code[m - 7..m], &[0xb8, 39, 0, 0, 0, 0x0f, 0x05]);
        let (gettid, gettid_end) = super::code(FpSave::Xsave(0x1000), 186);
        assert_eq!(gettid_end, marker_end);
        assert_eq!(&gettid[m - 7..m], &[0xb8, 186, 0, 0, 0, 0x0f, 0x05]);
        // lea 0xb8(%rbx),%rsp; mov -0x78(%rsp),%rax; ...; mov -0x8(%rsp),%r15; iretq
        assert_eq!(&code[m..m + 7], &[0x48, 0x8d, 0xa3, 0xb8, 0, 0, 0]);
        assert_eq!(&code[m + 7..m + 12], &[0x48, 0x8b, 0x44, 0x24, 0x88]);
        let end = code.len();
        assert_eq!(
            &code[end - 7..],
            &[0x4c, 0x8b, 0x7c, 0x24, 0xf8, 0x48, 0xcf]
        );
        assert_eq!(IRET, 0xb8);
    }

    #[test]
    fn block_layout() {
        // SAFETY: plain integers.
        let mut regs: super::super::ptrace::Regs = unsafe { std::mem::zeroed() };
        regs.rbx = 0xb;
        regs.rip = 0x1234;
        regs.rsp = 0x7000_0000;
        let b = block(&regs, 0xf, &[1, 2]);
        let slot = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
        assert_eq!((slot(0), slot(1), slot(2), slot(3)), (0xf, 1, 2, 0));
        assert_eq!(slot(9), 0xb); // rbx, second saved register
        assert_eq!(slot(IRET as usize / 8), 0x1234);
        assert_eq!(slot(IRET as usize / 8 + 3), 0x7000_0000);
        assert_eq!(b.len() as u64, SCRATCH);
        let d = block_at(regs.rsp);
        assert!(d.is_multiple_of(64) && d + BLOCK_LEN + 128 <= regs.rsp);
    }
}
