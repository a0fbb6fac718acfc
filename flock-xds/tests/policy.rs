//! Traffic policy in the translation: `HTTPRoute` rules become weighted, matched,
//! timed and retried routes for Envoy and proxyless gRPC; bad references are dropped
//! alone; every mesh cluster has circuit breakers; the memo's output equals a fresh
//! translation's when a route changes.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteConfiguration, route, route_action, route_match,
};
use flock_core::route::{HttpRoute, parse};
use flock_xds::cache::check_consistency;
use flock_xds::translate::{self, EnvoyOptions, EnvoyReferences, Flavor, Memo, Mesh, Resource};
use flock_xds::types::{CLUSTER, ROUTE};
use prost::Message;
use std::sync::Arc;

const CALLER: &str = "spiffe://cluster.local/ns/shop/sa/client";

fn mesh(protocol: &str, mtls: bool) -> Mesh {
    let id = |sa: &str| {
        if mtls {
            format!(r#", "identity": "spiffe://cluster.local/ns/shop/sa/{sa}""#)
        } else {
            String::new()
        }
    };
    let svc = |name: &str, ip: &str| {
        format!(
            r#"{{"name": "{name}", "namespace": "shop", "ports": [{{"port": 80, "protocol": "{protocol}"}}],
                "endpoints": [{{"address": "{ip}", "port": 15006{}}}]}}"#,
            id(name)
        )
    };
    let json = format!(
        r#"{{"services": [{}, {}, {}],
             "pods": [{{"name": "client", "namespace": "shop", "ip": "10.0.0.9",
                        "identity": "{CALLER}"}}]}}"#,
        svc("web", "10.0.0.1"),
        svc("web-v1", "10.0.0.2"),
        svc("web-v2", "10.0.0.3"),
    );
    Mesh::from_json(json.as_bytes()).unwrap()
}

fn canary(extra_backend: Option<&str>) -> HttpRoute {
    let mut backends = vec![
        serde_json::json!({ "name": "web-v1", "port": 80, "weight": 90 }),
        serde_json::json!({ "name": "web-v2", "port": 80, "weight": 10 }),
    ];
    if let Some(name) = extra_backend {
        backends.push(serde_json::json!({ "name": name, "port": 80, "weight": 5 }));
    }
    let obj = serde_json::json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": { "name": "web", "namespace": "shop" },
        "spec": {
            "parentRefs": [{ "group": "", "kind": "Service", "name": "web", "port": 80 }],
            "rules": [
                { "matches": [{ "path": { "type": "PathPrefix", "value": "/api" },
                                "headers": [{ "name": "x-canary", "value": "1" }] }],
                  "backendRefs": [{ "name": "web-v2", "port": 80 }] },
                { "backendRefs": backends,
                  "timeouts": { "request": "500ms" },
                  "retry": { "attempts": 3, "codes": [500] } }
            ]
        }
    });
    HttpRoute::from_object(&parse(obj.to_string().as_bytes()).unwrap()).unwrap()
}

fn routed(mut m: Mesh, route: &HttpRoute) -> (Mesh, Vec<translate::policy::RouteProblem>) {
    m.services[0].routes = route.rules_for("web");
    let problems = m.resolve_routes();
    (m, problems)
}

fn find<'a>(rs: &'a [Resource], type_url: &str, name: &str) -> &'a Resource {
    rs.iter()
        .find(|r| r.type_url == type_url && r.name == name)
        .unwrap_or_else(|| panic!("no {type_url} {name}"))
}

fn vhost_routes(rs: &[Resource], config: &str, vhost: &str) -> Vec<Route> {
    let rc = RouteConfiguration::decode(find(rs, ROUTE, config).any.value.as_slice()).unwrap();
    rc.virtual_hosts
        .into_iter()
        .find(|v| v.name == vhost)
        .unwrap()
        .routes
}

fn weighted(r: &Route) -> Vec<(String, u32)> {
    match &r.action {
        Some(route::Action::Route(a)) => match &a.cluster_specifier {
            Some(route_action::ClusterSpecifier::WeightedClusters(w)) => w
                .clusters
                .iter()
                .map(|c| (c.name.clone(), c.weight.as_ref().unwrap().value))
                .collect(),
            Some(route_action::ClusterSpecifier::Cluster(c)) => vec![(c.clone(), 1)],
            other => panic!("{other:?}"),
        },
        other => panic!("not a forwarding route: {other:?}"),
    }
}

