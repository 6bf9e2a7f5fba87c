use std::{
    ffi::CString,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use ebtrace_proto::tensorflow::{
    ProfileOptions,
    profiler::{XPlane, XSpace, XStat, x_stat},
};
use proptest::prelude::*;
use prost::Message as _;

use super::*;

fn text(t: &Text) -> String {
    String::from_utf8(t.as_bytes().to_vec()).expect("UTF-8 text")
}

fn options(levels: SessionLevels) -> ProfileOptions {
    let mut out = [0u8; 24];
    let n = profile_options(&levels, &mut out);
    ProfileOptions::decode(&out[..n]).expect("ProfileOptions decode")
}

#[test]
fn profile_options_decode_to_the_levels() {
    let o = options(SessionLevels {
        host: 2,
        python: 1,
        device: 1,
        ops: 0,
        op_fields: 0,
    });
    assert_eq!(
        (
            o.version,
            o.host_tracer_level,
            o.device_tracer_level,
            o.python_tracer_level
        ),
        (1, 2, 1, 0),
        "python tracing belongs to the framework's session, not the plugin's"
    );
    assert_eq!(
        o,
        ProfileOptions {
            version: 1,
            host_tracer_level: 2,
            device_tracer_level: 1,
            ..Default::default()
        }
    );
}

proptest! {
    #[test]
    fn profile_options_carry_any_levels(host: u32, python: u32, device: u32) {
        let o = options(SessionLevels {
            host,
            python,
            device,
            ops: 0,
            op_fields: 0,
        });
        prop_assert_eq!(o.version, 1);
        prop_assert_eq!(o.host_tracer_level, host);
        prop_assert_eq!(o.device_tracer_level, device);
        prop_assert_eq!(o.python_tracer_level, 0);
    }

    #[test]
    fn xspace_len_never_exceeds_its_input(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        prop_assert!(xspace_len(&bytes) <= bytes.len());
    }
}

/// An XSpace whose encoding ends with a zero byte that is a value (a
/// oneof int64 0, which protobuf writes).
fn ends_with_a_zero_value() -> Vec<u8> {
    let space = XSpace {
        planes: vec![XPlane {
            name: "/device:TPU:0".into(),
            stats: vec![XStat {
                metadata_id: 1,
                value: Some(x_stat::Value::Int64Value(0)),
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let bytes = space.encode_to_vec();
    assert_eq!(bytes.last(), Some(&0));
    bytes
}

#[test]
fn a_trailing_nul_is_dropped_and_a_zero_value_kept() {
    let bytes = ends_with_a_zero_value();
    assert_eq!(xspace_len(&bytes), bytes.len());
    let mut padded = bytes.clone();
    padded.push(0);
    assert!(
        XSpace::decode(padded.as_slice()).is_err(),
        "prost rejects the plugin's trailing NUL"
    );
    assert_eq!(xspace_len(&padded), bytes.len());
    assert_eq!(xspace_len(&[0]), 0);
    assert_eq!(xspace_len(&[]), 0);
}

/// Builds the stand-in plugin into `dir/name`.
fn build_standin(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/pjrt_plugin_standin.c");
    std::fs::create_dir_all(dir).expect("create the plugin directory");
    let out = dir.join(name);
    let status = Command::new("cc")
        .args([
            "-O2",
            "-Wall",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-o",
        ])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("run cc (install gcc)");
    assert!(status.success(), "compiling {} failed", src.display());
    out
}

/// A plugin loaded the way jax loads one (`RTLD_LAZY | RTLD_LOCAL`: not in
/// the global scope).
struct Loaded {
    execute: unsafe extern "C" fn(*const c_char, c_int),
    step: unsafe extern "C" fn(i64, *const *const c_char, c_int),
}

fn load(path: &Path) -> Loaded {
    let c = CString::new(path.as_os_str().as_bytes()).expect("path without NUL");
    // SAFETY: a NUL-terminated path; RTLD_LOCAL is 0.
    let handle = unsafe { sys::dlopen(c.as_ptr(), sys::RTLD_LAZY) };
    assert!(!handle.is_null(), "dlopen {}", path.display());
    // SAFETY: the stand-in's exported functions, of these C signatures.
    unsafe {
        let execute = sys::dlsym(handle, c"standin_tpu_execute".as_ptr());
        let step = sys::dlsym(handle, c"standin_tpu_step".as_ptr());
        assert!(!execute.is_null() && !step.is_null());
        Loaded {
            execute: core::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_char, c_int)>(
                execute,
            ),
            step: core::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(i64, *const *const c_char, c_int),
            >(step),
        }
    }
}

impl Loaded {
    fn execute(&self, op: &CStr) {
        // SAFETY: a NUL-terminated op name.
        unsafe { (self.execute)(op.as_ptr(), 3) }
    }

    fn step(&self, step: i64, ops: &[&CStr]) {
        let ptrs: Vec<*const c_char> = ops.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: `ptrs` holds `ops.len()` NUL-terminated names.
        unsafe { (self.step)(step, ptrs.as_ptr(), ptrs.len() as c_int) }
    }
}

fn realtime_ns() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch");
    d.as_nanos() as i64
}

/// An event's name, start and end (realtime ns).
type Event = (String, i64, i64);

/// (line name, events) of the plane `name`.
fn events(space: &XSpace, name: &str) -> Vec<(String, Vec<Event>)> {
    let plane = space
        .planes
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no plane {name}"));
    plane
        .lines
        .iter()
        .map(|l| {
            let evs = l
                .events
                .iter()
                .map(|e| {
                    let Some(ebtrace_proto::tensorflow::profiler::x_event::Data::OffsetPs(off)) =
                        e.data
                    else {
                        panic!("event without offset_ps");
                    };
                    let start = l.timestamp_ns + off / 1000;
                    (
                        plane.event_metadata[&e.metadata_id].name.clone(),
                        start,
                        start + e.duration_ps / 1000,
                    )
                })
                .collect();
            (l.name.clone(), evs)
        })
        .collect()
}

fn start(levels: SessionLevels) -> Result<(PluginSession, String), String> {
    match PluginSession::start(&levels) {
        Ok(Some((s, t))) => Ok((s, text(&t))),
        Ok(None) => Err("no PJRT plugin is loaded".into()),
        Err(t) => Err(text(&t)),
    }
}

fn stop(session: PluginSession) -> Vec<XSpace> {
    let mut spaces = Vec::new();
    let why = session.stop(|bytes| {
        spaces.push(XSpace::decode(bytes).expect("a delivered XSpace decodes"));
    });
    assert!(why.is_none(), "stop: {}", text(&why.expect("some")));
    spaces
}

const LEVELS: SessionLevels = SessionLevels {
    host: 2,
    python: 0,
    device: 1,
    ops: 0,
    op_fields: 0,
};

/// The whole route in this process, in one test: plugins are global.
#[test]
fn plugin_profilers_record_the_stand_in_tpu() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/fixtures/pjrt-agent-test")
        .join(std::process::id().to_string());
    let a_path = build_standin(&dir, "libplugin_a.so");
    let b_path = dir.join("libplugin_b.so");
    std::fs::copy(&a_path, &b_path).expect("copy the plugin");

    let no_plugin = start(LEVELS).err().expect("no plugin loaded yet");
    assert!(no_plugin.contains("no PJRT plugin"), "{no_plugin}");

    let a = load(&a_path);
    let before = realtime_ns();
    let (session, running) = start(LEVELS).expect("start with plugin a");
    assert_eq!(
        running,
        format!("PJRT plugin profiler of {}", a_path.display())
    );
    let busy = start(LEVELS).err().expect("a second session fails");
    assert!(
        busy.starts_with("the process runs a profiler session of its own")
            && busy.contains("Another profile session running."),
        "{busy}"
    );
    for _ in 0..3 {
        a.execute(c"fusion.1");
    }
    a.step(7, &[c"copy.2", c"fusion.1"]);
    let spaces = stop(session);
    let after = realtime_ns();
    assert_eq!(spaces.len(), 1);
    let lines = events(&spaces[0], "/device:TPU:0");
    let names = |line: &str| -> Vec<String> {
        lines
            .iter()
            .find(|(n, _)| n == line)
            .unwrap_or_else(|| panic!("no line {line}"))
            .1
            .iter()
            .map(|e| e.0.clone())
            .collect()
    };
    assert_eq!(
        names("XLA Ops"),
        ["fusion.1", "fusion.1", "fusion.1", "copy.2", "fusion.1"]
    );
    assert_eq!(names("Steps"), ["7"]);
    for (_, evs) in &lines {
        for (name, s, e) in evs {
            assert!(
                before <= *s && s <= e && *e <= after,
                "{name} at {s}..{e}, outside the session's realtime {before}..{after}"
            );
        }
    }

    // Nothing is recorded once stopped; two plugins, two XSpaces.
    a.execute(c"after.stop");
    let b = load(&b_path);
    let (session, running) = start(LEVELS).expect("start with plugins a and b");
    assert_eq!(
        running,
        format!(
            "PJRT plugin profiler of {} and {}",
            a_path.display(),
            b_path.display()
        )
    );
    a.execute(c"on.a");
    b.execute(c"on.b");
    b.execute(c"on.b");
    let spaces = stop(session);
    let ops: Vec<Vec<String>> = spaces
        .iter()
        .map(|s| {
            events(s, "/device:TPU:0")
                .into_iter()
                .flat_map(|(_, evs)| evs.into_iter().map(|e| e.0))
                .collect()
        })
        .collect();
    assert_eq!(ops, [vec!["on.a"], vec!["on.b", "on.b"]]);

    // Device level 0: the plugin's device tracer does not run.
    let (session, _) = start(SessionLevels {
        device: 0,
        ..LEVELS
    })
    .expect("start at device 0");
    a.execute(c"untraced");
    let spaces = stop(session);
    assert_eq!(spaces.len(), 2);
    assert!(spaces.iter().all(|s| s.planes.is_empty()), "{spaces:?}");

    let _ = std::fs::remove_dir_all(&dir);
}
