//! PyTorch's ops, autograd's backward functions and `record_function`
//! ranges, recorded through RecordFunction callbacks registered for the
//! capture (`at::addGlobalCallback`), on every thread of the program, and
//! removed at its end.
//!
//! The callbacks run on the program's threads, in the middle of its ops:
//! they never block, never allocate, and cannot fail. Each end of a
//! RecordFunction takes a slot of a fixed buffer (records beyond it are
//! counted, never kept) and names are interned into a fixed table, so the
//! target's memory for a capture is bounded whatever it runs. ebtrace
//! checked the callback struct's layout against the headers of the very
//! PyTorch it found before asking for this (`tracer-user`'s
//! `agent::torch_abi`); here only the functions are looked up.
//!
//! PyTorch calls the callbacks through a [`trampoline`] that outlives the
//! agent.

mod layout;
mod names;
mod shapes;
mod trampoline;

use core::{
    ffi::{c_char, c_void},
    sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering},
};

use crate::{
    op_records::{
        self, NO_NAME, NO_SEQUENCE, NameEntry, OpRecord, OpsHeader, SCOPE_BACKWARD_FUNCTION,
        SCOPE_FUNCTION, SCOPE_USER,
    },
    protocol::{OP_SEQUENCE, OP_SHAPES, OPS_ALL},
    python::Text,
    sys,
};
use names::NameSlot;
use trampoline::Trampoline;

/// Records the buffer holds: 40 MiB of address space, resident only as
/// far as a capture fills it.
const CAPACITY: usize = 1 << 20;
/// Slots of the name table (a power of two).
const NAME_SLOTS: usize = 1 << 13;
/// Bytes for names.
const ARENA: usize = 1 << 19;

// Where each part lies in the region. The frame sent at the end is built
// in place, from its start: header, entries, names, records (see
// `op_records`), each moved down over room the previous part did not use.
const ENTRIES_AT: usize = OpsHeader::LEN;
const ARENA_AT: usize = ENTRIES_AT + NAME_SLOTS * NameEntry::LEN;
const RECORDS_AT: usize = (ARENA_AT + ARENA).next_multiple_of(8);
const SLOTS_AT: usize = RECORDS_AT + CAPACITY * OpRecord::LEN;
const COUNTERS_AT: usize = SLOTS_AT + NAME_SLOTS * core::mem::size_of::<NameSlot>();
const REGION_BYTES: usize = (COUNTERS_AT + core::mem::size_of::<Counters>()).next_multiple_of(4096);

/// The region's counters.
#[repr(C)]
struct Counters {
    /// Record slots taken (some past the end: those are dropped).
    next: AtomicUsize,
    /// Records that did not fit.
    dropped: AtomicU64,
    /// Bytes of the arena taken.
    arena_next: AtomicUsize,
    /// Names that did not fit.
    names_lost: AtomicU32,
}

/// The region the callbacks write into while a recording runs.
static REGION: AtomicPtr<u8> = AtomicPtr::new(core::ptr::null_mut());
/// `const char* at::RecordFunction::name() const`.
static NAME_FN: AtomicUsize = AtomicUsize::new(0);
/// Where a RecordFunction keeps its sequence number (0: not read).
static SEQUENCE_AT: AtomicUsize = AtomicUsize::new(0);
/// PyTorch's undefined tensor, while ATen ops' input shapes are read (0:
/// they are not).
static UNDEFINED_TENSOR: AtomicUsize = AtomicUsize::new(0);
/// The pthread key holding each thread's tid, plus one (0: none).
static TID_KEY: AtomicU32 = AtomicU32::new(0);

/// `at::RecordFunctionCallback`, as PyTorch 2's `ATen/record_function.h`
/// lays it out (40 bytes, passed by value).
#[repr(C)]
struct Callback {
    start: usize,
    end: usize,
    sampling_prob: f64,
    scopes: [bool; 10],
    needs_inputs: bool,
    needs_outputs: bool,
    needs_ids: bool,
}

const _: () = assert!(core::mem::size_of::<Callback>() == 40);

type AddGlobalCallback = unsafe extern "C" fn(Callback) -> u64;
type RemoveCallback = unsafe extern "C" fn(u64);
type NameOf = unsafe extern "C" fn(*const c_void) -> *const c_char;
type HasCallbacks = unsafe extern "C" fn() -> bool;

