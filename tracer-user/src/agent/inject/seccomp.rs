//! A target's seccomp filters, asked before it is made to load the agent:
//! a filter that kills (or traps, or hands to a supervisor) one of the
//! system calls loading makes would end or stall the program, and one that
//! fails such a call would leave the load half-done in it, so the load is
//! refused with one line instead. The filters are classic BPF programs
//! over `struct seccomp_data`, read with `PTRACE_SECCOMP_GET_FILTER` (which
//! needs `CAP_SYS_ADMIN`; without it, or where a filter cannot be told,
//! the filters are not judged) and run here on each such call.
//!
//! The kernel runs the filters after a tracer's syscall-entry stop, on the
//! number the tracer left: a syscall skipped there (number -1) is on no
//! allowlist and gets the profile's default action, `EPERM` in the
//! container runtimes' profiles, a kill in systemd's. So a session never
//! skips one: the syscall it stops the thread at is one every filter lets
//! through, [`marker_syscall`], which runs.

/// `AUDIT_ARCH_X86_64`, the `arch` of `struct seccomp_data`.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const ENOSYS: u32 = 38;

/// What a failure of a loading call does to the load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// The load fails half-way: the filter must let the call run.
    Fatal,
    /// The C library tries another way on `ENOSYS` (`clone3`, then `clone`).
    FallsBackOnEnosys,
    /// The C library goes on without it (`rseq`, `set_robust_list` and
    /// `madvise` of a new thread).
    Ignored,
}

/// One system call loading and starting the agent makes, with the
/// arguments that filters look at, where fixed.
#[derive(Clone, Copy, Debug)]
pub struct LoadingCall {
    pub name: &'static str,
    pub nr: u32,
    pub args: [u64; 6],
    pub on_failure: OnFailure,
}

const fn call(name: &'static str, nr: u32, args: [u64; 6], on_failure: OnFailure) -> LoadingCall {
    LoadingCall {
        name,
        nr,
        args,
        on_failure,
    }
}

/// The calls loading and starting the agent make: the trampoline's own
/// (`memfd_create`, `socketpair`, `close`), `dlopen`'s, `pthread_create`'s,
/// and those of the agent's thread before it answers (its start, its name,
/// its socket).
pub const LOADING_CALLS: [LoadingCall; 25] = [
    call(
        "memfd_create",
        319,
        [0, 0x1 | 0x2, 0, 0, 0, 0],
        OnFailure::Fatal,
    ),
    call(
        "socketpair",
        53,
        [1, 1 | 0o2_000_000, 0, 0, 0, 0],
        OnFailure::Fatal,
    ),
    call("close", 3, [0; 6], OnFailure::Fatal),
    call(
        "openat",
        257,
        [(-100i64) as u64, 0, 0o2_000_000, 0, 0, 0],
        OnFailure::Fatal,
    ),
    call("read", 0, [0; 6], OnFailure::Fatal),
    call("pread64", 17, [0; 6], OnFailure::Fatal),
    call("fstat", 5, [0; 6], OnFailure::Fatal),
    call("newfstatat", 262, [0; 6], OnFailure::Fatal),
    call("mmap", 9, [0, 0, 1 | 4, 2, 0, 0], OnFailure::Fatal),
    call("mprotect", 10, [0, 0, 1, 0, 0, 0], OnFailure::Fatal),
    call("munmap", 11, [0; 6], OnFailure::Fatal),
    call("brk", 12, [0; 6], OnFailure::Fatal),
    call("clone3", 435, [0; 6], OnFailure::FallsBackOnEnosys),
    call("clone", 56, [0x003d_0f00, 0, 0, 0, 0, 0], OnFailure::Fatal),
    call("rt_sigprocmask", 14, [0; 6], OnFailure::Fatal),
    call("futex", 202, [0; 6], OnFailure::Fatal),
    call("madvise", 28, [0; 6], OnFailure::Ignored),
    call("prctl", 157, [15, 0, 0, 0, 0, 0], OnFailure::Fatal),
    call("set_robust_list", 273, [0; 6], OnFailure::Ignored),
    call("rseq", 334, [0; 6], OnFailure::Ignored),
    call("poll", 7, [0; 6], OnFailure::Fatal),
    call("sendto", 44, [0; 6], OnFailure::Fatal),
    call("recvfrom", 45, [0; 6], OnFailure::Fatal),
    call("write", 1, [0; 6], OnFailure::Fatal),
    call("exit", 60, [0; 6], OnFailure::Fatal),
];

