//! The agent's traffic policy: Gateway API `HTTPRoute`s with a `Service` parent
//! ([`flock_core::route`]), from a watched directory (`--routes-dir`: one route per
//! `*.json` file), kept in the agent's core ([`flock_core::agent::AgentCore::set_route`])
//! and applied to the services at each publish.
//!
//! At a publish, each service some route names gets those routes' rules, resolved
//! against the services of that publish ([`translate::policy::resolve`]): a backend
//! that does not exist is dropped from its rule and reported, never the route. A
//! route that does not parse or check is refused alone: its Service keeps the
//! default route (or its other routes), every other route stays in force, and
//! [`Agent::route_status`] (`/debug/routes`, `flockctl routes`) names the file and
//! the field. The resolved service is kept while its base service, its routes and
//! its backends are the very same values, so a publish with routes in force
//! re-resolves only the services a change touched.

use super::Agent;
use flock_core::route::{MAX_ROUTE_BYTES, RouteRule, SourcedRoute};
use flock_xds::translate::{self, policy::RouteProblem};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Most route files the agent reads from its directory.
pub const MAX_FILES: usize = 10_000;

/// One route's status, as `/debug/routes` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteStatus {
    /// The source's key (the file name, the API object), or `Service <ns>/<name>`
    /// for a Service whose connection-pool annotations were refused.
    pub key: String,
    /// Where it came from.
    pub origin: String,
    /// `<namespace>/<name>`, when it parsed.
    pub route: Option<String>,
    /// `Accepted` (every rule served as written), `PartiallyInvalid` (a backend or
    /// a rule dropped: see `problems`) or `Refused` (nothing of it is served).
    pub state: &'static str,
    /// What is wrong, for the operator.
    pub problems: Vec<String>,
}

/// What the last publish resolved: per routed service, the base service it was
/// resolved from, the rules and backends it was resolved against, and the result.
#[derive(Default)]
pub(super) struct RoutedCache {
    entries: HashMap<(String, String), Routed>,
    /// The route subsets' services by (namespace, name), from the last publish.
    subsets: HashMap<(String, String), Arc<translate::Service>>,
    /// The status of every route, from the last publish.
    pub(super) status: Vec<RouteStatus>,
}

struct Routed {
    base: Arc<translate::Service>,
    rules: Vec<RouteRule>,
    backends: Vec<Option<Arc<translate::Service>>>,
    problems: Vec<RouteProblem>,
    service: Arc<translate::Service>,
}

