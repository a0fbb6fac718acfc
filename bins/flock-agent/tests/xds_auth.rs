//! The real agent's xDS trust boundary, with real gRPC clients (tonic, flock-xds's raw
//! ADS client) over the agent's real listeners:
//!
//! * a process of another uid (the test binary itself, re-run under `setpriv --reuid
//!   65534`) on the unix socket gets `PERMISSION_DENIED` and nothing, unless it is
//!   `--envoy-uid`: then it reaches the socket the agent handed it and gets its keys;
//! * a TLS client without a certificate that claims to be Envoy gets `UNAUTHENTICATED`
//!   and nothing;
//! * a TLS client with a certificate of the trust domain (proxyless gRPC) gets
//!   non-secret resources only, and `PERMISSION_DENIED` for secrets.
//!
//! And the agent's memory itself: it is not dumpable (no same-uid process reads it).
//!
//! Every refused client is checked for every byte it received: never `PRIVATE KEY`.
//! Each test first shows, with an allowed client on the same agent, that the key *is*
//! there to leak (a meshed pod with an SVID from the built-in CA), so a refusal is not
//! an empty snapshot. Needs root (setpriv to another uid): the `peers` tier.

mod common;

use common::{Agent, NetNs, WAIT, web_add_request};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use flock_cni::client as cni;
use flock_cni::proto::v1::{AddPodRequest, Outcome};
use flock_testkit::eventually;
use flock_testkit::pki::{Leaf, TestCa};
use flock_xds::client::{self, RecvError};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
use prost::Message;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

const T: Duration = Duration::from_secs(5);
const ENVOY_ID: &str = "spiffe://cluster.local/ns/flock/sa/envoy";
const GRPC_ID: &str = "spiffe://cluster.local/ns/default/sa/greeter";
const ALL_TYPES: [&str; 5] = [LISTENER, CLUSTER, ROUTE, ENDPOINT, SECRET];
/// Set in the environment of the re-run test binary: the xDS target it probes.
const CLIENT_TARGET_ENV: &str = "FLOCK_XDS_AUTH_CLIENT_TARGET";

/// A meshed pod (`web`, gRPC on port 8080, in a real network namespace, which the
/// caller keeps) through the agent's CNI socket: with the built-in CA it gets an SVID,
/// so the Envoy group's snapshot holds its private key.
async fn add_meshed_pod(agent: &Agent) -> NetNs {
    let ns = NetNs::new("xdsauth");
    let req = AddPodRequest {
        // gRPC: proxyless clients get resources for it too.
        annotations: HashMap::from([
            ("flock.io/service".to_string(), "web".to_string()),
            ("flock.io/ports".to_string(), "8080/grpc".to_string()),
        ]),
        ..web_add_request("c-web", "web-0", "10.7.0.2/24", &ns.path())
    };

    let resp = cni::call(
        &agent.cni_socket,
        T,
        |mut c| async move { c.add_pod(req).await },
    )
    .await
    .unwrap();
    assert_eq!(resp.outcome, Outcome::Success as i32, "{}", resp.message);
    ns
}

/// A node that claims to be Envoy (what any client can write).
fn claimed_envoy() -> Node {
    Node {
        id: "sidecar~10.0.0.1~envoy.flock~flock.svc".into(),
        cluster: "flock".into(),
        user_agent_name: "envoy".into(),
        ..Node::default()
    }
}

/// Every byte a client received (messages and statuses).
#[derive(Default)]
struct Received {
    bytes: Vec<u8>,
    /// (type URL, resources) per response.
    responses: Vec<(String, usize)>,
    /// The status each stream ended with (`None`: still open at the deadline).
    codes: Vec<(String, Option<Code>)>,
}

impl std::fmt::Debug for Received {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Received")
            .field("bytes", &self.bytes.len())
            .field("private_key", &self.has_private_key())
            .field("responses", &self.responses)
            .field("codes", &self.codes)
            .finish()
    }
}

