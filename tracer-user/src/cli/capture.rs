//! `ebtrace capture`: its flags and the hand-over to [`crate::remote`].

use std::{path::PathBuf, time::Duration};

use clap::Args;

use super::parse_duration;
use crate::{
    error::{EXIT_FAILURE, Result},
    remote::{self, Ask, ClientTls, Outcome},
};

// A `concat!` doc, which clap does not read: a literal one would become
// the help text of the command this type is part of.
#[doc = concat!("The flags of `ebtrace capture`.")]
#[derive(Debug, Clone, Args)]
pub struct CaptureArgs {
    /// The servers (`ebtrace serve`) to ask, as HOST:PORT, comma-separated.
    #[arg(value_name = "HOST:PORT", value_delimiter = ',', required = true)]
    pub servers: Vec<String>,

    /// How long each server records.
    #[arg(short = 'd', long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
    pub duration: Duration,

    /// Ask for what each server's flight recorder holds (GetSnapshot)
    /// instead of a new capture.
    #[arg(long, conflicts_with = "duration")]
    pub snapshot: bool,

    /// Log directory; the traces go to
    /// DIR/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<HOST>_<PORT>.xplane.pb,
    /// one run for all servers.
    #[arg(long, value_name = "DIR", default_value = "ebtrace-logs")]
    pub logdir: PathBuf,

    /// This client's certificate (PEM), for servers that speak TLS.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "server_ca"])]
    pub tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "server_ca"])]
    pub tls_key: Option<PathBuf>,

    /// The CA (PEM) that signed the servers' certificates; the servers'
    /// certificates must name the HOST they are reached by.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub server_ca: Option<PathBuf>,
}

/// Runs `ebtrace capture`: exit 0 when every server's trace was written
/// whole, 1 when one gave none or a full disk took part of it (the others'
/// traces are written all the same).
pub fn run(args: &CaptureArgs) -> Result<i32> {
    let tls = match (&args.tls_cert, &args.tls_key, &args.server_ca) {
        (Some(cert), Some(key), Some(server_ca)) => Some(ClientTls {
            cert: cert.clone(),
            key: key.clone(),
            server_ca: server_ca.clone(),
        }),
        _ => None,
    };
    let results = remote::run(&remote::Request {
        servers: args.servers.clone(),
        ask: if args.snapshot {
            Ask::Snapshot
        } else {
            Ask::Capture(args.duration)
        },
        logdir: args.logdir.clone(),
        tls,
    })?;
    let (mut failed, mut partial) = (0, 0);
    for result in &results {
        let server = &result.server;
        match &result.outcome {
            Outcome::Written(path) => eprintln!("ebtrace: {server}: wrote {}", path.display()),
            Outcome::Partial(why) => {
                partial += 1;
                eprintln!("ebtrace: error: {server}: {why}");
            }
            Outcome::Failed(why) => {
                failed += 1;
                eprintln!("ebtrace: error: {server}: {why}");
            }
        }
    }
    let n = results.len();
    if failed > 0 {
        eprintln!("ebtrace: {failed} of {n} servers gave no trace");
    }
    if partial > 0 {
        eprintln!("ebtrace: {partial} of {n} traces were written in part");
    }
    Ok(if failed + partial > 0 {
        EXIT_FAILURE
    } else {
        0
    })
}
