//! The CUDA fixtures: a stand-in `libcuda.so.1` and a workload that
//! `dlopen`s it by soname (see `tests/fixtures/cuda_workload.c`).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use crate::{gated::Gated, workspace_root};

/// Compiler flags that give every exported function of the stand-in the
/// prologue the real driver's functions have (`push %rbp` first).
const STANDIN_CFLAGS: &[&str] = &[
    "-O2",
    "-g",
    "-Wall",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-fno-omit-frame-pointer",
    "-fno-shrink-wrap",
    "-fno-optimize-sibling-calls",
    "-fcf-protection=none",
    "-Wl,-soname,libcuda.so.1",
];

fn newer(src: &[PathBuf], out: &Path) -> bool {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let Some(built) = mtime(out) else {
        return true;
    };
    src.iter().any(|s| mtime(s).is_none_or(|m| m > built))
}

/// Runs `cc` with `args`, writing `out` atomically (tests build concurrently).
fn cc(args: &[&str], srcs: &[PathBuf], out: &Path, libs: &[&str]) {
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    let fixtures = workspace_root().join("tests/fixtures");
    let status = Command::new("cc")
        .args(args)
        .arg("-I")
        .arg(&fixtures)
        .arg("-o")
        .arg(&tmp)
        .args(
            srcs.iter()
                .filter(|s| s.extension().is_some_and(|e| e == "c")),
        )
        .args(libs)
        .status()
        .expect("run cc (install gcc)");
    assert!(status.success(), "compiling {} failed", out.display());
    std::fs::rename(&tmp, out).expect("rename fixture");
}

/// Flags for the stand-in CUPTI, linked against the stand-in driver as the
/// real one is against the driver.
const CUPTI_CFLAGS: &[&str] = &[
    "-O2",
    "-g",
    "-Wall",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-pthread",
    "-Wl,-soname,libcupti.so.12",
    "-Wl,-rpath,$ORIGIN",
];

/// Builds the stand-in driver into `target/fixtures/cuda-lib/libcuda.so.1`,
/// the stand-in CUPTI beside it as `libcupti.so.12` (see [`cupti_lib`]),
/// and the workload into `target/fixtures/cuda_workload`; returns the
/// libraries' directory and the workload.
pub fn build() -> (PathBuf, PathBuf) {
    let root = workspace_root();
    let fixtures = root.join("tests/fixtures");
    let header = fixtures.join("cuda_driver.h");
    let lib_dir = root.join("target/fixtures/cuda-lib");
    std::fs::create_dir_all(&lib_dir).expect("create target/fixtures/cuda-lib");
    let lib = lib_dir.join("libcuda.so.1");
    let lib_src = [
        fixtures.join("libcuda_standin.c"),
        fixtures.join("standin_gpu.c"),
        fixtures.join("standin_gpu.h"),
        fixtures.join("standin_observer.h"),
        header.clone(),
    ];
    if newer(&lib_src, &lib) {
        cc(STANDIN_CFLAGS, &lib_src, &lib, &[]);
    }
    let cupti = cupti_lib(&lib_dir);
    std::fs::create_dir_all(cupti.parent().expect("a directory")).expect("create cupti-lib");
    let cupti_src = [
        fixtures.join("libcupti_standin.c"),
        fixtures.join("cupti_records.h"),
        fixtures.join("standin_observer.h"),
        lib.clone(),
    ];
    if newer(&cupti_src, &cupti) {
        cc(
            CUPTI_CFLAGS,
            &cupti_src,
            &cupti,
            &[lib.to_str().expect("utf-8 path")],
        );
    }
    let workload = root.join("target/fixtures/cuda_workload");
    let workload_src = [fixtures.join("cuda_workload.c"), header];
    if newer(&workload_src, &workload) {
        cc(
            &["-O2", "-g", "-Wall", "-pthread"],
            &workload_src,
            &workload,
            &["-ldl"],
        );
    }
    (lib_dir, workload)
}

