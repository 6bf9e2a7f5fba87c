//! Where `serve` listens: TCP addresses and Unix sockets, bound before
//! anything else runs, and the servers started on them. On a loopback
//! address or a Unix socket the kernel says who each caller is (see
//! [`super::caller`]); on any other address a caller is who its TLS client
//! certificate names (`--tls-cert`, `--tls-key`, `--client-ca`), and
//! without TLS no one can be told apart there, so such an address then
//! needs `--insecure-listen`.

use std::{
    fmt,
    net::SocketAddr,
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    str::FromStr,
    sync::Arc,
};

use ebtrace_proto::tensorflow::profiler_service_server::ProfilerServiceServer;
use tokio::{
    net::{TcpListener, UnixListener},
    task::JoinSet,
};
use tokio_stream::wrappers::UnixListenerStream;

use super::{
    ServeConfig, answer,
    connection::{self, Closing, Incoming},
    http::{self, HttpServing},
    service::ProfilerServer,
    tls::{Protocol, ServerTls},
};
use crate::error::{Error, Result};

/// An address `--bind` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindAddr {
    /// An IP address and port.
    Tcp(SocketAddr),
    /// A Unix socket (`unix:PATH`), which any local user may connect to:
    /// each is told apart by the kernel (`SO_PEERCRED`).
    Unix(PathBuf),
}

impl FromStr for BindAddr {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("unix:") {
            let path = PathBuf::from(path);
            if !path.is_absolute() {
                return Err(format!(
                    "{s:?}: a Unix socket's path must be absolute, e.g. unix:/run/ebtrace/ebtrace.sock"
                ));
            }
            return Ok(BindAddr::Unix(path));
        }
        s.parse().map(BindAddr::Tcp).map_err(|_| {
            format!(
                "{s:?} is not an IP address with a port (e.g. 127.0.0.1:6009 or [::1]:6009) nor \
                 unix:PATH"
            )
        })
    }
}

impl fmt::Display for BindAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BindAddr::Tcp(addr) => write!(f, "{addr}"),
            BindAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Whether a TCP listener on `addr` speaks TLS: on every address but
/// loopback, where TLS is set up.
fn speaks_tls(config: &ServeConfig, addr: SocketAddr) -> bool {
    config.tls.is_some() && !is_loopback(addr)
}

fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

/// The listeners on addresses other than loopback without TLS, with the
/// flag naming each: there no caller can be told apart.
pub fn unauthenticated(config: &ServeConfig) -> Vec<(&'static str, SocketAddr)> {
    let binds = config.binds.iter().filter_map(|b| match b {
        BindAddr::Tcp(addr) => Some(("--bind", *addr)),
        BindAddr::Unix(_) => None,
    });
    binds
        .chain(config.http.map(|a| ("--http", a)))
        .filter(|(_, a)| !is_loopback(*a) && !speaks_tls(config, *a))
        .collect()
}

/// Refuses, before anything runs, a listener where no caller can be told
/// apart, unless `--insecure-listen` allows it.
pub fn refuse_unauthenticated(config: &ServeConfig) -> Result<()> {
    match unauthenticated(config).first() {
        Some(&(flag, addr)) if !config.insecure_listen => Err(Error::InsecureListen { flag, addr }),
        _ => Ok(()),
    }
}

/// The servers running, each with the address it serves on and how it
/// ended.
pub type Servers = JoinSet<(String, std::result::Result<(), String>)>;

/// A socket the ProfilerService listens on.
enum GrpcListener {
    /// A TCP address, and its TLS where it speaks it.
    Tcp(TcpListener, Option<Arc<ServerTls>>),
    /// A Unix socket, and its path (removed when the server stops).
    Unix(UnixListener, PathBuf),
}

/// The sockets the server listens on, bound before anything else runs.
pub struct Listeners {
    /// One per `--bind` address, for the gRPC ProfilerService.
    grpc: Vec<GrpcListener>,
    /// The `--http` address's, if there is one, and its TLS.
    http: Option<(TcpListener, Option<Arc<ServerTls>>)>,
}

impl Listeners {
    /// Binds every address `config` names, in order, with TLS set up
    /// from its files where a listener speaks it.
    pub async fn bind(config: &ServeConfig) -> Result<Self> {
        let tls_for = |addr: SocketAddr, protocol: Protocol| -> Result<Option<Arc<ServerTls>>> {
            match &config.tls {
                Some(files) if speaks_tls(config, addr) => ServerTls::open(files, protocol)
                    .map(|tls| Some(Arc::new(tls)))
                    .map_err(Error::Tls),
                _ => Ok(None),
            }
        };
        let mut grpc = Vec::new();
        for bind in &config.binds {
            grpc.push(match bind {
                BindAddr::Tcp(addr) => {
                    let tls = tls_for(*addr, Protocol::Http2)?;
                    GrpcListener::Tcp(bind_tcp(*addr).await?, tls)
                }
                BindAddr::Unix(path) => {
                    GrpcListener::Unix(bind_unix(path, config.socket_gid)?, path.clone())
                }
            });
        }
        let http = match config.http {
            Some(addr) => {
                let tls = tls_for(addr, Protocol::Http1)?;
                Some((bind_tcp(addr).await?, tls))
            }
            None => None,
        };
        Ok(Listeners { grpc, http })
    }

