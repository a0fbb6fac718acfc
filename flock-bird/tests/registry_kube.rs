//! `--registry kubernetes` (`registry::kube::KubeRegistry`) against the API-server
//! double.
//!
//! Every test here runs against flock-kube's `double` (feature `testing`): an HTTP
//! API-server double on 127.0.0.1, because no Kubernetes API server runs on these
//! machines. kube's real client and reflectors talk to it over TCP; the registry reads
//! their snapshot. Tests await conditions on the registry's view with a deadline.

use flock_bird::model::{Endpoint, Health};
use flock_bird::registry::kube::KubeRegistry;
use flock_bird::registry::{Registry, View};
use flock_core::registry::Reject;
use flock_kube::double::ApiServer;
use flock_kube::watch::{KubeWatch, WatchOptions};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

const TD: &str = "cluster.local";
const DEADLINE: Duration = Duration::from_secs(30);

fn namespace(name: &str, meshed: bool) -> Namespace {
    let labels = if meshed {
        json!({ "flock.io/mesh": "enabled" })
    } else {
        json!({})
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": { "name": name, "labels": labels },
    }))
    .unwrap()
}

fn node(name: &str, region: &str, zone: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": {
            "topology.kubernetes.io/region": region, "topology.kubernetes.io/zone": zone } },
    }))
    .unwrap()
}

fn service(ns: &str, name: &str, annotations: Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "namespace": ns, "name": name, "annotations": annotations },
        "spec": { "selector": { "app": name }, "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                  "ports": [{ "name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP" }] },
    }))
    .unwrap()
}

fn slice(ns: &str, name: &str, service: &str, endpoints: Value) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "namespace": ns, "name": name,
            "labels": { "kubernetes.io/service-name": service } },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{ "name": "http", "port": 8080, "protocol": "TCP" }],
    }))
    .unwrap()
}

fn ready(ip: &str, node: &str) -> Value {
    json!({ "addresses": [ip], "conditions": { "ready": true }, "nodeName": node })
}

/// A double with nodes `node-a` (region r1, zone z-a) and `node-b` (r1, z-b), a meshed
/// namespace `shop` and a plain one `legacy`; the reflectors and the registry on it.
async fn cluster() -> (ApiServer, KubeWatch, KubeRegistry) {
    let api = ApiServer::start().await;
    api.apply(&namespace("shop", true));
    api.apply(&namespace("legacy", false));
    api.apply(&node("node-a", "r1", "z-a"));
    api.apply(&node("node-b", "r1", "z-b"));
    let watch = KubeWatch::start(
        api.client(),
        WatchOptions {
            node_name: "node-a".into(),
            endpoint_slices: true,
        },
    );
    let registry = KubeRegistry::start(&watch, TD.to_string());
    (api, watch, registry)
}

/// Waits until the registry's view satisfies `cond`; returns it.
async fn until(registry: &KubeRegistry, what: &str, cond: impl Fn(&View) -> bool) -> Arc<View> {
    let mut rx = registry.view();
    let found = tokio::time::timeout(DEADLINE, async {
        loop {
            let view = rx.borrow_and_update().clone();
            if cond(&view) {
                return view;
            }
            rx.changed().await.expect("registry view closed");
        }
    })
    .await;
    match found {
        Ok(v) => v,
        Err(_) => panic!(
            "timed out waiting for {what}; view: {:#?}",
            registry.view().borrow().endpoints
        ),
    }
}

fn of<'a>(view: &'a View, ns: &str, svc: &str) -> Vec<&'a Endpoint> {
    let mut eps: Vec<&Endpoint> = view
        .endpoints
        .values()
        .filter(|e| e.namespace == ns && e.service == svc)
        .map(|e| &**e)
        .collect();
    eps.sort_by_key(|e| e.address);
    eps
}

fn addresses(view: &View, ns: &str, svc: &str) -> Vec<String> {
    of(view, ns, svc)
        .iter()
        .map(|e| e.address.to_string())
        .collect()
}

