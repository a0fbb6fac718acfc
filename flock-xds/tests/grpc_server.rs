//! flock-xds's authorization for proxyless gRPC servers, against real gRPC peers:
//! Python `grpcio` (gRPC C-core) runs an xDS-enabled server (`grpc.server(xds=True)`
//! with xDS server credentials) that asks flock-xds for its listener, and clients
//! with xDS channel credentials dial it through `xds:///greeter.default:<port>`.
//! Every peer's certificate and roots come from its bootstrap's `file_watcher`
//! certificate provider named `flock`, over SVIDs of a throwaway CA; the server's
//! RBAC is the policy of the pod's port, as Envoy's inbound listener would enforce it.
//! The peers are `tests/peers/grpc_peer.py`.

mod common;

use common::xds::start_tcp;
use common::{ChildGuard, TempDir, grpc_python, repo};
use envoy_types::pb::google::protobuf::Any;
use flock_testkit::pki::{TestCa, Usage};
use flock_xds::cache::Cache;
use flock_xds::server::Server;
use flock_xds::translate::{self, EnvoyReferences, Mesh};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NODE: &str = "grpc-app";
/// The node id of the Envoy of the Envoy-caller test.
const ENVOY_NODE: &str = "envoy-caller";
const TD: &str = "spiffe://td.test/ns/default/sa";

struct Peer {
    guard: ChildGuard,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn start(dir: &Path, tag: &str, args: &[&str], bootstrap: &Path) -> Self {
        Self::start_with(
            dir,
            tag,
            args,
            &[("GRPC_XDS_BOOTSTRAP", bootstrap.display().to_string())],
        )
    }

    fn start_with(dir: &Path, tag: &str, args: &[&str], env: &[(&str, String)]) -> Self {
        let log = dir.join(format!("peer-{tag}.log"));
        let mut child = Command::new(grpc_python())
            .arg(repo().join("flock-xds/tests/peers/grpc_peer.py"))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn grpc_peer.py");
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
        assert!(n > 0, "peer exited; its log:\n{}", self.guard.log_tail());
        line.trim().to_string()
    }

    fn call(&mut self) -> String {
        writeln!(self.stdin, "call").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }

    /// Calls until one answer starts with `want` (the server serves only once it has
    /// its listener; a client's first calls may race it), or panics after `timeout`.
    fn until(&mut self, want: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            let got = self.call();
            if got.starts_with(want) {
                return;
            }
            seen.push(got);
            assert!(
                Instant::now() < deadline,
                "never got {want:?}; last answers: {:?}\nlog:\n{}",
                &seen[seen.len().saturating_sub(4)..],
                self.guard.log_tail()
            );
        }
    }
}