/// Syscalls without effects, one of which every filter lets run: the
/// trampoline's marker, where a session stops the thread after each call.
/// `getpid` (39) first; `gettid` (186), `getppid` (110), `getuid` (102),
/// `sched_yield` (24) for a filter that refuses it.
const MARKER_CANDIDATES: [u32; 5] = [39, 186, 110, 102, 24];

/// The marker syscall for a thread under `filters` (newest first): the
/// first candidate they let run, or fail with an errno (the thread's
/// registers are put back at the syscall's exit either way); `None` where
/// they would kill or stop the thread for every candidate.
pub fn marker_syscall(filters: &[Vec<Insn>]) -> Option<u32> {
    MARKER_CANDIDATES.into_iter().find(|&nr| {
        matches!(
            judge(filters, nr, [0; 6]),
            Verdict::Runs | Verdict::Fails { .. }
        )
    })
}

/// Why `filters` stand in the way of a load: the first loading call they
/// would kill or stop the thread for ([`Verdict::Harmful`]), or fail where
/// the load cannot do without it, with its errno.
pub fn forbidden(filters: &[Vec<Insn>]) -> Option<(&'static str, Verdict)> {
    LOADING_CALLS.iter().find_map(|c| {
        let verdict = judge(filters, c.nr, c.args);
        let stands_in_the_way = match verdict {
            Verdict::Harmful => true,
            Verdict::Fails { errno } => match c.on_failure {
                OnFailure::Fatal => true,
                OnFailure::FallsBackOnEnosys => errno != ENOSYS,
                OnFailure::Ignored => false,
            },
            Verdict::Runs | Verdict::Unknown => false,
        };
        stands_in_the_way.then_some((c.name, verdict))
    })
}

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

/// What a thread's filters do to one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Runs (`ALLOW`, `LOG`).
    Runs,
    /// Fails with this errno without running (`ERRNO`; `TRACE`, which
    /// fails with `ENOSYS` where no tracer asked for seccomp stops).
    Fails { errno: u32 },
    /// Kills the thread or the process, raises SIGSYS, or waits for a
    /// supervisor.
    Harmful,
    /// A filter this interpreter cannot run.
    Unknown,
}

/// What `filters` (the thread's, newest first) do to call `nr` with
/// `args`: the action of highest precedence among their answers, as the
/// kernel takes it.
pub fn judge(filters: &[Vec<Insn>], nr: u32, args: [u64; 6]) -> Verdict {
    let mut data = [0u8; 64];
    data[..4].copy_from_slice(&nr.to_ne_bytes());
    data[4..8].copy_from_slice(&AUDIT_ARCH_X86_64.to_ne_bytes());
    for (i, a) in args.iter().enumerate() {
        data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
    }
    let mut taken: Option<u32> = None;
    let mut unknown = false;
    for filter in filters {
        match run(filter, &data) {
            None => unknown = true,
            Some(ret) => {
                if taken.is_none_or(|t| precedence(ret) < precedence(t)) {
                    taken = Some(ret);
                }
            }
        }
    }
    match taken.map(verdict_of) {
        Some(Verdict::Harmful) => Verdict::Harmful,
        _ if unknown => Verdict::Unknown,
        Some(v) => v,
        None => Verdict::Runs,
    }
}

/// The kernel's order among actions: the lower, the stronger
/// (`SECCOMP_RET_KILL_PROCESS` first, `SECCOMP_RET_ALLOW` last).
fn precedence(ret: u32) -> i32 {
    (ret & ACTION_FULL) as i32
}

const ACTION_FULL: u32 = 0xffff_0000;

