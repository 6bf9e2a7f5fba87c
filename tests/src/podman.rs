//! podman as the tests run it, and the Debian base image they run
//! containers from.
//!
//! The image's base, `debian:bookworm-slim`, is pulled from a registry on
//! a real node; here it is the same distribution built from Debian's
//! packages (`debootstrap --variant=minbase bookworm`) and imported under
//! that name, once per machine.

use std::process::{Command, Output};

use crate::{TempDir, debian_tool};

/// The base image every test container starts from.
pub const BASE: &str = "debian:bookworm-slim";

/// podman, with what this test machine needs of it: `runc` and cgroupfs
/// (crun refuses a host with both cgroup versions mounted), and limits no
/// higher than the host's (root here lacks CAP_SYS_RESOURCE to raise them).
pub fn podman() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"]);
    cmd
}

pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The base image, made from Debian's packages if this machine has none.
pub fn ensure_base() {
    let exists = podman()
        .args(["image", "exists", BASE])
        .status()
        .is_ok_and(|s| s.success());
    if exists {
        return;
    }
    let root = TempDir::new("container-base");
    let rootfs = root.path().join("rootfs");
    run(Command::new("debootstrap").args([
        "--variant=minbase",
        "bookworm",
        rootfs.to_str().unwrap(),
        "http://deb.debian.org/debian",
    ]));
    let tar = root.path().join("rootfs.tar");
    run(Command::new("tar").args([
        "-C",
        rootfs.to_str().unwrap(),
        "-cf",
        tar.to_str().unwrap(),
        ".",
    ]));
    run(podman().args(["import", tar.to_str().unwrap(), BASE]));
}

/// podman, runc and debootstrap (`cargo xtask setup` installs them).
pub fn tools_present() -> bool {
    ["podman", "runc", "debootstrap"]
        .iter()
        .all(|t| debian_tool(t).is_some())
}

/// `podman run`'s limits for this machine: no higher than the host's
/// (root here lacks CAP_SYS_RESOURCE to raise them).
pub fn host_limits() -> Vec<String> {
    let out = Command::new("sh")
        .args(["-c", "ulimit -Hn"])
        .output()
        .expect("sh");
    let n = String::from_utf8_lossy(&out.stdout).trim().to_string();
    vec![
        "--ulimit".into(),
        format!("nofile={n}:{n}"),
        "--ulimit".into(),
        "nproc=4096:4096".into(),
    ]
}
