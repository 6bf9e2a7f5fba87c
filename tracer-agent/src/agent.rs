//! The agent's thread: answers ebtrace's requests on the control socket and,
//! when ebtrace's end closes, stops whatever ebtrace started and ends.

use core::{
    ffi::{c_int, c_void},
    sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering},
};

use crate::{
    protocol::{self, Header},
    python::Text,
    sources::Sources,
    sys,
};

/// The control socket, owned by whoever swaps it out first: the thread
/// when it ends on its own, or `detach` (which closes it after the join).
static CONTROL_FD: AtomicI32 = AtomicI32::new(-1);
/// The agent's thread, while it has not been joined.
static THREAD: AtomicU64 = AtomicU64::new(0);
static THREAD_EXISTS: AtomicBool = AtomicBool::new(false);
/// Whether [`child_after_fork`] is registered (once per loaded copy: the C
/// library drops it when the copy is unloaded).
static FORK_HANDLER: AtomicBool = AtomicBool::new(false);

/// Starts the agent's thread on the control socket `fd`; 0 or -errno.
pub fn attach(fd: c_int) -> c_int {
    if fd < 0 {
        return -sys::EINVAL;
    }
    if THREAD_EXISTS
        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return -sys::EBUSY;
    }
    CONTROL_FD.store(fd, Ordering::Release);
    let mut thread: sys::PthreadT = 0;
    // SAFETY: a valid out pointer, default attributes, and a start routine
    // that takes the fd by value.
    let rc = unsafe {
        sys::pthread_create(
            &mut thread,
            core::ptr::null(),
            thread_main,
            fd as usize as *mut c_void,
        )
    };
    if rc != 0 {
        CONTROL_FD.store(-1, Ordering::Release);
        THREAD_EXISTS.store(false, Ordering::Release);
        return -rc;
    }
    THREAD.store(thread, Ordering::Release);
    if !FORK_HANDLER.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain function for the child side of fork(),
        // tied to this library (glibc drops it if the library is unloaded).
        unsafe {
            sys::__register_atfork(
                None,
                None,
                Some(child_after_fork),
                &raw const sys::__dso_handle as _,
            )
        };
    }
    0
}

/// In a child forked while the agent runs (a DataLoader's worker, a pool's
/// process): the agent's thread and its session are the parent's alone.
/// The child closes its copy of the control socket (a shutdown would end
/// the parent's session too) and keeps the agent loaded but idle, with no
/// thread and nothing recording: the parent's ebtrace, or the next one
/// loading into the child, takes it out as it takes out a killed
/// ebtrace's. Only async-signal-safe calls: the child of a threaded
/// program may find any lock held.
extern "C" fn child_after_fork() {
    let fd = CONTROL_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: the child's copy of the socket; nothing in it uses it.
        unsafe { sys::close(fd) };
    }
    THREAD.store(0, Ordering::Release);
    THREAD_EXISTS.store(false, Ordering::Release);
    crate::torch_ops::quiet_in_child();
}

/// Ends the agent's thread (waking it if it still waits for a request)
/// and joins it; 0 or -errno. Nothing to do when no thread exists.
pub fn detach() -> c_int {
    if !THREAD_EXISTS.load(Ordering::Acquire) {
        // A forked child's copy: what it inherited of a recording.
        crate::torch_ops::remove_inherited();
        return 0;
    }
    let fd = CONTROL_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: `fd` is the control socket, still open: the thread
        // closes it only if it swaps it out first.
        unsafe { sys::shutdown(fd, sys::SHUT_RDWR) };
    }
    // SAFETY: the thread was created joinable and is joined once.
    let rc = unsafe { sys::pthread_join(THREAD.load(Ordering::Acquire), core::ptr::null_mut()) };
    if fd >= 0 {
        // SAFETY: ours since the swap; the thread no longer uses it.
        unsafe { sys::close(fd) };
    }
    THREAD_EXISTS.store(false, Ordering::Release);
    -rc
}

/// Blocks every signal in the calling thread (the program's signals are
/// for its own threads) and names it `ebtrace-agent`, which tells ebtrace
/// and the reader of a trace what it is.
pub fn quiet_thread() {
    let mut all = sys::SigSet::empty();
    // SAFETY: valid set pointers; the name is a NUL-terminated string.
    unsafe {
        sys::sigfillset(&mut all);
        sys::pthread_sigmask(sys::SIG_SETMASK, &all, core::ptr::null_mut());
        sys::prctl(sys::PR_SET_NAME, c"ebtrace-agent".as_ptr() as _, 0, 0, 0);
    }
}

