//! Authorization policies: who may call a service, by the caller's verified SPIFFE ID,
//! and what a pod's own annotation may add to that (narrow, never widen).
//!
//! A [`PolicySpec`] is what an operator writes (a CRD's spec, a registry entry, a
//! file): for one namespace, or one service of it, a [`DefaultAction`] and rules. It is
//! read with [`parse_spec`] (bounded, unknown fields refused) and checked into a
//! [`Policy`] with [`Policy::from_spec`]. What a service's inbound connections are
//! decided by is its [`Effective`] policy ([`effective`]): the namespace's policy, then
//! the service's own on top of it, then the pod's annotation as a further restriction.
//! [`Effective::decide`] answers one [`Request`] and names the rule that decided it.
//!
//! # Semantics
//!
//! * **No policy, no change.** A service no policy names is served as without this
//!   module: every authenticated caller (and, in permissive capture, plaintext).
//! * **Deny wins.** A request a deny rule matches is denied, whatever allows it.
//! * Otherwise a request an allow rule matches is allowed; otherwise the default
//!   decides: `all-authenticated` (any caller with a verified ID of the trust domain),
//!   `same-namespace` (callers whose ID names the service's namespace), `deny`.
//! * **Only authenticated callers** are ever allowed once a policy is in force: a
//!   plaintext caller (no verified ID) is denied by every default and matched by no
//!   rule.
//! * A rule's `from` is a list of exact SPIFFE IDs, namespaces, `ns/sa` service
//!   accounts, or `*` (any authenticated caller); an empty `from` matches no caller
//!   (a rule that names nobody allows nobody, rather than everybody). Its `to` narrows
//!   by ports and, on HTTP ports, methods, paths (exact, or a prefix ending in `*`)
//!   and hosts; an empty list does not narrow.
//! * HTTP conditions on a TCP port cannot be checked: an **allow** rule with any of them
//!   never matches a TCP connection, and a **deny** rule with them matches on its other
//!   conditions alone. Both ways the connection fails closed.
//! * **Fail closed.** A policy that does not parse or check ([`Policy::from_spec`]
//!   errs) denies every call to what it names ([`Effective::Invalid`]), and the error
//!   says which field and why; it is never skipped.
//! * **A pod narrows, never widens.** A pod's annotation ([`ANNOTATION`]) is a policy
//!   of its own; a request is allowed only if the service's policy *and* the
//!   annotation's allow it. An annotation without a default does not restrict beyond
//!   its deny rules.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::pod::{check_label, check_subdomain};

/// The pod annotation a pod narrows its own policy with (a [`PolicySpec`] without
/// `namespace` and `service`: the pod's own).
pub const ANNOTATION: &str = "flock.io/authz";
/// Most bytes of one policy document [`parse_spec`] reads.
pub const MAX_SPEC_BYTES: usize = 64 * 1024;
/// Most bytes of a pod's [`ANNOTATION`]: it is kept in the pod's record, whose file
/// has a limit of its own (a pod narrows its policy with a few rules, not a catalogue).
pub const MAX_ANNOTATION_BYTES: usize = 4096;

/// Whether a pod's [`ANNOTATION`] may be kept in its record: at most
/// [`MAX_ANNOTATION_BYTES`], and no control character but tab, CR and LF (JSON needs
/// no other; a bound on the bytes its record's encoding takes). Whether it is a policy
/// is decided where it is enforced, which fails closed.
pub fn check_annotation_size(value: &str) -> Result<(), String> {
    if value.len() > MAX_ANNOTATION_BYTES {
        return Err(format!(
            "{} bytes, more than {MAX_ANNOTATION_BYTES}",
            value.len()
        ));
    }
    if let Some(c) = value
        .chars()
        .find(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
    {
        return Err(format!("control character {:?}", c));
    }
    Ok(())
}

/// Most rules in one policy.
pub const MAX_RULES: usize = 256;
/// Most entries in one list of a rule (`from`, ports, methods, paths, hosts).
pub const MAX_LIST: usize = 256;
/// Longest SPIFFE ID, path or host in a rule.
pub const MAX_VALUE_LEN: usize = 2048;

/// What a caller no rule matches gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DefaultAction {
    /// Any caller with a verified ID (the mesh without policies).
    AllAuthenticated,
    /// Callers whose ID names the service's own namespace.
    SameNamespace,
    /// Nobody.
    Deny,
}

