//! The HTTP listener of `ebtrace serve --http ADDR`:
//! - `/metrics`: Prometheus text format (see [`crate::metrics`]);
//! - `/debug/pprof/profile?seconds=N`: a CPU profile of the watched
//!   processes, sampled for N seconds (default 30), as pprof, the endpoint
//!   and format of Go's `net/http/pprof` that Parca, Pyroscope and
//!   `go tool pprof` read. `hz=F` changes the sampling rate.
//!
//! Anything else gets 404 and the list of what is there. A caller other
//! than root on this machine gets metrics only where every watched process
//! is one it could trace, and profiles of those processes only (see
//! [`super::caller`]); others get 403 and the rule that refused them.

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::{ConnectInfo, Query, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};

use super::{
    admission::{Admission, Work},
    caller::{Authority, Caller, Refusal, Scope},
    connection::{Incoming, Peer},
    service::not_admitted,
    sessions::HubHandle,
};
use crate::{
    attach::cpu_sample::MAX_HZ,
    capture::cpu_profile::take_cpu_profile,
    metrics::{Metrics, exposition},
};

/// Go's default when `seconds` is not given.
const DEFAULT_PROFILE_SECONDS: u64 = 30;

/// What the HTTP listener serves from.
#[derive(Clone)]
pub struct HttpServing {
    /// What `/metrics` reads.
    pub metrics: Arc<Metrics>,
    /// Where the watched processes are asked for.
    pub hub: HubHandle,
    /// Sampling rate of CPU profiles unless a request gives `hz`.
    pub sample_hz: u64,
    /// The longest CPU profile a request may ask for (`--max-duration`).
    pub max_profile: Duration,
    /// Who may do what.
    pub authority: Arc<Authority>,
    /// How many CPU profiles each caller may have in progress.
    pub admission: Arc<Admission>,
}

#[derive(Clone)]
struct Shared {
    serving: HttpServing,
    /// Set at shutdown: a profile in progress ends with what it has.
    stopping: Arc<AtomicBool>,
}

impl std::ops::Deref for Shared {
    type Target = HttpServing;

    fn deref(&self) -> &HttpServing {
        &self.serving
    }
}

impl Shared {
    /// 403 with the rule's line, counted.
    fn forbidden(&self, caller: &Caller, what: &str, why: Refusal) -> Response {
        why.count(&self.metrics, caller, what);
        refuse(StatusCode::FORBIDDEN, why.to_string())
    }
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    incoming: Incoming,
    serving: HttpServing,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let stopping = Arc::new(AtomicBool::new(false));
    let app = Router::new()
        .route("/metrics", get(scrape))
        .route("/debug/pprof/profile", get(cpu_profile))
        .fallback(not_found)
        .with_state(Shared {
            serving,
            stopping: Arc::clone(&stopping),
        });
    let shutdown = async move {
        shutdown.await;
        stopping.store(true, Ordering::Relaxed);
    };
    axum::serve(incoming, app.into_make_service_with_connect_info::<Peer>())
        .with_graceful_shutdown(shutdown)
        .await
}

async fn scrape(State(shared): State<Shared>, ConnectInfo(peer): ConnectInfo<Peer>) -> Response {
    // The hub knows the watched processes; a server shutting down has none.
    let targets = shared.hub.targets().unwrap_or_default();
    let caller = shared.authority.caller_of_peer(&peer);
    if let Err(why) = caller.may_read_all(&targets) {
        return shared.forbidden(&caller, "/metrics", why);
    }
    let metrics = Arc::clone(&shared.metrics);
    // Reading /proc for every thread is blocking work.
    let body = tokio::task::spawn_blocking(move || metrics.render(&targets))
        .await
        .unwrap_or_default();
    ([(header::CONTENT_TYPE, exposition::CONTENT_TYPE)], body).into_response()
}

/// One line saying what went wrong and what to do, as Go's handler does.
fn refuse(status: StatusCode, line: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        line + "\n",
    )
        .into_response()
}

