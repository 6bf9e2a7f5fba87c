//! Who is asking, and what they may do. Every request is tied to the
//! identity of the connection it came on before it is served:
//!
//! - a loopback peer is the user owning its socket, as the kernel's socket
//!   table says ([`crate::procfs::tcp_socket_owner`]), and a Unix socket's
//!   peer the user the kernel gives with it (`SO_PEERCRED`); a user other than
//!   root may capture and read only the processes it could trace itself
//!   (ptrace's rule: its own uid, dumpable, not set-id), and change
//!   nothing of the server (the flight recorder, others' captures);
//! - a peer on another machine reached a listener the operator put on a
//!   non-loopback address, which `serve` warns about at start.

use std::{collections::BTreeSet, fmt, net::SocketAddr};

use tonic::{
    Request,
    transport::server::{TcpConnectInfo, UdsConnectInfo},
};

use crate::{
    metrics::Metrics,
    procfs::{self, TargetProcess},
};

/// Who sent a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A process of this machine, by the user owning its socket.
    Local {
        /// The socket owner's uid.
        uid: u32,
    },
    /// A peer on another machine.
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

/// Why a request was refused: one line naming the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal(String);

impl Refusal {
    /// Counts the refusal of `what` to `caller` (on `/metrics`) and logs it,
    /// as both listeners do.
    pub fn count(&self, metrics: &Metrics, caller: Caller, what: &str) {
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

impl Caller {
    /// The caller at the far end of a connection from `remote` to this
    /// server's `local` address.
    pub fn of_connection(local: Option<SocketAddr>, remote: Option<SocketAddr>) -> Self {
        let (Some(local), Some(remote)) = (local, remote) else {
            return Caller::Unknown { addr: remote };
        };
        if !remote.ip().to_canonical().is_loopback() {
            return Caller::Remote { addr: remote };
        }
        match procfs::tcp_socket_owner(remote, local) {
            Ok(Some(uid)) => Caller::Local { uid },
            Ok(None) => Caller::Unknown { addr: Some(remote) },
            Err(e) => {
                log::warn!("the owner of the connection from {remote} is unknown: {e}");
                Caller::Unknown { addr: Some(remote) }
            }
        }
    }

    /// The caller of a gRPC request.
    pub fn of<T>(request: &Request<T>) -> Self {
        if let Some(unix) = request.extensions().get::<UdsConnectInfo>() {
            return match unix.peer_cred {
                Some(cred) => Caller::Local { uid: cred.uid() },
                None => Caller::Unknown { addr: None },
            };
        }
        let info = request.extensions().get::<TcpConnectInfo>();
        Caller::of_connection(
            info.and_then(TcpConnectInfo::local_addr),
            info.and_then(TcpConnectInfo::remote_addr),
        )
    }

    /// Whether the caller may do anything to every process and the server.
    fn is_unrestricted(self) -> bool {
        matches!(self, Caller::Local { uid: 0 } | Caller::Remote { .. })
    }

    /// The processes among `targets` the caller may capture or read
    /// (`scope`); `None`: all of them. Refused where it may see none, or
    /// where it named one (`asked`) it may not.
    pub fn allowed_pids(
        self,
        scope: Scope,
        targets: &[TargetProcess],
        asked: Option<&BTreeSet<u32>>,
    ) -> Result<Option<BTreeSet<u32>>, Refusal> {
        if self.is_unrestricted() {
            return Ok(None);
        }
        let uid = self.uid(scope)?;
        if let Some(pid) = asked
            .into_iter()
            .flatten()
            .find(|p| !procfs::traceable_by(**p, uid))
        {
            return Err(self.not_theirs(scope, *pid));
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
    pub fn may_read_all(self, targets: &[TargetProcess]) -> Result<(), Refusal> {
        if self.is_unrestricted() {
            return Ok(());
        }
        let uid = self.uid(Scope::Read)?;
        match targets.iter().find(|t| !procfs::traceable_by(t.pid, uid)) {
            Some(t) => Err(self.not_theirs(Scope::Read, t.pid)),
            None => Ok(()),
        }
    }

    /// Refused unless the caller may change the server for everyone.
    pub fn may_control(self) -> Result<(), Refusal> {
        if self.is_unrestricted() {
            return Ok(());
        }
        let uid = self.uid(Scope::Control)?;
        Err(Refusal(format!(
            "uid {uid} may not control the server (the flight recorder, other callers' \
             captures): only root may"
        )))
    }

    /// The uid of a local caller; refused for one unknown.
    fn uid(self, scope: Scope) -> Result<u32, Refusal> {
        match self {
            Caller::Local { uid } => Ok(uid),
            Caller::Unknown { addr } => Err(Refusal(format!(
                "who sent this request from {} is unknown (the kernel lists no socket for \
                 it), so it may not {}",
                addr.map_or_else(|| "an unknown address".into(), |a| a.to_string()),
                scope.describe()
            ))),
            Caller::Remote { .. } => unreachable!("remote callers are unrestricted"),
        }
    }

    fn not_theirs(self, scope: Scope, pid: u32) -> Refusal {
        let uid = match self {
            Caller::Local { uid } => uid,
            _ => u32::MAX,
        };
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
        match self {
            Caller::Local { uid } => write!(f, "uid {uid}"),
            Caller::Remote { addr } => write!(f, "{addr}"),
            Caller::Unknown { addr: Some(addr) } => write!(f, "an unknown caller at {addr}"),
            Caller::Unknown { addr: None } => f.write_str("an unknown caller"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(pid: u32) -> TargetProcess {
        TargetProcess::open(pid).expect("a live process")
    }

    /// Root and remote peers get everything; a user only its own
    /// processes, never control; an unknown caller nothing.
    #[test]
    fn who_may_do_what() {
        let ours = std::process::id();
        // SAFETY: no arguments.
        let uid = unsafe { libc::getuid() };
        let targets = [target(ours), target(1)];
        let root = Caller::Local { uid: 0 };
        assert_eq!(root.allowed_pids(Scope::Capture, &targets, None), Ok(None));
        assert_eq!(root.may_control(), Ok(()));
        let remote = Caller::Remote {
            addr: "10.0.0.1:5000".parse().unwrap(),
        };
        assert_eq!(remote.may_read_all(&targets), Ok(()));

        let nobody = Caller::Local { uid: 65534 };
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
            let me = Caller::Local { uid };
            let allowed = me.allowed_pids(Scope::Capture, &targets, None).unwrap();
            assert_eq!(allowed, Some(BTreeSet::from([ours])));
            let asked = BTreeSet::from([1]);
            assert!(
                me.allowed_pids(Scope::Capture, &targets, Some(&asked))
                    .is_err()
            );
        }
        let unknown = Caller::Unknown { addr: None };
        assert!(unknown.may_read_all(&[]).is_err());
    }
}
