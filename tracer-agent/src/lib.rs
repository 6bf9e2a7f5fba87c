//! ebtrace's in-process agent.
//!
//! ebtrace loads this library into a running target (ptrace, from a memfd:
//! see `tracer-user/src/agent/inject`) or the program starts with it
//! (`LD_PRELOAD`, see [`preload`]). Its entry point starts one thread that talks to ebtrace
//! over a socket ([`protocol`]) and drives what only the process itself can
//! run: the framework's own profiler session ([`python`]), the profilers
//! of its PJRT plugins ([`pjrt`]) and PyTorch's ops ([`torch_ops`]). When ebtrace's
//! end of the socket closes, whatever the agent started is stopped.
//!
//! It is small and self-contained: `no_std`, no allocator of its own (it
//! never allocates), no unwinding across the C boundary (built with
//! panic=abort), and linked without the C library so that it loads into
//! any target with glibc 2.28 or later.
#![cfg_attr(not(test), no_std)]

pub mod activity;
pub mod op_records;
pub mod protocol;

mod agent;
mod challenge;
mod cupti;
mod kernel_names;
mod pjrt;
pub mod preload;
mod python;
mod sources;
mod sys;
mod torch_ops;

/// Listens for ebtrace when preloaded (see [`preload`]).
#[cfg(feature = "cdylib")]
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = preload::on_load;

/// The name [`ebtrace_agent_attach`] is exported under: what ebtrace calls.
pub const ATTACH_SYMBOL: &str = "ebtrace_agent_attach";
/// The name [`ebtrace_agent_detach`] is exported under.
pub const DETACH_SYMBOL: &str = "ebtrace_agent_detach";

/// Starts the agent on the control socket `fd` (the target's end of a
/// socketpair whose other end ebtrace holds). Returns 0, or -EBUSY if an
/// agent of this library already runs, or another negative errno.
#[cfg_attr(feature = "cdylib", unsafe(no_mangle))]
pub extern "C" fn ebtrace_agent_attach(fd: core::ffi::c_int) -> core::ffi::c_int {
    agent::attach(fd)
}

/// Ends the agent's thread and waits for it, so that the library can be
/// unloaded. ebtrace sends SHUTDOWN first, so this never waits for Python.
#[cfg_attr(feature = "cdylib", unsafe(no_mangle))]
pub extern "C" fn ebtrace_agent_detach() -> core::ffi::c_int {
    agent::detach()
}

/// A panic can only come from the agent's own thread (the entry points
/// cannot panic): end that thread, never the program.
#[cfg(feature = "cdylib")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: ends the calling thread; the agent holds no lock here.
    unsafe { sys::pthread_exit(core::ptr::null_mut()) }
}

/// The unwinder's personality routine, which the precompiled `core` names
/// in its unwind tables. The agent never unwinds; a forced unwind (a
/// thread ending through `pthread_exit`) passes through its frames, which
/// hold nothing to clean up.
#[cfg(feature = "cdylib")]
#[unsafe(no_mangle)]
pub extern "C" fn rust_eh_personality(
    _version: core::ffi::c_int,
    _actions: core::ffi::c_int,
    _class: u64,
    _exception: *mut core::ffi::c_void,
    _context: *mut core::ffi::c_void,
) -> core::ffi::c_int {
    /// `_URC_CONTINUE_UNWIND`.
    const CONTINUE_UNWIND: core::ffi::c_int = 8;
    CONTINUE_UNWIND
}
