//! `ebtrace serve`: its flags (each documented here) and the hand-over to
//! [`crate::server`].

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::Args;

use super::{parse_duration, parse_duration_or_zero, parse_ring_mib};
use crate::{
    attach::{LaunchStacks, ProbeSetConfig},
    capture::{flight_recorder::Retention, open_targets},
    error::{Error, Result},
    server::{
        self, ServeConfig, listen::BindAddr, tls::TlsFiles, validate::Limits, watch::WatchMode,
    },
};

// A `concat!` doc, which clap does not read: a literal one would become
// the help text of the command this type is part of.
#[doc = concat!("The flags of `ebtrace serve`.")]
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Process to watch (repeat or comma-separate for several). A thread id
    /// selects its whole process.
    #[arg(
        short = 'p',
        long = "pid",
        value_name = "PID",
        value_delimiter = ',',
        required_unless_present = "discover",
        conflicts_with = "discover"
    )]
    pub pids: Vec<u32>,

    /// Watch every process that maps libcuda, jaxlib, TensorFlow or libtpu,
    /// including processes started later (found by reading /proc/*/maps).
    #[arg(long)]
    pub discover: bool,

    /// How often --discover looks for new processes.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
    pub discover_interval: Duration,

    /// Address to listen on, e.g. 127.0.0.1:6009, [::1]:6009, or a Unix
    /// socket as unix:/run/ebtrace/ebtrace.sock (repeat for several).
    /// Anything but loopback or a Unix socket needs TLS (--tls-cert) or
    /// --insecure-listen.
    #[arg(long = "bind", value_name = "ADDR", default_value = "127.0.0.1:6009")]
    pub binds: Vec<BindAddr>,

    /// Let --bind and --http listen on addresses other than loopback
    /// without TLS, where ebtrace cannot tell who asks: anyone who reaches
    /// them may capture and read every watched process and control the
    /// server. Without it (or TLS) such an address is refused at start.
    #[arg(long)]
    pub insecure_listen: bool,

    /// The server's certificate chain (PEM): --bind and --http addresses
    /// other than loopback then speak TLS and take only clients with a
    /// certificate signed by --client-ca, who are who it names. Read again
    /// when it changes.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "client_ca"])]
    pub tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "client_ca"])]
    pub tls_key: Option<PathBuf>,

    /// The CA certificates (PEM) that must have signed a client's
    /// certificate on a TLS listener.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub client_ca: Option<PathBuf>,

    /// Let only root and the members of GROUP connect to the --bind
    /// unix: sockets (owned by GROUP, mode 0660); without it any local user
    /// may, each told apart by the kernel.
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,

    /// A TOML file granting scopes (read, capture, control) over every
    /// watched process to local users by uid or group and to client
    /// certificates by name, and revoking certificates (docs/serve.md).
    /// Read again when it changes.
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,

    /// Also save each trace where the request's repository_root says, if
    /// that lies inside DIR (never elsewhere). Without it, traces only go
    /// back to the client, which writes them itself.
    #[arg(long, value_name = "DIR")]
    pub allow_write_under: Option<PathBuf>,

    /// Captures in progress at once; more are refused (RESOURCE_EXHAUSTED).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_sessions: u32,

    /// Captures one caller (a uid, a certificate's name) may have in
    /// progress at once; more are refused (RESOURCE_EXHAUSTED). Each caller
    /// also gets one flight-recorder snapshot and one CPU profile at a
    /// time; beyond the server's one at a time they wait their turn.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_sessions_per_caller: u32,

    /// Longest capture (and CPU profile) a request may ask for.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub max_duration: Duration,

    /// Most events a capture's answer holds, whatever its request asks (a
    /// request asking for more, or for no limit, gets this many, and its
    /// trace says so): building an answer takes about 160 bytes an event.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_capture_events: Option<u64>,

    /// How far in the future a request may ask its capture to start.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub max_start_delay: Duration,

    /// How long the probes stay attached after a capture, recording
    /// nothing, so that the next capture of the same processes starts
    /// without attaching them again (0 detaches them at once). While kept,
    /// the programs still run on the watched processes' scheduler events
    /// (see BENCHMARKS.md for what that costs them).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration_or_zero)]
    pub keep_probes: Duration,

    /// Also serve Prometheus metrics of the watched processes (on-CPU
    /// time, run-queue wait, context switches, threads) and of ebtrace
    /// itself at http://ADDR/metrics, and CPU profiles (pprof, as Parca,
    /// Pyroscope and `go tool pprof` read them) at
    /// http://ADDR/debug/pprof/profile?seconds=N, e.g. 127.0.0.1:9464.
    /// Anything but loopback needs TLS (--tls-cert) or --insecure-listen.
    #[arg(long, value_name = "ADDR", value_parser = parse_bind)]
    pub http: Option<SocketAddr>,

    /// Stack samples a second per CPU of CPU profiles (a request's `hz`
    /// overrides it).
    #[arg(long, value_name = "HZ", default_value_t = crate::attach::cpu_sample::DEFAULT_HZ,
          value_parser = clap::value_parser!(u64).range(1..=crate::attach::cpu_sample::MAX_HZ))]
    pub sample_hz: u64,

    /// Run the flight recorder from the start: keep the last DURATION of
    /// every watched process (scheduling, CUDA driver calls) for
    /// GetSnapshot. Without it, StartContinuousProfiling switches it on
    /// (keeping 30s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub retain: Option<Duration>,

    /// Most memory ebtrace takes while the flight recorder runs, in MiB
    /// (its resident memory, as top shows it): ebtrace itself, the records
    /// it keeps and a snapshot built from them. Past it the oldest records
    /// are forgotten (and counted).
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub retain_memory: u32,

    /// Stack samples a second per CPU the flight recorder takes and lays
    /// on its snapshots' thread lines (0: none). It samples for as long as
    /// it runs: the default is low; a CPU profile asks for its own rate.
    #[arg(long, value_name = "HZ", default_value_t = crate::attach::cpu_sample::RECORDER_DEFAULT_HZ,
          value_parser = clap::value_parser!(u32).range(0..=crate::attach::cpu_sample::MAX_HZ as i64))]
    pub retain_sample_hz: u32,

    /// In captures, also take the user stack of a thread that waited in a
    /// system call (a sleep, a lock's futex, a read, a poll) for at least
    /// DURATION, as the call returns, and show it over the wait on its
    /// line: where it waited. While a capture takes them, every system call
    /// on the machine is slower (about 100 ns a call on a 2-core VM); the
    /// flight recorder never takes them.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub off_cpu_min: Option<Duration>,

    /// CUDA driver calls that submit work carry the stack they were made
    /// from in captures and the flight recorder, at most this many a second
    /// on each CPU (0: none). A stack costs the launching thread a few
    /// microseconds: the default keeps them under 0.1% of a CPU however
    /// fast a program launches.
    #[arg(long, value_name = "N", default_value_t = RECORDER_LAUNCH_STACKS_PER_S,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub launch_stacks_per_s: u32,

    /// Kernel ring buffer size in MiB (a power of two), shared by the
    /// captures in progress.
    #[arg(long, value_name = "MIB", default_value_t = 16, value_parser = parse_ring_mib)]
    pub ring_buffer_mib: u32,
}

