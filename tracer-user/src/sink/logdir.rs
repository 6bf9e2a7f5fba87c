//! The TensorBoard/XProf log directory layout:
//! `<logdir>/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>.xplane.pb`.
//!
//! Files are written as [`HeldDir`] writes them: under a temporary name
//! and renamed into place, so a reader (or a crash) never sees half a
//! trace; never through a link planted in a directory someone else owns;
//! readable by that directory's owner alone, who owns them.

use std::{
    ffi::OsStr,
    fs,
    io::{BufWriter, Write as _},
    path::{Path, PathBuf},
};

use super::held_dir::HeldDir;
use crate::error::{Error, Result};

/// Session directory name, as TSL names runs (local time).
pub fn session_name(now: chrono::DateTime<chrono::Local>) -> String {
    now.format("%Y_%m_%d_%H_%M_%S").to_string()
}

/// File name for a host: every ':' becomes '_' (as TSL's `SaveXSpace`).
pub fn xplane_file_name(host: &str) -> String {
    format!("{}.xplane.pb", host.replace(':', "_"))
}

/// Where runs go below a log directory.
const PROFILE_ROOT: [&str; 2] = ["plugins", "profile"];

/// The directory runs go into (`<logdir>/plugins/profile`), created where
/// missing.
fn profile_root(logdir: &Path) -> std::io::Result<HeldDir> {
    HeldDir::create_all(logdir)?.subdirs(PROFILE_ROOT.map(OsStr::new))
}

/// Fails early, before anything is attached, if traces cannot be written.
pub fn check_writable(logdir: &Path) -> Result<()> {
    let not_writable = |source| Error::LogdirNotWritable {
        path: logdir.to_path_buf(),
        source,
    };
    let root = profile_root(logdir).map_err(not_writable)?;
    let probe = OsStr::new(".ebtrace-write-test");
    root.write_file(probe, |f| f.write_all(b"x"))
        .map_err(not_writable)?;
    root.remove_file(probe);
    Ok(())
}

/// Writes `bytes` atomically to `path`, creating parent directories.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"))?;
    HeldDir::create_all(dir)?.write_file(name, |f| f.write_all(bytes))
}

/// Writes a run into `logdir`, the file's bytes written by `write`, and
/// returns the file's path and what `write` returned. A run directory that
/// already holds this host's file (two captures in one second) gets a
/// numeric suffix instead of being overwritten.
pub fn write_run_with<T>(
    logdir: &Path,
    session: &str,
    host: &str,
    write: impl FnOnce(&mut BufWriter<fs::File>) -> std::io::Result<T>,
) -> Result<(PathBuf, T)> {
    let file = xplane_file_name(host);
    let profile_path = PROFILE_ROOT
        .iter()
        .fold(logdir.to_path_buf(), |p, c| p.join(c));
    let writing = |path: &Path, e| Error::io(format!("writing {}", path.display()), e);
    let root = profile_root(logdir).map_err(|e| writing(&profile_path, e))?;
    let mut run_name = session.to_string();
    let mut n = 1;
    let (run, path) = loop {
        let path = profile_path.join(&run_name).join(&file);
        let run = root
            .subdir(OsStr::new(&run_name))
            .map_err(|e| writing(&path, e))?;
        if !run.holds(OsStr::new(&file)) {
            break (run, path);
        }
        n += 1;
        run_name = format!("{session}_{n}");
    };
    let written = run
        .write_file(OsStr::new(&file), write)
        .map_err(|e| writing(&path, e))?;
    Ok((path, written))
}

#[cfg(test)]
mod tests {
    use ebtrace_proto::tensorflow::profiler::XSpace;
    use prost::Message as _;

    use super::*;

    #[test]
    fn names_follow_tsl() {
        assert_eq!(
            xplane_file_name("127.0.0.1:6009"),
            "127.0.0.1_6009.xplane.pb"
        );
        let t = chrono::NaiveDate::from_ymd_opt(2026, 11, 22)
            .unwrap()
            .and_hms_opt(1, 2, 3)
            .unwrap()
            .and_local_timezone(chrono::Local)
            .unwrap();
        assert_eq!(session_name(t), "2026_11_22_01_02_03");
    }

    #[test]
    fn writes_runs_without_clobbering() {
        let dir = std::env::temp_dir().join(format!("ebtrace-logdir-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        check_writable(&dir).unwrap();
        let xs = XSpace {
            hostnames: vec!["h".into()],
            ..Default::default()
        };
        let write = |f: &mut BufWriter<fs::File>| f.write_all(&xs.encode_to_vec());
        let (a, ()) = write_run_with(&dir, "s", "h", write).unwrap();
        let (b, ()) = write_run_with(&dir, "s", "h", write).unwrap();
        assert_ne!(a, b);
        assert!(a.ends_with("plugins/profile/s/h.xplane.pb"));
        assert!(b.ends_with("plugins/profile/s_2/h.xplane.pb"));
        let back = XSpace::decode(fs::read(&a).unwrap().as_slice()).unwrap();
        assert_eq!(back, xs);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_in_the_way_is_reported() {
        let file = std::env::temp_dir().join(format!("ebtrace-not-a-dir-{}", std::process::id()));
        fs::write(&file, b"").unwrap();
        let err = check_writable(&file).unwrap_err();
        assert!(matches!(err, Error::LogdirNotWritable { .. }), "{err}");
        fs::remove_file(&file).unwrap();
    }

    /// A link planted where the temporary file of the old, predictable
    /// name went (`.NAME.tmp-PID`), and one at the final name: neither is
    /// written through.
    #[test]
    fn planted_links_are_never_written_through() {
        let dir = std::env::temp_dir().join(format!("ebtrace-planted-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        fs::write(&victim, "precious").unwrap();
        let path = dir.join("host.xplane.pb");
        let old_tmp = dir.join(format!(".host.xplane.pb.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &old_tmp).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write_atomically(&path, b"trace").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert_eq!(fs::read(&path).unwrap(), b"trace");
        assert!(
            !fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
