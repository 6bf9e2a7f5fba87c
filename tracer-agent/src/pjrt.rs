//! The profilers of the process's PJRT plugins (the XLA CUDA plugin,
//! libtpu), driven through their C profiler extension.
//!
//! A framework loads each plugin with `dlopen` and calls its `GetPjrtApi`;
//! the table it returns chains extensions, one of which (type 1) is the
//! plugin's profiler: create a profiler from serialized `ProfileOptions`,
//! start, stop, and collect its recording as a serialized XSpace. The agent
//! finds every loaded object exporting `GetPjrtApi`, whether or not it was
//! loaded `RTLD_LOCAL`, and runs one profiler in each. Calling the plugin
//! directly bypasses the framework's own session lock; the plugin's device
//! tracer is a singleton, so a session of the program's own makes create
//! or start fail, which is reported.
//!
//! The XSpaces are delivered as the plugin wrote them: their times are
//! CLOCK_REALTIME based (epoch ns in `XLine.timestamp_ns`).

use core::ffi::{CStr, c_char, c_int, c_void};

use crate::{protocol::SessionLevels, python::Text, sys};

/// `PJRT_Extension_Type_Profiler`.
const EXTENSION_PROFILER: c_int = 1;
/// Bytes of `PLUGIN_Profiler_Api` version 1 (newer plugins append fields).
const PROFILER_API_SIZE: usize = 80;
/// At most this many plugins are profiled.
const MAX_PLUGINS: usize = 4;
/// A cycle or a corrupt chain ends the walk here.
const MAX_EXTENSIONS: usize = 64;
/// The walk over loaded objects gives up past this many.
const MAX_OBJECTS: usize = 8192;
/// Longest object path looked at (`PATH_MAX`).
const PATH_MAX: usize = 4096;
/// Bytes of a plugin path kept for messages.
const NAME_LEN: usize = 240;

/// `PJRT_Extension_Base`.
#[repr(C)]
struct ExtensionBase {
    struct_size: usize,
    kind: c_int,
    next: *const ExtensionBase,
}

/// The head of `PJRT_Api`, which every version starts with.
#[repr(C)]
struct PjrtApiHead {
    struct_size: usize,
    extension_start: *const ExtensionBase,
}

/// `PJRT_Profiler_Extension` (without the trailing `traceme_context_id`,
/// which is only set when the extension is passed as an argument).
#[repr(C)]
struct ProfilerExtension {
    base: ExtensionBase,
    profiler_api: *const ProfilerApi,
}

/// `PLUGIN_Profiler_Error`, opaque.
type PluginError = c_void;
/// `PLUGIN_Profiler`, opaque.
type Profiler = c_void;

/// `PLUGIN_Profiler_Api` version 1.
#[repr(C)]
struct ProfilerApi {
    struct_size: usize,
    private: *mut c_void,
    error_destroy: Option<unsafe extern "C" fn(*mut ErrorDestroyArgs)>,
    error_message: Option<unsafe extern "C" fn(*mut ErrorMessageArgs)>,
    error_get_code: *const c_void,
    create: Option<unsafe extern "C" fn(*mut CreateArgs) -> *mut PluginError>,
    destroy: Option<unsafe extern "C" fn(*mut ProfilerArgs) -> *mut PluginError>,
    start: Option<unsafe extern "C" fn(*mut ProfilerArgs) -> *mut PluginError>,
    stop: Option<unsafe extern "C" fn(*mut ProfilerArgs) -> *mut PluginError>,
    collect_data: Option<unsafe extern "C" fn(*mut CollectDataArgs) -> *mut PluginError>,
}

const _: () = {
    assert!(size_of::<ProfilerApi>() == PROFILER_API_SIZE);
    assert!(core::mem::offset_of!(ProfilerApi, create) == 0x28);
    assert!(core::mem::offset_of!(ProfilerApi, collect_data) == 0x48);
    assert!(core::mem::offset_of!(ProfilerExtension, profiler_api) == 24);
};

