//! Decodes the real captures in `tests/fixtures/real/` with our own `.proto` files.
//!
//! The fixtures were recorded from jaxlib 0.10.2, TensorFlow 2.21 and XProf 2.24 (see
//! `tests/fixtures/real/README.md`). prost drops unknown fields silently, so each test also re-encodes
//! what it decoded: equal bytes (or an equal length where maps make the order vary) prove that
//! our schema knows every field the real producers wrote.

use std::path::PathBuf;

use ebtrace_proto::tensorflow::profile_options::{AdvancedConfigValue, advanced_config_value};
use ebtrace_proto::tensorflow::profiler::{XPlane, XSpace, x_stat};
use ebtrace_proto::tensorflow::{ProfileOptions, ProfileRequest};
use prost::Message;

/// Reads one of the recorded fixtures the repository carries.
fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/real"
    ))
    .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()))
}

fn jax_xspace() -> (Vec<u8>, XSpace) {
    let bytes = fixture("jax_cpu_matmul.xplane.pb");
    let space =
        XSpace::decode(bytes.as_slice()).expect("jax_cpu_matmul.xplane.pb decodes as XSpace");
    (bytes, space)
}

fn plane<'a>(space: &'a XSpace, name: &str) -> &'a XPlane {
    space
        .planes
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no plane named {name:?}"))
}

/// The plane-level uint64 stat whose metadata is named `name`.
fn plane_u64_stat(plane: &XPlane, name: &str) -> u64 {
    let stat = plane
        .stats
        .iter()
        .find(|s| {
            plane
                .stat_metadata
                .get(&s.metadata_id)
                .is_some_and(|m| m.name == name)
        })
        .unwrap_or_else(|| panic!("plane {:?} has no stat {name:?}", plane.name));
    match stat.value {
        Some(x_stat::Value::Uint64Value(v)) => v,
        ref other => panic!("stat {name:?} is {other:?}, expected uint64_value"),
    }
}

#[test]
fn jax_xspace_has_the_three_jaxlib_planes() {
    let (_, space) = jax_xspace();
    let names: Vec<&str> = space.planes.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["/host:metadata", "/host:CPU", "Task Environment"]);
    // jaxlib leaves every plane id at 0; only device planes carry an ordinal.
    assert!(space.planes.iter().all(|p| p.id == 0));
    assert_eq!(space.hostnames, ["vm"]);
    assert!(space.errors.is_empty() && space.warnings.is_empty());
}

#[test]
fn jax_xspace_task_environment_brackets_a_two_second_capture() {
    let (_, space) = jax_xspace();
    let env = plane(&space, "Task Environment");
    let mut stat_names: Vec<&str> = env
        .stat_metadata
        .values()
        .map(|m| m.name.as_str())
        .collect();
    stat_names.sort_unstable();
    assert_eq!(
        stat_names,
        ["profile_options", "profile_start_time", "profile_stop_time"]
    );

    let start = plane_u64_stat(env, "profile_start_time");
    let stop = plane_u64_stat(env, "profile_stop_time");
    assert_eq!(start, 1_795_304_311_944_113_143);
    assert_eq!(stop, 1_795_304_313_956_187_910);
    let span_ns = stop.checked_sub(start).expect("stop after start");
    assert_eq!(span_ns, 2_012_074_767);
    assert!((1_500_000_000..=3_000_000_000).contains(&span_ns));
}

#[test]
fn jax_xspace_host_cpu_events() {
    let (_, space) = jax_xspace();
    let total: usize = space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len())
        .sum();
    assert_eq!(total, 72_351);

    let cpu = plane(&space, "/host:CPU");
    assert_eq!(cpu.lines.len(), 5);
    assert_eq!(cpu.event_metadata.len(), 48);
    // Line times are session-relative (a few µs after the session start), not epoch ns.
    assert!(cpu.lines.iter().all(|l| l.timestamp_ns == 10_556));
    let python = cpu
        .lines
        .iter()
        .find(|l| l.name == "python")
        .expect("python line");
    assert_eq!(python.id, 659_116_323_103_773_678);
    assert_eq!(python.events.len(), 46_902);
}

#[test]
fn jax_xspace_metadata_ids_resolve() {
    let (_, space) = jax_xspace();
    for plane in &space.planes {
        for (key, md) in &plane.event_metadata {
            assert_eq!(
                *key, md.id,
                "plane {:?}: event_metadata key != id",
                plane.name
            );
        }
        for (key, md) in &plane.stat_metadata {
            assert_eq!(
                *key, md.id,
                "plane {:?}: stat_metadata key != id",
                plane.name
            );
        }
        for line in &plane.lines {
            for event in &line.events {
                assert!(
                    plane.event_metadata.contains_key(&event.metadata_id),
                    "plane {:?} line {:?}: event metadata_id {} has no event_metadata",
                    plane.name,
                    line.name,
                    event.metadata_id
                );
                for stat in &event.stats {
                    assert!(plane.stat_metadata.contains_key(&stat.metadata_id));
                }
            }
        }
    }
}

