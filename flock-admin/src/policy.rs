//! `flockctl policy check`'s answer from a [`Policies`] document: the decision of
//! `flock_core::authz` for one call, and the rule that made it, named by where it is
//! written (which policy, which rule).

use crate::api::Policies;
use flock_core::authz::{self, Action, Checked, Decider, Effective, PolicyError, Request};
pub use flock_core::authz::{HttpRequest, Target};

/// One call to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call<'a> {
    /// The caller's SPIFFE ID (`None`: plaintext).
    pub from: Option<&'a str>,
    /// The service called.
    pub to: &'a Target,
    /// The service port called (`None`: a port no rule names).
    pub port: Option<u16>,
    /// The HTTP request, for an HTTP port.
    pub http: Option<HttpRequest<'a>>,
}

/// The answer for the service, and for each of this node's pods of it whose own
/// annotation narrows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Allowed by the service's policy (namespace and service)?
    pub allowed: bool,
    /// What decided, in words.
    pub why: String,
    /// Pods whose annotation decides otherwise: `(pod, allowed, why)`.
    pub pods: Vec<(String, bool, String)>,
}

fn checked(doc: &Policies, target: &Target) -> Option<Checked> {
    doc.policies
        .iter()
        .find(|p| p.target == *target)
        .map(|p| match (&p.spec, &p.error) {
            (Some(spec), None) => authz::Policy::from_spec(spec),
            (_, error) => Err(PolicyError {
                field: "policy".into(),
                reason: format!(
                    "refused ({}): {}",
                    p.origin,
                    error.as_deref().unwrap_or("no spec")
                ),
            }),
        })
}

/// Where rule `index` of the effective list is written: the namespace's rules come
/// first, then the service's.
fn rule_name(doc: &Policies, to: &Target, index: usize) -> String {
    let ns = Target {
        namespace: to.namespace.clone(),
        service: None,
    };
    let count = |t: &Target| match checked(doc, t) {
        Some(Ok(p)) => p.rules.len(),
        _ => 0,
    };
    let in_ns = count(&ns);
    let (target, i) = if index < in_ns || to.service.is_none() {
        (ns, index)
    } else {
        (to.clone(), index - in_ns)
    };
    let origin = doc
        .policies
        .iter()
        .find(|p| p.target == target)
        .map(|p| p.origin.as_str())
        .unwrap_or("?");
    format!("rules[{i}] of the policy of {target} ({origin})")
}

fn words(doc: &Policies, to: &Target, by: &Decider) -> String {
    match by {
        Decider::NoPolicy => "no policy governs it (every caller, as without policies)".into(),
        Decider::Rule { index, action } => format!(
            "{} rule: {}",
            match action {
                Action::Allow => "allow",
                Action::Deny => "deny",
            },
            rule_name(doc, to, *index)
        ),
        Decider::Default(d) => format!("the default ({d})"),
        Decider::Unauthenticated => {
            "a policy is in force and the caller is not authenticated".into()
        }
        Decider::Invalid(e) => format!("the policy is refused, so every call is denied: {e}"),
        Decider::Annotation(inner) => {
            format!("the pod's own annotation: {}", annotation_words(inner))
        }
    }
}

fn annotation_words(by: &Decider) -> String {
    match by {
        Decider::Rule { index, action } => format!(
            "its {} rules[{index}]",
            match action {
                Action::Allow => "allow",
                Action::Deny => "deny",
            }
        ),
        Decider::Default(d) => format!("its default ({d})"),
        Decider::Invalid(e) => format!("it is refused: {e}"),
        other => format!("{other:?}"),
    }
}

