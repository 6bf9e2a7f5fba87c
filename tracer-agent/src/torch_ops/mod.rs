//! PyTorch's ops, autograd's backward functions and `record_function`
//! ranges, recorded through RecordFunction callbacks registered for the
//! capture (`at::addGlobalCallback`), on every thread of the program, and
//! removed at its end.
//!
//! The [`callbacks`] run on the program's threads, in the middle of its
//! ops: they never block, never allocate, and cannot fail. Each end of a
//! RecordFunction takes a slot of a fixed buffer (records beyond it are
//! counted, never kept) and names are interned into a fixed table (the
//! [`region`]), so the target's memory for a capture is bounded whatever
//! it runs. ebtrace checked the callback struct's layout against the
//! headers of the very PyTorch it found before asking for this
//! (`tracer-user`'s `agent::torch_abi`); here only the functions are
//! looked up.
//!
//! PyTorch calls the callbacks through a [`trampoline`] that outlives the
//! agent.

mod callbacks;
mod layout;
mod names;
mod region;
mod shapes;
mod trampoline;

use core::{
    ffi::c_void,
    fmt::Write as _,
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
};

use crate::{
    op_records::{SCOPE_BACKWARD_FUNCTION, SCOPE_FUNCTION, SCOPE_USER},
    protocol::{OP_SEQUENCE, OP_SHAPES, OPS_ALL},
    python::Text,
    sys,
};
use callbacks::{Seen, install};
use region::{CAPACITY, build_frame};
use trampoline::Trampoline;

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

/// The first `len` bytes of the code of the function at `at`.
///
/// # Safety
/// `at` is the start of a function in mapped code longer than `len` bytes
/// (its instructions and `ret`).
unsafe fn code_at<'a>(at: usize, len: usize) -> &'a [u8] {
    // SAFETY: as the caller promises.
    unsafe { core::slice::from_raw_parts(at as *const u8, len) }
}

/// PyTorch's library and the functions a recording calls in it.
struct Torch {
    /// `libtorch_cpu.so`, opened for the recording.
    library: *mut c_void,
    add: usize,
    remove: usize,
    /// `RecordFunction::name`.
    name: usize,
}

impl Torch {
    /// Opens the loaded `libtorch_cpu.so` and finds the functions.
    #[allow(clippy::result_large_err)]
    fn open() -> Result<Torch, Text> {
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
        match (
            symbol(library, ADD),
            symbol(library, REMOVE),
            symbol(library, layout::NAME),
        ) {
            (Some(add), Some(remove), Some(name)) => Ok(Torch {
                library,
                add,
                remove,
                name,
            }),
            _ => {
                // SAFETY: the handle dlopen gave above.
                unsafe { sys::dlclose(library) };
                Err(Text::new(
                    "PyTorch ops: libtorch_cpu.so lacks at::addGlobalCallback, \
                     at::removeCallback or at::RecordFunction::name",
                ))
            }
        }
    }

    /// Whether PyTorch's flag function `name` (`bool f()`) says yes.
    fn asks(&self, name: &core::ffi::CStr) -> bool {
        symbol(self.library, name).is_some_and(|f| {
            // SAFETY: PyTorch's `bool at::hasCallbacks()` or `bool
            // isProfilerEnabledInMainThread()`: no argument, a flag read.
            unsafe { core::mem::transmute::<usize, HasCallbacks>(f)() }
        })
    }

    /// Registers one callback a scope, each entering through `trampoline`
    /// and recording a RecordFunction with a chance of `millionths` in a
    /// million; returns their handles.
    fn register(&self, trampoline: &Trampoline, millionths: u32, seen: Seen) -> [u64; 3] {
        // SAFETY: PyTorch's `CallbackHandle addGlobalCallback(
        // RecordFunctionCallback)`, whose argument's layout ebtrace checked.
        let add: AddGlobalCallback = unsafe { core::mem::transmute(self.add) };
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
        handles
    }
}

/// What a recording reads beyond names, or why not.
struct Extras {
    sequence_at: Result<usize, &'static str>,
    /// None where not asked for.
    shapes: Option<Result<usize, &'static str>>,
}

impl Extras {
    /// What of `fields` (`OP_SEQUENCE`, `OP_SHAPES`) `torch` lets the
    /// callbacks read.
    fn find(torch: &Torch, fields: u32) -> Extras {
        let sequence_at = if fields & OP_SEQUENCE != 0 {
            sequence_offset(torch.library, torch.name)
        } else {
            Err("ebtrace did not find RecordFunction's members declared as the agent reads them")
        };
        // Shapes are read through the members the sequence number's checks
        // cover.
        let shapes = match (&sequence_at, fields & OP_SHAPES != 0) {
            (_, false) => None,
            (Ok(_), true) => Some(undefined_tensor(torch.library)),
            (Err(_), true) => Some(Err("no sequence numbers, whose checks they need")),
        };
        Extras {
            sequence_at,
            shapes,
        }
    }

    fn seen(&self) -> Seen {
        Seen {
            sequence_at: *self.sequence_at.as_ref().unwrap_or(&0),
            undefined_tensor: self.shapes.and_then(|s| s.ok()).unwrap_or(0),
        }
    }
}