/// A Service whose endpoints are split across two EndpointSlices is one service with
/// every endpoint of both; conditions give health (ready → healthy, unset → unknown,
/// serving+terminating → draining, not ready → unhealthy); the endpoint's zone wins
/// over its Node's, the region is the Node's; the port is the slice's (the app's).
#[tokio::test]
async fn slices_of_one_service_merge_with_health_and_locality() {
    let (api, _watch, registry) = cluster().await;
    api.apply(&service("shop", "cart", json!({})));
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([ready("10.1.0.1", "node-a"),
               { "addresses": ["10.1.0.2"], "nodeName": "node-b", "zone": "z-x" }]),
    ));
    api.apply(&slice(
        "shop",
        "cart-2",
        "cart",
        json!([{ "addresses": ["10.1.0.3"], "nodeName": "node-b",
                 "conditions": { "ready": false, "serving": true, "terminating": true } },
               { "addresses": ["10.1.0.4"], "nodeName": "node-a",
                 "conditions": { "ready": false } }]),
    ));
    let view = until(&registry, "four cart endpoints", |v| {
        v.synced && of(v, "shop", "cart").len() == 4
    })
    .await;
    let eps = of(&view, "shop", "cart");
    let got: Vec<(String, Health, &str, &str, u16, u16)> = eps
        .iter()
        .map(|e| {
            (
                e.address.to_string(),
                e.health,
                e.region.as_str(),
                e.zone.as_str(),
                e.service_port,
                e.port,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("10.1.0.1".into(), Health::Healthy, "r1", "z-a", 80, 8080),
            ("10.1.0.2".into(), Health::Unknown, "r1", "z-x", 80, 8080),
            ("10.1.0.3".into(), Health::Draining, "r1", "z-b", 80, 8080),
            ("10.1.0.4".into(), Health::Unhealthy, "r1", "z-a", 80, 8080),
        ]
    );
    assert_eq!(registry.describe(), "kubernetes");
    assert!(registry.read_only());

    // Kubernetes is the registry: a put writes nothing, a delete removes nothing.
    let mine = Endpoint {
        address: "10.9.9.9".parse().unwrap(),
        ..eps[0].clone()
    };
    registry.put(&mine).await.unwrap();
    let key = eps[0].key();
    assert!(!registry.delete(&key).await.unwrap());
    let rev = view.endpoints[&key].revision;
    assert!(!registry.delete_if_revision(&key, rev).await.unwrap());
    let now = registry.view().borrow().clone();
    assert!(now.endpoints.contains_key(&key));
    assert!(!now.endpoints.values().any(|e| e.address == mine.address));

    // One slice goes: only its endpoints leave.
    api.delete::<EndpointSlice>(Some("shop"), "cart-2");
    let view = until(&registry, "cart-2's endpoints gone", |v| {
        of(v, "shop", "cart").len() == 2
    })
    .await;
    assert_eq!(addresses(&view, "shop", "cart"), ["10.1.0.1", "10.1.0.2"]);
}

/// Callee identity: a Service in a meshed namespace accepts any account of the
/// namespace (`spiffe://<td>/ns/<ns>/sa/*`), or the exact ID of the account its
/// `flock.io/service-accounts` annotation names; a Service in a namespace that is
/// not meshed is plaintext.
#[tokio::test]
async fn identities_follow_the_mesh_label_and_the_annotation() {
    let (api, _watch, registry) = cluster().await;
    api.apply(&service("shop", "cart", json!({})));
    api.apply(&service(
        "shop",
        "pay",
        json!({ "flock.io/service-accounts": "payments" }),
    ));
    api.apply(&service("legacy", "old", json!({})));
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([ready("10.1.0.1", "node-b")]),
    ));
    api.apply(&slice(
        "shop",
        "pay-1",
        "pay",
        json!([ready("10.1.0.2", "node-b")]),
    ));
    api.apply(&slice(
        "legacy",
        "old-1",
        "old",
        json!([ready("10.2.0.1", "node-b")]),
    ));
    let view = until(&registry, "three services", |v| v.endpoints.len() == 3).await;
    let id = |ns: &str, svc: &str| of(&view, ns, svc)[0].identity.clone();
    assert_eq!(
        id("shop", "cart").as_deref(),
        Some("spiffe://cluster.local/ns/shop/sa/*")
    );
    assert_eq!(
        id("shop", "pay").as_deref(),
        Some("spiffe://cluster.local/ns/shop/sa/payments")
    );
    assert_eq!(id("legacy", "old"), None);

    // The namespace joins the mesh: its Service turns mTLS (never stays plaintext).
    api.apply(&namespace("legacy", true));
    until(&registry, "legacy meshed", |v| {
        of(v, "legacy", "old")
            .first()
            .is_some_and(|e| e.identity.as_deref() == Some("spiffe://cluster.local/ns/legacy/sa/*"))
    })
    .await;
}

