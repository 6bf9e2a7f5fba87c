//! Builds the eBPF object (`tracer-ebpf`, nightly + bpf-linker) and the
//! in-process agent library (`tracer-agent`) into OUT_DIR, where `attach`
//! and `agent` embed them. `AYA_BUILD_SKIP=1` skips that step (e.g. for a
//! quick `cargo check`); an empty placeholder then keeps the crate compiling
//! and the binary reports the missing object at run time.
use anyhow::{Context as _, anyhow};

/// Set in the child this script starts to build the eBPF object (see
/// [`build_ebpf_quietly`]).
const EBPF_BUILD_CHILD: &str = "EBTRACE_EBPF_BUILD_CHILD";

fn main() -> anyhow::Result<()> {
    if std::env::var_os(EBPF_BUILD_CHILD).is_some() {
        return build_ebpf();
    }
    build_ebpf_quietly()?;
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
    let object = out.join("tracer-ebpf");
    if !object.exists() {
        std::fs::write(&object, []).context("writing placeholder eBPF object")?;
    }
    let manifest_dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?,
    );
    build_agent(&manifest_dir.join(".."), &out)
}

/// Builds the eBPF object in a child process (this script again) and passes
/// on what it tells cargo: its progress, which `aya-build` prints as one
/// cargo warning a line, only when the build fails.
fn build_ebpf_quietly() -> anyhow::Result<()> {
    let me = std::env::current_exe().context("this build script's path")?;
    let child = std::process::Command::new(me)
        .env(EBPF_BUILD_CHILD, "1")
        .output()
        .context("running the eBPF build")?;
    let failed = !child.status.success();
    for line in String::from_utf8_lossy(&child.stdout).lines() {
        let progress = line.starts_with("cargo:warning=") && !line.contains("AYA_BUILD_SKIP");
        if failed || !progress {
            println!("{line}");
        }
    }
    if failed {
        eprint!("{}", String::from_utf8_lossy(&child.stderr));
        return Err(anyhow!(
            "building the eBPF object failed ({}): see the warnings above",
            child.status
        ));
    }
    Ok(())
}

/// Builds `tracer-ebpf` into OUT_DIR with `aya-build`.
fn build_ebpf() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "tracer-ebpf")
        .ok_or_else(|| anyhow!("package tracer-ebpf not found in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("tracer-ebpf manifest has no parent directory"))?;
    // aya-build watches the eBPF crate only; the records it writes are
    // defined beside it, and a change there must rebuild both sides.
    let common = root_dir.join("../tracer-common/src");
    println!("cargo:rerun-if-changed={common}");
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}

/// Compiles the agent as a `cdylib` with rustc itself: it needs
/// panic=abort (no unwinding into the target's frames) and no C library at
/// link time (its symbol references then carry no glibc version, so it
/// loads into older targets), neither of which a workspace member's
/// profile can ask for.
fn build_agent(workspace: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
    let source = workspace.join("tracer-agent/src");
    println!("cargo:rerun-if-changed={}", source.display());
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let library = out.join("libebtrace_agent.so");
    let status = std::process::Command::new(rustc)
        .args(["--edition", "2024", "--crate-name", "ebtrace_agent"])
        .args(["--crate-type", "cdylib", "--cfg", "feature=\"cdylib\""])
        .args(["-C", "panic=abort", "-C", "opt-level=s", "-C", "lto"])
        .args(["-C", "codegen-units=1", "-C", "strip=symbols"])
        .args(["-C", "link-arg=-nodefaultlibs"])
        .arg("-o")
        .arg(&library)
        .arg(source.join("lib.rs"))
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .context("running rustc for the agent")?;
    if !status.success() {
        return Err(anyhow!("building the agent library failed ({status})"));
    }
    Ok(())
}
