//! The embedded registry backends, `memory` and `file:PATH`: put/delete/conditional
//! delete semantics, view updates, persistence across reopen, corrupt-file recovery,
//! file mode and size limit; and spec parsing.

#[path = "common/endpoint.rs"]
mod endpoint;

use flock_bird::model::{Endpoint, Health};
use flock_bird::registry::{self, Registry, RegistryError, RegistryOptions, RegistrySpec};
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

fn ep(pod: &str, port: u16) -> Endpoint {
    Endpoint {
        service_port: port,
        ..endpoint::web("n1", pod)
    }
}

async fn open(spec: &RegistrySpec) -> Arc<dyn Registry> {
    registry::connect(spec, RegistryOptions::default())
        .await
        .unwrap()
}

fn file_spec(dir: &tempfile::TempDir) -> (std::path::PathBuf, RegistrySpec) {
    let path = dir.path().join("reg").join("endpoints.json");
    (path.clone(), RegistrySpec::File(path))
}

/// The put/delete/conditional-delete contract, run against each backend.
async fn semantics(reg: Arc<dyn Registry>) {
    let view = reg.view();
    assert!(view.borrow().synced);
    assert_eq!(view.borrow().generation, 1);
    let a = ep("c1", 8080);
    let r1 = reg.put(&a).await.unwrap();
    // The view is updated before put returns.
    assert_eq!(
        view.borrow().endpoints.get(&a.key()).map(|e| &**e),
        Some(&a)
    );
    assert_eq!(view.borrow().revision, r1);

    // A newer put of the same key makes the older revision's conditional delete a no-op.
    let mut a2 = a.clone();
    a2.health = Health::Unhealthy;
    let r2 = reg.put(&a2).await.unwrap();
    assert!(r2 > r1);
    assert!(!reg.delete_if_revision(&a.key(), r1).await.unwrap());
    assert_eq!(
        view.borrow().endpoints.get(&a.key()).map(|e| &**e),
        Some(&a2)
    );
    // The current revision's conditional delete works, once.
    assert!(reg.delete_if_revision(&a.key(), r2).await.unwrap());
    assert!(!view.borrow().endpoints.contains_key(&a.key()));
    assert!(!reg.delete_if_revision(&a.key(), r2).await.unwrap());

    // Plain delete: true when present, false when absent.
    let b = ep("c2", 9090);
    reg.put(&b).await.unwrap();
    reg.put(&a).await.unwrap();
    assert_eq!(view.borrow().endpoints.len(), 2);
    assert!(reg.delete(&b.key()).await.unwrap());
    assert!(!reg.delete(&b.key()).await.unwrap());
    assert_eq!(
        view.borrow().endpoints.keys().collect::<Vec<_>>(),
        vec![&a.key()]
    );
    assert!(!reg.delete("no/such/key").await.unwrap());
    // Revisions only grow.
    assert!(view.borrow().revision > r2);
}

#[tokio::test]
async fn memory_semantics() {
    let reg = open(&RegistrySpec::Memory).await;
    assert_eq!(reg.describe(), "memory");
    semantics(reg).await;
}

#[tokio::test]
async fn file_semantics() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = file_spec(&dir);
    let reg = open(&spec).await;
    assert_eq!(reg.describe(), format!("file:{}", path.display()));
    semantics(reg).await;
}

#[tokio::test]
async fn view_receivers_are_notified() {
    let reg = open(&RegistrySpec::Memory).await;
    let mut rx = reg.view();
    rx.borrow_and_update();
    let a = ep("c1", 8080);
    let writer = {
        let reg = reg.clone();
        let a = a.clone();
        tokio::spawn(async move { reg.put(&a).await.unwrap() })
    };
    rx.changed().await.unwrap();
    assert!(rx.borrow_and_update().endpoints.contains_key(&a.key()));
    writer.await.unwrap();
}

