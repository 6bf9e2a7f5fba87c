//! Random and malformed calls against a running `ebtrace serve` watching a
//! CUDA workload (the stand-in driver: GPU stream tracks without a GPU) and
//! the scheduler fixture: every method of the service, raw bytes in place
//! of messages and of HTTP/2, zero and huge values, path-like names, bogus
//! pids, and a few real captures among them. Every call must get a status
//! that names its problem (INVALID_ARGUMENT for a bad value, NOT_FOUND,
//! UNIMPLEMENTED, ...), the server must never stop answering, and it must
//! hold no more descriptors and little more memory at the end than after
//! warming up. The calls derive from one seed (`EBTRACE_FUZZ_SEED`
//! replaces it), printed on failure so that the run can be repeated.

use std::{
    io::{Read as _, Write as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, MonitorRequest, ProfileOptions, ProfileRequest, ProfileResponse,
    StopContinuousProfilingRequest, TerminateRequest,
    profile_options::{AdvancedConfigValue, advanced_config_value::Value},
    profiler::XSpace,
};
use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    fixture::SchedWorkload,
    require_root, serial,
    serve::{ServeProcess, block_on, event_count, now_ns, real_request},
    xspace::links,
};
use proptest::{
    collection::vec,
    prelude::*,
    strategy::ValueTree as _,
    test_runner::{Config, RngAlgorithm, TestRng, TestRunner},
};
use prost::Message as _;
use tonic::Code;

const SEED: u64 = 0x00eb_7ace_f022;
const CALLS: usize = 1000;
const MAX_DURATION_MS: u64 = 300;
const MAX_START_DELAY_MS: u64 = 2000;
const MAX_SESSIONS: usize = 4;
const METHODS: [&str; 6] = [
    "Profile",
    "Terminate",
    "Monitor",
    "StartContinuousProfiling",
    "StopContinuousProfiling",
    "GetSnapshot",
];

/// What the calls may name.
#[derive(Clone, Debug)]
struct Context {
    watched: Vec<u32>,
    allowed: String,
    outside: String,
}

/// One call, with what it must get back.
#[derive(Clone, Debug)]
enum Call {
    /// A request answered at once: refused (`valid` false) or, with no
    /// tracer level on, an empty trace after a few milliseconds.
    Profile {
        req: ProfileRequest,
        /// `opts.start_timestamp_ns` is set this far from the sending time.
        start_in_ms: i64,
        valid: bool,
    },
    /// Real captures at once (they share one set of probes).
    Captures(Vec<ProfileRequest>),
    Terminate(String),
    Monitor(MonitorRequest),
    StartContinuous(ProfileRequest),
    StopContinuous,
    GetSnapshot(String),
    /// Bytes in place of a method's message.
    RawMessage {
        method: String,
        body: Vec<u8>,
    },
    /// Bytes in place of HTTP/2 on a connection of its own.
    RawConnection(Vec<u8>),
}

/// Strings a client may send where a name or path belongs.
fn path_like(ctx: &Context) -> impl Strategy<Value = String> + use<> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9_.:-]{1,12}",
        (
            Just(ctx.allowed.clone()),
            "(/(\\.\\.|\\.|[a-z]{1,3}|link-out|plugins|profile)){0,5}"
        )
            .prop_map(|(a, s)| a + &s),
        (Just(ctx.outside.clone()), "(/[a-z]{1,3}){0,3}").prop_map(|(o, s)| o + &s),
        "(\\.\\./|\\./|/|[a-z]{1,3}/){1,6}[a-z]{0,4}",
        "[\u{0}\n/.:\\\\]{1,6}",
        "\\PC{0,16}",
    ]
}

