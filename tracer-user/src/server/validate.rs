//! Checks a `ProfileRequest` and turns it into a [`SessionSpec`]: the one
//! place where request fields become capture parameters, and where a bad
//! request gets its INVALID_ARGUMENT message.
//!
//! Field semantics follow TSL's server: `opts.duration_ms` (falling back to
//! `duration_ms`), `opts.start_timestamp_ns` (wall clock; in the past means
//! now), tracer levels from `opts` unless `opts.version` is 0, which means
//! TSL's defaults. The levels choose the probe families in
//! [`families_for`].

use std::{collections::BTreeSet, fmt, time::Duration};

use ebtrace_proto::tensorflow::{
    ProfileOptions, ProfileRequest, profile_options::advanced_config_value,
};

use super::write_guard::{Destination, WriteGuard};
use crate::{capture::ProbeFamilies, timeline::EventLimitFrom};

/// What the operator allows a request to ask for, and sets for what no
/// request can ask.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest capture a request may ask for.
    pub max_duration: Duration,
    /// How far in the future a requested start may be.
    pub max_start_delay: Duration,
    /// The shortest block whose stack a capture with scheduling takes
    /// (zero: none); ProfileOptions has no switch for it.
    pub off_cpu_min: Duration,
    /// The most events an answer holds, whatever its request asks
    /// (`--max-capture-events`; `None`: what it asks): what a capture
    /// takes to build its answer grows with its events.
    pub max_events: Option<usize>,
}

/// The advanced-configuration key that restricts a capture to some of the
/// watched processes: an int64 pid, or a string of comma-separated pids.
pub const PIDS_KEY: &str = "pid";

/// TSL's tracer levels: host (0 off, 1 user TraceMe, 2 +high-level, 3
/// verbose), device (0/1), python (0/1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TracerLevels {
    /// `host_tracer_level`: scheduler data and TraceMe events at this level.
    pub host: u32,
    /// `device_tracer_level`: CUDA driver calls and, through them, device work.
    pub device: u32,
    /// `python_tracer_level`; ebtrace has no Python tracer, so it switches nothing.
    pub python: u32,
}

impl TracerLevels {
    /// `ProfilerSession::DefaultOptions()`, used when `opts.version` is 0.
    pub const DEFAULT: TracerLevels = TracerLevels {
        host: 2,
        device: 1,
        python: 0,
    };

    /// The levels `opts` asks for; TSL's defaults without them or where `opts.version` is 0.
    pub fn of(opts: Option<&ProfileOptions>) -> Self {
        match opts {
            Some(o) if o.version != 0 => TracerLevels {
                host: o.host_tracer_level,
                device: o.device_tracer_level,
                python: o.python_tracer_level,
            },
            _ => Self::DEFAULT,
        }
    }
}

/// Which probe families a request's tracer levels switch on. Scheduler
/// data and TraceMe events are host data: `host_tracer_level` 0 turns them
/// off, and its value is the TraceMe level. CUDA driver calls are what
/// TSL's device tracer records: `device_tracer_level`.
pub fn families_for(levels: TracerLevels, off_cpu_min: Duration) -> ProbeFamilies {
    ProbeFamilies {
        sched: levels.host >= 1,
        cuda: levels.device >= 1,
        traceme_level: levels.host,
        // ProfileOptions has no switch for stack samples: the flight
        // recorder and /debug/pprof/profile take them.
        cpu_sample_hz: 0,
        // Off-CPU stacks lie over the scheduler's Blocked states.
        off_cpu_min: if levels.host >= 1 {
            off_cpu_min
        } else {
            Duration::ZERO
        },
        python_frames: true,
    }
}

/// How the XSpace goes back to the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// `tool_data { name: "xplane.pb" }`: the client writes the file.
    ToolData,
    /// `ProfileResponse.xspace` (`emit_xspace` was set).
    Inline,
}

