//! Transparent capture in the Envoy translation: a captured pod's outbound listener
//! routes by original destination (service VIPs and endpoint addresses to the
//! service's cluster, anything else through the pod's `ORIGINAL_DST` passthrough
//! cluster), Envoy's sockets in the pod's netns carry the capture mark, permissive
//! inbound listeners take plaintext next to mTLS, and a pod without capture
//! translates exactly as before.

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster,
    cluster::{ClusterDiscoveryType, DiscoveryType, LbPolicy},
};
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, data_source, substitution_format_string,
};
use envoy_types::pb::envoy::config::core::v3::{
    SocketAddress, SocketOption, address, socket_address, socket_option,
};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint;
use envoy_types::pb::envoy::config::listener::v3::{
    FilterChain, Listener, filter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{route, route_action};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::filter_state_value;
use envoy_types::pb::envoy::extensions::filters::listener::original_src::v3::OriginalSrc;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager::RouteSpecifier,
};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterState;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use flock_core::ContentHash;
use flock_xds::cache::check_consistency;
use flock_xds::translate::{
    self, CaptureMode, EnvoyOptions, EnvoyReferences, Mesh, Resource, type_urls,
};
use flock_xds::types::{CLUSTER, LISTENER};
use prost::Message;
use std::collections::{BTreeSet, HashSet};

const CLIENT_ID: &str = "spiffe://td/ns/default/sa/client";
const WEB_ID: &str = "spiffe://td/ns/default/sa/web";

/// Services `web` (HTTP, mTLS, a VIP), `db` (TCP, mTLS, a VIP), `plain` (HTTP,
/// plaintext, a VIP, an endpoint on web's pod IP) and `dup.x` (HTTP on web's port,
/// one endpoint address and port shared with `web`); pods `client` (captured,
/// strict), `web-0` (captured, permissive, mark 7) and `old` (not captured).
fn mesh() -> Mesh {
    let secret = |name: &str, kind: &str| {
        if kind == "ca" {
            format!(
                r#"{{"name": "{name}", "kind": {{"validation_context": {{"trusted_ca_pem": "ca"}}}}}}"#
            )
        } else {
            format!(
                r#"{{"name": "{name}", "kind": {{"tls_certificate": {{"certificate_chain_pem": "c", "private_key_pem": "k"}}}}}}"#
            )
        }
    };
    let json = format!(
        r#"{{
      "services": [
        {{"name": "web", "ports": [{{"port": 8080}}], "vips": ["10.96.0.10"],
          "endpoints": [{{"address": "10.0.0.2", "port": 15006, "identity": "{WEB_ID}"}},
                        {{"address": "10.0.0.3", "port": 15006, "identity": "{WEB_ID}"}}]}},
        {{"name": "db", "ports": [{{"port": 5432, "protocol": "tcp"}}], "vips": ["10.96.0.11"],
          "endpoints": [{{"address": "10.0.0.4", "port": 15006, "identity": "spiffe://td/ns/default/sa/db"}}]}},
        {{"name": "plain", "ports": [{{"port": 9000}}], "vips": ["10.96.0.12"],
          "endpoints": [{{"address": "10.0.0.2", "port": 15007}}]}},
        {{"name": "dup", "namespace": "x", "ports": [{{"port": 8080}}], "vips": ["10.96.0.13"],
          "endpoints": [{{"address": "10.0.0.2", "port": 15006}}]}}
      ],
      "pods": [
        {{"name": "client", "ip": "10.0.0.1", "netns": "/run/netns/client", "identity": "{CLIENT_ID}",
          "capture": {{"mode": "strict"}}}},
        {{"name": "web-0", "ip": "10.0.0.2", "netns": "/run/netns/web-0", "identity": "{WEB_ID}",
          "inbound": [{{"app_port": 8080, "listen_port": 15006}}],
          "capture": {{"mode": "permissive", "mark": 7}}}},
        {{"name": "old", "ip": "10.0.0.5", "netns": "/run/netns/old", "identity": "{CLIENT_ID}",
          "inbound": [{{"app_port": 8080, "listen_port": 15006}}]}}
      ],
      "secrets": [{}, {}, {}]
    }}"#,
        secret("td", "ca"),
        secret(CLIENT_ID, "cert"),
        secret(WEB_ID, "cert"),
    );
    Mesh::from_json(json.as_bytes()).unwrap()
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
    assert_eq!(r.hash, ContentHash::of(&r.any.value));
    M::decode(r.any.value.as_slice()).expect("decodes")
}