/// A Service annotated with two accounts (`web,web-canary`): a slice does not say which
/// account each endpoint runs as, so every endpoint carries both IDs (the first as its
/// identity, the other as `also_accept`), and a caller's mTLS cluster of the Service
/// port accepts exactly those two IDs from each of them, so pods of either account are
/// reachable and no other account of the namespace is.
#[tokio::test]
async fn an_annotation_of_two_accounts_makes_callers_accept_both() {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        UpstreamTlsContext, common_tls_context::ValidationContextType,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    use flock_bird::agent::mesh::{service_models, serving_endpoints};
    use flock_xds::translate::{self, EnvoyOptions, Mesh};
    use prost::Message;

    const WEB: &str = "spiffe://cluster.local/ns/shop/sa/web";
    const CANARY: &str = "spiffe://cluster.local/ns/shop/sa/web-canary";
    const CLIENT: &str = "spiffe://cluster.local/ns/shop/sa/client";
    let (api, _watch, registry) = cluster().await;
    api.apply(&service(
        "shop",
        "web",
        json!({ "flock.io/service-accounts": "web,web-canary" }),
    ));
    api.apply(&slice(
        "shop",
        "web-1",
        "web",
        json!([ready("10.1.0.1", "node-a"), ready("10.1.0.2", "node-b")]),
    ));
    let view = until(&registry, "web", |v| of(v, "shop", "web").len() == 2).await;
    for e in of(&view, "shop", "web") {
        assert_eq!(e.identity.as_deref(), Some(WEB), "{e:?}");
        assert_eq!(e.also_accept, [CANARY], "{e:?}");
    }

    // Through the agent's model into the translation: the caller's cluster.
    let (serving, excluded) = serving_endpoints(&view);
    assert!(excluded.is_empty(), "{excluded:?}");
    let mut mesh = Mesh {
        services: service_models(serving),
        ..Mesh::default()
    };
    mesh.pods.push(translate::Pod {
        name: "client-0".into(),
        namespace: "shop".into(),
        uid: None,
        ip: "10.1.0.9".parse().unwrap(),
        netns: None,
        inbound: Vec::new(),
        outbound_port: 15001,
        identity: Some(CLIENT.into()),
        capture: None,
    });
    mesh.validate().unwrap();
    let rs = translate::envoy_resources(&mesh, &EnvoyOptions::default());
    let name = format!("outbound|80|web.shop|{CLIENT}");
    let cluster = rs
        .iter()
        .find(|r| r.type_url == flock_xds::types::CLUSTER && r.name == name)
        .unwrap_or_else(|| panic!("no cluster {name}"));
    let cluster = Cluster::decode(cluster.any.value.as_slice()).unwrap();
    // Both endpoints carry the same two IDs: one pinned socket accepting both.
    let [pinned] = &cluster.transport_socket_matches[..] else {
        panic!(
            "{name}: {} transport socket matches, expected one",
            cluster.transport_socket_matches.len()
        )
    };
    let Some(ConfigType::TypedConfig(tls)) =
        pinned.transport_socket.clone().and_then(|t| t.config_type)
    else {
        panic!("{name}: no TLS")
    };
    let tls = UpstreamTlsContext::decode(tls.value.as_slice()).unwrap();
    let Some(ValidationContextType::CombinedValidationContext(v)) =
        tls.common_tls_context.unwrap().validation_context_type
    else {
        panic!("{name}: no combined validation context")
    };
    let sans: Vec<MatchPattern> = v
        .default_validation_context
        .unwrap()
        .match_typed_subject_alt_names
        .into_iter()
        .map(|m| m.matcher.unwrap().match_pattern.unwrap())
        .collect();
    assert_eq!(
        sans,
        [
            MatchPattern::Exact(WEB.into()),
            MatchPattern::Exact(CANARY.into())
        ]
    );
}

