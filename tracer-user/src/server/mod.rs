//! `ebtrace serve`: TensorFlow/XLA's gRPC `tensorflow.ProfilerService` for
//! processes that run no profiler server of their own, so that
//! `jax.collect_profile`, `tf.profiler.experimental.client.trace` and
//! XProf's "Capture profile" button can profile them unmodified.
//!
//! - [`service`]: the gRPC methods, thin: validate, ask the hub, map errors;
//! - [`caller`]: who sent a request, and what they may do;
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
//! - [`panics`]: a panic stops the server (exit 1) instead of leaving it
//!   half alive.

pub mod answer;
pub mod caller;
pub mod http;
pub mod monitor;
pub mod panics;
pub mod response;
pub mod service;
pub mod sessions;
pub mod validate;
pub mod watch;
pub mod write_guard;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use ebtrace_proto::tensorflow::profiler_service_server::ProfilerServiceServer;
use tokio::{
    net::TcpListener,
    signal::unix::{Signal, SignalKind, signal},
    task::JoinSet,
};
use tokio_stream::wrappers::TcpListenerStream;

use crate::{
    attach::{ProbeSet, ProbeSetConfig, tracefs},
    capture::check_privileges,
    capture::flight_recorder::Retention,
    error::{EXIT_FAILURE, Error, Result},
    metrics::Metrics,
    sink::xspace::local_hostname,
};
use panics::PanicWatch;
use service::ProfilerServer;
use sessions::{HubConfig, HubHandle};
use validate::Limits;
use watch::WatchMode;
use write_guard::WriteGuard;

/// Everything `ebtrace serve` was asked to do.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The addresses the gRPC ProfilerService listens on (`--bind`).
    pub binds: Vec<SocketAddr>,
    /// Whether listeners on addresses other than loopback, where no one
    /// can be told apart, are allowed (`--insecure-listen`).
    pub insecure_listen: bool,
    /// How target processes are chosen.
    pub watch: WatchMode,
    /// What a request may ask for.
    pub limits: Limits,
    /// The most sessions run at once (`--max-sessions`).
    pub max_sessions: usize,
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

/// How long in-flight captures get to finish after SIGTERM/SIGINT.
/// What the server's threads and runtime add to ebtrace's memory once it
/// listens, about: [`Retention::check_room`] is asked before.
pub const SERVER_MEMORY: usize = 4 * 1024 * 1024;

const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// After a panic, the process exits by then even if stopping hangs.
const PANIC_EXIT_DEADLINE: Duration = Duration::from_secs(45);

/// Runs the server until SIGTERM or SIGINT; in-flight captures are then
/// answered with what they recorded so far, and every probe is detached.
/// A panic in any thread stops it the same way, with an error.
pub fn run(config: ServeConfig) -> Result<()> {
    let panics = panics::watch();
    refuse_unauthenticated_listeners(&config)?;
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
    runtime.block_on(serve(config, checked, guard, panics))
}

