//! Files mapped into ebtrace's memory (the ELF objects of the targets,
//! which their owners may truncate at any moment) must not kill it when
//! they shrink: a read past a mapped file's new end raises `SIGBUS`
//! (`BUS_ADRERR`). ebtrace answers it by mapping a page of zeros where the
//! read went, so the read sees zeros, as if the file held them: whatever
//! parses it already treats the file's contents as untrusted.

use std::sync::Once;

/// The page a fault is answered with: file mappings use base pages.
const PAGE: usize = 4096;

/// Installs the `SIGBUS` handler (once per process).
pub fn survive_truncated_files() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: installs a handler that only makes async-signal-safe
        // calls (mmap, sigaction, raise); the action is fully initialised.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
        }
    });
}

extern "C" fn on_sigbus(sig: i32, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: `info` is the kernel's siginfo for this signal; the calls are
    // async-signal-safe.
    unsafe {
        if (*info).si_code == libc::BUS_ADRERR {
            let page = ((*info).si_addr() as usize) & !(PAGE - 1);
            let zeros = libc::mmap(
                page as *mut libc::c_void,
                PAGE,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            );
            if zeros != libc::MAP_FAILED {
                return;
            }
        }
        // Any other bus error ends ebtrace as it would have without this
        // handler: a fault happens again on return, a sent signal is sent
        // again.
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &default, std::ptr::null_mut());
        if (*info).si_code <= 0 {
            libc::raise(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// A mapped file truncated under the mapping: reading past its new end
    /// gives zeros instead of ending the process.
    #[test]
    fn a_read_past_a_truncated_files_end_gives_zeros() {
        survive_truncated_files();
        let path = std::env::temp_dir().join(format!("ebtrace-truncated-{}", std::process::id()));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.write_all(&[7u8; 4 * PAGE]).unwrap();
        // SAFETY: a private read-only mapping of a file this test owns.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        assert_eq!(map[0], 7);
        file.set_len(0).unwrap();
        let seen: Vec<u8> = map.iter().step_by(PAGE / 2).copied().collect();
        assert!(seen.iter().all(|b| *b == 0), "{seen:?}");
        drop(map);
        std::fs::remove_file(&path).unwrap();
    }
}
