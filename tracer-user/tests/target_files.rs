//! A file a traced process names is opened only through
//! `procfs::TargetRoot`, which looks it up inside the process's root as
//! its own loader would (absolute links stay inside, only regular files
//! are read, never a FIFO or a device). A path built into `/proc/PID/root`
//! and opened as any other would follow the process's absolute links into
//! ebtrace's own root and open whatever is there: this reads every source
//! file outside `src/procfs/` and names each line that builds one.

use std::{
    fs,
    path::{Path, PathBuf},
};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether a line of code (not a comment) reaches into a process's root
/// by a path: `root_dir(…)`, or a string naming `/proc/…/root`, or
/// `"root"` joined to a process's directory.
fn builds_a_path_into_a_root(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or_default();
    code.contains("root_dir(")
        || (code.contains("/proc/") && code.contains("/root"))
        || (code.contains(".join(\"root\")") && code.contains("process_dir"))
}

#[test]
fn files_of_a_process_are_opened_only_through_its_held_root() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut found = Vec::new();
    for file in files.iter().filter(|f| !f.starts_with(src.join("procfs"))) {
        let text = fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            if builds_a_path_into_a_root(line) {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "open these through procfs::TargetRoot instead:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_sees_each_way_of_building_such_a_path() {
    assert!(builds_a_path_into_a_root(
        "let p = procfs::root_dir(pid).join(path);"
    ));
    assert!(builds_a_path_into_a_root(
        "let p = format!(\"/proc/{pid}/root{path}\");"
    ));
    assert!(builds_a_path_into_a_root(
        "let p = process_dir(pid).join(\"root\");"
    ));
    assert!(!builds_a_path_into_a_root(
        "// procfs::root_dir(pid) is gone"
    ));
    assert!(!builds_a_path_into_a_root(
        "let root = TargetRoot::open(pid)?;"
    ));
}
