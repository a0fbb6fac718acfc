//! The translation for a mesh spanning many nodes: endpoint priorities by the
//! caller's locality, outlier detection and a short connect timeout on exactly the
//! service port (mesh) clusters, retry policies on exactly the outbound routes, and a
//! memo that, given any sequence of meshes and local localities, translates like a
//! fresh one. Hermetic: no peers (tests/envoy.rs feeds these to a real Envoy).

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    RetryPolicy, Route, RouteConfiguration, header_matcher, retry_policy, route,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager::RouteSpecifier,
};
use envoy_types::pb::envoy::extensions::retry::priority::previous_priorities::v3::PreviousPrioritiesConfig;
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
use flock_core::ContentHash;
use flock_xds::translate::{
    self, Endpoint, EnvoyOptions, Flavor, Locality, Memo, Mesh, Resource, Service, ServicePort,
    envoy::RETRY_ON_IDEMPOTENT, envoy::RETRY_ON_OTHER, type_urls,
};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, VIRTUAL_HOST};
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

const WEB_ID: &str = "spiffe://cluster.local/ns/default/sa/web";

fn loc(region: &str, zone: &str) -> Locality {
    Locality {
        region: region.into(),
        zone: zone.into(),
        sub_zone: String::new(),
    }
}

fn local(region: &str, zone: &str) -> EnvoyOptions {
    EnvoyOptions {
        local_locality: Some(loc(region, zone)),
        ..EnvoyOptions::default()
    }
}

/// `web` (HTTP 8080, mTLS: its endpoints have identities) with one endpoint per
/// locality: eu/a, eu/b (two), us/c and one without a locality; `db` (TCP 5432,
/// plaintext) on eu/b; `greeter` (gRPC 50051, plaintext) on eu/a and us/c. Pod
/// `web-0` (an HTTP, a gRPC and a TCP inbound port) calls out with identity
/// `WEB_ID`; pod `plain` calls out without one.
fn mesh() -> Mesh {
    Mesh::from_json(
        br#"{
      "services": [
        {"name": "web", "ports": [{"port": 8080}],
         "endpoints": [
           {"address": "10.0.1.1", "port": 15006, "locality": {"region": "eu", "zone": "a"}, "identity": "spiffe://cluster.local/ns/default/sa/web"},
           {"address": "10.0.2.1", "port": 15006, "locality": {"region": "eu", "zone": "b"}, "identity": "spiffe://cluster.local/ns/default/sa/web"},
           {"address": "10.0.2.2", "port": 15006, "locality": {"region": "eu", "zone": "b"}, "identity": "spiffe://cluster.local/ns/default/sa/web"},
           {"address": "10.0.3.1", "port": 15006, "locality": {"region": "us", "zone": "c"}, "identity": "spiffe://cluster.local/ns/default/sa/web"},
           {"address": "10.0.4.1", "port": 15006, "identity": "spiffe://cluster.local/ns/default/sa/web"}
         ]},
        {"name": "db", "ports": [{"port": 5432, "protocol": "tcp"}],
         "endpoints": [{"address": "10.0.2.3", "port": 5432, "locality": {"region": "eu", "zone": "b"}}]},
        {"name": "greeter", "ports": [{"port": 50051, "protocol": "grpc"}],
         "endpoints": [{"address": "10.0.1.2", "port": 15007, "locality": {"region": "eu", "zone": "a"}},
                       {"address": "10.0.3.2", "port": 15007, "locality": {"region": "us", "zone": "c"}}]}
      ],
      "pods": [
        {"name": "web-0", "ip": "10.0.1.1", "netns": "/var/run/netns/web-0", "identity": "spiffe://cluster.local/ns/default/sa/web",
         "inbound": [{"app_port": 8080, "listen_port": 15006},
                     {"app_port": 50051, "listen_port": 15007, "protocol": "grpc"},
                     {"app_port": 5432, "listen_port": 15008, "protocol": "tcp"}]},
        {"name": "plain", "ip": "10.0.1.9", "netns": "/var/run/netns/plain"}
      ],
      "secrets": [
        {"name": "spiffe://cluster.local/ns/default/sa/web", "kind": {"tls_certificate": {"certificate_chain_pem": "CERT", "private_key_pem": "KEY"}}},
        {"name": "cluster.local", "kind": {"validation_context": {"trusted_ca_pem": "CA"}}}
      ]
    }"#,
    )
    .expect("valid mesh")
}

fn find<'a>(rs: &'a [Resource], type_url: &str, name: &str) -> &'a Resource {
    rs.iter()
        .find(|r| r.type_url == type_url && r.name == name)
        .unwrap_or_else(|| panic!("no {type_url} {name:?}"))
}

fn decode<M: Message + Default>(r: &Resource) -> M {
    assert_eq!(r.hash, ContentHash::of(&r.any.value));
    M::decode(r.any.value.as_slice()).expect("decodes")
}

/// Endpoint address → its group's priority.
fn priorities(cla: &ClusterLoadAssignment) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for g in &cla.endpoints {
        for e in &g.lb_endpoints {
            let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                panic!("no endpoint")
            };
            let Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(sa)) =
                ep.address.as_ref().and_then(|a| a.address.as_ref())
            else {
                panic!("no socket address")
            };
            out.insert(sa.address.clone(), g.priority);
        }
    }
    out
}

