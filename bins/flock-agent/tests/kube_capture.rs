//! The shipped deployment meshes: two nodes (network namespaces on an underlay), per
//! node the real agent with the DaemonSet's own `--registry`, `--capture` and
//! `--capture-enforce` (read from `deploy/daemonset.yaml` and `deploy/configmap.yaml`:
//! `kubernetes` and `strict`) in kube mode, and a real Envoy under `flock-supervisor`;
//! pods added through libcni (Debian's `bridge` + `host-local`, then `flock-cni`).
//! Only `--capture-probe-cgroup` differs: kubelet's cgroup is a test cgroup here.
//!
//! The Kubernetes API server is flock-kube's API-server DOUBLE (`flock_kube::double`,
//! feature `testing`): no control plane can run where this suite runs. The test plays
//! the EndpointSlice controller: it writes the Service's slice with the pods' addresses
//! and their app port, as the real controller would. Everything else is real, and the
//! apps are unmodified (Python's HTTP server, curl).
//!
//! Pods: `client` and `web-1` on n1, `web-2` on n2; Service `web` (ClusterIP, port 80
//! → `http`, 8080). `shipped_flags_mesh_app_ports_through_both_envoys` asserts:
//! * `client` → `web-1`'s pod IP and app port (same node) answers `web-1`, over a
//!   TLS handshake counted by n1's Envoy as a client (cluster) and as a server (the
//!   inbound listener): the caller's Envoy dialled the app port the slice names and
//!   the callee's capture turned it into its inbound listener;
//! * `client` → `web-2`'s pod IP (across nodes) answers `web-2`, with n1's cluster
//!   and n2's listener handshakes rising;
//! * `client` → the ClusterIP reaches both pods, with a client handshake per pod on
//!   n1 and a server handshake on each node;
//! * strict capture: plaintext from n2's node to `web-1`'s app port gets no answer
//!   from the app, while a "kubelet probe" (a process in the probe cgroup on web-1's
//!   node) does.
//!
//! Needs root, nft, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`.

mod common;
mod multinode;

use common::*;
use multinode::*;
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;

const CLUSTER_IP: &str = "10.96.6.10";

/// A cgroup v2 group standing in for kubelet's (removed on drop).
struct KubeletCgroup {
    name: String,
    dir: PathBuf,
}

impl KubeletCgroup {
    fn new() -> Self {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(PathBuf::from)
            .find(|r| r.join("cgroup.controllers").exists())
            .expect("a cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified");
        let name = format!("flock-test-kubelet-kc-{}", std::process::id());
        let dir = root.join(&name);
        std::fs::create_dir_all(&dir).expect("creating the test cgroup");
        Self { name, dir }
    }

    /// `curl url` from a process in this cgroup, in network namespace `netns`.
    fn curl_in(&self, netns: &str, url: &str) -> (u16, String) {
        // Joins the cgroup first (`ip netns exec` hides the host's /sys/fs/cgroup),
        // then enters the namespace: the membership survives both execs.
        let out = Command::new("sh")
            .arg("-c")
            .arg(
                r#"echo $$ > "$1" && exec ip netns exec "$2" curl -sS -m 5 -o - -w "\n%{http_code}" "$3""#,
            )
            .arg("sh")
            .arg(self.dir.join("cgroup.procs"))
            .arg(netns)
            .arg(url)
            .output()
            .expect("curl is needed");
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }
}

impl Drop for KubeletCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `GET url` from inside `pod`: (status, body); status 0 when nothing answered.
fn get_from(pod: &Pod, url: &str) -> (u16, String) {
    let out = pod
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}", url])
        .output()
        .expect("curl is needed");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// TLS handshakes n's Envoy made as a client (clusters) and as a server (listeners).
fn handshakes(node: &Node) -> (u64, u64) {
    (
        node.envoy_counter(&["cluster.", "ssl.handshake"]),
        node.envoy_counter(&["listener.", "ssl.handshake"]),
    )
}

