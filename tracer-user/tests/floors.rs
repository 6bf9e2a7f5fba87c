//! The library's modules stand on floors, which the module map at the top
//! of `src/lib.rs` lists from the bottom, one bullet per floor: a module
//! uses only modules on its own floor and below, so that data flows one
//! way (probes and agent → collector → timeline → sinks). This reads the
//! map and every source file's paths to other modules (code only: comments,
//! doc links and test modules may point anywhere) and names each path that
//! climbs.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The floors of the module map in `lib.rs`: module name → floor, from 0.
fn floors(lib: &str) -> BTreeMap<String, usize> {
    let mut floors = BTreeMap::new();
    let mut floor = None;
    for line in lib.lines().map_while(|l| l.strip_prefix("//!")) {
        if line.starts_with(" - ") {
            floor = Some(floor.map_or(0, |f| f + 1));
        } else if !line.starts_with("   ") {
            continue;
        }
        let Some(floor) = floor else { continue };
        for part in line.split("[`").skip(1) {
            let name = part.split('`').next().unwrap_or_default();
            if !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                floors.insert(name.to_string(), floor);
            }
        }
    }
    floors
}

/// `source` without comments, string and character literals, and items
/// under `#[cfg(test)]`.
fn code_only(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => break,
                        _ => escaped = false,
                    }
                }
                out.push_str("\"\"");
            }
            // A character literal ('{', '\n'); a lifetime stays.
            '\'' => {
                let rest: String = chars.clone().take(4).collect();
                let len = if rest.starts_with('\\') {
                    rest.find('\'').map(|i| i + 1)
                } else if rest.chars().nth(1) == Some('\'') {
                    Some(rest.chars().next().map_or(0, char::len_utf8) + 1)
                } else {
                    None
                };
                match len {
                    Some(len) => {
                        let mut taken = 0;
                        while taken < len {
                            taken += chars.next().map_or(len, char::len_utf8);
                        }
                    }
                    None => out.push(c),
                }
            }
            _ => out.push(c),
        }
    }
    without_test_items(&out)
}

/// `code` without each item under `#[cfg(test)]` (to its matching brace, or
/// its semicolon).
fn without_test_items(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let end = match (item.find('{'), item.find(';')) {
            (Some(open), semi) if semi.is_none_or(|s| open < s) => {
                let mut depth = 0;
                item[open..]
                    .char_indices()
                    .find_map(|(i, c)| {
                        match c {
                            '{' => depth += 1,
                            '}' => depth -= 1,
                            _ => return None,
                        }
                        (depth == 0).then_some(open + i + 1)
                    })
                    .unwrap_or(item.len())
            }
            (_, Some(semi)) => semi + 1,
            _ => item.len(),
        };
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The top-level modules `code`, in a module `depth` levels below the
/// crate's root, names through `crate::` or enough `super::`s.
fn modules_named(code: &str, depth: usize) -> Vec<String> {
    let mut named = Vec::new();
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':' || c == '{'))
        .collect();
    for word in words {
        let mut path = word;
        let mut ups = 0;
        while let Some(rest) = path.strip_prefix("super::") {
            ups += 1;
            path = rest;
        }
        let at_root = match path.strip_prefix("crate::") {
            Some(rest) => Some(rest),
            None if ups >= depth && ups > 0 => Some(path),
            None => None,
        };
        let Some(rest) = at_root else { continue };
        if let Some(group) = rest.strip_prefix('{') {
            named.extend(
                group
                    .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .filter(|s| !s.is_empty())
                    .take(1)
                    .map(|s| s.split("::").next().unwrap_or(s).to_string()),
            );
        } else {
            named.push(rest.split("::").next().unwrap_or(rest).to_string());
        }
    }
    named
}

/// A `use crate::{a::X, b::{Y, Z}}` group names each of its top-level
/// modules: the words above split at the braces, so groups are read here.
fn grouped_modules(code: &str) -> Vec<String> {
    let mut named = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::{") {
        let group = &rest[at + "crate::{".len()..];
        let mut depth = 1;
        let mut start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 1 => {
                    named.push(first_segment(&group[start..i]));
                    start = i + 1;
                }
                _ => {}
            }
            if depth == 0 {
                named.push(first_segment(&group[start..i]));
                break;
            }
        }
        rest = group;
    }
    named.retain(|n| !n.is_empty());
    named
}

fn first_segment(path: &str) -> String {
    path.trim()
        .split("::")
        .next()
        .unwrap_or_default()
        .trim_matches(|c: char| !(c.is_alphanumeric() || c == '_'))
        .to_string()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_uses_one_on_a_floor_above_it() {
    let src = src();
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    let floors = floors(&lib);
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';'))
        .collect();
    assert!(declared.len() > 10, "no modules read from lib.rs");
    for m in &declared {
        assert!(
            floors.contains_key(*m),
            "module `{m}` is not on the module map at the top of src/lib.rs: add it to its floor"
        );
    }

    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut climbs = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let parts: Vec<String> = rel
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let top = parts[0].trim_end_matches(".rs");
        let Some(&floor) = floors.get(top) else {
            continue;
        };
        let depth = parts.len() - usize::from(parts.last().is_some_and(|p| p == "mod.rs"));
        let code = code_only(&fs::read_to_string(file).unwrap());
        let mut named = modules_named(&code, depth);
        named.extend(grouped_modules(&code));
        for other in named {
            if let Some(&above) = floors.get(other.as_str())
                && above > floor
            {
                climbs.push(format!(
                    "{} (floor {floor}) uses `{other}` (floor {above})",
                    rel.display()
                ));
            }
        }
    }
    climbs.sort();
    climbs.dedup();
    assert!(
        climbs.is_empty(),
        "modules use modules on a floor above theirs (move the type or function to the floor \
         that owns it, or change the map in src/lib.rs if the floors are wrong):\n{}",
        climbs.join("\n")
    );
}

/// The reader finds what it must: a path in a test module or a comment is
/// not a use, one in code (grouped or not, or through `super::`) is.
#[test]
fn the_reader_sees_code_paths_only() {
    let code = code_only(
        "use crate::{clock::ClockSync, sink::{a, b}};\n\
         // crate::server::x\n\
         let s = \"crate::cli\"; let c = '{';\n\
         fn f<'a>() { super::super::capture::run() }\n\
         #[cfg(test)]\nmod tests { use crate::metrics; }\n\
         use crate::timeline::Timeline;\n",
    );
    let mut named = modules_named(&code, 2);
    named.extend(grouped_modules(&code));
    named.sort();
    named.dedup();
    assert_eq!(named, ["capture", "clock", "sink", "timeline"]);
    let lib = "//! - [`procfs`], [`error`];\n//!   more [`clock`]\n//! - [`collect`]: x\n\
               //! - [`timeline`]\n";
    let floors = floors(lib);
    assert_eq!(floors["clock"], 0);
    assert_eq!(floors["collect"], 1);
    assert_eq!(floors["timeline"], 2);
}