extern "C" fn thread_main(arg: *mut c_void) -> *mut c_void {
    let fd = arg as usize as c_int;
    quiet_thread();
    serve(fd, false);
    if CONTROL_FD
        .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // SAFETY: swapped out above, so no one else closes it.
        unsafe { sys::close(fd) };
    }
    core::ptr::null_mut()
}

/// Answers requests until a SHUTDOWN or until ebtrace's end closes. With
/// `challenge` (a preloaded agent, whose socket anyone may reach), the
/// peer must first [prove](protocol::PROVE) that it can read the program's
/// memory.
pub fn serve(fd: c_int, challenge: bool) {
    // SAFETY: getpid cannot fail.
    let pid = unsafe { sys::getpid() } as u32;
    let hello = protocol::Hello {
        version: protocol::VERSION,
        pid,
        challenge: if challenge {
            match crate::challenge::fresh() {
                Some(address) => address,
                None => return,
            }
        } else {
            0
        },
    };
    send_frame(fd, protocol::HELLO, &hello.encode());
    if challenge {
        let proven =
            crate::challenge::await_proof(|buf, deadline| read_exact_by(fd, buf, Some(deadline)));
        if !proven || !send_frame(fd, protocol::PROVEN, &[]) {
            return;
        }
    }

    let mut session: Option<Sources> = None;
    // The running session's lease (`StartRequest::lease_ms`) and when it
    // runs out: each request renews it.
    let mut lease_ns = 0u64;
    let mut deadline = None;
    let mut ended_at_deadline = false;
    loop {
        let mut h = [0u8; protocol::HEADER_LEN];
        match read_exact_by(fd, &mut h, deadline) {
            Read::Done => {}
            Read::TimedOut => {
                // No word for the lease: ebtrace hangs, or the peer forgot.
                if let Some(s) = session.take() {
                    s.discard();
                }
                deadline = None;
                ended_at_deadline = true;
                continue;
            }
            Read::Closed => break,
        }
        if session.is_some() {
            deadline = Some(sys::monotonic_ns().saturating_add(lease_ns));
        }
        let header = Header::decode(&h);
        let mut payload = [0u8; protocol::MAX_REQUEST_LEN];
        let Some(payload) = payload.get_mut(..header.len as usize) else {
            break;
        };
        if !matches!(read_exact_by(fd, payload, deadline), Read::Done) {
            break;
        }
        let no_session: &[u8] = if ended_at_deadline {
            b"the agent ended its session: no word from ebtrace for the session's lease"
        } else {
            b"no profiler session is running"
        };
        match header.kind {
            protocol::PING => {
                send_frame(fd, protocol::PONG, &[]);
            }
            protocol::START => {
                let reply = match (&session, protocol::StartRequest::decode(payload)) {
                    (Some(_), _) => Err(Text::new("a profiler session is already running")),
                    (None, None) => Err(Text::new("malformed START request")),
                    (None, Some(start)) => Sources::start(&start.levels).map(|ok| (ok, start)),
                };
                match reply {
                    Ok(((s, framework), start)) => {
                        session = Some(s);
                        ended_at_deadline = false;
                        lease_ns = u64::from(start.lease_ms) * 1_000_000;
                        deadline = Some(sys::monotonic_ns().saturating_add(lease_ns));
                        send_frame(fd, protocol::STARTED, framework.as_bytes())
                    }
                    Err(why) => send_frame(fd, protocol::FAILED, why.as_bytes()),
                };
            }
            protocol::WINDOW_OPEN => match &mut session {
                None => {
                    send_frame(fd, protocol::FAILED, no_session);
                }
                Some(s) => {
                    s.open_window();
                    send_frame(fd, protocol::WINDOW_OPENED, &[]);
                }
            },
            protocol::COLLECT => match &mut session {
                None => {
                    send_frame(fd, protocol::FAILED, no_session);
                }
                Some(s) => {
                    let why = s.collect(|kind, payload| {
                        send_frame(fd, kind, payload);
                    });
                    let why = why.as_ref().map(Text::as_bytes).unwrap_or_default();
                    send_frame(fd, protocol::COLLECTED, why);
                }
            },
            protocol::NAME_KERNELS => {
                let answered =
                    crate::kernel_names::answer(payload, |kind, parts| send_parts(fd, kind, parts));
                if let Err(why) = answered {
                    send_frame(fd, protocol::FAILED, why);
                }
            }
            protocol::STOP => match session.take() {
                None => {
                    send_frame(fd, protocol::FAILED, no_session);
                }
                Some(s) => {
                    deadline = None;
                    let why = s.stop(|kind, payload| {
                        send_frame(fd, kind, payload);
                    });
                    let why = why.as_ref().map(Text::as_bytes).unwrap_or_default();
                    send_frame(fd, protocol::STOPPED, why);
                }
            },
            protocol::STOP_FRAMEWORK => match &mut session {
                None => {
                    send_frame(fd, protocol::FAILED, no_session);
                }
                Some(s) => {
                    let why = s.stop_framework(|kind, payload| {
                        send_frame(fd, kind, payload);
                    });
                    let why = why.as_ref().map(Text::as_bytes).unwrap_or_default();
                    send_frame(fd, protocol::STOPPED, why);
                }
            },
            protocol::SHUTDOWN => {
                if let Some(s) = session.take() {
                    s.discard();
                }
                send_frame(fd, protocol::BYE, &[]);
                return;
            }
            _ => {
                send_frame(fd, protocol::FAILED, b"unknown request");
            }
        }
    }
    // ebtrace is gone (or spoke nonsense): stop what it started, and free
    // what it recorded at once.
    if let Some(s) = session.take() {
        s.discard();
    }
}

