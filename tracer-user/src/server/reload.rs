//! Files `serve` reads again when they change on disk (its certificates,
//! the policy), so that replacing one takes effect for the next connection
//! or request with no restart. A file that no longer loads (half written,
//! or wrong) is reported once and the last good contents stay in use.

use std::{
    io::Read as _,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

/// The most a file `serve` reloads may hold: these are certificates and
/// small policies, never megabytes.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// What the files looked like on disk: any change to one (replaced,
/// rewritten, a Kubernetes Secret's link switched) changes it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp(Vec<Option<(SystemTime, u64, u64)>>);

impl Stamp {
    fn of(paths: &[PathBuf]) -> Self {
        Stamp(
            paths
                .iter()
                .map(|p| {
                    std::fs::metadata(p).ok().map(|m| {
                        (
                            m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                            m.len(),
                            m.ino(),
                        )
                    })
                })
                .collect(),
        )
    }
}

/// How the files become a `T`.
type Load<T> = Box<dyn Fn(&[PathBuf]) -> Result<T, String> + Send + Sync>;

/// A `T` loaded from files, loaded again when they change.
pub struct Reloading<T> {
    paths: Vec<PathBuf>,
    load: Load<T>,
    state: Mutex<Loaded<T>>,
}

struct Loaded<T> {
    stamp: Stamp,
    value: Arc<T>,
    /// The files as they were when they last failed to load: not tried
    /// again until they change.
    failed: Option<Stamp>,
}

impl<T> Reloading<T> {
    /// Loads `paths` with `load`; they must load now.
    pub fn open(
        paths: Vec<PathBuf>,
        load: impl Fn(&[PathBuf]) -> Result<T, String> + Send + Sync + 'static,
    ) -> Result<Self, String> {
        let stamp = Stamp::of(&paths);
        let value = Arc::new(load(&paths)?);
        Ok(Reloading {
            paths,
            load: Box::new(load),
            state: Mutex::new(Loaded {
                stamp,
                value,
                failed: None,
            }),
        })
    }

    /// The value from the files as they are now, or, where they do not
    /// load, the last that did.
    pub fn current(&self) -> Arc<T> {
        let stamp = Stamp::of(&self.paths);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if stamp == state.stamp || state.failed.as_ref() == Some(&stamp) {
            return Arc::clone(&state.value);
        }
        match (self.load)(&self.paths) {
            Ok(value) => {
                eprintln!("ebtrace: {} changed: loaded again", self.names());
                state.value = Arc::new(value);
                state.stamp = stamp;
                state.failed = None;
            }
            Err(why) => {
                eprintln!(
                    "ebtrace: warning: {why}; still using what was loaded from {} before",
                    self.names()
                );
                state.failed = Some(stamp);
            }
        }
        Arc::clone(&state.value)
    }

    fn names(&self) -> String {
        let names: Vec<String> = self.paths.iter().map(|p| p.display().to_string()).collect();
        names.join(", ")
    }
}

/// The bytes of `path`, at most [`MAX_FILE_BYTES`]; the error names the
/// file.
pub fn read_small(path: &Path) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err(format!("{}: not a regular file", path.display()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "{}: larger than {} KiB, which no certificate or policy is",
            path.display(),
            MAX_FILE_BYTES / 1024
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A changed file is loaded again; one that stops loading leaves the
    /// last good value in use until it changes again.
    #[test]
    fn changed_files_are_loaded_again_and_broken_ones_keep_the_last_good() {
        let dir = std::env::temp_dir().join(format!("ebtrace-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("n");
        std::fs::write(&path, "1").unwrap();
        let parse = |paths: &[PathBuf]| -> Result<u32, String> {
            let text = String::from_utf8(read_small(&paths[0])?).map_err(|e| e.to_string())?;
            text.trim().parse().map_err(|e| format!("{e}"))
        };
        let reloading = Reloading::open(vec![path.clone()], parse).unwrap();
        assert_eq!(*reloading.current(), 1);
        // A new inode, as a rename into place or a Secret update makes.
        std::fs::write(dir.join("n.new"), "22").unwrap();
        std::fs::rename(dir.join("n.new"), &path).unwrap();
        assert_eq!(*reloading.current(), 22);
        std::fs::write(dir.join("n.new"), "not a number").unwrap();
        std::fs::rename(dir.join("n.new"), &path).unwrap();
        assert_eq!(*reloading.current(), 22);
        std::fs::write(dir.join("n.new"), "333").unwrap();
        std::fs::rename(dir.join("n.new"), &path).unwrap();
        assert_eq!(*reloading.current(), 333);
        assert!(Reloading::open(vec![dir.join("absent")], parse).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