impl Received {
    fn has_private_key(&self) -> bool {
        let needle = b"PRIVATE KEY";
        self.bytes.windows(needle.len()).any(|w| w == needle)
    }

    fn status(&mut self, what: String, status: &Status) {
        self.bytes.extend(status.message().as_bytes());
        self.bytes.extend(status.details());
        self.codes.push((what, Some(status.code())));
    }

    fn to_line(&self) -> String {
        let codes: Vec<String> = self
            .codes
            .iter()
            .map(|(w, c)| format!("{w}={}", c.map_or(-1, |c| c as i32)))
            .collect();
        format!(
            "RESULT responses={} private_key={} codes={}",
            self.responses.iter().map(|(_, n)| n).sum::<usize>(),
            self.has_private_key(),
            codes.join(",")
        )
    }
}

/// Asks for every type, wildcard, over Delta and over SotW ADS, as a client claiming
/// to be Envoy, and records all it gets within `wait` per stream.
async fn probe(channel: &Channel, wait: Duration) -> Received {
    let mut got = Received::default();
    for type_url in ALL_TYPES {
        let short = type_url.rsplit('.').next().unwrap_or(type_url);
        match client::delta(channel.clone()).await {
            Err(s) => got.status(format!("delta:{short}"), &s),
            Ok(mut ads) => {
                let _ = ads.send(DeltaDiscoveryRequest {
                    node: Some(claimed_envoy()),
                    type_url: type_url.into(),
                    resource_names_subscribe: vec!["*".into()],
                    ..Default::default()
                });
                match ads.recv(wait).await {
                    Ok(resp) => {
                        got.bytes.extend(resp.encode_to_vec());
                        got.responses.push((type_url.into(), resp.resources.len()));
                        got.codes.push((format!("delta:{short}"), None));
                    }
                    Err(RecvError::Status(s)) => got.status(format!("delta:{short}"), &s),
                    Err(_) => got.codes.push((format!("delta:{short}"), None)),
                }
            }
        }
        match client::sotw(channel.clone()).await {
            Err(s) => got.status(format!("sotw:{short}"), &s),
            Ok(mut ads) => {
                let _ = ads.send(DiscoveryRequest {
                    node: Some(claimed_envoy()),
                    type_url: type_url.into(),
                    ..Default::default()
                });
                match ads.recv(wait).await {
                    Ok(resp) => {
                        got.bytes.extend(resp.encode_to_vec());
                        got.responses.push((type_url.into(), resp.resources.len()));
                        got.codes.push((format!("sotw:{short}"), None));
                    }
                    Err(RecvError::Status(s)) => got.status(format!("sotw:{short}"), &s),
                    Err(_) => got.codes.push((format!("sotw:{short}"), None)),
                }
            }
        }
    }
    got
}

/// Asserts that a Delta wildcard SDS stream on `channel` delivers a private key within
/// [`WAIT`], ACKing each response without one: the positive control (an allowed Envoy
/// does get keys from this agent).
async fn assert_sds_delivers_a_private_key(channel: &Channel) {
    let mut ads = client::delta(channel.clone()).await.unwrap();
    ads.send(DeltaDiscoveryRequest {
        node: Some(claimed_envoy()),
        type_url: SECRET.into(),
        resource_names_subscribe: vec!["*".into()],
        ..Default::default()
    })
    .unwrap();
    eventually("a private key over SDS", WAIT, async || {
        let resp = ads
            .recv(WAIT)
            .await
            .expect("an allowed Envoy gets the pod's SVID over SDS");
        let has_key = resp
            .encode_to_vec()
            .windows(11)
            .any(|w| w == b"PRIVATE KEY");
        if !has_key {
            ads.send(DeltaDiscoveryRequest {
                type_url: SECRET.into(),
                response_nonce: resp.nonce.clone(),
                ..Default::default()
            })
            .unwrap();
        }
        has_key
    })
    .await;
}

