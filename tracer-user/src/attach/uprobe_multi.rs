//! Multi-uprobe links (`BPF_LINK_TYPE_UPROBE_MULTI`, Linux 6.6+): one link
//! puts one program on many offsets of one file, each offset with its own
//! attach cookie, in one `BPF_LINK_CREATE`.
//!
//! Why: a perf-event uprobe link is destroyed under the kernel's global
//! `event_mutex`, which it holds while it waits for an RCU tasks-trace
//! grace period, so a hundred links take seconds to release whatever the
//! number of threads releasing them, and a capture starting meanwhile waits
//! for that mutex to create its own. A multi-uprobe link unregisters all of
//! its offsets and then waits for one grace period, without that mutex.
//!
//! aya 0.14 can neither load a program for such a link (it needs
//! `expected_attach_type = BPF_TRACE_UPROBE_MULTI`) nor create one, so this
//! module does both with the raw `bpf(2)` calls: it parses ebtrace's eBPF
//! object again with `aya_obj`, points the copy's map references at the
//! maps aya already created (both copies share them), and loads the named
//! programs as kprobe-type programs for multi-uprobe links.

use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use aya_obj::{
    Object,
    generated::{
        BPF_F_UPROBE_MULTI_RETURN, bpf_attach_type, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_type,
    },
};

/// Where a multi-uprobe link's program runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// At the probed instruction.
    Entry,
    /// When the function that starts at the offset returns.
    Return,
}

/// Why the programs for multi-uprobe links could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Re-reading the eBPF object failed.
    #[error("re-reading the eBPF object for uprobe_multi links failed: {0}")]
    Object(String),
    /// A map the programs need was not created.
    #[error("the eBPF object's map {0} was not created; the object and its loader disagree")]
    MissingMap(String),
    /// The object has no such program.
    #[error("the eBPF object has no program {0}")]
    MissingProgram(String),
    /// The kernel refused to load a program.
    #[error("the kernel refused program {program} for uprobe_multi links: {source}{log}")]
    Refused {
        /// The program.
        program: String,
        /// The kernel's error.
        #[source]
        source: io::Error,
        /// The verifier's last lines, if it said anything.
        log: String,
    },
}

impl LoadError {
    /// Whether the kernel itself said no (as opposed to a broken object).
    pub fn errno(&self) -> Option<i32> {
        match self {
            LoadError::Refused { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Programs of ebtrace's object loaded for multi-uprobe links, by name.
#[derive(Debug, Default)]
pub struct Programs {
    fds: HashMap<String, OwnedFd>,
}

impl Programs {
    /// Loads `names` from `object` (the ELF aya loaded), with their map
    /// references resolved to the descriptors of the maps of the same name
    /// that aya created (`maps`), so both copies share their maps.
    pub fn load(
        object: &[u8],
        maps: &[(String, OwnedFd)],
        names: &[&str],
    ) -> Result<Self, LoadError> {
        let mut obj = Object::parse(object).map_err(|e| LoadError::Object(e.to_string()))?;
        if obj.has_btf_relocations() {
            let btf = aya::Btf::from_sys_fs().map_err(|e| LoadError::Object(e.to_string()))?;
            obj.relocate_btf(&btf)
                .map_err(|e| LoadError::Object(e.to_string()))?;
        }
        // Taken out of the object: relocating borrows it mutably.
        let obj_maps = std::mem::take(&mut obj.maps);
        let mut resolved = Vec::with_capacity(obj_maps.len());
        for (name, map) in &obj_maps {
            let fd = maps
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, fd)| fd.as_raw_fd())
                .ok_or_else(|| LoadError::MissingMap(name.clone()))?;
            resolved.push((name.as_str(), fd, map));
        }
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
        obj.relocate_maps(resolved.into_iter(), &text_sections)
            .map_err(|e| LoadError::Object(e.to_string()))?;
        obj.relocate_calls(&text_sections)
            .map_err(|e| LoadError::Object(e.to_string()))?;
        obj.sanitize_functions(aya::features());
        let mut fds = HashMap::new();
        for &name in names {
            let program = obj
                .programs
                .get(name)
                .ok_or_else(|| LoadError::MissingProgram(name.to_string()))?;
            let function = obj
                .functions
                .get(&program.function_key())
                .ok_or_else(|| LoadError::MissingProgram(name.to_string()))?;
            let fd = prog_load(name, &function.instructions, &program.license)?;
            fds.insert(name.to_string(), fd);
        }
        Ok(Programs { fds })
    }

    /// The loaded program called `name`.
    pub fn get(&self, name: &str) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd as _;
        self.fds.get(name).map(|fd| fd.as_fd())
    }

    /// Every loaded program.
    pub fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        use std::os::fd::AsFd as _;
        self.fds.values().map(|fd| fd.as_fd())
    }
}