/// Launch stacks a second on each CPU that `serve` takes by default: at
/// the 3 to 4 µs a stack costs a launching thread (BENCHMARKS.md), 0.08%
/// of a CPU, within the flight recorder's budget of 0.5% of one with its
/// CPU samples.
const RECORDER_LAUNCH_STACKS_PER_S: u32 = 200;

/// What the flight recorder keeps when `StartContinuousProfiling` starts it
/// and `--retain` did not say.
const DEFAULT_RETAIN: Duration = Duration::from_secs(30);

fn parse_bind(s: &str) -> Result<SocketAddr, String> {
    s.trim().parse().map_err(|_| {
        format!("{s:?} is not an IP address with a port (e.g. 127.0.0.1:6009 or [::1]:6009)")
    })
}

/// Runs `ebtrace serve` until SIGTERM or SIGINT.
pub fn run(args: &ServeArgs) -> Result<()> {
    crate::attach::traceme::prepare_gates();
    let watch = if args.discover {
        WatchMode::Discover {
            interval: args.discover_interval,
        }
    } else {
        WatchMode::Pids(open_targets(&args.pids)?)
    };
    server::run(ServeConfig {
        binds: args.binds.clone(),
        insecure_listen: args.insecure_listen,
        tls: match (&args.tls_cert, &args.tls_key, &args.client_ca) {
            (Some(cert), Some(key), Some(client_ca)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
            }),
            _ => None,
        },
        policy: args.policy.clone(),
        socket_gid: args
            .socket_group
            .as_deref()
            .map(|name| {
                crate::procfs::group_id(name).ok_or_else(|| Error::NoSuchGroup(name.to_string()))
            })
            .transpose()?,
        watch,
        limits: Limits {
            max_duration: args.max_duration,
            max_start_delay: args.max_start_delay,
            off_cpu_min: args.off_cpu_min.unwrap_or_default(),
            max_events: args.max_capture_events.map(|n| n as usize),
        },
        max_sessions: args.max_sessions as usize,
        max_sessions_per_caller: args.max_sessions_per_caller as usize,
        probe: ProbeSetConfig {
            ring_bytes: args.ring_buffer_mib * 1024 * 1024,
            launch_stacks: LaunchStacks::PerCpuPerSecond(args.launch_stacks_per_s),
            ..ProbeSetConfig::default()
        },
        allow_write_under: args.allow_write_under.clone(),
        keep_probes: args.keep_probes,
        http: args.http,
        sample_hz: args.sample_hz,
        retention: Retention {
            window: args.retain.unwrap_or(DEFAULT_RETAIN),
            memory_bytes: args.retain_memory as usize * 1024 * 1024,
            cpu_sample_hz: args.retain_sample_hz,
        },
        record_from_start: args.retain.is_some(),
    })
}
