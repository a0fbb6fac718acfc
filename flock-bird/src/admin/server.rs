//! The admin endpoint's HTTP/1.1 server, on hyper.
//!
//! The admin port serves operators, probes and `flockctl`, not traffic, so it is
//! small on purpose: GET only, one request per connection, a request head of at most
//! [`MAX_HEAD`] bytes sent within [`ServeOptions::header_timeout`], each connection
//! closed after [`ServeOptions::connection_timeout`], and at most
//! [`ServeOptions::max_connections`] at once (further clients wait in the listen
//! backlog). An accept error backs off (5 ms doubling to 1 s) instead of retrying at
//! once: errors like `EMFILE` persist until some descriptor is closed, and an
//! immediate retry would spin a core doing nothing else. Both bounds are tested in
//! `tests/admin_limits.rs`.

use super::api::{
    Health, Pod, PodPolicy, Pods, Policies, PolicyEntry, ProxyStatus, RegistryView, Route,
    Snapshot, SnapshotGroup, Status,
};
use super::route;
use crate::agent::{Agent, ENVOY_GROUP, GRPC_GROUP};
use flock_core::backoff::Backoff;
use flock_telemetry::metrics::{Sampled, Samples};
use flock_telemetry::prometheus_client::registry::Registry;
use flock_xds::server::Server;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Semaphore;

/// The size limit of a request head (request line and headers); hyper answers 431
/// beyond it.
pub const MAX_HEAD: usize = 8 * 1024;

/// The first and the longest pause after an accept error.
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(5), Duration::from_secs(1));

/// Limits of the admin server.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Connections served at once (default [`DEFAULT_MAX_CONNECTIONS`]); the next is
    /// accepted when one ends, so a flood of idle clients costs the agent at most this
    /// many tasks and descriptors, and the rest wait in the kernel's listen backlog.
    pub max_connections: usize,
    /// Time a client has to send its request head.
    pub header_timeout: Duration,
    /// Time a connection may live, request and response together.
    pub connection_timeout: Duration,
    /// The startup-taint removal (`--remove-startup-taint`), whose state `/readyz`
    /// adds as a second line until the taint is gone.
    pub startup_taint: Option<Arc<crate::node_ready::NodeReadiness>>,
}

/// The default of [`ServeOptions::max_connections`]: far more than the probes, a
/// Prometheus scraper and a few `flockctl`s need at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(10),
            startup_taint: None,
        }
    }
}

/// What the admin endpoint shows: the agent ([`AgentViews`]) or a test double.
pub trait Views: Send + Sync + 'static {
    /// `/debug/status` and `/readyz`.
    fn status(&self) -> Status;
    /// A second `/readyz` line: why the node's startup taint is still there, if it is
    /// (`--remove-startup-taint`). Not part of readiness: the agent serves before its
    /// node is untainted (Envoy must connect to it for the taint to go).
    fn startup_taint(&self) -> Option<String> {
        None
    }
    /// Another `/readyz` line: why the registry does not reflect this node's pods now,
    /// if it does not. Not part of readiness either: pods are meshed and served
    /// locally while the registry is out of sync, and the registry sync catches up
    /// when it is back (docs/races.md, "The registry off the CNI path").
    fn registry_sync(&self) -> Option<String> {
        None
    }
    /// More `/readyz` lines: xDS clients that reject their config (NACK) or leave a
    /// response unanswered too long. Not part of readiness either: a proxy's verdict
    /// on a config must not stop pods from starting ([`crate::xds_answers`]).
    fn xds_answers(&self) -> Option<String> {
        None
    }
    /// `/debug/pods`.
    fn pods(&self) -> Pods;
    /// `/debug/snapshot`.
    fn snapshot(&self) -> Snapshot;
    /// `/debug/registry`.
    fn registry(&self) -> RegistryView;
    /// `/debug/policies`.
    fn policies(&self) -> Policies {
        Policies::default()
    }
    /// `/debug/proxy-status`.
    fn proxy_status(&self) -> ProxyStatus {
        ProxyStatus::default()
    }
    /// `/debug/routes`.
    fn routes(&self) -> flock_admin::api::Routes {
        flock_admin::api::Routes::default()
    }
    /// `/metrics`, Prometheus text.
    fn metrics(&self) -> String;
}

