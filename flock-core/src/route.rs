//! Traffic policy: Gateway API `HTTPRoute`s attached to a `Service` (the GAMMA
//! profile), read into the rules the translation turns into Envoy and proxyless-gRPC
//! routes.
//!
//! An operator writes an `HTTPRoute` whose `parentRefs` name a `Service` (kind
//! `Service`, core group) of the route's own namespace: a *producer route*, which
//! governs every caller of that Service. Its rules split the Service's traffic by
//! weight over `backendRefs` (other Services of the namespace, typically `web-v1`
//! and `web-v2` behind `web`), match on path, headers and method, and set timeouts
//! and retries. [`parse`] reads one object (bounded, unknown fields refused) and
//! [`HttpRoute::from_object`] checks it into [`RouteRule`]s; [`precedence`] orders
//! the rules of every route on one Service as Gateway API says.
//!
//! # Semantics (as Gateway API, and where flock is narrower)
//!
//! * A Service that some route governs answers **404** to a request no rule matches
//!   (the Gateway API's rule for a route's parent); a Service without a route keeps
//!   the mesh's default route (all endpoints, default retries).
//! * `matches`: path `Exact` or `PathPrefix` (segment-wise: `/api` matches `/api` and
//!   `/api/x`, not `/apix`), headers `Exact`, `method`. A rule without matches
//!   matches every request. `RegularExpression` matches and `queryParams` are refused
//!   (a regex Envoy would reject would break every route of the node, and flock
//!   carries no RE2 checker), as are `filters` of any kind and `hostnames`.
//! * `backendRefs`: Services of the route's namespace (a cross-namespace reference
//!   needs a ReferenceGrant, which flock does not read), with a `port` and a `weight`
//!   (default 1, may be 0). A rule whose weights are all 0 answers 500. A backend
//!   that does not exist is dropped from its rule and reported; a rule left with none
//!   answers 500 (Gateway API: requests to an invalid backend get a 500).
//! * **Subsets** (flock's extension): a backendRef of group [`SUBSET_GROUP`], kind
//!   [`SUBSET_KIND`] names a subset the route's annotation [`SUBSETS_ANNOTATION`]
//!   defines: the endpoints of a Service whose pods carry given labels
//!   (`version: v2`), for versions that share one Service. Its requests go to
//!   clusters of their own ([`subset_service_name`]); a subset no endpoint matches
//!   is dropped from its rule and reported, as a missing Service is.
//! * `timeouts.request` is the whole request's timeout (Envoy's route timeout, the
//!   gRPC stream's maximum duration); `timeouts.backendRequest` each try's.
//! * `retry` (`attempts`, `codes`, `backoff`): retries on connect failures, resets
//!   and the listed status codes. **Only idempotent methods are retried after the
//!   request may have reached the app**; `POST` and `PATCH` are retried only where
//!   the request provably never left (connect failure, refused stream), unless the
//!   route's annotation [`RETRY_NON_IDEMPOTENT`] is `"true"`.
//! * A route that does not parse or check is refused **alone** and reported: the
//!   Service's other routes, and every other Service, keep working.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::pod::check_label;

/// The annotation of an `HTTPRoute` that lets its retries repeat non-idempotent
/// requests (`"true"`): only the route's owner knows that its `POST`s are safe to
/// send twice.
pub const RETRY_NON_IDEMPOTENT: &str = "flock.io/retry-non-idempotent";
/// Most bytes of one route document [`parse`] reads.
pub const MAX_ROUTE_BYTES: usize = 64 * 1024;
/// Most rules of one route (Gateway API's own limit).
pub const MAX_RULES: usize = 16;
/// Most matches of one rule (Gateway API's limit).
pub const MAX_MATCHES: usize = 8;
/// Most header matches of one match (Gateway API's limit).
pub const MAX_HEADERS: usize = 16;
/// Most backends of one rule (Gateway API's limit).
pub const MAX_BACKENDS: usize = 16;
/// Most parent references of one route (Gateway API's limit).
pub const MAX_PARENTS: usize = 32;
/// Longest path value (Gateway API's limit).
pub const MAX_PATH_LEN: usize = 1024;
/// Longest header value (Gateway API's limit).
pub const MAX_HEADER_VALUE_LEN: usize = 4096;
/// Longest header name (Gateway API's limit).
pub const MAX_HEADER_NAME_LEN: usize = 256;
/// Most retries of one rule: each is one more request to the backends.
pub const MAX_ATTEMPTS: u32 = 10;
/// The longest timeout a route may set (one hour).
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;
/// Largest backend weight (Gateway API's limit).
pub const MAX_WEIGHT: u32 = 1_000_000;

/// The HTTP methods Gateway API allows in a match.
pub const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

/// Why a route was refused: where (`spec.rules[1].backendRefs[0].port`) and what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteError {
    /// The field.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl RouteError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        RouteError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for RouteError {}

// ---------------------------------------------------------------------------
// The object as written (the subset of gateway.networking.k8s.io/v1 HTTPRoute flock
// reads; a field it does not know is refused, not ignored).
// ---------------------------------------------------------------------------

/// An `HTTPRoute` object as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteObject {
    /// `gateway.networking.k8s.io/v1` (or `v1beta1`), when given.
    #[serde(default)]
    pub api_version: Option<String>,
    /// `HTTPRoute`, when given.
    #[serde(default)]
    pub kind: Option<String>,
    /// Name, namespace and annotations; other metadata is ignored.
    pub metadata: ObjectMeta,
    /// The route.
    pub spec: HttpRouteSpec,
    /// Written by controllers; ignored.
    #[serde(default, skip_serializing)]
    pub status: Option<serde_json::Value>,
}

