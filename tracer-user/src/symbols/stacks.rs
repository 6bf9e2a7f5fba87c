//! Names for the addresses of sampled stacks, with blazesym: functions
//! (demangled), the functions inlined at an address, and file:line where
//! the object has debug information. User addresses are resolved in the
//! sampled process (its mappings, while it runs), or, once it has exited,
//! in the files it had mapped where [`StackSymbolizer::note_stack`] saw
//! them; kernel ones from `/proc/kallsyms`. The addresses of each sample
//! are named as it arrives, on a thread of its own
//! (`super::symbolizer_thread`), so that a trace built later finds them
//! named.

use std::{
    collections::{BTreeMap, HashMap},
    ops::Range,
    sync::Arc,
    time::{Duration, Instant},
};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::procfs;

pub use super::symbolizer_thread::{Frame, Symbol};
use super::{
    maps::{self, Mapping},
    python::frames::{is_python_frame, python_symbol},
    symbolizer_thread::{Answer, Place, SymbolizerThread},
};

/// How soon a process's mappings are read again when a sample has an
/// address in none of its executable ones (a library loaded since).
const MAPS_REREAD_AFTER: Duration = Duration::from_secs(1);
/// How long that wait grows to, doubled by each read that finds no code
/// mapped since: the address was junk (a frame-pointer walk gone astray
/// in code built without frame pointers), and such addresses come in
/// most samples of some processes. A PyTorch process with CUDA maps
/// thousands of regions, and reading them takes milliseconds.
const MAPS_REREAD_AT_MOST: Duration = Duration::from_secs(32);

/// Whose address space an address is in.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Space {
    /// The kernel's.
    Kernel,
    /// A process's, by pid.
    Process(u32),
    /// Python frames: not addresses but the tagged entries that name them
    /// (see [`super::python::frames`]), the same in every process.
    Python,
}

/// Resolves addresses, each once per address space, and keeps the
/// answers (a capture that lives on, such as the flight recorder, asks
/// again for the same addresses).
#[derive(Default)]
pub struct StackSymbolizer {
    cache: FxHashMap<(Space, u64), Arc<Symbol>>,
    /// Where each sampled process has its code.
    code: HashMap<u32, ProcessCode>,
    /// Where blazesym runs, keeping what it parsed while this lives.
    thread: SymbolizerThread,
    /// Addresses asked of it and not answered yet.
    asked: FxHashSet<(Space, u64)>,
    /// Functions whose every address has the same name (see
    /// [`Answer::functions`]), by start address, with their end: a new
    /// address in one is named without asking blazesym. Most samples land
    /// on an instruction not sampled before, and on a jax loop most of
    /// those are in the few hundred hot functions of jaxlib, which has no
    /// debug information.
    functions: FxHashMap<Space, BTreeMap<u64, (u64, Arc<Symbol>)>>,
}

/// The address to look up for frame `depth` of a stack: every frame past
/// the innermost is a return address, which may already be the next
/// line's (or, after a call that does not return, the next function's).
pub fn lookup_address(depth: usize, address: u64) -> u64 {
    if depth == 0 {
        address
    } else {
        address.saturating_sub(1)
    }
}

/// A sampled stack, as the symbolizer reads it: its process and its
/// addresses, innermost first (every one past the first a return address).
#[derive(Clone, Copy, Debug)]
pub struct SampledStack<'a> {
    /// The process whose user addresses these are.
    pub pid: u32,
    /// Kernel instruction addresses.
    pub kernel: &'a [u64],
    /// User-space instruction addresses.
    pub user: &'a [u64],
}

impl SampledStack<'_> {
    /// The addresses to look up: kernel frames, then user frames,
    /// innermost first.
    pub fn frames(self) -> Vec<(Space, u64)> {
        let kernel = self
            .kernel
            .iter()
            .enumerate()
            .map(|(depth, a)| (Space::Kernel, lookup_address(depth, *a)));
        let user = self.user.iter().enumerate().map(|(depth, a)| {
            if is_python_frame(*a) {
                (Space::Python, *a)
            } else {
                (Space::Process(self.pid), lookup_address(depth, *a))
            }
        });
        kernel.chain(user).collect()
    }
}

