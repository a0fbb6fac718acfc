//! The node-scoped reflectors (`KubeWatch`) against the API-server double.
//!
//! Every test here runs against flock-kube's `double` (feature `testing`): an HTTP
//! API-server double on 127.0.0.1, because no Kubernetes API server can run on these
//! machines. kube's real client and watcher talk to it over TCP. Tests await
//! conditions on the published view (or poll the double) with a deadline; none sleeps
//! as synchronization.
#![cfg(feature = "testing")]

use std::sync::Arc;
use std::time::Duration;

use flock_kube::double::ApiServer;
use flock_kube::watch::{KubeWatch, LookupError, Snapshot, WatchOptions};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use serde_json::json;
use tokio::sync::watch;

const NODE: &str = "node-a";
const DEADLINE: Duration = Duration::from_secs(30);

fn pod(ns: &str, name: &str, node: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "namespace": ns, "name": name, "labels": labels },
        "spec": { "nodeName": node, "containers": [{ "name": "app", "image": "app" }] },
    }))
    .expect("pod fixture")
}

fn service(ns: &str, name: &str, selector: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "namespace": ns, "name": name },
        "spec": { "selector": selector, "ports": [{ "port": 80, "targetPort": 8080 }] },
    }))
    .expect("service fixture")
}

fn slice(ns: &str, name: &str, service: &str, ip: &str) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "namespace": ns, "name": name,
            "labels": { "kubernetes.io/service-name": service } },
        "addressType": "IPv4",
        "endpoints": [{ "addresses": [ip], "conditions": { "ready": true }, "nodeName": "node-b" }],
        "ports": [{ "name": "http", "port": 8080, "protocol": "TCP" }],
    }))
    .expect("slice fixture")
}

fn namespace(name: &str) -> Namespace {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": { "name": name, "labels": { "flock.io/mesh": "enabled" } },
    }))
    .expect("namespace fixture")
}

fn node(name: &str, zone: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "topology.kubernetes.io/zone": zone } },
    }))
    .expect("node fixture")
}

/// A double holding namespace `default`, nodes `node-a` and `node-b`.
async fn cluster() -> ApiServer {
    let api = ApiServer::start().await;
    api.apply(&namespace("default"));
    api.apply(&node(NODE, "zone-a"));
    api.apply(&node("node-b", "zone-b"));
    api
}

fn start(api: &ApiServer, endpoint_slices: bool) -> KubeWatch {
    KubeWatch::start(
        api.client(),
        WatchOptions {
            node_name: NODE.into(),
            endpoint_slices,
        },
    )
}

fn summary(s: &Snapshot) -> String {
    format!(
        "synced={} last_error={:?} pods={:?} services={:?} slices={:?} namespaces={:?} nodes={:?}",
        s.synced,
        s.last_error,
        s.pods.keys().collect::<Vec<_>>(),
        s.services.keys().collect::<Vec<_>>(),
        s.slices.keys().collect::<Vec<_>>(),
        s.namespaces.keys().collect::<Vec<_>>(),
        s.nodes.keys().collect::<Vec<_>>(),
    )
}

/// Awaits a snapshot satisfying `cond` (woken by each published snapshot).
async fn until(
    view: &mut watch::Receiver<Arc<Snapshot>>,
    what: &str,
    cond: impl Fn(&Snapshot) -> bool,
) -> Arc<Snapshot> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let current = view.borrow_and_update().clone();
        if cond(&current) {
            return current;
        }
        match tokio::time::timeout_at(deadline, view.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => panic!("view closed while waiting for {what}"),
            Err(_) => panic!(
                "timed out waiting for {what}; last view: {}",
                summary(&current)
            ),
        }
    }
}

