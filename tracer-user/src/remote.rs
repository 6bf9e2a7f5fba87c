//! `ebtrace capture`: asks `ebtrace serve` on several hosts at once for a
//! capture (or a flight-recorder snapshot), over TLS with a client
//! certificate where one is given, and writes one run of the XProf log
//! directory: `<logdir>/plugins/profile/<run>/<HOST>_<PORT>.xplane.pb`,
//! one file per server, the layout XProf's and TF's `client.trace` write. A host that fails is reported on its own line; the others'
//! traces are still written.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, ProfileOptions, ProfileRequest, ProfileResponse,
    profiler_service_client::ProfilerServiceClient,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::{
    error::{Error, Result},
    sink::{
        logdir,
        xspace::{self, file::Written},
    },
};

/// The files of a client certificate and of the CA the servers'
/// certificates are signed by.
#[derive(Clone, Debug)]
pub struct ClientTls {
    /// This client's certificate chain, PEM.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
    /// The CA that signed the servers' certificates, PEM.
    pub server_ca: PathBuf,
}

/// What to ask every server for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// A capture this long, from now.
    Capture(Duration),
    /// What the flight recorder holds (GetSnapshot).
    Snapshot,
}

/// One `ebtrace capture`.
#[derive(Clone, Debug)]
pub struct Request {
    /// The servers, as `HOST:PORT`.
    pub servers: Vec<String>,
    /// What to ask them for.
    pub ask: Ask,
    /// The log directory written into.
    pub logdir: PathBuf,
    /// TLS, if the servers speak it.
    pub tls: Option<ClientTls>,
}

/// How long a server gets to answer beyond the capture's own length.
const ANSWER_MARGIN: Duration = Duration::from_secs(60);

/// What one server gave.
pub struct HostResult {
    /// The server, as given.
    pub server: String,
    /// The file written, or why there is none.
    pub outcome: Outcome,
}

/// What became of one server's trace.
#[derive(Debug)]
pub enum Outcome {
    /// Written whole, to this file.
    Written(PathBuf),
    /// The disk filled up: the file holds part of it
    /// ([`Error::PartialTrace`]).
    Partial(Error),
    /// No trace, and why.
    Failed(String),
}

/// Asks every server at once and writes what each answers into one run.
pub fn run(request: &Request) -> Result<Vec<HostResult>> {
    logdir::check_writable(&request.logdir)?;
    let tls = request.tls.as_ref().map(tls_config).transpose()?;
    let run = logdir::session_name(chrono::Local::now());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the async runtime", e))?;
    let results = runtime.block_on(async {
        let asks = request.servers.iter().map(|server| {
            let tls = tls.clone();
            let run = run.clone();
            async move {
                let outcome = ask_one(server, tls, request.ask, &run).await;
                (server.clone(), outcome)
            }
        });
        futures_util::future::join_all(asks).await
    });
    Ok(results
        .into_iter()
        .map(|(server, answered)| {
            let outcome = match answered {
                Ok(bytes) => write_trace(&request.logdir, &run, &server, &bytes),
                Err(why) => Outcome::Failed(why),
            };
            HostResult { server, outcome }
        })
        .collect())
}

/// Writes the XSpace `bytes` that `server` answered into the run: named by
/// the address asked, as TSL's clients name theirs (`HOST_PORT.xplane.pb`).
fn write_trace(logdir: &Path, run: &str, server: &str, bytes: &[u8]) -> Outcome {
    let written = logdir::write_run_with(logdir, run, server, |f| {
        xspace::received::write_received_trace(f.get_mut(), bytes)
    });
    match written {
        Ok((path, Written::Whole)) => Outcome::Written(path),
        Ok((path, Written::Partial { kept, why })) => {
            Outcome::Partial(Error::partial_trace(path, &kept, why))
        }
        Err(e) => Outcome::Failed(e.to_string()),
    }
}

/// The host part of `HOST:PORT`, which its certificate must name.
fn host_of(server: &str) -> String {
    match server.rsplit_once(':') {
        Some((host, _)) => host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        None => server.to_string(),
    }
}

fn tls_config(files: &ClientTls) -> Result<ClientTlsConfig> {
    let read = |flag: &str, path: &PathBuf| {
        std::fs::read(path).map_err(|e| Error::Tls(format!("{flag} {}: {e}", path.display())))
    };
    let cert = read("--tls-cert", &files.cert)?;
    let key = read("--tls-key", &files.key)?;
    let ca = read("--server-ca", &files.server_ca)?;
    Ok(ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(cert, key)))
}

/// The trace `server` answers with, as XSpace bytes.
async fn ask_one(
    server: &str,
    tls: Option<ClientTlsConfig>,
    ask: Ask,
    run: &str,
) -> std::result::Result<Vec<u8>, String> {
    let channel = connect(server, tls).await?;
    let mut client = ProfilerServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let timeout = match ask {
        Ask::Capture(duration) => duration + ANSWER_MARGIN,
        Ask::Snapshot => ANSWER_MARGIN,
    };
    let answered = match ask {
        Ask::Capture(duration) => {
            let ms = duration.as_millis().max(1) as u64;
            let mut request = tonic::Request::new(ProfileRequest {
                duration_ms: ms,
                tools: vec![crate::server::response::XPLANE_TOOL.into()],
                session_id: run.to_string(),
                host_name: server.to_string(),
                // What jax.collect_profile asks for by default.
                opts: Some(ProfileOptions {
                    version: 1,
                    duration_ms: ms,
                    host_tracer_level: 2,
                    device_tracer_level: 1,
                    ..Default::default()
                }),
                ..Default::default()
            });
            request.set_timeout(timeout);
            client.profile(request).await
        }
        Ask::Snapshot => {
            let mut request = tonic::Request::new(GetSnapshotRequest {
                snapshot_session_id: run.to_string(),
            });
            request.set_timeout(timeout);
            client.get_snapshot(request).await
        }
    };
    let response = answered.map_err(|status| describe_status(&status))?;
    xspace_bytes(response.into_inner())
}

async fn connect(
    server: &str,
    tls: Option<ClientTlsConfig>,
) -> std::result::Result<Channel, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{server}"))
        .map_err(|e| format!("{server:?} is not HOST:PORT ({e})"))?
        .connect_timeout(Duration::from_secs(10));
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls.domain_name(host_of(server)))
            .map_err(|e| format!("TLS: {e}"))?;
    }
    endpoint.connect().await.map_err(|e| {
        let mut line = format!("could not connect: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            line.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        line
    })
}

fn describe_status(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// The XSpace of a response, whichever way the server sent it.
fn xspace_bytes(response: ProfileResponse) -> std::result::Result<Vec<u8>, String> {
    if response.empty_trace {
        return Err("the server recorded nothing (an empty trace)".into());
    }
    if let Some(space) = response.xspace {
        return Ok(prost::Message::encode_to_vec(&space));
    }
    response
        .tool_data
        .into_iter()
        .find(|t| t.name.ends_with(crate::server::response::XPLANE_TOOL))
        .map(|t| t.data)
        .ok_or_else(|| "the answer holds no XSpace (xplane.pb)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_name_the_host() {
        assert_eq!(host_of("10.0.0.7:6443"), "10.0.0.7");
        assert_eq!(host_of("[::1]:6443"), "::1");
        assert_eq!(host_of("node-3.cluster:6443"), "node-3.cluster");
    }
}