/// Where blazesym looks `space`'s addresses up (`None`: it does not).
fn place_of(space: Space) -> Option<Place> {
    match space {
        Space::Kernel => Some(Place::Kernel),
        Space::Process(pid) => Some(Place::Process(pid)),
        Space::Python => None,
    }
}

fn space_of(place: &Place) -> Option<Space> {
    match place {
        Place::Kernel => Some(Space::Kernel),
        Place::Process(pid) => Some(Space::Process(*pid)),
        Place::File(_) => None,
    }
}

/// Where a sampled process has its code, as its mappings were last read.
struct ProcessCode {
    /// Its executable file mappings, by start address: its addresses are
    /// named from them once it has exited.
    files: Vec<Mapping>,
    /// Every executable range, by start, code in no file (JIT code, the
    /// vDSO) too: an address in none of them may be in code mapped since.
    all: Vec<Range<u64>>,
    read_at: Instant,
    /// How long after `read_at` such an address has them read again.
    reread_after: Duration,
}

/// The mapping of `maps` (sorted by start) that holds `address`.
fn mapping_of(maps: &[Mapping], address: u64) -> Option<&Mapping> {
    let i = maps.partition_point(|m| m.start <= address);
    maps[..i].last().filter(|m| address < m.end)
}

impl StackSymbolizer {
    /// Remembers where `stack`'s process has its code while it runs: its
    /// addresses can then still be named after it exits. Reads its
    /// mappings the first time, and again (at most once a second) when an
    /// address is in none of them.
    pub fn note_stack(&mut self, stack: SampledStack<'_>) {
        self.take_answers();
        self.ask_ahead(stack);
        self.note_code(stack);
    }

    /// Asks for the names of the addresses of `stack` not named yet,
    /// without waiting. (Called for every sample: most addresses are
    /// named already, and this looks them up without allocating.)
    fn ask_ahead(&mut self, stack: SampledStack<'_>) {
        let kernel = stack
            .kernel
            .iter()
            .enumerate()
            .map(|(depth, a)| lookup_address(depth, *a));
        self.ask_for(Space::Kernel, kernel);
        let user = stack
            .user
            .iter()
            .enumerate()
            .filter(|(_, a)| !is_python_frame(**a))
            .map(|(depth, a)| lookup_address(depth, *a));
        self.ask_for(Space::Process(stack.pid), user);
    }

    fn ask_for(&mut self, space: Space, addresses: impl Iterator<Item = u64>) {
        let Some(place) = place_of(space) else {
            return;
        };
        let mut unnamed = Vec::new();
        for address in addresses {
            if !self.cache.contains_key(&(space, address))
                && !self.named_by_function(space, address)
                && self.asked.insert((space, address))
            {
                unnamed.push(address);
            }
        }
        if unnamed.is_empty() {
            return;
        }
        if !self.thread.ask(place, unnamed.clone()) {
            for a in unnamed {
                self.asked.remove(&(space, a));
            }
        }
    }

    /// Keeps the names that came, without waiting.
    fn take_answers(&mut self) {
        for answer in self.thread.answers() {
            self.keep(answer);
        }
    }