/// `PLUGIN_Profiler_Error_Destroy_Args`.
#[repr(C)]
struct ErrorDestroyArgs {
    struct_size: usize,
    private: *mut c_void,
    error: *mut PluginError,
}

/// `PLUGIN_Profiler_Error_Message_Args`.
#[repr(C)]
struct ErrorMessageArgs {
    struct_size: usize,
    private: *mut c_void,
    error: *const PluginError,
    message: *const c_char,
    message_size: usize,
}

/// `PLUGIN_Profiler_Create_Args`.
#[repr(C)]
struct CreateArgs {
    struct_size: usize,
    options: *const c_char,
    options_size: usize,
    profiler: *mut Profiler,
}

/// `PLUGIN_Profiler_{Destroy,Start,Stop}_Args`.
#[repr(C)]
struct ProfilerArgs {
    struct_size: usize,
    profiler: *mut Profiler,
}

/// `PLUGIN_Profiler_CollectData_Args`.
#[repr(C)]
struct CollectDataArgs {
    struct_size: usize,
    profiler: *mut Profiler,
    buffer: *mut u8,
    buffer_size_in_bytes: usize,
}

/// A one-line message built in place (the agent has no allocator).
struct Line {
    buf: [u8; 400],
    len: usize,
}

impl Line {
    fn new() -> Self {
        Line {
            buf: [0; 400],
            len: 0,
        }
    }

    /// Appends `bytes`, line breaks turned into spaces, cut at the end of
    /// the buffer.
    fn push(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            if self.len == self.buf.len() {
                break;
            }
            self.buf[self.len] = if b == b'\n' || b == b'\r' { b' ' } else { b };
            self.len += 1;
        }
        self
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The message, up to its last whole UTF-8 character.
    fn text(&self) -> Text {
        let bytes = &self.buf[..self.len];
        let s = match core::str::from_utf8(bytes) {
            Ok(s) => s,
            // SAFETY: `valid_up_to` bytes are valid UTF-8.
            Err(e) => unsafe { core::str::from_utf8_unchecked(&bytes[..e.valid_up_to()]) },
        };
        Text::new(s)
    }
}

/// Encodes the `tensorflow.ProfileOptions` the plugin's profiler is
/// created with (as `ProfilerSession::DefaultOptions` does, at `levels`;
/// Python tracing is the framework's, never the plugin's) into `out`;
/// returns its length. Fields go in number order and zeros are left out,
/// as protobuf serializers write them.
fn profile_options(levels: &SessionLevels, out: &mut [u8; 24]) -> usize {
    /// Field numbers (tensorflow/profiler_options.proto).
    const HOST_TRACER_LEVEL: u8 = 2;
    const DEVICE_TRACER_LEVEL: u8 = 3;
    const VERSION: u8 = 5;
    let mut len = 0;
    for (field, value) in [
        (HOST_TRACER_LEVEL, levels.host),
        (DEVICE_TRACER_LEVEL, levels.device),
        (VERSION, 1),
    ] {
        if value == 0 {
            continue;
        }
        out[len] = field << 3;
        len += 1;
        let mut v = value;
        while v >= 0x80 {
            out[len] = (v as u8) | 0x80;
            len += 1;
            v >>= 7;
        }
        out[len] = v as u8;
        len += 1;
    }
    len
}

