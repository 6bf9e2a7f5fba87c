//! Telling a thread that drains the ring buffer to stop, without waiting
//! for its poll or its timer to run out.

use std::{
    os::fd::{AsRawFd as _, OwnedFd},
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use rustix::event::EventfdFlags;

/// A flag and an eventfd that wakes a [`super::Collector::wait_unless_stopped`]
/// when the flag is set: the producers do not wake the collector per record,
/// so its wait would otherwise last its whole timeout.
pub struct DrainStop {
    stopped: AtomicBool,
    /// `None` where no eventfd could be made (out of descriptors): the
    /// wait then ends at its timeout.
    event: Option<OwnedFd>,
}

impl DrainStop {
    /// A flag not set yet.
    pub fn new() -> Self {
        let flags = EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK;
        DrainStop {
            stopped: AtomicBool::new(false),
            event: rustix::event::eventfd(0, flags).ok(),
        }
    }

    /// Sets the flag and wakes the thread waiting on it.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        if let Some(event) = &self.event {
            // It cannot fail but by overflow, which leaves it readable anyway.
            let _ = rustix::io::write(event, &1u64.to_ne_bytes());
        }
    }

    /// Whether the flag is set.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Waits until [`Self::stop`] or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        if self.is_stopped() {
            return;
        }
        match self.event_fd() {
            Some(fd) => poll_readable(&[fd], timeout),
            None => std::thread::sleep(timeout),
        }
    }

    /// The descriptor that becomes readable at [`Self::stop`].
    pub(super) fn event_fd(&self) -> Option<i32> {
        self.event.as_ref().map(|e| e.as_raw_fd())
    }
}

impl Default for DrainStop {
    fn default() -> Self {
        Self::new()
    }
}

/// Waits until one of `fds` (the first two) is readable or `timeout`
/// passes (EINTR, e.g. Ctrl-C, ends it early). The plain C call: the
/// descriptors come as numbers, which rustix's poll would take only
/// through an unsafe borrow of each.
pub(super) fn poll_readable(fds: &[i32], timeout: Duration) {
    let unused = libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    };
    let mut polled = [unused; 2];
    for (slot, &fd) in polled.iter_mut().zip(fds) {
        slot.fd = fd;
    }
    let count = fds.len().min(polled.len());
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `count` valid pollfds.
    unsafe { libc::poll(polled.as_mut_ptr(), count as libc::nfds_t, ms) };
}

/// Calls [`DrainStop::stop`] when dropped: also when the work beside the
/// draining thread panics, which would otherwise leave its scope waiting.
pub struct StopOnDrop<'a>(pub &'a DrainStop);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_stop_is_seen_and_wakes_a_poll_on_it() {
        let stop = DrainStop::new();
        assert!(!stop.is_stopped());
        let fd = stop.event_fd().expect("an eventfd");
        let poll = |ms| {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, ms) }
        };
        assert_eq!(poll(0), 0, "not readable before the stop");
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                drop(StopOnDrop(&stop));
            });
            let started = Instant::now();
            assert_eq!(poll(10_000), 1);
            assert!(started.elapsed() < Duration::from_secs(5));
        });
        assert!(stop.is_stopped());
        let started = Instant::now();
        stop.wait(Duration::from_secs(10));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a stopped wait returns"
        );
    }

    #[test]
    fn a_wait_ends_at_the_stop_or_its_timeout() {
        let stop = DrainStop::new();
        let started = Instant::now();
        stop.wait(Duration::from_millis(30));
        assert!(started.elapsed() >= Duration::from_millis(30));
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                stop.stop();
            });
            let started = Instant::now();
            stop.wait(Duration::from_secs(10));
            assert!(started.elapsed() < Duration::from_secs(5));
        });
    }
}