fn pid_value(ctx: &Context) -> impl Strategy<Value = (Value, bool)> + use<> {
    let watched = ctx.watched.clone();
    let some = watched.clone();
    prop_oneof![
        proptest::sample::select(watched.clone()).prop_map(|p| (Value::Int64Value(p.into()), true)),
        proptest::sample::subsequence(some, 1..=2).prop_map(|p| {
            let list: Vec<String> = p.iter().map(u32::to_string).collect();
            (Value::StringValue(list.join(", ")), true)
        }),
        prop_oneof![
            Just(0i64),
            Just(-1),
            Just(1),
            Just(4_194_999),
            Just(i64::from(u32::MAX)),
            Just(i64::MAX),
            Just(i64::MIN)
        ]
        .prop_map(|p| (Value::Int64Value(p), false)),
        "[0-9,x -]{0,10}|\\PC{0,6}".prop_filter_map("a pid list", move |s| {
            let valid = s
                .split(',')
                .all(|p| p.trim().parse::<u32>().is_ok_and(|p| watched.contains(&p)));
            (!valid).then_some((Value::StringValue(s), false))
        }),
        any::<bool>().prop_map(|b| (Value::BoolValue(b), false)),
    ]
}

fn any_u64() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 1u64..100_000, any::<u64>(), Just(u64::MAX)]
}

/// The fields whose values do not decide whether a request is valid.
fn request_around(ctx: &Context) -> impl Strategy<Value = ProfileRequest> + use<> {
    (
        (
            path_like(ctx),
            path_like(ctx),
            path_like(ctx),
            path_like(ctx),
        ),
        any_u64(),
        any::<bool>(),
        any::<u32>(),
        vec(("[a-z_]{0,12}", "\\PC{0,8}"), 0..3),
    )
        .prop_map(
            |((root, session, host, override_host), max_events, emit, python, extra)| {
                let advanced = extra
                    .into_iter()
                    .filter(|(k, _)| k != "pid" && k != "override_hostname")
                    .map(|(k, v)| {
                        let value = Some(Value::StringValue(v));
                        (k, AdvancedConfigValue { value })
                    })
                    .collect();
                ProfileRequest {
                    max_events,
                    repository_root: root,
                    session_id: session,
                    host_name: host,
                    emit_xspace: emit,
                    opts: Some(ProfileOptions {
                        version: 1,
                        python_tracer_level: python,
                        override_hostname: override_host,
                        advanced_configuration: advanced,
                        ..Default::default()
                    }),
                    ..Default::default()
                }
            },
        )
}

/// What is wrong with a request, if anything.
#[derive(Clone, Copy, Debug)]
enum Defect {
    None,
    ZeroDuration,
    TooLong(u64),
    TooLate(i64),
    BadPid,
}

fn profile(ctx: &Context) -> impl Strategy<Value = Call> + use<> {
    let defect = prop_oneof![
        2 => Just(Defect::None),
        1 => Just(Defect::ZeroDuration),
        1 => (MAX_DURATION_MS + 1..=u64::MAX).prop_map(Defect::TooLong),
        1 => (2 * MAX_START_DELAY_MS as i64..1_000_000_000).prop_map(Defect::TooLate),
        2 => Just(Defect::BadPid),
    ];
    (
        request_around(ctx),
        defect,
        1u64..30,
        -1_000_000i64..50,
        any::<bool>(),
        proptest::option::of(pid_value(ctx)),
        pid_value(ctx),
        (any::<u32>(), any::<u32>()),
    )
        .prop_map(
            |(mut req, defect, ms, start_in_ms, in_opts, pid, bad_pid, levels)| {
                let opts = req.opts.as_mut().expect("request_around sets opts");
                let (duration, start_in_ms, pid, valid) = match defect {
                    Defect::None => (ms, start_in_ms, pid.filter(|p| p.1), true),
                    Defect::ZeroDuration => (0, start_in_ms, pid, false),
                    Defect::TooLong(ms) => (ms, start_in_ms, pid, false),
                    Defect::TooLate(later) => (ms, later, pid, false),
                    Defect::BadPid if bad_pid.1 => (
                        ms,
                        start_in_ms,
                        Some((Value::BoolValue(true), false)),
                        false,
                    ),
                    Defect::BadPid => (ms, start_in_ms, Some(bad_pid), false),
                };
                if valid {
                    // No tracer level: nothing is attached, the trace is empty.
                    opts.host_tracer_level = 0;
                    opts.device_tracer_level = 0;
                } else {
                    (opts.host_tracer_level, opts.device_tracer_level) = levels;
                }
                if in_opts {
                    opts.duration_ms = duration;
                } else {
                    req.duration_ms = duration;
                }
                if let Some((value, _)) = pid {
                    opts.advanced_configuration
                        .insert("pid".into(), AdvancedConfigValue { value: Some(value) });
                }
                Call::Profile {
                    req,
                    start_in_ms,
                    valid,
                }
            },
        )
}