#[tokio::test]
async fn file_persists_across_reopen_with_revision_and_mode_0600() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = file_spec(&dir);
    let (a, b) = (ep("c1", 8080), ep("c2", 8080));
    let (ra, rev) = {
        let reg = open(&spec).await;
        let ra = reg.put(&a).await.unwrap();
        reg.put(&b).await.unwrap();
        reg.delete(&b.key()).await.unwrap();
        (ra, reg.view().borrow().revision)
    };
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "registry file mode");
    let text = std::fs::read_to_string(&path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["schema"], 1);
    // No temp files left behind.
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["endpoints.json".to_string()]);

    let reg = open(&spec).await;
    let view = reg.view().borrow().clone();
    assert_eq!(view.endpoints.len(), 1);
    assert_eq!(view.endpoints.get(&a.key()).map(|e| &**e), Some(&a));
    assert_eq!(view.revision, rev, "revision persisted");
    // Mod revisions survive too: the conditional delete of the loaded entry works,
    // and revisions keep growing after the reopen.
    assert!(reg.delete_if_revision(&a.key(), ra).await.unwrap());
    assert!(reg.view().borrow().revision > rev);
}

#[tokio::test]
async fn corrupt_file_is_moved_aside_and_registry_starts_empty() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = file_spec(&dir);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    for (i, junk) in [
        "{\"schema\":1,\"endpoints\":[{tru",
        "not json at all",
        "{\"schema\":1,\"revision\":3,\"endpoints\":[{\"bogus\":1}]}",
    ]
    .iter()
    .enumerate()
    {
        std::fs::write(&path, junk).unwrap();
        let reg = open(&spec).await;
        assert!(reg.view().borrow().endpoints.is_empty(), "case {i}");
        assert!(!path.exists(), "case {i}: the corrupt file was moved away");
        let aside: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("endpoints.json.corrupt-"))
            .collect();
        assert!(!aside.is_empty(), "case {i}: a .corrupt-<ms> file exists");
        // The registry works and writes a fresh file.
        reg.put(&ep("c1", 80)).await.unwrap();
        assert!(path.exists());
        std::fs::remove_file(&path).unwrap();
        // Distinct millisecond names for the next case.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn unknown_schema_is_an_error_not_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = file_spec(&dir);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, r#"{"schema":2,"whatever":[]}"#).unwrap();
    let err = registry::connect(&spec, RegistryOptions::default())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, RegistryError::UnsupportedSchema { schema: 2, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert!(path.exists(), "left in place for the newer version");
}

#[tokio::test]
async fn file_over_the_size_limit_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = file_spec(&dir);
    {
        let reg = open(&spec).await;
        for i in 0..20 {
            reg.put(&ep(&format!("c{i}"), 8080)).await.unwrap();
        }
    }
    let size = std::fs::metadata(&path).unwrap().len();
    let opts = RegistryOptions {
        file_max_bytes: size - 1,
        ..RegistryOptions::default()
    };
    let err = registry::connect(&spec, opts).await.err().unwrap();
    assert!(matches!(err, RegistryError::FileTooLarge { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("limit"),
        "{msg}"
    );
    // Exactly at the limit it loads.
    let opts = RegistryOptions {
        file_max_bytes: size,
        ..RegistryOptions::default()
    };
    let reg = registry::connect(&spec, opts).await.unwrap();
    assert_eq!(reg.view().borrow().endpoints.len(), 20);
}

#[tokio::test]
async fn write_failure_leaves_state_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = file_spec(&dir);
    let reg = open(&spec).await;
    reg.put(&ep("c1", 80)).await.unwrap();
    let before = reg.view().borrow().clone();
    // Make the directory unwritable by replacing it with a file of the same name... via
    // a read-only directory (root ignores modes, so use a path that cannot be a dir).
    let parent = path.parent().unwrap().to_path_buf();
    std::fs::remove_dir_all(&parent).unwrap();
    std::fs::write(&parent, b"not a directory").unwrap();
    let err = reg.put(&ep("c2", 80)).await.err().unwrap();
    assert!(err.to_string().contains("file:"), "{err}");
    assert_eq!(*reg.view().borrow(), before);
}