/// Not a test on its own: the client the uid test runs as another user (it re-runs
/// this test binary under `setpriv` with [`CLIENT_TARGET_ENV`] set). Prints one
/// `RESULT` line.
#[tokio::test]
#[ignore = "run by a_process_of_another_uid_on_the_socket_gets_permission_denied_and_nothing"]
async fn other_uid_client() {
    let target = std::env::var(CLIENT_TARGET_ENV).expect("run by the uid test");
    let got = match client::connect(&target).await {
        Ok(channel) => probe(&channel, T).await,
        Err(e) => panic!("connecting to {target}: {e}"),
    };
    println!("{}", got.to_line());
}

/// A process of another uid on the agent's unix socket (made reachable for the test:
/// the agent's own 0700 directory and 0600 socket would stop it before the agent
/// sees it) gets `PERMISSION_DENIED` on every stream, no resource of any type, and no
/// private key, though root on the same socket gets the pod's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_of_another_uid_on_the_socket_gets_permission_denied_and_nothing() {
    let agent = Agent::start(&[]);
    let _pod = add_meshed_pod(&agent).await;
    let root = client::connect(&agent.xds_target()).await.unwrap();
    assert_sds_delivers_a_private_key(&root).await;

    // Let uid 65534 reach the socket: only the agent's check stands in its way now.
    let run_dir = agent.xds_socket.parent().unwrap();
    for (path, mode) in [
        (agent.dir.path(), 0o711),
        (run_dir, 0o711),
        (agent.xds_socket.as_path(), 0o666),
    ] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let line = probe_as_uid_65534(&agent);
    assert!(
        line.contains("responses=0 "),
        "a client of another uid got xDS responses: {line}"
    );
    assert!(
        line.contains("private_key=false "),
        "a private key reached a client of another uid: {line}"
    );
    let denied = Code::PermissionDenied as i32;
    let codes = line.split("codes=").nth(1).unwrap();
    assert_eq!(codes.split(',').count(), 2 * ALL_TYPES.len(), "{line}");
    for code in codes.split(',') {
        assert!(code.ends_with(&format!("={denied}")), "{line}");
    }
    let metrics = agent.get("/metrics").1;
    assert!(
        metrics.lines().any(|l| l
            .starts_with("flock_xds_unauthorized_total{reason=\"permission_denied\"}")
            && !l.ends_with(" 0")),
        "the refusals are counted: {metrics}"
    );
}

/// Runs [`other_uid_client`] against `agent`'s socket as uid/gid 65534 (this test
/// binary re-run under `setpriv`); its `RESULT` line.
fn probe_as_uid_65534(agent: &Agent) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(&exe)
        .args(["--ignored", "--exact", "other_uid_client", "--nocapture"])
        .env(CLIENT_TARGET_ENV, agent.xds_target())
        .output()
        .expect("setpriv (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the uid-65534 client failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line: {stdout}"))
        .to_owned()
}

/// With `--envoy-uid 65534` the agent hands the socket to that uid (0600, owner 65534)
/// and makes its directory traversable but not listable or writable (0711): a process
/// of that uid connects without any help and is served as the node's Envoy, keys
/// included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envoy_uid_reaches_the_socket_and_gets_its_keys() {
    use std::os::unix::fs::MetadataExt;
    let agent = Agent::start(&["--envoy-uid", "65534"]);
    let _pod = add_meshed_pod(&agent).await;
    let socket = std::fs::symlink_metadata(&agent.xds_socket).unwrap();
    assert_eq!((socket.uid(), socket.mode() & 0o777), (65534, 0o600));
    let dir = std::fs::metadata(agent.xds_socket.parent().unwrap()).unwrap();
    assert_eq!((dir.uid(), dir.mode() & 0o777), (0, 0o711));
    // The test's own temp dir is 0700: let the uid through it (the agent's dirs are
    // what is under test).
    std::fs::set_permissions(agent.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let root = client::connect(&agent.xds_target()).await.unwrap();
    assert_sds_delivers_a_private_key(&root).await;
    let line = probe_as_uid_65534(&agent);
    assert!(line.contains("private_key=true "), "{line}");
    assert!(!line.contains("=7"), "no PERMISSION_DENIED: {line}");
    // CAP_CHOWN (and CAP_SETPCAP) served the chown only: gone from every thread, in
    // every set, once the workers have parked.
    const SYS_ADMIN: u64 = 1 << 21;
    common::wait_for(
        "every agent thread to hold CAP_SYS_ADMIN only",
        WAIT,
        || {
            agent
                .thread_capabilities()
                .iter()
                .all(|(_, [inh, prm, eff, bnd, amb])| {
                    *inh == 0 && *amb == 0 && [prm, eff, bnd].iter().all(|s| **s & !SYS_ADMIN == 0)
                })
        },
    );
}

