//! Server-side saving, confined to the directory the operator allowed
//! (`--allow-write-under DIR`).
//!
//! The path comes from the network (`repository_root`, `session_id`,
//! `host_name`) and ebtrace runs as root, so two checks stand between a
//! request and the disk. [`WriteGuard::resolve`] judges the text alone, on
//! the request's own task, touching no file system (a lookup on a hung
//! mount would hold the server's runtime): a relative path, a `..`, an odd
//! component or a path not below the allowed directory is refused before
//! anything is captured. [`WriteGuard::write`], on the delivery's own
//! thread, follows the path's symlinks, refuses one leading out of the
//! allowed directory, and walks what is left from a descriptor of that
//! directory ([`HeldDir`]), so a symlink swapped in between cannot lead out
//! of it either. New directories and the file take the owner of the
//! directory they are created in, so a client running as that user can
//! still write beside them (TSL's clients save the same file themselves).

use std::{
    ffi::OsString,
    fmt, fs, io,
    path::{Component, Path, PathBuf},
};

use crate::sink::{held_dir::HeldDir, logdir::xplane_file_name};

/// The directory the server may write under, held open.
#[derive(Debug)]
pub struct WriteGuard {
    /// The allowed directory, canonical.
    root: PathBuf,
    /// The allowed directory as the operator named it, made absolute:
    /// clients name it so too when it lies behind a symlink.
    named: PathBuf,
    dir: HeldDir,
}

/// A checked place to save one XSpace: components below the allowed
/// directory, as the request named them, and a file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destination {
    below_root: Vec<OsString>,
    file_name: String,
}

/// Why a path was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused(String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A single plain path component: not empty, not `.` or `..`, no `/`, no NUL.
fn plain_component(what: &str, value: &str) -> Result<(), Refused> {
    if value.is_empty() || value == "." || value == ".." || value.contains(['/', '\0']) {
        return Err(Refused(format!(
            "{what} {value:?} is not a plain file name"
        )));
    }
    Ok(())
}

