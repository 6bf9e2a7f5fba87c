//! Python stacks deeper than a sample keeps, on real CPython processes of
//! every version ebtrace reads: each sample keeps both ends of the stack,
//! the innermost frame and `<module>`, with one marker where frames were
//! left out, and the frames left out are counted as such, as many as the
//! script's own count of its frames says.

use ebtrace_tests::{
    TempDir,
    pyenv::{self, python_fixture, python_frames},
    python::PythonWorkload,
    require_root, serial,
};

/// Frames a sample keeps of the inner end of a deep stack (the manual's
/// figure, `docs/recording.md`).
const INNER_FRAMES: usize = 96;
/// And of its outer end, entry frames of no function's included.
const OUTER_FRAMES: usize = 32;

const LEFT_OUT: &str = "[python frames left out: the stack is deeper than ebtrace keeps]";

/// On CPython 3.`minor`, a recursion 400 deep spinning at its bottom: every
/// sample of it holds `bottom` innermost, then 95 frames of `descend`, the
/// marker, and the outer end down to `<module>`; the summary counts the
/// frames between as left out (the script's count less those named), and
/// none as unreadable.
fn a_deep_recursion_keeps_both_ends(minor: u8) {
    let test = format!("python_3_{minor}_a_deep_recursion_keeps_both_ends");
    if !require_root(&test) {
        return;
    }
    let _serial = serial();
    let script = python_fixture("deep_recursion.py");
    let workload = PythonWorkload::start_script(&pyenv::cpython(minor), &script, &["400"], &[]);
    let frames = workload.start_line["frames"].as_u64().expect("frames") as usize;
    assert!(frames > 400, "the script counts {frames} frames");
    let logdir = TempDir::new("python-deep");
    let summary = pyenv::record_json(workload.pid, "2s", &logdir, &["--sample-hz", "99"]);
    let samples = pyenv::sampled_events(&logdir, workload.pid, "cpu_sample_stack");
    assert!(
        samples.len() >= 100,
        "3.{minor}: {} samples in 2 s at 99 Hz",
        samples.len()
    );
    let mut named_in_all = 0;
    for s in &samples {
        let stack = s.stats["cpu_sample_stack"].as_str();
        let lines: Vec<&str> = stack.lines().collect();
        let markers: Vec<&&str> = lines.iter().filter(|l| l.starts_with('[')).collect();
        assert_eq!(
            markers,
            [&LEFT_OUT],
            "3.{minor}: one marker, no other:\n{stack}"
        );
        let gap = lines.iter().position(|l| *l == LEFT_OUT).expect("a marker");
        let inner = python_frames(&lines[..gap].join("\n"));
        let outer = python_frames(&lines[gap..].join("\n"));
        let names = |f: &[pyenv::PyFrame]| f.iter().map(|f| f.function.clone()).collect::<Vec<_>>();
        let expected_inner: Vec<String> = std::iter::once("bottom")
            .chain(std::iter::repeat_n("descend", INNER_FRAMES - 1))
            .map(String::from)
            .collect();
        assert_eq!(names(&inner), expected_inner, "3.{minor}:\n{stack}");
        // Of the outer end: `descend`s, then `<module>`, less an entry frame
        // of no function's below it (3.12 on).
        assert!(
            (OUTER_FRAMES - 1..=OUTER_FRAMES).contains(&outer.len()),
            "3.{minor}: {} frames after the marker:\n{stack}",
            outer.len()
        );
        let outer_names = names(&outer);
        let (module, descends) = outer_names.split_last().expect("frames");
        assert_eq!(module, "<module>", "3.{minor}:\n{stack}");
        assert!(
            descends.iter().all(|f| f == "descend"),
            "3.{minor}:\n{stack}"
        );
        assert!(
            outer.iter().all(|f| f.file.ends_with("deep_recursion.py")),
            "3.{minor}:\n{stack}"
        );
        named_in_all += inner.len() + outer.len();
    }
    let python = &summary["python_stacks"];
    assert_eq!(python["unreadable_frames"], 0, "3.{minor}: {python}");
    let laid = python["stacks_with_python"].as_u64().unwrap() as usize;
    assert_eq!(laid, samples.len(), "3.{minor}: {python}");
    assert_eq!(
        python["frames_beyond_limit"].as_u64().unwrap() as usize,
        frames * samples.len() - named_in_all,
        "3.{minor}: the script has {frames} frames, in {} samples: {python}",
        samples.len()
    );
    drop(workload);
}

#[test]
fn python_3_10_a_deep_recursion_keeps_both_ends() {
    a_deep_recursion_keeps_both_ends(10);
}

#[test]
fn python_3_11_a_deep_recursion_keeps_both_ends() {
    a_deep_recursion_keeps_both_ends(11);
}

#[test]
fn python_3_12_a_deep_recursion_keeps_both_ends() {
    a_deep_recursion_keeps_both_ends(12);
}

#[test]
fn python_3_13_a_deep_recursion_keeps_both_ends() {
    a_deep_recursion_keeps_both_ends(13);
}

#[test]
fn python_3_14_a_deep_recursion_keeps_both_ends() {
    a_deep_recursion_keeps_both_ends(14);
}
