//! The fixture processes that print `{"pid":N}`, wait for `go` on stdin,
//! and print one JSON report line when they are done.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// A started gated fixture; killed when dropped.
pub struct Gated {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    /// Its pid, from its first line.
    pub pid: u32,
    what: &'static str,
}

impl Gated {
    /// Starts `cmd` (the fixture `what`) with stdin and stdout piped and
    /// waits for its pid line.
    pub fn start(mut cmd: Command, what: &'static str) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {what}: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{what} start line"));
        let v: serde_json::Value = serde_json::from_str(&first)
            .unwrap_or_else(|e| panic!("bad start line {first:?}: {e}"));
        let pid = v["pid"].as_u64().expect("pid") as u32;
        Gated {
            child,
            stdin,
            lines,
            pid,
            what,
        }
    }

    /// Writes `go` to its stdin, which stays open.
    pub fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin still open");
        stdin.write_all(b"go\n").expect("signal the workload");
        stdin.flush().expect("signal the workload");
    }

    /// Closes its stdin.
    pub fn close_stdin(&mut self) {
        drop(self.stdin.take());
    }

    /// Waits for its report line; the process may go on.
    pub fn report_line(&mut self, deadline: Duration) -> serde_json::Value {
        let what = self.what;
        let line = self
            .lines
            .recv_timeout(deadline)
            .unwrap_or_else(|_| panic!("{what} report line"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad report {line:?}: {e}"))
    }

    /// Waits for its report line and its successful exit.
    pub fn report(mut self, deadline: Duration) -> serde_json::Value {
        let what = self.what;
        let line = self
            .lines
            .recv_timeout(deadline)
            .unwrap_or_else(|_| panic!("{what} report line"));
        let status = self.child.wait().expect("wait for the workload");
        assert!(status.success(), "{what} failed: {status}");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad report {line:?}: {e}"))
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
