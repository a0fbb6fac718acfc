//! The xDS server's quotas over real sockets and real gRPC clients (tonic, rustls):
//!
//! * the unix socket has connection slots of its own, which TCP/TLS clients cannot
//!   take (mutant `xds-shared-connection-pool`);
//! * a TCP/TLS connection that stalls its handshake, or carries no authorized stream
//!   (a client without a certificate is refused and stays idle), is closed at the idle
//!   timeout and counted, while one holding a stream is kept (mutant
//!   `xds-idle-connections-kept`);
//! * subscriptions over the budget of a connection, a client identity or all clients
//!   are refused with `RESOURCE_EXHAUSTED` naming the budget, while the streams within
//!   budget are served (mutant `xds-unbudgeted-subscriptions`);
//! * a rotated certificate, key and client CA reach new connections without a restart
//!   (mutant `xds-tls-no-reload`).

mod common;

use common::xds::{NODE, any, put};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::google::protobuf::Any;
use flock_testkit::pki::{Leaf, TestCa};
use flock_xds::cache::Cache;
use flock_xds::client::{self, RecvError};
use flock_xds::server::{
    ConnectionLimits, GroupChoice, Limits, Peer, Principal, Server, ServerTls, SubscriptionBudget,
    TlsSettings, Usage, ensure_private_dir,
};
use flock_xds::types::{CLUSTER, ENDPOINT};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

const WAIT: Duration = Duration::from_secs(10);
const TRUST_DOMAIN: &str = "spiffe://test.flock/";

fn id(name: &str) -> String {
    format!("{TRUST_DOMAIN}ns/default/sa/{name}")
}

fn cache() -> Arc<Cache<Any>> {
    let cache = Arc::new(Cache::by_node_id());
    cache.update(NODE, |s| {
        let mut b = s.edit();
        put(&mut b, CLUSTER, "web", "cluster web");
        put(&mut b, ENDPOINT, "web", "10.0.0.1");
        b.build()
    });
    cache
}

/// A unix peer of our uid, or a TLS peer of the trust domain (named by its SPIFFE
/// ID, so the budget's per-client level counts its connections together); anyone
/// else is unauthenticated.
fn policy(peer: &Peer) -> Result<Principal, Status> {
    match peer {
        Peer::Unix { uid, .. } if *uid == nix::unistd::geteuid().as_raw() => Ok(Principal {
            name: format!("uid {uid}"),
            group: GroupChoice::ByNode,
            secrets: true,
        }),
        Peer::Tls {
            spiffe_id: Some(id),
            ..
        } if id.starts_with(TRUST_DOMAIN) => Ok(Principal {
            name: id.clone(),
            group: GroupChoice::Fixed(NODE.into()),
            secrets: false,
        }),
        _ => Err(Status::unauthenticated(format!(
            "{peer}: xDS needs a client certificate"
        ))),
    }
}

fn delta(type_url: &str, subscribe: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(Node {
            id: NODE.into(),
            ..Node::default()
        }),
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        ..DeltaDiscoveryRequest::default()
    }
}

/// The ACK of `resp` (the server sends one response per type at a time).
fn ack(
    resp: &envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse,
) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        ..DeltaDiscoveryRequest::default()
    }
}

fn settings(server: &Leaf, client_ca: &TestCa) -> TlsSettings {
    TlsSettings {
        cert_chain_pem: server.cert_pem.clone(),
        key_pem: server.key_pem.clone().into(),
        client_ca_pem: client_ca.ca_pem.clone(),
    }
}

