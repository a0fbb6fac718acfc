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

use envoy_types::pb::envoy::config::rbac::v3::{
    Permission, Policy as RbacPolicy, Principal, Rbac, permission, principal, rbac,
};
use envoy_types::pb::envoy::config::route::v3::{HeaderMatcher, header_matcher};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    PathMatcher, RegexMatcher, StringMatcher, path_matcher, string_matcher::MatchPattern,
};
use flock_core::authz::{Action, DefaultAction, Effective, PathMatch, Principal as Who, Rule};
use std::collections::{BTreeSet, HashMap};

/// `envoy.extensions.filters.http.rbac.v3.RBAC`.
pub const HTTP_RBAC: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";
/// `envoy.extensions.filters.network.rbac.v3.RBAC`.
pub const NETWORK_RBAC: &str = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC";

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
}
