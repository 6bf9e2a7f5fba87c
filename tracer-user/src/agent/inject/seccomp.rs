//! A target's seccomp filters, asked before it is made to load the agent:
//! a filter that kills (or traps, or hands to a supervisor) one of the
//! system calls loading makes would end or stall the program, so the load
//! is refused with one line instead. The filters are classic BPF programs
//! over `struct seccomp_data`, read with `PTRACE_SECCOMP_GET_FILTER` (which
//! needs `CAP_SYS_ADMIN`; without it, or where a filter cannot be told,
//! the filters are not judged) and run here on each such call.

/// `AUDIT_ARCH_X86_64`, the `arch` of `struct seccomp_data`.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

/// The calls loading and starting the agent make, with the arguments that
/// filters look at, where fixed: the trampoline's own (`memfd_create`,
/// `socketpair`, `close`), `dlopen`'s and `pthread_create`'s.
pub const LOADING_CALLS: [(&str, u32, [u64; 6]); 18] = [
    ("memfd_create", 319, [0, 0x1 | 0x2, 0, 0, 0, 0]),
    ("socketpair", 53, [1, 1 | 0o2_000_000, 0, 0, 0, 0]),
    ("close", 3, [0; 6]),
    ("openat", 257, [(-100i64) as u64, 0, 0o2_000_000, 0, 0, 0]),
    ("read", 0, [0; 6]),
    ("pread64", 17, [0; 6]),
    ("fstat", 5, [0; 6]),
    ("newfstatat", 262, [0; 6]),
    ("mmap", 9, [0, 0, 1 | 4, 2, 0, 0]),
    ("mprotect", 10, [0, 0, 1, 0, 0, 0]),
    ("munmap", 11, [0; 6]),
    ("brk", 12, [0; 6]),
    ("clone3", 435, [0; 6]),
    ("clone", 56, [0x003d_0f00, 0, 0, 0, 0, 0]),
    ("rt_sigprocmask", 14, [0; 6]),
    ("futex", 202, [0; 6]),
    ("madvise", 28, [0; 6]),
    ("prctl", 157, [15, 0, 0, 0, 0, 0]),
];

/// One classic BPF instruction (`struct sock_filter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

impl Insn {
    /// Reads `struct sock_filter`s from their bytes.
    pub fn parse_all(bytes: &[u8]) -> Vec<Insn> {
        bytes
            .chunks_exact(8)
            .map(|b| Insn {
                code: u16::from_ne_bytes([b[0], b[1]]),
                jt: b[2],
                jf: b[3],
                k: u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
            })
            .collect()
    }
}

/// What a filter does to a call that the loading would mind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Runs (or fails with an errno, which the load reports as it is).
    Harmless,
    /// Kills the thread or the process, raises SIGSYS, or waits for a
    /// supervisor.
    Harmful,
    /// A filter this interpreter cannot run.
    Unknown,
}

/// What `filters` (the thread's, newest first) do to call `nr` with `args`.
pub fn judge(filters: &[Vec<Insn>], nr: u32, args: [u64; 6]) -> Verdict {
    let mut data = [0u8; 64];
    data[..4].copy_from_slice(&nr.to_ne_bytes());
    data[4..8].copy_from_slice(&AUDIT_ARCH_X86_64.to_ne_bytes());
    for (i, a) in args.iter().enumerate() {
        data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
    }
    let mut verdict = Verdict::Harmless;
    for filter in filters {
        match run(filter, &data) {
            None => verdict = Verdict::Unknown,
            Some(action) if harmful(action) => return Verdict::Harmful,
            Some(_) => {}
        }
    }
    verdict
}

/// `SECCOMP_RET_KILL_PROCESS`, `KILL_THREAD`, `TRAP` and `USER_NOTIF`
/// (the program's supervisor may never answer).
fn harmful(action: u32) -> bool {
    const ACTION_FULL: u32 = 0xffff_0000;
    matches!(
        action & ACTION_FULL,
        0x8000_0000 | 0x0000_0000 | 0x0003_0000 | 0x7fc0_0000
    )
}

