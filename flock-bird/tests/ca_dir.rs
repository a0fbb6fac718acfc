//! The built-in CA under a shared trust root (`--ca-dir`): SVIDs of two nodes with
//! different issuers under one root pass a real TLS handshake (rustls client and server,
//! each verifying the other against its own bundle and checking the SPIFFE ID), per-node
//! CAs without a shared root do not; a Kubernetes-style atomic `..data` symlink swap
//! re-issues every SVID under the new issuer with old and new roots in the bundle; a bad
//! set is refused with a reason and the old one kept.

use flock_bird::identity::ca_dir::{
    self, CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE, ROOT_KEY_FILE,
};
use flock_bird::identity::{
    BuiltinCa, CLOCK_SKEW, CaReload, IdentityError, IdentityProvider, PodIdentity, Svid,
};
use flock_core::UnixMs;
use flock_core::pod::PodKey;
use flock_testkit::wait_for_async;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore, ServerConfig,
    ServerConnection,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use x509_parser::prelude::{FromDer as _, GeneralName, X509Certificate};

const TD: &str = "cluster.local";
const TTL: Duration = Duration::from_secs(3600);

fn now() -> UnixMs {
    flock_clock::unix_now()
}

fn pod(container: &str, ns: &str, sa: &str) -> PodIdentity {
    PodIdentity {
        key: PodKey::new(container, "eth0"),
        namespace: ns.to_string(),
        service_account: sa.to_string(),
        pod_name: format!("pod-{container}"),
        pod_uid: format!("uid-{container}"),
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// A root CA directory (`root-cert.pem`, `root-key.pem`), as `flock-agent ca init` writes.
fn root(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir(&dir).unwrap();
    let (cert, key) =
        ca_dir::generate_root(TD, now(), CLOCK_SKEW, Duration::from_secs(86400)).unwrap();
    write(&dir.join(ROOT_CERT_FILE), &cert);
    write(&dir.join(ROOT_KEY_FILE), key.expose());
    dir
}

/// The files of a `--ca-dir` set: an issuer signed by `root_dir`'s root, trusting
/// `trusted_roots` (PEM; the issuing root's own when `None`).
fn issuer_files(
    root_dir: &Path,
    name: &str,
    trusted_roots: Option<&str>,
) -> Vec<(&'static str, String)> {
    let (cert, key, roots) = ca_dir::generate_issuer(
        root_dir,
        name,
        now(),
        CLOCK_SKEW,
        Duration::from_secs(86400),
    )
    .unwrap();
    vec![
        (CA_CERT_FILE, cert.clone()),
        (CA_KEY_FILE, key.expose().to_string()),
        (CERT_CHAIN_FILE, format!("{cert}{roots}")),
        (ROOT_CERT_FILE, trusted_roots.unwrap_or(&roots).to_string()),
    ]
}

fn write_set(dir: &Path, files: &[(&'static str, String)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, text) in files {
        write(&dir.join(name), text);
    }
}

fn read_root(root_dir: &Path) -> String {
    std::fs::read_to_string(root_dir.join(ROOT_CERT_FILE)).unwrap()
}

/// Subscribes `pod` and returns its SVID and the CA's bundle (PEM) from the view.
async fn svid_and_bundle(ca: &BuiltinCa, pod: &PodIdentity) -> (Arc<Svid>, String) {
    let id = ca.subscribe(pod).await.expect("subscribe");
    let view = ca.view().borrow().clone();
    (view.svids[&id].clone(), view.bundles[TD].ca_pem.clone())
}

fn certs(pem: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("PEM certificates")
}

fn roots(pem: &str) -> Arc<RootCertStore> {
    let mut store = RootCertStore::empty();
    for c in certs(pem) {
        store.add(c).expect("root");
    }
    Arc::new(store)
}

fn spiffe_id_of(der: &[u8]) -> Option<String> {
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    })
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What a mesh client does with the server's certificate: chain to its own bundle
/// (webpki), then require the expected SPIFFE ID (no DNS name in an X.509-SVID).
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: Arc<RootCertStore>,
    expected: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match spiffe_id_of(end_entity) {
            Some(id) if id == self.expected => Ok(ServerCertVerified::assertion()),
            other => Err(rustls::Error::General(format!(
                "server SPIFFE ID {other:?}, expected {}",
                self.expected
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A full TLS 1.3 handshake, in memory, between a client presenting `client` and
/// trusting `client_bundle`, and a server presenting `server` and requiring a client
/// certificate that chains to `server_bundle`. Returns the SPIFFE ID the server saw.
fn mtls_handshake(
    client: &Svid,
    client_bundle: &str,
    server: &Svid,
    server_bundle: &str,
) -> Result<String, rustls::Error> {
    let key = |svid: &Svid| {
        PrivateKeyDer::from_pem_slice(svid.private_key_pem.expose().as_bytes()).unwrap()
    };
    let server_config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(roots(server_bundle), provider())
                .build()
                .expect("client verifier"),
        )
        .with_single_cert(certs(&server.cert_chain_pem), key(server))?;
    let client_config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(SpiffeServerVerifier {
            roots: roots(client_bundle),
            expected: server.spiffe_id.clone(),
            provider: provider(),
        }))
        .with_client_auth_cert(certs(&client.cert_chain_pem), key(client))?;
    let mut c = ClientConnection::new(
        Arc::new(client_config),
        ServerName::try_from("svid.invalid").unwrap(),
    )?;
    let mut s = ServerConnection::new(Arc::new(server_config))?;
    for _ in 0..10 {
        let mut wire = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut wire).unwrap();
        }
        if !wire.is_empty() {
            s.read_tls(&mut wire.as_slice()).unwrap();
            s.process_new_packets()?;
        }
        let mut wire = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut wire).unwrap();
        }
        if !wire.is_empty() {
            c.read_tls(&mut wire.as_slice()).unwrap();
            c.process_new_packets()?;
        }
        if !c.is_handshaking() && !s.is_handshaking() {
            let peer = s.peer_certificates().expect("client certificate");
            return Ok(spiffe_id_of(&peer[0]).expect("SPIFFE ID"));
        }
    }
    panic!("handshake did not finish in 10 flights");
}

