//! Translation for proxyless gRPC clients: per gRPC service port an `ApiListener`
//! named like the target (`xds:///<svc>.<ns>:<port>`), its route configuration, and
//! the same EDS cluster and endpoints Envoy gets. See the [module docs](super).

use super::envoy::{
    EnvoyOptions, address_of, any, hcm_rds, load_assignment, mtls_peers, network_filter,
    outbound_cluster, rbac_http_filter, route_to, router_filter, san_patterns, socket_address,
    stat_safe, tls_socket,
};
use super::model::{Mesh, Pod, Protocol, Service, ip_host};
use super::{Resource, names, type_urls};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE};
use envoy_types::pb::envoy::config::listener::v3::{ApiListener, FilterChain, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    NonForwardingAction, Route, RouteConfiguration, RouteMatch, VirtualHost, route, route_match,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateProviderPluginInstance, CertificateValidationContext, CommonTlsContext,
    DownstreamTlsContext, UpstreamTlsContext, common_tls_context,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher::MatchPattern};
use envoy_types::pb::google::protobuf::BoolValue;
use prost::Message;

/// The certificate provider instance a proxyless app's bootstrap must define
/// (`certificate_providers.flock`, e.g. gRPC's `file_watcher` plugin over its SVID,
/// key and trust bundle): its mTLS clusters and server listeners name it for both
/// their own certificate and the roots they verify the peer with.
pub const CERTIFICATE_PROVIDER: &str = "flock";

/// The `server_listener_resource_name_template` a proxyless server's bootstrap must
/// hold: gRPC asks for the listener named by it, `%s` replaced by the address the
/// server listens on (`<ip>:<port>`, IPv6 in brackets).
pub const SERVER_LISTENER_TEMPLATE: &str = "grpc/server?xds.resource.listening_address=%s";

/// The listener a proxyless server listening on `ip:port` asks for
/// ([`SERVER_LISTENER_TEMPLATE`]).
pub fn server_listener_name(ip: std::net::IpAddr, port: u16) -> String {
    SERVER_LISTENER_TEMPLATE.replace("%s", &std::net::SocketAddr::new(ip, port).to_string())
}

/// A proxyless app's certificate files: its SVID (chain, PEM), its private key and
/// the trust bundle it verifies peers with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppCertificates {
    /// The SVID's certificate chain (PEM file).
    pub certificate_file: String,
    /// Its private key (PEM file).
    pub private_key_file: String,
    /// The trust bundle (PEM file).
    pub ca_certificate_file: String,
}

/// The gRPC xDS bootstrap (`GRPC_XDS_BOOTSTRAP`) of a proxyless app, client or
/// server: the control plane at `server_uri` over mTLS with the app's own certificate
/// (gRPC's `tls` channel credentials, reloading the files), node id `node_id`, the
/// certificate provider [`CERTIFICATE_PROVIDER`] (gRPC's `file_watcher` plugin over
/// the same files, re-read every 10 s) and [`SERVER_LISTENER_TEMPLATE`]. gRPC's
/// bootstrap format (gRFC A27, A29, A36, A65); the files must be readable by the app
/// at those paths.
pub fn proxyless_bootstrap(
    server_uri: &str,
    node_id: &str,
    files: &AppCertificates,
) -> serde_json::Value {
    let certs = serde_json::json!({
        "certificate_file": files.certificate_file,
        "private_key_file": files.private_key_file,
        "ca_certificate_file": files.ca_certificate_file,
    });
    let mut watcher = certs.clone();
    watcher["refresh_interval"] = serde_json::json!("10s");
    serde_json::json!({
        "xds_servers": [{
            "server_uri": server_uri,
            "channel_creds": [{"type": "tls", "config": certs}],
            "server_features": ["xds_v3"],
        }],
        "node": {"id": node_id},
        "certificate_providers": {
            CERTIFICATE_PROVIDER: {"plugin_name": "file_watcher", "config": watcher},
        },
        "server_listener_resource_name_template": SERVER_LISTENER_TEMPLATE,
    })
}

fn provider() -> Option<CertificateProviderPluginInstance> {
    Some(CertificateProviderPluginInstance {
        instance_name: CERTIFICATE_PROVIDER.to_string(),
        certificate_name: String::new(),
    })
}

