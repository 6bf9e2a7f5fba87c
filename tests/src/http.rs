//! A plain HTTP/1.1 client for the tests of `ebtrace serve --http`: one GET
//! per connection, chunked bodies joined.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
};

/// A response: status, headers (names lower-cased) and body.
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as a gzipped pprof profile.
    pub fn pprof(&self) -> ebtrace_proto::perftools::profiles::Profile {
        use prost::Message as _;
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(self.body.as_slice())
            .read_to_end(&mut raw)
            .expect("a gzipped profile");
        ebtrace_proto::perftools::profiles::Profile::decode(raw.as_slice())
            .expect("a pprof Profile")
    }
}

/// One row of `go tool pprof -top`: flat and cumulative percent, function.
#[derive(Clone, Debug, PartialEq)]
pub struct TopRow {
    pub flat_pct: f64,
    pub cum_pct: f64,
    pub function: String,
}

/// What Go's own `go tool pprof -top` (Debian's `golang-go`) makes of the
/// gzipped profile `body`: its rows, most time in itself first, and its
/// whole output; `None` where Go is not installed.
pub fn go_pprof_top(body: &[u8]) -> Option<(Vec<TopRow>, String)> {
    let go = crate::debian_tool("go")?;
    let dir = crate::TempDir::new("go-pprof");
    let file = dir.path().join("profile.pb.gz");
    std::fs::write(&file, body).expect("write the profile");
    let out = std::process::Command::new(go)
        .args(["tool", "pprof", "-top", "-symbolize=none"])
        .arg(&file)
        .env("HOME", dir.path())
        .output()
        .expect("run go tool pprof");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let percent = |f: &str| f.trim_end_matches('%').parse::<f64>().ok();
    // `flat flat% sum% cum cum% function [(inline)]`.
    let rows = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .skip(1)
        .filter_map(|row| {
            let f: Vec<&str> = row.split_whitespace().collect();
            Some(TopRow {
                flat_pct: percent(f.get(1)?)?,
                cum_pct: percent(f.get(4)?)?,
                function: f.get(5)?.to_string(),
            })
        })
        .collect();
    Some((rows, text))
}

/// `GET path` from `addr`.
pub fn get(addr: SocketAddr, path: &str) -> Response {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read response");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let body = &raw[split + 4..];
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let headers: Vec<(String, String)> = head
        .lines()
        .skip(1)
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_ascii_lowercase(), v.trim().to_string()))
        })
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            .unwrap_or(0);
        let rest = &body[eol + 2..];
        if size == 0 || rest.len() < size {
            break;
        }
        out.extend_from_slice(&rest[..size]);
        body = &rest[(size + 2).min(rest.len())..];
    }
    out
}

/// The value of the unlabelled sample `name` in a Prometheus text
/// exposition (what `/metrics` answers).
pub fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {body}"))
}
