//! The control socket as ebtrace reads it. Every frame comes from inside
//! the target, which may be hostile: an answer is bounded in bytes, frames
//! and time, and all the answers of one session (a capture) in bytes.
//! Past a bound the channel is broken for good (its frames can no longer
//! be told apart), and every later request fails with the same line.

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use tracer_agent::protocol::{self, Header, Hello};

/// The most one answer may bring: one framework's XSpace of a capture as
/// long as `--max-target-growth-mib` lets its session run fits (jaxlib
/// holds about 140 bytes an event, which TSL writes in about 30).
pub const MAX_ANSWER_BYTES: u64 = 256 << 20;
/// The most frames one answer may bring (a device activity batch is a
/// frame; the agent's buffers hold far fewer).
pub const MAX_ANSWER_FRAMES: u32 = 16_384;
/// The most all the answers of one session (a capture) may bring: with
/// what they decode into (at most 512 MiB, `timeline::framework`), within
/// the 2 GiB the DaemonSet gives ebtrace beside its flight recorder.
pub const MAX_SESSION_BYTES: u64 = 1 << 30;
/// How long the agent may stay silent within an answer: it waits for the
/// GIL, and stopping a session serializes its events.
const SILENCE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long it may stay silent answering what it answers without Python
/// or the framework (a ping, opening a window, the device activity so
/// far), asked again and again while a capture runs: a silent agent holds
/// whoever asks no longer than this, once.
const QUICK_SILENCE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one answer may take in all, however it trickles in.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);
/// How often a wait for an answer looks whether it was abandoned.
const ABANDON_CHECK: Duration = Duration::from_millis(100);
/// Bytes read into a frame at a time: a header that announces a large
/// payload gets memory only as the payload arrives.
const READ_CHUNK: usize = 16 << 20;

/// Set once ebtrace is told to stop at once (a second Ctrl-C, a server's
/// shutdown past its deadline): the process is going, so every answer is.
static ANSWERS_ABANDONED: AtomicBool = AtomicBool::new(false);

/// Ends every wait for an agent's answer, in this process, within
/// [`ABANDON_CHECK`], and every later one at once: each channel breaks
/// with a line saying so. Async-signal-safe (an atomic store).
pub fn abandon_every_answer() {
    ANSWERS_ABANDONED.store(true, Ordering::SeqCst);
}

/// Whether [`abandon_every_answer`] was called: no agent is to be asked
/// anything more, nor loaded to be asked.
pub fn answers_abandoned() -> bool {
    ANSWERS_ABANDONED.load(Ordering::SeqCst)
}

/// The control socket to one target's agent.
pub struct Channel {
    stream: UnixStream,
    pid: u32,
    /// The request being answered, for messages.
    request: &'static str,
    answer_bytes: u64,
    answer_frames: u32,
    answer_began: Instant,
    /// How long the answer may stay silent.
    silence: Duration,
    session_bytes: u64,
    /// Why the channel can no longer be used.
    broken: Option<String>,
}

impl Channel {
    /// The channel over `stream`, to the agent in `pid`. The socket moves
    /// above ebtrace's other descriptors: should ebtrace die, it is closed
    /// first, and the agent lets its session go at once.
    pub fn new(stream: UnixStream, pid: u32) -> Self {
        Channel {
            stream: UnixStream::from(crate::procfs::released_first_at_exit(stream.into())),
            pid,
            request: "HELLO",
            answer_bytes: 0,
            answer_frames: 0,
            answer_began: Instant::now(),
            silence: SILENCE_TIMEOUT,
            session_bytes: 0,
            broken: None,
        }
    }

