//! Authenticated xDS transport over real sockets and real gRPC clients: mTLS with
//! certificates made by rcgen (a client without a certificate, one from the trusted
//! CA, one whose principal may not see secrets), unix peer credentials of a process
//! running under another uid (Python grpcio under `setpriv`; root only, the `peers`
//! tier), the connection and per-connection stream caps, a real `EMFILE` on accept,
//! and the socket directory checks of `bind_unix` / `ensure_private_dir`.
//!
//! The snapshot every test serves holds a secret whose body contains `PRIVATE KEY`: a
//! test that must leak no key checks every byte it received for that string.

mod common;

use common::xds::{NODE, any, put};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::cluster::v3::cluster_discovery_service_client::ClusterDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::protobuf::Any;
use flock_testkit::pki::{Leaf, TestCa};
use flock_xds::cache::Cache;
use flock_xds::client::{self, RecvError};
use flock_xds::server::{
    ConnectionLimits, GroupChoice, Peer, Principal, Server, TlsSettings, bind_unix,
    bind_unix_with_mode, ensure_private_dir,
};
use flock_xds::types::{CLUSTER, ENDPOINT, SECRET};
use prost::Message;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

const WAIT: Duration = Duration::from_secs(10);
/// The secret's body: what must never reach a client without `secrets`.
const KEY_BODY: &str =
    "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA\n-----END PRIVATE KEY-----\n";
const TRUST_DOMAIN: &str = "spiffe://test.flock/";
const ENVOY_ID: &str = "spiffe://test.flock/ns/flock/sa/envoy";
const GRPC_ID: &str = "spiffe://test.flock/ns/default/sa/greeter";

/// Node `n1`'s snapshot: a cluster, its endpoints, and a secret with a private key.
fn cache() -> Arc<Cache<Any>> {
    let cache = Arc::new(Cache::by_node_id());
    cache.update(NODE, |s| {
        let mut b = s.edit();
        put(&mut b, CLUSTER, "web", "cluster web");
        put(&mut b, ENDPOINT, "web", "10.0.0.1");
        put(&mut b, SECRET, "svid", KEY_BODY);
        b.build()
    });
    cache
}

/// The node a client claims: `n1`, and it says it is Envoy.
fn envoy_node() -> Node {
    Node {
        id: NODE.into(),
        user_agent_name: "envoy".into(),
        ..Node::default()
    }
}

fn sotw(type_url: &str, names: &[&str]) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(envoy_node()),
        type_url: type_url.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        ..DiscoveryRequest::default()
    }
}

fn delta(type_url: &str, subscribe: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(envoy_node()),
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        ..DeltaDiscoveryRequest::default()
    }
}

