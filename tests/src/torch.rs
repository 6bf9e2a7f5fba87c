//! The PyTorch loop the tests trace (`torch_ops_loop.py`): starting it,
//! what it says of its steps and of what its own profiler recorded, and
//! the op spans ebtrace wrote of it.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::MutexGuard,
};

use ebtrace_proto::tensorflow::profiler::XSpace;

use crate::{
    TempDir,
    pyenv::python_fixture,
    python::PythonWorkload,
    require_root, serial, xplane_files,
    xprof::python_with,
    xspace::{self, Event, line_events, plane},
};

pub const STEP: &str = "train_step";
/// The stat holding an op span's kind.
pub const SCOPE_STAT: &str = "torch_scope";
/// The stat holding an op span's sequence number.
pub const SEQUENCE_STAT: &str = "sequence_number";
/// XProf's stat of an arrow's end.
pub const FLOW_STAT: &str = "flow";
/// The stat holding an ATen op's input shapes.
pub const SHAPES_STAT: &str = "input_shapes";

/// An op's kind and name.
pub type OpKey = (String, String);

/// What torch.profiler recorded inside its train_step ranges.
pub struct Profiled {
    pub steps: f64,
    /// Per step.
    pub counts: HashMap<OpKey, f64>,
    /// Per step, those with a sequence number.
    pub numbered: HashMap<OpKey, f64>,
    /// Each backward function's name, with the names of the forward ops
    /// sharing its sequence number.
    pub forward_of: BTreeMap<String, BTreeSet<String>>,
    /// Per step, each ATen op with each list of input shapes (name, then
    /// shapes as `record_shapes` writes them).
    pub shapes: HashMap<OpKey, f64>,
    /// On how many threads each ran.
    pub threads: HashMap<OpKey, u64>,
}

/// ebtrace's name of RecordScope `scope`.
pub fn scope_name(scope: &str) -> &'static str {
    match scope {
        "0" => "function",
        "1" => "backward_function",
        "7" => "user_scope",
        _ => "other",
    }
}

/// What the loop says of itself when asked.
pub struct LoopReport {
    /// Its steps since the last ask, as (start, end) wall-clock ns.
    pub steps: Vec<(f64, f64)>,
    /// Whether PyTorch had RecordFunction callbacks (`at::hasCallbacks()`).
    pub has_callbacks: bool,
}

