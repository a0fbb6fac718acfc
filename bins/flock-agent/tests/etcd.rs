//! Two agents sharing a real etcd: two nodes simulated on one machine (separate state
//! dirs, CNI sockets, xDS and admin ports), `--registry etcd://… --registry-ttl 2`.
//!
//! * A pod added on n1 (real CNI gRPC API on n1's socket) reaches n2's xDS: a raw
//!   Delta ADS client (Envoy node group) on n2 gets the ClusterLoadAssignment
//!   `outbound|8080|web.default` with 10.9.0.5:15006 in zone z1, and n2's
//!   `/debug/registry` has it with node n1. A pod added on n2 shows up in n1's view.
//! * `kill -9` of n1: its endpoint leaves n2's xDS once its etcd lease expires —
//!   within TTL + 3 s and not at once (nobody deleted it). n2's own endpoint stays.
//! * n1 restarted on the same state dir loads the pod from its store, re-registers it
//!   under a new lease, and n2's xDS has it again.
//! * RemovePod on n1 deletes the endpoint: it leaves n2's xDS well under the TTL.
//!
//! Needs `FLOCK_ETCD_BIN` (scripts/test, or scripts/prereqs/40-etcd.sh) and
//! `cargo build -p flock-agent`. Waits are on xDS messages or polls with deadlines.

mod common;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{Node, address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef, RemovePodRequest};
use flock_xds::client::{self, DeltaStream};
use flock_xds::types::{CLUSTER, ENDPOINT};
use prost::Message as _;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// `--registry-ttl`, seconds.
const TTL: u64 = 2;
const WEB_CLA: &str = "outbound|8080|web.default";
/// n1's pod and its EDS endpoint (the first inbound listener port).
const N1_IP: &str = "10.9.0.5";
const N1_EP: &str = "10.9.0.5:15006";
/// n2's pod (same service) and its endpoint.
const N2_IP: &str = "10.9.1.7";
const N2_EP: &str = "10.9.1.7:15006";

/// Runs a blocking harness call (HTTP polls, process waits) without stalling the
/// runtime's other worker (the ADS stream's connection task).
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Node `node`'s registry flags beside [`Etcd::registry_spec`]: the TTL and its zone.
fn node_flags(zone: &str) -> [String; 4] {
    [
        "--registry-ttl".into(),
        TTL.to_string(),
        "--zone".into(),
        zone.into(),
    ]
}

/// Starts agent `node` in `zone` on `etcd` and waits until it is ready.
fn start_node(etcd: &Etcd, node: &str, zone: &str) -> Agent {
    let flags = node_flags(zone);
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    blocking(|| Agent::start_node(node, &etcd.registry_spec(), &extra))
}

/// Starts `agent` again as [`start_node`] did (same state dir, socket and ports),
/// without waiting for it.
fn restart_node(etcd: &Etcd, agent: &mut Agent, node: &str, zone: &str) {
    let flags = node_flags(zone);
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    agent.respawn(node, &etcd.registry_spec(), &extra);
}

/// AddPod over the agent's CNI socket (the plugin's own client): a `web` pod on port
/// 8080 in the host netns (it exists; nothing here needs traffic).
async fn add_pod(socket: &Path, container_id: &str, name: &str, ip: &str) {
    let req = AddPodRequest {
        container_id: container_id.into(),
        netns: common::pods_netns().into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: name.into(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
        }),
        ips: vec![IpConfig {
            address: format!("{ip}/16"),
            gateway: String::new(),
            interface: -1,
            interface_name: String::new(),
        }],
        annotations: [("flock.io/service", "web"), ("flock.io/ports", "8080")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        network_name: "flock-test".into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(10), |mut c| async move {
        c.add_pod(req).await
    })
    .await
    .unwrap_or_else(|e| panic!("AddPod {name}: {e}"));
    assert_eq!(
        resp.outcome,
        Outcome::Success as i32,
        "AddPod {name}: {}",
        resp.message
    );
}

async fn remove_pod(socket: &Path, container_id: &str, name: &str) {
    let req = RemovePodRequest {
        container_id: container_id.into(),
        netns: common::pods_netns().into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: name.into(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
        }),
        network_name: "flock-test".into(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(10), |mut c| async move {
        c.remove_pod(req).await
    })
    .await
    .unwrap_or_else(|e| panic!("RemovePod {name}: {e}"));
    assert_eq!(
        resp.outcome,
        Outcome::Success as i32,
        "RemovePod {name}: {}",
        resp.message
    );
}

