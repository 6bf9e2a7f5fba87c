//! Mixed stacks on the frameworks ML programs run: a jax loop and a PyTorch
//! CPU loop (PyPI's jaxlib and torch, from the venv of `cargo xtask
//! setup`). The Python caller of each framework call and the framework's
//! C++ frames under it are in the same stack, in the order they ran, each
//! Python frame at the line of the script that made the call.

use std::path::Path;

use ebtrace_tests::{
    TempDir,
    pyenv::{self, PyFrame, function_lines, python_fixture, python_frames},
    python::{PythonWorkload, jax_python},
    require_root, serial,
    xprof::python_with,
    xspace::Event,
};

/// One frame of a stack's text: a Python frame, or a native function.
enum Frame {
    Python(PyFrame),
    Native(String),
}

impl Frame {
    fn python(&self) -> Option<&PyFrame> {
        match self {
            Frame::Python(f) => Some(f),
            Frame::Native(_) => None,
        }
    }

    fn native(&self) -> Option<&str> {
        match self {
            Frame::Python(_) => None,
            Frame::Native(name) => Some(name),
        }
    }
}

/// The frames of a sample's stack, innermost first.
fn frames(sample: &Event) -> Vec<Frame> {
    sample.stats["cpu_sample_stack"]
        .as_str()
        .lines()
        .map(|l| match python_frames(l).pop() {
            Some(f) => Frame::Python(f),
            None => Frame::Native(l.to_string()),
        })
        .collect()
}

/// The line of `script` that holds `text`.
fn line_of(script: &Path, text: &str) -> u32 {
    let source = std::fs::read_to_string(script).expect("read the script");
    let at = source.lines().position(|l| l.contains(text));
    at.map(|i| i as u32 + 1)
        .unwrap_or_else(|| panic!("{} has no `{text}`", script.display()))
}

/// Whether `f` is `function` of `script`, at a line inside it.
fn is_function(f: &PyFrame, script: &Path, function: &str) -> bool {
    let lines = function_lines(script);
    let def = function.rsplit('.').next().unwrap_or(function);
    Path::new(&f.file) == script
        && f.function == function
        && lines
            .iter()
            .any(|(name, range)| name == def && range.contains(&f.line))
}

/// Where in `frames` the Python frame of `function` of `script` is.
fn position_of(frames: &[Frame], script: &Path, function: &str) -> Option<usize> {
    frames
        .iter()
        .position(|f| f.python().is_some_and(|f| is_function(f, script, function)))
}

/// Whether a sample ran the script's loop: its outermost Python frames are
/// `train_step`, `main` and `<module>` of `script`; the `train_step` frame.
fn in_the_loop<'a>(frames: &'a [Frame], script: &Path) -> Option<&'a PyFrame> {
    let python: Vec<&PyFrame> = frames.iter().filter_map(Frame::python).collect();
    let [.., step, main, module] = python.as_slice() else {
        return None;
    };
    (is_function(step, script, "train_step")
        && is_function(main, script, "main")
        && module.function == "<module>"
        && Path::new(&module.file) == script)
        .then_some(*step)
}

/// Records the script's process at 99 Hz for 3 s; the samples of its main
/// thread.
fn sample_main_thread(workload: &PythonWorkload) -> Vec<Event> {
    let logdir = TempDir::new("framework-stacks");
    let summary = pyenv::record_json(workload.pid, "3s", &logdir, &["--sample-hz", "99"]);
    let python = &summary["python_stacks"];
    assert_eq!(python["unreadable_frames"], 0, "{python}");
    pyenv::sampled_events(&logdir, workload.pid, "cpu_sample_stack")
}

fn stack_text(sample: &Event) -> &str {
    sample.stats["cpu_sample_stack"].as_str()
}