/// The metadata flock reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// The route's name.
    #[serde(default)]
    pub name: Option<String>,
    /// The route's namespace (default `default`).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Annotations ([`RETRY_NON_IDEMPOTENT`]).
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// `HTTPRouteSpec`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRouteSpec {
    /// The Services (or Gateways, not flock's) the route attaches to.
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
    /// Must be empty for a Service parent (GAMMA).
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// The rules; none is one rule that matches everything and has no backend.
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
}

/// `ParentReference`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentRef {
    /// `""` (core) for a Service; default `gateway.networking.k8s.io`.
    #[serde(default)]
    pub group: Option<String>,
    /// `Service`; default `Gateway`.
    #[serde(default)]
    pub kind: Option<String>,
    /// Default: the route's.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The parent's name.
    pub name: String,
    /// The Service port the route governs; default every port.
    #[serde(default)]
    pub port: Option<u16>,
    /// A listener name, for Gateways: refused on a Service.
    #[serde(default)]
    pub section_name: Option<String>,
}

/// `HTTPRouteRule`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleSpec {
    /// An optional name.
    #[serde(default)]
    pub name: Option<String>,
    /// Conditions; none matches every request.
    #[serde(default)]
    pub matches: Vec<MatchSpec>,
    /// Filters: none is supported, any is refused.
    #[serde(default)]
    pub filters: Vec<serde_json::Value>,
    /// Where matching requests go.
    #[serde(default)]
    pub backend_refs: Vec<BackendRefSpec>,
    /// Request and per-try timeouts.
    #[serde(default)]
    pub timeouts: Option<TimeoutsSpec>,
    /// Retries.
    #[serde(default)]
    pub retry: Option<RetrySpec>,
}

/// `HTTPRouteMatch`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MatchSpec {
    /// Path condition; default `PathPrefix /`.
    #[serde(default)]
    pub path: Option<PathSpec>,
    /// Header conditions (all must match).
    #[serde(default)]
    pub headers: Vec<HeaderSpec>,
    /// Refused when not empty.
    #[serde(default)]
    pub query_params: Vec<serde_json::Value>,
    /// Method condition.
    #[serde(default)]
    pub method: Option<String>,
}

/// `HTTPPathMatch`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PathSpec {
    /// `Exact` or `PathPrefix` (default).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Default `/`.
    #[serde(default)]
    pub value: Option<String>,
}

/// `HTTPHeaderMatch`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderSpec {
    /// `Exact` (default).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Header name (case-insensitive).
    pub name: String,
    /// The value it must equal.
    pub value: String,
}

/// `HTTPBackendRef`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendRefSpec {
    /// `""` (core, default).
    #[serde(default)]
    pub group: Option<String>,
    /// `Service` (default).
    #[serde(default)]
    pub kind: Option<String>,
    /// The Service.
    pub name: String,
    /// Default: the route's; another is refused.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The Service port (required for a Service).
    #[serde(default)]
    pub port: Option<u16>,
    /// Share of the rule's requests (default 1).
    #[serde(default)]
    pub weight: Option<u32>,
    /// Refused when not empty.
    #[serde(default)]
    pub filters: Vec<serde_json::Value>,
}

/// `HTTPRouteTimeouts`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TimeoutsSpec {
    /// The whole request, retries included (Gateway API duration: `500ms`, `2s`,
    /// `1m30s`); `0s` disables it.
    #[serde(default)]
    pub request: Option<String>,
    /// Each try.
    #[serde(default)]
    pub backend_request: Option<String>,
}

/// `HTTPRouteRetry`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySpec {
    /// Status codes (400–599) that are retried, besides connect failures and resets.
    #[serde(default)]
    pub codes: Vec<u16>,
    /// Retries after the first try (default 2).
    #[serde(default)]
    pub attempts: Option<u32>,
    /// Base of the exponential back-off between tries (default 25ms).
    #[serde(default)]
    pub backoff: Option<String>,
}

/// The annotation of an `HTTPRoute` that names subsets of Services for its
/// `backendRefs` of group [`SUBSET_GROUP`], kind [`SUBSET_KIND`]: a JSON object from
/// subset name to the Service and the labels its endpoints must carry,
/// `{"web-v2": {"service": "web", "labels": {"version": "v2"}}}`. The Gateway API has
/// no subset field; an implementation-specific backend kind is its way to extend
/// what a backend can be, and the route is the one place that needs the subset.
pub const SUBSETS_ANNOTATION: &str = "flock.io/subsets";
/// The `group` of a backendRef that names a subset ([`SUBSETS_ANNOTATION`]).
pub const SUBSET_GROUP: &str = "flock.io";
/// The `kind` of a backendRef that names a subset ([`SUBSETS_ANNOTATION`]).
pub const SUBSET_KIND: &str = "ServiceSubset";
/// Most subsets one route names.
pub const MAX_SUBSETS: usize = 16;
/// Longest [`SUBSETS_ANNOTATION`] value.
pub const MAX_SUBSETS_BYTES: usize = 8 * 1024;

/// One subset as [`SUBSETS_ANNOTATION`] writes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SubsetSpec {
    /// The Service (of the route's namespace).
    pub service: String,
    /// The labels its endpoints must carry (at least one).
    pub labels: crate::labels::Labels,
}