/// Writes `account`'s SVID (usable as server and client), its key and the CA, and a
/// bootstrap that names them as the `flock` certificate provider.
fn identity_bootstrap(dir: &TempDir, ca: &TestCa, account: &str, xds: &str) -> PathBuf {
    let id = format!("{TD}/{account}");
    let leaf = ca.issue(
        None,
        vec![rcgen::SanType::URI(id.as_str().try_into().unwrap())],
        Usage::Both,
    );
    let file = |name: &str, body: &str| {
        let p = dir.0.join(format!("{account}-{name}"));
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let (cert, key, roots) = (
        file("cert.pem", &leaf.cert_pem),
        file("key.pem", &leaf.key_pem),
        file("ca.pem", &ca.ca_pem),
    );
    let bootstrap = dir.0.join(format!("{account}-bootstrap.json"));
    std::fs::write(
        &bootstrap,
        serde_json::json!({
            "xds_servers": [{"server_uri": xds, "channel_creds": [{"type": "insecure"}],
                             "server_features": ["xds_v3"]}],
            "node": {"id": NODE},
            "certificate_providers": {translate::CERTIFICATE_PROVIDER: {
                "plugin_name": "file_watcher",
                "config": {"certificate_file": cert, "private_key_file": key,
                           "ca_certificate_file": roots, "refresh_interval": "1s"}}},
            "server_listener_resource_name_template": translate::SERVER_LISTENER_TEMPLATE,
        })
        .to_string(),
    )
    .unwrap();
    bootstrap
}

/// The mesh: pod `web` (identity `sa/web`) serves greeter on `port` itself
/// (proxyless), under the service policy `policy` (JSON; `None`: no policy) or, with
/// `refused`, a policy refused for that reason.
fn mesh(port: u16, policy: Option<&str>, refused: Option<&str>) -> Mesh {
    let service_policy = match (policy, refused) {
        (_, Some(why)) => serde_json::json!({"refused": why}),
        (Some(p), None) => {
            serde_json::json!({"spec": serde_json::from_str::<serde_json::Value>(p).unwrap()})
        }
        (None, None) => serde_json::Value::Null,
    };
    let mut authz = serde_json::json!({"service_ports": [port], "governed_by": "default/greeter"});
    if !service_policy.is_null() {
        authz["service_policy"] = service_policy;
    }
    let json = serde_json::json!({
        "services": [{"name": "greeter", "ports": [{"port": port, "protocol": "grpc"}],
                      "endpoints": [{"address": "127.0.0.1", "port": port,
                                     "identity": format!("{TD}/web")}]}],
        "pods": [{"name": "web", "ip": "127.0.0.1", "identity": format!("{TD}/web"),
                  "outbound_port": 0,
                  "inbound": [{"app_port": port, "listen_port": port, "protocol": "grpc",
                               "proxyless": true, "authz": authz}]}],
    });
    let mesh = Mesh::from_json(json.to_string().as_bytes()).unwrap();
    mesh.validate().unwrap();
    mesh
}

/// Publishes the proxyless translation of `mesh` to the apps' node id.
fn publish(cache: &Cache<Any>, mesh: &Mesh) {
    publish_to(cache, NODE, translate::grpc_resources(mesh));
}

fn publish_to(cache: &Cache<Any>, node: &str, resources: Vec<translate::Resource>) {
    cache
        .update_checked(node, &EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, resources);
            b.build()
        })
        .unwrap();
}

