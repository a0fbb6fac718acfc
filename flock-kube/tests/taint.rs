//! Removing the startup taint from this node, against the API-server double.
//!
//! Every test here runs against flock-kube's `double` (feature `testing`): an HTTP
//! API-server double on 127.0.0.1, because no Kubernetes API server can run on these
//! machines. The double enforces a merge patch's `metadata.resourceVersion` (409
//! Conflict when stale) as the real API server does.
#![cfg(feature = "testing")]

use flock_kube::double::ApiServer;
use flock_kube::taint::{STARTUP_TAINT_KEY, remove_startup_taint};
use flock_kube::watch::KubeError;
use k8s_openapi::api::core::v1::Node;
use serde_json::json;

fn node(taints: serde_json::Value) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": "node-a", "labels": { "kubernetes.io/hostname": "node-a" } },
        "spec": { "podCIDR": "10.244.1.0/24", "taints": taints },
    }))
    .expect("node fixture")
}

fn ours() -> serde_json::Value {
    json!({ "key": STARTUP_TAINT_KEY, "effect": "NoSchedule" })
}

fn other(key: &str) -> serde_json::Value {
    json!({ "key": key, "value": "true", "effect": "NoExecute" })
}

fn taint_keys(api: &ApiServer) -> Vec<String> {
    let node: Node = api.get(None, "node-a").expect("node-a stored");
    node.spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect()
}

fn patches(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.verb == "patch" && r.resource == "nodes")
        .count()
}

/// Our taint goes, other controllers' taints and the rest of the Node stay; a second
/// call finds nothing to do and writes nothing (API double).
#[tokio::test]
async fn removes_only_the_startup_taint() {
    let api = ApiServer::start().await;
    api.apply(&node(json!([
        other("example.com/maintenance"),
        ours(),
        other("example.com/gpu")
    ])));
    let client = api.client();

    assert!(
        remove_startup_taint(&client, "node-a")
            .await
            .expect("removal")
    );
    assert_eq!(
        taint_keys(&api),
        ["example.com/maintenance", "example.com/gpu"]
    );
    let stored: Node = api.get(None, "node-a").unwrap();
    assert_eq!(
        stored.spec.and_then(|s| s.pod_cidr).as_deref(),
        Some("10.244.1.0/24")
    );
    assert_eq!(
        stored
            .metadata
            .labels
            .and_then(|l| l.get("kubernetes.io/hostname").cloned())
            .as_deref(),
        Some("node-a")
    );
    assert_eq!(patches(&api), 1);

    assert!(
        !remove_startup_taint(&client, "node-a")
            .await
            .expect("second removal")
    );
    assert_eq!(patches(&api), 1, "nothing to remove: no write");
    assert_eq!(
        taint_keys(&api),
        ["example.com/maintenance", "example.com/gpu"]
    );
}

/// Another controller adds a taint between our GET and our PATCH: the PATCH conflicts
/// (409), we re-read, and the final Node has its taint and not ours (API double).
#[tokio::test]
async fn concurrent_modification_is_retried_and_kept() {
    let api = ApiServer::start().await;
    api.apply(&node(json!([ours()])));
    api.write_before_next_patch(&node(json!([ours(), other("example.com/added-meanwhile")])));

    assert!(
        remove_startup_taint(&api.client(), "node-a")
            .await
            .expect("removal")
    );
    assert_eq!(taint_keys(&api), ["example.com/added-meanwhile"]);
    assert_eq!(
        patches(&api),
        2,
        "one conflicting PATCH, one after re-reading"
    );
    let gets = api
        .requests()
        .iter()
        .filter(|r| r.verb == "get" && r.resource == "nodes")
        .count();
    assert_eq!(gets, 2);
}

/// A Node that keeps changing under us ends in a Conflict error, not a blind write
/// (API double).
#[tokio::test]
async fn endless_conflicts_give_up_with_an_error() {
    let api = ApiServer::start().await;
    api.apply(&node(json!([ours()])));
    for i in 0..10 {
        api.write_before_next_patch(&node(json!([ours(), other(&format!("example.com/t{i}"))])));
    }
    match remove_startup_taint(&api.client(), "node-a").await {
        Err(e @ KubeError::Conflict(_)) => {
            assert!(e.to_string().contains("409 Conflict"), "{e}");
            assert!(e.to_string().contains("node-a"), "{e}");
        }
        other => panic!("expected a Conflict error, got {other:?}"),
    }
    assert!(
        taint_keys(&api).contains(&STARTUP_TAINT_KEY.to_string()),
        "our taint was never removed blindly"
    );
}

/// A missing Node is an API error naming the request (API double).
#[tokio::test]
async fn missing_node_is_an_error() {
    let api = ApiServer::start().await;
    match remove_startup_taint(&api.client(), "node-x").await {
        Err(e @ KubeError::Api { .. }) => {
            assert!(e.to_string().starts_with("GET node node-x: "), "{e}");
            let KubeError::Api {
                source: kube::Error::Api(status),
                ..
            } = e
            else {
                panic!("expected an API status");
            };
            assert_eq!(status.code, 404);
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}