/// Real captures at one host tracer level (so that they share one set of
/// probes); `gpu`: with the CUDA driver probes (which the kernel takes
/// seconds to detach, holding up the next attach meanwhile).
fn captures(ctx: &Context, gpu: bool) -> impl Strategy<Value = Call> + use<> {
    let one = (
        request_around(ctx),
        100u64..=MAX_DURATION_MS,
        proptest::option::of(proptest::sample::subsequence(ctx.watched.clone(), 1..=2)),
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(50),
            Just(5_000),
            Just(50_000),
            Just(u64::MAX)
        ],
    )
        .prop_map(|(mut req, ms, pids, max_events)| {
            let opts = req.opts.as_mut().expect("request_around sets opts");
            opts.duration_ms = ms;
            if let Some(pids) = pids {
                let list: Vec<String> = pids.iter().map(u32::to_string).collect();
                opts.advanced_configuration.insert(
                    "pid".into(),
                    AdvancedConfigValue {
                        value: Some(Value::StringValue(list.join(","))),
                    },
                );
            }
            req.max_events = max_events;
            req
        });
    (1u32..=3, vec(one, 1..=MAX_SESSIONS)).prop_map(move |(host, mut reqs)| {
        for opts in reqs.iter_mut().filter_map(|r| r.opts.as_mut()) {
            opts.host_tracer_level = host;
            opts.device_tracer_level = u32::from(gpu);
        }
        Call::Captures(reqs)
    })
}

fn raw_body() -> impl Strategy<Value = Vec<u8>> {
    let recorded = real_request("profile_request_jax_collect_profile.bin").0;
    prop_oneof![
        vec(any::<u8>(), 0..300),
        (
            Just(recorded.clone()),
            vec((any::<proptest::sample::Index>(), any::<u8>()), 1..8)
        )
            .prop_map(|(mut bytes, flips)| {
                for (at, b) in flips {
                    let i = at.index(bytes.len());
                    bytes[i] = b;
                }
                bytes
            }),
        (Just(recorded), any::<proptest::sample::Index>())
            .prop_map(|(bytes, cut)| bytes[..cut.index(bytes.len())].to_vec()),
    ]
}

fn call(ctx: &Context) -> impl Strategy<Value = Call> + use<> {
    prop_oneof![
        60 => profile(ctx),
        8 => "\\PC{0,12}|[./a-z]{0,6}".prop_map(Call::Terminate),
        6 => (any_u64().prop_map(|d| d % (3 * MAX_DURATION_MS)).boxed(), any::<i32>(), any::<bool>())
            .prop_map(|(d, level, timestamp)| Call::Monitor(MonitorRequest {
                // Mostly refused, sometimes a window of at most 20 ms.
                duration_ms: if d < MAX_DURATION_MS { d % 21 } else { d },
                monitoring_level: level,
                timestamp,
            })),
        1 => Just(Call::Monitor(MonitorRequest { duration_ms: u64::MAX, ..Default::default() })),
        4 => request_around(ctx).prop_map(Call::StartContinuous),
        2 => Just(Call::StopContinuous),
        2 => "\\PC{0,12}".prop_map(Call::GetSnapshot),
        12 => (proptest::sample::select(METHODS.to_vec()).prop_map(str::to_string)
                .boxed()
                .prop_union("[A-Za-z/]{0,12}".boxed()), raw_body())
            .prop_map(|(method, body)| Call::RawMessage { method, body }),
        4 => prop_oneof![
            vec(any::<u8>(), 0..200),
            vec(any::<u8>(), 0..200).prop_map(|b| [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice(), &b].concat()),
        ].prop_map(Call::RawConnection),
    ]
}