/// The agent's registry view (`/debug/registry`): (address, node) of every endpoint.
fn registry_view(agent: &Agent) -> Vec<(String, String)> {
    let reg = agent.json("/debug/registry");
    let eps: Vec<Value> = match &reg["endpoints"] {
        Value::Object(m) => m.values().cloned().collect(),
        Value::Array(a) => a.clone(),
        other => panic!("/debug/registry endpoints: {other}"),
    };
    eps.iter()
        .map(|e| {
            (
                e["address"].as_str().unwrap_or_default().to_owned(),
                e["node"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// A raw Delta ADS client in the Envoy node group, subscribed to every cluster and
/// every ClusterLoadAssignment; it ACKs each response and keeps the CLAs it holds.
struct EdsWatcher {
    ads: DeltaStream,
    node: Node,
    clas: BTreeMap<String, ClusterLoadAssignment>,
}

impl EdsWatcher {
    async fn connect(target: &str) -> Self {
        let channel = client::connect(target)
            .await
            .expect("connecting to the agent's xDS socket");
        let ads = client::delta(channel).await.expect("opening Delta ADS");
        let node = Node {
            id: "envoy-on-n2".into(),
            cluster: "flock-test".into(),
            user_agent_name: "envoy".into(),
            ..Node::default()
        };
        let watcher = Self {
            ads,
            node,
            clas: BTreeMap::new(),
        };
        for type_url in [CLUSTER, ENDPOINT] {
            watcher.send(type_url, &["*"], "");
        }
        watcher
    }

    fn send(&self, type_url: &str, subscribe: &[&str], nonce: &str) {
        self.ads
            .send(DeltaDiscoveryRequest {
                node: Some(self.node.clone()),
                type_url: type_url.into(),
                resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
                response_nonce: nonce.into(),
                ..DeltaDiscoveryRequest::default()
            })
            .unwrap();
    }

    /// ACKs `resp` and applies it to the held CLAs.
    fn apply(&mut self, resp: DeltaDiscoveryResponse) {
        self.send(&resp.type_url, &[], &resp.nonce);
        if resp.type_url != ENDPOINT {
            return;
        }
        for name in &resp.removed_resources {
            self.clas.remove(name);
        }
        for r in resp.resources {
            let any = r.resource.expect("a resource body");
            let cla = ClusterLoadAssignment::decode(any.value.as_slice())
                .expect("a ClusterLoadAssignment");
            self.clas.insert(r.name, cla);
        }
    }

    /// The endpoints `WEB_CLA` holds: `ip:port` → zone.
    fn web(&self) -> BTreeMap<String, String> {
        let Some(cla) = self.clas.get(WEB_CLA) else {
            return BTreeMap::new();
        };
        let mut out = BTreeMap::new();
        for group in &cla.endpoints {
            let zone = group
                .locality
                .as_ref()
                .map(|l| l.zone.clone())
                .unwrap_or_default();
            for lb in &group.lb_endpoints {
                let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
                    continue;
                };
                let Some(address::Address::SocketAddress(sa)) =
                    ep.address.as_ref().and_then(|a| a.address.as_ref())
                else {
                    continue;
                };
                let port = match sa.port_specifier {
                    Some(socket_address::PortSpecifier::PortValue(p)) => p,
                    _ => 0,
                };
                out.insert(format!("{}:{port}", sa.address), zone.clone());
            }
        }
        out
    }

    /// Receives (and ACKs) responses until `cond` holds on `WEB_CLA`'s endpoints;
    /// returns when the deciding response arrived. Panics after `timeout`.
    async fn until(
        &mut self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Instant {
        let deadline = Instant::now() + timeout;
        loop {
            if cond(&self.web()) {
                return Instant::now();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let resp = self.ads.recv(left).await.unwrap_or_else(|e| {
                panic!(
                    "waiting for {what} in n2's xDS: {e}; {WEB_CLA} holds {:?}",
                    self.web()
                )
            });
            self.apply(resp);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_cross_nodes_through_etcd_expire_with_the_lease_and_come_back() {
    let started = Instant::now();
    let etcd = blocking(Etcd::start);
    let mut n1 = start_node(&etcd, "n1", "z1");
    let n2 = start_node(&etcd, "n2", "z2");
    let mut xds = EdsWatcher::connect(&n2.xds_target()).await;

    // n1's pod reaches n2's xDS (locality z1) and n2's registry view (node n1).
    add_pod(&n1.cni_socket, "c-web-n1", "web-n1", N1_IP).await;
    xds.until("n1's endpoint in zone z1", WAIT, |web| {
        web.get(N1_EP).is_some_and(|z| z == "z1")
    })
    .await;
    blocking(|| {
        wait_for("n2's /debug/registry to list n1's pod", WAIT, || {
            registry_view(&n2).contains(&(N1_IP.into(), "n1".into()))
        })
    });

    // And the other way: n2's pod is in n1's view; n2's xDS has both nodes' endpoints.
    add_pod(&n2.cni_socket, "c-web-n2", "web-n2", N2_IP).await;
    blocking(|| {
        wait_for("n1's /debug/registry to list n2's pod", WAIT, || {
            registry_view(&n1).contains(&(N2_IP.into(), "n2".into()))
        })
    });
    xds.until("both endpoints (z1 and z2)", WAIT, |web| {
        web.get(N1_EP).is_some_and(|z| z == "z1") && web.get(N2_EP).is_some_and(|z| z == "z2")
    })
    .await;

    // kill -9 n1: nobody deletes its endpoint; it goes when the lease expires.
    let killed = Instant::now();
    blocking(|| n1.kill9());
    let gone = xds
        .until(
            "n1's endpoint to expire",
            Duration::from_secs(TTL + 10),
            |web| !web.contains_key(N1_EP),
        )
        .await;
    let expiry = gone - killed;
    println!("n1 SIGKILLed: its endpoint left n2's xDS after {expiry:?} (lease TTL {TTL} s)");
    assert!(
        expiry > Duration::from_millis(500),
        "n1's endpoint left after {expiry:?}: too early for a lease expiry"
    );
    assert!(
        expiry <= Duration::from_secs(TTL + 3),
        "n1's endpoint left after {expiry:?}: later than TTL + 3 s"
    );
    assert!(
        xds.web().contains_key(N2_EP),
        "n2's own endpoint must survive n1's death: {:?}",
        xds.web()
    );
    blocking(|| {
        wait_for("n2's /debug/registry to drop n1's pod", WAIT, || {
            !registry_view(&n2).iter().any(|(_, node)| node == "n1")
        })
    });

    // Restart n1 on the same state dir: it loads the pod and re-registers it.
    let restarted = Instant::now();
    restart_node(&etcd, &mut n1, "n1", "z1");
    let back = xds
        .until("n1's endpoint back after the restart", WAIT, |web| {
            web.get(N1_EP).is_some_and(|z| z == "z1")
        })
        .await;
    let reregistration = back - restarted;
    println!("n1 restarted: its endpoint was back in n2's xDS after {reregistration:?}");
    blocking(|| n1.wait_ready(WAIT));
    assert_eq!(n1.store_files().len(), 1, "n1's store holds its one pod");
    assert!(
        registry_view(&n2).contains(&(N1_IP.into(), "n1".into())),
        "n2's registry view has n1's pod again"
    );

    // RemovePod on n1 deletes the endpoint: gone from n2's xDS well under the TTL.
    let removing = Instant::now();
    remove_pod(&n1.cni_socket, "c-web-n1", "web-n1").await;
    let removed = xds
        .until("n1's endpoint to be deleted", WAIT, |web| {
            !web.contains_key(N1_EP)
        })
        .await;
    let deletion = removed - removing;
    println!("RemovePod on n1: its endpoint left n2's xDS after {deletion:?}");
    assert!(
        deletion < Duration::from_secs(TTL) / 2,
        "a delete must not wait for the lease: took {deletion:?}"
    );
    assert!(xds.web().contains_key(N2_EP), "{:?}", xds.web());
    assert!(
        n1.store_files().is_empty(),
        "n1's store is empty after RemovePod"
    );

    let wall = started.elapsed();
    println!("wall time {wall:?}");
    assert!(wall < Duration::from_secs(40), "took {wall:?}");
}