/// The scopes registered, one callback each, in the trampoline's order.
const SCOPES: [u32; 3] = [SCOPE_FUNCTION, SCOPE_BACKWARD_FUNCTION, SCOPE_USER];

/// Mangled names in `libtorch_cpu.so`.
const ADD: &core::ffi::CStr = c"_ZN2at17addGlobalCallbackENS_22RecordFunctionCallbackE";
const REMOVE: &core::ffi::CStr = c"_ZN2at14removeCallbackEm";
const HAS_CALLBACKS: &core::ffi::CStr = c"_ZN2at12hasCallbacksEv";
/// `bool torch::autograd::profiler::isProfilerEnabledInMainThread()`:
/// whether torch.profiler runs, whichever thread started it (its
/// callbacks are that thread's alone, which `at::hasCallbacks()` on the
/// agent's thread does not see).
const PROFILER_ON: &core::ffi::CStr =
    c"_ZN5torch8autograd8profiler29isProfilerEnabledInMainThreadEv";

/// A recording running.
pub struct Recording {
    trampoline: Trampoline,
    handles: [u64; 3],
    remove: RemoveCallback,
    library: *mut c_void,
    region: *mut u8,
    key: sys::PthreadKey,
}

/// Looks `name` up in `library`.
fn symbol(library: *mut c_void, name: &core::ffi::CStr) -> Option<usize> {
    // SAFETY: a handle from dlopen and a NUL-terminated name.
    let f = unsafe { sys::dlsym(library, name.as_ptr()) };
    (!f.is_null()).then_some(f as usize)
}