/// A source of connections: a TCP listener, or a test double.
pub trait Accept: Send + 'static {
    /// One connection.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Waits for the next connection.
    fn accept(&mut self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;

    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Serves the agent's admin endpoint on `listener` with the default
/// [`ServeOptions`] until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    agent: Arc<Agent>,
    xds: Server,
    shutdown: impl Future<Output = ()>,
) {
    serve_agent(listener, agent, xds, ServeOptions::default(), shutdown).await;
}

/// Serves the agent's admin endpoint on `listener` with `opts` (an operator's
/// `--admin-max-connections`, say) until `shutdown` resolves.
pub async fn serve_agent(
    listener: tokio::net::TcpListener,
    agent: Arc<Agent>,
    xds: Server,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()>,
) {
    let mut views = AgentViews::new(agent, &xds);
    views.startup_taint = opts.startup_taint.clone();
    serve_with(listener, Arc::new(views), opts, shutdown).await;
}

/// Serves `views` on connections from `acceptor` until `shutdown` resolves.
pub async fn serve_with<A: Accept, V: Views>(
    mut acceptor: A,
    views: Arc<V>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let slots = Arc::new(Semaphore::new(opts.max_connections.max(1)));
    let mut backoff = Backoff::new(ACCEPT_BACKOFF.0, ACCEPT_BACKOFF.1);
    // Connections end with the server: returning drops the set, which aborts them.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        // A slot first: at the cap, connections wait in the kernel's backlog rather
        // than in a task each.
        let slot = tokio::select! {
            _ = &mut shutdown => return,
            slot = Arc::clone(&slots).acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let io = tokio::select! {
            _ = &mut shutdown => return,
            conn = acceptor.accept() => conn,
        };
        let io = match io {
            Ok(io) => {
                backoff.reset();
                io
            }
            Err(e) => {
                // One listener, no herd to spread: the ceiling is the pause (jitter 1).
                let pause = backoff.next_delay(1.0);
                let pause = if flock_core::reintroduced!("admin-accept-spin") {
                    Duration::ZERO
                } else {
                    pause
                };
                tracing::warn!(error = %e, ?pause, "admin endpoint: accept failed");
                tokio::select! {
                    _ = &mut shutdown => return,
                    _ = tokio::time::sleep(pause) => continue,
                }
            }
        };
        let views = Arc::clone(&views);
        let opts = opts.clone();
        connections.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req| {
                let views = Arc::clone(&views);
                async move { Ok::<_, Infallible>(respond(&*views, &req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(opts.header_timeout)
                .keep_alive(false)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(io), service);
            match tokio::time::timeout(opts.connection_timeout, conn).await {
                Ok(Err(e)) => tracing::debug!(error = %e, "admin connection"),
                Err(_) => tracing::debug!("admin connection timed out"),
                Ok(Ok(())) => {}
            }
        });
    }
}

/// The response to one request.
fn respond<V: Views + ?Sized>(views: &V, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let route = match route(req.method().as_str(), req.uri().path()) {
        Ok(r) => r,
        Err(refusal) => {
            let status = StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::BAD_REQUEST);
            let mut resp = text(status, format!("{refusal}\n"));
            if status == StatusCode::METHOD_NOT_ALLOWED {
                resp.headers_mut()
                    .insert(ALLOW, hyper::header::HeaderValue::from_static("GET"));
            }
            return resp;
        }
    };
    match route {
        Route::Healthz => text(StatusCode::OK, "ok\n".into()),
        Route::Readyz => {
            let s = views.status();
            let status = if s.ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let mut body = s.readiness_line();
            if let Some(taint) = views.startup_taint() {
                body.push_str(&taint);
                body.push('\n');
            }
            if let Some(sync) = views.registry_sync() {
                body.push_str(&sync);
                body.push('\n');
            }
            if let Some(xds) = views.xds_answers() {
                body.push_str(&xds);
                body.push('\n');
            }
            // Not part of readiness either: a refused policy denies the calls it
            // governs (fail closed), and the agent keeps serving everything else.
            for refused in &s.policies_refused {
                body.push_str(&format!("authorization policy refused: {refused}\n"));
            }
            text(status, body)
        }
        Route::Metrics => body(
            StatusCode::OK,
            flock_telemetry::metrics::CONTENT_TYPE,
            views.metrics().into(),
        ),
        Route::Status => json(&views.status()),
        Route::Pods => json(&views.pods()),
        Route::Snapshot => json(&views.snapshot()),
        Route::Registry => json(&views.registry()),
        Route::Policies => json(&views.policies()),
        Route::ProxyStatus => json(&views.proxy_status()),
        Route::Routes => json(&views.routes()),
    }
}