/// Polls the double with a deadline (the double publishes no change events).
async fn until_double(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn key(ns: &str, name: &str) -> (String, String) {
    (ns.to_string(), name.to_string())
}

fn pod_names(s: &Snapshot) -> Vec<String> {
    s.pods.keys().map(|(ns, n)| format!("{ns}/{n}")).collect()
}

/// A pod created after the watch started shows up in the view (API double).
#[tokio::test]
async fn pod_created_after_start_appears() {
    let api = cluster().await;
    let kw = start(&api, false);
    let mut view = kw.view();
    let first = until(&mut view, "the first sync", |s| s.synced).await;
    assert!(first.pods.is_empty(), "{}", summary(&first));
    assert_eq!(first.last_error, None);
    assert_eq!(
        first
            .namespaces
            .get("default")
            .and_then(|l| l.get("flock.io/mesh"))
            .map(String::as_str),
        Some("enabled")
    );

    api.apply(&pod("default", "web-1", NODE, json!({ "app": "web" })));
    let s = until(&mut view, "pod web-1", |s| {
        s.pods.contains_key(&key("default", "web-1"))
    })
    .await;
    let p = &s.pods[&key("default", "web-1")];
    assert_eq!(
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(NODE)
    );
}

/// Only this node's pods are watched, and without endpoint slices only this node's
/// Node object (API double).
#[tokio::test]
async fn only_this_nodes_pods_and_node() {
    let api = cluster().await;
    api.apply(&pod("default", "here-1", NODE, json!({})));
    api.apply(&pod("default", "there-1", "node-b", json!({})));
    let kw = start(&api, false);
    let mut view = kw.view();
    let s = until(&mut view, "the first sync", |s| s.synced).await;
    assert_eq!(pod_names(&s), ["default/here-1"]);
    assert_eq!(s.nodes.keys().cloned().collect::<Vec<_>>(), [NODE]);
    assert!(s.slices.is_empty());

    // Later changes are filtered the same way: the other node's new pod never shows,
    // this node's does (and arrives after it, so its absence is observed, not assumed).
    api.apply(&pod("default", "there-2", "node-b", json!({})));
    api.apply(&pod("other", "here-2", NODE, json!({})));
    let s = until(&mut view, "pod other/here-2", |s| {
        s.pods.contains_key(&key("other", "here-2"))
    })
    .await;
    assert_eq!(pod_names(&s), ["default/here-1", "other/here-2"]);

    api.delete::<Pod>(Some("default"), "here-1");
    let s = until(&mut view, "pod here-1 deleted", |s| {
        !s.pods.contains_key(&key("default", "here-1"))
    })
    .await;
    assert_eq!(pod_names(&s), ["other/here-2"]);
}

/// A Service's selector change reaches the view (API double).
#[tokio::test]
async fn service_selector_change_is_seen() {
    let api = cluster().await;
    api.apply(&service("default", "web", json!({ "app": "web" })));
    let kw = start(&api, false);
    let mut view = kw.view();
    let selector = |s: &Snapshot| {
        s.services
            .get(&key("default", "web"))
            .and_then(|svc| svc.spec.as_ref()?.selector.clone())
            .and_then(|sel| sel.get("app").cloned())
    };
    until(&mut view, "service web selecting app=web", |s| {
        s.synced && selector(s).as_deref() == Some("web")
    })
    .await;

    api.apply(&service("default", "web", json!({ "app": "web-v2" })));
    until(&mut view, "service web selecting app=web-v2", |s| {
        selector(s).as_deref() == Some("web-v2")
    })
    .await;
}

/// A Service's endpoints split across two EndpointSlices are both in the view, and all
/// nodes are watched when slices are (API double).
#[tokio::test]
async fn endpoint_slices_split_across_slices() {
    let api = cluster().await;
    api.apply(&slice("default", "web-abc", "web", "10.0.0.1"));
    let kw = start(&api, true);
    let mut view = kw.view();
    let s = until(&mut view, "the first sync", |s| s.synced).await;
    assert_eq!(
        s.nodes.keys().cloned().collect::<Vec<_>>(),
        [NODE, "node-b"]
    );
    assert_eq!(
        s.nodes
            .get("node-b")
            .and_then(|l| l.get("topology.kubernetes.io/zone"))
            .map(String::as_str),
        Some("zone-b")
    );

    api.apply(&slice("default", "web-def", "web", "10.0.0.2"));
    let s = until(&mut view, "both slices of web", |s| s.slices.len() == 2).await;
    let ips: Vec<String> = s
        .slices
        .values()
        .filter(|sl| {
            sl.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/service-name"))
                .map(String::as_str)
                == Some("web")
        })
        .flat_map(|sl| sl.endpoints.iter().flat_map(|e| e.addresses.clone()))
        .collect();
    assert_eq!(ips, ["10.0.0.1", "10.0.0.2"]);

    api.delete::<EndpointSlice>(Some("default"), "web-abc");
    let s = until(&mut view, "slice web-abc gone", |s| s.slices.len() == 1).await;
    assert!(s.slices.contains_key(&key("default", "web-def")));
}

/// A watch resuming from a compacted resourceVersion gets 410 Gone and re-lists: an
/// object deleted while the watch was away disappears, one added appears (API double).
#[tokio::test]
async fn gone_forces_a_relist_that_converges() {
    let api = cluster().await;
    api.apply(&pod("default", "stays", NODE, json!({})));
    api.apply(&pod("default", "deleted-while-away", NODE, json!({})));
    let kw = start(&api, false);
    let mut view = kw.view();
    until(&mut view, "the first sync with two pods", |s| {
        s.synced && s.pods.len() == 2
    })
    .await;
    until_double(
        "the six watches open (pods, services, namespaces, nodes, policies, routes)",
        || api.open_watches() == 6,
    )
    .await;
    let lists_before = kw.stats().lists;

    // The watches fall behind (events held back), the changes happen, the log is
    // compacted, and the streams end cleanly: kube resumes from the old version.
    api.pause_watch_delivery(true);
    api.delete::<Pod>(Some("default"), "deleted-while-away");
    api.apply(&pod("default", "added-while-away", NODE, json!({})));
    api.compact();
    api.end_watches();
    api.pause_watch_delivery(false);

    let s = until(&mut view, "the re-listed pods", |s| {
        pod_names(s) == ["default/added-while-away", "default/stays"] && s.last_error.is_none()
    })
    .await;
    assert!(s.synced);
    assert!(api.gone_answers() >= 1, "no watch was answered 410 Gone");
    assert!(kw.stats().lists > lists_before, "no re-list after 410 Gone");
}

/// Watch connections cut mid-stream are re-established; a change made while they were
/// down and one made after both arrive (API double).
#[tokio::test]
async fn dropped_watch_connections_resume() {
    let api = cluster().await;
    let kw = start(&api, false);
    let mut view = kw.view();
    until(&mut view, "the first sync", |s| s.synced).await;
    until_double(
        "the six watches open (pods, services, namespaces, nodes, policies, routes)",
        || api.open_watches() == 6,
    )
    .await;
    let watches_before = api.requests().iter().filter(|r| r.verb == "watch").count();

    api.drop_watches();
    api.apply(&pod("default", "during-drop", NODE, json!({})));
    until_double("the watches re-opened", || {
        api.open_watches() == 6
            && api.requests().iter().filter(|r| r.verb == "watch").count() >= watches_before + 6
    })
    .await;
    api.apply(&pod("default", "after-drop", NODE, json!({})));
    let s = until(&mut view, "pods during-drop and after-drop", |s| {
        pod_names(s) == ["default/after-drop", "default/during-drop"]
    })
    .await;
    assert!(s.synced);
    assert_eq!(s.last_error, None);
}

/// Watches ended by the server's timeout resume from their resourceVersion without
/// an error or a re-list (API double).
#[tokio::test]
async fn watch_timeouts_resume_without_error() {
    let api = cluster().await;
    api.set_watch_timeout_cap(Some(Duration::from_millis(200)));
    let kw = start(&api, false);
    let mut view = kw.view();
    until(&mut view, "the first sync", |s| s.synced).await;
    let lists = kw.stats().lists;
    until_double("several rounds of timed-out watches", || {
        api.requests().iter().filter(|r| r.verb == "watch").count() >= 12
    })
    .await;
    api.apply(&pod("default", "after-timeouts", NODE, json!({})));
    until(&mut view, "pod after-timeouts", |s| {
        s.pods.contains_key(&key("default", "after-timeouts"))
    })
    .await;
    assert_eq!(kw.stats().errors, 0);
    assert_eq!(
        kw.stats().lists,
        lists,
        "a clean watch end resumes, it does not re-list"
    );
}

/// During an API outage the view keeps the last-known state and says why it may be
/// stale; when the API returns the view resyncs, including changes made meanwhile
/// (API double).
#[tokio::test]
async fn outage_keeps_last_known_state_and_resyncs() {
    let api = cluster().await;
    api.apply(&pod("default", "before", NODE, json!({})));
    let kw = start(&api, false);
    let mut view = kw.view();
    until(&mut view, "the first sync", |s| {
        s.synced && s.pods.len() == 1
    })
    .await;

    api.set_unreachable(true);
    let s = until(&mut view, "the outage noticed", |s| s.last_error.is_some()).await;
    assert_eq!(pod_names(&s), ["default/before"], "last-known state kept");
    assert!(s.synced, "synced stays true through an outage");
    // Changes the agent cannot see yet.
    api.delete::<Pod>(Some("default"), "before");
    api.apply(&pod("default", "during", NODE, json!({})));
    let s = view.borrow().clone();
    assert_eq!(pod_names(&s), ["default/before"]);
    assert!(s.last_error.is_some());

    api.set_unreachable(false);
    let s = until(&mut view, "the resync", |s| {
        s.last_error.is_none() && pod_names(s) == ["default/during"]
    })
    .await;
    assert!(s.synced);
}

/// `pod()` falls back to a direct GET when the reflector lags, and tells NotFound and
/// NotOnThisNode apart (API double).
#[tokio::test]
async fn pod_lookup_falls_back_to_get() {
    let api = cluster().await;
    let kw = start(&api, false);
    let mut view = kw.view();
    until(&mut view, "the first sync", |s| s.synced).await;

    api.pause_watch_delivery(true);
    api.apply(&pod("default", "racing", NODE, json!({})));
    api.apply(&pod("default", "elsewhere", "node-b", json!({})));
    let gets = |api: &ApiServer| {
        api.requests()
            .iter()
            .filter(|r| r.verb == "get" && r.resource == "pods")
            .count()
    };
    assert_eq!(gets(&api), 0);

    let p = kw
        .pod("default", "racing", Duration::from_millis(200))
        .await
        .expect("pod by GET");
    assert_eq!(p.metadata.name.as_deref(), Some("racing"));
    assert!(
        !view.borrow().pods.contains_key(&key("default", "racing")),
        "the reflector really lagged"
    );
    assert_eq!(gets(&api), 1, "found by the direct GET");

    assert_eq!(
        kw.pod("default", "ghost", Duration::from_millis(50)).await,
        Err(LookupError::NotFound {
            pod: "default/ghost".into()
        })
    );
    let err = kw
        .pod("default", "elsewhere", Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        LookupError::NotOnThisNode {
            pod: "default/elsewhere".into(),
            node: Some("node-b".into()),
            this_node: NODE.into()
        }
    );
    assert_eq!(
        err.to_string(),
        "pod default/elsewhere is scheduled on node node-b, not on this node node-a"
    );

    // Once delivered, the reflector answers without a GET.
    api.pause_watch_delivery(false);
    until(&mut view, "pod racing in the view", |s| {
        s.pods.contains_key(&key("default", "racing"))
    })
    .await;
    kw.pod("default", "racing", Duration::ZERO)
        .await
        .expect("pod from the reflector");
    assert_eq!(gets(&api), 3);
}

/// With the API down, `pod()` for a pod the reflector lacks says Unreachable, naming
/// the pod and the cause (API double).
#[tokio::test]
async fn pod_lookup_reports_unreachable_api() {
    let api = cluster().await;
    let kw = start(&api, false);
    let mut view = kw.view();
    until(&mut view, "the first sync", |s| s.synced).await;
    api.set_unreachable(true);
    match kw.pod("default", "web-1", Duration::from_millis(50)).await {
        Err(LookupError::Unreachable(message)) => {
            assert!(message.contains("GET pod default/web-1"), "{message}");
            let shown = LookupError::Unreachable(message).to_string();
            assert!(
                shown.starts_with("Kubernetes API unreachable: GET pod default/web-1"),
                "{shown}"
            );
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
}

/// The double refuses a request without its bearer token, and the kubeconfig it
/// writes gives `flock_kube::watch::client` working credentials (API double).
#[tokio::test]
async fn double_authenticates_and_kubeconfig_works() {
    let api = cluster().await;
    let anonymous = kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
    match Api::<Node>::all(anonymous).list(&Default::default()).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 401),
        other => panic!("expected 401, got {other:?}"),
    }
    assert!(
        api.requests().is_empty(),
        "refused requests are not audited as served"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    api.write_kubeconfig(&path);
    let client = flock_kube::watch::client(Some(&path))
        .await
        .expect("client from kubeconfig");
    let nodes = Api::<Node>::all(client)
        .list(&Default::default())
        .await
        .expect("list nodes");
    assert_eq!(nodes.items.len(), 2);
    let last = api.requests().pop().unwrap();
    assert_eq!(
        (
            last.verb.as_str(),
            last.resource.as_str(),
            last.group.as_str()
        ),
        ("list", "nodes", "")
    );

    match flock_kube::watch::client(Some(&dir.path().join("absent"))).await {
        Err(missing) => assert!(missing.to_string().starts_with("kubeconfig "), "{missing}"),
        Ok(_) => panic!("a client from a kubeconfig that does not exist"),
    }
}

/// The double pages lists (`limit`/`continue`, as kube's watcher requests them),
/// expires continue tokens older than the compaction point with 410, and filters
/// lists by label selector (API double).
#[tokio::test]
async fn double_pages_lists_and_expires_continue_tokens() {
    let api = cluster().await;
    for (i, app) in ["web", "api", "web", "db", "web"].iter().enumerate() {
        let mut svc = service("default", &format!("svc-{i}"), json!({ "app": app }));
        svc.metadata.labels = Some([("app".to_string(), app.to_string())].into());
        api.apply(&svc);
    }
    let services: Api<Service> = Api::all(api.client());
    let mut names = Vec::new();
    let mut params = kube::api::ListParams::default().limit(2);
    let mut pages = 0;
    loop {
        let page = services.list(&params).await.expect("list page");
        pages += 1;
        assert!(page.items.len() <= 2);
        names.extend(page.items.iter().filter_map(|s| s.metadata.name.clone()));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(names, ["svc-0", "svc-1", "svc-2", "svc-3", "svc-4"]);

    let page = services
        .list(&kube::api::ListParams::default().limit(2))
        .await
        .unwrap();
    let token = page.metadata.continue_.expect("a continue token");
    api.apply(&service("default", "svc-5", json!({ "app": "web" })));
    api.compact();
    match services
        .list(
            &kube::api::ListParams::default()
                .limit(2)
                .continue_token(&token),
        )
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"))
        }
        other => panic!("expected 410 Expired, got {other:?}"),
    }

    let not_web = services
        .list(&kube::api::ListParams::default().labels("app!=web"))
        .await
        .unwrap();
    let names: Vec<_> = not_web
        .items
        .iter()
        .filter_map(|s| s.metadata.name.clone())
        .collect();
    // svc-5 has no `app` label: an absent label is `!=` any value, as in Kubernetes.
    assert_eq!(names, ["svc-1", "svc-3", "svc-5"]);
    let bad = services
        .list(&kube::api::ListParams::default().labels("app in (web)"))
        .await;
    assert!(matches!(bad, Err(kube::Error::Api(s)) if s.code == 400));
}

/// With `FLOCK_KUBE_AUDIT_DIR` set, the double appends one JSON line per request,
/// verbs named as RBAC names them (API double). The variable is read when a double
/// starts, so the requests are made in a child run of this test binary (setting the
/// environment of this multi-threaded process is not sound).
#[tokio::test]
async fn double_writes_the_audit_jsonl() {
    if std::env::var_os("FLOCK_KUBE_AUDIT_CHILD").is_some() {
        let api = cluster().await;
        let pods: Api<Pod> = Api::namespaced(api.client(), "default");
        let _ = pods.get_opt("web-1").await.expect("get pod");
        let nodes: Api<Node> = Api::all(api.client());
        nodes.list(&Default::default()).await.expect("list nodes");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "double_writes_the_audit_jsonl",
            "--test-threads=1",
        ])
        .env("FLOCK_KUBE_AUDIT_CHILD", "1")
        .env("FLOCK_KUBE_AUDIT_DIR", dir.path())
        .output()
        .expect("run the child test");
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.ends_with(".jsonl") && name.contains('-'), "{name}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&files[0])
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines,
        [
            json!({ "verb": "get", "group": "", "resource": "pods", "namespace": "default", "subresource": null }),
            json!({ "verb": "list", "group": "", "resource": "nodes", "namespace": null, "subresource": null }),
        ]
    );
}