impl fmt::Display for DefaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DefaultAction::AllAuthenticated => "all-authenticated",
            DefaultAction::SameNamespace => "same-namespace",
            DefaultAction::Deny => "deny",
        })
    }
}

/// Allow or deny.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Allows what it matches (unless a deny rule matches too).
    Allow,
    /// Denies what it matches.
    Deny,
}

/// A policy as written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// The namespace it governs (absent in a pod's annotation: the pod's).
    #[serde(default)]
    pub namespace: Option<String>,
    /// The service it governs; absent: every service of the namespace.
    #[serde(default)]
    pub service: Option<String>,
    /// What a caller no rule matches gets; absent: `all-authenticated` for a
    /// namespace, the namespace's for a service, no restriction for an annotation.
    #[serde(default)]
    pub default: Option<DefaultAction>,
    /// The rules, deny rules first whatever their order here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<RuleSpec>,
}

/// One rule as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Allow or deny.
    pub action: Action,
    /// Who: SPIFFE IDs, `*`, namespaces or `ns/sa` service accounts.
    #[serde(default)]
    pub from: FromSpec,
    /// To what.
    #[serde(default)]
    pub to: ToSpec,
}

/// A rule's callers as written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FromSpec {
    /// Exact SPIFFE IDs, or `*`: any authenticated caller.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<String>,
    /// Namespaces: any workload ID naming one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// `namespace/service-account`.
    #[serde(
        default,
        rename = "serviceAccounts",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_accounts: Vec<String>,
}

/// A rule's target as written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToSpec {
    /// Service ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// HTTP methods (`GET`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// HTTP paths: exact, or a prefix ending in `*` (`/api/*`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    /// HTTP hosts (`:authority`), exact.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
}

/// Who a rule names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Principal {
    /// Any caller with a verified ID.
    Authenticated,
    /// Exactly this SPIFFE ID.
    Id(String),
    /// Any workload ID `spiffe://<td>/ns/<namespace>/...`.
    Namespace(String),
    /// `spiffe://<td>/ns/<namespace>/sa/<account>` in any trust domain of the mesh.
    ServiceAccount {
        /// The namespace.
        namespace: String,
        /// The service account.
        account: String,
    },
}

/// An HTTP path condition.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathMatch {
    /// The whole path, exactly.
    Exact(String),
    /// A prefix (`/api/` for `/api/*`).
    Prefix(String),
}

/// A checked rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    /// Allow or deny.
    pub action: Action,
    /// Who (never empty after [`Policy::from_spec`]).
    pub from: BTreeSet<Principal>,
    /// Ports; empty: any.
    pub ports: BTreeSet<u16>,
    /// Methods, upper case; empty: any.
    pub methods: BTreeSet<String>,
    /// Paths; empty: any.
    pub paths: BTreeSet<PathMatch>,
    /// Hosts, lower case; empty: any.
    pub hosts: BTreeSet<String>,
}

impl Rule {
    /// Whether the rule has conditions only HTTP requests carry.
    pub fn is_http(&self) -> bool {
        !(self.methods.is_empty() && self.paths.is_empty() && self.hosts.is_empty())
    }
}

/// A checked policy: a default (if it sets one) and its rules.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Policy {
    /// The default it sets, if any.
    pub default: Option<DefaultAction>,
    /// The rules, in the order written.
    pub rules: Vec<Rule>,
}

/// Why a policy was refused: the field and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, thiserror::Error, Serialize, Deserialize)]
#[error("{field}: {reason}")]
pub struct PolicyError {
    /// Where (`rules[2].from.ids[0]`).
    pub field: String,
    /// What.
    pub reason: String,
}

impl PolicyError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        PolicyError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Reads a policy document (JSON), at most [`MAX_SPEC_BYTES`]; unknown fields are
/// refused (a field this version does not know could be a restriction it would
/// silently drop).
pub fn parse_spec(bytes: &[u8]) -> Result<PolicySpec, PolicyError> {
    if bytes.len() > MAX_SPEC_BYTES {
        return Err(PolicyError::new(
            "policy",
            format!("{} bytes, more than {MAX_SPEC_BYTES}", bytes.len()),
        ));
    }
    if crate::reintroduced!("authz-unknown-field-ignored") {
        return parse_lenient(bytes);
    }
    serde_json::from_slice(bytes).map_err(|e| PolicyError::new("policy", e.to_string()))
}

