//! The few C library functions the agent calls.
//!
//! The loadable library is linked without the C library (see tracer-user's
//! build script), so these references carry no symbol version: the target's
//! dynamic linker binds each to the version its own C library provides,
//! which lets one build load into any target with glibc 2.28 or later.

use core::ffi::{c_char, c_int, c_ulong, c_void};

/// `pthread_t`.
pub type PthreadT = c_ulong;

/// `pthread_key_t`.
pub type PthreadKey = core::ffi::c_uint;

/// `SYS_gettid` (x86-64).
pub const SYS_GETTID: core::ffi::c_long = 186;

/// `sigset_t` (glibc: 1024 bits).
#[repr(C)]
pub struct SigSet([u64; 16]);

impl SigSet {
    /// An empty set, to be filled by `sigfillset`.
    pub const fn empty() -> Self {
        SigSet([0; 16])
    }
}

/// `struct sockaddr_un`.
#[repr(C)]
pub struct SockaddrUn {
    pub family: u16,
    pub path: [u8; 108],
}

/// `struct ucred`.
#[repr(C)]
#[derive(Default)]
pub struct Ucred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// `Dl_info`.
#[repr(C)]
pub struct DlInfo {
    pub fname: *const c_char,
    pub fbase: *mut c_void,
    pub sname: *const c_char,
    pub saddr: *mut c_void,
}

impl DlInfo {
    /// An answer not filled in yet, for `dladdr` to write into.
    pub const EMPTY: DlInfo = DlInfo {
        fname: core::ptr::null(),
        fbase: core::ptr::null_mut(),
        sname: core::ptr::null(),
        saddr: core::ptr::null_mut(),
    };
}

/// `struct timespec`.
#[repr(C)]
#[derive(Default)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: i64,
}

/// `struct pollfd`.
#[repr(C)]
pub struct PollFd {
    pub fd: c_int,
    pub events: i16,
    pub revents: i16,
}

/// `POLLIN`.
pub const POLLIN: i16 = 1;

/// `struct iovec`.
#[repr(C)]
pub struct IoVec {
    pub base: *mut c_void,
    pub len: usize,
}

/// `CLOCK_MONOTONIC`.
pub const CLOCK_MONOTONIC: c_int = 1;
/// `RTLD_LAZY`.
pub const RTLD_LAZY: c_int = 1;
/// `RTLD_NOLOAD`: a handle to an object only if it is already loaded.
pub const RTLD_NOLOAD: c_int = 4;
/// `RTLD_NODELETE`.
pub const RTLD_NODELETE: c_int = 0x1000;
/// `PROT_READ | PROT_WRITE`.
pub const PROT_READ_WRITE: c_int = 3;
/// `MAP_PRIVATE | MAP_ANONYMOUS`.
pub const MAP_PRIVATE_ANONYMOUS: c_int = 0x02 | 0x20;
/// `PROT_READ | PROT_EXEC`.
pub const PROT_READ_EXEC: c_int = 1 | 4;
/// `MAP_FIXED_NOREPLACE`: at this address or nowhere (Linux 4.17; older
/// kernels take the address as a hint).
pub const MAP_FIXED_NOREPLACE: c_int = 0x10_0000;
/// `MAP_NORESERVE`.
pub const MAP_NORESERVE: c_int = 0x4000;
/// `MAP_FAILED`.
pub const MAP_FAILED: *mut c_void = !0usize as *mut c_void;

/// `CLOCK_MONOTONIC` now, in ns.
pub fn monotonic_ns() -> u64 {
    let mut ts = Timespec::default();
    // SAFETY: a valid out pointer; the clock always exists.
    unsafe { clock_gettime(CLOCK_MONOTONIC, &mut ts) };
    (ts.sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.nsec as u64)
}