#[test]
fn spec_parsing() {
    assert_eq!(registry::parse_spec("memory"), Ok(RegistrySpec::Memory));
    assert_eq!(
        registry::parse_spec("file:/var/lib/flock/reg.json"),
        Ok(RegistrySpec::File("/var/lib/flock/reg.json".into()))
    );
    assert_eq!(
        registry::parse_spec("etcd://10.0.0.1:2379,etcd-2.local:2379,[::1]:2379"),
        Ok(RegistrySpec::Etcd(vec![
            "10.0.0.1:2379".into(),
            "etcd-2.local:2379".into(),
            "[::1]:2379".into()
        ]))
    );
    for (bad, needle) in [
        ("", "unknown backend"),
        ("redis://x:1", "unknown backend"),
        ("file:", "empty file path"),
        ("etcd://", "no etcd endpoint"),
        ("etcd://host", "HOST:PORT"),
        ("etcd://host:0", "port"),
        ("etcd://host:99999", "port"),
        ("etcd://::1:2379", "brackets"),
        ("etcd://a:1,,b:2", "HOST:PORT"),
    ] {
        let err = registry::parse_spec(bad).unwrap_err();
        assert!(err.contains(needle), "{bad:?}: {err}");
        assert!(
            err.contains("expected") || err.contains("etcd endpoint"),
            "{bad:?}: {err}"
        );
    }
    let spec = registry::parse_spec("etcd://a:1,b:2").unwrap();
    assert_eq!(spec.to_string(), "etcd://a:1,b:2");
    let spec = registry::parse_spec("etcds://a:1,b:2").unwrap();
    assert_eq!(
        spec,
        RegistrySpec::EtcdTls(vec!["a:1".into(), "b:2".into()])
    );
    assert_eq!(spec.to_string(), "etcds://a:1,b:2");
}

/// The scheme decides TLS and the options must agree: TLS options with `etcd://`,
/// `etcds://` without a CA, a password over plaintext, or etcd options for an embedded
/// backend are errors at start that say what to do, never a silent plaintext
/// connection. (No etcd needed: each is refused before dialling.)
#[tokio::test]
async fn registry_security_options_must_match_the_scheme() {
    let tls = registry::EtcdTls {
        ca_pem: "-----BEGIN CERTIFICATE-----\n".into(),
        cert_pem: None,
        key_pem: None,
    };
    let auth = registry::EtcdAuth {
        user: "node-a".into(),
        password: zeroize::Zeroizing::new("hunter2".into()),
    };
    let cases = [
        (
            "etcd://127.0.0.1:1",
            Some(tls.clone()),
            None,
            "write etcds://",
        ),
        ("etcds://127.0.0.1:1", None, None, "--registry-ca"),
        ("etcd://127.0.0.1:1", None, Some(auth.clone()), "in clear"),
        ("memory", Some(tls.clone()), None, "etcds:// only"),
        ("memory", None, Some(auth.clone()), "etcds:// only"),
    ];
    for (spec, tls, auth, needle) in cases {
        let opts = RegistryOptions {
            tls,
            auth,
            ..RegistryOptions::default()
        };
        let err = registry::connect(&registry::parse_spec(spec).unwrap(), opts)
            .await
            .err()
            .unwrap_or_else(|| panic!("{spec}: accepted"))
            .to_string();
        assert!(err.contains(needle), "{spec}: {err}");
    }
    // The password never shows in Debug output.
    assert!(!format!("{auth:?}").contains("hunter2"));
}

