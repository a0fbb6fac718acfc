//! `flock-agent ca init|issue` and `--ca-dir`, through the real binary: the files are
//! 0600 in a 0700 directory, never written through a symlink nor over an existing file
//! without `--force`, keys never printed; two issuers made under one root are accepted
//! by `--ca-dir` and verify each other's SVIDs; the agent logs the issuer it runs with,
//! re-issues when the directory changes, refuses a bad set at start, and without
//! `--ca-dir` says that cross-node mTLS needs one.

mod common;

use common::{AGENT_BIN, Agent, WAIT, wait_for};
use flock_bird::identity::ca_dir::{self, CA_KEY_FILE, ROOT_CERT_FILE, ROOT_KEY_FILE};
use flock_bird::identity::{BuiltinCa, IdentityProvider as _, PodIdentity};
use flock_core::pod::PodKey;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

fn ca(args: &[&str]) -> Output {
    Command::new(AGENT_BIN)
        .arg("ca")
        .args(args)
        .output()
        .expect("running flock-agent ca")
}

fn ok(args: &[&str]) -> String {
    let out = ca(args);
    assert!(
        out.status.success(),
        "flock-agent ca {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn refused(args: &[&str], needle: &str) {
    let out = ca(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "flock-agent ca {args:?} succeeded");
    assert!(stderr.contains(needle), "{needle:?} not in: {stderr}");
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn pod(container: &str) -> PodIdentity {
    PodIdentity {
        key: PodKey::new(container, "eth0"),
        namespace: "shop".to_string(),
        service_account: container.to_string(),
        pod_name: container.to_string(),
        pod_uid: String::new(),
    }
}

#[tokio::test]
async fn init_and_issue_make_sets_that_ca_dir_accepts_and_that_trust_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let (n1, n2) = (tmp.path().join("n1"), tmp.path().join("n2"));
    let mut printed = ok(&["init", "--out", s(&root), "--trust-domain", "mesh.test"]);
    printed += &ok(&["issue", "--root", s(&root), "--out", s(&n1), "--name", "n1"]);
    printed += &ok(&[
        "issue",
        "--root",
        s(&root),
        "--out",
        s(&n2),
        "--name",
        "n2",
        "--days",
        "30",
    ]);

    for dir in [&root, &n1, &n2] {
        assert_eq!(mode(dir), 0o700, "{}", dir.display());
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            assert_eq!(mode(&path), 0o600, "{}", path.display());
        }
    }
    // No key reaches the terminal.
    assert!(!printed.contains("PRIVATE KEY"), "{printed}");
    for key in [root.join(ROOT_KEY_FILE), n1.join(CA_KEY_FILE)] {
        let body = std::fs::read_to_string(&key).unwrap();
        assert!(!printed.contains(body.lines().nth(1).unwrap()));
    }

    let a = BuiltinCa::from_ca_dir(
        "mesh.test",
        Duration::from_secs(3600),
        flock_clock::unix_now,
        &n1,
    )
    .expect("--ca-dir accepts n1");
    let b = BuiltinCa::from_ca_dir(
        "mesh.test",
        Duration::from_secs(3600),
        flock_clock::unix_now,
        &n2,
    )
    .expect("--ca-dir accepts n2");
    assert_eq!(a.bundle().ca_pem, b.bundle().ca_pem, "one root");
    let id = a.subscribe(&pod("front")).await.unwrap();
    let svid = a.view().borrow().svids[&id].clone();
    // The leaf and its issuer, verified against the *other* node's bundle.
    assert_eq!(
        svid.cert_chain_pem.matches("BEGIN CERTIFICATE").count(),
        2,
        "leaf + issuer"
    );
    ca_dir::verify_svid_chain(
        &svid.cert_chain_pem,
        &b.bundle().ca_pem,
        flock_clock::unix_now(),
    )
    .expect("n1's SVID verifies against n2's bundle");
    // And not against a root made separately.
    let other = tmp.path().join("other");
    ok(&["init", "--out", s(&other)]);
    let other_root = std::fs::read_to_string(other.join(ROOT_CERT_FILE)).unwrap();
    assert!(
        ca_dir::verify_svid_chain(&svid.cert_chain_pem, &other_root, flock_clock::unix_now())
            .is_err()
    );
}