    /// Keeps the names `answer` found for addresses still asked for (not
    /// those of a process forgotten since). An address of a place that
    /// could not be read, or not yet in its mappings, is left unnamed:
    /// the next sample or [`Self::resolve`] asks again.
    fn keep(&mut self, answer: Answer) {
        let Some(space) = space_of(&answer.place) else {
            return;
        };
        let symbols = answer.symbols.map(Vec::into_iter);
        let mut symbols = symbols.into_iter().flatten();
        let mut functions = answer.functions.into_iter();
        for address in answer.addresses {
            let symbol = symbols.next();
            let function = functions.next().flatten();
            if self.asked.remove(&(space, address))
                && !answer.not_yet.contains(&address)
                && let Some(symbol) = symbol
            {
                let symbol = Arc::new(self.placed(space, address, symbol));
                if let Some(range) = function {
                    self.functions
                        .entry(space)
                        .or_default()
                        .insert(range.start, (range.end, Arc::clone(&symbol)));
                }
                self.cache.insert((space, address), symbol);
            }
        }
    }

    /// Names `address` after the function it is in, if that function's
    /// every address has the same name; false if it is not known so.
    fn named_by_function(&mut self, space: Space, address: u64) -> bool {
        let Some((_, (end, symbol))) = self
            .functions
            .get(&space)
            .and_then(|f| f.range(..=address).next_back())
        else {
            return false;
        };
        if address >= *end {
            return false;
        }
        let symbol = Arc::clone(symbol);
        self.cache.insert((space, address), symbol);
        true
    }

    /// Remembers where `stack`'s process has its code (see
    /// [`Self::note_stack`]).
    fn note_code(&mut self, stack: SampledStack<'_>) {
        let pid = stack.pid;
        if stack.user.is_empty() {
            return;
        }
        if let Some(known) = self.code.get(&pid)
            && (known.read_at.elapsed() < known.reread_after
                || stack
                    .user
                    .iter()
                    .all(|a| is_python_frame(*a) || maps::in_code(&known.all, *a)))
        {
            return;
        }
        self.read_code(pid);
    }

    /// Remembers where process `pid` has its code now, before any stack of
    /// it arrives: a process that exits before its first stacks are drained
    /// still has them named. Its first stack with an address in none of
    /// these mappings (a library loaded since) has them read again at once.
    pub fn note_process(&mut self, pid: u32) {
        self.read_code(pid);
        if let Some(known) = self.code.get_mut(&pid) {
            known.reread_after = Duration::ZERO;
        }
    }

    /// Reads `pid`'s mappings into [`Self::code`]. A process that has
    /// exited keeps the mappings last read: a zombie maps nothing, and its
    /// addresses are named from the files it had mapped.
    fn read_code(&mut self, pid: u32) {
        let maps = match maps::read_maps(pid) {
            Ok(maps) if !maps.is_empty() => maps,
            _ => {
                if let Some(known) = self.code.get_mut(&pid) {
                    known.read_at = Instant::now();
                    known.reread_after = MAPS_REREAD_AT_MOST;
                }
                return;
            }
        };
        let all = maps::code_ranges(&maps);
        let mut files: Vec<Mapping> = maps
            .into_iter()
            .filter(|m| m.perms.contains('x') && m.path.starts_with('/') && !m.deleted)
            .collect();
        files.sort_by_key(|m| m.start);
        let reread_after = match self.code.get(&pid) {
            Some(known) if known.all == all => {
                (known.reread_after * 2).clamp(MAPS_REREAD_AFTER, MAPS_REREAD_AT_MOST)
            }
            _ => MAPS_REREAD_AFTER,
        };
        self.code.insert(
            pid,
            ProcessCode {
                files,
                all,
                read_at: Instant::now(),
                reread_after,
            },
        );
    }