fn body(status: StatusCode, kind: &'static str, bytes: Bytes) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(bytes));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(kind));
    resp
}

fn text(status: StatusCode, s: String) -> Response<Full<Bytes>> {
    body(status, "text/plain; charset=utf-8", s.into())
}

fn json<T: serde::Serialize>(doc: &T) -> Response<Full<Bytes>> {
    match serde_json::to_vec_pretty(doc) {
        Ok(v) => body(StatusCode::OK, "application/json", v.into()),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the document: {e}\n"),
        ),
    }
}

/// The agent's views, and its metrics with the xDS server's in one registry.
pub struct AgentViews {
    agent: Arc<Agent>,
    registry: Registry,
    startup_taint: Option<Arc<crate::node_ready::NodeReadiness>>,
}

impl std::fmt::Debug for AgentViews {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentViews").finish_non_exhaustive()
    }
}

impl AgentViews {
    /// Views of `agent`; `/metrics` also renders `xds`'s counters.
    pub fn new(agent: Arc<Agent>, xds: &Server) -> Self {
        let mut registry = Registry::default();
        let read = Arc::clone(&agent);
        registry.register_collector(Box::new(Sampled::new(move |s: &mut Samples| {
            sample_agent(&read, s)
        })));
        xds.metrics().register(&mut registry);
        agent.denials().register(&mut registry);
        if let Some(logs) = agent.access_logs() {
            logs.register(&mut registry);
        }
        if let Some(r) = agent.registry().rejections() {
            registry.register_collector(Box::new(crate::registry::RejectionsCollector(r)));
        }
        Self {
            agent,
            registry,
            startup_taint: None,
        }
    }
}

