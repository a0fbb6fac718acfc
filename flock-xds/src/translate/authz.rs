//! An inbound listener's authorization as Envoy RBAC filters: `flock_core::authz`'s
//! effective policy for the ports it serves, enforced on the verified peer certificate.
//!
//! Per policy level (the service's policy, then each narrowing annotation) at most two
//! filters, in order: a `DENY` filter matching the deny rules, then an `ALLOW` filter
//! matching the allow rules and the default's callers; every filter must let a request
//! through, so a level's deny rules win over its allow rules and a narrowing level can
//! only refuse more. A refused policy is one `ALLOW` filter with no policy: every
//! connection or request is denied (fail closed).
//!
//! Each filter holds **one** RBAC policy (`rbac.policies` is a protobuf map, which
//! prost encodes in hash order: with one entry the encoding, and so the resource's
//! content hash, is deterministic). Each rule is one principal of it: `and_ids` of the
//! caller (`authenticated.principal_name`: the exact URI SAN, or a regex for a
//! namespace or a service account) and, on HTTP ports, the method (`:method`), the path
//! (`url_path`, without query) and the host (`:authority`, any case). Port conditions
//! are decided here, statically: a rule applies to a listener if it names no port or
//! one of the service ports the listener serves.
//!
//! On a TCP port an allow rule with HTTP conditions is left out (it can never be
//! checked there) and a deny rule keeps only its callers (it denies the connection
//! outright): both fail closed, as `flock_core::authz` decides.

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLog, AccessLogFilter, MetadataFilter, OrFilter, access_log, access_log_filter,
};
use envoy_types::pb::envoy::config::core::v3::{
    ApiVersion, DataSource, GrpcService, SubstitutionFormatString, data_source, grpc_service,
    substitution_format_string,
};
use envoy_types::pb::envoy::config::rbac::v3::{
    Permission, Policy as RbacPolicy, Principal, Rbac, permission, principal, rbac,
};
use envoy_types::pb::envoy::config::route::v3::{HeaderMatcher, header_matcher};
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{
    CommonGrpcAccessLogConfig, HttpGrpcAccessLogConfig, TcpGrpcAccessLogConfig,
};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{
    FilterStateValue, filter_state_value,
};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterStateConfig;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    MetadataMatcher, ValueMatcher, metadata_matcher, value_matcher,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    PathMatcher, RegexMatcher, StringMatcher, path_matcher, string_matcher::MatchPattern,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use flock_core::authz::{Action, DefaultAction, Effective, PathMatch, Principal as Who, Rule};
use std::collections::{BTreeSet, HashMap};

/// `envoy.extensions.filters.http.rbac.v3.RBAC`.
pub const HTTP_RBAC: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";
/// `envoy.extensions.filters.network.rbac.v3.RBAC`.
pub const NETWORK_RBAC: &str = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC";

/// `envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig`.
pub const HTTP_GRPC_ACCESS_LOG: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig";
/// `envoy.extensions.access_loggers.grpc.v3.TcpGrpcAccessLogConfig`.
pub const TCP_GRPC_ACCESS_LOG: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.TcpGrpcAccessLogConfig";
/// The gRPC access log every inbound port's denials go to. One name (one logger
/// configuration) for all ports: Envoy keeps one stream per logger configuration and
/// worker thread, so a name per port would open a stream per port.
pub const DENIAL_LOG_NAME: &str = "flock.authz.denied";
/// The connection's filter state key that names the port a denial happened on
/// ([`denial_port_tag`]), set by the listener's first filter and sent with each entry.
pub const DENIAL_PORT_KEY: &str = "flock.authz.port";

/// One RBAC filter's rules, and whether it denies what they match or allows only it.
#[derive(Clone, Debug, PartialEq)]
pub struct RbacLayer {
    /// `deny` or `allow`, and the level (`0`: the service's policy; `1`..: narrowing).
    pub name: String,
    /// The rules.
    pub rules: Rbac,
}

