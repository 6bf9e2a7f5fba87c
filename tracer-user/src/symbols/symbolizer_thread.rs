//! blazesym's symbolizer on a thread of its own. It keeps what it parsed
//! (a library's symbols and debug information, the kernel's symbol table)
//! from one lookup to the next, for as long as its owner lives: parsing is
//! most of what naming a stack costs, and a recorder names new stacks for
//! as long as it runs. It cannot move between threads itself, and a
//! thread of its own also lets addresses be named while stacks are being
//! sampled, without the recording waiting for it.
//!
//! A process's memory map is read once and kept ([`ProcessMaps`]): blazesym
//! otherwise reads `/proc/PID/maps` at every lookup, and a Python process
//! with jaxlib maps thousands of regions, so that reading took most of a
//! recorder's CPU on a jax loop.
//!
//! What it answers for an address is a [`Symbol`]: the functions there,
//! inlined ones first, with their files and lines.

use std::{
    collections::HashMap,
    ops::Range,
    sync::mpsc::{self, Receiver, Sender},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use blazesym::{
    Pid,
    symbolize::{
        CodeInfo, Input, Reason, Symbolized, Symbolizer, cache,
        source::{Elf, Kernel, Process, Source},
    },
};

/// One function at an address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The function's name, demangled.
    pub function: String,
    /// Its source file, where the object has debug information.
    pub file: Option<String>,
    /// The line in that file.
    pub line: Option<u32>,
}

/// What is at one address: the functions inlined there, innermost first,
/// then the function the address is in. Empty where nothing is known.
#[derive(Clone, Debug, Default)]
pub struct Symbol {
    /// The functions inlined at the address, innermost first, then the one it is in.
    pub frames: Vec<Frame>,
    /// The object the address is in, where known.
    pub module: Option<String>,
    /// Where no function is named: the address's offset in `module`'s
    /// file (what `addr2line -e` takes), from the process's mappings.
    pub file_offset: Option<u64>,
}

impl Symbol {
    /// Where an unnamed address is, as `object+0xoffset` (what `perf`
    /// prints for one): a local function of a stripped object, such as a
    /// distribution's Python, is unnamed but still told apart.
    pub fn place(&self) -> Option<String> {
        let (module, offset) = (self.module.as_deref()?, self.file_offset?);
        let name = module.rsplit('/').next().unwrap_or(module);
        Some(format!("{name}+{offset:#x}"))
    }
}

/// The functions blazesym found at one address, innermost first.
fn symbol_of(result: &Symbolized<'_>) -> Option<Symbol> {
    let Symbolized::Sym(sym) = result else {
        return None;
    };
    let mut frames: Vec<Frame> = sym
        .inlined
        .iter()
        .rev()
        .map(|f| frame(&f.name, f.code_info.as_ref()))
        .collect();
    frames.push(frame(&sym.name, sym.code_info.as_deref()));
    Some(Symbol {
        frames,
        module: sym
            .module
            .as_ref()
            .map(|m| m.to_string_lossy().into_owned()),
        file_offset: None,
    })
}

fn frame(function: &str, code_info: Option<&CodeInfo<'_>>) -> Frame {
    Frame {
        function: function.to_string(),
        file: code_info.map(|c| c.to_path().display().to_string()),
        line: code_info.and_then(|c| c.line),
    }
}

/// The addresses of the function `found` names at `address`, where every
/// one of them has that name alone: no inlined functions, no file:line.
fn function_range(address: u64, found: &Symbolized<'_>) -> Option<Range<u64>> {
    let Symbolized::Sym(sym) = found else {
        return None;
    };
    if sym.code_info.is_some() || !sym.inlined.is_empty() {
        return None;
    }
    let start = address.checked_sub(sym.offset as u64)?;
    let end = start.checked_add(sym.size? as u64)?;
    (address < end).then_some(start..end)
}

/// Where the addresses of a lookup are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Place {
    Kernel,
    /// Addresses in the address space of a running process.
    Process(u32),
    /// Offsets in an object file.
    File(String),
}

/// The names found for a lookup's addresses: one per address (`None`
/// where there is none), or `None` for all when the place could not be
/// read (a process that exited, a file that is gone).
pub(super) struct Answer {
    pub place: Place,
    pub addresses: Vec<u64>,
    pub symbols: Option<Vec<Option<Symbol>>>,
    /// Addresses outside the process's mappings as last read, which were
    /// read too recently to be read again: a library loaded since may hold
    /// them, so they are to be asked again rather than kept nameless.
    pub not_yet: Vec<u64>,
    /// For each address whose name holds no more than its function (no
    /// inlined functions, no file:line: an object without debug
    /// information), the addresses of that function, which all have that
    /// name (empty when there are none).
    pub functions: Vec<Option<Range<u64>>>,
    /// Whether its asker waits for it ([`SymbolizerThread::look_up`]).
    waited: bool,
}

