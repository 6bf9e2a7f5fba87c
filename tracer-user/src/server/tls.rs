//! TLS with client certificates for `serve`'s listeners on network
//! addresses (`--tls-cert`, `--tls-key`, `--client-ca`): a caller there is
//! who its certificate, signed by the client CA, names. The files are read
//! again when they change, so a rotated certificate is used from the next
//! connection on (see [`super::reload`]).

use std::{fmt, path::PathBuf, sync::Arc};

use tokio_rustls::rustls::{
    self, RootCertStore, ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _},
    server::WebPkiClientVerifier,
};
use x509_parser::{certificate::X509Certificate, extensions::GeneralName, prelude::FromDer as _};

use super::reload::{Reloading, read_small};

/// The files TLS is set up from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain, PEM (`--tls-cert`).
    pub cert: PathBuf,
    /// Its private key, PEM (`--tls-key`).
    pub key: PathBuf,
    /// The CA certificates client certificates must be signed by, PEM
    /// (`--client-ca`).
    pub client_ca: PathBuf,
}

/// The protocol a listener speaks inside TLS, offered by ALPN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// gRPC.
    Http2,
    /// `/metrics` and pprof.
    Http1,
}

impl Protocol {
    fn alpn(self) -> &'static [u8] {
        match self {
            Protocol::Http2 => b"h2",
            Protocol::Http1 => b"http/1.1",
        }
    }
}

/// The TLS configuration of one listener, from its files as they are now.
pub struct ServerTls(Reloading<ServerConfig>);

impl ServerTls {
    /// Loads `files` for a listener speaking `protocol`; the line says
    /// which file is wrong and how.
    pub fn open(files: &TlsFiles, protocol: Protocol) -> Result<Self, String> {
        let files = files.clone();
        let paths = vec![
            files.cert.clone(),
            files.key.clone(),
            files.client_ca.clone(),
        ];
        Reloading::open(paths, move |_| server_config(&files, protocol)).map(ServerTls)
    }

    /// The configuration for the next connection.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.0.current()
    }
}

fn server_config(files: &TlsFiles, protocol: Protocol) -> Result<ServerConfig, String> {
    let chain = certificates(&files.cert, "--tls-cert")?;
    let key = PrivateKeyDer::from_pem_slice(&read_small(&files.key)?).map_err(|e| {
        format!(
            "--tls-key {}: no private key in it ({e}); it must be PEM",
            files.key.display()
        )
    })?;
    let mut roots = RootCertStore::empty();
    for ca in certificates(&files.client_ca, "--client-ca")? {
        roots.add(ca).map_err(|e| {
            format!(
                "--client-ca {}: not a CA certificate ({e})",
                files.client_ca.display()
            )
        })?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| format!("--client-ca {}: {e}", files.client_ca.display()))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
            format!(
                "--tls-cert {} with --tls-key {}: {e} (is the key the certificate's?)",
                files.cert.display(),
                files.key.display()
            )
        })?;
    config.alpn_protocols = vec![protocol.alpn().to_vec()];
    Ok(config)
}

fn certificates(
    path: &std::path::Path,
    flag: &str,
) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read_small(path).map_err(|e| format!("{flag} {e}"))?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{flag} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{flag} {}: no certificate in it; it must be PEM (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(certs)
}

/// Who a client certificate names: its subject's common name and its
/// subject alternative names (DNS names, URIs such as SPIFFE IDs, email
/// addresses). A policy's `subjects` match any of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertSubject {
    /// The subject's CN, if it has one.
    pub common_name: Option<String>,
    /// Its DNS, URI and email subject alternative names.
    pub alt_names: Vec<String>,
}

impl CertSubject {
    /// The names of the DER certificate `der`; `None` if it does not parse
    /// (rustls verified it, so it does).
    pub fn of(der: &[u8]) -> Option<Self> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let common_name = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_string);
        let mut alt_names = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(n) | GeneralName::URI(n) | GeneralName::RFC822Name(n) => {
                        alt_names.push((*n).to_string());
                    }
                    _ => {}
                }
            }
        }
        Some(CertSubject {
            common_name,
            alt_names,
        })
    }

    /// Every name it goes by.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.common_name
            .iter()
            .chain(&self.alt_names)
            .map(String::as_str)
    }
}

impl fmt::Display for CertSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.names().next() {
            Some(name) => write!(f, "certificate {name:?}"),
            None => f.write_str("a certificate naming no one"),
        }
    }
}