/// Bytes of verifier log asked for when a load fails.
const VERIFIER_LOG_BYTES: usize = 1 << 20;

/// `BPF_PROG_LOAD` of a kprobe-type program for multi-uprobe links; on
/// failure, loads again with the verifier's log to say why.
fn prog_load(name: &str, insns: &[bpf_insn], license: &CString) -> Result<OwnedFd, LoadError> {
    let attempt = |log: Option<&mut Vec<u8>>| -> io::Result<OwnedFd> {
        // SAFETY: bpf_attr is a plain C union of integers; all zeroes is
        // the "unset" value of every field.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing plain integer fields of the BPF_PROG_LOAD member.
        let load = unsafe { &mut attr.__bindgen_anon_3 };
        load.prog_type = bpf_prog_type::BPF_PROG_TYPE_KPROBE as u32;
        load.expected_attach_type = bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32;
        load.insns = insns.as_ptr() as u64;
        load.insn_cnt = insns.len() as u32;
        load.license = license.as_ptr() as u64;
        // The kernel keeps 15 bytes of a name made of [A-Za-z0-9_.].
        for (dst, src) in load.prog_name.iter_mut().zip(name.bytes().take(15)) {
            *dst = src as libc::c_char;
        }
        if let Some(log) = log {
            load.log_level = 1;
            load.log_buf = log.as_mut_ptr() as u64;
            load.log_size = log.len() as u32;
        }
        // SAFETY: attr is a valid bpf_attr whose pointers (instructions,
        // license, log buffer) outlive the call and whose sizes match them.
        unsafe { bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr) }
    };
    attempt(None).map_err(|first| {
        let mut log = vec![0u8; VERIFIER_LOG_BYTES];
        let source = attempt(Some(&mut log)).err().unwrap_or(first);
        LoadError::Refused {
            program: name.to_string(),
            source,
            log: verifier_tail(&log),
        }
    })
}

/// The last lines of a verifier log, on one line (`""` for an empty log).
fn verifier_tail(log: &[u8]) -> String {
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    let tail = &lines[lines.len().saturating_sub(3)..];
    format!(" (verifier: {})", tail.join(" / "))
}

/// One multi-uprobe link: dropping it detaches the program from every
/// offset at once.
#[derive(Debug)]
pub struct Link {
    _fd: OwnedFd,
}

/// Attaches `program` to `offsets` (file offsets) of the file at `path`,
/// each with its cookie, limited to the process `pid`. A return link fires
/// when the function entered at the offset returns.
pub fn attach(
    program: BorrowedFd<'_>,
    path: &Path,
    offsets: &[u64],
    cookies: &[u64],
    pid: u32,
    kind: Kind,
) -> io::Result<Link> {
    assert_eq!(offsets.len(), cookies.len(), "one cookie per offset");
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: bpf_attr is a plain C union of integers; zeroes are unset.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain integer fields of the BPF_LINK_CREATE member.
    let create = unsafe { &mut attr.link_create };
    create.__bindgen_anon_1.prog_fd = program.as_raw_fd() as u32;
    create.attach_type = bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32;
    // SAFETY: as above, the uprobe_multi member of the same union.
    let multi = unsafe { &mut create.__bindgen_anon_3.uprobe_multi };
    multi.path = path.as_ptr() as u64;
    multi.offsets = offsets.as_ptr() as u64;
    multi.cookies = cookies.as_ptr() as u64;
    multi.cnt = offsets.len() as u32;
    multi.pid = pid;
    if kind == Kind::Return {
        multi.flags = BPF_F_UPROBE_MULTI_RETURN;
    }
    // SAFETY: attr is a valid bpf_attr; path, offsets and cookies outlive
    // the call and cnt is the length of both arrays.
    let fd = unsafe { bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr) }?;
    Ok(Link { _fd: fd })
}

