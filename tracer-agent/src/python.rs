//! The framework's own profiler session, driven through the target's
//! Python from the agent's thread.
//!
//! The agent's thread takes the GIL with `PyGILState_Ensure` like any
//! foreign thread (never the thread ebtrace interrupted, which may be in the
//! middle of anything), and runs short scripts in a dictionary of its own:
//! nothing is added to the program's modules or namespaces, and only
//! frameworks the program already imported are used.

use core::ffi::{CStr, c_char, c_int, c_long, c_void};

use crate::sys;

type PyObject = c_void;

/// `Py_file_input`: run the source as a module body.
const PY_FILE_INPUT: c_int = 257;

/// Starts the `ProfilerSession` of every framework the program imported
/// (jax and TensorFlow each carry their own profiler and TraceMe recorder);
/// sets `sessions` (name, function that stops it and returns its XSpace),
/// `framework` (their names) and `status`
/// (why one or all did not start).
const START_SOURCE: &CStr = c"
import sys as _sys
sessions = []
_why = []
def _first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0]
def _not_started(name, e):
    if 'ALREADY_EXISTS' in str(e) or 'Another profiling session' in str(e):
        return 'the process runs a profiler session of its own'
    return name + ' ProfilerSession did not start: ' + _first_line(e)
_jax_lib = _sys.modules.get('jax._src.lib')
_prof = getattr(_jax_lib, '_profiler', None)
if _prof is not None:
    _state = getattr(_sys.modules.get('jax._src.profiler'), '_profile_state', None)
    if getattr(_state, 'profile_session', None) is not None:
        _why.append('the process runs a jax profiler session of its own')
    else:
        _opts = _prof.ProfileOptions()
        _opts.host_tracer_level = host_level
        _opts.python_tracer_level = python_level
        _opts.raise_error_on_start_failure = True
        try:
            _version = getattr(_sys.modules.get('jax.version'), '__version__', '?')
            sessions.append(('jax ' + _version + ' ProfilerSession',
                             _prof.ProfilerSession(_opts).stop, lambda: None))
        except Exception as _e:
            _why.append(_not_started('jax', _e))
_tf = _sys.modules.get('tensorflow')
if _tf is not None:
    _v2 = _sys.modules.get('tensorflow.python.profiler.profiler_v2')
    if getattr(_v2, '_profiler', None) is not None:
        _why.append('the process runs a TensorFlow profiler session of its own')
    else:
        try:
            import os as _os, shutil as _shutil, tempfile as _tempfile
            from tensorflow.python.profiler.internal import _pywrap_profiler as _tfp
            _s = _tfp.ProfilerSession()
            # Its stop() returns the old trace format: the XSpace is what
            # export_to_tb() writes, into a directory of our own.
            _tmp = _tempfile.mkdtemp(prefix='ebtrace-agent-')
            try:
                _s.start(_tmp, {'host_tracer_level': host_level,
                                'python_tracer_level': python_level,
                                'device_tracer_level': device_level})
            except BaseException:
                _shutil.rmtree(_tmp, ignore_errors=True)
                raise
            def _tf_stop(_s=_s, _tmp=_tmp):
                try:
                    _s.export_to_tb()
                    for _root, _, _files in _os.walk(_tmp):
                        for _f in _files:
                            if _f.endswith('.xplane.pb'):
                                with open(_os.path.join(_root, _f), 'rb') as _fh:
                                    return _fh.read()
                    raise RuntimeError('it wrote no XSpace')
                finally:
                    _shutil.rmtree(_tmp, ignore_errors=True)
            def _tf_drop(_tmp=_tmp):
                _shutil.rmtree(_tmp, ignore_errors=True)
            _version = str(getattr(_tf, '__version__', '?'))
            sessions.append(('TensorFlow ' + _version + ' ProfilerSession', _tf_stop, _tf_drop))
        except Exception as _e:
            _why.append(_not_started('TensorFlow', _e))
if not sessions and not _why:
    _why.append('neither jax nor TensorFlow is loaded in this Python process')
framework = ' and '.join(_n for _n, _, _ in sessions)
status = '; '.join(_why) or None
if sessions and status:
    framework += ' (' + status + ')'
";

/// Stops the sessions; sets `xspaces` (a list of bytes) and `status`.
const STOP_SOURCE: &CStr = c"
xspaces = []
_why = []
for _n, _stop, _ in sessions:
    try:
        xspaces.append(bytes(_stop()))
    except Exception as _e:
        _why.append(_n + ' did not stop cleanly: ' + _first_line(_e))
