//! Liveness probes from inside a pod's network namespace: TCP connect for TCP and gRPC
//! ports, an HTTP/1.1 `GET /` for HTTP ports (any status below 500 is alive). Ports
//! are probed on loopback, a proxyless gRPC server's on the pod's address.
//!
//! `setns` changes the namespace of the calling *thread*, so every probe runs on a
//! fresh OS thread that exits afterwards: a pooled thread (tokio's blocking pool)
//! would carry the pod's namespace into unrelated work.

use crate::model::{PodRecord, Protocol};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Probes every app port of `pod` (all must answer); a pod without ports is alive.
pub async fn probe_pod(pod: &PodRecord, timeout: Duration) -> bool {
    if pod.ports.is_empty() {
        return true;
    }
    let netns = pod.netns.clone();
    // A proxyless gRPC server listens on the pod's address (its xDS listener names
    // it), not necessarily on loopback: it is probed there.
    let pod_ip = pod.ip();
    let ports: Vec<(SocketAddr, Protocol)> = pod
        .ports
        .iter()
        .map(|p| {
            let ip = match pod_ip {
                Some(ip) if p.proxyless => ip,
                _ => std::net::Ipv4Addr::LOCALHOST.into(),
            };
            (SocketAddr::new(ip, p.app_port), p.protocol)
        })
        .collect();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("flock-probe".into())
        .spawn(move || {
            let ok = in_netns(&netns, || {
                ports
                    .iter()
                    .all(|(addr, proto)| probe_port(*addr, *proto, timeout))
            })
            .unwrap_or(false);
            let _ = tx.send(ok);
        });
    if spawned.is_err() {
        return false;
    }
    // The thread always answers within ports × timeout; the outer timeout is a guard.
    let limit = timeout * (pod.ports.len() as u32 + 1);
    matches!(tokio::time::timeout(limit, rx).await, Ok(Ok(true)))
}

/// Runs `f` on this thread inside the network namespace at `path`. Only call it on a
/// thread that exits afterwards.
fn in_netns<T>(path: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("opening netns {path}: {e}"))?;
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("entering netns {path}: {e}"))?;
    Ok(f())
}

fn probe_port(addr: SocketAddr, protocol: Protocol, timeout: Duration) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    if protocol != Protocol::Http {
        return true;
    }
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    if stream
        .write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: flock-probe\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    if stream.read_exact(&mut head).is_err() {
        return false;
    }
    // "HTTP/1.1 200"
    let status = std::str::from_utf8(&head[9..12])
        .ok()
        .and_then(|s| s.parse::<u16>().ok());
    head.starts_with(b"HTTP/1.") && status.is_some_and(|s| s < 500)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http_port_needs_an_http_answer_and_a_tcp_port_only_a_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            for (i, conn) in listener.incoming().take(2).enumerate() {
                let mut conn = conn.unwrap();
                if i == 1 {
                    let mut buf = [0u8; 512];
                    let _ = conn.read(&mut buf);
                    let _ = conn.write_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n");
                }
            }
        });
        let t = Duration::from_secs(2);
        assert!(
            probe_port(port, Protocol::Tcp, t),
            "a TCP connect is enough"
        );
        assert!(!probe_port(port, Protocol::Http, t), "a 503 is not alive");
        server.join().unwrap();
        assert!(
            !probe_port(port, Protocol::Tcp, t),
            "nothing listens any more"
        );
    }
}
