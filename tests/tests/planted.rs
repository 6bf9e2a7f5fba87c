//! Where ebtrace, as root, writes traces into a directory someone else
//! owns: what that someone planted there (a link, a FIFO, at any name
//! ebtrace writes) is never written through, opened or waited on; the
//! trace is readable by the directory's owner only, and owned by it.

use std::{
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::Path,
    time::Duration,
};

use ebtrace_tests::{
    TempDir,
    fixture::SchedWorkload,
    mkfifo, require_root, serial,
    serve::{ServeProcess, block_on, request},
    spawn_record, wait_with_deadline, xplane_files,
};

/// What `nobody` owns.
const NOBODY: u32 = 65534;

/// Only its owner may read it, and that owner is `nobody`.
fn assert_private_to_nobody(path: &Path) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(meta.is_file(), "{}", path.display());
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{}",
        path.display()
    );
    assert_eq!(
        (meta.uid(), meta.gid()),
        (NOBODY, NOBODY),
        "{}",
        path.display()
    );
}

/// A server saving into a user's directory: a FIFO and a link planted at
/// the temporary names a save used to take, and a FIFO at the trace's own
/// name, neither wedge the save nor get written through.
#[test]
fn a_server_save_is_neither_wedged_nor_led_by_what_was_planted() {
    if !require_root("a_server_save_is_neither_wedged_nor_led_by_what_was_planted") {
        return;
    }
    let _serial = serial();
    block_on(async {
        let workload = SchedWorkload::start(&[]);
        let scratch = TempDir::new("planted-serve");
        let allowed = scratch.path().join("allowed");
        let run = allowed.join("logs/plugins/profile/2026_12_02_01_02_03");
        std::fs::create_dir_all(&run).unwrap();
        let victim = scratch.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        for dir in [&allowed, &allowed.join("logs"), &run] {
            std::os::unix::fs::chown(dir, Some(NOBODY), Some(NOBODY)).unwrap();
        }
        let server = ServeProcess::loopback(&[
            "--pid",
            &workload.pid.to_string(),
            "--allow-write-under",
            allowed.to_str().unwrap(),
        ]);
        let host = "127.0.0.1_6009.xplane.pb";
        // The names a save's temporary file once had: the server's pid.
        let old_tmp = run.join(format!(".{host}.tmp-{}", server.pid()));
        mkfifo(&old_tmp);
        let mut client = server.client().await;

        let mut req = request(200);
        req.repository_root = allowed
            .join("logs/plugins/profile")
            .to_string_lossy()
            .into_owned();
        req.session_id = "2026_12_02_01_02_03".into();
        req.host_name = "127.0.0.1:6009".into();
        let saved = tokio::time::timeout(Duration::from_secs(30), client.profile(req.clone()))
            .await
            .expect("the save waited on a planted FIFO")
            .expect("profile")
            .into_inner();
        let file = run.join(host);
        assert_eq!(std::fs::read(&file).unwrap(), saved.tool_data[0].data);
        assert_private_to_nobody(&file);

        // A link at the old temporary name, and a FIFO at the trace's own.
        std::fs::remove_file(&old_tmp).unwrap();
        std::os::unix::fs::symlink(&victim, &old_tmp).unwrap();
        std::fs::remove_file(&file).unwrap();
        mkfifo(&file);
        let saved = tokio::time::timeout(Duration::from_secs(30), client.profile(req))
            .await
            .expect("the save waited on a planted FIFO")
            .expect("profile")
            .into_inner();
        assert_eq!(std::fs::read(&file).unwrap(), saved.tool_data[0].data);
        assert_private_to_nobody(&file);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(std::fs::symlink_metadata(&old_tmp).unwrap().is_symlink());
    });
}

/// `ebtrace --pid` writing into a user's log directory: the run's
/// directories and trace are that user's, the trace readable by it alone;
/// a link it planted where ebtrace makes `plugins` is not followed out of
/// the directory, and the capture says why in one line.
#[test]
fn a_capture_into_a_users_logdir_is_theirs_and_stays_inside_it() {
    if !require_root("a_capture_into_a_users_logdir_is_theirs_and_stays_inside_it") {
        return;
    }
    let _serial = serial();
    let workload = SchedWorkload::start(&[]);
    let pid = workload.pid.to_string();

    let logdir = TempDir::new("planted-logdir");
    std::os::unix::fs::chown(logdir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    let out = wait_with_deadline(
        spawn_record(&pid, "300ms", &logdir, &[]),
        Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = xplane_files(logdir.path());
    assert_eq!(files.len(), 1);
    assert_private_to_nobody(&files[0]);
    let mut dir = files[0].parent().unwrap();
    while dir != logdir.path() {
        assert_eq!(
            std::fs::metadata(dir).unwrap().uid(),
            NOBODY,
            "{}",
            dir.display()
        );
        dir = dir.parent().unwrap();
    }

    let logdir = TempDir::new("planted-link");
    let outside = TempDir::new("planted-outside");
    std::os::unix::fs::symlink(outside.path(), logdir.path().join("plugins")).unwrap();
    let out = wait_with_deadline(
        spawn_record(&pid, "300ms", &logdir, &[]),
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("plugins is a link leading out of the directory it is in"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
}