/// A pod's [`ANNOTATION`]: a policy without `namespace` or `service` (it is the
/// pod's own), checked. Any error refuses the pod's every inbound call.
pub fn annotation_policy(value: &str) -> Checked {
    let spec = parse_spec(value.as_bytes())?;
    if spec.namespace.is_some() || spec.service.is_some() {
        return Err(PolicyError::new(
            "namespace",
            "a pod's annotation governs the pod itself: no namespace or service",
        ));
    }
    Policy::from_spec(&spec)
}

/// The mutant's reading: an unknown field is dropped instead of refusing the policy
/// (so a restriction this version does not know is silently lost).
fn parse_lenient(bytes: &[u8]) -> Result<PolicySpec, PolicyError> {
    fn drop_key(v: &mut serde_json::Value, key: &str) {
        match v {
            serde_json::Value::Object(o) => {
                o.remove(key);
                o.values_mut().for_each(|c| drop_key(c, key));
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(|c| drop_key(c, key)),
            _ => {}
        }
    }
    let mut v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| PolicyError::new("policy", e.to_string()))?;
    for _ in 0..64 {
        match serde_json::from_value::<PolicySpec>(v.clone()) {
            Ok(spec) => return Ok(spec),
            Err(e) => {
                let msg = e.to_string();
                let Some(key) = msg
                    .strip_prefix("unknown field `")
                    .and_then(|r| r.split('`').next())
                else {
                    return Err(PolicyError::new("policy", msg));
                };
                drop_key(&mut v, key);
            }
        }
    }
    Err(PolicyError::new("policy", "too many unknown fields"))
}

fn check_len<T>(field: &str, list: &[T]) -> Result<(), PolicyError> {
    if list.len() > MAX_LIST {
        return Err(PolicyError::new(
            field,
            format!("{} entries, more than {MAX_LIST}", list.len()),
        ));
    }
    Ok(())
}

fn printable(field: &str, v: &str) -> Result<(), PolicyError> {
    if v.is_empty()
        || v.len() > MAX_VALUE_LEN
        || v.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(PolicyError::new(
            field,
            format!(
                "{:?} is empty, longer than {MAX_VALUE_LEN} bytes, or has whitespace or control characters",
                v.chars().take(64).collect::<String>()
            ),
        ));
    }
    Ok(())
}

/// An exact SPIFFE ID: `spiffe://<trust domain>/<path>`, no `*`, no empty segment.
fn check_spiffe_id(field: &str, id: &str) -> Result<(), PolicyError> {
    printable(field, id)?;
    let bad = || {
        PolicyError::new(
            field,
            format!(
                "{id:?} is not an exact SPIFFE ID spiffe://<trust-domain>/<path> (`*` alone means any authenticated caller)"
            ),
        )
    };
    let rest = id.strip_prefix("spiffe://").ok_or_else(bad)?;
    let (td, path) = rest.split_once('/').ok_or_else(bad)?;
    if td.is_empty() || id.contains('*') || path.split('/').any(str::is_empty) {
        return Err(bad());
    }
    Ok(())
}

/// An HTTP method token (RFC 9110: `tchar`s), kept upper case.
fn check_method(field: &str, m: &str) -> Result<String, PolicyError> {
    if m.is_empty()
        || m.len() > 32
        || !m
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c))
    {
        return Err(PolicyError::new(
            field,
            format!("{m:?} is not an HTTP method"),
        ));
    }
    Ok(m.to_ascii_uppercase())
}

fn check_path(field: &str, p: &str) -> Result<PathMatch, PolicyError> {
    printable(field, p)?;
    if !p.starts_with('/') {
        return Err(PolicyError::new(
            field,
            format!("{p:?} does not start with `/`"),
        ));
    }
    match p.strip_suffix('*') {
        Some(prefix) if !prefix.contains('*') => Ok(PathMatch::Prefix(prefix.to_string())),
        Some(_) => Err(PolicyError::new(
            field,
            format!("{p:?}: `*` only as the last character (a prefix)"),
        )),
        None if p.contains('*') || p.contains('?') || p.contains('#') => Err(PolicyError::new(
            field,
            format!("{p:?}: a path has no `*` but a final one, no query and no fragment"),
        )),
        None => Ok(PathMatch::Exact(p.to_string())),
    }
}

