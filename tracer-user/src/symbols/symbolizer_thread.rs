//! blazesym's symbolizer on a thread of its own. It keeps what it parsed
//! (a library's symbols and debug information, the kernel's symbol table)
//! from one lookup to the next, for as long as its owner lives: parsing is
//! most of what naming a stack costs, and a recorder names new stacks for
//! as long as it runs. It cannot move between threads itself, and a
//! thread of its own also lets addresses be named while stacks are being
//! sampled, without the recording waiting for it.

use std::{
    sync::mpsc::{self, Receiver, Sender},
    thread::JoinHandle,
};

use blazesym::{
    Pid,
    symbolize::{
        Input, Symbolizer,
        source::{Elf, Kernel, Process, Source},
    },
};

use super::stacks::{Symbol, symbol_of};

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

fn serve(jobs: Receiver<Job>, answers: Sender<Answer>) {
    let mut parsed: Option<Symbolizer> = None;
    for job in jobs {
        match job {
            Job::Forget => parsed = None,
            Job::LookUp {
                place,
                addresses,
                waited,
            } => {
                let symbolizer = parsed.get_or_insert_with(symbolizer);
                let found = match &place {
                    Place::Kernel => symbolizer.symbolize(
                        &Source::Kernel(Kernel::default()),
                        Input::AbsAddr(&addresses),
                    ),
                    Place::Process(pid) => symbolizer.symbolize(
                        &Source::Process(Process::new(Pid::from(*pid))),
                        Input::AbsAddr(&addresses),
                    ),
                    Place::File(path) => symbolizer
                        .symbolize(&Source::Elf(Elf::new(path)), Input::FileOffset(&addresses)),
                };
                let symbols = found.ok().map(|f| f.iter().map(symbol_of).collect());
                let answer = Answer {
                    place,
                    addresses,
                    symbols,
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