#[tokio::test]
async fn svids_of_two_issuers_under_one_root_pass_mtls_both_ways() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root(tmp.path(), "root");
    write_set(&tmp.path().join("a"), &issuer_files(&r, "node-a", None));
    write_set(&tmp.path().join("b"), &issuer_files(&r, "node-b", None));
    let a = BuiltinCa::from_ca_dir(TD, TTL, now, &tmp.path().join("a")).expect("CA a");
    let b = BuiltinCa::from_ca_dir(TD, TTL, now, &tmp.path().join("b")).expect("CA b");
    let (svid_a, bundle_a) = svid_and_bundle(&a, &pod("c1", "shop", "front")).await;
    let (svid_b, bundle_b) = svid_and_bundle(&b, &pod("c2", "shop", "cart")).await;

    // Leaf + its issuer (never the root); the bundle is root-cert.pem.
    assert_eq!(certs(&svid_a.cert_chain_pem).len(), 2);
    assert_eq!(certs(&bundle_a), certs(&read_root(&r)));
    assert_ne!(
        certs(&svid_a.cert_chain_pem)[1],
        certs(&svid_b.cert_chain_pem)[1],
        "the two nodes have different issuers"
    );

    // A calls B, and B calls A: each verifies the other against its own bundle.
    let seen = mtls_handshake(&svid_a, &bundle_a, &svid_b, &bundle_b).expect("A -> B");
    assert_eq!(seen, "spiffe://cluster.local/ns/shop/sa/front");
    let seen = mtls_handshake(&svid_b, &bundle_b, &svid_a, &bundle_a).expect("B -> A");
    assert_eq!(seen, "spiffe://cluster.local/ns/shop/sa/cart");
}

