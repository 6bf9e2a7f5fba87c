//! The `ebtrace` binary: parse the command line, run, map errors to exit codes.

use clap::Parser as _;
use ebtrace::cli::{Cli, Command, record, serve};

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            // One line: clap's message up to its usage hint, without its prefix.
            let text = e.to_string();
            let message: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .filter(|l| !l.is_empty())
                .collect();
            let message = message.join(" ");
            let message = message.strip_prefix("error: ").unwrap_or(&message);
            eprintln!("ebtrace: error: {message} (see `ebtrace --help`)");
            std::process::exit(ebtrace::error::EXIT_USAGE);
        }
    };
    let result = match &cli.command {
        Some(Command::Record(args)) => record::run(args),
        Some(Command::Serve(args)) => serve::run(args),
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