/// A policy allowing `sa/a` only reaches the proxyless server as its RBAC: `a`'s calls
/// are served, `b`'s are refused with `PERMISSION_DENIED`, a client without a
/// certificate cannot connect at all (the listener requires mTLS); allowing `b` too
/// reaches the running server with no restart, and a refused policy denies every
/// caller (fail closed) until it is fixed; a client refuses the server when the
/// endpoint's published identity is not the one the server's certificate carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxyless_server_enforces_the_policy_of_its_port() {
    let dir = TempDir::new("grpc-server");
    let (_held, [port]) = flock_testkit::reserve_ports_for_child();
    let allow = |accounts: &[&str]| {
        let sas: Vec<String> = accounts.iter().map(|a| format!("default/{a}")).collect();
        serde_json::json!({"default": "deny", "rules": [{"action": "allow",
            "from": {"serviceAccounts": sas}, "to": {"paths": ["/flock.test.Echo/*"]}}]})
        .to_string()
    };

    let cache = Arc::new(Cache::by_node_id());
    publish(&cache, &mesh(port, Some(&allow(&["a"])), None));
    let running = start_tcp(Server::new(Arc::clone(&cache))).await;
    let xds = format!("127.0.0.1:{}", running.port);

    let ca = TestCa::new("mesh");
    let target = format!("xds:///greeter.default:{port}");
    let web_boot = identity_bootstrap(&dir, &ca, "web", &xds);
    let a_boot = identity_bootstrap(&dir, &ca, "a", &xds);
    let b_boot = identity_bootstrap(&dir, &ca, "b", &xds);

    let logs = dir.0.clone();
    let (a_, b_, plain_, web_) = tokio::task::spawn_blocking(move || {
        let dir = logs.as_path();
        let address = format!("127.0.0.1:{port}");
        let mut web = Peer::start(dir, "web", &["serve-xds", "web", &address], &web_boot);
        assert_eq!(web.line(), "ready");
        let mut a = Peer::start(dir, "a", &["client", &target, "xds-creds"], &a_boot);
        let mut b = Peer::start(dir, "b", &["client", &target, "xds-creds"], &b_boot);
        // A client with plain credentials: it ignores the cluster's TLS and dials
        // plaintext, which the server's mTLS chain refuses.
        let mut plain = Peer::start(dir, "plain", &["client", &target], &a_boot);
        a.until("ok web", Duration::from_secs(30));
        let b_got = b.call();
        assert!(
            b_got.starts_with("error PERMISSION_DENIED"),
            "b is not allowed: {b_got}"
        );
        let p = plain.call();
        assert!(
            p.starts_with("error UNAVAILABLE"),
            "a plaintext caller must not reach the mTLS server: {p}"
        );
        (a, b, plain, web)
    })
    .await
    .unwrap();
    let (mut a, mut b) = (a_, b_);

    // Allow b too: the running server follows.
    publish(&cache, &mesh(port, Some(&allow(&["a", "b"])), None));
    let (a_, b_) = tokio::task::spawn_blocking(move || {
        b.until("ok web", Duration::from_secs(10));
        assert_eq!(a.call(), "ok web");
        (a, b)
    })
    .await
    .unwrap();
    let (mut a, mut b) = (a_, b_);

    // A refused policy: nobody is allowed.
    publish(
        &cache,
        &mesh(port, None, Some("rules[0].frm: unknown field")),
    );
    let (a_, b_) = tokio::task::spawn_blocking(move || {
        a.until("error PERMISSION_DENIED", Duration::from_secs(10));
        let got = b.call();
        assert!(got.starts_with("error PERMISSION_DENIED"), "{got}");
        (a, b)
    })
    .await
    .unwrap();
    let (mut a, b) = (a_, b_);

    // Fixed: served again.
    publish(&cache, &mesh(port, Some(&allow(&["a"])), None));
    let a = tokio::task::spawn_blocking(move || {
        a.until("ok web", Duration::from_secs(10));
        a
    })
    .await
    .unwrap();

    // The client verifies the server: with the endpoint's identity published as
    // sa/other, a new client of a's refuses web's certificate (sa/web) and never
    // reaches it; with sa/web again it is served.
    let mut other: serde_json::Value =
        serde_json::to_value(mesh(port, Some(&allow(&["a"])), None)).unwrap();
    other["services"][0]["endpoints"][0]["identity"] = serde_json::json!(format!("{TD}/other"));
    publish(&cache, &serde_json::from_value(other).unwrap());
    let (logs, a_boot) = (dir.0.clone(), dir.0.join("a-bootstrap.json"));
    let target = format!("xds:///greeter.default:{port}");
    let fresh = tokio::task::spawn_blocking(move || {
        let mut fresh = Peer::start(&logs, "a-fresh", &["client", &target, "xds-creds"], &a_boot);
        for _ in 0..3 {
            let got = fresh.call();
            assert!(
                got.starts_with("error UNAVAILABLE"),
                "a server with another identity than the endpoint's was trusted: {got}"
            );
        }
        fresh
    })
    .await
    .unwrap();
    publish(&cache, &mesh(port, Some(&allow(&["a"])), None));
    let fresh = tokio::task::spawn_blocking(move || {
        let mut fresh = fresh;
        fresh.until("ok web", Duration::from_secs(15));
        fresh
    })
    .await
    .unwrap();
    drop(fresh);

    for kind in ["lds", "cds", "eds", "rds"] {
        assert_eq!(
            running
                .server
                .metrics()
                .counter("flock_xds_nacks_total", kind),
            0,
            "{kind} NACKed"
        );
    }
    drop((a, b, plain_, web_));
    drop(dir);
    running.stop().await;
}

