//! `cargo xtask setup`: installs what building, testing and viewing need.
//! Every step checks first, so a second run does nothing and takes a
//! second or two.

use std::{path::Path, process::Command};

use anyhow::{Result, bail};

use crate::util::{self, run, say, stdout_of, succeeds};

mod cpython;

/// Pinned: newer bpf-linker releases need an external LLVM; 0.10.2 loads
/// rustc's own.
const BPF_LINKER_VERSION: &str = "0.10.2";
/// The XProf release whose converter the demo and the interop tests use.
const XPROF_VERSION: &str = "2.24.2";
/// The module the interop check imports; if it loads, the venv is complete.
const XPROF_PROBE_MODULE: &str = "xprof.convert.raw_to_tool_data";
/// The JAX release (CPU jaxlib) the interop tests run: `jax.collect_profile`
/// against `ebtrace serve`, and a jax process whose TraceMe events are
/// traced. jax and jaxlib are 88 MB of wheels (plus numpy and scipy; 540 MB
/// installed), and the whole venv installs in about 40 s. The serve tests
/// talk to the server through xprof's capture client, the same C++ code as
/// TensorFlow's `client.trace`.
const JAX_VERSION: &str = "0.10.2";
const JAX_PROBE_MODULE: &str = "jax.collect_profile";
/// The TensorFlow release (CPU build) whose TraceMe gates the TraceMe
/// interop test switches: `tf.profiler.experimental.Trace` steps of an
/// unmodified TensorFlow process. A 274 MB wheel, 1.4 GB installed, about
/// a minute to install. Its version is checked through the package
/// metadata: importing TensorFlow takes seconds.
const TENSORFLOW_PACKAGE: &str = "tensorflow-cpu";
const TENSORFLOW_VERSION: &str = "2.21.0";
/// PyTorch (PyPI's build, which runs on the CPU and pulls its CUDA
/// libraries, about 3.5 GB installed): the mixed-stack tests sample a CPU
/// training loop. Its version is checked through the package metadata:
/// importing torch takes seconds.
const TORCH_VERSION: &str = "2.15.0";
/// Perfetto's Python package: its `perfetto_trace_pb2` is the independent
/// schema the Perfetto output tests parse `perfetto_trace.pb` with.
const PERFETTO_VERSION: &str = "0.59.1";
/// py-spy, the independent reader of Python stacks the Python stack tests
/// compare ebtrace's with (a Rust binary in a wheel, run as root).
const PY_SPY_VERSION: &str = "0.4.3";

/// Debian packages: (package, why).
const APT_BASE: &[(&str, &str)] = &[
    ("gcc", "compiles the C test fixtures"),
    ("libc6-dev", "headers for the C test fixtures"),
    ("python3-venv", "creates the XProf virtual environment"),
    ("g++", "compiles the TraceMe test fixture against libstdc++"),
    ("clang", "compiles the TraceMe test fixture against libc++"),
    ("libc++-dev", "libc++ for the TraceMe test fixture"),
    ("libc++abi-dev", "libc++abi for the TraceMe test fixture"),
    ("binutils", "strip and nm for the TraceMe tests"),
    (
        "libtcmalloc-minimal4",
        "an allocator preloaded in place of the C library's in the agent loader's tests",
    ),
    (
        "chromium",
        "headless browser: the interop test opens XProf's trace viewer and screenshots it",
    ),
    (
        "fonts-liberation",
        "text in the headless browser's screenshots",
    ),
    (
        "prometheus",
        "a real Prometheus server scrapes `ebtrace serve --http` in the tests (and promtool checks it)",
    ),
    (
        "golang-go",
        "`go tool pprof` reads ebtrace's CPU profiles in the tests",
    ),
    (
        "podman",
        "a test builds deploy/container/Containerfile and runs the image as the DaemonSet does",
    ),
    ("runc", "the container runtime of that test"),
    (
        "patchelf",
        "points Debian's CPython 3.14 at the C library it comes with (see setup/cpython.rs)",
    ),
    (
        "debootstrap",
        "that test's base image, Debian built from its packages",
    ),
];
const APT_BENCH: &[(&str, &str)] = &[("bpftrace", "the comparison tracer of `cargo xtask bench`")];

#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Also install what `cargo xtask bench` needs.
    pub bench: bool,
}

pub fn run_setup(root: &Path, opts: Options) -> Result<()> {
    say("setup: checking toolchains and tools");
    nightly_toolchain()?;
    bpf_linker()?;
    let mut packages: Vec<(&str, &str)> = APT_BASE.to_vec();
    if opts.bench {
        packages.extend_from_slice(APT_BENCH);
    }
    apt_packages(&packages)?;
    cpython::cpython_314(&root.join("target"))?;
    python_venv(root)?;
    say("setup: done");
    Ok(())
}

