//! `ebtrace capture`: its flags and the hand-over to [`crate::remote`].

use std::{path::PathBuf, time::Duration};

use clap::Args;

use super::parse_duration;
use crate::{
    error::{EXIT_FAILURE, Result},
    remote::{self, Ask, ClientTls},
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

/// Runs `ebtrace capture`: exit 0 when every server answered, 1 when one
/// did not (the others' traces are written all the same).
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
    let mut failed = 0;
    for result in &results {
        match &result.outcome {
            Ok(path) => eprintln!("ebtrace: {}: wrote {}", result.server, path.display()),
            Err(why) => {
                failed += 1;
                eprintln!("ebtrace: error: {}: {why}", result.server);
            }
        }
    }
    if failed > 0 {
        eprintln!(
            "ebtrace: {failed} of {} servers gave no trace",
            results.len()
        );
        return Ok(EXIT_FAILURE);
    }
    Ok(0)
}