/// The subsets of a route's [`SUBSETS_ANNOTATION`], checked; none without it.
fn subsets_of(
    annotations: &std::collections::BTreeMap<String, String>,
) -> Result<std::collections::BTreeMap<String, SubsetSpec>, RouteError> {
    let field = format!("metadata.annotations[{SUBSETS_ANNOTATION}]");
    let Some(text) = annotations.get(SUBSETS_ANNOTATION) else {
        return Ok(Default::default());
    };
    if text.len() > MAX_SUBSETS_BYTES {
        return Err(RouteError::new(
            field,
            format!("{} bytes, more than {MAX_SUBSETS_BYTES}", text.len()),
        ));
    }
    let subsets: std::collections::BTreeMap<String, SubsetSpec> = serde_json::from_str(text)
        .map_err(|e| {
            RouteError::new(
                &field,
                format!(
                    "not a JSON object of {{\"<subset>\": {{\"service\": .., \"labels\": {{..}}}}}}: {e}"
                ),
            )
        })?;
    if subsets.len() > MAX_SUBSETS {
        return Err(RouteError::new(
            field,
            format!("more than {MAX_SUBSETS} subsets"),
        ));
    }
    for (name, spec) in &subsets {
        let sf = format!("{field}.{name}");
        check_label(name).map_err(|e| RouteError::new(&field, format!("subset name {e}")))?;
        check_label(&spec.service).map_err(|e| RouteError::new(format!("{sf}.service"), e))?;
        if spec.labels.is_empty() {
            return Err(RouteError::new(
                format!("{sf}.labels"),
                "empty: a subset selects on at least one label (name the Service itself for all of it)",
            ));
        }
        crate::labels::check(&spec.labels)
            .map_err(|e| RouteError::new(format!("{sf}.labels"), e))?;
    }
    Ok(subsets)
}

/// Reads one `HTTPRoute` object (JSON): at most [`MAX_ROUTE_BYTES`], unknown spec
/// fields refused with the serde error's line and column.
pub fn parse(bytes: &[u8]) -> Result<HttpRouteObject, RouteError> {
    if bytes.len() > MAX_ROUTE_BYTES {
        return Err(RouteError::new(
            "document",
            format!("{} bytes, more than {MAX_ROUTE_BYTES}", bytes.len()),
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| RouteError::new("document", e.to_string()))
}

// ---------------------------------------------------------------------------
// The checked model: what the translation reads (and the mesh JSON carries).
// ---------------------------------------------------------------------------

/// One checked rule, for one parent Service: its matches (each its own Envoy
/// route, in the rule's place in [`precedence`]), backends and policies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRule {
    /// The route it came from, `<namespace>/<name>` (status, logs).
    pub route: String,
    /// The parent Service port it governs; `None`: every HTTP port.
    #[serde(default)]
    pub port: Option<u16>,
    /// The conditions; empty matches every request.
    #[serde(default)]
    pub matches: Vec<RouteMatch>,
    /// Where matching requests go, by weight; empty (or all weights 0): 500.
    #[serde(default)]
    pub backends: Vec<BackendRef>,
    /// The whole request's timeout; `None`: the mesh default, `Some(0)`: none.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// The retry policy; `None`: the mesh default.
    #[serde(default)]
    pub retry: Option<RetryRule>,
}

/// A path condition.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PathMatch {
    /// The path (before `?`) equals this.
    Exact(String),
    /// The path is this or under it, by segments; no trailing `/` but for `/` itself.
    Prefix(String),
}

impl Default for PathMatch {
    fn default() -> Self {
        PathMatch::Prefix("/".to_string())
    }
}

/// One match: all its conditions must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteMatch {
    /// The path.
    #[serde(default)]
    pub path: PathMatch,
    /// Headers that must have these exact values (names lowercase).
    #[serde(default)]
    pub headers: Vec<HeaderMatch>,
    /// The method, uppercase.
    #[serde(default)]
    pub method: Option<String>,
}

/// A header that must have an exact value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    /// Lowercase name.
    pub name: String,
    /// The value.
    pub value: String,
}

/// A backend: a Service port and its weight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendRef {
    /// The Service.
    pub service: String,
    /// Its namespace (the route's).
    pub namespace: String,
    /// Its port.
    pub port: u16,
    /// Its share.
    #[serde(default = "one")]
    pub weight: u32,
    /// The labels its endpoints must carry: a subset of the Service
    /// ([`SUBSETS_ANNOTATION`]). Empty: the whole Service.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub subset: crate::labels::Labels,
    /// Whether the port is mTLS (an endpoint has an identity): which cluster a
    /// caller with an identity reaches it through. Set when the routes are resolved
    /// against the services; the translation does not look at other services.
    #[serde(default)]
    pub mtls: bool,
}

fn one() -> u32 {
    1
}

/// The separator of a subset's service name, `<service>~<selector>`: no Service
/// name holds it (they are DNS labels), so a subset's clusters never share a name
/// with a Service's.
pub const SUBSET_SEPARATOR: char = '~';

/// The name of the service whose clusters carry the subset `subset` of `service`:
/// `web~version=v2` ([`crate::labels::render`]); `service` itself for the empty
/// subset.
pub fn subset_service_name(service: &str, subset: &crate::labels::Labels) -> String {
    if subset.is_empty() {
        service.to_string()
    } else {
        format!(
            "{service}{SUBSET_SEPARATOR}{}",
            crate::labels::render(subset)
        )
    }
}

impl BackendRef {
    /// The name of the service whose clusters this backend's requests go to
    /// ([`subset_service_name`]).
    pub fn target(&self) -> std::borrow::Cow<'_, str> {
        if self.subset.is_empty() {
            std::borrow::Cow::Borrowed(&self.service)
        } else {
            std::borrow::Cow::Owned(subset_service_name(&self.service, &self.subset))
        }
    }
}

