//! Authorization denials as the agent reports them: Envoy streams each inbound port's
//! RBAC denials to the agent's access log service (flock-xds `server::accesslog`;
//! each entry carries the port's tag, `denial_port_tag`, naming the policy, pod and
//! port, from the connection's filter state), and this counts
//! them per policy (`flock_authz_denied_total{policy,protocol}`) and logs the first
//! denial of each (policy, caller) once, so an operator learns who is refused without
//! a line per request.
//!
//! Bounded: at most [`MAX_POLICIES`] policy series (the rest count under
//! `policy="(other)"`) and [`MAX_CALLERS`] remembered (policy, caller) pairs (past that,
//! new callers are counted and one line says they are no longer logged). A log line
//! carries the path without its query (queries carry tokens) and at most
//! [`MAX_LOGGED_PATH`] bytes of it.

use envoy_types::pb::envoy::config::core::v3::{RequestMethod, address};
use envoy_types::pb::envoy::data::accesslog::v3::{
    AccessLogCommon, HttpAccessLogEntry, TcpAccessLogEntry,
    tls_properties::certificate_properties::subject_alt_name::San,
};
use envoy_types::pb::google::protobuf::StringValue;
use flock_telemetry::prometheus_client::metrics::counter::Counter;
use flock_telemetry::prometheus_client::metrics::family::Family;
use flock_telemetry::prometheus_client::registry::Registry;
use flock_xds::server::accesslog::AccessLogSink;
use flock_xds::translate::authz::{DENIAL_LOG_NAME, DENIAL_PORT_KEY, parse_denial_port_tag};
use prost::Message as _;
use std::collections::HashSet;
use std::sync::Mutex;

/// Policy series kept apart; more count under `(other)`.
pub const MAX_POLICIES: usize = 1024;
/// (policy, caller) pairs remembered as logged.
pub const MAX_CALLERS: usize = 4096;
/// Bytes of a denied request's path a log line shows.
pub const MAX_LOGGED_PATH: usize = 256;

/// The labels of `flock_authz_denied_total`: `policy`, the policy that governs the
/// port (`namespace` or `namespace/service`), and `protocol`, `http` (a request
/// answered 403) or `tcp` (a connection closed).
type DenialLabels = Vec<(&'static str, String)>;

fn labels(policy: &str, protocol: &str) -> DenialLabels {
    vec![
        ("policy", policy.to_string()),
        ("protocol", protocol.to_string()),
    ]
}

/// The agent's denial counter and once-per-caller log (see the module docs).
#[derive(Debug, Default)]
pub struct Denials {
    denied: Family<DenialLabels, Counter>,
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    policies: HashSet<String>,
    callers: HashSet<(String, String)>,
    callers_full: bool,
}

/// One denial, as the log line tells it.
struct Denial<'a> {
    policy: &'a str,
    pod: &'a str,
    port: u16,
    protocol: &'static str,
    caller: String,
    from: String,
    request: Option<(String, String)>,
}

impl Denials {
    /// A counter and log with nothing seen.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `flock_authz_denied_total` in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flock_authz_denied",
            "Calls an authorization policy denied (HTTP requests answered 403, TCP connections closed), by the policy that governs the port",
            self.denied.clone(),
        );
    }

    /// The denials counted so far under `policy` over `protocol`.
    pub fn count(&self, policy: &str, protocol: &str) -> u64 {
        self.denied
            .get(&labels(policy, protocol))
            .map_or(0, |c| c.get())
    }

    /// Every denial counted so far, under every policy.
    pub fn total(&self) -> u64 {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = 0;
        for policy in seen.policies.iter().map(String::as_str).chain(["(other)"]) {
            for protocol in ["http", "tcp"] {
                total += self.count(policy, protocol);
            }
        }
        total
    }

    fn record(&self, d: Denial<'_>) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let policy = if seen.policies.contains(d.policy) || seen.policies.len() < MAX_POLICIES {
            seen.policies.insert(d.policy.to_string());
            d.policy
        } else {
            "(other)"
        };
        self.denied.get_or_create(&labels(policy, d.protocol)).inc();
        let key = (d.policy.to_string(), d.caller.clone());
        if seen.callers.contains(&key) {
            return;
        }
        if seen.callers.len() >= MAX_CALLERS {
            if !seen.callers_full {
                seen.callers_full = true;
                tracing::warn!(
                    max = MAX_CALLERS,
                    "authorization denials: {MAX_CALLERS} (policy, caller) pairs logged; \
                     denials of new callers are counted (flock_authz_denied_total) but no \
                     longer logged"
                );
            }
            return;
        }
        seen.callers.insert(key);
        drop(seen);
        let (method, path) = d.request.unwrap_or_default();
        tracing::warn!(
            policy = d.policy,
            pod = d.pod,
            port = d.port,
            protocol = d.protocol,
            caller = %d.caller,
            from = %d.from,
            method = %method,
            path = %path,
            "authorization policy denied a caller (logged once per caller and policy; \
             flock_authz_denied_total counts every denial)"
        );
    }
}