fn sock(addr: &Option<envoy_types::pb::envoy::config::core::v3::Address>) -> &SocketAddress {
    match addr.as_ref().and_then(|a| a.address.as_ref()) {
        Some(address::Address::SocketAddress(s)) => s,
        other => panic!("not a socket address: {other:?}"),
    }
}

fn port_of(s: &SocketAddress) -> u32 {
    match s.port_specifier {
        Some(socket_address::PortSpecifier::PortValue(p)) => p,
        ref other => panic!("{other:?}"),
    }
}

/// What a filter chain does: `Http(cluster of its inline routes)`, `Rds(route
/// config name)` or `Tcp(cluster)`.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Http(BTreeSet<String>),
    Rds(String),
    Tcp(String),
}

/// What a filter chain does; a captured pod's outbound chains start with the filter
/// naming the pod's netns for their upstreams ([`upstream_netns`]), which is skipped.
fn action(chain: &FilterChain) -> Action {
    let filters: Vec<_> = chain
        .filters
        .iter()
        .filter(|f| f.name != "envoy.filters.network.set_filter_state")
        .collect();
    assert_eq!(filters.len(), 1, "{chain:?}");
    let Some(filter::ConfigType::TypedConfig(any)) = &filters[0].config_type else {
        panic!("{chain:?}")
    };
    if any.type_url == type_urls::TCP_PROXY {
        let tcp = TcpProxy::decode(any.value.as_slice()).unwrap();
        let Some(tcp_proxy::ClusterSpecifier::Cluster(c)) = tcp.cluster_specifier else {
            panic!("{tcp:?}")
        };
        return Action::Tcp(c);
    }
    assert_eq!(any.type_url, type_urls::HCM);
    let hcm = HttpConnectionManager::decode(any.value.as_slice()).unwrap();
    match hcm.route_specifier {
        Some(RouteSpecifier::Rds(rds)) => Action::Rds(rds.route_config_name),
        Some(RouteSpecifier::RouteConfig(rc)) => {
            assert_eq!(rc.virtual_hosts.len(), 1);
            assert_eq!(rc.virtual_hosts[0].domains, ["*"]);
            let routes = &rc.virtual_hosts[0].routes;
            // The outbound retry routes: idempotent methods first, then the rest.
            assert_eq!(routes.len(), 2);
            assert!(routes.iter().all(|r| matches!(&r.action,
                Some(route::Action::Route(a)) if a.retry_policy.is_some())));
            Action::Http(
                routes
                    .iter()
                    .map(|r| match &r.action {
                        Some(route::Action::Route(a)) => match &a.cluster_specifier {
                            Some(route_action::ClusterSpecifier::Cluster(c)) => c.clone(),
                            other => panic!("{other:?}"),
                        },
                        other => panic!("{other:?}"),
                    })
                    .collect(),
            )
        }
        other => panic!("{other:?}"),
    }
}

/// `(destination port, sorted prefixes)` of a chain's match.
fn matched(chain: &FilterChain) -> (u32, Vec<String>) {
    let m = chain.filter_chain_match.as_ref().expect("a match");
    let mut prefixes: Vec<String> = m
        .prefix_ranges
        .iter()
        .map(|c| format!("{}/{}", c.address_prefix, c.prefix_len.unwrap().value))
        .collect();
    prefixes.sort();
    (m.destination_port.unwrap().value, prefixes)
}

