//! The control channel between ebtrace and the agent: a stream socket
//! carrying frames of `[kind: u32][len: u32][payload]`, little-endian.
//!
//! ebtrace asks, the agent answers each request with exactly one frame.
//! When ebtrace's end closes (exit, SIGKILL, crash), the agent stops
//! whatever it started and its thread ends: the socket is its watchdog.

/// Version of this protocol, sent in [`HELLO`].
pub const VERSION: u32 = 5;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 8;
/// Longest payload ebtrace accepts from an agent (an XSpace).
pub const MAX_PAYLOAD: u32 = 1 << 30;

/// A preloaded agent listens on the abstract unix socket of this name
/// followed by the program's pid.
pub const SOCKET_PREFIX: &[u8] = b"ebtrace-agent.";

/// Writes the abstract socket name of `pid`'s preloaded agent (without the
/// leading NUL) into `out`; returns its length.
pub fn abstract_socket_name(pid: u32, out: &mut [u8]) -> usize {
    let mut digits = [0u8; 10];
    let mut n = pid;
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let total = SOCKET_PREFIX.len() + len;
    if out.len() < total {
        return 0;
    }
    out[..SOCKET_PREFIX.len()].copy_from_slice(SOCKET_PREFIX);
    for (i, d) in digits[..len].iter().rev().enumerate() {
        out[SOCKET_PREFIX.len() + i] = *d;
    }
    total
}

/// ebtrace → agent: answer [`PONG`].
pub const PING: u32 = 1;
/// ebtrace → agent: start recording: the framework's profiler session
/// (host level > 0) and the device's activity (device level > 0); payload:
/// [`StartRequest`]. Answer: [`STARTED`] if anything records, else
/// [`FAILED`]. While the session runs, the agent ends it by itself if
/// ebtrace sends nothing for the request's lease (a [`PING`] renews it).
pub const START: u32 = 2;
/// ebtrace → agent: stop recording; answer: one [`XSPACE`] per framework
/// session, the [`DEVICE_ACTIVITY`] batches, then [`STOPPED`].
pub const STOP: u32 = 3;
/// ebtrace → agent: stop everything and end the agent's thread; answer:
/// [`BYE`], the last frame.
pub const SHUTDOWN: u32 = 4;
/// ebtrace → agent: the capture window opens now (ebtrace's probes are
/// attached): device activity recorded since [`START`] is discarded, so
/// that a slow attach never fills the device buffers with records the
/// window cuts anyway. Answer: [`WINDOW_OPENED`], or [`FAILED`] with no
/// session running.
pub const WINDOW_OPEN: u32 = 5;
/// ebtrace → agent: name these kernels (payload: function or kernel
/// handles the program launched, u64 each, at most
/// [`MAX_NAMED_KERNELS`]), as the CUDA driver names them. Answer:
/// [`KERNEL_NAMES`], or [`FAILED`] with why (no driver, a driver without
/// `cuFuncGetName`). Works with or without a session.
pub const NAME_KERNELS: u32 = 6;
/// ebtrace → agent: hand over the device activity recorded so far and go
/// on recording. Answer: the [`DEVICE_ACTIVITY`] batches, then
/// [`COLLECTED`] (payload: why some could not be handed over, or nothing);
/// [`FAILED`] with no session running.
pub const COLLECT: u32 = 7;
/// ebtrace → agent: stop the framework's profiler session only (it
/// recorded as much as the capture allows); the device activity goes on.
/// Answer: one [`XSPACE`] per framework session, then [`STOPPED`];
/// [`FAILED`] with no session running.
pub const STOP_FRAMEWORK: u32 = 8;
/// ebtrace → agent, the first request to a preloaded agent: the
/// [`CHALLENGE_LEN`] bytes ebtrace read from the program's memory at the
/// address [`HELLO`] gave, which proves that it may read (and so trace)
/// the program. Answer: [`PROVEN`]; a wrong or late proof closes the
/// connection.
pub const PROVE: u32 = 9;
/// Bytes of a preloaded agent's challenge.
pub const CHALLENGE_LEN: usize = 32;
/// How long a preloaded agent waits for [`PROVE`] after [`HELLO`].
pub const PROOF_TIMEOUT_MS: u32 = 5_000;
/// Handles one [`NAME_KERNELS`] request may carry.
pub const MAX_NAMED_KERNELS: usize = 1024;
/// Longest request payload the agent reads.
pub const MAX_REQUEST_LEN: usize = 8 * MAX_NAMED_KERNELS;

