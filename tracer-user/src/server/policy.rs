//! `serve --policy FILE`: who gets more than ptrace's rule gives them. A
//! TOML file of grants, read again when it changes:
//!
//! ```toml
//! # Prometheus, by its client certificate, reads metrics and snapshots.
//! [[grant]]
//! subjects = ["prometheus.monitoring.svc"]
//! scopes = ["read"]
//!
//! # The ML platform team captures and controls, from any host or locally.
//! [[grant]]
//! groups = ["ebtrace"]
//! subjects = ["spiffe://cluster.local/ns/ml/sa/platform"]
//! scopes = ["read", "capture", "control"]
//!
//! # Certificates no longer trusted, by any name they carry.
//! revoked_subjects = ["laptop-of-someone-who-left"]
//! ```
//!
//! A grant gives its scopes over every watched process to the local users
//! it lists by uid or group, and to callers whose client certificate names
//! one of its subjects (the CN or a subject alternative name). With a
//! policy, a certificate gets only what the policy grants it; without
//! one, any certificate the client CA signed gets everything.

use std::{collections::BTreeSet, path::PathBuf};

use serde::Deserialize;

use super::{
    caller::Scope,
    reload::{Reloading, read_small},
    tls::CertSubject,
};
use crate::procfs;

/// A policy, as loaded.
#[derive(Debug, Default)]
pub struct Policy {
    grants: Vec<Grant>,
    revoked: BTreeSet<String>,
}

#[derive(Debug)]
struct Grant {
    uids: BTreeSet<u32>,
    gids: BTreeSet<u32>,
    subjects: BTreeSet<String>,
    scopes: BTreeSet<Scope>,
}

/// The file, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    grant: Vec<GrantEntry>,
    #[serde(default)]
    revoked_subjects: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantEntry {
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    groups: Vec<String>,
    #[serde(default)]
    subjects: Vec<String>,
    scopes: Vec<Scope>,
}

/// What a certificate's names get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CertificateGrant {
    /// These scopes (perhaps none).
    Scopes(BTreeSet<Scope>),
    /// Nothing: the policy revokes this name.
    Revoked(String),
}

impl Policy {
    /// Parses a policy; the error says what is wrong and where.
    pub fn parse(text: &str, origin: &str) -> Result<Self, String> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| {
            format!(
                "--policy {origin}: {}",
                e.to_string().replace('\n', " ").trim()
            )
        })?;
        let mut grants = Vec::new();
        for (n, entry) in file.grant.into_iter().enumerate() {
            let mut gids = BTreeSet::new();
            for group in &entry.groups {
                gids.insert(procfs::group_id(group).ok_or_else(|| {
                    format!(
                        "--policy {origin}: grant {}: no group {group:?} on this machine (see \
                         `getent group {group}`)",
                        n + 1
                    )
                })?);
            }
            if entry.uids.is_empty() && gids.is_empty() && entry.subjects.is_empty() {
                return Err(format!(
                    "--policy {origin}: grant {} names no one: give uids, groups or subjects",
                    n + 1
                ));
            }
            grants.push(Grant {
                uids: entry.uids.into_iter().collect(),
                gids,
                subjects: entry.subjects.into_iter().collect(),
                scopes: entry.scopes.into_iter().collect(),
            });
        }
        Ok(Policy {
            grants,
            revoked: file.revoked_subjects.into_iter().collect(),
        })
    }

    /// The policy at `path`, read again whenever it changes.
    pub fn watch(path: PathBuf) -> Result<Reloading<Policy>, String> {
        let shown = path.display().to_string();
        Reloading::open(vec![path], move |paths| {
            let bytes = read_small(&paths[0]).map_err(|e| format!("--policy {e}"))?;
            let text = String::from_utf8(bytes)
                .map_err(|_| format!("--policy {shown}: not UTF-8 text"))?;
            Policy::parse(&text, &shown)
        })
    }

    /// The scopes granted to local user `uid`, by uid or by group.
    pub fn for_uid(&self, uid: u32) -> BTreeSet<Scope> {
        let mut groups: Option<Vec<u32>> = None;
        let mut scopes = BTreeSet::new();
        for grant in &self.grants {
            let mut by_group = || {
                let groups = groups.get_or_insert_with(|| procfs::groups_of(uid));
                groups.iter().any(|g| grant.gids.contains(g))
            };
            if grant.uids.contains(&uid) || (!grant.gids.is_empty() && by_group()) {
                scopes.extend(&grant.scopes);
            }
        }
        scopes
    }

    /// What a client certificate naming `subject` is granted.
    pub fn for_certificate(&self, subject: &CertSubject) -> CertificateGrant {
        if let Some(name) = subject.names().find(|n| self.revoked.contains(*n)) {
            return CertificateGrant::Revoked(name.to_string());
        }
        let scopes = self
            .grants
            .iter()
            .filter(|g| subject.names().any(|n| g.subjects.contains(n)))
            .flat_map(|g| g.scopes.iter().copied())
            .collect();
        CertificateGrant::Scopes(scopes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subject(cn: &str, alt: &[&str]) -> CertSubject {
        CertSubject {
            common_name: Some(cn.into()),
            alt_names: alt.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn grants_go_to_the_uids_groups_and_subjects_they_name() {
        let policy = Policy::parse(
            r#"
            revoked_subjects = ["old"]
            [[grant]]
            subjects = ["prometheus"]
            scopes = ["read"]
            [[grant]]
            uids = [1234]
            groups = ["root"]
            subjects = ["spiffe://x/ops"]
            scopes = ["capture", "control"]
            "#,
            "test.toml",
        )
        .unwrap();
        let read = BTreeSet::from([Scope::Read]);
        let capture_control = BTreeSet::from([Scope::Capture, Scope::Control]);
        assert_eq!(
            policy.for_certificate(&subject("prometheus", &[])),
            CertificateGrant::Scopes(read)
        );
        assert_eq!(
            policy.for_certificate(&subject("ops", &["spiffe://x/ops"])),
            CertificateGrant::Scopes(capture_control.clone())
        );
        assert_eq!(
            policy.for_certificate(&subject("someone", &["old"])),
            CertificateGrant::Revoked("old".into())
        );
        assert_eq!(
            policy.for_certificate(&subject("stranger", &[])),
            CertificateGrant::Scopes(BTreeSet::new())
        );
        assert_eq!(policy.for_uid(1234), capture_control);
        // Root is in group root.
        assert_eq!(policy.for_uid(0), capture_control);
        assert!(policy.for_uid(4_000_000_000).is_empty());
    }

    #[test]
    fn a_wrong_policy_says_what_is_wrong() {
        let cases = [
            (
                "[[grant]]\nuids = [1]\nscopes = [\"everything\"]",
                "unknown variant",
            ),
            ("[[grant]]\nscopes = [\"read\"]", "names no one"),
            (
                "[[grant]]\ngroups = [\"no such group\"]\nscopes = [\"read\"]",
                "no group",
            ),
            ("[[grants]]\nuids = [1]", "unknown field"),
        ];
        for (text, expected) in cases {
            let err = Policy::parse(text, "p.toml").unwrap_err();
            assert!(err.starts_with("--policy p.toml: "), "{err}");
            assert!(err.contains(expected), "{text}: {err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }
}
