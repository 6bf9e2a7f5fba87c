//! Who is asking, and what they may do. Every request is tied to the
//! identity of the connection it came on before it is served:
//!
//! - a loopback peer is the user owning its socket, as the kernel's socket
//!   table says ([`crate::procfs::tcp_socket_owner`]), and a Unix socket's
//!   peer the user the kernel gives with it (`SO_PEERCRED`); a user other than
//!   root may capture and read only the processes it could trace itself
//!   (ptrace's rule: its own uid, dumpable, not set-id), and change
//!   nothing of the server (the flight recorder, others' captures), beyond
//!   what `--policy` grants it by uid or group;
//! - a peer on a TLS listener is who its client certificate names: it gets
//!   what `--policy` grants that name, or, without a policy, everything;
//! - a peer on another machine without TLS reached a listener the operator
//!   allowed with `--insecure-listen`, which `serve` warns about.

use std::{collections::BTreeSet, fmt, net::SocketAddr, path::PathBuf, sync::Arc};

use serde::Deserialize;
use tonic::{Request, transport::server::UdsConnectInfo};

use super::{
    connection::Peer,
    policy::{CertificateGrant, Policy},
    reload::Reloading,
    tls::CertSubject,
};
use crate::{
    metrics::Metrics,
    procfs::{self, TargetProcess},
};

/// Who sent a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Who {
    /// A process of this machine, by the user owning its socket.
    Local {
        /// The socket owner's uid.
        uid: u32,
    },
    /// A peer on a TLS listener, by its client certificate.
    Certified {
        /// What the certificate names.
        subject: Arc<CertSubject>,
        /// The peer's address.
        addr: SocketAddr,
    },
    /// A peer on another machine, on a listener without TLS.
    Remote {
        /// Its address.
        addr: SocketAddr,
    },
    /// A loopback peer whose socket the kernel does not list (it closed
    /// since, or the table could not be read): it gets nothing.
    Unknown {
        /// Its address, where known.
        addr: Option<SocketAddr>,
    },
}

/// What a request does, which decides who may make it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Reads what the server has of processes (GetSnapshot, Monitor,
    /// metrics, CPU profiles).
    Read,
    /// Captures processes (Profile: it may load the agent into them).
    Capture,
    /// Changes the server for everyone (the flight recorder, Terminate).
    Control,
}

impl Scope {
    fn describe(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Capture => "capture",
            Scope::Control => "control the server",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Capture => "capture",
            Scope::Control => "control",
        }
    }
}

/// Why a request was refused: one line naming the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal(String);

impl Refusal {
    /// Counts the refusal of `what` to `caller` (on `/metrics`) and logs it,
    /// as both listeners do.
    pub fn count(&self, metrics: &Metrics, caller: &Caller, what: &str) {
        metrics
            .server
            .requests_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        eprintln!("ebtrace: refused {what} from {caller}: {self}");
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a caller was granted beyond ptrace's rule.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Granted {
    /// Every scope over every process: root, a certificate without a
    /// policy, a peer `--insecure-listen` let in.
    Everything,
    /// These scopes over every process, from the policy.
    Scopes(BTreeSet<Scope>),
    /// Nothing: the policy revokes a name its certificate carries.
    Revoked(String),
}

/// A caller, and what it was granted when its request arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    who: Who,
    granted: Granted,
}

/// The rules callers are judged by: ptrace's, and `--policy`'s.
#[derive(Default)]
pub struct Authority {
    policy: Option<Reloading<Policy>>,
}

impl Authority {
    /// Judges callers by the policy at `path`, if one is given; it must
    /// load now.
    pub fn new(policy: Option<PathBuf>) -> Result<Self, String> {
        Ok(Authority {
            policy: policy.map(Policy::watch).transpose()?,
        })
    }

    /// The caller of a gRPC request.
    pub fn caller_of<T>(&self, request: &Request<T>) -> Caller {
        let who = if let Some(peer) = request.extensions().get::<Peer>() {
            Who::of_peer(peer)
        } else if let Some(unix) = request.extensions().get::<UdsConnectInfo>() {
            match unix.peer_cred {
                Some(cred) => Who::Local { uid: cred.uid() },
                None => Who::Unknown { addr: None },
            }
        } else {
            Who::Unknown { addr: None }
        };
        self.judge(who)
    }

    /// The caller at the far end of an HTTP connection.
    pub fn caller_of_peer(&self, peer: &Peer) -> Caller {
        self.judge(Who::of_peer(peer))
    }

