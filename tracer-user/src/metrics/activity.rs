//! What the watched processes did through the probes, counted as the
//! flight recorder drains its records: CUDA kernel launches and the time
//! threads waited in the driver's synchronizing calls. `/proc` has neither.

use rustc_hash::FxHashMap;

use crate::{
    collect::{DriverCallCounted, Record},
    cuda_api::{self, Op},
};

/// One process's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessActivity {
    /// Successful kernel and graph launches (`cuLaunchKernel*`,
    /// `cuLaunchCooperativeKernel*`, `cuGraphLaunch*`).
    pub cuda_launches: u64,
    /// Time from entry to return of `cuStreamSynchronize`,
    /// `cuCtxSynchronize` and `cuEventSynchronize`, summed over threads.
    pub cuda_sync_wait_ns: u64,
}

impl ProcessActivity {
    fn add(&mut self, other: &ProcessActivity) {
        self.cuda_launches += other.cuda_launches;
        self.cuda_sync_wait_ns += other.cuda_sync_wait_ns;
    }
}

/// Counts per process, from the records seen so far.
#[derive(Debug, Default)]
pub struct ActivityTally {
    by_pid: FxHashMap<u32, ProcessActivity>,
}

impl ActivityTally {
    /// Counts `record` if it is a driver call these metrics follow.
    pub fn count(&mut self, record: &Record) {
        if let Record::CudaCall(call) = record {
            self.count_call(DriverCallCounted::from(&**call));
        }
    }

    /// Counts one driver call.
    #[inline]
    pub fn count_call(&mut self, call: DriverCallCounted) {
        let Some(function) = cuda_api::function(call.function) else {
            return;
        };
        let (launches, waited) = match function.op {
            Op::Launch | Op::LaunchEx | Op::GraphLaunch if call.result == 0 => (1, 0),
            Op::StreamSynchronize | Op::CtxSynchronize | Op::EventSynchronize => {
                (0, call.end_ns.saturating_sub(call.start_ns))
            }
            _ => return,
        };
        let counts = self.by_pid.entry(call.tgid).or_default();
        counts.cuda_launches += launches;
        counts.cuda_sync_wait_ns += waited;
    }

    /// Adds every process's counts of `other`.
    pub fn add(&mut self, other: &ActivityTally) {
        for (pid, a) in &other.by_pid {
            self.by_pid.entry(*pid).or_default().add(a);
        }
    }

    /// The counts of `pid` (zero if nothing was seen).
    pub fn of(&self, pid: u32) -> ProcessActivity {
        self.by_pid.get(&pid).copied().unwrap_or_default()
    }

    /// Forgets every process but `pids`.
    pub fn retain(&mut self, pids: impl Fn(u32) -> bool) {
        self.by_pid.retain(|pid, _| pids(*pid));
    }

    /// The counts so far, leaving this tally empty.
    pub fn take(&mut self) -> ActivityTally {
        std::mem::take(self)
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind, cuda::CudaCall};

    use super::*;

    fn call(name: &str, tgid: u32, start_ns: u64, end_ns: u64, result: u32) -> Record {
        let function = (0..u16::MAX)
            .find(|i| cuda_api::function(*i).is_some_and(|f| f.name == name))
            .unwrap();
        Record::CudaCall(Box::new(CudaCall {
            header: RecordHeader::new(RecordKind::CudaCall, size_of::<CudaCall>(), 0, end_ns),
            tid: tgid,
            tgid,
            start_ns,
            function,
            flags: 0,
            result,
            args: [0; 6],
            extra: [0; 8],
            out_value: 0,
        }))
    }

    #[test]
    fn launches_that_succeed_and_time_in_synchronizing_calls_are_counted_per_process() {
        let mut tally = ActivityTally::default();
        for r in [
            call("cuLaunchKernel", 7, 0, 10, 0),
            call("cuLaunchKernelEx_ptsz", 7, 20, 30, 0),
            call("cuGraphLaunch", 7, 40, 50, 0),
            call("cuLaunchKernel", 7, 60, 70, 1),
            call("cuStreamSynchronize", 7, 100, 350, 0),
            call("cuEventSynchronize", 7, 400, 500, 0),
            call("cuCtxSynchronize", 8, 0, 1_000, 0),
            call("cuMemcpyHtoD_v2", 8, 0, 5_000, 0),
        ] {
            tally.count(&r);
        }
        let mut total = ActivityTally::default();
        total.add(&tally.take());
        total.add(&tally);
        assert_eq!(
            total.of(7),
            ProcessActivity {
                cuda_launches: 3,
                cuda_sync_wait_ns: 350,
            }
        );
        assert_eq!(total.of(8).cuda_sync_wait_ns, 1_000);
        assert_eq!(total.of(8).cuda_launches, 0);
        assert_eq!(total.of(9), ProcessActivity::default());
        total.retain(|pid| pid == 8);
        assert_eq!(total.of(7), ProcessActivity::default());
    }
}