/// Reads a protobuf varint at the start of `b`: (value, bytes).
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// The length of the XSpace in `bytes`: some plugin versions return one
/// NUL byte past the message. A lone trailing 0x00 where a field's tag
/// would start is that byte (field 0 does not exist); a 0x00 that ends a
/// field's value is kept. Malformed input is left whole for the decoder.
fn xspace_len(bytes: &[u8]) -> usize {
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == 0 && i + 1 == bytes.len() {
            return i;
        }
        let Some((tag, n)) = varint(&bytes[i..]) else {
            return bytes.len();
        };
        i += n;
        let skip = match tag & 7 {
            0 => match varint(&bytes[i..]) {
                Some((_, n)) => n,
                None => return bytes.len(),
            },
            1 => 8,
            2 => match varint(&bytes[i..]) {
                Some((len, n)) => match usize::try_from(len).ok().and_then(|l| l.checked_add(n)) {
                    Some(skip) => skip,
                    None => return bytes.len(),
                },
                None => return bytes.len(),
            },
            5 => 4,
            _ => return bytes.len(),
        };
        i = match i.checked_add(skip) {
            Some(next) => next,
            None => return bytes.len(),
        };
    }
    bytes.len()
}

/// One plugin whose profiler runs.
struct Plugin {
    /// Our reference to the loaded object (keeps it loaded).
    handle: *mut c_void,
    api: *const ProfilerApi,
    profiler: *mut Profiler,
    name: [u8; NAME_LEN],
    name_len: usize,
}

impl Plugin {
    fn name(&self) -> &[u8] {
        &self.name[..self.name_len]
    }

    /// Turns a returned error into `why` (`what` failed: message) and
    /// destroys it; true if there was none.
    ///
    /// # Safety
    /// `error` is null or an error this plugin just returned.
    unsafe fn check(&self, error: *mut PluginError, what: &str, why: &mut Line) -> bool {
        // SAFETY: per the contract; `api` was validated in `find_profiler`.
        unsafe { check(&*self.api, error, what, why) }
    }
}

/// Appends `what: <the plugin's message>` to `why`, destroys the error;
/// true if `error` is null.
///
/// # Safety
/// `error` is null or an error `api` just returned.
unsafe fn check(api: &ProfilerApi, error: *mut PluginError, what: &str, why: &mut Line) -> bool {
    if error.is_null() {
        return true;
    }
    why.push(what.as_bytes()).push(b": ");
    let mut message = ErrorMessageArgs {
        struct_size: size_of::<ErrorMessageArgs>(),
        private: core::ptr::null_mut(),
        error,
        message: core::ptr::null(),
        message_size: 0,
    };
    // SAFETY: a live error and args of the documented layout; the message
    // stays valid until the error is destroyed, after it is copied.
    unsafe {
        match api.error_message {
            Some(f) => {
                f(&mut message);
                if message.message.is_null() {
                    why.push(b"(no message)");
                } else {
                    why.push(core::slice::from_raw_parts(
                        message.message.cast::<u8>(),
                        message.message_size,
                    ));
                }
            }
            None => {
                why.push(b"(no message)");
            }
        }
        if let Some(f) = api.error_destroy {
            let mut destroy = ErrorDestroyArgs {
                struct_size: size_of::<ErrorDestroyArgs>(),
                private: core::ptr::null_mut(),
                error,
            };
            f(&mut destroy);
        }
    }
    false
}

/// What `dl_iterate_phdr` looks for: the path of the `want`-th object.
struct NthObject {
    want: usize,
    seen: usize,
    found: bool,
    path: [u8; PATH_MAX + 1],
    /// Bytes of `path` before its NUL; 0 if it has no usable path.
    len: usize,
}

unsafe extern "C" fn nth_object(info: *mut sys::DlPhdrInfo, _: usize, data: *mut c_void) -> c_int {
    // SAFETY: `data` is the `NthObject` passed to dl_iterate_phdr, `info`
    // the C library's record of one loaded object.
    let (nth, info) = unsafe { (&mut *data.cast::<NthObject>(), &*info) };
    if nth.seen < nth.want {
        nth.seen += 1;
        return 0;
    }
    nth.found = true;
    nth.len = 0;
    if !info.name.is_null() {
        // SAFETY: the loader's NUL-terminated name of this object.
        let name = unsafe { CStr::from_ptr(info.name) }.to_bytes();
        if name.len() <= PATH_MAX {
            nth.path[..name.len()].copy_from_slice(name);
            nth.path[name.len()] = 0;
            nth.len = name.len();
        }
    }
    1
}

