//! CPU stack samples as a pprof profile (`perftools.profiles.Profile`,
//! gzipped), the format `go tool pprof`, Parca and Pyroscope read.
//!
//! Samples of the same thread with the same stack are counted together.
//! Each sample carries two values, as Go's own CPU profiles do: the number
//! of samples and the CPU time they stand for (one sampling period each);
//! where CUDA driver calls were probed with their stacks, a third: the
//! launches (calls that submit work) made from that stack.
//! Stacks are kernel frames then user frames, innermost first; functions,
//! inlined calls and lines are resolved here, so readers need no binary.

use std::{collections::HashMap, io::Write as _};

use ebtrace_proto::perftools::profiles::{
    Function, Label, Line, Location, Mapping, Profile, Sample, ValueType,
};
use flate2::{Compression, write::GzEncoder};
use prost::Message as _;

use crate::{
    collect::StackSample,
    symbols::stacks::{Space, StackSymbolizer},
};

/// The mapping name of kernel frames, as `perf` names it.
const KERNEL_MODULE: &str = "[kernel.kallsyms]";

/// How the samples were taken, for the profile's header.
#[derive(Clone, Debug)]
pub struct SamplingInfo {
    /// Sampling rate per CPU.
    pub hz: u64,
    /// Wall-clock start of the sampling, ns since the Unix epoch.
    pub start_unix_ns: i64,
    /// How long it sampled, in ns.
    pub duration_ns: i64,
}

/// The pprof profile of `samples`, gzipped. `thread_names` labels each
/// sample with its thread's name where known; `processes` names the
/// sampled processes (label `process`).
pub fn encode(
    samples: &[StackSample],
    thread_names: &HashMap<u32, String>,
    process_names: &HashMap<u32, String>,
    info: &SamplingInfo,
    symbolizer: &mut StackSymbolizer,
) -> Vec<u8> {
    let profile = build(samples, thread_names, process_names, info, symbolizer);
    let mut gz = GzEncoder::new(Vec::new(), Compression::fast());
    gz.write_all(&profile.encode_to_vec())
        .expect("writing to memory");
    gz.finish().expect("writing to memory")
}

/// A sampled thread (process, thread) and its stack of lookup addresses.
type ThreadStack = (u32, u32, Vec<(Space, u64)>);

/// The profile of `samples`, not yet encoded.
pub fn build(
    samples: &[StackSample],
    thread_names: &HashMap<u32, String>,
    process_names: &HashMap<u32, String>,
    info: &SamplingInfo,
    symbolizer: &mut StackSymbolizer,
) -> Profile {
    let period = 1_000_000_000 / info.hz.max(1) as i64;
    // (CPU samples, launches) per stack. A CPU profile counts time on a
    // CPU: off-CPU stacks are not in it; the stacks of driver calls that
    // submit work count as launches.
    let mut counts: HashMap<ThreadStack, (i64, i64)> = HashMap::new();
    for s in samples.iter().filter(|s| !s.is_off_cpu()) {
        let count = counts
            .entry((s.tgid, s.tid, s.stack().frames()))
            .or_default();
        if s.launch {
            count.1 += 1;
        } else {
            count.0 += 1;
        }
    }
    let with_launches = counts.values().any(|(_, launches)| *launches > 0);
    symbolizer.resolve_stacks(counts.keys().map(|(_, _, stack)| stack.as_slice()));

    let mut b = Builder::default();
    let samples_type = ValueType {
        r#type: b.string("samples"),
        unit: b.string("count"),
    };
    let cpu_type = ValueType {
        r#type: b.string("cpu"),
        unit: b.string("nanoseconds"),
    };
    let launches_type = ValueType {
        r#type: b.string("launches"),
        unit: b.string("count"),
    };
    let mut out_samples = Vec::with_capacity(counts.len());
    let mut keys: Vec<_> = counts.into_iter().collect();
    // A stable order: the same samples give the same bytes.
    keys.sort_unstable();
    for ((tgid, tid, stack), (n, launches)) in keys {
        let location_id = stack
            .iter()
            .map(|&(space, address)| b.location(space, address, symbolizer))
            .collect();
        let mut label = vec![
            Label {
                key: b.string("pid"),
                num: i64::from(tgid),
                ..Label::default()
            },
            Label {
                key: b.string("tid"),
                num: i64::from(tid),
                ..Label::default()
            },
        ];
        for (key, names, id) in [
            ("process", process_names, tgid),
            ("thread", thread_names, tid),
        ] {
            if let Some(name) = names.get(&id) {
                label.push(Label {
                    key: b.string(key),
                    str: b.string(name),
                    ..Label::default()
                });
            }
        }
        out_samples.push(Sample {
            location_id,
            value: if with_launches {
                vec![n, n * period, launches]
            } else {
                vec![n, n * period]
            },
            label,
        });
    }
    b.kernel_mapping_last();
    Profile {
        sample_type: if with_launches {
            vec![samples_type, cpu_type, launches_type]
        } else {
            vec![samples_type, cpu_type]
        },
        sample: out_samples,
        period_type: Some(cpu_type),
        period,
        time_nanos: info.start_unix_ns,
        duration_nanos: info.duration_ns,
        default_sample_type: cpu_type.r#type,
        mapping: b.mappings,
        location: b.locations,
        function: b.functions,
        string_table: b.strings,
        ..Profile::default()
    }
}

