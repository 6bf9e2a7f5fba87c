//! Files written as root into directories other users may control: every
//! name is looked up from a descriptor of a directory held open, never
//! through a link leading out of it; a file is written under an
//! unpredictable temporary name that must not exist yet (`O_EXCL`, which a
//! planted link or FIFO also fails), readable by its owner only, and
//! renamed into place once it is on disk. Directories and files created
//! take the owner of the directory they are created in, so that a user
//! whose directory ebtrace writes into owns what it writes there.

use std::{
    ffi::OsStr,
    fs,
    io::{self, BufWriter},
    os::fd::{AsFd, OwnedFd},
    path::Path,
};

use rustix::{
    fs::{AtFlags, Gid, Mode, OFlags, ResolveFlags, Uid},
    io::Errno,
};

/// Traces carry other users' stacks and op names: their owner alone reads
/// them.
const FILE_MODE: u32 = 0o600;
const DIR_MODE: u32 = 0o755;

/// A directory held open.
#[derive(Debug)]
pub struct HeldDir {
    fd: OwnedFd,
}

impl HeldDir {
    /// Holds the directory at `path`, which must exist (the path itself is
    /// the caller's: links in it are followed).
    pub fn open(path: &Path) -> io::Result<Self> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        Ok(HeldDir {
            fd: rustix::fs::open(path, flags, Mode::empty())?,
        })
    }

    /// Creates the directory at `path` and its parents where missing (with
    /// root's ownership: the path is the operator's), then holds it.
    pub fn create_all(path: &Path) -> io::Result<Self> {
        fs::create_dir_all(path)?;
        Self::open(path)
    }

    /// The directory `name` in this one, created if missing (owned as this
    /// one is). A link leading out of this directory is refused.
    pub fn subdir(&self, name: &OsStr) -> io::Result<HeldDir> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        match self.open_beneath(name, flags, Mode::empty()) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            other => return other.map(|fd| HeldDir { fd }),
        }
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(DIR_MODE)) {
            Ok(()) => {
                let fd = self.open_beneath(name, flags, Mode::empty())?;
                chown_fd(&fd, self.owner()?)?;
                Ok(HeldDir { fd })
            }
            // Made by someone else in between.
            Err(Errno::EXIST) => self
                .open_beneath(name, flags, Mode::empty())
                .map(|fd| HeldDir { fd }),
            Err(e) => Err(e.into()),
        }
    }

    /// Each of `names` in turn below this directory, created where missing.
    pub fn subdirs<'a>(&self, names: impl IntoIterator<Item = &'a OsStr>) -> io::Result<HeldDir> {
        let mut dir = HeldDir {
            fd: self.fd.try_clone()?,
        };
        for name in names {
            dir = dir.subdir(name)?;
        }
        Ok(dir)
    }

    /// Whether anything (a link too) is named `name` here.
    pub fn holds(&self, name: &OsStr) -> bool {
        rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW).is_ok()
    }

    /// Writes the file `name` here with what `write` writes: it appears,
    /// replacing whatever had the name, once everything is written and on
    /// disk; on failure nothing is left behind.
    pub fn write_file<T>(
        &self,
        name: &OsStr,
        write: impl FnOnce(&mut BufWriter<fs::File>) -> io::Result<T>,
    ) -> io::Result<T> {
        let tmp = format!(".{}.tmp-{:016x}", name.to_string_lossy(), unpredictable());
        let flags = OFlags::WRONLY
            | OFlags::CREATE
            | OFlags::EXCL
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC;
        let created = self.open_beneath(OsStr::new(&tmp), flags, Mode::from_raw_mode(FILE_MODE))?;
        let result = (|| {
            let owner = self.owner()?;
            let mut f = BufWriter::with_capacity(1 << 20, fs::File::from(created));
            let written = write(&mut f)?;
            let f = f.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            chown_fd(&f, owner)?;
            rustix::fs::renameat(&self.fd, tmp.as_str(), &self.fd, name)?;
            Ok(written)
        })();
        if result.is_err() {
            let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
        }
        result
    }

    /// Removes the file `name` here, if it is there.
    pub fn remove_file(&self, name: &OsStr) {
        let _ = rustix::fs::unlinkat(&self.fd, name, AtFlags::empty());
    }

    /// `openat2(self, name, flags, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`,
    /// a link out of this directory said to be one.
    fn open_beneath(&self, name: &OsStr, flags: OFlags, mode: Mode) -> io::Result<OwnedFd> {
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
        rustix::fs::openat2(&self.fd, name, flags, mode, resolve).map_err(|e| match e {
            Errno::XDEV => io::Error::other(format!(
                "{} is a link leading out of the directory it is in",
                name.to_string_lossy()
            )),
            e => e.into(),
        })
    }

    fn owner(&self) -> io::Result<(Uid, Gid)> {
        let st = rustix::fs::fstat(&self.fd)?;
        Ok((Uid::from_raw(st.st_uid), Gid::from_raw(st.st_gid)))
    }
}

fn chown_fd(fd: impl AsFd, (uid, gid): (Uid, Gid)) -> io::Result<()> {
    // AT_EMPTY_PATH makes the call act on fd itself (which works for O_PATH
    // descriptors, unlike fchown).
    Ok(rustix::fs::chownat(
        fd,
        c"",
        Some(uid),
        Some(gid),
        AtFlags::EMPTY_PATH,
    )?)
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