    /// Names `addresses` of `pid`, which has exited, from the files it had
    /// mapped; `None` where they are unknown.
    fn resolve_in_files(&mut self, pid: u32, addresses: &[u64]) -> Vec<Option<Symbol>> {
        let mut out = vec![None; addresses.len()];
        let Some(ProcessCode { files: maps, .. }) = self.code.get(&pid) else {
            return out;
        };
        let mut by_file: HashMap<String, Vec<(usize, u64)>> = HashMap::new();
        for (i, a) in addresses.iter().enumerate() {
            if let Some(m) = mapping_of(maps, *a) {
                by_file
                    .entry(m.path.clone())
                    .or_default()
                    .push((i, a - m.start + m.offset));
            }
        }
        for (path, wanted) in by_file {
            let offsets: Vec<u64> = wanted.iter().map(|(_, o)| *o).collect();
            let Some((found, _)) = self.look_up(Place::File(path.clone()), offsets) else {
                continue;
            };
            for ((i, _), symbol) in wanted.iter().zip(found) {
                if let Some(mut symbol) = symbol {
                    symbol.module.get_or_insert_with(|| path.clone());
                    out[*i] = Some(symbol);
                }
            }
        }
        out
    }

    /// `symbol` as kept for `address` of `space`: where no function names
    /// it, with its object file and offset there, from the mappings last
    /// read. A local function of a stripped object (Debian's and Ubuntu's
    /// Python) is then still told apart, and known to be the interpreter's.
    fn placed(&self, space: Space, address: u64, symbol: Option<Symbol>) -> Symbol {
        let mut symbol = symbol.unwrap_or_default();
        if let Space::Process(pid) = space
            && symbol.frames.is_empty()
            && let Some(m) = self
                .code
                .get(&pid)
                .and_then(|c| mapping_of(&c.files, address))
        {
            symbol.module.get_or_insert_with(|| m.path.clone());
            symbol.file_offset = Some(address - m.start + m.offset);
        }
        symbol
    }

    /// Looks `addresses` of `place` up and waits; what earlier lookups
    /// answered meanwhile is kept. With the addresses to ask again later
    /// (see [`Answer::not_yet`]).
    fn look_up(
        &mut self,
        place: Place,
        addresses: Vec<u64>,
    ) -> Option<(Vec<Option<Symbol>>, Vec<u64>)> {
        let (earlier, ours) = self.thread.look_up(place, addresses);
        for answer in earlier {
            self.keep(answer);
        }
        let ours = ours?;
        Some((ours.symbols?, ours.not_yet))
    }