/// A bad endpoint (an address that is not an IP) is left out alone and counted as a
/// rejection; the good endpoints of its slice stay. Fixing it clears the refusal.
#[tokio::test]
async fn a_bad_endpoint_is_dropped_alone_and_counted() {
    let (api, _watch, registry) = cluster().await;
    api.apply(&service("shop", "cart", json!({})));
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([
            ready("10.1.0.1", "node-b"),
            ready("not-an-ip", "node-b"),
            ready("10.1.0.3", "node-b")
        ]),
    ));
    let view = until(&registry, "the good endpoints", |v| {
        of(v, "shop", "cart").len() == 2
    })
    .await;
    assert_eq!(addresses(&view, "shop", "cart"), ["10.1.0.1", "10.1.0.3"]);
    let rejections = registry.rejections().unwrap();
    assert_eq!(rejections.count(Reject::Address), 1);
    let refused = rejections.refused();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused.keys().next().unwrap().contains("cart-1"),
        "{refused:?}"
    );

    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([
            ready("10.1.0.1", "node-b"),
            ready("10.1.0.2", "node-b"),
            ready("10.1.0.3", "node-b")
        ]),
    ));
    until(&registry, "the fixed endpoint", |v| {
        of(v, "shop", "cart").len() == 3
    })
    .await;
    assert!(rejections.refused().is_empty());
    assert_eq!(rejections.count(Reject::Address), 1, "counted once");
}

/// While the API is unreachable the view keeps the last-known endpoints (still
/// synced: stale, not empty); when it is back, the reflectors re-list and the view
/// follows what changed meanwhile.
#[tokio::test]
async fn an_api_outage_keeps_the_last_known_endpoints_and_resyncs() {
    let (api, watch, registry) = cluster().await;
    api.apply(&service("shop", "cart", json!({})));
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([ready("10.1.0.1", "node-b")]),
    ));
    let before = until(&registry, "cart", |v| v.synced && v.endpoints.len() == 1).await;

    api.set_unreachable(true);
    let mut snapshots = watch.view();
    tokio::time::timeout(DEADLINE, snapshots.wait_for(|s| s.last_error.is_some()))
        .await
        .expect("the watch notices the outage")
        .unwrap();
    let during = registry.view().borrow().clone();
    assert_eq!(
        during.endpoints, before.endpoints,
        "last-known endpoints kept"
    );
    assert!(during.synced);

    // Changed while the API was down (the reflectors did not see it).
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([ready("10.1.0.1", "node-b"), ready("10.1.0.2", "node-b")]),
    ));
    api.set_unreachable(false);
    // A resync after an outage is a new generation (the agent's GC runs then).
    let gen_before = before.generation;
    until(
        &registry,
        "the change made during the outage, in a new generation",
        |v| of(v, "shop", "cart").len() == 2 && v.generation > gen_before,
    )
    .await;
}

