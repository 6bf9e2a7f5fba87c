//! The `ebtrace` binary: parse the command line, run, map errors to exit codes.

use clap::Parser as _;
use ebtrace::cli::{Cli, Command, convert, record, serve};

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
    large_buffers_from_mmap();
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
        Some(Command::AgentLibrary { path }) => ebtrace::agent::write_library(path),
        Some(Command::RestoreGuard { lifeline_fd }) => {
            std::process::exit(ebtrace::attach::traceme::guard::run(*lifeline_fd))
        }
        Some(Command::InjectCheck {
            pid,
            cycles,
            library,
        }) => std::process::exit(ebtrace::attach::inject::check::run(
            *pid,
            *cycles,
            library.as_deref(),
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

/// Serves allocations of 1 MiB and more (records, timelines, XSpaces) with
/// their own mappings: freeing one gives its memory back at once, so an idle
/// `ebtrace serve` does not keep a finished capture's pages, and growing one
/// remaps it instead of copying. (glibc otherwise raises this threshold as
/// large blocks are freed, up to 32 MiB, and keeps what falls below it.)
fn large_buffers_from_mmap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: a plain allocator setting, made before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}
