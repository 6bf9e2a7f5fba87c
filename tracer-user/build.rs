//! Builds the eBPF object (`tracer-ebpf`, nightly + bpf-linker) and the
//! in-process agent library (`tracer-agent`) into OUT_DIR, where `attach`
//! and `agent` embed them. `AYA_BUILD_SKIP=1` skips that step (e.g. for a
//! quick `cargo check`); an empty placeholder then keeps the crate compiling
//! and the binary reports the missing object at run time.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
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
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
    let object = out.join("tracer-ebpf");
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
    )?;
    if !object.exists() {
        std::fs::write(&object, []).context("writing placeholder eBPF object")?;
    }
    build_agent(root_dir.as_std_path(), &out)
}

/// Compiles the agent as a `cdylib` with rustc itself: it needs
/// panic=abort (no unwinding into the target's frames) and no C library at
/// link time (its symbol references then carry no glibc version, so it
/// loads into older targets), neither of which a workspace member's
/// profile can ask for.
fn build_agent(ebpf_dir: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
    let workspace = ebpf_dir
        .parent()
        .ok_or_else(|| anyhow!("tracer-ebpf has no parent directory"))?;
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
