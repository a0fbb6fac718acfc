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
            subset: Default::default(),
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

/// A translation's entries as sorted (type, name, bytes): two are equal when they
/// hold the same resources.
fn flat(e: translate::Entries) -> Vec<(String, String, Vec<u8>)> {
    let mut v: Vec<(String, String, Vec<u8>)> = Vec::new();
    for (ty, list) in e {
        for (name, _, any) in list {
            v.push((ty.to_string(), name.to_string(), any.value.clone()));
        }
    }
    v.sort();
    v
}

#[test]
fn the_memo_follows_route_changes_like_a_fresh_translation() {
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

/// A Service `shop` whose endpoints carry `version` labels (two v1, one v2, one
/// without), and a route on it splitting 80/20 over the subsets v1 and v2 of itself.
fn subset_mesh(protocol: &str, mtls: bool) -> Mesh {
    let id = if mtls {
        r#", "identity": "spiffe://cluster.local/ns/shop/sa/shop""#
    } else {
        ""
    };
    let ep = |ip: &str, labels: &str| {
        format!(r#"{{"address": "{ip}", "port": 15006, "labels": {labels}{id}}}"#)
    };
    let json = format!(
        r#"{{"services": [{{"name": "shop", "namespace": "shop",
                             "ports": [{{"port": 80, "protocol": "{protocol}"}}],
                             "endpoints": [{}, {}, {}, {}]}}],
             "pods": [{{"name": "client", "namespace": "shop", "ip": "10.0.0.9",
                        "identity": "{CALLER}"}}]}}"#,
        ep("10.0.1.1", r#"{"version": "v1"}"#),
        ep("10.0.1.2", r#"{"version": "v1", "track": "stable"}"#),
        ep("10.0.1.3", r#"{"version": "v2"}"#),
        ep("10.0.1.4", "{}"),
    );
    let mut m = Mesh::from_json(json.as_bytes()).unwrap();
    let obj = serde_json::json!({
        "metadata": { "name": "shop", "namespace": "shop", "annotations": {
            "flock.io/subsets": r#"{"v1": {"service": "shop", "labels": {"version": "v1"}},
                                   "v2": {"service": "shop", "labels": {"version": "v2"}},
                                   "v3": {"service": "shop", "labels": {"version": "v3"}}}"# } },
        "spec": {
            "parentRefs": [{ "kind": "Service", "name": "shop", "port": 80 }],
            "rules": [
                { "matches": [{ "headers": [{ "name": "x-canary", "value": "1" }] }],
                  "backendRefs": [{ "group": "flock.io", "kind": "ServiceSubset", "name": "v2", "port": 80 }] },
                { "backendRefs": [
                    { "group": "flock.io", "kind": "ServiceSubset", "name": "v1", "port": 80, "weight": 80 },
                    { "group": "flock.io", "kind": "ServiceSubset", "name": "v2", "port": 80, "weight": 20 },
                    { "group": "flock.io", "kind": "ServiceSubset", "name": "v3", "port": 80, "weight": 5 }] }
            ]
        }
    });
    let route = HttpRoute::from_object(&parse(obj.to_string().as_bytes()).unwrap()).unwrap();
    m.services[0].routes = route.rules_for("shop");
    m
}

fn cla_addresses(rs: &[Resource], name: &str) -> Vec<String> {
    use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
    let cla = ClusterLoadAssignment::decode(
        find(rs, flock_xds::types::ENDPOINT, name)
            .any
            .value
            .as_slice(),
    )
    .unwrap();
    let mut out: Vec<String> = cla
        .endpoints
        .iter()
        .flat_map(|g| &g.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => {
                match ep.address.as_ref()?.address.as_ref()? {
                    envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(
                        sa,
                    ) => Some(sa.address.clone()),
                    _ => None,
                }
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}

#[test]
fn subsets_route_to_clusters_of_the_endpoints_that_carry_their_labels() {
    let mut m = subset_mesh("http", false);
    let problems = m.resolve_routes();
    // v3 selects no endpoint: dropped from its rule and reported, the rest served.
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0]
            .message
            .contains("subset version=v3 has no endpoints"),
        "{problems:?}"
    );
    m.validate().unwrap();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    assert_eq!(
        cla_addresses(&rs, "outbound|80|shop~version=v1.shop"),
        ["10.0.1.1", "10.0.1.2"]
    );
    assert_eq!(
        cla_addresses(&rs, "outbound|80|shop~version=v2.shop"),
        ["10.0.1.3"]
    );
    // The Service itself keeps every endpoint.
    assert_eq!(cla_addresses(&rs, "outbound|80|shop.shop").len(), 4);
    let routes = vhost_routes(&rs, "outbound|http", "shop.shop:80");
    // x-canary (idempotent and other methods), the split (both), the 404.
    assert_eq!(
        weighted(&routes[0]),
        [("outbound|80|shop~version=v2.shop".to_string(), 1)]
    );
    assert_eq!(
        weighted(&routes[2]),
        [
            ("outbound|80|shop~version=v1.shop".to_string(), 80),
            ("outbound|80|shop~version=v2.shop".to_string(), 20)
        ]
    );
    // A subset has no host names of its own: no virtual host, no domain.
    let rc =
        RouteConfiguration::decode(find(&rs, ROUTE, "outbound|http").any.value.as_slice()).unwrap();
    assert_eq!(rc.virtual_hosts.len(), 1, "{:?}", rc.virtual_hosts);
    // The same for proxyless gRPC: clusters, no listener or route configuration.
    let mut m = subset_mesh("grpc", false);
    m.resolve_routes();
    let rs = translate::grpc_resources(&m);
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    assert_eq!(
        cla_addresses(&rs, "outbound|80|shop~version=v2.shop"),
        ["10.0.1.3"]
    );
    assert!(
        rs.iter()
            .filter(|r| r.type_url != CLUSTER && r.type_url != flock_xds::types::ENDPOINT)
            .all(|r| !r.name.contains('~')),
        "{:?}",
        rs.iter().map(|r| &r.name).collect::<Vec<_>>()
    );
    let routes = vhost_routes(&rs, "grpc|shop.shop:80", "shop.shop:80");
    assert_eq!(weighted(&routes[1]).len(), 2, "{routes:#?}");
}

#[test]
fn callers_with_an_identity_reach_a_subset_over_its_own_mtls_cluster() {
    let mut m = subset_mesh("http", true);
    m.resolve_routes();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    // The fixture has no secrets: the clusters' references to them are not checked.
    let routes = vhost_routes(&rs, &format!("outbound|http|{CALLER}"), "shop.shop:80");
    assert_eq!(
        weighted(&routes[2]),
        [
            (format!("outbound|80|shop~version=v1.shop|{CALLER}"), 80),
            (format!("outbound|80|shop~version=v2.shop|{CALLER}"), 20)
        ]
    );
    assert_eq!(
        cla_addresses(&rs, &format!("outbound|80|shop~version=v2.shop|{CALLER}")),
        ["10.0.1.3"]
    );
}

#[test]
fn the_memo_follows_a_subset_like_a_fresh_translation() {
    let opts = EnvoyOptions::default();
    let mut memo = Memo::new(Flavor::Envoy);
    let mut m = subset_mesh("http", false);
    m.resolve_routes();
    assert_eq!(
        flat(memo.translate(&m, &opts)),
        flat(Memo::new(Flavor::Envoy).translate(&m, &opts))
    );
    // An endpoint of the Service turns v3: the subset v3 appears, its backend with it.
    let mut m = subset_mesh("http", false);
    m.services[0].endpoints[3].labels = flock_core::labels::parse("version=v3").unwrap();
    assert!(m.resolve_routes().is_empty());
    assert_eq!(
        flat(memo.translate(&m, &opts)),
        flat(Memo::new(Flavor::Envoy).translate(&m, &opts))
    );
    assert_eq!(
        cla_addresses(
            &translate::envoy_resources(&m, &opts),
            "outbound|80|shop~version=v3.shop"
        ),
        ["10.0.1.4"]
    );
}

#[test]
fn a_subset_service_with_a_malformed_selector_fails_validation() {
    let mut m = subset_mesh("http", false);
    m.resolve_routes();
    let subset = m
        .services
        .iter()
        .position(|s| s.subset_of().is_some())
        .unwrap();
    for bad in [
        "shop~",
        "shop~version",
        "shop~version=v2,a=b",
        "Shop~version=v2",
    ] {
        let mut m = m.clone();
        m.services[subset].name = bad.to_string();
        assert!(m.validate().is_err(), "{bad} validated");
    }
    let mut m = m.clone();
    m.services[subset].vips = vec!["10.96.0.1".parse().unwrap()];
    assert!(m.validate().is_err(), "a subset with a VIP validated");
}

#[test]
fn resolving_again_forgets_a_subset_whose_endpoints_are_gone() {
    let mut m = subset_mesh("http", false);
    assert_eq!(m.resolve_routes().len(), 1); // v3
    assert!(m.services.iter().any(|s| s.name == "shop~version=v2"));
    // The v2 pod is relabelled v3: v2 is gone, v3 appears.
    m.services[0].endpoints[2].labels = flock_core::labels::parse("version=v3").unwrap();
    m.services[0].routes = subset_mesh("http", false).services[0].routes.clone();
    let problems = m.resolve_routes();
    assert!(
        !m.services.iter().any(|s| s.name == "shop~version=v2"),
        "a stale subset was kept"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.message.contains("subset version=v2")),
        "{problems:?}"
    );
    m.validate().unwrap();
    // The validator names a subset backend whose subset service is missing.
    let mut broken = m.clone();
    broken.services.retain(|s| s.name != "shop~version=v3");
    let errors = broken.validate().unwrap_err();
    assert!(
        errors.iter().any(|e| e
            .to_string()
            .contains("shop~version=v3.shop has no HTTP or gRPC port")),
        "{errors:?}"
    );
}

#[test]
fn a_subset_of_an_mtls_port_never_takes_an_endpoint_without_an_identity() {
    let mut m = subset_mesh("http", true);
    // An identity-less endpoint labelled v2: the port is mTLS, so it serves no one.
    let mut plain = m.services[0].endpoints[2].clone();
    plain.address = "10.0.1.9".parse().unwrap();
    plain.identity = None;
    m.services[0].endpoints.push(plain);
    m.resolve_routes();
    let v2 = m
        .services
        .iter()
        .find(|s| s.name == "shop~version=v2")
        .unwrap();
    let addresses: Vec<String> = v2.endpoints.iter().map(|e| e.address.to_string()).collect();
    assert_eq!(addresses, ["10.0.1.3"]);
    // And a subset of only such endpoints is not made (reported, not plaintext).
    let mut m = subset_mesh("http", true);
    m.services[0].endpoints[2].identity = None;
    let problems = m.resolve_routes();
    assert!(
        problems
            .iter()
            .any(|p| p.message.contains("subset version=v2")),
        "{problems:?}"
    );
    assert!(!m.services.iter().any(|s| s.name == "shop~version=v2"));
}
