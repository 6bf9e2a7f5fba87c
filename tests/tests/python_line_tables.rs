//! ebtrace's line table decoder against CPython's own: for every code
//! object of a few standard library modules, under each CPython ebtrace
//! reads (from pyenv), the line `line_at` gives each instruction is the
//! one `co_lines()` gives it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use ebtrace::symbols::python::line_table::{LineTableFormat, line_at};
use ebtrace_tests::{pyenv, workspace_root};

/// Each version must have at least this many instructions checked: fewer
/// means the dump script found next to nothing.
const MIN_OFFSETS: usize = 5000;

/// What one version's check found.
#[derive(Default)]
struct Checked {
    codes: usize,
    offsets: usize,
    /// Instructions `co_lines()` puts on no line.
    no_line: usize,
    /// Instructions `co_lines()` puts on line 0.
    line_zero: usize,
    mismatches: usize,
    /// The first few mismatches, described.
    examples: Vec<String>,
}

impl Checked {
    fn mismatch(&mut self, why: impl FnOnce() -> String) {
        self.mismatches += 1;
        if self.examples.len() < 20 {
            self.examples.push(why());
        }
    }
}

/// Checks every code object `python` dumps.
fn check(python: &Path, minor: u8) -> Checked {
    let script = workspace_root().join("tests/fixtures/python/dump_line_tables.py");
    let out = Command::new(python)
        .arg("-I")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "{} {} failed: {}",
        python.display(),
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let format = LineTableFormat::of_minor(minor);
    let mut checked = Checked::default();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let code: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        checked.codes += 1;
        check_code(format, &code, &mut checked);
    }
    checked
}

/// Checks each instruction of one dumped code object, and the first
/// byte past its last range (no line).
fn check_code(format: LineTableFormat, code: &serde_json::Value, checked: &mut Checked) {
    let first = code["first"].as_u64().expect("first") as u32;
    let table = hex(code["table"].as_str().expect("table"));
    let mut end = 0;
    for range in code["lines"].as_array().expect("lines") {
        let start = range[0].as_u64().expect("start");
        end = range[1].as_u64().expect("end");
        let said = range[2].as_u64();
        // 3.11+ puts a module's first instruction (`RESUME`) on line 0,
        // which `line_at` calls no line: there is no source line 0.
        let expected = said.filter(|&l| l > 0).map(|l| l as u32);
        for offset in (start..end).step_by(2) {
            checked.offsets += 1;
            checked.no_line += usize::from(said.is_none());
            checked.line_zero += usize::from(said == Some(0));
            let found = line_at(format, &table, first, offset);
            if found != expected {
                checked.mismatch(|| {
                    format!(
                        "first line {first}, table {}, offset {offset}: {found:?}, co_lines {said:?}",
                        code["table"]
                    )
                });
            }
        }
    }
    if let Some(found) = line_at(format, &table, first, end) {
        checked.mismatch(|| {
            format!(
                "table {} has line {found} past its end {end}",
                code["table"]
            )
        });
    }
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn line_tables_decode_as_co_lines_does() {
    let pythons: Vec<(u8, PathBuf)> = pyenv::MINORS
        .iter()
        .map(|&minor| (minor, pyenv::cpython(minor)))
        .collect();
    let mut failed = vec![];
    for (minor, python) in pythons {
        let checked = check(&python, minor);
        println!(
            "CPython 3.{minor} ({}): {} code objects, {} instructions ({} on no line, {} on line 0), {} mismatches",
            python.display(),
            checked.codes,
            checked.offsets,
            checked.no_line,
            checked.line_zero,
            checked.mismatches
        );
        for example in &checked.examples {
            println!("  3.{minor}: {example}");
        }
        if checked.mismatches > 0 || checked.offsets < MIN_OFFSETS {
            failed.push(minor);
        }
    }
    assert!(
        failed.is_empty(),
        "line tables of CPython 3.{failed:?} decode differently from co_lines(), or too few \
         instructions were checked: see above"
    );
}
