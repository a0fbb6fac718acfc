//! Test harness for flock-supervisor against real Envoy: Envoy discovery, unique ports
//! and base ids, a real HTTP/1.1 backend, a load generator, and guards that remove
//! every process, temporary directory and `/dev/shm` file a test creates, also when
//! it fails.
#![allow(dead_code)]

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use flock_hotrestart::admin::{AdminClient, ServerInfo};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub use flock_testkit::{Backend, envoy_bin, reserve_ports_for_child};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A base id no other test (process or thread) uses.
pub fn unique_base_id() -> u32 {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Leaves room for BaseId::AvoidInUse (+1): steps of 4.
    100_000 + (std::process::id() % 50_000) * 64 + n * 4
}

/// A temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("flock-sup-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills every Envoy started with `--base-id <id>` for each id, and removes their
/// shared-memory files: run on drop, so a failing test leaves nothing behind.
pub struct EnvoyCleanup(pub Vec<u32>);

impl Drop for EnvoyCleanup {
    fn drop(&mut self) {
        for pid in envoy_pids(&self.0) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for id in &self.0 {
            let _ = std::fs::remove_file(format!(
                "/dev/shm/envoy_shared_memory_{}",
                u64::from(*id) * 10
            ));
        }
    }
}

/// Pids of running processes whose command line has `--base-id <id>` for one of `ids`.
pub fn envoy_pids(ids: &[u32]) -> Vec<i32> {
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        // Zombies have an empty cmdline; only live Envoys count.
        if !args.first().is_some_and(|a| a.ends_with(b"envoy")) {
            continue;
        }
        let hit = args.windows(2).any(|w| {
            w[0] == b"--base-id" && ids.iter().any(|id| w[1] == id.to_string().as_bytes())
        });
        if hit && !is_zombie(pid) {
            pids.push(pid);
        }
    }
    pids
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}

/// Whether process `pid` is gone (or a zombie).
pub fn is_gone(pid: i32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid)
}

/// The Envoy bootstrap used by the tests: admin on the unix socket `admin` (mode
/// 0600, as `flock-agent envoy-bootstrap` writes it), a listener proxying to
/// `backend_port`, adding response header `x-config-version: <version>`.
pub fn envoy_config(admin: &Path, listen_port: u16, backend_port: u16, version: u32) -> String {
    let admin = admin.display();
    format!(
        r#"admin:
  address: {{pipe: {{path: "{admin}", mode: 384}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            response_headers_to_add:
            - header: {{key: x-config-version, value: "{version}"}}
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: backend}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {backend_port}}}}}}}
"#
    )
}

/// Writes `contents` to `path` atomically (write + rename), like an editor or a
/// ConfigMap update.
pub fn write_atomically(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Continuous HTTP/1.1 load against `127.0.0.1:port`: `keepalive` clients reusing
/// their connection (reconnecting only when the server says `connection: close`) and
/// `fresh` clients opening a new connection per request. Every request either gets a
/// 200 or counts as failed; nothing is retried.
pub struct Load {
    pub ok: Arc<AtomicU64>,
    pub failed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub errors: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Load {
    pub fn start(port: u16, keepalive: usize, fresh: usize) -> Self {
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..keepalive + fresh {
            let reuse = i < keepalive;
            let (ok, failed, stop, errors) =
                (ok.clone(), failed.clone(), stop.clone(), errors.clone());
            tasks.push(tokio::spawn(async move {
                let mut conn: Option<BufReader<TcpStream>> = None;
                while !stop.load(Ordering::Relaxed) {
                    if conn.is_none() {
                        match TcpStream::connect(("127.0.0.1", port)).await {
                            Ok(s) => conn = Some(BufReader::new(s)),
                            Err(e) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                                errors.lock().unwrap().push(format!("connect: {e}"));
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                continue;
                            }
                        }
                    }
                    let stream = conn.as_mut().expect("connected");
                    let result =
                        tokio::time::timeout(Duration::from_secs(5), one_request(stream, reuse))
                            .await
                            .unwrap_or_else(|_| Err("timeout".into()));
                    match result {
                        Ok(keep) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            if !(keep && reuse) {
                                conn = None;
                            }
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            errors.lock().unwrap().push(e);
                            conn = None;
                        }
                    }
                }
            }));
        }
        Self {
            ok,
            failed,
            stop,
            tasks,
            errors,
        }
    }

    pub async fn stop(mut self) -> (u64, u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        let errors = self.errors.lock().unwrap().clone();
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            errors,
        )
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One GET; `Ok(keep_alive)` on a 200 with its whole body.
async fn one_request(stream: &mut BufReader<TcpStream>, reuse: bool) -> Result<bool, String> {
    let req = if reuse {
        "GET / HTTP/1.1\r\nhost: flock\r\n\r\n"
    } else {
        "GET / HTTP/1.1\r\nhost: flock\r\nconnection: close\r\n\r\n"
    };
    stream
        .get_mut()
        .write_all(req.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    let n = stream
        .read_line(&mut line)
        .await
        .map_err(|e| format!("read status: {e}"))?;
    if n == 0 {
        return Err("connection closed before the response".into());
    }
    if !line.starts_with("HTTP/1.1 200") {
        return Err(format!("status: {}", line.trim()));
    }
    let mut length = 0usize;
    let mut keep = true;
    loop {
        line.clear();
        stream
            .read_line(&mut line)
            .await
            .map_err(|e| format!("read header: {e}"))?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().map_err(|_| "bad content-length")?;
        } else if lower.starts_with("connection:") && lower.contains("close") {
            keep = false;
        }
    }
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| format!("read body: {e}"))?;
    if body != b"ok" {
        return Err(format!("body {body:?}"));
    }
    Ok(keep)
}