/// The netns a chain's `set_filter_state` filter names for its upstreams, if any.
fn upstream_netns(chain: &FilterChain) -> Option<String> {
    let f = chain
        .filters
        .iter()
        .find(|f| f.name == "envoy.filters.network.set_filter_state")?;
    let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
        panic!("{f:?}")
    };
    assert_eq!(any.type_url, type_urls::SET_FILTER_STATE);
    let config = SetFilterState::decode(any.value.as_slice()).unwrap();
    let [value] = config.on_new_connection.as_slice() else {
        panic!("{config:?}")
    };
    assert_eq!(
        value.key,
        Some(filter_state_value::Key::ObjectKey(
            "envoy.network.upstream_bind_override.network_namespace".into()
        ))
    );
    // Hashable: pods never share an upstream connection.
    assert_eq!(value.factory_key, "envoy.hashable_string");
    assert_eq!(
        value.shared_with_upstream,
        filter_state_value::SharedWithUpstream::Once as i32
    );
    let Some(filter_state_value::Value::FormatString(f)) = &value.value else {
        panic!("{value:?}")
    };
    let Some(substitution_format_string::Format::TextFormatSource(DataSource {
        specifier: Some(data_source::Specifier::InlineString(netns)),
        ..
    })) = &f.format
    else {
        panic!("{f:?}")
    };
    Some(netns.clone())
}

fn http(cluster: &str) -> Action {
    Action::Http([cluster.to_string()].into())
}

fn mark_of(options: &[SocketOption]) -> Option<i64> {
    match options {
        [] => None,
        [o] => {
            assert_eq!((o.level, o.name), (1, 36), "SOL_SOCKET, SO_MARK: {o:?}");
            assert_eq!(o.state, socket_option::SocketState::StatePrebind as i32);
            match o.value {
                Some(socket_option::Value::IntValue(v)) => Some(v),
                ref other => panic!("{other:?}"),
            }
        }
        more => panic!("{more:?}"),
    }
}