/// The double answers kube's streaming-list watcher (`sendInitialEvents=true`): the
/// current objects, then the initial-events-end bookmark, then live changes; and a
/// plain watch with `allowWatchBookmarks` gets BOOKMARKs at the current version (API
/// double).
#[tokio::test]
async fn double_serves_streaming_lists_and_bookmarks() {
    use futures::{StreamExt, TryStreamExt};
    use kube::api::{WatchEvent, WatchParams};
    use kube::runtime::watcher;

    let api = cluster().await;
    api.apply(&pod("default", "here", NODE, json!({})));
    api.apply(&pod("default", "there", "node-b", json!({})));
    let pods: Api<Pod> = Api::all(api.client());
    let config = watcher::Config::default()
        .streaming_lists()
        .fields(&format!("spec.nodeName={NODE}"));
    let mut events = watcher::watcher(pods.clone(), config).boxed();
    let mut initial = Vec::new();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let ev = tokio::time::timeout_at(deadline, events.try_next())
            .await
            .expect("streaming list within the deadline")
            .expect("watcher event")
            .expect("stream open");
        match ev {
            watcher::Event::Init => {}
            watcher::Event::InitApply(p) => initial.push(p.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?} before InitDone"),
        }
    }
    assert_eq!(initial, ["here"]);
    api.apply(&pod("default", "later", NODE, json!({})));
    match tokio::time::timeout_at(deadline, events.try_next()).await {
        Ok(Ok(Some(watcher::Event::Apply(p)))) => {
            assert_eq!(p.metadata.name.as_deref(), Some("later"))
        }
        other => panic!("expected pod later, got {other:?}"),
    }

    let rv = api.resource_version().to_string();
    let mut raw = pods
        .watch(
            &WatchParams::default().fields(&format!("spec.nodeName={NODE}")),
            &rv,
        )
        .await
        .expect("watch")
        .boxed();
    match tokio::time::timeout_at(deadline, raw.next()).await {
        Ok(Some(Ok(WatchEvent::Bookmark(b)))) => assert_eq!(b.metadata.resource_version, rv),
        other => panic!("expected a bookmark, got {other:?}"),
    }
}