#[tokio::test]
async fn per_node_cas_without_a_shared_root_fail_the_handshake() {
    let a = BuiltinCa::new(TD, TTL, now).unwrap();
    let b = BuiltinCa::new(TD, TTL, now).unwrap();
    let (svid_a, bundle_a) = svid_and_bundle(&a, &pod("c1", "shop", "front")).await;
    let (svid_b, bundle_b) = svid_and_bundle(&b, &pod("c2", "shop", "cart")).await;
    // Each node's own SVIDs do verify against its own bundle (the test's handshake works).
    let (svid_a2, _) = svid_and_bundle(&a, &pod("c3", "shop", "cart")).await;
    mtls_handshake(&svid_a, &bundle_a, &svid_a2, &bundle_a).expect("same node");

    let err = mtls_handshake(&svid_a, &bundle_a, &svid_b, &bundle_b).expect_err("A -> B");
    assert!(
        matches!(
            err,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)
        ),
        "{err:?}"
    );

    // The same holds for two shared-root sets under *different* roots.
    let tmp = tempfile::tempdir().unwrap();
    let r1 = root(tmp.path(), "r1");
    let r2 = root(tmp.path(), "r2");
    write_set(&tmp.path().join("a"), &issuer_files(&r1, "node-a", None));
    write_set(&tmp.path().join("b"), &issuer_files(&r2, "node-b", None));
    let a = BuiltinCa::from_ca_dir(TD, TTL, now, &tmp.path().join("a")).unwrap();
    let b = BuiltinCa::from_ca_dir(TD, TTL, now, &tmp.path().join("b")).unwrap();
    let (svid_a, bundle_a) = svid_and_bundle(&a, &pod("c1", "shop", "front")).await;
    let (svid_b, bundle_b) = svid_and_bundle(&b, &pod("c2", "shop", "cart")).await;
    let err = mtls_handshake(&svid_a, &bundle_a, &svid_b, &bundle_b).expect_err("A -> B");
    assert!(
        matches!(
            err,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)
        ),
        "{err:?}"
    );
}

/// A directory laid out like a mounted Kubernetes Secret: each file a symlink through
/// `..data`, which points at a timestamped directory holding the contents.
struct SecretVolume {
    dir: PathBuf,
    version: u32,
}

