//! `ebtrace serve`: TensorFlow/XLA's gRPC `tensorflow.ProfilerService` for
//! processes that run no profiler server of their own, so that
//! `jax.collect_profile`, `tf.profiler.experimental.client.trace` and
//! XProf's "Capture profile" button can profile them unmodified.
//!
//! - [`service`]: the gRPC methods, thin: validate, ask the hub, map errors;
//! - [`caller`]: who sent a request, and what they may do;
//! - [`admission`]: how much work each caller may have in progress;
//! - [`policy`]: `--policy`, who gets more than ptrace's rule gives;
//! - [`tls`]: TLS with client certificates on network listeners;
//! - [`reload`]: certificates and the policy, read again when they change;
//! - [`answer`]: `Profile` and `GetSnapshot` answers sent from the trace's
//!   own buffer rather than copied into tonic's;
//! - [`validate`]: request fields → a checked [`validate::SessionSpec`];
//! - [`sessions`]: the hub thread that owns probes and sessions;
//! - [`response`]: a finished timeline → `ProfileResponse`;
//! - [`write_guard`]: server-side saving, confined to `--allow-write-under`;
//! - [`recorder`]: the flight recorder behind `GetSnapshot`;
//! - [`watch`]: the watched processes (`--pid` or `--discover`);
//! - [`monitor`]: the `Monitor` summary;
//! - [`http`]: `--http`: Prometheus `/metrics` and pprof CPU profiles;
//! - [`listen`]: the TCP addresses and Unix sockets it listens on;
//! - [`connection`]: their connections, plain or TLS, and who is at the
//!   other end;
//! - [`panics`]: a panic stops the server (exit 1) instead of leaving it
//!   half alive.

pub mod admission;
pub mod answer;
pub mod caller;
pub mod connection;
pub mod http;
pub mod listen;
pub mod monitor;
pub mod panics;
pub mod policy;
pub mod reload;
pub mod response;
pub mod service;
pub mod sessions;
pub mod tls;
pub mod validate;
pub mod watch;
pub mod write_guard;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    task::JoinSet,
};

use crate::{
    attach::{ProbeSet, ProbeSetConfig, tracefs},
    capture::check_privileges,
    capture::flight_recorder::Retention,
    error::{EXIT_FAILURE, Error, Result},
    metrics::Metrics,
    sink::xspace::local_hostname,
};
use admission::{Admission, AdmissionLimits};
use caller::Authority;
use connection::Closing;
use http::HttpServing;
use listen::{BindAddr, Listeners, Servers};
use panics::PanicWatch;
use service::ProfilerServer;
use sessions::HubConfig;
use validate::Limits;
use watch::WatchMode;
use write_guard::WriteGuard;

/// Everything `ebtrace serve` was asked to do.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The addresses the gRPC ProfilerService listens on (`--bind`).
    pub binds: Vec<BindAddr>,
    /// Whether listeners on addresses other than loopback, where no one
    /// can be told apart, are allowed (`--insecure-listen`).
    pub insecure_listen: bool,
    /// TLS with client certificates for the listeners on addresses other
    /// than loopback (`--tls-cert`, `--tls-key`, `--client-ca`).
    pub tls: Option<tls::TlsFiles>,
    /// Who gets more than ptrace's rule gives them (`--policy`).
    pub policy: Option<PathBuf>,
    /// The group whose members alone (and root) may connect to the Unix
    /// sockets (`--socket-group`, resolved); without it, anyone may.
    pub socket_gid: Option<u32>,
    /// How target processes are chosen.
    pub watch: WatchMode,
    /// What a request may ask for.
    pub limits: Limits,
    /// The most sessions run at once (`--max-sessions`).
    pub max_sessions: usize,
    /// The most captures one caller runs at once
    /// (`--max-sessions-per-caller`).
    pub max_sessions_per_caller: usize,
    /// How the eBPF object is loaded.
    pub probe: ProbeSetConfig,
    /// The directory under which the server may save traces itself (`--allow-write-under`).
    pub allow_write_under: Option<PathBuf>,
    /// How long a finished capture's probes stay attached (paused) for
    /// the next one.
    pub keep_probes: Duration,
    /// Where to serve `/metrics` and `/debug/pprof/profile` over HTTP, if anywhere.
    pub http: Option<SocketAddr>,
    /// Sampling rate of CPU profiles (per CPU).
    pub sample_hz: u64,
    /// What the flight recorder keeps.
    pub retention: Retention,
    /// Whether it runs from the start (`--retain`) rather than from
    /// `StartContinuousProfiling`.
    pub record_from_start: bool,
}