/// A PyTorch training loop: the forward ops' ATen C++ frames sit under
/// `Model.forward` and the line of `train_step` that calls the model;
/// autograd's engine sits under `Tensor.backward` and the line that calls
/// `loss.backward()`. A sample in ATen's code is named after its native
/// function, not after the Python line.
#[test]
fn a_pytorch_loop_shows_its_python_lines_over_atens_frames() {
    if !require_root("a_pytorch_loop_shows_its_python_lines_over_atens_frames") {
        return;
    }
    let Some(python) = python_with(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let script = python_fixture("torch_loop.py");
    let forward_call = line_of(&script, "loss = F.cross_entropy(model(x), y)");
    let backward_call = line_of(&script, "loss.backward()");
    let workload = PythonWorkload::start_script(&python, &script, &[], &[]);
    let samples = sample_main_thread(&workload);
    assert!(samples.len() >= 150, "{} samples", samples.len());

    let (mut in_loop, mut in_forward, mut forward_in_aten, mut backward_in_engine) = (0, 0, 0, 0);
    for sample in &samples {
        let frames = frames(sample);
        let Some(step) = in_the_loop(&frames, &script) else {
            continue;
        };
        in_loop += 1;
        let text = stack_text(sample);
        if let Some(forward) = position_of(&frames, &script, "Model.forward") {
            in_forward += 1;
            assert_eq!(step.line, forward_call, "{text}");
            let aten = frames[..forward]
                .iter()
                .filter_map(Frame::native)
                .any(|n| n.starts_with("at::_ops::"));
            forward_in_aten += usize::from(aten);
            if frames[0].native().is_some_and(|n| n.contains("at::")) {
                assert!(text.starts_with(&sample.name), "{}:\n{text}", sample.name);
            }
        }
        let backward = frames.iter().position(|f| {
            f.python()
                .is_some_and(|f| f.function == "Tensor.backward" && f.file.ends_with("_tensor.py"))
        });
        if let Some(backward) = backward {
            assert_eq!(step.line, backward_call, "{text}");
            let engine = frames[..backward]
                .iter()
                .filter_map(Frame::native)
                .any(|n| n.starts_with("torch::autograd::Engine::"));
            backward_in_engine += usize::from(engine);
        }
    }
    let n = samples.len();
    assert!(
        in_loop * 10 >= n * 9,
        "{in_loop} of {n} samples under the loop"
    );
    // MKL's kernels keep no frame pointers: a sample in one loses the
    // native frames between it and the interpreter, so fewer samples show
    // ATen's than ran in it. The model is small, so that most of the
    // forward pass is ATen's dispatch rather than MKL's matrix products
    // (about half of its samples show ATen's frames).
    assert!(
        forward_in_aten * 4 >= in_forward && in_forward * 10 >= n,
        "{forward_in_aten} of {in_forward} samples under Model.forward in ATen, of {n}"
    );
    assert!(
        backward_in_engine * 20 >= n,
        "{backward_in_engine} of {n} samples in autograd's engine under Tensor.backward"
    );
}

/// A jax loop: jaxlib's C++ (the jitted function's dispatch, the wait for
/// its result) sits under the line of `train_step` that calls the jitted
/// step.
#[test]
fn a_jax_loop_shows_the_jitted_steps_caller_over_jaxlibs_frames() {
    if !require_root("a_jax_loop_shows_the_jitted_steps_caller_over_jaxlibs_frames") {
        return;
    }
    let Some(python) = jax_python() else {
        return;
    };
    let _serial = serial();
    let script = python_fixture("jax_loop.py");
    let call = line_of(&script, "return step(x, w).block_until_ready()");
    let workload = PythonWorkload::start_script(&python, &script, &[], &[("JAX_PLATFORMS", "cpu")]);
    let samples = sample_main_thread(&workload);
    assert!(samples.len() >= 20, "{} samples", samples.len());

    let (mut in_loop, mut in_jaxlib) = (0, 0);
    for sample in &samples {
        let frames = frames(sample);
        let Some(step) = in_the_loop(&frames, &script) else {
            continue;
        };
        in_loop += 1;
        let at = position_of(&frames, &script, "train_step").expect("train_step");
        let jaxlib = frames[..at]
            .iter()
            .filter_map(Frame::native)
            .any(|n| n.starts_with("jax::") || n.contains(" jax::") || n.starts_with("xla::"));
        if jaxlib {
            assert_eq!(step.line, call, "{}", stack_text(sample));
            in_jaxlib += 1;
        }
    }
    let n = samples.len();
    assert!(
        in_loop * 10 >= n * 8,
        "{in_loop} of {n} samples under the loop"
    );
    assert!(
        in_jaxlib * 2 >= in_loop,
        "{in_jaxlib} of {in_loop} samples in jaxlib's C++ under train_step"
    );
}