/// The captured client's outbound listener binds every address in its netns,
/// restores the original destination, and sends each service's VIP and serving
/// endpoint addresses on the service port to the cluster the client uses for that
/// port (its mTLS cluster for mTLS ports, HTTP and TCP alike); an address and port
/// two services share goes to the first only (Envoy rejects duplicate matches);
/// the app's explicit `127.0.0.1:15001` keeps its Host-based routes; anything else
/// on the listener port is closed, and everything else passes through.
#[test]
fn a_captured_pods_outbound_listener_routes_by_original_destination() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "outbound|default/client"));
    let a = sock(&l.address);
    assert_eq!(
        (
            a.address.as_str(),
            port_of(a),
            a.network_namespace_filepath.as_str(),
            a.ipv4_compat
        ),
        ("0.0.0.0", 15001, "/run/netns/client", false)
    );
    let filters: Vec<&str> = l.listener_filters.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(filters, ["envoy.filters.listener.original_dst"]);
    assert!(!l.use_original_dst.is_some_and(|b| b.value));

    let chains: Vec<((u32, Vec<String>), Action)> = l
        .filter_chains
        .iter()
        .map(|c| (matched(c), action(c)))
        .collect();
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mtls = |svc: &str, port: u16| format!("outbound|{port}|{svc}.default|{CLIENT_ID}");
    let direct = |svc: &str, port: u16| format!("{}|direct-0", mtls(svc, port));
    let want = vec![
        // An mTLS port's endpoints dialled on their own address and port (here the
        // Envoy listen port the registry names) reach that endpoint: its direct
        // cluster; the plaintext port's endpoints have none.
        (
            (15006, s(&["10.0.0.4/32"])),
            Action::Tcp(direct("db", 5432)),
        ),
        (
            (5432, s(&["10.0.0.4/32", "10.96.0.11/32"])),
            Action::Tcp(mtls("db", 5432)),
        ),
        (
            (9000, s(&["10.0.0.2/32", "10.96.0.12/32"])),
            http("outbound|9000|plain.default"),
        ),
        (
            (15006, s(&["10.0.0.2/32", "10.0.0.3/32"])),
            http(&direct("web", 8080)),
        ),
        (
            (8080, s(&["10.0.0.2/32", "10.0.0.3/32", "10.96.0.10/32"])),
            http(&mtls("web", 8080)),
        ),
        ((8080, s(&["10.96.0.13/32"])), http("outbound|8080|dup.x")),
        (
            (15001, s(&["127.0.0.1/32"])),
            Action::Rds(format!("outbound|http|{CLIENT_ID}")),
        ),
        ((15001, vec![]), Action::Tcp("blackhole".into())),
    ];
    assert_eq!(chains, want);
    // Every chain names the pod's netns for its upstreams.
    for c in &l.filter_chains {
        assert_eq!(
            upstream_netns(c).as_deref(),
            Some("/run/netns/client"),
            "{}",
            c.name
        );
    }
    let default = l.default_filter_chain.as_ref().expect("a default chain");
    assert!(default.filter_chain_match.is_none());
    assert_eq!(
        action(default),
        Action::Tcp("passthrough|default/client".into())
    );

    // Every cluster a chain names exists: the db port's mTLS cluster (TCP ports get
    // one only for captured callers) with TLS, the blackhole, the passthrough.
    let db: Cluster = decode(find(&rs, CLUSTER, &mtls("db", 5432)));
    assert!(db.transport_socket.is_some());
    // A direct cluster goes to the address the app dialled (ORIGINAL_DST), over TLS,
    // bound as the mTLS clusters are (with a capture mark: from the caller's netns).
    for (svc, port) in [("db", 5432), ("web", 8080)] {
        let d: Cluster = decode(find(&rs, CLUSTER, &direct(svc, port)));
        assert_eq!(
            (d.cluster_discovery_type, d.lb_policy),
            (
                Some(ClusterDiscoveryType::Type(
                    DiscoveryType::OriginalDst as i32
                )),
                LbPolicy::ClusterProvided as i32
            ),
            "{}",
            d.name
        );
        assert!(d.eds_cluster_config.is_none() && d.transport_socket.is_some());
        assert_eq!(
            d.upstream_bind_config, db.upstream_bind_config,
            "{}",
            d.name
        );
    }
    let bh: Cluster = decode(find(&rs, CLUSTER, "blackhole"));
    assert_eq!(
        bh.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32))
    );
    assert!(bh.load_assignment.is_none());
    check_consistency(&translate::into_set(rs), &EnvoyReferences).unwrap();
}

