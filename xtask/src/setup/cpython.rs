//! CPython 3.14 beside the machine image's 3.10 to 3.13 under pyenv, so
//! that the Python stack tests run on every version ebtrace reads. Where
//! pyenv has none, Debian's own build is taken from Debian's unstable
//! suite (the release builds that later Debian and Ubuntu ship): its
//! packages are downloaded and verified by apt with a configuration of
//! its own (nothing of the system's apt changes), unpacked, and laid out
//! as a pyenv version. It needs that suite's C library, which it brings
//! along: the interpreter's program loader and search path point at it.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::util::{run, say, stdout_of, succeeds};

/// The minor version added.
const MINOR: u8 = 14;
/// Debian's suite that has it.
const SUITE: &str = "sid";
/// The interpreter (statically linked with libpython), its standard
/// library, and the shared libraries it and its C modules load.
const PACKAGES: &[&str] = &[
    "python3.14-minimal",
    "libpython3.14-minimal",
    "libpython3.14-stdlib",
    "libc6",
    "libexpat1",
    "zlib1g",
    "libffi8",
];
/// What of the suite's `libc6` and libraries goes into `lib/native`.
const NATIVE_LIBRARIES: &[&str] = &[
    "ld-linux-x86-64.so.2",
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libexpat.so.1",
    "libz.so.1",
    "libffi.so.8",
];
/// What the interpreter must import to serve the tests' fixtures.
const PROBE: &str = "import sys, ctypes, threading, json, time; \
                     assert sys.version_info[:2] == (3, 14), sys.version";

/// Makes sure pyenv has a CPython 3.14 that runs.
pub fn cpython_314(work: &Path) -> Result<()> {
    let versions = ebtrace_tests::pyenv::pyenv_root().join("versions");
    if let Some(python) = ebtrace_tests::pyenv::installed_cpython(MINOR)
        && succeeds(Command::new(&python).args(["-c", PROBE]))
    {
        say(format!("ok: CPython 3.{MINOR} ({})", python.display()));
        return Ok(());
    }
    say(format!(
        "CPython 3.{MINOR} is not under {}: installing Debian's build",
        versions.display()
    ));
    let debs = download(&work.join("cpython-3.14"))?;
    let unpacked = work.join("cpython-3.14/unpacked");
    let _ = fs::remove_dir_all(&unpacked);
    for deb in &debs {
        run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&unpacked))?;
    }
    let minimal = debs
        .iter()
        .find(|d| file_name(d).starts_with("python3.14-minimal_"))
        .context("python3.14-minimal was not downloaded")?;
    let version = package_version(minimal)?;
    let prefix = versions.join(&version);
    lay_out(&unpacked, &prefix)?;
    let python = prefix.join("bin/python3.14");
    if !succeeds(Command::new(&python).args(["-c", PROBE])) {
        bail!(
            "{} was installed but does not run `{PROBE}`; remove {} and run setup again",
            python.display(),
            prefix.display()
        );
    }
    say(format!("ok: CPython {version} ({})", python.display()));
    Ok(())
}

/// Downloads [`PACKAGES`] from [`SUITE`] into `dir`; the `.deb` files.
fn download(dir: &Path) -> Result<Vec<PathBuf>> {
    let apt = dir.join("apt");
    for sub in [
        "etc/preferences.d",
        "state/lists/partial",
        "cache/archives/partial",
    ] {
        fs::create_dir_all(apt.join(sub))?;
    }
    let sources = apt.join("etc/sources.list");
    fs::write(
        &sources,
        format!(
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] \
             http://deb.debian.org/debian {SUITE} main\n"
        ),
    )?;
    let options = [
        format!("Dir::Etc={}", apt.join("etc").display()),
        format!("Dir::Etc::sourcelist={}", sources.display()),
        "Dir::Etc::sourceparts=-".to_string(),
        format!("Dir::State={}", apt.join("state").display()),
        format!("Dir::Cache={}", apt.join("cache").display()),
        // Downloads land in a directory apt's own user may not write.
        "APT::Sandbox::User=root".to_string(),
    ];
    let apt_get = || {
        let mut cmd = Command::new("apt-get");
        cmd.arg("-q");
        for o in &options {
            cmd.args(["-o", o]);
        }
        cmd
    };
    run(apt_get().arg("update"))?;
    let debs = dir.join("debs");
    let _ = fs::remove_dir_all(&debs);
    fs::create_dir_all(&debs)?;
    run(apt_get().current_dir(&debs).arg("download").args(PACKAGES))?;
    let found: Vec<PathBuf> = fs::read_dir(&debs)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    if found.len() != PACKAGES.len() {
        bail!(
            "apt-get downloaded {} of the {} packages into {}",
            found.len(),
            PACKAGES.len(),
            debs.display()
        );
    }
    Ok(found)
}

/// `3.14.N` of a package whose version is `3.14.N-R`.
fn package_version(deb: &Path) -> Result<String> {
    let full = stdout_of(
        Command::new("dpkg-deb")
            .args(["-f"])
            .arg(deb)
            .arg("Version"),
    )
    .with_context(|| format!("no version in {}", deb.display()))?;
    let upstream = full.split('-').next().unwrap_or_default();
    let prefix = format!("3.{MINOR}.");
    match upstream.strip_prefix(&prefix) {
        Some(micro) if !micro.is_empty() && micro.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(upstream.to_string())
        }
        _ => bail!("{} has version {full}, not 3.{MINOR}.N", deb.display()),
    }
}

/// Lays the unpacked packages out as a pyenv version at `prefix`:
/// `bin/python3.14`, `lib/python3.14`, and `lib/native` with the suite's
/// C library, which the interpreter's loader and search path name.
fn lay_out(unpacked: &Path, prefix: &Path) -> Result<()> {
    let _ = fs::remove_dir_all(prefix);
    let native = prefix.join("lib/native");
    fs::create_dir_all(&native)?;
    fs::create_dir_all(prefix.join("bin"))?;
    let usr = unpacked.join("usr");
    let python = prefix.join("bin/python3.14");
    fs::copy(usr.join("bin/python3.14"), &python)?;
    run(Command::new("cp")
        .arg("-a")
        .arg(usr.join("lib/python3.14"))
        .arg(prefix.join("lib/")))?;
    let libraries = usr.join("lib/x86_64-linux-gnu");
    for name in NATIVE_LIBRARIES {
        // Followed: each is a link to the versioned file.
        fs::copy(libraries.join(name), native.join(name))
            .with_context(|| format!("{name} is not in the downloaded packages"))?;
    }
    std::os::unix::fs::symlink("python3.14", prefix.join("bin/python3"))?;
    run(Command::new("patchelf")
        .arg("--set-interpreter")
        .arg(native.join("ld-linux-x86-64.so.2"))
        // An RPATH (not a RUNPATH) applies to the C modules' libraries too.
        .arg("--force-rpath")
        .arg("--set-rpath")
        .arg(&native)
        .arg(&python))
}

fn file_name(path: &Path) -> &str {
    path.file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
}