fn web_priorities(opts: &EnvoyOptions) -> Vec<(&'static str, u32)> {
    let rs = translate::envoy_resources(&mesh(), opts);
    let p = priorities(&decode(find(&rs, ENDPOINT, "outbound|8080|web.default")));
    let name = |a: &str| match a {
        "10.0.1.1" => "eu/a",
        "10.0.2.1" => "eu/b#1",
        "10.0.2.2" => "eu/b#2",
        "10.0.3.1" => "us/c",
        "10.0.4.1" => "none",
        other => panic!("unexpected endpoint {other}"),
    };
    p.iter().map(|(a, prio)| (name(a), *prio)).collect()
}

#[test]
fn without_a_local_locality_every_endpoint_is_priority_0() {
    let all_zero = vec![
        ("eu/a", 0),
        ("eu/b#1", 0),
        ("eu/b#2", 0),
        ("us/c", 0),
        ("none", 0),
    ];
    assert_eq!(web_priorities(&EnvoyOptions::default()), all_zero);
    // A locality with neither region nor zone is no locality.
    assert_eq!(web_priorities(&local("", "")), all_zero);
}

#[test]
fn the_callers_zone_is_priority_0_its_region_1_the_rest_2() {
    assert_eq!(
        web_priorities(&local("eu", "a")),
        vec![
            ("eu/a", 0),
            ("eu/b#1", 1),
            ("eu/b#2", 1),
            ("us/c", 2),
            ("none", 2)
        ]
    );
    assert_eq!(
        web_priorities(&local("eu", "b")),
        vec![
            ("eu/a", 1),
            ("eu/b#1", 0),
            ("eu/b#2", 0),
            ("us/c", 2),
            ("none", 2)
        ]
    );
    assert_eq!(
        web_priorities(&local("us", "c")),
        vec![
            ("eu/a", 1),
            ("eu/b#1", 1),
            ("eu/b#2", 1),
            ("us/c", 0),
            ("none", 1)
        ]
    );
}

#[test]
fn priorities_have_no_gaps() {
    // No endpoint in the caller's zone: its region is priority 0, not 1.
    assert_eq!(
        web_priorities(&local("eu", "z")),
        vec![
            ("eu/a", 0),
            ("eu/b#1", 0),
            ("eu/b#2", 0),
            ("us/c", 1),
            ("none", 1)
        ]
    );
    // Nothing in the caller's region: all other regions are priority 0.
    assert_eq!(
        web_priorities(&local("ap", "x"))
            .iter()
            .map(|(_, p)| *p)
            .collect::<BTreeSet<_>>(),
        BTreeSet::from([0])
    );
    // The groups are sorted by priority, each locality in one group.
    let rs = translate::envoy_resources(&mesh(), &local("eu", "b"));
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|8080|web.default"));
    let groups: Vec<(u32, String, usize)> = cla
        .endpoints
        .iter()
        .map(|g| {
            let l = g.locality.as_ref().unwrap();
            (
                g.priority,
                format!("{}/{}", l.region, l.zone),
                g.lb_endpoints.len(),
            )
        })
        .collect();
    assert_eq!(
        groups,
        vec![
            (0, "eu/b".to_string(), 2),
            (1, "eu/a".to_string(), 1),
            (2, "/".to_string(), 1),
            (2, "us/c".to_string(), 1),
        ]
    );
}

#[test]
fn proxyless_grpc_gets_the_same_priorities() {
    let opts = local("us", "c");
    let envoy = translate::envoy_resources(&mesh(), &opts);
    let mut memo = Memo::new(Flavor::Grpc);
    let grpc = memo.translate(&mesh(), &opts);
    let (_, hash, any) = grpc[ENDPOINT]
        .iter()
        .find(|(n, _, _)| n.as_ref() == "outbound|50051|greeter.default")
        .expect("the gRPC flavor has the greeter endpoints");
    let envoy_cla = find(&envoy, ENDPOINT, "outbound|50051|greeter.default");
    assert_eq!(*hash, envoy_cla.hash, "byte-identical to Envoy's");
    let cla = ClusterLoadAssignment::decode(any.value.as_slice()).unwrap();
    assert_eq!(
        priorities(&cla),
        BTreeMap::from([("10.0.1.2".to_string(), 1), ("10.0.3.2".to_string(), 0)])
    );
}

#[test]
fn mesh_clusters_and_only_they_have_outlier_detection_and_a_1s_connect_timeout() {
    let rs = translate::envoy_resources(&mesh(), &local("eu", "a"));
    let clusters: Vec<Cluster> = rs
        .iter()
        .filter(|r| r.type_url == CLUSTER)
        .map(decode)
        .collect();
    let mut mesh_clusters = BTreeSet::new();
    for c in &clusters {
        if c.name.starts_with("inbound|") {
            assert_eq!(c.outlier_detection, None, "{}: one local app", c.name);
            continue;
        }
        mesh_clusters.insert(c.name.clone());
        let od = c
            .outlier_detection
            .as_ref()
            .unwrap_or_else(|| panic!("{} has no outlier detection", c.name));
        let v = |x: Option<envoy_types::pb::google::protobuf::UInt32Value>| x.map(|v| v.value);
        assert_eq!(v(od.consecutive_gateway_failure), Some(3), "{}", c.name);
        assert_eq!(v(od.enforcing_consecutive_gateway_failure), Some(100));
        assert_eq!(v(od.consecutive_5xx), Some(5));
        assert_eq!(v(od.enforcing_consecutive_5xx), Some(100));
        assert_eq!(v(od.enforcing_success_rate), Some(0));
        assert_eq!(v(od.max_ejection_percent), Some(100));
        assert!(!od.split_external_local_origin_errors);
        let secs = |d: Option<envoy_types::pb::google::protobuf::Duration>| {
            d.map(|d| d.seconds as f64 + f64::from(d.nanos) / 1e9)
        };
        assert_eq!(secs(od.interval), Some(1.0));
        assert_eq!(secs(od.base_ejection_time), Some(5.0));
        assert_eq!(secs(c.connect_timeout), Some(1.0));
    }
    // Plain (HTTP, gRPC, TCP) and the caller's mTLS cluster.
    assert_eq!(
        mesh_clusters,
        BTreeSet::from([
            "outbound|50051|greeter.default".to_string(),
            "outbound|5432|db.default".to_string(),
            "outbound|8080|web.default".to_string(),
            format!("outbound|8080|web.default|{WEB_ID}"),
        ])
    );
}