/// What the server's threads and runtime add to ebtrace's memory once it
/// listens, about: [`Retention::check_room`] is asked before.
pub const SERVER_MEMORY: usize = 4 * 1024 * 1024;

/// How long in-flight captures get to finish after SIGTERM/SIGINT.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// How long the agents' answers are waited for once the server is told to
/// stop; past it, or at a second signal, they are abandoned, so that a
/// silent agent cannot hold the shutdown.
const AGENTS_SHUTDOWN_WAIT: Duration = Duration::from_secs(10);
/// Work waits for other callers' as long as the longest capture, and this.
const ADMISSION_WAIT_MARGIN: Duration = Duration::from_secs(10);
/// After a panic, the process exits by then even if stopping hangs.
const PANIC_EXIT_DEADLINE: Duration = Duration::from_secs(45);

/// Runs the server until SIGTERM or SIGINT; in-flight captures are then
/// answered with what they recorded so far, and every probe is detached.
/// A panic in any thread stops it the same way, with an error.
pub fn run(config: ServeConfig) -> Result<()> {
    let panics = panics::watch();
    listen::refuse_unauthenticated(&config)?;
    let authority = Arc::new(Authority::new(config.policy.clone()).map_err(Error::Policy)?);
    check_privileges()?;
    // What every capture needs is checked once, before listening.
    let root = tracefs::locate()?;
    let check = tracefs::check_tracepoints(&root)?;
    let checked = ProbeSet::load(&ProbeSetConfig {
        exit_has_group_dead: check.exit_has_group_dead,
        ..config.probe.clone()
    })?;
    // With its ring buffer mapped, ebtrace takes what it will beside the
    // flight recorder's records: whether `--retain-memory` leaves them
    // room is known now.
    let resident = crate::procfs::own_resident_bytes();
    if let Err(why) = config
        .retention
        .check_room(resident + SERVER_MEMORY, config.probe.ring_bytes as usize)
    {
        if config.record_from_start {
            return Err(Error::RetainMemory(why));
        }
        eprintln!("ebtrace: warning: StartContinuousProfiling will be refused: {why}");
    }
    // A stack is written at most a capture's length, or the recorder's
    // window, after it was sampled: its Python frames' names stay that long.
    crate::symbols::python::names::keep_names_for(
        config.limits.max_duration.max(config.retention.window),
    );
    // Only the flight recorder of `--retain` uses it, at its first start
    // (which may wait for a watched process); a server without one holds
    // no ring buffer while idle.
    let checked = config.record_from_start.then_some(checked);
    let guard = config
        .allow_write_under
        .as_ref()
        .map(|dir| {
            WriteGuard::open(dir).map_err(|source| Error::AllowWriteUnder {
                path: dir.clone(),
                source,
            })
        })
        .transpose()?
        .map(Arc::new);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the async runtime", e))?;
    runtime.block_on(serve(config, checked, guard, authority, panics))
}