/// Decides `call` against the policies in `doc`.
pub fn check(doc: &Policies, call: &Call<'_>) -> Answer {
    let ns = checked(
        doc,
        &Target {
            namespace: call.to.namespace.clone(),
            service: None,
        },
    );
    let svc = call.to.service.as_ref().and_then(|_| checked(doc, call.to));
    let eff = authz::effective(&call.to.namespace, ns.as_ref(), svc.as_ref());
    let req = Request {
        caller: call.from,
        // Port 0 is a port no rule names.
        port: call.port.unwrap_or(0),
        http: call.http.clone(),
    };
    let d = eff.decide(&req);
    let mut pods = Vec::new();
    for p in &doc.pods {
        let Some(a) = &p.annotation else { continue };
        if p.namespace != call.to.namespace
            || call.to.service.as_deref().is_some_and(|s| s != p.service)
        {
            continue;
        }
        let narrowed: Effective = eff
            .clone()
            .narrowed(&call.to.namespace, Some(&authz::annotation_policy(a)));
        let pd = narrowed.decide(&req);
        if pd.allowed != d.allowed {
            pods.push((p.pod.clone(), pd.allowed, words(doc, call.to, &pd.by)));
        }
    }
    Answer {
        allowed: d.allowed,
        why: words(doc, call.to, &d.by),
        pods,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{PodPolicy, PolicyEntry};

    fn doc() -> Policies {
        let spec = |s: &str| Some(authz::parse_spec(s.as_bytes()).unwrap());
        Policies {
            policies: vec![
                PolicyEntry {
                    target: Target {
                        namespace: "shop".into(),
                        service: None,
                    },
                    origin: "/p/shop.json".into(),
                    spec: spec(r#"{"default":"deny"}"#),
                    error: None,
                },
                PolicyEntry {
                    target: Target {
                        namespace: "shop".into(),
                        service: Some("web".into()),
                    },
                    origin: "/p/shop.web.json".into(),
                    spec: spec(
                        r#"{"rules":[{"action":"allow","from":{"serviceAccounts":["shop/a"]},
                            "to":{"methods":["GET"],"paths":["/api/*"]}}]}"#,
                    ),
                    error: None,
                },
            ],
            pods: vec![PodPolicy {
                pod: "shop/web-0".into(),
                namespace: "shop".into(),
                service: "web".into(),
                annotation: Some(
                    r#"{"rules":[{"action":"deny","from":{"ids":["*"]},"to":{"paths":["/api/secret"]}}]}"#
                        .into(),
                ),
            }],
        }
    }

    fn call<'a>(from: &'a str, to: &'a Target, method: &'a str, path: &'a str) -> Call<'a> {
        Call {
            from: Some(from),
            to,
            port: Some(8080),
            http: Some(HttpRequest {
                method,
                path,
                host: "web",
            }),
        }
    }

    #[test]
    fn names_the_rule_that_allowed_and_the_default_that_denied() {
        let d = doc();
        let web = Target {
            namespace: "shop".into(),
            service: Some("web".into()),
        };
        let a = "spiffe://td/ns/shop/sa/a";
        let ok = check(&d, &call(a, &web, "GET", "/api/x"));
        assert!(ok.allowed, "{ok:?}");
        assert_eq!(
            ok.why,
            "allow rule: rules[0] of the policy of shop/web (/p/shop.web.json)"
        );
        let admin = check(&d, &call(a, &web, "GET", "/admin"));
        assert!(!admin.allowed);
        assert_eq!(admin.why, "the default (deny)");
        let b = check(&d, &call("spiffe://td/ns/shop/sa/b", &web, "GET", "/api/x"));
        assert!(!b.allowed);
        // The pod's annotation denies what the service allows.
        let secret = check(&d, &call(a, &web, "GET", "/api/secret"));
        assert!(secret.allowed);
        assert_eq!(
            secret.pods,
            [(
                "shop/web-0".to_string(),
                false,
                "the pod's own annotation: its deny rules[0]".to_string()
            )]
        );
    }

    #[test]
    fn a_refused_policy_denies_and_says_why() {
        let mut d = doc();
        d.policies[1].spec = None;
        d.policies[1].error = Some("rules[0].frm: unknown field".into());
        let web = Target {
            namespace: "shop".into(),
            service: Some("web".into()),
        };
        let r = check(&d, &call("spiffe://td/ns/shop/sa/a", &web, "GET", "/api/x"));
        assert!(!r.allowed);
        assert!(r.why.contains("refused (/p/shop.web.json)"), "{}", r.why);
        assert!(r.why.contains("unknown field"), "{}", r.why);
    }
}