/// Runs `filter` on `data`; its return value, or `None` for an
/// instruction seccomp does not allow, or a jump out of the program.
fn run(filter: &[Insn], data: &[u8; 64]) -> Option<u32> {
    let (mut a, mut x) = (0u32, 0u32);
    let mut mem = [0u32; 16];
    let mut pc = 0usize;
    // Jumps only go forward: at most one pass over the program.
    while let Some(insn) = filter.get(pc) {
        pc += 1;
        let k = insn.k;
        let src = if insn.code & 0x08 != 0 { x } else { k };
        match insn.code & 0x07 {
            // BPF_LD
            0x00 => match insn.code {
                0x20 => {
                    let at = usize::try_from(k).ok().filter(|k| k % 4 == 0)?;
                    a = u32::from_ne_bytes(data.get(at..at + 4)?.try_into().ok()?);
                }
                0x80 => a = 64,
                0x00 => a = k,
                0x60 => a = *mem.get(k as usize)?,
                _ => return None,
            },
            // BPF_LDX
            0x01 => match insn.code {
                0x81 => x = 64,
                0x01 => x = k,
                0x61 => x = *mem.get(k as usize)?,
                _ => return None,
            },
            0x02 => *mem.get_mut(k as usize)? = a,
            0x03 => *mem.get_mut(k as usize)? = x,
            // BPF_ALU
            0x04 => {
                a = match insn.code & 0xf0 {
                    0x00 => a.wrapping_add(src),
                    0x10 => a.wrapping_sub(src),
                    0x20 => a.wrapping_mul(src),
                    0x30 => a.checked_div(src)?,
                    0x40 => a | src,
                    0x50 => a & src,
                    0x60 => a.checked_shl(src).unwrap_or(0),
                    0x70 => a.checked_shr(src).unwrap_or(0),
                    0x80 => a.wrapping_neg(),
                    0x90 => a.checked_rem(src)?,
                    0xa0 => a ^ src,
                    _ => return None,
                }
            }
            // BPF_JMP
            0x05 => {
                let taken = match insn.code & 0xf0 {
                    0x00 => {
                        pc = pc.checked_add(k as usize)?;
                        continue;
                    }
                    0x10 => a == src,
                    0x20 => a > src,
                    0x30 => a >= src,
                    0x40 => a & src != 0,
                    _ => return None,
                };
                pc += usize::from(if taken { insn.jt } else { insn.jf });
            }
            // BPF_RET
            0x06 => {
                return Some(match insn.code & 0x18 {
                    0x00 => k,
                    0x10 => a,
                    _ => return None,
                });
            }
            // BPF_MISC: TAX, TXA
            _ => match insn.code {
                0x07 => x = a,
                0x87 => a = x,
                _ => return None,
            },
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insn(code: u16, jt: u8, jf: u8, k: u32) -> Insn {
        Insn { code, jt, jf, k }
    }

    /// `ld [4]; jne AUDIT_ARCH_X86_64, kill; ld [0]; jeq 319, kill;
    /// ret ALLOW; kill: ret KILL_PROCESS`, as libseccomp writes it.
    fn kills_memfd_create() -> Vec<Insn> {
        vec![
            insn(0x20, 0, 0, 4),
            insn(0x15, 0, 3, AUDIT_ARCH_X86_64),
            insn(0x20, 0, 0, 0),
            insn(0x15, 1, 0, 319),
            insn(0x06, 0, 0, 0x7fff_0000),
            insn(0x06, 0, 0, 0x8000_0000),
        ]
    }

    #[test]
    fn a_filter_is_run_on_each_call() {
        let filters = vec![kills_memfd_create()];
        assert_eq!(judge(&filters, 319, [0; 6]), Verdict::Harmful);
        assert_eq!(judge(&filters, 53, [0; 6]), Verdict::Harmless);
        // Failing with an errno harms nothing.
        let errno = vec![insn(0x06, 0, 0, 0x0005_0001)];
        assert_eq!(judge(&[errno], 319, [0; 6]), Verdict::Harmless);
        // A trap raises SIGSYS, which kills a program without a handler.
        let trap = vec![insn(0x06, 0, 0, 0x0003_0000)];
        assert_eq!(judge(&[trap], 0, [0; 6]), Verdict::Harmful);
        // An instruction seccomp refuses, a jump past the end.
        assert_eq!(
            judge(&[vec![insn(0xff, 0, 0, 0)]], 0, [0; 6]),
            Verdict::Unknown
        );
        assert_eq!(
            judge(&[vec![insn(0x05, 0, 0, 9)]], 0, [0; 6]),
            Verdict::Unknown
        );
    }

    proptest::proptest! {
        #[test]
        fn any_filter_runs_to_an_end(
            program in proptest::collection::vec(
                (proptest::num::u16::ANY, proptest::num::u8::ANY, proptest::num::u8::ANY, proptest::num::u32::ANY),
                0..64,
            ),
            nr in proptest::num::u32::ANY,
        ) {
            let filter: Vec<Insn> = program.into_iter().map(|(code, jt, jf, k)| insn(code, jt, jf, k)).collect();
            let _ = judge(&[filter], nr, [nr as u64; 6]);
        }
    }
}
