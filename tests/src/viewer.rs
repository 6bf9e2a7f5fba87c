//! XProf's web UI as a person opens it: the `xprof` server of the venv,
//! its trace viewer loaded in headless Chromium, the page's DOM and a
//! screenshot checked.
//!
//! Chromium runs with `--virtual-time-budget`: virtual time stands still
//! while a fetch is pending, so the page is read once the trace has loaded
//! and drawn, however long XProf takes to convert it.

use std::{
    fs::File,
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{TempDir, wait_with_deadline};

/// Chromium on `PATH`, or `None` to skip (unless
/// `EBTRACE_REQUIRE_INTEROP=1`, where a skip is a failure).
pub fn chromium() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("chromium"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        if std::env::var("EBTRACE_REQUIRE_INTEROP").as_deref() == Ok("1") {
            panic!("no chromium on PATH (run `cargo xtask setup`)");
        }
        eprintln!("skipping: no chromium on PATH (cargo xtask setup installs it)");
    }
    found
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// An `xprof` server on `logdir`, stopped when dropped. It listens on all
/// addresses; the tests reach it on loopback only.
pub struct Xprof {
    child: Child,
    port: u16,
}

impl Xprof {
    /// Starts XProf with `python` (its web port and gRPC port both free
    /// ones) and waits until it answers.
    pub fn start(python: &Path, logdir: &Path) -> Self {
        let (port, grpc_port) = (free_port(), free_port());
        let child = Command::new(python)
            .args([
                "-c",
                "import sys; from xprof.cli.xprof_cli import main; sys.argv[0] = 'xprof'; \
                 sys.exit(main())",
            ])
            .arg("--logdir")
            .arg(logdir)
            .args(["--port", &port.to_string()])
            .args(["--grpc_port", &grpc_port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start xprof");
        let mut server = Xprof { child, port };
        server.wait_ready();
        server
    }

    /// Polls `/data/plugin/profile/runs` until it answers 200. Importing
    /// XProf can take a minute on a busy machine: the limit only stops a
    /// server that never comes up.
    fn wait_ready(&mut self) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("xprof exited before answering: {status}");
            }
            if self.status_of("/data/plugin/profile/runs") == Some(200) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "xprof did not answer on port {} within 300 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The HTTP status of `GET path`, or `None` if nothing answers.
    fn status_of(&self, path: &str) -> Option<u16> {
        use std::io::{Read as _, Write as _};
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).ok()?;
        // "HTTP/1.x NNN"
        std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
    }

    /// `http://127.0.0.1:PORT` followed by `path_and_query`.
    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://127.0.0.1:{}{path_and_query}", self.port)
    }
}