/// One supervisor process under test, with its log; SIGKILLed on drop.
pub struct Supervisor {
    pub child: Child,
    pub log: PathBuf,
}

/// The usual setup of one supervisor.
pub struct Setup {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub state_dir: PathBuf,
    pub base_id: u32,
    pub ready: PathBuf,
    pub metrics: PathBuf,
}

impl Setup {
    pub fn new(dir: &Path, base_id: u32) -> Self {
        Self {
            dir: dir.to_owned(),
            config: dir.join("envoy.yaml"),
            state_dir: dir.join("state"),
            base_id,
            ready: dir.join("ready"),
            metrics: dir.join("metrics.prom"),
        }
    }

    /// The supervisor's default control directory (`<state-dir>/control`).
    pub fn control_dir(&self) -> PathBuf {
        self.state_dir.join("control")
    }

    /// Envoy's admin socket, where the supervisor looks for it by default.
    pub fn admin_socket(&self) -> PathBuf {
        self.control_dir().join("admin.sock")
    }

    pub fn admin(&self) -> AdminClient {
        AdminClient::new(self.admin_socket(), Duration::from_secs(1))
    }

    /// Starts `flock-supervisor` with short drain times; `name` tags its log and
    /// writer id; `extra` are additional supervisor flags.
    pub fn spawn(&self, name: &str, extra: &[&str]) -> Supervisor {
        self.spawn_under(&[], name, extra)
    }

    /// [`Setup::spawn`] with the supervisor exec'd by `wrapper` (e.g. `setpriv` and its
    /// flags, which keeps the pid).
    pub fn spawn_under(&self, wrapper: &[&str], name: &str, extra: &[&str]) -> Supervisor {
        let log = self.dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        // Short drains keep the tests fast; a test may override them.
        let mut defaults = Vec::new();
        for (flag, value) in [("--drain-time-s", "2"), ("--parent-shutdown-time-s", "3")] {
            if !extra.contains(&flag) {
                defaults.extend([flag, value]);
            }
        }
        let supervisor = env!("CARGO_BIN_EXE_flock-supervisor");
        let mut cmd = match wrapper.split_first() {
            None => Command::new(supervisor),
            Some((program, flags)) => {
                let mut cmd = Command::new(program);
                cmd.args(flags).arg(supervisor);
                cmd
            }
        };
        cmd.arg("--envoy-bin")
            .arg(envoy_bin())
            .arg("--config")
            .arg(&self.config)
            .arg("--base-id")
            .arg(self.base_id.to_string())
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["--shutdown-margin-s", "3", "--handoff-timeout-s", "20"])
            .arg("--writer-id")
            .arg(format!("{name}-{}", std::process::id()))
            .args(extra)
            .args(defaults)
            .args(["--", "--log-level", "warn", "--concurrency", "1"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        Supervisor {
            child: cmd.spawn().unwrap(),
            log,
        }
    }
}

impl Supervisor {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    pub fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the exit, at most `limit`; the exit code (`None`: by a signal).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        // On timeout the panic prints the supervisor's log (this guard's `Drop`).
        let status = wait_for("the supervisor to exit", limit, || {
            self.child.try_wait().unwrap()
        });
        status.code()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Pids of the supervisor's direct children (its Envoy epochs).
    pub fn children(&self) -> Vec<i32> {
        let pid = self.child.id();
        let mut out = Vec::new();
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in tasks.flatten() {
                if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                    out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
                }
            }
        }
        out
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "---- supervisor log {} ----", self.log.display());
            if let Ok(f) = std::fs::File::open(&self.log) {
                for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
                    let _ = writeln!(err, "{line}");
                }
            }
        }
    }
}

/// Polls `/server_info` until `epoch` of `base_id` is LIVE, at most `limit`.
pub async fn wait_live(
    admin: &AdminClient,
    epoch: u32,
    base_id: u32,
    limit: Duration,
) -> ServerInfo {
    let what = format!("epoch {epoch} of base id {base_id} LIVE");
    eventually(&what, limit, async || match admin.server_info().await {
        Ok(info) if info.is_live() && info.epoch == epoch && info.base_id == base_id => Ok(info),
        other => Err(other),
    })
    .await
}

/// One metric's value from the supervisor's textfile.
pub fn metric(path: &Path, name: &str) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[allow(unused_imports)]
pub use flock_testkit::{eventually, wait_for, wait_for_async};

/// p-th percentile (0..=100) of `samples` (sorted in place).
pub fn percentile(samples: &mut [Duration], p: usize) -> Duration {
    samples.sort();
    let idx = ((samples.len() - 1) * p).div_ceil(100);
    samples[idx]
}

/// `config` plus an EDS cluster whose xDS server (a closed port) never answers: the
/// epoch stays PRE_INITIALIZING for about a second before it gives up on it and
/// becomes LIVE. Makes "while the new epoch initializes" a wide, reliable window.
pub fn with_slow_init(config: &str) -> String {
    let mut out = format!("node: {{id: flock-test, cluster: flock-test}}\n{config}");
    out.push_str(
        r#"  - name: slow-eds
    connect_timeout: 1s
    type: EDS
    eds_cluster_config:
      eds_config:
        initial_fetch_timeout: 3s
        resource_api_version: V3
        api_config_source:
          api_type: GRPC
          transport_api_version: V3
          grpc_services:
          - envoy_grpc: {cluster_name: dead-xds}
  - name: dead-xds
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: dead-xds
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 1}}}
"#,
    );
    out
}