/// The agent is not dumpable (`PR_SET_DUMPABLE=0`), so another process of its own uid
/// can neither attach to it nor read its memory through /proc: the kernel makes a
/// non-dumpable process's /proc files root's. Shown with the agent run as uid 65534
/// (`--dev`, unprivileged) beside a control process of the same uid, whose /proc files
/// stay its own.
#[test]
fn the_agent_is_not_dumpable() {
    use common::{ChildGuard, http_get, wait_for};
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let as_nobody = |program: &str| {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            program,
        ])
        .env("TMPDIR", dir.path());
        cmd
    };
    let mut agent = as_nobody(common::AGENT_BIN);
    // Port 0: the agent logs the address it bound.
    agent.args(["--dev", "--admin-address", "127.0.0.1:0"]);
    let mut agent = ChildGuard::spawn(agent, dir.path().join("agent.log"));
    let admin = agent.bound_address("admin");
    wait_for("the unprivileged agent's /readyz", WAIT, || {
        assert!(agent.running(), "{}", agent.log_text());
        matches!(http_get(&admin, "/readyz"), Ok((200, _)))
    });
    let mut control = as_nobody("sleep");
    control.arg("60");
    let control = ChildGuard::spawn(control, dir.path().join("control.log"));
    // Until setpriv has exec'd `sleep`, its uid change leaves it non-dumpable.
    wait_for("the control to exec sleep", WAIT, || {
        std::fs::read_to_string(format!("/proc/{}/comm", control.pid()))
            .is_ok_and(|c| c.trim() == "sleep")
    });
    let owner = |pid: u32| {
        std::fs::metadata(format!("/proc/{pid}/environ"))
            .unwrap()
            .uid()
    };
    assert_eq!(owner(control.pid()), 65534, "the control is dumpable");
    assert_eq!(owner(agent.pid()), 0, "the agent is not dumpable");
}

/// The in-test CA and the directory the agent's TLS files are written to.
struct Pki {
    dir: tempfile::TempDir,
    ca: TestCa,
}

impl Pki {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            ca: TestCa::new("flock xDS test"),
        }
    }

    fn client(&self, spiffe_id: &str) -> Leaf {
        self.ca.client(spiffe_id)
    }

    /// Writes the server's files and returns the agent's TLS flags for `port`.
    fn agent_flags(&self, port: u16) -> Vec<String> {
        let server = self.ca.server();
        let write = |name: &str, text: &str| {
            let p = self.dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p.to_str().unwrap().to_owned()
        };
        vec![
            "--xds-address".into(),
            format!("127.0.0.1:{port}"),
            "--xds-tls-cert".into(),
            write("server.pem", &server.cert_pem),
            "--xds-tls-key".into(),
            write("server-key.pem", &server.key_pem),
            "--xds-tls-client-ca".into(),
            write("ca.pem", &self.ca.ca_pem),
            "--xds-envoy-spiffe-id".into(),
            ENVOY_ID.into(),
        ]
    }

    /// A TLS channel to the agent's port that trusts the CA, presenting `identity`.
    async fn channel(&self, port: u16, identity: Option<&Leaf>) -> Channel {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca.ca_pem))
            .domain_name("localhost");
        if let Some(leaf) = identity {
            tls = tls.identity(Identity::from_pem(&leaf.cert_pem, &leaf.key_pem));
        }
        Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .unwrap()
    }
}