fn policy(r: &Route) -> &RetryPolicy {
    match &r.action {
        Some(route::Action::Route(a)) => a.retry_policy.as_ref().expect("a retry policy"),
        other => panic!("not a route action: {other:?}"),
    }
}

fn no_policy(r: &Route) -> bool {
    matches!(&r.action, Some(route::Action::Route(a)) if a.retry_policy.is_none())
}

fn check_retry_policy(p: &RetryPolicy, retry_on: &str, per_try_ms: Option<i64>) {
    assert_eq!(p.retry_on, retry_on);
    assert_eq!(p.num_retries.map(|n| n.value), Some(2));
    assert_eq!(
        p.per_try_timeout
            .map(|d| d.seconds * 1000 + i64::from(d.nanos / 1_000_000)),
        per_try_ms
    );
    assert_eq!(p.host_selection_retry_max_attempts, 3);
    assert_eq!(p.retry_host_predicate.len(), 1);
    assert_eq!(
        p.retry_host_predicate[0].name,
        "envoy.retry_host_predicates.previous_hosts"
    );
    let prio = p.retry_priority.as_ref().expect("a retry priority");
    assert_eq!(prio.name, "envoy.retry_priorities.previous_priorities");
    let Some(retry_policy::retry_priority::ConfigType::TypedConfig(any)) = &prio.config_type else {
        panic!("no typed config")
    };
    assert_eq!(any.type_url, type_urls::PREVIOUS_PRIORITIES);
    let cfg = PreviousPrioritiesConfig::decode(any.value.as_slice()).unwrap();
    assert_eq!(cfg.update_frequency, 1);
}

fn method_regex(r: &Route) -> Option<String> {
    let m = r.r#match.as_ref()?;
    assert!(m.headers.len() <= 1);
    let h = m.headers.first()?;
    assert_eq!(h.name, ":method");
    match &h.header_match_specifier {
        Some(header_matcher::HeaderMatchSpecifier::StringMatch(s)) => match &s.match_pattern {
            Some(MatchPattern::SafeRegex(re)) => Some(re.regex.clone()),
            other => panic!("not a regex: {other:?}"),
        },
        other => panic!("not a string match: {other:?}"),
    }
}

#[test]
fn outbound_routes_retry_idempotent_methods_on_gateway_errors_and_the_rest_only_when_unsent() {
    let opts = EnvoyOptions {
        retry_per_try_timeout_ms: 2500,
        ..local("eu", "a")
    };
    let rs = translate::envoy_resources(&mesh(), &opts);
    for name in [
        "outbound|http".to_string(),
        format!("outbound|http|{WEB_ID}"),
    ] {
        let rc: RouteConfiguration = decode(find(&rs, ROUTE, &name));
        // web:8080 and greeter:50051 (HTTP and gRPC); db is TCP: no virtual host.
        assert_eq!(rc.virtual_hosts.len(), 2, "{name}");
        for vh in &rc.virtual_hosts {
            assert_eq!(vh.routes.len(), 2, "{name} {}", vh.name);
            let (idempotent, other) = (&vh.routes[0], &vh.routes[1]);
            assert_eq!(
                method_regex(idempotent).as_deref(),
                Some("GET|HEAD|OPTIONS|TRACE|PUT|DELETE")
            );
            check_retry_policy(policy(idempotent), RETRY_ON_IDEMPOTENT, Some(2500));
            // The catch-all comes second, so it only gets the other methods.
            assert_eq!(method_regex(other), None);
            check_retry_policy(policy(other), RETRY_ON_OTHER, None);
            assert!(!RETRY_ON_OTHER.contains("gateway-error"));
            assert!(
                !RETRY_ON_OTHER
                    .split(',')
                    .any(|c| c == "reset" || c == "5xx")
            );
        }
    }
    // 0 means no per-try timeout.
    let rs = translate::envoy_resources(
        &mesh(),
        &EnvoyOptions {
            retry_per_try_timeout_ms: 0,
            ..EnvoyOptions::default()
        },
    );
    let rc: RouteConfiguration = decode(find(&rs, ROUTE, "outbound|http"));
    check_retry_policy(
        policy(&rc.virtual_hosts[0].routes[0]),
        RETRY_ON_IDEMPOTENT,
        None,
    );

    // The inbound routes (inline in the inbound listeners) do not retry.
    for r in rs.iter().filter(|r| r.type_url == LISTENER) {
        let l: Listener = decode(r);
        for f in l.filter_chains.iter().flat_map(|c| &c.filters) {
            let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
                continue;
            };
            if any.type_url != type_urls::HCM {
                continue;
            }
            let hcm = HttpConnectionManager::decode(any.value.as_slice()).unwrap();
            if let Some(RouteSpecifier::RouteConfig(rc)) = hcm.route_specifier {
                assert!(r.name.starts_with("inbound|"));
                for route in rc.virtual_hosts.iter().flat_map(|v| &v.routes) {
                    assert!(no_policy(route), "{}", r.name);
                }
            }
        }
    }
    // Nor do proxyless gRPC routes (gRPC retries what never reached a server itself).
    for r in translate::grpc_resources(&mesh())
        .iter()
        .filter(|r| r.type_url == ROUTE)
    {
        let rc: RouteConfiguration = decode(r);
        for route in rc.virtual_hosts.iter().flat_map(|v| &v.routes) {
            assert!(no_policy(route), "{}", r.name);
        }
    }
}

