//! Certificates the tests make themselves (rcgen): a CA, and server and
//! client certificates it signs, written as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A certificate authority, and where its certificate was written.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub cert: PathBuf,
}

/// A certificate's and its key's files.
pub struct Issued {
    /// The certificate, PEM.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
}

impl Ca {
    /// A new CA named `name`, its certificate written to `dir/name.pem`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let path = dir.join(format!("{name}.pem"));
        std::fs::write(&path, cert.pem()).unwrap();
        Ca {
            issuer: Issuer::new(params, key),
            cert: path,
        }
    }

    /// A server certificate for `sans` (DNS names or IP addresses),
    /// written to `dir/stem.pem` and `dir/stem.key`.
    pub fn server(&self, dir: &Path, stem: &str, sans: &[&str]) -> Issued {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, stem);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params, dir, stem)
    }

    /// A client certificate whose subject's CN is `name`.
    pub fn client(&self, dir: &Path, name: &str) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params, dir, name)
    }

    fn issue(&self, params: CertificateParams, dir: &Path, stem: &str) -> Issued {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let issued = Issued {
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).unwrap();
        std::fs::write(&issued.key, key.serialize_pem()).unwrap();
        issued
    }
}
