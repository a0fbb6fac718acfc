//! Authorization for a proxyless gRPC server, end to end: a node (network namespace on
//! an underlay) with the real agent (`--capture strict --authz-dir <dir>`, mTLS xDS on
//! its underlay address for proxyless apps) and a real Envoy under `flock-supervisor`,
//! etcd, and pod `web` added through libcni with `flock.io/ports: 50051/grpc-xds`:
//! its app is Python `grpcio`'s xDS-enabled server (`grpc.server(xds=True)`, xDS server
//! credentials), listening on the pod's address. Two proxyless clients with xDS
//! channel credentials, `a` (sa a) and `b` (sa b), dial `xds:///web.default:50051`
//! from the node. Every app's SVID, key and roots come from its bootstrap's
//! `file_watcher` certificate provider `flock` (a test CA; the same certificate is its
//! client certificate to the agent's xDS, which serves the proxyless translation to any
//! SPIFFE ID of the trust domain). The peers are `flock-xds/tests/peers/grpc_peer.py`.
//!
//! Asserts that the pod's capture leaves the proxyless port to the app (callers reach
//! it directly although the pod is strictly captured), that the policy "allow sa/a on
//! /flock.test.Echo/*" serves `a` and refuses `b` (`PERMISSION_DENIED`) at the server
//! itself, that allowing `b` reaches the running server (the time from the file's
//! rename is printed), that a malformed policy denies `a` too (fail closed) while the
//! agent's `/debug/status` names it, and that fixing it restores `a`.
//!
//! Needs root, nft, etcd, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`,
//! `FLOCK_GRPC_PYTHON`.

mod common;
mod multinode;

use common::*;
use flock_testkit::pki::{TestCa, Usage};
use multinode::*;
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const TAG: u8 = 7;
const GRPC_PORT: u16 = 50051;
/// The agent's mTLS xDS address for proxyless apps (node n1's underlay address).
const XDS: &str = "10.77.7.11:15010";

const ALLOW_A: &str = r#"{"default":"deny","rules":[{"action":"allow",
  "from":{"serviceAccounts":["default/a"]},"to":{"paths":["/flock.test.Echo/*"]}}]}"#;
const ALLOW_A_AND_B: &str = r#"{"default":"deny","rules":[{"action":"allow",
  "from":{"serviceAccounts":["default/a","default/b"]},"to":{"paths":["/flock.test.Echo/*"]}}]}"#;
/// `frm` is no field of a rule: refused, so every call is denied.
const MALFORMED: &str = r#"{"default":"deny","rules":[{"action":"allow",
  "frm":{"serviceAccounts":["default/a"]},"to":{"paths":["/flock.test.Echo/*"]}}]}"#;

fn peer_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../flock-xds/tests/peers/grpc_peer.py")
}

fn write_policy(dir: &Path, body: &str) -> Instant {
    let tmp = dir.join(".default.web.json.tmp");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, dir.join("default.web.json")).unwrap();
    Instant::now()
}

/// A proxyless app's files: its SVID (server and client use), key, the roots, and the
/// bootstrap `flock-agent grpc-bootstrap` prints for them (the `flock` certificate
/// provider, and its mTLS credentials to the agent's xDS).
fn app_bootstrap(dir: &Path, ca: &TestCa, account: &str) -> PathBuf {
    let id = format!("spiffe://{TRUST_DOMAIN}/ns/default/sa/{account}");
    let leaf = ca.issue(
        None,
        vec![rcgen::SanType::URI(id.as_str().try_into().unwrap())],
        Usage::Both,
    );
    let file = |name: &str, body: &str| {
        let p = dir.join(format!("{account}-{name}"));
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let (cert, key, roots) = (
        file("cert.pem", &leaf.cert_pem),
        file("key.pem", &leaf.key_pem),
        file("ca.pem", &ca.ca_pem),
    );
    // The bootstrap as an operator makes it: `flock-agent grpc-bootstrap`.
    let out = Command::new(AGENT_BIN)
        .args(["--xds-address", XDS, "grpc-bootstrap", "--node-id", account])
        .args(["--cert", &cert, "--key", &key, "--ca", &roots])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let bootstrap = dir.join(format!("{account}-bootstrap.json"));
    std::fs::write(&bootstrap, &out.stdout).unwrap();
    bootstrap
}

/// A `grpc_peer.py` process driven over its stdin/stdout.
struct Peer {
    guard: ChildGuard,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    /// Runs the peer with `args` in network namespace `netns`.
    fn start(netns: &str, args: &[&str], bootstrap: &Path, log: PathBuf) -> Self {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns])
            .arg(required_env("FLOCK_GRPC_PYTHON"))
            .arg(peer_script())
            .args(args)
            .env("GRPC_XDS_BOOTSTRAP", bootstrap)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().expect("spawning grpc_peer.py");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Peer {
            guard: ChildGuard { child, log },
            stdin,
            stdout,
        }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "peer exited; its log:\n{}", self.guard.log_text());
        line.trim().to_string()
    }

    fn call(&mut self) -> String {
        writeln!(self.stdin, "call").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }

    /// Calls until an answer starts with `want`; the time it took.
    fn until(&mut self, want: &str, c: &Cluster) -> Duration {
        let start = Instant::now();
        let mut last = Vec::new();
        loop {
            let got = self.call();
            if got.starts_with(want) {
                return start.elapsed();
            }
            last.push(got);
            assert!(
                start.elapsed() < WAIT,
                "never {want:?}; last answers {:?}\npeer log:\n{}\n{}",
                &last[last.len().saturating_sub(4)..],
                self.guard.log_text(),
                c.logs()
            );
        }
    }
}

