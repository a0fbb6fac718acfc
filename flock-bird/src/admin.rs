//! The admin HTTP endpoint: `/healthz`, `/readyz`, `/metrics` (Prometheus text),
//! `/debug/pods`, `/debug/snapshot`, `/debug/registry` (JSON).
//!
//! A deliberately small HTTP/1.1 server (GET only, one request per connection,
//! request head ≤ 8 KiB, 5 s to send it): the admin port serves operators and
//! `flockctl`, not traffic.

use crate::agent::{Agent, ENVOY_GROUP, GRPC_GROUP};
use flock_xds::server::Server;
use serde_json::json;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MAX_HEAD: usize = 8 * 1024;

/// Serves the admin endpoint on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    agent: Arc<Agent>,
    xds: Server,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            _ = &mut shutdown => return,
            conn = listener.accept() => conn,
        };
        let Ok((stream, _)) = conn else { continue };
        let agent = Arc::clone(&agent);
        let xds = xds.clone();
        tokio::spawn(async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), handle(stream, &agent, &xds)).await;
        });
    }
}

async fn handle(
    mut stream: tokio::net::TcpStream,
    agent: &Agent,
    xds: &Server,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return respond(&mut stream, 431, "text/plain", "request head too large\n").await;
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return respond(&mut stream, 405, "text/plain", "only GET\n").await;
    }
    let path = target.split('?').next().unwrap_or("");
    let (status, kind, body) = route(path, agent, xds);
    respond(&mut stream, status, kind, &body).await
}

/// The response for `path`: (status, content type, body).
pub fn route(path: &str, agent: &Agent, xds: &Server) -> (u16, &'static str, String) {
    match path {
        "/healthz" => (200, "text/plain", "ok\n".into()),
        "/readyz" => match agent.not_ready() {
            None => (200, "text/plain", "ready\n".into()),
            Some(why) => (503, "text/plain", format!("not ready: {why}\n")),
        },
        "/metrics" => (200, "text/plain; version=0.0.4", metrics(agent, xds)),
        "/debug/pods" => (200, "application/json", debug_pods(agent)),
        "/debug/snapshot" => (200, "application/json", debug_snapshot(agent)),
        "/debug/registry" => (200, "application/json", debug_registry(agent)),
        _ => (
            404,
            "text/plain",
            "not found; try /healthz /readyz /metrics /debug/pods /debug/snapshot /debug/registry\n"
                .into(),
        ),
    }
}

async fn respond(
    stream: &mut tokio::net::TcpStream,
    status: u16,
    kind: &str,
    body: &str,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

fn metrics(agent: &Agent, xds: &Server) -> String {
    let m = &agent.metrics;
    let mut out = String::new();
    let mut put = |name: &str, kind: &str, help: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    };
    let pods = agent.pods();
    put(
        "flock_agent_pods",
        "gauge",
        "Meshed pods on this node.",
        pods.len() as u64,
    );
    put(
        "flock_agent_ready",
        "gauge",
        "1 when /readyz is ready.",
        u64::from(agent.not_ready().is_none()),
    );
    put(
        "flock_agent_pods_added_total",
        "counter",
        "AddPod requests that meshed a pod.",
        m.pods_added.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_pods_removed_total",
        "counter",
        "RemovePod requests that removed a pod.",
        m.pods_removed.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_pods_ignored_total",
        "counter",
        "CNI requests ignored (not meshed, unknown pod).",
        m.pods_ignored.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_pod_errors_total",
        "counter",
        "CNI requests that failed.",
        m.pod_errors.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_publishes_total",
        "counter",
        "xDS snapshots published for Envoy.",
        m.publishes.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_probes_total",
        "counter",
        "Liveness probes run.",
        m.probes.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_probe_failures_total",
        "counter",
        "Liveness probes that failed.",
        m.probe_failures.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_health_changes_total",
        "counter",
        "Pod health transitions.",
        m.health_changes.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_guard_undos_total",
        "counter",
        "Late re-registrations undone because the pod was removed meanwhile.",
        m.guard_undos.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_gc_sweeps_total",
        "counter",
        "Orphan GC sweeps.",
        m.gc_sweeps.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_gc_removed_pods_total",
        "counter",
        "Stored pods the GC removed.",
        m.gc_removed_store.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_gc_removed_endpoints_total",
        "counter",
        "Orphan registry endpoints the GC removed.",
        m.gc_removed_endpoints.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_gc_breaker_trips_total",
        "counter",
        "GC sweeps on which the breaker refused removals.",
        m.gc_breaker_trips.load(Ordering::Relaxed),
    );
    put(
        "flock_agent_registry_errors_total",
        "counter",
        "Registry operations that failed.",
        m.registry_errors.load(Ordering::Relaxed),
    );
    let view = agent.registry().view().borrow().clone();
    put(
        "flock_agent_registry_endpoints",
        "gauge",
        "Endpoints in the registry view (all nodes).",
        view.endpoints.len() as u64,
    );
    put(
        "flock_agent_registry_synced",
        "gauge",
        "1 while the registry view is synced.",
        u64::from(view.synced),
    );
    if let Some(s) = agent.cache().snapshot(ENVOY_GROUP) {
        put(
            "flock_agent_xds_version",
            "gauge",
            "Version of the Envoy group's snapshot.",
            s.version(),
        );
    }
    out.push_str(&xds.metrics().render_prometheus());
    out
}

fn debug_pods(agent: &Agent) -> String {
    let health = agent.health();
    let pods: Vec<_> = agent
        .pods()
        .into_values()
        .map(|p| {
            json!({
                "pod": p.pod_ref(),
                "container_id": p.key.container_id,
                "ifname": p.key.ifname,
                "uid": p.uid,
                "service": p.service,
                "ips": p.ips,
                "netns": p.netns,
                "ports": p.ports,
                "health": format!("{:?}", health.get(&p.key).copied().unwrap_or(flock_core::lifecycle::Health::Unknown)),
                "added_at_ms": p.added_at_ms,
            })
        })
        .collect();
    serde_json::to_string_pretty(&json!({ "pods": pods })).unwrap_or_default()
}

fn debug_snapshot(agent: &Agent) -> String {
    let mut groups = serde_json::Map::new();
    for group in [ENVOY_GROUP, GRPC_GROUP] {
        let Some(snap) = agent.cache().snapshot(group) else {
            continue;
        };
        let mut types = serde_json::Map::new();
        for t in snap.state().type_urls() {
            let names: Vec<&str> = snap.state().iter_type(t).map(|(n, _)| &**n).collect();
            types.insert(flock_xds::types::short_name(t).to_string(), json!(names));
        }
        groups.insert(
            group.to_string(),
            json!({ "version": snap.version(), "resources": types }),
        );
    }
    serde_json::to_string_pretty(&json!({ "groups": groups })).unwrap_or_default()
}

fn debug_registry(agent: &Agent) -> String {
    let view = agent.registry().view().borrow().clone();
    serde_json::to_string_pretty(&json!({
        "backend": agent.registry().describe(),
        "synced": view.synced,
        "revision": view.revision,
        "generation": view.generation,
        "endpoints": view.endpoints,
    }))
    .unwrap_or_default()
}