/// The RBAC layers that enforce `effective` on a listener serving the service ports
/// `ports`, over HTTP (`http`) or TCP. Empty for [`Effective::Unrestricted`]: no filter,
/// the listener as without policies.
pub fn layers(effective: &Effective, ports: &BTreeSet<u16>, http: bool) -> Vec<RbacLayer> {
    let mut out = Vec::new();
    let mut level = 0;
    let mut next = Some(effective);
    while let Some(e) = next {
        next = None;
        match e {
            Effective::Unrestricted => {}
            Effective::Invalid(_) => out.push(RbacLayer {
                name: format!("refused{level}"),
                rules: Rbac {
                    action: rbac::Action::Allow as i32,
                    policies: HashMap::new(),
                    ..Default::default()
                },
            }),
            Effective::Enforced {
                default,
                namespace,
                rules,
                narrowed_by,
            } => {
                let applies = |r: &&Rule| r.ports.is_empty() || !r.ports.is_disjoint(ports);
                let deny: Vec<Principal> = rules
                    .iter()
                    .filter(applies)
                    .filter(|r| r.action == Action::Deny)
                    .map(|r| rule_principal(r, http))
                    .collect();
                let mut allow: Vec<Principal> = rules
                    .iter()
                    .filter(applies)
                    .filter(|r| r.action == Action::Allow && (http || !r.is_http()))
                    .map(|r| rule_principal(r, http))
                    .collect();
                match default {
                    DefaultAction::AllAuthenticated => allow.push(authenticated(None)),
                    DefaultAction::SameNamespace => allow.push(authenticated(Some(regex(
                        &format!("^spiffe://[^/]+/ns/{}/.+$", escape(namespace)),
                    )))),
                    DefaultAction::Deny => {}
                }
                if !deny.is_empty() {
                    out.push(RbacLayer {
                        name: format!("deny{level}"),
                        rules: one_policy(rbac::Action::Deny, "deny", deny),
                    });
                }
                out.push(RbacLayer {
                    name: format!("allow{level}"),
                    rules: one_policy(rbac::Action::Allow, "allow", allow),
                });
                next = narrowed_by.as_deref();
            }
        }
        level += 1;
    }
    out
}

/// An HTTP RBAC filter's config for `layer`; its stats are
/// `http.<hcm prefix>.rbac.<stat_prefix><layer>.{allowed,denied}`.
pub fn http_filter(layer: &RbacLayer, stat_prefix: &str) -> HttpRbac {
    HttpRbac {
        rules: Some(layer.rules.clone()),
        rules_stat_prefix: format!("{stat_prefix}{}.", layer.name),
        ..Default::default()
    }
}

/// A network RBAC filter's config for `layer`; its stats are
/// `<stat_prefix><layer>.rbac.{allowed,denied}`.
pub fn network_filter(layer: &RbacLayer, stat_prefix: &str) -> NetworkRbac {
    NetworkRbac {
        rules: Some(layer.rules.clone()),
        stat_prefix: format!("{stat_prefix}{}.", layer.name),
        ..Default::default()
    }
}

/// What names one inbound port in its denials' entries (the [`DENIAL_PORT_KEY`]
/// filter state): `<policy>|<namespace>/<pod>|<app port>`, what the agent counts them
/// by ([`parse_denial_port_tag`]). `policy` names the policy that governs the port
/// (`namespace` or `namespace/service`).
pub fn denial_port_tag(policy: &str, namespace: &str, pod: &str, app_port: u16) -> String {
    format!("{policy}|{namespace}/{pod}|{app_port}")
}

/// A port tag's (policy, pod, app port), or `None` for anything else.
pub fn parse_denial_port_tag(tag: &str) -> Option<(&str, &str, u16)> {
    let mut fields = tag.split('|');
    let (policy, pod, port) = (fields.next()?, fields.next()?, fields.next()?);
    if fields.next().is_some() || policy.is_empty() || !pod.contains('/') {
        return None;
    }
    Some((policy, pod, port.parse().ok()?))
}