/// Starts the agent with mTLS xDS on a port of its own choosing (the in-test CA), and
/// one meshed pod.
async fn tls_agent(pki: &Pki) -> (Agent, u16, NetNs) {
    let flags = pki.agent_flags(0);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut agent = Agent::start(&flags);
    let port = agent
        .proc
        .bound_address("xds_mtls")
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("the xDS address's port");
    let pod = add_meshed_pod(&agent).await;
    (agent, port, pod)
}

/// A TCP client without a client certificate that claims to be Envoy gets
/// `UNAUTHENTICATED` on every stream, no resource of any type, and no private key,
/// though a client with the listed Envoy certificate gets the pod's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_without_a_certificate_claiming_envoy_gets_unauthenticated_and_nothing() {
    let pki = Pki::new();
    let (agent, port, _pod) = tls_agent(&pki).await;
    let envoy = pki.client(ENVOY_ID);
    assert_sds_delivers_a_private_key(&pki.channel(port, Some(&envoy)).await).await;

    let anonymous = pki.channel(port, None).await;
    let got = probe(&anonymous, T).await;
    assert!(!got.has_private_key(), "a private key reached it: {got:?}");
    assert!(got.responses.is_empty(), "{got:?}");
    assert_eq!(got.codes.len(), 2 * ALL_TYPES.len());
    for (what, code) in &got.codes {
        assert_eq!(*code, Some(Code::Unauthenticated), "{what}: {got:?}");
    }
    let metrics = agent.get("/metrics").1;
    assert!(
        metrics.lines().any(|l| l
            .starts_with("flock_xds_unauthorized_total{reason=\"unauthenticated\"}")
            && !l.ends_with(" 0")),
        "the refusals are counted: {metrics}"
    );
}

/// A client certificate of the trust domain (a proxyless gRPC client) gets the gRPC
/// group's resources, never a secret: every SDS request is `PERMISSION_DENIED`, and no
/// byte it receives holds a private key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_of_the_trust_domain_gets_only_non_secret_resources() {
    let pki = Pki::new();
    let (_agent, port, _pod) = tls_agent(&pki).await;
    let envoy = pki.client(ENVOY_ID);
    assert_sds_delivers_a_private_key(&pki.channel(port, Some(&envoy)).await).await;

    let grpc = pki.channel(port, Some(&pki.client(GRPC_ID))).await;
    // The gRPC group is published on its own schedule: wait for the pod's service.
    eventually(
        "the gRPC client to get the service's listener",
        WAIT,
        async || listeners_of(&grpc).await > 0,
    )
    .await;
    let got = probe(&grpc, Duration::from_secs(2)).await;
    assert!(!got.has_private_key(), "a private key reached it: {got:?}");
    assert!(
        got.responses.iter().all(|(t, _)| t != SECRET),
        "no SDS response: {got:?}"
    );
    assert!(
        got.responses.iter().any(|(t, n)| t == LISTENER && *n > 0),
        "non-secret resources flow: {got:?}"
    );
    for (what, code) in &got.codes {
        if what.ends_with(":Secret") {
            assert_eq!(*code, Some(Code::PermissionDenied), "{what}: {got:?}");
        } else {
            assert_ne!(*code, Some(Code::PermissionDenied), "{what}: {got:?}");
            assert_ne!(*code, Some(Code::Unauthenticated), "{what}: {got:?}");
        }
    }
}

