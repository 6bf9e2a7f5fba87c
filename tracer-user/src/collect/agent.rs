//! What the in-process agents hand over, as data entering the timeline:
//! the recordings of the frameworks' own profiler sessions, how their
//! thread ids map to the kernel's, and the kernel names the CUDA driver
//! gave. `agent` fills these in; `timeline` reads them.

use std::collections::{BTreeMap, HashMap};

/// What an agent's session recorded in one process.
pub struct AgentRecording {
    /// The target process.
    pub pid: u32,
    /// The serialized XSpaces, as the frameworks wrote them (one per
    /// framework: jax and TensorFlow each have their own profiler).
    pub xspaces: Vec<Vec<u8>>,
    /// CUPTI activity batches (`tracer_agent::activity`).
    pub device_activity: Vec<Vec<u8>>,
    /// PyTorch's ops (`tracer_agent::op_records`), one payload per stop.
    pub torch_ops: Vec<Vec<u8>>,
    /// Why a source did not stop cleanly (what it recorded is kept).
    pub problem: Option<String>,
    /// Its host lines' thread ids → kernel tids.
    pub threads: ThreadIds,
    /// Its threads' ids in the target's own pid namespace → kernel tids
    /// here, where they differ (a container's): what the agent's records
    /// (PyTorch's ops) name threads by.
    pub namespace_tids: HashMap<u32, u32>,
    /// How much the target's resident memory grew at most, in bytes, while
    /// the framework's session recorded (what its recorder held, and
    /// anything else the program allocated meanwhile).
    pub target_growth: u64,
}

/// TSL thread ids (line ids of its `/host:CPU` plane) → kernel tids.
pub type ThreadIds = HashMap<i64, u32>;

/// libstdc++'s `std::hash<std::thread::id>` of a thread whose `pthread_t`
/// is `pthread_self` (`_Hash_bytes` of its 8 bytes, seed 0xc70f6907): the
/// id TSL gives a thread when it cannot ask the kernel.
pub fn tsl_thread_id(pthread_self: u64) -> i64 {
    const MUL: u64 = (0xc6a4_a793 << 32) + 0x5bd1_e995;
    const SEED: u64 = 0xc70f_6907;
    let shift_mix = |v: u64| v ^ (v >> 47);
    let mut hash = SEED ^ 8u64.wrapping_mul(MUL);
    hash ^= shift_mix(pthread_self.wrapping_mul(MUL)).wrapping_mul(MUL);
    hash = hash.wrapping_mul(MUL);
    hash = shift_mix(hash).wrapping_mul(MUL);
    shift_mix(hash) as i64
}

/// Names of kernels launched through handles looked up before the capture,
/// as the CUDA driver inside each process gave them.
#[derive(Clone, Debug, Default)]
pub struct DriverKernelNames {
    /// Raw (mangled) names by `(pid, handle)`.
    pub names: HashMap<(u32, u64), String>,
    /// One line per process asked.
    pub notes: Vec<String>,
    /// How many handles were asked for and named, per process.
    pub counts: BTreeMap<u32, KernelNames>,
}

/// Names asked of the CUDA driver inside one process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelNames {
    /// Function handles asked for.
    pub asked: u64,
    /// Function handles the driver named.
    pub named: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ids_are_libstdcxx_hashes_of_pthread_self() {
        // Read from a jaxlib 0.10.2 session: the main thread's
        // `threading.main_thread().ident` and its `/host:CPU` line id.
        assert_eq!(tsl_thread_id(0x7f77_c405_9b80), 3_392_712_717_861_966_570);
    }
}