fn verdict_of(ret: u32) -> Verdict {
    const DATA: u32 = 0x0000_ffff;
    match ret & ACTION_FULL {
        // ERRNO carries its errno (the kernel caps it at MAX_ERRNO).
        0x0005_0000 => Verdict::Fails {
            errno: (ret & DATA).min(4095),
        },
        0x7ff0_0000 => Verdict::Fails { errno: ENOSYS },
        0x7ffc_0000 | 0x7fff_0000 => Verdict::Runs,
        // KILL_PROCESS, KILL_THREAD, TRAP, USER_NOTIF (the program's
        // supervisor may never answer), and what the kernel treats as
        // KILL_PROCESS: any action it does not know.
        _ => Verdict::Harmful,
    }
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
        assert_eq!(judge(&filters, 53, [0; 6]), Verdict::Runs);
        let errno = vec![insn(0x06, 0, 0, 0x0005_0001)];
        assert_eq!(judge(&[errno], 319, [0; 6]), Verdict::Fails { errno: 1 });
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

    /// `ld [0]; jeq NR, allow; ret DEFAULT; allow: ret ALLOW` for each of
    /// `allowed`, as container runtimes write their profiles.
    fn allowlist(allowed: &[u32], default: u32) -> Vec<Insn> {
        let mut f = vec![insn(0x20, 0, 0, 0)];
        for &nr in allowed {
            f.push(insn(0x15, 0, 1, nr));
            f.push(insn(0x06, 0, 0, 0x7fff_0000));
        }
        f.push(insn(0x06, 0, 0, default));
        f
    }

    #[test]
    fn the_strongest_action_of_all_filters_is_taken() {
        let eperm = vec![insn(0x06, 0, 0, 0x0005_0001)];
        let allow = vec![insn(0x06, 0, 0, 0x7fff_0000)];
        let notify = vec![insn(0x06, 0, 0, 0x7fc0_0000)];
        let kill = vec![insn(0x06, 0, 0, 0x8000_0000)];
        let log = vec![insn(0x06, 0, 0, 0x7ffc_0000)];
        let fails = Verdict::Fails { errno: 1 };
        assert_eq!(judge(&[allow.clone(), eperm.clone()], 0, [0; 6]), fails);
        assert_eq!(judge(&[eperm.clone(), allow.clone()], 0, [0; 6]), fails);
        // ERRNO comes before USER_NOTIF: no supervisor is asked.
        assert_eq!(judge(&[notify.clone(), eperm], 0, [0; 6]), fails);
        assert_eq!(judge(&[notify], 0, [0; 6]), Verdict::Harmful);
        assert_eq!(judge(&[log, allow.clone()], 0, [0; 6]), Verdict::Runs);
        assert_eq!(judge(&[allow, kill], 0, [0; 6]), Verdict::Harmful);
        assert_eq!(judge(&[], 0, [0; 6]), Verdict::Runs);
        // An action the kernel does not know kills the process.
        assert_eq!(
            judge(&[vec![insn(0x06, 0, 0, 0x7fa0_0000)]], 0, [0; 6]),
            Verdict::Harmful
        );
    }

    #[test]
    fn the_marker_is_a_syscall_the_filters_let_run() {
        let every_loading_call: Vec<u32> = LOADING_CALLS.iter().map(|c| c.nr).collect();
        // A skipped syscall (-1) is on no list: under an allowlist it gets
        // the default action, which the marker never does.
        let kills_unlisted = allowlist(
            &[every_loading_call.clone(), vec![39]].concat(),
            0x8000_0000,
        );
        assert_eq!(
            judge(std::slice::from_ref(&kills_unlisted), u32::MAX, [0; 6]),
            Verdict::Harmful
        );
        assert_eq!(
            marker_syscall(std::slice::from_ref(&kills_unlisted)),
            Some(39)
        );
        assert_eq!(forbidden(&[kills_unlisted]), None);
        let without_getpid = allowlist(
            &[every_loading_call.clone(), vec![186]].concat(),
            0x8000_0000,
        );
        assert_eq!(marker_syscall(&[without_getpid]), Some(186));
        // Failing with an errno is fine for the marker (its result is
        // never the program's), not for memfd_create.
        let eperm_unlisted = allowlist(&every_loading_call[1..], 0x0005_0001);
        assert_eq!(
            marker_syscall(std::slice::from_ref(&eperm_unlisted)),
            Some(39)
        );
        assert_eq!(
            forbidden(&[eperm_unlisted]),
            Some(("memfd_create", Verdict::Fails { errno: 1 }))
        );
        assert_eq!(
            marker_syscall(&[allowlist(&every_loading_call, 0x8000_0000)]),
            None
        );
    }

    #[test]
    fn only_failures_the_c_library_lives_with_are_let_through() {
        let all_but = |nr: u32| -> Vec<u32> {
            LOADING_CALLS
                .iter()
                .map(|c| c.nr)
                .filter(|&n| n != nr)
                .collect()
        };
        // clone3 failing with ENOSYS (Docker's profile): glibc uses clone.
        let enosys = allowlist(&all_but(435), 0x0005_0000 | ENOSYS);
        assert_eq!(forbidden(&[enosys]), None);
        let eperm = allowlist(&all_but(435), 0x0005_0001);
        assert_eq!(
            forbidden(&[eperm]),
            Some(("clone3", Verdict::Fails { errno: 1 }))
        );
        // rseq refused: a new thread goes on without it.
        assert_eq!(forbidden(&[allowlist(&all_but(334), 0x0005_0001)]), None);
        assert_eq!(
            forbidden(&[allowlist(&all_but(334), 0x8000_0000)]),
            Some(("rseq", Verdict::Harmful))
        );
    }
}