impl Drop for Xprof {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a URL query value.
fn encode_query_value(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs headless Chromium on `url` with `mode` (`--dump-dom` or
/// `--screenshot=FILE`), its stdout into `stdout`, in a fresh profile: no
/// trace viewer state remembered from an earlier run.
fn run_chromium(chromium: &Path, mode: &str, url: &str, stdout: &Path) {
    let profile = TempDir::new("chromium-profile");
    let mut user_data_dir = std::ffi::OsString::from("--user-data-dir=");
    user_data_dir.push(profile.path());
    let child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1600,1000",
            "--virtual-time-budget=30000",
        ])
        .arg(user_data_dir)
        .arg(mode)
        .arg(url)
        .stdin(Stdio::null())
        // A DOM is larger than a pipe's buffer: into a file, not a pipe
        // nobody drains while waiting.
        .stdout(File::create(stdout).expect("create chromium output"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let out = wait_with_deadline(child, Duration::from_secs(300));
    assert!(
        out.status.success(),
        "chromium {mode} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The trace viewer of `run`/`host` as XProf's UI shows it: the page's DOM
/// (the trace viewer frame alone) and a screenshot of the whole UI, both
/// written to `out_dir`.
pub struct TraceViewerPage {
    pub dom: String,
    pub dom_path: PathBuf,
    pub screenshot: PathBuf,
}

impl TraceViewerPage {
    pub fn open(chromium: &Path, xprof: &Xprof, run: &str, host: &str, out_dir: &Path) -> Self {
        let data = format!(
            "/data/plugin/profile/data?run={}&tag=trace_viewer%40&host={}",
            encode_query_value(run),
            encode_query_value(host)
        );
        // The frame XProf's UI embeds for the (default) trace viewer.
        let frame = xprof.url(&format!(
            "/trace_viewer_index.html?is_streaming=true&is_oss=true&trace_data_url={}",
            encode_query_value(&data)
        ));
        let dom_path = out_dir.join("trace_viewer.dom.html");
        run_chromium(chromium, "--dump-dom", &frame, &dom_path);
        let dom = std::fs::read_to_string(&dom_path).expect("read the DOM");

        let screenshot = out_dir.join("trace_viewer.png");
        let ui = xprof.url(&format!(
            "/?run={}&tool=trace_viewer%40&host={}",
            encode_query_value(run),
            encode_query_value(host)
        ));
        let mut mode = std::ffi::OsString::from("--screenshot=");
        mode.push(&screenshot);
        let discard = out_dir.join("chromium.out");
        run_chromium(chromium, mode.to_str().expect("UTF-8 path"), &ui, &discard);
        let _ = std::fs::remove_file(discard);
        TraceViewerPage {
            dom,
            dom_path,
            screenshot,
        }
    }

    /// Whether the process track titled `process` (`"HOST /host:CPU"`) is
    /// open, or `None` if the page shows no such process.
    pub fn process_expanded(&self, process: &str) -> Option<bool> {
        let header = format!("<div class=\"process-track-header\" title=\"{process} (pid ");
        let at = self.dom.find(&header)?;
        // The header is the first child of the process track's div.
        let track = &self.dom[..at];
        let open = track.rfind("<div class=\"")?;
        Some(track[open..].contains(" expanded\""))
    }

    /// Whether the page shows a row for thread `tid`.
    pub fn shows_thread(&self, tid: u32) -> bool {
        self.dom.contains(&format!("title=\"tid: {tid}, name: "))
    }

    /// The height in pixels, in the screenshot, from the first open
    /// process's header to the next open one (or the bottom): its rows.
    /// `None` if the screenshot shows no open process.
    pub fn first_open_process_px(&self) -> Option<u32> {
        let (headers, height) = expanded_headers(&self.screenshot);
        let first = headers.first()?;
        Some(headers.get(1).map_or(height, |h| h.start) - first.end)
    }
}

/// The background of an open process's header row in XProf's trace viewer
/// (`.process-track-base.expanded .process-track-header` in its
/// `trace_viewer_index.html`); a closed one is light grey.
const EXPANDED_HEADER: [u8; 3] = [0xcb, 0xd6, 0xe3];

/// Pixel rows of `png` holding a stretch of at least 100 header-coloured
/// pixels, merged into one header when less than 16 rows apart (the
/// process name's text breaks the colour); and the image's height.
fn expanded_headers(png: &Path) -> (Vec<std::ops::Range<u32>>, u32) {
    let decoder = png::Decoder::new(std::io::BufReader::new(
        File::open(png).expect("open the screenshot"),
    ));
    let mut reader = decoder.read_info().expect("read the PNG header");
    let mut buf = vec![0; reader.output_buffer_size().expect("PNG size")];
    let info = reader.next_frame(&mut buf).expect("decode the PNG");
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("unexpected screenshot colour type {other:?}"),
    };
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    let mut headers: Vec<std::ops::Range<u32>> = Vec::new();
    for y in 0..info.height {
        let row = &buf[y as usize * info.line_size..][..info.line_size];
        let (mut run, mut longest) = (0, 0);
        for px in row.chunks_exact(channels) {
            run = if px[..3] == EXPANDED_HEADER {
                run + 1
            } else {
                0
            };
            longest = longest.max(run);
        }
        if longest < 100 {
            continue;
        }
        match headers.last_mut() {
            Some(h) if y - h.end < 16 => h.end = y + 1,
            _ => headers.push(y..y + 1),
        }
    }
    (headers, info.height)
}

/// XProf's trace viewer opens a process with more threads than this
/// collapsed into one grey bar (`_collapseBigProcessTracks` in its
/// `trace_viewer_index.js`), where a jaxlib capture shows its few threads.
pub const TRACE_VIEWER_OPEN_MAX_THREADS: u64 = 20;

/// Height of one thread row in the trace viewer, in pixels.
pub const ROW_PX: u32 = 18;

/// Records `pid` for 2 s with ebtrace's `args` and checks that XProf opens
/// the capture with `/host:CPU` expanded on the process's threads: in its
/// conversion (few enough lines, a row for every thread, the threads moved
/// off `/host:CPU` without events) and in its UI in headless Chromium (the
/// process open, the main thread's row, rows drawn in the screenshot).
/// The trace and the screenshot stay under `target/tmp/trace-viewer-TAG`.
/// The workload is sent SIGTERM once recorded.
pub fn assert_capture_opens_with_threads_shown(
    python: &Path,
    chromium: &Path,
    pid: u32,
    args: &[&str],
    tag: &str,
) {
    let tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("list the workload's threads")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();

    // Kept under target/tmp: the trace and the screenshot stay for a
    // person to look at after the run.
    let dir = TempDir::kept(
        &crate::workspace_root().join("target/tmp").to_string_lossy(),
        &format!("trace-viewer-{tag}"),
    );
    let mut all = vec!["-q"];
    all.extend_from_slice(args);
    let out = crate::record(&pid.to_string(), "2s", &dir, &all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    crate::signal(pid, libc::SIGTERM);
    let files = crate::xplane_files(dir.path());
    assert_eq!(files.len(), 1);
    let file = &files[0];
    let run_dir = file.parent().expect("run directory");
    let run = run_dir.file_name().and_then(|n| n.to_str()).expect("run");
    let file_name = file.file_name().and_then(|n| n.to_str()).expect("name");
    let host = file_name.strip_suffix(".xplane.pb").expect("host");
    let host_process = format!("{host} /host:CPU");

    // XProf's conversion: `/host:CPU` holds few enough threads to open,
    // the Python thread among them, and every thread has its row.
    let json = crate::xprof::trace_viewer_summary(python, file);
    let processes = json["processes"].as_object().expect("processes");
    let (host_pid, _) = processes
        .iter()
        .find(|(_, name)| name.as_str() == Some(host_process.as_str()))
        .unwrap_or_else(|| panic!("no process {host_process}: {processes:?}"));
    let count = json["thread_counts"][host_pid]
        .as_u64()
        .expect("thread_count");
    assert!(
        count <= TRACE_VIEWER_OPEN_MAX_THREADS,
        "{host_process} has {count} threads: the trace viewer opens it collapsed"
    );
    assert_eq!(
        json["row_pids"][&pid.to_string()].to_string(),
        *host_pid,
        "the Python thread is not in {host_process}"
    );
    for tid in &tids {
        assert!(
            json["rows"][tid.to_string()].is_string(),
            "thread {tid} has no row: {}",
            json["rows"]
        );
    }
    // The threads moved off `/host:CPU` have no events but their states.
    let space = crate::xspace::load(file);
    for moved in space
        .planes
        .iter()
        .filter(|p| p.name == "/host:CPU threads that ran least")
    {
        for l in &moved.lines {
            for e in crate::xspace::line_events(moved, l.id) {
                assert!(
                    matches!(
                        e.name.as_str(),
                        "Running"
                            | "Runnable"
                            | "Blocked"
                            | "Unknown"
                            | "Wakeup"
                            | "Thread created"
                    ),
                    "thread {} with an event {:?} is on {}",
                    l.id,
                    e.name,
                    moved.name
                );
            }
        }
    }

    // XProf's UI in a browser: the process is open on the thread rows.
    let server = Xprof::start(python, dir.path());
    let page = TraceViewerPage::open(chromium, &server, run, host, run_dir);
    eprintln!("trace viewer: {}", page.screenshot.display());
    assert_eq!(
        page.process_expanded(&host_process),
        Some(true),
        "{host_process} is not open in the trace viewer (DOM: {})",
        page.dom_path.display()
    );
    assert!(
        page.shows_thread(pid),
        "no row for the Python thread (DOM: {})",
        page.dom_path.display()
    );
    let rows_px = page.first_open_process_px().unwrap_or_else(|| {
        panic!(
            "the screenshot shows no open process: {}",
            page.screenshot.display()
        )
    });
    assert!(
        rows_px >= 3 * ROW_PX,
        "{rows_px} px of rows under the first process: {}",
        page.screenshot.display()
    );
}