/// A loaded object's `GetPjrtApi`, with a reference to the object.
#[derive(Clone, Copy)]
struct Candidate {
    handle: *mut c_void,
    get_api: *mut c_void,
}

/// Every distinct `GetPjrtApi` of the loaded objects (at most
/// [`MAX_PLUGINS`]). Objects are visited one per walk and opened only
/// between walks: `dlopen` inside the walk's callback could deadlock
/// against another thread's `dlopen`.
fn candidates(out: &mut [Candidate; MAX_PLUGINS]) -> usize {
    let mut count = 0;
    let mut nth = NthObject {
        want: 0,
        seen: 0,
        found: false,
        path: [0; PATH_MAX + 1],
        len: 0,
    };
    while nth.want < MAX_OBJECTS && count < MAX_PLUGINS {
        nth.seen = 0;
        nth.found = false;
        // SAFETY: the callback matches the C signature and reads `data` as
        // the `NthObject` given here.
        unsafe { sys::dl_iterate_phdr(nth_object, (&raw mut nth).cast()) };
        if !nth.found {
            break;
        }
        nth.want += 1;
        // The program itself and the vDSO have no path to open.
        if nth.len == 0 {
            continue;
        }
        // SAFETY: a NUL-terminated path; RTLD_NOLOAD never loads anything.
        let handle =
            unsafe { sys::dlopen(nth.path.as_ptr().cast(), sys::RTLD_NOLOAD | sys::RTLD_LAZY) };
        if handle.is_null() {
            continue;
        }
        // SAFETY: a handle from dlopen and a NUL-terminated name. dlsym
        // also searches the object's dependencies: duplicates are dropped.
        let get_api = unsafe { sys::dlsym(handle, c"GetPjrtApi".as_ptr()) };
        if get_api.is_null() || out[..count].iter().any(|c| c.get_api == get_api) {
            // SAFETY: drops the reference dlopen took.
            unsafe { sys::dlclose(handle) };
            continue;
        }
        out[count] = Candidate { handle, get_api };
        count += 1;
    }
    count
}

/// The profiler table of the plugin whose `GetPjrtApi` is at `get_api`.
///
/// # Safety
/// `get_api` is an exported `GetPjrtApi` of a loaded object.
unsafe fn find_profiler(get_api: *mut c_void) -> Result<*const ProfilerApi, &'static str> {
    // SAFETY: `const PJRT_Api* GetPjrtApi(void)`, per the contract.
    let get = unsafe {
        core::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> *const PjrtApiHead>(get_api)
    };
    // SAFETY: the plugin's static table; each struct's size is checked
    // before a field past it is read.
    unsafe {
        let api = get();
        if api.is_null() || (*api).struct_size < size_of::<PjrtApiHead>() {
            return Err("GetPjrtApi returned no usable PJRT_Api");
        }
        let mut ext = (*api).extension_start;
        for _ in 0..MAX_EXTENSIONS {
            if ext.is_null() || (*ext).struct_size < size_of::<ExtensionBase>() {
                break;
            }
            if (*ext).kind == EXTENSION_PROFILER {
                if (*ext).struct_size < size_of::<ProfilerExtension>() {
                    return Err("its profiler extension is too small");
                }
                let table = (*ext.cast::<ProfilerExtension>()).profiler_api;
                if table.is_null() || (*table).struct_size < PROFILER_API_SIZE {
                    return Err("its profiler table is missing or older than version 1");
                }
                let t = &*table;
                if t.create.is_none()
                    || t.destroy.is_none()
                    || t.start.is_none()
                    || t.stop.is_none()
                    || t.collect_data.is_none()
                {
                    return Err("its profiler table lacks a function");
                }
                return Ok(table);
            }
            ext = (*ext).next;
        }
    }
    Err("it has no profiler extension")
}

