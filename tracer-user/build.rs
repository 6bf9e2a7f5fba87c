//! Builds the eBPF object (`tracer-ebpf`, nightly + bpf-linker) into OUT_DIR,
//! where `attach` embeds it. `AYA_BUILD_SKIP=1` skips that step (e.g. for a
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
    Ok(())
}
