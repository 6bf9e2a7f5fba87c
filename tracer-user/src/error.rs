//! The errors ebtrace reports to its user, each naming what failed and,
//! where there is one, what to do about it.

use std::path::PathBuf;

/// Exit code for errors the user can act on (bad arguments, privileges,
/// missing kernel features): the same code clap uses for usage errors.
pub const EXIT_USAGE: i32 = 2;
/// Exit code for failures during a capture.
pub const EXIT_FAILURE: i32 = 1;

/// An error ebtrace reports to its user.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A target process does not exist.
    #[error("no process with pid {pid} (is it still running? check with `ps -p {pid}`)")]
    NoSuchProcess {
        /// The pid asked for.
        pid: u32,
    },

    /// A target process has exited and was not reaped.
    #[error("pid {pid} is a zombie (it has exited and waits to be reaped); nothing to trace")]
    ZombieProcess {
        /// The pid asked for.
        pid: u32,
    },

    /// ebtrace lacks the capabilities to load eBPF programs.
    #[error(
        "not permitted to load eBPF programs: ebtrace needs root, or CAP_BPF and CAP_PERFMON \
         (missing: {missing}); run it with sudo"
    )]
    NotPrivileged {
        /// The capabilities missing, comma-separated.
        missing: String,
    },

    /// A kernel tracepoint ebtrace needs is not in tracefs.
    #[error(
        "kernel tracepoint {category}:{name} not found under {tracefs} (needs a kernel with \
         CONFIG_TRACEPOINTS and tracefs mounted: `mount -t tracefs nodev /sys/kernel/tracing`)"
    )]
    MissingTracepoint {
        /// The tracepoint's category (`sched`, ...).
        category: String,
        /// The tracepoint's name.
        name: String,
        /// Where tracefs was looked in.
        tracefs: PathBuf,
    },

    /// A tracepoint's record format differs from what the eBPF programs read.
    #[error(
        "kernel tracepoint {category}:{name} has an unsupported layout: field `{field}` {found} \
         (expected offset {expected}); please report this kernel version"
    )]
    TracepointLayout {
        /// The tracepoint's category.
        category: String,
        /// The tracepoint's name.
        name: String,
        /// The field out of place.
        field: String,
        /// Where it is instead (`is at offset N`, or `is missing`).
        found: String,
        /// The byte offset the programs read it at.
        expected: usize,
    },

    /// tracefs is not mounted, and ebtrace could not mount it.
    #[error(
        "tracefs is not mounted and mounting it at {path} failed: {source} (mount it first: \
         `mount -t tracefs nodev /sys/kernel/tracing`; in a container, mount the host's \
         /sys/kernel/tracing, as deploy/ does)"
    )]
    TracefsMount {
        /// Where mounting it was tried.
        path: PathBuf,
        /// The mount's error.
        #[source]
        source: std::io::Error,
    },

    /// The log directory cannot be written.
    #[error("cannot write traces under {path}: {source} (choose another directory with --logdir)")]
    LogdirNotWritable {
        /// The directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },

    /// The trace's disk filled up while it was written: it holds the
    /// planes that fit.
    #[error(
        "the disk filled up while the trace was written ({source}): {path} holds only part of \
         it ({kept}, and the Task Environment; XProf opens it); free space or choose another \
         --logdir, and record again"
    )]
    PartialTrace {
        /// The trace file.
        path: PathBuf,
        /// The planes it holds, in order.
        kept: String,
        /// What the write failed with.
        #[source]
        source: std::io::Error,
    },

    /// The binary has no eBPF object to load.
    #[error(
        "this ebtrace binary was built without its eBPF object (AYA_BUILD_SKIP was set); \
         rebuild it with `cargo build --release`"
    )]
    NoEbpfObject,

    /// Loading the eBPF object failed.
    #[error("loading the eBPF programs failed: {0}")]
    Load(#[source] Box<aya::EbpfError>),

    /// The kernel refused `bpf()` for another reason than missing capabilities.
    #[error(
        "the kernel refused ebtrace's bpf() calls (operation not permitted) although it has \
         CAP_BPF and CAP_PERFMON: {}",
        if *.seccomp {
            "a seccomp filter denies them, as container runtimes' default profiles do without \
             CAP_SYS_ADMIN; run the container with seccomp unconfined \
             (`--security-opt seccomp=unconfined`, or in Kubernetes \
             `seccompProfile: {type: Unconfined}` as deploy/kubernetes/daemonset.yaml sets)"
        } else {
            "a security module (SELinux, AppArmor) or the kernel's lockdown denies them; \
             check `dmesg` and the host's security policy"
        }
    )]
    BpfRefused {
        /// Whether a seccomp filter is in force on this process.
        seccomp: bool,
    },

    /// Loading or attaching one eBPF program failed.
    #[error("attaching {what} failed: {source}")]
    Attach {
        /// The program and what it was attached to.
        what: String,
        /// aya's error.
        #[source]
        source: Box<aya::programs::ProgramError>,
    },

    /// Opening or using an eBPF map failed.
    #[error("eBPF map {name}: {source}")]
    Map {
        /// The map's name.
        name: &'static str,
        /// The error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The server could not listen on its address.
    #[error(
        "cannot listen on {addr}: {source} (is another server using it? choose another address \
         with --bind)"
    )]
    Bind {
        /// The address (an IP address and port, or `unix:PATH`).
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },

    /// A listener on an address other than loopback, where ebtrace cannot
    /// tell who asks, without `--insecure-listen`.
    #[error(
        "{flag} {addr} is not a loopback address, and ebtrace cannot tell who asks there: anyone \
         who reaches it could capture and read every watched process; add --tls-cert, --tls-key \
         and --client-ca to take only clients with a certificate there, or listen on 127.0.0.1 \
         and reach it through a tunnel (ssh -L, kubectl port-forward), or add --insecure-listen \
         to allow it anyway"
    )]
    InsecureListen {
        /// The flag that named it.
        flag: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
    },

    /// The TLS files do not set TLS up: which one, and how.
    #[error("{0}")]
    Tls(String),

    /// `--socket-group` names a group this machine does not have.
    #[error(
        "--socket-group {0}: no such group on this machine; create it (`groupadd --system {0}`) \
         and add the users who may connect, or leave the flag out to let every user connect"
    )]
    NoSuchGroup(String),

    /// The `--policy` file does not load: where, and how.
    #[error("{0}")]
    Policy(String),

    /// A `--allow-write-under` directory could not be opened.
    #[error("--allow-write-under {path}: {source} (it must be an existing directory)")]
    AllowWriteUnder {
        /// The directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },

    /// `--retain-memory` leaves the flight recorder no room: what to do.
    #[error("{0}")]
    RetainMemory(String),

    /// A thread of `ebtrace serve` panicked: the first panic, on one line.
    #[error("stopped after an internal error: {0}")]
    Panicked(String),

    /// Any other I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// [`Error::PartialTrace`]: the file at `path` holds the planes `kept`,
    /// the write having failed with `source`.
    pub fn partial_trace(path: PathBuf, kept: &[String], source: std::io::Error) -> Self {
        let kept = match kept {
            [] => "none of its planes".to_string(),
            kept => kept.join(", "),
        };
        Error::PartialTrace { path, kept, source }
    }

    /// Process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::NoSuchProcess { .. }
            | Error::ZombieProcess { .. }
            | Error::NotPrivileged { .. }
            | Error::MissingTracepoint { .. }
            | Error::TracepointLayout { .. }
            | Error::TracefsMount { .. }
            | Error::LogdirNotWritable { .. }
            | Error::PartialTrace { .. }
            | Error::Bind { .. }
            | Error::InsecureListen { .. }
            | Error::Tls(_)
            | Error::Policy(_)
            | Error::NoSuchGroup(_)
            | Error::AllowWriteUnder { .. }
            | Error::RetainMemory(_)
            | Error::BpfRefused { .. }
            | Error::NoEbpfObject => EXIT_USAGE,
            Error::Load(_)
            | Error::Attach { .. }
            | Error::Map { .. }
            | Error::Panicked(_)
            | Error::Io { .. } => EXIT_FAILURE,
        }
    }

    /// [`Error::Load`] of `source`, or [`Error::BpfRefused`] where the
    /// kernel said EPERM: with the capabilities checked before, that is a
    /// seccomp filter or a security module, not a missing privilege;
    /// `seccomp_filtered` says whether ebtrace runs under a seccomp filter.
    pub(crate) fn load(source: aya::EbpfError, seccomp_filtered: impl FnOnce() -> bool) -> Self {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&source);
        while let Some(e) = cause {
            if e.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::raw_os_error)
                == Some(libc::EPERM)
            {
                return Error::BpfRefused {
                    seccomp: seccomp_filtered(),
                };
            }
            cause = e.source();
        }
        Error::Load(Box::new(source))
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The result of ebtrace's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use aya::{EbpfError, maps::MapError};

    use super::*;

    fn create_error(errno: i32) -> EbpfError {
        EbpfError::MapError(MapError::CreateError {
            name: "EVENTS".into(),
            io_error: std::io::Error::from_raw_os_error(errno),
        })
    }

    /// A refused bpf() says what refuses it and what to do, and exits as a
    /// usage error; other load failures keep aya's own words.
    #[test]
    fn a_refused_bpf_call_names_its_cause() {
        let refused = Error::load(create_error(libc::EPERM), || true);
        assert!(matches!(refused, Error::BpfRefused { .. }), "{refused:?}");
        assert_eq!(refused.exit_code(), EXIT_USAGE);
        let seccomp = Error::BpfRefused { seccomp: true }.to_string();
        assert!(seccomp.contains("seccomp=unconfined"), "{seccomp}");
        let other = Error::BpfRefused { seccomp: false }.to_string();
        assert!(other.contains("security module"), "{other}");
        let failed = Error::load(create_error(libc::EINVAL), || unreachable!());
        assert!(matches!(failed, Error::Load(_)), "{failed:?}");
    }
}