/// Creates and starts a profiler; on failure says why into `why`.
///
/// # Safety
/// `api` is a validated profiler table (see [`find_profiler`]).
unsafe fn start_profiler(
    api: &ProfilerApi,
    options: &[u8],
    why: &mut Line,
) -> Option<*mut Profiler> {
    let (Some(create), Some(start), Some(destroy)) = (api.create, api.start, api.destroy) else {
        return None;
    };
    let mut args = CreateArgs {
        struct_size: size_of::<CreateArgs>(),
        options: options.as_ptr().cast(),
        options_size: options.len(),
        profiler: core::ptr::null_mut(),
    };
    // SAFETY: args of the documented layout; errors are checked and
    // destroyed; the profiler is destroyed if it does not start.
    unsafe {
        if !check(api, create(&mut args), "create failed", why) {
            return None;
        }
        let profiler = args.profiler;
        let mut args = ProfilerArgs {
            struct_size: size_of::<ProfilerArgs>(),
            profiler,
        };
        if !check(api, start(&mut args), "start failed", why) {
            let mut args = ProfilerArgs {
                struct_size: size_of::<ProfilerArgs>(),
                profiler,
            };
            let mut ignored = Line::new();
            check(api, destroy(&mut args), "destroy failed", &mut ignored);
            return None;
        }
        Some(profiler)
    }
}

/// The profilers started in the process's PJRT plugins.
pub struct PluginSession {
    plugins: [Option<Plugin>; MAX_PLUGINS],
}

impl PluginSession {
    /// Starts a profiler at `levels` in every loaded PJRT plugin that has
    /// the profiler extension. The text says which plugins run one (and
    /// why others do not); `None`: no plugin is loaded; the error, one
    /// line, why no loaded plugin runs one.
    #[allow(clippy::result_large_err)]
    pub fn start(levels: &SessionLevels) -> Result<Option<(PluginSession, Text)>, Text> {
        let mut found = [Candidate {
            handle: core::ptr::null_mut(),
            get_api: core::ptr::null_mut(),
        }; MAX_PLUGINS];
        let count = candidates(&mut found);
        if count == 0 {
            return Ok(None);
        }
        let mut options = [0u8; 24];
        let options_len = profile_options(levels, &mut options);
        let options = &options[..options_len];
        let mut session = PluginSession {
            plugins: [const { None }; MAX_PLUGINS],
        };
        let mut why = Line::new();
        let mut another_session = false;
        for (slot, c) in session.plugins.iter_mut().zip(&found[..count]) {
            let (name, name_len) = object_name(c.get_api);
            let mut failed = Line::new();
            // SAFETY: `get_api` is the exported GetPjrtApi of a loaded object.
            let started = match unsafe { find_profiler(c.get_api) } {
                Err(e) => {
                    failed.push(e.as_bytes());
                    None
                }
                // SAFETY: validated by find_profiler.
                Ok(api) => unsafe { start_profiler(&*api, options, &mut failed) }
                    .map(|profiler| (api, profiler)),
            };
            match started {
                Some((api, profiler)) => {
                    *slot = Some(Plugin {
                        handle: c.handle,
                        api,
                        profiler,
                        name,
                        name_len,
                    });
                }
                None => {
                    another_session |= contains(
                        &failed.buf[..failed.len],
                        b"Another profile session running",
                    );
                    if !why.is_empty() {
                        why.push(b"; ");
                    }
                    why.push(b"PJRT plugin ")
                        .push(&name[..name_len])
                        .push(b": ")
                        .push(&failed.buf[..failed.len]);
                    // SAFETY: drops the reference dlopen took.
                    unsafe { sys::dlclose(c.handle) };
                }
            }
        }
        let mut running = Line::new();
        let mut n = 0;
        for p in session.plugins.iter().flatten() {
            running.push(if n == 0 {
                b"PJRT plugin profiler of ".as_slice()
            } else {
                b" and ".as_slice()
            });
            running.push(p.name());
            n += 1;
        }
        if n == 0 {
            let mut line = Line::new();
            if another_session {
                line.push(b"the process runs a profiler session of its own (");
                line.push(&why.buf[..why.len]).push(b")");
            } else {
                line.push(&why.buf[..why.len]);
            }
            return Err(line.text());
        }
        if !why.is_empty() {
            running.push(b" (").push(&why.buf[..why.len]).push(b")");
        }
        Ok(Some((session, running.text())))
    }

