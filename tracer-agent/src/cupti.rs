//! What the GPU ran, from CUPTI's activity API inside the target: kernels,
//! copies and memsets as the device timed them, and the driver calls that
//! submitted them (their correlation ids join the two).
//!
//! Only a CUPTI the process can already reach is used: a loaded
//! `libcupti` (PyTorch and jax's CUDA plugin load it), else one on the
//! program's library path. Its API is looked up with `dlsym`, so a missing
//! library or symbol is a message, never a crash.
//!
//! Conflicts: CUDA up to 13.2 allows one CUPTI subscriber per process. A
//! process whose own profiler holds it (torch.profiler, a framework
//! session, Nsight) is left alone and the start fails with one line. A
//! client that finalizes CUPTI while we record (jax ends its sessions with
//! `cuptiFinalize`) costs the records after that; the stop says so.
//!
//! Detaching disables every kind we enabled, stops lending buffers, flushes
//! until CUPTI has handed back every buffer it was lent, unsubscribes and
//! restores the thread-id type; it does not call `cuptiFinalize`, which
//! is documented to block every thread and has crashed real programs (see
//! jax-ml/jax#15384, #40260). CUPTI keeps the buffer callbacks it was
//! given, so the agent pins itself in memory (`RTLD_NODELETE`) before
//! handing them over: unloading the agent never leaves CUPTI a dangling
//! pointer. ebtrace starts a pinned copy again for the process's later
//! captures rather than loading another.

mod buffers;

use core::{
    ffi::{CStr, c_char, c_int, c_void},
    fmt::Write as _,
    sync::atomic::Ordering,
};

use buffers::{
    LENDING, REFUSED, forward, lend_buffer, release_free_buffers, take_back_buffer, take_back_lent,
};

use crate::{
    activity::{self, BatchHeader},
    python::Text,
    sys,
};