    /// Sends a request named `request` (for messages); its answer is
    /// counted from now.
    pub fn send(&mut self, request: &'static str, kind: u32, payload: &[u8]) -> Result<(), String> {
        if let Some(why) = &self.broken {
            return Err(why.clone());
        }
        let header = Header {
            kind,
            len: payload.len() as u32,
        };
        self.request = request;
        self.answer_bytes = 0;
        self.answer_frames = 0;
        self.answer_began = Instant::now();
        self.silence = match kind {
            protocol::PING | protocol::WINDOW_OPEN | protocol::COLLECT => QUICK_SILENCE_TIMEOUT,
            _ => SILENCE_TIMEOUT,
        };
        self.stream
            .write_all(&header.encode())
            .and_then(|()| self.stream.write_all(payload))
            .map_err(|e| format!("the agent in pid {} is gone: {e}", self.pid))
    }

    /// The next frame of the current answer.
    pub fn receive(&mut self) -> Result<(u32, Vec<u8>), String> {
        if let Some(why) = &self.broken {
            return Err(why.clone());
        }
        let mut h = [0u8; protocol::HEADER_LEN];
        self.read_exact(&mut h)?;
        let header = Header::decode(&h);
        let len = u64::from(header.len);
        self.answer_frames += 1;
        self.answer_bytes += len;
        self.session_bytes += len;
        let past = if self.answer_frames > MAX_ANSWER_FRAMES {
            Some(format!("more than {MAX_ANSWER_FRAMES} frames"))
        } else if self.answer_bytes > MAX_ANSWER_BYTES {
            Some(format!("more than {} MiB", MAX_ANSWER_BYTES >> 20))
        } else if self.session_bytes > MAX_SESSION_BYTES {
            Some(format!(
                "more than {} MiB in the capture's answers",
                MAX_SESSION_BYTES >> 20
            ))
        } else {
            None
        };
        if let Some(past) = past {
            return Err(self.break_with(format!(
                "the agent in pid {} sent {past} in answer to {}: what it sent is dropped and \
                 its part of the capture ends here",
                self.pid, self.request
            )));
        }
        let mut payload = Vec::new();
        let mut left = header.len as usize;
        while left > 0 {
            let chunk = left.min(READ_CHUNK);
            let at = payload.len();
            payload.resize(at + chunk, 0);
            self.read_exact(&mut payload[at..])?;
            left -= chunk;
        }
        Ok((header.kind, payload))
    }

    /// Reads the agent's greeting: this protocol's version, from the
    /// process the channel leads to.
    pub fn greeting(&mut self) -> Result<Hello, String> {
        let pid = self.pid;
        let (kind, payload) = self.receive()?;
        if kind != protocol::HELLO {
            return Err(format!("the agent in pid {pid} greeted with frame {kind}"));
        }
        let hello = Hello::decode(&payload)
            .ok_or_else(|| format!("the agent in pid {pid} sent a malformed greeting"))?;
        if hello.version != protocol::VERSION {
            return Err(format!(
                "it speaks protocol version {}, this ebtrace {} (start the program with this \
                 ebtrace's `ebtrace agent-library`)",
                hello.version,
                protocol::VERSION
            ));
        }
        // In a container with a pid namespace of its own the agent knows
        // the process by the pid it has there.
        let own_pid = crate::procfs::namespace_tid(pid, pid);
        if hello.pid != pid && Some(hello.pid) != own_pid {
            return Err(format!(
                "the agent in pid {pid} says it runs in pid {}",
                hello.pid
            ));
        }
        Ok(hello)
    }