/// Whether the server saves a copy of a trace itself. Where it may not,
/// the request is still answered: TSL's clients save the trace from the
/// response, as they do from any server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerCopy {
    /// Not asked for (no `repository_root`, or `emit_xspace`), or this
    /// server saves nothing (no `--allow-write-under`).
    NotAsked,
    /// A place inside the allowed directory.
    Save(Destination),
    /// Asked for where this server may not write: why, for its log.
    Refused(String),
}

/// A checked request: everything the session needs, nothing unchecked.
#[derive(Clone, Debug)]
pub struct SessionSpec {
    /// `session_id` (or `opts.session_id`); `Terminate` matches on it.
    pub session_id: String,
    /// Requested start, wall-clock epoch ns; `None`: now.
    pub start_wall_ns: Option<u64>,
    /// How long to record.
    pub duration: Duration,
    /// The tracer levels asked for.
    pub levels: TracerLevels,
    /// The probe families those levels switch on.
    pub families: ProbeFamilies,
    /// At most this many events in the trace (`None`: no limit).
    pub max_events: Option<usize>,
    /// Whether the request or the server set `max_events`.
    pub max_events_from: EventLimitFrom,
    /// Only these of the watched processes (`None`: all of them).
    pub pids: Option<BTreeSet<u32>>,
    /// Host name recorded in the XSpace.
    pub hostname: String,
    /// How the XSpace goes back to the client.
    pub delivery: Delivery,
    /// Whether the server itself saves the XSpace.
    pub server_copy: ServerCopy,
    /// Who asked (for the server's log).
    pub client: String,
    /// The identity its caller's work counts under
    /// ([`super::caller::Caller::identity`]): the caller may end it.
    pub owner: String,
}

impl SessionSpec {
    /// What the flight recorder records when started with `--retain`
    /// rather than by a request: TSL's default levels, for every watched
    /// process, answered in `tool_data`.
    pub fn flight_recorder(hostname: &str) -> Self {
        let levels = TracerLevels::DEFAULT;
        SessionSpec {
            session_id: "flight-recorder".into(),
            start_wall_ns: None,
            duration: Duration::ZERO,
            levels,
            families: families_for(levels, Duration::ZERO),
            max_events: None,
            max_events_from: EventLimitFrom::Request,
            pids: None,
            hostname: hostname.to_string(),
            delivery: Delivery::ToolData,
            server_copy: ServerCopy::NotAsked,
            client: "--retain".into(),
            owner: String::new(),
        }
    }
}

/// Why a request was refused; the message goes back as INVALID_ARGUMENT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid(pub String);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn human(d: Duration) -> String {
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64)).to_string()
}