impl SecretVolume {
    fn new(dir: PathBuf, files: &[(&'static str, String)]) -> Self {
        std::fs::create_dir(&dir).unwrap();
        let mut vol = Self { dir, version: 0 };
        vol.update(files);
        for name in [CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE] {
            std::os::unix::fs::symlink(format!("..data/{name}"), vol.dir.join(name)).unwrap();
        }
        vol
    }

    /// The kubelet's atomic writer: a new data directory, a `..data_tmp` symlink to
    /// it renamed over `..data`, the old directory removed.
    fn update(&mut self, files: &[(&'static str, String)]) {
        self.version += 1;
        let data = format!("..2026_12_01_00_00_{:02}.{}", self.version, self.version);
        write_set(&self.dir.join(&data), files);
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&data, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        if self.version > 1 {
            let old = format!(
                "..2026_12_01_00_00_{:02}.{}",
                self.version - 1,
                self.version - 1
            );
            std::fs::remove_dir_all(self.dir.join(old)).unwrap();
        }
    }
}

/// How long the CA's directory watch may take to act on a change.
const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_secret_swap_reissues_every_svid_and_serves_old_and_new_roots() {
    let tmp = tempfile::tempdir().unwrap();
    let r1 = root(tmp.path(), "r1");
    let r2 = root(tmp.path(), "r2");
    let old_root = read_root(&r1);
    let both_roots = format!("{old_root}{}", read_root(&r2));
    let mut vol = SecretVolume::new(
        tmp.path().join("cacerts"),
        &issuer_files(&r1, "n1-v1", None),
    );

    let ca = BuiltinCa::from_ca_dir(TD, TTL, now, &vol.dir).expect("CA");
    // A long poll: only the inotify watch can make the change show up in time.
    let watch = tokio::spawn(Arc::clone(&ca).watch_ca_dir(
        vol.dir.clone(),
        Duration::from_millis(100),
        Duration::from_secs(3600),
    ));
    let front = ca.subscribe(&pod("c1", "shop", "front")).await.unwrap();
    let cart = ca.subscribe(&pod("c2", "shop", "cart")).await.unwrap();
    let mut rx = ca.view();
    let before = rx.borrow_and_update().clone();
    // A peer node that stays on the old root for now (its Secret is not updated yet).
    let peer_dir = tmp.path().join("peer");
    write_set(&peer_dir, &issuer_files(&r1, "n2", None));
    let peer = BuiltinCa::from_ca_dir(TD, TTL, now, &peer_dir).unwrap();
    let (peer_svid, peer_bundle) = svid_and_bundle(&peer, &pod("c9", "shop", "pay")).await;

    // Root rotation, first step: the issuer moves under the new root, and the trust
    // bundle lists both roots.
    vol.update(&issuer_files(&r2, "n1-v2", Some(&both_roots)));
    eprintln!(
        "DEBUG {:?}",
        ca_dir::load_ca_dir(&vol.dir, TD, now()).map(|s| s.describe().to_string())
    );
    let after = wait_for_async("SVIDs re-issued under the new issuer", WAIT, || {
        let v = rx.borrow().clone();
        let done = [&front, &cart].iter().all(|id| {
            v.svids.get(*id).map(|s| &s.serial) != before.svids.get(*id).map(|s| &s.serial)
        });
        done.then_some(v)
    })
    .await;
    assert_eq!(certs(&after.bundles[TD].ca_pem), certs(&both_roots));
    for id in [&front, &cart] {
        let svid = &after.svids[id];
        let chain = certs(&svid.cert_chain_pem);
        let new_issuer = certs(&std::fs::read_to_string(vol.dir.join(CA_CERT_FILE)).unwrap());
        assert_eq!(chain[1], new_issuer[0], "{id}: signed by the new issuer");
        let leaf = &chain[0];
        let chain_pem = ca_dir::cert_pem(&chain[1]);
        ca_dir::verify_chain(leaf, &chain_pem, &read_root(&r2), now()).expect("under the new root");
        assert!(ca_dir::verify_chain(leaf, &chain_pem, &old_root, now()).is_err());
    }
    // Traffic keeps flowing both ways with the not-yet-rotated peer: we trust its old
    // root, and it will trust ours once its bundle lists the new root too.
    let svid = after.svids[&front].clone();
    mtls_handshake(&peer_svid, &peer_bundle, &svid, &after.bundles[TD].ca_pem)
        .expect_err("the peer does not trust the new root yet");
    mtls_handshake(&peer_svid, &both_roots, &svid, &after.bundles[TD].ca_pem)
        .expect("peer -> us once its bundle has both roots");
    mtls_handshake(&svid, &after.bundles[TD].ca_pem, &peer_svid, &peer_bundle)
        .map(|_| ())
        .expect_err("the peer's server side still trusts only the old root");
    let seen = mtls_handshake(&svid, &after.bundles[TD].ca_pem, &peer_svid, &both_roots)
        .expect("us -> peer");
    assert_eq!(seen, front);

    // A bad set (a key that is not the issuer's) is refused and changes nothing.
    let mut bad = issuer_files(&r2, "n1-v3", Some(&both_roots));
    let other = issuer_files(&r2, "other", None);
    bad[1].1 = other[1].1.clone();
    vol.update(&bad);
    let err = ca.reload_ca_dir(&vol.dir).expect_err("refused");
    assert!(
        err.to_string().contains("does not match the public key"),
        "{err}"
    );
    assert_eq!(
        ca.view().borrow().generation,
        after.generation,
        "nothing published"
    );
    assert_eq!(
        ca.view().borrow().svids[&front].serial,
        after.svids[&front].serial
    );
    // Then a good one again is taken up by the watch.
    vol.update(&issuer_files(&r2, "n1-v4", Some(&read_root(&r2))));
    let last = wait_for_async("the set after the bad one", WAIT, || {
        let v = rx.borrow().clone();
        let done = v.svids[&front].serial != after.svids[&front].serial;
        done.then_some(v)
    })
    .await;
    assert_eq!(certs(&last.bundles[TD].ca_pem), certs(&read_root(&r2)));
    watch.abort();
}

#[test]
fn reload_without_a_change_is_a_no_op() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root(tmp.path(), "root");
    let dir = tmp.path().join("set");
    write_set(&dir, &issuer_files(&r, "n1", None));
    let ca = BuiltinCa::from_ca_dir(TD, TTL, now, &dir).unwrap();
    assert_eq!(ca.reload_ca_dir(&dir), Ok(CaReload::Unchanged));
    write_set(&dir, &issuer_files(&r, "n1-new", None));
    assert_eq!(
        ca.reload_ca_dir(&dir),
        Ok(CaReload::Replaced { reissued: 0 })
    );
}

#[tokio::test]
async fn bad_sets_are_refused_with_the_file_and_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let r1 = root(tmp.path(), "r1");
    let r2 = root(tmp.path(), "r2");
    let good = issuer_files(&r1, "n1", None);
    let case = |name: &str, files: Vec<(&'static str, String)>| -> String {
        let dir = tmp.path().join(name);
        write_set(&dir, &files);
        match BuiltinCa::from_ca_dir(TD, TTL, now, &dir) {
            Err(IdentityError::CaDir(reason)) => reason,
            other => panic!("{name}: expected a refusal, got {other:?}"),
        }
    };

    // The key of another issuer.
    let mut files = good.clone();
    files[1].1 = issuer_files(&r1, "other", None)[1].1.clone();
    let why = case("wrong-key", files);
    assert!(
        why.contains("ca-key.pem") && why.contains("does not match"),
        "{why}"
    );

    // An issuer chained to a root that root-cert.pem does not list.
    let why = case("other-root", issuer_files(&r1, "n1", Some(&read_root(&r2))));
    assert!(
        why.contains("does not verify against root-cert.pem"),
        "{why}"
    );

    // A leaf (not a CA) as the issuer, with its own key.
    let leaf_ca = BuiltinCa::new(TD, TTL, now).unwrap();
    let leaf = leaf_ca.issue("spiffe://cluster.local/ns/a/sa/b").unwrap();
    let leaf_cert = ca_dir::cert_pem(&certs(&leaf.cert_chain_pem)[0]);
    let files = vec![
        (CA_CERT_FILE, leaf_cert.clone()),
        (CA_KEY_FILE, leaf.private_key_pem.expose().to_string()),
        (ROOT_CERT_FILE, leaf_ca.bundle().ca_pem),
    ];
    let why = case("leaf", files);
    assert!(why.contains("not a CA certificate"), "{why}");

    // Missing and garbage files.
    let files: Vec<_> = good
        .iter()
        .filter(|(n, _)| *n != ROOT_CERT_FILE)
        .cloned()
        .collect();
    let why = case("no-roots", files);
    assert!(
        why.contains("root-cert.pem") && why.contains("cannot read"),
        "{why}"
    );
    let mut files = good.clone();
    files[0].1 = "hello".to_string();
    let why = case("garbage", files);
    assert!(
        why.contains("ca-cert.pem") && why.contains("no CERTIFICATE"),
        "{why}"
    );

    // A PKCS#1 / SEC1 key gets the conversion hint.
    let mut files = good.clone();
    files[1].1 = files[1]
        .1
        .replace("BEGIN PRIVATE KEY", "BEGIN EC PRIVATE KEY")
        .replace("END PRIVATE KEY", "END EC PRIVATE KEY");
    let why = case("sec1", files);
    assert!(why.contains("PKCS#8"), "{why}");

    // Nothing of the key shows in any of these messages or in the CA's Debug.
    let key_body = good[1].1.lines().nth(1).unwrap().to_string();
    let ca = BuiltinCa::from_ca_dir(TD, TTL, now, &{
        let d = tmp.path().join("ok");
        write_set(&d, &good);
        d
    })
    .unwrap();
    assert!(!format!("{ca:?}").contains(&key_body));
}

#[test]
fn without_cert_chain_the_issuer_alone_follows_the_leaf() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root(tmp.path(), "root");
    let files: Vec<_> = issuer_files(&r, "n1", None)
        .into_iter()
        .filter(|(n, _)| *n != CERT_CHAIN_FILE)
        .collect();
    let dir = tmp.path().join("set");
    write_set(&dir, &files);
    let set = ca_dir::load_ca_dir(&dir, TD, now()).expect("accepted");
    assert_eq!(certs(set.chain_pem()), certs(&files[0].1));
    assert_eq!(certs(set.roots_pem()), certs(&read_root(&r)));
}

#[tokio::test]
async fn an_expired_issuer_signs_nothing_and_says_to_replace_the_set() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root(tmp.path(), "root");
    let dir = tmp.path().join("set");
    let (cert, key, roots) =
        ca_dir::generate_issuer(&r, "short", now(), CLOCK_SKEW, Duration::from_secs(3600)).unwrap();
    write_set(
        &dir,
        &[
            (CA_CERT_FILE, cert),
            (CA_KEY_FILE, key.expose().to_string()),
            (ROOT_CERT_FILE, roots),
        ],
    );
    let clock = Arc::new(std::sync::atomic::AtomicU64::new(now().as_millis()));
    let c = Arc::clone(&clock);
    let ca = BuiltinCa::from_ca_dir(
        TD,
        TTL,
        move || UnixMs(c.load(std::sync::atomic::Ordering::SeqCst)),
        &dir,
    )
    .unwrap();
    // Within the issuer's life a leaf is cut to end with it.
    let id = ca.subscribe(&pod("c1", "shop", "front")).await.unwrap();
    let svid = ca.view().borrow().svids[&id].clone();
    assert!(svid.not_after_ms.as_millis() <= now().as_millis() + 3_600_000);
    // Past it, nothing is signed, the reason says what to do, and nothing is rotated.
    clock.fetch_add(2 * 3_600_000, std::sync::atomic::Ordering::SeqCst);
    let err = ca.subscribe(&pod("c2", "shop", "cart")).await.unwrap_err();
    assert!(
        err.to_string().contains("replace the CA directory's set"),
        "{err}"
    );
    assert_eq!(ca.rotate_due(), 0);
    assert_eq!(ca.view().borrow().svids[&id].serial, svid.serial);
}

