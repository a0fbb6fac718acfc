//! flock-xds against a real proxyless gRPC client: Python `grpcio` (gRPC C-core's xDS
//! resolver, SotW ADS) dials `xds:///greeter.default:50051`, resolves it through the
//! proxyless translation served by flock-xds, and calls real gRPC backends (Python
//! servers); it follows endpoint additions and removals, and priorities by the
//! caller's zone (its zone first, the next priority when its zone has no healthy
//! endpoint). The peers are
//! `tests/peers/grpc_peer.py`.

mod common;

use common::{ChildGuard, TempDir, grpc_python, repo};
use envoy_types::pb::google::protobuf::Any;
use flock_xds::cache::Cache;
use flock_xds::server::Server;
use flock_xds::translate::{
    self, EnvoyOptions, EnvoyReferences, Flavor, Health, Locality, Memo, Mesh,
};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NODE: &str = "grpc-client";

fn peer(
    dir: &TempDir,
    args: &[&str],
    bootstrap: Option<&std::path::Path>,
) -> (ChildGuard, ChildStdin, BufReader<ChildStdout>) {
    let log = dir.0.join(format!("peer-{}.log", args[0]));
    let mut cmd = Command::new(grpc_python());
    cmd.arg(repo().join("flock-xds/tests/peers/grpc_peer.py"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
    if let Some(b) = bootstrap {
        cmd.env("GRPC_XDS_BOOTSTRAP", b);
    }
    let mut child = cmd.spawn().expect("spawn grpc_peer.py");
    let stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (ChildGuard { child, log }, stdin, stdout)
}

fn read_line(out: &mut BufReader<ChildStdout>, guard: &ChildGuard) -> String {
    let mut line = String::new();
    let n = out.read_line(&mut line).unwrap();
    assert!(n > 0, "peer exited; its log:\n{}", guard.log_tail());
    line.trim().to_string()
}

fn mesh(endpoints: &[u16]) -> Mesh {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|p| {
            format!(
                r#"{{"address": "127.0.0.1", "port": {p}, "locality": {{"region": "r1", "zone": "z{}"}}}}"#,
                p % 2
            )
        })
        .collect();
    let json = format!(
        r#"{{"services": [{{"name": "greeter", "ports": [{{"port": 50051, "protocol": "grpc"}}],
             "endpoints": [{}]}}]}}"#,
        eps.join(",")
    );
    let mesh = Mesh::from_json(json.as_bytes()).unwrap();
    mesh.validate().unwrap();
    mesh
}

fn publish(cache: &Cache<Any>, mesh: &Mesh) {
    let resources = translate::grpc_resources(mesh);
    cache
        .update_checked(NODE, &EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, resources);
            b.build()
        })
        .unwrap();
}

/// Publishes greeter with `endpoints` (port, zone, health; region r1) translated
/// for a caller in r1/z-near: the proxyless translation of a control plane that
/// knows its node's locality (a memo with its options).
fn publish_for_local_zone(cache: &Cache<Any>, endpoints: &[(u16, &str, Health)]) {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|(port, zone, health)| {
            let health = match health {
                Health::Unhealthy => "unhealthy",
                _ => "healthy",
            };
            format!(
                r#"{{"address": "127.0.0.1", "port": {port}, "health": "{health}",
                    "locality": {{"region": "r1", "zone": "{zone}"}}}}"#
            )
        })
        .collect();
    let mesh = Mesh::from_json(
        format!(
            r#"{{"services": [{{"name": "greeter", "ports": [{{"port": 50051, "protocol": "grpc"}}],
                 "endpoints": [{}]}}]}}"#,
            eps.join(",")
        )
        .as_bytes(),
    )
    .unwrap();
    mesh.validate().unwrap();
    let opts = EnvoyOptions {
        local_locality: Some(Locality {
            region: "r1".into(),
            zone: "z-near".into(),
            sub_zone: String::new(),
        }),
        ..EnvoyOptions::default()
    };
    let entries = Memo::new(Flavor::Grpc).translate(&mesh, &opts);
    cache
        .update_checked(NODE, &EnvoyReferences, |prev| {
            let mut b = prev.edit();
            for (type_url, list) in entries {
                b.replace_type(type_url, list);
            }
            b.build()
        })
        .unwrap();
}