/// The (policy, pod, app port) an entry's port tag names: `None` for another log;
/// an entry without a readable tag counts under `(untagged)`.
fn port_of(log_name: &str, common: Option<&AccessLogCommon>) -> Option<(String, String, u16)> {
    if log_name != DENIAL_LOG_NAME {
        return None;
    }
    // `envoy.string` objects are sent as a `google.protobuf.StringValue`.
    let tag = common
        .and_then(|c| c.filter_state_objects.get(DENIAL_PORT_KEY))
        .and_then(|any| StringValue::decode(any.value.as_slice()).ok())
        .map(|v| v.value)
        .unwrap_or_default();
    Some(match parse_denial_port_tag(&tag) {
        Some((policy, pod, port)) => (policy.to_string(), pod.to_string(), port),
        None => ("(untagged)".to_string(), String::new(), 0),
    })
}

/// The caller's SPIFFE ID (its certificate's URI SAN), or why there is none.
fn caller_of(common: Option<&AccessLogCommon>) -> String {
    common
        .and_then(|c| c.tls_properties.as_ref())
        .and_then(|t| t.peer_certificate_properties.as_ref())
        .and_then(|p| {
            p.subject_alt_name.iter().find_map(|s| match &s.san {
                Some(San::Uri(uri)) => Some(bounded(uri, 512)),
                _ => None,
            })
        })
        .unwrap_or_else(|| "(no verified identity)".to_string())
}

