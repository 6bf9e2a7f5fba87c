//! Names of kernels whose function handles the program looked up before
//! ebtrace attached: the driver itself tells them (`cuFuncGetName`,
//! `cuKernelGetName`, CUDA 12.3 and later), with or without CUPTI.
//!
//! The handles come from ebtrace, which saw the program launch them during
//! the capture, but they are values the program passed: one may since
//! have been freed (its module unloaded), and a peer could send anything.
//! A handle is handed to the driver only where the memory it points at can
//! be read, and the name the driver answers is copied out through the
//! kernel ([`sys::read_own_memory`]), never read in place: a wild handle
//! gets no name, never a fault in the program.

use core::ffi::{c_char, c_int, c_void};

use crate::{protocol, sys};

type GetName = unsafe extern "C" fn(*mut *const c_char, *mut c_void) -> c_int;

/// Answers a [`protocol::NAME_KERNELS`] request whose payload is
/// `handles` (u64 little-endian each): one [`protocol::KERNEL_NAMES`]
/// frame, written with `send` as `(kind, header, parts)`, or why not.
pub fn answer(
    handles: &[u8],
    mut send: impl FnMut(u32, &[&[u8]]) -> bool,
) -> Result<(), &'static [u8]> {
    if !handles.len().is_multiple_of(8) || handles.len() / 8 > protocol::MAX_NAMED_KERNELS {
        return Err(b"malformed NAME_KERNELS request");
    }
    // SAFETY: a NUL-terminated name; RTLD_NOLOAD never loads anything.
    let driver =
        unsafe { sys::dlopen(c"libcuda.so.1".as_ptr(), sys::RTLD_LAZY | sys::RTLD_NOLOAD) };
    if driver.is_null() {
        return Err(b"no CUDA driver (libcuda.so.1) in the process");
    }
    let lookup = |name: &core::ffi::CStr| {
        // SAFETY: a handle dlopen gave and a NUL-terminated name.
        let f = unsafe { sys::dlsym(driver, name.as_ptr()) };
        // SAFETY: the driver's documented signature for both functions.
        (!f.is_null()).then(|| unsafe { core::mem::transmute::<*mut c_void, GetName>(f) })
    };
    let (function_name, kernel_name) = (lookup(c"cuFuncGetName"), lookup(c"cuKernelGetName"));
    let result = if function_name.is_none() && kernel_name.is_none() {
        Err(&b"the process's CUDA driver has no cuFuncGetName (CUDA 12.3 or later has it)"[..])
    } else {
        let mut names: [&[u8]; protocol::MAX_NAMED_KERNELS] = [&[]; protocol::MAX_NAMED_KERNELS];
        let count = handles.len() / 8;
        for (i, chunk) in handles.chunks_exact(8).enumerate() {
            let mut h = [0u8; 8];
            h.copy_from_slice(chunk);
            let handle = u64::from_le_bytes(h) as usize as *mut c_void;
            names[i] = [function_name, kernel_name]
                .into_iter()
                .flatten()
                .find_map(|get| name_of(get, handle))
                .unwrap_or(&[]);
        }
        let mut lengths = [0u8; 4 * protocol::MAX_NAMED_KERNELS];
        for (i, name) in names[..count].iter().enumerate() {
            lengths[4 * i..4 * i + 4].copy_from_slice(&(name.len() as u32).to_le_bytes());
        }
        // The lengths first, then the names one after the other.
        let mut parts: [&[u8]; protocol::MAX_NAMED_KERNELS + 1] =
            [&[]; protocol::MAX_NAMED_KERNELS + 1];
        parts[0] = &lengths[..4 * count];
        parts[1..=count].copy_from_slice(&names[..count]);
        send(protocol::KERNEL_NAMES, &parts[..=count]);
        Ok(())
    };
    // SAFETY: the reference dlopen took above.
    unsafe { sys::dlclose(driver) };
    result
}

/// Bytes at a handle that must be readable before the driver may look at
/// it: the start of the driver's object, where it keeps what it checks.
const HANDLE_BYTES: usize = 64;

/// The name the driver gives `handle`, if it knows it: at most
/// [`crate::activity::MAX_NAME_LEN`] bytes, all of them readable memory.
fn name_of(get: GetName, handle: *mut c_void) -> Option<&'static [u8]> {
    let mut probe = [0u8; HANDLE_BYTES];
    if handle.is_null() || sys::read_own_memory(handle as usize, &mut probe) != HANDLE_BYTES {
        return None;
    }
    let mut name: *const c_char = core::ptr::null();
    // SAFETY: a valid out pointer and a handle into readable memory; the
    // driver validates what it finds there.
    if unsafe { get(&mut name, handle) } != 0 || name.is_null() {
        return None;
    }
    let len = readable_c_string_len(name as usize)?;
    // SAFETY: the `len` bytes at `name` were just read through the kernel,
    // and the driver's name strings live as long as their module.
    Some(unsafe { core::slice::from_raw_parts(name.cast::<u8>(), len) })
}

/// The length of the NUL-terminated string at `address` if all of it and
/// its NUL are readable, or its first [`crate::activity::MAX_NAME_LEN`]
/// bytes where it is longer.
fn readable_c_string_len(address: usize) -> Option<usize> {
    let mut chunk = [0u8; 256];
    let mut len = 0;
    while len < crate::activity::MAX_NAME_LEN {
        let want = chunk.len().min(crate::activity::MAX_NAME_LEN - len);
        let got = sys::read_own_memory(address.checked_add(len)?, &mut chunk[..want]);
        if let Some(end) = chunk[..got].iter().position(|b| *b == 0) {
            return Some(len + end);
        }
        if got < want {
            // Readable memory ended before the string did.
            return None;
        }
        len += got;
    }
    Some(len)
}