/// The passthrough cluster connects to the original destination from inside the
/// pod's netns with `SO_MARK` = the pod's capture mark; the captured pod's app
/// cluster carries the mark too, an uncaptured pod's does not.
#[test]
fn envoys_sockets_in_a_captured_pod_carry_its_mark() {
    let rs = translate::envoy_resources(&mesh(), &EnvoyOptions::default());
    for (pod, netns, mark) in [
        (
            "client",
            "/run/netns/client",
            translate::DEFAULT_CAPTURE_MARK,
        ),
        ("web-0", "/run/netns/web-0", 7),
    ] {
        let c: Cluster = decode(find(&rs, CLUSTER, &format!("passthrough|default/{pod}")));
        assert_eq!(
            c.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(
                DiscoveryType::OriginalDst as i32
            ))
        );
        assert_eq!(c.lb_policy, LbPolicy::ClusterProvided as i32);
        let bind = c.upstream_bind_config.as_ref().unwrap();
        let src = bind.source_address.as_ref().unwrap();
        assert_eq!(
            (
                src.address.as_str(),
                port_of(src),
                src.network_namespace_filepath.as_str()
            ),
            ("0.0.0.0", 0, netns)
        );
        assert_eq!(mark_of(&bind.socket_options), Some(i64::from(mark)));
    }
    // The captured pod's app cluster connects from the caller's address (the
    // original_src filter marks it with its own mark) to the pod's address.
    let app: Cluster = decode(find(&rs, CLUSTER, "inbound|8080|default/web-0"));
    let bind = app.upstream_bind_config.as_ref().unwrap();
    assert_eq!(mark_of(&bind.socket_options), None);
    let src = bind.source_address.as_ref().unwrap();
    assert_eq!(
        (
            src.address.as_str(),
            src.network_namespace_filepath.as_str()
        ),
        ("0.0.0.0", "/run/netns/web-0")
    );
    let endpoint = app.load_assignment.as_ref().unwrap().endpoints[0].lb_endpoints[0].clone();
    let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = endpoint.host_identifier else {
        panic!("{endpoint:?}")
    };
    assert_eq!(
        (sock(&e.address).address.as_str(), port_of(sock(&e.address))),
        ("10.0.0.2", 8080)
    );
    let old: Cluster = decode(find(&rs, CLUSTER, "inbound|8080|default/old"));
    assert_eq!(
        mark_of(&old.upstream_bind_config.unwrap().socket_options),
        None
    );
    assert!(!rs.iter().any(|r| r.name == "passthrough|default/old"));
}

/// Permissive: a TLS inspector and two chains with the same filters, mTLS for TLS
/// and plaintext for the rest. Strict: the mTLS chain alone, the very listener an
/// uncaptured pod gets.
#[test]
fn permissive_inbound_takes_plaintext_next_to_mtls_strict_only_mtls() {
    let mut m = mesh();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "inbound|default/web-0|8080"));
    let filters: Vec<&str> = l.listener_filters.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        filters,
        [
            "envoy.filters.listener.tls_inspector",
            "envoy.filters.listener.original_src"
        ]
    );
    let by_protocol: Vec<(&str, bool)> = l
        .filter_chains
        .iter()
        .map(|c| {
            (
                c.filter_chain_match
                    .as_ref()
                    .unwrap()
                    .transport_protocol
                    .as_str(),
                c.transport_socket.is_some(),
            )
        })
        .collect();
    assert_eq!(by_protocol, [("tls", true), ("raw_buffer", false)]);
    assert_eq!(l.filter_chains[0].filters, l.filter_chains[1].filters);

    let web = m.pods.iter_mut().find(|p| p.name == "web-0").unwrap();
    web.capture.as_mut().unwrap().mode = CaptureMode::Strict;
    let strict = find(
        &translate::envoy_resources(&m, &EnvoyOptions::default()),
        LISTENER,
        "inbound|default/web-0|8080",
    )
    .clone();
    m.pods
        .iter_mut()
        .find(|p| p.name == "web-0")
        .unwrap()
        .capture = None;
    let uncaptured = find(
        &translate::envoy_resources(&m, &EnvoyOptions::default()),
        LISTENER,
        "inbound|default/web-0|8080",
    )
    .clone();
    // Strict: the uncaptured pod's listener, plus the caller's address for the app.
    let l: Listener = decode(&strict);
    let plain: Listener = decode(&uncaptured);
    assert!(plain.listener_filters.is_empty());
    assert_eq!(l.filter_chains, plain.filter_chains);
    assert_eq!(l.filter_chains.len(), 1);
    assert!(l.filter_chains[0].transport_socket.is_some());
    let [original_src] = l.listener_filters.as_slice() else {
        panic!("{:?}", l.listener_filters)
    };
    assert_eq!(original_src.name, "envoy.filters.listener.original_src");
    let Some(listener_filter::ConfigType::TypedConfig(any)) = &original_src.config_type else {
        panic!("{original_src:?}")
    };
    assert_eq!(any.type_url, type_urls::ORIGINAL_SRC);
    assert_eq!(
        OriginalSrc::decode(any.value.as_slice()).unwrap(),
        OriginalSrc {
            bind_port: false,
            mark: flock_core::capture::ORIGINAL_SRC_MARK
        }
    );
}

