//! A seized thread's register sets beyond the general registers: its
//! floating-point and vector state, and its seccomp filters.

use std::io;

use super::{InjectError, Tracee, ptrace};
use crate::agent::inject::seccomp::Insn;

const PTRACE_SECCOMP_GET_FILTER: libc::c_long = 0x420c;
/// Filters a thread may have stacked: each costs the kernel at every
/// call, and programs install one or two.
const MAX_SECCOMP_FILTERS: u64 = 64;
const PTRACE_SETREGSET: libc::c_long = 0x4205;
/// The x87/SSE state (`struct user_fpregs_struct`).
const NT_PRFPREG: u32 = 2;
/// The whole XSAVE area (AVX, AVX-512, AMX tiles...).
const NT_X86_XSTATE: u32 = 0x202;
/// Room for the largest XSAVE area (AMX makes it about 11 KiB).
const XSTATE_MAX: usize = 16 * 1024;
const PTRACE_GETREGSET: libc::c_long = 0x4204;

impl Tracee {
    /// The thread's floating-point and vector state (`NT_X86_XSTATE`, or
    /// `NT_PRFPREG` where the kernel has no XSAVE area), as the kernel
    /// lays it out, to be put back by [`Self::set_fp_state`].
    pub fn fp_state(&self) -> Result<(u32, Vec<u8>), InjectError> {
        for note in [NT_X86_XSTATE, NT_PRFPREG] {
            let mut buf = vec![0u8; XSTATE_MAX];
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            if ptrace(
                PTRACE_GETREGSET,
                self.tid,
                u64::from(note),
                &raw mut iov as u64,
            )
            .is_ok()
            {
                buf.truncate(iov.iov_len);
                return Ok((note, buf));
            }
        }
        Err(self.ptrace_error("get FP state", io::Error::last_os_error()))
    }

    /// Puts back what [`Self::fp_state`] read.
    pub fn set_fp_state(&self, (note, state): &(u32, Vec<u8>)) -> Result<(), InjectError> {
        let mut iov = libc::iovec {
            iov_base: state.as_ptr() as *mut libc::c_void,
            iov_len: state.len(),
        };
        self.request(
            PTRACE_SETREGSET,
            u64::from(*note),
            &raw mut iov as u64,
            "set FP state",
        )
    }

    /// The thread's seccomp filters, newest first; `None` where they
    /// cannot be read (`PTRACE_SECCOMP_GET_FILTER` needs `CAP_SYS_ADMIN`).
    pub fn seccomp_filters(&self) -> Option<Vec<Vec<Insn>>> {
        let mut filters = Vec::new();
        for index in 0..MAX_SECCOMP_FILTERS {
            let count = match ptrace(PTRACE_SECCOMP_GET_FILTER, self.tid, index, 0) {
                Ok(n) => usize::try_from(n).ok()?,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Some(filters),
                Err(_) => return None,
            };
            let mut bytes = vec![0u8; count.checked_mul(8)?];
            let read = ptrace(
                PTRACE_SECCOMP_GET_FILTER,
                self.tid,
                index,
                bytes.as_mut_ptr() as u64,
            )
            .ok()?;
            bytes.truncate(usize::try_from(read).ok()?.checked_mul(8)?.min(bytes.len()));
            filters.push(Insn::parse_all(&bytes));
        }
        None
    }
}
