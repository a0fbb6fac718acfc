//! Traffic policy in the translation: a service's [`RouteRule`]s (from Gateway API
//! `HTTPRoute`s, [`flock_core::route`]) as the routes of its outbound virtual host,
//! for Envoy and for proxyless gRPC, and the circuit breakers of every mesh cluster.
//!
//! Per (rule, match) in [`flock_core::route::ordered`] order, one or two Envoy routes:
//! a path prefix `/api` is the exact path `/api` and the prefix `/api/` (Gateway
//! API's segment-wise prefix, in the two matchers both Envoy and gRPC implement).
//! Each routes to its backends by weight (`weighted_clusters`; one backend: its
//! cluster), with the rule's timeout. A rule's retries are split by method as the
//! mesh's default routes are: idempotent methods retry on everything the rule names,
//! other methods only where the request never left (unless the route allows
//! non-idempotent retries). After every rule, a 404 for what no rule matched.

use super::envoy::{
    IDEMPOTENT_METHODS, RETRY_ON_IDEMPOTENT, RETRY_ON_OTHER, duration_ms_u64, idempotent_methods,
    retry_policy,
};
use super::model::Service;
use envoy_types::pb::envoy::config::cluster::v3::{CircuitBreakers, circuit_breakers};
use envoy_types::pb::envoy::config::core::v3::{DataSource, RoutingPriority, data_source};
use envoy_types::pb::envoy::config::route::v3::{
    DirectResponseAction, HeaderMatcher, Route, RouteAction, RouteMatch as PbRouteMatch,
    WeightedCluster, header_matcher, retry_policy::RetryBackOff, route, route_action, route_match,
    weighted_cluster,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher::MatchPattern};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::UInt32Value;
use flock_core::route::{BackendRef, PathMatch, RouteMatch, RouteRule, ordered};

/// Which cluster a route sends to: `(namespace, service, port, backend_mtls)`;
/// `backend_mtls` is `None` for the service's own port, `Some` for a rule's backend
/// ([`BackendRef::mtls`]).
pub(crate) type ClusterFor<'a> = dyn Fn(&str, &str, u16, Option<bool>) -> String + 'a;

/// Who the routes are for: Envoy's outbound routes, or a proxyless gRPC client's
/// (no retry policy: gRPC's own transparent retries and the client's service config
/// decide; see [`super::grpc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    Envoy,
    Grpc,
}

/// The rules of `s` that govern `port` (those of every port, and the port's own).
pub fn rules_of(s: &Service, port: u16) -> impl Iterator<Item = &RouteRule> {
    s.routes
        .iter()
        .filter(move |r| r.port.is_none_or(|p| p == port))
}