/// The stand-in `libcupti.so.12`, in a directory of its own beside the
/// driver's (`target/fixtures/cupti-lib`), so that only a workload started
/// with [`CudaWorkload::start_with_cupti`] can reach it: the
/// CUPTI activity API (subscribe, buffers, records in the real layouts of
/// the API version `STANDIN_CUPTI_VERSION` selects, default 26 = CUDA
/// 12.8) over the stand-in driver's simulated GPU; `STANDIN_CUPTI_LOG=path`
/// makes it append one JSON line per device record it produces.
pub fn cupti_lib(lib_dir: &Path) -> PathBuf {
    lib_dir.with_file_name("cupti-lib").join("libcupti.so.12")
}

/// `LD_LIBRARY_PATH` that reaches the stand-in driver and CUPTI.
pub fn library_path_with_cupti(lib_dir: &Path) -> String {
    format!(
        "{}:{}",
        lib_dir.display(),
        cupti_lib(lib_dir).parent().expect("a directory").display()
    )
}

/// Builds `target/fixtures/cupti_check`, the stand-in CUPTI's self-check
/// (`tests/fixtures/cupti_check.c`); returns the libraries' directory and it.
pub fn build_cupti_check() -> (PathBuf, PathBuf) {
    let (lib_dir, _) = build();
    let root = workspace_root();
    let fixtures = root.join("tests/fixtures");
    let check = root.join("target/fixtures/cupti_check");
    let src = [
        fixtures.join("cupti_check.c"),
        fixtures.join("cuda_driver.h"),
    ];
    if newer(&src, &check) {
        cc(&["-O2", "-g", "-Wall"], &src, &check, &["-ldl"]);
    }
    (lib_dir, check)
}

/// A running `cuda_workload`, waiting for its start signal; killed when dropped.
pub struct CudaWorkload {
    process: Gated,
    pub pid: u32,
}

impl CudaWorkload {
    /// Starts the workload with `args`, the stand-in driver on its
    /// `LD_LIBRARY_PATH`, and waits for its pid line.
    pub fn start(args: &[&str]) -> Self {
        let (lib_dir, _) = build();
        Self::start_in(args, &lib_dir.display().to_string(), &[])
    }

    /// Starts it with the stand-in CUPTI on its library path too (as a
    /// PyTorch or jax-on-GPU process has CUPTI) and `env`.
    pub fn start_with_cupti(args: &[&str], env: &[(&str, &str)]) -> Self {
        let (lib_dir, _) = build();
        Self::start_in(args, &library_path_with_cupti(&lib_dir), env)
    }

    fn start_in(args: &[&str], library_path: &str, env: &[(&str, &str)]) -> Self {
        let (_, bin) = build();
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env("LD_LIBRARY_PATH", library_path)
            .envs(env.iter().copied());
        let process = Gated::start(cmd, "cuda_workload");
        let pid = process.pid;
        CudaWorkload { process, pid }
    }

    /// Lets it run its calls without waiting for them (for `--bench-seconds`,
    /// which keeps launching until then, or until it is dropped).
    pub fn go(&mut self) {
        self.process.go();
        self.process.close_stdin();
    }

    /// Lets a `--linger` workload run its calls and returns its report; it
    /// lives on until dropped.
    pub fn run_and_linger(&mut self, deadline: Duration) -> serde_json::Value {
        self.process.go();
        self.process.report_line(deadline)
    }

    /// Waits for the next line it prints (after [`Self::go`]), e.g. the
    /// one `--profile-late` prints when its profiler session ends.
    pub fn next_line(&mut self, deadline: Duration) -> serde_json::Value {
        self.process.report_line(deadline)
    }

    /// Lets it run its calls, waits for it to exit and returns its report.
    pub fn run(mut self, deadline: Duration) -> serde_json::Value {
        self.go();
        self.process.report(deadline)
    }
}

/// How the target's copy of the driver's code differs from the file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodePatches {
    /// Bytes of its executable mappings of `libcuda.so.1` that differ
    /// from the file's bytes at the same file offsets.
    pub differing: usize,
    /// Those of them that are `int3` (0xcc): what the kernel writes over
    /// the first byte of a function, in that process's copy only, while a
    /// uprobe is on it.
    pub int3: usize,
}