fn check_host(field: &str, h: &str) -> Result<String, PolicyError> {
    printable(field, h)?;
    let (name, port) = match h.rsplit_once(':') {
        Some((n, p)) if !n.contains(':') => (n, Some(p)),
        _ => (h, None),
    };
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return Err(PolicyError::new(
            field,
            format!("{h:?}: the port is not a number"),
        ));
    }
    let lower = name.to_ascii_lowercase();
    let ip = lower.parse::<std::net::IpAddr>().is_ok();
    if !ip && check_subdomain(&lower).is_err() {
        return Err(PolicyError::new(
            field,
            format!(
                "{h:?} is not a host name (DNS subdomain) or an address, with an optional :port"
            ),
        ));
    }
    Ok(h.to_ascii_lowercase())
}

impl Policy {
    /// Checks a written policy: every rule names at least one caller, every value is
    /// well formed, no list is over [`MAX_LIST`], at most [`MAX_RULES`] rules. The
    /// error names the first bad field.
    pub fn from_spec(spec: &PolicySpec) -> Result<Policy, PolicyError> {
        if let Some(ns) = &spec.namespace {
            check_label(ns).map_err(|e| PolicyError::new("namespace", e))?;
        }
        if let Some(s) = &spec.service {
            if spec.namespace.is_none() {
                return Err(PolicyError::new(
                    "service",
                    "a service's policy names its namespace too",
                ));
            }
            check_label(s).map_err(|e| PolicyError::new("service", e))?;
        }
        if spec.rules.len() > MAX_RULES {
            return Err(PolicyError::new(
                "rules",
                format!("{} rules, more than {MAX_RULES}", spec.rules.len()),
            ));
        }
        let mut rules = Vec::with_capacity(spec.rules.len());
        for (i, r) in spec.rules.iter().enumerate() {
            let at = |f: &str| format!("rules[{i}].{f}");
            let mut from = BTreeSet::new();
            check_len(&at("from.ids"), &r.from.ids)?;
            check_len(&at("from.namespaces"), &r.from.namespaces)?;
            check_len(&at("from.serviceAccounts"), &r.from.service_accounts)?;
            for (j, id) in r.from.ids.iter().enumerate() {
                if id == "*" {
                    from.insert(Principal::Authenticated);
                } else {
                    check_spiffe_id(&at(&format!("from.ids[{j}]")), id)?;
                    from.insert(Principal::Id(id.clone()));
                }
            }
            for (j, ns) in r.from.namespaces.iter().enumerate() {
                check_label(ns)
                    .map_err(|e| PolicyError::new(at(&format!("from.namespaces[{j}]")), e))?;
                from.insert(Principal::Namespace(ns.clone()));
            }
            for (j, sa) in r.from.service_accounts.iter().enumerate() {
                let field = at(&format!("from.serviceAccounts[{j}]"));
                let (ns, account) = sa.split_once('/').ok_or_else(|| {
                    PolicyError::new(
                        &field,
                        format!("{sa:?} is not <namespace>/<service-account>"),
                    )
                })?;
                check_label(ns).map_err(|e| PolicyError::new(&field, e))?;
                check_subdomain(account).map_err(|e| PolicyError::new(&field, e))?;
                from.insert(Principal::ServiceAccount {
                    namespace: ns.to_string(),
                    account: account.to_string(),
                });
            }
            if from.is_empty() {
                return Err(PolicyError::new(
                    at("from"),
                    "names no caller (use ids: [\"*\"] for any authenticated caller)",
                ));
            }
            check_len(&at("to.ports"), &r.to.ports)?;
            check_len(&at("to.methods"), &r.to.methods)?;
            check_len(&at("to.paths"), &r.to.paths)?;
            check_len(&at("to.hosts"), &r.to.hosts)?;
            if r.to.ports.contains(&0) {
                return Err(PolicyError::new(at("to.ports"), "port 0"));
            }
            let methods =
                r.to.methods
                    .iter()
                    .enumerate()
                    .map(|(j, m)| check_method(&at(&format!("to.methods[{j}]")), m))
                    .collect::<Result<_, _>>()?;
            let paths =
                r.to.paths
                    .iter()
                    .enumerate()
                    .map(|(j, p)| check_path(&at(&format!("to.paths[{j}]")), p))
                    .collect::<Result<_, _>>()?;
            let hosts =
                r.to.hosts
                    .iter()
                    .enumerate()
                    .map(|(j, h)| check_host(&at(&format!("to.hosts[{j}]")), h))
                    .collect::<Result<_, _>>()?;
            rules.push(Rule {
                action: r.action,
                from,
                ports: r.to.ports.iter().copied().collect(),
                methods,
                paths,
                hosts,
            });
        }
        Ok(Policy {
            default: spec.default,
            rules,
        })
    }
}