/// agent → ebtrace, first frame after attaching: [`Hello`].
pub const HELLO: u32 = 100;
/// agent → ebtrace: recording; payload: UTF-8 lines `SOURCE\tTEXT`, where
/// SOURCE is [`SOURCE_FRAMEWORK`] or [`SOURCE_DEVICE`] (what records) or
/// [`SOURCE_NOTE`] (a source that could not start, and why).
pub const STARTED: u32 = 101;
/// agent → ebtrace: the request failed; payload: why, one line (UTF-8).
pub const FAILED: u32 = 102;
/// agent → ebtrace: a framework session's serialized XSpace.
pub const XSPACE: u32 = 103;
/// agent → ebtrace: everything stopped; the thread ends.
pub const BYE: u32 = 104;
/// agent → ebtrace: answer to [`PING`].
pub const PONG: u32 = 105;
/// agent → ebtrace: the last answer to [`STOP`]; payload: why a session
/// did not stop cleanly (UTF-8), or nothing.
pub const STOPPED: u32 = 106;

/// agent → ebtrace: a batch of CUPTI activity records (see
/// [`crate::activity`]).
pub const DEVICE_ACTIVITY: u32 = 107;
/// agent → ebtrace: answer to [`WINDOW_OPEN`].
pub const WINDOW_OPENED: u32 = 108;
/// agent → ebtrace: answer to [`NAME_KERNELS`]: one u32 length per handle,
/// in the request's order (0: the driver does not know it), then the
/// names' bytes one after the other.
pub const KERNEL_NAMES: u32 = 109;
/// agent → ebtrace: the last answer to [`COLLECT`].
pub const COLLECTED: u32 = 110;
/// agent → ebtrace: answer to a right [`PROVE`].
pub const PROVEN: u32 = 111;

/// agent → ebtrace: PyTorch's ops, one frame at the end of a recording
/// (see [`crate::op_records`]).
pub const TORCH_OPS: u32 = 112;

/// A [`STARTED`] line: the framework session that runs.
pub const SOURCE_FRAMEWORK: &str = "framework";
/// A [`STARTED`] line: the device activity source that runs.
pub const SOURCE_DEVICE: &str = "device";
/// A [`STARTED`] line: PyTorch's ops recording.
pub const SOURCE_OPS: &str = "ops";
/// A [`STARTED`] line: a source that did not start, and why.
pub const SOURCE_NOTE: &str = "note";

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// One of the kinds above.
    pub kind: u32,
    /// Payload bytes that follow.
    pub len: u32,
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0; HEADER_LEN];
        b[..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads a header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        Header {
            kind: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            len: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        }
    }
}

/// [`SessionLevels::op_fields`]: each op's sequence number, where ebtrace
/// found `at::RecordFunction`'s members declared, in the PyTorch the
/// process runs, as the agent finds it (see `torch_ops::layout`).
pub const OP_SEQUENCE: u32 = 1;
/// [`SessionLevels::op_fields`]: each ATen op's input shapes.
pub const OP_SHAPES: u32 = 2;

/// [`SessionLevels::ops`] that records every RecordFunction.
pub const OPS_ALL: u32 = 1_000_000;

/// What a [`START`] asks the framework's profiler to record (the
/// `ProfileOptions` tracer levels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionLevels {
    /// TraceMe level: 0 none, 1 critical, 2 info, 3 verbose.
    pub host: u32,
    /// Python function tracing: 0 off, 1 on.
    pub python: u32,
    /// Device tracers (GPU/TPU activity): 0 off, 1 on.
    pub device: u32,
    /// PyTorch's ops (RecordFunction callbacks): 0 off, else the chance,
    /// in millionths, that a RecordFunction is recorded ([`OPS_ALL`] and
    /// above: every one).
    pub ops: u32,
    /// With `ops`, what else to record of each: [`OP_SEQUENCE`],
    /// [`OP_SHAPES`].
    pub op_fields: u32,
}

impl SessionLevels {
    /// Bytes of an encoded [`SessionLevels`].
    pub const LEN: usize = 20;

    /// The payload of a [`START`].
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..4].copy_from_slice(&self.host.to_le_bytes());
        b[4..8].copy_from_slice(&self.python.to_le_bytes());
        b[8..12].copy_from_slice(&self.device.to_le_bytes());
        b[12..16].copy_from_slice(&self.ops.to_le_bytes());
        b[16..].copy_from_slice(&self.op_fields.to_le_bytes());
        b
    }

    /// Reads a [`START`] payload.
    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        SessionLevels {
            host: word(0),
            python: word(4),
            device: word(8),
            ops: word(12),
            op_fields: word(16),
        }
    }
}

/// What a [`HELLO`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The agent's [`VERSION`].
    pub version: u32,
    /// The process it runs in.
    pub pid: u32,
    /// A preloaded agent: where in the program's memory its challenge lies
    /// (see [`PROVE`]); 0 for an agent ebtrace loaded, whose socket only
    /// ebtrace holds.
    pub challenge: u64,
}