/// The authorizer of these tests: the agent's policy in miniature. A unix peer with
/// our euid, or a TLS peer with the Envoy SPIFFE ID, is the node's Envoy (its group
/// by node, secrets); another SPIFFE ID of the trust domain is a proxyless client
/// (group `n1` fixed — which holds the secret, so only `secrets: false` keeps it
/// out); no certificate or plain TCP is unauthenticated; anyone else is denied.
fn policy(peer: &Peer) -> Result<Principal, Status> {
    let euid = nix::unistd::geteuid().as_raw();
    match peer {
        Peer::Unix { uid, .. } if *uid == euid => Ok(Principal {
            name: format!("uid {uid}"),
            group: GroupChoice::ByNode,
            secrets: true,
        }),
        Peer::Unix { uid, .. } => Err(Status::permission_denied(format!(
            "uid {uid} may not use xDS"
        ))),
        Peer::Tls {
            spiffe_id: Some(id),
            ..
        } if id == ENVOY_ID => Ok(Principal {
            name: id.clone(),
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
        Peer::Tls { .. } if peer.has_certificate() => Err(Status::permission_denied(format!(
            "{peer} is not in the trust domain"
        ))),
        _ => Err(Status::unauthenticated(format!(
            "{peer}: xDS needs a client certificate"
        ))),
    }
}

/// A server serving mTLS on a free 127.0.0.1 port until dropped.
struct TlsRunning {
    server: Server,
    port: u16,
    ca_pem: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve_tls(pki: &TestCa) -> TlsRunning {
    serve_tls_with(pki, Server::builder(cache()).authorizer(policy).build()).await
}

async fn serve_tls_with(pki: &TestCa, server: Server) -> TlsRunning {
    let leaf = pki.server();
    let tls = TlsSettings {
        cert_chain_pem: leaf.cert_pem,
        key_pem: leaf.key_pem.into(),
        client_ca_pem: pki.ca_pem.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    tokio::spawn(async move {
        s.serve_tls(listener, tls, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    TlsRunning {
        server,
        port,
        ca_pem: pki.ca_pem.clone(),
        _stop: stop,
    }
}

impl TlsRunning {
    /// A TLS channel that trusts the server's CA, presenting `identity` if given.
    async fn channel(&self, identity: Option<&Leaf>) -> Channel {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
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
            .unwrap()
    }
}

/// Every byte a client received: no private key may be among them.
#[derive(Default)]
struct Received(Vec<u8>);

impl Received {
    fn add(&mut self, msg: &impl Message) {
        self.0.extend(msg.encode_to_vec());
    }
    fn status(&mut self, status: &Status) {
        self.0.extend(status.message().as_bytes());
        self.0.extend(status.details());
    }
    fn assert_no_private_key(&self) {
        let needle = b"PRIVATE KEY";
        assert!(
            !self.0.windows(needle.len()).any(|w| w == needle),
            "a private key reached the client"
        );
    }
}

fn expect_code<T: std::fmt::Debug>(result: Result<T, Status>, code: Code, what: &str) -> Status {
    match result {
        Err(status) if status.code() == code => status,
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

fn expect_recv_code<T: std::fmt::Debug>(
    result: Result<T, RecvError>,
    code: Code,
    what: &str,
) -> Status {
    match result {
        Err(RecvError::Status(status)) if status.code() == code => status,
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

/// A TLS client without a certificate that claims to be Envoy gets `UNAUTHENTICATED`
/// on every RPC — SotW and Delta ADS, the per-type SDS and CDS services, stream and
/// fetch — and not one resource; each refusal is counted.
#[tokio::test]
async fn a_tls_client_without_a_certificate_gets_unauthenticated_and_nothing() {
    let pki = TestCa::new("trusted");
    let running = serve_tls(&pki).await;
    let channel = running.channel(None).await;
    let mut received = Received::default();

    let s = expect_code(
        client::sotw(channel.clone()).await,
        Code::Unauthenticated,
        "SotW ADS",
    );
    received.status(&s);
    let s = expect_code(
        client::delta(channel.clone()).await,
        Code::Unauthenticated,
        "Delta ADS",
    );
    received.status(&s);
    let mut sds = SecretDiscoveryServiceClient::new(channel.clone());
    let s = expect_code(
        sds.stream_secrets(tokio_stream::iter([sotw(SECRET, &[])]))
            .await,
        Code::Unauthenticated,
        "SDS stream",
    );
    received.status(&s);
    let s = expect_code(
        sds.delta_secrets(tokio_stream::iter([delta(SECRET, &["*"])]))
            .await,
        Code::Unauthenticated,
        "SDS delta",
    );
    received.status(&s);
    let s = expect_code(
        sds.fetch_secrets(sotw(SECRET, &[])).await,
        Code::Unauthenticated,
        "SDS fetch",
    );
    received.status(&s);
    let mut cds = ClusterDiscoveryServiceClient::new(channel);
    let s = expect_code(
        cds.fetch_clusters(sotw(CLUSTER, &[])).await,
        Code::Unauthenticated,
        "CDS fetch",
    );
    received.status(&s);

    received.assert_no_private_key();
    let m = running.server.metrics();
    assert_eq!(m.unauthorized("unauthenticated"), 6);
    assert_eq!(m.unauthorized("permission_denied"), 0);
    assert_eq!(m.streams_open(), 0, "no stream was ever opened");
    let text = m.render_prometheus();
    assert!(
        text.contains("flock_xds_unauthorized_total{reason=\"unauthenticated\"} 6"),
        "{text}"
    );
}

/// A client certificate from another CA is no identity: the handshake itself fails
/// (rustls verifies it against the configured client CA), so it reaches nothing.
#[tokio::test]
async fn a_certificate_from_another_ca_gets_nothing() {
    let pki = TestCa::new("trusted");
    let running = serve_tls(&pki).await;
    let rogue = TestCa::new("rogue").client(ENVOY_ID);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&running.ca_pem))
        .domain_name("localhost")
        .identity(Identity::from_pem(&rogue.cert_pem, &rogue.key_pem));
    let endpoint = Endpoint::from_shared(format!("https://127.0.0.1:{}", running.port))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    // TLS 1.3: the client may finish its side before the server rejects its
    // certificate, so the refusal can surface at connect or at the first RPC.
    if let Ok(channel) = endpoint.connect().await {
        let result = client::sotw(channel).await;
        assert!(result.is_err(), "a rogue certificate opened a stream");
    }
    assert_eq!(running.server.metrics().streams_open(), 0);
}

/// A client with the Envoy certificate of the trusted CA gets its node's resources
/// over SotW and Delta, secrets included.
#[tokio::test]
async fn a_trusted_envoy_certificate_gets_resources_and_secrets() {
    let pki = TestCa::new("trusted");
    let running = serve_tls(&pki).await;
    let envoy = pki.client(ENVOY_ID);
    let mut ads = client::sotw(running.channel(Some(&envoy)).await)
        .await
        .unwrap();
    ads.send(sotw(CLUSTER, &[])).unwrap();
    let cds = ads.recv(WAIT).await.unwrap();
    assert_eq!(cds.resources, vec![any(CLUSTER, "cluster web")]);

    let mut ads = client::delta(running.channel(Some(&envoy)).await)
        .await
        .unwrap();
    ads.send(delta(SECRET, &["*"])).unwrap();
    let sds = ads.recv(WAIT).await.unwrap();
    assert_eq!(sds.resources.len(), 1);
    assert_eq!(
        sds.resources[0].resource.as_ref().unwrap(),
        &any(SECRET, KEY_BODY),
        "the authenticated Envoy gets its secret"
    );
    assert_eq!(running.server.metrics().unauthorized("unauthenticated"), 0);
}

/// A principal without `secrets` (a proxyless client of the trust domain, fixed to a
/// group whose snapshot holds a secret) gets non-secret resources, and
/// `PERMISSION_DENIED` for SDS however it asks: ADS SotW (wildcard and named), ADS
/// Delta (wildcard and named), the per-type SDS service (stream, delta, fetch). No
/// byte it receives contains a private key.
#[tokio::test]
async fn a_principal_without_secrets_is_refused_sds_however_it_asks() {
    let pki = TestCa::new("trusted");
    let running = serve_tls(&pki).await;
    let grpc = pki.client(GRPC_ID);
    let channel = running.channel(Some(&grpc)).await;
    let mut received = Received::default();

    // Non-secret resources flow on the same stream until it asks for SDS.
    let mut ads = client::sotw(channel.clone()).await.unwrap();
    ads.send(sotw(CLUSTER, &[])).unwrap();
    let cds = ads.recv(WAIT).await.unwrap();
    received.add(&cds);
    assert_eq!(cds.resources, vec![any(CLUSTER, "cluster web")]);
    for names in [&[][..], &["svid"][..]] {
        let mut ads = client::sotw(channel.clone()).await.unwrap();
        ads.send(sotw(SECRET, names)).unwrap();
        let s = expect_recv_code(ads.recv(WAIT).await, Code::PermissionDenied, "SotW ADS SDS");
        received.status(&s);
    }
    for names in [&["*"][..], &["svid"][..], &[][..]] {
        let mut ads = client::delta(channel.clone()).await.unwrap();
        ads.send(delta(SECRET, names)).unwrap();
        let s = expect_recv_code(
            ads.recv(WAIT).await,
            Code::PermissionDenied,
            "Delta ADS SDS",
        );
        received.status(&s);
    }
    let mut sds = SecretDiscoveryServiceClient::new(channel.clone());
    let s = expect_code(
        sds.stream_secrets(tokio_stream::iter([sotw(SECRET, &[])]))
            .await,
        Code::PermissionDenied,
        "SDS stream",
    );
    received.status(&s);
    let s = expect_code(
        sds.delta_secrets(tokio_stream::iter([delta(SECRET, &["*"])]))
            .await,
        Code::PermissionDenied,
        "SDS delta",
    );
    received.status(&s);
    let s = expect_code(
        sds.fetch_secrets(sotw(SECRET, &["svid"])).await,
        Code::PermissionDenied,
        "SDS fetch",
    );
    received.status(&s);
    // Its fetch of a non-secret type works, from its fixed group.
    let mut cds = ClusterDiscoveryServiceClient::new(channel);
    let fetched = cds.fetch_clusters(sotw(CLUSTER, &[])).await.unwrap();
    received.add(fetched.get_ref());
    assert_eq!(fetched.get_ref().resources.len(), 1);

    received.assert_no_private_key();
    assert_eq!(running.server.metrics().unauthorized("secrets"), 8);
}

/// The connection cap: with `max_connections = 2`, a third connection is closed as
/// soon as it is accepted and counted; once one of the two closes, a new one is
/// served.
#[tokio::test]
async fn the_connection_over_the_cap_is_closed_and_a_freed_slot_is_reused() {
    use tokio::io::AsyncReadExt;
    let server = Server::builder(cache())
        .connection_limits(ConnectionLimits {
            max_connections: 2,
            ..ConnectionLimits::default()
        })
        .build();
    let running = common::xds::start_tcp(server).await;
    let metrics = running.server.metrics().clone();
    let mut first = running.sotw().await;
    first.send(sotw(CLUSTER, &[])).unwrap();
    first.recv(WAIT).await.unwrap();
    let mut second = running.sotw().await;
    second.send(sotw(CLUSTER, &[])).unwrap();
    second.recv(WAIT).await.unwrap();
    assert_eq!(metrics.connections_open(), 2);

    let mut third = tokio::net::TcpStream::connect(("127.0.0.1", running.port))
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(WAIT, third.read(&mut buf))
        .await
        .expect("the server closes a connection over the cap at once");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "closed without a byte: {read:?}"
    );
    assert_eq!(metrics.connections_refused(), 1);
    assert_eq!(metrics.connections_open(), 2);

    drop(first);
    common::eventually("the closed connection's slot to free", WAIT, async || {
        (metrics.connections_open() == 1).then_some(())
    })
    .await;
    let mut fourth = running.sotw().await;
    fourth.send(sotw(CLUSTER, &[])).unwrap();
    let cds = fourth.recv(WAIT).await.unwrap();
    assert_eq!(cds.resources, vec![any(CLUSTER, "cluster web")]);
    assert_eq!(metrics.connections_refused(), 1);
    drop(second);
    drop(fourth);
    running.stop().await;
}

/// The stream cap of one connection (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`): with
/// 2 allowed, a third stream on the same connection is not opened while two are, and
/// is once one of them ends.
#[tokio::test]
async fn a_connection_carries_at_most_its_stream_cap() {
    let server = Server::builder(cache())
        .connection_limits(ConnectionLimits {
            max_concurrent_streams_per_connection: 2,
            ..ConnectionLimits::default()
        })
        .build();
    let running = common::xds::start_tcp(server).await;
    let channel = client::connect(&running.target).await.unwrap();
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut ads = client::sotw(channel.clone()).await.unwrap();
        ads.send(sotw(CLUSTER, &[])).unwrap();
        ads.recv(WAIT).await.unwrap();
        open.push(ads);
    }
    assert_eq!(running.server.metrics().streams_open(), 2);
    // The client holds the third stream back until the server's limit allows it.
    let third = tokio::spawn(client::sotw(channel.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await; // must NOT open meanwhile
    assert!(!third.is_finished(), "a third stream opened past the cap");
    assert_eq!(running.server.metrics().streams_open(), 2);
    let first = open.remove(0);
    drop(first.close());
    let mut ads = tokio::time::timeout(WAIT, third)
        .await
        .expect("the third stream opens once a slot frees")
        .unwrap()
        .unwrap();
    ads.send(sotw(CLUSTER, &[])).unwrap();
    let cds = ads.recv(WAIT).await.unwrap();
    assert_eq!(cds.resources, vec![any(CLUSTER, "cluster web")]);
}

/// `ensure_private_dir` creates a missing directory 0700; `bind_unix` makes the
/// socket 0600 and `bind_unix_with_mode` 0660, leaving nothing else behind, and
/// replaces a stale socket.
#[tokio::test]
async fn private_dir_and_socket_modes() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("run/flock");
    ensure_private_dir(&dir).unwrap();
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&dir), 0o700);
    ensure_private_dir(&dir).unwrap();

    let path = dir.join("xds.sock");
    let listener = bind_unix(&path).unwrap();
    assert_eq!(mode(&path), 0o600);
    drop(listener);
    // The socket file outlives its listener: a restart replaces it.
    let _listener = bind_unix_with_mode(&path, 0o660).unwrap();
    assert_eq!(mode(&path), 0o660);
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("xds.sock")]);
    // A regular file at the path is not ours to replace.
    let file = dir.join("file");
    std::fs::write(&file, "x").unwrap();
    let err = bind_unix(&file).unwrap_err();
    assert!(err.to_string().contains("not a socket"), "{err}");
}

/// The directory checks: a symlinked directory, a group- or other-writable directory,
/// and a symlink at the socket path are refused with an error naming the path and
/// what is wrong, and nothing is created or chmod'ed through them.
#[test]
fn unsafe_socket_directories_and_paths_are_refused() {
    let base = tempfile::tempdir().unwrap();
    let real = base.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();

    let link = base.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let err = ensure_private_dir(&link).unwrap_err();
    assert!(err.to_string().contains("symlink"), "{err}");
    assert!(err.to_string().contains(&*link.to_string_lossy()), "{err}");
    let err = bind_unix(&link.join("xds.sock")).unwrap_err();
    assert!(err.to_string().contains("symlink"), "{err}");
    assert!(!real.join("xds.sock").exists());

    for bad in [0o770, 0o702, 0o777] {
        let dir = base.path().join(format!("open-{bad:o}"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(bad)).unwrap();
        let err = ensure_private_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("can write"), "{bad:o}: {err}");
        let err = bind_unix(&dir.join("xds.sock")).unwrap_err();
        assert!(err.to_string().contains(&format!("{bad:04o}")), "{err}");
        assert!(!dir.join("xds.sock").exists());
    }

    // A symlink at the socket path (to a file elsewhere): refused, its target untouched.
    let target = base.path().join("target");
    std::fs::write(&target, "x").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
    let sock = real.join("xds.sock");
    std::os::unix::fs::symlink(&target, &sock).unwrap();
    let err = bind_unix(&sock).unwrap_err();
    assert!(err.to_string().contains("symlink"), "{err}");
    assert_eq!(
        std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
        0o644
    );
    assert!(
        std::fs::symlink_metadata(&sock)
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

/// Peer credentials on a unix socket: a process running as uid 65534 (Python grpcio
/// under `setpriv`, a real gRPC client) gets `PERMISSION_DENIED` and no response; the
/// refusal is counted; a client with our uid is served. The socket is 0666 and its
/// directory 0755 here so the kernel lets the other uid connect at all: peer
/// credentials are the layer under test. Needs root (the `peers` tier).
#[tokio::test]
async fn root_a_unix_peer_with_another_uid_is_refused_and_counted() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test runs a client as another uid and needs root (run it in the peers tier)"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("xds.sock");
    let listener = bind_unix_with_mode(&path, 0o666).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = Server::builder(cache()).authorizer(policy).build();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let p = path.clone();
    let task = tokio::spawn(async move {
        s.serve_unix_listener(listener, &p, async {
            let _ = stopped.await;
        })
        .await
    });

    // Our uid: served.
    let mut ads = client::sotw(
        client::connect(&format!("unix:{}", path.display()))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    ads.send(sotw(SECRET, &["svid"])).unwrap();
    let sds = ads.recv(WAIT).await.unwrap();
    assert_eq!(sds.resources, vec![any(SECRET, KEY_BODY)]);

    // uid 65534: refused before its request is read.
    let script = r#"
import grpc, os, sys, threading
# grpc's default :authority for a unix target is the path, which HTTP/2 servers
# (hyper) refuse as malformed; Envoy's pipe clusters send a host name too.
channel = grpc.insecure_channel("unix:" + sys.argv[1], options=[("grpc.default_authority", "localhost")])
call = channel.stream_stream(
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources")
def requests():
    yield bytes.fromhex(sys.argv[2])
    threading.Event().wait(20)  # keep the stream open: the server must end it
try:
    for response in call(requests(), timeout=15):
        print("RESPONSE", response.hex(), flush=True)
        os._exit(0)
    print("ENDED", flush=True)
except grpc.RpcError as e:
    print("STATUS", e.code().name, flush=True)
    print(e.details(), file=sys.stderr)
"#;
    let request = hex(&sotw(SECRET, &[]).encode_to_vec());
    let output = tokio::process::Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(common::grpc_python())
        .arg("-c")
        .arg(script)
        .arg(&path)
        .arg(&request)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        stdout.trim(),
        "STATUS PERMISSION_DENIED",
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!stdout.contains(&hex(b"PRIVATE KEY")));
    assert_eq!(server.metrics().unauthorized("permission_denied"), 1);

    let _ = stop.send(());
    drop(ads);
    task.await.unwrap().unwrap();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Accept errors do not spin: a helper process (this test binary, re-run as
/// [`emfile_helper_process`]) serves xDS, then uses up its file descriptors. A client
/// connects, so every `accept` fails with a real `EMFILE` while the connection waits in
/// the backlog; over a second the helper burns almost no CPU (it pauses on the accept
/// backoff instead of retrying at once). Once it frees its descriptors, the waiting
/// connection is accepted and served.
#[tokio::test]
async fn accept_errors_do_not_spin() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "emfile_helper_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FLOCK_XDS_EMFILE_HELPER", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut port = None;
    loop {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("the helper reports")
            .unwrap()
            .expect("the helper exited early");
        // libtest prints "test emfile_helper_process ... " before the helper's output.
        if let Some((_, p)) = line.split_once("HELPER port=") {
            port = Some(p.parse::<u16>().unwrap());
        }
        if line.ends_with("HELPER full") {
            break;
        }
    }
    let port = port.unwrap();
    // Connected by the kernel (backlog); the helper cannot accept it.
    let _waiting = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let cpu_before = cpu_ticks(pid);
    let window = Duration::from_secs(2);
    tokio::time::sleep(window).await; // a measurement window, not synchronization
    let used = cpu_ticks(pid) - cpu_before;
    // Clock ticks are 1/100 s: a spinning loop uses ~200 in 2 s; the backoff pauses
    // at most 8 times in that window.
    assert!(
        used < 40,
        "the helper used {used} ticks of CPU in {window:?} while accept failed"
    );

    stdin.write_all(b"free\n").await.unwrap();
    stdin.flush().await.unwrap();
    let channel = client::connect(&format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    let mut ads = client::sotw(channel).await.unwrap();
    ads.send(sotw(CLUSTER, &[])).unwrap();
    let cds = ads.recv(WAIT).await.unwrap();
    assert_eq!(cds.resources, vec![any(CLUSTER, "cluster web")]);
    drop(stdin);
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> i64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may contain spaces) start at field 3.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    fields[11].parse::<i64>().unwrap() + fields[12].parse::<i64>().unwrap()
}

/// The server side of [`accept_errors_do_not_spin`], run in its own process (it
/// exhausts its file descriptors). Does nothing unless that test started it.
#[test]
#[ignore = "a helper process of accept_errors_do_not_spin"]
fn emfile_helper_process() {
    if std::env::var_os("FLOCK_XDS_EMFILE_HELPER").is_none() {
        return;
    }
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 256, hard.min(256)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = Server::new(cache());
        tokio::spawn(async move {
            server
                .serve_tcp(listener, std::future::pending())
                .await
                .unwrap()
        });
        println!("HELPER port={port}");
        // Use up every descriptor.
        let mut held = Vec::new();
        loop {
            match std::fs::File::open("/dev/null") {
                Ok(f) => held.push(f),
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EMFILE as i32) => break,
                Err(e) => panic!("{e}"),
            }
        }
        println!("HELPER full");
        // Wait for "free" on stdin (read on a blocking thread: stdin needs no new fd).
        let line = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(line.trim(), "free");
        drop(held);
        // Serve until the parent goes away (stdin closes).
        tokio::task::spawn_blocking(|| {
            let mut rest = String::new();
            let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
        })
        .await
        .unwrap();
    });
}

/// An access log sink that keeps what it is given: (log name, HTTP path).
#[derive(Default)]
struct KeptLogs(std::sync::Mutex<Vec<(String, String)>>);

impl flock_xds::server::accesslog::AccessLogSink for KeptLogs {
    fn http(
        &self,
        log_name: &str,
        entry: &envoy_types::pb::envoy::data::accesslog::v3::HttpAccessLogEntry,
    ) {
        let path = entry
            .request
            .as_ref()
            .map(|r| r.path.clone())
            .unwrap_or_default();
        self.0.lock().unwrap().push((log_name.to_string(), path));
    }
    fn tcp(
        &self,
        log_name: &str,
        _: &envoy_types::pb::envoy::data::accesslog::v3::TcpAccessLogEntry,
    ) {
        self.0
            .lock()
            .unwrap()
            .push((log_name.to_string(), String::new()));
    }
}

/// Envoy's access log service (what the agent counts denials from) takes entries
/// from the principal trusted with secrets (the node's Envoy) only: a proxyless
/// client of the trust domain is refused, and one without a certificate is
/// unauthenticated, before an entry reaches the sink. The node's Envoy's entries
/// arrive with the log name its stream's first message gave (real tonic client over
/// mTLS).
#[tokio::test]
async fn access_logs_are_taken_from_the_nodes_envoy_only() {
    use envoy_types::pb::envoy::data::accesslog::v3::{HttpAccessLogEntry, HttpRequestProperties};
    use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsMessage;
    use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_client::AccessLogServiceClient;
    use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::{
        HttpAccessLogEntries, Identifier, LogEntries,
    };

    let pki = TestCa::new(TRUST_DOMAIN);
    let kept = Arc::new(KeptLogs::default());
    let server = Server::builder(cache())
        .authorizer(policy)
        .access_log_sink(Arc::clone(&kept) as Arc<dyn flock_xds::server::accesslog::AccessLogSink>)
        .build();
    let running = serve_tls_with(&pki, server).await;
    let message = |name: Option<&str>, path: &str| StreamAccessLogsMessage {
        identifier: name.map(|n| Identifier {
            node: Some(envoy_node()),
            log_name: n.to_string(),
        }),
        log_entries: Some(LogEntries::HttpLogs(HttpAccessLogEntries {
            log_entry: vec![HttpAccessLogEntry {
                request: Some(HttpRequestProperties {
                    path: path.to_string(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
        })),
    };
    let send = |channel: Channel, messages: Vec<StreamAccessLogsMessage>| async move {
        AccessLogServiceClient::new(channel)
            .stream_access_logs(tokio_stream::iter(messages))
            .await
    };

    let grpc = pki.client(GRPC_ID);
    let refused = send(
        running.channel(Some(&grpc)).await,
        vec![message(Some("l"), "/x")],
    )
    .await;
    assert_eq!(refused.unwrap_err().code(), Code::PermissionDenied);
    let anonymous = send(running.channel(None).await, vec![message(Some("l"), "/x")]).await;
    assert_eq!(anonymous.unwrap_err().code(), Code::Unauthenticated);
    assert!(
        kept.0.lock().unwrap().is_empty(),
        "a refused peer's entries reached the sink"
    );

    let envoy = pki.client(ENVOY_ID);
    send(
        running.channel(Some(&envoy)).await,
        vec![message(Some("denials"), "/a"), message(None, "/b")],
    )
    .await
    .unwrap();
    assert_eq!(
        *kept.0.lock().unwrap(),
        [
            ("denials".to_string(), "/a".to_string()),
            ("denials".to_string(), "/b".to_string())
        ]
    );
}
