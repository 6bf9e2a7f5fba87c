//! What `deploy/` ships, read as the tests need it: the files themselves,
//! and the settings of the Kubernetes DaemonSet's container.

use std::{collections::BTreeSet, path::PathBuf};

/// The contents of `deploy/PATH`.
pub fn deploy_file(path: &str) -> String {
    let file = deploy_path(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// Where `deploy/PATH` is.
pub fn deploy_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join(path)
}

/// The items of the YAML list under the DaemonSet's first `KEY:` line
/// (`add:` gives the capabilities it adds, `args:` the server's arguments).
pub fn daemonset_list(key: &str) -> Vec<String> {
    let yaml = deploy_file("kubernetes/daemonset.yaml");
    yaml.lines()
        .skip_while(|l| l.trim() != key)
        .skip(1)
        .map_while(|l| l.trim().strip_prefix("- "))
        .map(|item| item.trim().trim_matches('"').to_string())
        .collect()
}

/// The capabilities the DaemonSet adds (`SYS_PTRACE`, ...).
pub fn daemonset_capabilities() -> BTreeSet<String> {
    daemonset_list("add:").into_iter().collect()
}

/// The `type:` of the DaemonSet's `seccompProfile`, if it sets one.
pub fn daemonset_seccomp() -> Option<String> {
    let yaml = deploy_file("kubernetes/daemonset.yaml");
    let mut lines = yaml.lines().skip_while(|l| l.trim() != "seccompProfile:");
    lines.next()?;
    lines
        .next()?
        .trim()
        .strip_prefix("type:")
        .map(|t| t.trim().to_string())
}