async fn serve(
    config: ServeConfig,
    checked_probes: Option<ProbeSet>,
    guard: Option<Arc<WriteGuard>>,
    mut panics: PanicWatch,
) -> Result<()> {
    // Bind first: a taken address is reported before anything else runs.
    let listeners = Listeners::bind(&config).await?;
    let mut signals = StopSignals::install()?;

    let metrics = Arc::new(Metrics::default());
    metrics.server.unauthenticated_listeners.store(
        unauthenticated_listeners(&config).len() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
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
    for listener in listeners.grpc {
        spawn_grpc_server(listener, &service, stopped.clone(), &mut servers)?;
    }
    if let Some(listener) = listeners.http {
        let metrics = Arc::clone(&metrics);
        let hub = hub.clone();
        spawn_http_server(
            listener,
            metrics,
            hub,
            config.sample_hz,
            stopped.clone(),
            &mut servers,
        )?;
    }
    if let Some(first) = config.binds.first() {
        eprintln!(
            "ebtrace: capture with e.g. `python -m jax.collect_profile {} 2000 --log_dir DIR \
             --no_perfetto_link`; Ctrl-C stops",
            first.port()
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
    let _ = stop.send(true);
    drain_servers(&mut servers).await;
    let _ = tokio::task::spawn_blocking(move || hub_thread.join()).await;
    eprintln!("ebtrace: stopped; every probe is detached");
    if let Some(why) = panics.seen() {
        return Err(Error::Panicked(why));
    }
    match failure {
        Some(why) => Err(Error::io(why, std::io::Error::other("server stopped"))),
        None => Ok(()),
    }
}

/// The listeners on addresses other than loopback, with the flag naming
/// each: there no caller can be told apart (see [`caller`]).
fn unauthenticated_listeners(config: &ServeConfig) -> Vec<(&'static str, SocketAddr)> {
    let binds = config.binds.iter().map(|a| ("--bind", *a));
    binds
        .chain(config.http.map(|a| ("--http", a)))
        .filter(|(_, a)| !a.ip().to_canonical().is_loopback())
        .collect()
}

/// Refuses, before anything runs, a listener where no caller can be told
/// apart, unless `--insecure-listen` allows it.
fn refuse_unauthenticated_listeners(config: &ServeConfig) -> Result<()> {
    match unauthenticated_listeners(config).first() {
        Some(&(flag, addr)) if !config.insecure_listen => Err(Error::InsecureListen { flag, addr }),
        _ => Ok(()),
    }
}

/// The servers running, each with the address it serves on and how it
/// ended.
type Servers = JoinSet<(SocketAddr, std::result::Result<(), String>)>;

/// The sockets the server listens on, bound before anything else runs.
struct Listeners {
    /// One per `--bind` address, for the gRPC ProfilerService.
    grpc: Vec<TcpListener>,
    /// The `--http` address's, if there is one.
    http: Option<TcpListener>,
}

impl Listeners {
    /// Binds every address `config` names, in order.
    async fn bind(config: &ServeConfig) -> Result<Self> {
        let mut grpc = Vec::new();
        for addr in &config.binds {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Bind {
                    addr: *addr,
                    source,
                })?;
            grpc.push(listener);
        }
        let http = match config.http {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| Error::Bind { addr, source })?,
            ),
            None => None,
        };
        Ok(Listeners { grpc, http })
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

/// Resolves once the server is told to stop.
async fn stop_requested(mut stopped: tokio::sync::watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}

/// Starts serving the ProfilerService on `listener`, until `stopped`.
fn spawn_grpc_server(
    listener: TcpListener,
    service: &Arc<ProfilerServer>,
    stopped: tokio::sync::watch::Receiver<bool>,
    servers: &mut Servers,
) -> Result<()> {
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bound address", e))?;
    eprintln!("ebtrace: serving tensorflow.ProfilerService on {local}");
    warn_if_unauthenticated(local);
    let server = tonic::transport::Server::builder()
        .add_service(answer::Answering::new(
            ProfilerServiceServer::from_arc(Arc::clone(service)),
            Arc::clone(service),
        ))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop_requested(stopped));
    servers.spawn(async move { (local, server.await.map_err(|e| e.to_string())) });
    Ok(())
}

/// Starts serving `/metrics` and CPU profiles (of `hub`'s processes,
/// sampled `sample_hz` times a second) on `listener`, until `stopped`.
fn spawn_http_server(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    hub: HubHandle,
    sample_hz: u64,
    stopped: tokio::sync::watch::Receiver<bool>,
    servers: &mut Servers,
) -> Result<()> {
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bound address", e))?;
    eprintln!("ebtrace: serving Prometheus metrics on http://{local}/metrics");
    warn_if_unauthenticated(local);
    eprintln!("ebtrace: serving CPU profiles (pprof) on http://{local}/debug/pprof/profile");
    let server = http::serve(listener, metrics, hub, sample_hz, stop_requested(stopped));
    servers.spawn(async move { (local, server.await.map_err(|e| e.to_string())) });
    Ok(())
}

/// The warning for a listener `--insecure-listen` allowed.
fn warn_if_unauthenticated(local: SocketAddr) {
    if !local.ip().to_canonical().is_loopback() {
        eprintln!(
            "ebtrace: warning: {local} is not a loopback address (--insecure-listen): anyone \
             who reaches it can capture and read every watched process and control the server"
        );
    }
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