type CuptiResult = c_int;
const SUCCESS: CuptiResult = 0;
const ERROR_MAX_LIMIT_REACHED: CuptiResult = 12;
const ERROR_MULTIPLE_SUBSCRIBERS: CuptiResult = 39;
/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`: partly filled buffers too.
const FLUSH_FORCED: u32 = 1;
/// `CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM`: records carry kernel tids.
const THREAD_ID_SYSTEM: c_int = 1;

/// The kinds recorded, in the order they are enabled.
const KINDS: [(u32, &str); 4] = [
    (activity::KIND_CONCURRENT_KERNEL, "kernels"),
    (activity::KIND_MEMCPY, "copies"),
    (activity::KIND_MEMSET, "memsets"),
    (activity::KIND_DRIVER, "driver calls"),
];

/// The subscriber callback: the subscription only claims CUPTI (and tells
/// us whether someone else has); no callback domain is enabled.
extern "C" fn on_callback(_: *mut c_void, _: c_int, _: u32, _: *const c_void) {}

/// The CUPTI functions the agent calls.
struct Api {
    get_version: unsafe extern "C" fn(*mut u32) -> CuptiResult,
    subscribe: unsafe extern "C" fn(
        *mut *mut c_void,
        extern "C" fn(*mut c_void, c_int, u32, *const c_void),
        *mut c_void,
    ) -> CuptiResult,
    unsubscribe: unsafe extern "C" fn(*mut c_void) -> CuptiResult,
    register_callbacks: unsafe extern "C" fn(
        extern "C" fn(*mut *mut u8, *mut usize, *mut usize),
        extern "C" fn(*mut c_void, u32, *mut u8, usize, usize),
    ) -> CuptiResult,
    enable: unsafe extern "C" fn(u32) -> CuptiResult,
    disable: unsafe extern "C" fn(u32) -> CuptiResult,
    flush_all: unsafe extern "C" fn(u32) -> CuptiResult,
    next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> CuptiResult,
    dropped: unsafe extern "C" fn(*mut c_void, u32, *mut usize) -> CuptiResult,
    timestamp: unsafe extern "C" fn(*mut u64) -> CuptiResult,
    set_thread_id_type: unsafe extern "C" fn(c_int) -> CuptiResult,
    get_thread_id_type: Option<unsafe extern "C" fn(*mut c_int) -> CuptiResult>,
    result_string: Option<unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult>,
}

/// The libraries tried, newest first, with the CUDA major version each
/// belongs to (0: unknown).
const LIBRARIES: [(&CStr, i32); 4] = [
    (c"libcupti.so.13", 13),
    (c"libcupti.so.12", 12),
    (c"libcupti.so.11.8", 11),
    (c"libcupti.so", 0),
];

/// The function `F` named `name` in `handle`.
///
/// # Safety
/// `F` is the function pointer type of that CUPTI function.
unsafe fn function<F: Copy>(handle: *mut c_void, name: &CStr) -> Option<F> {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: a handle from dlopen and a NUL-terminated name.
    let p = unsafe { sys::dlsym(handle, name.as_ptr()) };
    // SAFETY: same size (checked above); the type per the contract.
    (!p.is_null()).then(|| unsafe { core::mem::transmute_copy::<*mut c_void, F>(&p) })
}

macro_rules! need {
    ($handle:expr, $name:literal) => {
        // SAFETY: the field's type spells out the C signature of the CUPTI
        // function of that name.
        unsafe { function($handle, $name) }.ok_or($name)?
    };
}

impl Api {
    /// Resolves the API in `handle`; the error names the missing symbol.
    fn resolve(handle: *mut c_void) -> Result<Api, &'static CStr> {
        Ok(Api {
            get_version: need!(handle, c"cuptiGetVersion"),
            subscribe: need!(handle, c"cuptiSubscribe"),
            unsubscribe: need!(handle, c"cuptiUnsubscribe"),
            register_callbacks: need!(handle, c"cuptiActivityRegisterCallbacks"),
            enable: need!(handle, c"cuptiActivityEnable"),
            disable: need!(handle, c"cuptiActivityDisable"),
            flush_all: need!(handle, c"cuptiActivityFlushAll"),
            next_record: need!(handle, c"cuptiActivityGetNextRecord"),
            dropped: need!(handle, c"cuptiActivityGetNumDroppedRecords"),
            timestamp: need!(handle, c"cuptiGetTimestamp"),
            set_thread_id_type: need!(handle, c"cuptiSetThreadIdType"),
            // SAFETY: as in `need!`.
            get_thread_id_type: unsafe { function(handle, c"cuptiGetThreadIdType") },
            // SAFETY: as in `need!`.
            result_string: unsafe { function(handle, c"cuptiGetResultString") },
        })
    }

    /// `CUPTI error N (NAME)`.
    fn describe(&self, t: &mut Text, result: CuptiResult) {
        let _ = write!(t, "CUPTI error {result}");
        let mut s: *const c_char = core::ptr::null();
        if let Some(f) = self.result_string
            // SAFETY: a valid out pointer; CUPTI returns a static string.
            && unsafe { f(result, &mut s) } == SUCCESS
            && !s.is_null()
        {
            // SAFETY: a NUL-terminated static string.
            let name = unsafe { CStr::from_ptr(s) };
            t.push(b" (");
            t.push(name.to_bytes());
            t.push(b")");
        }
    }

    /// The GPU clock and `CLOCK_MONOTONIC` at one instant: the tightest of
    /// a few brackets.
    fn calibrate(&self) -> (u64, u64) {
        let mut best = (0, 0, u64::MAX);
        for _ in 0..20 {
            let before = sys::monotonic_ns();
            let mut gpu = 0;
            // SAFETY: a valid out pointer.
            let ok = unsafe { (self.timestamp)(&mut gpu) } == SUCCESS;
            let after = sys::monotonic_ns();
            let width = after.saturating_sub(before);
            if ok && width < best.2 {
                best = (gpu, before + width / 2, width);
            }
        }
        (best.0, best.1)
    }
}

/// The CUDA version of the process's driver (`cuDriverGetVersion`: 12080
/// for 12.8), which answers before `cuInit` and touches nothing.
#[allow(clippy::result_large_err)]
fn driver_version(driver: *mut c_void) -> Result<i32, Text> {
    type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: the driver's function of that name has this C signature.
    let get: Option<GetVersion> = unsafe { function(driver, c"cuDriverGetVersion") };
    let mut version = 0;
    // SAFETY: a valid out pointer.
    match get.map(|f| unsafe { f(&mut version) }) {
        Some(0) if version > 0 => Ok(version),
        _ => Err(Text::new(
            "the CUDA driver (libcuda.so.1) does not say its version (cuDriverGetVersion)",
        )),
    }
}

/// Whether a CUPTI of CUDA `major` can run on a driver of CUDA `driver`
/// (`cuDriverGetVersion`'s number): CUPTI needs a driver of at least its
/// own major version, and a CUPTI run on an older one can loop until the
/// process's stack is gone, so it is never called there.
fn runs_on(major: i32, driver: i32) -> bool {
    major == 0 || driver / 1000 >= major
}

/// Finds the process's CUPTI: the newest loaded one that runs on its
/// driver, else the newest its library path reaches. Only for a process
/// that has loaded the CUDA driver.
#[allow(clippy::result_large_err)]
fn open_library() -> Result<*mut c_void, Text> {
    // SAFETY: NUL-terminated names; RTLD_NOLOAD never loads anything.
    let driver =
        unsafe { sys::dlopen(c"libcuda.so.1".as_ptr(), sys::RTLD_LAZY | sys::RTLD_NOLOAD) };
    if driver.is_null() {
        return Err(Text::new("no CUDA driver (libcuda.so.1) in the process"));
    }
    let version = driver_version(driver)?;
    let mut refused = None;
    for flags in [sys::RTLD_LAZY | sys::RTLD_NOLOAD, sys::RTLD_LAZY] {
        for (name, major) in LIBRARIES {
            // SAFETY: a NUL-terminated name.
            let handle = unsafe { sys::dlopen(name.as_ptr(), flags) };
            if handle.is_null() {
                continue;
            }
            if runs_on(major, version) {
                return Ok(handle);
            }
            // SAFETY: the handle this dlopen returned, closed once; the
            // library stays as loaded as it was before it.
            unsafe { sys::dlclose(handle) };
            refused.get_or_insert((name, major));
        }
    }
    Err(match refused {
        Some((name, major)) => {
            let mut t = Text::new("the process's CUPTI (");
            t.push(name.to_bytes());
            let _ = write!(
                t,
                ") needs a CUDA {major} driver and its driver is CUDA {}.{}: CUPTI is left \
                 alone, only host-observed GPU work is shown",
                version / 1000,
                version % 1000 / 10
            );
            t
        }
        None => Text::new(
            "the process has CUDA but no libcupti loaded or on its library path \
             (libcupti.so.13/.12); only host-observed GPU work is shown",
        ),
    })
}

/// Whether [`pin_self`] has pinned this copy: ebtrace uses a pinned copy
/// again for later captures, which pin it once.
static PINNED: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

/// Keeps this library mapped for the life of the process: CUPTI keeps the
/// callbacks it is given.
fn pin_self() -> bool {
    if PINNED.load(Ordering::Acquire) {
        return true;
    }
    let mut info = sys::DlInfo::EMPTY;
    // SAFETY: an address inside this library and a valid out pointer; the
    // name dladdr returns is the loaded object's, which dlopen matches
    // without opening anything (RTLD_NOLOAD).
    let pinned = unsafe {
        sys::dladdr(lend_buffer as *const c_void, &mut info) != 0
            && !info.fname.is_null()
            && !sys::dlopen(
                info.fname,
                sys::RTLD_LAZY | sys::RTLD_NOLOAD | sys::RTLD_NODELETE,
            )
            .is_null()
    };
    PINNED.store(pinned, Ordering::Release);
    pinned
}

/// CUPTI recording activity for ebtrace.
pub struct Recording {
    api: Api,
    version: u32,
    subscriber: *mut c_void,
    /// Kinds enabled, as bits of their index in [`KINDS`].
    enabled: u32,
    thread_id_type: Option<c_int>,
    /// Records CUPTI dropped since the window opened (its own count resets
    /// each time it is read).
    dropped: u64,
    /// Whether CUPTI kept a buffer of the agent's after the stop.
    kept_buffer: bool,
}

impl Recording {
    /// Starts recording; the text says what records, the error why not.
    #[allow(clippy::result_large_err)]
    pub fn start() -> Result<(Recording, Text), Text> {
        let handle = open_library()?;
        let api = Api::resolve(handle).map_err(|missing| {
            let mut t = Text::new("the process's libcupti lacks ");
            t.push(missing.to_bytes());
            t
        })?;
        let mut version = 0;
        // SAFETY: a valid out pointer.
        unsafe { (api.get_version)(&mut version) };
        let mut subscriber: *mut c_void = core::ptr::null_mut();
        // SAFETY: a valid out pointer and a callback of this library's,
        // which stays mapped: it is pinned below before this thread, the
        // only one that could unload the library, goes on.
        let r = unsafe { (api.subscribe)(&mut subscriber, on_callback, core::ptr::null_mut()) };
        if r == ERROR_MULTIPLE_SUBSCRIBERS {
            return Err(Text::new(
                "another CUPTI client is subscribed (the program's own profiler: \
                 torch.profiler, a framework session, Nsight); it is left alone",
            ));
        }
        if r != SUCCESS {
            let mut t = Text::new("cuptiSubscribe failed: ");
            api.describe(&mut t, r);
            return Err(t);
        }
        // Pinned only once CUPTI holds a callback: a refused start leaves
        // nothing of the agent behind when it is unloaded.
        if !pin_self() {
            // SAFETY: the subscriber just returned; CUPTI drops its callback.
            unsafe { (api.unsubscribe)(subscriber) };
            return Err(Text::new(
                "the agent could not pin itself in memory; CUPTI not used",
            ));
        }
        let mut recording = Recording {
            api,
            version,
            subscriber,
            enabled: 0,
            thread_id_type: None,
            dropped: 0,
            kept_buffer: false,
        };
        let api = &recording.api;
        if let Some(get) = api.get_thread_id_type {
            let mut previous = 0;
            // SAFETY: a valid out pointer.
            if unsafe { get(&mut previous) } == SUCCESS {
                recording.thread_id_type = Some(previous);
            }
        }
        LENDING.store(true, Ordering::Release);
        // SAFETY: plain calls; the callbacks live as long as the process.
        let registered = unsafe {
            (api.set_thread_id_type)(THREAD_ID_SYSTEM);
            (api.register_callbacks)(lend_buffer, take_back_buffer)
        };
        if registered != SUCCESS {
            let mut t = Text::new("cuptiActivityRegisterCallbacks failed: ");
            api.describe(&mut t, registered);
            recording.stop_recording();
            return Err(t);
        }
        let mut what = Text::new("");
        for (i, (kind, name)) in KINDS.iter().enumerate() {
            // SAFETY: a plain call.
            if unsafe { (api.enable)(*kind) } == SUCCESS {
                recording.enabled |= 1 << i;
                if what.as_bytes().is_empty() {
                    what.push(b": ");
                } else {
                    what.push(b", ");
                }
                what.push(name.as_bytes());
            }
        }
        if recording.enabled & 1 == 0 {
            recording.stop_recording();
            return Err(Text::new("CUPTI refused to record kernels"));
        }
        let mut t = Text::new("CUPTI");
        match activity::cuda_release(version) {
            Some((major, minor)) => {
                let _ = write!(t, " {major}.{minor}");
            }
            None => {
                let _ = write!(t, " (API version {version})");
            }
        }
        t.push(b" activity");
        t.push(what.as_bytes());
        Ok((recording, t))
    }

    /// Forgets the records of the time before the capture window and the
    /// count of those dropped: the buffers are free again for the window.
    pub fn discard_until_now(&mut self) {
        // SAFETY: a plain call.
        unsafe { (self.api.flush_all)(FLUSH_FORCED) };
        buffers::discard_filled();
        self.count_dropped();
        self.dropped = 0;
    }

    /// Adds what CUPTI dropped since the last reading to [`Self::dropped`].
    /// A refused buffer request makes CUPTI drop (and count) the records it
    /// would have held, so the refusals only bound the count from below.
    fn count_dropped(&mut self) -> u64 {
        let mut dropped = 0usize;
        // SAFETY: a valid out pointer; null context = all contexts.
        unsafe { (self.api.dropped)(core::ptr::null_mut(), 0, &mut dropped) };
        self.dropped += (dropped as u64).max(REFUSED.swap(0, Ordering::AcqRel));
        self.dropped
    }

    /// The header of the batches handed over now, with `dropped` records
    /// missing from the window so far.
    fn header(&self, flags: u32, dropped: u64) -> BatchHeader {
        let (gpu_ns, monotonic_ns) = self.api.calibrate();
        BatchHeader {
            api_version: self.version,
            flags,
            gpu_ns,
            monotonic_ns,
            dropped,
        }
    }

    /// Hands the buffers CUPTI has completed so far to `deliver` (as
    /// [`Self::stop`] does) and goes on recording: collected often enough,
    /// nothing is dropped, and the agent's memory stays bounded.
    pub fn collect(&mut self, mut deliver: impl FnMut(&[u8])) -> Option<Text> {
        // SAFETY: a plain call; 0 = only buffers whose records are complete.
        unsafe { (self.api.flush_all)(0) };
        let dropped = self.count_dropped();
        let header = self.header(0, dropped);
        forward(&self.api, &header, &mut deliver)
    }

    /// Stops recording and hands the records to `deliver` in
    /// [`crate::protocol::DEVICE_ACTIVITY`] payloads; returns what went
    /// wrong, if anything.
    pub fn stop(mut self, mut deliver: impl FnMut(&[u8])) -> Option<Text> {
        let finalized = self.stop_recording();
        let flags = if finalized {
            activity::FLAG_FINALIZED
        } else {
            0
        };
        // Counted by stop_recording: what CUPTI drops later (a call that
        // ends as recording stops, with no buffer lent) is past the window.
        let header = self.header(flags, self.dropped);
        let why = forward(&self.api, &header, &mut deliver);
        release_free_buffers();
        if self.kept_buffer {
            return Some(Text::new(
                "CUPTI still holds one of the agent's activity buffers (work still running on \
                 the GPU?): the program's own profiler may record no GPU activity",
            ));
        }
        if finalized {
            return Some(Text::new(
                "another CUPTI client finalized CUPTI during the capture (a framework's \
                 own profiler session ending?): GPU activity after that is missing",
            ));
        }
        why
    }

    /// Disables what was enabled, counts the records dropped until then,
    /// takes back every buffer CUPTI was lent, unsubscribes and restores the
    /// thread-id type; true if CUPTI had been finalized by someone else (our
    /// subscription was gone).
    fn stop_recording(&mut self) -> bool {
        let api = &self.api;
        // SAFETY: plain calls on the handle this recording holds.
        unsafe {
            (api.flush_all)(FLUSH_FORCED);
            for (i, (kind, _)) in KINDS.iter().enumerate() {
                if self.enabled & (1 << i) != 0 {
                    (api.disable)(*kind);
                }
            }
        }
        self.enabled = 0;
        self.count_dropped();
        // Lending stops before the last flushes: the record of a kernel
        // still running comes after them, and a buffer lent for it would
        // be one CUPTI keeps (see take_back_lent). Such a record, of work
        // that ends after the window, is dropped and not counted.
        LENDING.store(false, Ordering::Release);
        self.kept_buffer = !take_back_lent(&self.api);
        REFUSED.store(0, Ordering::Release);
        let api = &self.api;
        // SAFETY: the handle cuptiSubscribe gave.
        let finalized = unsafe { (api.unsubscribe)(self.subscriber) } != SUCCESS;
        if let Some(previous) = self.thread_id_type.take() {
            // SAFETY: a plain call.
            unsafe { (api.set_thread_id_type)(previous) };
        }
        finalized
    }
}

#[cfg(test)]
mod tests {
    use super::runs_on;

    #[test]
    fn cupti_runs_only_on_a_driver_of_its_major_version_or_newer() {
        assert!(runs_on(12, 12080));
        assert!(runs_on(12, 13000));
        assert!(runs_on(13, 13020));
        assert!(!runs_on(13, 12080));
        assert!(!runs_on(12, 11080));
        assert!(runs_on(0, 11080));
    }
}