#[test]
fn a_canary_route_becomes_matched_and_weighted_routes_ending_in_404() {
    let (m, problems) = routed(mesh("http", false), &canary(None));
    assert!(problems.is_empty(), "{problems:?}");
    m.validate().unwrap();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    let routes = vhost_routes(&rs, "outbound|http", "web.shop:80");
    // The header rule's prefix /api: exact /api and prefix /api/, each split by
    // idempotence (2 x 2); the split rule: idempotent + other; the 404.
    assert_eq!(routes.len(), 7, "{routes:#?}");
    let path = |r: &Route| r.r#match.as_ref().unwrap().path_specifier.clone().unwrap();
    assert_eq!(
        path(&routes[0]),
        route_match::PathSpecifier::Path("/api".into())
    );
    assert!(
        routes[0]
            .r#match
            .as_ref()
            .unwrap()
            .headers
            .iter()
            .any(|h| h.name == "x-canary")
    );
    assert_eq!(
        weighted(&routes[0]),
        vec![("outbound|80|web-v2.shop".to_string(), 1)]
    );
    assert_eq!(
        weighted(&routes[4]),
        vec![
            ("outbound|80|web-v1.shop".to_string(), 90),
            ("outbound|80|web-v2.shop".to_string(), 10)
        ]
    );
    let Some(route::Action::Route(a)) = &routes[4].action else {
        panic!()
    };
    assert_eq!(a.timeout.as_ref().unwrap().nanos, 500_000_000);
    let retry = a.retry_policy.as_ref().unwrap();
    assert_eq!(retry.num_retries.as_ref().unwrap().value, 3);
    assert_eq!(retry.retriable_status_codes, vec![500]);
    assert!(retry.retry_on.contains("retriable-status-codes"));
    // The non-idempotent twin retries only what never reached the app.
    let Some(route::Action::Route(b)) = &routes[5].action else {
        panic!()
    };
    let safe = &b.retry_policy.as_ref().unwrap().retry_on;
    assert!(
        !safe.contains("retriable-status-codes") && !safe.contains("gateway-error"),
        "a non-idempotent request is retried after it reached the app: {safe}"
    );
    match &routes[6].action {
        Some(route::Action::DirectResponse(d)) => assert_eq!(d.status, 404),
        other => panic!("{other:?}"),
    }
    // The backends keep their default routes.
    let v1 = vhost_routes(&rs, "outbound|http", "web-v1.shop:80");
    assert_eq!(
        weighted(&v1[0]),
        vec![("outbound|80|web-v1.shop".to_string(), 1)]
    );
}

#[test]
fn callers_with_an_identity_reach_mtls_backends_through_their_own_clusters() {
    let (m, problems) = routed(mesh("http", true), &canary(None));
    assert!(problems.is_empty(), "{problems:?}");
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let routes = vhost_routes(&rs, &format!("outbound|http|{CALLER}"), "web.shop:80");
    // The clusters exist (the fixture has no secrets, so only these are checked).
    for (name, _) in weighted(&routes[4]) {
        find(&rs, CLUSTER, &name);
    }
    assert_eq!(
        weighted(&routes[4]),
        vec![
            (format!("outbound|80|web-v1.shop|{CALLER}"), 90),
            (format!("outbound|80|web-v2.shop|{CALLER}"), 10)
        ]
    );
}

