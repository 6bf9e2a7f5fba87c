//! `ebtrace serve` on a network address speaks TLS and takes only clients
//! with a certificate its `--client-ca` signed; each is who its certificate
//! names, and gets what `--policy` grants that name. The certificates are
//! made by the test (rcgen); the clients are `ebtrace capture`, tonic's
//! own TLS client, and a real Prometheus (Debian's package) scraping
//! `/metrics` with its client certificate.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Output,
    time::Duration,
};

use ebtrace_proto::tensorflow::profiler_service_client::ProfilerServiceClient;
use ebtrace_tests::{
    TempDir, debian_tool,
    fixture::SchedWorkload,
    prometheus::Prometheus,
    require_root, run_ebtrace, serial,
    serve::{ServeProcess, block_on, request},
    tls::{Ca, Issued},
    xplane_files, xspace,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// `ebtrace capture` of `server` as `client`, trusting `server_ca`.
fn capture(
    server: SocketAddr,
    client: &Issued,
    server_ca: &Path,
    logdir: &Path,
    extra: &[&str],
) -> Output {
    let mut args = vec![
        "capture".to_string(),
        server.to_string(),
        "--logdir".into(),
        logdir.display().to_string(),
        "--tls-cert".into(),
        client.cert.display().to_string(),
        "--tls-key".into(),
        client.key.display().to_string(),
        "--server-ca".into(),
        server_ca.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_ebtrace(&args)
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The thread ids on the trace's CPU plane.
fn thread_lines(path: &Path) -> Vec<i64> {
    let space = xspace::load(path);
    xspace::plane(&space, "/host:CPU")
        .lines
        .iter()
        .map(|l| l.id)
        .collect()
}

/// Replaces `issued`'s files with `with`'s, each renamed into place as a
/// Secret update or a certificate manager does.
fn replace(issued: &Issued, with: &Issued) {
    for (to, from) in [(&issued.key, &with.key), (&issued.cert, &with.cert)] {
        let staged = PathBuf::from(format!("{}.new", to.display()));
        std::fs::copy(from, &staged).unwrap();
        std::fs::rename(&staged, to).unwrap();
    }
}

#[test]
fn client_certificates_decide_who_is_served_and_a_rotated_certificate_is_used() {
    if !require_root("client_certificates_decide_who_is_served_and_a_rotated_certificate_is_used") {
        return;
    }
    let _serial = serial();
    let dir = TempDir::new("tls");
    let d = dir.path();
    let ca = Ca::new(d, "ebtrace-ca");
    let other_ca = Ca::new(d, "other-ca");
    let server_cert = ca.server(d, "server", &["127.0.0.1"]);
    let ops = ca.client(d, "ops");
    let prometheus_cert = ca.client(d, "prometheus");
    let revoked = ca.client(d, "laptop");
    let stranger = ca.client(d, "stranger");
    let forged = other_ca.client(d, "ops-forged");
    let policy = d.join("policy.toml");
    std::fs::write(
        &policy,
        "revoked_subjects = [\"laptop\"]\n\
         [[grant]]\nsubjects = [\"ops\", \"laptop\"]\nscopes = [\"read\", \"capture\", \"control\"]\n\
         [[grant]]\nsubjects = [\"prometheus\"]\nscopes = [\"read\"]\n",
    )
    .unwrap();

    let workload = SchedWorkload::start(&[]);
    let path = |p: &Path| p.display().to_string();
    let server = ServeProcess::start(
        &[
            "--pid",
            &workload.pid.to_string(),
            "--bind",
            "0.0.0.0:0",
            "--http",
            "0.0.0.0:0",
            "--retain",
            "10s",
            "--tls-cert",
            &path(&server_cert.cert),
            "--tls-key",
            &path(&server_cert.key),
            "--client-ca",
            &path(&ca.cert),
            "--policy",
            &path(&policy),
        ],
        1,
    );
    assert!(
        server.lines().iter().all(|l| !l.contains("warning")),
        "{:?}",
        server.lines()
    );
    let grpc: SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let http: SocketAddr = format!("127.0.0.1:{}", server.http_addr().port())
        .parse()
        .unwrap();

    // The operator's certificate: a capture of the watched process, in the
    // layout jax.collect_profile writes.
    let logdir = TempDir::new("tls-logdir");
    let ok = capture(
        grpc,
        &ops,
        &ca.cert,
        logdir.path(),
        &["--duration", "500ms"],
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(
        files[0].ends_with(format!("127.0.0.1_{}.xplane.pb", grpc.port())),
        "{}",
        files[0].display()
    );
    let lines = thread_lines(&files[0]);
    for tid in workload.threads.values() {
        assert!(lines.contains(&i64::from(*tid)), "{tid} not in {lines:?}");
    }
    let snapshot = capture(grpc, &ops, &ca.cert, logdir.path(), &["--snapshot"]);
    assert!(snapshot.status.success(), "{}", stderr(&snapshot));

    // A revoked name, and one the policy grants nothing: refused, saying
    // by which rule.
    let refused = capture(
        grpc,
        &revoked,
        &ca.cert,
        logdir.path(),
        &["--duration", "100ms"],
    );
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("PermissionDenied: certificate \"laptop\" is revoked"),
        "{}",
        stderr(&refused)
    );
    let refused = capture(
        grpc,
        &stranger,
        &ca.cert,
        logdir.path(),
        &["--duration", "100ms"],
    );
    assert!(
        stderr(&refused).contains("certificate \"stranger\" is granted no \"capture\""),
        "{}",
        stderr(&refused)
    );

    // A certificate of another CA, and none at all: the handshake fails.
    let forged_out = capture(
        grpc,
        &forged,
        &ca.cert,
        logdir.path(),
        &["--duration", "100ms"],
    );
    assert_eq!(forged_out.status.code(), Some(1), "{}", stderr(&forged_out));
    let without_certificate = block_on(async {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(std::fs::read(&ca.cert).unwrap()))
            .domain_name("127.0.0.1");
        let channel = Endpoint::from_shared(format!("https://{grpc}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await;
        match channel {
            Ok(channel) => ProfilerServiceClient::new(channel)
                .profile(request(100))
                .await
                .map(drop)
                .map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        }
    });
    assert!(without_certificate.is_err());
    assert_eq!(xplane_files(logdir.path()).len(), 2, "only ops's traces");
    assert!(
        server.count_lines("ebtrace: refused a TLS connection from 127.0.0.1") >= 2,
        "{:?}",
        server.lines()
    );

    // Prometheus scrapes /metrics over TLS with its own certificate, which
    // the policy lets read.
    if let Some(binary) = debian_tool("prometheus") {
        let prom_dir = TempDir::new("tls-prometheus");
        let job = format!(
            "    scheme: https\n    tls_config:\n      ca_file: {}\n      cert_file: {}\n      \
             key_file: {}\n",
            ca.cert.display(),
            prometheus_cert.cert.display(),
            prometheus_cert.key.display()
        );
        let prom = Prometheus::start(&binary, prom_dir.path(), http, &job);
        let up = prom.wait_value("up{job=\"ebtrace\"} == 1", Duration::from_secs(30));
        assert_eq!(up, Some(1.0), "{}", prom.log());
        let refused = prom.wait_value(
            "ebtrace_tls_handshakes_refused_total >= 2",
            Duration::from_secs(10),
        );
        assert!(refused.is_some(), "{}", prom.log());
        let query = format!("ebtrace_process_threads{{pid=\"{}\"}}", workload.pid);
        assert!(prom.wait_value(&query, Duration::from_secs(10)).is_some());
    }

    // The server's certificate replaced on disk, by one a new CA signed:
    // the next connection is served with it.
    let new_ca = Ca::new(d, "rotated-ca");
    replace(
        &server_cert,
        &new_ca.server(d, "server-rotated", &["127.0.0.1"]),
    );
    let stale = capture(
        grpc,
        &ops,
        &ca.cert,
        logdir.path(),
        &["--duration", "100ms"],
    );
    assert_eq!(stale.status.code(), Some(1), "{}", stderr(&stale));
    let fresh = capture(
        grpc,
        &ops,
        &new_ca.cert,
        logdir.path(),
        &["--duration", "100ms"],
    );
    assert!(fresh.status.success(), "{}", stderr(&fresh));
    assert!(
        server.count_lines("changed: loaded again") >= 1,
        "{:?}",
        server.lines()
    );
}

#[test]
fn tls_files_that_do_not_load_stop_the_server_with_one_line() {
    let dir = TempDir::new("tls-bad");
    let ca = Ca::new(dir.path(), "ca");
    let cert = ca.server(dir.path(), "server", &["127.0.0.1"]);
    let not_a_key = dir.path().join("not-a-key.pem");
    std::fs::write(&not_a_key, "hello\n").unwrap();
    let path = |p: &Path| p.display().to_string();
    let output = run_ebtrace(&[
        "serve",
        "--pid",
        "1",
        "--bind",
        "0.0.0.0:0",
        "--tls-cert",
        &path(&cert.cert),
        "--tls-key",
        &path(&not_a_key),
        "--client-ca",
        &path(&ca.cert),
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    let text = stderr(&output);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.starts_with(&format!(
            "ebtrace: error: --tls-key {}: no private key",
            path(&not_a_key)
        )),
        "{text}"
    );
}
