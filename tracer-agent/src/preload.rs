//! Start-time attach, for fleets: a program started with the agent in
//! `LD_PRELOAD` and `EBTRACE_AGENT=listen` gets one thread that waits, idle,
//! for ebtrace on the abstract unix socket `@ebtrace-agent.<pid>`
//! ([`protocol::SOCKET_PREFIX`]); ebtrace connects to it instead of loading
//! the agent with ptrace. Each connection is served like an injected
//! agent's socket (the session stops when ebtrace's end closes); the
//! thread then waits for the next one. Only root or the program's own user
//! may connect. A forked child gets a listener of its own.

use core::{
    ffi::{c_int, c_void},
    sync::atomic::{AtomicI32, Ordering},
};

use crate::{agent, protocol, sys};

/// The environment variable that asks a preloaded agent to listen.
pub const ENV: &core::ffi::CStr = c"EBTRACE_AGENT";

/// The listening socket, closed in a forked child (which listens anew).
static LISTENER: AtomicI32 = AtomicI32::new(-1);

/// Runs when the library is loaded: listens if preloaded and asked to.
pub extern "C" fn on_load() {
    if !wanted() {
        return;
    }
    start_listener();
    // SAFETY: registers a plain function for the child side of fork(),
    // tied to this library (glibc drops it if the library is unloaded).
    unsafe {
        sys::__register_atfork(
            None,
            None,
            Some(after_fork),
            &raw const sys::__dso_handle as _,
        )
    };
}

extern "C" fn after_fork() {
    let old = LISTENER.swap(-1, Ordering::AcqRel);
    if old >= 0 {
        // SAFETY: the parent's socket, inherited; the child does not serve it.
        unsafe { sys::close(old) };
    }
    start_listener();
}

/// `EBTRACE_AGENT=listen`, and loaded from a file (ebtrace's ptrace loads
/// come from `/proc/self/fd/N` and must never listen: they are unloaded).
fn wanted() -> bool {
    // SAFETY: a NUL-terminated name; the value is NUL-terminated or null.
    let value = unsafe { sys::getenv(ENV.as_ptr()) };
    // SAFETY: non-null, NUL-terminated (checked by the caller above).
    if value.is_null() || unsafe { core::ffi::CStr::from_ptr(value) } != c"listen" {
        return false;
    }
    let mut info = sys::DlInfo::EMPTY;
    // SAFETY: any address inside this library, and a valid out pointer;
    // `fname` is NUL-terminated when set.
    unsafe {
        sys::dladdr(on_load as *const c_void, &mut info) != 0
            && !info.fname.is_null()
            && !core::ffi::CStr::from_ptr(info.fname)
                .to_bytes()
                .starts_with(b"/proc/self/fd/")
    }
}

fn start_listener() {
    // SAFETY: plain socket calls on a descriptor this function owns; the
    // address is a valid sockaddr_un of the length given.
    unsafe {
        let fd = sys::socket(sys::AF_UNIX, sys::SOCK_STREAM_CLOEXEC, 0);
        if fd < 0 {
            return;
        }
        let mut addr = sys::SockaddrUn {
            family: sys::AF_UNIX as u16,
            path: [0; 108],
        };
        let len = protocol::abstract_socket_name(sys::getpid() as u32, &mut addr.path[1..]);
        if sys::bind(fd, &addr, (2 + 1 + len) as u32) != 0 || sys::listen(fd, 4) != 0 {
            sys::close(fd);
            return;
        }
        let mut thread: sys::PthreadT = 0;
        if sys::pthread_create(
            &mut thread,
            core::ptr::null(),
            listener_main,
            fd as usize as *mut c_void,
        ) != 0
        {
            sys::close(fd);
            return;
        }
        sys::pthread_detach(thread);
        LISTENER.store(fd, Ordering::Release);
    }
}

extern "C" fn listener_main(arg: *mut c_void) -> *mut c_void {
    let listener = arg as usize as c_int;
    agent::quiet_thread();
    loop {
        // SAFETY: accepts on our listening socket; no address wanted.
        let fd = unsafe {
            sys::accept4(
                listener,
                core::ptr::null_mut(),
                core::ptr::null_mut(),
                0o2_000_000,
            )
        };
        if fd < 0 {
            if sys::errno() == sys::EINTR {
                continue;
            }
            // Closed in a forked child, or out of descriptors: stop.
            return core::ptr::null_mut();
        }
        if peer_may_connect(fd) {
            agent::serve(fd, true);
        }
        // SAFETY: the accepted connection, ours.
        unsafe { sys::close(fd) };
    }
}

/// Root, or the program's own user (the proof comes after).
fn peer_may_connect(fd: c_int) -> bool {
    let mut cred = sys::Ucred::default();
    let mut len = size_of::<sys::Ucred>() as u32;
    // SAFETY: a valid out buffer of the length given.
    let ok = unsafe {
        sys::getsockopt(
            fd,
            sys::SOL_SOCKET,
            sys::SO_PEERCRED,
            (&mut cred as *mut sys::Ucred).cast(),
            &mut len,
        )
    } == 0;
    // SAFETY: getuid cannot fail.
    ok && (cred.uid == 0 || cred.uid == unsafe { sys::getuid() })
}
