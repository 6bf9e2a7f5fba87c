//! What `/proc` tells about the traced processes and about ebtrace's own:
//! existence, threads, names, the state each thread is in when the capture
//! starts, memory, files, the owners of sockets, users' groups and the kernel's settings. Every read of `/proc`
//! goes through here; the rest of the crate asks these functions. It also
//! keeps ebtrace alive when a file it mapped is truncated.

mod cgroup;
mod files;
mod memory;
mod process;
mod sockets;
mod status;
mod system;
mod target_root;
mod truncated_files;
mod users;

use std::path::PathBuf;

pub use cgroup::frozen_cgroup;
pub use files::{
    descriptor_targets, entry_point, environment, executable, is_unix_socket, mapped_file,
    own_descriptor_target, own_executable, pidfd_open, released_first_at_exit,
};
pub use memory::{
    ProcessMemory, mapping_at, maps_text, mem_available_bytes, memory_file, own_resident_bytes,
    read_memory, resident_bytes, write_memory,
};
pub use process::{
    ProcessCounters, TargetProcess, TaskStat, descendants_since, is_alive, is_listed, parse_stat,
    process_ids, start_time_ticks, thread_ids, thread_is_listed, thread_state, thread_syscall,
    thread_syscall_number,
};
pub use sockets::tcp_socket_owner;
pub use status::{
    ContextSwitches, namespace_tid, process_name, process_of_task, real_uid, seccomp_mode,
    thread_context_switches, thread_name, thread_schedstat, thread_status_field, traceable_by,
    tracer_of,
};
pub use system::{
    boot_ticks_now, clock_ticks_per_second, effective_capabilities, kernel_release,
    own_cpu_seconds, seccomp_filtered, set_own_oom_score_adj, sysctl_number,
};
pub use target_root::{HeldFile, TargetRoot};
pub use truncated_files::survive_truncated_files;
pub use users::{group_id, groups_of};

fn proc_root() -> PathBuf {
    PathBuf::from("/proc")
}

/// `/proc/PID`.
fn process_dir(pid: u32) -> PathBuf {
    proc_root().join(pid.to_string())
}

/// `/proc/PID/task/TID`.
fn thread_dir(pid: u32, tid: u32) -> PathBuf {
    process_dir(pid).join("task").join(tid.to_string())
}

#[cfg(test)]
mod tests;