/// What the loop says of itself, and what its own profiler then recorded.
pub fn ask(workload: &mut PythonWorkload) -> (LoopReport, Profiled) {
    workload.signal(libc::SIGUSR1);
    let report = workload.next_line();
    let profiled = read_profiled(workload);
    let steps = report["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| (s[0].as_f64().unwrap(), s[1].as_f64().unwrap()))
        .collect();
    let report = LoopReport {
        steps,
        has_callbacks: report["has_callbacks"].as_bool().expect("has_callbacks"),
    };
    (report, profiled)
}

/// What the loop's own profiler recorded, as it prints it.
pub fn read_profiled(workload: &mut PythonWorkload) -> Profiled {
    let p = workload.next_line();
    let n = p["profiled_steps"].as_f64().expect("profiled steps");
    let key = |k: &str| {
        let (scope, name) = k.split_once('\t').expect("scope\tname");
        (scope_name(scope).to_string(), name.to_string())
    };
    let per_step = |field: &str| {
        p[field]
            .as_object()
            .expect(field)
            .iter()
            .map(|(k, v)| (key(k), v.as_f64().unwrap() / n))
            .filter(|((scope, _), _)| scope != "other")
            .collect()
    };
    let forward_of = p["forward_of"]
        .as_object()
        .expect("forward_of")
        .iter()
        .map(|(k, v)| {
            let names = v.as_array().expect("names").iter();
            let names = names.map(|n| n.as_str().unwrap().to_string());
            (k.clone(), names.collect())
        })
        .collect();
    let threads = p["thread_count"]
        .as_object()
        .expect("threads")
        .iter()
        .map(|(k, v)| (key(k), v.as_u64().unwrap()))
        .collect();
    let shapes = p["shapes"]
        .as_object()
        .expect("shapes")
        .iter()
        .map(|(k, v)| {
            let (name, shapes) = k.split_once('\t').expect("name\tshapes");
            (
                (name.to_string(), shapes.to_string()),
                v.as_f64().unwrap() / n,
            )
        })
        .collect();
    Profiled {
        steps: n,
        shapes,
        counts: per_step("counts"),
        numbered: per_step("numbered"),
        forward_of,
        threads,
    }
}

/// The op spans of every thread line of the host plane, by line, their
/// times wall-clock ns; but for a train_step range reaching the trace's
/// end: cut there (a client's `max_events` ends a trace early), its later
/// ops are not in the trace.
pub fn op_lines(logdir: &TempDir) -> HashMap<i64, Vec<Event>> {
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let space = xspace::load(&files[0]);
    let (start, stop) = xspace::profile_window(&space);
    let cut_at_stop = |e: &Event| e.name == STEP && e.end_ns() + 1_000.0 >= stop as f64;
    let host = plane(&space, "/host:CPU");
    host.lines
        .iter()
        .map(|l| {
            let ops: Vec<Event> = line_events(host, l.id)
                .into_iter()
                .filter(|e| e.stats.contains_key(SCOPE_STAT))
                .map(|mut e| {
                    e.start_ns += start as f64;
                    e
                })
                .filter(|e| !cut_at_stop(e))
                .collect();
            (l.id, ops)
        })
        .filter(|(_, ops)| !ops.is_empty())
        .collect()
}

/// The op spans on every line of `space`'s host plane.
pub fn op_spans(space: &XSpace) -> Vec<Event> {
    let host = plane(space, "/host:CPU");
    host.lines
        .iter()
        .flat_map(|l| line_events(host, l.id))
        .filter(|e| e.stats.contains_key(SCOPE_STAT))
        .collect()
}

pub fn key_of(e: &Event) -> OpKey {
    (e.stats[SCOPE_STAT].as_str().to_string(), e.name.clone())
}

/// The train_step spans of `ops`, and the ops inside them per step.
pub fn per_step(ops: &[Event]) -> (Vec<&Event>, HashMap<OpKey, f64>) {
    let mut steps: Vec<&Event> = ops.iter().filter(|e| e.name == STEP).collect();
    steps.sort_by(|a, b| a.start_ns.total_cmp(&b.start_ns));
    let mut counts: HashMap<OpKey, f64> = HashMap::new();
    for e in ops.iter().filter(|e| e.name != STEP) {
        let i = steps.partition_point(|s| s.start_ns <= e.start_ns);
        if i > 0 && e.end_ns() <= steps[i - 1].end_ns() {
            *counts.entry(key_of(e)).or_default() += 1.0;
        }
    }
    for c in counts.values_mut() {
        *c /= steps.len().max(1) as f64;
    }
    (steps, counts)
}

/// The median time a step of `report` took.
pub fn median_step_ns(report: &LoopReport) -> f64 {
    let mut took: Vec<f64> = report.steps.iter().map(|(a, b)| b - a).collect();
    took.sort_by(f64::total_cmp);
    took[took.len() / 2]
}

pub fn start_loop() -> Option<PythonWorkload> {
    let python = python_with(&["torch"])?;
    let script = python_fixture("torch_ops_loop.py");
    Some(PythonWorkload::start_script(&python, &script, &[], &[]))
}

/// For test `name`, where it can run here (as root, with PyTorch): the
/// tests' turn, and the loop started.
pub fn loop_for(name: &str) -> Option<(MutexGuard<'static, ()>, PythonWorkload)> {
    if !require_root(name) {
        return None;
    }
    let turn = serial();
    Some((turn, start_loop()?))
}