/// `services` with each routed service replaced by one carrying its resolved rules
/// (see the [module docs](self)); the same list when no route is in force.
pub(super) fn apply(
    routes: &flock_core::journal::Snapshot<String, Arc<SourcedRoute>>,
    services: Arc<Vec<Arc<translate::Service>>>,
    cache: &mut RoutedCache,
    vips_of: &dyn Fn(&str, &str) -> Vec<std::net::IpAddr>,
) -> Arc<Vec<Arc<translate::Service>>> {
    if routes.map().is_empty() {
        cache.entries.clear();
        cache.subsets.clear();
        cache.status.clear();
        return services;
    }
    // The rules per parent (namespace, service), routes in key order.
    let mut by_parent: BTreeMap<(String, String), Vec<RouteRule>> = BTreeMap::new();
    for (_, sourced) in routes.map().iter() {
        if let Ok(route) = &sourced.written {
            let names: BTreeSet<&str> = route.parents.iter().map(|(n, _)| n.as_str()).collect();
            for name in names {
                by_parent
                    .entry((route.namespace.clone(), name.to_string()))
                    .or_default()
                    .extend(route.rules_for(name));
            }
        }
    }
    // The route subsets the rules name, each a service of its own (its Service's
    // endpoints that carry the labels). The last publish's value is kept while it is
    // equal, so the translation's memo sees the same service and does no work.
    let subsets: Vec<Arc<translate::Service>> = {
        let base: HashMap<(&str, &str), &Arc<translate::Service>> = services
            .iter()
            .map(|s| ((s.namespace.as_str(), s.name.as_str()), s))
            .collect();
        let lookup = |ns: &str, name: &str| base.get(&(ns, name)).map(|s| &***s);
        let mut kept = HashMap::new();
        let made: Vec<Arc<translate::Service>> =
            translate::policy::subset_services(by_parent.values().flatten(), &lookup)
                .into_iter()
                .map(|subset| {
                    let key = (subset.namespace.clone(), subset.name.clone());
                    let service = match cache.subsets.remove(&key) {
                        Some(old) if *old == subset => old,
                        _ => Arc::new(subset),
                    };
                    kept.insert(key, Arc::clone(&service));
                    service
                })
                .collect();
        cache.subsets = kept;
        made
    };
    let index: HashMap<(&str, &str), &Arc<translate::Service>> = services
        .iter()
        .chain(&subsets)
        .map(|s| ((s.namespace.as_str(), s.name.as_str()), s))
        .collect();
    let mut out: Vec<Arc<translate::Service>> = Vec::with_capacity(services.len() + subsets.len());
    let mut problems: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut kept = HashMap::with_capacity(by_parent.len());
    for s in services.iter() {
        let key = (s.namespace.clone(), s.name.clone());
        let Some(rules) = by_parent.remove(&key) else {
            out.push(Arc::clone(s));
            continue;
        };
        let backends: Vec<Option<Arc<translate::Service>>> = rules
            .iter()
            .flat_map(|r| &r.backends)
            .map(|b| {
                index
                    .get(&(b.namespace.as_str(), &*b.target()))
                    .map(|s| Arc::clone(s))
            })
            .collect();
        let same = |r: &Routed| {
            Arc::ptr_eq(&r.base, s)
                && r.rules == rules
                && r.backends.len() == backends.len()
                && r.backends.iter().zip(&backends).all(|(a, b)| match (a, b) {
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    (None, None) => true,
                    _ => false,
                })
        };
        let routed = match cache.entries.remove(&key) {
            Some(r) if same(&r) => r,
            _ => {
                let lookup = |ns: &str, name: &str| index.get(&(ns, name)).map(|s| &***s);
                let (resolved, found) = translate::policy::resolve(&rules, s, &lookup);
                let mut service = (**s).clone();
                service.routes = resolved;
                Routed {
                    base: Arc::clone(s),
                    rules,
                    backends,
                    problems: found,
                    service: Arc::new(service),
                }
            }
        };
        for p in &routed.problems {
            problems
                .entry(p.route.clone())
                .or_default()
                .push(p.message.clone());
        }
        out.push(Arc::clone(&routed.service));
        kept.insert(key, routed);
    }
    // A parent with no endpoints of its own (GAMMA's usual shape: a Service that only
    // names the traffic, with `web-v1` and `web-v2` behind it) is served from its
    // routes alone, on the ports its parentRefs name: gRPC where every backend of the
    // port's rules is a gRPC port, else HTTP; with the Service's VIPs (kube mode), so
    // captured callers dialing its address are routed too.
    let mut synthesized = false;
    for ((ns, name), rules) in by_parent {
        let mut ports: Vec<u16> = rules.iter().filter_map(|r| r.port).collect();
        ports.sort_unstable();
        ports.dedup();
        if ports.is_empty() {
            let ids: BTreeSet<&str> = rules.iter().map(|r| r.route.as_str()).collect();
            for id in ids {
                problems.entry(id.to_string()).or_default().push(format!(
                    "parent Service {name}.{ns} has no endpoints and the parentRef no port: not served"
                ));
            }
            continue;
        }
        let protocol = |port: u16| {
            let mut backends = rules
                .iter()
                .filter(|r| r.port == Some(port))
                .flat_map(|r| &r.backends)
                .filter_map(|b| {
                    let s = index.get(&(b.namespace.as_str(), b.service.as_str()))?;
                    s.ports
                        .iter()
                        .find(|p| p.port == b.port)
                        .map(|p| p.protocol)
                })
                .peekable();
            let grpc =
                backends.peek().is_some() && backends.all(|p| p == flock_core::pod::Protocol::Grpc);
            if grpc {
                flock_core::pod::Protocol::Grpc
            } else {
                flock_core::pod::Protocol::Http
            }
        };
        let base = translate::Service {
            name: name.clone(),
            namespace: ns.clone(),
            ports: ports
                .iter()
                .map(|p| translate::ServicePort {
                    name: None,
                    port: *p,
                    protocol: protocol(*p),
                })
                .collect(),
            endpoints: Vec::new(),
            vips: vips_of(&ns, &name),
            routes: Vec::new(),
            pool: None,
        };
        let lookup = |ns: &str, name: &str| index.get(&(ns, name)).map(|s| &***s);
        let (resolved, found) = translate::policy::resolve(&rules, &base, &lookup);
        for p in &found {
            problems
                .entry(p.route.clone())
                .or_default()
                .push(p.message.clone());
        }
        let service = translate::Service {
            routes: resolved,
            ..base
        };
        let key = (ns, name);
        let service = match cache.entries.remove(&key) {
            Some(r) if *r.service == service => r.service,
            _ => Arc::new(service),
        };
        out.push(Arc::clone(&service));
        synthesized = true;
        kept.insert(
            key,
            Routed {
                base: Arc::clone(&service),
                rules,
                backends: Vec::new(),
                problems: found,
                service,
            },
        );
    }
    out.extend(subsets.iter().cloned());
    if synthesized || !subsets.is_empty() {
        out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
    cache.entries = kept;
    cache.status = routes
        .map()
        .iter()
        .map(|(key, sourced)| match &sourced.written {
            Ok(route) => {
                let found = problems.get(&route.id).cloned().unwrap_or_default();
                RouteStatus {
                    key: key.clone(),
                    origin: sourced.origin.clone(),
                    route: Some(route.id.clone()),
                    state: if found.is_empty() {
                        "Accepted"
                    } else {
                        "PartiallyInvalid"
                    },
                    problems: found,
                }
            }
            Err(e) => RouteStatus {
                key: key.clone(),
                origin: sourced.origin.clone(),
                route: None,
                state: "Refused",
                problems: vec![e.to_string()],
            },
        })
        .collect();
    Arc::new(out)
}

impl Agent {
    /// Puts the route `key` (or its removal) into the core and, when what is in force
    /// changed, publishes. Returns whether it changed.
    pub fn set_route(&self, key: &str, route: Option<SourcedRoute>) -> bool {
        let log = route.clone();
        let changed = self.core().set_route(key.to_string(), route);
        if changed {
            match log {
                None => tracing::info!(key, "route removed"),
                Some(SourcedRoute {
                    origin,
                    written: Ok(r),
                }) => tracing::info!(key, %origin, route = %r.id, "route in force"),
                Some(SourcedRoute {
                    origin,
                    written: Err(e),
                }) => tracing::warn!(
                    key, %origin, error = %e,
                    "route refused: its Service keeps its other routes (or the default route) until it is fixed"
                ),
            }
            let version = self.publish();
            tracing::debug!(key, version, "route change published");
            for s in self.route_status() {
                if s.state == "PartiallyInvalid" && s.key == key {
                    for p in &s.problems {
                        tracing::warn!(key, route = s.route.as_deref().unwrap_or(""), problem = %p, "route partly served");
                    }
                }
            }
        }
        changed
    }

    /// Every route's status as of the last publish, then the Services whose
    /// connection-pool annotations were refused ([`super::pools`]).
    pub fn route_status(&self) -> Vec<RouteStatus> {
        let state = super::lock(&self.publish);
        let mut all = state.routed.status.clone();
        all.extend(state.pools.status.iter().cloned());
        all
    }
}

/// What the directory says about the file `path`: its route (or refusal), or `None`
/// when there is no such file.
pub fn read_file(path: &Path) -> Option<SourcedRoute> {
    let origin = path.display().to_string();
    let refused = |reason: String| SourcedRoute {
        origin: origin.clone(),
        written: Err(flock_core::route::RouteError {
            field: "file".to_string(),
            reason,
        }),
    };
    // Checked before the open, and opened non-blocking: opening a FIFO named
    // `*.json` for reading would otherwise wait for a writer forever.
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(refused(format!("cannot stat: {e}"))),
        Ok(m) if !m.is_file() => return Some(refused("not a regular file".to_string())),
        Ok(_) => {}
    }
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(refused(format!("cannot open: {e}"))),
    };
    match file.metadata() {
        Ok(m) if !m.is_file() => return Some(refused("not a regular file".to_string())),
        Err(e) => return Some(refused(format!("cannot stat: {e}"))),
        Ok(_) => {}
    }
    let mut bytes = Vec::new();
    if let Err(e) = file
        .take(MAX_ROUTE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
    {
        return Some(refused(format!("cannot read: {e}")));
    }
    Some(SourcedRoute::read(origin, &bytes))
}

