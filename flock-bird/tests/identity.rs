//! Workload identity: the builtin CA's SVIDs verify against its bundle, are
//! shared per SPIFFE ID, rotate at half-life (monotonic: a wall-clock step of hours
//! neither rotates every identity at once nor stalls rotation) and never show their
//! keys when formatted.

use flock_bird::identity::{
    BuiltinCa, IdentityError, IdentityProvider, IdentityView, PodIdentity, Svid, spiffe_id,
    validate_trust_domain,
};
use flock_core::UnixMs;
use flock_core::pod::PodKey;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

fn pod(container: &str, ns: &str, sa: &str) -> PodIdentity {
    PodIdentity {
        key: PodKey::new(container, "eth0"),
        namespace: ns.to_string(),
        service_account: sa.to_string(),
        pod_name: format!("pod-{container}"),
        pod_uid: format!("uid-{container}"),
    }
}

/// A clock the test moves by hand, starting at the real now (so openssl, which checks
/// validity against the real time, accepts the certificates).
fn fake_clock() -> (Arc<AtomicU64>, impl Fn() -> UnixMs + Send + Sync + 'static) {
    let now = Arc::new(AtomicU64::new(flock_clock::unix_now().as_millis()));
    let c = now.clone();
    (now, move || UnixMs(c.load(Ordering::SeqCst)))
}