/// A retry policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryRule {
    /// Retries after the first try.
    pub attempts: u32,
    /// Status codes retried (besides connect failures and resets).
    #[serde(default)]
    pub codes: Vec<u16>,
    /// Each try's timeout; `None`: the mesh default.
    #[serde(default)]
    pub per_try_timeout_ms: Option<u64>,
    /// Base back-off between tries.
    #[serde(default)]
    pub backoff_ms: Option<u64>,
    /// Whether non-idempotent requests are retried like idempotent ones.
    #[serde(default)]
    pub non_idempotent: bool,
}

/// A checked route: where it attaches and its rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpRoute {
    /// `<namespace>/<name>`.
    pub id: String,
    /// Its namespace.
    pub namespace: String,
    /// The Services it governs (names in `namespace`), each with a port or `None`.
    pub parents: Vec<(String, Option<u16>)>,
    /// Its rules (`RouteRule::port` unset: [`HttpRoute::rules_for`] sets it).
    pub rules: Vec<RouteRule>,
}

impl HttpRoute {
    /// The rules this route puts on the Service `service` of its namespace: its rules
    /// once per parent reference to that Service, with that reference's port.
    pub fn rules_for(&self, service: &str) -> Vec<RouteRule> {
        let mut out = Vec::new();
        for (_, port) in self.parents.iter().filter(|(name, _)| name == service) {
            out.extend(self.rules.iter().map(|r| RouteRule {
                port: *port,
                ..r.clone()
            }));
        }
        out
    }
}

/// A route as its source gave it: where it came from, and the route or why it was
/// refused (kept, so the status names it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourcedRoute {
    /// A file path or an object name.
    pub origin: String,
    /// The route, or the refusal.
    pub written: Result<HttpRoute, RouteError>,
}

impl SourcedRoute {
    /// Reads one `HTTPRoute` document from `origin`: parsed ([`parse`]) and checked
    /// ([`HttpRoute::from_object`]).
    pub fn read(origin: impl Into<String>, bytes: &[u8]) -> SourcedRoute {
        SourcedRoute {
            origin: origin.into(),
            written: parse(bytes).and_then(|obj| HttpRoute::from_object(&obj)),
        }
    }
}

/// A Gateway API duration (`^([0-9]{1,5}(h|m|s|ms)){1,4}$`) in milliseconds.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not a duration like 500ms, 2s or 1m30s");
    if s.is_empty() || s.len() > 32 {
        return Err(bad());
    }
    let b = s.as_bytes();
    let (mut i, mut total, mut parts) = (0, 0u64, 0);
    while i < b.len() {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start || i - start > 5 {
            return Err(bad());
        }
        let n: u64 = s[start..i].parse().map_err(|_| bad())?;
        let unit = if s[i..].starts_with("ms") {
            i += 2;
            1
        } else {
            let u = match b.get(i) {
                Some(b'h') => 3_600_000,
                Some(b'm') => 60_000,
                Some(b's') => 1000,
                _ => return Err(bad()),
            };
            i += 1;
            u
        };
        total += n * unit;
        parts += 1;
        if parts > 4 {
            return Err(bad());
        }
    }
    Ok(total)
}

fn check_text(field: &str, value: &str, max: usize) -> Result<(), RouteError> {
    if value.len() > max {
        return Err(RouteError::new(
            field,
            format!("{} bytes, more than {max}", value.len()),
        ));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(RouteError::new(field, format!("control character {c:?}")));
    }
    Ok(())
}

fn check_path(field: &str, value: &str) -> Result<(), RouteError> {
    check_text(field, value, MAX_PATH_LEN)?;
    if !value.starts_with('/') {
        return Err(RouteError::new(field, "must start with /"));
    }
    if value.contains(['?', '#']) || value.contains("//") || value.contains(' ') {
        return Err(RouteError::new(
            field,
            "must be a plain path: no ?, #, // or space",
        ));
    }
    Ok(())
}

fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

fn duration_field(field: &str, s: &str) -> Result<u64, RouteError> {
    let ms = parse_duration(s).map_err(|e| RouteError::new(field, e))?;
    if ms > MAX_TIMEOUT_MS {
        return Err(RouteError::new(field, "longer than 1h"));
    }
    Ok(ms)
}

