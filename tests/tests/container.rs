//! The container image of `deploy/container/Containerfile`, built and run
//! as the Kubernetes DaemonSet runs it: the host's processes, its network,
//! only the capabilities and the seccomp setting the DaemonSet gives, and
//! the tracefs, debugfs and BTF mounts. It finds a process that uses the
//! CUDA driver, and a snapshot holds that process's driver calls, asked
//! over its TLS listener with a client certificate, the Secret's files made
//! by the test and mounted where the DaemonSet mounts them. Run under
//! the runtime's default seccomp profile instead, it exits with the line
//! that says why and what to do. The image's base is the one
//! `ebtrace_tests::podman` builds.

use std::time::{Duration, Instant};

use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, profiler_service_client::ProfilerServiceClient,
};
use ebtrace_tests::{
    TempDir,
    cuda::CudaWorkload,
    deploy::{
        daemonset_capabilities, daemonset_host_mounts, daemonset_list, daemonset_seccomp,
        deploy_file, deploy_path,
    },
    ebtrace_bin,
    podman::{ensure_base, host_limits, podman, run, tools_present},
    require_root, serial,
    serve::xspace_of,
    tls::{Ca, Issued},
    xspace::{count_named, plane},
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const IMAGE: &str = "localhost/ebtrace-test:latest";

/// Builds the image from the Containerfile, the binary under test placed
/// where the Containerfile takes it from.
fn build_image() {
    let context = TempDir::new("container-context");
    let release = context.path().join("target/release");
    std::fs::create_dir_all(&release).unwrap();
    std::fs::copy(ebtrace_bin(), release.join("ebtrace")).unwrap();
    let containerfile = deploy_path("container/Containerfile");
    run(podman().args([
        "build",
        "--pull=never",
        "-f",
        containerfile.to_str().unwrap(),
        "-t",
        IMAGE,
        context.path().to_str().unwrap(),
    ]));
}

/// A container started from the image; removed when dropped.
struct Container {
    name: String,
}

/// The DaemonSet's TLS Secret, made here: a client CA, the node's
/// certificate (for 127.0.0.1), and an operator's client certificate kept
/// apart from it.
struct Secret {
    /// What is mounted: the files the DaemonSet's flags name.
    dir: TempDir,
    /// Where the DaemonSet mounts it.
    mount: String,
    /// Where the CA's certificate and the operator's lie, as a client
    /// holds them.
    _client: TempDir,
    ca: std::path::PathBuf,
    operator: Issued,
}

impl Secret {
    fn make() -> Self {
        let args = daemonset_list("args:");
        let value = |flag: &str| {
            let at = args.iter().position(|a| a == flag).expect(flag);
            std::path::PathBuf::from(&args[at + 1])
        };
        let (cert, key, client_ca) = (
            value("--tls-cert"),
            value("--tls-key"),
            value("--client-ca"),
        );
        for file in [&key, &client_ca] {
            assert_eq!(file.parent(), cert.parent(), "one Secret holds them all");
        }
        let mount = cert.parent().unwrap().display().to_string();
        assert!(
            deploy_file("kubernetes/daemonset.yaml").contains(&format!("mountPath: {mount}")),
            "the DaemonSet mounts nothing at {mount}"
        );
        let client = TempDir::new("container-client");
        let ca = Ca::new(client.path(), "clients-ca");
        let operator = ca.client(client.path(), "operator");
        let node = ca.server(client.path(), "node", &["127.0.0.1"]);
        let dir = TempDir::new("container-secret");
        for (from, to) in [
            (&node.cert, &cert),
            (&node.key, &key),
            (&ca.cert, &client_ca),
        ] {
            std::fs::copy(from, dir.path().join(to.file_name().unwrap())).unwrap();
        }
        Secret {
            dir,
            mount,
            ca: ca.cert.clone(),
            _client: client,
            operator,
        }
    }
}

impl Container {
    /// Runs the image as the DaemonSet does, its arguments but the
    /// listening ports (any free one on the same address instead), with
    /// `secret` where the DaemonSet mounts its Secret, under the runtime's
    /// default seccomp profile unless `as_the_daemonset`.
    fn start(name: &str, as_the_daemonset: bool, secret: &Secret) -> Self {
        let _ = podman().args(["rm", "-f", name]).output();
        let mut cmd = podman();
        cmd.args(["run", "-d", "--name", name, "--pid=host", "--network=host"])
            .args(host_limits())
            .args(["--cap-drop=ALL", "--security-opt", "no-new-privileges"]);
        for cap in daemonset_capabilities() {
            cmd.arg(format!("--cap-add={cap}"));
        }
        if as_the_daemonset {
            let profile = daemonset_seccomp().expect("the DaemonSet sets a seccomp profile");
            assert_eq!(
                profile, "Unconfined",
                "the DaemonSet's seccomp profile changed"
            );
            cmd.args(["--security-opt", "seccomp=unconfined"]);
        }
        let mounts = daemonset_host_mounts();
        assert!(
            mounts.iter().any(|(host, _, _)| host == "/run/ebtrace"),
            "the DaemonSet keeps ebtrace's markers in a host directory: {mounts:?}"
        );
        for (host, container, read_only) in mounts {
            std::fs::create_dir_all(&host).expect("the host directory");
            let ro = if read_only { ":ro" } else { "" };
            cmd.args(["-v", &format!("{host}:{container}{ro}")]);
        }
        cmd.args([
            "-v",
            &format!("{}:{}:ro", secret.dir.path().display(), secret.mount),
        ]);
        cmd.arg(IMAGE);
        let mut args = daemonset_list("args:");
        assert_eq!(args.first().map(String::as_str), Some("serve"), "{args:?}");
        for at in 1..args.len() {
            if args[at - 1] == "--bind" || args[at - 1] == "--http" {
                let addr: std::net::SocketAddr = args[at].parse().expect("an address");
                args[at] = std::net::SocketAddr::new(addr.ip(), 0).to_string();
            }
        }
        cmd.args(&args);
        run(&mut cmd);
        Container { name: name.into() }
    }

    fn logs(&self) -> String {
        let out = podman().args(["logs", &self.name]).output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// The first log line that starts with `prefix`, without it, waiting
    /// up to `deadline`.
    fn wait_line(&self, prefix: &str, deadline: Duration) -> Option<String> {
        let start = Instant::now();
        loop {
            let logs = self.logs();
            let found = logs
                .lines()
                .find_map(|l| l.strip_prefix(prefix))
                .map(str::to_string);
            if found.is_some() || start.elapsed() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn running(&self) -> bool {
        let out = podman()
            .args(["inspect", "-f", "{{.State.Running}}", &self.name])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim() == "true"
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman().args(["rm", "-f", "-t", "2", &self.name]).output();
    }
}

#[test]
fn the_image_runs_as_the_daemonset_runs_it_and_records_a_cuda_process() {
    if !require_root("the_image_runs_as_the_daemonset_runs_it_and_records_a_cuda_process") {
        return;
    }
    if !tools_present() {
        return;
    }
    let _serial = serial();
    ensure_base();
    build_image();

    // Under the runtime's own seccomp profile: one line that says what to do.
    let secret = Secret::make();
    let refused = Container::start("ebtrace-test-seccomp", false, &secret);
    let start = Instant::now();
    while refused.running() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let logs = refused.logs();
    assert!(
        !refused.running(),
        "it runs under the default profile: {logs}"
    );
    assert!(
        logs.contains("a seccomp filter denies them") && logs.contains("seccomp=unconfined"),
        "{logs}"
    );
    drop(refused);

    let container = Container::start("ebtrace-test-daemonset", true, &secret);
    // The listener on every address, where the DaemonSet's clients come
    // from: TLS, reached here at 127.0.0.1 with the operator's certificate.
    let tls_port = container
        .wait_line(
            "ebtrace: serving tensorflow.ProfilerService on 0.0.0.0:",
            Duration::from_secs(60),
        )
        .unwrap_or_else(|| panic!("the server did not start: {}", container.logs()));
    let addr = format!("127.0.0.1:{tls_port}");
    assert!(
        container
            .logs()
            .contains(&format!("0.0.0.0:{tls_port} speaks TLS")),
        "{}",
        container.logs()
    );
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&secret.ca).unwrap()))
        .identity(Identity::from_pem(
            std::fs::read(&secret.operator.cert).unwrap(),
            std::fs::read(&secret.operator.key).unwrap(),
        ))
        .domain_name("127.0.0.1");
    let mut workload = CudaWorkload::start(&["--bench-seconds", "30"]);
    workload.go();
    let pid = workload.pid;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // --discover rescans /proc every 2 s; then the recorder holds its calls.
    let start = Instant::now();
    loop {
        let space = runtime.block_on(async {
            let channel = Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(tls.clone())
                .unwrap()
                .connect()
                .await
                .expect("connect over TLS");
            let mut client =
                ProfilerServiceClient::new(channel).max_decoding_message_size(usize::MAX);
            client
                .get_snapshot(GetSnapshotRequest::default())
                .await
                .ok()
                .map(|r| xspace_of(&r.into_inner()))
        });
        // The workload is the only process here that calls the driver.
        let launches = space.as_ref().map_or(0, |space| {
            count_named(plane(space, "/host:CPU"), "cuLaunchKernel")
        });
        if launches > 100 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no driver calls of pid {pid} in a snapshot ({launches}): {}",
            container.logs()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let logs = container.logs();
    assert!(
        logs.contains(&format!("pid {pid}")),
        "the server never named the workload: {logs}"
    );
    assert!(!logs.contains("Operation not permitted"), "{logs}");
}