impl Recording {
    /// Registers the callbacks, each to record a RecordFunction with a
    /// chance of `millionths` in a million (PyTorch draws which), with its
    /// sequence number if `sequence` (ebtrace checked the header the
    /// [`layout`] follows); the text says what records, the error why
    /// nothing does.
    #[allow(clippy::result_large_err)]
    pub fn start(millionths: u32, fields: u32) -> Result<(Recording, Text), Text> {
        let sequence = fields & OP_SEQUENCE != 0;
        let millionths = millionths.clamp(1, OPS_ALL);
        // SAFETY: a NUL-terminated name; RTLD_NOLOAD loads nothing.
        let library = unsafe {
            sys::dlopen(
                c"libtorch_cpu.so".as_ptr(),
                sys::RTLD_LAZY | sys::RTLD_NOLOAD,
            )
        };
        if library.is_null() {
            return Err(Text::new("PyTorch ops: libtorch_cpu.so is not loaded"));
        }
        let close = || {
            // SAFETY: the handle dlopen gave above.
            unsafe { sys::dlclose(library) };
        };
        let (Some(add), Some(remove), Some(name)) = (
            symbol(library, ADD),
            symbol(library, REMOVE),
            symbol(library, layout::NAME),
        ) else {
            close();
            return Err(Text::new(
                "PyTorch ops: libtorch_cpu.so lacks at::addGlobalCallback, at::removeCallback \
                 or at::RecordFunction::name",
            ));
        };
        let trampoline = match Trampoline::get() {
            Ok(t) => t,
            Err(why) => {
                close();
                let mut text = Text::new("PyTorch ops: ");
                text.push(why.as_bytes());
                return Err(text);
            }
        };
        let sequence_at = if sequence {
            sequence_offset(library, name)
        } else {
            Err("ebtrace did not find RecordFunction's members declared as the agent reads them")
        };
        // Shapes are read through the members the sequence number's checks
        // cover.
        let shapes = match (&sequence_at, fields & OP_SHAPES != 0) {
            (_, false) => None,
            (Ok(_), true) => Some(undefined_tensor(library)),
            (Err(_), true) => Some(Err("no sequence numbers, whose checks they need")),
        };
        let seen = Seen {
            sequence_at: *sequence_at.as_ref().unwrap_or(&0),
            undefined_tensor: shapes.and_then(|s| s.ok()).unwrap_or(0),
        };
        let Some((region, key)) = install(&trampoline, name, seen) else {
            close();
            return Err(Text::new(
                "PyTorch ops: no memory or pthread key for the buffer",
            ));
        };
        let asked = |name| {
            symbol(library, name).is_some_and(|f| {
                // SAFETY: PyTorch's `bool at::hasCallbacks()` or `bool
                // isProfilerEnabledInMainThread()`: no argument, a flag read.
                unsafe { core::mem::transmute::<usize, HasCallbacks>(f)() }
            })
        };
        let (profiler, others) = (asked(PROFILER_ON), asked(HAS_CALLBACKS));
        // SAFETY: PyTorch's `CallbackHandle addGlobalCallback(
        // RecordFunctionCallback)`, whose argument's layout ebtrace checked.
        let add: AddGlobalCallback = unsafe { core::mem::transmute(add) };
        let mut handles = [0u64; 3];
        for ((handle, scope), start) in handles.iter_mut().zip(SCOPES).zip(trampoline.start) {
            let mut scopes = [false; 10];
            scopes[scope as usize] = true;
            let callback = Callback {
                start,
                end: trampoline.end,
                sampling_prob: f64::from(millionths) / f64::from(OPS_ALL),
                scopes,
                needs_inputs: scope == SCOPE_FUNCTION && seen.undefined_tensor != 0,
                needs_outputs: false,
                needs_ids: false,
            };
            // SAFETY: see `add` above; the entries stay mapped for good.
            *handle = unsafe { add(callback) };
        }
        let recording = Recording {
            trampoline,
            handles,
            // SAFETY: PyTorch's `void removeCallback(CallbackHandle)`.
            remove: unsafe { core::mem::transmute::<usize, RemoveCallback>(remove) },
            library,
            region,
            key,
        };
        // Driving torch.profiler from inside would cost each op more (see
        // BENCHMARKS.md) and take CUPTI from the program on a GPU.
        let mut text = Text::new(
            "PyTorch ops through RecordFunction callbacks, not torch.profiler: they cost \
             less and leave CUPTI to the program (",
        );
        let _ = core::fmt::Write::write_fmt(
            &mut text,
            format_args!("a buffer of {} records", CAPACITY),
        );
        if millionths < OPS_ALL {
            let _ = core::fmt::Write::write_fmt(
                &mut text,
                format_args!(
                    "; {} in a million RecordFunctions, drawn by PyTorch",
                    millionths
                ),
            );
        }
        match sequence_at {
            Ok(at) => {
                let _ = core::fmt::Write::write_fmt(
                    &mut text,
                    format_args!("; sequence numbers at byte {at} of a RecordFunction"),
                );
            }
            Err(why) => {
                text.push(b"; no sequence numbers: ");
                text.push(why.as_bytes());
            }
        }
        match shapes {
            Some(Ok(_)) => text.push(b"; ATen ops' input shapes"),
            Some(Err(why)) => {
                text.push(b"; no input shapes: ");
                text.push(why.as_bytes());
            }
            None => {}
        }
        // The program's own profiler (or another observer) runs: its
        // callbacks are left as they are, and see what they saw.
        if profiler {
            text.push(b"; beside the program's own torch.profiler, left as it is");
        } else if others {
            text.push(b"; beside the program's own callbacks, left as they are");
        }
        text.push(b")");
        Ok((recording, text))
    }

    /// Removes the callbacks and waits until none runs. A thread stopped
    /// inside one (by a debugger, or SIGSTOP) is waited for as long as it
    /// stays: this is the agent's thread, which ebtrace waits for before it
    /// unloads the agent (and leaves loaded, to take out later, when it
    /// does not end), so the agent's code and buffer stay while that call
    /// needs them.
    fn unregister(&self) {
        for handle in self.handles {
            // SAFETY: a handle `addGlobalCallback` returned, removed once.
            unsafe { (self.remove)(handle) };
        }
        self.trampoline.empty_and_drain();
        REGION.store(core::ptr::null_mut(), Ordering::Release);
    }

    fn release(self) {
        // SAFETY: no callback runs or will run; the region is ours.
        unsafe { sys::munmap(self.region.cast(), REGION_BYTES) };
        TID_KEY.store(0, Ordering::Release);
        // SAFETY: the key made at the start; no callback reads it now.
        unsafe {
            sys::pthread_key_delete(self.key);
            sys::dlclose(self.library);
        }
    }

    /// Stops recording, dropping what was recorded.
    pub fn discard(self) {
        self.unregister();
        self.release();
    }

    /// Stops recording and hands what was recorded to `deliver` as one
    /// [`crate::protocol::TORCH_OPS`] payload.
    pub fn stop(self, deliver: impl FnOnce(&[u8])) {
        self.unregister();
        // SAFETY: no callback runs; the region is ours alone.
        let frame = unsafe { build_frame(self.region) };
        deliver(frame);
        self.release();
    }
}

