//! A real Prometheus server (Debian's `prometheus` package) scraping
//! ebtrace, queried through its HTTP API.

use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A Prometheus server scraping one job every second, killed when dropped.
pub struct Prometheus {
    child: Child,
    web: SocketAddr,
    log: PathBuf,
}

impl Prometheus {
    /// Starts `binary` with its data in `dir`, scraping `target` (the job
    /// `ebtrace`) every second with the job's further settings `job_extra`
    /// (YAML lines indented under the job, e.g. a `tls_config`).
    pub fn start(binary: &Path, dir: &Path, target: SocketAddr, job_extra: &str) -> Self {
        let web = free_port();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: ebtrace\n    static_configs:\n      \
                 - targets: ['{target}']\n{job_extra}"
            ),
        )
        .unwrap();
        let log = dir.join("prometheus.log");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start prometheus");
        Prometheus { child, web, log }
    }

    /// What it logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls an instant query until it has one sample; its value.
    pub fn wait_value(&self, query: &str, deadline: Duration) -> Option<f64> {
        let start = Instant::now();
        while start.elapsed() < deadline {
            if let Some(v) = self.query(query) {
                return Some(v);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        None
    }

    /// The first sample of an instant query, if it has one.
    pub fn query(&self, query: &str) -> Option<f64> {
        let encoded: String = query
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        TcpStream::connect(self.web).ok()?;
        let response = crate::http::get(self.web, &format!("/api/v1/query?query={encoded}"));
        if response.status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&response.text()).ok()?;
        let result = v["data"]["result"].as_array()?;
        result.first()?["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on now.
pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}
