//! A tracer process under the benchmark: its output lines as they come,
//! with the time each arrived, and its peak memory once it has exited.
//! (ebtrace's own side, its `--json` summary, is in [`harness`](super::harness).)

use std::{
    io::{BufRead as _, BufReader, Read},
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::BpftraceRun;
use crate::util::{self, signal};

/// Which output a line came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

pub struct Traced {
    child: Child,
    name: String,
    spawned: Instant,
    lines_rx: Receiver<(Instant, Stream, String)>,
    /// Every line seen so far, stdout and stderr interleaved.
    lines: Vec<String>,
    /// The stdout lines among them.
    stdout: Vec<String>,
    /// When each awaited line arrived, counted from the spawn.
    marks: Vec<Duration>,
    readers: Vec<JoinHandle<()>>,
    reaped: bool,
}

fn forward(
    output: impl Read + Send + 'static,
    stream: Stream,
    tx: mpsc::Sender<(Instant, Stream, String)>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(output).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), stream, line)).is_err() {
                break;
            }
        }
    })
}

impl Traced {
    pub fn spawn(mut cmd: Command) -> Result<Self> {
        let name = util::display(&cmd);
        let spawned = Instant::now();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting `{name}`"))?;
        let (tx, lines_rx) = mpsc::channel();
        let readers = vec![
            forward(
                child.stdout.take().expect("piped"),
                Stream::Stdout,
                tx.clone(),
            ),
            forward(child.stderr.take().expect("piped"), Stream::Stderr, tx),
        ];
        Ok(Traced {
            child,
            name,
            spawned,
            lines_rx,
            lines: Vec::new(),
            stdout: Vec::new(),
            marks: Vec::new(),
            readers,
            reaped: false,
        })
    }

    /// Waits for a line matching `pred`; records when it came.
    pub fn wait_line(&mut self, pred: impl Fn(&str) -> bool, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines_rx.recv_timeout(left) {
                Ok((at, stream, line)) => {
                    self.keep(stream, line.clone());
                    if pred(&line) {
                        self.marks.push(at - self.spawned);
                        return Ok(line);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    bail!(
                        "{}: no expected line after {timeout:?}; output: {:?}",
                        self.name,
                        self.lines
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    bail!("{} exited early; output: {:?}", self.name, self.lines)
                }
            }
        }
    }

    fn keep(&mut self, stream: Stream, line: String) {
        if stream == Stream::Stdout {
            self.stdout.push(line.clone());
        }
        self.lines.push(line);
    }

    /// Takes the lines that came but were not awaited.
    fn keep_the_rest(&mut self) {
        for (_, stream, line) in self.lines_rx.try_iter().collect::<Vec<_>>() {
            self.keep(stream, line);
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// When the last awaited line came, counted from the spawn.
    pub fn last_mark(&self) -> Option<Duration> {
        self.marks.last().copied()
    }

    /// Every output line seen so far.
    pub fn lines(&self) -> &[String] {
        &self.lines
    }

    /// The stdout lines seen so far.
    pub fn stdout(&self) -> &[String] {
        &self.stdout
    }

    /// Waits for the process to exit (killing it past `timeout`), collects
    /// the rest of its output, and returns its peak RSS in KiB.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<u64> {
        let pid = self.child.id() as libc::pid_t;
        let start = Instant::now();
        let mut status = 0;
        // SAFETY: zeroed rusage is a valid out-parameter.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // wait4 rather than Child::wait: it reports this child's own
        // ru_maxrss (RUSAGE_CHILDREN would mix in the fixture and bpftrace).
        loop {
            // SAFETY: valid pointers; pid is our unreaped child.
            let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
            if r == pid {
                break;
            }
            if r < 0 {
                bail!(
                    "wait4 on {}: {}",
                    self.name,
                    std::io::Error::last_os_error()
                );
            }
            if start.elapsed() > timeout {
                signal(pid as u32, libc::SIGKILL);
                // SAFETY: as above; blocks until the kill lands.
                unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
                self.reaped = true;
                bail!("{} still running after {timeout:?}; killed", self.name);
            }
            thread::sleep(Duration::from_millis(20));
        }
        self.reaped = true;
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        self.keep_the_rest();
        let exited_ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        // bpftrace exits 0 on SIGINT; anything else is a failure.
        if !exited_ok {
            bail!(
                "{} failed (wait status {status:#x}); output: {:?}",
                self.name,
                self.lines
            );
        }
        Ok(usage.ru_maxrss as u64)
    }

    /// Kills the process (SIGKILL) and returns how long the kernel took to
    /// end it: from the signal until it could be reaped, which includes
    /// closing its descriptors.
    pub fn kill_and_reap(&mut self) -> Result<Duration> {
        let pid = self.child.id();
        let start = Instant::now();
        signal(pid, libc::SIGKILL);
        self.child
            .wait()
            .with_context(|| format!("reaping {}", self.name))?;
        let took = start.elapsed();
        self.reaped = true;
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        self.keep_the_rest();
        Ok(took)
    }

    /// Stops bpftrace (SIGINT makes it print its maps) and sums the counts.
    pub fn finish_bpftrace(&mut self) -> Result<BpftraceRun> {
        signal(self.child.id(), libc::SIGINT);
        self.wait_exit(Duration::from_secs(60))?;
        let sum = |map: &str| -> u64 {
            let prefix = format!("@{map}[");
            self.lines
                .iter()
                .filter(|l| l.starts_with(&prefix))
                .filter_map(|l| l.rsplit(": ").next()?.trim().parse::<u64>().ok())
                .sum()
        };
        Ok(BpftraceRun {
            spawn_to_attaching: self.marks[0],
            spawn_to_ready: self.marks[1],
            switches: sum("switch"),
            wakeups: sum("wakeup"),
        })
    }
}

impl Traced {
    /// Stops bpftrace (SIGINT makes it print its maps) and reads the
    /// scalar map `@<map>: N`.
    pub fn finish_bpftrace_map(&mut self, map: &str) -> Result<u64> {
        signal(self.child.id(), libc::SIGINT);
        self.wait_exit(Duration::from_secs(60))?;
        let prefix = format!("@{map}: ");
        self.lines
            .iter()
            .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
            .with_context(|| format!("no `{prefix}N` line in {:?}", self.lines))
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        // Error paths only: never leave a tracer attached.
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