/// Draws the calls of one run from `seed`; real captures are put where
/// the run needs them: one with GPU tracks near the start (which also
/// warms the server up), two more later.
fn calls(ctx: &Context, seed: u64) -> Vec<Call> {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let (gpu, host, other) = (
        captures(ctx, true).boxed(),
        captures(ctx, false).boxed(),
        call(ctx).boxed(),
    );
    (0..CALLS)
        .map(|i| {
            let strategy = match i {
                5 => &gpu,
                450 | 850 => &host,
                _ => &other,
            };
            strategy.new_tree(&mut runner).expect("a value").current()
        })
        .collect()
}

/// The trace a response carries, where it carries one.
/// Switches the flight recorder off (whether a call switched it on or not).
async fn stop_recorder(
    client: &mut ebtrace_proto::tensorflow::profiler_service_client::ProfilerServiceClient<
        tonic::transport::Channel,
    >,
) {
    client
        .stop_continuous_profiling(StopContinuousProfilingRequest {})
        .await
        .expect("StopContinuousProfiling");
}

fn trace_of(response: &ProfileResponse) -> XSpace {
    match &response.xspace {
        Some(space) => space.clone(),
        None => {
            assert_eq!(response.tool_data.len(), 1, "tool_data");
            XSpace::decode(response.tool_data[0].data.as_slice()).expect("an XSpace")
        }
    }
}

/// Checks what a real capture answered.
fn check_capture(req: &ProfileRequest, response: &ProfileResponse) {
    let space = trace_of(response);
    let events = event_count(&space);
    assert_eq!(response.empty_trace, events == 0);
    if req.max_events > 0 {
        assert!(
            events as u64 <= req.max_events,
            "{events} events for max_events {}",
            req.max_events
        );
    }
    let links = links(&space);
    assert_eq!(links.flows_out, links.flows_in, "wake-up flows");
    assert_eq!(links.calls, links.submitted, "correlation ids");
}

fn expect_code(what: &str, got: Code, allowed: &[Code]) {
    assert!(
        allowed.contains(&got),
        "{what}: answered {got:?}, expected one of {allowed:?}"
    );
}