/// Password and TLS files: a password file's final newline is dropped, an empty one
/// is refused, and a client certificate without its key is an error naming both flags.
#[test]
fn credential_files_are_read_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("pw");
    std::fs::write(&pw, "s3cret\n").unwrap();
    let auth = registry::load_auth("node-a", &pw).unwrap();
    assert_eq!(auth.password.as_str(), "s3cret");
    std::fs::write(&pw, "\n").unwrap();
    let err = registry::load_auth("node-a", &pw).unwrap_err();
    assert!(err.contains("empty password"), "{err}");
    let err = registry::load_auth("node-a", &dir.path().join("missing")).unwrap_err();
    assert!(err.contains("--registry-password-file"), "{err}");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
    let err = registry::load_tls(&ca, Some(&ca), None).unwrap_err();
    assert!(
        err.contains("--registry-cert") && err.contains("--registry-key"),
        "{err}"
    );
}

mod whole_view {
    //! The rules over the whole registry view the agent applies before its
    //! translation model (`serving_endpoints`), and the property that makes filtering
    //! there sufficient: whatever entries pass the per-entry check, the services they
    //! form pass the model's validation, so no entry can take its service down.

    use flock_bird::agent::mesh::{service_models, serving_endpoints};
    use flock_bird::model::{Endpoint, Health, Protocol};
    use flock_bird::registry::{Rejections, View};
    use flock_core::pod::{MAX_PORTS, PodKey};
    use flock_core::registry::{Reject, Trust, check_entry};
    use flock_xds::translate::Mesh;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn ep(node: &str, pod: &str, port: u16, identity: Option<&str>) -> Endpoint {
        Endpoint {
            service_port: port,
            identity: identity.map(str::to_string),
            ..super::endpoint::web(node, pod)
        }
    }

    fn view(eps: Vec<Endpoint>) -> View {
        View {
            endpoints: eps.into_iter().map(|e| (e.key(), e)).collect(),
            ..View::default()
        }
    }

