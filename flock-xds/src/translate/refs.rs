//! What an Envoy resource (an `Any`) refers to, for [`crate::cache::check_consistency`].

use super::type_urls;
use crate::cache::References;
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, VIRTUAL_HOST};
use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster,
    cluster::{ClusterDiscoveryType, DiscoveryType},
};
use envoy_types::pb::envoy::config::core::v3::{
    ConfigSource, TransportSocket, config_source::ConfigSourceSpecifier, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    RouteConfiguration, VirtualHost, route, route_action,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager::RouteSpecifier,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, UpstreamTlsContext,
    common_tls_context::ValidationContextType,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

/// [`References`] for Envoy and proxyless-gRPC resources held as `Any`s:
///
/// * a **listener** refers to the route configuration of every HTTP connection
///   manager with RDS (in its filter chains, default filter chain or API listener),
///   to the clusters of inline route configurations and TCP proxies, and to the
///   SDS secrets of its filter chains' TLS transport sockets;
/// * a **route configuration** refers to the clusters of its routes (single and
///   weighted), and so does a **virtual host** (VHDS); a route configuration's
///   virtual hosts served by VHDS are not references: its name is their namespace;
/// * an **EDS cluster** refers to its `ClusterLoadAssignment` (`service_name`, or the
///   cluster's own name if that is empty), and to the SDS secrets of its TLS
///   transport socket.
///
/// Only references served by this server count: RDS, EDS and SDS configs whose
/// config source is ADS or `self` (not a path, a separate API source, or, for SDS,
/// none: a static bootstrap secret). A value that does not decode, or whose `Any`
/// type URL is not the expected one, refers to nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct EnvoyReferences;

impl References<Any> for EnvoyReferences {
    fn references(&self, type_url: &str, value: &Any, refer: &mut dyn FnMut(&str, &str)) {
        if value.type_url != type_url {
            return;
        }
        match type_url {
            LISTENER => {
                if let Ok(l) = Listener::decode(value.value.as_slice()) {
                    listener_refs(&l, refer);
                }
            }
            ROUTE => {
                if let Ok(rc) = RouteConfiguration::decode(value.value.as_slice()) {
                    route_config_refs(&rc, refer);
                }
            }
            VIRTUAL_HOST => {
                if let Ok(vh) = VirtualHost::decode(value.value.as_slice()) {
                    virtual_host_refs(&vh, refer);
                }
            }
            CLUSTER => {
                if let Ok(c) = Cluster::decode(value.value.as_slice()) {
                    cluster_refs(&c, refer);
                }
            }
            _ => {}
        }
    }
}

/// Whether a config source is this server (ADS or `self`). An SDS config without a
/// source names a static bootstrap secret, which is not ours to check.
fn served_here(cs: Option<&ConfigSource>) -> bool {
    matches!(
        cs.and_then(|cs| cs.config_source_specifier.as_ref()),
        Some(ConfigSourceSpecifier::Ads(_) | ConfigSourceSpecifier::Self_(_))
    )
}

fn listener_refs(l: &Listener, refer: &mut dyn FnMut(&str, &str)) {
    for chain in l
        .filter_chains
        .iter()
        .chain(l.default_filter_chain.as_ref())
    {
        for f in &chain.filters {
            filter_refs(f, refer);
        }
        if let Some(ts) = &chain.transport_socket {
            transport_socket_refs(ts, true, refer);
        }
    }
    if let Some(api) = l
        .api_listener
        .as_ref()
        .and_then(|a| a.api_listener.as_ref())
        && api.type_url == type_urls::HCM
        && let Ok(hcm) = HttpConnectionManager::decode(api.value.as_slice())
    {
        hcm_refs(&hcm, refer);
    }
}

fn filter_refs(f: &Filter, refer: &mut dyn FnMut(&str, &str)) {
    let Some(filter::ConfigType::TypedConfig(any)) = &f.config_type else {
        return;
    };
    match any.type_url.as_str() {
        type_urls::HCM => {
            if let Ok(hcm) = HttpConnectionManager::decode(any.value.as_slice()) {
                hcm_refs(&hcm, refer);
            }
        }
        type_urls::TCP_PROXY => {
            if let Ok(tcp) = TcpProxy::decode(any.value.as_slice()) {
                match &tcp.cluster_specifier {
                    Some(tcp_proxy::ClusterSpecifier::Cluster(c)) => refer(CLUSTER, c),
                    Some(tcp_proxy::ClusterSpecifier::WeightedClusters(w)) => {
                        for c in &w.clusters {
                            refer(CLUSTER, &c.name);
                        }
                    }
                    None => {}
                }
            }
        }
        _ => {}
    }
}

fn hcm_refs(hcm: &HttpConnectionManager, refer: &mut dyn FnMut(&str, &str)) {
    match &hcm.route_specifier {
        Some(RouteSpecifier::Rds(rds)) if served_here(rds.config_source.as_ref()) => {
            refer(ROUTE, &rds.route_config_name);
        }
        Some(RouteSpecifier::RouteConfig(rc)) => route_config_refs(rc, refer),
        _ => {}
    }
}

fn route_config_refs(rc: &RouteConfiguration, refer: &mut dyn FnMut(&str, &str)) {
    for vh in &rc.virtual_hosts {
        virtual_host_refs(vh, refer);
    }
}

fn virtual_host_refs(vh: &VirtualHost, refer: &mut dyn FnMut(&str, &str)) {
    {
        for r in &vh.routes {
            let Some(route::Action::Route(action)) = &r.action else {
                continue;
            };
            match &action.cluster_specifier {
                Some(route_action::ClusterSpecifier::Cluster(c)) => refer(CLUSTER, c),
                Some(route_action::ClusterSpecifier::WeightedClusters(w)) => {
                    for c in &w.clusters {
                        refer(CLUSTER, &c.name);
                    }
                }
                _ => {}
            }
        }
    }
}

fn cluster_refs(c: &Cluster, refer: &mut dyn FnMut(&str, &str)) {
    let eds = matches!(
        c.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(t)) if t == DiscoveryType::Eds as i32
    );
    if eds {
        let cfg = c.eds_cluster_config.as_ref();
        if served_here(cfg.and_then(|e| e.eds_config.as_ref())) {
            let service = cfg.map(|e| e.service_name.as_str()).unwrap_or_default();
            refer(ENDPOINT, if service.is_empty() { &c.name } else { service });
        }
    }
    if let Some(ts) = &c.transport_socket {
        transport_socket_refs(ts, false, refer);
    }
    // The per-endpoint sockets refer to the same secrets (the caller's certificate and
    // its trust bundle): checked all the same, so a broken one is not missed.
    for m in &c.transport_socket_matches {
        if let Some(ts) = &m.transport_socket {
            transport_socket_refs(ts, false, refer);
        }
    }
}