    /// Resolves every address of `stacks` (see [`SampledStack::frames`]), one
    /// batch per address space.
    pub fn resolve_stacks<'a>(&mut self, stacks: impl IntoIterator<Item = &'a [(Space, u64)]>) {
        let mut by_space: HashMap<Space, Vec<u64>> = HashMap::new();
        for stack in stacks {
            for (space, address) in stack {
                by_space.entry(*space).or_default().push(*address);
            }
        }
        for (space, addresses) in by_space {
            self.resolve(space, addresses);
        }
    }

    /// Resolves `addresses` of `space` (lookup addresses, see
    /// [`lookup_address`]) and keeps the answers for [`Self::get`]. An
    /// address that cannot be resolved (the process exited, the object has
    /// no symbols) gets an empty [`Symbol`].
    pub fn resolve(&mut self, space: Space, addresses: impl IntoIterator<Item = u64>) {
        let Some(place) = place_of(space) else {
            return;
        };
        for answer in self.thread.wait_for_all() {
            self.keep(answer);
        }
        let mut wanted: Vec<u64> = addresses
            .into_iter()
            .filter(|a| !self.cache.contains_key(&(space, *a)))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        wanted.retain(|a| !self.named_by_function(space, *a));
        if wanted.is_empty() {
            return;
        }
        let (mut symbols, not_yet) = match self.look_up(place, wanted.clone()) {
            Some((found, not_yet)) => (found, not_yet),
            None => (vec![None; wanted.len()], Vec::new()),
        };
        // Once the process has exited (a zombie maps nothing), the files it
        // had mapped when it was seen still name its code. (Only then: a
        // live process in a container sees other files at those paths.)
        if let Space::Process(pid) = space
            && !procfs::is_alive(pid)
        {
            let unnamed: Vec<usize> = (0..wanted.len())
                .filter(|i| symbols[*i].is_none() && !not_yet.contains(&wanted[*i]))
                .collect();
            if !unnamed.is_empty() {
                let addresses: Vec<u64> = unnamed.iter().map(|i| wanted[*i]).collect();
                let found = self.resolve_in_files(pid, &addresses);
                for (i, symbol) in unnamed.into_iter().zip(found) {
                    symbols[i] = symbol;
                }
            }
        }
        for (address, symbol) in wanted.into_iter().zip(symbols) {
            if !not_yet.contains(&address) {
                let symbol = self.placed(space, address, symbol);
                self.cache.insert((space, address), Arc::new(symbol));
            }
        }
    }

    /// Forgets what it knows of process `pid`, which exited and whose
    /// samples are all gone: a long-running capture would keep the names
    /// of every process that came and went (and give them to a new process
    /// that reuses the pid).
    pub fn forget_process(&mut self, pid: u32) {
        self.cache
            .retain(|(space, _), _| *space != Space::Process(pid));
        self.asked
            .retain(|(space, _)| *space != Space::Process(pid));
        self.functions.remove(&Space::Process(pid));
        self.code.remove(&pid);
        // What was parsed for it goes too (blazesym keeps a process's
        // objects under its pid).
        self.thread.forget_parsed();
    }

    /// What [`Self::resolve`] found at `address` of `space`.
    pub fn get(&self, space: Space, address: u64) -> Arc<Symbol> {
        if space == Space::Python {
            return python_symbol(address);
        }
        self.cache
            .get(&(space, address))
            .cloned()
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    /// A sample of process `pid` whose user stack is `address` alone.
    struct UserSample {
        pid: u32,
        user: [u64; 1],
    }

    impl UserSample {
        fn stack(&self) -> SampledStack<'_> {
            SampledStack {
                pid: self.pid,
                kernel: &[],
                user: &self.user,
            }
        }
    }

    fn user_sample(pid: u32, address: u64) -> UserSample {
        UserSample {
            pid,
            user: [address],
        }
    }

    /// The executable mapping of `pid` that holds `address`.
    fn code_mapping(pid: u32, address: u64) -> Option<Mapping> {
        maps::read_maps(pid)
            .ok()?
            .into_iter()
            .find(|m| m.perms.contains('x') && m.start <= address && address < m.end)
    }

    /// A child running `sleep`, and the first mapping of it `wanted` takes
    /// (waited for: the loader maps its libraries after the start).
    fn sleep_mapping(wanted: impl Fn(&Mapping) -> bool) -> (std::process::Child, Mapping) {
        let child = Command::new("sleep")
            .arg("30")
            .stdout(Stdio::null())
            .spawn()
            .expect("start sleep");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = maps::read_maps(child.id())
                .unwrap_or_default()
                .into_iter()
                .find(&wanted);
            match found {
                Some(m) => return (child, m),
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                None => panic!("sleep never mapped what was wanted"),
            }
        }
    }

    /// A child running `sleep`, and where libc's `write()` is in it.
    fn sleeping_child() -> (std::process::Child, u64, Mapping) {
        // libc's write() in this process, and where the same byte of the
        // same file is in the child's address space.
        let write = libc::write as *const () as u64;
        let ours = code_mapping(std::process::id(), write).expect("write() is mapped");
        assert!(ours.path.contains("libc"), "{ours:?}");
        let (child, theirs) = sleep_mapping(|m| {
            m.path == ours.path && m.offset == ours.offset && m.perms.contains('x')
        });
        (child, theirs.start + (write - ours.start), ours)
    }

    /// Kills `child` and waits until it is a zombie (not reaped).
    fn kill_to_zombie(child: &mut std::process::Child) {
        child.kill().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while procfs::is_alive(child.id()) {
            assert!(Instant::now() < deadline, "sleep did not die");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn assert_names_write(symbolizer: &StackSymbolizer, pid: u32, address: u64, libc: &Mapping) {
        let symbol = symbolizer.get(Space::Process(pid), address);
        let function = &symbol.frames.last().expect("a name").function;
        assert!(function.contains("write"), "{symbol:?}");
        assert_eq!(symbol.module.as_deref(), Some(libc.path.as_str()));
    }

    #[test]
    fn an_exited_process_is_named_from_the_files_it_had_mapped() {
        let (mut child, address, libc) = sleeping_child();
        let pid = child.id();
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_stack(user_sample(pid, address).stack());
        child.kill().unwrap();
        child.wait().unwrap();

        symbolizer.resolve(Space::Process(pid), [address]);
        assert_names_write(&symbolizer, pid, address, &libc);

        // An address in no file it had mapped stays unknown.
        symbolizer.resolve(Space::Process(pid), [8]);
        assert!(symbolizer.get(Space::Process(pid), 8).frames.is_empty());
    }

    /// An address no symbol names (a local function of the stripped
    /// `sleep` every distribution ships) is told by its file and offset.
    #[test]
    fn an_unnamed_address_keeps_its_file_and_offset() {
        let (mut child, text) =
            sleep_mapping(|m| m.perms.contains('x') && m.path.ends_with("/sleep"));
        let pid = child.id();
        let address = text.start + (text.end - text.start) / 2;
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_stack(user_sample(pid, address).stack());
        symbolizer.resolve(Space::Process(pid), [address]);
        let symbol = symbolizer.get(Space::Process(pid), address);
        child.kill().unwrap();
        child.wait().unwrap();

        assert!(
            symbol.frames.is_empty(),
            "{} is stripped: {symbol:?}",
            text.path
        );
        assert_eq!(symbol.module.as_deref(), Some(text.path.as_str()));
        let offset = address - text.start + text.offset;
        assert_eq!(symbol.place(), Some(format!("sleep+{offset:#x}")));
    }

    /// Code mapped after the capture started (a library the target loads
    /// later) has the mappings read again at the first stack in it, not a
    /// second later.
    #[test]
    fn code_mapped_after_the_start_is_read_at_its_first_stack() {
        use maps::AnonymousCode;

        let pid = std::process::id();
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_process(pid);
        let read_at = symbolizer.code[&pid].read_at;
        let later = AnonymousCode::map();
        symbolizer.note_code(user_sample(pid, later.address).stack());
        let known = &symbolizer.code[&pid];
        assert!(known.read_at > read_at);
        assert!(maps::in_code(&known.all, later.address));
        assert_eq!(known.reread_after, MAPS_REREAD_AFTER);
    }

    /// A target noted when the capture starts, whose stacks are all drained
    /// after it exited (a short run), and which is a zombie when they are
    /// named: its own mappings are empty, the files it had mapped name them.
    #[test]
    fn a_zombie_noted_before_its_stacks_came_is_named_from_its_files() {
        let (mut child, address, libc) = sleeping_child();
        let pid = child.id();
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_process(pid);
        kill_to_zombie(&mut child);
        assert!(procfs::is_listed(pid), "a zombie until reaped");

        symbolizer.note_stack(user_sample(pid, address).stack());
        symbolizer.resolve(Space::Process(pid), [address]);
        assert_names_write(&symbolizer, pid, address, &libc);
        child.wait().unwrap();
    }

    /// A target noted when the capture starts, which loads a library, runs
    /// in it and exits before its stacks are drained: the stack in the new
    /// library has its mappings read again, from a zombie that maps
    /// nothing, and what was read at the start still names the rest.
    #[test]
    fn a_zombie_read_again_keeps_the_files_it_had_mapped() {
        let (mut child, address, libc) = sleeping_child();
        let pid = child.id();
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_process(pid);
        kill_to_zombie(&mut child);

        // An address in no mapping read at the start: a library loaded since.
        let stack = [0x10, address + 1];
        symbolizer.note_stack(SampledStack {
            pid,
            kernel: &[],
            user: &stack,
        });
        // The background lookup finds the zombie's map empty.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !symbolizer.asked.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            symbolizer.take_answers();
        }
        symbolizer.resolve(Space::Process(pid), [lookup_address(1, address + 1)]);
        assert_names_write(&symbolizer, pid, address, &libc);
        child.wait().unwrap();
    }

    /// A sample in code that is in no file (JIT code) does not have the
    /// mappings read again; one at an address in no mapping does, less and
    /// less often while nothing is mapped since, and soon again once code
    /// was.
    #[test]
    fn maps_are_read_again_less_often_while_nothing_is_mapped_since() {
        use maps::AnonymousCode;

        fn code(s: &mut StackSymbolizer, pid: u32) -> &mut ProcessCode {
            s.code.get_mut(&pid).unwrap()
        }
        let long_ago = Instant::now() - 2 * MAPS_REREAD_AT_MOST;
        let ours = std::process::id();
        let jit = AnonymousCode::map();
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_code(user_sample(ours, jit.address).stack());
        code(&mut symbolizer, ours).read_at = long_ago;
        symbolizer.note_code(user_sample(ours, jit.address + 8).stack());
        assert_eq!(
            code(&mut symbolizer, ours).read_at,
            long_ago,
            "JIT code is known code"
        );

        // Below any mapping of a process whose mappings nothing changes
        // (tests running beside this one map code in this process): read
        // again, waiting twice as long each time.
        let (mut child, _, _) = sleeping_child();
        let pid = child.id();
        symbolizer.note_code(user_sample(pid, 0x10).stack());
        let mut waits = Vec::new();
        for _ in 0..7 {
            code(&mut symbolizer, pid).read_at = long_ago;
            symbolizer.note_code(user_sample(pid, 0x10).stack());
            assert!(code(&mut symbolizer, pid).read_at > long_ago);
            waits.push(code(&mut symbolizer, pid).reread_after.as_secs());
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(waits, [2, 4, 8, 16, 32, 32, 32]);
        // Not before that wait is over.
        let read_at = code(&mut symbolizer, pid).read_at;
        symbolizer.note_code(user_sample(pid, 0x10).stack());
        assert_eq!(code(&mut symbolizer, pid).read_at, read_at);

        // Code mapped since: found at the next read, and the wait is short again.
        code(&mut symbolizer, ours).reread_after = MAPS_REREAD_AT_MOST;
        let later = AnonymousCode::map();
        code(&mut symbolizer, ours).read_at = long_ago;
        symbolizer.note_code(user_sample(ours, later.address).stack());
        let known = code(&mut symbolizer, ours);
        assert!(maps::in_code(&known.all, later.address));
        assert_eq!(known.reread_after, MAPS_REREAD_AFTER);
    }

    /// A noted sample's addresses are named in the background: a trace
    /// built later finds them named without waiting for blazesym.
    #[test]
    fn a_noted_sample_is_named_before_it_is_asked_for() {
        let pid = std::process::id();
        let address = a_noted_sample_is_named_before_it_is_asked_for as *const () as u64;
        let sample = user_sample(pid, address);
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_stack(sample.stack());
        assert!(symbolizer.asked.contains(&(Space::Process(pid), address)));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !symbolizer.asked.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            symbolizer.take_answers();
        }
        let symbol = symbolizer.get(Space::Process(pid), address);
        let function = &symbol
            .frames
            .last()
            .expect("named in the background")
            .function;
        assert!(
            function.contains("a_noted_sample_is_named_before_it_is_asked_for"),
            "{symbol:?}"
        );
        // Noted again, it is not asked again.
        symbolizer.note_stack(sample.stack());
        assert!(symbolizer.asked.is_empty());
    }

    /// Names asked for a process that is forgotten before they come are
    /// not kept (its pid may be a new process's by then).
    #[test]
    fn names_that_come_after_their_process_was_forgotten_are_dropped() {
        let pid = std::process::id();
        let address =
            names_that_come_after_their_process_was_forgotten_are_dropped as *const () as u64;
        let sample = user_sample(pid, address);
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.note_stack(sample.stack());
        symbolizer.forget_process(pid);
        let answers = symbolizer.thread.wait_for_all();
        assert_eq!(answers.len(), 1);
        for answer in answers {
            symbolizer.keep(answer);
        }
        assert!(symbolizer.cache.is_empty());
        assert!(symbolizer.asked.is_empty());
    }

    /// An address in a function known to have one name throughout is
    /// named without a lookup; one past its end is asked for.
    #[test]
    fn an_address_in_a_function_named_whole_is_not_asked_for() {
        let pid = std::process::id();
        let mut symbolizer = StackSymbolizer::default();
        symbolizer.asked.insert((Space::Process(pid), 0x1010));
        let symbol = Symbol {
            frames: vec![Frame {
                function: "f".into(),
                file: None,
                line: None,
            }],
            module: Some("libf.so".into()),
            file_offset: None,
        };
        symbolizer.keep(Answer::for_test(
            pid,
            vec![0x1010],
            vec![Some(symbol.clone())],
            vec![Some(0x1000..0x1040)],
        ));
        symbolizer.ask_ahead(user_sample(pid, 0x1000).stack());
        symbolizer.ask_ahead(user_sample(pid, 0x103f).stack());
        assert!(symbolizer.asked.is_empty());
        for address in [0x1000, 0x1010, 0x103f] {
            let found = symbolizer.get(Space::Process(pid), address);
            assert_eq!(
                (&found.frames, &found.module),
                (&symbol.frames, &symbol.module)
            );
        }
        // Not in another process, nor past the function's end.
        symbolizer.ask_ahead(user_sample(pid, 0x1040).stack());
        symbolizer.ask_ahead(user_sample(pid + 1, 0x1010).stack());
        assert!(symbolizer.asked.contains(&(Space::Process(pid), 0x1040)));
        assert!(
            symbolizer
                .asked
                .contains(&(Space::Process(pid + 1), 0x1010))
        );
        symbolizer.forget_process(pid);
        assert!(!symbolizer.named_by_function(Space::Process(pid), 0x1010));
    }

    #[test]
    fn a_forgotten_process_keeps_nothing() {
        let mut symbolizer = StackSymbolizer::default();
        let pid = std::process::id();
        let address = a_forgotten_process_keeps_nothing as *const () as u64;
        symbolizer.resolve(Space::Process(pid), [address]);
        symbolizer.resolve(Space::Process(pid + 1), [address]);
        assert!(
            !symbolizer
                .get(Space::Process(pid), address)
                .frames
                .is_empty()
        );
        symbolizer.forget_process(pid);
        assert!(
            symbolizer
                .get(Space::Process(pid), address)
                .frames
                .is_empty()
        );
        assert_eq!(symbolizer.cache.len(), 1);
    }

    #[test]
    fn an_address_is_in_the_mapping_that_starts_at_or_below_it() {
        let m = |start, end| Mapping {
            start,
            end,
            perms: "r-xp".into(),
            offset: 0,
            dev: "00:00".into(),
            inode: 1,
            path: "/x".into(),
            deleted: false,
        };
        let maps = [m(0x1000, 0x2000), m(0x3000, 0x4000)];
        assert_eq!(mapping_of(&maps, 0x1000).map(|m| m.start), Some(0x1000));
        assert_eq!(mapping_of(&maps, 0x1fff).map(|m| m.start), Some(0x1000));
        assert_eq!(mapping_of(&maps, 0x2000), None);
        assert_eq!(mapping_of(&maps, 0x3800).map(|m| m.start), Some(0x3000));
        assert_eq!(mapping_of(&maps, 0xfff), None);
        assert_eq!(mapping_of(&[], 0x1000), None);
    }
}
