//! Translation for the node-local Envoy: per-pod inbound and outbound listeners and
//! app clusters, per-service-port EDS clusters and endpoints, the shared outbound
//! route configuration, and secrets. See the [module docs](super) for the names.

use super::model::{
    Capture, CaptureMode, Endpoint, Health, Locality, Mesh, Pod, Protocol, Secret, SecretKind,
    Service, ServicePort, ambiguous_service_names, identity_prefix, ip_host, port_endpoints,
    trust_domain,
};
use super::{Resource, names, type_urls};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, VIRTUAL_HOST};
use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster, OutlierDetection,
    cluster::{
        ClusterDiscoveryType, DiscoveryType, EdsClusterConfig, LbPolicy, TransportSocketMatch,
    },
};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, BindConfig, CidrRange, ConfigSource, DataSource,
    ExtraSourceAddress, HealthStatus, Http2ProtocolOptions, Locality as PbLocality, Metadata,
    SocketAddress, SocketOption, SubstitutionFormatString, TrafficDirection, TypedExtensionConfig,
    address, config_source::ConfigSourceSpecifier, data_source, socket_address, socket_option,
    substitution_format_string,
};
use envoy_types::pb::envoy::config::core::v3::{TransportSocket, transport_socket};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint as PbEndpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher, RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch, Vhds,
    VirtualHost, header_matcher, retry_policy, route, route_action, route_match,
};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{
    FilterStateValue, filter_state_value,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::original_src::v3::OriginalSrc;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterStateConfig;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::local_address_selectors::filter_state_override::v3::Config as FilterStateOverrideSelector;
use envoy_types::pb::envoy::extensions::retry::host::previous_hosts::v3::PreviousHostsPredicate;
use envoy_types::pb::envoy::extensions::retry::priority::previous_priorities::v3::PreviousPrioritiesConfig;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
    Secret as PbSecret, SubjectAltNameMatcher, TlsCertificate, UpstreamTlsContext,
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    secret,
    subject_alt_name_matcher::SanType,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    HttpProtocolOptions, http_protocol_options,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    RegexMatcher, StringMatcher, string_matcher::MatchPattern,
};
use envoy_types::pb::google::protobuf::{
    Any, BoolValue, Duration, Struct as PbStruct, UInt32Value, Value as PbValue, value as pb_value,
};
use flock_core::capture::ORIGINAL_SRC_MARK;
use prost::Message;
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::net::IpAddr;

/// Settings of the Envoy translation that are not part of the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyOptions {
    /// The cluster DNS domain for the long host names of services
    /// (`<svc>.<ns>.svc.<cluster_domain>`). Default `cluster.local`.
    pub cluster_domain: String,
    /// Connect timeout of the per-pod app clusters, in milliseconds. Default 1000.
    pub inbound_connect_timeout_ms: u32,
    /// The locality of the node the translation is for (the agent's `--region` and
    /// `--zone`; the sub-zone is not used). With one, each service port's endpoints
    /// get priorities (`load_assignment`): the same region and zone first, then
    /// the same region, then the rest, so callers stay in their zone and fail over
    /// when it has no healthy endpoint left. `None` (the default), or a locality
    /// whose region and zone are both empty: every endpoint has priority 0.
    pub local_locality: Option<Locality>,
    /// Per-try timeout of the outbound routes' idempotent requests, in milliseconds
    /// (default 5000; 0: none, the route timeout). A request on a connection to a
    /// node that vanished without a reset (powered off, link down) gets no answer;
    /// this bounds the wait before it is retried on another endpoint. It also bounds
    /// a slow idempotent request: one that legitimately takes longer is cut and
    /// retried, so keep it above the slowest expected response.
    pub retry_per_try_timeout_ms: u32,
    /// Transparent capture is on on this node (the agent's `--capture` is not `off`),
    /// with this `SO_MARK` for Envoy's sockets in captured pods. The mTLS clusters
    /// then connect from inside the calling pod's netns when the caller is a captured
    /// pod (its outbound listener names the netns: [`capture_listener`]), marked, so
    /// the callee sees the caller's own pod address (and shows it to its app). `None`
    /// (the default): every mTLS connection is made from the node's netns, unmarked
    /// (Envoy needs no `CAP_NET_ADMIN` then).
    pub capture_mark: Option<u32>,
    /// The bootstrap's cluster of the agent's gRPC access log service (flock's
    /// bootstrap: `xds`, the agent's xDS socket). With one, each inbound port under an
    /// authorization policy streams its denials there, for the agent's per-policy
    /// denial counter and its one log line per caller. `None` (the default): Envoy's
    /// `rbac.denied` stats only. Envoy refuses a listener naming a cluster its
    /// bootstrap lacks, so set it only for a bootstrap that has it.
    pub denial_log_cluster: Option<String>,
    /// Tracing: every HTTP connection manager (outbound and inbound listeners) runs
    /// Envoy's OpenTelemetry tracer to this collector ([`super::telemetry`]), and the
    /// collector's cluster is published with the mesh. `None` (the default): no
    /// tracing.
    pub tracing: Option<super::telemetry::TracingOptions>,
    /// Access logs: every inbound port streams one entry per request or connection
    /// (sampled) to the agent's gRPC access log service
    /// ([`super::telemetry`]). `None` (the default): no access log. The cluster must
    /// be in the bootstrap, as for `denial_log_cluster`.
    pub access_log: Option<super::telemetry::AccessLogOptions>,
    /// Outbound virtual hosts over VHDS: each outbound route configuration is served
    /// empty but for a VHDS source (ADS), and each of its virtual hosts is its own
    /// `VirtualHost` resource named `<route configuration>/<svc>.<ns>:<port>`
    /// (docs/xds.md, "Virtual hosts over VHDS"). A route change then replaces one
    /// service's virtual hosts, not a route configuration holding every service's.
    /// Only for an Envoy on a Delta ADS
    /// stream (`DELTA_GRPC`, as flock's bootstrap): Envoy refuses VHDS over
    /// state-of-the-world. Default false.
    pub vhds: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        EnvoyOptions {
            cluster_domain: "cluster.local".to_string(),
            inbound_connect_timeout_ms: 1000,
            local_locality: None,
            retry_per_try_timeout_ms: 5000,
            capture_mark: None,
            denial_log_cluster: None,
            access_log: None,
            tracing: None,
            vhds: false,
        }
    }
}

/// Encodes `msg` as an `Any` of `type_url`.
pub(crate) fn any<M: Message>(type_url: &str, msg: &M) -> Any {
    Any {
        type_url: type_url.to_string(),
        value: msg.encode_to_vec(),
    }
}

/// `ConfigSource { ads {} , resource_api_version: V3 }`.
pub(crate) fn ads() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

pub(crate) fn socket_address(ip: IpAddr, port: u16, netns: Option<&str>) -> SocketAddress {
    SocketAddress {
        protocol: socket_address::Protocol::Tcp as i32,
        address: ip.to_string(),
        port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
        network_namespace_filepath: netns.unwrap_or_default().to_string(),
        ..Default::default()
    }
}

pub(crate) fn address_of(sa: SocketAddress) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(sa)),
    }
}

/// `ms` milliseconds as a protobuf `Duration`.
pub(crate) fn duration_ms_u64(ms: u64) -> Duration {
    Duration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

fn duration_ms(ms: u32) -> Duration {
    Duration {
        seconds: i64::from(ms / 1000),
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// The router HTTP filter (must be last in a filter chain).
pub(crate) fn router_filter() -> HttpFilter {
    HttpFilter {
        name: "envoy.filters.http.router".to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(
            type_urls::ROUTER,
            &Router::default(),
        ))),
        ..Default::default()
    }
}

/// An HTTP RBAC filter enforcing one authorization layer (`super::authz`).
pub(crate) fn rbac_http_filter(layer: &super::authz::RbacLayer, stat_prefix: &str) -> HttpFilter {
    HttpFilter {
        name: format!("envoy.filters.http.rbac.{}", layer.name),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(
            super::authz::HTTP_RBAC,
            &super::authz::http_filter(layer, stat_prefix),
        ))),
        ..Default::default()
    }
}

/// An HTTP connection manager whose routes come over RDS on the ADS stream.
pub(crate) fn hcm_rds(stat_prefix: &str, route_config_name: &str) -> HttpConnectionManager {
    HttpConnectionManager {
        stat_prefix: stat_prefix.to_string(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_config_name.to_string(),
        })),
        http_filters: vec![router_filter()],
        ..Default::default()
    }
}

/// A route matching `prefix` and sending everything to `cluster`.
pub(crate) fn route_to(prefix: &str, cluster: &str) -> Route {
    Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix(prefix.to_string())),
            ..Default::default()
        }),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.to_string())),
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(crate) fn network_filter(name: &str, type_url: &str, value: Vec<u8>) -> Filter {
    Filter {
        name: name.to_string(),
        config_type: Some(filter::ConfigType::TypedConfig(Any {
            type_url: type_url.to_string(),
            value,
        })),
    }
}

/// `typed_extension_protocol_options` that make a cluster speak HTTP/2 (prior
/// knowledge) to its upstream.
pub(crate) fn http2_options(cluster: &mut Cluster) {
    let opts = HttpProtocolOptions {
        upstream_protocol_options: Some(
            http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                http_protocol_options::ExplicitHttpConfig {
                    protocol_config: Some(
                        http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(
                            Http2ProtocolOptions::default(),
                        ),
                    ),
                },
            ),
        ),
        ..Default::default()
    };
    // One entry: a map of one element encodes deterministically.
    cluster.typed_extension_protocol_options.insert(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
        any(type_urls::HTTP_PROTOCOL_OPTIONS, &opts),
    );
}

