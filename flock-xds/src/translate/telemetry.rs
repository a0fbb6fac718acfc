//! Access logs of the inbound listeners: one entry per HTTP request or TCP connection a
//! pod receives, streamed to the agent over Envoy's gRPC access log service.
//!
//! Logged on the callee's inbound listener only, so a call through both Envoys is one
//! entry, and that listener knows both identities: the caller's verified certificate
//! (the entry's peer certificate) and the pod's own (its local certificate). Each
//! connection carries its port's tag ([`access_port_tag`], filter state
//! [`ACCESS_PORT_KEY`]) so every port shares one logger configuration: Envoy keeps one
//! gRPC stream per distinct configuration and worker thread, and a per-port log name
//! would open one per port.
//!
//! Sampling happens in Envoy (a runtime filter with independent randomness), so an
//! unsampled request costs no entry on the wire.
//!
//! Tracing ([`TracingOptions`]): every HTTP connection manager of the mesh (outbound
//! and inbound listeners) runs Envoy's OpenTelemetry tracer, exporting spans over OTLP
//! gRPC to the collector cluster [`TRACE_COLLECTOR_CLUSTER`]. The tracer reads an
//! incoming W3C `traceparent` and writes one upstream, so the caller's egress span and
//! the callee's ingress span are one trace; other headers (`b3`, baggage) pass through
//! untouched.

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLog, AccessLogFilter, RuntimeFilter, access_log, access_log_filter,
};
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{
    HttpGrpcAccessLogConfig, TcpGrpcAccessLogConfig,
};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterStateConfig;
use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    Address, GrpcService, SocketAddress, address, grpc_service, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::trace::v3::{OpenTelemetryConfig, tracing};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::Tracing;
use envoy_types::pb::envoy::r#type::v3::{FractionalPercent, Percent, fractional_percent};

use super::authz::{HTTP_GRPC_ACCESS_LOG, TCP_GRPC_ACCESS_LOG, filter_state_tags, grpc_log_config};

/// The log name of access log entries.
pub const ACCESS_LOG_NAME: &str = "flock.access";
/// The filter state key carrying an inbound port's [`access_port_tag`].
pub const ACCESS_PORT_KEY: &str = "flock.access.port";
/// The runtime key of the sampling filter (its default is the configured percentage;
/// an Envoy runtime override of this key changes it without a new listener).
pub const SAMPLE_RUNTIME_KEY: &str = "flock.access_log.sample_percent";

/// The cluster of the OTLP trace collector (published with the mesh when tracing is
/// on).
pub const TRACE_COLLECTOR_CLUSTER: &str = "flock-otlp";
/// `envoy.config.trace.v3.OpenTelemetryConfig`.
pub const OPENTELEMETRY_CONFIG: &str =
    "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig";

/// Where spans go and how many requests start a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracingOptions {
    /// The OTLP gRPC collector: a host name or address, and a port.
    pub collector_host: String,
    /// The collector's port.
    pub collector_port: u16,
    /// The `service.name` of Envoy's spans.
    pub service_name: String,
    /// Percentage of requests without a sampled `traceparent` that start a trace
    /// (0 to 100; a request arriving with a sampled one is always traced).
    pub sample_percent: u32,
}

/// The tracing of an HTTP connection manager.
pub fn hcm_tracing(opts: &TracingOptions) -> Tracing {
    Tracing {
        random_sampling: Some(Percent {
            value: f64::from(opts.sample_percent.min(100)),
        }),
        provider: Some(tracing::Http {
            name: "envoy.tracers.opentelemetry".to_string(),
            config_type: Some(tracing::http::ConfigType::TypedConfig(super::envoy::any(
                OPENTELEMETRY_CONFIG,
                &OpenTelemetryConfig {
                    grpc_service: Some(GrpcService {
                        target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                            grpc_service::EnvoyGrpc {
                                cluster_name: TRACE_COLLECTOR_CLUSTER.to_string(),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }),
                    service_name: opts.service_name.clone(),
                    ..Default::default()
                },
            ))),
        }),
        ..Default::default()
    }
}

/// The collector's cluster: HTTP/2 (OTLP is gRPC), resolved by DNS when the host is
/// a name.
pub fn trace_collector_cluster(opts: &TracingOptions) -> super::Resource {
    let is_ip = opts.collector_host.parse::<std::net::IpAddr>().is_ok();
    let mut c = Cluster {
        name: TRACE_COLLECTOR_CLUSTER.to_string(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(if is_ip {
            cluster::DiscoveryType::Static as i32
        } else {
            cluster::DiscoveryType::StrictDns as i32
        })),
        connect_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 1,
            nanos: 0,
        }),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: TRACE_COLLECTOR_CLUSTER.to_string(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(Address {
                            address: Some(address::Address::SocketAddress(SocketAddress {
                                address: opts.collector_host.clone(),
                                port_specifier: Some(socket_address::PortSpecifier::PortValue(
                                    u32::from(opts.collector_port),
                                )),
                                ..Default::default()
                            })),
                        }),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    super::envoy::http2_options(&mut c);
    super::Resource::new(
        crate::types::CLUSTER,
        TRACE_COLLECTOR_CLUSTER.to_string(),
        super::envoy::any(crate::types::CLUSTER, &c),
    )
}

/// Where and how much to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLogOptions {
    /// The bootstrap's cluster of the agent's gRPC access log service.
    pub cluster: String,
    /// Percentage of requests and connections logged, 1 to 100.
    pub sample_percent: u32,
}

