//! `ebtrace serve` stops on a panic in any of its threads: the hook that
//! [`ebtrace::server::panics::watch`] installs reports it, and the
//! server's main loop, which waits on it, then stops and exits with an
//! error. Its own process: the hook is process-wide.

use std::time::Duration;

use ebtrace::{error::Error, server::panics};

#[test]
fn a_panic_in_the_hub_thread_or_a_task_stops_the_server() {
    let mut watch = panics::watch();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    assert_eq!(watch.seen(), None);

    // A real panic where the session hub runs (an index past the end, as
    // `select_nth_unstable` raised with a `max_events` beyond its events).
    let hub = std::thread::Builder::new()
        .name("ebtrace-hub".into())
        .spawn(|| {
            let starts: Vec<u64> = vec![1, 2, 3];
            let max = starts.len() + std::hint::black_box(300);
            starts[max]
        })
        .unwrap();
    assert!(hub.join().is_err());
    let first = runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(5), watch.panicked()).await })
        .expect("the main loop hears of the panic");
    assert!(
        first.starts_with("thread 'ebtrace-hub' panicked at "),
        "{first}"
    );
    assert!(first.contains("index out of bounds"), "{first}");
    assert!(first.contains("serve_panics.rs"), "{first}");

    // A panic in a gRPC handler's task: reported too; the first one is kept.
    let task = runtime.spawn(async { panic!("a handler failed\non two lines") });
    assert!(runtime.block_on(task).is_err());
    assert_eq!(watch.seen().as_deref(), Some(first.as_str()));

    // What the server returns then: an error with the panic, exit code 1.
    let stopped = Error::Panicked(first.clone());
    assert_eq!(stopped.exit_code(), ebtrace::error::EXIT_FAILURE);
    assert!(stopped.to_string().contains(&first));
    assert!(!stopped.to_string().contains('\n'));
}