/// The agent's metrics, read at scrape time from its counters and state.
fn sample_agent(agent: &Agent, s: &mut Samples) {
    let m = &agent.metrics;
    s.gauge(
        "flock_agent_pods",
        "Meshed pods on this node",
        agent.pod_count() as u64,
    );
    s.gauge(
        "flock_agent_ready",
        "1 when /readyz is ready",
        u64::from(agent.not_ready().is_none()),
    );
    s.gauge(
        "flock_agent_xds_streams_slow_ack",
        "xDS streams with a response unanswered (no ACK or NACK) for over 5 s",
        agent.xds_answers().slow(std::time::Instant::now()) as u64,
    );
    // Every agent counter: (metric name, help, the atomic it reads).
    let counters: [(&'static str, &'static str, &AtomicU64); 14] = [
        (
            "flock_agent_pods_added",
            "AddPod requests that meshed a pod",
            &m.pods_added,
        ),
        (
            "flock_agent_pods_removed",
            "RemovePod requests that removed a pod",
            &m.pods_removed,
        ),
        (
            "flock_agent_pods_ignored",
            "CNI requests ignored (not meshed, unknown pod)",
            &m.pods_ignored,
        ),
        (
            "flock_agent_pod_errors",
            "CNI requests that failed",
            &m.pod_errors,
        ),
        (
            "flock_agent_publishes",
            "xDS snapshots published for Envoy",
            &m.publishes,
        ),
        ("flock_agent_probes", "Liveness probes run", &m.probes),
        (
            "flock_agent_probe_failures",
            "Liveness probes that failed",
            &m.probe_failures,
        ),
        (
            "flock_agent_health_changes",
            "Pod health transitions",
            &m.health_changes,
        ),
        (
            "flock_agent_guard_undos",
            "Late re-registrations undone because the pod was removed meanwhile",
            &m.guard_undos,
        ),
        ("flock_agent_gc_sweeps", "Orphan GC sweeps", &m.gc_sweeps),
        (
            "flock_agent_gc_removed_pods",
            "Stored pods the GC removed",
            &m.gc_removed_store,
        ),
        (
            "flock_agent_gc_removed_endpoints",
            "Orphan registry endpoints the GC removed",
            &m.gc_removed_endpoints,
        ),
        (
            "flock_agent_gc_breaker_trips",
            "GC sweeps on which the breaker refused removals",
            &m.gc_breaker_trips,
        ),
        (
            "flock_agent_registry_errors",
            "Registry operations that failed",
            &m.registry_errors,
        ),
    ];
    for (name, help, value) in counters {
        s.counter(name, help, value.load(Ordering::Relaxed));
    }
    let capture: [(&'static str, &'static str, &AtomicU64); 3] = [
        (
            "flock_capture_applied",
            "Capture tables installed in pods' network namespaces by ADD",
            &m.capture.applied,
        ),
        (
            "flock_capture_errors",
            "Capture operations that failed (apply, remove, start-up repair) and CNI CHECKs that found a pod's capture table missing or drifted",
            &m.capture.errors,
        ),
        (
            "flock_capture_repairs",
            "Capture tables re-applied at start-up because they were missing or drifted",
            &m.capture.repairs,
        ),
    ];
    for (name, help, value) in capture {
        s.counter(name, help, value.load(Ordering::Relaxed));
    }
    let view = agent.registry().view().borrow().clone();
    s.gauge(
        "flock_agent_registry_endpoints",
        "Endpoints in the registry view (all nodes)",
        view.endpoints.len() as u64,
    );
    s.gauge(
        "flock_agent_registry_synced",
        "1 while the registry view is synced",
        u64::from(view.synced),
    );
    s.gauge(
        "flock_registry_in_sync",
        "1 while the registry holds exactly this node's wanted endpoints (the registry sync's last round succeeded and the view is connected)",
        u64::from(agent.registry_out_of_sync().is_none()),
    );
    s.gauge(
        "flock_registry_pending_ops",
        "Registry writes the registry sync has left to do",
        m.registry_pending_ops.load(Ordering::Relaxed),
    );
    let out_of_sync_for = match agent.registry_out_of_sync() {
        None => Duration::ZERO,
        Some(_) => agent.registry_sync_status().since_in_sync(),
    };
    s.gauge(
        "flock_registry_out_of_sync_ms",
        "0 while the registry is in sync; else milliseconds since it last held exactly this node's wanted endpoints",
        u64::try_from(out_of_sync_for.as_millis()).unwrap_or(u64::MAX),
    );
    s.counter(
        "flock_registry_sync_errors",
        "Registry sync rounds that failed (each is retried with backoff)",
        m.registry_sync_errors.load(Ordering::Relaxed),
    );
    s.counter(
        "flock_agent_adds_undone",
        "ADDs undone because the plugin went away before their answer (the runtime saw them fail)",
        m.adds_undone.load(Ordering::Relaxed),
    );
    if let Some(provider) = agent.identity() {
        s.gauge(
            "flock_identity_subscriptions",
            "Pods with an identity subscription (one per meshed pod: more is a leak)",
            provider.view().borrow().subscriptions.len() as u64,
        );
    }
    if let Some(issued) = agent.identity().and_then(|p| p.svids_issued()) {
        s.counter(
            "flock_identity_svids_issued",
            "SVIDs the built-in CA signed: first issuances, rotations (one per identity per half-life of monotonic time) and re-issues under a new issuer",
            issued,
        );
    }
    if let Some(r) = agent.repairer() {
        s.gauge(
            "flock_agent_unmeshed_pods",
            "Running pods of this node that should be meshed and have no record in the store (started before the CNI plugin was in the chain): their traffic bypasses Envoy",
            r.unmeshed(),
        );
        s.counter(
            "flock_agent_unmeshed_pods_deleted",
            "Unmeshed pods deleted so their controllers recreate them meshed (--repair delete)",
            r.deleted(),
        );
    }
    if let Some(snap) = agent.cache().snapshot(ENVOY_GROUP) {
        s.gauge(
            "flock_agent_xds_version",
            "Version of the Envoy group's snapshot",
            snap.version(),
        );
    }
}