/// A server on mTLS (a free loopback port) until the returned sender drops.
struct Tls {
    port: u16,
    tls: Arc<ServerTls>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve_tls(server: Server, settings: &TlsSettings) -> Tls {
    let tls = Arc::new(ServerTls::new(settings).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (s, t) = (server.clone(), Arc::clone(&tls));
    tokio::spawn(async move {
        s.serve_tls_reloadable(listener, t, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Tls {
        port,
        tls,
        _stop: stop,
    }
}

impl Tls {
    /// A TLS channel trusting `ca`, presenting `identity` if given.
    async fn try_channel(
        &self,
        ca: &TestCa,
        identity: Option<&Leaf>,
    ) -> Result<Channel, tonic::transport::Error> {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&ca.ca_pem))
            .domain_name("localhost");
        if let Some(leaf) = identity {
            tls = tls.identity(Identity::from_pem(&leaf.cert_pem, &leaf.key_pem));
        }
        Endpoint::from_shared(format!("https://127.0.0.1:{}", self.port))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
    }

    async fn channel(&self, ca: &TestCa, identity: Option<&Leaf>) -> Channel {
        self.try_channel(ca, identity).await.unwrap()
    }
}

/// Waits for `cond`, polling every 20 ms, up to `limit`; false if it never held.
async fn until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// TCP clients fill their pool (two slots; a third is refused at accept), and the
/// node's Envoy still connects on the unix socket and gets its clusters.
#[tokio::test]
async fn tcp_clients_cannot_take_the_unix_sockets_connection_slots() {
    let server = Server::builder(cache())
        .authorizer(policy)
        .connection_limits(ConnectionLimits {
            max_connections: 2,
            max_unix_connections: 2,
            idle_timeout: None,
            ..ConnectionLimits::default()
        })
        .build();
    let metrics = server.metrics().clone();
    let running = common::xds::start_tcp(server.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ensure_private_dir(&run).unwrap();
    let path = run.join("xds.sock");
    let listener = flock_xds::server::bind_unix(&path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (s, p) = (server.clone(), path.clone());
    tokio::spawn(async move {
        s.serve_unix_listener(listener, &p, async {
            let _ = stopped.await;
        })
        .await
    });

    // Stream-less TCP connections take every TCP slot; one more is refused.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", running.port))
                .await
                .unwrap(),
        );
    }
    let mut over = tokio::net::TcpStream::connect(("127.0.0.1", running.port))
        .await
        .unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(WAIT, over.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "the TCP connection over the cap is closed: {read:?}"
    );
    assert!(until(WAIT, || metrics.connections_open() == 2).await);

    // The node's Envoy on the unix socket is served.
    let envoy = async {
        let channel = client::connect(&format!("unix:{}", path.display()))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut ads = client::delta(channel)
            .await
            .map_err(|e| format!("open: {e}"))?;
        ads.send(delta(CLUSTER, &["*"]))
            .map_err(|e| format!("send: {e}"))?;
        ads.recv(WAIT).await.map_err(|e| format!("recv: {e}"))
    };
    let cds = tokio::time::timeout(WAIT, envoy)
        .await
        .unwrap_or_else(|_| Err("timed out".into()));
    let cds = cds.unwrap_or_else(|e| {
        panic!("the node's Envoy on the unix socket got no clusters while TCP clients held their slots: {e}")
    });
    assert_eq!(cds.resources.len(), 1);
    assert_eq!(metrics.connections_refused(), 1);
    drop(held);
    let _ = stop.send(());
    running.stop().await;
}

/// With a 1 s idle timeout: a TCP connection that never starts its TLS handshake is
/// closed (counted as a handshake timeout), a client without a certificate — refused,
/// so it carries no authorized stream — is closed (counted as idle), and a client
/// holding a stream is kept well past the timeout and still gets updates.
#[tokio::test]
async fn connections_without_an_authorized_stream_are_closed_at_the_idle_timeout() {
    const IDLE: Duration = Duration::from_secs(1);
    let ca = TestCa::new("idle");
    let cache = cache();
    let server = Server::builder(Arc::clone(&cache))
        .authorizer(policy)
        .connection_limits(ConnectionLimits {
            idle_timeout: Some(IDLE),
            ..ConnectionLimits::default()
        })
        .build();
    let metrics = server.metrics().clone();
    let tls = serve_tls(server, &settings(&ca.server(), &ca)).await;

    // Authorized, holding a stream.
    let good = tls.channel(&ca, Some(&ca.client(&id("good")))).await;
    let mut kept = client::delta(good).await.unwrap();
    kept.send(delta(ENDPOINT, &["web"])).unwrap();
    let first = kept.recv(WAIT).await.unwrap();
    kept.send(ack(&first)).unwrap();

    // No certificate: the handshake completes, the stream is refused, the connection
    // then carries nothing.
    let anonymous = tls.channel(&ca, None).await;
    let refused = match client::delta(anonymous.clone()).await {
        Err(status) => status,
        Ok(mut ads) => {
            let _ = ads.send(delta(CLUSTER, &["*"]));
            match ads.recv(WAIT).await {
                Err(RecvError::Status(status)) => status,
                other => panic!("a client without a certificate was served: {other:?}"),
            }
        }
    };
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert!(
        until(WAIT, || metrics.connections_idle_closed() == 1).await,
        "the server never closed the connection of a client without a certificate \
         (idle closed: {}, open: {})",
        metrics.connections_idle_closed(),
        metrics.connections_open()
    );
    assert_eq!(
        metrics.connections_open(),
        1,
        "only the authorized connection is left"
    );

    // A stalled handshake.
    let started = Instant::now();
    let mut stalled = tokio::net::TcpStream::connect(("127.0.0.1", tls.port))
        .await
        .unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(WAIT, stalled.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "the server never closed a connection that stalled its TLS handshake: {read:?}"
    );
    let lived = started.elapsed();
    assert!(
        lived >= IDLE - Duration::from_millis(100) && lived < IDLE * 5,
        "closed after {lived:?}, the idle timeout is {IDLE:?}"
    );
    assert!(
        until(WAIT, || metrics.connections_handshake_timeouts() == 1).await,
        "a stalled handshake is counted"
    );

    // The authorized one was never closed: three timeouts later it gets an update.
    tokio::time::sleep(IDLE * 2).await;
    cache.update(NODE, |s| {
        let mut b = s.edit();
        put(&mut b, ENDPOINT, "web", "10.0.0.2");
        b.build()
    });
    let update = kept
        .recv(WAIT)
        .await
        .expect("the authorized stream is kept");
    assert_eq!(
        update.resources[0].resource,
        Some(any(ENDPOINT, "10.0.0.2"))
    );
    assert_eq!(metrics.connections_idle_closed(), 1);
}

/// Budgets of 3 names per connection, 4 per client and 6 in total (1,000 bytes per
/// connection): each level refuses the request that would go over it with
/// `RESOURCE_EXHAUSTED` naming it, and the streams within budget keep being served.
#[tokio::test]
async fn subscriptions_over_budget_are_refused_and_clients_within_budget_are_served() {
    let ca = TestCa::new("budget");
    let cache = cache();
    let server = Server::builder(Arc::clone(&cache))
        .authorizer(policy)
        .limits(Limits {
            subscription_budget: SubscriptionBudget {
                per_connection: Usage {
                    names: 3,
                    bytes: 1000,
                },
                per_client: Usage {
                    names: 4,
                    bytes: 10_000,
                },
                total: Usage {
                    names: 6,
                    bytes: 100_000,
                },
            },
            ..Limits::default()
        })
        .build();
    let metrics = server.metrics().clone();
    let tls = serve_tls(server, &settings(&ca.server(), &ca)).await;
    let (a, b, c) = (
        ca.client(&id("a")),
        ca.client(&id("b")),
        ca.client(&id("c")),
    );

    async fn refused(channel: Channel, names: &[&str], level: &str) -> Status {
        let mut ads = client::delta(channel).await.unwrap();
        ads.send(delta(ENDPOINT, names)).unwrap();
        let status = match ads.recv(WAIT).await {
            Err(RecvError::Status(status)) => status,
            other => panic!(
                "expected RESOURCE_EXHAUSTED for the {level} budget, the request was served: {other:?}"
            ),
        };
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status
                .message()
                .contains(&format!("subscription_budget.{level}")),
            "the refusal names the budget: {status:?}"
        );
        status
    }

    // Client a, connection 1: three names, its whole connection budget.
    let a1 = tls.channel(&ca, Some(&a)).await;
    let mut a_stream = client::delta(a1.clone()).await.unwrap();
    a_stream
        .send(delta(ENDPOINT, &["web", "x1", "x2"]))
        .unwrap();
    let first = a_stream.recv(WAIT).await.unwrap();
    a_stream.send(ack(&first)).unwrap();
    // A fourth name on the same connection (another stream) is over it.
    let status = refused(a1.clone(), &["x3"], "per_connection").await;
    assert!(status.message().contains("4 names"), "{status:?}");
    // Two more on a second connection: within that connection, over the client's 4.
    let a2 = tls.channel(&ca, Some(&a)).await;
    refused(a2, &["x3", "x4"], "per_client").await;
    // Client b takes three: 6 in total, the budget.
    let mut b_stream = client::delta(tls.channel(&ca, Some(&b)).await)
        .await
        .unwrap();
    b_stream
        .send(delta(ENDPOINT, &["web", "y1", "y2"]))
        .unwrap();
    let first = b_stream.recv(WAIT).await.unwrap();
    b_stream.send(ack(&first)).unwrap();
    // Client c's one name is over the total.
    refused(tls.channel(&ca, Some(&c)).await, &["z1"], "total").await;
    // Bytes count like names: one 1,001-byte name is over the connection's 1,000.
    let long = "n".repeat(1001);
    let status = refused(
        tls.channel(&ca, Some(&ca.client(&id("d")))).await,
        &[&long],
        "per_connection",
    )
    .await;
    assert!(status.message().contains("1001 bytes"), "{status:?}");
    assert_eq!(metrics.refused_streams("subscription_budget"), 4);

    // The streams within budget are undisturbed: both get the next update.
    cache.update(NODE, |s| {
        let mut b = s.edit();
        put(&mut b, ENDPOINT, "web", "10.0.0.9");
        b.build()
    });
    for (who, stream) in [("a", &mut a_stream), ("b", &mut b_stream)] {
        let update = stream
            .recv(WAIT)
            .await
            .unwrap_or_else(|e| panic!("client {who} within budget: {e}"));
        assert_eq!(
            update.resources[0].resource,
            Some(any(ENDPOINT, "10.0.0.9"))
        );
    }
    // A refused stream gave nothing back it did not hold, and an ended one gives back
    // what it held: once b leaves, c fits.
    drop(b_stream);
    let mut c_stream = None;
    for _ in 0..100 {
        let mut s = client::delta(tls.channel(&ca, Some(&c)).await)
            .await
            .unwrap();
        s.send(delta(ENDPOINT, &["web"])).unwrap();
        if s.recv(WAIT).await.is_ok() {
            c_stream = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        c_stream.is_some(),
        "b's share was given back when its stream ended"
    );
}

/// The listener's certificate is rotated to one of another CA, with a new client CA:
/// a client that trusts only the new CA is refused before and served after, with a
/// client certificate of the new client CA; a set whose key is not the certificate's
/// is refused and the current one kept.
#[tokio::test]
async fn a_rotated_certificate_key_and_client_ca_reach_new_connections() {
    let (old_ca, new_ca) = (TestCa::new("old"), TestCa::new("new"));
    let server = Server::builder(cache()).authorizer(policy).build();
    let tls = serve_tls(server, &settings(&old_ca.server(), &old_ca)).await;
    let old_client = old_ca.client(&id("old"));
    let new_client = new_ca.client(&id("new"));

    let before = tls.channel(&old_ca, Some(&old_client)).await;
    assert!(
        tls.try_channel(&new_ca, Some(&new_client)).await.is_err(),
        "a client of the new CA cannot verify the old certificate"
    );

    // A key that is not the certificate's is refused; the old set stays.
    let (a, b) = (new_ca.server(), new_ca.server());
    let mismatched = TlsSettings {
        cert_chain_pem: a.cert_pem.clone(),
        key_pem: b.key_pem.clone().into(),
        client_ca_pem: new_ca.ca_pem.clone(),
    };
    let err = tls.tls.replace(&mismatched).unwrap_err();
    assert!(err.to_string().contains("do not go together"), "{err}");
    tls.try_channel(&old_ca, Some(&old_client))
        .await
        .expect("the old set is still served after a refused one");

    tls.tls.replace(&settings(&a, &new_ca)).unwrap();
    let after = tls
        .try_channel(&new_ca, Some(&new_client))
        .await
        .unwrap_or_else(|e| {
            panic!("after the rotation a new connection still got the old certificate: {e:?}")
        });
    let mut ads = client::delta(after).await.unwrap();
    ads.send(delta(CLUSTER, &["*"])).unwrap();
    let cds = ads.recv(WAIT).await.expect("served with the new client CA");
    assert_eq!(cds.resources.len(), 1);
    // The connection made before the rotation goes on.
    let mut old = client::delta(before).await.unwrap();
    old.send(delta(CLUSTER, &["*"])).unwrap();
    old.recv(WAIT)
        .await
        .expect("an established connection is kept");
}
