//! `ebtrace convert FILE.xplane.pb --to perfetto`: rewrites a trace already
//! written in another viewer's format.

use std::{io, path::PathBuf};

use clap::{Args, ValueEnum};
use ebtrace_proto::tensorflow::profiler::XSpace;
use prost::Message as _;

use crate::{
    error::{Error, Result},
    sink::{logdir, perfetto},
};

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Perfetto's native protobuf trace (perfetto_trace.pb).
    Perfetto,
}

// A `concat!` doc, which clap does not read: a literal one would become
// the help text of the command this type is part of.
#[doc = concat!("The flags of `ebtrace convert`.")]
#[derive(Debug, Clone, Args)]
pub struct ConvertArgs {
    /// The XSpace to read (<host>.xplane.pb, from ebtrace or from jax /
    /// TensorFlow's profiler).
    #[arg(value_name = "FILE")]
    pub input: PathBuf,

    /// Format to write.
    #[arg(long, value_enum)]
    pub to: Format,

    /// Where to write; default: perfetto_trace.pb beside FILE.
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
}

/// Runs `ebtrace convert`: reads the XSpace and writes it in the format asked for.
pub fn run(args: &ConvertArgs) -> Result<()> {
    let bytes = std::fs::read(&args.input)
        .map_err(|e| Error::io(format!("reading {}", args.input.display()), e))?;
    let space = XSpace::decode(bytes.as_slice()).map_err(|e| {
        Error::io(
            format!("{} is not an XSpace (.xplane.pb)", args.input.display()),
            io::Error::new(io::ErrorKind::InvalidData, e),
        )
    })?;
    drop(bytes);
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| args.input.with_file_name(perfetto::FILE_NAME));
    let Format::Perfetto = args.to;
    let mut encoded = Vec::new();
    perfetto::convert::write_xspace(&space, &mut encoded).expect("writing to a Vec does not fail");
    logdir::write_atomically(&out, &encoded)
        .map_err(|e| Error::io(format!("writing {}", out.display()), e))?;
    println!("{}", out.display());
    Ok(())
}