/// Puts `program` at `index` of the program array `map`, for tail calls
/// from the programs loaded here (a tail call needs a program of the
/// caller's attach type: these, not aya's).
pub fn set_jump(map: BorrowedFd<'_>, index: u32, program: BorrowedFd<'_>) -> io::Result<()> {
    let value = program.as_raw_fd() as u32;
    // SAFETY: bpf_attr is a plain C union of integers; zeroes are unset.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing plain integer fields of the map element member.
    let elem = unsafe { &mut attr.__bindgen_anon_2 };
    elem.map_fd = map.as_raw_fd() as u32;
    elem.key = &raw const index as u64;
    elem.__bindgen_anon_1.value = &raw const value as u64;
    // SAFETY: attr is valid for BPF_MAP_UPDATE_ELEM; key and value outlive
    // the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_MAP_UPDATE_ELEM as libc::c_long,
            &raw mut attr,
            size_of::<bpf_attr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `bpf(cmd, attr)` for commands that return a new descriptor.
///
/// # Safety
/// Every pointer in `attr` must be valid for the command for the call.
unsafe fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    // SAFETY: the caller vouches for attr's pointers; the size is the
    // union's, which the kernel accepts (it zero-checks unknown tails).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            size_of::<bpf_attr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success these commands return a new descriptor that
    // nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

/// Whether a kernel of this release (`uname -r`) filters multi-uprobe links
/// by process, `None` if it does: Linux 6.6 to 6.9 ran a link's program
/// only for the one thread whose id was given, until upstream commit
/// 46ba0e49b642 ("bpf: fix multi-uprobe PID filtering logic"), which 6.10,
/// 6.9.5 and 6.6.35 carry. Older kernels have no such links.
pub fn kernel_unfit(release: &str) -> Option<String> {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    let (Some(Some(major)), Some(Some(minor))) = (parts.next(), parts.next()) else {
        return Some(format!("kernel release {release:?} is not a version"));
    };
    let patch = parts.next().flatten().unwrap_or(0);
    let fit = match (major, minor) {
        (m, _) if m > 6 => true,
        (6, n) if n >= 10 => true,
        (6, 9) => patch >= 5,
        (6, 6) => patch >= 35,
        _ => false,
    };
    (!fit).then(|| {
        if (major, minor) < (6, 6) {
            format!("kernel {release} predates them (Linux 6.6)")
        } else {
            format!(
                "kernel {release} filters them by thread, not by process (fixed in 6.10, \
                 6.9.5 and 6.6.35)"
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_that_filter_by_process() {
        for release in [
            "6.18.44-fc-v595",
            "6.10.0",
            "6.12.1-arch1-1",
            "7.0",
            "6.9.5",
            "6.6.35-generic",
        ] {
            assert_eq!(kernel_unfit(release), None, "{release}");
        }
    }

    #[test]
    fn kernels_without_or_with_a_per_thread_filter() {
        for (release, why) in [
            ("5.15.0-91-generic", "predates"),
            ("6.5.13", "predates"),
            ("4.19", "predates"),
            ("6.6.0", "by thread"),
            ("6.6.34-lts", "by thread"),
            ("6.8.0-45-generic", "by thread"),
            ("6.9.4", "by thread"),
            ("", "not a version"),
            ("linux", "not a version"),
        ] {
            let said = kernel_unfit(release).unwrap_or_else(|| panic!("{release} accepted"));
            assert!(said.contains(why), "{release}: {said}");
        }
    }

    #[test]
    fn the_verifier_tail_keeps_the_last_lines() {
        let mut log = b"0: r1 = 0\n\n1: exit\nR0 !read_ok\nprocessed 2 insns\n".to_vec();
        log.extend([0, 0, b'x']);
        assert_eq!(
            verifier_tail(&log),
            " (verifier: 1: exit / R0 !read_ok / processed 2 insns)"
        );
        assert_eq!(verifier_tail(&[0; 8]), "");
    }
}