sessions = []
status = '; '.join(_why) or None
";

/// Lets go of the sessions without converting what they recorded: the
/// framework's session object, once gone, stops its recorder and frees its
/// events (jax's and TensorFlow's `ProfilerSession` destructors).
const DISCARD_SOURCE: &CStr = c"
for _n, _stop, _drop in sessions:
    try:
        _drop()
    except Exception:
        pass
sessions = []
_stop = _drop = _s = None
";

/// At most this many sessions (one per framework) are handed back.
const MAX_SESSIONS: usize = 4;

/// A short UTF-8 message, copied out of Python before the GIL is released.
pub struct Text {
    buf: [u8; 1024],
    len: usize,
}

impl Text {
    /// A message from a constant.
    pub fn new(s: &str) -> Self {
        let mut t = Text {
            buf: [0; 1024],
            len: 0,
        };
        t.push(s.as_bytes());
        t
    }

    /// Appends `bytes`, as far as they fit.
    pub fn push(&mut self, bytes: &[u8]) {
        let room = self.buf.len() - self.len;
        let n = bytes.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    /// The message's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl core::fmt::Write for Text {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        self.push(s.as_bytes());
        Ok(())
    }
}

/// The Python C API functions the agent calls, found in the target.
struct Api {
    is_initialized: unsafe extern "C" fn() -> c_int,
    is_finalizing: Option<unsafe extern "C" fn() -> c_int>,
    gil_ensure: unsafe extern "C" fn() -> c_int,
    gil_release: unsafe extern "C" fn(c_int),
    dict_new: unsafe extern "C" fn() -> *mut PyObject,
    dict_get: unsafe extern "C" fn(*mut PyObject, *const c_char) -> *mut PyObject,
    dict_set: unsafe extern "C" fn(*mut PyObject, *const c_char, *mut PyObject) -> c_int,
    long_from: unsafe extern "C" fn(c_long) -> *mut PyObject,
    run: unsafe extern "C" fn(
        *const c_char,
        c_int,
        *mut PyObject,
        *mut PyObject,
        *mut c_void,
    ) -> *mut PyObject,
    incref: unsafe extern "C" fn(*mut PyObject),
    decref: unsafe extern "C" fn(*mut PyObject),
    err_clear: unsafe extern "C" fn(),
    bytes_data: unsafe extern "C" fn(*mut PyObject, *mut *mut c_char, *mut isize) -> c_int,
    list_size: unsafe extern "C" fn(*mut PyObject) -> isize,
    list_item: unsafe extern "C" fn(*mut PyObject, isize) -> *mut PyObject,
    unicode_utf8: unsafe extern "C" fn(*mut PyObject, *mut isize) -> *const c_char,
    none: *mut PyObject,
}