    /// Never downgrade: in a port with an identified endpoint the identity-less one is
    /// left out (reason `downgrade`); a port with no identity keeps all its endpoints.
    /// Ports beyond the 32 a service may have are left out (`too_many_ports`), not the
    /// service. The exclusions are warned about and counted once across publishes.
    #[test]
    fn whole_view_rules_exclude_single_entries_not_services() {
        let id = "spiffe://cluster.local/ns/default/sa/web";
        let mut eps = vec![
            ep("a", "p1", 8080, Some(id)),
            ep("b", "p2", 8080, None),
            ep("a", "p3", 9090, None),
            ep("b", "p4", 9090, None),
        ];
        // 2 + 31 more ports: 33, the highest is over the cap.
        for (i, port) in (10_000..10_000 + MAX_PORTS as u16 - 1).enumerate() {
            eps.push(ep("c", &format!("q{i}"), port, None));
        }
        let v = view(eps);
        let (serving, excluded) = serving_endpoints(&v);
        let over = v.endpoints.values().map(|e| e.service_port).max().unwrap();
        let want: BTreeMap<String, Reject> = v
            .endpoints
            .iter()
            .filter_map(|(k, e)| {
                if e.pod == "default/p2" {
                    Some((k.clone(), Reject::Downgrade))
                } else if e.service_port == over {
                    Some((k.clone(), Reject::TooManyPorts))
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(excluded, want);
        assert_eq!(serving.len(), v.endpoints.len() - 2);
        let services = service_models(serving);
        assert_eq!(services.len(), 1);
        assert_eq!(services[0].ports.len(), MAX_PORTS);
        Mesh {
            services,
            ..Mesh::default()
        }
        .validate()
        .expect("the service is served");

        let r = Rejections::default();
        r.set_excluded("test", excluded.clone());
        r.set_excluded("test", excluded.clone());
        assert_eq!(
            r.count(Reject::Downgrade),
            1,
            "counted once, not per publish"
        );
        assert_eq!(r.count(Reject::TooManyPorts), 1);
        r.set_excluded("test", BTreeMap::new());
        r.set_excluded("test", excluded);
        assert_eq!(
            r.count(Reject::Downgrade),
            2,
            "excluded again after it was served"
        );
    }

    /// Mostly one of `good`, sometimes one of `bad`: most generated entries pass the
    /// per-entry check, so the property below is about many accepted entries at once.
    fn mostly<T: Clone + std::fmt::Debug + 'static>(
        good: Vec<T>,
        bad: Vec<T>,
    ) -> impl Strategy<Value = T> {
        prop_oneof![
            12 => proptest::sample::select(good),
            1 => proptest::sample::select(bad),
        ]
    }

    prop_compose! {
        /// An endpoint from pools of good and bad values (a node may write anything).
        fn any_entry()(
            node in mostly(vec!["a", "b", "c"], vec!["B", ""]),
            ns in mostly(vec!["default", "kube-system"], vec!["bad.ns", ""]),
            svc in mostly(vec!["web", "db"], vec!["Web", "a|b"]),
            sp in mostly(vec![80u16, 8080, 9090], vec![0]),
            proto in proptest::sample::select(vec![Protocol::Http, Protocol::Grpc, Protocol::Tcp]),
            addr in mostly(
                vec!["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::1"],
                vec!["0.0.0.0", "224.0.0.1", "127.0.0.1", "::"],
            ),
            port in mostly(vec![15006u16, 15007], vec![0]),
            pod_ns_ok in mostly(vec![true], vec![false]),
            pod in mostly(vec!["p1", "p2"], vec!["P", ""]),
            cid in mostly(vec!["c1", "c2", "c3"], vec!["-x", ""]),
            ifname in mostly(vec!["eth0", "net1"], vec!["a/b", ""]),
            zone in mostly(vec!["", "z1"], vec!["bad\nzone"]),
            identity in mostly(
                vec![None, Some("web"), Some("db")],
                vec![
                    Some("evil"), Some("other-ns"), Some("space"), Some("http"), Some("star"),
                    Some("slash"),
                ],
            ),
            // Further accepted IDs (`also_accept`), spelled like `identity`; "any" is
            // the namespace-wide prefix.
            also in mostly(
                vec![vec![], vec![], vec!["canary"], vec!["canary", "any"]],
                vec![vec!["evil"], vec!["other-ns"], vec!["star"], vec!["canary", "slash"]],
            ),
            key_ok in mostly(vec![true], vec![false]),
        ) -> (String, Endpoint) {
            let spell = |id: &str| match id {
                "evil" => format!("spiffe://evil.example/ns/{ns}/sa/web"),
                "other-ns" => "spiffe://cluster.local/ns/elsewhere/sa/x".to_string(),
                "space" => format!("spiffe://cluster.local/ns/{ns}/sa/a b"),
                "http" => "http://x".to_string(),
                "star" => format!("spiffe://cluster.local/ns/{ns}/sa/a*"),
                "slash" => format!("spiffe://cluster.local/ns/{ns}/sa/"),
                "any" => format!("spiffe://cluster.local/ns/{ns}/sa/*"),
                sa => format!("spiffe://cluster.local/ns/{ns}/sa/{sa}"),
            };
            let identity = identity.map(spell);
            let also_accept = also.into_iter().map(spell).collect();
            let e = Endpoint {
                service: svc.into(),
                namespace: ns.into(),
                service_port: sp,
                protocol: proto,
                address: addr.parse().unwrap(),
                port,
                node: node.into(),
                pod: if pod_ns_ok { format!("{ns}/{pod}") } else { pod.to_string() },
                pod_key: PodKey { container_id: cid.into(), ifname: ifname.into() },
                region: String::new(),
                zone: zone.into(),
                health: Health::Healthy,
                identity,
                also_accept,
                labels: Default::default(),
            };
            let key = if key_ok { e.key() } else { format!("b/{}", e.key()) };
            (key, e)
        }
    }

    proptest! {
        /// Whatever a node writes: the entries that pass the per-entry check and the
        /// whole-view rules form only services the translation model accepts.
        #[test]
        fn accepted_entries_always_form_valid_services(
            entries in proptest::collection::vec(any_entry(), 0..24),
        ) {
            let trust = Trust { local_node: "a", trust_domain: Some("cluster.local"), scope: None };
            let accepted: BTreeMap<String, Endpoint> = entries
                .into_iter()
                .filter(|(k, e)| check_entry(&e.entry_fields(k), &trust).is_ok())
                .collect();
            // Not vacuous: most generated entries pass (see `mostly`).
            let v = View { endpoints: accepted.into_iter().collect(), ..View::default() };
            let (serving, _) = serving_endpoints(&v);
            for svc in service_models(serving) {
                let name = format!("{}.{}", svc.name, svc.namespace);
                let one = Mesh { services: vec![svc], ..Mesh::default() };
                prop_assert!(one.validate().is_ok(), "{name}: {:?}", one.validate());
            }
        }
    }
}

/// `decode_entry`, the etcd backend's decoder of other nodes' entries: a valid entry
/// under its key decodes; over the size limit, undecodable JSON (its message bounded
/// and escaped) and a mismatched key each give their own reason.
#[test]
fn decode_entry_accepts_valid_entries_and_names_each_refusal() {
    use flock_core::registry::{MAX_ENTRY_BYTES, Reject, Trust};
    let trust = Trust {
        local_node: "n2",
        trust_domain: Some("cluster.local"),
        scope: None,
    };
    let e = ep("c1", 8080);
    let bytes = serde_json::to_vec(&e).unwrap();
    assert_eq!(
        registry::decode_entry(&e.key(), &bytes, &trust),
        Ok(e.clone())
    );
    let reason = |key: &str, value: &[u8]| {
        registry::decode_entry(key, value, &trust)
            .unwrap_err()
            .reason
    };
    assert_eq!(
        reason(&e.key(), &vec![b' '; MAX_ENTRY_BYTES + 1]),
        Reject::Oversized
    );
    assert_eq!(reason(&e.key(), b"{\"service\": 7}"), Reject::Undecodable);
    assert_eq!(reason("n1/default/web/c1/eth0/9090", &bytes), Reject::Key);
    assert_eq!(reason("n9/default/web/c1/eth0/8080", &bytes), Reject::Node);
    let long = format!("{{\"{}\n\": 1}}", "x".repeat(10_000));
    let err = registry::decode_entry(&e.key(), long.as_bytes(), &trust).unwrap_err();
    assert!(
        err.detail.len() < 300 && !err.detail.contains('\n'),
        "{}",
        err.detail
    );
}

/// `/metrics`: `flock_registry_entries_rejected_total` has one series per reason (a
/// closed set, whatever the entries' contents) and counts what was refused.
#[test]
fn the_rejection_metric_has_one_series_per_reason() {
    use flock_core::registry::{Reject, Rejected};
    use flock_telemetry::prometheus_client::registry::Registry as Metrics;
    let r = Arc::new(registry::Rejections::default());
    r.reject(
        "etcd://x",
        "n1/a\"b\nc",
        &Rejected::new(Reject::Address, "0.0.0.0"),
    );
    r.reject(
        "etcd://x",
        "n1/a\"b\nc",
        &Rejected::new(Reject::Address, "0.0.0.0"),
    );
    r.reject("etcd://x", "n1/other", &Rejected::new(Reject::Name, "bad"));
    let mut m = Metrics::default();
    m.register_collector(Box::new(registry::RejectionsCollector(Arc::clone(&r))));
    let text = flock_telemetry::metrics::render(&m);
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("flock_registry_entries_rejected_total{"))
        .collect();
    assert_eq!(series.len(), Reject::ALL.len(), "{text}");
    assert!(
        series.contains(&"flock_registry_entries_rejected_total{reason=\"address\"} 1"),
        "{text}"
    );
    assert!(
        series.contains(&"flock_registry_entries_rejected_total{reason=\"name\"} 1"),
        "{text}"
    );
}