/// A policy as it reached the agent: checked, or refused with why.
pub type Checked = Result<Policy, PolicyError>;

/// What decides a service's (or a pod's) inbound calls.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Effective {
    /// No policy names it: every caller, as without policies.
    Unrestricted,
    /// A policy that did not check names it: nobody (fail closed).
    Invalid(PolicyError),
    /// The default and rules in force, and further restrictions that must allow too.
    Enforced {
        /// The default.
        default: DefaultAction,
        /// The service's namespace (`same-namespace`).
        namespace: String,
        /// The rules (namespace's first, then the service's).
        rules: Vec<Rule>,
        /// A pod's own restriction (its annotation), if any.
        narrowed_by: Option<Box<Effective>>,
    },
}

/// The effective policy of service `service` in `namespace`, from the namespace's
/// policy and the service's own (either may be absent, either may have been refused).
/// The service's rules add to the namespace's; its default, if it sets one, replaces
/// the namespace's. A refused policy makes the whole service refuse (fail closed).
pub fn effective(
    namespace: &str,
    ns_policy: Option<&Checked>,
    svc_policy: Option<&Checked>,
) -> Effective {
    let mut default = None;
    let mut rules = Vec::new();
    let mut any = false;
    for p in [ns_policy, svc_policy].into_iter().flatten() {
        match p {
            Err(e) => return Effective::Invalid(e.clone()),
            Ok(p) => {
                any = true;
                default = p.default.or(default);
                rules.extend(p.rules.iter().cloned());
            }
        }
    }
    if !any {
        return Effective::Unrestricted;
    }
    Effective::Enforced {
        default: default.unwrap_or(DefaultAction::AllAuthenticated),
        namespace: namespace.to_string(),
        rules,
        narrowed_by: None,
    }
}

impl Effective {
    /// `self` further restricted by a pod's annotation policy: a request is allowed
    /// only if both allow it. An annotation that did not check refuses everything
    /// (fail closed). The annotation's own default, if it sets none, restricts nothing.
    pub fn narrowed(self, namespace: &str, annotation: Option<&Checked>) -> Effective {
        let narrow = match annotation {
            None => return self,
            Some(Err(e)) => Effective::Invalid(e.clone()),
            Some(Ok(p)) => Effective::Enforced {
                // No default: the annotation's deny rules are its only restriction.
                default: p.default.unwrap_or(DefaultAction::AllAuthenticated),
                namespace: namespace.to_string(),
                rules: p.rules.clone(),
                narrowed_by: None,
            },
        };
        self.and(narrow)
    }

    /// `self`, and `narrow` must allow too.
    fn and(self, narrow: Effective) -> Effective {
        match self {
            Effective::Invalid(e) => Effective::Invalid(e),
            // Unrestricted admits plaintext too; narrowed, only what `narrow` allows
            // (authenticated callers at most).
            Effective::Unrestricted => narrow,
            Effective::Enforced {
                default,
                namespace,
                rules,
                narrowed_by,
            } => Effective::Enforced {
                default,
                namespace,
                rules,
                narrowed_by: Some(Box::new(match narrowed_by {
                    None => narrow,
                    Some(prev) => prev.and(narrow),
                })),
            },
        }
    }