async fn serve(
    config: ServeConfig,
    checked_probes: Option<ProbeSet>,
    guard: Option<Arc<WriteGuard>>,
    authority: Arc<Authority>,
    mut panics: PanicWatch,
) -> Result<()> {
    // Bind first: a taken address is reported before anything else runs.
    let listeners = Listeners::bind(&config).await?;
    let mut signals = StopSignals::install()?;

    let metrics = Arc::new(Metrics::default());
    metrics.server.unauthenticated_listeners.store(
        listen::unauthenticated(&config).len() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    let admission = Admission::new(AdmissionLimits {
        captures_per_caller: config.max_sessions_per_caller,
        wait: config.limits.max_duration + ADMISSION_WAIT_MARGIN,
    });
    let (hub, hub_thread) = sessions::spawn(HubConfig {
        watch: config.watch.clone(),
        max_sessions: config.max_sessions,
        max_duration: config.limits.max_duration,
        probe: config.probe.clone(),
        checked_probes,
        guard: guard.clone(),
        keep_probes: config.keep_probes,
        metrics: Arc::clone(&metrics),
        retention: config.retention,
        record_from_start: config.record_from_start,
        hostname: local_hostname(),
    })
    .map_err(|e| Error::io("starting the session thread", e))?;
    let service = Arc::new(ProfilerServer {
        hub: hub.clone(),
        limits: config.limits,
        guard: guard.clone(),
        hostname: local_hostname(),
        metrics: Arc::clone(&metrics),
        authority: Arc::clone(&authority),
        admission: Arc::clone(&admission),
    });

    describe_watch(&config.watch);
    if let Some(g) = &guard {
        eprintln!(
            "ebtrace: requests whose repository_root lies under {} are also saved there",
            g.root().display()
        );
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut servers = JoinSet::new();
    let closing = Closing::default();
    listeners.serve(
        &service,
        HttpServing {
            metrics: Arc::clone(&metrics),
            hub: hub.clone(),
            sample_hz: config.sample_hz,
            max_profile: config.limits.max_duration,
            authority,
            admission,
        },
        &stopped,
        &closing,
        &mut servers,
    )?;
    let first_port = config.binds.iter().find_map(|b| match b {
        BindAddr::Tcp(addr) => Some(addr.port()),
        BindAddr::Unix(_) => None,
    });
    if let Some(port) = first_port {
        eprintln!(
            "ebtrace: capture with e.g. `python -m jax.collect_profile {port} 2000 --log_dir DIR \
             --no_perfetto_link`; Ctrl-C stops"
        );
    }

    let failure = tokio::select! {
        _ = signals.terminate.recv() => None,
        _ = signals.interrupt.recv() => None,
        _ = panics.panicked() => {
            exit_anyway_after(PANIC_EXIT_DEADLINE);
            None
        }
        Some(ended) = servers.join_next() => match ended {
            Ok((addr, Err(e))) => Some(format!("the server on {addr} failed: {e}")),
            Ok((addr, Ok(()))) => Some(format!("the server on {addr} stopped")),
            Err(e) => Some(format!("a server task failed: {e}")),
        },
    };
    if let Some(why) = &failure {
        eprintln!("ebtrace: {why}");
    }
    eprintln!("ebtrace: shutting down: answering captures in progress with what they recorded");
    hub.shutdown();
    let abandoning = tokio::spawn(abandon_answers_later(signals));
    let _ = stop.send(true);
    drain_servers(&mut servers).await;
    let _ = tokio::task::spawn_blocking(move || hub_thread.join()).await;
    abandoning.abort();
    closing.wait().await;
    eprintln!("ebtrace: stopped; every probe is detached");
    if let Some(why) = panics.seen() {
        return Err(Error::Panicked(why));
    }
    match failure {
        Some(why) => Err(Error::io(why, std::io::Error::other("server stopped"))),
        None => Ok(()),
    }
}

/// The signals that stop the server.
struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl StopSignals {
    fn install() -> Result<Self> {
        Ok(StopSignals {
            terminate: signal(SignalKind::terminate())
                .map_err(|e| Error::io("installing the SIGTERM handler", e))?,
            interrupt: signal(SignalKind::interrupt())
                .map_err(|e| Error::io("installing the SIGINT handler", e))?,
        })
    }
}

/// Abandons every answer still awaited from an agent after
/// [`AGENTS_SHUTDOWN_WAIT`], or at once at another signal.
async fn abandon_answers_later(mut signals: StopSignals) {
    let why = tokio::select! {
        _ = tokio::time::sleep(AGENTS_SHUTDOWN_WAIT) => format!(
            "still stopping after {}s",
            AGENTS_SHUTDOWN_WAIT.as_secs()
        ),
        _ = signals.terminate.recv() => "told again to stop".to_string(),
        _ = signals.interrupt.recv() => "told again to stop".to_string(),
    };
    eprintln!("ebtrace: {why}: what the agents have still to hand over is abandoned");
    crate::agent::abandon_every_answer();
}

/// Waits up to [`SHUTDOWN_GRACE`] for the servers to answer what is in
/// flight and stop.
async fn drain_servers(servers: &mut Servers) {
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!(
            "ebtrace: connections still open after {}s; closing them",
            SHUTDOWN_GRACE.as_secs()
        );
    }
}

/// Ends the process with [`EXIT_FAILURE`] after `deadline`, whatever the
/// other threads are doing by then.
fn exit_anyway_after(deadline: Duration) {
    let watchdog = std::thread::Builder::new()
        .name("ebtrace-exit".into())
        .spawn(move || {
            std::thread::sleep(deadline);
            eprintln!(
                "ebtrace: error: still stopping {}s after an internal error; exiting now",
                deadline.as_secs()
            );
            std::process::exit(EXIT_FAILURE);
        });
    if watchdog.is_err() {
        std::process::exit(EXIT_FAILURE);
    }
}

fn describe_watch(watch: &WatchMode) {
    match watch {
        WatchMode::Pids(targets) => {
            let names: Vec<String> = targets
                .iter()
                .map(|t| format!("{} ({})", t.pid, t.name))
                .collect();
            eprintln!("ebtrace: watching pid {}", names.join(", "));
        }
        WatchMode::Discover { interval } => eprintln!(
            "ebtrace: watching every process that maps {} or a jaxlib/ library (rescanned every \
             {})",
            watch::RUNTIME_LIBRARIES.join(", "),
            humantime::format_duration(*interval)
        ),
    }
}
