//! Running `ebtrace serve` under test: start it on a loopback port chosen
//! by the kernel, talk to it with a real gRPC client (or put raw bytes on
//! the wire), watch its log, its open descriptors and its memory.

use std::{
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, ProfileOptions, ProfileRequest, ProfileResponse,
    profile_options::AdvancedConfigValue, profiler::XSpace,
    profiler_service_client::ProfilerServiceClient,
};
use prost::{
    Message as _,
    bytes::{Buf as _, BufMut as _},
};
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::http::uri::PathAndQuery,
    transport::Channel,
};

use crate::ebtrace_bin;

/// The line the server prints for each address it listens on.
const SERVING: &str = "ebtrace: serving tensorflow.ProfilerService on ";

/// A running `ebtrace serve`, killed when dropped.
pub struct ServeProcess {
    child: Child,
    /// Every TCP address it listens on, in `--bind` order (Unix sockets
    /// are where `--bind unix:PATH` said).
    pub addrs: Vec<SocketAddr>,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl ServeProcess {
    /// Starts `ebtrace serve ARGS` (add `--bind 127.0.0.1:0` yourself or
    /// let [`ServeProcess::loopback`] do it) and waits until it listens on
    /// `listeners` addresses.
    pub fn start(args: &[&str], listeners: usize) -> Self {
        Self::start_under(&[], args, listeners)
    }

    /// Like [`ServeProcess::start`], run through `wrapper` (a command that
    /// runs the rest of its arguments: `setpriv ...`, `ip netns exec NS`).
    pub fn start_under(wrapper: &[&str], args: &[&str], listeners: usize) -> Self {
        let bin = ebtrace_bin();
        let mut command = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let mut child = command
            .arg("serve")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ebtrace serve");
        let stderr = child.stderr.take().expect("piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(line);
            }
        });
        let mut server = ServeProcess {
            child,
            addrs: Vec::new(),
            lines,
            reader: Some(reader),
        };
        let started = Instant::now();
        loop {
            let serving: Vec<String> = server
                .lines()
                .iter()
                .filter_map(|l| Some(l.strip_prefix(SERVING)?.to_string()))
                .collect();
            if serving.len() >= listeners {
                server.addrs = serving
                    .iter()
                    .filter(|a| !a.starts_with("unix:"))
                    .map(|a| a.parse().expect("address"))
                    .collect();
                break;
            }
            if started.elapsed() > Duration::from_secs(30) {
                panic!(
                    "ebtrace serve did not start listening: {:?}",
                    server.lines()
                );
            }
            if let Some(status) = server.child.try_wait().expect("try_wait") {
                std::thread::sleep(Duration::from_millis(50));
                panic!("ebtrace serve exited with {status}: {:?}", server.lines());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        server
    }

    /// Starts `ebtrace serve --bind 127.0.0.1:0 ARGS`.
    pub fn loopback(args: &[&str]) -> Self {
        let mut all = vec!["--bind", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Self::start(&all, 1)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn port(&self) -> u16 {
        self.addrs[0].port()
    }

    /// The address of its `--http` listener, from its log.
    pub fn http_addr(&self) -> SocketAddr {
        const LINE: &str = "ebtrace: serving Prometheus metrics on ";
        let line = self
            .wait_line(LINE, Duration::from_secs(10))
            .expect("the HTTP listener's address (was --http given?)");
        line.split(LINE)
            .nth(1)
            .and_then(|a| {
                a.strip_prefix("http://")
                    .or_else(|| a.strip_prefix("https://"))
            })
            .and_then(|a| a.strip_suffix("/metrics"))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
    }

    /// Waits until its flight recorder is full (it forgets its oldest
    /// records, as `/metrics` of its `--http` listener counts), then long
    /// enough for it to have measured ebtrace's own memory since.
    pub fn wait_recorder_full(&self, deadline: Duration) {
        const FORGOTTEN: &str = "ebtrace_recorder_forgotten_records_total ";
        let at = self.http_addr();
        let filling = Instant::now();
        loop {
            let body = crate::http::get(at, "/metrics").text();
            let forgotten = body
                .lines()
                .find_map(|l| l.strip_prefix(FORGOTTEN)?.parse::<f64>().ok())
                .unwrap_or(0.0);
            if forgotten > 0.0 {
                break;
            }
            assert!(
                filling.elapsed() < deadline,
                "the recorder never filled its --retain-memory"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_secs(3));
    }

    /// Asserts that the server reused the probes of an earlier capture.
    pub fn assert_probes_kept(&self) {
        assert!(
            self.wait_line("probes kept from the last capture", Duration::from_secs(1))
                .is_some(),
            "the probes were not kept: {:?}",
            self.lines()
        );
    }

    /// Its stderr so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("lock").clone()
    }

    /// Waits for a stderr line containing `needle`.
    pub fn wait_line(&self, needle: &str, deadline: Duration) -> Option<String> {
        let start = Instant::now();
        while start.elapsed() < deadline {
            if let Some(l) = self.lines().into_iter().find(|l| l.contains(needle)) {
                return Some(l);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// How many stderr lines contain `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        self.lines().iter().filter(|l| l.contains(needle)).count()
    }

    /// Open file descriptors of the server (probes hold several each).
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("read server fds")
            .count()
    }

    /// Descriptors of eBPF objects and perf events (programs, maps,
    /// links, attached tracepoints): zero while no probe is attached.
    pub fn probe_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("read server fds")
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .filter(|target| {
                let t = target.to_string_lossy();
                t.starts_with("anon_inode:") && (t.contains("bpf") || t.contains("perf_event"))
            })
            .count()
    }

    /// The ids of the eBPF links the server holds (`link_id` of each
    /// descriptor's fdinfo), sorted: the same ids mean the same probes.
    pub fn link_ids(&self) -> Vec<u32> {
        self.fdinfo_ids("link_id:")
    }

    /// Records the server's probes have written to the ring buffer so far
    /// (the `SUBMITTED` slot of its `STATS` map, summed over CPUs), read
    /// from the kernel, not from the server.
    pub fn records_submitted(&self) -> u64 {
        use aya::maps::{Map, MapData, MapInfo, PerCpuArray};
        const SUBMITTED: u32 = 0;
        self.fdinfo_ids("map_id:")
            .into_iter()
            .filter(|&id| {
                MapInfo::from_id(id).is_ok_and(|info| info.name_as_str() == Some("STATS"))
            })
            .map(|id| {
                let data = MapData::from_id(id).expect("open the STATS map");
                let stats: PerCpuArray<MapData, u64> =
                    PerCpuArray::try_from(Map::PerCpuArray(data)).expect("a per-CPU array");
                stats
                    .get(&SUBMITTED, 0)
                    .expect("read STATS")
                    .iter()
                    .sum::<u64>()
            })
            .sum()
    }

    /// The values of `key` in the fdinfo of every descriptor, sorted.
    fn fdinfo_ids(&self, key: &str) -> Vec<u32> {
        let dir = format!("/proc/{}/fdinfo", self.pid());
        let mut ids: Vec<u32> = std::fs::read_dir(&dir)
            .expect("read server fdinfo")
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .filter_map(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.trim().parse().ok())
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Waits until no probe is attached (detaching waits for the kernel's
    /// RCU grace periods, which can take seconds on a busy machine).
    pub fn wait_detached(&self, deadline: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < deadline {
            if self.probe_fds() == 0 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Resident memory of the server, KiB.
    pub fn rss_kib(&self) -> u64 {
        status_kib(self.pid(), "VmRSS:")
    }

    /// Starts measuring [`Self::peak_rss_kib`] again from now.
    pub fn reset_peak_rss(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5").expect("clear_refs");
    }

    /// The most resident memory the server held (since
    /// [`Self::reset_peak_rss`]), KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        status_kib(self.pid(), "VmHWM:")
    }

    /// Resident memory once it is under `limit_kib`, or at `deadline`:
    /// what a finished capture frees goes back on the server's worker
    /// threads (detaching, delivering) a moment after its answer is sent
    /// and its probes are gone.
    pub fn rss_kib_settled(&self, limit_kib: u64, deadline: Duration) -> u64 {
        let start = Instant::now();
        loop {
            let rss = self.rss_kib();
            if rss < limit_kib || start.elapsed() >= deadline {
                return rss;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's `n` mappings holding the most resident memory, a line
    /// each: what a failed memory check shows.
    pub fn largest_mappings(&self, n: usize) -> String {
        let smaps =
            std::fs::read_to_string(format!("/proc/{}/smaps", self.pid())).unwrap_or_default();
        let mut mappings: Vec<(u64, String)> = Vec::new();
        let mut header = String::new();
        for line in smaps.lines() {
            if let Some(kib) = line.strip_prefix("Rss:") {
                mappings.push((parse_kib(kib).unwrap_or(0), header.clone()));
            } else if line
                .split_whitespace()
                .next()
                .is_some_and(|w| w.contains('-'))
            {
                header = line.to_string();
            }
        }
        mappings.sort_by_key(|m| std::cmp::Reverse(m.0));
        mappings
            .iter()
            .take(n)
            .map(|(kib, header)| format!("{kib} KiB: {header}\n"))
            .collect()
    }

    /// A gRPC client connected to the first address.
    pub async fn client(&self) -> ProfilerServiceClient<Channel> {
        let url = match self.addrs[0] {
            SocketAddr::V4(a) => format!("http://{a}"),
            SocketAddr::V6(a) => format!("http://[{}]:{}", a.ip(), a.port()),
        };
        ProfilerServiceClient::connect(url)
            .await
            .expect("connect to ebtrace serve")
            .max_decoding_message_size(usize::MAX)
    }

    /// Its answer to `GetSnapshot` (the flight recorder's), decoded.
    pub fn snapshot(&self, id: &str) -> XSpace {
        block_on(async {
            let mut client = self.client().await;
            let r = client
                .get_snapshot(GetSnapshotRequest {
                    snapshot_session_id: id.into(),
                })
                .await
                .expect("a snapshot");
            xspace_of(&r.into_inner())
        })
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Calls `method` of the service (e.g. `Profile`) with `body` as its
    /// message, whatever it holds; answers the response's raw bytes.
    pub async fn raw_call(&self, method: &str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
        let url = format!("http://{}", self.addrs[0]);
        let channel = Channel::from_shared(url)
            .expect("a valid URL")
            .connect()
            .await
            .expect("connect to ebtrace serve");
        let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(usize::MAX);
        grpc.ready().await.expect("channel ready");
        let path = format!("/tensorflow.ProfilerService/{method}");
        let path = PathAndQuery::try_from(path).expect("a valid path");
        grpc.unary(tonic::Request::new(body), path, RawCodec)
            .await
            .map(tonic::Response::into_inner)
    }

    /// Sends `sig` and waits for the exit (panics after `deadline`).
    pub fn signal_and_wait(&mut self, sig: i32, deadline: Duration) -> ExitStatus {
        crate::signal(self.pid(), sig);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                return status;
            }
            if start.elapsed() > deadline {
                panic!("ebtrace serve still running {deadline:?} after signal {sig}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gRPC codec for messages as raw bytes: sends them unchanged, so a
/// test can put anything where a protobuf message belongs.
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// Runs a test body on a multi-threaded runtime: the gRPC connections keep
/// going while the body blocks (waiting on the server's state).
pub fn block_on<F: std::future::Future>(body: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(body)
}

/// `CLOCK_REALTIME` now, epoch ns (the clock of `start_timestamp_ns`).
pub fn now_ns() -> u64 {
    crate::realtime_ns()
}

/// A request like the real clients send: levels 2/1/0, version 1, start
/// now, `duration_ms`.
pub fn request(duration_ms: u64) -> ProfileRequest {
    ProfileRequest {
        duration_ms,
        max_events: 1_000_000,
        tools: vec!["xplane.pb".into()],
        opts: Some(ProfileOptions {
            include_dataset_ops: true,
            host_tracer_level: 2,
            device_tracer_level: 1,
            version: 1,
            start_timestamp_ns: now_ns(),
            duration_ms,
            ..Default::default()
        }),
        session_id: format!("test_{}", now_ns()),
        host_name: "127.0.0.1:1".into(),
        ..Default::default()
    }
}

/// Sets `advanced_configuration[key]`.
pub fn with_advanced(
    mut req: ProfileRequest,
    key: &str,
    value: AdvancedConfigValue,
) -> ProfileRequest {
    req.opts
        .get_or_insert_with(Default::default)
        .advanced_configuration
        .insert(key.into(), value);
    req
}

/// One of the recorded client requests in `tests/fixtures/real/`.
pub fn real_request(name: &str) -> (Vec<u8>, ProfileRequest) {
    let path = real_fixture(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let req = ProfileRequest::decode(bytes.as_slice()).expect("a ProfileRequest");
    (bytes, req)
}

/// A file of `tests/fixtures/real/` (recorded from the real clients).
pub fn real_fixture(name: &str) -> PathBuf {
    crate::workspace_root()
        .join("tests/fixtures/real")
        .join(name)
}

/// The XSpace a response carries in `tool_data { name: "xplane.pb" }`,
/// checking that this is the only tool data.
pub fn xspace_of(response: &ProfileResponse) -> XSpace {
    assert_eq!(
        response
            .tool_data
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        vec!["xplane.pb"],
        "tool_data names"
    );
    XSpace::decode(response.tool_data[0].data.as_slice()).expect("tool_data decodes as XSpace")
}

/// Events on every line of every plane.
pub fn event_count(space: &XSpace) -> usize {
    space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len())
        .sum()
}

/// Scrapes the `/metrics` of an `--http` listener at `at` (off the
/// runtime's threads) and answers how long that took; a body without
/// ebtrace's metrics fails the test.
pub async fn timed_metrics_scrape(at: SocketAddr) -> Duration {
    let scraped = Instant::now();
    let body = tokio::task::spawn_blocking(move || crate::http::get(at, "/metrics").text())
        .await
        .expect("the scrape");
    assert!(body.contains("ebtrace_"), "{body}");
    scraped.elapsed()
}

/// The KiB of the `/proc/PID/status` field named `field` (with its colon).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    try_status_kib(pid, field).unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// [`status_kib`], or `None` where the process is gone.
pub fn try_status_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(parse_kib)
}

/// A `/proc` size such as `  1234 kB`, in KiB.
fn parse_kib(value: &str) -> Option<u64> {
    value.trim().trim_end_matches("kB").trim().parse().ok()
}