    /// Whether and why `req` is allowed.
    pub fn decide(&self, req: &Request<'_>) -> Decision {
        match self {
            Effective::Unrestricted => Decision {
                allowed: true,
                by: Decider::NoPolicy,
            },
            Effective::Invalid(e) => Decision {
                allowed: false,
                by: Decider::Invalid(e.to_string()),
            },
            Effective::Enforced {
                default,
                namespace,
                rules,
                narrowed_by,
            } => {
                let own = decide_rules(*default, namespace, rules, req);
                match narrowed_by {
                    Some(narrow) if own.allowed => {
                        let n = narrow.decide(req);
                        if n.allowed {
                            own
                        } else {
                            Decision {
                                allowed: false,
                                by: Decider::Annotation(Box::new(n.by)),
                            }
                        }
                    }
                    _ => own,
                }
            }
        }
    }
}

/// One inbound call, as the callee's Envoy sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// The caller's verified SPIFFE ID; `None` for plaintext.
    pub caller: Option<&'a str>,
    /// The service port called.
    pub port: u16,
    /// The HTTP request, on an HTTP port.
    pub http: Option<HttpRequest<'a>>,
}

/// An HTTP request's parts a rule can match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpRequest<'a> {
    /// The method.
    pub method: &'a str,
    /// The path, without query.
    pub path: &'a str,
    /// The `:authority`.
    pub host: &'a str,
}

/// An answer and what gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Allowed?
    pub allowed: bool,
    /// What decided.
    pub by: Decider,
}

/// What decided a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decider {
    /// No policy is in force.
    NoPolicy,
    /// Rule `index` (its position in the effective list).
    Rule {
        /// Its position.
        index: usize,
        /// Allow or deny.
        action: Action,
    },
    /// The default.
    Default(DefaultAction),
    /// A plaintext caller where a policy is in force.
    Unauthenticated,
    /// A policy that did not check (its error).
    Invalid(String),
    /// The pod's annotation refused what the service's policy allowed.
    Annotation(Box<Decider>),
}

impl fmt::Display for Decider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decider::NoPolicy => f.write_str("no policy"),
            Decider::Rule { index, action } => write!(f, "rule {index} ({action:?})"),
            Decider::Default(d) => write!(f, "default {d}"),
            Decider::Unauthenticated => f.write_str("no verified caller identity"),
            Decider::Invalid(e) => write!(f, "refused policy ({e})"),
            Decider::Annotation(d) => write!(f, "the pod's annotation: {d}"),
        }
    }
}

/// The namespace a workload ID names: `spiffe://<td>/ns/<namespace>/...`.
pub fn id_namespace(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("spiffe://")?;
    let (_, path) = rest.split_once('/')?;
    let mut segs = path.split('/');
    match (segs.next(), segs.next()) {
        (Some("ns"), Some(ns)) if !ns.is_empty() => Some(ns),
        _ => None,
    }
}

impl Principal {
    /// Whether the verified `id` is this principal.
    pub fn matches(&self, id: &str) -> bool {
        match self {
            Principal::Authenticated => true,
            Principal::Id(want) => want == id,
            Principal::Namespace(ns) => id_namespace(id) == Some(ns.as_str()),
            Principal::ServiceAccount { namespace, account } => {
                crate::registry::identity_account(id)
                    == Some((namespace.as_str(), account.as_str()))
            }
        }
    }
}

impl PathMatch {
    /// Whether `path` matches.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(p) => p == path,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
        }
    }
}

impl Rule {
    /// Whether the rule matches `req` from the verified `caller`. HTTP conditions on a
    /// request without HTTP: an allow rule does not match, a deny rule matches on the
    /// rest (both fail closed).
    pub fn matches(&self, caller: &str, req: &Request<'_>) -> bool {
        if !self.from.iter().any(|p| p.matches(caller)) {
            return false;
        }
        if !self.ports.is_empty() && !self.ports.contains(&req.port) {
            return false;
        }
        let Some(http) = &req.http else {
            return !self.is_http() || self.action == Action::Deny;
        };
        (self.methods.is_empty() || self.methods.contains(&http.method.to_ascii_uppercase()))
            && (self.paths.is_empty() || self.paths.iter().any(|p| p.matches(http.path)))
            && (self.hosts.is_empty() || self.hosts.contains(&http.host.to_ascii_lowercase()))
    }
}