/// TLS from the app's own certificate provider, verifying the peer against its roots
/// and (when not empty) the URI SANs `sans`. gRPC reads `match_subject_alt_names`
/// (matched against the URI, DNS, then IP SANs), not the typed list Envoy's clusters
/// use (gRPC-Java does not honour the typed list correctly either).
#[allow(deprecated)]
fn provider_tls(sans: Vec<MatchPattern>) -> CommonTlsContext {
    CommonTlsContext {
        tls_certificate_provider_instance: provider(),
        validation_context_type: Some(
            common_tls_context::ValidationContextType::ValidationContext(
                CertificateValidationContext {
                    ca_certificate_provider_instance: provider(),
                    match_subject_alt_names: sans
                        .into_iter()
                        .map(|p| StringMatcher {
                            match_pattern: Some(p),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                },
            ),
        ),
        ..Default::default()
    }
}

/// The resources of one pod for proxyless gRPC servers: per [`proxyless`](super::InboundPort::proxyless)
/// port, the server listener [`server_listener_name`]`(pod ip, app port)`. It binds
/// the pod IP and port (gRPC checks the listener's address against its own), has one
/// filter chain whose HTTP connection manager holds the port's RBAC filters
/// ([`super::authz`], the same layers Envoy's inbound listener gets, on the peer
/// certificate's URI SAN: gRPC's RBAC matches `principal_name` against it) before the
/// router, and an inline route configuration with one non-forwarding route (a server
/// serves the call itself). The chain is always mTLS (whether or not the agent holds
/// the pod's SVID yet): the server's certificate and roots from its provider
/// [`CERTIFICATE_PROVIDER`], a client certificate required, from any ID its roots
/// verify (who may call is the RBAC's to decide).
pub fn grpc_pod_resources(pod: &Pod) -> Vec<Resource> {
    let mut out = Vec::new();
    for ib in pod.inbound.iter().filter(|ib| ib.proxyless) {
        let name = server_listener_name(pod.ip, ib.app_port);
        let stat_prefix = format!(
            "grpc_server_{}_{}_{}",
            stat_safe(&pod.namespace),
            stat_safe(&pod.name),
            ib.app_port
        );
        let layers = ib
            .authz
            .as_ref()
            // The mutant serves the proxyless server's listener without its RBAC, as
            // before proxyless servers were authorized.
            .filter(|_| !flock_core::reintroduced!("grpc-server-without-rbac"))
            .map(|a| super::authz::layers(&a.effective(&pod.namespace), &a.service_ports, true))
            .unwrap_or_default();
        let mut http_filters: Vec<_> = layers
            .iter()
            .map(|l| rbac_http_filter(l, &format!("{stat_prefix}_")))
            .collect();
        http_filters.push(router_filter());
        let hcm = HttpConnectionManager {
            stat_prefix: stat_prefix.clone(),
            route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
                RouteConfiguration {
                    name: format!("grpc-server|{}/{}|{}", pod.namespace, pod.name, ib.app_port),
                    virtual_hosts: vec![VirtualHost {
                        name: "inbound".to_string(),
                        domains: vec!["*".to_string()],
                        routes: vec![Route {
                            r#match: Some(RouteMatch {
                                path_specifier: Some(route_match::PathSpecifier::Prefix(
                                    String::new(),
                                )),
                                ..Default::default()
                            }),
                            action: Some(route::Action::NonForwardingAction(
                                NonForwardingAction {},
                            )),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            )),
            http_filters,
            ..Default::default()
        };
        // Always mTLS, whether or not the pod's SVID is issued yet: the app has its own
        // certificate, and a listener without TLS would let gRPC fall back to its
        // fallback (often plaintext) credentials on a port capture leaves alone.
        let transport_socket = Some({
            let ctx = DownstreamTlsContext {
                common_tls_context: Some(provider_tls(Vec::new())),
                require_client_certificate: Some(BoolValue { value: true }),
                ..Default::default()
            };
            tls_socket(type_urls::DOWNSTREAM_TLS, ctx.encode_to_vec())
        });
        let listener = Listener {
            name: name.clone(),
            address: Some(address_of(socket_address(pod.ip, ib.app_port, None))),
            filter_chains: vec![FilterChain {
                name: "inbound".to_string(),
                filters: vec![network_filter(
                    "envoy.filters.network.http_connection_manager",
                    type_urls::HCM,
                    hcm.encode_to_vec(),
                )],
                transport_socket,
                ..Default::default()
            }],
            ..Default::default()
        };
        out.push(Resource::new(LISTENER, name, any(LISTENER, &listener)));
    }
    out
}

/// The resources of one service for proxyless gRPC clients, per port whose protocol
/// is `grpc`: the listener `<svc>.<ns>:<port>` (an `ApiListener` holding an
/// `HttpConnectionManager` with RDS over ADS and the router filter), the route
/// configuration `grpc|<svc>.<ns>:<port>` (one virtual host for the target and `*`, routing
/// everything to the cluster), the EDS cluster `outbound|<port>|<svc>.<ns>` and its
/// endpoints. Each VIP of the service adds a listener `<ip>:<port>` (IPv6 in
/// brackets: the client dials `xds:///<ip>:<port>`) using the same route
/// configuration, whose virtual host also lists those authorities.
///
/// An mTLS port (any endpoint has an identity; those without one are left out,
/// `load_assignment`) gets a cluster with mTLS from the client's own certificate
/// provider [`CERTIFICATE_PROVIDER`], accepting any of the serving endpoints' IDs
/// (gRPC has no per-endpoint transport socket match, which pins each endpoint to its
/// own ID in Envoy's mTLS clusters). A client uses it with gRPC's xDS channel
/// credentials; with other credentials gRPC ignores it (and verifies no server
/// identity). Other ports give nothing.
///
/// The endpoints have the same priorities by distance from `opts.local_locality`
/// as Envoy's (gRPC's xDS load balancing fails over by `LocalityLbEndpoints`
/// priority too: the `priority` policy moves to the next priority when one has no
/// ready subchannel); the other options are Envoy's only. The route has no retry
/// policy: gRPC already retries, transparently, an RPC that never left the client
/// or that the server refused unprocessed, and any further retry (on a status such
/// as `UNAVAILABLE`, which a server may send after acting on the call) is the
/// client's decision, in its service config.
pub fn grpc_service_resources(service: &Service, opts: &EnvoyOptions) -> Vec<Resource> {
    let mut out = Vec::new();
    for p in service
        .ports
        .iter()
        .filter(|p| p.protocol == Protocol::Grpc)
    {
        let authority = names::service_authority(service, p.port);
        let route_name = names::grpc_route(service, p.port);
        let cluster_name = names::outbound_cluster(service, p.port);

        let vip_authorities: Vec<String> = service
            .vips
            .iter()
            .map(|ip| format!("{}:{}", ip_host(*ip), p.port))
            .collect();
        let targets = if service.subset_of().is_some() {
            Vec::new()
        } else {
            std::iter::once(&authority)
                .chain(&vip_authorities)
                .collect()
        };
        for target in targets {
            let hcm = hcm_rds(target, &route_name);
            let listener = Listener {
                name: target.clone(),
                api_listener: Some(ApiListener {
                    api_listener: Some(any(type_urls::HCM, &hcm)),
                }),
                ..Default::default()
            };
            out.push(Resource::new(
                LISTENER,
                target.clone(),
                any(LISTENER, &listener),
            ));
        }

        if service.subset_of().is_some() {
            // A route subset: its cluster and endpoints only; clients dial the
            // Service, whose routes send a share here.
            push_cluster(service, p, &cluster_name, opts, &mut out);
            continue;
        }
        let mut domains = vec![authority.clone()];
        domains.extend(vip_authorities);
        domains.push("*".to_string());
        let rc = RouteConfiguration {
            name: route_name.clone(),
            virtual_hosts: vec![VirtualHost {
                name: authority.clone(),
                domains,
                // gRPC matches paths like "/pkg.Service/Method": the empty prefix
                // matches them all.
                routes: if super::policy::rules_of(service, p.port).next().is_none() {
                    vec![route_to("", &cluster_name)]
                } else {
                    super::policy::policy_routes(
                        super::policy::rules_of(service, p.port),
                        0,
                        &|ns, name, port, _| names::outbound_cluster_of(name, ns, port),
                        super::policy::Flavor::Grpc,
                    )
                },
                ..Default::default()
            }],
            ..Default::default()
        };
        out.push(Resource::new(ROUTE, route_name, any(ROUTE, &rc)));
        push_cluster(service, p, &cluster_name, opts, &mut out);
    }
    out
}

/// The cluster of a gRPC service port for proxyless clients and its endpoints.
fn push_cluster(
    service: &Service,
    p: &super::model::ServicePort,
    cluster_name: &str,
    opts: &EnvoyOptions,
    out: &mut Vec<Resource>,
) {
    let mut cluster = outbound_cluster(service, p.port, p.protocol);
    if let Some(peers) = mtls_peers(service, p.port) {
        let ctx = UpstreamTlsContext {
            common_tls_context: Some(provider_tls(san_patterns(peers.iter().flatten().copied()))),
            ..Default::default()
        };
        cluster.transport_socket = Some(tls_socket(type_urls::UPSTREAM_TLS, ctx.encode_to_vec()));
    }
    out.push(Resource::new(
        CLUSTER,
        cluster_name.to_string(),
        any(CLUSTER, &cluster),
    ));
    let cla = load_assignment(service, p.port, opts.local_locality.as_ref());
    out.push(Resource::new(
        ENDPOINT,
        cluster_name.to_string(),
        any(ENDPOINT, &cla),
    ));
}

/// Everything proxyless gRPC clients need for `mesh`: [`grpc_service_resources`] of
/// every service, sorted by type URL and name. Serve these to a different node
/// group than Envoy's: Envoy rejects `ApiListener`s it receives over LDS. The
/// translation of a fresh [`Memo`](super::Memo), with the default options (no local
/// locality: every endpoint priority 0); a control plane that knows its node's
/// locality translates with a memo and its options.
pub fn grpc_resources(mesh: &Mesh) -> Vec<Resource> {
    super::memo::translate_once(
        super::memo::Flavor::Grpc,
        mesh,
        &super::EnvoyOptions::default(),
    )
}