/// The profile's tables, each entry added once.
struct Builder {
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<Function>,
    function_ids: HashMap<(String, Option<String>), u64>,
    locations: Vec<Location>,
    location_ids: HashMap<(Space, u64), u64>,
    mappings: Vec<Mapping>,
    mapping_ids: HashMap<String, u64>,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            // pprof requires the empty string first.
            strings: vec![String::new()],
            string_ids: HashMap::from([(String::new(), 0)]),
            functions: Vec::new(),
            function_ids: HashMap::new(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
            mappings: Vec::new(),
            mapping_ids: HashMap::new(),
        }
    }
}

impl Builder {
    fn string(&mut self, s: &str) -> i64 {
        if let Some(&id) = self.string_ids.get(s) {
            return id;
        }
        let id = self.strings.len() as i64;
        self.strings.push(s.to_string());
        self.string_ids.insert(s.to_string(), id);
        id
    }

    fn function(&mut self, name: &str, file: Option<&str>) -> u64 {
        let key = (name.to_string(), file.map(str::to_string));
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let function = Function {
            id,
            name: self.string(name),
            system_name: self.string(name),
            filename: file.map_or(0, |f| self.string(f)),
            start_line: 0,
        };
        self.functions.push(function);
        self.function_ids.insert(key, id);
        id
    }

    /// The mapping of an object, by name: pprof readers show it, and its
    /// flags tell them the names are already resolved.
    fn mapping(&mut self, module: &str) -> u64 {
        if let Some(&id) = self.mapping_ids.get(module) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        let mapping = Mapping {
            id,
            filename: self.string(module),
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
            ..Mapping::default()
        };
        self.mappings.push(mapping);
        self.mapping_ids.insert(module.to_string(), id);
        id
    }

    /// Readers take the first mapping for the profiled program (`go tool
    /// pprof` prints it as the profile's `File:`): the kernel, whose
    /// frames come first in every stack, is moved last.
    fn kernel_mapping_last(&mut self) {
        let Some(&kernel) = self.mapping_ids.get(KERNEL_MODULE) else {
            return;
        };
        let last = self.mappings.len() as u64;
        let renumber = |id: u64| match id {
            0 => 0,
            id if id == kernel => last,
            id if id > kernel => id - 1,
            id => id,
        };
        for m in &mut self.mappings {
            m.id = renumber(m.id);
        }
        self.mappings.sort_by_key(|m| m.id);
        for l in &mut self.locations {
            l.mapping_id = renumber(l.mapping_id);
        }
    }

