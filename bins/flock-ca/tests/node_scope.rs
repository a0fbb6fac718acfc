//! The node-scoped signer, end to end: the real `flock-ca` binary, real TLS, two nodes'
//! credentials.
//!
//! Root on node A has A's disk (its node credential) and its agent's memory (the keys
//! of A's own pods). These tests show that with both it cannot obtain a certificate for
//! a pod on node B: the signer refuses, and nothing on A's disk can sign a certificate
//! the trust domain accepts.
//!
//! The Kubernetes API is flock-kube's API-server double (no API server can run here):
//! it serves real k8s-openapi Pods over HTTP as the API does, and the signer's GET of a
//! pod by name goes through kube's real client.

use flock_bird::identity::ca_dir::{self, verify_svid_chain};
use flock_ca::client::{Client, ClientError, SignerAddress};
use flock_kube::double::ApiServer;
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

const TD: &str = "cluster.local";

struct Signer {
    child: Child,
    addr: SignerAddress,
    dir: tempfile::TempDir,
    api: ApiServer,
}

impl Drop for Signer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pod(ns: &str, name: &str, node: &str, sa: &str, uid: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            service_account_name: Some(sa.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// A root and an issuer under it, in the layout `--ca-dir` reads.
fn make_ca(dir: &Path) -> PathBuf {
    let now = flock_clock::unix_now();
    let day = Duration::from_secs(24 * 3600);
    let root = dir.join("root");
    std::fs::create_dir(&root).unwrap();
    let (cert, key) = ca_dir::generate_root(TD, now, Duration::from_secs(60), day * 30).unwrap();
    write(&root.join(ca_dir::ROOT_CERT_FILE), &cert);
    write(&root.join(ca_dir::ROOT_KEY_FILE), key.expose());
    let ca = dir.join("ca");
    std::fs::create_dir(&ca).unwrap();
    issue_into(&root, &ca, "one");
    ca
}

fn issue_into(root: &Path, ca: &Path, name: &str) {
    let now = flock_clock::unix_now();
    let (cert, key, roots) = ca_dir::generate_issuer(
        root,
        name,
        now,
        Duration::from_secs(60),
        Duration::from_secs(24 * 3600),
    )
    .unwrap();
    // Key first, then the certificates: the watcher may read between writes and must
    // then see a mismatched set, which it refuses, never half of one it accepts.
    write(&ca.join(ca_dir::CA_KEY_FILE), key.expose());
    write(&ca.join(ca_dir::CERT_CHAIN_FILE), &format!("{cert}{roots}"));
    write(&ca.join(ca_dir::ROOT_CERT_FILE), &roots);
    write(&ca.join(ca_dir::CA_CERT_FILE), &cert);
}

fn node_credential(ca: &Path, node: &str, out: &Path) {
    let status = Command::new(env!("CARGO_BIN_EXE_flock-ca"))
        .args(["node-credential", "--trust-domain", TD, "--node", node])
        .arg("--ca-dir")
        .arg(ca)
        .arg("--out")
        .arg(out)
        .status()
        .expect("run flock-ca node-credential");
    assert!(
        status.success(),
        "flock-ca node-credential --node {node}: {status}"
    );
}

async fn start() -> Signer {
    let dir = tempfile::tempdir().unwrap();
    let ca = make_ca(dir.path());
    let api = ApiServer::start().await;
    api.apply(&pod("shop", "web-a", "node-a", "web", "uid-web-a"));
    api.apply(&pod("pay", "api-b", "node-b", "api", "uid-api-b"));
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    for node in ["node-a", "node-b"] {
        node_credential(&ca, node, &dir.path().join(node));
    }
    let port = flock_testkit::reserve_port_for_child();
    let child = Command::new(env!("CARGO_BIN_EXE_flock-ca"))
        .args(["serve", "--trust-domain", TD, "--kube", "--svid-ttl", "600"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--ca-dir")
        .arg(&ca)
        .args(["--listen", &format!("127.0.0.1:{}", port.port())])
        .spawn()
        .expect("spawn flock-ca serve");
    let addr = SignerAddress {
        url: format!("https://127.0.0.1:{}", port.port()),
        server_name: flock_ca::DEFAULT_SERVER_NAME.into(),
        timeout: Duration::from_secs(5),
    };
    let signer = Signer {
        child,
        addr,
        dir,
        api,
    };
    let a = signer.node_dir("node-a");
    let addr = signer.addr.clone();
    flock_testkit::eventually(
        "flock-ca to accept node-a",
        Duration::from_secs(30),
        async || Client::connect(&addr, &a).await.map(|_| ()),
    )
    .await;
    drop(port);
    signer
}

impl Signer {
    fn node_dir(&self, node: &str) -> PathBuf {
        self.dir.path().join(node)
    }

    async fn as_node(&self, node: &str) -> Client {
        Client::connect(&self.addr, &self.node_dir(node))
            .await
            .unwrap_or_else(|e| panic!("{node} connects: {e}"))
    }
}

fn new_key() -> rcgen::KeyPair {
    rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap()
}

fn roots(dir: &Path) -> String {
    std::fs::read_to_string(dir.join(flock_ca::files::BUNDLE)).unwrap()
}

fn leaf_uri(chain_pem: &str) -> String {
    let der = pem_first(chain_pem);
    flock_ca::server::uri_san(&der).expect("one URI SAN")
}

/// The first certificate of a PEM chain, DER.
fn pem_first(chain_pem: &str) -> Vec<u8> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain_pem.as_bytes()).expect("PEM");
    pem.contents
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_gets_its_own_pods_certificate_and_never_another_nodes() {
    let signer = start().await;
    let mut a = signer.as_node("node-a").await;

    // A's own pod, as its own account: signed, for exactly that identity, verifiable
    // against the trust domain's roots.
    let key = new_key();
    let ok = a
        .sign_workload(&key, "shop", "web-a", "uid-web-a", "web")
        .await
        .expect("node-a gets web-a's certificate");
    assert_eq!(
        leaf_uri(&ok.cert_chain_pem),
        format!("spiffe://{TD}/ns/shop/sa/web")
    );
    verify_svid_chain(&ok.cert_chain_pem, &ok.bundle_pem, flock_clock::unix_now())
        .expect("the workload certificate verifies against the bundle");

    // B's pod, asked by A (with or without B's UID, which A could learn from the API):
    // refused, naming the pod's node.
    for uid in ["uid-api-b", ""] {
        match a
            .sign_workload(&new_key(), "pay", "api-b", uid, "api")
            .await
        {
            Err(ClientError::Refused { code, message }) => {
                assert_eq!(code, tonic::Code::PermissionDenied, "{message}");
                assert!(
                    message.contains("runs on node \"node-b\", not on \"node-a\""),
                    "{message}"
                );
            }
            other => panic!("node-a asked for node-b's pod and got {other:?}"),
        }
    }
    // Its own pod under another account, and a pod that does not exist: refused.
    for (ns, pod, sa, needle) in [
        ("shop", "web-a", "admin", "runs as service account \"web\""),
        ("pay", "api-a", "api", "does not exist"),
    ] {
        match a.sign_workload(&new_key(), ns, pod, "", sa).await {
            Err(ClientError::Refused { code, message }) => {
                assert_eq!(code, tonic::Code::PermissionDenied);
                assert!(message.contains(needle), "{message}");
            }
            other => panic!("{ns}/{pod} as {sa}: {other:?}"),
        }
    }
    // B asks for its own pod: signed.
    let mut b = signer.as_node("node-b").await;
    let ok = b
        .sign_workload(&new_key(), "pay", "api-b", "uid-api-b", "api")
        .await
        .expect("node-b gets api-b's certificate");
    assert_eq!(
        leaf_uri(&ok.cert_chain_pem),
        format!("spiffe://{TD}/ns/pay/sa/api")
    );
    // The pod moves to node-a (deleted and recreated there): only now may A have it.
    assert!(signer.api.delete::<Pod>(Some("pay"), "api-b"));
    signer
        .api
        .apply(&pod("pay", "api-b", "node-a", "api", "uid-api-b2"));
    a.sign_workload(&new_key(), "pay", "api-b", "uid-api-b2", "api")
        .await
        .expect("the pod now runs on node-a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_on_a_nodes_disk_can_sign_or_stand_in_for_a_node() {
    let signer = start().await;
    let dir_a = signer.node_dir("node-a");
    // A's disk holds its node credential and the bundle, no issuer: the credential's
    // key signing a leaf for B's identity makes a chain the trust domain refuses.
    let names: Vec<String> = std::fs::read_dir(&dir_a)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, ["bundle.pem", "node-cert.pem", "node-key.pem"]);
    let node_cert = std::fs::read_to_string(dir_a.join("node-cert.pem")).unwrap();
    let node_key = std::fs::read_to_string(dir_a.join("node-key.pem")).unwrap();
    let der = pem_first(&node_cert);
    let issuer = rcgen::Issuer::from_ca_cert_der(
        &der.clone().into(),
        rcgen::KeyPair::from_pem(&node_key).unwrap(),
    )
    .unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = vec![rcgen::SanType::URI(
        format!("spiffe://{TD}/ns/pay/sa/api").try_into().unwrap(),
    )];
    let forged = params.signed_by(&new_key(), &issuer).unwrap();
    let forged_chain = format!("{}{}", forged.pem(), node_cert);
    let e = verify_svid_chain(&forged_chain, &roots(&dir_a), flock_clock::unix_now())
        .expect_err("a leaf signed with the node credential's key must not verify");
    assert!(!e.is_empty());

    // A workload certificate (what A's agent holds in memory) is not a node
    // credential: the signer refuses it before reading the request.
    let mut a = signer.as_node("node-a").await;
    let key = new_key();
    let web = a
        .sign_workload(&key, "shop", "web-a", "", "web")
        .await
        .expect("web-a's certificate");
    let wl = signer.dir.path().join("workload-as-node");
    std::fs::create_dir(&wl).unwrap();
    write(&wl.join("node-cert.pem"), &web.cert_chain_pem);
    write(&wl.join("node-key.pem"), &key.serialize_pem());
    write(&wl.join("bundle.pem"), &web.bundle_pem);
    let mut c = Client::connect(&signer.addr, &wl)
        .await
        .expect("TLS accepts a verified certificate");
    match c
        .sign_workload(&new_key(), "shop", "web-a", "", "web")
        .await
    {
        Err(ClientError::Refused { code, message }) => {
            assert_eq!(code, tonic::Code::PermissionDenied);
            assert!(message.contains("is not a node credential"), "{message}");
        }
        other => panic!("a workload certificate used as a node credential: {other:?}"),
    }

    // Without a client certificate the TLS handshake itself fails.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(roots(&dir_a)))
        .domain_name(flock_ca::DEFAULT_SERVER_NAME);
    let anon = tonic::transport::Channel::from_shared(signer.addr.url.clone())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await;
    let refused = match anon {
        Err(_) => true,
        Ok(ch) => flock_ca::proto::signer_client::SignerClient::new(ch)
            .renew_node(flock_ca::proto::RenewNodeRequest { csr_der: vec![1] })
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_credentials_renew_and_the_issuer_rotates() {
    let signer = start().await;
    let dir_a = signer.node_dir("node-a");
    let before = std::fs::read_to_string(dir_a.join("node-cert.pem")).unwrap();
    let mut a = signer.as_node("node-a").await;
    a.renew_node().await.expect("node-a renews its credential");
    let after = std::fs::read_to_string(dir_a.join("node-cert.pem")).unwrap();
    assert_ne!(before, after, "the renewal wrote a new certificate");
    assert_eq!(leaf_uri(&after), format!("spiffe://{TD}/flock/node/node-a"));
    // The renewed credential authenticates (a new connection reads the new files).
    let mut a = signer.as_node("node-a").await;
    let first = a
        .sign_workload(&new_key(), "shop", "web-a", "", "web")
        .await
        .expect("signed with the renewed credential");

    // A new issuer under the same root: the signer re-reads its CA directory and signs
    // with it; the old node credential keeps working (same root).
    issue_into(
        &signer.dir.path().join("root"),
        &signer.dir.path().join("ca"),
        "two",
    );
    let issuer_of = |chain: &str| -> String {
        let (_, pem) = x509_parser::pem::parse_x509_pem(chain.as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        cert.issuer().to_string()
    };
    let old_issuer = issuer_of(&first.cert_chain_pem);
    assert!(old_issuer.contains("flock issuer one"), "{old_issuer}");
    flock_testkit::eventually(
        "leaves signed by the new issuer",
        Duration::from_secs(30),
        async || {
            let mut a = Client::connect(&signer.addr, &dir_a)
                .await
                .map_err(|e| e.to_string())?;
            let s = a
                .sign_workload(&new_key(), "shop", "web-a", "", "web")
                .await
                .map_err(|e| e.to_string())?;
            let issuer = issuer_of(&s.cert_chain_pem);
            if issuer.contains("flock issuer two") {
                verify_svid_chain(&s.cert_chain_pem, &s.bundle_pem, flock_clock::unix_now())?;
                Ok(())
            } else {
                Err(issuer)
            }
        },
    )
    .await;
}