#[test]
fn files_are_never_overwritten_without_force_nor_written_through_symlinks() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    ok(&["init", "--out", s(&root)]);
    let cert = std::fs::read(root.join(ROOT_CERT_FILE)).unwrap();
    let key = std::fs::read(root.join(ROOT_KEY_FILE)).unwrap();

    refused(&["init", "--out", s(&root)], "--force");
    assert_eq!(
        std::fs::read(root.join(ROOT_CERT_FILE)).unwrap(),
        cert,
        "untouched"
    );
    assert_eq!(
        std::fs::read(root.join(ROOT_KEY_FILE)).unwrap(),
        key,
        "untouched"
    );
    ok(&["init", "--out", s(&root), "--force"]);
    assert_ne!(
        std::fs::read(root.join(ROOT_KEY_FILE)).unwrap(),
        key,
        "replaced"
    );
    assert_eq!(mode(&root.join(ROOT_KEY_FILE)), 0o600);

    // The output directory a symlink: refused, nothing written where it points.
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    refused(&["init", "--out", s(&link)], "symlink");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);

    // A symlink planted at a file's path: refused (with and without --force the link's
    // target is never written).
    let out = tmp.path().join("planted");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o700)).unwrap();
    let target = tmp.path().join("target");
    std::os::unix::fs::symlink(&target, out.join(ROOT_KEY_FILE)).unwrap();
    refused(&["init", "--out", s(&out)], "exists");
    assert!(!target.exists());
    ok(&["init", "--out", s(&out), "--force"]);
    assert!(
        !target.exists(),
        "--force replaced the link, not its target"
    );
    assert!(
        !std::fs::symlink_metadata(out.join(ROOT_KEY_FILE))
            .unwrap()
            .file_type()
            .is_symlink()
    );

    // A directory others can read.
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    refused(&["init", "--out", s(&open)], "chmod 700");

    // Bad input: a missing root, zero days, a bad trust domain.
    refused(
        &[
            "issue",
            "--root",
            s(&tmp.path().join("none")),
            "--out",
            s(&tmp.path().join("x")),
        ],
        "root-cert.pem",
    );
    refused(
        &["init", "--out", s(&tmp.path().join("y")), "--days", "0"],
        "--days",
    );
    refused(
        &[
            "init",
            "--out",
            s(&tmp.path().join("z")),
            "--trust-domain",
            "Bad_Domain!",
        ],
        "trust domain",
    );
}

#[test]
fn the_agent_runs_with_ca_dir_follows_changes_and_refuses_a_bad_set() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let n1 = tmp.path().join("n1");
    ok(&["init", "--out", s(&root)]);
    ok(&["issue", "--root", s(&root), "--out", s(&n1), "--name", "n1"]);

    let mut agent = Agent::start(&["--ca-dir", s(&n1)]);
    let log = agent.proc.log_text();
    assert!(log.contains("built-in CA under a shared root"), "{log}");
    assert!(log.contains("flock issuer n1"), "{log}");
    assert!(!log.contains("PRIVATE KEY"));
    // A new issuer written over the set (atomic renames): the agent takes it up.
    ok(&[
        "issue",
        "--root",
        s(&root),
        "--out",
        s(&n1),
        "--name",
        "n1-next",
        "--force",
    ]);
    wait_for("the agent to use the new issuer", WAIT, || {
        agent.proc.log_text().contains("CA directory changed")
    });
    assert!(agent.proc.log_text().contains("flock issuer n1-next"));
    agent.proc.stop(WAIT);
    drop(agent);

    // Without --ca-dir: the node-local CA, and a word about cross-node mTLS.
    let agent = Agent::start(&[]);
    assert!(
        agent
            .proc
            .log_text()
            .contains("cross-node mTLS needs a shared root (--ca-dir)")
    );
    drop(agent);

    // A set whose key is not the issuer's: the agent does not start, and says why.
    let n2 = tmp.path().join("n2");
    ok(&["issue", "--root", s(&root), "--out", s(&n2), "--name", "n2"]);
    std::fs::copy(n1.join(CA_KEY_FILE), n2.join(CA_KEY_FILE)).unwrap();
    let state = tmp.path().join("state");
    let out = Command::new(AGENT_BIN)
        .args([
            "--node-name",
            "n2",
            "--admin-address",
            "127.0.0.1:0",
            "--ca-dir",
            s(&n2),
        ])
        .arg("--state-dir")
        .arg(&state)
        .arg("--cni-socket")
        .arg(tmp.path().join("cni.sock"))
        .arg("--xds-socket")
        .arg(tmp.path().join("run/xds.sock"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--ca-dir") && stderr.contains("does not match"),
        "{stderr}"
    );
    // --ca-dir only goes with the built-in CA.
    let out = Command::new(AGENT_BIN)
        .args([
            "--node-name",
            "n2",
            "--identity",
            "none",
            "--ca-dir",
            s(&n1),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("only the built-in CA"));
}
