//! Kube mode in process: the agent over a real pod store and the embedded registry,
//! its pod source (`flock_bird::kube::KubePods`) over real kube reflectors talking HTTP
//! to flock-kube's API-server double. The API server is a double because no Kubernetes
//! control plane can run where this suite runs; it serves the list/watch/get HTTP API
//! kube's client and watcher use, and can be made unreachable.
//!
//! What is checked: identity and ports come from the API (annotations change nothing);
//! a Service created after the pod's ADD registers it without any new CNI call, a
//! label change unregisters it, and the GC leaves memberships of live pods alone; an
//! unreachable API fails the ADD with the message the runtime shows; a pod not opted
//! in is ignored; a sandbox whose pod was re-created under the same name is refused.

use envoy_types::pb::google::protobuf::Any;
use flock_bird::agent::{
    AddPodInput, Agent, AgentConfig, ENVOY_GROUP, PodError, PodOutcome, group_of,
};
use flock_bird::kube::KubePods;
use flock_bird::registry::{self, Registry, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_kube::double::ApiServer;
use flock_kube::watch::{KubeWatch, WatchOptions};
use flock_xds::cache::Cache;
use flock_xds::types::CLUSTER;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

const UID: &str = "0e0c8a4f-0000-4000-8000-00000000000a";
/// A network namespace file that exists on every Linux machine (the agent serves a
/// pod only if its netns exists; no Envoy runs here).
const NETNS: &str = "/proc/self/ns/net";

fn namespace(name: &str, meshed: bool) -> Namespace {
    let labels = if meshed {
        json!({"flock.io/mesh": "enabled"})
    } else {
        json!({})
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": labels}
    }))
    .unwrap()
}

fn pod(ns: &str, name: &str, uid: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels},
        "spec": {
            "nodeName": "n1",
            "serviceAccountName": "web-sa",
            "containers": [{"name": "app", "image": "web",
                "ports": [{"containerPort": 8080, "name": "http"}]}]
        }
    }))
    .unwrap()
}

fn web_service() -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap()
}

fn input(ns: &str, name: &str, uid: &str) -> AddPodInput {
    AddPodInput {
        container_id: format!("ctr-{name}"),
        ifname: "eth0".into(),
        netns: NETNS.into(),
        name: name.into(),
        namespace: ns.into(),
        uid: uid.into(),
        ips: vec!["10.1.0.5/24".into()],
        annotations: BTreeMap::new(),
        network_name: "net".into(),
    }
}

