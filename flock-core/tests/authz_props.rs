#![cfg(not(loom))]
//! Authorization policies (`flock_core::authz`): the decisions the issue names, the
//! refusals and their fields, and the properties — deny wins, a pod's annotation never
//! widens, anything that does not parse fails closed.

use flock_core::authz::*;
use proptest::prelude::*;

const A: &str = "spiffe://td/ns/shop/sa/a";
const B: &str = "spiffe://td/ns/shop/sa/b";
const OTHER_NS: &str = "spiffe://td/ns/other/sa/a";

fn checked(json: &str) -> Checked {
    parse_spec(json.as_bytes()).and_then(|s| Policy::from_spec(&s))
}

fn http<'a>(caller: Option<&'a str>, method: &'a str, path: &'a str) -> Request<'a> {
    Request {
        caller,
        port: 80,
        http: Some(HttpRequest {
            method,
            path,
            host: "web",
        }),
    }
}

fn tcp(caller: Option<&str>, port: u16) -> Request<'_> {
    Request {
        caller,
        port,
        http: None,
    }
}

/// "allow sa/a GET /api/*" with a deny default: `a` gets `/api/x` and nothing else,
/// `b` nothing, over HTTP or TCP; plaintext nothing.
#[test]
fn allow_sa_a_get_api_prefix() {
    let p = checked(
        r#"{"namespace": "shop", "service": "web", "default": "deny",
            "rules": [{"action": "allow", "from": {"serviceAccounts": ["shop/a"]},
                       "to": {"methods": ["get"], "paths": ["/api/*"]}}]}"#,
    );
    let e = effective("shop", None, Some(&p));
    assert!(e.decide(&http(Some(A), "GET", "/api/x")).allowed);
    let d = e.decide(&http(Some(A), "GET", "/admin"));
    assert_eq!(
        d,
        Decision {
            allowed: false,
            by: Decider::Default(DefaultAction::Deny)
        }
    );
    assert!(!e.decide(&http(Some(A), "POST", "/api/x")).allowed);
    assert!(!e.decide(&http(Some(B), "GET", "/api/x")).allowed);
    // An HTTP-only allow rule never matches a TCP connection.
    assert!(!e.decide(&tcp(Some(A), 80)).allowed);
    assert_eq!(
        e.decide(&http(None, "GET", "/api/x")).by,
        Decider::Unauthenticated
    );
    assert_eq!(
        e.decide(&http(Some(A), "GET", "/api/x")).by,
        Decider::Rule {
            index: 0,
            action: Action::Allow
        }
    );
}

#[test]
fn defaults() {
    let ns = |d: &str| checked(&format!(r#"{{"namespace": "shop", "default": "{d}"}}"#));
    let all = effective("shop", Some(&ns("all-authenticated")), None);
    let same = effective("shop", Some(&ns("same-namespace")), None);
    let deny = effective("shop", Some(&ns("deny")), None);
    for (e, a, other) in [
        (&all, true, true),
        (&same, true, false),
        (&deny, false, false),
    ] {
        assert_eq!(e.decide(&tcp(Some(A), 5432)).allowed, a, "{e:?}");
        assert_eq!(e.decide(&tcp(Some(OTHER_NS), 5432)).allowed, other, "{e:?}");
        assert!(!e.decide(&tcp(None, 5432)).allowed);
    }
    // No policy: as without policies, plaintext included.
    let none = effective("shop", None, None);
    assert_eq!(none, Effective::Unrestricted);
    assert!(none.decide(&tcp(None, 5432)).allowed);
    // A namespace policy without a default: all-authenticated; a service's default
    // replaces the namespace's.
    let e = effective(
        "shop",
        Some(&checked(r#"{"namespace": "shop", "default": "deny"}"#)),
        Some(&checked(
            r#"{"namespace": "shop", "service": "web", "default": "same-namespace"}"#,
        )),
    );
    assert!(e.decide(&tcp(Some(A), 1)).allowed);
    assert!(!e.decide(&tcp(Some(OTHER_NS), 1)).allowed);
}

#[test]
fn deny_rules_win_whatever_their_order() {
    let e = effective(
        "shop",
        Some(&checked(
            r#"{"namespace": "shop", "rules": [
                {"action": "allow", "from": {"ids": ["*"]}},
                {"action": "deny", "from": {"ids": ["spiffe://td/ns/shop/sa/b"]}, "to": {"ports": [5432]}}]}"#,
        )),
        None,
    );
    assert!(e.decide(&tcp(Some(B), 80)).allowed);
    let d = e.decide(&tcp(Some(B), 5432));
    assert!(!d.allowed, "an allow rule beat the deny rule: {d:?}");
    assert_eq!(
        d.by,
        Decider::Rule {
            index: 1,
            action: Action::Deny
        }
    );
    // A deny rule with HTTP conditions denies a TCP connection outright.
    let e = effective(
        "shop",
        Some(&checked(
            r#"{"namespace": "shop", "rules": [
                {"action": "deny", "from": {"namespaces": ["shop"]}, "to": {"paths": ["/admin"]}}]}"#,
        )),
        None,
    );
    assert!(!e.decide(&tcp(Some(A), 80)).allowed);
    assert!(e.decide(&http(Some(A), "GET", "/x")).allowed);
    assert!(!e.decide(&http(Some(A), "GET", "/admin")).allowed);
}