/// The `set_filter_state` config that sets each `(key, value)` on a new connection,
/// as a string object access logs can carry (`filter_state_objects_to_log`). A `%` is
/// doubled: the value is a format string, where `%%` is a literal `%`.
pub fn filter_state_tags(tags: &[(&str, &str)]) -> SetFilterStateConfig {
    SetFilterStateConfig {
        on_new_connection: tags
            .iter()
            .map(|(key, value)| FilterStateValue {
                key: Some(filter_state_value::Key::ObjectKey(key.to_string())),
                factory_key: "envoy.string".to_string(),
                value: Some(filter_state_value::Value::FormatString(
                    SubstitutionFormatString {
                        format: Some(substitution_format_string::Format::TextFormatSource(
                            DataSource {
                                specifier: Some(data_source::Specifier::InlineString(
                                    value.replace('%', "%%"),
                                )),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A gRPC access logger's common config: entries of the log `log_name`, carrying the
/// filter state object `state_key`, to the bootstrap cluster `cluster`, flushed at
/// least every `flush_ms`.
pub(super) fn grpc_log_config(
    cluster: &str,
    log_name: &str,
    state_key: &str,
    flush_ms: u32,
) -> CommonGrpcAccessLogConfig {
    CommonGrpcAccessLogConfig {
        log_name: log_name.to_string(),
        filter_state_objects_to_log: vec![state_key.to_string()],
        grpc_service: Some(GrpcService {
            target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                grpc_service::EnvoyGrpc {
                    cluster_name: cluster.to_string(),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        transport_api_version: ApiVersion::V3 as i32,
        buffer_flush_interval: Some(PbDuration {
            seconds: i64::from(flush_ms / 1000),
            nanos: (flush_ms % 1000 * 1_000_000) as i32,
        }),
        ..Default::default()
    }
}

/// Denials are rare and an operator waits for them: flushed within 0.5 s.
fn denial_log_config(cluster: &str) -> CommonGrpcAccessLogConfig {
    grpc_log_config(cluster, DENIAL_LOG_NAME, DENIAL_PORT_KEY, 500)
}

/// The HCM access log that streams an HTTP port's RBAC denials (and nothing else) to
/// `cluster` over the gRPC access log service. The HTTP RBAC filter records its
/// decision in the request's dynamic metadata (`envoy.filters.http.rbac`, key
/// `<rules_stat_prefix>enforced_engine_result`); a request is logged when any of the
/// port's layers says `denied`. `None` without layers.
pub fn http_denial_log(
    layers: &[RbacLayer],
    stat_prefix: &str,
    cluster: &str,
) -> Option<AccessLog> {
    let denied_by = |layer: &RbacLayer| AccessLogFilter {
        filter_specifier: Some(access_log_filter::FilterSpecifier::MetadataFilter(
            MetadataFilter {
                matcher: Some(MetadataMatcher {
                    filter: "envoy.filters.http.rbac".to_string(),
                    path: vec![metadata_matcher::PathSegment {
                        segment: Some(metadata_matcher::path_segment::Segment::Key(format!(
                            "{}enforced_engine_result",
                            http_filter(layer, stat_prefix).rules_stat_prefix
                        ))),
                    }],
                    value: Some(ValueMatcher {
                        match_pattern: Some(value_matcher::MatchPattern::StringMatch(exact(
                            "denied",
                        ))),
                    }),
                    invert: false,
                }),
                // A request no layer decided (none ran) is not a denial.
                match_if_key_not_found: Some(envoy_types::pb::google::protobuf::BoolValue {
                    value: false,
                }),
            },
        )),
    };
    let mut filters: Vec<AccessLogFilter> = layers.iter().map(denied_by).collect();
    let filter = match filters.len() {
        0 => return None,
        1 => filters.pop(),
        _ => Some(AccessLogFilter {
            filter_specifier: Some(access_log_filter::FilterSpecifier::OrFilter(OrFilter {
                filters,
            })),
        }),
    };
    Some(AccessLog {
        name: "envoy.access_loggers.http_grpc".to_string(),
        filter,
        config_type: Some(access_log::ConfigType::TypedConfig(super::envoy::any(
            HTTP_GRPC_ACCESS_LOG,
            &HttpGrpcAccessLogConfig {
                common_config: Some(denial_log_config(cluster)),
                ..Default::default()
            },
        ))),
    })
}

/// The listener access log that streams a TCP port's connections to `cluster` over
/// the gRPC access log service, for the agent to pick out the ones RBAC closed. The
/// network RBAC filter records an enforced denial only in the connection's
/// termination details (`rbac_access_denied_matched_policy[...]`), which no access
/// log filter can match: every connection of a TCP port under a policy is sent, one
/// small entry at its close, batched.
pub fn tcp_denial_log(cluster: &str) -> AccessLog {
    AccessLog {
        name: "envoy.access_loggers.tcp_grpc".to_string(),
        filter: None,
        config_type: Some(access_log::ConfigType::TypedConfig(super::envoy::any(
            TCP_GRPC_ACCESS_LOG,
            &TcpGrpcAccessLogConfig {
                common_config: Some(denial_log_config(cluster)),
            },
        ))),
    }
}

/// An RBAC of one policy named `name` whose principals are `principals` (none: no
/// policy at all; for `ALLOW` that denies everything, for `DENY` nothing).
fn one_policy(action: rbac::Action, name: &str, principals: Vec<Principal>) -> Rbac {
    let mut policies = HashMap::new();
    if !principals.is_empty() {
        policies.insert(
            name.to_string(),
            RbacPolicy {
                permissions: vec![Permission {
                    rule: Some(permission::Rule::Any(true)),
                }],
                principals,
                ..Default::default()
            },
        );
    }
    Rbac {
        action: action as i32,
        policies,
        ..Default::default()
    }
}

fn authenticated(name: Option<StringMatcher>) -> Principal {
    Principal {
        identifier: Some(principal::Identifier::Authenticated(
            principal::Authenticated {
                principal_name: name,
            },
        )),
    }
}

fn exact(s: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(MatchPattern::Exact(s.to_string())),
        ..Default::default()
    }
}

fn regex(r: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(MatchPattern::SafeRegex(RegexMatcher {
            regex: r.to_string(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A DNS label or subdomain in a regex (`.` is the only metacharacter they can hold).
fn escape(s: &str) -> String {
    s.replace('.', "\\.")
}

fn any_of(ids: Vec<Principal>) -> Principal {
    if ids.len() == 1 {
        return ids.into_iter().next().expect("one");
    }
    Principal {
        identifier: Some(principal::Identifier::OrIds(principal::Set { ids })),
    }
}

fn header(name: &str, m: StringMatcher) -> Principal {
    Principal {
        identifier: Some(principal::Identifier::Header(HeaderMatcher {
            name: name.to_string(),
            header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(m)),
            ..Default::default()
        })),
    }
}

/// One rule as a principal: its callers and, over HTTP, its request conditions.
fn rule_principal(r: &Rule, http: bool) -> Principal {
    let callers = r
        .from
        .iter()
        .map(|w| match w {
            Who::Authenticated => authenticated(None),
            Who::Id(id) => authenticated(Some(exact(id))),
            Who::Namespace(ns) => authenticated(Some(regex(&format!(
                "^spiffe://[^/]+/ns/{}/.+$",
                escape(ns)
            )))),
            Who::ServiceAccount { namespace, account } => authenticated(Some(regex(&format!(
                "^spiffe://[^/]+/ns/{}/sa/{}$",
                escape(namespace),
                escape(account)
            )))),
        })
        .collect();
    let mut all = vec![any_of(callers)];
    if http {
        if !r.methods.is_empty() {
            all.push(any_of(
                r.methods
                    .iter()
                    .map(|m| header(":method", exact(m)))
                    .collect(),
            ));
        }
        if !r.paths.is_empty() {
            all.push(any_of(
                r.paths
                    .iter()
                    .map(|p| Principal {
                        identifier: Some(principal::Identifier::UrlPath(PathMatcher {
                            rule: Some(path_matcher::Rule::Path(match p {
                                PathMatch::Exact(p) => exact(p),
                                PathMatch::Prefix(p) => StringMatcher {
                                    match_pattern: Some(MatchPattern::Prefix(p.clone())),
                                    ..Default::default()
                                },
                            })),
                        })),
                    })
                    .collect(),
            ));
        }
        if !r.hosts.is_empty() {
            all.push(any_of(
                r.hosts
                    .iter()
                    .map(|h| {
                        header(
                            ":authority",
                            StringMatcher {
                                ignore_case: true,
                                ..exact(h)
                            },
                        )
                    })
                    .collect(),
            ));
        }
    }
    if all.len() == 1 {
        return all.pop().expect("one");
    }
    Principal {
        identifier: Some(principal::Identifier::AndIds(principal::Set { ids: all })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flock_core::authz::{Policy, effective, parse_spec};

    fn eff(json: &str) -> Effective {
        let p = parse_spec(json.as_bytes()).and_then(|s| Policy::from_spec(&s));
        effective("shop", None, Some(&p))
    }

    fn names(ls: &[RbacLayer]) -> Vec<(&str, i32, usize)> {
        ls.iter()
            .map(|l| {
                (
                    l.name.as_str(),
                    l.rules.action,
                    l.rules
                        .policies
                        .values()
                        .map(|p| p.principals.len())
                        .sum::<usize>(),
                )
            })
            .collect()
    }

    const ALLOW: i32 = rbac::Action::Allow as i32;
    const DENY: i32 = rbac::Action::Deny as i32;

    #[test]
    fn unrestricted_has_no_filter_and_refused_denies_everything() {
        assert!(layers(&Effective::Unrestricted, &BTreeSet::from([80]), true).is_empty());
        let bad = eff(r#"{"namespace": "shop", "service": "web", "rules": [{"action": "allow"}]}"#);
        let ls = layers(&bad, &BTreeSet::from([80]), true);
        assert_eq!(names(&ls), [("refused0", ALLOW, 0)]);
        assert!(ls[0].rules.policies.is_empty());
    }

    #[test]
    fn deny_rules_then_allow_rules_and_the_default() {
        let e = eff(
            r#"{"namespace": "shop", "service": "web", "default": "same-namespace", "rules": [
                {"action": "allow", "from": {"serviceAccounts": ["shop/a"]}, "to": {"methods": ["GET"], "paths": ["/api/*"]}},
                {"action": "deny", "from": {"ids": ["spiffe://td/ns/shop/sa/b"]}, "to": {"paths": ["/admin"]}},
                {"action": "allow", "from": {"ids": ["*"]}, "to": {"ports": [5432]}}]}"#,
        );
        // HTTP port 80: the deny rule with its path; the GET rule and the default (the
        // port-5432 rule does not apply here).
        let http = layers(&e, &BTreeSet::from([80]), true);
        assert_eq!(names(&http), [("deny0", DENY, 1), ("allow0", ALLOW, 2)]);
        let deny = &http[0].rules.policies["deny"].principals[0];
        let Some(principal::Identifier::AndIds(set)) = &deny.identifier else {
            panic!("{deny:?}")
        };
        assert_eq!(set.ids.len(), 2, "the caller and the path");
        // TCP port 5432: the deny rule denies the caller outright (no path there), the
        // GET rule cannot be checked and is left out, the port-5432 rule applies.
        let tcp = layers(&e, &BTreeSet::from([5432]), false);
        assert_eq!(names(&tcp), [("deny0", DENY, 1), ("allow0", ALLOW, 2)]);
        let deny = &tcp[0].rules.policies["deny"].principals[0];
        assert!(
            matches!(&deny.identifier, Some(principal::Identifier::Authenticated(a))
                if a.principal_name == Some(exact("spiffe://td/ns/shop/sa/b"))),
            "{deny:?}"
        );
    }

    #[test]
    fn a_deny_default_without_allow_rules_is_an_empty_allow_filter() {
        let e = eff(r#"{"namespace": "shop", "default": "deny"}"#);
        let ls = layers(&e, &BTreeSet::from([80]), false);
        assert_eq!(names(&ls), [("allow0", ALLOW, 0)]);
    }

    #[test]
    fn a_narrowing_annotation_adds_its_own_filters() {
        let e = eff(r#"{"namespace": "shop", "default": "all-authenticated"}"#).narrowed(
            "shop",
            Some(&flock_core::authz::annotation_policy(
                r#"{"default": "same-namespace", "rules": [{"action": "deny", "from": {"namespaces": ["other"]}}]}"#,
            )),
        );
        let ls = layers(&e, &BTreeSet::from([80]), true);
        assert_eq!(
            names(&ls),
            [
                ("allow0", ALLOW, 1),
                ("deny1", DENY, 1),
                ("allow1", ALLOW, 1)
            ]
        );
        let f = http_filter(&ls[1], "authz_web_");
        assert_eq!(f.rules_stat_prefix, "authz_web_deny1.");
        let n = network_filter(&ls[1], "authz_web_");
        assert_eq!(n.stat_prefix, "authz_web_deny1.");
    }

    #[test]
    fn regexes_escape_dots() {
        let e = eff(
            r#"{"namespace": "shop", "rules": [{"action": "allow", "from": {"serviceAccounts": ["shop/a.b"]}}]}"#,
        );
        let ls = layers(&e, &BTreeSet::new(), false);
        let p = &ls[0].rules.policies["allow"].principals[0];
        let Some(principal::Identifier::Authenticated(a)) = &p.identifier else {
            panic!("{p:?}")
        };
        assert_eq!(
            a.principal_name,
            Some(regex(r"^spiffe://[^/]+/ns/shop/sa/a\.b$"))
        );
    }

    #[test]
    fn denial_port_tags_round_trip_and_refuse_others() {
        let tag = denial_port_tag("shop/web", "shop", "web-0", 8080);
        assert_eq!(tag, "shop/web|shop/web-0|8080");
        assert_eq!(
            parse_denial_port_tag(&tag),
            Some(("shop/web", "shop/web-0", 8080))
        );
        for bad in [
            "",
            "access_log",
            "shop/web|shop/web-0",
            "shop/web|shop/web-0|80|x",
            "|shop/web-0|80",
            "shop|web-0|80",
            "shop|shop/web-0|99999",
        ] {
            assert_eq!(parse_denial_port_tag(bad), None, "{bad:?}");
        }
    }

    /// The HTTP denial log matches each layer's own decision key (the filter's
    /// `rules_stat_prefix` + `enforced_engine_result`), any of them `denied`, and
    /// streams to the named cluster; one layer needs no `or`.
    #[test]
    fn the_http_denial_log_matches_every_layers_decision() {
        let e = eff(r#"{"namespace": "shop", "default": "deny", "rules": [
                {"action": "deny", "from": {"namespaces": ["evil"]}},
                {"action": "allow", "from": {"namespaces": ["shop"]}}]}"#);
        let ls = layers(&e, &BTreeSet::from([80]), true);
        assert_eq!(ls.len(), 2);
        let log = http_denial_log(&ls, "authz_p_", "xds").unwrap();
        let Some(access_log_filter::FilterSpecifier::OrFilter(or)) =
            log.filter.unwrap().filter_specifier
        else {
            panic!("an or of the layers")
        };
        let keys: Vec<String> = or
            .filters
            .iter()
            .map(|f| match &f.filter_specifier {
                Some(access_log_filter::FilterSpecifier::MetadataFilter(m)) => {
                    let m = m.matcher.as_ref().unwrap();
                    assert_eq!(m.filter, "envoy.filters.http.rbac");
                    match &m.path[0].segment {
                        Some(metadata_matcher::path_segment::Segment::Key(k)) => k.clone(),
                        None => panic!("no key"),
                    }
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            keys,
            [
                "authz_p_deny0.enforced_engine_result",
                "authz_p_allow0.enforced_engine_result"
            ]
        );
        let Some(access_log::ConfigType::TypedConfig(any)) = log.config_type else {
            panic!("typed config")
        };
        assert_eq!(any.type_url, HTTP_GRPC_ACCESS_LOG);
        let config = <HttpGrpcAccessLogConfig as prost::Message>::decode(any.value.as_slice())
            .unwrap()
            .common_config
            .unwrap();
        assert_eq!(config.log_name, DENIAL_LOG_NAME);
        assert_eq!(config.filter_state_objects_to_log, [DENIAL_PORT_KEY]);
        assert_eq!(config.transport_api_version, ApiVersion::V3 as i32);
        let Some(grpc_service::TargetSpecifier::EnvoyGrpc(g)) =
            config.grpc_service.unwrap().target_specifier
        else {
            panic!("envoy_grpc")
        };
        assert_eq!(g.cluster_name, "xds");

        let one = layers(
            &eff(r#"{"namespace": "shop", "default": "deny"}"#),
            &BTreeSet::new(),
            true,
        );
        let log = http_denial_log(&one, "authz_p_", "xds").unwrap();
        assert!(matches!(
            log.filter.unwrap().filter_specifier,
            Some(access_log_filter::FilterSpecifier::MetadataFilter(_))
        ));
        assert!(http_denial_log(&[], "authz_p_", "xds").is_none());
    }
}