    /// What `who` is granted now.
    pub(super) fn judge(&self, who: Who) -> Caller {
        let policy = self.policy.as_ref().map(|p| p.current());
        let granted = match (&who, policy) {
            (Who::Local { uid: 0 } | Who::Remote { .. }, _) => Granted::Everything,
            (Who::Certified { .. }, None) => Granted::Everything,
            (Who::Certified { subject, .. }, Some(policy)) => {
                match policy.for_certificate(subject) {
                    CertificateGrant::Scopes(scopes) => Granted::Scopes(scopes),
                    CertificateGrant::Revoked(name) => Granted::Revoked(name),
                }
            }
            (Who::Local { uid }, Some(policy)) => Granted::Scopes(policy.for_uid(*uid)),
            (Who::Local { .. } | Who::Unknown { .. }, None) => Granted::Scopes(BTreeSet::new()),
            (Who::Unknown { .. }, Some(_)) => Granted::Scopes(BTreeSet::new()),
        };
        Caller { who, granted }
    }
}

impl Who {
    fn of_peer(peer: &Peer) -> Self {
        if let Some(subject) = &peer.certificate {
            return Who::Certified {
                subject: Arc::clone(subject),
                addr: peer.remote,
            };
        }
        Who::of_connection(peer.local, peer.remote)
    }

    /// Who is at the far end of a plain TCP connection from `remote` to
    /// this server's `local` address.
    fn of_connection(local: SocketAddr, remote: SocketAddr) -> Self {
        if !remote.ip().to_canonical().is_loopback() {
            return Who::Remote { addr: remote };
        }
        match procfs::tcp_socket_owner(remote, local) {
            Ok(Some(uid)) => Who::Local { uid },
            Ok(None) => Who::Unknown { addr: Some(remote) },
            Err(e) => {
                log::warn!("the owner of the connection from {remote} is unknown: {e}");
                Who::Unknown { addr: Some(remote) }
            }
        }
    }
}

impl Caller {
    /// What its work is counted under: its uid, its certificate's name,
    /// or, for a peer `--insecure-listen` let in, its address without the
    /// port (each connection has a new one).
    pub fn identity(&self) -> String {
        match &self.who {
            Who::Local { uid } => format!("uid {uid}"),
            Who::Certified { subject, .. } => subject.to_string(),
            Who::Remote { addr } => addr.ip().to_string(),
            Who::Unknown { .. } => "an unknown caller".into(),
        }
    }

    /// Whether it may do `scope` to every process.
    fn granted(&self, scope: Scope) -> bool {
        match &self.granted {
            Granted::Everything => true,
            Granted::Scopes(scopes) => scopes.contains(&scope),
            Granted::Revoked(_) => false,
        }
    }

    /// The processes among `targets` the caller may capture or read
    /// (`scope`); `None`: all of them. Refused where it may see none, or
    /// where it named one (`asked`) it may not.
    pub fn allowed_pids(
        &self,
        scope: Scope,
        targets: &[TargetProcess],
        asked: Option<&BTreeSet<u32>>,
    ) -> Result<Option<BTreeSet<u32>>, Refusal> {
        if self.granted(scope) {
            return Ok(None);
        }
        let uid = self.local_uid(scope)?;
        if let Some(pid) = asked
            .into_iter()
            .flatten()
            .find(|p| !procfs::traceable_by(**p, uid))
        {
            return Err(self.not_theirs(scope, uid, *pid));
        }
        let allowed: BTreeSet<u32> = targets
            .iter()
            .map(|t| t.pid)
            .filter(|p| asked.is_none_or(|a| a.contains(p)) && procfs::traceable_by(*p, uid))
            .collect();
        if allowed.is_empty() {
            return Err(Refusal(format!(
                "uid {uid} may {} only processes it could trace itself (its own uid, \
                 dumpable, not set-id), and none of the watched processes is one",
                scope.describe()
            )));
        }
        Ok(Some(allowed))
    }

    /// Refused unless the caller may read every one of `targets` (what the
    /// flight recorder and the metrics hold is of them all).
    pub fn may_read_all(&self, targets: &[TargetProcess]) -> Result<(), Refusal> {
        if self.granted(Scope::Read) {
            return Ok(());
        }
        let uid = self.local_uid(Scope::Read)?;
        match targets.iter().find(|t| !procfs::traceable_by(t.pid, uid)) {
            Some(t) => Err(self.not_theirs(Scope::Read, uid, t.pid)),
            None => Ok(()),
        }
    }

    /// Refused unless the caller may change the server for everyone.
    pub fn may_control(&self) -> Result<(), Refusal> {
        if self.granted(Scope::Control) {
            return Ok(());
        }
        let uid = self.local_uid(Scope::Control)?;
        Err(Refusal(format!(
            "uid {uid} may not control the server (the flight recorder, other callers' \
             captures): only root may, and those --policy grants \"control\""
        )))
    }

    /// The uid of a local caller, whom ptrace's rule judges; refused for
    /// any other.
    fn local_uid(&self, scope: Scope) -> Result<u32, Refusal> {
        match &self.who {
            Who::Local { uid } => Ok(*uid),
            Who::Unknown { addr } => Err(Refusal(format!(
                "who sent this request from {} is unknown (the kernel lists no socket for \
                 it), so it may not {}",
                addr.map_or_else(|| "an unknown address".into(), |a| a.to_string()),
                scope.describe()
            ))),
            Who::Certified { subject, .. } => Err(Refusal(match &self.granted {
                Granted::Revoked(name) => {
                    format!("{subject} is revoked: --policy lists {name:?} in revoked_subjects")
                }
                _ => format!(
                    "{subject} is granted no \"{}\" by --policy: add one of its names to a \
                     grant's subjects",
                    scope.name()
                ),
            })),
            Who::Remote { .. } => unreachable!("peers --insecure-listen let in get everything"),
        }
    }