/// Checks `req` against `limits`; `now_wall_ns` is the server's clock,
/// `local_host` its host name, `guard` the directory it may write under.
pub fn profile_request(
    req: &ProfileRequest,
    limits: &Limits,
    guard: Option<&WriteGuard>,
    now_wall_ns: u64,
    local_host: &str,
    client: String,
) -> Result<SessionSpec, Invalid> {
    let opts = req.opts.as_ref();
    let duration_ms = opts
        .map(|o| o.duration_ms)
        .filter(|&ms| ms > 0)
        .unwrap_or(req.duration_ms);
    if duration_ms == 0 {
        return Err(Invalid(
            "the requested duration is 0: set ProfileRequest.duration_ms or \
             opts.duration_ms to the capture length in milliseconds"
                .into(),
        ));
    }
    let duration = Duration::from_millis(duration_ms);
    if duration > limits.max_duration {
        return Err(Invalid(format!(
            "the requested duration {} is above this server's limit of {} \
             (ebtrace serve --max-duration)",
            human(duration),
            human(limits.max_duration)
        )));
    }

    let start_wall_ns = opts
        .map(|o| o.start_timestamp_ns)
        .filter(|&ns| ns > now_wall_ns);
    if let Some(start) = start_wall_ns {
        let delay = Duration::from_nanos(start - now_wall_ns);
        if delay > limits.max_start_delay {
            return Err(Invalid(format!(
                "opts.start_timestamp_ns is {} in the future, beyond this server's limit of {} \
                 (ebtrace serve --max-start-delay); check the client's clock",
                human(delay),
                human(limits.max_start_delay)
            )));
        }
    }

    let levels = TracerLevels::of(opts);
    let pids = requested_pids(opts)?;
    let override_hostname = override_hostname(opts);
    let session_id = if req.session_id.is_empty() {
        opts.map(|o| o.session_id.clone()).unwrap_or_default()
    } else {
        req.session_id.clone()
    };
    let delivery = if req.emit_xspace {
        Delivery::Inline
    } else {
        Delivery::ToolData
    };

    // The server saves a file only where the operator allowed it, and only
    // if the request names a repository (as TSL's clients always do). A
    // path it may not write to costs the client nothing: it gets the trace
    // and saves it itself, as it would with any other server.
    let server_copy = match guard {
        Some(guard) if !req.repository_root.is_empty() && delivery == Delivery::ToolData => {
            let file_host = override_hostname
                .clone()
                .or_else(|| (!req.host_name.is_empty()).then(|| req.host_name.clone()))
                .unwrap_or_else(|| local_host.to_string());
            match guard.resolve(&req.repository_root, &session_id, &file_host) {
                Ok(destination) => ServerCopy::Save(destination),
                Err(refusal) => ServerCopy::Refused(refusal.to_string()),
            }
        }
        _ => ServerCopy::NotAsked,
    };

    let asked_events = (req.max_events > 0).then_some(req.max_events as usize);
    let (max_events, max_events_from) = match (asked_events, limits.max_events) {
        (Some(asked), Some(most)) if asked <= most => (Some(asked), EventLimitFrom::Request),
        (_, Some(most)) => (Some(most), EventLimitFrom::Server),
        (asked, None) => (asked, EventLimitFrom::Request),
    };
    Ok(SessionSpec {
        session_id,
        start_wall_ns,
        duration,
        levels,
        families: families_for(levels, limits.off_cpu_min),
        max_events,
        max_events_from,
        pids,
        hostname: override_hostname.unwrap_or_else(|| local_host.to_string()),
        delivery,
        server_copy,
        client,
        owner: String::new(),
    })
}