/// Files below `dir`, recursively (links are not followed).
fn written_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() && !p.is_symlink() {
            out.extend(written_under(&p));
        } else if !p.is_symlink() {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_thousand_random_and_malformed_calls_leave_the_server_answering() {
    if !require_root("a_thousand_random_and_malformed_calls_leave_the_server_answering") {
        return;
    }
    let seed = std::env::var("EBTRACE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED);
    let _serial = serial();
    let scratch = TempDir::new("serve-fuzz");
    let allowed = scratch.path().join("allowed");
    let outside = scratch.path().join("outside");
    std::fs::create_dir_all(&allowed).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, allowed.join("link-out")).unwrap();

    let mut cuda = CudaWorkload::start(&["--bench-seconds", "600"]);
    cuda.go();
    let sched = SchedWorkload::start(&[]);
    let max_duration = format!("{MAX_DURATION_MS}ms");
    let max_delay = format!("{MAX_START_DELAY_MS}ms");
    let pids = format!("{},{}", cuda.pid, sched.pid);
    let sessions = MAX_SESSIONS.to_string();
    let mut server = ServeProcess::loopback(&[
        "--keep-probes",
        "0",
        "--pid",
        &pids,
        "--max-duration",
        &max_duration,
        "--max-start-delay",
        &max_delay,
        "--max-sessions",
        &sessions,
        "--max-sessions-per-caller",
        &sessions,
        "--allow-write-under",
        allowed.to_str().unwrap(),
    ]);
    let ctx = Context {
        watched: vec![cuda.pid, sched.pid],
        allowed: allowed.to_string_lossy().into_owned(),
        outside: outside.to_string_lossy().into_owned(),
    };
    let calls = calls(&ctx, seed);
    let real = calls
        .iter()
        .filter(|c| matches!(c, Call::Captures(_)))
        .count();
    eprintln!("seed {seed}: {CALLS} calls, {real} of them real captures");
    let started = Instant::now();

    block_on(async {
        let mut client = server.client().await;
        let mut baseline = None;
        let mut recorder_on = false;
        for (i, call) in calls.iter().enumerate() {
            let what: String = format!("seed {seed}, call {i}: {call:?}")
                .chars()
                .take(600)
                .collect();
            let what = what.as_str();
            match call {
                Call::Profile {
                    req,
                    start_in_ms,
                    valid,
                } => {
                    let mut req = req.clone();
                    let start = now_ns() as i64 + start_in_ms.saturating_mul(1_000_000);
                    req.opts.as_mut().unwrap().start_timestamp_ns = start.max(0) as u64;
                    match client.profile(req.clone()).await {
                        Ok(response) => {
                            assert!(valid, "{what}: answered a bad request");
                            check_capture(&req, response.get_ref());
                        }
                        Err(status) => {
                            assert!(!valid, "{what}: {status}");
                            expect_code(what, status.code(), &[Code::InvalidArgument]);
                            assert!(!status.message().is_empty(), "{what}");
                        }
                    }
                }
                Call::Captures(reqs) => {
                    let mut answers = Vec::new();
                    for req in reqs {
                        let mut client = client.clone();
                        let mut req = req.clone();
                        req.opts.as_mut().unwrap().start_timestamp_ns = now_ns();
                        answers.push(tokio::spawn(async move {
                            let answer = client.profile(req.clone()).await;
                            (req, answer)
                        }));
                    }
                    for answer in answers {
                        let (req, answer) = answer.await.expect("capture task");
                        let response = answer.unwrap_or_else(|s| panic!("{what}: {s}"));
                        check_capture(&req, response.get_ref());
                    }
                }
                Call::Terminate(id) => {
                    let status = client
                        .terminate(TerminateRequest {
                            session_id: id.clone(),
                        })
                        .await
                        .unwrap_err();
                    expect_code(what, status.code(), &[Code::NotFound]);
                }
                Call::Monitor(req) => {
                    let valid = (1..=MAX_DURATION_MS).contains(&req.duration_ms);
                    match client.monitor(*req).await {
                        Ok(r) => {
                            assert!(valid, "{what}");
                            assert!(r.into_inner().data.contains("pid"), "{what}");
                        }
                        Err(s) => {
                            assert!(!valid, "{what}: {s}");
                            expect_code(what, s.code(), &[Code::InvalidArgument]);
                        }
                    }
                }
                Call::StartContinuous(req) => {
                    // The flight recorder starts (whatever the levels say)
                    // or the request is refused as a Profile would be.
                    match client.start_continuous_profiling(req.clone()).await {
                        Ok(_) => recorder_on = true,
                        Err(s) => expect_code(what, s.code(), &[Code::InvalidArgument]),
                    }
                }
                Call::StopContinuous => {
                    client
                        .stop_continuous_profiling(StopContinuousProfilingRequest {})
                        .await
                        .unwrap_or_else(|s| panic!("{what}: {s}"));
                    recorder_on = false;
                }
                Call::GetSnapshot(id) => {
                    let s = client
                        .get_snapshot(GetSnapshotRequest {
                            snapshot_session_id: id.clone(),
                        })
                        .await;
                    match s {
                        Ok(_) => assert!(recorder_on, "{what}: a snapshot while off"),
                        Err(s) => {
                            assert!(!recorder_on, "{what}: {s}");
                            expect_code(what, s.code(), &[Code::FailedPrecondition]);
                        }
                    }
                }
                Call::RawMessage { method, body } => {
                    // Whatever the bytes decode to: a refusal that says
                    // why, or (rarely) a valid call's answer.
                    let allowed: &[Code] = match method.as_str() {
                        "Profile" => &[Code::Ok, Code::InvalidArgument, Code::Internal],
                        "Terminate" => &[Code::NotFound, Code::Internal],
                        "Monitor" => &[Code::Ok, Code::InvalidArgument, Code::Internal],
                        "StartContinuousProfiling" => {
                            &[Code::Ok, Code::InvalidArgument, Code::Internal]
                        }
                        "StopContinuousProfiling" => &[Code::Ok, Code::Internal],
                        "GetSnapshot" => &[Code::Ok, Code::FailedPrecondition, Code::Internal],
                        _ => &[Code::Unimplemented],
                    };
                    let code = match server.raw_call(method, body.clone()).await {
                        Ok(_) => Code::Ok,
                        Err(s) => s.code(),
                    };
                    expect_code(what, code, allowed);
                    match (method.as_str(), code) {
                        ("StartContinuousProfiling", Code::Ok) => recorder_on = true,
                        ("StopContinuousProfiling", Code::Ok) => recorder_on = false,
                        _ => {}
                    }
                }
                Call::RawConnection(bytes) => {
                    let mut stream = std::net::TcpStream::connect(server.addrs[0]).unwrap();
                    stream
                        .set_read_timeout(Some(Duration::from_secs(2)))
                        .unwrap();
                    let _ = stream.write_all(bytes);
                    let _ = stream.shutdown(std::net::Shutdown::Write);
                    let mut answer = Vec::new();
                    let _ = stream.read_to_end(&mut answer);
                }
            }
            if let Some(status) = server.exited() {
                panic!(
                    "{what}: the server exited with {status}: {:?}",
                    server.lines()
                );
            }
            if i % 100 == 99 {
                eprintln!("{} calls in {:.1?}", i + 1, started.elapsed());
            }
            if i == 50 {
                stop_recorder(&mut client).await;
                recorder_on = false;
                assert!(
                    server.wait_detached(Duration::from_secs(120)),
                    "probes left attached: {:?}",
                    server.lines()
                );
                baseline = Some((server.open_fds(), server.rss_kib()));
            }
        }

        // Still answering, with nothing held over once the flight
        // recorder is off.
        stop_recorder(&mut client).await;
        let mut req = ebtrace_tests::serve::request(200);
        req.max_events = 100;
        // Scheduler data only: no driver probes left to detach slowly.
        req.opts.as_mut().unwrap().device_tracer_level = 0;
        let last = client
            .profile(req.clone())
            .await
            .expect("a capture after the calls");
        check_capture(&req, last.get_ref());
        assert!(
            server.wait_detached(Duration::from_secs(120)),
            "probes left attached: {:?}",
            server.lines()
        );
        let (fds, rss) = baseline.expect("measured after warming up");
        assert_eq!(server.open_fds(), fds, "descriptors leaked");
        let after = server.rss_kib_settled(rss + 8 * 1024, Duration::from_secs(10));
        let grown = after as i64 - rss as i64;
        eprintln!("RSS {rss} KiB after warming up, grew by {grown} KiB");
        assert!(
            grown < 8 * 1024,
            "RSS grew by {grown} KiB over the calls (from {rss} KiB); largest mappings:\n{}",
            server.largest_mappings(8)
        );
    });
    eprintln!("{CALLS} calls in {:.1?}", started.elapsed());
    let lines = server.lines();
    assert!(
        !lines.iter().any(|l| l.contains("internal error")),
        "{lines:?}"
    );
    // Saved only inside the allowed directory, and only finished traces.
    assert_eq!(written_under(&outside), Vec::<PathBuf>::new());
    for file in written_under(&allowed) {
        assert!(file.to_string_lossy().ends_with(".xplane.pb"), "{file:?}");
        let bytes = std::fs::read(&file).unwrap();
        XSpace::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("{file:?}: {e}"));
    }
}