/// The eBPF crate builds with nightly (`-Z build-std=core`) and needs
/// rust-src; clippy checks it.
fn nightly_toolchain() -> Result<()> {
    match stdout_of(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        Some(v) => say(format!("ok: nightly toolchain ({v})")),
        None => run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?,
    }
    let installed = stdout_of(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))
    .unwrap_or_default();
    // Installed components are listed with their target triple appended,
    // except rust-src, which has none. Clippy checks the eBPF crate for its
    // own target (`cargo xtask test`).
    for component in ["rust-src", "clippy"] {
        let has = installed.lines().any(|l| {
            let l = l.trim();
            l == component || l.starts_with(&format!("{component}-"))
        });
        if has {
            say(format!("ok: {component} for nightly"));
        } else {
            run(Command::new("rustup").args([
                "component",
                "add",
                component,
                "--toolchain",
                "nightly",
            ]))?;
        }
    }
    Ok(())
}

fn bpf_linker() -> Result<()> {
    let version = stdout_of(Command::new("bpf-linker").arg("--version"));
    if let Some(v) = version
        .as_deref()
        .filter(|v| v.split_whitespace().any(|w| w == BPF_LINKER_VERSION))
    {
        say(format!("ok: {v}"));
        return Ok(());
    }
    if let Some(v) = version {
        say(format!(
            "found {v}; installing the pinned {BPF_LINKER_VERSION}"
        ));
    }
    run(util::cargo().args([
        "install",
        &format!("bpf-linker@{BPF_LINKER_VERSION}"),
        "--locked",
    ]))
}

/// Installs the missing Debian packages (`apt-get update` once, only if
/// something is missing).
fn apt_packages(packages: &[(&str, &str)]) -> Result<()> {
    if !succeeds(Command::new("dpkg").arg("--version")) {
        let names: Vec<&str> = packages.iter().map(|(p, _)| *p).collect();
        say(format!(
            "warning: no dpkg (not Debian/Ubuntu?); make sure these are installed: {}",
            names.join(", ")
        ));
        return Ok(());
    }
    let missing: Vec<(&str, &str)> = packages
        .iter()
        .copied()
        .filter(|(p, _)| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        let names: Vec<&str> = packages.iter().map(|(p, _)| *p).collect();
        say(format!("ok: packages {}", names.join(", ")));
        return Ok(());
    }
    for (p, why) in &missing {
        say(format!("missing package {p} ({why})"));
    }
    if !util::is_root() {
        bail!("installing Debian packages needs root: run this as root, or install them yourself");
    }
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(missing.iter().map(|(p, _)| *p)))
}

fn dpkg_installed(package: &str) -> bool {
    // `dpkg -s` also succeeds for removed-but-configured packages; the
    // Status line tells.
    stdout_of(Command::new("dpkg").args(["-s", package]))
        .is_some_and(|s| s.lines().any(|l| l == "Status: install ok installed"))
}

/// `<repo>/.venv` with XProf, used to prove that XProf reads our traces,
/// and JAX: its capture client runs against `ebtrace serve`, and its jaxlib
/// is the real TraceMe recorder the TraceMe interop test traces.
fn python_venv(root: &Path) -> Result<()> {
    let venv = root.join(".venv");
    let python = venv.join("bin/python");
    let import = format!(
        "import {XPROF_PROBE_MODULE}, {JAX_PROBE_MODULE}, jax, jaxlib, importlib.metadata; \
         assert jax.__version__ == jaxlib.__version__ == '{JAX_VERSION}'; \
         assert importlib.metadata.version('{TENSORFLOW_PACKAGE}') == '{TENSORFLOW_VERSION}'; \
         assert importlib.metadata.version('perfetto') == '{PERFETTO_VERSION}'; \
         assert importlib.metadata.version('torch') == '{TORCH_VERSION}'; \
         assert importlib.metadata.version('py-spy') == '{PY_SPY_VERSION}'"
    );
    if succeeds(Command::new(&python).args(["-c", &import])) {
        say(format!(
            "ok: {} has xprof, jax {JAX_VERSION}, TensorFlow {TENSORFLOW_VERSION} and \
             torch {TORCH_VERSION}",
            venv.display()
        ));
        return Ok(());
    }
    if !python.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    run(Command::new(venv.join("bin/pip")).args([
        "install",
        "--quiet",
        &format!("xprof=={XPROF_VERSION}"),
        &format!("jax=={JAX_VERSION}"),
        &format!("jaxlib=={JAX_VERSION}"),
        &format!("{TENSORFLOW_PACKAGE}=={TENSORFLOW_VERSION}"),
        &format!("perfetto=={PERFETTO_VERSION}"),
        &format!("py-spy=={PY_SPY_VERSION}"),
        &format!("torch=={TORCH_VERSION}"),
    ]))?;
    if !succeeds(Command::new(&python).args(["-c", &import])) {
        bail!(
            "xprof {XPROF_VERSION}, jax {JAX_VERSION}, TensorFlow {TENSORFLOW_VERSION} and \
             torch {TORCH_VERSION} installed into {} but `{import}` fails",
            venv.display()
        );
    }
    Ok(())
}
