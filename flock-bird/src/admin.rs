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
            break;
        }
    }
    match parse_head(&head) {
        Ok(path) => {
            let (status, kind, body) = route(path, agent, xds);
            respond(&mut stream, status, kind, &body).await
        }
        Err(e) => respond(&mut stream, e.status(), "text/plain", &format!("{e}\n")).await,
    }
}

/// Why a request head was refused, with the HTTP status it gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// More than [`MAX_HEAD`] bytes before the blank line.
    #[error("request head too large (limit {MAX_HEAD} bytes)")]
    TooLarge,
    /// The request line is not `METHOD SP /path SP HTTP/1.x`.
    #[error("malformed request line: {0}")]
    Malformed(&'static str),
    /// Anything but GET.
    #[error("only GET is served here, not {0}")]
    Method(String),
}

impl HeadError {
    /// The HTTP status for this refusal.
    pub fn status(&self) -> u16 {
        match self {
            HeadError::TooLarge => 431,
            HeadError::Malformed(_) => 400,
            HeadError::Method(_) => 405,
        }
    }
}

/// The size limit of a request head (request line and headers).
pub const MAX_HEAD: usize = 8 * 1024;
/// The longest method name echoed back in an error.
const MAX_METHOD_ECHO: usize = 16;

/// Parses an admin request head (everything read up to the blank line, at most
/// [`MAX_HEAD`] bytes of it) into the requested path, without its query.
///
/// Only the request line matters: headers are not read (no body, one request per
/// connection). The target must be origin-form (`/...`, RFC 9112 §3.2.1).
pub fn parse_head(head: &[u8]) -> Result<&str, HeadError> {
    if head.len() > MAX_HEAD {
        return Err(HeadError::TooLarge);
    }
    let line_end = head
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or(HeadError::Malformed("no CRLF after the request line"))?;
    let line =
        std::str::from_utf8(&head[..line_end]).map_err(|_| HeadError::Malformed("not UTF-8"))?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::Malformed("expected METHOD /path HTTP/1.1"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(HeadError::Malformed("expected HTTP/1.x"));
    }
    if method != "GET" {
        // The method came from the network: echo a bounded, printable prefix only.
        let shown: String = method
            .chars()
            .take(MAX_METHOD_ECHO)
            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
            .collect();
        return Err(HeadError::Method(shown));
    }
    if !target.starts_with('/') {
        return Err(HeadError::Malformed(
            "the target must be a path starting with /",
        ));
    }
    Ok(target.split('?').next().unwrap_or(target))
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
        400 => "Bad Request",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_get_gives_its_path_without_the_query() {
        assert_eq!(
            parse_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Ok("/metrics")
        );
        assert_eq!(
            parse_head(b"GET /debug/pods?x=1 HTTP/1.0\r\n\r\n"),
            Ok("/debug/pods")
        );
    }

    #[test]
    fn refusals_carry_their_status() {
        let cases: [(&[u8], u16); 7] = [
            (b"POST /healthz HTTP/1.1\r\n\r\n", 405),
            (b"GET /healthz\r\n\r\n", 400),
            (b"GET  /healthz HTTP/1.1\r\n\r\n", 400),
            (b"GET http://x/healthz HTTP/1.1\r\n\r\n", 400),
            (b"GET /healthz SPDY/3\r\n\r\n", 400),
            (b"GET /\xff HTTP/1.1\r\n\r\n", 400),
            (b"GET /healthz HTTP/1.1", 400),
        ];
        for (head, status) in cases {
            let e = parse_head(head).unwrap_err();
            assert_eq!(
                e.status(),
                status,
                "{:?}: {e}",
                String::from_utf8_lossy(head)
            );
        }
        let big = vec![b'a'; MAX_HEAD + 1];
        assert_eq!(parse_head(&big), Err(HeadError::TooLarge));
    }

    #[test]
    fn an_echoed_method_is_bounded_and_printable() {
        let mut head = vec![b'X'; 100];
        head.extend_from_slice(b"\x07 / HTTP/1.1\r\n\r\n");
        let HeadError::Method(m) = parse_head(&head).unwrap_err() else {
            panic!("a method error")
        };
        assert_eq!(m, "X".repeat(MAX_METHOD_ECHO));
        let e = parse_head(b"G\x07T / HTTP/1.1\r\n\r\n").unwrap_err();
        assert_eq!(e, HeadError::Method("G?T".into()));
    }
}