/// How a bounded read ended.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// The buffer is full.
    Done,
    /// The deadline passed first.
    TimedOut,
    /// End of stream, or an error.
    Closed,
}

/// Fills `buf`, waiting until `deadline` (`CLOCK_MONOTONIC` ns) at most.
/// A deadline that passes with part of `buf` read is [`Read::Closed`]: the
/// stream's frames can no longer be told apart.
pub(crate) fn read_exact_by(fd: c_int, mut buf: &mut [u8], deadline: Option<u64>) -> Read {
    let wanted = buf.len();
    while !buf.is_empty() {
        if let Some(deadline) = deadline {
            let left_ms = deadline
                .saturating_sub(sys::monotonic_ns())
                .div_ceil(1_000_000);
            if left_ms == 0 {
                return if buf.len() == wanted {
                    Read::TimedOut
                } else {
                    Read::Closed
                };
            }
            let mut poll = sys::PollFd {
                fd,
                events: sys::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let ready = unsafe { sys::poll(&mut poll, 1, left_ms.min(i32::MAX as u64) as c_int) };
            if ready == 0 || (ready < 0 && sys::errno() == sys::EINTR) {
                continue;
            }
            if ready < 0 {
                return Read::Closed;
            }
        }
        // SAFETY: reads into the remaining part of `buf`.
        let n = unsafe { sys::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            buf = &mut buf[n as usize..];
        } else if n == 0 || sys::errno() != sys::EINTR {
            return Read::Closed;
        }
    }
    Read::Done
}

/// Sends one frame; false if ebtrace's end is gone.
fn send_frame(fd: c_int, kind: u32, payload: &[u8]) -> bool {
    send_parts(fd, kind, &[payload])
}

/// Sends one frame whose payload is `parts` one after the other.
fn send_parts(fd: c_int, kind: u32, parts: &[&[u8]]) -> bool {
    let header = Header {
        kind,
        len: parts.iter().map(|p| p.len()).sum::<usize>() as u32,
    }
    .encode();
    send_all(fd, &header) && parts.iter().all(|p| send_all(fd, p))
}

fn send_all(fd: c_int, mut buf: &[u8]) -> bool {
    while !buf.is_empty() {
        // SAFETY: sends from the remaining part of `buf`; MSG_NOSIGNAL keeps
        // a closed peer from raising SIGPIPE in the target.
        let n = unsafe { sys::send(fd, buf.as_ptr().cast(), buf.len(), sys::MSG_NOSIGNAL) };
        if n > 0 {
            buf = &buf[n as usize..];
        } else if n == 0 || sys::errno() != sys::EINTR {
            return false;
        }
    }
    true
}