/// What names one inbound port in its access log entries:
/// `<namespace>/<pod>|<app port>`.
pub fn access_port_tag(namespace: &str, pod: &str, app_port: u16) -> String {
    format!("{namespace}/{pod}|{app_port}")
}

/// An access port tag's (`<namespace>/<pod>`, app port), or `None` for anything else.
pub fn parse_access_port_tag(tag: &str) -> Option<(&str, u16)> {
    let (pod, port) = tag.split_once('|')?;
    let (ns, name) = pod.split_once('/')?;
    if ns.is_empty() || name.is_empty() || name.contains('/') {
        return None;
    }
    Some((pod, port.parse().ok()?))
}

/// The `set_filter_state` config of an inbound port's chain: its access tag, and its
/// denial tag when its denials are logged too.
pub fn port_tags(access_tag: Option<&str>, denial_tag: Option<&str>) -> SetFilterStateConfig {
    let mut tags = Vec::new();
    if let Some(t) = denial_tag {
        tags.push((super::authz::DENIAL_PORT_KEY, t));
    }
    if let Some(t) = access_tag {
        tags.push((ACCESS_PORT_KEY, t));
    }
    filter_state_tags(&tags)
}

fn sampled(opts: &AccessLogOptions) -> Option<AccessLogFilter> {
    (opts.sample_percent < 100).then(|| AccessLogFilter {
        filter_specifier: Some(access_log_filter::FilterSpecifier::RuntimeFilter(
            RuntimeFilter {
                runtime_key: SAMPLE_RUNTIME_KEY.to_string(),
                percent_sampled: Some(FractionalPercent {
                    numerator: opts.sample_percent,
                    denominator: fractional_percent::DenominatorType::Hundred as i32,
                }),
                // Not by x-request-id: TCP has none, and a caller must not pick which
                // of its requests are logged.
                use_independent_randomness: true,
            },
        )),
    })
}

/// Entries go out at least every second (Envoy's default), or sooner when the
/// logger's 16 KiB buffer fills.
const FLUSH_MS: u32 = 1000;

/// The HCM access log of an HTTP inbound port: every (sampled) request.
pub fn http_access_log(opts: &AccessLogOptions) -> AccessLog {
    AccessLog {
        name: "envoy.access_loggers.http_grpc".to_string(),
        filter: sampled(opts),
        config_type: Some(access_log::ConfigType::TypedConfig(super::envoy::any(
            HTTP_GRPC_ACCESS_LOG,
            &HttpGrpcAccessLogConfig {
                common_config: Some(grpc_log_config(
                    &opts.cluster,
                    ACCESS_LOG_NAME,
                    ACCESS_PORT_KEY,
                    FLUSH_MS,
                )),
                ..Default::default()
            },
        ))),
    }
}

/// The listener access log of a TCP inbound port: every (sampled) connection, at
/// its close.
pub fn tcp_access_log(opts: &AccessLogOptions) -> AccessLog {
    AccessLog {
        name: "envoy.access_loggers.tcp_grpc".to_string(),
        filter: sampled(opts),
        config_type: Some(access_log::ConfigType::TypedConfig(super::envoy::any(
            TCP_GRPC_ACCESS_LOG,
            &TcpGrpcAccessLogConfig {
                common_config: Some(grpc_log_config(
                    &opts.cluster,
                    ACCESS_LOG_NAME,
                    ACCESS_PORT_KEY,
                    FLUSH_MS,
                )),
            },
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_port_tags_round_trip_and_refuse_others() {
        let tag = access_port_tag("default", "web-0", 8080);
        assert_eq!(parse_access_port_tag(&tag), Some(("default/web-0", 8080)));
        for bad in [
            "",
            "default/web-0",
            "web-0|80",
            "/w|80",
            "a/|80",
            "a/b/c|80",
            "a/b|x",
        ] {
            assert_eq!(parse_access_port_tag(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn full_logging_has_no_filter_and_sampling_a_runtime_filter() {
        let all = AccessLogOptions {
            cluster: "xds".into(),
            sample_percent: 100,
        };
        assert_eq!(http_access_log(&all).filter, None);
        let some = AccessLogOptions {
            sample_percent: 10,
            ..all
        };
        let Some(access_log_filter::FilterSpecifier::RuntimeFilter(f)) = tcp_access_log(&some)
            .filter
            .and_then(|f| f.filter_specifier)
        else {
            panic!("no runtime filter");
        };
        assert_eq!(f.percent_sampled.map(|p| p.numerator), Some(10));
        assert!(f.use_independent_randomness);
    }
}