/// With capture on the node (`capture_mark`), every mTLS cluster connects from the
/// netns its caller's outbound listener names (the `filter_state_override` local
/// address selector over wildcard addresses of both families), marked; without,
/// from the node's netns, unmarked.
#[test]
fn on_a_capturing_node_mtls_clusters_connect_from_the_callers_netns() {
    let m = mesh();
    let mtls = format!("outbound|8080|web.default|{CLIENT_ID}");
    let plain: Cluster = decode(find(
        &translate::envoy_resources(&m, &EnvoyOptions::default()),
        CLUSTER,
        &mtls,
    ));
    assert!(plain.upstream_bind_config.is_none());
    let opts = EnvoyOptions {
        capture_mark: Some(0x539),
        ..EnvoyOptions::default()
    };
    let rs = translate::envoy_resources(&m, &opts);
    for name in [mtls, format!("outbound|5432|db.default|{CLIENT_ID}")] {
        let c: Cluster = decode(find(&rs, CLUSTER, &name));
        let bind = c.upstream_bind_config.expect("a bind config");
        let sources: Vec<(&str, &str)> = std::iter::once(bind.source_address.as_ref().unwrap())
            .chain(
                bind.extra_source_addresses
                    .iter()
                    .map(|e| e.address.as_ref().unwrap()),
            )
            .map(|a| (a.address.as_str(), a.network_namespace_filepath.as_str()))
            .collect();
        assert_eq!(sources, [("0.0.0.0", ""), ("::", "")], "{name}");
        let selector = bind.local_address_selector.expect("a selector");
        assert_eq!(
            selector.name,
            "envoy.upstream.local_address_selector.filter_state_override"
        );
        assert_eq!(
            selector.typed_config.unwrap().type_url,
            type_urls::FILTER_STATE_OVERRIDE_SELECTOR
        );
        assert_eq!(mark_of(&bind.socket_options), Some(0x539), "{name}");
    }
    // The plain (non-mTLS) service clusters, shared with proxyless gRPC, are unchanged.
    let plain_cluster: Cluster = decode(find(&rs, CLUSTER, "outbound|9000|plain.default"));
    assert!(plain_cluster.upstream_bind_config.is_none());
}

/// Capture is off by default and changes nothing else: without it a mesh
/// translates to no passthrough, blackhole or TCP mTLS clusters and outbound
/// listeners on 127.0.0.1; and every resource of an uncaptured pod, every service
/// resource and route is byte-identical whether other pods are captured or not.
#[test]
fn without_capture_the_translation_is_unchanged() {
    let captured = mesh();
    let mut plain = captured.clone();
    for p in &mut plain.pods {
        p.capture = None;
    }
    // The JSON form leaves the field out, so a mesh without capture serialises as
    // it did before the field existed.
    assert!(
        !String::from_utf8(serde_json::to_vec(&plain).unwrap())
            .unwrap()
            .contains("capture")
    );
    let opts = EnvoyOptions::default();
    let a = translate::envoy_resources(&captured, &opts);
    let b = translate::envoy_resources(&plain, &opts);
    assert!(
        !b.iter()
            .any(|r| r.name.starts_with("passthrough|") || r.name == "blackhole")
    );
    assert!(
        !b.iter()
            .any(|r| r.name == format!("outbound|5432|db.default|{CLIENT_ID}"))
    );
    for r in b
        .iter()
        .filter(|r| r.type_url == LISTENER && r.name.starts_with("outbound|"))
    {
        let l: Listener = decode(r);
        assert_eq!(sock(&l.address).address, "127.0.0.1");
        assert!(l.listener_filters.is_empty() && l.default_filter_chain.is_none());
    }
    let a_names: HashSet<(&str, &str)> = a.iter().map(|r| (r.type_url, r.name.as_str())).collect();
    let changed: BTreeSet<&str> = b
        .iter()
        .filter(|r| {
            !a_names.contains(&(r.type_url, r.name.as_str()))
                || find(&a, r.type_url, &r.name).hash != r.hash
        })
        .map(|r| r.name.as_str())
        .collect();
    let want: BTreeSet<&str> = [
        "outbound|default/client",
        "outbound|default/web-0",
        "inbound|default/web-0|8080",
        "inbound|8080|default/web-0",
    ]
    .into();
    assert_eq!(changed, want);
}