/// One stream of the xDS server's proxy status as the admin document shows it.
fn proxy_stream(
    (id, s): (
        &flock_xds::callbacks::StreamId,
        &flock_xds::sync_status::StreamSync,
    ),
) -> flock_admin::api::ProxyStream {
    use flock_admin::api::{SyncState as Wire, TypeStatus};
    use flock_xds::callbacks::StreamKind;
    use flock_xds::sync_status::SyncState;
    use flock_xds::types::short_name;
    let service = match s.kind {
        StreamKind::SotwAds => "ads-sotw".to_string(),
        StreamKind::DeltaAds => "ads-delta".to_string(),
        StreamKind::Sotw(url) => format!("{}-sotw", short_name(url)),
        StreamKind::Delta(url) => format!("{}-delta", short_name(url)),
    };
    flock_admin::api::ProxyStream {
        stream: id.0,
        node: s.node.id.clone(),
        cluster: s.node.cluster.clone(),
        user_agent: s.node.user_agent_name.clone(),
        service,
        types: s
            .types
            .iter()
            .map(|(name, t)| TypeStatus {
                type_name: name.to_string(),
                state: match t.state() {
                    SyncState::Synced => Wire::Synced,
                    SyncState::Stale => Wire::Stale,
                    SyncState::Nacked => Wire::Nacked,
                    SyncState::NotSent => Wire::NotSent,
                },
                sent: t.sent.map(|(v, _)| v),
                acked: t.acked,
                rejected: t.rejected.as_ref().map(|r| r.version),
                error: t.rejected.as_ref().map(|r| r.error.clone()),
            })
            .collect(),
    }
}

impl Views for AgentViews {
    fn startup_taint(&self) -> Option<String> {
        self.startup_taint.as_ref().and_then(|t| t.describe())
    }

    fn registry_sync(&self) -> Option<String> {
        self.agent.registry_out_of_sync()
    }

    fn xds_answers(&self) -> Option<String> {
        self.agent.xds_answers().describe(std::time::Instant::now())
    }

    fn status(&self) -> Status {
        let agent = &self.agent;
        let not_ready = agent.not_ready();
        Status {
            ready: not_ready.is_none(),
            not_ready,
            node: agent.config().node_name.clone(),
            pods: agent.pod_count(),
            registry: agent.registry().describe(),
            registry_synced: agent.registry().view().borrow().synced,
            xds_version: agent.cache().snapshot(ENVOY_GROUP).map(|s| s.version()),
            policies_refused: agent
                .policies()
                .into_iter()
                .filter_map(|(target, p)| {
                    p.written
                        .as_ref()
                        .err()
                        .map(|e| format!("{target} ({}): {e}", p.origin))
                })
                .collect(),
        }
    }