fn openssl(args: &[&str], dir: &Path) -> String {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("this test needs the `openssl` CLI on PATH (apt-get install openssl): {e}")
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn svid_verifies_against_the_bundle_with_exactly_its_spiffe_id() {
    let ca = BuiltinCa::new(
        "cluster.local",
        Duration::from_secs(3600),
        flock_clock::unix_now,
    )
    .expect("CA");
    let id = ca
        .subscribe(&pod("a", "shop", "cart"))
        .await
        .expect("subscribe");
    assert_eq!(id, "spiffe://cluster.local/ns/shop/sa/cart");
    let view = ca.view().borrow().clone();
    let svid = view.svids.get(&id).expect("SVID in the view").clone();
    let bundle = view.bundles.get("cluster.local").expect("bundle").clone();
    assert_eq!(svid.spiffe_id, id);
    assert_eq!(
        svid.cert_chain_pem.matches("BEGIN CERTIFICATE").count(),
        1,
        "leaf only"
    );

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bundle.pem"), &bundle.ca_pem).unwrap();
    std::fs::write(dir.path().join("leaf.pem"), &svid.cert_chain_pem).unwrap();
    std::fs::write(dir.path().join("key.pem"), svid.private_key_pem.expose()).unwrap();

    let verify = openssl(&["verify", "-CAfile", "bundle.pem", "leaf.pem"], dir.path());
    assert!(verify.contains("leaf.pem: OK"), "{verify}");

    let san = openssl(
        &[
            "x509",
            "-in",
            "leaf.pem",
            "-noout",
            "-ext",
            "subjectAltName",
        ],
        dir.path(),
    );
    let names: Vec<&str> = san
        .lines()
        .skip(1)
        .flat_map(|l| l.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(
        names,
        vec![format!("URI:{id}")],
        "exactly the URI SAN: {san}"
    );

    let text = openssl(&["x509", "-in", "leaf.pem", "-noout", "-text"], dir.path());
    assert!(text.contains("CA:FALSE"), "{text}");
    assert!(text.contains("Digital Signature"), "{text}");
    assert!(
        text.contains("TLS Web Server Authentication")
            && text.contains("TLS Web Client Authentication"),
        "{text}"
    );
    assert!(text.contains("prime256v1"), "P-256: {text}");
    let serial = openssl(
        &["x509", "-in", "leaf.pem", "-noout", "-serial"],
        dir.path(),
    );
    assert_eq!(
        serial.trim().to_lowercase(),
        format!("serial={}", svid.serial)
    );

    let ca_text = openssl(
        &["x509", "-in", "bundle.pem", "-noout", "-text"],
        dir.path(),
    );
    assert!(ca_text.contains("CA:TRUE"), "{ca_text}");
    assert!(ca_text.contains("Certificate Sign"), "{ca_text}");

    let cert_pub = openssl(
        &["x509", "-in", "leaf.pem", "-noout", "-pubkey"],
        dir.path(),
    );
    let key_pub = openssl(&["pkey", "-in", "key.pem", "-pubout"], dir.path());
    assert_eq!(
        cert_pub, key_pub,
        "the private key belongs to the certificate"
    );

    // Validity: not_before is a minute back (clock skew), not_after = issue + TTL.
    assert_eq!(svid.not_after_ms, svid.issued_ms.plus(3_600_000));
}

#[tokio::test]
async fn pods_with_one_service_account_share_one_svid_until_the_last_leaves() {
    let ca = BuiltinCa::new(
        "example.org",
        Duration::from_secs(600),
        flock_clock::unix_now,
    )
    .unwrap();
    let rx = ca.view();
    let a = pod("a", "shop", "cart");
    let b = pod("b", "shop", "cart");
    let c = pod("c", "shop", "pay");
    let id_a = ca.subscribe(&a).await.unwrap();
    let first = rx.borrow().svids[&id_a].clone();
    let id_b = ca.subscribe(&b).await.unwrap();
    assert_eq!(id_a, id_b);
    let id_c = ca.subscribe(&c).await.unwrap();
    assert_ne!(id_a, id_c);
    {
        let v = rx.borrow();
        assert_eq!(v.svids.len(), 2);
        assert_eq!(v.subscriptions.len(), 3);
        assert!(Arc::ptr_eq(&v.svids[&id_a], &first), "b reuses a's secret");
        assert!(Arc::ptr_eq(v.svid_of(&b.key).unwrap(), &first));
    }

    ca.unsubscribe(&a.key).await;
    assert!(
        Arc::ptr_eq(&rx.borrow().svids[&id_a], &first),
        "b still uses it"
    );
    let g = rx.borrow().generation;
    ca.unsubscribe(&a.key).await;
    assert_eq!(
        rx.borrow().generation,
        g,
        "a second unsubscribe changes nothing"
    );

    ca.unsubscribe(&b.key).await;
    {
        let v = rx.borrow();
        assert!(
            !v.svids.contains_key(&id_a),
            "last subscriber gone: SVID dropped"
        );
        assert!(v.svids.contains_key(&id_c));
        assert_eq!(v.subscriptions.len(), 1);
        assert!(v.bundles.contains_key("example.org"), "the bundle stays");
    }
    ca.unsubscribe(&b.key).await;
    ca.unsubscribe(&PodKey::new("never", "eth0")).await;

    // Re-subscribing brings a fresh SVID.
    let again = ca.subscribe(&a).await.unwrap();
    assert_ne!(rx.borrow().svids[&again].serial, first.serial);
}

#[tokio::test]
async fn a_pod_that_changes_service_account_moves_its_subscription() {
    let ca = BuiltinCa::new(
        "example.org",
        Duration::from_secs(600),
        flock_clock::unix_now,
    )
    .unwrap();
    let old = ca.subscribe(&pod("a", "shop", "cart")).await.unwrap();
    let new = ca.subscribe(&pod("a", "shop", "pay")).await.unwrap();
    let v = ca.view().borrow().clone();
    assert_eq!(v.subscriptions.len(), 1);
    assert_eq!(v.subscriptions.values().next(), Some(&new));
    assert!(!v.svids.contains_key(&old));
    // Subscribing again with the same identity is a no-op.
    let g = v.generation;
    ca.subscribe(&pod("a", "shop", "pay")).await.unwrap();
    assert_eq!(ca.view().borrow().generation, g);
}

/// Rotation runs on tokio's clock (`flock_clock::mono_now`): these tests pause it and
/// advance it by hand, and move the wall clock separately.
#[tokio::test(start_paused = true)]
async fn rotation_happens_at_half_life_with_a_new_key_and_serial() {
    let (now, clock) = fake_clock();
    let ttl = Duration::from_secs(3600);
    let ca = BuiltinCa::new("cluster.local", ttl, clock).unwrap();
    let mut rx = ca.view();
    assert_eq!(ca.next_rotation(), None);
    assert_eq!(ca.rotate_due(), 0);
    let t0 = now.load(Ordering::SeqCst);
    let m0 = flock_clock::mono_now();
    let id = ca.subscribe(&pod("a", "ns", "sa")).await.unwrap();
    let before = rx.borrow_and_update().clone();
    let old = before.svids[&id].clone();
    assert_eq!(ca.next_rotation(), Some(m0.plus(1_800_000)));

    advance(&now, 1_800_000 - 1).await;
    assert_eq!(ca.rotate_due(), 0, "before half-life");
    assert!(!rx.has_changed().unwrap());

    advance(&now, 1).await;
    assert_eq!(ca.rotate_due(), 1, "at half-life");
    assert!(rx.has_changed().unwrap(), "watchers are woken");
    let after = rx.borrow_and_update().clone();
    let new = after.svids[&id].clone();
    assert_ne!(new.serial, old.serial);
    assert_ne!(new.private_key_pem, old.private_key_pem);
    assert_ne!(new.cert_chain_pem, old.cert_chain_pem);
    assert_eq!(after.generation, before.generation + 1);
    assert_eq!(new.not_after_ms, UnixMs(t0 + 1_800_000 + 3_600_000));
    assert!(new.not_after_ms > old.not_after_ms);
    assert_eq!(ca.rotate_due(), 0, "fresh again");
    assert_eq!(ca.next_rotation(), Some(m0.plus(1_800_000 + 1_800_000)));
    assert_eq!(ca.issued_count(), 2);
}

/// Moves both clocks forward by `ms`: real time passing.
async fn advance(wall: &AtomicU64, ms: u64) {
    wall.fetch_add(ms, Ordering::SeqCst);
    tokio::time::advance(Duration::from_millis(ms)).await;
}

const HOUR_MS: u64 = 3_600_000;

/// The wall clock stepped +6 h and then 12 h back (−6 h from the real time), with three
/// identities on an hour's TTL: the step forward rotates none of them (they were issued
/// a minute ago; a wall-clock schedule would rotate all three at once), and after the
/// step back each still rotates at its monotonic half-life (a wall-clock schedule would
/// wait 12 h more, while the certificates run out on the peers' clocks).
#[tokio::test(start_paused = true)]
async fn wall_clock_steps_neither_rotate_every_identity_nor_stall_rotation() {
    let (wall, clock) = fake_clock();
    let ca = BuiltinCa::new("cluster.local", Duration::from_secs(3600), clock).unwrap();
    for (c, sa) in [("a", "sa1"), ("b", "sa2"), ("c", "sa3")] {
        ca.subscribe(&pod(c, "ns", sa)).await.unwrap();
    }
    assert_eq!(ca.issued_count(), 3);
    advance(&wall, 60_000).await;

    wall.fetch_add(6 * HOUR_MS, Ordering::SeqCst);
    assert_eq!(
        ca.rotate_due(),
        0,
        "a step forward rotated SVIDs a minute old"
    );
    advance(&wall, 60_000).await;
    assert_eq!(ca.rotate_due(), 0);

    wall.fetch_sub(12 * HOUR_MS, Ordering::SeqCst);
    advance(&wall, 30 * 60_000 - 2 * 60_000 - 1).await;
    assert_eq!(ca.rotate_due(), 0, "before half-life");
    advance(&wall, 1).await;
    assert_eq!(ca.rotate_due(), 3, "at half-life, 12 h after a step back");
    // The new SVIDs' validity is the (stepped) wall clock's: what peers check.
    let view = ca.view().borrow().clone();
    for svid in view.svids.values() {
        assert_eq!(svid.issued_ms, UnixMs(wall.load(Ordering::SeqCst)));
        assert_eq!(svid.not_after_ms, svid.issued_ms.plus(HOUR_MS));
    }
    assert_eq!(ca.issued_count(), 6);
}

/// The rotation loop itself over four simulated hours with the wall clock stepped ±6 h:
/// exactly one issuance per identity per half-life.
#[tokio::test(start_paused = true)]
async fn the_rotation_loop_issues_one_svid_per_half_life_whatever_the_wall_clock_does() {
    let (wall, clock) = fake_clock();
    let ca = BuiltinCa::new("cluster.local", Duration::from_secs(3600), clock).unwrap();
    ca.subscribe(&pod("a", "ns", "sa1")).await.unwrap();
    ca.subscribe(&pod("b", "ns", "sa2")).await.unwrap();
    let start = flock_clock::mono_now();
    let task = tokio::spawn(ca.clone().run_rotation(Duration::from_secs(5)));
    for step in [
        6 * HOUR_MS as i64,
        -12 * HOUR_MS as i64,
        6 * HOUR_MS as i64,
        0,
    ] {
        // An hour of real time, then the step.
        for _ in 0..60 {
            advance(&wall, 60_000).await;
        }
        if step >= 0 {
            wall.fetch_add(step as u64, Ordering::SeqCst);
        } else {
            wall.fetch_sub(step.unsigned_abs(), Ordering::SeqCst);
        }
    }
    // Not on a rotation boundary, so the count does not depend on which task ran first.
    advance(&wall, 60_000).await;
    let elapsed = flock_clock::mono_now().since(start);
    task.abort();
    // Two first issuances, then one per identity per 30 minutes of monotonic time.
    let warranted = 2 * (1 + elapsed / (HOUR_MS / 2));
    assert_eq!(elapsed, 4 * HOUR_MS + 60_000);
    assert_eq!(
        ca.issued_count(),
        warranted,
        "not one issuance per identity per half-life of monotonic time: issued {} in {elapsed} ms",
        ca.issued_count()
    );
}

fn key_lines(svid: &Svid) -> Vec<String> {
    svid.private_key_pem
        .expose()
        .lines()
        .filter(|l| !l.starts_with("-----"))
        // PKCS#8 embeds the public key, which the certificate (public) also holds:
        // a line of only public-key bytes may legitimately appear in it. The lines
        // holding the private scalar never do.
        .filter(|l| !svid.cert_chain_pem.contains(l))
        .map(str::to_string)
        .collect()
}

fn assert_no_key(text: &str, keys: &[String]) {
    assert!(!text.contains("PRIVATE KEY"), "key marker in: {text}");
    for line in keys {
        assert!(
            !text.contains(line.as_str()),
            "key material {line:?} in: {text}"
        );
    }
}

#[tokio::test]
async fn formatting_never_shows_key_material() {
    let ca = BuiltinCa::new(
        "cluster.local",
        Duration::from_secs(60),
        flock_clock::unix_now,
    )
    .unwrap();
    let id = ca.subscribe(&pod("a", "ns", "sa")).await.unwrap();
    let view: Arc<IdentityView> = ca.view().borrow().clone();
    let svid = view.svids[&id].clone();
    let keys = key_lines(&svid);
    // The first line holds the PKCS#8 header and the private scalar: always checked.
    assert!(keys.len() >= 2, "{} key lines checked", keys.len());
    assert!(svid.private_key_pem.expose().contains("PRIVATE KEY"));

    assert_no_key(&format!("{svid:?}"), &keys);
    assert_no_key(&format!("{svid:#?}"), &keys);
    assert_no_key(&format!("{view:?}"), &keys);
    assert_no_key(&format!("{:?}", svid.private_key_pem), &keys);
    assert_no_key(&format!("{}", svid.private_key_pem), &keys);
    assert!(format!("{:?}", svid.private_key_pem).starts_with("<redacted "));
    assert_no_key(&format!("{ca:?}"), &keys);
    assert_no_key(&ca.describe(), &keys);
    assert_eq!(
        ca.describe(),
        "builtin (trust domain cluster.local, ttl 60s)"
    );

    let errors = [
        ca.subscribe(&pod("b", "Bad/NS", "sa")).await.unwrap_err(),
        ca.subscribe(&pod("b", "ns", "..")).await.unwrap_err(),
        BuiltinCa::new("Bad", Duration::from_secs(60), flock_clock::unix_now).unwrap_err(),
        BuiltinCa::new("ok", Duration::from_secs(0), flock_clock::unix_now).unwrap_err(),
    ];
    for e in &errors {
        assert_no_key(&format!("{e:?}"), &keys);
        assert_no_key(&e.to_string(), &keys);
    }
    assert!(matches!(errors[0], IdentityError::InvalidName { .. }));
    assert!(matches!(
        errors[2],
        IdentityError::InvalidTrustDomain { .. }
    ));
    assert!(matches!(errors[3], IdentityError::InvalidTtl(_)));
}

#[test]
fn names_and_selectors() {
    assert_eq!(spiffe_id("td", "ns", "sa"), "spiffe://td/ns/ns/sa/sa");
    assert!(validate_trust_domain("cluster.local").is_ok());
    assert!(validate_trust_domain("a-b_c.9").is_ok());
    assert!(validate_trust_domain("").is_err());
    assert!(validate_trust_domain("Cluster.local").is_err());
    assert!(validate_trust_domain("td:8080").is_err());
    assert!(validate_trust_domain(&"a".repeat(255)).is_ok());
    assert!(validate_trust_domain(&"a".repeat(256)).is_err());

    let p = pod("c1", "shop", "cart");
    assert_eq!(
        p.selectors(),
        [
            ("k8s", "ns:shop"),
            ("k8s", "sa:cart"),
            ("k8s", "pod-name:pod-c1"),
            ("k8s", "pod-uid:uid-c1"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );

    let record = flock_bird::model::PodRecord {
        key: PodKey::new("c1", "eth0"),
        name: "web-0".into(),
        namespace: "shop".into(),
        uid: "u-1".into(),
        netns: String::new(),
        ips: vec![],
        service: "web".into(),
        service_account: String::new(),
        ports: vec![],
        network_name: "net".into(),
        added_at_ms: UnixMs::ZERO,
        capture: None,
        authz: None,
        labels: Default::default(),
    };
    let id = PodIdentity::from(&record);
    assert_eq!(id.service_account, "default");
    assert_eq!(id.pod_name, "web-0");
    assert_eq!(id.pod_uid, "u-1");
}

#[tokio::test]
async fn run_rotation_keeps_svids_fresh() {
    // A 2 s TTL with the real clock: the loop must rotate at ~1 s.
    let ca = BuiltinCa::new("td", Duration::from_secs(2), flock_clock::unix_now).unwrap();
    let id = ca.subscribe(&pod("a", "ns", "sa")).await.unwrap();
    let mut rx = ca.view();
    let first = rx.borrow_and_update().svids[&id].serial.clone();
    let task = tokio::spawn(ca.clone().run_rotation(Duration::from_secs(5)));
    tokio::time::timeout(Duration::from_secs(5), rx.changed())
        .await
        .expect("rotated within 5 s")
        .unwrap();
    assert_ne!(rx.borrow().svids[&id].serial, first);
    task.abort();
}