fn exact(name: &str, value: &str) -> HeaderMatcher {
    HeaderMatcher {
        name: name.to_string(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            StringMatcher {
                match_pattern: Some(MatchPattern::Exact(value.to_string())),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

/// Whether `method` is idempotent (RFC 9110 section 9.2.2).
fn is_idempotent(method: &str) -> bool {
    IDEMPOTENT_METHODS.split('|').any(|m| m == method)
}

/// The Envoy matchers of one match: the path (two for a segment-wise prefix), each
/// with the headers and the method.
fn matchers(m: &RouteMatch, flavor: Flavor) -> Vec<PbRouteMatch> {
    let mut headers: Vec<HeaderMatcher> =
        m.headers.iter().map(|h| exact(&h.name, &h.value)).collect();
    if let Some(method) = &m.method {
        headers.push(exact(":method", method));
    }
    let with = |path: route_match::PathSpecifier| PbRouteMatch {
        path_specifier: Some(path),
        headers: headers.clone(),
        ..Default::default()
    };
    use route_match::PathSpecifier::{Path, Prefix};
    match &m.path {
        PathMatch::Exact(p) => vec![with(Path(p.clone()))],
        // gRPC paths are `/pkg.Service/Method`; the empty prefix is how gRPC's own
        // routes say "everything".
        PathMatch::Prefix(p) if p == "/" => vec![with(Prefix(match flavor {
            Flavor::Envoy => "/".to_string(),
            Flavor::Grpc => String::new(),
        }))],
        PathMatch::Prefix(p) => vec![with(Path(p.clone())), with(Prefix(format!("{p}/")))],
    }
}

/// A status-only answer (404 for what no rule matches, 500 for a rule without a
/// usable backend).
fn direct(status: u32, body: &str) -> route::Action {
    route::Action::DirectResponse(DirectResponseAction {
        status,
        body: Some(DataSource {
            specifier: Some(data_source::Specifier::InlineString(body.to_string())),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The route action of a rule: its backends by weight (those with weight 0 get
/// none), its timeout; `None` when no backend has a weight (the rule answers 500).
fn forward(rule: &RouteRule, cluster_for: &ClusterFor<'_>, flavor: Flavor) -> Option<RouteAction> {
    let cluster = |b: &BackendRef| cluster_for(&b.namespace, &b.target(), b.port, Some(b.mtls));
    // One entry per cluster, weights summed: the same backend named twice must keep
    // its whole share (gRPC keys weighted clusters by name).
    let mut live: Vec<(String, u32)> = Vec::new();
    for b in rule.backends.iter().filter(|b| b.weight > 0) {
        let name = cluster(b);
        match live.iter_mut().find(|(n, _)| *n == name) {
            Some((_, w)) => *w = w.saturating_add(b.weight),
            None => live.push((name, b.weight)),
        }
    }
    let specifier = match live.as_slice() {
        [] => return None,
        [(one, _)] => route_action::ClusterSpecifier::Cluster(one.clone()),
        many => route_action::ClusterSpecifier::WeightedClusters(WeightedCluster {
            clusters: many
                .iter()
                .map(|(name, weight)| weighted_cluster::ClusterWeight {
                    name: name.clone(),
                    weight: Some(UInt32Value { value: *weight }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
    };
    let mut action = RouteAction {
        cluster_specifier: Some(specifier),
        ..Default::default()
    };
    if let Some(ms) = rule.timeout_ms {
        match flavor {
            // 0 disables Envoy's route timeout (15 s by default).
            Flavor::Envoy => action.timeout = Some(duration_ms_u64(ms)),
            // gRPC reads a route's deadline from max_stream_duration (gRFC A31).
            Flavor::Grpc if ms > 0 => {
                action.max_stream_duration = Some(route_action::MaxStreamDuration {
                    max_stream_duration: Some(duration_ms_u64(ms)),
                    ..Default::default()
                })
            }
            Flavor::Grpc => {}
        }
    }
    Some(action)
}

/// The routes of one port of a service that rules govern, in the order Envoy tries
/// them (see the [module docs](self)), ending in a 404 for everything else.
pub(crate) fn policy_routes<'a>(
    rules: impl IntoIterator<Item = &'a RouteRule>,
    default_per_try_ms: u32,
    cluster_for: &ClusterFor<'_>,
    flavor: Flavor,
) -> Vec<Route> {
    let mut out = Vec::new();
    for (rule, m) in ordered(rules) {
        let action = forward(rule, cluster_for, flavor);
        for matcher in matchers(&m, flavor) {
            let Some(action) = &action else {
                out.push(Route {
                    r#match: Some(matcher),
                    action: Some(direct(
                        500,
                        "no backend of this route can take the request\n",
                    )),
                    ..Default::default()
                });
                continue;
            };
            let route = |matcher: PbRouteMatch, action: RouteAction| Route {
                r#match: Some(matcher),
                action: Some(route::Action::Route(action)),
                ..Default::default()
            };
            if flavor == Flavor::Grpc {
                out.push(route(matcher, action.clone()));
                continue;
            }
            let retry = rule.retry.as_ref();
            let attempts = retry.map_or(2, |r| r.attempts);
            let per_try = retry
                .and_then(|r| r.per_try_timeout_ms)
                .map_or(u64::from(default_per_try_ms), |ms| ms);
            let full = {
                let mut on = RETRY_ON_IDEMPOTENT.to_string();
                let mut policy;
                match retry {
                    Some(r) if !r.codes.is_empty() => {
                        on = RETRY_ON_OTHER.replace("reset-before-request", "reset");
                        on.push_str(",retriable-status-codes");
                        policy = retry_policy(&on, 0);
                        policy.retriable_status_codes =
                            r.codes.iter().map(|c| u32::from(*c)).collect();
                    }
                    _ => policy = retry_policy(&on, 0),
                }
                policy.per_try_timeout = (per_try > 0).then(|| duration_ms_u64(per_try));
                policy.num_retries = Some(UInt32Value { value: attempts });
                if let Some(ms) = retry.and_then(|r| r.backoff_ms).filter(|ms| *ms > 0) {
                    policy.retry_back_off = Some(RetryBackOff {
                        base_interval: Some(duration_ms_u64(ms)),
                        max_interval: Some(duration_ms_u64(ms.saturating_mul(10))),
                    });
                }
                policy
            };
            let mut safe = retry_policy(RETRY_ON_OTHER, 0);
            safe.num_retries = Some(UInt32Value { value: attempts });
            // `backendRequest` bounds each try of every method; a timed-out POST is
            // not retried (`reset-before-request` does not cover a sent request).
            if let Some(ms) = retry
                .and_then(|r| r.per_try_timeout_ms)
                .filter(|ms| *ms > 0)
            {
                safe.per_try_timeout = Some(duration_ms_u64(ms));
            }
            let everything = retry.is_some_and(|r| r.non_idempotent);
            // The mutant retries every method like an idempotent one: a POST that
            // reached the app and failed is sent again.
            if flock_core::reintroduced!("route-retries-non-idempotent") {
                safe = full.clone();
            }
            match m.method.as_deref() {
                _ if everything => {
                    out.push(route(
                        matcher,
                        RouteAction {
                            retry_policy: Some(full),
                            ..action.clone()
                        },
                    ));
                }
                Some(method) if is_idempotent(method) => {
                    out.push(route(
                        matcher,
                        RouteAction {
                            retry_policy: Some(full),
                            ..action.clone()
                        },
                    ));
                }
                Some(_) => {
                    out.push(route(
                        matcher,
                        RouteAction {
                            retry_policy: Some(safe),
                            ..action.clone()
                        },
                    ));
                }
                None => {
                    // A RetryPolicy cannot depend on the method: the method selects
                    // the route.
                    let mut idempotent = matcher.clone();
                    idempotent.headers.push(idempotent_methods());
                    out.push(route(
                        idempotent,
                        RouteAction {
                            retry_policy: Some(full),
                            ..action.clone()
                        },
                    ));
                    out.push(route(
                        matcher,
                        RouteAction {
                            retry_policy: Some(safe),
                            ..action.clone()
                        },
                    ));
                }
            }
        }
    }
    out.push(Route {
        r#match: Some(PbRouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix(match flavor {
                Flavor::Envoy => "/".to_string(),
                Flavor::Grpc => String::new(),
            })),
            ..Default::default()
        }),
        action: Some(direct(
            404,
            "no route of this service matches the request\n",
        )),
        ..Default::default()
    });
    out
}

/// The connection-pool limits of one mesh cluster, when its service sets none.
///
/// One Envoy carries every pod of the node, so one service's callers must not be
/// able to take all of its connections, memory or retries: each cluster gets
/// bounds of its own. Requests over a bound fail at once with a 503 (and the
/// cluster's `upstream_rq_pending_overflow` counter), rather than queueing behind
/// a backend that cannot keep up. Retries are bounded by a budget (a share of the
/// active requests, as Linkerd does) instead of Envoy's default of 3 concurrent
/// retries per cluster, which a busy service exceeds in ordinary operation.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 4096;
/// See [`DEFAULT_MAX_CONNECTIONS`].
pub const DEFAULT_MAX_PENDING_REQUESTS: u32 = 4096;
/// See [`DEFAULT_MAX_CONNECTIONS`].
pub const DEFAULT_MAX_REQUESTS: u32 = 16384;
/// Retries may add this percentage of the active requests (see
/// [`DEFAULT_MAX_CONNECTIONS`]).
pub const DEFAULT_RETRY_BUDGET_PERCENT: u32 = 20;
/// Retries always allowed, whatever the budget (a service with few requests must
/// still be able to retry).
pub const DEFAULT_MIN_RETRY_CONCURRENCY: u32 = 10;

/// A service's connection-pool limits (every one of its mesh clusters).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionPool {
    /// Most connections to all endpoints of a port.
    #[serde(default = "max_connections")]
    pub max_connections: u32,
    /// Most requests waiting for a connection.
    #[serde(default = "max_pending")]
    pub max_pending_requests: u32,
    /// Most requests in flight.
    #[serde(default = "max_requests")]
    pub max_requests: u32,
    /// Retries may add this percentage of the requests in flight (1–100).
    #[serde(default = "retry_budget")]
    pub retry_budget_percent: u32,
}

fn max_connections() -> u32 {
    DEFAULT_MAX_CONNECTIONS
}
fn max_pending() -> u32 {
    DEFAULT_MAX_PENDING_REQUESTS
}
fn max_requests() -> u32 {
    DEFAULT_MAX_REQUESTS
}
fn retry_budget() -> u32 {
    DEFAULT_RETRY_BUDGET_PERCENT
}

impl Default for ConnectionPool {
    fn default() -> Self {
        ConnectionPool {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_pending_requests: DEFAULT_MAX_PENDING_REQUESTS,
            max_requests: DEFAULT_MAX_REQUESTS,
            retry_budget_percent: DEFAULT_RETRY_BUDGET_PERCENT,
        }
    }
}

/// The circuit breakers of a mesh cluster: `pool`'s limits at the default priority.
pub fn circuit_breakers(pool: &ConnectionPool) -> CircuitBreakers {
    let v = |value| Some(UInt32Value { value });
    CircuitBreakers {
        thresholds: vec![circuit_breakers::Thresholds {
            priority: RoutingPriority::Default as i32,
            max_connections: v(pool.max_connections),
            max_pending_requests: v(pool.max_pending_requests),
            max_requests: v(pool.max_requests),
            retry_budget: Some(circuit_breakers::thresholds::RetryBudget {
                budget_percent: Some(Percent {
                    value: f64::from(pool.retry_budget_percent),
                }),
                min_retry_concurrency: v(DEFAULT_MIN_RETRY_CONCURRENCY),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A rule the resolution changed or dropped, for the route's status.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RouteProblem {
    /// The route, `<namespace>/<name>`.
    pub route: String,
    /// What is wrong, for the operator.
    pub message: String,
}

/// The rules `rules` of the service `parent` as the translation can serve them,
/// against the services `lookup` finds by (namespace, name): a rule for a port that
/// is not one of `parent`'s HTTP/gRPC ports (or, without a port, on a parent that has
/// none) is dropped; a backend that is not a port of an existing service speaking
/// the protocol of the parent's port (gRPC to gRPC, HTTP to HTTP) is dropped from its
/// rule (a rule left with none answers 500); rules beyond
/// [`MAX_ROUTE_RULES`](super::model::MAX_ROUTE_RULES) are dropped; each remaining
/// backend's [`BackendRef::mtls`] is set from its port's endpoints. Each change is a
/// [`RouteProblem`]; the other rules and backends are kept (a bad reference never
/// breaks what is fine).
pub fn resolve<'a>(
    rules: &[RouteRule],
    parent: &Service,
    lookup: &dyn Fn(&str, &str) -> Option<&'a Service>,
) -> (Vec<RouteRule>, Vec<RouteProblem>) {
    use super::model::{MAX_ROUTE_RULES, Protocol};
    let mut out = Vec::with_capacity(rules.len().min(MAX_ROUTE_RULES));
    let mut problems = Vec::new();
    let protocol_of = |s: &Service, port: u16| {
        s.ports
            .iter()
            .find(|p| p.port == port && p.protocol.is_http())
            .map(|p| p.protocol)
    };
    let name = |p: Protocol| if p == Protocol::Grpc { "gRPC" } else { "HTTP" };
    for rule in rules {
        if out.len() == MAX_ROUTE_RULES {
            problems.push(RouteProblem {
                route: rule.route.clone(),
                message: format!(
                    "{}.{} has more than {MAX_ROUTE_RULES} rules: this one is not served",
                    parent.name, parent.namespace
                ),
            });
            continue;
        }
        // The protocols of the parent's ports this rule governs.
        let governed: Vec<Protocol> = match rule.port {
            Some(port) => protocol_of(parent, port).into_iter().collect(),
            None => parent
                .ports
                .iter()
                .filter(|p| p.protocol.is_http())
                .map(|p| p.protocol)
                .collect(),
        };
        if governed.is_empty() {
            problems.push(RouteProblem {
                route: rule.route.clone(),
                message: match rule.port {
                    Some(port) => format!(
                        "parent {}.{} has no HTTP or gRPC port {port}: its rules are not served",
                        parent.name, parent.namespace
                    ),
                    None => format!(
                        "parent {}.{} has no HTTP or gRPC port: its rules are not served",
                        parent.name, parent.namespace
                    ),
                },
            });
            continue;
        }
        let mut rule = rule.clone();
        rule.backends.retain_mut(|b| {
            let target = b.target();
            let found = if b.namespace == parent.namespace && *target == parent.name {
                Some(parent)
            } else {
                lookup(&b.namespace, &target)
            };
            let problem = match found {
                None if b.subset.is_empty() => format!(
                    "backend {}.{} does not exist (no endpoints): requests for it get 500",
                    b.service, b.namespace
                ),
                None => format!(
                    "backend {}.{} subset {} has no endpoints (none carries those labels): \
                     requests for it get 500",
                    b.service,
                    b.namespace,
                    flock_core::labels::render(&b.subset)
                ),
                Some(s) => match protocol_of(s, b.port) {
                    None => format!(
                        "backend {}.{} has no HTTP or gRPC port {}: requests for it get 500",
                        b.service, b.namespace, b.port
                    ),
                    Some(p) if governed.iter().any(|g| *g != p) => format!(
                        "backend {}.{} port {} speaks {}, the parent's port {}: requests for it get 500",
                        b.service,
                        b.namespace,
                        b.port,
                        name(p),
                        name(governed[0])
                    ),
                    Some(_) => {
                        b.mtls = super::model::port_endpoints(s, b.port).mtls;
                        return true;
                    }
                },
            };
            problems.push(RouteProblem {
                route: rule.route.clone(),
                message: problem,
            });
            false
        });
        out.push(rule);
    }
    (out, problems)
}

/// The services of the route subsets `rules` name ([`BackendRef::subset`]), made
/// from the services `lookup` finds by (namespace, name): per distinct (namespace,
/// Service, selector), a service named [`flock_core::route::subset_service_name`]
/// (`web~version=v2`) with the Service's ports and connection pool and those of its
/// endpoints whose labels the selector selects (an endpoint without an identity
/// only where no port it serves is mTLS); no VIPs, no routes. Its clusters
/// are the Service's, narrowed ([`Service::subset_of`]). A subset no endpoint
/// matches is not made, so [`resolve`] drops its backend and reports it, as it does
/// a Service that does not exist. Sorted by namespace and name.
pub fn subset_services<'a, 'b>(
    rules: impl IntoIterator<Item = &'b RouteRule>,
    lookup: &dyn Fn(&str, &str) -> Option<&'a Service>,
) -> Vec<Service> {
    let mut wanted: std::collections::BTreeMap<(String, String), &'b BackendRef> =
        std::collections::BTreeMap::new();
    for b in rules
        .into_iter()
        .flat_map(|r| &r.backends)
        .filter(|b| !b.subset.is_empty())
    {
        wanted
            .entry((b.namespace.clone(), b.target().into_owned()))
            .or_insert(b);
    }
    wanted
        .into_iter()
        .filter_map(|((namespace, name), b)| {
            let base = lookup(&b.namespace, &b.service)?;
            // Never downgrade: an endpoint without an identity is left out of a
            // Service port that is mTLS (`port_endpoints`), so a subset of only such
            // endpoints must not become a plaintext port of its own.
            let mtls_ports: Vec<u16> = base
                .ports
                .iter()
                .map(|p| p.port)
                .filter(|p| super::model::port_endpoints(base, *p).mtls)
                .collect();
            let endpoints: Vec<_> = base
                .endpoints
                .iter()
                .filter(|e| flock_core::labels::selects(&b.subset, &e.labels))
                .filter(|e| {
                    e.identity.is_some()
                        || !mtls_ports
                            .iter()
                            .any(|p| e.service_port.is_none_or(|sp| sp == *p))
                })
                .cloned()
                .collect();
            (!endpoints.is_empty()).then(|| Service {
                name,
                namespace,
                ports: base.ports.clone(),
                endpoints,
                vips: Vec::new(),
                routes: Vec::new(),
                pool: base.pool.clone(),
            })
        })
        .collect()
}