enum Job {
    LookUp {
        place: Place,
        addresses: Vec<u64>,
        waited: bool,
    },
    /// Drop everything parsed so far.
    Forget,
}

/// The thread, started at the first lookup and ended when this is dropped.
#[derive(Default)]
pub(super) struct SymbolizerThread {
    running: Option<Running>,
    /// Lookups asked and not answered yet.
    in_flight: usize,
}

struct Running {
    jobs: Sender<Job>,
    answers: Receiver<Answer>,
    thread: JoinHandle<()>,
}

/// The symbolizer every lookup goes through: names with the functions
/// inlined at an address and file:line where there is debug information.
fn symbolizer() -> Symbolizer {
    Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .enable_demangling(true)
        .build()
}

/// How long a process's memory map, once read, names its addresses before
/// it is read again (a library unloaded and another loaded in its place).
const MAPS_KEPT: Duration = Duration::from_secs(10);
/// How soon an address outside every mapping read has them read again
/// sooner: a library loaded since. Code a JIT wrote to anonymous memory is
/// never in them, so this is at most once a second.
const MAPS_RECHECKED: Duration = Duration::from_secs(1);

/// When blazesym last kept each process's memory map.
#[derive(Default)]
struct ProcessMaps {
    read_at: HashMap<u32, Instant>,
}

impl ProcessMaps {
    /// Names `addresses` of process `pid`, from its memory map as last
    /// kept; with the addresses outside it that are to be asked again
    /// later (see [`Answer::not_yet`]).
    fn symbolize<'s>(
        &mut self,
        symbolizer: &'s Symbolizer,
        pid: u32,
        addresses: &[u64],
    ) -> blazesym::Result<(Vec<Symbolized<'s>>, Vec<u64>)> {
        let read_within =
            |maps: &Self, age: Duration| maps.read_at.get(&pid).is_some_and(|t| t.elapsed() < age);
        let read_now = !read_within(self, MAPS_KEPT);
        if read_now {
            self.read(symbolizer, pid);
        }
        let source = Source::Process(Process::new(Pid::from(pid)));
        let found = symbolizer.symbolize(&source, Input::AbsAddr(addresses))?;
        let not_yet: Vec<u64> = addresses
            .iter()
            .zip(&found)
            .filter(|(_, s)| matches!(s, Symbolized::Unknown(Reason::Unmapped)))
            .map(|(a, _)| *a)
            .collect();
        if not_yet.is_empty() || read_now {
            return Ok((found, Vec::new()));
        }
        if read_within(self, MAPS_RECHECKED) {
            return Ok((found, not_yet));
        }
        // What is still outside once read again is outside for good.
        self.read(symbolizer, pid);
        let found = symbolizer.symbolize(&source, Input::AbsAddr(addresses))?;
        Ok((found, Vec::new()))
    }

    /// Has blazesym read and keep `pid`'s memory map. Where that fails (the
    /// process is gone) what was kept stays, and the next lookup tries
    /// again; a new process taking the pid makes its owner forget it all
    /// ([`SymbolizerThread::forget_parsed`]).
    fn read(&mut self, symbolizer: &Symbolizer, pid: u32) {
        let mut process = cache::Process::new(Pid::from(pid));
        process.cache_perf_map = false;
        if symbolizer.cache(&cache::Cache::Process(process)).is_ok() {
            self.read_at.insert(pid, Instant::now());
        } else {
            self.read_at.remove(&pid);
        }
    }
}

fn serve(jobs: Receiver<Job>, answers: Sender<Answer>) {
    let mut parsed: Option<Symbolizer> = None;
    let mut maps = ProcessMaps::default();
    for job in jobs {
        match job {
            Job::Forget => {
                parsed = None;
                maps = ProcessMaps::default();
            }
            Job::LookUp {
                place,
                addresses,
                waited,
            } => {
                let symbolizer = parsed.get_or_insert_with(symbolizer);
                let found = match &place {
                    Place::Kernel => symbolizer
                        .symbolize(
                            &Source::Kernel(Kernel::default()),
                            Input::AbsAddr(&addresses),
                        )
                        .map(|f| (f, Vec::new())),
                    Place::Process(pid) => maps.symbolize(symbolizer, *pid, &addresses),
                    Place::File(path) => symbolizer
                        .symbolize(&Source::Elf(Elf::new(path)), Input::FileOffset(&addresses))
                        .map(|f| (f, Vec::new())),
                };
                let (symbols, not_yet, functions) = match found {
                    Ok((f, not_yet)) => {
                        let functions = match place {
                            Place::File(_) => Vec::new(),
                            Place::Kernel | Place::Process(_) => addresses
                                .iter()
                                .zip(&f)
                                .map(|(a, s)| function_range(*a, s))
                                .collect(),
                        };
                        (Some(f.iter().map(symbol_of).collect()), not_yet, functions)
                    }
                    Err(_) => (None, Vec::new(), Vec::new()),
                };
                let answer = Answer {
                    place,
                    addresses,
                    symbols,
                    not_yet,
                    functions,
                    waited,
                };
                if answers.send(answer).is_err() {
                    return;
                }
            }
        }
    }
}