impl HttpRoute {
    /// Checks `obj` (read from `origin`) into a route. A parent that is not a Service
    /// (a Gateway) is not flock's: a route with no Service parent is refused with a
    /// message that says so, as are all the unsupported fields of the
    /// [module docs](self).
    pub fn from_object(obj: &HttpRouteObject) -> Result<HttpRoute, RouteError> {
        if let Some(kind) = &obj.kind
            && kind != "HTTPRoute"
        {
            return Err(RouteError::new("kind", format!("{kind:?}, not HTTPRoute")));
        }
        if let Some(v) = &obj.api_version
            && !v.starts_with("gateway.networking.k8s.io/")
        {
            return Err(RouteError::new(
                "apiVersion",
                format!("{v:?}, not gateway.networking.k8s.io/*"),
            ));
        }
        let name = obj
            .metadata
            .name
            .as_deref()
            .ok_or_else(|| RouteError::new("metadata.name", "missing"))?;
        crate::pod::check_subdomain(name)
            .map_err(|e| RouteError::new("metadata.name", e.to_string()))?;
        let namespace = obj.metadata.namespace.as_deref().unwrap_or("default");
        check_label(namespace).map_err(|e| RouteError::new("metadata.namespace", e.to_string()))?;
        let id = format!("{namespace}/{name}");
        let non_idempotent = match obj.metadata.annotations.get(RETRY_NON_IDEMPOTENT) {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) if v == "false" => false,
            Some(v) => {
                return Err(RouteError::new(
                    format!("metadata.annotations[{RETRY_NON_IDEMPOTENT}]"),
                    format!("{v:?}, not \"true\" or \"false\""),
                ));
            }
        };
        let subsets = subsets_of(&obj.metadata.annotations)?;
        let spec = &obj.spec;
        if !spec.hostnames.is_empty() {
            return Err(RouteError::new(
                "spec.hostnames",
                "must be empty on a route whose parent is a Service",
            ));
        }
        if spec.parent_refs.len() > MAX_PARENTS {
            return Err(RouteError::new(
                "spec.parentRefs",
                format!("more than {MAX_PARENTS}"),
            ));
        }
        let mut parents = Vec::new();
        for (i, p) in spec.parent_refs.iter().enumerate() {
            let field = format!("spec.parentRefs[{i}]");
            let is_service =
                p.kind.as_deref() == Some("Service") && p.group.as_deref().unwrap_or("").is_empty();
            if !is_service {
                continue; // a Gateway's route: not the mesh's
            }
            if p.namespace.as_deref().is_some_and(|ns| ns != namespace) {
                return Err(RouteError::new(
                    format!("{field}.namespace"),
                    "a Service of another namespace (a consumer route) is not supported; \
                     put the route in the Service's namespace",
                ));
            }
            if p.section_name.is_some() {
                return Err(RouteError::new(
                    format!("{field}.sectionName"),
                    "not supported on a Service parent; use port",
                ));
            }
            check_label(&p.name).map_err(|e| RouteError::new(format!("{field}.name"), e))?;
            if p.port == Some(0) {
                return Err(RouteError::new(format!("{field}.port"), "must be 1-65535"));
            }
            if !parents.contains(&(p.name.clone(), p.port)) {
                parents.push((p.name.clone(), p.port));
            }
        }
        if parents.is_empty() {
            return Err(RouteError::new(
                "spec.parentRefs",
                "no Service parent (kind: Service, group: \"\"): nothing for the mesh to route",
            ));
        }
        if spec.rules.len() > MAX_RULES {
            return Err(RouteError::new(
                "spec.rules",
                format!("more than {MAX_RULES}"),
            ));
        }
        let one_rule = [RuleSpec::default()];
        let specs: &[RuleSpec] = if spec.rules.is_empty() {
            &one_rule
        } else {
            &spec.rules
        };
        let mut checked = Vec::with_capacity(specs.len());
        for (i, r) in specs.iter().enumerate() {
            checked.push(check_rule(
                &format!("spec.rules[{i}]"),
                r,
                &id,
                namespace,
                non_idempotent,
                &subsets,
            )?);
        }
        Ok(HttpRoute {
            id,
            namespace: namespace.to_string(),
            parents,
            rules: checked,
        })
    }
}