fn resource(type_url: &'static str, name: String, any: Any) -> Resource {
    Resource::new(type_url, name, any)
}

pub(crate) fn stat_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The resources of one pod: per inbound port a listener on the pod IP and an app
/// cluster reaching `127.0.0.1:app_port` inside the pod, and the outbound listener
/// (unless `outbound_port` is 0), which uses the route configuration
/// [`OUTBOUND_ROUTE`](names::OUTBOUND_ROUTE) from [`outbound_routes`].
///
/// Listeners and clusters carry `network_namespace_filepath = pod.netns`.
///
/// A captured pod ([`Pod::capture`]) instead gets its passthrough cluster
/// `passthrough|<ns>/<pod>` here (its outbound listener depends on the services:
/// [`capture_listener`]), `SO_MARK` on its app clusters, and in permissive mode a
/// plaintext chain next to the mTLS one on its inbound listeners.
pub fn pod_resources(pod: &Pod, opts: &EnvoyOptions) -> Vec<Resource> {
    let netns = pod.netns.as_deref();
    let capture = pod.capture.as_ref();
    let mut out = Vec::with_capacity(2 * pod.inbound.len() + 1);
    // A proxyless port is served by the app itself (`super::grpc`): nothing of Envoy's.
    for ib in pod.inbound.iter().filter(|ib| !ib.proxyless) {
        let cluster_name = names::inbound_cluster(pod, ib.app_port);
        let listener_name = names::inbound_listener(pod, ib.app_port);
        let stat_prefix = format!(
            "inbound_{}_{}_{}",
            stat_safe(&pod.namespace),
            stat_safe(&pod.name),
            ib.app_port
        );

        // Who may call: RBAC on the verified peer certificate, before the router or
        // the TCP proxy (none without a policy).
        let authz = ib
            .authz
            .as_ref()
            .map(|a| {
                super::authz::layers(
                    &a.effective(&pod.namespace),
                    &a.service_ports,
                    ib.protocol.is_http(),
                )
            })
            .unwrap_or_default();
        let authz_prefix = format!(
            "authz_{}_{}_{}_",
            stat_safe(&pod.namespace),
            stat_safe(&pod.name),
            ib.app_port
        );
        // The port's denials to the agent's access log service (with a policy only),
        // each entry tagged with the port by the chain's first filter.
        let denial_log = opts
            .denial_log_cluster
            .as_deref()
            .filter(|_| !authz.is_empty());
        let denial_tag = denial_log.map(|_| {
            let policy = ib.authz.as_ref().map_or("", |a| a.governed_by.as_str());
            super::authz::denial_port_tag(policy, &pod.namespace, &pod.name, ib.app_port)
        });
        let access_log = opts.access_log.as_ref();
        let access_tag = access_log
            .map(|_| super::telemetry::access_port_tag(&pod.namespace, &pod.name, ib.app_port));
        let port_tag = (denial_tag.is_some() || access_tag.is_some()).then(|| {
            network_filter(
                "envoy.filters.network.set_filter_state",
                type_urls::SET_FILTER_STATE,
                super::telemetry::port_tags(access_tag.as_deref(), denial_tag.as_deref())
                    .encode_to_vec(),
            )
        });
        let mut listener_access_log = Vec::new();
        let filters: Vec<Filter> = if ib.protocol.is_http() {
            let hcm = HttpConnectionManager {
                access_log: denial_log
                    .and_then(|cluster| {
                        super::authz::http_denial_log(&authz, &authz_prefix, cluster)
                    })
                    .into_iter()
                    .chain(access_log.map(super::telemetry::http_access_log))
                    .collect(),
                tracing: opts.tracing.as_ref().map(super::telemetry::hcm_tracing),
                stat_prefix,
                route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
                    RouteConfiguration {
                        name: cluster_name.clone(),
                        virtual_hosts: vec![VirtualHost {
                            name: "inbound".to_string(),
                            domains: vec!["*".to_string()],
                            routes: vec![route_to("/", &cluster_name)],
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                )),
                http_filters: authz
                    .iter()
                    .map(|layer| rbac_http_filter(layer, &authz_prefix))
                    .chain([router_filter()])
                    .collect(),
                // The app learns the verified caller's SPIFFE ID from
                // `x-forwarded-client-cert: ...;URI=spiffe://...`. SANITIZE_SET
                // replaces whatever XFCC the caller sent, and on a connection without
                // a client certificate (plaintext) only removes it, so no caller can
                // forge an identity.
                forward_client_cert_details:
                    http_connection_manager::ForwardClientCertDetails::SanitizeSet as i32,
                set_current_client_cert_details: Some(
                    http_connection_manager::SetCurrentClientCertDetails {
                        uri: true,
                        ..Default::default()
                    },
                ),
                ..Default::default()
            };
            port_tag
                .into_iter()
                .chain([network_filter(
                    "envoy.filters.network.http_connection_manager",
                    type_urls::HCM,
                    hcm.encode_to_vec(),
                )])
                .collect()
        } else {
            listener_access_log.extend(denial_log.map(super::authz::tcp_denial_log));
            listener_access_log.extend(access_log.map(super::telemetry::tcp_access_log));
            let tcp = TcpProxy {
                stat_prefix,
                cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster_name.clone())),
                ..Default::default()
            };
            port_tag
                .into_iter()
                .chain(authz.iter().map(|layer| {
                    network_filter(
                        "envoy.filters.network.rbac",
                        super::authz::NETWORK_RBAC,
                        super::authz::network_filter(layer, &authz_prefix).encode_to_vec(),
                    )
                }))
                .chain([network_filter(
                    "envoy.filters.network.tcp_proxy",
                    type_urls::TCP_PROXY,
                    tcp.encode_to_vec(),
                )])
                .collect()
        };
        let tls = pod.identity.as_deref().and_then(server_tls);
        let permissive = capture.is_some_and(|c| c.mode == CaptureMode::Permissive);
        let (listener_filters, filter_chains) = match tls {
            // Permissive capture: the TLS inspector tells a mesh caller (TLS) from a
            // caller outside the mesh (anything else), which reaches the app in
            // plaintext.
            Some(tls) if permissive => (
                vec![listener_filter(
                    "envoy.filters.listener.tls_inspector",
                    &TlsInspector::default(),
                    type_urls::TLS_INSPECTOR,
                )],
                vec![
                    FilterChain {
                        filter_chain_match: Some(FilterChainMatch {
                            transport_protocol: "tls".to_string(),
                            ..Default::default()
                        }),
                        filters: filters.clone(),
                        transport_socket: Some(tls),
                        name: "mtls".to_string(),
                        ..Default::default()
                    },
                    FilterChain {
                        filter_chain_match: Some(FilterChainMatch {
                            transport_protocol: "raw_buffer".to_string(),
                            ..Default::default()
                        }),
                        filters,
                        name: "plaintext".to_string(),
                        ..Default::default()
                    },
                ],
            ),
            tls => (
                Vec::new(),
                vec![FilterChain {
                    filters,
                    transport_socket: tls,
                    ..Default::default()
                }],
            ),
        };
        let mut listener_filters = listener_filters;
        // The app sees each caller's own address, not Envoy's: the connection to the
        // app is made from it (the pod's `output_route` chain and policy route bring
        // the app's replies back to Envoy; `flock_core::capture::OriginalSrc`). The
        // mutant connects from the pod's loopback, and every caller is 127.0.0.1 to
        // the app (localhost-only admin endpoints, Redis protected mode trust that).
        let original_src =
            capture.is_some() && !flock_core::reintroduced!("capture-inbound-from-loopback");
        if original_src {
            listener_filters.push(listener_filter(
                "envoy.filters.listener.original_src",
                &OriginalSrc {
                    bind_port: false,
                    mark: ORIGINAL_SRC_MARK,
                },
                type_urls::ORIGINAL_SRC,
            ));
        }
        let listener = Listener {
            name: listener_name.clone(),
            address: Some(address_of(socket_address(pod.ip, ib.listen_port, netns))),
            filter_chains,
            listener_filters,
            traffic_direction: TrafficDirection::Inbound as i32,
            access_log: listener_access_log,
            ..Default::default()
        };
        out.push(resource(LISTENER, listener_name, any(LISTENER, &listener)));

        let loopback: IpAddr = std::net::Ipv4Addr::LOCALHOST.into();
        // With the caller's address as the source, the app is reached on the pod's
        // address (a non-local source to 127.0.0.1 is a martian the kernel drops), so
        // an app listening on loopback only is not reachable through the mesh either.
        let (app_ip, bind_ip, bind_options) = if original_src {
            (pod.ip, unspecified_like(pod.ip), Vec::new())
        } else {
            (
                loopback,
                loopback,
                capture.map(|c| vec![so_mark(c.mark)]).unwrap_or_default(),
            )
        };
        let mut cluster = Cluster {
            name: cluster_name.clone(),
            cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
            connect_timeout: Some(duration_ms(opts.inbound_connect_timeout_ms)),
            lb_policy: LbPolicy::RoundRobin as i32,
            // The endpoint may not carry a namespace; the bind address does, so Envoy
            // (in the host namespace) connects from inside the pod to its loopback.
            load_assignment: Some(ClusterLoadAssignment {
                cluster_name: cluster_name.clone(),
                endpoints: vec![LocalityLbEndpoints {
                    lb_endpoints: vec![LbEndpoint {
                        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(PbEndpoint {
                            address: Some(address_of(socket_address(app_ip, ib.app_port, None))),
                            ..Default::default()
                        })),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }),
            upstream_bind_config: Some(BindConfig {
                source_address: Some(socket_address(bind_ip, 0, netns)),
                socket_options: bind_options,
                ..Default::default()
            }),
            ..Default::default()
        };
        if ib.protocol == Protocol::Grpc {
            http2_options(&mut cluster);
        }
        out.push(resource(CLUSTER, cluster_name, any(CLUSTER, &cluster)));
    }
    if let Some(c) = capture {
        // The outbound listener of a captured pod depends on the services
        // ([`capture_listener`]).
        out.push(passthrough_cluster(pod, c));
    } else if pod.outbound_port != 0 {
        let name = names::outbound_listener(pod);
        let hcm = outbound_hcm(pod, opts);
        let listener = Listener {
            name: name.clone(),
            address: Some(address_of(socket_address(
                std::net::Ipv4Addr::LOCALHOST.into(),
                pod.outbound_port,
                netns,
            ))),
            filter_chains: vec![FilterChain {
                filters: vec![network_filter(
                    "envoy.filters.network.http_connection_manager",
                    type_urls::HCM,
                    hcm.encode_to_vec(),
                )],
                ..Default::default()
            }],
            traffic_direction: TrafficDirection::Outbound as i32,
            ..Default::default()
        };
        out.push(resource(LISTENER, name, any(LISTENER, &listener)));
    }
    out
}

/// The HTTP connection manager of a pod's outbound listener: the outbound routes
/// of its identity (or the shared ones), by `Host`.
fn outbound_hcm(pod: &Pod, opts: &EnvoyOptions) -> HttpConnectionManager {
    let mut hcm = hcm_rds(
        &outbound_stat_prefix(pod),
        &match &pod.identity {
            Some(id) => names::outbound_route_for(id),
            None => names::OUTBOUND_ROUTE.to_string(),
        },
    );
    hcm.tracing = opts.tracing.as_ref().map(super::telemetry::hcm_tracing);
    hcm
}

fn outbound_stat_prefix(pod: &Pod) -> String {
    format!(
        "outbound_{}_{}",
        stat_safe(&pod.namespace),
        stat_safe(&pod.name)
    )
}

/// `SOL_SOCKET` (Linux `asm-generic/socket.h`).
const SOL_SOCKET: i64 = 1;
/// `SO_MARK` (Linux `asm-generic/socket.h`).
const SO_MARK: i64 = 36;

/// The socket option `SO_MARK = mark`, set before `bind` (a mark set later would
/// miss nothing here, but pre-bind is where Envoy applies upstream options anyway).
fn so_mark(mark: u32) -> SocketOption {
    SocketOption {
        description: "SO_MARK: capture rules let Envoy's own connections out".to_string(),
        level: SOL_SOCKET,
        name: SO_MARK,
        value: Some(socket_option::Value::IntValue(i64::from(mark))),
        state: socket_option::SocketState::StatePrebind as i32,
        ..Default::default()
    }
}

/// The filter state key Envoy's `filter_state_override` local address selector reads:
/// the network namespace an upstream connection is made in.
const UPSTREAM_NETNS_KEY: &str = "envoy.network.upstream_bind_override.network_namespace";

/// A `set_filter_state` network filter naming `netns` as the netns of the
/// connection's upstreams. `envoy.hashable_string`: connection pools are keyed by the
/// hashable objects shared with the upstream, so two pods never share a connection (a
/// plain `envoy.string` is not hashed, and a second pod's requests would ride the
/// first pod's connection, from the first pod's address). A netns path with a `%`
/// would be read as a format command: such a path (no runtime makes one) is not named.
fn upstream_netns_filter(netns: &str) -> Filter {
    let value = (!netns.contains('%')).then(|| SubstitutionFormatString {
        format: Some(substitution_format_string::Format::TextFormatSource(
            DataSource {
                specifier: Some(data_source::Specifier::InlineString(netns.to_string())),
                ..Default::default()
            },
        )),
        ..Default::default()
    });
    let config = SetFilterStateConfig {
        on_new_connection: value
            .map(|v| FilterStateValue {
                key: Some(filter_state_value::Key::ObjectKey(
                    UPSTREAM_NETNS_KEY.to_string(),
                )),
                factory_key: "envoy.hashable_string".to_string(),
                value: Some(filter_state_value::Value::FormatString(v)),
                shared_with_upstream: filter_state_value::SharedWithUpstream::Once as i32,
                ..Default::default()
            })
            .into_iter()
            .collect(),
        ..Default::default()
    };
    network_filter(
        "envoy.filters.network.set_filter_state",
        type_urls::SET_FILTER_STATE,
        config.encode_to_vec(),
    )
}

/// The bind config of an mTLS cluster on a node with capture: the wildcard address of
/// the endpoint's family, in the netns the caller's outbound listener names (Envoy's
/// `filter_state_override` selector; a caller that names none connects from the
/// node's netns, as without capture), marked so the caller's capture rules let the
/// connection out instead of redirecting it back to Envoy.
fn caller_netns_bind(mark: u32) -> BindConfig {
    BindConfig {
        source_address: Some(socket_address(
            std::net::Ipv4Addr::UNSPECIFIED.into(),
            0,
            None,
        )),
        extra_source_addresses: vec![ExtraSourceAddress {
            address: Some(socket_address(
                std::net::Ipv6Addr::UNSPECIFIED.into(),
                0,
                None,
            )),
            ..Default::default()
        }],
        local_address_selector: Some(TypedExtensionConfig {
            name: "envoy.upstream.local_address_selector.filter_state_override".to_string(),
            typed_config: Some(any(
                type_urls::FILTER_STATE_OVERRIDE_SELECTOR,
                &FilterStateOverrideSelector::default(),
            )),
        }),
        socket_options: vec![so_mark(mark)],
        ..Default::default()
    }
}

fn listener_filter<M: Message>(name: &str, config: &M, type_url: &str) -> ListenerFilter {
    ListenerFilter {
        name: name.to_string(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(any(
            type_url, config,
        ))),
        ..Default::default()
    }
}

/// Connect timeout of the passthrough clusters (`passthrough|<ns>/<pod>`):
/// destinations outside the mesh may be far away, so Envoy's default (5 s) rather
/// than the mesh's 1 s.
pub const PASSTHROUGH_CONNECT_TIMEOUT_MS: u32 = 5000;

/// The wildcard address of the pod's IP family: where a captured pod's outbound
/// listener binds and its passthrough connections are made from.
fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// `passthrough|<ns>/<pod>`: an `ORIGINAL_DST` cluster connecting to wherever a
/// captured connection was going, from inside the pod's netns (so the destination
/// sees the pod's address, as without capture) with `SO_MARK` = the capture mark
/// (so the capture rules let it out instead of redirecting it back to Envoy).
fn passthrough_cluster(pod: &Pod, capture: &Capture) -> Resource {
    let name = names::passthrough_cluster(pod);
    let cluster = Cluster {
        name: name.clone(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(
            DiscoveryType::OriginalDst as i32,
        )),
        connect_timeout: Some(duration_ms(PASSTHROUGH_CONNECT_TIMEOUT_MS)),
        lb_policy: LbPolicy::ClusterProvided as i32,
        upstream_bind_config: Some(BindConfig {
            source_address: Some(socket_address(
                unspecified_like(pod.ip),
                0,
                pod.netns.as_deref(),
            )),
            socket_options: vec![so_mark(capture.mark)],
            ..Default::default()
        }),
        ..Default::default()
    };
    resource(CLUSTER, name, any(CLUSTER, &cluster))
}

/// The cluster [`BLACKHOLE_CLUSTER`](names::BLACKHOLE_CLUSTER): STATIC without
/// endpoints, so a TCP proxy to it closes the connection. Emitted once when any pod
/// is captured.
pub fn blackhole_cluster() -> Resource {
    let cluster = Cluster {
        name: names::BLACKHOLE_CLUSTER.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(duration_ms(MESH_CONNECT_TIMEOUT_MS)),
        ..Default::default()
    };
    resource(
        CLUSTER,
        names::BLACKHOLE_CLUSTER.to_string(),
        any(CLUSTER, &cluster),
    )
}

fn tcp_proxy_filter(stat_prefix: &str, cluster: &str) -> Filter {
    let tcp = TcpProxy {
        stat_prefix: stat_prefix.to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        ..Default::default()
    };
    network_filter(
        "envoy.filters.network.tcp_proxy",
        type_urls::TCP_PROXY,
        tcp.encode_to_vec(),
    )
}

/// The HTTP connection manager of a captured pod's filter chain: inline routes (one
/// virtual host `*`: the destination address already chose the service).
fn capture_hcm(
    route_name: String,
    vhost_name: String,
    routes: Vec<Route>,
    stat_prefix: &str,
    opts: &EnvoyOptions,
) -> Filter {
    let hcm = HttpConnectionManager {
        stat_prefix: stat_prefix.to_string(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
            RouteConfiguration {
                name: route_name,
                virtual_hosts: vec![VirtualHost {
                    name: vhost_name,
                    domains: vec!["*".to_string()],
                    routes,
                    ..Default::default()
                }],
                ..Default::default()
            },
        )),
        http_filters: vec![router_filter()],
        tracing: opts.tracing.as_ref().map(super::telemetry::hcm_tracing),
        ..Default::default()
    };
    network_filter(
        "envoy.filters.network.http_connection_manager",
        type_urls::HCM,
        hcm.encode_to_vec(),
    )
}

fn cidr(ip: IpAddr) -> CidrRange {
    CidrRange {
        address_prefix: ip.to_string(),
        prefix_len: Some(UInt32Value {
            value: if ip.is_ipv4() { 32 } else { 128 },
        }),
    }
}

/// The outbound listener `outbound|<ns>/<pod>` of a captured pod (`None` if `pod`
/// is not captured). It binds the wildcard address of the pod's family on
/// `outbound_port` in the pod's netns (IPv6: `[::]`, also taking IPv4) and restores
/// each connection's original destination (the `original_dst` listener filter reads
/// it from the redirect's conntrack entry). Filter chains by destination:
///
/// * per service port (services by namespace and name, ports in order): its VIPs
///   and its serving endpoints' addresses ([`port_endpoints`]) on the service port
///   → that port's cluster, the caller's mTLS cluster when the port is mTLS and the
///   pod has an identity (the choice [`caller_resources`] makes); HTTP/gRPC ports
///   through an HTTP connection manager with the outbound retry routes (one virtual
///   host `*`: the destination already chose the service, whatever the `Host`),
///   TCP ports through a TCP proxy. An address and port claimed by an earlier
///   service port is not repeated (Envoy rejects two chains with one match);
/// * `127.0.0.1` (and `::1` for an IPv6 pod) on `outbound_port`: the app talking
///   to the outbound listener explicitly, routed by `Host` as without capture;
/// * any other address on `outbound_port` → [`BLACKHOLE_CLUSTER`](names::BLACKHOLE_CLUSTER):
///   a connection to the listener from outside the pod (it binds every address) has
///   no original destination, and passing it through would connect Envoy to itself;
/// * everything else (the default chain) → the pod's `passthrough|<ns>/<pod>` over a
///   TCP proxy, so destinations outside the mesh keep working.
pub fn capture_listener<S: Borrow<Service>>(
    pod: &Pod,
    services: &[S],
    opts: &EnvoyOptions,
) -> Option<Resource> {
    pod.capture.as_ref()?;
    let stat_prefix = outbound_stat_prefix(pod);
    let mut sorted: Vec<&Service> = services.iter().map(Borrow::borrow).collect();
    sorted.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let loopbacks: Vec<IpAddr> = match pod.ip {
        IpAddr::V4(_) => vec![std::net::Ipv4Addr::LOCALHOST.into()],
        IpAddr::V6(_) => vec![
            std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::Ipv6Addr::LOCALHOST.into(),
        ],
    };
    let mut claimed: std::collections::HashSet<(IpAddr, u16)> = loopbacks
        .iter()
        .map(|ip| (*ip, pod.outbound_port))
        .collect();
    let mut chains = Vec::new();
    // A route subset's endpoints are its Service's too: a connection to one of their
    // addresses, or to the Service's, takes the Service's chain.
    for s in sorted.into_iter().filter(|s| s.subset_of().is_none()) {
        let mut seen = std::collections::BTreeSet::new();
        for p in &s.ports {
            if !seen.insert(p.port) {
                continue;
            }
            let eps = port_endpoints(s, p.port);
            let caller = pod
                .identity
                .as_deref()
                .filter(|id| trust_domain(id).is_some());
            // An app that dials an endpoint's own address and port (a pod IP: what
            // a headless Service or a StatefulSet peer gives) reaches that endpoint,
            // not whichever the service's balancer picks, over mTLS verified against
            // that endpoint's own IDs: its set's direct cluster. These come first,
            // so they win where the endpoint's port is also the service port.
            if let (Some(id), true) = (caller, eps.mtls) {
                let peers: Vec<_> = mtls_peers(s, p.port)
                    .map(|sets| sets.into_iter().collect())
                    .unwrap_or_default();
                let mut direct: BTreeMap<(u16, usize), Vec<IpAddr>> = BTreeMap::new();
                for e in &eps.serving {
                    let Some(set) =
                        endpoint_peers(e).and_then(|ids| peers.iter().position(|p| *p == ids))
                    else {
                        continue;
                    };
                    if claimed.insert((e.address, e.port)) {
                        direct.entry((e.port, set)).or_default().push(e.address);
                    }
                }
                for ((port, set), ips) in direct {
                    let cluster = names::direct_cluster(s, p.port, id, set);
                    let filter = if p.protocol.is_http() {
                        capture_hcm(
                            format!("{}|direct-{set}", names::capture_route(s, p.port)),
                            names::service_authority(s, p.port),
                            outbound_service_routes(&cluster, opts),
                            &stat_prefix,
                            opts,
                        )
                    } else {
                        tcp_proxy_filter(&stat_prefix, &cluster)
                    };
                    chains.push(FilterChain {
                        filter_chain_match: Some(FilterChainMatch {
                            destination_port: Some(UInt32Value {
                                value: u32::from(port),
                            }),
                            prefix_ranges: ips.into_iter().map(cidr).collect(),
                            ..Default::default()
                        }),
                        filters: vec![filter],
                        name: format!(
                            "{}|{port}|direct-{set}",
                            names::service_authority(s, p.port)
                        ),
                        ..Default::default()
                    });
                }
            }
            let mut ips: Vec<IpAddr> = s.vips.clone();
            ips.extend(eps.serving.iter().map(|e| e.address));
            ips.retain(|ip| claimed.insert((*ip, p.port)));
            if ips.is_empty() {
                continue;
            }
            let cluster = match (caller, eps.mtls) {
                (Some(id), true) => names::mtls_cluster(s, p.port, id),
                _ => names::outbound_cluster(s, p.port),
            };
            let filter = if p.protocol.is_http() {
                // A routed service's port follows its rules here too: an unmodified
                // app dialing the Service's address gets the same split, matches and
                // retries as one naming it in `Host`.
                let mut rules = super::policy::rules_of(s, p.port).peekable();
                let routes = if rules.peek().is_some() {
                    let own_mtls = eps.mtls;
                    super::policy::policy_routes(
                        rules,
                        opts.retry_per_try_timeout_ms,
                        &|ns, name, port, backend_mtls| match caller {
                            Some(id) if backend_mtls.unwrap_or(own_mtls) => {
                                names::mtls_cluster_of(name, ns, port, id)
                            }
                            _ => names::outbound_cluster_of(name, ns, port),
                        },
                        super::policy::Flavor::Envoy,
                    )
                } else {
                    outbound_service_routes(&cluster, opts)
                };
                capture_hcm(
                    names::capture_route(s, p.port),
                    names::service_authority(s, p.port),
                    routes,
                    &stat_prefix,
                    opts,
                )
            } else {
                tcp_proxy_filter(&stat_prefix, &cluster)
            };
            chains.push(FilterChain {
                filter_chain_match: Some(FilterChainMatch {
                    destination_port: Some(UInt32Value {
                        value: u32::from(p.port),
                    }),
                    prefix_ranges: ips.into_iter().map(cidr).collect(),
                    ..Default::default()
                }),
                filters: vec![filter],
                name: names::service_authority(s, p.port),
                ..Default::default()
            });
        }
    }
    let on_listener_port = |prefix_ranges| {
        Some(FilterChainMatch {
            destination_port: Some(UInt32Value {
                value: u32::from(pod.outbound_port),
            }),
            prefix_ranges,
            ..Default::default()
        })
    };
    chains.push(FilterChain {
        filter_chain_match: on_listener_port(loopbacks.into_iter().map(cidr).collect()),
        filters: vec![network_filter(
            "envoy.filters.network.http_connection_manager",
            type_urls::HCM,
            outbound_hcm(pod, opts).encode_to_vec(),
        )],
        name: "explicit".to_string(),
        ..Default::default()
    });
    chains.push(FilterChain {
        filter_chain_match: on_listener_port(Vec::new()),
        filters: vec![tcp_proxy_filter(&stat_prefix, names::BLACKHOLE_CLUSTER)],
        name: "blackhole".to_string(),
        ..Default::default()
    });
    // Every connection of this listener names the pod's netns for its upstream: the
    // mTLS clusters connect from there (`EnvoyOptions::capture_mark`), so the callee
    // sees this pod's address. The mutant leaves it out: they connect from the node.
    if let Some(netns) = pod
        .netns
        .as_deref()
        .filter(|_| !flock_core::reintroduced!("capture-outbound-from-node"))
    {
        let state = upstream_netns_filter(netns);
        for chain in &mut chains {
            chain.filters.insert(0, state.clone());
        }
    }
    let name = names::outbound_listener(pod);
    let wildcard = unspecified_like(pod.ip);
    let mut address = socket_address(wildcard, pod.outbound_port, pod.netns.as_deref());
    address.ipv4_compat = wildcard.is_ipv6();
    let listener = Listener {
        name: name.clone(),
        address: Some(address_of(address)),
        listener_filters: vec![listener_filter(
            "envoy.filters.listener.original_dst",
            &OriginalDst::default(),
            type_urls::ORIGINAL_DST,
        )],
        filter_chains: chains,
        default_filter_chain: Some(FilterChain {
            filters: vec![tcp_proxy_filter(
                &stat_prefix,
                &names::passthrough_cluster(pod),
            )],
            name: "passthrough".to_string(),
            ..Default::default()
        }),
        traffic_direction: TrafficDirection::Outbound as i32,
        ..Default::default()
    };
    Some(resource(LISTENER, name, any(LISTENER, &listener)))
}

/// The clusters only captured pods with SPIFFE ID `identity` route to: the mTLS
/// clusters of the TCP service ports ([`caller_resources`] makes those of the
/// HTTP/gRPC ports; without capture nothing routes to a TCP port's mTLS cluster), and
/// every mTLS port's direct clusters (`ORIGINAL_DST`, one per set of accepted IDs).
/// Empty if `identity` is not a SPIFFE ID.
pub fn capture_caller_resources<S: Borrow<Service>>(
    identity: &str,
    services: &[S],
    opts: &EnvoyOptions,
) -> Vec<Resource> {
    let Some(td) = trust_domain(identity) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    // The capture listener has no chain of a route subset's ([`capture_listener`]).
    for s in services.iter().map(Borrow::borrow) {
        if s.subset_of().is_some() {
            continue;
        }
        let mut seen = std::collections::BTreeSet::new();
        for p in &s.ports {
            if !seen.insert(p.port) {
                continue;
            }
            if let Some(peers) = mtls_peers(s, p.port) {
                direct_clusters(s, p, identity, td, &peers, opts, &mut out);
                if !p.protocol.is_http() {
                    mtls_cluster(s, p, identity, td, peers, opts, &mut out);
                }
            }
        }
    }
    out
}

/// The direct clusters of a service port for captured callers with `identity`: per
/// set of accepted IDs among its serving endpoints (`peers`, in order), an
/// `ORIGINAL_DST` cluster to the address the app dialled, opened from the caller's
/// netns with the capture mark like [`mtls_cluster`]'s, that presents the caller's
/// certificate and accepts exactly that set: the capture listener sends a connection
/// to an endpoint's own address and port here ([`capture_listener`]), so it meets
/// that endpoint, verified as itself.
fn direct_clusters(
    s: &Service,
    p: &ServicePort,
    identity: &str,
    td: &str,
    peers: &std::collections::BTreeSet<std::collections::BTreeSet<&str>>,
    opts: &EnvoyOptions,
    out: &mut Vec<Resource>,
) {
    for (set, ids) in peers.iter().enumerate() {
        let name = names::direct_cluster(s, p.port, identity, set);
        let mut cluster = outbound_cluster(s, p.port, p.protocol);
        cluster.name = name.clone();
        cluster.cluster_discovery_type = Some(ClusterDiscoveryType::Type(
            DiscoveryType::OriginalDst as i32,
        ));
        cluster.eds_cluster_config = None;
        cluster.lb_policy = LbPolicy::ClusterProvided as i32;
        // One host, the one dialled: nothing to eject it in favour of.
        cluster.outlier_detection = None;
        cluster.upstream_bind_config = opts.capture_mark.map(caller_netns_bind);
        let ctx = UpstreamTlsContext {
            common_tls_context: Some(common_tls(
                identity,
                td,
                san_patterns(ids.iter().copied())
                    .into_iter()
                    .map(uri_san)
                    .collect(),
            )),
            ..Default::default()
        };
        cluster.transport_socket = Some(tls_socket(type_urls::UPSTREAM_TLS, ctx.encode_to_vec()));
        out.push(resource(CLUSTER, name, any(CLUSTER, &cluster)));
    }
}

/// Connect timeout of the service port (mesh) clusters: short, because every
/// endpoint is a pod reached over the node network, where a connection is set up in
/// well under a millisecond; a connect that takes a second is a dead node (its
/// packets vanish, nothing answers with a reset) and the request is better retried
/// elsewhere ([`retry_policy`]) than waiting.
pub const MESH_CONNECT_TIMEOUT_MS: u32 = 1000;

/// Outlier detection of the service port (mesh) clusters: a node that dies takes its
/// endpoints with it long before the registry's lease on them expires, and every
/// request to them fails with a connect timeout or a reset. With
/// `split_external_local_origin_errors` off (the default) Envoy counts those local
/// failures as gateway errors (503/504) too, so three consecutive ones eject the
/// host within one interval of its death; five consecutive 5xx of any kind (an app
/// that only fails) also eject it. Ejection lasts `base_ejection_time` × the number
/// of ejections so far. `max_ejection_percent` 100: when a whole node (possibly all
/// of a zone's endpoints) is gone, all of them must go, and the caller's traffic
/// fails over to the next priority ([`load_assignment`]); if every endpoint of every
/// priority is ejected, Envoy's panic threshold sends to all of them anyway.
/// Success-rate ejection is off (`enforcing_success_rate` 0; Envoy's default is on):
/// it needs 5 hosts and 100 requests per interval to judge, and its statistical
/// verdict is not needed for dead nodes. Proxyless gRPC clients get the same cluster:
/// gRPC implements only the success-rate and failure-percentage algorithms, both off
/// here, so for them this is inert; they stop using a dead endpoint when its
/// connection fails (the subchannel goes to `TRANSIENT_FAILURE`).
fn outlier_detection() -> OutlierDetection {
    let percent = |value| Some(UInt32Value { value });
    OutlierDetection {
        consecutive_5xx: percent(5),
        consecutive_gateway_failure: percent(3),
        enforcing_consecutive_5xx: percent(100),
        // Envoy's default is 0: counted but never ejecting.
        enforcing_consecutive_gateway_failure: percent(100),
        enforcing_success_rate: percent(0),
        interval: Some(duration_ms(1000)),
        base_ejection_time: Some(duration_ms(5000)),
        max_ejection_percent: percent(100),
        split_external_local_origin_errors: false,
        ..Default::default()
    }
}

/// The EDS cluster of one service port (shared by Envoy and proxyless gRPC), with
/// [`outlier_detection`] and the short [`MESH_CONNECT_TIMEOUT_MS`].
pub(crate) fn outbound_cluster(service: &Service, port: u16, protocol: Protocol) -> Cluster {
    let mut cluster = Cluster {
        name: names::outbound_cluster(service, port),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        connect_timeout: Some(duration_ms(MESH_CONNECT_TIMEOUT_MS)),
        lb_policy: LbPolicy::RoundRobin as i32,
        outlier_detection: Some(outlier_detection()),
        circuit_breakers: Some(super::policy::circuit_breakers(
            service
                .pool
                .as_ref()
                .unwrap_or(&super::policy::ConnectionPool::default()),
        )),
        ..Default::default()
    };
    if protocol == Protocol::Grpc {
        http2_options(&mut cluster);
    }
    cluster
}

fn health(h: Health) -> HealthStatus {
    match h {
        Health::Healthy => HealthStatus::Healthy,
        Health::Unhealthy => HealthStatus::Unhealthy,
        Health::Draining => HealthStatus::Draining,
        Health::Unknown => HealthStatus::Unknown,
    }
}

/// How far an endpoint in `endpoint` is from the caller in `local`: 0 in the same
/// region and zone, 1 in the same region, 2 elsewhere (compared as strings, so an
/// endpoint with an empty locality is "elsewhere" from a caller that has one). 0 for
/// every endpoint when the caller's locality is unknown (`None`, or region and zone
/// both empty). The sub-zone is not compared.
fn locality_rank(local: Option<&Locality>, endpoint: &Locality) -> u32 {
    match local {
        Some(l) if !(l.region.is_empty() && l.zone.is_empty()) => {
            if l.region != endpoint.region {
                2
            } else if l.zone != endpoint.zone {
                1
            } else {
                0
            }
        }
        _ => 0,
    }
}

/// The endpoints of one service port: grouped by locality, each group with its
/// locality set and a weight equal to the sum of its endpoints' weights; endpoints
/// sorted by address and port. Of an mTLS port (one with an endpoint that has an
/// identity), only the endpoints with an identity ([`port_endpoints`]).
///
/// Each group's priority is its distance from `local` ([`locality_rank`]: same zone,
/// same region, elsewhere), renumbered densely from 0 in that order: gRPC rejects
/// an assignment whose priorities skip a number, and for Envoy an empty priority
/// would only be skipped over. Envoy sends a priority's share of the traffic to the
/// next one as its healthy (not ejected, not unhealthy) share falls below 100% ÷
/// 1.4 (the default overprovisioning factor), so callers use their own zone while
/// it is healthy and fail over, zone then region, when it is not. Groups are sorted
/// by priority, then locality. Without a local locality every group is priority 0.
pub(crate) fn load_assignment(
    service: &Service,
    port: u16,
    local: Option<&Locality>,
) -> ClusterLoadAssignment {
    let mut groups: BTreeMap<(u32, &Locality), Vec<&Endpoint>> = BTreeMap::new();
    for e in port_endpoints(service, port).serving {
        groups
            .entry((locality_rank(local, &e.locality), &e.locality))
            .or_default()
            .push(e);
    }
    let ranks: std::collections::BTreeSet<u32> = groups.keys().map(|(rank, _)| *rank).collect();
    let dense = |rank: u32| ranks.iter().position(|r| *r == rank).unwrap_or(0) as u32;
    let endpoints = groups
        .into_iter()
        .map(|((rank, loc), mut eps)| {
            eps.sort_by(|a, b| {
                (a.address, a.port, a.weight, a.health)
                    .cmp(&(b.address, b.port, b.weight, b.health))
            });
            let sum: u64 = eps.iter().map(|e| u64::from(e.weight.max(1))).sum();
            LocalityLbEndpoints {
                locality: Some(PbLocality {
                    region: loc.region.clone(),
                    zone: loc.zone.clone(),
                    sub_zone: loc.sub_zone.clone(),
                }),
                load_balancing_weight: Some(UInt32Value {
                    value: u32::try_from(sum).unwrap_or(u32::MAX),
                }),
                priority: dense(rank),
                lb_endpoints: eps
                    .into_iter()
                    .map(|e| LbEndpoint {
                        health_status: health(e.health) as i32,
                        load_balancing_weight: Some(UInt32Value {
                            value: e.weight.max(1),
                        }),
                        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(PbEndpoint {
                            address: Some(address_of(socket_address(e.address, e.port, None))),
                            ..Default::default()
                        })),
                        // Which of an mTLS cluster's transport sockets verifies this
                        // endpoint: the one accepting its own identity ([`mtls_cluster`]).
                        metadata: endpoint_peers(e).map(|ids| peer_metadata(&ids)),
                    })
                    .collect(),
                ..Default::default()
            }
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: names::outbound_cluster(service, port),
        endpoints,
        ..Default::default()
    }
}

/// The resources of one service: per port an EDS cluster
/// `outbound|<port>|<svc>.<ns>` (HTTP/2 for gRPC ports) and its
/// `ClusterLoadAssignment` of the same name, with priorities by distance from
/// `opts.local_locality` (`load_assignment`). Used by both Envoy and proxyless
/// gRPC.
pub fn service_resources(service: &Service, opts: &EnvoyOptions) -> Vec<Resource> {
    let mut out = Vec::with_capacity(2 * service.ports.len());
    for p in &service.ports {
        let name = names::outbound_cluster(service, p.port);
        let cluster = outbound_cluster(service, p.port, p.protocol);
        out.push(resource(CLUSTER, name.clone(), any(CLUSTER, &cluster)));
        let cla = load_assignment(service, p.port, opts.local_locality.as_ref());
        out.push(resource(ENDPOINT, name, any(ENDPOINT, &cla)));
    }
    out
}

/// The host names of a service port in the outbound routes: `<svc>`, `<svc>.<ns>`,
/// `<svc>.<ns>.svc`, `<svc>.<ns>.svc.<cluster_domain>` and each VIP (`<ip>`, IPv6
/// in brackets), each with `:<port>`, and without the port too if `with_bare` (the
/// service's first HTTP/gRPC port). The bare `<svc>` forms are left out if `short`
/// is false (the name is in several namespaces).
fn domains(
    service: &Service,
    port: u16,
    with_bare: bool,
    short: bool,
    cluster_domain: &str,
) -> Vec<String> {
    let (s, ns) = (&service.name, &service.namespace);
    let mut hosts = Vec::with_capacity(4);
    if short {
        hosts.push(s.clone());
    }
    hosts.push(format!("{s}.{ns}"));
    hosts.push(format!("{s}.{ns}.svc"));
    if !cluster_domain.is_empty() {
        hosts.push(format!("{s}.{ns}.svc.{cluster_domain}"));
    }
    hosts.extend(service.vips.iter().map(|ip| ip_host(*ip)));
    let mut out = Vec::with_capacity(hosts.len() * 2);
    for h in &hosts {
        out.push(format!("{h}:{port}"));
    }
    if with_bare {
        out.extend(hosts);
    }
    out
}

/// The route configuration [`OUTBOUND_ROUTE`](names::OUTBOUND_ROUTE) every pod's
/// outbound listener uses: per HTTP or gRPC service port a virtual host
/// `<svc>.<ns>:<port>` routing everything to `outbound|<port>|<svc>.<ns>`.
/// Virtual hosts are sorted by namespace, name and port order, so the result does
/// not depend on the order of `services`. Domains are unique: the bare `<svc>`
/// names are only used for a service name that exists in one namespace only.
pub fn outbound_routes<S: Borrow<Service>>(services: &[S], opts: &EnvoyOptions) -> Resource {
    routes(
        names::OUTBOUND_ROUTE,
        services,
        opts,
        &|ns, name, port, _| names::outbound_cluster_of(name, ns, port),
    )
}

/// The methods RFC 9110 (section 9.2.2) defines as idempotent, as an RE2 pattern
/// Envoy matches against the whole `:method`.
pub(crate) const IDEMPOTENT_METHODS: &str = "GET|HEAD|OPTIONS|TRACE|PUT|DELETE";

/// What the outbound routes retry for idempotent requests: everything that fails
/// with a gateway error (502, 503, 504: a refused or timed-out connection, a
/// reset, a per-try timeout, or such a status from the callee). Repeating an
/// idempotent request that did reach the app is harmless by the method's definition.
pub const RETRY_ON_IDEMPOTENT: &str = "connect-failure,refused-stream,reset,gateway-error";

/// What the outbound routes retry for every other request (`POST`, `PATCH`, gRPC):
/// only failures where the request provably never reached the callee's app: the
/// connection could not be made (`connect-failure`), the callee refused the stream
/// unprocessed (HTTP/2 `REFUSED_STREAM`, e.g. after its `GOAWAY`), or the
/// connection was reset before the request was sent (`reset-before-request`: a
/// pooled connection the callee had closed). Not `reset` nor `gateway-error`: a
/// reset or a 502/503/504 after the request went out may come from an app that
/// already acted on it, and repeating a non-idempotent request would do it twice.
/// Those failures reach the client, which alone knows whether its request may be
/// repeated.
pub const RETRY_ON_OTHER: &str = "connect-failure,refused-stream,reset-before-request";

/// A retry policy of the outbound routes: `retry_on`, at most 2 retries, each on
/// another host (`previous_hosts`, up to 3 picks to find one) and, while one is
/// left, another priority (`previous_priorities`: the first retry after the local
/// zone's only endpoint failed goes to the next zone, not back to the same dead
/// endpoint, which outlier detection may not have ejected yet).
/// A header matcher taking the idempotent methods ([`IDEMPOTENT_METHODS`]): the
/// method selects the route, because a `RetryPolicy` cannot depend on it.
pub(crate) fn idempotent_methods() -> HeaderMatcher {
    HeaderMatcher {
        name: ":method".to_string(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            StringMatcher {
                match_pattern: Some(MatchPattern::SafeRegex(RegexMatcher {
                    regex: IDEMPOTENT_METHODS.to_string(),
                    ..Default::default()
                })),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

pub(crate) fn retry_policy(retry_on: &str, per_try_timeout_ms: u32) -> RetryPolicy {
    RetryPolicy {
        retry_on: retry_on.to_string(),
        num_retries: Some(UInt32Value { value: 2 }),
        per_try_timeout: (per_try_timeout_ms > 0).then(|| duration_ms(per_try_timeout_ms)),
        retry_priority: Some(retry_policy::RetryPriority {
            name: "envoy.retry_priorities.previous_priorities".to_string(),
            config_type: Some(retry_policy::retry_priority::ConfigType::TypedConfig(any(
                type_urls::PREVIOUS_PRIORITIES,
                // Recompute the priority load after every attempt.
                &PreviousPrioritiesConfig {
                    update_frequency: 1,
                },
            ))),
        }),
        retry_host_predicate: vec![retry_policy::RetryHostPredicate {
            name: "envoy.retry_host_predicates.previous_hosts".to_string(),
            config_type: Some(retry_policy::retry_host_predicate::ConfigType::TypedConfig(
                any(type_urls::PREVIOUS_HOSTS, &PreviousHostsPredicate {}),
            )),
        }],
        host_selection_retry_max_attempts: 3,
        ..Default::default()
    }
}

/// The routes of one outbound virtual host, both to `cluster`: first the
/// idempotent methods ([`IDEMPOTENT_METHODS`]) retried on [`RETRY_ON_IDEMPOTENT`]
/// with a per-try timeout of `opts.retry_per_try_timeout_ms`, then everything else
/// retried on [`RETRY_ON_OTHER`] only, without a per-try timeout (a timed-out try
/// of a request that may not be repeated could only fail, earlier). A `RetryPolicy`
/// cannot depend on the method, so the method selects the route.
fn outbound_service_routes(cluster: &str, opts: &EnvoyOptions) -> Vec<Route> {
    let with_policy = |mut route: Route, policy: RetryPolicy| {
        if let Some(route::Action::Route(action)) = route.action.as_mut() {
            action.retry_policy = Some(policy);
        }
        route
    };
    let mut idempotent = route_to("/", cluster);
    if let Some(m) = idempotent.r#match.as_mut() {
        m.headers = vec![idempotent_methods()];
    }
    vec![
        with_policy(
            idempotent,
            retry_policy(RETRY_ON_IDEMPOTENT, opts.retry_per_try_timeout_ms),
        ),
        with_policy(route_to("/", cluster), retry_policy(RETRY_ON_OTHER, 0)),
    ]
}

/// The outbound route configuration `name`, routing each service port to the cluster
/// `cluster_for` names ([`outbound_service_routes`]).
fn routes<S: Borrow<Service>>(
    name: &str,
    services: &[S],
    opts: &EnvoyOptions,
    cluster_for: &super::policy::ClusterFor<'_>,
) -> Resource {
    let ambiguous = ambiguous_service_names(services);
    let mut sorted: Vec<&Service> = services.iter().map(Borrow::borrow).collect();
    sorted.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    sorted.dedup_by(|a, b| (&a.namespace, &a.name) == (&b.namespace, &b.name));
    let mut virtual_hosts = Vec::new();
    // Every domain emitted so far: a valid mesh has no VIP host name in two services,
    // but Envoy rejects the whole route configuration (every pod's routes) if two
    // virtual hosts share one, so an invalid mesh loses the later duplicate instead.
    let mut emitted = std::collections::HashSet::new();
    for s in sorted {
        let short = !ambiguous.contains(s.name.as_str());
        virtual_hosts.extend(service_virtual_hosts(
            s,
            short,
            opts,
            cluster_for,
            &mut emitted,
        ));
    }
    let rc = RouteConfiguration {
        name: name.to_string(),
        virtual_hosts,
        ..Default::default()
    };
    resource(ROUTE, name.to_string(), any(ROUTE, &rc))
}

/// The virtual hosts of one service in an outbound route configuration: one per
/// HTTP/gRPC port, with the domains not already `emitted` (`short`: the bare service
/// name is a domain too).
fn service_virtual_hosts(
    s: &Service,
    short: bool,
    opts: &EnvoyOptions,
    cluster_for: &super::policy::ClusterFor<'_>,
    emitted: &mut std::collections::HashSet<String>,
) -> Vec<VirtualHost> {
    let mut out = Vec::new();
    if s.subset_of().is_some() {
        // A route subset is reached through its Service's routes, by no name of its
        // own.
        return out;
    }
    let mut first = true;
    let mut seen = std::collections::BTreeSet::new();
    for p in s.ports.iter().filter(|p| p.protocol.is_http()) {
        if !seen.insert(p.port) {
            continue; // an invalid mesh; never emit a duplicate domain
        }
        let mut domains = domains(s, p.port, first, short, &opts.cluster_domain);
        domains.retain(|d| emitted.insert(d.clone()));
        let mut rules = super::policy::rules_of(s, p.port).peekable();
        let routes = if rules.peek().is_some() {
            super::policy::policy_routes(
                rules,
                opts.retry_per_try_timeout_ms,
                cluster_for,
                super::policy::Flavor::Envoy,
            )
        } else {
            let cluster = cluster_for(&s.namespace, &s.name, p.port, None);
            outbound_service_routes(&cluster, opts)
        };
        out.push(VirtualHost {
            name: names::service_authority(s, p.port),
            domains,
            routes,
            ..Default::default()
        });
        first = false;
    }
    out
}

/// One service's part of an outbound route configuration, encoded: its virtual hosts
/// as the bytes of `RouteConfiguration.virtual_hosts` entries (field 2, tag
/// included). A memo keeps it per service and [`routes_from_parts`] joins the parts,
/// so a change re-encodes one service's virtual hosts, not every service's. Valid
/// only where no two services share a domain (see [`routes_from_parts`]).
pub(crate) fn encoded_service_routes(
    s: &Service,
    short: bool,
    opts: &EnvoyOptions,
    cluster_for: &super::policy::ClusterFor<'_>,
) -> Vec<u8> {
    let mut emitted = std::collections::HashSet::new();
    let mut buf = Vec::new();
    for vh in service_virtual_hosts(s, short, opts, cluster_for, &mut emitted) {
        prost::encoding::message::encode(2, &vh, &mut buf);
    }
    buf
}

/// The route configuration `name` from its services' [`encoded_service_routes`], in
/// service order: the same bytes as [`routes`] gives when no domain is in two
/// services (protobuf encodes a repeated message field as one tagged entry per
/// element, after the lower-numbered `name`), without building or encoding any
/// virtual host again.
pub(crate) fn routes_from_parts<'a>(
    name: &str,
    parts: impl IntoIterator<Item = &'a [u8]>,
) -> Resource {
    let mut value = RouteConfiguration {
        name: name.to_string(),
        ..Default::default()
    }
    .encode_to_vec();
    for part in parts {
        value.extend_from_slice(part);
    }
    resource(
        ROUTE,
        name.to_string(),
        Any {
            type_url: ROUTE.to_string(),
            value,
        },
    )
}

/// The route configuration `name` with its virtual hosts over VHDS (ADS): no virtual
/// host of its own, so it never changes.
pub(crate) fn vhds_route_config(name: &str) -> Resource {
    let rc = RouteConfiguration {
        name: name.to_string(),
        vhds: Some(Vhds {
            config_source: Some(ads()),
        }),
        ..Default::default()
    };
    resource(ROUTE, name.to_string(), any(ROUTE, &rc))
}

/// The `VirtualHost` resources of route configuration `rc`'s virtual hosts encoded in
/// `part` (`RouteConfiguration.virtual_hosts` entries, as [`encoded_service_routes`]
/// makes), each named `<rc>/<its name>`: Envoy keys a VHDS virtual host by its own
/// name and removes it by the resource name, so the two are the same, and subscribes
/// by the namespace `<rc>` (what comes before the last `/`; a host has none).
pub(crate) fn vhds_resources(rc: &str, part: &[u8]) -> Vec<Resource> {
    // The part is this crate's own encoding: it decodes (a failure would only leave
    // the service's virtual hosts out).
    let hosts = RouteConfiguration::decode(part)
        .map(|rc| rc.virtual_hosts)
        .unwrap_or_default();
    hosts
        .into_iter()
        .map(|mut vh| {
            vh.name = format!("{rc}/{}", vh.name);
            let name = vh.name.clone();
            resource(VIRTUAL_HOST, name, any(VIRTUAL_HOST, &vh))
        })
        .collect()
}

/// A whole outbound route configuration as VHDS serves it: the configuration
/// without virtual hosts ([`vhds_route_config`]) and one resource per virtual host
/// ([`vhds_resources`]).
pub(crate) fn vhds_split(routes: &Resource) -> Vec<Resource> {
    let mut out = vec![vhds_route_config(&routes.name)];
    out.extend(vhds_resources(&routes.name, &routes.any.value));
    out
}

/// An SDS reference to the secret `name`, served over ADS.
fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.to_string(),
        sds_config: Some(ads()),
    }
}

fn uri_san(pattern: MatchPattern) -> SubjectAltNameMatcher {
    SubjectAltNameMatcher {
        san_type: SanType::Uri as i32,
        matcher: Some(StringMatcher {
            match_pattern: Some(pattern),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// TLS with `identity`'s certificate, verifying the peer against `trust_domain`'s
/// bundle and the given SAN matchers.
fn common_tls(
    identity: &str,
    trust_domain: &str,
    sans: Vec<SubjectAltNameMatcher>,
) -> CommonTlsContext {
    CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![sds(identity)],
        validation_context_type: Some(ValidationContextType::CombinedValidationContext(
            CombinedCertificateValidationContext {
                default_validation_context: Some(CertificateValidationContext {
                    match_typed_subject_alt_names: sans,
                    ..Default::default()
                }),
                validation_context_sds_secret_config: Some(sds(trust_domain)),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

pub(crate) fn tls_socket(type_url: &str, value: Vec<u8>) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(Any {
            type_url: type_url.to_string(),
            value,
        })),
    }
}

/// The inbound side of mTLS: present `identity`'s certificate, require a client
/// certificate whose URI SAN is in the same trust domain.
fn server_tls(identity: &str) -> Option<TransportSocket> {
    let td = trust_domain(identity)?;
    let ctx = DownstreamTlsContext {
        common_tls_context: Some(common_tls(
            identity,
            td,
            vec![uri_san(MatchPattern::Prefix(format!("spiffe://{td}/")))],
        )),
        require_client_certificate: Some(BoolValue { value: true }),
        ..Default::default()
    };
    Some(tls_socket(type_urls::DOWNSTREAM_TLS, ctx.encode_to_vec()))
}

/// The IDs a caller accepts from endpoint `e`: its identity and its `also_accept`
/// IDs, sorted and deduplicated; `None` without an identity (its `also_accept` IDs
/// only count with one).
pub(crate) fn endpoint_peers(e: &Endpoint) -> Option<std::collections::BTreeSet<&str>> {
    let id = e.identity.as_deref()?;
    Some(
        std::iter::once(id)
            .chain(e.also_accept.iter().map(String::as_str))
            .collect(),
    )
}

/// The value of an endpoint's [`PEER_MATCH_KEY`]: its accepted IDs
/// ([`endpoint_peers`]) joined by spaces (an ID holds no whitespace: the model's
/// validator refuses it), so equal sets give equal keys.
fn peer_key(ids: &std::collections::BTreeSet<&str>) -> String {
    ids.iter().copied().collect::<Vec<_>>().join(" ")
}

/// The key of the endpoint metadata (under [`TRANSPORT_SOCKET_MATCH`]) and of the
/// cluster's `transport_socket_matches` entries that pins an endpoint to its own
/// identity.
pub const PEER_MATCH_KEY: &str = "flock.peer";

/// Envoy's metadata namespace for `Cluster.transport_socket_matches`.
pub const TRANSPORT_SOCKET_MATCH: &str = "envoy.transport_socket_match";

/// The one URI SAN the fallback transport socket of an mTLS cluster accepts: not a
/// SPIFFE ID, so no certificate the signer or SPIRE issues carries it, and an
/// endpoint that matches none of the cluster's `transport_socket_matches` fails
/// closed instead of being verified against another endpoint's identity.
pub const UNPINNED_SAN: &str = "flock:no-pinned-identity";

/// The URI SAN matchers for a set of accepted IDs: an exact match per SPIFFE ID, a
/// prefix match per ID prefix (`spiffe://td/path/*` → prefix `spiffe://td/path/`),
/// exact IDs first, then prefixes, each sorted. Never empty for a non-empty set.
pub(crate) fn san_patterns<'a>(ids: impl IntoIterator<Item = &'a str>) -> Vec<MatchPattern> {
    let ids: std::collections::BTreeSet<(bool, &str)> = ids
        .into_iter()
        .map(|id| match identity_prefix(id) {
            Some(prefix) => (true, prefix),
            None => (false, id),
        })
        .collect();
    ids.into_iter()
        .map(|(prefix, s)| {
            if prefix {
                MatchPattern::Prefix(s.to_string())
            } else {
                MatchPattern::Exact(s.to_string())
            }
        })
        .collect()
}

/// The distinct accepted-ID sets ([`endpoint_peers`]) of a service port's serving
/// endpoints if the port is mTLS (any endpoint has an identity, [`port_endpoints`]),
/// else `None` (plaintext). Never empty when `Some`. An ID outside the caller's trust
/// domain stays; the caller's bundle cannot verify its certificate, so that endpoint
/// fails closed instead of turning the port to plaintext.
pub(crate) fn mtls_peers(
    service: &Service,
    port: u16,
) -> Option<std::collections::BTreeSet<std::collections::BTreeSet<&str>>> {
    let eps = port_endpoints(service, port);
    if !eps.mtls {
        return None;
    }
    let sets: std::collections::BTreeSet<_> = eps
        .serving
        .iter()
        .filter_map(|e| endpoint_peers(e))
        .collect();
    (!sets.is_empty()).then_some(sets)
}

/// The outbound resources of the pods with SPIFFE ID `identity`: the route
/// configuration `outbound|http|<identity>` and, per HTTP/gRPC service port that is
/// mTLS (any endpoint has an identity; endpoints without one are left out of it), an
/// mTLS cluster that presents the caller's certificate and accepts only those
/// endpoints' IDs. Only ports where no endpoint has an identity route to the plain
/// cluster. Empty if `identity` is not a SPIFFE ID.
pub fn caller_resources<S: Borrow<Service>>(
    identity: &str,
    services: &[S],
    opts: &EnvoyOptions,
) -> Vec<Resource> {
    if trust_domain(identity).is_none() {
        return Vec::new();
    }
    let mut out: Vec<Resource> = Vec::new();
    let mut mtls = std::collections::BTreeSet::new();
    for s in services {
        for r in caller_service_clusters(identity, s.borrow(), opts) {
            // Two services of one name (an invalid mesh) would make one cluster twice.
            if mtls.insert(r.name.clone()) {
                out.push(r);
            }
        }
    }
    out.push(caller_routes(identity, services, opts, &|name| {
        mtls.contains(name)
    }));
    out
}

/// The mTLS clusters of one service's HTTP/gRPC ports for callers with `identity`
/// (the per-service part of [`caller_resources`]: it depends on this service alone,
/// so a memo can keep it while the service is unchanged). Empty if `identity` is not
/// a SPIFFE ID or no port of the service is mTLS.
pub fn caller_service_clusters(identity: &str, s: &Service, opts: &EnvoyOptions) -> Vec<Resource> {
    let Some(td) = trust_domain(identity) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for p in s.ports.iter().filter(|p| p.protocol.is_http()) {
        if !seen.insert(p.port) {
            continue;
        }
        let Some(peers) = mtls_peers(s, p.port) else {
            continue;
        };
        mtls_cluster(s, p, identity, td, peers, opts, &mut out);
    }
    out
}

/// The outbound routes `outbound|http|<identity>` of [`caller_resources`]: each
/// service port routes to its mTLS cluster for `identity` where `has_cluster` says
/// that cluster exists ([`caller_service_clusters`] made it), else to the plain
/// outbound cluster.
pub fn caller_routes<S: Borrow<Service>>(
    identity: &str,
    services: &[S],
    opts: &EnvoyOptions,
    has_cluster: &dyn Fn(&str) -> bool,
) -> Resource {
    routes(
        &names::outbound_route_for(identity),
        services,
        opts,
        &|ns, svc, port, backend_mtls| {
            let name = names::mtls_cluster_of(svc, ns, port, identity);
            let mtls = backend_mtls.unwrap_or_else(|| has_cluster(&name));
            if mtls {
                name
            } else {
                names::outbound_cluster_of(svc, ns, port)
            }
        },
    )
}

/// The mTLS cluster `outbound|<port>|<svc>.<ns>|<identity>` of a service port for
/// callers with `identity` (trust domain `td`), and its own `ClusterLoadAssignment` of
/// the same name: the service port's endpoints ([`load_assignment`]), the same content
/// as the plain cluster's.
///
/// Each endpoint is verified against its own identity only (and its own `also_accept`
/// IDs), never against the union of the port's: per distinct set of accepted IDs
/// (`peers`) the cluster has one `transport_socket_matches` entry, matching the
/// [`PEER_MATCH_KEY`] that [`load_assignment`] writes into each endpoint's
/// [`TRANSPORT_SOCKET_MATCH`] metadata, whose TLS context accepts exactly that set. The
/// cluster's own transport socket, used by an endpoint that matches no entry, accepts
/// only [`UNPINNED_SAN`], which no workload certificate carries: it fails closed. With
/// a union, a node that registered one endpoint of the service with identity X (its
/// own pod's) made every caller accept X from every endpoint of the service: a pod
/// running as X anywhere could then answer for any of them (an address it took over,
/// a stale entry's address reused).
///
/// The endpoints get a name per cluster, not the plain cluster's shared by every
/// caller, because Envoy keeps one EDS subscription per resource name: a cluster
/// added on a name another cluster already watches sends no new request, so the
/// server (rightly) sends nothing, and the new cluster waits out its initial fetch
/// timeout (15 s) before it routes. A name of its own is always a new subscription,
/// answered at once.
fn mtls_cluster(
    s: &Service,
    p: &ServicePort,
    identity: &str,
    td: &str,
    peers: std::collections::BTreeSet<std::collections::BTreeSet<&str>>,
    opts: &EnvoyOptions,
    out: &mut Vec<Resource>,
) {
    let local = opts.local_locality.as_ref();
    let name = names::mtls_cluster(s, p.port, identity);
    let mut cluster = outbound_cluster(s, p.port, p.protocol);
    cluster.name = name.clone();
    cluster.upstream_bind_config = opts.capture_mark.map(caller_netns_bind);
    let upstream = |sans: Vec<MatchPattern>| {
        let ctx = UpstreamTlsContext {
            common_tls_context: Some(common_tls(
                identity,
                td,
                sans.into_iter().map(uri_san).collect(),
            )),
            ..Default::default()
        };
        tls_socket(type_urls::UPSTREAM_TLS, ctx.encode_to_vec())
    };
    // The mutant verifies every endpoint against the union of the port's accepted
    // IDs, as callers did before endpoints were pinned.
    if flock_core::reintroduced!("xds-union-peer-identities") {
        let union = san_patterns(peers.iter().flatten().copied());
        cluster.transport_socket = Some(upstream(union));
    } else {
        cluster.transport_socket = Some(upstream(vec![MatchPattern::Exact(
            UNPINNED_SAN.to_string(),
        )]));
        cluster.transport_socket_matches = peers
            .iter()
            .enumerate()
            .map(|(i, ids)| TransportSocketMatch {
                // Stats only: `peer-<n>` in the order of the sorted sets.
                name: format!("peer-{i}"),
                r#match: Some(string_struct(PEER_MATCH_KEY, &peer_key(ids))),
                transport_socket: Some(upstream(san_patterns(ids.iter().copied()))),
            })
            .collect();
    }
    out.push(resource(CLUSTER, name.clone(), any(CLUSTER, &cluster)));
    let mut cla = load_assignment(s, p.port, local);
    cla.cluster_name = name.clone();
    out.push(resource(ENDPOINT, name, any(ENDPOINT, &cla)));
}

/// A `google.protobuf.Struct` of one string field (one entry: its encoding does not
/// depend on a map's iteration order).
fn string_struct(key: &str, value: &str) -> PbStruct {
    PbStruct {
        fields: [(
            key.to_string(),
            PbValue {
                kind: Some(pb_value::Kind::StringValue(value.to_string())),
            },
        )]
        .into(),
    }
}

/// The metadata pinning an endpoint with accepted IDs `ids` to its
/// `transport_socket_matches` entry ([`mtls_cluster`]).
fn peer_metadata(ids: &std::collections::BTreeSet<&str>) -> Metadata {
    Metadata {
        filter_metadata: [(
            TRANSPORT_SOCKET_MATCH.to_string(),
            string_struct(PEER_MATCH_KEY, &peer_key(ids)),
        )]
        .into(),
        ..Default::default()
    }
}

/// An SDS secret: a TLS certificate (chain and key inline) or a validation context
/// (trusted CA inline).
pub fn secret_resource(s: &Secret) -> Resource {
    let inline = |pem: &str| DataSource {
        specifier: Some(data_source::Specifier::InlineString(pem.to_string())),
        ..Default::default()
    };
    let r#type = match &s.kind {
        SecretKind::TlsCertificate {
            certificate_chain_pem,
            private_key_pem,
        } => secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: Some(inline(certificate_chain_pem)),
            private_key: Some(inline(&private_key_pem.0)),
            ..Default::default()
        }),
        SecretKind::ValidationContext { trusted_ca_pem } => {
            secret::Type::ValidationContext(CertificateValidationContext {
                trusted_ca: Some(inline(trusted_ca_pem)),
                ..Default::default()
            })
        }
    };
    let mut pb = PbSecret {
        name: s.name.clone(),
        r#type: Some(r#type),
    };
    let encoded = any(SECRET, &pb);
    // The message was only a step to its encoding: wipe its copy of the key before it
    // is freed (the encoded copy lives on in the snapshot until it is replaced).
    if let Some(secret::Type::TlsCertificate(TlsCertificate {
        private_key:
            Some(DataSource {
                specifier: Some(data_source::Specifier::InlineString(key)),
                ..
            }),
        ..
    })) = &mut pb.r#type
    {
        zeroize::Zeroize::zeroize(key);
    }
    resource(SECRET, s.name.clone(), encoded)
}

/// Everything the node-local Envoy needs for `mesh`: [`pod_resources`] of every pod,
/// [`service_resources`] of every service, [`outbound_routes`] and every
/// [`secret_resource`], sorted by type URL and name (so the same mesh gives the same
/// list, whatever the order of its services and pods). Expects a
/// [validated](Mesh::validate) mesh. The translation of a fresh
/// [`Memo`](super::Memo): a control plane that keeps one gets the same resources.
pub fn envoy_resources(mesh: &Mesh, opts: &EnvoyOptions) -> Vec<Resource> {
    super::memo::translate_once(super::memo::Flavor::Envoy, mesh, opts)
}