/// Looks `name` up in the target's global scope (the executable, when it
/// exports the API, or its libpython).
fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: RTLD_DEFAULT (null) and a NUL-terminated name.
    let p = unsafe { sys::dlsym(core::ptr::null_mut(), name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The function pointer `F` at `p`.
///
/// # Safety
/// `F` is a function pointer type matching the C signature of the
/// function at `p`.
unsafe fn function_at<F: Copy>(p: *mut c_void) -> F {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: same size (checked above); validity per the contract.
    unsafe { core::mem::transmute_copy::<*mut c_void, F>(&p) }
}

macro_rules! function {
    ($name:literal) => {
        // SAFETY: the symbol is the Python C API function of that name,
        // whose C signature the field's type spells out.
        unsafe { function_at(symbol($name)?) }
    };
}

impl Api {
    fn find() -> Option<Api> {
        Some(Api {
            is_initialized: function!(c"Py_IsInitialized"),
            is_finalizing: symbol(c"Py_IsFinalizing")
                .or_else(|| symbol(c"_Py_IsFinalizing"))
                // SAFETY: `int (void)` in every Python that exports it.
                .map(|p| unsafe { function_at(p) }),
            gil_ensure: function!(c"PyGILState_Ensure"),
            gil_release: function!(c"PyGILState_Release"),
            dict_new: function!(c"PyDict_New"),
            dict_get: function!(c"PyDict_GetItemString"),
            dict_set: function!(c"PyDict_SetItemString"),
            long_from: function!(c"PyLong_FromLong"),
            run: function!(c"PyRun_StringFlags"),
            incref: function!(c"Py_IncRef"),
            decref: function!(c"Py_DecRef"),
            err_clear: function!(c"PyErr_Clear"),
            bytes_data: function!(c"PyBytes_AsStringAndSize"),
            list_size: function!(c"PyList_Size"),
            list_item: function!(c"PyList_GetItem"),
            unicode_utf8: function!(c"PyUnicode_AsUTF8AndSize"),
            none: symbol(c"_Py_NoneStruct")?,
        })
    }

    /// Whether Python can run code now (initialized, not shutting down:
    /// a thread taking the GIL during shutdown is ended by Python).
    fn usable(&self) -> bool {
        // SAFETY: both take no argument and only read interpreter state.
        unsafe { (self.is_initialized)() != 0 && self.is_finalizing.is_none_or(|f| f() == 0) }
    }
}

/// Holds the GIL while alive.
struct Gil<'a> {
    api: &'a Api,
    state: c_int,
}

impl<'a> Gil<'a> {
    /// Takes the GIL, unless Python is not running: once `Py_FinalizeEx`
    /// has begun, a thread that asks for the GIL is ended or blocked for
    /// ever by Python, so every acquisition checks first.
    fn take(api: &'a Api) -> Option<Self> {
        if !api.usable() {
            return None;
        }
        // SAFETY: the interpreter is initialized and not finalizing
        // (checked just above); any thread may take the GIL this way.
        let state = unsafe { (api.gil_ensure)() };
        Some(Gil { api, state })
    }
}

impl Drop for Gil<'_> {
    fn drop(&mut self) {
        // SAFETY: releases what `take` acquired, on the same thread.
        unsafe { (self.api.gil_release)(self.state) }
    }
}

/// A running profiler session and the dictionary its scripts run in.
///
/// Errors are [`Text`] by value: the agent has no allocator to box them.
pub struct Session {
    api: Api,
    globals: *mut PyObject,
}

impl Session {
    /// Starts the framework's profiler session at `levels`; the error is
    /// one line saying why not.
    #[allow(clippy::result_large_err)]
    pub fn start(levels: &crate::protocol::SessionLevels) -> Result<(Session, Text), Text> {
        let api = Api::find().ok_or_else(|| Text::new("not a Python process"))?;
        let Some(gil) = Gil::take(&api) else {
            return Err(Text::new(
                "Python is not running (starting or shutting down)",
            ));
        };
        // SAFETY: the GIL is held; every object pointer is checked for null
        // before use and each new reference is released.
        let outcome = unsafe {
            let globals = (api.dict_new)();
            if globals.is_null() {
                (api.err_clear)();
                return Err(Text::new("Python could not allocate a dictionary"));
            }
            for (key, value) in [
                (c"host_level", levels.host),
                (c"python_level", levels.python),
                (c"device_level", levels.device),
            ] {
                let v = (api.long_from)(c_long::from(value.min(i32::MAX as u32) as i32));
                if !v.is_null() {
                    (api.dict_set)(globals, key.as_ptr(), v);
                    (api.decref)(v);
                }
            }
            let ran = run(&api, START_SOURCE, globals);
            let sessions = (api.dict_get)(globals, c"sessions".as_ptr());
            let started = !sessions.is_null() && (api.list_size)(sessions) > 0;
            (api.err_clear)();
            if ran && started {
                Ok((globals, text_of(&api, globals, c"framework")))
            } else {
                let why = if ran {
                    text_of(&api, globals, c"status")
                } else {
                    Text::new("the start script raised")
                };
                (api.decref)(globals);
                Err(why)
            }
        };
        drop(gil);
        let (globals, framework) = outcome?;
        Ok((Session { api, globals }, framework))
    }