#[test]
fn a_missing_backend_is_dropped_and_reported_and_the_rest_is_served() {
    let (m, problems) = routed(mesh("http", false), &canary(Some("gone")));
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].message.contains("gone.shop does not exist"),
        "{problems:?}"
    );
    assert_eq!(problems[0].route, "shop/web");
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    let routes = vhost_routes(&rs, "outbound|http", "web.shop:80");
    assert_eq!(weighted(&routes[4]).len(), 2);

    // A rule whose every backend is gone answers 500.
    let mut only_gone = canary(None);
    only_gone.rules = only_gone.rules_for("web");
    only_gone.rules[1].backends.retain(|_| false);
    only_gone.rules[1]
        .backends
        .push(flock_core::route::BackendRef {
            service: "gone".into(),
            namespace: "shop".into(),
            port: 80,
            weight: 1,
            mtls: false,
        });
    let (m, _) = routed(mesh("http", false), &only_gone);
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let routes = vhost_routes(&rs, "outbound|http", "web.shop:80");
    match &routes[4].action {
        Some(route::Action::DirectResponse(d)) => assert_eq!(d.status, 500),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_rule_for_a_port_the_service_lacks_is_invalid_in_the_model_and_dropped_by_resolution() {
    let mut route = canary(None);
    route.rules = route.rules_for("web");
    for r in &mut route.rules {
        r.port = Some(81);
    }
    let mut m = mesh("http", false);
    m.services[0].routes = route.rules.clone();
    let errors = m.validate().unwrap_err();
    assert!(
        errors
            .iter()
            .any(|e| e.path == "services[0].routes[0].port"),
        "{errors:?}"
    );
    let problems = m.resolve_routes();
    assert_eq!(problems.len(), 2);
    assert!(m.services[0].routes.is_empty());
    m.validate().unwrap();
}

#[test]
fn proxyless_grpc_gets_weighted_clusters_header_matches_and_stream_deadlines() {
    let (m, problems) = routed(mesh("grpc", false), &canary(None));
    assert!(problems.is_empty(), "{problems:?}");
    let rs = translate::grpc_resources(&m);
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    let routes = vhost_routes(&rs, "grpc|web.shop:80", "web.shop:80");
    // /api exact and /api/ prefix; the split rule (gRPC: no method split); the 404.
    assert_eq!(routes.len(), 4, "{routes:#?}");
    assert_eq!(weighted(&routes[2]).len(), 2);
    let Some(route::Action::Route(a)) = &routes[2].action else {
        panic!()
    };
    assert!(a.retry_policy.is_none());
    let deadline = a
        .max_stream_duration
        .as_ref()
        .unwrap()
        .max_stream_duration
        .as_ref()
        .unwrap();
    assert_eq!(deadline.nanos, 500_000_000);
}

#[test]
fn every_mesh_cluster_has_circuit_breakers_and_a_retry_budget() {
    let mut m = mesh("http", false);
    m.services[1].pool = Some(translate::policy::ConnectionPool {
        max_connections: 7,
        ..Default::default()
    });
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    for (name, want) in [
        (
            "outbound|80|web.shop",
            translate::policy::DEFAULT_MAX_CONNECTIONS,
        ),
        ("outbound|80|web-v1.shop", 7),
    ] {
        let c = Cluster::decode(find(&rs, CLUSTER, name).any.value.as_slice()).unwrap();
        let t = &c.circuit_breakers.as_ref().unwrap().thresholds[0];
        assert_eq!(t.max_connections.as_ref().unwrap().value, want);
        let budget = t.retry_budget.as_ref().unwrap();
        assert_eq!(budget.budget_percent.as_ref().unwrap().value, 20.0);
    }
}

#[test]
fn the_memo_follows_route_changes_like_a_fresh_translation() {
    let flat = |e: translate::Entries| {
        let mut v: Vec<(String, String, Vec<u8>)> = Vec::new();
        for (ty, list) in e {
            for (name, _, any) in list {
                v.push((ty.to_string(), name.to_string(), any.value.clone()));
            }
        }
        v.sort();
        v
    };
    let opts = EnvoyOptions::default();
    let mut memo = Memo::new(Flavor::Envoy);
    let (base, _) = routed(mesh("http", true), &canary(None));
    let services: Vec<Arc<translate::Service>> =
        base.services.iter().cloned().map(Arc::new).collect();
    let pods: Vec<Arc<translate::Pod>> = base.pods.iter().cloned().map(Arc::new).collect();
    memo.translate_shared(&services, &pods, &base.secrets, &opts);
    for weight in [50, 0, 100] {
        let mut next = base.clone();
        next.services[0].routes[1].backends[1].weight = weight;
        let mut shared = services.clone();
        shared[0] = Arc::new(next.services[0].clone());
        let got = memo
            .translate_shared(&shared, &pods, &next.secrets, &opts)
            .entries();
        assert_eq!(
            flat(got),
            flat(Memo::new(Flavor::Envoy).translate(&next, &opts)),
            "weight {weight}"
        );
    }
}

#[test]
fn a_grpc_port_without_rules_keeps_its_default_route_beside_a_routed_http_port() {
    let mut m = Mesh::from_json(
        br#"{"services": [
          {"name": "web", "namespace": "shop",
           "ports": [{"port": 80, "protocol": "http"}, {"port": 9090, "protocol": "grpc"}],
           "endpoints": [{"address": "10.0.0.1", "port": 15006}]},
          {"name": "web-v1", "namespace": "shop", "ports": [{"port": 80}],
           "endpoints": [{"address": "10.0.0.2", "port": 15006}]},
          {"name": "web-v2", "namespace": "shop", "ports": [{"port": 80}],
           "endpoints": [{"address": "10.0.0.3", "port": 15006}]}]}"#,
    )
    .unwrap();
    m.services[0].routes = canary(None).rules_for("web");
    assert!(m.resolve_routes().is_empty());
    let rs = translate::grpc_resources(&m);
    let routes = vhost_routes(&rs, "grpc|web.shop:9090", "web.shop:9090");
    assert_eq!(routes.len(), 1, "{routes:#?}");
    assert_eq!(
        weighted(&routes[0]),
        vec![("outbound|9090|web.shop".to_string(), 1)]
    );
}

