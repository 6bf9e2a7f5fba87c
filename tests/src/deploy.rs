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

/// The DaemonSet's host directories and where its container mounts each:
/// `(host path, container path, read-only)`.
pub fn daemonset_host_mounts() -> Vec<(String, String, bool)> {
    let yaml = deploy_file("kubernetes/daemonset.yaml");
    let lines: Vec<&str> = yaml.lines().map(str::trim).collect();
    // `- name: N` then `mountPath: P` (and `readOnly: true`) under
    // volumeMounts; `- name: N`, `hostPath:`, `path: H` under volumes.
    let field = |from: usize, key: &str| {
        lines[from + 1..]
            .iter()
            .take_while(|l| !l.starts_with("- "))
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().to_string())
    };
    let mut mounts = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.strip_prefix("- name: ") else {
            continue;
        };
        let Some(container) = field(i, "mountPath:") else {
            continue;
        };
        let read_only = field(i, "readOnly:").as_deref() == Some("true");
        let host = lines.iter().enumerate().find_map(|(j, l)| {
            (l.strip_prefix("- name: ") == Some(name) && field(j, "hostPath:").is_some())
                .then(|| field(j + 1, "path:"))
                .flatten()
        });
        if let Some(host) = host {
            mounts.push((host, container, read_only));
        }
    }
    mounts
}
