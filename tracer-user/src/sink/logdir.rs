//! The TensorBoard/XProf log directory layout:
//! `<logdir>/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>.xplane.pb`.
//!
//! Files are written to a temporary name and renamed into place, so a
//! reader (or a crash) never sees half a trace. The temporary name is
//! unpredictable and created only if nothing is there (`O_EXCL`, which a
//! symbolic link also fails), so that a link planted in a directory others
//! may write to does not make root write through it; the rename replaces a
//! link at the final name rather than following it.

use std::{
    fs,
    io::{BufWriter, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
};

use crate::error::{Error, Result};

/// Session directory name, as TSL names runs (local time).
pub fn session_name(now: chrono::DateTime<chrono::Local>) -> String {
    now.format("%Y_%m_%d_%H_%M_%S").to_string()
}

/// File name for a host: every ':' becomes '_' (as TSL's `SaveXSpace`).
pub fn xplane_file_name(host: &str) -> String {
    format!("{}.xplane.pb", host.replace(':', "_"))
}

/// Fails early, before anything is attached, if traces cannot be written.
pub fn check_writable(logdir: &Path) -> Result<()> {
    let profile_root = logdir.join("plugins").join("profile");
    let not_writable = |source| Error::LogdirNotWritable {
        path: logdir.to_path_buf(),
        source,
    };
    fs::create_dir_all(&profile_root).map_err(not_writable)?;
    let probe = profile_root.join(format!(".ebtrace-write-test-{}", std::process::id()));
    fs::File::create(&probe)
        .and_then(|mut f| f.write_all(b"x"))
        .map_err(not_writable)?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

/// Writes `bytes` atomically to `path`, creating parent directories.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomically_with(path, |f| f.write_all(bytes))
}

/// Writes to `path` atomically what `write` writes, creating parent
/// directories: `path` appears once everything is written and on disk.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<fs::File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp-{:016x}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("xspace"),
        unpredictable()
    ));
    let created = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)?;
    let result = (|| {
        let mut f = BufWriter::with_capacity(1 << 20, created);
        write(&mut f)?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// 64 bits no one else can guess: std's per-process random hash keys,
/// mixed with the time.
fn unpredictable() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.finish()
}

/// Writes a run into `logdir`, the file's bytes written by `write`, and
/// returns the file's path. A run directory that already holds this host's
/// file (two captures in one second) gets a numeric suffix instead of being
/// overwritten.
pub fn write_run_with(
    logdir: &Path,
    session: &str,
    host: &str,
    write: impl FnOnce(&mut BufWriter<fs::File>) -> std::io::Result<()>,
) -> Result<PathBuf> {
    let profile_root = logdir.join("plugins").join("profile");
    let file = xplane_file_name(host);
    let mut run = profile_root.join(session);
    let mut n = 1;
    while run.join(&file).exists() {
        n += 1;
        run = profile_root.join(format!("{session}_{n}"));
    }
    let path = run.join(file);
    write_atomically_with(&path, write)
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(path)
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
        let a = write_run_with(&dir, "s", "h", write).unwrap();
        let b = write_run_with(&dir, "s", "h", write).unwrap();
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