#[test]
fn a_backend_of_another_protocol_is_dropped_and_the_same_backend_twice_keeps_its_share() {
    // web's port 80 is gRPC; web-v1 and web-v2 speak HTTP: both dropped, reported.
    let (m, problems) = routed(mesh("http", false), &canary(None));
    assert!(problems.is_empty());
    let mut grpc_parent = m.clone();
    grpc_parent.services[0].ports[0].protocol = translate::Protocol::Grpc;
    grpc_parent.services[0].routes = canary(None).rules_for("web");
    let problems = grpc_parent.resolve_routes();
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(
        problems[0]
            .message
            .contains("speaks HTTP, the parent's port gRPC"),
        "{problems:?}"
    );

    // The same backend named twice: one weighted entry with both weights.
    let mut twice = canary(None);
    twice.rules = twice.rules_for("web");
    let again = twice.rules[1].backends[0].clone();
    twice.rules[1].backends.push(again);
    let (m, _) = routed(mesh("http", false), &twice);
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let routes = vhost_routes(&rs, "outbound|http", "web.shop:80");
    assert_eq!(
        weighted(&routes[4]),
        vec![
            ("outbound|80|web-v1.shop".to_string(), 180),
            ("outbound|80|web-v2.shop".to_string(), 10)
        ]
    );
}

#[test]
fn hand_written_rules_out_of_bounds_or_unresolved_fail_validation() {
    let (m, _) = routed(mesh("http", true), &canary(None));
    m.validate().unwrap();
    let mut long = m.clone();
    long.services[0].routes[1].timeout_ms = Some(u64::MAX);
    long.services[0].routes[1]
        .retry
        .as_mut()
        .unwrap()
        .codes
        .push(99);
    let errors = long.validate().unwrap_err();
    assert!(
        errors
            .iter()
            .any(|e| e.path == "services[0].routes[1].timeout_ms"),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.path == "services[0].routes[1].retry.codes"),
        "{errors:?}"
    );
    // A stale mtls flag (the backend's port is mTLS) is caught.
    let mut stale = m.clone();
    stale.services[0].routes[1].backends[0].mtls = false;
    let errors = stale.validate().unwrap_err();
    assert!(
        errors
            .iter()
            .any(|e| e.path == "services[0].routes[1].backends[0].mtls"),
        "{errors:?}"
    );
}

#[test]
fn a_captured_callers_chain_for_a_routed_service_follows_its_rules() {
    use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
        HttpConnectionManager, http_connection_manager::RouteSpecifier,
    };
    let (mut m, _) = routed(mesh("http", true), &canary(None));
    m.pods[0].capture = Some(translate::Capture {
        mode: translate::CaptureMode::Strict,
        mark: 1337,
    });
    m.pods[0].netns = Some("/var/run/netns/client".into());
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let l = Listener::decode(
        find(&rs, flock_xds::types::LISTENER, "outbound|shop/client")
            .any
            .value
            .as_slice(),
    );
    let l = l.unwrap();
    let chain = l
        .filter_chains
        .iter()
        .find(|c| c.name == "web.shop:80")
        .unwrap();
    let hcm = chain
        .filters
        .iter()
        .find_map(|f| match &f.config_type {
            Some(filter::ConfigType::TypedConfig(a))
                if a.type_url.ends_with("HttpConnectionManager") =>
            {
                HttpConnectionManager::decode(a.value.as_slice()).ok()
            }
            _ => None,
        })
        .unwrap();
    let Some(RouteSpecifier::RouteConfig(rc)) = hcm.route_specifier else {
        panic!()
    };
    let routes = &rc.virtual_hosts[0].routes;
    assert_eq!(
        weighted(&routes[4]),
        vec![
            (format!("outbound|80|web-v1.shop|{CALLER}"), 90),
            (format!("outbound|80|web-v2.shop|{CALLER}"), 10)
        ]
    );
    match &routes.last().unwrap().action {
        Some(route::Action::DirectResponse(d)) => assert_eq!(d.status, 404),
        other => panic!("{other:?}"),
    }
}
