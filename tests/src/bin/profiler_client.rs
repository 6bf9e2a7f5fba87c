//! A `tensorflow.ProfilerService` client the tests run as another user:
//! `profiler_client ADDR METHOD OUT`, ADDR `HOST:PORT` or `unix:PATH`,
//! METHOD one of `profile`,
//! `profile:PID` (of that watched process only), `session:ID` (a 10 s
//! capture with session_id ID), `terminate:ID`, `snapshot` and
//! `stop-recorder`. Prints `OK`, or the gRPC code and message, on one
//! line, and writes a Profile's XSpace to OUT. `http:PATH` GETs PATH of
//! the HTTP listener at ADDR and prints its status and body's first line.

use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, StopContinuousProfilingRequest, TerminateRequest,
    profile_options::{AdvancedConfigValue, advanced_config_value::Value},
    profiler_service_client::ProfilerServiceClient,
};
use ebtrace_tests::serve::{block_on, request, with_advanced, xspace_of};
use hyper_util::rt::TokioIo;
use prost::Message as _;
use tokio::net::UnixStream;
use tonic::transport::{Endpoint, Uri};
use tower::service_fn;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, method, out] = args.as_slice() else {
        eprintln!("usage: profiler_client ADDR METHOD OUT");
        std::process::exit(2);
    };
    if let Some(path) = method.strip_prefix("http:") {
        let response = ebtrace_tests::http::get(addr.parse().expect("an address"), path);
        let text = response.text();
        println!("{} {}", response.status, text.lines().next().unwrap_or(""));
        return;
    }
    block_on(async {
        let channel = match addr.strip_prefix("unix:") {
            Some(path) => {
                let path = path.to_string();
                Endpoint::from_static("http://localhost")
                    .connect_with_connector(service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?))
                        }
                    }))
                    .await
            }
            None => {
                Endpoint::from_shared(format!("http://{addr}"))
                    .expect("an address")
                    .connect()
                    .await
            }
        };
        let mut client = ProfilerServiceClient::new(channel.expect("connect to ebtrace serve"))
            .max_decoding_message_size(usize::MAX);
        let result = match method.split_once(':') {
            None if method == "snapshot" => client
                .get_snapshot(GetSnapshotRequest::default())
                .await
                .map(drop),
            None if method == "stop-recorder" => client
                .stop_continuous_profiling(StopContinuousProfilingRequest {})
                .await
                .map(drop),
            Some(("terminate", id)) => client
                .terminate(TerminateRequest {
                    session_id: id.to_string(),
                })
                .await
                .map(drop),
            Some(("session", id)) => {
                let mut req = request(10_000);
                req.session_id = id.to_string();
                client.profile(req).await.map(|r| {
                    std::fs::write(out, xspace_of(r.get_ref()).encode_to_vec())
                        .expect("write the XSpace");
                })
            }
            only => {
                let mut req = request(500);
                if let Some((_, pid)) = only {
                    let pid: i64 = pid.parse().expect("a pid");
                    let value = AdvancedConfigValue {
                        value: Some(Value::Int64Value(pid)),
                    };
                    req = with_advanced(req, "pid", value);
                }
                client.profile(req).await.map(|r| {
                    std::fs::write(out, xspace_of(r.get_ref()).encode_to_vec())
                        .expect("write the XSpace");
                })
            }
        };
        match result {
            Ok(()) => println!("OK"),
            Err(status) => println!("{:?}: {}", status.code(), status.message()),
        }
    });
}
