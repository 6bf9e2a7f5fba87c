//! Perfetto traces read back with Perfetto's own schema (`perfetto_trace_pb2`
//! from the `perfetto` package on PyPI), summarized for assertions.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The module that holds Perfetto's trace schema.
pub const SCHEMA_MODULE: &str = "perfetto.protos.perfetto.trace.perfetto_trace_pb2";

/// The Python with the `perfetto` package, or `None` to skip (unless
/// `EBTRACE_REQUIRE_INTEROP=1`).
pub fn python() -> Option<PathBuf> {
    crate::xprof::python_with(&[SCHEMA_MODULE])
}

/// Parses the trace and prints, as JSON: `processes` (pid → name),
/// `threads` (tid → {name, pid}), per tid the `sched_switch` events that
/// switch it in (`switch_in`) and out (`switch_out`) and the `sched_waking`
/// events that wake it (`wakings`), the clock snapshots' clocks
/// (`clocks`: id → ts), per tid the track-event names begun or instant on
/// its thread track (`spans`: tid → name → count), the number of track
/// event tracks whose begins and ends do not pair (`unbalanced`), the
/// flows that leave (`flow_out`) and end (`flow_in`) on events, as [id,
/// track] (the track as in `named`, or "tid:TID"), and per
/// named track, as "parent name/name", the events begun or instant on it
/// (`named`); per tid the `PerfSample`s (`perf_samples`: [timestamp,
/// callstack as [function, mapping] from its root]), resolved through the
/// interned data of their sequence as Perfetto's reader does, the
/// sequences they (`perf_sequences`) and the track events
/// (`track_event_sequences`) are on, and what breaks the interning rules
/// (`interning_errors`: data on a sequence not cleared first, an iid or a
/// string interned twice, a sample without `SEQ_NEEDS_INCREMENTAL_STATE`,
/// an iid no entry has).
const SUMMARIZE: &str = r#"
import json, sys, collections
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
t = pb.Trace()
with open(sys.argv[1], "rb") as f:
    t.ParseFromString(f.read())
out = {"processes": {}, "threads": {}, "switch_in": collections.Counter(),
       "switch_out": collections.Counter(), "wakings": collections.Counter(),
       "clocks": {}, "spans": {}, "unbalanced": 0, "flow_out": [], "flow_in": [],
       "named": collections.Counter(), "perf_samples": {}, "perf_sequences": [],
       "track_event_sequences": [], "interning_errors": []}
TABLES = ("function_names", "frames", "callstacks", "mappings", "mapping_paths")
interned = {}
errors = out["interning_errors"]
def resolve(state, s):
    def name(table, iid):
        return state[table][iid].str.decode()
    frames = []
    for f in state["callstacks"][s.callstack_iid].frame_ids:
        frame = state["frames"][f]
        mapping = state["mappings"][frame.mapping_id]
        frames.append([name("function_names", frame.function_name_id),
                       "/".join(name("mapping_paths", i) for i in mapping.path_string_ids)])
    return frames
track_tid = {}
track_name = {}
depth = collections.Counter()
for p in t.packet:
    kind = p.WhichOneof("data")
    seq = p.trusted_packet_sequence_id
    if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
        interned[seq] = {table: {} for table in TABLES}
    if p.HasField("interned_data"):
        state = interned.get(seq)
        if state is None:
            errors.append(f"interned data on sequence {seq} before it was cleared")
            state = {}
        for table in state:
            for entry in getattr(p.interned_data, table):
                if entry.iid in state[table]:
                    errors.append(f"{table} {entry.iid} interned twice")
                if hasattr(entry, "str") and any(e.str == entry.str for e in state[table].values()):
                    errors.append(f"{table}: {entry.str!r} interned twice")
                state[table][entry.iid] = entry
    if kind == "track_event" and seq not in out["track_event_sequences"]:
        out["track_event_sequences"].append(seq)
    if kind == "perf_sample":
        s = p.perf_sample
        if seq not in out["perf_sequences"]:
            out["perf_sequences"].append(seq)
        if not p.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE:
            errors.append(f"sample at {p.timestamp} without SEQ_NEEDS_INCREMENTAL_STATE")
        try:
            frames = resolve(interned[seq], s)
        except KeyError as e:
            errors.append(f"sample at {p.timestamp}: no interned {e}")
            continue
        out["perf_samples"].setdefault(str(s.tid), []).append([p.timestamp, frames])
    if kind == "clock_snapshot":
        for c in p.clock_snapshot.clocks:
            out["clocks"][str(c.clock_id)] = c.timestamp
    elif kind == "track_descriptor":
        d = p.track_descriptor
        if d.HasField("process"):
            out["processes"][str(d.process.pid)] = d.process.process_name
        if d.HasField("thread"):
            out["threads"][str(d.thread.tid)] = {"name": d.thread.thread_name, "pid": d.thread.pid}
            track_tid[d.uuid] = str(d.thread.tid)
        if d.HasField("name"):
            parent = track_name.get(d.parent_uuid, "") if d.HasField("parent_uuid") else ""
            track_name[d.uuid] = d.name
            track_name[d.uuid, "key"] = parent + "/" + d.name
    elif kind == "ftrace_events":
        for e in p.ftrace_events.event:
            ev = e.WhichOneof("event")
            if ev == "sched_switch":
                if e.sched_switch.next_pid:
                    out["switch_in"][str(e.sched_switch.next_pid)] += 1
                if e.sched_switch.prev_pid:
                    out["switch_out"][str(e.sched_switch.prev_pid)] += 1
            elif ev == "sched_waking":
                out["wakings"][str(e.sched_waking.pid)] += 1
    elif kind == "track_event":
        e = p.track_event
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            depth[e.track_uuid] += 1
        elif e.type == pb.TrackEvent.TYPE_SLICE_END:
            depth[e.track_uuid] -= 1
            if depth[e.track_uuid] < 0:
                out["unbalanced"] += 1
        if e.type in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_INSTANT):
            tid = track_tid.get(e.track_uuid)
            if tid is not None:
                names = out["spans"].setdefault(tid, {})
                names[e.name] = names.get(e.name, 0) + 1
            key = track_name.get((e.track_uuid, "key"))
            if key is not None:
                out["named"][key] += 1
        where = track_name.get((e.track_uuid, "key")) or "tid:" + str(track_tid.get(e.track_uuid))
        out["flow_out"] += [[i, where] for i in e.flow_ids]
        out["flow_in"] += [[i, where] for i in e.terminating_flow_ids]
out["unbalanced"] += sum(1 for v in depth.values() if v != 0)
print(json.dumps(out))
"#;

/// Summarizes `path` with `python` (see [`SUMMARIZE`]).
pub fn summarize(python: &Path, path: &Path) -> serde_json::Value {
    let out = Command::new(python)
        .args(["-c", SUMMARIZE])
        .arg(path)
        .output()
        .expect("running python");
    assert!(
        out.status.success(),
        "perfetto_trace_pb2 could not read {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("summary is JSON")
}