    fn routes(&self) -> flock_admin::api::Routes {
        flock_admin::api::Routes {
            routes: self
                .agent
                .route_status()
                .into_iter()
                .map(|r| flock_admin::api::RouteEntry {
                    key: r.key,
                    origin: r.origin,
                    route: r.route,
                    state: r.state.to_string(),
                    problems: r.problems,
                })
                .collect(),
        }
    }

    fn proxy_status(&self) -> ProxyStatus {
        ProxyStatus {
            envoy_version: self
                .agent
                .cache()
                .snapshot(ENVOY_GROUP)
                .map(|s| s.version()),
            streams: self
                .agent
                .xds_answers()
                .sync()
                .with_streams(|streams| streams.iter().map(proxy_stream).collect()),
        }
    }

    fn policies(&self) -> Policies {
        Policies {
            policies: self
                .agent
                .policies()
                .into_iter()
                .map(|(target, p)| PolicyEntry {
                    target,
                    origin: p.origin.clone(),
                    spec: p.written.as_ref().ok().cloned(),
                    error: p.written.as_ref().err().map(|e| e.to_string()),
                })
                .collect(),
            pods: self
                .agent
                .pods()
                .into_values()
                .map(|p| PodPolicy {
                    pod: p.pod_ref(),
                    namespace: p.namespace.clone(),
                    service: p.service.clone(),
                    annotation: p.authz.clone(),
                })
                .collect(),
        }
    }

    fn pods(&self) -> Pods {
        let health = self.agent.health();
        let pods = self
            .agent
            .pods()
            .into_values()
            .map(|p| Pod {
                pod: p.pod_ref(),
                // No decision yet (not tracked): unknown.
                health: health.get(&p.key).copied().unwrap_or(Health::Unknown),
                container_id: p.key.container_id,
                ifname: p.key.ifname,
                uid: p.uid,
                service: p.service,
                service_account: p.service_account,
                ips: p.ips,
                netns: p.netns,
                ports: p.ports,
                added_at_ms: p.added_at_ms,
            })
            .collect();
        Pods { pods }
    }

    fn snapshot(&self) -> Snapshot {
        let mut out = Snapshot::default();
        for group in [ENVOY_GROUP, GRPC_GROUP] {
            let Some(snap) = self.agent.cache().snapshot(group) else {
                continue;
            };
            let state = snap.state();
            let resources = state
                .type_urls()
                .map(|t| {
                    let names = state.iter_type(t).map(|(n, _)| n.to_string()).collect();
                    (flock_xds::types::short_name(t).to_string(), names)
                })
                .collect();
            out.groups.insert(
                group.to_string(),
                SnapshotGroup {
                    version: snap.version(),
                    resources,
                },
            );
        }
        out
    }

    fn registry(&self) -> RegistryView {
        let view = self.agent.registry().view().borrow().clone();
        RegistryView {
            backend: self.agent.registry().describe(),
            synced: view.synced,
            revision: view.revision,
            generation: view.generation,
            endpoints: view
                .endpoints
                .iter()
                .map(|(k, e)| (k.clone(), (**e).clone()))
                .collect(),
        }
    }

