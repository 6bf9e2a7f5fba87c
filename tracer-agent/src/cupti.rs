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
//! Detaching disables every kind we enabled, flushes, unsubscribes and
//! restores the thread-id type; it does not call `cuptiFinalize`, which
//! is documented to block every thread and has crashed real programs (see
//! jax-ml/jax#15384, #40260). CUPTI keeps the buffer callbacks it was
//! given, so the agent pins itself in memory (`RTLD_NODELETE`) before
//! handing them over: unloading the agent never leaves CUPTI a dangling
//! pointer.

use core::{
    ffi::{CStr, c_char, c_int, c_void},
    fmt::Write as _,
    sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
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

/// Bytes of one activity buffer (what wprof and XLA use).
const BUFFER_BYTES: usize = 2 << 20;
/// Buffers CUPTI may hold or fill between two collections: the agent's
/// memory is bounded by `BUFFERS * BUFFER_BYTES` (64 MiB); beyond it CUPTI
/// drops records and counts them.
const BUFFERS: usize = 32;
/// Bytes of the frames the records are forwarded in.
const FRAME_BYTES: usize = 1 << 20;

const FREE: u32 = 0;
const LENT: u32 = 1;
const FILLED: u32 = 2;

/// One activity buffer: lent to CUPTI, filled by it, drained by the agent.
struct Slot {
    state: AtomicU32,
    base: AtomicUsize,
    valid: AtomicUsize,
    order: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: Slot = Slot {
    state: AtomicU32::new(FREE),
    base: AtomicUsize::new(0),
    valid: AtomicUsize::new(0),
    order: AtomicU64::new(0),
};
static SLOTS: [Slot; BUFFERS] = [EMPTY_SLOT; BUFFERS];
static FILL_ORDER: AtomicU64 = AtomicU64::new(0);
/// Whether buffers are lent (only while recording).
static LENDING: AtomicBool = AtomicBool::new(false);
/// Buffer requests refused: CUPTI drops what they would have held.
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// A fresh private anonymous mapping of `len` bytes, if there is memory.
fn map_anonymous(len: usize) -> Option<*mut c_void> {
    // SAFETY: asks for new memory; touches no existing mapping.
    let p = unsafe {
        sys::mmap(
            core::ptr::null_mut(),
            len,
            sys::PROT_READ_WRITE,
            sys::MAP_PRIVATE_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != sys::MAP_FAILED).then_some(p)
}

/// `CUpti_BuffersCallbackRequestFunc`: lends a free buffer, mapping it on
/// first use; none while not recording or when all are in use.
extern "C" fn lend_buffer(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    let mut given: *mut u8 = core::ptr::null_mut();
    if LENDING.load(Ordering::Acquire) {
        for slot in &SLOTS {
            if slot
                .state
                .compare_exchange(FREE, LENT, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            let mut base = slot.base.load(Ordering::Acquire);
            if base == 0 {
                let Some(p) = map_anonymous(BUFFER_BYTES) else {
                    slot.state.store(FREE, Ordering::Release);
                    break;
                };
                base = p as usize;
                slot.base.store(base, Ordering::Release);
            }
            given = base as *mut u8;
            break;
        }
    }
    if given.is_null() {
        REFUSED.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: CUPTI passes valid out pointers.
    unsafe {
        *buffer = given;
        *size = if given.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

/// `CUpti_BuffersCallbackCompleteFunc`: marks the buffer filled; the
/// agent's thread reads it at the next collection.
extern "C" fn take_back_buffer(
    _context: *mut c_void,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    let Some(slot) = SLOTS
        .iter()
        .find(|s| s.base.load(Ordering::Acquire) == buffer as usize && !buffer.is_null())
    else {
        return;
    };
    slot.valid.store(valid.min(BUFFER_BYTES), Ordering::Release);
    slot.order
        .store(FILL_ORDER.fetch_add(1, Ordering::AcqRel), Ordering::Release);
    slot.state.store(FILLED, Ordering::Release);
}

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

/// The libraries tried, newest first.
const LIBRARIES: [&CStr; 4] = [
    c"libcupti.so.13",
    c"libcupti.so.12",
    c"libcupti.so.11.8",
    c"libcupti.so",
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

/// Finds the process's CUPTI: a loaded one, else one its library path
/// reaches. Only for a process that has loaded the CUDA driver.
#[allow(clippy::result_large_err)]
fn open_library() -> Result<*mut c_void, Text> {
    // SAFETY: NUL-terminated names; RTLD_NOLOAD never loads anything.
    let driver =
        unsafe { sys::dlopen(c"libcuda.so.1".as_ptr(), sys::RTLD_LAZY | sys::RTLD_NOLOAD) };
    if driver.is_null() {
        return Err(Text::new("no CUDA driver (libcuda.so.1) in the process"));
    }
    for flags in [sys::RTLD_LAZY | sys::RTLD_NOLOAD, sys::RTLD_LAZY] {
        for name in LIBRARIES {
            // SAFETY: a NUL-terminated name.
            let handle = unsafe { sys::dlopen(name.as_ptr(), flags) };
            if !handle.is_null() {
                return Ok(handle);
            }
        }
    }
    Err(Text::new(
        "the process has CUDA but no libcupti loaded or on its library path \
         (libcupti.so.13/.12); only host-observed GPU work is shown",
    ))
}

/// Keeps this library mapped for the life of the process: CUPTI keeps the
/// callbacks it is given.
fn pin_self() -> bool {
    let mut info = sys::DlInfo {
        fname: core::ptr::null(),
        fbase: core::ptr::null_mut(),
        sname: core::ptr::null(),
        saddr: core::ptr::null_mut(),
    };
    // SAFETY: an address inside this library and a valid out pointer; the
    // name dladdr returns is the loaded object's, which dlopen matches
    // without opening anything (RTLD_NOLOAD).
    unsafe {
        sys::dladdr(lend_buffer as *const c_void, &mut info) != 0
            && !info.fname.is_null()
            && !sys::dlopen(
                info.fname,
                sys::RTLD_LAZY | sys::RTLD_NOLOAD | sys::RTLD_NODELETE,
            )
            .is_null()
    }
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
        if !pin_self() {
            return Err(Text::new(
                "the agent could not pin itself in memory; CUPTI not used",
            ));
        }
        let mut subscriber: *mut c_void = core::ptr::null_mut();
        // SAFETY: a valid out pointer and a callback that lives as long as
        // the process (pinned above).
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
        let mut recording = Recording {
            api,
            version,
            subscriber,
            enabled: 0,
            thread_id_type: None,
            dropped: 0,
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
        for slot in &SLOTS {
            let _ = slot
                .state
                .compare_exchange(FILLED, FREE, Ordering::AcqRel, Ordering::Acquire);
        }
        self.count_dropped();
        self.dropped = 0;
    }

    /// Adds what CUPTI dropped since the last reading to [`Self::dropped`].
    fn count_dropped(&mut self) -> u64 {
        let mut dropped = 0usize;
        // SAFETY: a valid out pointer; null context = all contexts.
        unsafe { (self.api.dropped)(core::ptr::null_mut(), 0, &mut dropped) };
        self.dropped += dropped as u64 + REFUSED.swap(0, Ordering::AcqRel);
        self.dropped
    }

    /// The header of the batches handed over now.
    fn header(&mut self, flags: u32) -> BatchHeader {
        let (gpu_ns, monotonic_ns) = self.api.calibrate();
        BatchHeader {
            api_version: self.version,
            flags,
            gpu_ns,
            monotonic_ns,
            dropped: self.count_dropped(),
        }
    }

    /// Hands the buffers CUPTI has completed so far to `deliver` (as
    /// [`Self::stop`] does) and goes on recording: collected often enough,
    /// nothing is dropped, and the agent's memory stays bounded.
    pub fn collect(&mut self, mut deliver: impl FnMut(&[u8])) -> Option<Text> {
        // SAFETY: a plain call; 0 = only buffers whose records are complete.
        unsafe { (self.api.flush_all)(0) };
        let header = self.header(0);
        forward(&self.api, &header, &mut deliver)
    }

    /// Stops recording and hands the records to `deliver` in
    /// [`crate::protocol::DEVICE_ACTIVITY`] payloads; returns what went
    /// wrong, if anything.
    pub fn stop(mut self, mut deliver: impl FnMut(&[u8])) -> Option<Text> {
        let finalized = self.stop_recording();
        let header = self.header(if finalized {
            activity::FLAG_FINALIZED
        } else {
            0
        });
        let why = forward(&self.api, &header, &mut deliver);
        release_free_buffers();
        if finalized {
            return Some(Text::new(
                "another CUPTI client finalized CUPTI during the capture (a framework's \
                 own profiler session ending?): GPU activity after that is missing",
            ));
        }
        why
    }

    /// Disables what was enabled, flushes, unsubscribes and restores the
    /// thread-id type; true if CUPTI had been finalized by someone else
    /// (our subscription was gone).
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
            self.enabled = 0;
            (api.flush_all)(FLUSH_FORCED);
        }
        LENDING.store(false, Ordering::Release);
        // SAFETY: the handle cuptiSubscribe gave.
        let finalized = unsafe { (api.unsubscribe)(self.subscriber) } != SUCCESS;
        if let Some(previous) = self.thread_id_type.take() {
            // SAFETY: a plain call.
            unsafe { (api.set_thread_id_type)(previous) };
        }
        finalized
    }
}

/// Reads the filled buffers in the order they were filled and forwards
/// their records; returns why some were not, if any.
fn forward(api: &Api, header: &BatchHeader, deliver: &mut impl FnMut(&[u8])) -> Option<Text> {
    // Unmapped below.
    let Some(frame) = map_anonymous(FRAME_BYTES) else {
        return Some(Text::new("no memory to forward the GPU activity"));
    };
    // SAFETY: the mapping is FRAME_BYTES long and only this thread uses it.
    let frame = unsafe { core::slice::from_raw_parts_mut(frame as *mut u8, FRAME_BYTES) };
    let mut out = Frame {
        buf: frame,
        len: 0,
        header,
        delivered: false,
    };
    out.reset();
    loop {
        let next = SLOTS
            .iter()
            .filter(|s| s.state.load(Ordering::Acquire) == FILLED)
            .min_by_key(|s| s.order.load(Ordering::Acquire));
        let Some(slot) = next else { break };
        let base = slot.base.load(Ordering::Acquire) as *mut u8;
        let valid = slot.valid.load(Ordering::Acquire);
        for_each_record(api, base, valid, |record, name| {
            out.push(record, name, deliver)
        });
        slot.state.store(FREE, Ordering::Release);
    }
    if !out.delivered {
        // Nothing recorded: the header alone still tells the clock and
        // the drops.
        deliver(&out.buf[..BatchHeader::LEN]);
    } else {
        out.flush(deliver);
    }
    // SAFETY: the mapping made above, no longer used.
    unsafe { sys::munmap(out.buf.as_mut_ptr().cast(), FRAME_BYTES) };
    None
}

/// Calls `visit` with each record of a filled buffer and, for kernels,
/// the name it points at. A record's length is where the next one starts.
fn for_each_record(api: &Api, base: *mut u8, valid: usize, mut visit: impl FnMut(&[u8], &[u8])) {
    let mut current: *mut u8 = core::ptr::null_mut();
    let end = base as usize + valid;
    let mut emit = |from: *mut u8, to: usize| {
        let len = to
            .saturating_sub(from as usize)
            .min(activity::MAX_RECORD_LEN);
        // SAFETY: the record lies inside the buffer CUPTI filled.
        let record = unsafe { core::slice::from_raw_parts(from, len) };
        visit(record, kernel_name(record));
    };
    loop {
        let mut next: *mut u8 = current;
        // SAFETY: the buffer and valid size CUPTI gave; `next` is the
        // cursor CUPTI advances.
        let r = unsafe { (api.next_record)(base, valid, &mut next) };
        if r != SUCCESS || next.is_null() || (next as usize) >= end {
            if !current.is_null() {
                emit(current, end);
            }
            if r != SUCCESS && r != ERROR_MAX_LIMIT_REACHED {
                return;
            }
            return;
        }
        if !current.is_null() {
            emit(current, next as usize);
        }
        current = next;
    }
}

/// The name a kernel record points at (CUPTI owns the string).
fn kernel_name(record: &[u8]) -> &[u8] {
    let kind = record
        .get(..4)
        .map_or(0, |k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
    if !matches!(
        kind,
        activity::KIND_KERNEL | activity::KIND_CONCURRENT_KERNEL
    ) || record.len() < activity::KERNEL_PREFIX_LEN
    {
        return &[];
    }
    let mut p = [0u8; 8];
    p.copy_from_slice(&record[activity::KERNEL_NAME_OFFSET..activity::KERNEL_NAME_OFFSET + 8]);
    let name = usize::from_le_bytes(p) as *const u8;
    if name.is_null() {
        return &[];
    }
    let mut len = 0;
    // SAFETY: CUPTI's name strings are NUL-terminated and live as long as
    // the module they name; at most MAX_NAME_LEN bytes are read.
    unsafe {
        while len < activity::MAX_NAME_LEN && *name.add(len) != 0 {
            len += 1;
        }
        core::slice::from_raw_parts(name, len)
    }
}

/// Unmaps the buffers CUPTI does not hold (they are mapped again when
/// recording restarts).
fn release_free_buffers() {
    for slot in &SLOTS {
        if slot
            .state
            .compare_exchange(FREE, LENT, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        let base = slot.base.swap(0, Ordering::AcqRel);
        if base != 0 {
            // SAFETY: a buffer mapped by `lend_buffer`, held by no one.
            unsafe { sys::munmap(base as *mut c_void, BUFFER_BYTES) };
        }
        slot.state.store(FREE, Ordering::Release);
    }
}

/// A DEVICE_ACTIVITY payload being filled.
struct Frame<'a> {
    buf: &'a mut [u8],
    len: usize,
    header: &'a BatchHeader,
    delivered: bool,
}

impl Frame<'_> {
    fn reset(&mut self) {
        self.buf[..BatchHeader::LEN].copy_from_slice(&self.header.encode());
        self.len = BatchHeader::LEN;
    }

    fn push(&mut self, record: &[u8], name: &[u8], deliver: &mut impl FnMut(&[u8])) {
        let need = 8 + record.len() + name.len();
        if self.len + need > self.buf.len() {
            self.flush(deliver);
        }
        let at = self.len;
        self.buf[at..at + 4].copy_from_slice(&(record.len() as u32).to_le_bytes());
        self.buf[at + 4..at + 8].copy_from_slice(&(name.len() as u32).to_le_bytes());
        self.buf[at + 8..at + 8 + record.len()].copy_from_slice(record);
        self.buf[at + 8 + record.len()..at + need].copy_from_slice(name);
        self.len += need;
    }

    fn flush(&mut self, deliver: &mut impl FnMut(&[u8])) {
        if self.len > BatchHeader::LEN {
            deliver(&self.buf[..self.len]);
            self.delivered = true;
        }
        self.reset();
    }
}