impl SymbolizerThread {
    fn running(&mut self) -> Option<&Running> {
        if self.running.is_none() {
            let (jobs, queue) = mpsc::channel();
            let (answer, answers) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name("ebtrace-symbols".into())
                .spawn(move || serve(queue, answer))
                .ok()?;
            self.running = Some(Running {
                jobs,
                answers,
                thread,
            });
        }
        self.running.as_ref()
    }

    /// Asks for the names of `addresses` of `place` without waiting: the
    /// answer comes with [`Self::answers`] or [`Self::look_up`]. False if
    /// the thread could not be started or has ended.
    pub fn ask(&mut self, place: Place, addresses: Vec<u64>) -> bool {
        self.send(place, addresses, false)
    }

    fn send(&mut self, place: Place, addresses: Vec<u64>, waited: bool) -> bool {
        let Some(running) = self.running() else {
            return false;
        };
        let job = Job::LookUp {
            place,
            addresses,
            waited,
        };
        let sent = running.jobs.send(job).is_ok();
        self.in_flight += usize::from(sent);
        sent
    }

    /// The answers that came since the last call, without waiting.
    pub fn answers(&mut self) -> Vec<Answer> {
        let Some(running) = &self.running else {
            return Vec::new();
        };
        let answers: Vec<Answer> = running.answers.try_iter().collect();
        self.in_flight -= answers.len();
        answers
    }

    /// Every answer still to come: those asked for earlier, in the order
    /// they were asked.
    pub fn wait_for_all(&mut self) -> Vec<Answer> {
        self.receive_until(|_| false)
    }

    /// Looks `addresses` of `place` up and waits for the answer: the
    /// answers of earlier lookups still to come, then its own (none if
    /// the thread ended).
    pub fn look_up(&mut self, place: Place, addresses: Vec<u64>) -> (Vec<Answer>, Option<Answer>) {
        if !self.send(place, addresses, true) {
            return (Vec::new(), None);
        }
        let mut earlier = self.receive_until(|a| a.waited);
        let ours = earlier.pop_if(|a| a.waited);
        (earlier, ours)
    }

    fn receive_until(&mut self, last: impl Fn(&Answer) -> bool) -> Vec<Answer> {
        let mut got = Vec::new();
        while self.in_flight > 0 {
            let Some(running) = &self.running else {
                break;
            };
            // The thread ended (blazesym panicked): nothing more comes.
            let Ok(answer) = running.answers.recv() else {
                self.in_flight = 0;
                break;
            };
            self.in_flight -= 1;
            let done = last(&answer);
            got.push(answer);
            if done {
                break;
            }
        }
        got
    }

    /// Drops what was parsed (the objects of a process that went away
    /// may be in it); the next lookup parses what it needs again.
    pub fn forget_parsed(&mut self) {
        if let Some(running) = &self.running {
            let _ = running.jobs.send(Job::Forget);
        }
    }
}

