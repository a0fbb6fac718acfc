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

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLog, AccessLogFilter, RuntimeFilter, access_log, access_log_filter,
};
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{
    HttpGrpcAccessLogConfig, TcpGrpcAccessLogConfig,
};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterStateConfig;
use envoy_types::pb::envoy::r#type::v3::{FractionalPercent, fractional_percent};

use super::authz::{HTTP_GRPC_ACCESS_LOG, TCP_GRPC_ACCESS_LOG, filter_state_tags, grpc_log_config};

/// The log name of access log entries.
pub const ACCESS_LOG_NAME: &str = "flock.access";
/// The filter state key carrying an inbound port's [`access_port_tag`].
pub const ACCESS_PORT_KEY: &str = "flock.access.port";
/// The runtime key of the sampling filter (its default is the configured percentage;
/// an Envoy runtime override of this key changes it without a new listener).
pub const SAMPLE_RUNTIME_KEY: &str = "flock.access_log.sample_percent";

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
