//! Authorization policies in the agent, in process (a real pod store in a tempdir, the
//! embedded registry): a policy change re-translates only the pods it governs, and the
//! published listener carries the RBAC filters; a policy file that does not parse is
//! refused for the target its name gives.

mod common;

use common::input;
use envoy_types::pb::google::protobuf::Any;
use flock_bird::agent::{Agent, AgentConfig, ENVOY_GROUP, group_of};
use flock_bird::registry::{self, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_core::authz::{Sourced, Target};
use flock_core::resources::diff;
use flock_xds::cache::Cache;
use flock_xds::types::LISTENER;
use std::sync::Arc;

async fn agent(dir: &std::path::Path) -> Arc<Agent> {
    let reg = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "n1".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let store = Arc::new(PodStore::open(dir).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let agent = Arc::new(Agent::new(AgentConfig::new("n1"), store, reg, cache));
    agent.load().await.unwrap();
    agent
}

/// The Envoy group's listener names that changed (added, changed, removed) between two
/// snapshots, and the version moved.
fn changed_listeners(agent: &Agent, prev: &flock_core::resources::ResourceSet<Any>) -> Vec<String> {
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    let d = diff(prev, snap.state());
    let mut out = Vec::new();
    for (t, td) in &d.types {
        assert_eq!(
            t.as_ref(),
            LISTENER,
            "a policy change touches listeners only: {d:?}"
        );
        out.extend(
            td.added
                .iter()
                .chain(&td.changed)
                .chain(&td.removed)
                .map(|n| n.to_string()),
        );
    }
    out
}

fn state(agent: &Agent) -> flock_core::resources::ResourceSet<Any> {
    agent.cache().snapshot(ENVOY_GROUP).unwrap().state().clone()
}

fn target(ns: &str, svc: Option<&str>) -> Target {
    Target {
        namespace: ns.into(),
        service: svc.map(str::to_string),
    }
}

fn written(t: &Target, body: &str) -> Sourced {
    Sourced::read(format!("test/{}", t.file_name()), t, body.as_bytes())
}

#[tokio::test]
async fn a_policy_change_retranslates_only_the_pods_it_governs() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(dir.path()).await;
    for (id, svc) in [("c1", "web"), ("c2", "api"), ("c3", "db")] {
        let mut pod = input(id, Some(svc), "8080/http");
        pod.ips = vec![format!("10.1.0.{}/24", id[1..].parse::<u8>().unwrap() + 10)];
        agent.add_pod(&pod).await.unwrap();
    }
    agent.publish();

    // A service's policy: its one pod's inbound listener, nothing else.
    let before = state(&agent);
    let web = target("default", Some("web"));
    assert!(agent.set_policy(&web, Some(written(&web, r#"{"default":"deny"}"#))));
    assert_eq!(
        changed_listeners(&agent, &before),
        ["inbound|default/pod-c1|8080"],
        "the policy did not reach the one pod it governs"
    );
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    let (_, listener) = snap
        .state()
        .iter_type(LISTENER)
        .find(|(n, _)| n.as_ref() == "inbound|default/pod-c1|8080")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&listener.value().value).contains("envoy.filters.http.rbac"),
        "the listener carries the RBAC filter"
    );

    // The same policy read again (a resync, a rewrite with equal content): nothing.
    let before = state(&agent);
    let version = agent.cache().snapshot(ENVOY_GROUP).unwrap().version();
    assert!(!agent.set_policy(&web, Some(written(&web, r#"{"default":"deny"}"#))));
    assert_eq!(
        agent.cache().snapshot(ENVOY_GROUP).unwrap().version(),
        version
    );
    assert!(changed_listeners(&agent, &before).is_empty());

    // A policy of a service with no pod here: nothing to re-translate.
    let other = target("default", Some("billing"));
    let before = state(&agent);
    assert!(agent.set_policy(&other, Some(written(&other, r#"{"default":"deny"}"#))));
    assert!(changed_listeners(&agent, &before).is_empty());

    // The namespace's policy governs every pod of it; web's own default (deny)
    // replaces the namespace's, so web's listener is the same as before.
    let ns = target("default", None);
    let before = state(&agent);
    assert!(agent.set_policy(&ns, Some(written(&ns, r#"{"default":"same-namespace"}"#))));
    let mut changed = changed_listeners(&agent, &before);
    changed.sort();
    assert_eq!(
        changed,
        ["inbound|default/pod-c2|8080", "inbound|default/pod-c3|8080"]
    );

    // A malformed service policy is refused for its target (its pod denies all) and
    // named by the agent; removing it restores the namespace's policy alone.
    let before = state(&agent);
    let bad = written(&web, r#"{"rules":[{"action":"allow","frm":{}}]}"#);
    assert!(bad.written.is_err());
    assert!(agent.set_policy(&web, Some(bad)));
    assert_eq!(
        changed_listeners(&agent, &before),
        ["inbound|default/pod-c1|8080"]
    );
    let refused: Vec<_> = agent
        .policies()
        .into_iter()
        .filter(|(_, p)| p.written.is_err())
        .map(|(t, _)| t)
        .collect();
    assert_eq!(refused, std::slice::from_ref(&web));
    let before = state(&agent);
    assert!(agent.set_policy(&web, None));
    assert_eq!(
        changed_listeners(&agent, &before),
        ["inbound|default/pod-c1|8080"]
    );
}

/// The directory source: a file per target, names that give none ignored, a file that
/// does not parse refused for its name's target, a removed file's policy removed.
#[tokio::test]
async fn the_directory_is_read_into_the_core() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(dir.path()).await;
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(policies.path().join("shop.json"), r#"{"default":"deny"}"#).unwrap();
    std::fs::write(policies.path().join("shop.web.json"), "{not json").unwrap();
    std::fs::write(policies.path().join("README.txt"), "notes").unwrap();
    std::fs::write(policies.path().join(".shop.api.json.swp"), "x").unwrap();
    let ignored = flock_bird::agent::policies::resync_dir(&agent, policies.path());
    assert_eq!(ignored, ["README.txt"]);
    let held: Vec<(String, bool)> = agent
        .policies()
        .into_iter()
        .map(|(t, p)| (t.to_string(), p.written.is_ok()))
        .collect();
    assert_eq!(
        held,
        [("shop".to_string(), true), ("shop/web".to_string(), false)]
    );
    std::fs::remove_file(policies.path().join("shop.web.json")).unwrap();
    flock_bird::agent::policies::resync_dir(&agent, policies.path());
    assert_eq!(agent.policies().len(), 1);
    // An unreadable directory keeps what is in force (dropping it would open every
    // service).
    drop(policies);
    let gone = dir.path().join("no-such-dir");
    flock_bird::agent::policies::resync_dir(&agent, &gone);
    assert_eq!(agent.policies().len(), 1);
}