struct Setup {
    api: ApiServer,
    agent: Arc<Agent>,
    _stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let api = ApiServer::start().await;
    api.apply(&namespace("shop", true));
    api.apply(&namespace("plain", false));
    let dir = tempfile::tempdir().unwrap();
    let reg: Arc<dyn Registry> = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "n1".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let watch = Arc::new(KubeWatch::start(
        api.client(),
        WatchOptions {
            node_name: "n1".into(),
            endpoint_slices: false,
        },
    ));
    let mut cfg = AgentConfig::new("n1");
    cfg.refresh_debounce = Duration::from_millis(20);
    cfg.gc_policy.confirm_sweeps = 1;
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let agent = Arc::new(
        Agent::new(cfg, store, reg, cache).with_kube(Arc::new(KubePods::new(
            watch,
            "n1",
            Duration::from_millis(500),
        ))),
    );
    agent.load().await.unwrap();
    let (stop, stop_rx) = watch::channel(false);
    tokio::spawn(Arc::clone(&agent).run_kube_resync(stop_rx));
    Setup {
        api,
        agent,
        _stop: stop,
        _dir: dir,
    }
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after 10 s.
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn endpoint_keys(agent: &Agent) -> Vec<String> {
    agent
        .registry()
        .view()
        .borrow()
        .endpoints
        .keys()
        .cloned()
        .collect()
}

fn clusters(agent: &Agent) -> Vec<String> {
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    snap.state()
        .iter_type(CLUSTER)
        .map(|(n, _)| n.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_from_the_api_and_memberships_follow_services_and_labels() {
    let s = setup().await;
    let agent = &s.agent;
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_until("the reflectors synced (ready)", || {
        agent.not_ready().is_none()
    })
    .await;

    // An annotation claiming another account, service and ports changes nothing.
    let mut req = input("shop", "web-0", UID);
    req.annotations = [
        ("flock.io/service-account".to_string(), "admin".to_string()),
        ("flock.io/service".to_string(), "payments".to_string()),
        ("flock.io/ports".to_string(), "7000".to_string()),
    ]
    .into();
    let out = agent.add_pod(&req).await.unwrap();
    assert!(
        matches!(&out, PodOutcome::Done(m) if m.contains("web-sa")),
        "{out:?}"
    );
    let rec = agent.pods().into_values().next().unwrap();
    assert_eq!(rec.service_account, "web-sa");
    assert_eq!(rec.service, "");
    assert_eq!(
        rec.ports.iter().map(|p| p.app_port).collect::<Vec<_>>(),
        vec![8080]
    );
    // No Service selects it yet: nothing registered.
    assert_eq!(endpoint_keys(agent), Vec::<String>::new());

    // A Service created after the ADD: registered and published, no CNI call.
    s.api.apply(&web_service());
    let key = "n1/shop/web/ctr-web-0/eth0/80";
    wait_until("the membership registered", || {
        endpoint_keys(agent) == vec![key.to_string()]
    })
    .await;
    let ep = agent.registry().view().borrow().endpoints[key].clone();
    assert_eq!((ep.service_port, ep.port), (80, 15006));
    assert_eq!(ep.pod, "shop/web-0");
    wait_until("the Service's cluster published", || {
        clusters(agent).iter().any(|c| c.contains("web.shop"))
    })
    .await;

    // The GC judges by pod key: a live pod's memberships are not orphans.
    for _ in 0..3 {
        agent.gc_sweep(None).await;
    }
    assert_eq!(endpoint_keys(agent), vec![key.to_string()]);

    // A label change takes it out of the Service.
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web-v2"})));
    wait_until("the membership unregistered", || {
        endpoint_keys(agent).is_empty()
    })
    .await;
    wait_until("the Service's cluster withdrawn", || {
        !clusters(agent).iter().any(|c| c.contains("web.shop"))
    })
    .await;

    // Back in: registered again; then CNI DEL leaves nothing.
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_until("the membership registered again", || {
        endpoint_keys(agent) == vec![key.to_string()]
    })
    .await;
    let rec_key = agent.pods().into_keys().next().unwrap();
    assert!(matches!(
        agent.remove_pod(&rec_key).await,
        PodOutcome::Done(_)
    ));
    assert!(endpoint_keys(agent).is_empty());
    assert!(agent.pods().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_api_fails_the_add_and_refuses_to_guess() {
    let s = setup().await;
    wait_until("the reflectors synced (ready)", || {
        s.agent.not_ready().is_none()
    })
    .await;
    s.api.set_unreachable(true);
    // Created while the agent cannot see it: neither the watch nor a GET answers.
    s.api
        .apply(&pod("shop", "web-1", UID, json!({"app": "web"})));
    match s.agent.add_pod(&input("shop", "web-1", UID)).await {
        Err(PodError::Unidentified(m)) => {
            assert!(
                m.starts_with(
                    "cannot identify pod shop/web-1: the Kubernetes API is unreachable ("
                ) && m.ends_with("); refusing to guess its identity"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(s.agent.pods().is_empty());
    assert!(endpoint_keys(&s.agent).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_not_opted_in_is_ignored_and_a_recreated_pods_sandbox_refused() {
    let s = setup().await;
    wait_until("the reflectors synced (ready)", || {
        s.agent.not_ready().is_none()
    })
    .await;
    s.api
        .apply(&pod("plain", "app-0", UID, json!({"app": "web"})));
    match s.agent.add_pod(&input("plain", "app-0", UID)).await {
        Ok(PodOutcome::Ignored(why)) => assert!(why.contains("not meshed"), "{why}"),
        other => panic!("{other:?}"),
    }
    // The API's pod of this name is another one than the runtime's sandbox is for.
    s.api
        .apply(&pod("shop", "web-2", UID, json!({"app": "web"})));
    let old_sandbox = input("shop", "web-2", "99999999-0000-4000-8000-000000000000");
    match s.agent.add_pod(&old_sandbox).await {
        Err(PodError::Unidentified(m)) => assert!(m.contains("re-created"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(s.agent.pods().is_empty());
}

/// An API server that accepts connections and never answers (hung, or a proxy in
/// front of a dead one): the ADD still fails with the reason, and before the CNI
/// plugin's default 5 s timeout would cut it off with a bare "deadline exceeded".
/// (A plain listener, not the double: the double answers or closes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_api_fails_the_add_in_time_with_the_reason() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            open.push(conn);
        }
    });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let watch = Arc::new(KubeWatch::start(
        kube::Client::try_from(config).unwrap(),
        WatchOptions {
            node_name: "n1".into(),
            endpoint_slices: false,
        },
    ));
    let pods = KubePods::new(watch, "n1", Duration::from_secs(1));
    let started = std::time::Instant::now();
    match pods.admit(&input("shop", "web-0", UID)).await {
        Err(PodError::Unidentified(m)) => assert!(
            m.starts_with("cannot identify pod shop/web-0: the Kubernetes API is unreachable (")
                && m.contains("no answer"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(4900),
        "the ADD took {took:?}: the plugin would have given up first"
    );
    held.abort();
}