/// An IPv6 pod's outbound listener binds `[::]` taking IPv4 too, its explicit chain
/// covers both loopbacks, and its passthrough connects from `::`.
#[test]
fn an_ipv6_pod_binds_both_families() {
    let m = Mesh::from_json(
        br#"{"pods": [{"name": "v6", "ip": "fd00::5", "netns": "/run/netns/v6", "capture": {}}]}"#,
    )
    .unwrap();
    let rs = translate::envoy_resources(&m, &EnvoyOptions::default());
    let l: Listener = decode(find(&rs, LISTENER, "outbound|default/v6"));
    let a = sock(&l.address);
    assert_eq!((a.address.as_str(), a.ipv4_compat), ("::", true));
    let explicit: Vec<_> = l.filter_chains.iter().map(matched).collect();
    assert_eq!(
        explicit,
        [
            (
                15001,
                vec!["127.0.0.1/32".to_string(), "::1/128".to_string()]
            ),
            (15001, vec![])
        ]
    );
    let c: Cluster = decode(find(&rs, CLUSTER, "passthrough|default/v6"));
    assert_eq!(
        c.upstream_bind_config
            .unwrap()
            .source_address
            .unwrap()
            .address,
        "::"
    );
}

/// Capture needs a netns (else the wildcard listener would take the node's
/// connections), an outbound listener and a non-zero mark; the JSON form defaults
/// the mode to strict and the mark to 0x539, and refuses unknown fields.
#[test]
fn capture_is_validated() {
    let errors = |pod: &str| -> Vec<String> {
        match Mesh::from_json(format!(r#"{{"pods": [{pod}]}}"#).as_bytes()) {
            Ok(_) => Vec::new(),
            Err(e) => e.to_string().lines().map(String::from).collect(),
        }
    };
    let e = errors(r#"{"name": "a", "ip": "10.0.0.1", "capture": {}}"#);
    assert!(
        e.iter()
            .any(|l| l.contains("pods[0].capture: capture needs a netns")),
        "{e:?}"
    );
    let e = errors(
        r#"{"name": "a", "ip": "10.0.0.1", "netns": "/run/netns/a", "outbound_port": 0, "capture": {}}"#,
    );
    assert!(
        e.iter()
            .any(|l| l.contains("pods[0].capture: capture needs an outbound listener")),
        "{e:?}"
    );
    let e = errors(
        r#"{"name": "a", "ip": "10.0.0.1", "netns": "/run/netns/a", "capture": {"mark": 0}}"#,
    );
    assert!(
        e.iter()
            .any(|l| l.contains("pods[0].capture.mark: mark must not be 0")),
        "{e:?}"
    );
    let e = errors(
        r#"{"name": "a", "ip": "10.0.0.1", "netns": "/run/netns/a", "capture": {"mod": "strict"}}"#,
    );
    assert!(e.iter().any(|l| l.contains("unknown field `mod`")), "{e:?}");

    let m = Mesh::from_json(
        br#"{"pods": [{"name": "a", "ip": "10.0.0.1", "netns": "/run/netns/a", "capture": {}}]}"#,
    )
    .unwrap();
    assert_eq!(
        m.pods[0].capture,
        Some(translate::Capture {
            mode: CaptureMode::Strict,
            mark: 0x539
        })
    );
}
