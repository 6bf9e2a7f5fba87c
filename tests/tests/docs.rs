//! The manual's flag tables say what `--help` says: every flag of a
//! command is in its table and every flag in a table is the command's, with
//! the default `--help` prints.

use std::{collections::BTreeMap, path::Path, process::Command};

use ebtrace_tests::ebtrace_bin;

/// Long flag name (without dashes) to its `[default: ...]`, if any, as
/// `ebtrace ARGS --help` prints them.
fn help_flags(args: &[&str]) -> BTreeMap<String, Option<String>> {
    let out = Command::new(ebtrace_bin())
        .args(args)
        .arg("--help")
        .output()
        .expect("run ebtrace --help");
    assert!(out.status.success(), "ebtrace {args:?} --help failed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut flags = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('-') && line.starts_with(' ') {
            current = trimmed
                .split([',', ' '])
                .find_map(|w| w.strip_prefix("--"))
                .filter(|name| !matches!(*name, "help" | "version"))
                .map(str::to_string);
            if let Some(name) = &current {
                flags.insert(name.clone(), None);
            }
        }
        if let (Some(name), Some(at)) = (&current, line.find("[default: ")) {
            let value = &line[at + "[default: ".len()..];
            let value = value[..value.find(']').unwrap_or(value.len())].to_string();
            flags.insert(name.clone(), Some(value));
        }
    }
    flags
}

/// Long flag name to the text of its row, from the table of `page` whose
/// rows start with a flag in backticks.
fn table_flags(page: &str) -> BTreeMap<String, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs")
        .join(page);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.lines()
        .filter_map(|row| {
            let first = row.strip_prefix("| `")?;
            let flag = &first[..first.find('`')?];
            let name = flag.split([',', ' ']).find_map(|w| w.strip_prefix("--"))?;
            Some((name.to_string(), row.replace(['`', ','], "")))
        })
        .collect()
}

fn assert_table_matches_help(page: &str, args: &[&str]) {
    let help = help_flags(args);
    let table = table_flags(page);
    assert!(!help.is_empty() && !table.is_empty(), "nothing read");
    let missing: Vec<_> = help.keys().filter(|f| !table.contains_key(*f)).collect();
    let unknown: Vec<_> = table.keys().filter(|f| !help.contains_key(*f)).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/{page}: flags of `ebtrace {}` missing from its table: {missing:?}; \
         in the table but not a flag: {unknown:?}",
        args.join(" ")
    );
    for (flag, default) in &help {
        let Some(default) = default else { continue };
        let default = default.replace(',', "");
        assert!(
            table[flag].contains(&default),
            "docs/{page}: the row of --{flag} does not give its default {default:?}: {}",
            table[flag]
        );
    }
}

#[test]
fn the_record_flag_table_says_what_help_says() {
    assert_table_matches_help("recording.md", &[]);
}

#[test]
fn the_serve_flag_table_says_what_help_says() {
    assert_table_matches_help("serve.md", &["serve"]);
}

/// Markdown files of the repository's documentation, relative to its root.
fn doc_files(root: &Path) -> Vec<std::path::PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("docs/").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files
}

/// Every relative link of the documentation leads to a file or folder of
/// the repository (anchors aside).
#[test]
fn every_link_of_the_documentation_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in doc_files(&root) {
        let text = std::fs::read_to_string(&file).expect("read");
        let mut in_code = false;
        for line in text.lines() {
            if line.trim_start().starts_with("```") {
                in_code = !in_code;
            }
            if in_code {
                continue;
            }
            for part in line.split("](").skip(1) {
                let Some(end) = part.find(')') else { continue };
                let target = &part[..end];
                let target = target.split('#').next().unwrap_or_default();
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let resolved = file.parent().expect("in a folder").join(target);
                if !resolved.exists() {
                    broken.push(format!("{}: {target}", file.display()));
                }
            }
        }
    }
    assert!(checked > 20, "too few links found ({checked})");
    assert!(broken.is_empty(), "links that lead nowhere: {broken:#?}");
}
