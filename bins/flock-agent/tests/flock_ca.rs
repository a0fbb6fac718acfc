//! `--identity flock-ca`: the agent holds no issuer key and gets its pods' SVIDs from
//! the node-scoped signer, for the pods it may host only.
//!
//! Real processes: the `flock-ca` binary (with an operator's scope file: node `n1` may
//! host `default/web`) and the agent binary as node `n1` with its node credential. A
//! pod of an account in scope is meshed with its SVID; a pod of an account outside the
//! scope fails its ADD with the signer's refusal; nothing on the node's disk is an
//! issuer key.

mod common;

use common::*;
use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// AddPod `name` (service `web`, port 8080, service account `sa`); the answer.
async fn add_pod(socket: &Path, name: &str, sa: &str, ip: &str) -> (i32, String) {
    let req = AddPodRequest {
        container_id: format!("c-{name}"),
        netns: "/var/run/netns/none".into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: name.into(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
        }),
        ips: vec![IpConfig {
            address: format!("{ip}/16"),
            ..IpConfig::default()
        }],
        annotations: [
            ("flock.io/service", "web"),
            ("flock.io/ports", "8080"),
            ("flock.io/service-account", sa),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        network_name: "flock-test".into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(30), |mut c| async move {
        c.add_pod(req).await
    })
    .await
    .unwrap_or_else(|e| panic!("AddPod {name}: {e}"));
    (resp.outcome, resp.message)
}

fn secrets(agent: &Agent) -> Vec<String> {
    agent.json("/debug/snapshot")["groups"]["envoy"]["resources"]["sds"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_gets_svids_from_the_signer_for_the_pods_it_may_host_only() {
    let tmp = tempfile::tempdir().unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let (root, ca, cred) = (
        tmp.path().join("root"),
        tmp.path().join("ca"),
        tmp.path().join("n1"),
    );
    run(Command::new(AGENT_BIN).args(["ca", "init", "--out", &s(&root)]));
    run(Command::new(AGENT_BIN).args([
        "ca",
        "issue",
        "--root",
        &s(&root),
        "--out",
        &s(&ca),
        "--name",
        "signer",
    ]));
    let signer_bin = sibling_bin("flock-ca");
    run(Command::new(&signer_bin).args([
        "node-credential",
        "--node",
        "n1",
        "--ca-dir",
        &s(&ca),
        "--out",
        &s(&cred),
    ]));
    let scope = tmp.path().join("scope");
    std::fs::write(&scope, "n1: default/web\n").unwrap();
    let port = reserve_port_for_child();
    let mut signer = Command::new(&signer_bin);
    signer
        .args(["serve", "--ca-dir", &s(&ca), "--scope-file", &s(&scope)])
        .args(["--listen", &format!("127.0.0.1:{}", port.port())]);
    let _signer = ChildGuard::spawn(signer, tmp.path().join("signer.log"));

    // The agent asks the signer nothing until the first ADD: the signer must be up
    // by then.
    wait_for("flock-ca to listen", WAIT, || {
        std::net::TcpStream::connect(("127.0.0.1", port.port())).is_ok()
    });
    let url = format!("flock-ca:https://127.0.0.1:{}", port.port());
    let agent = Agent::start(&["--identity", &url, "--node-credential", &s(&cred)]);
    assert!(
        agent.proc.log_text().contains("no issuer key on this node"),
        "{}",
        agent.proc.log_text()
    );

    let (outcome, message) = add_pod(&agent.cni_socket, "web-0", "web", "10.9.0.10").await;
    assert_eq!(outcome, Outcome::Success as i32, "{message}");
    let id = "spiffe://cluster.local/ns/default/sa/web".to_string();
    assert!(secrets(&agent).contains(&id), "{:?}", secrets(&agent));

    // An account the node may not host: the signer refuses and so does the ADD.
    let (outcome, message) = add_pod(&agent.cni_socket, "admin-0", "admin", "10.9.0.11").await;
    assert_ne!(
        outcome,
        Outcome::Success as i32,
        "a pod outside the node's scope was meshed"
    );
    assert!(
        message.contains("may not host service account default/admin"),
        "{message}"
    );
    assert!(!secrets(&agent).iter().any(|s| s.ends_with("/sa/admin")));

    // The node's disk: its credential and the agent's state, no issuer key anywhere.
    let keys: Vec<String> = walk(agent.dir.path())
        .chain(walk(&cred))
        .filter(|p| std::fs::read_to_string(p).is_ok_and(|t| t.contains("PRIVATE KEY")))
        .map(|p| p.display().to_string())
        .collect();
    assert_eq!(keys, [cred.join("node-key.pem").display().to_string()]);
    assert!(!agent.proc.log_text().contains("PRIVATE KEY"));
}

fn walk(dir: &Path) -> impl Iterator<Item = std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(p),
                Ok(t) if t.is_file() => out.push(p),
                _ => {}
            }
        }
    }
    out.into_iter()
}