/// The proxyless client, driven one call at a time.
struct Client {
    guard: ChildGuard,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    fn call(&mut self) -> String {
        writeln!(self.stdin, "call").unwrap();
        self.stdin.flush().unwrap();
        read_line(&mut self.stdout, &self.guard)
    }

    /// Calls until the last `window` answers all came from `want` (each of them at
    /// least once), or panics after `timeout`. Returns the answers seen.
    fn until_serving(&mut self, want: &[&str], window: usize, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let want: BTreeSet<String> = want.iter().map(|w| format!("ok {w}")).collect();
        let mut seen = Vec::new();
        loop {
            seen.push(self.call());
            if seen.len() >= window {
                let last: BTreeSet<String> = seen[seen.len() - window..].iter().cloned().collect();
                if last == want {
                    return seen;
                }
            }
            assert!(
                Instant::now() < deadline,
                "client never settled on {want:?}; last answers: {:?}\nclient log:\n{}",
                &seen[seen.len().saturating_sub(8)..],
                self.guard.log_tail()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_resolves_through_flock_xds_and_follows_endpoints() {
    let dir = TempDir::new("grpc");
    // The Python backends bind these themselves.
    let (_held, [p1, p2]) = flock_testkit::reserve_ports_for_child();
    let (backends, _backends_in, mut backends_out) = peer(
        &dir,
        &[
            "serve",
            &format!("backend-1:{p1}"),
            &format!("backend-2:{p2}"),
        ],
        None,
    );
    assert_eq!(read_line(&mut backends_out, &backends), "ready");

    let cache = Arc::new(Cache::by_node_id());
    publish(&cache, &mesh(&[p1]));
    let server = Server::new(Arc::clone(&cache));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let xds = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let serving = tokio::spawn(async move {
        s.serve_tcp(listener, async {
            let _ = stopped.await;
        })
        .await
    });

    let bootstrap = dir.0.join("bootstrap.json");
    std::fs::write(
        &bootstrap,
        format!(
            r#"{{"xds_servers": [{{"server_uri": "{xds}", "channel_creds": [{{"type": "insecure"}}],
                 "server_features": ["xds_v3"]}}],
                "node": {{"id": "{NODE}", "locality": {{"region": "r1"}}}}}}"#
        ),
    )
    .unwrap();
    let (guard, stdin, stdout) = peer(
        &dir,
        &["client", "xds:///greeter.default:50051"],
        Some(&bootstrap),
    );
    let mut client = Client {
        guard,
        stdin,
        stdout,
    };

    // The blocking peer I/O runs off the async runtime, which keeps serving xDS.
    let (client, cache) = tokio::task::spawn_blocking(move || {
        let first = client.call();
        assert_eq!(
            first,
            "ok backend-1",
            "client log:\n{}",
            client.guard.log_tail()
        );

        // An added endpoint: round robin reaches both.
        publish(&cache, &mesh(&[p1, p2]));
        client.until_serving(&["backend-1", "backend-2"], 4, Duration::from_secs(20));

        // A removed endpoint: only backend 2 answers.
        publish(&cache, &mesh(&[p2]));
        client.until_serving(&["backend-2"], 6, Duration::from_secs(20));

        // Priorities by the caller's zone: both endpoints serve, but only the one in
        // the caller's zone (priority 0) gets calls; round robin over one priority
        // would alternate.
        publish_for_local_zone(
            &cache,
            &[
                (p1, "z-near", Health::Healthy),
                (p2, "z-far", Health::Healthy),
            ],
        );
        client.until_serving(&["backend-1"], 6, Duration::from_secs(20));
        // The caller's zone has no healthy endpoint left: priority 1 takes over.
        publish_for_local_zone(
            &cache,
            &[
                (p1, "z-near", Health::Unhealthy),
                (p2, "z-far", Health::Healthy),
            ],
        );
        client.until_serving(&["backend-2"], 6, Duration::from_secs(20));
        (client, cache)
    })
    .await
    .unwrap();
    let acked = server.metrics().counter("flock_xds_acks_total", "eds");
    assert!(acked >= 5, "grpcio ACKed every EDS version it got: {acked}");
    assert_eq!(server.metrics().counter("flock_xds_nacks_total", "eds"), 0);
    assert_eq!(server.metrics().counter("flock_xds_nacks_total", "lds"), 0);
    assert_eq!(server.metrics().counter("flock_xds_nacks_total", "cds"), 0);
    drop((client, cache));
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}

