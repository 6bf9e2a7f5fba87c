use std::{fs::File, io::Write as _};

use rustix::fs::MemfdFlags;

use super::{is_fresh_memfd, seal};

const NAME: &str = "ebtrace-agent.0123456789abcdef";

fn memfd(name: &str) -> File {
    File::from(
        rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .expect("memfd_create"),
    )
}

#[test]
fn only_the_memfd_made_for_the_agent_is_written() {
    assert!(is_fresh_memfd(&memfd(NAME), NAME));
    // The program's own memfd, another file at that number.
    assert!(!is_fresh_memfd(
        &memfd("ebtrace-agent.fedcba9876543210"),
        NAME
    ));
    let mut written = memfd(NAME);
    written.write_all(b"the program's data").unwrap();
    assert!(!is_fresh_memfd(&written, NAME));
    let sealed = memfd(NAME);
    seal(&sealed).unwrap();
    assert!(!is_fresh_memfd(&sealed, NAME));
    // An unlinked file whose name ends the same way.
    let path = std::env::temp_dir().join(format!("memfd:{NAME}"));
    let file = File::create(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(!is_fresh_memfd(&file, NAME));
}