/// Compares `pid`'s executable mappings of `libcuda.so.1` (its
/// `/proc/PID/maps` and `/proc/PID/mem`) with the mapped file.
pub fn driver_code_patches(pid: u32) -> CodePatches {
    use std::os::unix::fs::FileExt as _;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("read maps");
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open mem");
    let mut patches = CodePatches::default();
    let mut mapped = false;
    for line in maps.lines() {
        // start-end perms offset dev inode path
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [range, perms, offset, _, _, path] = fields[..] else {
            continue;
        };
        if !path.ends_with("/libcuda.so.1") || !perms.contains('x') {
            continue;
        }
        mapped = true;
        let (start, end) = range.split_once('-').expect("a range");
        let start = u64::from_str_radix(start, 16).expect("hex");
        let end = u64::from_str_radix(end, 16).expect("hex");
        let offset = usize::from_str_radix(offset, 16).expect("hex");
        let file = std::fs::read(path).expect("read the mapped library");
        let mut memory = vec![0u8; (end - start) as usize];
        mem.read_exact_at(&mut memory, start)
            .expect("read the code from /proc/PID/mem");
        for (i, &byte) in memory.iter().enumerate() {
            // Past the file's end a mapping reads as zeroes.
            let original = file.get(offset + i).copied().unwrap_or(0);
            if byte != original {
                patches.differing += 1;
                patches.int3 += usize::from(byte == 0xcc);
            }
        }
    }
    assert!(
        mapped,
        "pid {pid} has no executable mapping of libcuda.so.1"
    );
    patches
}

/// Polls until the target's driver code is the file's again.
pub fn wait_until_restored(pid: u32, what: &str) {
    let started = Instant::now();
    let deadline = Duration::from_secs(120);
    loop {
        let patches = driver_code_patches(pid);
        if patches.differing == 0 {
            eprintln!("{what}: driver code restored {:?} after", started.elapsed());
            return;
        }
        assert!(
            started.elapsed() < deadline,
            "{what}: the target's driver code still differs from the file {deadline:?} \
             later: {patches:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The uprobes behind the BPF links a process holds, by kind: for each
/// link its `/proc/PID/fdinfo` says (`uprobe_multi` and `uretprobe_multi`
/// links: their `uprobe_cnt`; perf-event links: 1 per link, under
/// `perf <event_type>`).
pub fn uprobes_of_links(pid: u32) -> BTreeMap<String, u64> {
    let mut kinds = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return kinds;
    };
    for entry in dir.flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(":\t"))
                .map(str::to_string)
        };
        let (kind, count) = match (field("link_type"), field("event_type")) {
            (Some(link), Some(event)) if link == "perf" => (format!("perf {event}"), 1),
            (Some(link), _) => {
                let count = field("uprobe_cnt")
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(1);
                (link, count)
            }
            _ => continue,
        };
        *kinds.entry(kind).or_insert(0) += count;
    }
    kinds
}

/// Demangles with binutils' `c++filt`, a source independent of ebtrace.
pub fn cxxfilt(mangled: &str) -> String {
    let out = Command::new("c++filt")
        .arg(mangled)
        .output()
        .expect("run c++filt (binutils)");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stand-in CUPTI's records walk with `cuptiActivityGetNextRecord`
    /// in the sizes and offsets of the real layouts, for each API version
    /// it emulates and for one it does not know.
    #[test]
    fn standin_cupti_records_have_the_real_layouts() {
        let (lib_dir, check) = build_cupti_check();
        for version in ["26", "130001", "130101", "140000"] {
            let out = Command::new(&check)
                .env("LD_LIBRARY_PATH", library_path_with_cupti(&lib_dir))
                .env("STANDIN_CUPTI_VERSION", version)
                .env_remove("STANDIN_CUPTI_LOG")
                .output()
                .expect("run cupti_check");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.starts_with(&format!("ok version {version}:")),
                "cupti_check with STANDIN_CUPTI_VERSION={version}: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