/// A proxyless gRPC client follows an `HTTPRoute` on its target: `greeter` (no
/// endpoints of its own) split 90/10 over `greeter-v1` and `greeter-v2` lands within
/// ±5 points over 1,000 calls, and calls with the metadata `x-canary: 1` all reach
/// v2; the client ACKs every route it gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_follows_a_weighted_split_and_a_header_match() {
    let dir = TempDir::new("grpc-routes");
    let (_held, [p1, p2]) = flock_testkit::reserve_ports_for_child();
    let (backends, _backends_in, mut backends_out) = peer(
        &dir,
        &["serve", &format!("v1:{p1}"), &format!("v2:{p2}")],
        None,
    );
    assert_eq!(read_line(&mut backends_out, &backends), "ready");
    let svc = |name: &str, port: Option<u16>| {
        let eps = port.map_or(String::new(), |p| {
            format!(r#"{{"address": "127.0.0.1", "port": {p}}}"#)
        });
        format!(
            r#"{{"name": "{name}", "ports": [{{"port": 50051, "protocol": "grpc"}}], "endpoints": [{eps}]}}"#
        )
    };
    let mut mesh = Mesh::from_json(
        format!(
            r#"{{"services": [{}, {}, {}]}}"#,
            svc("greeter", None),
            svc("greeter-v1", Some(p1)),
            svc("greeter-v2", Some(p2))
        )
        .as_bytes(),
    )
    .unwrap();
    let route = flock_core::route::SourcedRoute::read(
        "test",
        serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": { "name": "greeter", "namespace": "default" },
            "spec": {
                "parentRefs": [{ "group": "", "kind": "Service", "name": "greeter", "port": 50051 }],
                "rules": [
                    { "matches": [{ "headers": [{ "name": "x-canary", "value": "1" }] }],
                      "backendRefs": [{ "name": "greeter-v2", "port": 50051 }] },
                    { "backendRefs": [
                        { "name": "greeter-v1", "port": 50051, "weight": 90 },
                        { "name": "greeter-v2", "port": 50051, "weight": 10 }] }
                ]
            }
        })
        .to_string()
        .as_bytes(),
    )
    .written
    .unwrap();
    mesh.services[0].routes = route.rules_for("greeter");
    assert!(mesh.resolve_routes().is_empty());
    mesh.validate().unwrap();

    let cache = Arc::new(Cache::by_node_id());
    publish(&cache, &mesh);
    let server = Server::new(Arc::clone(&cache));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let xds = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let serving = tokio::spawn(async move {
        s.serve_tcp(listener, async {
            let _ = stopped.await;
        })
        .await
    });
    let bootstrap = dir.0.join("bootstrap.json");
    std::fs::write(
        &bootstrap,
        format!(
            r#"{{"xds_servers": [{{"server_uri": "{xds}", "channel_creds": [{{"type": "insecure"}}],
                 "server_features": ["xds_v3"]}}],
                "node": {{"id": "{NODE}", "locality": {{"region": "r1"}}}}}}"#
        ),
    )
    .unwrap();
    let (guard, mut stdin, mut stdout) = peer(
        &dir,
        &["client", "xds:///greeter.default:50051"],
        Some(&bootstrap),
    );
    let tallies = tokio::task::spawn_blocking(move || {
        let mut many = |args: &str| {
            writeln!(stdin, "many {args}").unwrap();
            stdin.flush().unwrap();
            let line = read_line(&mut stdout, &guard);
            let counts: std::collections::BTreeMap<String, usize> = line
                .strip_prefix("tally ")
                .unwrap_or_else(|| panic!("{line}"))
                .split_whitespace()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap();
                    (k.to_string(), v.parse().unwrap())
                })
                .collect();
            counts
        };
        let split = many("1000");
        let canary = many("100 x-canary=1");
        (split, canary)
    })
    .await
    .unwrap();
    let (split, canary) = tallies;
    println!("proxyless 90/10 over 1000 calls: {split:?}; canary: {canary:?}");
    let v2 = split.get("v2").copied().unwrap_or(0);
    assert_eq!(
        split.get("v1").copied().unwrap_or(0) + v2,
        1000,
        "{split:?}"
    );
    assert!((50..=150).contains(&v2), "v2 got {v2} of 1000: {split:?}");
    assert_eq!(
        canary,
        std::collections::BTreeMap::from([("v2".to_string(), 100)])
    );
    assert_eq!(server.metrics().counter("flock_xds_nacks_total", "rds"), 0);
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}
