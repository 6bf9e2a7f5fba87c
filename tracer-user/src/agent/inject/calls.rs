//! Calls made on the thread of a session, by the C library function's
//! name: each puts its arguments in the session's scratch memory and reads
//! back what the function returned.

use super::{
    InjectError,
    session::Session,
    symbols::{LIBC_DLOPEN_MODE_FLAG, TargetFns},
};

const SYS_MEMFD_CREATE: u64 = 319;

/// Calls on the thread of a session, by function name.
pub struct Calls<'a> {
    pub s: &'a mut Session,
    pub fns: TargetFns,
}

impl Calls<'_> {
    pub fn pid(&self) -> u32 {
        self.s.pid()
    }

    /// Has the thread's `errno` and `dlerror()` state put back at the end:
    /// the calls' failures set the one and every call resets the other,
    /// and the program may be about to read its own. A C library without
    /// `__errno_location` (none known) leaves both as the calls do; one
    /// older than glibc 2.34, the `dlerror()` state.
    pub fn keep_thread_state(&mut self) {
        if let Some(f) = self.fns.errno_location
            && let Err(e) = self
                .s
                .keep_thread_state(f, self.fns.dlerror_state_from_errno)
        {
            log::debug!("pid {}: errno not kept: {e}", self.pid());
        }
    }

    pub fn dlopen(&mut self, path: &str, flags: i32) -> Result<u64, InjectError> {
        self.s.reset_scratch();
        let p = self.s.put_str(path)?;
        let mut mode = flags as u64;
        if self.fns.dlerror.is_none() {
            mode |= LIBC_DLOPEN_MODE_FLAG;
        }
        self.s.call("dlopen", self.fns.dlopen, &[p, mode])
    }

    pub fn dlsym(&mut self, handle: u64, name: &str) -> Result<u64, InjectError> {
        self.s.reset_scratch();
        let p = self.s.put_str(name)?;
        self.s.call("dlsym", self.fns.dlsym, &[handle, p])
    }

    /// Whether `dlclose` took a reference (it refuses once an object that
    /// stays loaded has none left).
    pub fn dlclose(&mut self, handle: u64) -> Result<bool, InjectError> {
        let r = self.s.call("dlclose", self.fns.dlclose, &[handle])?;
        Ok(r as i32 == 0)
    }

    /// A `dlopen` handle of the loaded object that `address` is in, taken
    /// by the name the loader knows it by (`RTLD_NOLOAD`: a reference,
    /// never a load). None where no object holds `address`, or where the
    /// name leads to another object.
    pub fn loaded_object_at(&mut self, address: u64) -> Result<Option<u64>, InjectError> {
        let Some(dladdr) = self.fns.dladdr else {
            return Ok(None);
        };
        self.s.reset_scratch();
        // Dl_info: the object's name and base, then the symbol's.
        let info = self.s.put(&[0; 32])?;
        if self.s.call("dladdr", dladdr, &[address, info])? as i32 == 0 {
            return Ok(None);
        }
        let mut fields = [0u8; 16];
        self.s.read(info, &mut fields)?;
        let [name_at, base] = [&fields[..8], &fields[8..]]
            .map(|f| u64::from_le_bytes(f.try_into().expect("8 bytes")));
        let name = self.s.read_cstring(name_at)?;
        let handle = self.dlopen(&name, libc::RTLD_NOW | libc::RTLD_NOLOAD)?;
        if handle == 0 {
            return Ok(None);
        }
        // The handle is the object's link map (glibc) or descriptor (musl),
        // whose first field is its base for a library linked at 0.
        let mut first = [0u8; 8];
        self.s.read(handle, &mut first)?;
        if u64::from_le_bytes(first) != base {
            self.dlclose(handle)?;
            return Ok(None);
        }
        Ok(Some(handle))
    }

    pub fn close(&mut self, fd: i32) -> Result<(), InjectError> {
        self.s.call("close", self.fns.close, &[fd as u64]).map(drop)
    }

    /// The target's `dlerror()` text.
    pub fn dlerror(&mut self) -> String {
        let Some(f) = self.fns.dlerror else {
            return "no reason given (this C library has no dlerror)".into();
        };
        match self.s.call("dlerror", f, &[]) {
            Ok(0) => "no reason given".into(),
            Ok(p) => self
                .s
                .read_cstring(p)
                .unwrap_or_else(|e| format!("(its message is unreadable: {e})")),
            Err(e) => format!("(dlerror failed: {e})"),
        }
    }

    pub fn memfd_create(&mut self, name: &str) -> Result<i32, InjectError> {
        self.s.reset_scratch();
        let name = self.s.put_str(name)?;
        let flags = (libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64;
        let fd = if self.fns.memfd_is_syscall {
            self.s.call(
                "syscall",
                self.fns.memfd_create,
                &[SYS_MEMFD_CREATE, name, flags],
            )?
        } else {
            self.s
                .call("memfd_create", self.fns.memfd_create, &[name, flags])?
        } as i32;
        if fd < 0 {
            return Err(InjectError::TargetCall {
                pid: self.pid(),
                call: "memfd_create",
                detail: "it returned -1 (out of descriptors or memory?)".into(),
            });
        }
        Ok(fd)
    }

    pub fn socketpair(&mut self) -> Result<[i32; 2], InjectError> {
        self.s.reset_scratch();
        let slot = self.s.put(&[0xff; 8])?;
        let kind = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        let r = self.s.call(
            "socketpair",
            self.fns.socketpair,
            &[libc::AF_UNIX as u64, kind, 0, slot],
        )?;
        let mut b = [0u8; 8];
        self.s.read(slot, &mut b)?;
        if r as i32 != 0 {
            return Err(InjectError::TargetCall {
                pid: self.pid(),
                call: "socketpair",
                detail: "it returned -1 (out of descriptors?)".into(),
            });
        }
        let fd = |i: usize| i32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Ok([fd(0), fd(4)])
    }
}
