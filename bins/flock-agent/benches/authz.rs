//! The agent's cost per authorization policy change, printed as plain numbers: the
//! in-process agent (memory registry) with 100 local pods (services `svc-0` to
//! `svc-99`, one HTTP port each) holds 10, 100 or 1,000 policies (services `svc-0`
//! to `svc-<n-1>`: a cluster's policies, most for services with no pod on this node);
//! one policy of a local pod's service changes, and `Agent::set_policy` puts it in
//! the core and publishes both node groups (the governed pod's model re-derived, its
//! listeners re-translated and encoded, the snapshot's new version built). 1,000 changes
//! per size (1,000); p50 and p99.
//!
//! Each size runs twice: the agent as it is, then the baseline that rebuilds the
//! whole mesh and its translation on every publish (`publish_from_scratch`). The
//! ratio to compare is p50 at 1,000 policies over p50 at 10 (flat: ≤ 1.5).
//!
//! ```sh
//! cargo bench -p flock-agent --bench authz
//! ```

use flock_bird::agent::{AddPodInput, Agent, AgentConfig, group_of};
use flock_bird::registry::{self, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_core::authz::{Sourced, Target};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

const LOCAL_PODS: usize = 100;
const CHANGES: usize = 1_000;

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn target(i: usize) -> Target {
    Target {
        namespace: "default".into(),
        service: Some(format!("svc-{i}")),
    }
}

/// Service `i`'s policy, generation `g` (each generation a different path).
fn policy(i: usize, g: usize) -> Sourced {
    let text = format!(
        r#"{{"default":"deny","rules":[{{"action":"allow","from":{{"serviceAccounts":["default/client-{i}"]}},
            "to":{{"methods":["GET"],"paths":["/api/v{g}/*"]}}}}]}}"#
    );
    Sourced::read(
        format!("bench/{}", target(i).file_name()),
        &target(i),
        text.as_bytes(),
    )
}

/// p50 and p99 of one policy change, in ms, with `policies` policies in force.
async fn per_change(policies: usize, from_scratch: bool) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let reg = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "bench".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache = Arc::new(flock_xds::cache::Cache::new(group_of));
    let mut cfg = AgentConfig::new("bench");
    cfg.publish_from_scratch = from_scratch;
    // As flock-agent runs it: each policed port also streams its denials to the agent.
    cfg.denial_log_cluster = Some(flock_bird::runtime::XDS_CLUSTER.to_string());
    let agent = Arc::new(Agent::new(cfg, store, Arc::clone(&reg), cache));
    agent.load().await.unwrap();
    for i in 0..LOCAL_PODS {
        let input = AddPodInput {
            container_id: format!("p{i}"),
            ifname: "eth0".into(),
            netns: "/proc/self/ns/net".into(),
            name: format!("p{i}"),
            namespace: "default".into(),
            uid: String::new(),
            ips: vec![format!("10.100.{}.{}/8", i / 256, i % 256)],
            gateways: Vec::new(),
            annotations: BTreeMap::from([
                ("flock.io/service".to_string(), format!("svc-{i}")),
                ("flock.io/ports".to_string(), "8080/http".to_string()),
            ]),
            network_name: "net".into(),
        };
        agent.add_pod(&input).await.unwrap();
    }
    for i in 0..policies {
        agent.set_policy(&target(i), Some(policy(i, 0)));
    }
    agent.publish();
    let mut samples = Vec::with_capacity(CHANGES);
    for round in 0..CHANGES {
        // A local pod's service, a new generation of its policy.
        let i = (round * 7) % policies.min(LOCAL_PODS);
        let p = policy(i, round + 1);
        let t = Instant::now();
        assert!(agent.set_policy(&target(i), Some(p)));
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    (pct(&samples, 0.5), pct(&samples, 0.99))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    for from_scratch in [false, true] {
        let label = if from_scratch {
            "baseline (full rebuild per publish)"
        } else {
            "flock"
        };
        let mut p50s = Vec::new();
        for n in [10, 100, 1_000] {
            let (p50, p99) = per_change(n, from_scratch).await;
            println!(
                "{label}: one policy change with {n} policies, {LOCAL_PODS} local pods: p50 {p50:.3} ms, p99 {p99:.3} ms ({CHANGES} changes)"
            );
            p50s.push(p50);
        }
        println!(
            "{label}: p50 ratio 1,000 / 10 policies: {:.2}",
            p50s[2] / p50s[0]
        );
    }
}
