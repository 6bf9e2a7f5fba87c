//! The `ebtrace` binary: parse the command line, run, map errors to exit codes.

use clap::Parser as _;
use ebtrace::cli::{Cli, Command, capture, convert, record, serve};

/// Prints the library's warnings as ebtrace's other messages are printed:
/// one line on stderr each.
struct StderrWarnings;

impl log::Log for StderrWarnings {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let line = record.args().to_string();
            eprintln!("ebtrace: warning: {line}");
            ebtrace::cli::keep_logged_warning(line);
        }
    }

    fn flush(&self) {}
}

fn main() {
    ebtrace::large_buffers_from_mmap();
    // blazesym maps the targets' files too.
    ebtrace::procfs::survive_truncated_files();
    static LOGGER: StderrWarnings = StderrWarnings;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
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
        Some(Command::Convert(args)) => convert::run(args),
        Some(Command::Capture(args)) => capture::run(args).map(|code| {
            if code != 0 {
                std::process::exit(code);
            }
        }),
        Some(Command::AgentLibrary { path }) => ebtrace::agent::write_library(path),
        Some(Command::RestoreGuard { lifeline_fd }) => {
            std::process::exit(ebtrace::attach::traceme::guard::run(*lifeline_fd))
        }
        Some(Command::InjectCheck {
            pid,
            cycles,
            library,
            hold,
        }) => std::process::exit(ebtrace::agent::inject::check::run(
            *pid,
            *cycles,
            library.as_deref(),
            *hold,
        )),
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