    /// Starts the servers on every listener, until `stopped`; their TCP
    /// connections are closed through `closing`.
    pub fn serve(
        self,
        service: &Arc<ProfilerServer>,
        http: HttpServing,
        stopped: &tokio::sync::watch::Receiver<bool>,
        closing: &Closing,
        servers: &mut Servers,
    ) -> Result<()> {
        for listener in self.grpc {
            spawn_grpc_server(listener, service, stopped.clone(), closing, servers)?;
        }
        if let Some((listener, tls)) = self.http {
            spawn_http_server(listener, tls, http, stopped.clone(), closing, servers)?;
        }
        Ok(())
    }
}

async fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind {
        addr: addr.to_string(),
        source,
    })
}

/// Listens on the Unix socket `path`, taking the place of one a server
/// that is gone left (nothing answers on it), never of a live one or of
/// another kind of file. Any local user may connect, or, with `group`,
/// root and that group's members.
fn bind_unix(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    let bind_error = |source| Error::Bind {
        addr: format!("unix:{}", path.display()),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(bind_error(std::io::Error::other(
                "it exists and is not a socket",
            )));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(bind_error(std::io::Error::from(
                std::io::ErrorKind::AddrInUse,
            )));
        }
        std::fs::remove_file(path).map_err(bind_error)?;
    }
    let listener = UnixListener::bind(path).map_err(bind_error)?;
    let mode = match group {
        Some(gid) => {
            std::os::unix::fs::chown(path, None, Some(gid)).map_err(bind_error)?;
            0o660
        }
        None => 0o666,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(bind_error)?;
    Ok(listener)
}

/// Resolves once the server is told to stop.
pub async fn stop_requested(mut stopped: tokio::sync::watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}

/// Starts serving the ProfilerService on `listener`, until `stopped`.
fn spawn_grpc_server(
    listener: GrpcListener,
    service: &Arc<ProfilerServer>,
    stopped: tokio::sync::watch::Receiver<bool>,
    closing: &Closing,
    servers: &mut Servers,
) -> Result<()> {
    let router = tonic::transport::Server::builder().add_service(answer::Answering::new(
        ProfilerServiceServer::from_arc(Arc::clone(service)),
        Arc::clone(service),
    ));
    match listener {
        GrpcListener::Tcp(listener, tls) => {
            let incoming = accept(listener, tls, &service.metrics, closing)?;
            let local = incoming.local_addr();
            eprintln!("ebtrace: serving tensorflow.ProfilerService on {local}");
            describe_callers(&incoming);
            let server = router.serve_with_incoming_shutdown(incoming, stop_requested(stopped));
            servers
                .spawn(async move { (local.to_string(), server.await.map_err(|e| e.to_string())) });
        }
        GrpcListener::Unix(listener, path) => {
            let shown = format!("unix:{}", path.display());
            eprintln!("ebtrace: serving tensorflow.ProfilerService on {shown}");
            let server = router.serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                stop_requested(stopped),
            );
            servers.spawn(async move {
                let ended = server.await.map_err(|e| e.to_string());
                let _ = std::fs::remove_file(&path);
                (shown, ended)
            });
        }
    }
    Ok(())
}

/// Starts accepting connections on `listener`.
fn accept(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    metrics: &Arc<crate::metrics::Metrics>,
    closing: &Closing,
) -> Result<Incoming> {
    connection::accept(listener, tls, Arc::clone(metrics), closing.clone())
        .map_err(|e| Error::io("reading the bound address", e))
}

/// How callers on `incoming` are told apart, where it is not by the
/// kernel.
fn describe_callers(incoming: &Incoming) {
    let local = incoming.local_addr();
    if incoming.speaks_tls() {
        eprintln!("ebtrace: {local} speaks TLS: callers are who their client certificates name");
    } else {
        warn_if_unauthenticated(local);
    }
}

/// Starts serving `/metrics` and CPU profiles on `listener`, until
/// `stopped`.
fn spawn_http_server(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    serving: HttpServing,
    stopped: tokio::sync::watch::Receiver<bool>,
    closing: &Closing,
    servers: &mut Servers,
) -> Result<()> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let incoming = accept(listener, tls, &serving.metrics, closing)?;
    let local = incoming.local_addr();
    eprintln!("ebtrace: serving Prometheus metrics on {scheme}://{local}/metrics");
    eprintln!("ebtrace: serving CPU profiles (pprof) on {scheme}://{local}/debug/pprof/profile");
    describe_callers(&incoming);
    let server = http::serve(incoming, serving, stop_requested(stopped));
    servers.spawn(async move { (local.to_string(), server.await.map_err(|e| e.to_string())) });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses_are_ip_literals_or_absolute_unix_paths() {
        assert_eq!(
            "127.0.0.1:6009".parse(),
            Ok(BindAddr::Tcp("127.0.0.1:6009".parse().unwrap()))
        );
        assert_eq!(
            " unix:/run/ebtrace/ebtrace.sock".parse(),
            Ok(BindAddr::Unix("/run/ebtrace/ebtrace.sock".into()))
        );
        assert!(
            "unix:ebtrace.sock"
                .parse::<BindAddr>()
                .unwrap_err()
                .contains("must be absolute")
        );
        assert!(
            "localhost:6009"
                .parse::<BindAddr>()
                .unwrap_err()
                .contains("not an IP address")
        );
    }
}