/// Where `library`'s RecordFunctions keep their sequence number, from the
/// code of `name` (its `RecordFunction::name`) and two more accessors.
fn sequence_offset(library: *mut c_void, name: usize) -> Result<usize, &'static str> {
    let (Some(num_inputs), Some(is_async)) = (
        symbol(library, layout::NUM_INPUTS),
        symbol(library, layout::IS_ASYNC),
    ) else {
        return Err("libtorch_cpu.so lacks RecordFunction::num_inputs or isAsync");
    };
    // SAFETY: the starts of three functions in the library's mapped code,
    // each longer than the bytes read (their instructions and `ret`).
    let code = |at: usize, len: usize| unsafe { core::slice::from_raw_parts(at as *const u8, len) };
    let at = layout::sequence_offset(code(name, 7), code(num_inputs, 17), code(is_async, 8))?;
    Ok(at as usize)
}

/// PyTorch's undefined tensor, once the code that reads input shapes
/// in `library` (`libtorch_cpu.so`) and in `libc10.so` reads them as
/// [`shapes`] does; the error says why not.
fn undefined_tensor(library: *mut c_void) -> Result<usize, &'static str> {
    // SAFETY: a NUL-terminated name; RTLD_NOLOAD loads nothing.
    let c10 = unsafe { sys::dlopen(c"libc10.so".as_ptr(), sys::RTLD_LAZY | sys::RTLD_NOLOAD) };
    if c10.is_null() {
        return Err("libc10.so is not loaded");
    }
    let found = (
        symbol(library, shapes::INPUT_SIZES),
        symbol(c10, shapes::SIZES_CUSTOM),
        symbol(c10, shapes::UNDEFINED_TENSOR),
    );
    // SAFETY: the handle opened above; libtorch_cpu.so keeps libc10.so
    // loaded for the recording.
    unsafe { sys::dlclose(c10) };
    let (Some(input_sizes), Some(sizes_custom), Some(undefined)) = found else {
        return Err("PyTorch lacks inputSizes, TensorImpl::sizes_custom or its undefined tensor");
    };
    // SAFETY: the starts of two functions in the libraries' mapped code,
    // each longer than the bytes read.
    let code = |at: usize, len: usize| unsafe { core::slice::from_raw_parts(at as *const u8, len) };
    shapes::check(
        code(input_sizes, shapes::INPUT_SIZES_BYTES),
        code(sizes_custom, shapes::SIZES_CUSTOM_BYTES),
    )?;
    Ok(undefined)
}

/// What the callbacks read of a RecordFunction beyond its name.
#[derive(Clone, Copy)]
struct Seen {
    /// Where it keeps its sequence number (0: not read).
    sequence_at: usize,
    /// PyTorch's undefined tensor, if input shapes are read (else 0).
    undefined_tensor: usize,
}

