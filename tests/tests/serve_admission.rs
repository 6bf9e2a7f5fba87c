//! `ebtrace serve` bounds the work each caller may have in progress: one
//! caller asking fifty times at once for a flight-recorder snapshot or a
//! CPU profile gets one at a time (the rest `RESOURCE_EXHAUSTED`, HTTP
//! 429), another caller is still served meanwhile, and the server's memory
//! stays within `--retain-memory` however many are asked for. A capture
//! asking for every event of a launch loop gets `--max-capture-events` of
//! them, and builds no more than it answers.

use std::time::Duration;

use ebtrace_proto::tensorflow::{GetSnapshotRequest, ProfileRequest};
use ebtrace_tests::{
    TempDir,
    callers::{Client, NOBODY},
    cuda::CudaWorkload,
    fixture::SchedWorkload,
    http, require_root, serial,
    serve::{ServeProcess, block_on, request, xspace_of},
};
use tonic::Code;

const FLOOD: usize = 50;
const CAP_MIB: u64 = 96;

fn metric(body: &str, name: &str) -> u64 {
    http::metric(body, name) as u64
}

#[test]
fn one_caller_asking_fifty_times_holds_one_place_and_others_are_still_served() {
    if !require_root("one_caller_asking_fifty_times_holds_one_place_and_others_are_still_served") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&["--mode", "pingpong", "--seconds", "90"]);
    let dir = TempDir::new("admission");
    // The other caller, uid 65534, may read root's process by the policy.
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, "[[grant]]\nuids = [65534]\nscopes = [\"read\"]\n").unwrap();
    let server = ServeProcess::loopback(&[
        "--pid",
        &workload.pid.to_string(),
        "--retain",
        "30s",
        "--retain-memory",
        &CAP_MIB.to_string(),
        "--ring-buffer-mib",
        "4",
        "--keep-probes",
        "0",
        "--policy",
        policy.to_str().unwrap(),
        "--http",
        "127.0.0.1:0",
    ]);
    let http_at = server.http_addr();
    let other = Client::new(env!("CARGO_BIN_EXE_profiler_client"));
    let grpc_at = server.addrs[0].to_string();
    // Full: the recorder forgets the oldest records to keep the newest,
    // so each snapshot is as large as the budget allows.
    server.wait_recorder_full(Duration::from_secs(40));
    server.reset_peak_rss();

    // Fifty snapshots at once from root, over one connection, and one from
    // uid 65534 meanwhile.
    let (codes, (other, others)) = block_on(async {
        let client = server.client().await;
        let flood: Vec<_> = (0..FLOOD)
            .map(|n| {
                let mut client = client.clone();
                tokio::spawn(async move {
                    let asked = GetSnapshotRequest {
                        snapshot_session_id: format!("flood-{n}"),
                    };
                    client
                        .get_snapshot(asked)
                        .await
                        .map(drop)
                        .map_err(|s| s.code())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let others = tokio::task::spawn_blocking(move || {
            let line = other.ask_at(NOBODY, &grpc_at, "snapshot");
            (other, line)
        });
        let mut codes = Vec::new();
        for asked in flood {
            codes.push(asked.await.unwrap());
        }
        (codes, others.await.unwrap())
    });
    let served = codes.iter().filter(|c| c.is_ok()).count();
    let refused = codes
        .iter()
        .filter(|c| **c == Err(Code::ResourceExhausted))
        .count();
    assert!(served >= 1, "{codes:?}");
    assert_eq!(served + refused, FLOOD, "{codes:?}");
    assert!(
        refused >= FLOOD - 5,
        "only {refused} of {FLOOD} refused: {codes:?}"
    );
    assert_eq!(others, "OK", "uid 65534 was not served during the flood");
    let peak = server.peak_rss_kib();
    assert!(
        peak <= CAP_MIB * 1024,
        "the server took {peak} KiB at its peak, over --retain-memory {CAP_MIB} MiB, with \
         {FLOOD} snapshots asked at once; largest mappings:\n{}",
        server.largest_mappings(8)
    );
    let body = http::get(http_at, "/metrics").text();
    assert!(
        metric(&body, "ebtrace_requests_not_admitted_total") >= refused as u64,
        "{body}"
    );

    // Fifty CPU profiles at once from root, and one from uid 65534, which
    // waits its turn behind root's one.
    let flood: Vec<_> = (0..FLOOD)
        .map(|_| {
            std::thread::spawn(move || http::get(http_at, "/debug/pprof/profile?seconds=1").status)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let others = other.ask_at(
        NOBODY,
        &http_at.to_string(),
        "http:/debug/pprof/profile?seconds=1",
    );
    let statuses: Vec<u16> = flood.into_iter().map(|t| t.join().unwrap()).collect();
    let served = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert!(served >= 1, "{statuses:?}");
    assert_eq!(served + refused, FLOOD, "{statuses:?}");
    assert!(refused >= FLOOD - 5, "{statuses:?}");
    assert!(others.starts_with("200 "), "{others}");
}

/// A capture of `pid` by a server started with `args`, asking for every
/// event: the events its answer holds, its warnings, and how far the
/// server's resident memory rose above what it took before (MiB).
fn capture_every_event(pid: u32, args: &[&str]) -> (u64, Vec<String>, u64) {
    let pid = pid.to_string();
    let mut all = vec!["--pid", &pid];
    all.extend_from_slice(args);
    let server = ServeProcess::loopback(&all);
    let before = server.rss_kib();
    server.reset_peak_rss();
    let answer = block_on(async {
        let mut client = server.client().await;
        client
            .profile(ProfileRequest {
                max_events: 0,
                ..request(1_000)
            })
            .await
            .expect("the capture is answered")
            .into_inner()
    });
    let rose_mib = server.peak_rss_kib().saturating_sub(before) >> 10;
    let space = xspace_of(&answer);
    let events = space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .map(|l| l.events.len() as u64)
        .sum();
    (events, space.warnings, rose_mib)
}

#[test]
fn a_capture_asking_every_event_of_a_launch_loop_gets_the_servers_most_and_builds_no_more() {
    if !require_root(
        "a_capture_asking_every_event_of_a_launch_loop_gets_the_servers_most_and_builds_no_more",
    ) {
        return;
    }
    let _serial = serial();
    const MOST: u64 = 50_000;
    let mut workload = CudaWorkload::start(&["--iters", "100000000"]);
    workload.go();
    let (whole, _, whole_rose_mib) = capture_every_event(workload.pid, &[]);
    assert!(
        whole > 10 * MOST,
        "the loop made {whole} events in 1 s: too few to judge"
    );
    let (capped, warnings, capped_rose_mib) =
        capture_every_event(workload.pid, &["--max-capture-events", &MOST.to_string()]);
    assert!(capped <= MOST, "{capped} events answered");
    assert!(
        warnings.iter().any(|w| w.contains(&format!(
            "this server's --max-capture-events ({MOST}) was reached; the trace covers the first"
        ))),
        "{warnings:?}"
    );
    // What the window's records take is held either way (about 15 bytes
    // a call); building them into the answer is what the limit spares.
    assert!(
        capped_rose_mib * 2 < whole_rose_mib,
        "the server rose {capped_rose_mib} MiB answering {capped} events, {whole_rose_mib} MiB \
         answering all {whole}"
    );
    println!(
        "all {whole} events: {whole_rose_mib} MiB; at most {MOST}: {capped} events, \
         {capped_rose_mib} MiB"
    );
}