fn policy(
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> flock_kube::policy::AuthorizationPolicy {
    serde_json::from_value(json!({
        "apiVersion": "flock.io/v1alpha1", "kind": "AuthorizationPolicy",
        "metadata": { "name": name, "namespace": ns },
        "spec": spec,
    }))
    .expect("policy fixture")
}

/// AuthorizationPolicy objects (flock.io/v1alpha1) reach the snapshot, their changes
/// and deletions too; the spec arrives as written (unknown fields kept, for the agent
/// to refuse).
#[tokio::test]
async fn authorization_policies_are_watched() {
    let api = cluster().await;
    api.apply(&policy(
        "default",
        "web",
        json!({"service": "web", "default": "deny"}),
    ));
    let watch = start(&api, false);
    let mut view = watch.view();
    until(&mut view, "the policy listed", |s| {
        s.synced && s.policies.contains_key(&("default".into(), "web".into()))
    })
    .await;
    api.apply(&policy(
        "default",
        "web",
        json!({"service": "web", "frm": {}}),
    ));
    let s = until(&mut view, "the change watched", |s| {
        s.policies
            .get(&("default".into(), "web".into()))
            .is_some_and(|p| p.spec.get("frm").is_some())
    })
    .await;
    assert_eq!(s.policies.len(), 1);
    assert!(api.delete::<flock_kube::policy::AuthorizationPolicy>(Some("default"), "web"));
    until(&mut view, "the deletion watched", |s| s.policies.is_empty()).await;
}

/// A cluster without the AuthorizationPolicy CRD answers its list with 404: the view
/// still syncs (no policies) and carries no error; installing the CRD later is picked
/// up by the retry.
#[tokio::test]
async fn a_cluster_without_the_policy_crd_syncs_with_no_policies() {
    let api = cluster().await;
    api.set_policy_crd_installed(false);
    api.apply(&policy("default", "web", json!({"default": "deny"})));
    let watch = start(&api, false);
    let mut view = watch.view();
    let s = until(&mut view, "synced without the CRD", |s| s.synced).await;
    assert!(s.policies.is_empty(), "{:?}", s.policies);
    assert_eq!(s.last_error, None);
    api.set_policy_crd_installed(true);
    until(&mut view, "the policy listed once the CRD is there", |s| {
        s.synced && s.policies.len() == 1 && s.last_error.is_none()
    })
    .await;
}