impl Hello {
    /// Bytes of an encoded [`Hello`].
    pub const LEN: usize = 16;

    /// The payload of a [`HELLO`].
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..4].copy_from_slice(&self.version.to_le_bytes());
        b[4..8].copy_from_slice(&self.pid.to_le_bytes());
        b[8..].copy_from_slice(&self.challenge.to_le_bytes());
        b
    }

    /// Reads a [`HELLO`] payload; `None` for one of another length (an
    /// agent of another protocol version says only its version and pid).
    pub fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        let version = word(0)?;
        let pid = word(4)?;
        let challenge = match b.get(8..) {
            Some(rest) if rest.len() == 8 => u64::from_le_bytes(rest.try_into().ok()?),
            _ if version != VERSION => 0,
            _ => return None,
        };
        Some(Hello {
            version,
            pid,
            challenge,
        })
    }
}

/// What a [`START`] asks for: what to record, and how long the session
/// may go on without word from ebtrace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartRequest {
    /// What to record.
    pub levels: SessionLevels,
    /// The session's lease, in milliseconds: each request renews it, and
    /// when it runs out (ebtrace hangs, or a peer never stops what it
    /// started) the agent ends the session by itself. At most, and for 0,
    /// [`MAX_LEASE_MS`].
    pub lease_ms: u32,
}

/// The longest lease a [`START`] may ask for.
pub const MAX_LEASE_MS: u32 = 10 * 60 * 1000;

impl StartRequest {
    /// Bytes of an encoded [`StartRequest`].
    pub const LEN: usize = SessionLevels::LEN + 4;

    /// The payload of a [`START`].
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..SessionLevels::LEN].copy_from_slice(&self.levels.encode());
        b[SessionLevels::LEN..].copy_from_slice(&self.lease_ms.to_le_bytes());
        b
    }

    /// Reads a [`START`] payload; `None` if it is not one.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b: &[u8; Self::LEN] = b.try_into().ok()?;
        let levels: &[u8; SessionLevels::LEN] = b[..SessionLevels::LEN].try_into().ok()?;
        let lease: [u8; 4] = b[SessionLevels::LEN..].try_into().ok()?;
        Some(StartRequest {
            levels: SessionLevels::decode(levels),
            lease_ms: match u32::from_le_bytes(lease) {
                0 => MAX_LEASE_MS,
                ms => ms.min(MAX_LEASE_MS),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names_carry_the_pid() {
        let mut buf = [0u8; 64];
        let n = abstract_socket_name(4_194_304, &mut buf);
        assert_eq!(&buf[..n], b"ebtrace-agent.4194304");
        let n = abstract_socket_name(0, &mut buf);
        assert_eq!(&buf[..n], b"ebtrace-agent.0");
    }

    #[test]
    fn frames_round_trip() {
        let h = Header {
            kind: XSPACE,
            len: 0x0102_0304,
        };
        assert_eq!(Header::decode(&h.encode()), h);
        let l = SessionLevels {
            host: 2,
            python: 0,
            device: 1,
            ops: 1,
            op_fields: OP_SEQUENCE | OP_SHAPES,
        };
        assert_eq!(SessionLevels::decode(&l.encode()), l);
        let start = StartRequest {
            levels: l,
            lease_ms: 2_500,
        };
        assert_eq!(StartRequest::decode(&start.encode()), Some(start));
        assert_eq!(StartRequest::decode(&l.encode()), None);
        let hello = Hello {
            version: VERSION,
            pid: 7,
            challenge: 0x7f00_1234_5678,
        };
        assert_eq!(Hello::decode(&hello.encode()), Some(hello));
        assert_eq!(Hello::decode(&hello.encode()[..8]), None);
    }

    #[test]
    fn a_start_asks_for_at_most_the_longest_lease() {
        let start = StartRequest {
            levels: SessionLevels {
                host: 2,
                python: 0,
                device: 0,
                ops: 0,
                op_fields: 0,
            },
            lease_ms: u32::MAX,
        };
        let decoded = StartRequest::decode(&start.encode()).unwrap();
        assert_eq!(decoded.lease_ms, MAX_LEASE_MS);
        let none = StartRequest {
            lease_ms: 0,
            ..start
        };
        assert_eq!(
            StartRequest::decode(&none.encode()).unwrap().lease_ms,
            MAX_LEASE_MS
        );
    }

    #[test]
    fn an_older_agent_says_its_version() {
        let mut v1 = [0u8; 8];
        v1[..4].copy_from_slice(&1u32.to_le_bytes());
        v1[4..].copy_from_slice(&9u32.to_le_bytes());
        let hello = Hello::decode(&v1).unwrap();
        assert_eq!((hello.version, hello.pid, hello.challenge), (1, 9, 0));
    }
}