/// Maps a region and a pthread key, points the callbacks at them (with
/// `name_of`, PyTorch's `RecordFunction::name`, and what else they read,
/// `seen`) and the trampoline at the callbacks; `None` if there is no
/// memory or key.
fn install(
    trampoline: &Trampoline,
    name_of: usize,
    seen: Seen,
) -> Option<(*mut u8, sys::PthreadKey)> {
    let mut key: sys::PthreadKey = 0;
    // SAFETY: a valid out pointer; no destructor (the values are tids).
    if unsafe { sys::pthread_key_create(&mut key, None) } != 0 {
        return None;
    }
    // SAFETY: fresh private memory, never backed by swap until touched.
    let region = unsafe {
        sys::mmap(
            core::ptr::null_mut(),
            REGION_BYTES,
            sys::PROT_READ_WRITE,
            sys::MAP_PRIVATE_ANONYMOUS | sys::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if region == sys::MAP_FAILED {
        // SAFETY: the key made above, used by no one yet.
        unsafe { sys::pthread_key_delete(key) };
        return None;
    }
    let region = region.cast::<u8>();
    NAME_FN.store(name_of, Ordering::Release);
    SEQUENCE_AT.store(seen.sequence_at, Ordering::Release);
    UNDEFINED_TENSOR.store(seen.undefined_tensor, Ordering::Release);
    TID_KEY.store(key + 1, Ordering::Release);
    REGION.store(region, Ordering::Release);
    trampoline.fill(
        [
            on_start::<SCOPE_FUNCTION> as *const () as usize,
            on_start::<SCOPE_BACKWARD_FUNCTION> as *const () as usize,
            on_start::<SCOPE_USER> as *const () as usize,
        ],
        on_end as *const () as usize,
    );
    Some((region, key))
}

/// The region's counters.
///
/// # Safety
/// `region` is a live region.
unsafe fn counters<'a>(region: *mut u8) -> &'a Counters {
    // SAFETY: the counters lie at an aligned offset of the region.
    unsafe { &*(region.add(COUNTERS_AT) as *const Counters) }
}

/// The region's name table.
///
/// # Safety
/// `region` is a live region.
unsafe fn name_slots<'a>(region: *mut u8) -> &'a [NameSlot] {
    // SAFETY: the slots lie at an aligned offset of the region, zeroed
    // (empty) when it was mapped.
    unsafe { core::slice::from_raw_parts(region.add(SLOTS_AT) as *const NameSlot, NAME_SLOTS) }
}

/// Lays the frame out from the region's start, in place; returns it.
///
/// # Safety
/// `region` is a live region no callback writes into any more.
unsafe fn build_frame<'a>(region: *mut u8) -> &'a [u8] {
    // SAFETY: every offset is inside the region, and each part moves down
    // over room the parts before it did not take.
    unsafe {
        let counters = counters(region);
        let records = counters.next.load(Ordering::Acquire).min(CAPACITY);
        let arena_len = counters.arena_next.load(Ordering::Acquire).min(ARENA);
        let mut names = 0usize;
        for (id, slot) in name_slots(region).iter().enumerate() {
            if let Some((offset, len)) = slot.published() {
                let entry = NameEntry {
                    id: id as u32,
                    offset,
                    len,
                };
                let at = region.add(ENTRIES_AT + names * NameEntry::LEN) as *mut NameEntry;
                at.write_unaligned(entry);
                names += 1;
            }
        }
        let mut end = ENTRIES_AT + names * NameEntry::LEN;
        core::ptr::copy(region.add(ARENA_AT), region.add(end), arena_len);
        end += arena_len;
        core::ptr::copy(
            region.add(RECORDS_AT),
            region.add(end),
            records * OpRecord::LEN,
        );
        end += records * OpRecord::LEN;
        let header = OpsHeader {
            magic: op_records::MAGIC,
            version: op_records::VERSION,
            records: records as u32,
            names: names as u32,
            arena_len: arena_len as u32,
            names_lost: counters.names_lost.load(Ordering::Acquire),
            dropped: counters.dropped.load(Ordering::Acquire),
        };
        core::ptr::copy_nonoverlapping(header.encode().as_ptr(), region, OpsHeader::LEN);
        core::slice::from_raw_parts(region, end)
    }
}

/// The calling thread's kernel tid, kept in the pthread key after the
/// first ask.
fn tid() -> u32 {
    let key = TID_KEY.load(Ordering::Acquire);
    if key == 0 {
        return 0;
    }
    let key = key - 1;
    // SAFETY: a key that exists while callbacks run.
    let kept = unsafe { sys::pthread_getspecific(key) } as usize;
    if kept != 0 {
        return kept as u32;
    }
    // SAFETY: gettid takes nothing and cannot fail.
    let tid = unsafe { sys::syscall(sys::SYS_GETTID) } as u32;
    // SAFETY: as above; the value is an integer, never dereferenced.
    unsafe { sys::pthread_setspecific(key, tid as usize as *const c_void) };
    tid
}

/// Takes a slot for `record`, or counts it dropped.
fn write(region: *mut u8, record: OpRecord) {
    // SAFETY: `region` is live while a callback runs (see `unregister`).
    let counters = unsafe { counters(region) };
    let slot = counters.next.fetch_add(1, Ordering::Relaxed);
    if slot >= CAPACITY {
        counters.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // SAFETY: slot `slot` is this call's alone, inside the records' part.
    unsafe {
        let at = region.add(RECORDS_AT + slot * OpRecord::LEN) as *mut OpRecord;
        at.write(record);
    }
}

/// Start callback for RecordFunctions of `SCOPE`, called by the trampoline
/// as PyTorch calls a `std::unique_ptr<ObserverContext>
/// (*)(const RecordFunction&)`: `ret` is where the (empty) pointer goes.
extern "C" fn on_start<const SCOPE: u32>(
    ret: *mut *mut c_void,
    record_function: *const c_void,
) -> *mut *mut c_void {
    let ts_ns = sys::monotonic_ns();
    // SAFETY: PyTorch passes room for the returned pointer.
    unsafe { ret.write(core::ptr::null_mut()) };
    let region = REGION.load(Ordering::Acquire);
    if region.is_null() {
        return ret;
    }
    let name_of = NAME_FN.load(Ordering::Acquire);
    let name_id = if name_of == 0 {
        NO_NAME
    } else {
        // SAFETY: `at::RecordFunction::name() const`, on the RecordFunction
        // PyTorch passed; it returns a C string that lives through the call.
        let name = unsafe { core::mem::transmute::<usize, NameOf>(name_of)(record_function) };
        // SAFETY: as above; `region` is live while a callback runs.
        unsafe { names::intern(name_slots(region), region, name) }
    };
    let sequence_at = SEQUENCE_AT.load(Ordering::Acquire);
    let sequence = match sequence_at {
        0 => NO_SEQUENCE,
        // SAFETY: the RecordFunction PyTorch passed, whose `sequence_nr_`
        // lies at `at` (see `layout`); `before()` set it ahead of this call.
        at => unsafe {
            (record_function as *const u8)
                .add(at)
                .cast::<i64>()
                .read_unaligned()
        },
    };
    let undefined = UNDEFINED_TENSOR.load(Ordering::Acquire);
    let shapes = if SCOPE != SCOPE_FUNCTION || undefined == 0 || sequence_at == 0 {
        NO_NAME
    } else {
        // SAFETY: `inputs_`, an `ArrayRef` (pointer, length), follows the
        // sequence number (see `layout`); the arguments live through the
        // start callback, which PyTorch called with them boxed.
        unsafe {
            let inputs = (record_function as *const u8).add(sequence_at + 8);
            let args = inputs.cast::<*const u8>().read_unaligned();
            let len = inputs.add(8).cast::<usize>().read_unaligned();
            match shapes::write(args, len, undefined).bytes() {
                Some(text) => names::intern_bytes(name_slots(region), region, text),
                None => NO_NAME,
            }
        }
    };
    write(
        region,
        OpRecord {
            ts_ns,
            record_function: record_function as u64,
            tid: tid(),
            what: op_records::start_what(SCOPE, name_id),
            sequence,
            shapes,
            reserved: 0,
        },
    );
    ret
}

/// End callback: `void (*)(const RecordFunction&, ObserverContext*)`.
extern "C" fn on_end(record_function: *const c_void, _context: *mut c_void) {
    let ts_ns = sys::monotonic_ns();
    let region = REGION.load(Ordering::Acquire);
    if region.is_null() {
        return;
    }
    write(
        region,
        OpRecord {
            ts_ns,
            record_function: record_function as u64,
            tid: tid(),
            what: op_records::END,
            sequence: NO_SEQUENCE,
            shapes: NO_NAME,
            reserved: 0,
        },
    );
}

/// Where the arena lies in `region`, and its counters (for [`names`]).
///
/// # Safety
/// `region` is a live region.
unsafe fn arena<'a>(region: *mut u8) -> (*mut u8, &'a AtomicUsize, &'a AtomicU32) {
    // SAFETY: as the caller promises.
    unsafe {
        let c = counters(region);
        (region.add(ARENA_AT), &c.arena_next, &c.names_lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op_records::{NO_NAME, OpsHeader};

    const NAMES: [&core::ffi::CStr; 3] = [c"aten::addmm", c"aten::mm", c"train_step"];

    /// Where the stand-in RecordFunctions keep their sequence number.
    const SEQUENCE_AT: usize = 200;

    /// Stand-in RecordFunctions: `RECORD_FUNCTIONS[i]` is named `NAMES[i]`
    /// and numbered `i + 40` (the third, a user scope, -1: none).
    static RECORD_FUNCTIONS: [[i64; 32]; 3] = {
        let mut r = [[0; 32]; 3];
        r[0][SEQUENCE_AT / 8] = 40;
        r[1][SEQUENCE_AT / 8] = 41;
        r[2][SEQUENCE_AT / 8] = -1;
        r
    };

    fn record_function(i: usize) -> *const c_void {
        RECORD_FUNCTIONS[i].as_ptr().cast()
    }

    /// A stand-in for `RecordFunction::name`.
    extern "C" fn name_of(record_function: *const c_void) -> *const c_char {
        let base = RECORD_FUNCTIONS.as_ptr() as usize;
        let i = (record_function as usize).wrapping_sub(base) / size_of::<[i64; 32]>();
        NAMES[i.min(NAMES.len() - 1)].as_ptr()
    }

    type Start = extern "C" fn(*mut *mut c_void, *const c_void) -> *mut *mut c_void;
    type End = extern "C" fn(*const c_void, *mut c_void);

    /// Calls go through the trampoline's entries as PyTorch calls them;
    /// the frame holds each start and end with its name and each start
    /// with its sequence number, and once the
    /// slots are emptied a call records nothing and returns an empty
    /// pointer. (One test: the trampoline and the region are the process's.)
    #[test]
    fn calls_through_the_trampoline_are_recorded_and_stop_when_emptied() {
        let trampoline = Trampoline::get().expect("a trampoline");
        let name_of = name_of as *const () as usize;
        let seen = Seen {
            sequence_at: SEQUENCE_AT,
            undefined_tensor: 0,
        };
        let (region, key) = install(&trampoline, name_of, seen).unwrap();
        // SAFETY: the trampoline's entries, with PyTorch's signatures.
        let (start, end): (Start, End) = unsafe {
            (
                core::mem::transmute::<usize, Start>(trampoline.start[0]),
                core::mem::transmute::<usize, End>(trampoline.end),
            )
        };
        // SAFETY: as above.
        let user: Start = unsafe { core::mem::transmute::<usize, Start>(trampoline.start[2]) };
        let pairs = 300_000usize;
        let began = std::time::Instant::now();
        for i in 0..pairs {
            let mut ret: *mut c_void = core::ptr::dangling_mut();
            let rf = record_function(i % 2);
            let slot: *mut *mut c_void = &mut ret;
            let back = start(slot, rf);
            assert!(ret.is_null() && core::ptr::eq(back, slot));
            end(rf, core::ptr::null_mut());
        }
        let took = began.elapsed();
        eprintln!(
            "{:.0} ns a start and end through the trampoline",
            took.as_nanos() as f64 / pairs as f64
        );
        let mut ret = core::ptr::null_mut();
        user(&mut ret, record_function(2));
        end(record_function(2), core::ptr::null_mut());

        trampoline.empty_and_drain();
        REGION.store(core::ptr::null_mut(), Ordering::Release);
        let mut ret: *mut c_void = core::ptr::dangling_mut();
        start(&mut ret, core::ptr::null());
        end(core::ptr::null(), core::ptr::null_mut());
        assert!(ret.is_null());

        // SAFETY: nothing writes into the region any more.
        let frame = unsafe { build_frame(region) };
        let header = OpsHeader::decode(frame).unwrap();
        assert_eq!(header.records as usize, 2 * pairs + 2);
        assert_eq!((header.names, header.dropped, header.names_lost), (3, 0, 0));
        let records_at = frame.len() - header.records as usize * OpRecord::LEN;
        let records: Vec<OpRecord> = frame[records_at..]
            .chunks_exact(OpRecord::LEN)
            .filter_map(OpRecord::decode)
            .collect();
        // SAFETY: gettid takes nothing.
        let tid = unsafe { sys::syscall(sys::SYS_GETTID) } as u32;
        assert!(records.iter().all(|r| r.tid == tid));
        assert_eq!(records[1].what, op_records::END);
        let numbers: Vec<i64> = records[..4].iter().map(|r| r.sequence).collect();
        assert_eq!(numbers, [40, NO_SEQUENCE, 41, NO_SEQUENCE]);
        assert_eq!(records[records.len() - 2].sequence, -1);
        let last_start = records[records.len() - 2].what;
        assert_eq!(last_start >> 24, SCOPE_USER);
        assert_ne!(last_start & 0xff_ffff, NO_NAME);
        assert!(records.windows(2).all(|w| w[0].ts_ns <= w[1].ts_ns));
        // SAFETY: the region and key made above.
        unsafe {
            sys::munmap(region.cast(), REGION_BYTES);
            sys::pthread_key_delete(key);
        }
    }
}
