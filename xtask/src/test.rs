//! `cargo xtask test`: the full check CI runs, with nothing allowed to skip.

use std::{path::Path, process::Command};

use anyhow::Result;

use crate::{
    setup,
    util::{self, cargo, run, say},
};

pub fn run_tests(root: &Path, libtest_args: &[String]) -> Result<()> {
    util::require_root("test")?;
    setup::run_setup(root, setup::Options::default())?;

    // Cheapest checks first: a formatting slip fails in a second.
    self_contained(root)?;
    say("checking formatting");
    run(cargo().current_dir(root).args(["fmt", "--all", "--check"]))?;
    say("running clippy");
    // The eBPF crate is built by tracer-user/build.rs for its own target;
    // unified with the workspace it would get `std` (see Cargo.toml).
    run(cargo().current_dir(root).args([
        "clippy",
        "--workspace",
        "--exclude",
        "tracer-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The agent as ebtrace loads it: its entry points and panic handler.
    run(cargo().current_dir(root).args([
        "clippy",
        "-p",
        "tracer-agent",
        "--features",
        "cdylib",
        "--lib",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The eBPF programs, for their own target as tracer-user/build.rs
    // builds them (its own target directory: another target's artifacts).
    run(Command::new("rustup")
        .current_dir(root)
        .env("CARGO_TARGET_DIR", root.join("target/ebpf-clippy"))
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .args([
            "run",
            "nightly",
            "cargo",
            "clippy",
            "-p",
            "tracer-ebpf",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--bins",
            "--",
            "-D",
            "warnings",
        ]))?;
    // The tests run this binary (EBTRACE_BIN); build it explicitly, since
    // `cargo test` builds binaries only for their own package's tests.
    let ebtrace = util::build_release(root)?;

    say("running the tests (BPF and XProf interop required: no skipping)");
    // --no-fail-fast: one failing test binary must not hide the others'.
    run(cargo()
        .current_dir(root)
        .env("EBTRACE_REQUIRE_BPF", "1")
        .env("EBTRACE_REQUIRE_INTEROP", "1")
        .env("EBTRACE_PYTHON", root.join(".venv/bin/python"))
        .env("EBTRACE_BIN", &ebtrace)
        .args([
            "test",
            "--release",
            "--no-fail-fast",
            "--workspace",
            "--exclude",
            "tracer-ebpf",
            "--",
        ])
        .args(libtest_args))?;
    say("all checks passed");
    Ok(())
}

/// A clone of the repository must pass on its own: no source, test or
/// script may read files from outside it (a `shared/` checkout beside it,
/// say). The recorded fixtures live in `tests/fixtures/`.
fn self_contained(root: &Path) -> Result<()> {
    let out = std::process::Command::new("git")
        .current_dir(root)
        .args([
            "grep",
            "-n",
            "-E",
            r"\.\./(\.\./)?shared/",
            "--",
            "*.rs",
            "*.py",
            "*.sh",
            "*.toml",
            ".ci/*",
        ])
        .output();
    let Ok(out) = out else {
        return Ok(());
    };
    let found = String::from_utf8_lossy(&out.stdout);
    if let Some(first) = found.lines().next() {
        anyhow::bail!(
            "the repository reads files outside itself ({first}): copy what the tests need into \
             tests/fixtures/ and read it from there"
        );
    }
    Ok(())
}
