//! A panic anywhere in `ebtrace serve` is a bug, and after one the server
//! cannot be trusted to answer (a panicked session hub would refuse every
//! request as if shutting down). [`watch`] installs the process's panic
//! hook: it writes the panic as one line on stderr, and the server's main
//! loop, waiting on the [`PanicWatch`], then stops the way SIGTERM stops it
//! (unwinding has already dropped, and so detached, what the panicking
//! thread held) and exits non-zero, so that a supervisor restarts it.

use std::{panic::PanicHookInfo, thread};

use tokio::sync::watch;

/// Resolves once a thread of this process has panicked.
pub struct PanicWatch {
    first: watch::Receiver<Option<String>>,
}

impl PanicWatch {
    /// The first panic's one-line description, once there is one.
    pub async fn panicked(&mut self) -> String {
        match self.first.wait_for(Option::is_some).await {
            Ok(first) => first.clone().unwrap_or_default(),
            // The hook holds the sender for the life of the process.
            Err(_) => std::future::pending().await,
        }
    }

    /// The first panic's description, if there was one.
    pub fn seen(&self) -> Option<String> {
        self.first.borrow().clone()
    }
}

/// Replaces the process's panic hook (see the module doc).
pub fn watch() -> PanicWatch {
    let (tx, first) = watch::channel(None);
    std::panic::set_hook(Box::new(move |info| {
        let line = describe(info);
        eprintln!("ebtrace: internal error (a bug, please report it): {line}");
        tx.send_if_modified(|first| {
            let unset = first.is_none();
            if unset {
                *first = Some(line.clone());
            }
            unset
        });
    }));
    PanicWatch { first }
}

/// `thread 'NAME' panicked at FILE:LINE:COL: MESSAGE`, on one line.
fn describe(info: &PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    let location = info
        .location()
        .map_or_else(String::new, |l| format!(" at {l}"));
    let current = thread::current();
    format!(
        "thread '{}' panicked{location}: {}",
        current.name().unwrap_or("unnamed"),
        message.escape_debug()
    )
}