fn check_rule(
    field: &str,
    r: &RuleSpec,
    id: &str,
    namespace: &str,
    non_idempotent: bool,
    subsets: &std::collections::BTreeMap<String, SubsetSpec>,
) -> Result<RouteRule, RouteError> {
    if let Some(f) = r.filters.first() {
        let kind = f.get("type").and_then(|t| t.as_str()).unwrap_or("?");
        return Err(RouteError::new(
            format!("{field}.filters[0]"),
            format!("filter type {kind:?} is not supported"),
        ));
    }
    if r.matches.len() > MAX_MATCHES {
        return Err(RouteError::new(
            format!("{field}.matches"),
            format!("more than {MAX_MATCHES}"),
        ));
    }
    let mut matches = Vec::with_capacity(r.matches.len());
    for (j, m) in r.matches.iter().enumerate() {
        let field = format!("{field}.matches[{j}]");
        if !m.query_params.is_empty() {
            return Err(RouteError::new(
                format!("{field}.queryParams"),
                "query parameter matches are not supported",
            ));
        }
        let path = match &m.path {
            None => PathMatch::default(),
            Some(p) => {
                let value = p.value.as_deref().unwrap_or("/");
                check_path(&format!("{field}.path.value"), value)?;
                match p.kind.as_deref().unwrap_or("PathPrefix") {
                    "Exact" => PathMatch::Exact(value.to_string()),
                    "PathPrefix" => {
                        // Gateway API ignores a trailing `/` of a prefix.
                        let trimmed = value.trim_end_matches('/');
                        PathMatch::Prefix(
                            if trimmed.is_empty() { "/" } else { trimmed }.to_string(),
                        )
                    }
                    other => {
                        return Err(RouteError::new(
                            format!("{field}.path.type"),
                            format!("{other:?} is not supported (Exact or PathPrefix)"),
                        ));
                    }
                }
            }
        };
        if m.headers.len() > MAX_HEADERS {
            return Err(RouteError::new(
                format!("{field}.headers"),
                format!("more than {MAX_HEADERS}"),
            ));
        }
        let mut headers: Vec<HeaderMatch> = Vec::with_capacity(m.headers.len());
        for (k, h) in m.headers.iter().enumerate() {
            let hf = format!("{field}.headers[{k}]");
            if let Some(kind) = h.kind.as_deref()
                && kind != "Exact"
            {
                return Err(RouteError::new(
                    format!("{hf}.type"),
                    format!("{kind:?} is not supported (Exact)"),
                ));
            }
            if h.name.is_empty()
                || h.name.len() > MAX_HEADER_NAME_LEN
                || !h.name.chars().all(is_token_char)
            {
                return Err(RouteError::new(
                    format!("{hf}.name"),
                    format!("{:?} is not a header name", h.name),
                ));
            }
            if h.name.starts_with(':') {
                return Err(RouteError::new(format!("{hf}.name"), "a pseudo-header"));
            }
            check_text(&format!("{hf}.value"), &h.value, MAX_HEADER_VALUE_LEN)?;
            let name = h.name.to_ascii_lowercase();
            // Gateway API: a later match of the same name is ignored.
            if !headers.iter().any(|x| x.name == name) {
                headers.push(HeaderMatch {
                    name,
                    value: h.value.clone(),
                });
            }
        }
        let method = match &m.method {
            None => None,
            Some(mt) if METHODS.contains(&mt.as_str()) => Some(mt.clone()),
            Some(mt) => {
                return Err(RouteError::new(
                    format!("{field}.method"),
                    format!("{mt:?} is not one of {}", METHODS.join(", ")),
                ));
            }
        };
        matches.push(RouteMatch {
            path,
            headers,
            method,
        });
    }
    if r.backend_refs.len() > MAX_BACKENDS {
        return Err(RouteError::new(
            format!("{field}.backendRefs"),
            format!("more than {MAX_BACKENDS}"),
        ));
    }
    let mut backends = Vec::with_capacity(r.backend_refs.len());
    for (j, b) in r.backend_refs.iter().enumerate() {
        let bf = format!("{field}.backendRefs[{j}]");
        let group = b.group.as_deref().unwrap_or("");
        let kind = b.kind.as_deref().unwrap_or("Service");
        let is_subset = group == SUBSET_GROUP && kind == SUBSET_KIND;
        let is_service = group.is_empty() && kind == "Service";
        if !(is_subset || is_service) {
            return Err(RouteError::new(
                bf,
                format!(
                    "only Services (group \"\", kind Service) and subsets (group \"{SUBSET_GROUP}\", \
                     kind {SUBSET_KIND}) can be backends"
                ),
            ));
        }
        if b.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return Err(RouteError::new(
                format!("{bf}.namespace"),
                "a Service of another namespace needs a ReferenceGrant, which is not supported",
            ));
        }
        if let Some(f) = b.filters.first() {
            let kind = f.get("type").and_then(|t| t.as_str()).unwrap_or("?");
            return Err(RouteError::new(
                format!("{bf}.filters[0]"),
                format!("filter type {kind:?} is not supported"),
            ));
        }
        check_label(&b.name).map_err(|e| RouteError::new(format!("{bf}.name"), e))?;
        let (service, subset) = if is_subset {
            let Some(spec) = subsets.get(&b.name) else {
                return Err(RouteError::new(
                    format!("{bf}.name"),
                    format!(
                        "subset {:?} is not in the annotation {SUBSETS_ANNOTATION}",
                        b.name
                    ),
                ));
            };
            (spec.service.clone(), spec.labels.clone())
        } else {
            (b.name.clone(), Default::default())
        };
        let port = match b.port {
            Some(p) if p > 0 => p,
            _ => {
                return Err(RouteError::new(
                    format!("{bf}.port"),
                    "required for a Service (1-65535)",
                ));
            }
        };
        let weight = b.weight.unwrap_or(1);
        if weight > MAX_WEIGHT {
            return Err(RouteError::new(
                format!("{bf}.weight"),
                format!("more than {MAX_WEIGHT}"),
            ));
        }
        backends.push(BackendRef {
            service,
            namespace: namespace.to_string(),
            port,
            weight,
            subset,
            mtls: false,
        });
    }
    let (mut timeout_ms, mut per_try) = (None, None);
    if let Some(t) = &r.timeouts {
        if let Some(s) = &t.request {
            timeout_ms = Some(duration_field(&format!("{field}.timeouts.request"), s)?);
        }
        if let Some(s) = &t.backend_request {
            let ms = duration_field(&format!("{field}.timeouts.backendRequest"), s)?;
            if ms == 0 {
                return Err(RouteError::new(
                    format!("{field}.timeouts.backendRequest"),
                    "must not be 0",
                ));
            }
            if timeout_ms.is_some_and(|t| t != 0 && ms > t) {
                return Err(RouteError::new(
                    format!("{field}.timeouts.backendRequest"),
                    "longer than timeouts.request",
                ));
            }
            per_try = Some(ms);
        }
    }
    let retry = match &r.retry {
        None if per_try.is_none() => None,
        None => Some(RetryRule {
            attempts: 2,
            codes: Vec::new(),
            per_try_timeout_ms: per_try,
            backoff_ms: None,
            non_idempotent,
        }),
        Some(spec) => {
            let attempts = spec.attempts.unwrap_or(2);
            if attempts > MAX_ATTEMPTS {
                return Err(RouteError::new(
                    format!("{field}.retry.attempts"),
                    format!("more than {MAX_ATTEMPTS}"),
                ));
            }
            let mut codes = spec.codes.clone();
            if let Some(c) = codes.iter().find(|c| !(400..=599).contains(*c)) {
                return Err(RouteError::new(
                    format!("{field}.retry.codes"),
                    format!("{c} is not 400-599"),
                ));
            }
            codes.sort_unstable();
            codes.dedup();
            let backoff_ms = match &spec.backoff {
                None => None,
                Some(s) => Some(duration_field(&format!("{field}.retry.backoff"), s)?),
            };
            Some(RetryRule {
                attempts,
                codes,
                per_try_timeout_ms: per_try,
                backoff_ms,
                non_idempotent,
            })
        }
    };
    Ok(RouteRule {
        route: id.to_string(),
        port: None,
        matches,
        backends,
        timeout_ms,
        retry,
    })
}