/// Sleeps for about `ns` nanoseconds (less if a signal comes).
pub fn sleep_ns(ns: u64) {
    let ts = Timespec {
        sec: (ns / 1_000_000_000) as _,
        nsec: (ns % 1_000_000_000) as _,
    };
    // SAFETY: a valid request; no remainder wanted.
    unsafe { nanosleep(&ts, core::ptr::null_mut()) };
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
/// `AF_UNIX`.
pub const AF_UNIX: c_int = 1;
/// `SOCK_STREAM | SOCK_CLOEXEC`.
pub const SOCK_STREAM_CLOEXEC: c_int = 1 | 0o2_000_000;
/// `SOL_SOCKET`.
pub const SOL_SOCKET: c_int = 1;
/// `SO_PEERCRED`.
pub const SO_PEERCRED: c_int = 17;
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
    pub fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
    pub fn getenv(name: *const c_char) -> *const c_char;
    pub fn getuid() -> u32;
    pub fn socket(domain: c_int, kind: c_int, protocol: c_int) -> c_int;
    pub fn bind(fd: c_int, addr: *const SockaddrUn, len: u32) -> c_int;
    pub fn listen(fd: c_int, backlog: c_int) -> c_int;
    pub fn accept4(fd: c_int, addr: *mut c_void, len: *mut u32, flags: c_int) -> c_int;
    pub fn getsockopt(
        fd: c_int,
        level: c_int,
        name: c_int,
        value: *mut c_void,
        len: *mut u32,
    ) -> c_int;
    /// What `pthread_atfork` (a static wrapper in libc_nonshared.a, not
    /// exported by libc.so.6) calls, with this library's handle.
    pub fn __register_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
        dso_handle: *const c_void,
    ) -> c_int;
    /// This library's handle (from the C runtime's start files).
    pub static __dso_handle: u8;
    pub fn pthread_detach(thread: PthreadT) -> c_int;
    pub fn __errno_location() -> *mut c_int;
    pub fn dlopen(name: *const c_char, flags: c_int) -> *mut c_void;
    pub fn mmap(
        addr: *mut c_void,
        len: usize,
        prot: c_int,
        flags: c_int,
        fd: c_int,
        offset: i64,
    ) -> *mut c_void;
    pub fn munmap(addr: *mut c_void, len: usize) -> c_int;
    pub fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int;
    pub fn pthread_key_create(
        key: *mut PthreadKey,
        destructor: Option<unsafe extern "C" fn(*mut c_void)>,
    ) -> c_int;
    pub fn pthread_key_delete(key: PthreadKey) -> c_int;
    pub fn pthread_getspecific(key: PthreadKey) -> *mut c_void;
    pub fn pthread_setspecific(key: PthreadKey, value: *const c_void) -> c_int;
    pub fn syscall(number: core::ffi::c_long, ...) -> core::ffi::c_long;
    pub fn clock_gettime(clock: c_int, ts: *mut Timespec) -> c_int;
    pub fn nanosleep(req: *const Timespec, rem: *mut Timespec) -> c_int;
    pub fn poll(fds: *mut PollFd, n: c_ulong, timeout_ms: c_int) -> c_int;
    pub fn getrandom(buf: *mut c_void, len: usize, flags: core::ffi::c_uint) -> isize;
    pub fn process_vm_readv(
        pid: c_int,
        local: *const IoVec,
        local_count: c_ulong,
        remote: *const IoVec,
        remote_count: c_ulong,
        flags: c_ulong,
    ) -> isize;
}

/// Copies `out.len()` bytes of this process's memory at `address` into
/// `out`, through the kernel, so that an unmapped or unreadable address is
/// an error instead of a fault; returns how many bytes it copied (fewer
/// where readable memory ends first).
pub fn read_own_memory(address: usize, out: &mut [u8]) -> usize {
    let local = IoVec {
        base: out.as_mut_ptr().cast(),
        len: out.len(),
    };
    let remote = IoVec {
        base: address as *mut c_void,
        len: out.len(),
    };
    // SAFETY: the kernel checks the remote range and writes only `out`.
    let n = unsafe { process_vm_readv(getpid(), &local, 1, &remote, 1, 0) };
    n.max(0) as usize
}

/// The calling thread's `errno`.
pub fn errno() -> c_int {
    // SAFETY: glibc's per-thread errno location is always valid.
    unsafe { *__errno_location() }
}

/// The start of `struct dl_phdr_info`; the fields after the name are
/// never read, and the C library owns the struct.
#[repr(C)]
pub struct DlPhdrInfo {
    pub addr: usize,
    pub name: *const c_char,
}

/// What `dl_iterate_phdr` calls once per loaded object.
pub type DlIterateCallback = unsafe extern "C" fn(*mut DlPhdrInfo, usize, *mut c_void) -> c_int;

// The loaded-object functions of the PJRT plugin route (see their manual
// pages).
#[allow(missing_docs)]
unsafe extern "C" {
    pub fn dl_iterate_phdr(callback: DlIterateCallback, data: *mut c_void) -> c_int;
    pub fn dlclose(handle: *mut c_void) -> c_int;
}

/// Hands the C library's free memory back to the system: `malloc_trim(0)`
/// where the C library has it (glibc; looked up, so that a C library
/// without it still loads the agent).
pub fn trim_heap() {
    // SAFETY: a NUL-terminated name looked up in the global scope
    // (RTLD_DEFAULT is the null handle).
    let f = unsafe { dlsym(core::ptr::null_mut(), c"malloc_trim".as_ptr()) };
    if !f.is_null() {
        // SAFETY: glibc's `int malloc_trim(size_t pad)`.
        let trim: extern "C" fn(usize) -> c_int = unsafe { core::mem::transmute(f) };
        trim(0);
    }
}