fn decide_rules(
    default: DefaultAction,
    namespace: &str,
    rules: &[Rule],
    req: &Request<'_>,
) -> Decision {
    let Some(caller) = req.caller else {
        return Decision {
            allowed: false,
            by: Decider::Unauthenticated,
        };
    };
    let first = |action: Action| {
        rules
            .iter()
            .position(|r| r.action == action && r.matches(caller, req))
            .map(|index| Decider::Rule { index, action })
    };
    // Deny wins: looked for first, whatever the order written.
    let deny_wins = !crate::reintroduced!("authz-allow-before-deny");
    let (first_try, then) = if deny_wins {
        (Action::Deny, Action::Allow)
    } else {
        (Action::Allow, Action::Deny)
    };
    for action in [first_try, then] {
        if let Some(by) = first(action) {
            return Decision {
                allowed: action == Action::Allow,
                by,
            };
        }
    }
    let allowed = match default {
        DefaultAction::AllAuthenticated => true,
        DefaultAction::SameNamespace => id_namespace(caller) == Some(namespace),
        DefaultAction::Deny => false,
    };
    Decision {
        allowed,
        by: Decider::Default(default),
    }
}

/// One Service port a pod port serves: in kube mode a membership (the Service selects
/// the pod and its `targetPort` is the pod port), so the Service's policy governs that
/// pod port and a rule's `to.ports` names the Service port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PortService {
    /// The pod port (the app's).
    pub app_port: u16,
    /// The Service.
    pub service: String,
    /// The Service's port.
    pub service_port: u16,
}

/// What one policy governs: a namespace, or one service of it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Target {
    /// The namespace.
    pub namespace: String,
    /// The service; `None`: the namespace's policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.service {
            Some(s) => write!(f, "{}/{s}", self.namespace),
            None => write!(f, "{}", self.namespace),
        }
    }
}

impl Target {
    /// The target a policy file's name gives: `<namespace>.json` or
    /// `<namespace>.<service>.json` (both DNS labels, which hold no dot, so the name
    /// splits one way only). `None` for any other name: such a file names nothing.
    ///
    /// The name, not the content, says what a file governs, so a file whose content
    /// does not parse still names what it must refuse (fail closed).
    pub fn from_file_name(name: &str) -> Option<Target> {
        let stem = name.strip_suffix(".json")?;
        let (namespace, service) = match stem.split_once('.') {
            Some((ns, svc)) => (ns, Some(svc)),
            None => (stem, None),
        };
        check_label(namespace).ok()?;
        if let Some(s) = service {
            check_label(s).ok()?;
        }
        Some(Target {
            namespace: namespace.to_string(),
            service: service.map(str::to_string),
        })
    }

    /// The file name [`Target::from_file_name`] reads back as `self`.
    pub fn file_name(&self) -> String {
        match &self.service {
            Some(s) => format!("{}.{s}.json", self.namespace),
            None => format!("{}.json", self.namespace),
        }
    }
}

/// A policy as it reached the agent from one source, for `target`: its spec, or why it
/// is refused (which refuses every call to what it governs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sourced {
    /// Where it came from (a file path, an object name), for the operator.
    pub origin: String,
    /// The spec, or the refusal.
    pub written: Result<PolicySpec, PolicyError>,
}

impl Sourced {
    /// Reads the policy document `bytes` from `origin` for `target`: parsed
    /// ([`parse_spec`]), its `namespace`/`service` (if it sets them) those of
    /// `target` (a document moved to another name must not govern something it does
    /// not say), and checked ([`Policy::from_spec`]). Any error is kept as the refusal.
    pub fn read(origin: impl Into<String>, target: &Target, bytes: &[u8]) -> Sourced {
        let written = parse_spec(bytes).and_then(|mut spec| {
            if spec
                .namespace
                .as_ref()
                .is_some_and(|ns| *ns != target.namespace)
            {
                return Err(PolicyError::new(
                    "namespace",
                    format!("names another namespace than its target {target}"),
                ));
            }
            if spec.service != target.service && spec.service.is_some() {
                return Err(PolicyError::new(
                    "service",
                    format!("names another service than its target {target}"),
                ));
            }
            spec.namespace = Some(target.namespace.clone());
            spec.service = target.service.clone();
            Policy::from_spec(&spec)?;
            Ok(spec)
        });
        Sourced {
            origin: origin.into(),
            written,
        }
    }

    /// The policy checked, or its refusal.
    pub fn checked(&self) -> Checked {
        match &self.written {
            Ok(spec) => Policy::from_spec(spec),
            Err(e) => Err(e.clone()),
        }
    }
}
