//! Helpers shared by the subcommands: paths, running commands, the fixture.

use std::{
    collections::BTreeMap,
    ffi::OsStr,
    fs,
    io::{BufRead as _, BufReader, Lines},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, ExitStatus, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask/ has a parent")
        .to_path_buf()
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Fails with a one-line explanation unless running as root.
pub fn require_root(what: &str) -> Result<()> {
    if !is_root() {
        bail!(
            "`cargo xtask {what}` must run as root: ebtrace loads eBPF programs \
             (run it from a root shell, or `sudo -E env PATH=\"$PATH\" cargo xtask {what}`)"
        );
    }
    Ok(())
}

/// Prints a step of work, so that every subcommand says what it does.
pub fn say(msg: impl AsRef<str>) {
    println!("xtask: {}", msg.as_ref());
}

/// The command line as a shell would show it (for logs and errors).
pub fn display(cmd: &Command) -> String {
    let quote = |s: &OsStr| {
        let s = s.to_string_lossy();
        if s.is_empty() || s.contains(|c: char| c.is_whitespace() || "\"'$|&;<>()*?".contains(c)) {
            format!("'{}'", s.replace('\'', r"'\''"))
        } else {
            s.into_owned()
        }
    };
    let envs = cmd
        .get_envs()
        .filter_map(|(k, v)| v.map(|v| format!("{}={}", k.to_string_lossy(), quote(v))));
    // `$CARGO` is an absolute toolchain path; "cargo" reads better.
    let program = Path::new(cmd.get_program());
    let program = if program.file_name() == Some(OsStr::new("cargo")) {
        "cargo".to_string()
    } else {
        quote(program.as_os_str())
    };
    envs.chain(std::iter::once(program))
        .chain(cmd.get_args().map(quote))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a command with inherited stdio after printing it; fails if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    say(format!("$ {shown}"));
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    check_status(&shown, status)
}

pub fn check_status(shown: &str, status: ExitStatus) -> Result<()> {
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a command quietly; true if it ran and exited 0.
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs a command quietly and returns its stdout, or None if it failed.
pub fn stdout_of(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// `cargo build --release` of the default members: the ebtrace binary with
/// its eBPF object (built by tracer-user/build.rs).
pub fn build_release(root: &Path) -> Result<PathBuf> {
    run(cargo().current_dir(root).args(["build", "--release"]))?;
    let bin = root.join("target/release/ebtrace");
    if !bin.exists() {
        bail!("{} is missing after the build", bin.display());
    }
    Ok(bin)
}

/// The scheduling fixture, built as the tests build it.
pub fn build_fixture() -> PathBuf {
    ebtrace_tests::fixture::build_c("sched_workload")
}

pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain syscall; a stale pid only makes it fail.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// A running `sched_workload`: its pid and thread ids from its start line.
pub struct Workload {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    pub pid: u32,
    pub tids: BTreeMap<String, u32>,
}

impl Workload {
    /// Starts the fixture (`cmd` runs it, possibly through a wrapper that
    /// execs it, like taskset) and waits for the JSON line naming its threads.
    pub fn start(mut cmd: Command) -> Result<Self> {
        let shown = display(&cmd);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting `{shown}`"))?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let first = match lines.next() {
            Some(Ok(l)) => l,
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("`{shown}` exited before printing its start line");
            }
        };
        let v: serde_json::Value =
            serde_json::from_str(&first).with_context(|| format!("start line {first:?}"))?;
        let pid = v["pid"].as_u64().context("no pid in the start line")? as u32;
        let tids = v["threads"]
            .as_object()
            .context("no threads in the start line")?
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.as_u64()? as u32)))
            .collect();
        Ok(Workload {
            child,
            lines,
            pid,
            tids,
        })
    }

    pub fn tid(&self, name: &str) -> Result<u32> {
        self.tids
            .get(name)
            .copied()
            .with_context(|| format!("the fixture reported no thread {name:?}"))
    }

    /// Asks it to stop (SIGTERM) and returns its closing counters.
    pub fn stop(mut self) -> Result<serde_json::Value> {
        signal(self.pid, libc::SIGTERM);
        let last = self.lines.by_ref().map_while(Result::ok).last();
        let status = self.child.wait()?;
        check_status("sched_workload", status)?;
        let last = last.context("the fixture printed no counters")?;
        serde_json::from_str(&last).with_context(|| format!("counters line {last:?}"))
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        // Only reached on error paths with the child still running.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A fresh directory under `target/tmp` (removed by the caller when done).
pub fn temp_dir(root: &Path, tag: &str) -> Result<PathBuf> {
    let dir = root
        .join("target/tmp")
        .join(format!("xtask-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Median of a non-empty slice.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