    fn location(&mut self, space: Space, address: u64, symbolizer: &StackSymbolizer) -> u64 {
        if let Some(&id) = self.location_ids.get(&(space, address)) {
            return id;
        }
        let symbol = symbolizer.get(space, address);
        let module = match (space, &symbol.module) {
            (Space::Kernel, _) => Some(KERNEL_MODULE),
            (Space::Process(_) | Space::Python, m) => m.as_deref(),
        };
        let mapping_id = module.map_or(0, |m| self.mapping(m));
        let mut line: Vec<Line> = symbol
            .frames
            .iter()
            .map(|f| Line {
                function_id: self.function(&f.function, f.file.as_deref()),
                line: f.line.map_or(0, i64::from),
                column: 0,
            })
            .collect();
        // An unnamed function of a stripped object keeps its place, as the
        // trace's stack text shows it, not one "unknown" for all.
        if let (true, Some(place)) = (line.is_empty(), symbol.place()) {
            line.push(Line {
                function_id: self.function(&place, None),
                line: 0,
                column: 0,
            });
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id,
            address,
            line,
            is_folded: false,
        });
        self.location_ids.insert((space, address), id);
        id
    }
}

#[cfg(test)]
mod tests {
    use tracer_common::{RecordHeader, RecordKind, stack::StackSampleRecord};

    use super::*;

    #[inline(never)]
    fn a_function_the_profile_names() -> u64 {
        std::hint::black_box(7)
    }

    fn sample(tid: u32, user: &[u64], kernel: &[u64]) -> StackSample {
        StackSample {
            header: RecordHeader::new(
                RecordKind::StackSample,
                size_of::<StackSampleRecord>(),
                0,
                1,
            ),
            tid,
            tgid: std::process::id(),
            user: user.into(),
            kernel: kernel.into(),
            user_unreadable: false,
            kernel_unreadable: false,
            off_cpu_us: 0,
            syscall: 0,
            python: Default::default(),
            launch: false,
        }
    }

    #[test]
    fn samples_of_one_stack_are_counted_together_and_named() {
        a_function_the_profile_names();
        let pc = a_function_the_profile_names as *const () as u64 + 1;
        let kernel = [0xffff_ffff_8100_0010];
        let pid = std::process::id();
        let samples = [
            sample(pid, &[pc], &kernel),
            sample(pid, &[pc], &kernel),
            sample(pid + 1, &[pc], &[]),
        ];
        let info = SamplingInfo {
            hz: 100,
            start_unix_ns: 5,
            duration_ns: 2_000_000_000,
        };
        let threads = HashMap::from([(pid, "main".to_string())]);
        let p = build(
            &samples,
            &threads,
            &HashMap::new(),
            &info,
            &mut StackSymbolizer::default(),
        );
        assert_eq!(p.string_table[0], "");
        assert_eq!(p.period, 10_000_000);
        let mut values: Vec<_> = p.sample.iter().map(|s| s.value.clone()).collect();
        values.sort();
        assert_eq!(values, [vec![1, 10_000_000], vec![2, 20_000_000]]);

        // Kernel frames first in a stack, the kernel's mapping last.
        let two = p.sample.iter().find(|s| s.value[0] == 2).unwrap();
        assert_eq!(two.location_id.len(), 2);
        let kernel_loc = &p.location[two.location_id[0] as usize - 1];
        let last = p.mapping.last().unwrap();
        assert_eq!(kernel_loc.mapping_id, last.id);
        assert_eq!(p.string_table[last.filename as usize], KERNEL_MODULE);
        for (i, m) in p.mapping.iter().enumerate() {
            assert_eq!(m.id, i as u64 + 1);
        }

        // The user frame is this test's function, by name.
        let user_loc = &p.location[two.location_id[1] as usize - 1];
        let function = &p.function[user_loc.line.last().unwrap().function_id as usize - 1];
        let name = &p.string_table[function.name as usize];
        assert!(name.contains("a_function_the_profile_names"), "{name}");
        assert!(p.sample.iter().all(|s| s.label.len() >= 2));
    }
}