/// An Envoy-meshed caller reaches a proxyless server: a plain gRPC app calls its
/// pod's Envoy outbound listener with `:authority greeter.default:<port>`; Envoy's
/// mTLS cluster presents the caller pod's SVID (`sa/a`, from SDS) to the server,
/// whose RBAC allows `sa/a`. With `sa/b` as the caller pod's identity, the same call
/// is refused by the server (`PERMISSION_DENIED` through Envoy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_caller_reaches_a_proxyless_server_with_its_pods_identity() {
    let dir = TempDir::new("grpc-server-envoy");
    let (_held, [port, outbound]) = flock_testkit::reserve_ports_for_child();
    let ca = TestCa::new("mesh");
    let policy = serde_json::json!({"default": "deny", "rules": [{"action": "allow",
        "from": {"serviceAccounts": ["default/a"]}, "to": {"paths": ["/flock.test.Echo/*"]}}]})
    .to_string();
    let envoy_mesh = |account: &str| {
        let mut m = serde_json::to_value(mesh(port, Some(&policy), None)).unwrap();
        let id = format!("{TD}/{account}");
        let leaf = ca.issue(
            None,
            vec![rcgen::SanType::URI(id.as_str().try_into().unwrap())],
            Usage::Both,
        );
        m["pods"].as_array_mut().unwrap().push(serde_json::json!({
            "name": "caller", "ip": "127.0.0.1", "outbound_port": outbound, "identity": id}));
        m["secrets"] = serde_json::json!([
            {"name": "td.test", "kind": {"validation_context": {"trusted_ca_pem": ca.ca_pem}}},
            {"name": id, "kind": {"tls_certificate": {
                "certificate_chain_pem": leaf.cert_pem, "private_key_pem": leaf.key_pem}}},
        ]);
        let m: Mesh = serde_json::from_value(m).unwrap();
        m.validate().unwrap();
        m
    };
    let cache = Arc::new(Cache::by_node_id());
    let publish_envoy = |m: &Mesh| {
        let resources = translate::envoy_resources(m, &translate::EnvoyOptions::default());
        publish_to(&cache, ENVOY_NODE, resources);
    };
    publish(&cache, &mesh(port, Some(&policy), None));
    publish_envoy(&envoy_mesh("a"));
    let running = start_tcp(Server::new(Arc::clone(&cache))).await;
    let xds = format!("127.0.0.1:{}", running.port);
    let envoy = common::Envoy::start(ENVOY_NODE, "GRPC", running.port).await;

    let web_boot = identity_bootstrap(&dir, &ca, "web", &xds);
    let logs = dir.0.clone();
    let (app, web) = tokio::task::spawn_blocking(move || {
        let address = format!("127.0.0.1:{port}");
        let mut web = Peer::start(&logs, "web", &["serve-xds", "web", &address], &web_boot);
        assert_eq!(web.line(), "ready");
        // The caller's app: plaintext to its Envoy, which routes by the authority.
        let mut app = Peer::start_with(
            &logs,
            "app",
            &["client", &format!("127.0.0.1:{outbound}")],
            &[("GRPC_PEER_AUTHORITY", format!("greeter.default:{port}"))],
        );
        app.until("ok web", Duration::from_secs(30));
        (app, web)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nEnvoy:\n{}", envoy.guard.log_tail()));

    // The caller pod is sa/b now: its Envoy presents b's SVID, which the server refuses.
    publish_envoy(&envoy_mesh("b"));
    let mut app = app;
    let app = tokio::task::spawn_blocking(move || {
        app.until("error PERMISSION_DENIED", Duration::from_secs(10));
        app
    })
    .await
    .unwrap();
    drop((app, web, envoy));
    drop(dir);
    running.stop().await;
}