/// Re-reads every `*.json` file of `dir` into `agent`; a key whose file is gone is
/// removed. An unreadable directory keeps the routes in force.
pub fn resync_dir(agent: &Agent, dir: &Path) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot read the routes directory; keeping the routes in force");
            return;
        }
    };
    let mut seen = BTreeSet::new();
    for entry in entries.flatten().take(MAX_FILES) {
        let name = entry.file_name().to_string_lossy().into_owned();
        // `..data` and its timestamped directories (a ConfigMap volume), swap files.
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        let route = read_file(&dir.join(&name));
        if route.is_some() {
            seen.insert(name.clone());
        }
        agent.set_route(&name, route);
    }
    let gone: Vec<String> = agent
        .core()
        .routes()
        .map()
        .keys()
        // The directory's own keys only: kube mode's `HTTPRoute ns/name` keys are
        // the reflector's to remove.
        .filter(|k| k.ends_with(".json") && !seen.contains(*k))
        .cloned()
        .collect();
    for key in gone {
        agent.set_route(&key, None);
    }
}

/// Follows `dir` forever: every inotify event (a file written, renamed or deleted;
/// a ConfigMap's `..data` swap) and a timer every `resync` re-read the directory.
/// Spawn it; abort to stop.
pub async fn watch_dir(agent: Arc<Agent>, dir: PathBuf, resync: Duration) {
    use inotify::WatchMask;
    use tokio_stream::StreamExt as _;
    let arm = |dir: &Path| {
        crate::dirwatch::arm(
            dir,
            WatchMask::CLOSE_WRITE
                | WatchMask::MOVED_TO
                | WatchMask::MOVED_FROM
                | WatchMask::DELETE,
            "routes directory",
        )
    };
    let mut events = arm(&dir);
    resync_dir(&agent, &dir);
    let mut timer = tokio::time::interval(resync);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer.tick().await;
    loop {
        let event = async {
            match events.as_mut() {
                Some(stream) => stream.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = event => {
                if !crate::dirwatch::alive(ev.as_ref()) {
                    tracing::warn!(dir = %dir.display(), "routes directory watch lost; re-arming it");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    events = arm(&dir);
                }
                resync_dir(&agent, &dir);
            }
            _ = timer.tick() => {
                if events.is_none() {
                    events = arm(&dir);
                }
                resync_dir(&agent, &dir);
            }
        }
    }
}

/// Kube mode's source: puts the `HTTPRoute` objects of `kube`'s reflectors with a
/// Service parent into `agent` whenever they change ([`flock_kube::route`]: one route
/// or refusal per object; an object gone, or no longer the mesh's, is removed).
/// Nothing is put before the reflectors' first list. Routes of `--routes-dir` (keys
/// that are file names) are left alone. Returns when the reflectors stop.
pub async fn follow_kube(agent: Arc<Agent>, kube: Arc<crate::kube::KubePods>) {
    let mut view = kube.watch().view();
    let mut seen: Option<imbl::OrdMap<(String, String), Arc<flock_kube::route::HttpRoute>>> = None;
    let (status_tx, status_rx) = tokio::sync::watch::channel(Arc::new(StatusWrites::new()));
    let writer = tokio::spawn(write_statuses(
        kube.watch().client().clone(),
        status_rx,
        status_delay(&agent.config().node_name),
    ));
    let _writer = AbortOnDrop(writer);
    loop {
        let snapshot = view.borrow_and_update().clone();
        let unchanged = seen.as_ref().is_some_and(|s| s.ptr_eq(&snapshot.routes));
        if snapshot.synced && !unchanged {
            let now =
                flock_kube::route::routes_by_key(snapshot.routes.iter().map(|(k, v)| (k, &**v)));
            let keys: BTreeSet<&str> = now.iter().map(|(k, _)| k.as_str()).collect();
            let gone: Vec<String> = agent
                .core()
                .routes()
                .map()
                .keys()
                .filter(|k| k.starts_with("HTTPRoute ") && !keys.contains(k.as_str()))
                .cloned()
                .collect();
            for key in gone {
                agent.set_route(&key, None);
            }
            for (key, route) in now {
                agent.set_route(&key, Some(route));
            }
            seen = Some(snapshot.routes.clone());
        }
        // A route's status follows the routes and the services they resolve against
        // (a backend that gains endpoints is resolved at the next publish, with no
        // change of any route object): recomputed at each change and every
        // STATUS_RECHECK, written only where it differs from the object's.
        // (No route objects, nothing to compute: the publish lock is not taken.)
        if snapshot.synced && !(snapshot.routes.is_empty() && status_tx.borrow().is_empty()) {
            let writes = statuses_to_write(&agent, &snapshot.routes);
            status_tx.send_if_modified(|current| {
                if **current == writes {
                    return false;
                }
                *current = Arc::new(writes);
                true
            });
        }
        tokio::select! {
            changed = view.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(STATUS_RECHECK) => {}
        }
    }
}

/// How often the route statuses are recomputed without a change of the objects.
const STATUS_RECHECK: Duration = Duration::from_secs(2);

/// The route statuses to write: per object (namespace, name), the resourceVersion it
/// was computed from and its new `status`.
type StatusWrites = BTreeMap<(String, String), (String, serde_json::Value)>;

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The statuses the mesh's routes among `objects` need (see
/// [`flock_kube::route::desired_status`]): one per object whose status does not yet
/// say what this agent made of it.
fn statuses_to_write(
    agent: &Agent,
    objects: &imbl::OrdMap<(String, String), Arc<flock_kube::route::HttpRoute>>,
) -> StatusWrites {
    use flock_kube::route::{RouteOutcome, desired_status, key_of};
    let status: HashMap<String, RouteStatus> = agent
        .route_status()
        .into_iter()
        .map(|s| (s.key.clone(), s))
        .collect();
    let now = k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for ((ns, name), obj) in objects.iter() {
        // Not the mesh's (a Gateway's route, or one whose Service parents are gone):
        // only entries the mesh wrote before are removed.
        let outcome = match status.get(&key_of(ns, name)) {
            None => RouteOutcome::NotServed,
            Some(s) if s.state == "Refused" => RouteOutcome::Refused(s.problems.join("; ")),
            Some(s) => RouteOutcome::Accepted {
                problems: s.problems.clone(),
            },
        };
        let (Some(rv), Some(new)) = (
            obj.metadata.resource_version.clone(),
            desired_status(obj, &outcome, &now),
        ) else {
            continue;
        };
        out.insert((ns.clone(), name.clone()), (rv, new));
    }
    out
}

/// How long this node's agent waits before writing statuses: every node's agent
/// computes the same status from the same object, and the first write makes the
/// others' unnecessary (they find it written when their wait ends). A spread of up to
/// 2 s, fixed per node (a hash of its name), keeps the writes of a route change to a
/// few instead of one per node.
fn status_delay(node: &str) -> Duration {
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    Duration::from_millis(hash % 2000)
}

/// Writes each wanted status with a merge patch of the `status` subresource, the
/// object's resourceVersion as a precondition: a write over a newer object (another
/// node's status, a spec change, a deleted route) fails with 409 or 404 and is left to
/// the next computation, which sees that object. Any other failure (a ClusterRole
/// without the grant, say) is logged and that object's write at that version waits
/// [`STATUS_RETRY`], doubling up to [`STATUS_RETRY_MAX`], whatever else changes.
async fn write_statuses(
    client: kube::Client,
    mut wanted: tokio::sync::watch::Receiver<Arc<StatusWrites>>,
    delay: Duration,
) {
    use kube::api::{Api, Patch, PatchParams};
    // Per object: the resourceVersion whose write failed, when to try again, and the
    // wait after the next failure.
    let mut backoff: HashMap<(String, String), (String, tokio::time::Instant, Duration)> =
        HashMap::new();
    loop {
        let retry_at = backoff.values().map(|(_, at, _)| *at).min();
        tokio::select! {
            changed = wanted.changed() => if changed.is_err() { return },
            () = async {
                match retry_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        tokio::time::sleep(delay).await;
        let writes = Arc::clone(&wanted.borrow_and_update());
        backoff.retain(|key, (rv, ..)| writes.get(key).is_some_and(|(now, _)| now == rv));
        let now = tokio::time::Instant::now();
        for (key, (rv, status)) in writes.iter() {
            if backoff.get(key).is_some_and(|(_, at, _)| *at > now) {
                continue;
            }
            let (ns, name) = key;
            let api: Api<flock_kube::route::HttpRoute> = Api::namespaced(client.clone(), ns);
            let patch = if flock_core::reintroduced!("route-status-unconditional") {
                serde_json::json!({ "status": status })
            } else {
                serde_json::json!({
                    "metadata": {"resourceVersion": rv},
                    "status": status,
                })
            };
            match api
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    backoff.remove(key);
                    tracing::info!(namespace = %ns, route = %name, "HTTPRoute status written");
                }
                Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {
                    backoff.remove(key);
                    tracing::debug!(namespace = %ns, route = %name, code = e.code, "HTTPRoute changed or gone before its status was written; recomputed at the change");
                }
                Err(e) => {
                    let wait = backoff.get(key).map_or(STATUS_RETRY, |(_, _, next)| *next);
                    backoff.insert(
                        key.clone(),
                        (
                            rv.clone(),
                            tokio::time::Instant::now() + wait,
                            (wait * 2).min(STATUS_RETRY_MAX),
                        ),
                    );
                    tracing::warn!(namespace = %ns, route = %name, error = %e, retry_in = ?wait, "writing the HTTPRoute's status failed");
                }
            }
        }
    }
}

/// How long a failed status write waits before it is tried again (doubling).
const STATUS_RETRY: Duration = Duration::from_secs(10);
/// The longest wait between two tries of a failing status write.
const STATUS_RETRY_MAX: Duration = Duration::from_secs(300);