/// The caller's address as Envoy saw it.
fn from_of(common: Option<&AccessLogCommon>) -> String {
    match common
        .and_then(|c| c.downstream_remote_address.as_ref())
        .and_then(|a| a.address.as_ref())
    {
        Some(address::Address::SocketAddress(s)) => {
            let port = match s.port_specifier {
                Some(envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(p)) => p,
                _ => 0,
            };
            format!("{}:{port}", bounded(&s.address, 64))
        }
        _ => String::new(),
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
fn bounded(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// A denied request's path as its log line shows it: no query (queries carry tokens),
/// at most [`MAX_LOGGED_PATH`] bytes.
fn logged_path(path: &str) -> String {
    bounded(path.split('?').next().unwrap_or_default(), MAX_LOGGED_PATH)
}

/// Whether Envoy's details say RBAC refused it: `rbac_access_denied_matched_policy[..]`
/// (HTTP responses, and connections in most versions) or `rbac_deny_close` (the
/// network filter's connection close in some).
fn is_rbac_denial(details: &str) -> bool {
    details.starts_with("rbac_access_denied") || details.starts_with("rbac_deny")
}

impl AccessLogSink for Denials {
    fn http(&self, log_name: &str, entry: &HttpAccessLogEntry) {
        let common = entry.common_properties.as_ref();
        let Some((policy, pod, port)) = port_of(log_name, common) else {
            return;
        };
        let (policy, pod) = (policy.as_str(), pod.as_str());
        let denied = entry
            .response
            .as_ref()
            .is_some_and(|r| is_rbac_denial(&r.response_code_details));
        if !denied {
            return;
        }
        let request = entry.request.as_ref().map(|r| {
            let method = RequestMethod::try_from(r.request_method)
                .map(|m| m.as_str_name().to_string())
                .unwrap_or_default();
            (method, logged_path(&r.path))
        });
        self.record(Denial {
            policy,
            pod,
            port,
            protocol: "http",
            caller: caller_of(common),
            from: from_of(common),
            request,
        });
    }

    fn tcp(&self, log_name: &str, entry: &TcpAccessLogEntry) {
        let common = entry.common_properties.as_ref();
        let Some((policy, pod, port)) = port_of(log_name, common) else {
            return;
        };
        let (policy, pod) = (policy.as_str(), pod.as_str());
        if !common.is_some_and(|c| is_rbac_denial(&c.connection_termination_details)) {
            return;
        }
        self.record(Denial {
            policy,
            pod,
            port,
            protocol: "tcp",
            caller: caller_of(common),
            from: from_of(common),
            request: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::data::accesslog::v3::{
        HttpRequestProperties, HttpResponseProperties, TlsProperties,
        tls_properties::{CertificateProperties, certificate_properties::SubjectAltName},
    };
    use envoy_types::pb::google::protobuf::Any;

    const TAG: &str = "shop/web|shop/web-0|8080";
    const DENIED: &str = "rbac_access_denied_matched_policy[none]";

    fn common(tag: Option<&str>, caller: Option<&str>, termination: &str) -> AccessLogCommon {
        AccessLogCommon {
            tls_properties: caller.map(|id| TlsProperties {
                peer_certificate_properties: Some(CertificateProperties {
                    subject_alt_name: vec![SubjectAltName {
                        san: Some(San::Uri(id.to_string())),
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            }),
            filter_state_objects: tag
                .map(|t| {
                    let any = Any {
                        type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                        value: StringValue {
                            value: t.to_string(),
                        }
                        .encode_to_vec(),
                    };
                    (DENIAL_PORT_KEY.to_string(), any)
                })
                .into_iter()
                .collect(),
            connection_termination_details: termination.to_string(),
            ..Default::default()
        }
    }

    fn http_on(tag: Option<&str>, caller: &str, details: &str) -> HttpAccessLogEntry {
        HttpAccessLogEntry {
            common_properties: Some(common(tag, Some(caller), "")),
            request: Some(HttpRequestProperties {
                request_method: RequestMethod::Get as i32,
                path: "/admin?token=secret".to_string(),
                ..Default::default()
            }),
            response: Some(HttpResponseProperties {
                response_code: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 403 }),
                response_code_details: details.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn http(caller: &str, details: &str) -> HttpAccessLogEntry {
        http_on(Some(TAG), caller, details)
    }

    fn callers(d: &Denials) -> usize {
        d.seen.lock().unwrap().callers.len()
    }

    #[test]
    fn every_denial_counts_and_each_caller_is_remembered_once() {
        let d = Denials::new();
        d.http(DENIAL_LOG_NAME, &http("spiffe://t/ns/shop/sa/b", DENIED));
        d.http(DENIAL_LOG_NAME, &http("spiffe://t/ns/shop/sa/b", DENIED));
        d.http(DENIAL_LOG_NAME, &http("spiffe://t/ns/shop/sa/c", DENIED));
        assert_eq!(d.count("shop/web", "http"), 3);
        assert_eq!(callers(&d), 2);
        // The same caller over TCP: counted, already logged.
        let tcp = TcpAccessLogEntry {
            common_properties: Some(common(
                Some(TAG),
                Some("spiffe://t/ns/shop/sa/b"),
                "rbac_deny_close",
            )),
            ..Default::default()
        };
        d.tcp(DENIAL_LOG_NAME, &tcp);
        assert_eq!(d.count("shop/web", "tcp"), 1);
        assert_eq!(callers(&d), 2);
    }

    #[test]
    fn what_is_not_an_rbac_denial_or_not_ours_is_ignored() {
        let d = Denials::new();
        // An app's own 403, a connection that ended normally, another log.
        d.http(
            DENIAL_LOG_NAME,
            &http("spiffe://t/ns/shop/sa/b", "via_upstream"),
        );
        d.tcp(
            DENIAL_LOG_NAME,
            &TcpAccessLogEntry {
                common_properties: Some(common(Some(TAG), None, "")),
                ..Default::default()
            },
        );
        d.http("some-other-log", &http("spiffe://t/ns/shop/sa/b", DENIED));
        assert_eq!(d.count("shop/web", "http"), 0);
        assert_eq!(d.count("shop/web", "tcp"), 0);
        assert_eq!(callers(&d), 0);
    }

    #[test]
    fn a_denial_without_a_readable_tag_still_counts() {
        let d = Denials::new();
        d.http(
            DENIAL_LOG_NAME,
            &http_on(None, "spiffe://t/ns/shop/sa/b", DENIED),
        );
        d.http(
            DENIAL_LOG_NAME,
            &http_on(Some("no|tag"), "spiffe://t/ns/shop/sa/b", DENIED),
        );
        assert_eq!(d.count("(untagged)", "http"), 2);
    }

    #[test]
    fn policies_and_callers_are_bounded() {
        let d = Denials::new();
        for i in 0..MAX_POLICIES + 5 {
            let tag = format!("ns{i}|ns{i}/p|80");
            d.http(
                DENIAL_LOG_NAME,
                &http_on(Some(&tag), "spiffe://t/ns/x/sa/a", DENIED),
            );
        }
        assert_eq!(d.count("(other)", "http"), 5);
        assert_eq!(d.seen.lock().unwrap().policies.len(), MAX_POLICIES);
        for i in 0..MAX_CALLERS + 5 {
            d.http(
                DENIAL_LOG_NAME,
                &http(&format!("spiffe://t/ns/x/sa/a{i}"), DENIED),
            );
        }
        assert_eq!(callers(&d), MAX_CALLERS);
        assert!(d.seen.lock().unwrap().callers_full);
    }

    #[test]
    fn a_path_is_logged_without_its_query_and_bounded() {
        assert_eq!(logged_path("/admin?token=secret"), "/admin");
        let long = format!("/{}?q", "é".repeat(MAX_LOGGED_PATH));
        let cut = logged_path(&long);
        assert!(cut.len() <= MAX_LOGGED_PATH && cut.len() > MAX_LOGGED_PATH - 2);
        assert!(long.starts_with(&cut));
    }
}