#[test]
fn a_proxyless_server_is_authorized_by_its_ports_policy() {
    let policies = tempfile::Builder::new()
        .prefix("flock-proxyless-policies-")
        .tempdir()
        .unwrap();
    let pdir = policies.path().to_owned();
    let files = tempfile::Builder::new()
        .prefix("flock-proxyless-certs-")
        .tempdir()
        .unwrap();
    let fdir = files.path().to_owned();
    let ca = TestCa::new("proxyless");
    let xds_ip: std::net::IpAddr = XDS.rsplit_once(':').unwrap().0.parse().unwrap();
    let server = ca.issue(None, vec![rcgen::SanType::IpAddress(xds_ip)], Usage::Server);
    let write = |name: &str, text: &str| {
        let p = fdir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let agent_args: Vec<String> = [
        "--capture",
        "strict",
        "--authz-dir",
        pdir.to_str().unwrap(),
        "--xds-address",
        XDS,
        "--xds-tls-cert",
        &write("xds.pem", &server.cert_pem),
        "--xds-tls-key",
        &write("xds-key.pem", &server.key_pem),
        "--xds-tls-client-ca",
        &write("xds-ca.pem", &ca.ca_pem),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    write_policy(&pdir, ALLOW_A);
    let mut c = Cluster::start(ClusterOptions {
        tag: TAG,
        zones: vec!["zone-a"],
        shared_root: false,
        registry_ttl: 10,
        agent_args,
        kube: false,
    });
    let web = c.add_pod_with(
        0,
        "web",
        json!({
            "flock.io/service": "web",
            "flock.io/service-account": "web",
            "flock.io/ports": format!("{GRPC_PORT}/grpc-xds"),
        }),
        false,
    );
    let web_ip = c.pods[web].ip.clone().unwrap();
    let node_ns = c.nodes[0].netns.clone();
    let log = |name: &str| c.dir.path().join(format!("{name}.log"));

    let mut server = Peer::start(
        &c.pods[web].netns,
        &["serve-xds", "web", &format!("{web_ip}:{GRPC_PORT}")],
        &app_bootstrap(&fdir, &ca, "web"),
        log("web-grpc"),
    );
    assert_eq!(server.line(), "ready");
    let target = format!("xds:///web.default:{GRPC_PORT}");
    let client = |name: &str| {
        Peer::start(
            &node_ns,
            &["client", &target, "xds-creds"],
            &app_bootstrap(&fdir, &ca, name),
            log(&format!("{name}-grpc")),
        )
    };
    let (mut a, mut b) = (client("a"), client("b"));

    // The pod is captured strictly, but its proxyless port is the app's: a reaches it
    // directly and is served; b is refused by the server's RBAC.
    a.until("ok web", &c);
    let got = b.call();
    assert!(
        got.starts_with("error PERMISSION_DENIED"),
        "b has no rule: {got}\n{}",
        c.logs()
    );

    // Allow b: the running server follows.
    let written = write_policy(&pdir, ALLOW_A_AND_B);
    b.until("ok web", &c);
    println!(
        "policy rename → the proxyless server serving b: {:?}",
        written.elapsed()
    );
    assert_eq!(a.call(), "ok web");

    // Malformed: every caller is denied and the agent names the policy.
    write_policy(&pdir, MALFORMED);
    a.until("error PERMISSION_DENIED", &c);
    let (_, status) = http_get(&c.nodes[0].agent_admin(), "/debug/status").unwrap();
    assert!(
        status.contains("default/web") && status.contains("frm"),
        "the status names the refused policy: {status}"
    );

    // Fixed: served again.
    write_policy(&pdir, ALLOW_A);
    a.until("ok web", &c);
    let got = b.call();
    assert!(got.starts_with("error PERMISSION_DENIED"), "{got}");
    drop((a, b, server));
}