    /// Stops the sessions and hands each one's serialized XSpace to
    /// `deliver` without holding the GIL (the bytes are kept alive
    /// meanwhile); returns why a session failed to stop, if one did.
    pub fn stop(self, mut deliver: impl FnMut(&[u8])) -> Option<Text> {
        let api = &self.api;
        let Some(gil) = Gil::take(api) else {
            return Some(Text::new("Python is shutting down; the session is lost"));
        };
        let mut found = [(core::ptr::null::<u8>(), 0usize); MAX_SESSIONS];
        // SAFETY: the GIL is held; each item is checked to be bytes by
        // PyBytes_AsStringAndSize; the list, kept by an extra reference,
        // keeps them alive.
        let (xspaces, count, why) = unsafe {
            let ran = run(api, STOP_SOURCE, self.globals);
            let list = (api.dict_get)(self.globals, c"xspaces".as_ptr());
            let mut count = 0;
            if ran && !list.is_null() {
                (api.incref)(list);
                let n = (api.list_size)(list).max(0) as usize;
                for i in 0..n.min(MAX_SESSIONS) {
                    let item = (api.list_item)(list, i as isize);
                    let mut data: *mut c_char = core::ptr::null_mut();
                    let mut len: isize = 0;
                    if !item.is_null()
                        && (api.bytes_data)(item, &mut data, &mut len) == 0
                        && !data.is_null()
                        && len >= 0
                    {
                        found[count] = (data as *const u8, len as usize);
                        count += 1;
                    }
                }
            }
            (api.err_clear)();
            let why = if !ran {
                Some(Text::new("the stop script raised"))
            } else if (api.dict_get)(self.globals, c"status".as_ptr()) == api.none {
                None
            } else {
                Some(text_of(api, self.globals, c"status"))
            };
            let list = if ran && !list.is_null() {
                list
            } else {
                core::ptr::null_mut()
            };
            (list, count, why)
        };
        drop(gil);
        for &(data, len) in &found[..count] {
            // SAFETY: a bytes object's buffer is immutable and lives as long
            // as the list holding it (referenced above).
            deliver(unsafe { core::slice::from_raw_parts(data, len) });
        }
        // Python may have begun shutting down while the XSpaces were sent:
        // then the references are left to the interpreter's own teardown.
        if let Some(gil) = Gil::take(api) {
            // SAFETY: the GIL is held; drops the references taken above and
            // the dictionary, which is ours.
            unsafe {
                if !xspaces.is_null() {
                    (api.decref)(xspaces);
                }
                (api.decref)(self.globals);
            }
            drop(gil);
            // The session's events and their XSpace are freed: the memory
            // they took goes back to the system, not to the heap's free lists.
            crate::sys::trim_heap();
        }
        why
    }
}

impl Session {
    /// Ends the sessions and frees what they recorded, converting none of
    /// it (no one is there to take it: ebtrace is gone), then hands the
    /// freed memory back to the system. A Python that began shutting down
    /// keeps the sessions for its own teardown.
    pub fn discard(self) {
        let api = &self.api;
        if let Some(gil) = Gil::take(api) {
            // SAFETY: the GIL is held; the dictionary is ours, and dropping
            // it drops the last references to the sessions.
            unsafe {
                run(api, DISCARD_SOURCE, self.globals);
                (api.err_clear)();
                (api.decref)(self.globals);
            }
            drop(gil);
            crate::sys::trim_heap();
        }
    }
}

/// Runs `source` in `globals`; false if it raised (the error is cleared:
/// nothing is printed in the target).
///
/// # Safety
/// The GIL is held and `globals` is a dictionary.
unsafe fn run(api: &Api, source: &CStr, globals: *mut PyObject) -> bool {
    // SAFETY: per the function's contract.
    unsafe {
        let r = (api.run)(
            source.as_ptr(),
            PY_FILE_INPUT,
            globals,
            globals,
            core::ptr::null_mut(),
        );
        if r.is_null() {
            (api.err_clear)();
            return false;
        }
        (api.decref)(r);
        true
    }
}

/// The string value of `key` in `globals`, or a placeholder.
///
/// # Safety
/// The GIL is held and `globals` is a dictionary.
unsafe fn text_of(api: &Api, globals: *mut PyObject, key: &CStr) -> Text {
    // SAFETY: per the function's contract; the UTF-8 buffer belongs to the
    // string, which the dictionary keeps alive while it is copied.
    unsafe {
        let v = (api.dict_get)(globals, key.as_ptr());
        if v.is_null() || v == api.none {
            return Text::new("(no reason given)");
        }
        let mut len: isize = 0;
        let p = (api.unicode_utf8)(v, &mut len);
        if p.is_null() || len < 0 {
            (api.err_clear)();
            return Text::new("(unreadable reason)");
        }
        let mut t = Text::new("");
        t.push(core::slice::from_raw_parts(p as *const u8, len as usize));
        t
    }
}