/// `seconds` and `hz` of a profile request, checked.
fn profile_parameters(
    query: &HashMap<String, String>,
    default_hz: u64,
    max_seconds: u64,
) -> Result<(Duration, u64), String> {
    let number = |name: &str, default: u64, max: u64| -> Result<u64, String> {
        match query.get(name) {
            None => Ok(default),
            Some(v) => match v.parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => Ok(n),
                _ => Err(format!(
                    "{name}={v:?} is not a whole number from 1 to {max}; e.g. \
                     /debug/pprof/profile?seconds=10"
                )),
            },
        }
    };
    Ok((
        Duration::from_secs(number(
            "seconds",
            DEFAULT_PROFILE_SECONDS.min(max_seconds),
            max_seconds,
        )?),
        number("hz", default_hz, MAX_HZ)?,
    ))
}

async fn cpu_profile(
    State(shared): State<Shared>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let (duration, hz) =
        match profile_parameters(&query, shared.sample_hz, shared.max_profile.as_secs()) {
            Ok(p) => p,
            Err(line) => return refuse(StatusCode::BAD_REQUEST, line),
        };
    let mut targets = shared.hub.targets().unwrap_or_default();
    let caller = shared.authority.caller_of_peer(&peer);
    match caller.allowed_pids(Scope::Read, &targets, None) {
        Ok(Some(allowed)) => targets.retain(|t| allowed.contains(&t.pid)),
        Ok(None) => {}
        Err(why) if !targets.is_empty() => {
            return shared.forbidden(&caller, "a CPU profile", why);
        }
        Err(_) => {}
    }
    if targets.is_empty() {
        return refuse(
            StatusCode::NOT_FOUND,
            "no process is watched: start ebtrace serve with --pid, --match or --discover"
                .to_string(),
        );
    }
    let slot = match shared.admission.admit(&caller, Work::CpuProfile).await {
        Ok(slot) => slot,
        Err(why) => {
            not_admitted(&shared.metrics, &caller, &why);
            return refuse(StatusCode::TOO_MANY_REQUESTS, why.to_string());
        }
    };
    let stopping = Arc::clone(&shared.stopping);
    // The place is held until the sampling stops, even if the client
    // hangs up first.
    let taken = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        take_cpu_profile(&targets, duration, hz, &stopping)
    })
    .await;
    match taken {
        Ok(Ok(profile)) => {
            if profile.dropped > 0 {
                log::warn!(
                    "CPU profile: {} samples kept, {} lost (ring buffer full)",
                    profile.samples,
                    profile.dropped
                );
            }
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream"),
                    (
                        header::CONTENT_DISPOSITION,
                        "attachment; filename=\"profile\"",
                    ),
                ],
                profile.pprof,
            )
                .into_response()
        }
        Ok(Err(e)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("could not take a CPU profile: {e}"),
        ),
        Err(e) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the CPU profile failed: {e}"),
        ),
    }
}

async fn not_found() -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        "not found; this server has /metrics (Prometheus) and \
         /debug/pprof/profile?seconds=N (CPU profile, pprof)\n",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn profile_parameters_default_and_refuse_what_makes_no_sense() {
        assert_eq!(
            profile_parameters(&query(&[]), 99, 3600),
            Ok((Duration::from_secs(30), 99))
        );
        assert_eq!(
            profile_parameters(&query(&[("seconds", "2"), ("hz", "497")]), 99, 3600),
            Ok((Duration::from_secs(2), 497))
        );
        for bad in ["0", "-1", "1.5", "", "99999999999999999999", "3601"] {
            let err = profile_parameters(&query(&[("seconds", bad)]), 99, 3600).unwrap_err();
            assert!(err.contains("seconds="), "{err}");
        }
        assert!(profile_parameters(&query(&[("hz", "10001")]), 99, 3600).is_err());
        // Never longer than --max-duration, and the default within it.
        assert!(profile_parameters(&query(&[("seconds", "61")]), 99, 60).is_err());
        assert_eq!(
            profile_parameters(&query(&[]), 99, 10),
            Ok((Duration::from_secs(10), 99))
        );
    }
}