/// The line saying what a recording records: with a chance of
/// `millionths` in a million, `extras`, beside the program's own
/// torch.profiler (`profiler`) or other callbacks (`others`).
fn start_line(millionths: u32, extras: &Extras, profiler: bool, others: bool) -> Text {
    // Driving torch.profiler from inside would cost each op more (see
    // BENCHMARKS.md) and take CUPTI from the program on a GPU.
    let mut text = Text::new(
        "PyTorch ops through RecordFunction callbacks, not torch.profiler: they cost \
         less and leave CUPTI to the program (",
    );
    let _ = write!(text, "a buffer of {CAPACITY} records");
    if millionths < OPS_ALL {
        let _ = write!(
            text,
            "; {millionths} in a million RecordFunctions, drawn by PyTorch"
        );
    }
    match extras.sequence_at {
        Ok(at) => {
            let _ = write!(text, "; sequence numbers at byte {at} of a RecordFunction");
        }
        Err(why) => {
            text.push(b"; no sequence numbers: ");
            text.push(why.as_bytes());
        }
    }
    match extras.shapes {
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
    text
}

/// The callbacks registered now, and PyTorch's function that removes them
/// (0: none registered). A child forked meanwhile has them too and no
/// thread of the agent's to remove them: [`remove_inherited`] does.
static REGISTERED: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
static REMOVE_FN: AtomicUsize = AtomicUsize::new(0);

/// In a child forked while ops were recorded: the callbacks, which stay
/// registered with PyTorch (asking it to remove them here could wait for a
/// lock a thread of the parent held at the fork), record nothing and
/// return at once, until [`remove_inherited`]. Async-signal-safe.
pub fn quiet_in_child() {
    callbacks::stop_writing();
    trampoline::empty_existing();
}

/// Removes the callbacks a forked child inherited from a recording under
/// way in its parent (nothing where none was): from the agent's exit,
/// which ebtrace calls in the child as in any process, on a thread that
/// holds no lock. The child then runs its ops as if never traced.
pub fn remove_inherited() {
    let remove = REMOVE_FN.swap(0, Ordering::AcqRel);
    if remove == 0 {
        return;
    }
    // SAFETY: PyTorch's `void removeCallback(CallbackHandle)`, stored by
    // `Recording::start`; the library stays loaded (the recording's
    // handle on it was inherited too).
    let remove = unsafe { core::mem::transmute::<usize, RemoveCallback>(remove) };
    for handle in &REGISTERED {
        // SAFETY: a handle `addGlobalCallback` returned, removed once.
        unsafe { remove(handle.swap(0, Ordering::AcqRel)) };
    }
}

impl Recording {
    /// Registers the callbacks, each to record a RecordFunction with a
    /// chance of `millionths` in a million (PyTorch draws which), with what
    /// of `fields` PyTorch lets it read (ebtrace checked the header the
    /// [`layout`] follows); the text says what records, the error why
    /// nothing does.
    #[allow(clippy::result_large_err)]
    pub fn start(millionths: u32, fields: u32) -> Result<(Recording, Text), Text> {
        let millionths = millionths.clamp(1, OPS_ALL);
        let torch = Torch::open()?;
        let close = || {
            // SAFETY: the handle Torch::open took.
            unsafe { sys::dlclose(torch.library) };
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
        let extras = Extras::find(&torch, fields);
        let Some((region, key)) = install(&trampoline, torch.name, extras.seen()) else {
            close();
            return Err(Text::new(
                "PyTorch ops: no memory or pthread key for the buffer",
            ));
        };
        let (profiler, others) = (torch.asks(PROFILER_ON), torch.asks(HAS_CALLBACKS));
        let handles = torch.register(&trampoline, millionths, extras.seen());
        for (kept, handle) in REGISTERED.iter().zip(handles) {
            kept.store(handle, Ordering::Release);
        }
        REMOVE_FN.store(torch.remove, Ordering::Release);
        let recording = Recording {
            trampoline,
            handles,
            // SAFETY: PyTorch's `void removeCallback(CallbackHandle)`.
            remove: unsafe { core::mem::transmute::<usize, RemoveCallback>(torch.remove) },
            library: torch.library,
            region,
            key,
        };
        Ok((recording, start_line(millionths, &extras, profiler, others)))
    }

    /// Removes the callbacks and waits until none runs. A thread stopped
    /// inside one (by a debugger, or SIGSTOP) is waited for as long as it
    /// stays: this is the agent's thread, which ebtrace waits for before it
    /// unloads the agent (and leaves loaded, to take out later, when it
    /// does not end), so the agent's code and buffer stay while that call
    /// needs them.
    fn unregister(&self) {
        REMOVE_FN.store(0, Ordering::Release);
        for handle in self.handles {
            // SAFETY: a handle `addGlobalCallback` returned, removed once.
            unsafe { (self.remove)(handle) };
        }
        self.trampoline.empty_and_drain();
        callbacks::stop_writing();
    }

    fn release(self) {
        // SAFETY: no callback runs or will run; the region is ours.
        unsafe { region::unmap(self.region) };
        callbacks::forget_tid_key();
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
    let at = unsafe {
        layout::sequence_offset(
            code_at(name, 7),
            code_at(num_inputs, 17),
            code_at(is_async, 8),
        )
    }?;
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
    unsafe {
        shapes::check(
            code_at(input_sizes, shapes::INPUT_SIZES_BYTES),
            code_at(sizes_custom, shapes::SIZES_CUSTOM_BYTES),
        )
    }?;
    Ok(undefined)
}