    fn metrics(&self) -> String {
        flock_telemetry::metrics::render(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::super::client::{AdminClient, ClientError};
    use super::*;
    use std::sync::atomic::AtomicBool;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};

    #[derive(Default)]
    struct Fake {
        ready: AtomicBool,
    }

    impl Views for Fake {
        fn status(&self) -> Status {
            let ready = self.ready.load(Ordering::Relaxed);
            Status {
                ready,
                not_ready: (!ready).then(|| "registry memory not synced".into()),
                node: "n1".into(),
                pods: 0,
                registry: "memory".into(),
                registry_synced: ready,
                xds_version: None,
                policies_refused: Vec::new(),
            }
        }
        fn pods(&self) -> Pods {
            Pods { pods: vec![] }
        }
        fn snapshot(&self) -> Snapshot {
            Snapshot::default()
        }
        fn registry(&self) -> RegistryView {
            RegistryView {
                backend: "memory".into(),
                synced: true,
                revision: 1,
                generation: 1,
                endpoints: Default::default(),
            }
        }
        fn metrics(&self) -> String {
            "# TYPE x gauge\nx 1\n".into()
        }
    }

    /// Serves `views` on an ephemeral port; the server stops when the returned sender
    /// is dropped.
    async fn start(
        views: Arc<Fake>,
        opts: ServeOptions,
    ) -> (String, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_with(listener, views, opts, async {
            let _ = rx.await;
        }));
        (addr, tx)
    }

    /// Sends raw bytes, returns the whole response.
    async fn raw(addr: &str, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn routes_refusals_and_documents_over_the_wire() {
        let views = Arc::new(Fake::default());
        let (addr, _stop) = start(Arc::clone(&views), ServeOptions::default()).await;

        let r = raw(&addr, b"POST /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 405 "), "{r}");
        assert!(r.to_ascii_lowercase().contains("allow: get\r\n"), "{r}");
        assert!(r.ends_with("only GET is served here, not POST\n"), "{r}");
        let r = raw(&addr, b"GET /nope?x=1 HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 404 "), "{r}");
        assert!(r.contains("try /healthz /readyz /metrics"), "{r}");
        let r = raw(&addr, b"GET /healthz?verbose HTTP/1.0\r\n\r\n").await;
        assert!(
            r.starts_with("HTTP/1.0 200 ") && r.ends_with("\r\n\r\nok\n"),
            "{r}"
        );
        let r = raw(&addr, b"GET /healthz SPDY/3\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
        let mut big = b"GET /healthz HTTP/1.1\r\nX: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_HEAD));
        big.extend_from_slice(b"\r\n\r\n");
        let r = raw(&addr, &big).await;
        assert!(r.starts_with("HTTP/1.1 431 "), "{r}");

        let client = AdminClient::new(addr.clone());
        let r = client.get(Route::Readyz).await.unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(&r.body[..], b"not ready: registry memory not synced\n");
        views.ready.store(true, Ordering::Relaxed);
        let r = client.get(Route::Readyz).await.unwrap();
        assert_eq!((r.status, &r.body[..]), (200, &b"ready\n"[..]));
        assert_eq!(client.status().await.unwrap(), views.status());
        assert_eq!(client.pods().await.unwrap(), views.pods());
        assert_eq!(client.registry().await.unwrap(), views.registry());
        assert_eq!(client.metrics().await.unwrap(), views.metrics());
    }

    #[tokio::test]
    async fn client_errors_say_what_failed() {
        let views = Arc::new(Fake::default());
        let (addr, _stop) = start(views, ServeOptions::default()).await;
        // A body larger than the client's limit.
        let e = AdminClient::new(addr.clone())
            .max_body(8)
            .registry()
            .await
            .unwrap_err();
        assert!(matches!(e, ClientError::TooLarge { limit: 8, .. }), "{e}");
        // Nothing listening.
        let free = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone = free.local_addr().unwrap().to_string();
        drop(free);
        let e = AdminClient::new(gone).status().await.unwrap_err();
        assert!(matches!(e, ClientError::Connect { .. }), "{e}");
        assert!(e.to_string().contains("is flock-agent running?"), "{e}");
        // An address that cannot be sent as a Host header.
        let e = AdminClient::new("x\n:1").status().await.unwrap_err();
        assert!(matches!(e, ClientError::Address { .. }), "{e}");
        // A 200 whose body is not the document asked for.
        let e = AdminClient::new(addr)
            .document::<Status>(Route::Healthz)
            .await
            .unwrap_err();
        assert!(matches!(e, ClientError::Decode { .. }), "{e}");
    }
}