#[tokio::test]
async fn a_directory_replaced_whole_is_watched_again_and_read() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root(tmp.path(), "root");
    let dir = tmp.path().join("set");
    write_set(&dir, &issuer_files(&r, "first", None));
    let ca = BuiltinCa::from_ca_dir(TD, TTL, now, &dir).unwrap();
    let id = ca.subscribe(&pod("c1", "shop", "front")).await.unwrap();
    let mut rx = ca.view();
    let before = rx.borrow_and_update().svids[&id].serial.clone();
    // A long poll: only re-arming the lost watch can notice the new directory in time.
    let watch = tokio::spawn(Arc::clone(&ca).watch_ca_dir(
        dir.clone(),
        Duration::from_millis(50),
        Duration::from_secs(3600),
    ));
    // Let the watch arm on the first directory (its first read is a no-op).
    tokio::task::yield_now().await;
    let next = tmp.path().join("next");
    write_set(&next, &issuer_files(&r, "second", None));
    std::fs::rename(&dir, tmp.path().join("old")).unwrap();
    std::fs::rename(&next, &dir).unwrap();
    let view = wait_for_async("the SVID re-issued from the new directory", WAIT, || {
        let v = rx.borrow().clone();
        let done = v.svids[&id].serial != before;
        done.then_some(v)
    })
    .await;
    let issuer = certs(&std::fs::read_to_string(dir.join(CA_CERT_FILE)).unwrap());
    assert_eq!(certs(&view.svids[&id].cert_chain_pem)[1], issuer[0]);
    watch.abort();
}