/// Every refusal names the field and the reason, and refuses the service's every
/// call (fail closed).
#[test]
fn bad_policies_name_the_field_and_fail_closed() {
    for (json, field) in [
        (
            r#"{"namespace": "shop", "rules": [{"action": "allow"}]}"#,
            "rules[0].from",
        ),
        (
            r#"{"namespace": "shop", "rules": [{"action": "allow", "from": {"ids": ["spiffe://td/ns/*"]}}]}"#,
            "rules[0].from.ids[0]",
        ),
        (
            r#"{"namespace": "shop", "rules": [{"action": "allow", "from": {"ids": ["*"]}, "to": {"paths": ["api"]}}]}"#,
            "rules[0].to.paths[0]",
        ),
        (
            r#"{"namespace": "shop", "rules": [{"action": "allow", "from": {"ids": ["*"]}, "to": {"methods": ["GE T"]}}]}"#,
            "rules[0].to.methods[0]",
        ),
        (
            r#"{"namespace": "shop", "rules": [{"action": "allow", "from": {"serviceAccounts": ["a"]}}]}"#,
            "rules[0].from.serviceAccounts[0]",
        ),
        (r#"{"namespace": "Shop"}"#, "namespace"),
        (r#"{"service": "web"}"#, "service"),
        (r#"{"namespace": "shop", "default": "maybe"}"#, "policy"),
    ] {
        let err = checked(json).unwrap_err();
        assert_eq!(err.field, field, "{json}: {err}");
        let e = effective("shop", None, Some(&Err(err)));
        assert!(!e.decide(&tcp(Some(A), 80)).allowed);
        assert!(matches!(
            e.decide(&tcp(Some(A), 80)).by,
            Decider::Invalid(_)
        ));
    }
    let big = vec![b' '; MAX_SPEC_BYTES + 1];
    assert!(parse_spec(&big).unwrap_err().reason.contains("more than"));
}

/// An unknown field is refused, never skipped: a rule's restriction this version
/// does not know (`to.notPaths`) would otherwise be dropped and the rule would allow
/// more than its author wrote. The service's calls are refused instead.
#[test]
fn an_unknown_field_fails_closed_instead_of_allowing() {
    let p = checked(
        r#"{"namespace": "shop", "default": "deny", "rules": [
            {"action": "allow", "from": {"ids": ["*"]}, "to": {"notPaths": ["/admin"]}}]}"#,
    );
    let e = effective("shop", Some(&p), None);
    let d = e.decide(&http(Some(A), "GET", "/admin"));
    assert!(
        !d.allowed,
        "a policy with an unknown field allowed a call: {d:?}"
    );
    let Err(err) = p else { unreachable!() };
    assert!(err.reason.contains("notPaths"), "{err}");
}

#[test]
fn a_pods_annotation_narrows() {
    let base = effective(
        "shop",
        Some(&checked(
            r#"{"namespace": "shop", "default": "all-authenticated"}"#,
        )),
        None,
    );
    let ann = annotation_policy(r#"{"default": "same-namespace"}"#);
    let e = base.clone().narrowed("shop", Some(&ann));
    assert!(e.decide(&tcp(Some(A), 1)).allowed);
    let d = e.decide(&tcp(Some(OTHER_NS), 1));
    assert!(!d.allowed);
    assert!(matches!(d.by, Decider::Annotation(_)), "{d:?}");
    // An annotation cannot widen: allowing OTHER_NS where the namespace denies it
    // changes nothing.
    let strict = effective(
        "shop",
        Some(&checked(
            r#"{"namespace": "shop", "default": "same-namespace"}"#,
        )),
        None,
    );
    let widen = annotation_policy(
        r#"{"rules": [{"action": "allow", "from": {"ids": ["spiffe://td/ns/other/sa/a"]}}]}"#,
    );
    assert!(
        !strict
            .narrowed("shop", Some(&widen))
            .decide(&tcp(Some(OTHER_NS), 1))
            .allowed
    );
    // It may not name a namespace or service; a bad one refuses everything.
    let bad = annotation_policy(r#"{"namespace": "shop"}"#);
    assert!(bad.is_err());
    assert!(
        !base
            .narrowed("shop", Some(&bad))
            .decide(&tcp(Some(A), 1))
            .allowed
    );
    // Narrowing an unrestricted service: plaintext is no longer admitted.
    let open = Effective::Unrestricted.narrowed("shop", Some(&annotation_policy("{}")));
    assert!(!open.decide(&tcp(None, 1)).allowed);
    assert!(open.decide(&tcp(Some(OTHER_NS), 1)).allowed);
}

// ---- properties ----

const IDS: [&str; 4] = [
    "spiffe://td/ns/shop/sa/a",
    "spiffe://td/ns/shop/sa/b",
    "spiffe://td/ns/other/sa/a",
    "spiffe://td/ns/web/sa/web",
];

fn from_strategy() -> impl Strategy<Value = FromSpec> {
    (
        proptest::collection::vec(
            prop_oneof![
                Just("*".to_string()),
                proptest::sample::select(IDS.to_vec()).prop_map(String::from)
            ],
            0..2,
        ),
        proptest::collection::vec(
            proptest::sample::select(vec!["shop", "other", "web"]).prop_map(String::from),
            0..2,
        ),
        proptest::collection::vec(
            proptest::sample::select(vec!["shop/a", "shop/b", "other/a"]).prop_map(String::from),
            0..2,
        ),
    )
        .prop_map(|(ids, namespaces, service_accounts)| FromSpec {
            ids,
            namespaces,
            service_accounts,
        })
}

fn to_strategy() -> impl Strategy<Value = ToSpec> {
    (
        proptest::collection::vec(proptest::sample::select(vec![80u16, 5432]), 0..2),
        proptest::collection::vec(
            proptest::sample::select(vec!["GET", "POST"]).prop_map(String::from),
            0..2,
        ),
        proptest::collection::vec(
            proptest::sample::select(vec!["/api/*", "/admin", "/api/x", "/*"])
                .prop_map(String::from),
            0..2,
        ),
        proptest::collection::vec(
            proptest::sample::select(vec!["web", "web.shop:80"]).prop_map(String::from),
            0..2,
        ),
    )
        .prop_map(|(ports, methods, paths, hosts)| ToSpec {
            ports,
            methods,
            paths,
            hosts,
        })
}

fn spec_strategy() -> impl Strategy<Value = PolicySpec> {
    (
        proptest::option::of(proptest::sample::select(vec![
            DefaultAction::AllAuthenticated,
            DefaultAction::SameNamespace,
            DefaultAction::Deny,
        ])),
        proptest::collection::vec(
            (
                proptest::sample::select(vec![Action::Allow, Action::Deny]),
                from_strategy(),
                to_strategy(),
            )
                .prop_map(|(action, from, to)| RuleSpec { action, from, to }),
            0..5,
        ),
    )
        .prop_map(|(default, rules)| PolicySpec {
            namespace: None,
            service: None,
            default,
            rules,
        })
}

/// A generated request: caller, port, and (method, path, host) on HTTP.
type Req = (
    Option<&'static str>,
    u16,
    Option<(&'static str, &'static str, &'static str)>,
);

fn request_strategy() -> impl Strategy<Value = Req> {
    (
        proptest::option::of(proptest::sample::select(IDS.to_vec())),
        proptest::sample::select(vec![80u16, 5432]),
        proptest::option::of((
            proptest::sample::select(vec!["GET", "POST", "get"]),
            proptest::sample::select(vec!["/api/x", "/admin", "/", "/api/"]),
            proptest::sample::select(vec!["web", "WEB", "web.shop:80"]),
        )),
    )
}

fn req((caller, port, http): Req) -> Request<'static> {
    Request {
        caller,
        port,
        http: http.map(|(method, path, host)| HttpRequest { method, path, host }),
    }
}

fn as_namespace_policy(mut spec: PolicySpec) -> Checked {
    spec.namespace = Some("shop".into());
    Policy::from_spec(&spec)
}

proptest! {
    /// Deny wins: a request any deny rule matches is denied, however many allow rules
    /// match it, in whatever order.
    #[test]
    fn deny_wins(spec in spec_strategy(), r in request_strategy()) {
        let r = req(r);
        if let Ok(p) = as_namespace_policy(spec) {
            let denied_by_a_rule = r.caller.is_some_and(|c| {
                p.rules.iter().any(|rule| rule.action == Action::Deny && rule.matches(c, &r))
            });
            let e = effective("shop", Some(&Ok(p)), None);
            if denied_by_a_rule {
                prop_assert!(!e.decide(&r).allowed);
            }
        }
    }

    /// A pod's annotation never widens: whatever it says (valid or not), what the
    /// narrowed policy allows, the service's policy allows.
    #[test]
    fn an_annotation_never_widens(
        base in proptest::option::of(spec_strategy()),
        ann in spec_strategy(),
        r in request_strategy(),
    ) {
        let r = req(r);
        let base = base.map(as_namespace_policy);
        let e = effective("shop", base.as_ref(), None);
        let narrowed = e.clone().narrowed("shop", Some(&Policy::from_spec(&ann)));
        if narrowed.decide(&r).allowed {
            prop_assert!(e.decide(&r).allowed);
        }
    }

    /// Parse or fail closed: any bytes either give a policy, or refuse every call to
    /// the service they would govern (never an error that lets calls through).
    #[test]
    fn parse_or_fail_closed(bytes in proptest::collection::vec(any::<u8>(), 0..256), r in request_strategy()) {
        let r = req(r);
        let checked = parse_spec(&bytes).and_then(|s| Policy::from_spec(&s));
        if checked.is_err() {
            let e = effective("shop", None, Some(&checked));
            prop_assert!(!e.decide(&r).allowed);
        }
    }

    /// Mutating a valid policy's JSON (a field renamed to one no version knows)
    /// never makes it allow more: it is refused and denies everything.
    #[test]
    fn a_renamed_field_is_refused(spec in spec_strategy(), which in 0usize..8, r in request_strategy()) {
        let r = req(r);
        let mut spec = spec;
        spec.namespace = Some("shop".into());
        let json = serde_json::to_string(&spec).unwrap();
        let keys = ["\"ids\"", "\"namespaces\"", "\"serviceAccounts\"", "\"ports\"", "\"methods\"", "\"paths\"", "\"hosts\"", "\"default\""];
        let key = keys[which];
        prop_assume!(json.contains(key));
        let renamed = json.replacen(key, "\"unknownField\"", 1);
        let checked = parse_spec(renamed.as_bytes()).and_then(|s| Policy::from_spec(&s));
        prop_assert!(checked.is_err());
        prop_assert!(!effective("shop", Some(&checked), None).decide(&r).allowed);
    }

    /// A checked policy's JSON reads back into the same policy.
    #[test]
    fn specs_round_trip(spec in spec_strategy()) {
        let mut spec = spec;
        spec.namespace = Some("shop".into());
        let again = parse_spec(serde_json::to_string(&spec).unwrap().as_bytes()).unwrap();
        prop_assert_eq!(&again, &spec);
        prop_assert_eq!(Policy::from_spec(&again), Policy::from_spec(&spec));
    }
}

/// A policy file's name is what it governs, one way only; other names govern nothing.
#[test]
fn file_names_give_their_target_and_nothing_else() {
    let t = Target::from_file_name("shop.json").unwrap();
    assert_eq!((t.namespace.as_str(), t.service.as_deref()), ("shop", None));
    let t = Target::from_file_name("shop.web.json").unwrap();
    assert_eq!(
        (t.namespace.as_str(), t.service.as_deref()),
        ("shop", Some("web"))
    );
    assert_eq!(t.file_name(), "shop.web.json");
    assert_eq!(t.to_string(), "shop/web");
    for bad in [
        "shop",
        "shop.yaml",
        ".json",
        "a.b.c.json",
        "Shop.json",
        "shop..json",
        "..data",
        "-x.json",
    ] {
        assert_eq!(Target::from_file_name(bad), None, "{bad}");
    }
}

/// A file's content must not govern something its name does not say, and whatever is
/// wrong with it is kept as the refusal of its target, naming the field.
#[test]
fn a_file_is_read_for_its_target_or_refused_with_why() {
    let web = Target::from_file_name("shop.web.json").unwrap();
    let ok = Sourced::read("f", &web, br#"{"default":"deny"}"#);
    let spec = ok.written.as_ref().unwrap();
    assert_eq!(spec.namespace.as_deref(), Some("shop"));
    assert_eq!(spec.service.as_deref(), Some("web"));
    assert!(ok.checked().is_ok());
    for (bytes, field) in [
        (&br#"{"namespace":"other"}"#[..], "namespace"),
        (br#"{"namespace":"shop","service":"api"}"#, "service"),
        (br#"{"default":"deny","extra":1}"#, "policy"),
        (
            br#"{"rules":[{"action":"allow","from":{}}]}"#,
            "rules[0].from",
        ),
        (b"", "policy"),
    ] {
        let r = Sourced::read("f", &web, bytes);
        let e = r.written.as_ref().unwrap_err();
        assert!(
            e.field.starts_with(field),
            "{}: {e}",
            String::from_utf8_lossy(bytes)
        );
        assert!(r.checked().is_err());
    }
}

/// The annotation kept in a pod's record is bounded and has no control characters but
/// whitespace.
#[test]
fn annotations_are_bounded() {
    assert!(check_annotation_size("{\n\t\"rules\": []\r\n}").is_ok());
    assert!(check_annotation_size(&"x".repeat(MAX_ANNOTATION_BYTES)).is_ok());
    assert!(check_annotation_size(&"x".repeat(MAX_ANNOTATION_BYTES + 1)).is_err());
    assert!(check_annotation_size("{\u{0}}").is_err());
}

/// The agent's core changes (and so re-publishes) only when what is in force changes.
#[test]
fn the_core_names_a_policy_change_once() {
    use flock_core::agent::AgentCore;
    use flock_core::lifecycle::liveness::LivenessPolicy;
    let mut core: AgentCore<(), ()> = AgentCore::new(LivenessPolicy::default());
    let web = Target::from_file_name("shop.web.json").unwrap();
    let p = || Sourced::read("f", &web, br#"{"default":"deny"}"#);
    let before = core.policies();
    assert!(core.set_policy(web.clone(), Some(p())));
    assert!(
        !core.set_policy(web.clone(), Some(p())),
        "the same policy read again"
    );
    let after = core.policies();
    assert_eq!(
        after.changed_since(&before).unwrap().collect::<Vec<_>>(),
        [&web]
    );
    assert!(core.set_policy(web.clone(), Some(Sourced::read("f", &web, b"{"))));
    assert!(core.set_policy(web.clone(), None));
    assert!(!core.set_policy(web, None));
    assert!(core.policies().is_empty());
}