fn transport_socket_refs(
    ts: &TransportSocket,
    downstream: bool,
    refer: &mut dyn FnMut(&str, &str),
) {
    let Some(transport_socket::ConfigType::TypedConfig(any)) = &ts.config_type else {
        return;
    };
    let common = if downstream {
        if any.type_url != type_urls::DOWNSTREAM_TLS {
            return;
        }
        DownstreamTlsContext::decode(any.value.as_slice())
            .ok()
            .and_then(|t| t.common_tls_context)
    } else {
        if any.type_url != type_urls::UPSTREAM_TLS {
            return;
        }
        UpstreamTlsContext::decode(any.value.as_slice())
            .ok()
            .and_then(|t| t.common_tls_context)
    };
    if let Some(common) = common {
        common_tls_refs(&common, refer);
    }
}

fn common_tls_refs(c: &CommonTlsContext, refer: &mut dyn FnMut(&str, &str)) {
    let mut sds = |s: &SdsSecretConfig| {
        if served_here(s.sds_config.as_ref()) {
            refer(SECRET, &s.name);
        }
    };
    for s in &c.tls_certificate_sds_secret_configs {
        sds(s);
    }
    match &c.validation_context_type {
        Some(ValidationContextType::ValidationContextSdsSecretConfig(s)) => sds(s),
        Some(ValidationContextType::CombinedValidationContext(combined)) => {
            if let Some(s) = &combined.validation_context_sds_secret_config {
                sds(s);
            }
        }
        _ => {}
    }
}
