//! The `ebtrace` binary: parse the command line, run, map errors to exit codes.

use clap::Parser as _;
use ebtrace::cli::{Cli, Command, record};

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Some(Command::Record(args)) => record::run(args),
        None => record::run(&cli.record),
    };
    if let Err(err) = result {
        let mut line = format!("ebtrace: error: {err}");
        let mut source = std::error::Error::source(&err);
        while let Some(s) = source {
            let text = s.to_string();
            if !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            source = s.source();
        }
        eprintln!("{line}");
        std::process::exit(err.exit_code());
    }
}