#[test]
fn shipped_flags_mesh_app_ports_through_both_envoys() {
    let kubelet = KubeletCgroup::new();
    let mut agent_args = manifest_agent_args(&["registry", "capture", "capture-enforce"]);
    assert_eq!(
        agent_args,
        [
            "--registry=kubernetes",
            "--capture=strict",
            "--capture-enforce"
        ],
        "the shipped DaemonSet's flags"
    );
    agent_args.extend(["--capture-probe-cgroup".into(), kubelet.name.clone()]);
    let mut c = Cluster::start(ClusterOptions {
        tag: 6,
        zones: vec!["z1", "z2"],
        shared_root: true,
        registry_ttl: 3,
        agent_args,
        kube: true,
    });
    let client = c.add_pod(0, "client", "client", false);
    let web1 = c.add_pod(0, "web-1", "web", true);
    let web2 = c.add_pod(1, "web-2", "web", true);
    let ip = |i: usize| c.pods[i].ip.clone().unwrap();
    let (ip1, ip2) = (ip(web1), ip(web2));

    // The Service and its slice, as the API server and the EndpointSlice controller
    // would write them: each endpoint is a pod's address and its app port.
    c.api()
        .apply(&kube_object::<k8s_openapi::api::core::v1::Service>(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"selector": {"app": "web"}, "clusterIP": CLUSTER_IP,
                     "clusterIPs": [CLUSTER_IP],
                     "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
        })));
    let endpoint = |ip: &str, node: &str, pod: &str| {
        json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": node,
               "targetRef": {"kind": "Pod", "namespace": "default", "name": pod}})
    };
    c.api().apply(
        &kube_object::<k8s_openapi::api::discovery::v1::EndpointSlice>(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-x1", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [endpoint(&ip1, "n1", "web-1"), endpoint(&ip2, "n2", "web-2")],
            "ports": [{"name": "http", "port": APP_PORT, "protocol": "TCP"}]
        })),
    );
    // Both agents hold both endpoints, at the app port (no listener port: the slice's).
    for n in &c.nodes {
        let admin = n.agent_admin();
        wait_for(
            &format!("{}'s registry has web-1 and web-2", n.name),
            WAIT,
            || {
                let Ok((200, body)) = http_get(&admin, "/debug/registry") else {
                    return false;
                };
                let view: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let ports: Vec<(String, u64)> = view["endpoints"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(_, e)| {
                        (
                            e["address"].as_str().unwrap_or_default().to_owned(),
                            e["port"].as_u64().unwrap_or_default(),
                        )
                    })
                    .collect();
                ports.contains(&(ip1.clone(), u64::from(APP_PORT)))
                    && ports.contains(&(ip2.clone(), u64::from(APP_PORT)))
            },
        );
    }

    // Same node: client → web-1's pod IP and app port.
    let (n1_before, n2_before) = (handshakes(&c.nodes[0]), handshakes(&c.nodes[1]));
    let url1 = format!("http://{ip1}:{APP_PORT}/");
    let answer = wait_for("client → web-1 (same node) answers", WAIT, || {
        let r = get_from(&c.pods[client], &url1);
        (r.0 == 200).then_some(r.1)
    });
    assert_eq!(answer, "web-1");
    let n1_after = handshakes(&c.nodes[0]);
    eprintln!("same node: n1 handshakes (client, server) {n1_before:?} -> {n1_after:?}");
    assert!(
        n1_after.0 > n1_before.0 && n1_after.1 > n1_before.1,
        "same node: n1's Envoy did not both dial and terminate mTLS: {n1_before:?} -> {n1_after:?}\n{}",
        c.logs()
    );

    // Across nodes: client → web-2's pod IP and app port.
    let n1_before = handshakes(&c.nodes[0]);
    let url2 = format!("http://{ip2}:{APP_PORT}/");
    let answer = wait_for("client → web-2 (across nodes) answers", WAIT, || {
        let r = get_from(&c.pods[client], &url2);
        (r.0 == 200).then_some(r.1)
    });
    assert_eq!(answer, "web-2");
    let (n1_after, n2_after) = (handshakes(&c.nodes[0]), handshakes(&c.nodes[1]));
    eprintln!(
        "across nodes: n1 client handshakes {} -> {}, n2 server handshakes {} -> {}",
        n1_before.0, n1_after.0, n2_before.1, n2_after.1
    );
    assert!(
        n1_after.0 > n1_before.0 && n2_after.1 > n2_before.1,
        "across nodes: no mTLS from n1's Envoy to n2's: n1 {n1_before:?} -> {n1_after:?}, n2 {n2_before:?} -> {n2_after:?}"
    );

    // The ClusterIP: both pods answer, through the Service's mTLS cluster (new
    // connections: one handshake on each side per pod).
    let (n1_before, n2_before) = (handshakes(&c.nodes[0]), handshakes(&c.nodes[1]));
    let vip = format!("http://{CLUSTER_IP}/");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        let (status, body) = get_from(&c.pods[client], &vip);
        assert_eq!(status, 200, "client → ClusterIP: {body}");
        seen.insert(body);
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(
        seen,
        ["web-1".to_string(), "web-2".to_string()].into(),
        "client → ClusterIP reached"
    );
    let (n1_after, n2_after) = (handshakes(&c.nodes[0]), handshakes(&c.nodes[1]));
    eprintln!("ClusterIP: n1 {n1_before:?} -> {n1_after:?}, n2 {n2_before:?} -> {n2_after:?}");
    assert!(
        n1_after.0 >= n1_before.0 + 2 && n1_after.1 > n1_before.1 && n2_after.1 > n2_before.1,
        "ClusterIP: not mTLS to both pods: n1 {n1_before:?} -> {n1_after:?}, n2 {n2_before:?} -> {n2_after:?}"
    );

    // Strict: nothing reaches web-1's app around Envoy. Plaintext from n2's node (not
    // a probe source) meets the inbound listener, which speaks only mTLS; kubelet's
    // probe (its cgroup, on web-1's node) reaches the app.
    let n2_ns = c.nodes[1].netns.clone();
    let out = Command::new("ip")
        .args(["netns", "exec", &n2_ns, "curl", "-sS", "-m", "5", &url1])
        .output()
        .unwrap();
    let plain = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && !plain.contains("web-1"),
        "plaintext from another node reached the app: {plain}"
    );
    let (status, body) = kubelet.curl_in(&c.nodes[0].netns, &url1);
    assert_eq!(
        (status, body.as_str()),
        (200, "web-1"),
        "kubelet's probe reaches the app"
    );
}