/// The agent's mTLS listener picks up a rotated certificate, key and client CA
/// without a restart: the files are replaced by ones of a new CA, and a new connection
/// that trusts only the new CA, with a client certificate of it, is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mtls_listener_serves_rotated_certificates_without_a_restart() {
    let pki = Pki::new();
    let (_agent, port, _pod) = tls_agent(&pki).await;
    let before = pki.channel(port, Some(&pki.client(GRPC_ID))).await;

    let new_ca = TestCa::new("rotated xDS CA");
    let try_new = async || {
        let client = new_ca.client(GRPC_ID);
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&new_ca.ca_pem))
            .domain_name("localhost")
            .identity(Identity::from_pem(&client.cert_pem, &client.key_pem));
        Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
    };
    assert!(
        try_new().await.is_err(),
        "a client of the new CA cannot verify the old certificate"
    );
    // Each file replaced by a rename, as a Secret volume or cert-manager does.
    let server = new_ca.server();
    for (name, text) in [
        ("server.pem", &server.cert_pem),
        ("server-key.pem", &server.key_pem),
        ("ca.pem", &new_ca.ca_pem),
    ] {
        let tmp = pki.dir.path().join(format!(".{name}.new"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, pki.dir.path().join(name)).unwrap();
    }
    let rotated = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(channel) = try_new().await {
                return channel;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!("after the rotation a new connection still got the old certificate ({WAIT:?})")
    });
    assert!(
        listeners_of(&rotated).await > 0,
        "served with the new client CA"
    );
    drop(before);
}

/// How many listeners a SotW wildcard LDS request on `channel` returns (0 on error).
async fn listeners_of(channel: &Channel) -> usize {
    let Ok(mut ads) = client::sotw(channel.clone()).await else {
        return 0;
    };
    let _ = ads.send(DiscoveryRequest {
        node: Some(claimed_envoy()),
        type_url: LISTENER.into(),
        ..Default::default()
    });
    ads.recv(T).await.map_or(0, |r| r.resources.len())
}

/// Set in the environment of the re-run test binary: the CNI socket it calls.
const CNI_SOCKET_ENV: &str = "FLOCK_CNI_AUTH_CLIENT_SOCKET";

/// Not a test on its own: the CNI client the CNI uid test runs as another user. Sends
/// one ADD of a meshed pod and prints `RESULT code=<gRPC code> outcome=<outcome>`.
#[tokio::test]
#[ignore = "run by a_process_of_another_uid_on_the_cni_socket_is_refused_and_meshes_nothing"]
async fn other_uid_cni_client() {
    let socket = std::env::var(CNI_SOCKET_ENV).expect("run by the CNI uid test");
    let mut client = cni::connect(std::path::Path::new(&socket))
        .await
        .expect("connecting to the CNI socket");
    let req = web_add_request("c-forged", "forged-0", "10.7.0.9/24", "/var/run/netns/none");

    match client.add_pod(req).await {
        Ok(resp) => println!("RESULT code=0 outcome={}", resp.into_inner().outcome),
        Err(status) => println!("RESULT code={} outcome=none", status.code() as i32),
    }
}

/// A process of another uid on the agent's CNI socket (made reachable for the test,
/// as above: the agent's own modes would stop it first) cannot report a pod: its ADD
/// gets `PERMISSION_DENIED` from the peer-credential check, and no pod is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_of_another_uid_on_the_cni_socket_is_refused_and_meshes_nothing() {
    let agent = Agent::start(&[]);
    for (path, mode) in [
        (agent.dir.path(), 0o711),
        (agent.cni_socket.as_path(), 0o666),
    ] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(&exe)
        .args([
            "--ignored",
            "--exact",
            "other_uid_cni_client",
            "--nocapture",
        ])
        .env(CNI_SOCKET_ENV, &agent.cni_socket)
        .output()
        .expect("setpriv (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the uid-65534 CNI client failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line: {stdout}"));
    assert_eq!(
        line,
        format!("RESULT code={} outcome=none", Code::PermissionDenied as i32),
        "a CNI client of another uid was served instead of refused: {stdout}"
    );
    let pods = agent.get("/debug/pods").1;
    assert!(
        !pods.contains("forged-0"),
        "a refused ADD stored a pod: {pods}"
    );
}
