//! ebtrace's reading of interpreter objects against the objects' own
//! symbol tables: where a CPython build names its eval loop's cold part
//! (`_PyEval_EvalFrameDefault.cold`, a local symbol), the part ebtrace
//! finds from `.eh_frame` alone, as it must in stripped interpreters
//! (Debian's, Ubuntu's), is that one; where a build's full symbol table
//! has none, ebtrace finds none.

use std::path::PathBuf;

use ebtrace::symbols::{ElfObject, unwind::cold_part_after};
use ebtrace_tests::pyenv;

/// The object of 3.`minor` that holds the interpreter: its libpython if
/// it has one, else its executable.
fn interpreter_object(minor: u8) -> PathBuf {
    let python = pyenv::cpython(minor);
    let prefix = python.parent().and_then(|p| p.parent()).expect("a prefix");
    let shared = prefix.join(format!("lib/libpython3.{minor}.so.1.0"));
    if shared.exists() { shared } else { python }
}

#[test]
fn the_eval_loops_cold_part_is_found_without_its_symbol() {
    let (mut with_part, mut without) = (Vec::new(), Vec::new());
    for minor in pyenv::MINORS {
        let path = interpreter_object(minor);
        let elf = ElfObject::open(&path, None).expect("open the interpreter");
        let scan = elf
            .scan(
                &["_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold"],
                |_| true,
            )
            .expect("scan its symbols");
        let hot = scan.found[0].expect("the eval loop's symbol");
        let found = cold_part_after(&elf, hot.vaddr);
        if elf.section(".symtab").is_none() {
            // Stripped: nothing to check against here; the stack tests
            // check where its Python frames go.
            println!("3.{minor} ({}): stripped; found {found:x?}", path.display());
            continue;
        }
        let named = scan.found[1].map(|cold| cold.vaddr..cold.vaddr + cold.size);
        assert_eq!(found, named, "3.{minor}: {}", path.display());
        if named.is_some() {
            with_part.push(minor);
        } else {
            without.push(minor);
        }
    }
    assert!(
        with_part.len() >= 2 && !without.is_empty(),
        "cold parts named in 3.{with_part:?}, none in 3.{without:?}: too few to check against"
    );
}