/// The precedence key of one match (smaller first), as Gateway API orders matches
/// across every rule of every route on a parent: an exact path before a prefix,
/// a longer prefix before a shorter one, a method before none, more headers before
/// fewer. Ties keep the rules' order (older route, then name, then rule order),
/// which the caller gives by sorting stably.
pub fn precedence(
    m: &RouteMatch,
) -> (u8, std::cmp::Reverse<usize>, bool, std::cmp::Reverse<usize>) {
    let (kind, len) = match &m.path {
        PathMatch::Exact(p) => (0, p.len()),
        PathMatch::Prefix(p) => (1, p.len()),
    };
    (
        kind,
        std::cmp::Reverse(len),
        m.method.is_none(),
        std::cmp::Reverse(m.headers.len()),
    )
}

/// The rules of several routes on one parent Service, as (rule, match) pairs in the
/// order Envoy must try them ([`precedence`]; equal matches resolve to the route
/// whose `<namespace>/<name>` sorts first, then to the earlier rule: Gateway API
/// prefers the older route first, which a file has no notion of). A rule without
/// matches contributes one match-everything entry.
pub fn ordered<'a>(
    rules: impl IntoIterator<Item = &'a RouteRule>,
) -> Vec<(&'a RouteRule, RouteMatch)> {
    let mut out: Vec<(usize, &RouteRule, RouteMatch)> = Vec::new();
    for (i, r) in rules.into_iter().enumerate() {
        if r.matches.is_empty() {
            out.push((i, r, RouteMatch::default()));
        } else {
            out.extend(r.matches.iter().map(|m| (i, r, m.clone())));
        }
    }
    out.sort_by(|(ia, a, ma), (ib, b, mb)| {
        precedence(ma)
            .cmp(&precedence(mb))
            .then_with(|| a.route.cmp(&b.route))
            .then_with(|| ia.cmp(ib))
    });
    out.into_iter().map(|(_, r, m)| (r, m)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(json: serde_json::Value) -> Result<HttpRoute, RouteError> {
        let obj = parse(json.to_string().as_bytes())?;
        HttpRoute::from_object(&obj)
    }

    fn canary() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": { "name": "web", "namespace": "shop" },
            "spec": {
                "parentRefs": [{ "group": "", "kind": "Service", "name": "web", "port": 80 }],
                "rules": [
                    { "matches": [{ "headers": [{ "name": "X-Canary", "value": "1" }] }],
                      "backendRefs": [{ "name": "web-v2", "port": 80 }] },
                    { "backendRefs": [
                        { "name": "web-v1", "port": 80, "weight": 90 },
                        { "name": "web-v2", "port": 80, "weight": 10 }],
                      "timeouts": { "request": "500ms", "backendRequest": "200ms" },
                      "retry": { "attempts": 2, "codes": [503, 500] } }
                ]
            }
        })
    }

    fn subset_route(annotation: &str) -> serde_json::Value {
        serde_json::json!({
            "metadata": { "name": "web", "namespace": "shop",
                          "annotations": { SUBSETS_ANNOTATION: annotation } },
            "spec": {
                "parentRefs": [{ "kind": "Service", "name": "web", "port": 80 }],
                "rules": [{ "backendRefs": [
                    { "group": "flock.io", "kind": "ServiceSubset", "name": "v1",
                      "port": 80, "weight": 90 },
                    { "group": "flock.io", "kind": "ServiceSubset", "name": "v2",
                      "port": 80, "weight": 10 }] }]
            }
        })
    }

    #[test]
    fn a_subset_backend_names_its_service_and_labels() {
        let r = route(subset_route(
            r#"{"v1": {"service": "web", "labels": {"version": "v1"}},
                "v2": {"service": "web", "labels": {"version": "v2", "track": "canary"}}}"#,
        ))
        .unwrap();
        let b = &r.rules[0].backends;
        assert_eq!((b[0].service.as_str(), b[0].weight), ("web", 90));
        assert_eq!(crate::labels::render(&b[0].subset), "version=v1");
        assert_eq!(b[1].target(), "web~track=canary,version=v2");
        assert_eq!(b[0].namespace, "shop");
        // A plain Service backend targets the Service itself.
        let plain = route(canary()).unwrap();
        assert_eq!(plain.rules[0].backends[0].target(), "web-v2");
        assert!(plain.rules[0].backends[0].subset.is_empty());
    }

    #[test]
    fn a_bad_subset_refuses_the_route_and_says_where() {
        let field = format!("metadata.annotations[{SUBSETS_ANNOTATION}]");
        for (annotation, at, says) in [
            ("not json", field.clone(), "not a JSON object"),
            (
                r#"{"v1": {"service": "web", "labels": {}}}"#,
                format!("{field}.v1.labels"),
                "empty",
            ),
            (
                r#"{"v1": {"service": "Web", "labels": {"a": "b"}}}"#,
                format!("{field}.v1.service"),
                "DNS label",
            ),
            (
                r#"{"v1": {"service": "web", "labels": {"a": "b,c"}}}"#,
                format!("{field}.v1.labels"),
                "label value",
            ),
            (
                r#"{"v1": {"service": "web", "labels": {"a": "b"}, "x": 1}}"#,
                field.clone(),
                "unknown field",
            ),
            // v2 is used but not defined.
            (
                r#"{"v1": {"service": "web", "labels": {"a": "b"}}}"#,
                "spec.rules[0].backendRefs[1].name".to_string(),
                "not in the annotation",
            ),
        ] {
            let e = route(subset_route(annotation)).unwrap_err();
            assert_eq!(e.field, at, "{annotation}: {e}");
            assert!(e.reason.contains(says), "{annotation}: {e}");
        }
        let many: serde_json::Map<String, serde_json::Value> = (0..=MAX_SUBSETS)
            .map(|i| {
                (
                    format!("s{i}"),
                    serde_json::json!({"service": "web", "labels": {"a": "b"}}),
                )
            })
            .collect();
        let e = route(subset_route(&serde_json::Value::Object(many).to_string())).unwrap_err();
        assert!(e.reason.contains("more than 16 subsets"), "{e}");
        // Another implementation's backend kind is still refused.
        let mut other = subset_route(r#"{"v1": {"service": "web", "labels": {"a": "b"}}}"#);
        other["spec"]["rules"][0]["backendRefs"][0]["group"] = "example.com".into();
        let e = route(other).unwrap_err();
        assert_eq!(e.field, "spec.rules[0].backendRefs[0]");
    }

    #[test]
    fn a_canary_route_checks_into_rules_for_its_parent_port() {
        let r = route(canary()).unwrap();
        assert_eq!(r.id, "shop/web");
        assert_eq!(r.parents, vec![("web".to_string(), Some(80))]);
        assert!(r.rules_for("other").is_empty());
        let r = HttpRoute {
            rules: r.rules_for("web"),
            ..r
        };
        assert!(r.rules.iter().all(|rule| rule.port == Some(80)));
        assert_eq!(r.rules.len(), 2);
        assert_eq!(r.rules[0].matches[0].headers[0].name, "x-canary");
        assert_eq!(r.rules[0].matches[0].path, PathMatch::Prefix("/".into()));
        assert_eq!(r.rules[1].backends[0].weight, 90);
        assert_eq!(r.rules[1].timeout_ms, Some(500));
        let retry = r.rules[1].retry.as_ref().unwrap();
        assert_eq!((retry.attempts, retry.per_try_timeout_ms), (2, Some(200)));
        assert_eq!(retry.codes, vec![500, 503]);
        assert!(!retry.non_idempotent);
    }

    #[test]
    fn unsupported_fields_are_refused_with_their_place() {
        let mut j = canary();
        j["spec"]["rules"][1]["filters"] = serde_json::json!([{ "type": "RequestMirror" }]);
        let e = route(j).unwrap_err();
        assert_eq!(e.field, "spec.rules[1].filters[0]");
        assert!(e.reason.contains("RequestMirror"), "{e}");

        let mut j = canary();
        j["spec"]["rules"][0]["matches"][0]["path"] =
            serde_json::json!({ "type": "RegularExpression", "value": "/a.*" });
        assert_eq!(
            route(j).unwrap_err().field,
            "spec.rules[0].matches[0].path.type"
        );

        let mut j = canary();
        j["spec"]["rules"][0]["sessionPersistence"] = serde_json::json!({});
        assert!(route(j).unwrap_err().reason.contains("sessionPersistence"));

        let mut j = canary();
        j["spec"]["rules"][1]["backendRefs"][0]["namespace"] = "other".into();
        assert!(route(j).unwrap_err().reason.contains("ReferenceGrant"));

        let mut j = canary();
        j["spec"]["parentRefs"] = serde_json::json!([{ "name": "gw" }]);
        assert!(route(j).unwrap_err().reason.contains("no Service parent"));

        let mut j = canary();
        j["spec"]["rules"][1]["timeouts"]["request"] = "5 s".into();
        assert_eq!(
            route(j).unwrap_err().field,
            "spec.rules[1].timeouts.request"
        );
    }

    #[test]
    fn durations_follow_gateway_api() {
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("1m30s"), Ok(90_000));
        assert_eq!(parse_duration("1h"), Ok(3_600_000));
        assert_eq!(parse_duration("0s"), Ok(0));
        for bad in ["", "5", "s", "1.5s", "123456s", "1s1s1s1s1s", "-1s", "1d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn precedence_puts_exact_then_longest_prefix_then_method_then_headers() {
        let m = |path: PathMatch, method: Option<&str>, headers: usize| RouteMatch {
            path,
            method: method.map(str::to_string),
            headers: (0..headers)
                .map(|i| HeaderMatch {
                    name: format!("h{i}"),
                    value: "v".into(),
                })
                .collect(),
        };
        let rule = |route: &str, matches: Vec<RouteMatch>| RouteRule {
            route: route.into(),
            port: None,
            matches,
            backends: vec![],
            timeout_ms: None,
            retry: None,
        };
        let rules = vec![
            rule("ns/b", vec![m(PathMatch::Prefix("/".into()), None, 0)]),
            rule("ns/a", vec![m(PathMatch::Prefix("/".into()), None, 1)]),
            rule("ns/a", vec![m(PathMatch::Prefix("/api".into()), None, 0)]),
            rule(
                "ns/a",
                vec![m(PathMatch::Prefix("/".into()), Some("GET"), 0)],
            ),
            rule("ns/b", vec![m(PathMatch::Exact("/".into()), None, 0)]),
        ];
        let order: Vec<usize> = ordered(&rules)
            .iter()
            .map(|(r, _)| rules.iter().position(|x| std::ptr::eq(x, *r)).unwrap())
            .collect();
        assert_eq!(order, vec![4, 2, 3, 1, 0]);
    }

    #[test]
    fn oversized_documents_are_refused_before_parsing() {
        let big = vec![b' '; MAX_ROUTE_BYTES + 1];
        assert!(parse(&big).unwrap_err().reason.contains("more than"));
    }
}
