//! The per-stream lines of each GPU: which line a submission goes on, and
//! the order work keeps on its line.

use std::{collections::BTreeMap, sync::Arc};

use super::{CudaTimelineBuilder, DeviceTrack, StreamTiming, StreamTrack};
use crate::{cuda_api::Stream, timeline::Span};

/// Which stream a submission went to, within one process and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum StreamKey {
    Legacy,
    PerThread(u32),
    Handle(u64),
}

impl StreamKey {
    /// The stream `stream` named by a call of thread `tid`.
    pub(super) fn of(stream: Stream, tid: u32) -> StreamKey {
        match stream {
            Stream::LegacyDefault => StreamKey::Legacy,
            Stream::PerThreadDefault => StreamKey::PerThread(tid),
            Stream::Handle(handle) => StreamKey::Handle(handle),
        }
    }
}

impl CudaTimelineBuilder {
    /// The line of a stream on a device (created on first use): its id and label.
    pub(super) fn stream_line(
        &mut self,
        ordinal: u32,
        pid: u32,
        key: StreamKey,
    ) -> (i64, Arc<str>) {
        if let Some((id, label)) = self.stream_ids.get(&(ordinal, pid, key)) {
            return (*id, Arc::clone(label));
        }
        let device = self
            .out
            .devices
            .entry(ordinal)
            .or_insert_with(|| DeviceTrack {
                ordinal,
                streams: BTreeMap::new(),
            });
        let next = device.streams.keys().max().map_or(1, |m| m + 1).max(1);
        // Line 0 is the first process's legacy stream; another process's
        // legacy stream on the same device is a stream of its own.
        let id = match key {
            StreamKey::Legacy if !device.streams.contains_key(&0) => 0,
            _ => next,
        };
        let label = match key {
            StreamKey::Legacy => format!("legacy default stream of pid {pid}"),
            StreamKey::PerThread(tid) => format!("per-thread default stream of tid {tid}"),
            StreamKey::Handle(handle) => format!("{handle:#x}"),
        };
        device.streams.entry(id).or_insert_with(|| StreamTrack {
            id,
            pid,
            label: label.clone(),
            timing: StreamTiming::HostObserved,
            events: Vec::new(),
        });
        let label: Arc<str> = label.into();
        self.stream_ids
            .insert((ordinal, pid, key), (id, Arc::clone(&label)));
        (id, label)
    }
}

/// Work on one stream runs in submission order: an event that starts
/// before the previous one ends is moved to start at that end.
pub(super) fn serialize(events: &mut [Span]) {
    events.sort_by_key(|e| (e.start_ns, e.end_ns));
    let mut last_end = 0;
    for e in events.iter_mut() {
        e.start_ns = e.start_ns.max(last_end);
        e.end_ns = e.end_ns.max(e.start_ns);
        last_end = e.end_ns;
    }
}
