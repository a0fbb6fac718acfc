//! Translation for proxyless gRPC clients: per gRPC service port an `ApiListener`
//! named like the target (`xds:///<svc>.<ns>:<port>`), its route configuration, and
//! the same EDS cluster and endpoints Envoy gets. See the [module docs](super).

use super::envoy::{EnvoyOptions, any, hcm_rds, load_assignment, outbound_cluster, route_to};
use super::model::{Mesh, Protocol, Service, ip_host};
use super::{Resource, names, type_urls};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE};
use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, VirtualHost};

/// The resources of one service for proxyless gRPC clients, per port whose protocol
/// is `grpc`: the listener `<svc>.<ns>:<port>` (an `ApiListener` holding an
/// `HttpConnectionManager` with RDS over ADS and the router filter), the route
/// configuration `grpc|<svc>.<ns>:<port>` (one virtual host for the target and `*`, routing
/// everything to the cluster), the EDS cluster `outbound|<port>|<svc>.<ns>` and its
/// endpoints. Each VIP of the service adds a listener `<ip>:<port>` (IPv6 in
/// brackets: the client dials `xds:///<ip>:<port>`) using the same route
/// configuration, whose virtual host also lists those authorities. The endpoints are
/// plaintext: proxyless clients get no TLS settings and so verify no server identity
/// at all (an mTLS port's endpoints without an identity are still left out,
/// `load_assignment`; the endpoints' `envoy.transport_socket_match` metadata, which
/// pins each to its own identity in Envoy's mTLS clusters, means nothing to them).
/// Other ports give nothing.
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
        for target in std::iter::once(&authority).chain(&vip_authorities) {
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

        let cluster = outbound_cluster(service, p.port, p.protocol);
        out.push(Resource::new(
            CLUSTER,
            cluster_name.clone(),
            any(CLUSTER, &cluster),
        ));
        let cla = load_assignment(service, p.port, opts.local_locality.as_ref());
        out.push(Resource::new(ENDPOINT, cluster_name, any(ENDPOINT, &cla)));
    }
    out
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