    fn not_theirs(&self, scope: Scope, uid: u32, pid: u32) -> Refusal {
        let owner = procfs::real_uid(pid).map_or_else(|| "?".into(), |u| u.to_string());
        Refusal(format!(
            "uid {uid} may {} only processes it could trace itself (its own uid, dumpable, \
             not set-id); pid {pid} runs as uid {owner}",
            scope.describe()
        ))
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.who {
            Who::Local { uid } => write!(f, "uid {uid}"),
            Who::Certified { subject, addr } => write!(f, "{subject} at {addr}"),
            Who::Remote { addr } => write!(f, "{addr}"),
            Who::Unknown { addr: Some(addr) } => write!(f, "an unknown caller at {addr}"),
            Who::Unknown { addr: None } => f.write_str("an unknown caller"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(pid: u32) -> TargetProcess {
        TargetProcess::open(pid).expect("a live process")
    }

    fn judged(who: Who) -> Caller {
        Authority::default().judge(who)
    }

    /// Without a policy: root, certificates and peers --insecure-listen
    /// let in get everything; a user only its own processes, never
    /// control; an unknown caller nothing.
    #[test]
    fn who_may_do_what() {
        let ours = std::process::id();
        // SAFETY: no arguments.
        let uid = unsafe { libc::getuid() };
        let targets = [target(ours), target(1)];
        let root = judged(Who::Local { uid: 0 });
        assert_eq!(root.allowed_pids(Scope::Capture, &targets, None), Ok(None));
        assert_eq!(root.may_control(), Ok(()));
        let addr: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let remote = judged(Who::Remote { addr });
        assert_eq!(remote.may_read_all(&targets), Ok(()));
        let certified = judged(Who::Certified {
            subject: Arc::new(CertSubject {
                common_name: Some("ops".into()),
                alt_names: vec![],
            }),
            addr,
        });
        assert_eq!(certified.may_control(), Ok(()));

        let nobody = judged(Who::Local { uid: 65534 });
        let refused = nobody
            .allowed_pids(Scope::Capture, &targets, None)
            .unwrap_err();
        assert!(
            refused.to_string().contains("none of the watched"),
            "{refused}"
        );
        assert!(nobody.may_control().is_err());
        let refused = nobody.may_read_all(&targets).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains(&format!("pid {ours} runs as uid {uid}")),
            "{refused}"
        );

        if uid != 0 {
            let me = judged(Who::Local { uid });
            let allowed = me.allowed_pids(Scope::Capture, &targets, None).unwrap();
            assert_eq!(allowed, Some(BTreeSet::from([ours])));
            let asked = BTreeSet::from([1]);
            assert!(
                me.allowed_pids(Scope::Capture, &targets, Some(&asked))
                    .is_err()
            );
        }
        let unknown = judged(Who::Unknown { addr: None });
        assert!(unknown.may_read_all(&[]).is_err());
    }

    /// With a policy, a certificate gets what it grants, a revoked one
    /// nothing, and a user its grants on top of ptrace's rule.
    #[test]
    fn a_policy_grants_and_revokes() {
        let dir = std::env::temp_dir().join(format!("ebtrace-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("policy.toml");
        std::fs::write(
            &path,
            "revoked_subjects = [\"gone\"]\n[[grant]]\nsubjects = [\"prom\"]\nuids = [65534]\n\
             scopes = [\"read\"]\n",
        )
        .unwrap();
        let authority = Authority::new(Some(path)).unwrap();
        let targets = [target(1)];
        let cert = |name: &str| Who::Certified {
            subject: Arc::new(CertSubject {
                common_name: Some(name.into()),
                alt_names: vec![],
            }),
            addr: "10.0.0.1:5000".parse().unwrap(),
        };
        let prom = authority.judge(cert("prom"));
        assert_eq!(prom.may_read_all(&targets), Ok(()));
        let refused = prom.may_control().unwrap_err().to_string();
        assert!(refused.contains("granted no \"control\""), "{refused}");
        let gone = authority.judge(cert("gone")).may_read_all(&targets);
        assert!(gone.unwrap_err().to_string().contains("revoked"));
        let stranger = authority.judge(cert("stranger"));
        assert!(
            stranger
                .allowed_pids(Scope::Capture, &targets, None)
                .is_err()
        );
        let nobody = authority.judge(Who::Local { uid: 65534 });
        assert_eq!(nobody.may_read_all(&targets), Ok(()));
        assert!(nobody.may_control().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
