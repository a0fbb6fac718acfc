//! What the agent refuses at start, and the bootstrap it prints: the real binary run
//! with each bad configuration exits non-zero with a message saying what is wrong and
//! how to fix it, before it binds or writes anything; `envoy-bootstrap` prints the
//! Envoy bootstrap matching its flags (real Envoy runs it in `mesh` and `mtls`).

mod common;

use common::AGENT_BIN;
use serde_json::Value;
use std::process::{Command, Output};

/// Runs the agent with `args` (state and sockets in a fresh temp dir), no node-name
/// environment, and returns its output; the temp dir is returned so the caller can
/// check nothing was created.
fn run(args: &[&str]) -> (Output, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(AGENT_BIN);
    cmd.arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--cni-socket")
        .arg(dir.path().join("cni.sock"))
        .arg("--xds-socket")
        .arg(dir.path().join("run/xds.sock"));
    if !args.contains(&"--admin-address") {
        cmd.args(["--admin-address", "127.0.0.1:0"]);
    }
    let out = cmd
        .args(args)
        .env_remove("FLOCK_NODE_NAME")
        .output()
        .unwrap();
    (out, dir)
}

/// Asserts the agent refused to start with a message containing every `needle`, and
/// created none of its state or sockets.
fn assert_refused(args: &[&str], needles: &[&str]) {
    let (out, dir) = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} started: {stderr}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: {needle:?} not in: {stderr}"
        );
    }
    let created: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
    assert!(created.is_empty(), "{args:?} created {created:?}");
}

#[test]
fn a_missing_node_name_is_refused_with_how_to_set_it() {
    assert_refused(&[], &["no node name", "--node-name", "FLOCK_NODE_NAME"]);
}

#[test]
fn an_invalid_node_name_is_refused() {
    assert_refused(
        &["--node-name", "Node_1"],
        &["node name \"Node_1\"", "DNS-1123", "--node-name"],
    );
}

#[test]
fn plaintext_tcp_xds_is_refused() {
    assert_refused(
        &["--node-name", "n1", "--xds-address", "127.0.0.1:0"],
        &["--xds-address", "needs mTLS", "--xds-tls-cert"],
    );
    assert_refused(
        &["--node-name", "n1", "--xds-tls-cert", "/nonexistent"],
        &["need --xds-address"],
    );
}

#[test]
fn non_loopback_listeners_need_the_opt_in() {
    assert_refused(
        &["--node-name", "n1", "--admin-address", "0.0.0.0:0"],
        &[
            "--admin-address 0.0.0.0:0",
            "not a loopback",
            "--allow-non-loopback",
        ],
    );
    assert_refused(
        &[
            "--node-name",
            "n1",
            "--xds-address",
            "0.0.0.0:0",
            "--xds-tls-cert",
            "/c",
            "--xds-tls-key",
            "/k",
            "--xds-tls-client-ca",
            "/ca",
        ],
        &["--xds-address 0.0.0.0:0", "--allow-non-loopback"],
    );
}

#[test]
fn envoy_bootstrap_matches_the_flags() {
    let out = Command::new(AGENT_BIN)
        .args([
            "--node-name",
            "node-7.example",
            "--xds-socket",
            "/run/x/xds.sock",
        ])
        .args(["--envoy-cluster", "edge", "--envoy-admin-port", "9901"])
        .arg("envoy-bootstrap")
        .env_remove("FLOCK_NODE_NAME")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(b["node"]["id"], "node-7.example");
    assert_eq!(b["node"]["cluster"], "edge");
    let admin = &b["admin"]["address"]["socket_address"];
    assert_eq!(
        (&admin["address"], &admin["port_value"]),
        (&"127.0.0.1".into(), &9901.into())
    );
    let ads = &b["dynamic_resources"]["ads_config"];
    assert_eq!(ads["api_type"], "DELTA_GRPC");
    assert_eq!(ads["grpc_services"][0]["envoy_grpc"]["cluster_name"], "xds");
    let xds = &b["static_resources"]["clusters"][0];
    assert_eq!(xds["name"], "xds");
    assert_eq!(
        xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]["path"],
        "/run/x/xds.sock"
    );

    // Defaults: the default socket; the node name is still required.
    let out = Command::new(AGENT_BIN)
        .args(["--node-name", "n1", "envoy-bootstrap"])
        .output()
        .unwrap();
    let b: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        b["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            ["endpoint"]["address"]["pipe"]["path"],
        "/run/flock/xds.sock"
    );
    // The admin: a 0600 unix socket in flock-supervisor's control directory, no TCP
    // port any local process could reach.
    let admin = &b["admin"]["address"];
    assert_eq!(admin["pipe"]["path"], "/run/flock/envoy/control/admin.sock");
    assert_eq!(admin["pipe"]["mode"], 0o600);
    assert!(admin.get("socket_address").is_none(), "{admin}");
    let out = Command::new(AGENT_BIN)
        .arg("envoy-bootstrap")
        .env_remove("FLOCK_NODE_NAME")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no node name"));
}