    /// Stops every profiler, hands each one's serialized XSpace to
    /// `deliver` and destroys the profilers; returns why one did not stop
    /// or collect cleanly, if one did not.
    pub fn stop(mut self, mut deliver: impl FnMut(&[u8])) -> Option<Text> {
        let mut why = Line::new();
        for plugin in self.plugins.iter_mut().filter_map(Option::take) {
            let mut failed = Line::new();
            // SAFETY: the table was validated at start; the profiler is ours
            // and used from this thread only; the collected buffer belongs
            // to the profiler and is read before it is destroyed.
            unsafe {
                let api = &*plugin.api;
                if let Some(stop) = api.stop {
                    let mut args = ProfilerArgs {
                        struct_size: size_of::<ProfilerArgs>(),
                        profiler: plugin.profiler,
                    };
                    plugin.check(stop(&mut args), "stop failed", &mut failed);
                }
                if let Some(collect) = api.collect_data {
                    // Both zero: the plugin serializes into a buffer of its
                    // own and returns it at once.
                    let mut args = CollectDataArgs {
                        struct_size: size_of::<CollectDataArgs>(),
                        profiler: plugin.profiler,
                        buffer: core::ptr::null_mut(),
                        buffer_size_in_bytes: 0,
                    };
                    let ok = plugin.check(collect(&mut args), "collecting failed", &mut failed);
                    if ok && !args.buffer.is_null() && args.buffer_size_in_bytes > 0 {
                        let bytes =
                            core::slice::from_raw_parts(args.buffer, args.buffer_size_in_bytes);
                        deliver(&bytes[..xspace_len(bytes)]);
                    } else if ok {
                        failed.push(b"it returned no data");
                    }
                }
                if let Some(destroy) = api.destroy {
                    let mut args = ProfilerArgs {
                        struct_size: size_of::<ProfilerArgs>(),
                        profiler: plugin.profiler,
                    };
                    plugin.check(destroy(&mut args), "destroy failed", &mut failed);
                }
                sys::dlclose(plugin.handle);
            }
            if !failed.is_empty() {
                if !why.is_empty() {
                    why.push(b"; ");
                }
                why.push(b"PJRT plugin ")
                    .push(plugin.name())
                    .push(b": ")
                    .push(&failed.buf[..failed.len]);
            }
        }
        (!why.is_empty()).then(|| why.text())
    }
}

/// The path of the object that defines `f` (cut to its last
/// [`NAME_LEN`] bytes).
fn object_name(f: *mut c_void) -> ([u8; NAME_LEN], usize) {
    let mut out = [0u8; NAME_LEN];
    let mut info = sys::DlInfo::EMPTY;
    // SAFETY: a valid out pointer; the name belongs to the loader and is
    // copied while the object is held open.
    let name: &[u8] = unsafe {
        if sys::dladdr(f, &mut info) == 0 || info.fname.is_null() {
            b"(unnamed object)"
        } else {
            CStr::from_ptr(info.fname).to_bytes()
        }
    };
    let tail = &name[name.len().saturating_sub(NAME_LEN)..];
    out[..tail.len()].copy_from_slice(tail);
    (out, tail.len())
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests;
