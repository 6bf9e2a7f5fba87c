//! The few C library functions the agent calls.
//!
//! The loadable library is linked without the C library (see tracer-user's
//! build script), so these references carry no symbol version: the target's
//! dynamic linker binds each to the version its own C library provides,
//! which lets one build load into any target with glibc 2.28 or later.

use core::ffi::{c_char, c_int, c_ulong, c_void};

/// `pthread_t`.
pub type PthreadT = c_ulong;

/// `sigset_t` (glibc: 1024 bits).
#[repr(C)]
pub struct SigSet([u64; 16]);

impl SigSet {
    /// An empty set, to be filled by `sigfillset`.
    pub const fn empty() -> Self {
        SigSet([0; 16])
    }
}

/// `SIG_SETMASK`.
pub const SIG_SETMASK: c_int = 2;
/// `MSG_NOSIGNAL`: a write to a closed socket returns EPIPE instead of
/// raising SIGPIPE in the target.
pub const MSG_NOSIGNAL: c_int = 0x4000;
/// `SHUT_RDWR`.
pub const SHUT_RDWR: c_int = 2;
/// `PR_SET_NAME`.
pub const PR_SET_NAME: c_int = 15;
/// `EINTR`.
pub const EINTR: c_int = 4;
/// `EBUSY`.
pub const EBUSY: c_int = 16;
/// `EINVAL`.
pub const EINVAL: c_int = 22;

// Named and documented by the C library (see their manual pages).
#[allow(missing_docs)]
unsafe extern "C" {
    pub fn pthread_create(
        thread: *mut PthreadT,
        attr: *const c_void,
        start: extern "C" fn(*mut c_void) -> *mut c_void,
        arg: *mut c_void,
    ) -> c_int;
    pub fn pthread_join(thread: PthreadT, ret: *mut *mut c_void) -> c_int;
    #[cfg(feature = "cdylib")]
    pub fn pthread_exit(ret: *mut c_void) -> !;
    pub fn pthread_sigmask(how: c_int, set: *const SigSet, old: *mut SigSet) -> c_int;
    pub fn sigfillset(set: *mut SigSet) -> c_int;
    pub fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize;
    pub fn send(fd: c_int, buf: *const c_void, n: usize, flags: c_int) -> isize;
    pub fn close(fd: c_int) -> c_int;
    pub fn shutdown(fd: c_int, how: c_int) -> c_int;
    pub fn getpid() -> c_int;
    pub fn prctl(
        option: c_int,
        arg2: c_ulong,
        arg3: c_ulong,
        arg4: c_ulong,
        arg5: c_ulong,
    ) -> c_int;
    pub fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
    pub fn __errno_location() -> *mut c_int;
}

/// The calling thread's `errno`.
pub fn errno() -> c_int {
    // SAFETY: glibc's per-thread errno location is always valid.
    unsafe { *__errno_location() }
}