#[test]
fn a_memo_starts_over_when_the_options_change() {
    let m = mesh();
    let mut memo = Memo::new(Flavor::Envoy);
    for opts in [
        EnvoyOptions::default(),
        local("eu", "a"),
        local("eu", "a"),
        local("us", "c"),
        EnvoyOptions::default(),
    ] {
        let got = memo.translate(&m, &opts);
        let want = translate::envoy_resources(&m, &opts);
        assert_eq!(
            got[ENDPOINT]
                .iter()
                .map(|(n, h, _)| (n.to_string(), *h))
                .collect::<BTreeSet<_>>(),
            want.iter()
                .filter(|r| r.type_url == ENDPOINT)
                .map(|r| (r.name.clone(), r.hash))
                .collect::<BTreeSet<_>>(),
            "{opts:?}"
        );
    }
}

/// Every (type, name, hash) of a translation's entries.
fn entry_set(entries: &translate::Entries) -> BTreeSet<(String, String, ContentHash)> {
    entries
        .iter()
        .flat_map(|(t, list)| {
            list.iter()
                .map(move |(n, h, _)| (t.to_string(), n.to_string(), *h))
        })
        .collect()
}

/// Every (type, name, hash) of a resource set.
fn set_entries(
    set: &flock_core::resources::ResourceSet<envoy_types::pb::google::protobuf::Any>,
) -> BTreeSet<(String, String, ContentHash)> {
    set.type_urls()
        .flat_map(|t| {
            set.iter_type(t)
                .map(move |(n, e)| (t.to_string(), n.to_string(), e.hash()))
        })
        .collect()
}

/// The set a publisher keeps: `memo`'s last changes applied to `prev`, or, where the
/// memo has none, `prev` with every type replaced by `entries`.
fn apply_changes(
    memo: &mut Memo,
    prev: &flock_core::resources::ResourceSet<envoy_types::pb::google::protobuf::Any>,
    entries: &translate::Entries,
) -> flock_core::resources::ResourceSet<envoy_types::pb::google::protobuf::Any> {
    match memo.take_changes() {
        Some(changes) => changes.apply(prev),
        None => {
            let mut whole = prev.edit();
            for (t, list) in entries {
                whole.replace_type(t, list.iter().cloned());
            }
            whole.build()
        }
    }
}

/// One step of [`vhds_memo_follows`]: the services and pods as the agent passes them.
type Step = (
    Vec<std::sync::Arc<Service>>,
    Vec<std::sync::Arc<translate::Pod>>,
);

/// A memo given shared `Arc`s (as the agent passes them): after each step,
/// its translation and its changes applied to the last set equal a fresh memo's.
fn vhds_memo_follows(steps: &[Step], opts: &EnvoyOptions) {
    let mut memo = Memo::new(Flavor::Envoy);
    let mut applied =
        flock_core::resources::ResourceSet::<envoy_types::pb::google::protobuf::Any>::new();
    for (i, (services, pods)) in steps.iter().enumerate() {
        let entries = memo.translate_shared(services, pods, &[], opts).entries();
        let mesh = Mesh {
            services: services.iter().map(|s| (**s).clone()).collect(),
            pods: pods.iter().map(|p| (**p).clone()).collect(),
            ..Mesh::default()
        };
        let fresh = entry_set(&Memo::new(Flavor::Envoy).translate(&mesh, opts));
        assert_eq!(entry_set(&entries), fresh, "step {i}");
        applied = apply_changes(&mut memo, &applied, &entries);
        assert_eq!(
            set_entries(&applied),
            fresh,
            "step {i}: the changes applied"
        );
    }
}

fn caller_pod(name: &str, id: &str) -> std::sync::Arc<translate::Pod> {
    std::sync::Arc::new(
        serde_json::from_value(serde_json::json!({
            "name": name, "ip": "10.9.0.1", "identity": id,
        }))
        .unwrap(),
    )
}

/// One caller identity replaced by another (the same number of callers) while a
/// service without mTLS peers routes every caller to its plain cluster, so its route
/// parts are the same bytes for either: its virtual hosts still move to the new
/// caller's route configuration (their names hold the caller).
#[test]
fn with_vhds_a_caller_replaced_by_another_gets_every_virtual_host() {
    let plain: Service = serde_json::from_value(serde_json::json!({
        "name": "plain", "ports": [{"port": 8080}],
        "endpoints": [{"address": "10.9.1.1", "port": 8080}],
    }))
    .unwrap();
    let services = vec![std::sync::Arc::new(plain)];
    let a = caller_pod("client", "spiffe://cluster.local/ns/default/sa/a");
    let b = caller_pod("client", "spiffe://cluster.local/ns/default/sa/b");
    let opts = EnvoyOptions {
        vhds: true,
        ..EnvoyOptions::default()
    };
    vhds_memo_follows(
        &[
            (services.clone(), vec![a.clone()]),
            (services.clone(), vec![b]),
            (services, vec![a]),
        ],
        &opts,
    );
}