impl WriteGuard {
    /// Opens `dir` (which must exist and be a directory).
    pub fn open(dir: &Path) -> io::Result<Self> {
        let root = fs::canonicalize(dir)?;
        if !root.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                "not a directory",
            ));
        }
        let named = std::path::absolute(dir)?.components().collect();
        let dir = HeldDir::open(&root)?;
        Ok(WriteGuard { root, named, dir })
    }

    /// The allowed directory, canonical.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where `<repository_root>/<session_id>/<host ':'→'_'>.xplane.pb`
    /// goes, if its text stays inside the allowed directory. Touches no
    /// file system: where its symlinks lead is [`WriteGuard::write`]'s
    /// question.
    pub fn resolve(
        &self,
        repository_root: &str,
        session_id: &str,
        host: &str,
    ) -> Result<Destination, Refused> {
        plain_component("session_id", session_id)?;
        let file_name = xplane_file_name(host);
        plain_component("host name", &file_name)?;
        let outside = || {
            Refused(format!(
                "repository_root {repository_root:?} is outside {} (the directory this server may \
                 write under, --allow-write-under)",
                self.root.display()
            ))
        };
        let requested = Path::new(repository_root);
        if !requested.is_absolute() || repository_root.contains('\0') {
            return Err(Refused(format!(
                "repository_root {repository_root:?} is not an absolute path"
            )));
        }
        if requested
            .components()
            .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(outside());
        }
        let below = requested
            .strip_prefix(&self.root)
            .or_else(|_| requested.strip_prefix(&self.named))
            .map_err(|_| outside())?;
        let mut below_root: Vec<OsString> = below
            .components()
            .map(|c| c.as_os_str().to_os_string())
            .collect();
        below_root.push(session_id.into());
        Ok(Destination {
            below_root,
            file_name,
        })
    }

    /// The path `destination` names (for messages).
    pub fn path_of(&self, destination: &Destination) -> PathBuf {
        self.path_below(&destination.below_root, &destination.file_name)
    }

    /// Saves `bytes` at `destination`, atomically (temporary file, then
    /// rename), never leaving the allowed directory; the path it was
    /// saved at, its symlinks followed.
    pub fn write(&self, destination: &Destination, bytes: &[u8]) -> io::Result<PathBuf> {
        let below_root = self.followed(&destination.below_root)?;
        let dir = self
            .dir
            .subdirs(below_root.iter().map(OsString::as_os_str))?;
        dir.write_file(destination.file_name.as_ref(), |f| {
            io::Write::write_all(f, bytes)
        })?;
        Ok(self.path_below(&below_root, &destination.file_name))
    }

    /// The path of `file_name` in the directory `below_root` names below
    /// the allowed one.
    fn path_below(&self, below_root: &[OsString], file_name: &str) -> PathBuf {
        let mut path = self.root.clone();
        path.extend(below_root);
        path.join(file_name)
    }

    /// The components below the allowed directory that `below_root` leads
    /// to: the longest prefix that exists decides (symlinks included); the
    /// rest is created below it.
    fn followed(&self, below_root: &[OsString]) -> io::Result<Vec<OsString>> {
        let (mut existing, mut missing) = (self.root.clone(), Vec::new());
        existing.extend(below_root);
        let canonical = loop {
            match fs::canonicalize(&existing) {
                Ok(c) => break c,
                Err(_) if existing != self.root => {
                    missing.extend(existing.file_name().map(ToOwned::to_owned));
                    existing.pop();
                }
                Err(e) => return Err(e),
            }
        };
        let inside = canonical.strip_prefix(&self.root).map_err(|_| {
            io::Error::other(format!(
                "{} is a link leading out of {}",
                existing.display(),
                self.root.display()
            ))
        })?;
        let mut followed: Vec<OsString> = inside
            .components()
            .map(|c| c.as_os_str().to_os_string())
            .collect();
        followed.extend(missing.into_iter().rev());
        Ok(followed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let p =
                std::env::temp_dir().join(format!("ebtrace-guard-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(p.join("allowed")).unwrap();
            fs::create_dir_all(p.join("outside")).unwrap();
            Scratch(fs::canonicalize(p).unwrap())
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn files_under(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn writes_inside_and_names_like_tsl() {
        let s = Scratch::new("ok");
        let guard = WriteGuard::open(&s.0.join("allowed")).unwrap();
        let root = s.0.join("allowed/logs/plugins/profile");
        let dest = guard
            .resolve(
                root.to_str().unwrap(),
                "2026_11_22_01_02_03",
                "127.0.0.1:6009",
            )
            .unwrap();
        let path = guard.write(&dest, b"xspace").unwrap();
        assert_eq!(
            path,
            root.join("2026_11_22_01_02_03/127.0.0.1_6009.xplane.pb")
        );
        assert_eq!(fs::read(&path).unwrap(), b"xspace");
        assert!(files_under(&s.0.join("outside")).is_empty());
        // No temporary file is left behind.
        assert_eq!(files_under(&s.0.join("allowed")), vec![path]);
    }

    #[test]
    fn escapes_are_refused() {
        let s = Scratch::new("escape");
        let allowed = s.0.join("allowed");
        let guard = WriteGuard::open(&allowed).unwrap();
        let a = allowed.to_str().unwrap();
        let attempts = [
            (format!("{a}/../outside"), "run", "h"),
            (
                s.0.join("outside").to_string_lossy().into_owned(),
                "run",
                "h",
            ),
            (format!("{a}-sibling/logs"), "run", "h"),
            ("/".to_string(), "run", "h"),
            ("relative/path".to_string(), "run", "h"),
            (format!("{a}/logs"), "..", "h"),
            (format!("{a}/logs"), "a/b", "h"),
            (format!("{a}/logs"), "", "h"),
            (format!("{a}/logs"), "run", "../../etc/passwd"),
            (format!("{a}/logs"), "run", "x/y"),
        ];
        for (root, session, host) in &attempts {
            let r = guard.resolve(root, session, host);
            assert!(r.is_err(), "{root} {session} {host} was allowed: {r:?}");
        }
        assert!(files_under(&s.0.join("outside")).is_empty());
    }

    #[test]
    fn a_link_leading_out_is_refused_when_written() {
        let s = Scratch::new("link-out");
        let allowed = s.0.join("allowed");
        let guard = WriteGuard::open(&allowed).unwrap();
        std::os::unix::fs::symlink(s.0.join("outside"), allowed.join("link-out")).unwrap();
        for root in ["link-out/plugins/profile", "link-out"] {
            let dest = guard
                .resolve(allowed.join(root).to_str().unwrap(), "run", "h")
                .unwrap();
            let err = guard.write(&dest, b"x").unwrap_err();
            assert!(
                err.to_string().contains("link leading out"),
                "{root}: {err}"
            );
        }
        assert!(files_under(&s.0.join("outside")).is_empty());
    }

    #[test]
    fn resolving_judges_the_text_alone() {
        let s = Scratch::new("text");
        let allowed = s.0.join("allowed");
        let guard = WriteGuard::open(&allowed).unwrap();
        // Gone from where it was named: resolve never looks.
        fs::rename(&allowed, s.0.join("moved")).unwrap();
        let dest = guard.resolve(allowed.join("logs").to_str().unwrap(), "run", "h");
        assert!(dest.is_ok(), "{dest:?}");
    }

    #[test]
    fn the_directory_as_the_operator_named_it_is_inside() {
        let s = Scratch::new("named");
        let alias = s.0.join("alias");
        std::os::unix::fs::symlink(s.0.join("allowed"), &alias).unwrap();
        let guard = WriteGuard::open(&alias).unwrap();
        let dest = guard
            .resolve(alias.join("logs").to_str().unwrap(), "run", "h")
            .unwrap();
        let path = guard.write(&dest, b"x").unwrap();
        assert_eq!(path, s.0.join("allowed/logs/run/h.xplane.pb"));
    }

    #[test]
    fn a_symlink_swapped_in_after_the_check_is_not_followed_out() {
        let s = Scratch::new("race");
        let allowed = s.0.join("allowed");
        let guard = WriteGuard::open(&allowed).unwrap();
        let dest = guard
            .resolve(allowed.join("logs").to_str().unwrap(), "run", "h")
            .unwrap();
        // Between check and write, `logs` becomes a link to the outside.
        std::os::unix::fs::symlink(s.0.join("outside"), allowed.join("logs")).unwrap();
        let err = guard.write(&dest, b"x").unwrap_err();
        assert!(err.to_string().contains("link leading out"), "{err}");
        assert!(files_under(&s.0.join("outside")).is_empty());
    }

    #[test]
    fn a_symlink_that_stays_inside_is_fine() {
        let s = Scratch::new("inside");
        let allowed = s.0.join("allowed");
        fs::create_dir_all(allowed.join("real")).unwrap();
        std::os::unix::fs::symlink(allowed.join("real"), allowed.join("alias")).unwrap();
        let guard = WriteGuard::open(&allowed).unwrap();
        let dest = guard
            .resolve(allowed.join("alias/p").to_str().unwrap(), "run", "h:1")
            .unwrap();
        let path = guard.write(&dest, b"x").unwrap();
        assert_eq!(path, allowed.join("real/p/run/h_1.xplane.pb"));
        assert!(path.exists());
    }
}
