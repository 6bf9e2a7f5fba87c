//! Files a traced process names, looked up the way its own loader would
//! see them and never more than that: inside its root directory (held
//! open), absolute symbolic links included (`RESOLVE_IN_ROOT`), through no
//! `/proc` magic link, and opened without blocking or a controlling
//! terminal. Only regular files are read, and no more of one than its
//! caller's cap: a FIFO, a device or a link to one named where a library
//! or a loader cache belongs is refused at once.

use std::{
    fmt,
    fs::File,
    io::{self, Read as _},
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::Arc,
};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

use super::process_dir;

/// A process's root directory, held open.
pub struct TargetRoot {
    dir: OwnedFd,
}

/// A regular file found in a target's root, held open (`O_PATH`) so that
/// [`HeldFile::path`] names exactly it, whatever is renamed or linked in
/// its place meanwhile, for as long as this lives.
#[derive(Clone)]
pub struct HeldFile {
    fd: Arc<OwnedFd>,
}

impl HeldFile {
    /// A path that opens this very file from ebtrace
    /// (`/proc/self/fd/N`), for as long as it is held.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }

    /// The file's inode number.
    pub fn inode(&self) -> io::Result<u64> {
        Ok(rustix::fs::fstat(&*self.fd)?.st_ino)
    }
}

impl fmt::Debug for HeldFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HeldFile({})", self.path().display())
    }
}

impl PartialEq for HeldFile {
    fn eq(&self, other: &Self) -> bool {
        self.fd.as_raw_fd() == other.fd.as_raw_fd()
    }
}

impl Eq for HeldFile {}

impl TargetRoot {
    /// The root directory of `pid` (`/proc/PID/root`).
    pub fn open(pid: u32) -> io::Result<Self> {
        let dir = rustix::fs::open(
            process_dir(pid).join("root"),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(TargetRoot { dir })
    }

    /// `path`, absolute in the process's view, held without being opened
    /// for reading (`O_PATH`: no device or FIFO is opened by it).
    fn look_up(&self, path: &Path) -> io::Result<OwnedFd> {
        let relative = path.strip_prefix("/").unwrap_or(path);
        Ok(rustix::fs::openat2(
            &self.dir,
            relative,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
        )?)
    }

    /// The regular file at `path`, held; an error for anything else.
    pub fn regular_file(&self, path: &Path) -> io::Result<HeldFile> {
        let fd = self.look_up(path)?;
        let stat = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", path.display()),
            ));
        }
        Ok(HeldFile { fd: Arc::new(fd) })
    }

    /// The bytes of the regular file at `path`, refused if it holds more
    /// than `max`.
    pub fn read_regular(&self, path: &Path, max: u64) -> io::Result<Vec<u8>> {
        let held = self.regular_file(path)?;
        // Opened again through the descriptor: the very file looked up.
        let file = File::from(rustix::fs::open(
            held.path(),
            OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )?);
        let mut bytes = Vec::new();
        file.take(max + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} holds more than {max} bytes", path.display()),
            ));
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a root of the test's making: absolute links stay inside it, and
    /// a FIFO or a device is refused at once, never opened for reading.
    #[test]
    fn lookups_stay_in_the_root_and_read_only_regular_files() {
        let dir = std::env::temp_dir().join(format!("ebtrace-root-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("etc")).unwrap();
        std::fs::write(dir.join("etc/real"), "inside").unwrap();
        std::os::unix::fs::symlink("/etc/real", dir.join("etc/absolute")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("etc/zero")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.join("etc/fifo"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let root = TargetRoot {
            dir: rustix::fs::open(&dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap(),
        };
        let read = |p: &str| root.read_regular(Path::new(p), 1024);
        assert_eq!(read("/etc/real").unwrap(), b"inside");
        // `/etc/real` of the test's root, not this machine's.
        assert_eq!(read("/etc/absolute").unwrap(), b"inside");
        // This machine's /dev/zero is outside the root: not found there.
        assert!(read("/etc/zero").is_err());
        assert!(read("/etc/fifo").is_err());
        assert!(read("/../../etc/passwd").is_err());
        assert!(root.read_regular(Path::new("/etc/real"), 3).is_err());
        let held = root.regular_file(Path::new("/etc/absolute")).unwrap();
        assert_eq!(std::fs::read(held.path()).unwrap(), b"inside");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_process_root_is_opened_through_proc() {
        let root = TargetRoot::open(std::process::id()).unwrap();
        assert!(root.regular_file(Path::new("/proc/self/exe")).is_err());
        let held = root.regular_file(Path::new("/etc/hostname"));
        assert!(held.is_ok() || !Path::new("/etc/hostname").is_file());
    }
}