/// With tracing on, an in-place edit (one service changed, everything else the same
/// `Arc`s) keeps the trace collector's cluster, as the whole pass makes it.
#[test]
fn an_in_place_edit_keeps_the_trace_collectors_cluster() {
    let svc = |port: u16| -> std::sync::Arc<Service> {
        std::sync::Arc::new(
            serde_json::from_value(serde_json::json!({
                "name": "web", "ports": [{"port": 8080}],
                "endpoints": [{"address": "10.9.1.1", "port": port}],
            }))
            .unwrap(),
        )
    };
    let pods = vec![caller_pod(
        "client",
        "spiffe://cluster.local/ns/default/sa/a",
    )];
    for vhds in [false, true] {
        let opts = EnvoyOptions {
            vhds,
            tracing: Some(translate::telemetry::TracingOptions {
                collector_host: "10.9.2.1".into(),
                collector_port: 4317,
                service_name: "envoy".into(),
                sample_percent: 100,
            }),
            ..EnvoyOptions::default()
        };
        vhds_memo_follows(
            &[
                (vec![svc(8080)], pods.clone()),
                (vec![svc(8081)], pods.clone()),
                (vec![svc(8082)], pods.clone()),
            ],
            &opts,
        );
    }
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn locality() -> impl Strategy<Value = Locality> {
        (
            prop::sample::select(vec!["", "eu", "us"]),
            prop::sample::select(vec!["", "a", "b"]),
        )
            .prop_map(|(r, z)| loc(r, z))
    }

    /// A mesh of the fixture's pods and 1–3 services whose endpoints (on distinct
    /// addresses) are spread over localities; mTLS or not per service.
    fn mesh_strategy() -> impl Strategy<Value = Mesh> {
        let service = (
            prop::sample::select(vec![
                translate::Protocol::Http,
                translate::Protocol::Grpc,
                translate::Protocol::Tcp,
            ]),
            prop::collection::vec((locality(), 1u32..3, any::<bool>()), 0..5),
            any::<bool>(),
            any::<bool>(),
        );
        // Per pod of `mesh()`: not captured, strict or permissive capture (a
        // captured pod's outbound listener depends on every service's addresses).
        let capture = prop::sample::select(vec![
            None,
            Some(translate::CaptureMode::Strict),
            Some(translate::CaptureMode::Permissive),
        ]);
        (
            prop::collection::vec(service, 1..4),
            prop::collection::vec(capture, 2),
        )
            .prop_map(|(services, captures)| {
                let mut m = mesh();
                for (pod, mode) in m.pods.iter_mut().zip(captures) {
                    pod.capture = mode.map(|mode| translate::Capture {
                        mode,
                        mark: translate::DEFAULT_CAPTURE_MARK,
                    });
                }
                m.services = services
                    .into_iter()
                    .enumerate()
                    .map(|(i, (protocol, eps, mtls, vip))| Service {
                        name: format!("s{i}"),
                        namespace: "default".into(),
                        ports: vec![ServicePort {
                            name: None,
                            port: 8000 + i as u16,
                            protocol,
                        }],
                        endpoints: eps
                            .into_iter()
                            .enumerate()
                            .map(|(j, (locality, weight, healthy))| {
                                // From JSON: fields this test does not vary keep
                                // their defaults.
                                let mut e: Endpoint = serde_json::from_value(serde_json::json!({
                                    "address": format!("10.1.{i}.{}", j + 1),
                                    "port": 15006,
                                    "weight": weight,
                                    "health": if healthy { "healthy" } else { "unknown" },
                                }))
                                .unwrap();
                                e.locality = locality;
                                e.identity = mtls.then(|| WEB_ID.to_string());
                                e
                            })
                            .collect(),
                        vips: if vip {
                            vec![std::net::Ipv4Addr::new(10, 96, 0, i as u8 + 1).into()]
                        } else {
                            Vec::new()
                        },
                        routes: Vec::new(),
                        pool: None,
                    })
                    .collect();
                m
            })
    }

    use super::entry_set as flat;

    /// A service edited under its name: 0 an equal copy, 1 an endpoint's weight
    /// changed (or one added), 2 its port's protocol changed (its routes change), 3
    /// renamed, keeping its place in (namespace, name) order (the memo cannot edit
    /// in place), 4 a VIP added, `10.97.0.<step>` (likewise).
    fn edited(s: &Service, kind: u8, step: u8) -> Service {
        let mut s = s.clone();
        match kind {
            0 => {}
            1 => match s.endpoints.first_mut() {
                Some(e) => e.weight += 1,
                None => {
                    let mut e: Endpoint = serde_json::from_value(serde_json::json!({
                        "address": "10.9.9.9", "port": 15006,
                    }))
                    .unwrap();
                    e.locality = loc("eu", "a");
                    s.endpoints.push(e);
                }
            },
            2 => {
                s.ports[0].protocol = match s.ports[0].protocol {
                    translate::Protocol::Tcp => translate::Protocol::Http,
                    _ => translate::Protocol::Tcp,
                }
            }
            3 => s.name.push_str("-b"),
            _ => s.vips.push(std::net::Ipv4Addr::new(10, 97, 0, step).into()),
        }
        s
    }

    /// One step of the shared-`Arc` proptests: both flavors translate `services` and
    /// `pods` (the mesh `m` holds the same values); each equals a fresh memo's whole
    /// translation, and the Envoy memo's changes applied to `applied` (or the whole
    /// lists, without changes) give that translation's set, with matching counts.
    /// The sets a publisher keeps per flavor by applying each translation's changes.
    type Applied = (
        flock_core::resources::ResourceSet<envoy_types::pb::google::protobuf::Any>,
        flock_core::resources::ResourceSet<envoy_types::pb::google::protobuf::Any>,
    );

    fn translate_and_check(
        envoy: &mut Memo,
        grpc: &mut Memo,
        sets: &mut Applied,
        services: &[std::sync::Arc<Service>],
        pods: &[std::sync::Arc<translate::Pod>],
        m: &Mesh,
        opts: &EnvoyOptions,
    ) -> Result<(), TestCaseError> {
        let (applied, grpc_applied) = sets;
        let t = envoy.translate_shared(services, pods, &m.secrets, opts);
        let entries = t.entries();
        let fresh = Memo::new(Flavor::Envoy).translate(m, opts);
        prop_assert_eq!(flat(&entries), flat(&fresh));
        *applied = apply_changes(envoy, applied, &entries);
        prop_assert!(
            t.counts_match(applied),
            "changes applied and counts disagree"
        );
        prop_assert_eq!(&set_entries(applied), &flat(&fresh));
        let g = grpc
            .translate_shared(services, pods, &m.secrets, opts)
            .entries();
        let fresh = Memo::new(Flavor::Grpc).translate(m, opts);
        prop_assert_eq!(flat(&g), flat(&fresh));
        // The proxyless flavor's changes (its pods' server listeners too) applied to
        // the last set give the whole lists.
        *grpc_applied = apply_changes(grpc, grpc_applied, &g);
        prop_assert_eq!(&set_entries(grpc_applied), &flat(&fresh));
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// The in-place path: pods and services passed as the same `Arc`s from one
        /// translation to the next (as the agent passes them), but for one service
        /// replaced by an edit of itself per step, and the secrets rotated or not.
        /// At every step, both flavors' translations and their changes applied to the
        /// last set equal a fresh memo's whole translation; edits under the same name
        /// and VIPs are done in place, the others by the whole pass.
        #[test]
        fn a_memo_given_shared_arcs_edits_in_place_like_a_fresh_translation(
            m in mesh_strategy(),
            steps in prop::collection::vec((0..3usize, 0..5u8, any::<bool>()), 1..8),
            vhds in any::<bool>(),
        ) {
            prop_assume!(m.validate().is_ok());
            let opts = EnvoyOptions { vhds, ..EnvoyOptions::default() };
            let mut m = m;
            for pod in &mut m.pods {
                pod.capture = None;
            }
            let mut services: Vec<std::sync::Arc<Service>> =
                m.services.iter().cloned().map(std::sync::Arc::new).collect();
            let pods: Vec<std::sync::Arc<translate::Pod>> =
                m.pods.iter().cloned().map(std::sync::Arc::new).collect();
            let mut envoy = Memo::new(Flavor::Envoy);
            let mut grpc = Memo::new(Flavor::Grpc);
            let mut applied: Applied = Default::default();
            let mut first = true;
            for (step, (which, kind, rotate)) in std::iter::once((0, 0, false)).chain(steps).enumerate() {
                if !first {
                    let i = which % services.len();
                    services[i] = std::sync::Arc::new(edited(&services[i], kind, step as u8));
                    if rotate {
                        for secret in &mut m.secrets {
                            if let translate::SecretKind::TlsCertificate { certificate_chain_pem, .. } = &mut secret.kind {
                                certificate_chain_pem.push('+');
                            }
                        }
                    }
                }
                m.services = services.iter().map(|s| (**s).clone()).collect();
                prop_assume!(m.validate().is_ok());
                let before = (envoy.in_place_count(), grpc.in_place_count());
                translate_and_check(&mut envoy, &mut grpc, &mut applied, &services, &pods, &m, &opts)?;
                if !first {
                    // Under the same name and VIPs: in place, both flavors.
                    let in_place = kind <= 2;
                    prop_assert_eq!(envoy.in_place_count() > before.0, in_place);
                    prop_assert_eq!(grpc.in_place_count() > before.1, in_place);
                }
                first = false;
            }
        }

        /// The in-place path for pods: one pod added, removed or replaced per step
        /// (what an ADD, a DEL or a changed record does to the agent's list), the
        /// other pods passed as the same `Arc`s, and a service edited or not. At every
        /// step both flavors' translations, and the changes applied to the last set,
        /// equal a fresh memo's whole translation; the edit is done in place exactly
        /// when the caller identities stay the same and the service edit allows it.
        #[test]
        fn a_memo_edits_an_added_removed_or_replaced_pod_in_place_like_a_fresh_translation(
            m in mesh_strategy(),
            start in prop::collection::vec((0..3usize, any::<bool>()), 0..6),
            steps in prop::collection::vec((0..4u8, 0..8usize, 0..3usize, any::<bool>(), 0..3u8), 1..10),
            vhds in any::<bool>(),
        ) {
            const IDS: [&str; 3] = [
                "spiffe://cluster.local/ns/default/sa/a",
                "spiffe://cluster.local/ns/default/sa/b",
                "spiffe://cluster.local/ns/default/sa/c",
            ];
            // Pod `name` on its own address and network namespace: a caller (an
            // outbound listener) or not, with SPIFFE ID `IDS[id]`.
            let pod = |name: &str, at: usize, id: usize, caller: bool| -> std::sync::Arc<translate::Pod> {
                let p: translate::Pod = serde_json::from_value(serde_json::json!({
                    "name": name,
                    "ip": format!("10.2.{}.{}", at / 200, at % 200 + 1),
                    "netns": format!("/var/run/netns/{name}"),
                    "identity": IDS[id],
                    "outbound_port": if caller { 15001 } else { 0 },
                    // Identity b's pods also serve a proxyless gRPC port: the proxyless
                    // flavor's server listeners are edited in place too.
                    "inbound": if id == 1 {
                        serde_json::json!([{"app_port": 8080, "listen_port": 15006},
                            {"app_port": 50051, "listen_port": 50051, "protocol": "grpc", "proxyless": true}])
                    } else {
                        serde_json::json!([{"app_port": 8080, "listen_port": 15006}])
                    },
                }))
                .unwrap();
                std::sync::Arc::new(p)
            };
            let callers = |pods: &[std::sync::Arc<translate::Pod>]| -> BTreeSet<String> {
                pods.iter()
                    .filter(|p| p.outbound_port != 0)
                    .filter_map(|p| p.identity.clone())
                    .filter(|id| translate::model::trust_domain(id).is_some())
                    .collect()
            };
            let opts = EnvoyOptions { vhds, ..EnvoyOptions::default() };
            let mut m = m;
            for p in &mut m.pods {
                p.capture = None;
            }
            m.secrets.extend(IDS.iter().map(|id| translate::Secret {
                name: id.to_string(),
                kind: translate::SecretKind::TlsCertificate {
                    certificate_chain_pem: "CERT".into(),
                    private_key_pem: translate::PrivateKeyPem("KEY".into()),
                },
            }));
            let mut pods: Vec<std::sync::Arc<translate::Pod>> =
                m.pods.iter().cloned().map(std::sync::Arc::new).collect();
            let mut next = 0usize;
            for (id, caller) in start {
                pods.push(pod(&format!("q{next}"), next, id, caller));
                next += 1;
            }
            let mut services: Vec<std::sync::Arc<Service>> =
                m.services.iter().cloned().map(std::sync::Arc::new).collect();
            let mut envoy = Memo::new(Flavor::Envoy);
            let mut grpc = Memo::new(Flavor::Grpc);
            let mut applied: Applied = Default::default();
            let mut first = true;
            for (step, (op, at, id, caller, kind)) in
                std::iter::once((4, 0, 0, false, 0)).chain(steps).enumerate()
            {
                let callers_before = callers(&pods);
                if !first {
                    match op {
                        0 if !pods.is_empty() => {
                            pods.remove(at % pods.len());
                        }
                        1 => {
                            let p = pod(&format!("q{next}"), next, id, caller);
                            next += 1;
                            pods.insert(at % (pods.len() + 1), p);
                        }
                        2 if !pods.is_empty() => {
                            let i = at % pods.len();
                            let mut p = (*pods[i]).clone();
                            p.uid = Some(format!("uid-{step}"));
                            pods[i] = std::sync::Arc::new(p);
                        }
                        3 if !pods.is_empty() => {
                            let i = at % pods.len();
                            pods[i] = std::sync::Arc::new((*pods[i]).clone());
                        }
                        _ => {}
                    }
                    let i = at % services.len();
                    services[i] = std::sync::Arc::new(edited(&services[i], kind, step as u8));
                }
                m.services = services.iter().map(|s| (**s).clone()).collect();
                m.pods = pods.iter().map(|p| (**p).clone()).collect();
                prop_assume!(m.validate().is_ok());
                let before = (envoy.in_place_count(), grpc.in_place_count());
                translate_and_check(&mut envoy, &mut grpc, &mut applied, &services, &pods, &m, &opts)?;
                if !first {
                    let in_place = kind <= 2 && callers(&pods) == callers_before;
                    prop_assert_eq!(envoy.in_place_count() > before.0, in_place);
                }
                first = false;
            }
        }

        /// Incremental == from scratch: a memo fed a sequence of meshes and local
        /// localities (the options change too) gives, at every step, what a fresh
        /// memo gives for that step's mesh and options; and the Envoy flavor equals
        /// the one-shot translation; its route configurations equal the whole builds;
        /// the changes it reports, applied step by step, give the whole lists' set.
        #[test]
        fn a_memo_over_any_sequence_translates_like_a_fresh_one(
            steps in prop::collection::vec(
                (mesh_strategy(), prop::option::of(locality()), any::<bool>()),
                1..5,
            )
        ) {
            let mut envoy = Memo::new(Flavor::Envoy);
            let mut grpc = Memo::new(Flavor::Grpc);
            // The set a publisher keeps by applying each translation's changes (when
            // the memo has them) to the last set, beside the set replaced whole.
            let mut applied =
                flock_core::resources::ResourceSet::<envoy_types::pb::google::protobuf::Any>::new();
            for (m, local_locality, vhds) in steps {
                prop_assume!(m.validate().is_ok());
                let opts = EnvoyOptions { local_locality, vhds, ..EnvoyOptions::default() };
                // Each generated mesh, then small edits of it that keep most of it
                // equal (so the memo reuses entries across the edit): its caller pod
                // gone and back, a secret rotated, a service gone (the last, then the
                // first).
                let mut no_caller = m.clone();
                no_caller.pods.retain(|p| p.identity.is_none());
                let mut rotated = m.clone();
                for secret in &mut rotated.secrets {
                    if let translate::SecretKind::TlsCertificate { certificate_chain_pem, .. } = &mut secret.kind {
                        certificate_chain_pem.push_str("-ROTATED");
                    }
                }
                let mut fewer = m.clone();
                fewer.services.pop();
                // The first service by (namespace, name) gone: the memo finds it gone
                // before the services it keeps, not after.
                let mut first_gone = m.clone();
                if let Some(i) = (0..first_gone.services.len())
                    .min_by_key(|i| (first_gone.services[*i].namespace.clone(), first_gone.services[*i].name.clone()))
                {
                    first_gone.services.remove(i);
                }
                for m in [m.clone(), no_caller, m.clone(), rotated, m.clone(), fewer, m.clone(), first_gone] {
                if m.validate().is_err() {
                    continue;
                }
                let entries = envoy.translate(&m, &opts);
                let mut whole = applied.edit();
                for (t, list) in &entries {
                    whole.replace_type(t, list.iter().cloned());
                }
                let whole = whole.build();
                applied = match envoy.take_changes() {
                    Some(changes) => changes.apply(&applied),
                    None => whole.clone(),
                };
                prop_assert!(
                    flock_core::resources::diff_full(&applied, &whole).is_empty(),
                    "changes applied != whole lists"
                );
                let e = flat(&entries);
                prop_assert_eq!(&e, &flat(&Memo::new(Flavor::Envoy).translate(&m, &opts)));
                let once: BTreeSet<_> = translate::envoy_resources(&m, &opts)
                    .into_iter()
                    .map(|r| (r.type_url.to_string(), r.name, r.hash))
                    .collect();
                prop_assert_eq!(&e, &once);
                // The route configurations, joined from per-service parts in the memo,
                // are byte for byte the whole builds.
                let routes: BTreeSet<_> = e.iter().filter(|(t, ..)| t == ROUTE && !vhds).cloned().collect();
                let mut whole = vec![translate::outbound_routes(&m.services, &opts)];
                let callers: BTreeSet<&str> = m
                    .pods
                    .iter()
                    .filter(|p| p.outbound_port != 0)
                    .filter_map(|p| p.identity.as_deref())
                    .collect();
                for id in callers {
                    whole.extend(translate::caller_resources(id, &m.services, &opts));
                }
                let whole: BTreeSet<_> = whole
                    .into_iter()
                    .filter(|r| r.type_url == ROUTE && !vhds)
                    .map(|r| (r.type_url.to_string(), r.name, r.hash))
                    .collect();
                prop_assert_eq!(&routes, &whole);
                let g = flat(&grpc.translate(&m, &opts));
                prop_assert_eq!(&g, &flat(&Memo::new(Flavor::Grpc).translate(&m, &opts)));
                // Priorities are dense: 0..n without gaps, in every assignment.
                for r in translate::envoy_resources(&m, &opts).iter().filter(|r| r.type_url == ENDPOINT) {
                    let cla: ClusterLoadAssignment = decode(r);
                    let ps: BTreeSet<u32> = cla.endpoints.iter().map(|g| g.priority).collect();
                    prop_assert_eq!(ps.iter().copied().collect::<Vec<_>>(), (0..ps.len() as u32).collect::<Vec<_>>());
                }
                }
            }
        }
        /// VHDS serves the same routing as whole route configurations: each outbound
        /// route configuration becomes one without virtual hosts whose VHDS source is
        /// ADS, each of its virtual hosts a `VirtualHost` resource named
        /// `<configuration>/<virtual host>` (the same bytes but for the name), and every
        /// other resource is the same. The oracle splits the plain translation here.
        #[test]
        fn vhds_serves_each_route_configurations_virtual_hosts_as_their_own_resources(
            m in mesh_strategy(),
        ) {
            prop_assume!(m.validate().is_ok());
            let plain = translate::envoy_resources(&m, &EnvoyOptions::default());
            let split = translate::envoy_resources(
                &m,
                &EnvoyOptions { vhds: true, ..EnvoyOptions::default() },
            );
            let mut expected: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
            let mut configs = BTreeSet::new();
            for r in plain {
                if r.type_url == ROUTE {
                    let rc = RouteConfiguration::decode(r.any.value.as_slice()).unwrap();
                    configs.insert(rc.name.clone());
                    for mut vh in rc.virtual_hosts {
                        vh.name = format!("{}/{}", rc.name, vh.name);
                        expected.insert((VIRTUAL_HOST.to_string(), vh.name.clone()), vh.encode_to_vec());
                    }
                } else {
                    expected.insert((r.type_url.to_string(), r.name), r.any.value);
                }
            }
            let mut got = BTreeMap::new();
            let mut got_configs = BTreeSet::new();
            for r in split {
                if r.type_url == ROUTE {
                    let rc = RouteConfiguration::decode(r.any.value.as_slice()).unwrap();
                    prop_assert!(rc.virtual_hosts.is_empty());
                    let source = rc.vhds.and_then(|v| v.config_source).and_then(|c| c.config_source_specifier);
                    prop_assert!(matches!(source, Some(ConfigSourceSpecifier::Ads(_))), "{}", rc.name);
                    prop_assert_eq!(&rc.name, &r.name);
                    got_configs.insert(rc.name);
                } else {
                    got.insert((r.type_url.to_string(), r.name), r.any.value);
                }
            }
            prop_assert_eq!(got_configs, configs);
            prop_assert_eq!(got, expected);
        }
    }
}