/// The agent on the kube registry (and its kube pod source): slice endpoints reach
/// the translation, the Service's ClusterIP is a host name of its port in the outbound
/// routes (`10.96.0.10:80` and bare `10.96.0.10`), and the orphan GC leaves the view
/// alone even for an endpoint on the agent's own node (the EndpointSlice controller's,
/// not the agent's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_serves_slices_with_cluster_ips_and_its_gc_leaves_them() {
    use envoy_types::pb::envoy::config::route::v3::VirtualHost;
    use flock_bird::agent::{Agent, AgentConfig, ENVOY_GROUP, group_of};
    use flock_bird::kube::KubePods;
    use flock_xds::cache::Cache;
    use flock_xds::types::VIRTUAL_HOST;
    use prost::Message;

    let (api, watch, registry) = cluster().await;
    api.apply(&service("shop", "cart", json!({})));
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([ready("10.1.0.1", "node-a"), ready("10.1.0.2", "node-b")]),
    ));
    until(&registry, "cart", |v| v.synced && v.endpoints.len() == 2).await;
    let registry: Arc<dyn Registry> = Arc::new(registry);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = AgentConfig::new("node-a");
    cfg.gc_policy.confirm_sweeps = 1;
    let store = Arc::new(flock_bird::store::PodStore::open(dir.path()).unwrap());
    let cache = Arc::new(Cache::new(group_of));
    let agent = Arc::new(
        Agent::new(cfg, store, Arc::clone(&registry), Arc::clone(&cache)).with_kube(Arc::new(
            KubePods::new(Arc::new(watch), "node-a", Duration::from_millis(500)),
        )),
    );
    agent.load().await.unwrap();
    agent.publish();
    let snap = cache.snapshot(ENVOY_GROUP).unwrap();
    // The agent serves the outbound virtual hosts over VHDS: one resource each.
    let (_, cart) = snap
        .state()
        .iter_type(VIRTUAL_HOST)
        .find(|(n, _)| n.to_string() == "outbound|http/cart.shop:80")
        .expect("cart's virtual host");
    let vh = &VirtualHost::decode(cart.value().value.as_slice()).unwrap();
    for d in ["10.96.0.10:80", "10.96.0.10", "cart.shop:80"] {
        assert!(
            vh.domains.iter().any(|x| x == d),
            "{d} not in {:?}",
            vh.domains
        );
    }

    // Two sweeps (the policy confirms an orphan on the first): nothing removed, the
    // node-a endpoint still in the view.
    assert_eq!(agent.gc_sweep(None).await, 0);
    assert_eq!(agent.gc_sweep(None).await, 0);
    let view = registry.view().borrow().clone();
    assert_eq!(view.endpoints.len(), 2);
    assert!(view.endpoints.values().any(|e| e.node == "node-a"));
    let report = agent.last_gc().unwrap();
    let endpoints = report.kind(flock_core::gc::Kind::Endpoint).unwrap();
    assert_eq!(
        (endpoints.population, endpoints.orphans),
        (0, 0),
        "the view's endpoints are not judged as the agent's: {report:?}"
    );
}

/// A Service the mapping refuses (here a cluster IP that is not an IP) serves nothing
/// and is refused once: later snapshot changes that leave it alone neither count it
/// again nor forget it.
#[tokio::test]
async fn a_bad_service_is_refused_once_and_stays_refused() {
    let (api, _watch, registry) = cluster().await;
    let mut bad = service("shop", "cart", json!({}));
    let spec = bad.spec.as_mut().unwrap();
    spec.cluster_ip = Some("not-an-ip".into());
    spec.cluster_ips = Some(vec!["not-an-ip".into()]);
    api.apply(&bad);
    api.apply(&slice(
        "shop",
        "cart-1",
        "cart",
        json!([ready("10.1.0.1", "node-b")]),
    ));
    api.apply(&service("shop", "pay", json!({})));
    api.apply(&slice(
        "shop",
        "pay-1",
        "pay",
        json!([ready("10.1.0.2", "node-b")]),
    ));
    until(&registry, "pay", |v| of(v, "shop", "pay").len() == 1).await;
    let rejections = registry.rejections().unwrap();
    let refused_cart = |r: &flock_bird::registry::Rejections| {
        r.refused()
            .keys()
            .any(|k| k.contains("services/cart/spec.clusterIPs"))
    };
    assert!(refused_cart(&rejections), "{:?}", rejections.refused());
    let count = rejections.count(Reject::Undecodable);
    assert_eq!(count, 1, "{:?}", rejections.refused());

    // Another change (pay gains an endpoint): cart is still refused, not counted again.
    api.apply(&slice(
        "shop",
        "pay-1",
        "pay",
        json!([ready("10.1.0.2", "node-b"), ready("10.1.0.3", "node-b")]),
    ));
    let view = until(&registry, "pay's second endpoint", |v| {
        of(v, "shop", "pay").len() == 2
    })
    .await;
    assert!(of(&view, "shop", "cart").is_empty());
    assert!(refused_cart(&rejections), "{:?}", rejections.refused());
    assert_eq!(rejections.count(Reject::Undecodable), 1);
}