impl Drop for SymbolizerThread {
    fn drop(&mut self) {
        if let Some(Running {
            jobs,
            answers,
            thread,
        }) = self.running.take()
        {
            // The thread ends once its queue is closed and its last
            // lookup answered (or its answer refused).
            drop(jobs);
            drop(answers);
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
impl Answer {
    /// An answer naming `addresses` of process `pid` with `symbols`.
    pub(super) fn for_test(
        pid: u32,
        addresses: Vec<u64>,
        symbols: Vec<Option<Symbol>>,
        functions: Vec<Option<Range<u64>>>,
    ) -> Answer {
        Answer {
            place: Place::Process(pid),
            addresses,
            symbols: Some(symbols),
            not_yet: Vec::new(),
            functions,
            waited: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use blazesym::symbolize::{CodeInfo, InlinedFn, Sym};

    use super::*;

    /// A function of 0x40 bytes at 0x1000, found at 0x1010.
    fn sym_at_0x1010<'a>() -> Sym<'a> {
        Sym {
            name: Cow::Borrowed("f"),
            module: None,
            addr: 0x1000,
            offset: 0x10,
            size: Some(0x40),
            code_info: None,
            inlined: Box::new([]),
            _non_exhaustive: (),
        }
    }

    /// A function's addresses share its name only where the name is the
    /// function alone: not with file:line, nor with inlined functions.
    #[test]
    fn a_function_without_lines_or_inlined_calls_is_named_whole() {
        let plain = Symbolized::Sym(sym_at_0x1010());
        assert_eq!(function_range(0x1010, &plain), Some(0x1000..0x1040));
        let code_info = CodeInfo {
            dir: None,
            file: Cow::Borrowed(std::ffi::OsStr::new("f.c")),
            line: Some(3),
            column: None,
            _non_exhaustive: (),
        };
        let with_line = Symbolized::Sym(Sym {
            code_info: Some(Box::new(code_info.clone())),
            ..sym_at_0x1010()
        });
        assert_eq!(function_range(0x1010, &with_line), None);
        let with_inlined = Symbolized::Sym(Sym {
            inlined: Box::new([InlinedFn {
                name: Cow::Borrowed("g"),
                code_info: None,
                _non_exhaustive: (),
            }]),
            ..sym_at_0x1010()
        });
        assert_eq!(function_range(0x1010, &with_inlined), None);
        let unsized_ = Symbolized::Sym(Sym {
            size: None,
            ..sym_at_0x1010()
        });
        assert_eq!(function_range(0x1010, &unsized_), None);
        // An offset past the size the object gives: not inside.
        let past = Symbolized::Sym(Sym {
            offset: 0x40,
            ..sym_at_0x1010()
        });
        assert_eq!(function_range(0x1040, &past), None);
        assert_eq!(
            function_range(0x1010, &Symbolized::Unknown(Reason::Unmapped)),
            None
        );
    }

    /// A page of address space reserved for the test (`PROT_NONE`: in no
    /// mapping blazesym reads), so that no other thread can map there.
    fn reserve_page() -> u64 {
        // SAFETY: a fresh anonymous mapping, never unmapped by the test.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        page as u64
    }

    #[test]
    fn a_mapping_made_after_the_maps_were_read_is_asked_again_then_found() {
        let symbolizer = symbolizer();
        let mut maps = ProcessMaps::default();
        let pid = std::process::id();
        let page = reserve_page();
        let known = reserve_page as *const () as u64;
        let first_read = Instant::now();
        let (found, not_yet) = maps.symbolize(&symbolizer, pid, &[known]).unwrap();
        assert!(matches!(found[0], Symbolized::Sym(_)), "{:?}", found[0]);
        assert!(not_yet.is_empty());

        // Made code after the read, as a library loaded or a JIT would:
        // outside what was kept, and too soon to read the maps again.
        // SAFETY: the page is ours, and nothing runs or reads it.
        let made =
            unsafe { libc::mprotect(page as *mut _, 4096, libc::PROT_READ | libc::PROT_EXEC) };
        assert_eq!(made, 0);
        let (found, not_yet) = maps.symbolize(&symbolizer, pid, &[page]).unwrap();
        // (On a loaded machine the second may have come a second later.)
        if first_read.elapsed() < MAPS_RECHECKED {
            assert!(matches!(found[0], Symbolized::Unknown(Reason::Unmapped)));
            assert_eq!(not_yet, [page]);
        }

        // A second on, the maps are read again and hold it.
        std::thread::sleep(MAPS_RECHECKED);
        let reread = Instant::now();
        let (found, not_yet) = maps.symbolize(&symbolizer, pid, &[page]).unwrap();
        assert!(
            !matches!(found[0], Symbolized::Unknown(Reason::Unmapped)),
            "{:?}",
            found[0]
        );
        assert!(not_yet.is_empty());

        // An address in no mapping at all waits like it, and is settled
        // once the maps are read again.
        let (_, not_yet) = maps.symbolize(&symbolizer, pid, &[8]).unwrap();
        if reread.elapsed() < MAPS_RECHECKED {
            assert_eq!(not_yet, [8]);
        }
        std::thread::sleep(MAPS_RECHECKED);
        let (found, not_yet) = maps.symbolize(&symbolizer, pid, &[8]).unwrap();
        assert!(matches!(found[0], Symbolized::Unknown(Reason::Unmapped)));
        assert!(not_yet.is_empty());
    }
}