    /// Fills `buf` within the answer's time bounds, unless every answer
    /// is abandoned meanwhile.
    fn read_exact(&mut self, mut buf: &mut [u8]) -> Result<(), String> {
        let pid = self.pid;
        let mut heard = Instant::now();
        while !buf.is_empty() {
            if answers_abandoned() {
                return Err(self.break_with(format!(
                    "the answer of the agent in pid {pid} to {} was abandoned: ebtrace was told \
                     to stop at once",
                    self.request
                )));
            }
            let left = ANSWER_TIMEOUT.saturating_sub(self.answer_began.elapsed());
            if left.is_zero() {
                return Err(self.break_with(format!(
                    "the agent in pid {pid} took more than {} s to answer {}",
                    ANSWER_TIMEOUT.as_secs(),
                    self.request
                )));
            }
            let silence_left = self.silence.saturating_sub(heard.elapsed());
            if silence_left.is_zero() {
                return Err(format!(
                    "no answer from the agent in pid {pid}: silent for {} s in answer to {}; \
                     nothing more is asked of it in this capture",
                    self.silence.as_secs(),
                    self.request
                ));
            }
            let lost = |e: std::io::Error| format!("no answer from the agent in pid {pid}: {e}");
            self.stream
                .set_read_timeout(Some(left.min(silence_left).min(ABANDON_CHECK)))
                .map_err(lost)?;
            match self.stream.read(buf) {
                Ok(0) => {
                    return Err(lost(std::io::ErrorKind::UnexpectedEof.into()));
                }
                Ok(n) => {
                    buf = &mut buf[n..];
                    heard = Instant::now();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted
                            | std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(lost(e)),
            }
        }
        Ok(())
    }

    fn break_with(&mut self, why: String) -> String {
        self.broken = Some(why.clone());
        why
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Header {
            kind,
            len: payload.len() as u32,
        }
        .encode()
        .to_vec();
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn an_answer_of_too_many_frames_breaks_the_channel_for_good() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut channel = Channel::new(ours, 1);
        let writer = std::thread::spawn(move || {
            let mut theirs = theirs;
            for _ in 0..=MAX_ANSWER_FRAMES {
                if theirs
                    .write_all(&frame(protocol::DEVICE_ACTIVITY, &[]))
                    .is_err()
                {
                    break;
                }
            }
        });
        channel.send("COLLECT", protocol::COLLECT, &[]).unwrap();
        let mut frames = 0;
        let why = loop {
            match channel.receive() {
                Ok(_) => frames += 1,
                Err(why) => break why,
            }
        };
        assert_eq!(frames, MAX_ANSWER_FRAMES);
        assert!(
            why.contains("more than 16384 frames in answer to COLLECT"),
            "{why}"
        );
        assert!(channel.broken.is_some());
        // Every later request says the same, and sends nothing.
        assert_eq!(channel.send("STOP", protocol::STOP, &[]), Err(why));
        drop(channel);
        writer.join().unwrap();
    }

    #[test]
    fn a_frame_gets_memory_only_as_it_arrives() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut channel = Channel::new(ours, 1);
        // A header that announces all an answer may bring, then 3 bytes
        // and the end.
        let mut theirs = theirs;
        theirs
            .write_all(
                &Header {
                    kind: protocol::XSPACE,
                    len: MAX_ANSWER_BYTES as u32,
                }
                .encode(),
            )
            .unwrap();
        theirs.write_all(b"abc").unwrap();
        drop(theirs);
        let before = crate::procfs::own_resident_bytes();
        let why = channel.receive().unwrap_err();
        assert!(why.contains("no answer from the agent in pid 1"), "{why}");
        let grown = crate::procfs::own_resident_bytes().saturating_sub(before);
        assert!(grown < 64 << 20, "grew by {grown} bytes");
    }

    #[test]
    fn a_capture_s_answers_are_bounded_together() {
        let mut channel = Channel::new(UnixStream::pair().unwrap().0, 1);
        channel.session_bytes = MAX_SESSION_BYTES;
        let (ours, theirs) = UnixStream::pair().unwrap();
        channel.stream = ours;
        let mut theirs = theirs;
        theirs
            .write_all(&frame(protocol::DEVICE_ACTIVITY, b"x"))
            .unwrap();
        channel.send("COLLECT", protocol::COLLECT, &[]).unwrap();
        let why = channel.receive().unwrap_err();
        assert!(why.contains("in the capture's answers"), "{why}");
    }
}
