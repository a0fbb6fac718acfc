//! The startup taint: the real `flock-agent --kube` removes
//! `flock.io/agent-not-ready:NoSchedule` from its own Node only once the node is ready
//! — the agent ready, the CNI installer's ready file present, and a real Envoy (on the
//! bootstrap `flock-agent envoy-bootstrap` writes) has ACKed a snapshot — and keeps
//! every other taint.
//!
//! The Kubernetes API is flock-kube's API-server double (feature `testing`): no API
//! server runs on these machines. The agent reaches it over TCP through the kubeconfig
//! the double writes. Envoy is the real one (`FLOCK_ENVOY_BIN`).

mod common;

use common::{Agent, ChildGuard, WAIT, envoy_bin, http_get, wait_for};
use flock_kube::double::ApiServer;
use k8s_openapi::api::core::v1::{Namespace, Node};
use serde_json::json;
use std::process::Command;

const TAINT: &str = "flock.io/agent-not-ready";

fn taint_keys(api: &ApiServer) -> Vec<String> {
    api.get::<Node>(None, "n1")
        .expect("node n1")
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect()
}

#[test]
fn the_startup_taint_goes_only_after_envoy_acked_and_other_taints_stay() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(ApiServer::start());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": "n1", "labels": { "topology.kubernetes.io/zone": "z1" } },
        "spec": { "taints": [
            { "key": TAINT, "effect": "NoSchedule" },
            { "key": "example.com/maintenance", "value": "soon", "effect": "NoExecute" },
        ] },
    }))
    .unwrap();
    api.apply(&node);
    let default_ns: Namespace = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": "default" },
    }))
    .unwrap();
    api.apply(&default_ns);

    let work = tempfile::tempdir().unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let ready_file = work.path().join("install-ready");
    let mut agent = Agent::start(&[
        "--kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--cni-ready-file",
        ready_file.to_str().unwrap(),
    ]);

    // Ready agent, no installer ready file, no Envoy: the taint stays, and /readyz
    // says why.
    let (status, body) = agent.get("/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("startup taint flock.io/agent-not-ready kept")
            && body.contains("install-ready"),
        "{body}"
    );
    assert_eq!(taint_keys(&api), [TAINT, "example.com/maintenance"]);

    // The installer is ready; still no Envoy.
    std::fs::write(&ready_file, "").unwrap();
    wait_for(
        "/readyz waiting for Envoy",
        WAIT,
        || matches!(http_get(&agent.admin, "/readyz"), Ok((200, b)) if b.contains("no Envoy has ACKed")),
    );
    assert_eq!(taint_keys(&api), [TAINT, "example.com/maintenance"]);
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.verb == "patch" && r.resource == "nodes"),
        "no Node patched before Envoy ACKed"
    );

    // A real Envoy on the agent's own bootstrap connects and ACKs.
    let bootstrap = work.path().join("envoy.json");
    // This test never calls Envoy's admin.
    std::fs::write(
        &bootstrap,
        agent.envoy_bootstrap("n1", &work.path().join("envoy-admin.sock")),
    )
    .unwrap();
    let mut cmd = Command::new(envoy_bin());
    cmd.arg("-c")
        .arg(&bootstrap)
        .args(["--disable-hot-restart", "--concurrency", "1"])
        .args(["--log-level", "info"]);
    let mut envoy = ChildGuard::spawn(cmd, work.path().join("envoy.log"));

    wait_for("the startup taint removed", WAIT, || {
        assert!(envoy.running(), "Envoy exited:\n{}", envoy.log_text());
        assert!(
            agent.proc.running(),
            "agent exited:\n{}",
            agent.proc.log_text()
        );
        !taint_keys(&api).iter().any(|k| k == TAINT)
    });
    assert_eq!(
        taint_keys(&api),
        ["example.com/maintenance"],
        "the other taint is kept"
    );
    wait_for(
        "/readyz without the taint line",
        WAIT,
        || matches!(http_get(&agent.admin, "/readyz"), Ok((200, b)) if b == "ready\n"),
    );
    let log = agent.proc.log_text();
    assert!(log.contains("startup taint removed"), "{log}");
    drop(envoy);
    agent.proc.stop(WAIT);
    drop(api);
}

/// `--registry kubernetes` reads EndpointSlices through kube mode's watch: without
/// `--kube` the agent refuses to start and says so.
#[test]
fn the_kubernetes_registry_needs_kube_mode() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(common::AGENT_BIN)
        .args(["--node-name", "n1", "--no-kube", "--registry", "kubernetes"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--cni-socket")
        .arg(dir.path().join("cni.sock"))
        .arg("--xds-socket")
        .arg(dir.path().join("run").join("xds.sock"))
        // It refuses to start before binding anything.
        .args(["--admin-address", "127.0.0.1:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--registry kubernetes") && stderr.contains("needs --kube"),
        "{stderr}"
    );
}