#[test]
fn jax_xspace_round_trips() {
    let (bytes, space) = jax_xspace();
    let encoded = space.encode_to_vec();
    // Map entries come back in HashMap order, so compare the length and the decoded value.
    assert_eq!(encoded.len(), bytes.len());
    assert_eq!(XSpace::decode(encoded.as_slice()).unwrap(), space);
}

const TOOLS: [&str; 10] = [
    "trace_viewer",
    "op_profile",
    "input_pipeline",
    "kernel_stats",
    "memory_viewer",
    "memory_profile",
    "overview_page",
    "pod_viewer",
    "tensorflow_stats",
    "xplane.pb",
];

/// What `CaptureRemoteTrace` sends for a 1 s capture into `/var/tmp/logdir`.
fn capture_request(
    python_tracer_level: u32,
    start_timestamp_ns: u64,
    session_id: &str,
    host_name: &str,
) -> ProfileRequest {
    ProfileRequest {
        duration_ms: 1000,
        max_events: 1_000_000,
        tools: TOOLS.map(String::from).to_vec(),
        opts: Some(ProfileOptions {
            include_dataset_ops: true,
            host_tracer_level: 2,
            device_tracer_level: 1,
            python_tracer_level,
            version: 1,
            enable_hlo_proto: true,
            start_timestamp_ns,
            duration_ms: 1000,
            repository_path: "/var/tmp/logdir".into(),
            ..Default::default()
        }),
        repository_root: "/var/tmp/logdir/plugins/profile".into(),
        session_id: session_id.into(),
        host_name: host_name.into(),
        ..Default::default()
    }
}

/// Decodes a request fixture and checks that re-encoding gives the same bytes.
fn request(name: &str) -> ProfileRequest {
    let bytes = fixture(name);
    let req = ProfileRequest::decode(bytes.as_slice())
        .unwrap_or_else(|e| panic!("{name} does not decode as ProfileRequest: {e}"));
    assert_eq!(
        req.encode_to_vec(),
        bytes,
        "{name}: re-encoding differs (unknown field?)"
    );
    req
}

#[test]
fn profile_request_from_jax_collect_profile() {
    let req = request("profile_request_jax_collect_profile.bin");
    let want = capture_request(
        1,
        1_795_304_620_669_481_578,
        "2026_11_21_23_43_40",
        "127.0.0.1:9998",
    );
    assert_eq!(req, want);
}

#[test]
fn profile_request_from_tf_client() {
    let req = request("profile_request_tf_client.bin");
    let want = capture_request(
        0,
        1_795_304_882_091_142_082,
        "2026_11_21_23_48_02",
        "127.0.0.1:9994",
    );
    assert_eq!(req, want);
}

#[test]
fn profile_request_from_xprof_web_capture() {
    let req = request("profile_request_xprof_web_capture.bin");
    let want = capture_request(
        0,
        1_795_304_661_769_232_414,
        "2026_11_21_23_44_21",
        "127.0.0.1:9998",
    );
    assert_eq!(req, want);
}

#[test]
fn start_continuous_profiling_request_from_xprof() {
    let req = request("start_continuous_profiling_request_xprof.bin");
    let want = ProfileRequest {
        duration_ms: 2000,
        max_events: 1_000_000,
        tools: TOOLS.map(String::from).to_vec(),
        opts: Some(ProfileOptions {
            device_tracer_level: 1,
            version: 1,
            enable_hlo_proto: true,
            duration_ms: 2000,
            advanced_configuration: [(
                "tpu_circular_buffer_tracing".to_owned(),
                AdvancedConfigValue {
                    value: Some(advanced_config_value::Value::BoolValue(true)),
                },
            )]
            .into(),
            ..Default::default()
        }),
        session_id: "2026_11_21_23_42_44".into(),
        host_name: "127.0.0.1:9996".into(),
        ..Default::default()
    };
    assert_eq!(req, want);
}

#[test]
fn service_paths_match_the_real_clients() {
    use ebtrace_proto::tensorflow::{profile_analysis_server, profiler_service_server};
    assert_eq!(
        profiler_service_server::SERVICE_NAME,
        "tensorflow.ProfilerService"
    );
    assert_eq!(
        profile_analysis_server::SERVICE_NAME,
        "tensorflow.ProfileAnalysis"
    );
}