/// `opts.override_hostname`, else `advanced_configuration["override_hostname"]`.
fn override_hostname(opts: Option<&ProfileOptions>) -> Option<String> {
    let opts = opts?;
    if !opts.override_hostname.is_empty() {
        return Some(opts.override_hostname.clone());
    }
    match opts
        .advanced_configuration
        .get("override_hostname")
        .and_then(|v| v.value.as_ref())
    {
        Some(advanced_config_value::Value::StringValue(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// The pids of `advanced_configuration["pid"]`, if given.
fn requested_pids(opts: Option<&ProfileOptions>) -> Result<Option<BTreeSet<u32>>, Invalid> {
    let Some(value) = opts
        .and_then(|o| o.advanced_configuration.get(PIDS_KEY))
        .and_then(|v| v.value.as_ref())
    else {
        return Ok(None);
    };
    let bad = |what: &str| {
        Invalid(format!(
            "advanced_configuration[\"{PIDS_KEY}\"] = {what} is not a pid or a comma-separated \
             list of pids"
        ))
    };
    let pids: BTreeSet<u32> = match value {
        advanced_config_value::Value::Int64Value(v) => {
            BTreeSet::from([u32::try_from(*v).map_err(|_| bad(&v.to_string()))?])
        }
        advanced_config_value::Value::StringValue(s) => s
            .split(',')
            .map(|p| p.trim().parse::<u32>().map_err(|_| bad(&format!("{s:?}"))))
            .collect::<Result<_, _>>()?,
        advanced_config_value::Value::BoolValue(b) => return Err(bad(&b.to_string())),
    };
    if pids.contains(&0) {
        return Err(bad("0"));
    }
    Ok(Some(pids))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use std::path::PathBuf;

    use ebtrace_proto::tensorflow::profile_options::AdvancedConfigValue;
    use proptest::prelude::*;
    use prost::Message as _;

    use super::*;

    const NOW: u64 = 1_800_000_000_000_000_000;
    const LIMITS: Limits = Limits {
        max_duration: Duration::from_secs(60),
        max_start_delay: Duration::from_secs(60),
        off_cpu_min: Duration::from_millis(10),
        max_events: None,
    };

    #[test]
    fn the_servers_max_events_holds_whatever_a_request_asks() {
        let limits = Limits {
            max_events: Some(1_000),
            ..LIMITS
        };
        let asking = |max_events| {
            let req = ProfileRequest {
                duration_ms: 1_000,
                max_events,
                ..ProfileRequest::default()
            };
            let spec = profile_request(&req, &limits, None, NOW, "box", "test".into()).unwrap();
            (spec.max_events, spec.max_events_from)
        };
        assert_eq!(asking(0), (Some(1_000), EventLimitFrom::Server));
        assert_eq!(asking(5_000), (Some(1_000), EventLimitFrom::Server));
        assert_eq!(asking(1_000), (Some(1_000), EventLimitFrom::Request));
        assert_eq!(asking(10), (Some(10), EventLimitFrom::Request));
    }

    fn fixture(name: &str) -> ProfileRequest {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/real/");
        let bytes = std::fs::read(format!("{path}{name}"))
            .unwrap_or_else(|e| panic!("fixture {path}{name}: {e}"));
        ProfileRequest::decode(bytes.as_slice()).expect("a ProfileRequest")
    }

    fn check(req: &ProfileRequest) -> Result<SessionSpec, Invalid> {
        profile_request(req, &LIMITS, None, NOW, "box", "test".into())
    }

    #[test]
    fn the_real_clients_requests_are_accepted() {
        for (name, python) in [
            ("profile_request_jax_collect_profile.bin", 1),
            ("profile_request_tf_client.bin", 0),
            ("profile_request_xprof_web_capture.bin", 0),
        ] {
            let req = fixture(name);
            let spec = check(&req).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(spec.duration, Duration::from_millis(1000), "{name}");
            // Recorded in 2026-11; NOW is later, so the start is "now".
            assert_eq!(spec.start_wall_ns, None, "{name}");
            assert_eq!(
                spec.levels,
                TracerLevels {
                    host: 2,
                    device: 1,
                    python
                }
            );
            assert!(spec.families.sched);
            assert_eq!(
                spec.families.off_cpu_min, LIMITS.off_cpu_min,
                "the server's"
            );
            assert_eq!(spec.max_events, Some(1_000_000));
            assert_eq!(spec.session_id, req.session_id);
            assert_eq!(spec.delivery, Delivery::ToolData);
            assert_eq!(spec.hostname, "box");
            assert_eq!(
                spec.server_copy,
                ServerCopy::NotAsked,
                "no directory allowed, no saving"
            );
            assert_eq!(spec.pids, None);
        }
    }

    #[test]
    fn version_zero_means_defaults_and_duration_falls_back() {
        let req = ProfileRequest {
            duration_ms: 1500,
            opts: Some(ProfileOptions {
                version: 0,
                host_tracer_level: 0,
                ..Default::default()
            }),
            ..Default::default()
        };
        let spec = check(&req).unwrap();
        assert_eq!(spec.levels, TracerLevels::DEFAULT);
        assert_eq!(spec.duration, Duration::from_millis(1500));
        let mut req = req;
        req.opts.as_mut().unwrap().version = 1;
        let spec = check(&req).unwrap();
        assert!(spec.families.is_empty(), "host level 0: no scheduler data");
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let zero = ProfileRequest::default();
        assert!(check(&zero).unwrap_err().0.contains("duration is 0"));

        let long = ProfileRequest {
            duration_ms: 61_000,
            ..Default::default()
        };
        assert!(check(&long).unwrap_err().0.contains("--max-duration"));

        let mut later = fixture("profile_request_tf_client.bin");
        later.opts.as_mut().unwrap().start_timestamp_ns = NOW + 61_000_000_000;
        assert!(check(&later).unwrap_err().0.contains("--max-start-delay"));
        later.opts.as_mut().unwrap().start_timestamp_ns = NOW + 2_000_000_000;
        assert_eq!(
            check(&later).unwrap().start_wall_ns,
            Some(NOW + 2_000_000_000)
        );

        let with_pid = |v: advanced_config_value::Value| ProfileRequest {
            duration_ms: 10,
            opts: Some(ProfileOptions {
                version: 1,
                advanced_configuration: HashMap::from([(
                    PIDS_KEY.to_string(),
                    AdvancedConfigValue { value: Some(v) },
                )]),
                ..Default::default()
            }),
            ..Default::default()
        };
        use advanced_config_value::Value;
        assert_eq!(
            check(&with_pid(Value::StringValue("3, 4".into())))
                .unwrap()
                .pids,
            Some(BTreeSet::from([3, 4]))
        );
        assert_eq!(
            check(&with_pid(Value::Int64Value(7))).unwrap().pids,
            Some(BTreeSet::from([7]))
        );
        for bad in [
            Value::StringValue("12,x".into()),
            Value::Int64Value(-1),
            Value::BoolValue(true),
            Value::StringValue("0".into()),
        ] {
            assert!(check(&with_pid(bad)).unwrap_err().0.contains("not a pid"));
        }
    }

    #[test]
    fn override_hostname_and_emit_xspace() {
        let mut req = fixture("profile_request_jax_collect_profile.bin");
        req.emit_xspace = true;
        req.opts.as_mut().unwrap().override_hostname = "worker-3".into();
        let spec = check(&req).unwrap();
        assert_eq!(spec.hostname, "worker-3");
        assert_eq!(spec.delivery, Delivery::Inline);
    }

    /// What a client may put in a string field: path-like, control
    /// characters, anything.
    fn any_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            Just(String::new()),
            "[a-z0-9_:.]{1,12}",
            "(/|\\.\\./|\\./|[a-z]{1,4}/){0,6}[a-z.]{0,6}",
            "\\PC{0,24}",
            ".{0,24}",
        ]
    }

    fn any_value() -> impl proptest::strategy::Strategy<Value = advanced_config_value::Value> {
        use advanced_config_value::Value;
        use proptest::prelude::*;
        prop_oneof![
            any::<i64>().prop_map(Value::Int64Value),
            (0i64..5).prop_map(Value::Int64Value),
            any::<bool>().prop_map(Value::BoolValue),
            "[0-9, ]{0,12}|-?[0-9]{1,12}|\\PC{0,8}".prop_map(Value::StringValue),
        ]
    }

    fn any_u64() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![Just(0u64), 1u64..70_000, any::<u64>(), Just(u64::MAX)]
    }

    prop_compose! {
        fn any_request()(
            duration_ms in any_u64(),
            opts_duration_ms in any_u64(),
            start in prop_oneof![Just(0u64), NOW - 10..NOW + 120_000_000_000, any_u64()],
            version in 0u32..3,
            levels in (any_u64(), any_u64(), any_u64()),
            with_opts in proptest::prelude::any::<bool>(),
            advanced in proptest::collection::hash_map(
                prop_oneof![Just(PIDS_KEY.to_string()), Just("override_hostname".to_string()), any_text()],
                proptest::option::of(any_value()),
                0..3,
            ),
            override_hostname in any_text(),
            session_id in any_text(),
            opts_session_id in any_text(),
            repository_root in any_text(),
            host_name in any_text(),
            max_events in any_u64(),
            emit_xspace in proptest::prelude::any::<bool>(),
        ) -> ProfileRequest {
            ProfileRequest {
                duration_ms,
                max_events,
                repository_root,
                session_id,
                host_name,
                emit_xspace,
                opts: with_opts.then(|| ProfileOptions {
                    duration_ms: opts_duration_ms,
                    start_timestamp_ns: start,
                    version,
                    host_tracer_level: levels.0 as u32,
                    device_tracer_level: levels.1 as u32,
                    python_tracer_level: levels.2 as u32,
                    override_hostname,
                    session_id: opts_session_id,
                    advanced_configuration: advanced
                        .into_iter()
                        .map(|(k, value)| (k, AdvancedConfigValue { value }))
                        .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }
        }
    }

    /// The documented rules, written out independently: a duration in
    /// 1..=max (opts first, then the request's), a start at most
    /// max_start_delay ahead, and pids that are pids.
    fn respects_the_limits(req: &ProfileRequest) -> bool {
        let opts = req.opts.as_ref();
        let duration = match opts.map_or(0, |o| o.duration_ms) {
            0 => req.duration_ms,
            ms => ms,
        };
        let start = opts.map_or(0, |o| o.start_timestamp_ns);
        let pids_ok = match opts
            .and_then(|o| o.advanced_configuration.get(PIDS_KEY))
            .and_then(|v| v.value.as_ref())
        {
            None => true,
            Some(advanced_config_value::Value::Int64Value(v)) => {
                (1..=i64::from(u32::MAX)).contains(v)
            }
            Some(advanced_config_value::Value::StringValue(s)) => s
                .split(',')
                .all(|p| p.trim().parse::<u32>().is_ok_and(|p| p > 0)),
            Some(advanced_config_value::Value::BoolValue(_)) => false,
        };
        (1..=LIMITS.max_duration.as_millis() as u64).contains(&duration)
            && start.saturating_sub(NOW) <= LIMITS.max_start_delay.as_nanos() as u64
            && pids_ok
    }

    /// The temporary directory as the allowed one (nothing is written).
    fn scratch_guard() -> &'static (PathBuf, WriteGuard) {
        static GUARD: std::sync::OnceLock<(PathBuf, WriteGuard)> = std::sync::OnceLock::new();
        GUARD.get_or_init(|| {
            let dir = std::fs::canonicalize(std::env::temp_dir()).unwrap();
            let guard = WriteGuard::open(&dir).unwrap();
            (dir, guard)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// A request is accepted exactly when it respects the documented
        /// limits; where it asks the server to save, the path never decides
        /// whether it is answered, and a copy is only ever planned inside
        /// the allowed directory.
        #[test]
        fn accepts_exactly_what_respects_the_limits(req in any_request(), allowed in proptest::prelude::any::<bool>()) {
            let (dir, guard) = scratch_guard();
            let guard = allowed.then_some(guard);
            let result = profile_request(&req, &LIMITS, guard, NOW, "box", "test".into());
            prop_assert_eq!(result.is_ok(), respects_the_limits(&req), "{:?}", result);
            let Ok(spec) = result else { return Ok(()) };
            prop_assert!(spec.duration > Duration::ZERO && spec.duration <= LIMITS.max_duration);
            prop_assert_eq!(spec.max_events, (req.max_events > 0).then_some(req.max_events as usize));
            prop_assert!(spec.pids.iter().flatten().all(|&p| p > 0));
            match &spec.server_copy {
                ServerCopy::Save(destination) => {
                    let guard = guard.expect("saving needs a directory");
                    let path = guard.path_of(destination);
                    prop_assert!(path.starts_with(dir));
                    prop_assert!(path.components().all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::RootDir)));
                }
                ServerCopy::Refused(why) => prop_assert!(guard.is_some() && !why.is_empty()),
                ServerCopy::NotAsked => prop_assert!(
                    guard.is_none() || req.repository_root.is_empty() || req.emit_xspace
                ),
            }
        }
    }
}
