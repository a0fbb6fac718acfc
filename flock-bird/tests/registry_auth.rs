//! The etcd registry against a REAL etcd with TLS, client-certificate authentication
//! and etcd auth (RBAC) enabled, set up as docs/registry-security.md tells an operator
//! to: a root user, one role per node with `readwrite` on `<prefix><node>/` and `read`
//! on `<prefix>`, and a read-only role. etcd is Debian's `etcd-server` (binary from
//! `FLOCK_ETCD_BIN`, installed by scripts/prereqs/40-etcd.sh); certificates are made
//! here with rcgen (a CA, etcd's server certificate for 127.0.0.1, one client
//! certificate per user: etcd takes the certificate's CN as the user when the client
//! sends no password).
//!
//! Each test starts its own single-member etcd on a reserved client port
//! (`flock_testkit::reserve_port_for_child`) in a temp dir; a guard kills it on drop. Waits are on the registry's view channel with a timeout.

#[path = "common/endpoint.rs"]
mod endpoint;

use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, route, route_action};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, Permission, TlsOptions};
use flock_bird::agent::mesh::{service_models, serving_endpoints};
use flock_bird::model::Endpoint;
use flock_bird::registry::{
    self, EtcdAuth, EtcdTls, Registry, RegistryError, RegistryOptions, RegistrySpec, View,
};
use flock_core::registry::Reject;
use flock_testkit::pki::{Leaf, TestCa};
use flock_testkit::{ChildPort, eventually, reserve_port_for_child};
use flock_xds::translate::{self, EnvoyOptions, Mesh};
use flock_xds::types::{CLUSTER, ENDPOINT, ROUTE};
use prost::Message;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

const PREFIX: &str = "/flock/endpoints/";
const TD: &str = "cluster.local";
const WEB_ID: &str = "spiffe://cluster.local/ns/default/sa/web";
const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/client";

/// The test CA of etcd and its clients.
struct Pki {
    ca: TestCa,
}

impl Pki {
    fn new() -> Self {
        Pki {
            ca: TestCa::new("flock test etcd"),
        }
    }

    /// A certificate with CN `cn` (etcd's user name for a client certificate), valid
    /// for 127.0.0.1, for servers and clients.
    fn leaf(&self, cn: &str) -> Leaf {
        self.ca.named(cn)
    }

    /// The registry's TLS settings with the client certificate of `cn`.
    fn registry_tls(&self, cn: &str) -> EtcdTls {
        let leaf = self.leaf(cn);
        EtcdTls {
            ca_pem: self.ca.ca_pem.clone(),
            cert_pem: Some(leaf.cert_pem),
            key_pem: Some(zeroize::Zeroizing::new(leaf.key_pem)),
        }
    }
}

/// One etcd process serving TLS with client-certificate auth; killed on drop.
struct Etcd {
    dir: tempfile::TempDir,
    /// Reserved while this etcd runs.
    client_port: ChildPort,
    child: Option<Child>,
}

impl Etcd {
    fn start(pki: &Pki) -> Self {
        let bin = std::env::var_os("FLOCK_ETCD_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                let p = PathBuf::from("/usr/bin/etcd");
                p.exists().then_some(p)
            })
            .expect("etcd not found: run scripts/prereqs/40-etcd.sh or set FLOCK_ETCD_BIN");
        let dir = tempfile::tempdir().unwrap();
        let server = pki.leaf("etcd");
        let file = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        let ca = file("ca.pem", &pki.ca.ca_pem);
        let cert = file("server.pem", &server.cert_pem);
        let key = file("server-key.pem", &server.key_pem);
        let client_port = reserve_port_for_child();
        let client = format!("https://127.0.0.1:{client_port}");
        // One member: nobody dials its peer URL, so port 0 (the kernel's pick) will do.
        let peer = "http://127.0.0.1:0";
        let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
        let child = Command::new(&bin)
            .args(["--name", "t1", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", peer])
            .args(["--initial-advertise-peer-urls", peer])
            .args(["--initial-cluster", &format!("t1={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
            .arg("--cert-file")
            .arg(&cert)
            .arg("--key-file")
            .arg(&key)
            .arg("--trusted-ca-file")
            .arg(&ca)
            .arg("--client-cert-auth")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting etcd");
        Etcd {
            dir,
            client_port,
            child: Some(child),
        }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// A raw etcd client with `cn`'s client certificate (and `user`'s password if
    /// given), once etcd answers.
    async fn client(&self, pki: &Pki, cn: &str, user: Option<(&str, &str)>) -> Client {
        let leaf = pki.leaf(cn);
        let tls = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(pki.ca.ca_pem.as_bytes()))
            .identity(Identity::from_pem(
                leaf.cert_pem.as_bytes(),
                leaf.key_pem.as_bytes(),
            ));
        eventually("etcd to answer", Duration::from_secs(15), async || {
            let mut opts = ConnectOptions::new().with_tls(tls.clone());
            if let Some((u, p)) = user {
                opts = opts.with_user(u, p);
            }
            let attempt = async {
                let mut c =
                    Client::connect([format!("https://{}", self.endpoint())], Some(opts)).await?;
                c.status().await?;
                Ok::<_, etcd_client::Error>(c)
            };
            match tokio::time::timeout(Duration::from_secs(2), attempt).await {
                Ok(Ok(c)) => Ok(c),
                Ok(Err(e)) => Err(format!("{e}; log: {}", self.log())),
                Err(_) => Err(format!("no answer in 2 s; log: {}", self.log())),
            }
        })
        .await
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The etcd end of the documented RBAC setup (docs/registry-security.md): root, a role
/// per node (`readwrite` on its prefix, `read` on the whole registry), a read-only
/// role, users holding them; then auth on. `node-b` also has a password (it logs in
/// with it; the others are known by their certificate's CN).
async fn secure(etcd: &Etcd, pki: &Pki) -> Client {
    let mut c = etcd.client(pki, "root", None).await;
    c.user_add("root", "root-password", None).await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    for node in ["node-a", "node-b"] {
        let role = format!("flock-{node}");
        c.role_add(&role).await.unwrap();
        c.role_grant_permission(
            &role,
            Permission::read_write(format!("{PREFIX}{node}/")).with_prefix(),
        )
        .await
        .unwrap();
        c.role_grant_permission(&role, Permission::read(PREFIX).with_prefix())
            .await
            .unwrap();
        let password = if node == "node-b" {
            "node-b-password"
        } else {
            "unused-password-of-a-cn-user"
        };
        c.user_add(node, password, None).await.unwrap();
        c.user_grant_role(node, &role).await.unwrap();
    }
    c.role_add("flock-reader").await.unwrap();
    c.role_grant_permission("flock-reader", Permission::read(PREFIX).with_prefix())
        .await
        .unwrap();
    c.user_add("reader", "unused-password-of-a-cn-user", None)
        .await
        .unwrap();
    c.user_grant_role("reader", "flock-reader").await.unwrap();
    c.auth_enable().await.unwrap();
    // A fresh root client: the one above connected before auth was on.
    etcd.client(pki, "root", None).await
}

fn opts(node: &str, tls: EtcdTls, auth: Option<EtcdAuth>) -> RegistryOptions {
    RegistryOptions {
        prefix: PREFIX.into(),
        lease_ttl_secs: 5,
        node: node.into(),
        reconnect_initial: Duration::from_millis(100),
        reconnect_max: Duration::from_millis(500),
        op_timeout: Duration::from_secs(3),
        tls: Some(tls),
        auth,
        trust_domain: Some(TD.into()),
        ..RegistryOptions::default()
    }
}

/// node-a logs in by its certificate's CN.
async fn node_a(etcd: &Etcd, pki: &Pki) -> Arc<dyn Registry> {
    registry::connect(
        &RegistrySpec::EtcdTls(vec![etcd.endpoint()]),
        opts("node-a", pki.registry_tls("node-a"), None),
    )
    .await
    .unwrap()
}

/// node-b logs in with its etcd user and password (its certificate's CN is not a user).
async fn node_b(etcd: &Etcd, pki: &Pki) -> Arc<dyn Registry> {
    registry::connect(
        &RegistrySpec::EtcdTls(vec![etcd.endpoint()]),
        opts(
            "node-b",
            pki.registry_tls("some-client"),
            Some(EtcdAuth {
                user: "node-b".into(),
                password: zeroize::Zeroizing::new("node-b-password".into()),
            }),
        ),
    )
    .await
    .unwrap()
}

fn ep(node: &str, pod: &str, address: &str, identity: Option<&str>) -> Endpoint {
    Endpoint {
        address: address.parse().unwrap(),
        identity: identity.map(str::to_string),
        ..endpoint::web(node, pod)
    }
}

async fn wait_view(reg: &dyn Registry, what: &str, cond: impl Fn(&View) -> bool) -> Arc<View> {
    let mut rx = reg.view();
    let res = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let v = rx.borrow_and_update().clone();
            if cond(&v) {
                return v;
            }
            rx.changed().await.expect("view sender dropped");
        }
    })
    .await;
    res.unwrap_or_else(|_| {
        panic!(
            "{}: timed out waiting for {what}; view: {:?}",
            reg.describe(),
            reg.view().borrow()
        )
    })
}

/// Writes `value` under `key` (relative to the prefix) with root's credentials.
async fn root_put(root: &mut Client, key: &str, value: impl Into<Vec<u8>>) {
    root.put(format!("{PREFIX}{key}"), value, None)
        .await
        .unwrap();
}

/// Per-node RBAC: node-a's credentials cannot write under node-b's prefix (etcd
/// refuses the raw write; the registry, misconfigured to write as node-b with node-a's
/// credentials, gets a `Denied` error naming the prefix its user may write), and the
/// registry refuses by itself to put another node's endpoint. Its own prefix works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cannot_write_under_another_nodes_prefix() {
    let pki = Pki::new();
    let etcd = Etcd::start(&pki);
    let _root = secure(&etcd, &pki).await;

    let mut raw_a = etcd.client(&pki, "node-a", None).await;
    let forged = ep("node-b", "forged", "10.0.0.66", None);
    let err = raw_a
        .put(
            format!("{PREFIX}{}", forged.key()),
            serde_json::to_vec(&forged).unwrap(),
            None,
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("permission denied"),
        "etcd did not refuse node-a's write under node-b/: {err}"
    );
    raw_a
        .put(format!("{PREFIX}node-a/probe"), "x", None)
        .await
        .expect("node-a may write under its own prefix");
    raw_a
        .delete(format!("{PREFIX}node-a/probe"), None)
        .await
        .unwrap();

    let a = node_a(&etcd, &pki).await;
    a.put(&ep("node-a", "pa", "10.0.0.1", None)).await.unwrap();
    let err = a.put(&forged).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Invalid { .. }) && err.to_string().contains("node-b"),
        "{err}"
    );

    // node-a's credentials in a registry that believes it is node-b: etcd refuses.
    let confused = registry::connect(
        &RegistrySpec::EtcdTls(vec![etcd.endpoint()]),
        opts("node-b", pki.registry_tls("node-a"), None),
    )
    .await
    .unwrap();
    let err = confused
        .put(&ep("node-b", "pb", "10.0.0.2", None))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, RegistryError::Denied { .. }), "{msg}");
    assert!(
        msg.contains("permission denied") && msg.contains("/flock/endpoints/node-b/"),
        "{msg}"
    );
}

/// A read-only user (no write permission anywhere) still connects, lists and watches
/// the whole registry: it sees both nodes' endpoints, including later changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_node_sees_everything() {
    let pki = Pki::new();
    let etcd = Etcd::start(&pki);
    let _root = secure(&etcd, &pki).await;
    let (a, b) = (node_a(&etcd, &pki).await, node_b(&etcd, &pki).await);
    let (ea, eb) = (
        ep("node-a", "pa", "10.0.0.1", None),
        ep("node-b", "pb", "10.0.0.2", None),
    );
    a.put(&ea).await.unwrap();
    b.put(&eb).await.unwrap();

    let reader = registry::connect(
        &RegistrySpec::EtcdTls(vec![etcd.endpoint()]),
        opts("reader", pki.registry_tls("reader"), None),
    )
    .await
    .unwrap();
    wait_view(&*reader, "both nodes' endpoints", |v| {
        v.synced && v.endpoints.contains_key(&ea.key()) && v.endpoints.contains_key(&eb.key())
    })
    .await;
    // And a later change by a node, through the watch.
    let eb2 = ep("node-b", "pb2", "10.0.0.3", None);
    b.put(&eb2).await.unwrap();
    wait_view(&*reader, "node-b's new endpoint", |v| {
        v.endpoints.contains_key(&eb2.key())
    })
    .await;
    // It cannot write anything.
    let err = reader
        .put(&ep("reader", "pr", "10.0.0.4", None))
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::Denied { .. }), "{err}");
}

/// Bad entries written by the test with root's credentials (so etcd RBAC does not
/// stop them: the agent's own check must) are each dropped alone: the service keeps
/// its good endpoints from both nodes in the view and in the translated Envoy
/// resources, each bad key is counted once under its reason, and writing the same bad
/// entry again does not count (or warn) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_entries_are_dropped_alone_and_the_service_keeps_serving() {
    let pki = Pki::new();
    let etcd = Etcd::start(&pki);
    let mut root = secure(&etcd, &pki).await;
    let (a, b) = (node_a(&etcd, &pki).await, node_b(&etcd, &pki).await);
    let (ea, eb) = (
        ep("node-a", "pa", "10.0.0.1", None),
        ep("node-b", "pb", "10.0.0.2", None),
    );
    a.put(&ea).await.unwrap();
    b.put(&eb).await.unwrap();

    let unspecified = ep("node-b", "zero", "0.0.0.0", None);
    let wrong_node = ep("node-c", "liar", "10.0.0.9", None);
    let wrong_node_key = "node-b/default/web/liar/eth0/8080".to_string();
    let foreign_td = ep(
        "node-b",
        "alien",
        "10.0.0.10",
        Some("spiffe://evil.example/ns/default/sa/web"),
    );
    let other_ns = ep(
        "node-b",
        "sneaky",
        "10.0.0.11",
        Some("spiffe://cluster.local/ns/kube-system/sa/admin"),
    );
    let bad: Vec<(String, Vec<u8>, Reject)> = vec![
        (
            unspecified.key(),
            serde_json::to_vec(&unspecified).unwrap(),
            Reject::Address,
        ),
        (
            wrong_node_key,
            serde_json::to_vec(&wrong_node).unwrap(),
            Reject::Node,
        ),
        (
            foreign_td.key(),
            serde_json::to_vec(&foreign_td).unwrap(),
            Reject::TrustDomain,
        ),
        (
            other_ns.key(),
            serde_json::to_vec(&other_ns).unwrap(),
            Reject::IdentityNamespace,
        ),
        (
            "node-b/default/web/junk/eth0/8080".into(),
            b"{not json".to_vec(),
            Reject::Undecodable,
        ),
        (
            "node-b/default/web/huge/eth0/8080".into(),
            vec![b' '; flock_core::registry::MAX_ENTRY_BYTES + 1],
            Reject::Oversized,
        ),
    ];
    for (key, value, _) in &bad {
        root_put(&mut root, key, value.clone()).await;
    }
    // A good entry written after the bad ones: once it is in the view, every bad one
    // was delivered (and judged) before it.
    let late = ep("node-b", "late", "10.0.0.5", None);
    b.put(&late).await.unwrap();
    let view = wait_view(&*a, "node-b's late endpoint", |v| {
        v.endpoints.contains_key(&late.key())
    })
    .await;

    let keys: BTreeSet<&str> = view.endpoints.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        BTreeSet::from([ea.key().as_str(), eb.key().as_str(), late.key().as_str()]),
        "only the good entries are in the view"
    );
    let rejections = a.rejections().expect("the etcd backend counts rejections");
    for (key, _, reason) in &bad {
        assert_eq!(
            rejections.refused().get(key),
            Some(reason),
            "{key}: {:?}",
            rejections.refused()
        );
        assert_eq!(rejections.count(*reason), 1, "{reason:?}");
    }

    // The same bad entry written again: still refused, not counted again.
    root_put(&mut root, &bad[0].0, bad[0].1.clone()).await;
    let later = ep("node-b", "later", "10.0.0.6", None);
    b.put(&later).await.unwrap();
    wait_view(&*a, "node-b's later endpoint", |v| {
        v.endpoints.contains_key(&later.key())
    })
    .await;
    assert_eq!(
        rejections.count(Reject::Address),
        1,
        "warned and counted once per key"
    );

    // A valid value replaced by a bad one leaves the view: what etcd holds is bad.
    let mut eb_bad = eb.clone();
    eb_bad.address = "224.0.0.1".parse().unwrap();
    root_put(&mut root, &eb.key(), serde_json::to_vec(&eb_bad).unwrap()).await;
    let view = wait_view(&*a, "node-b's endpoint to leave", |v| {
        !v.endpoints.contains_key(&eb.key())
    })
    .await;
    assert_eq!(rejections.count(Reject::Address), 2);

    // The service still translates, with every good endpoint.
    let (serving, _) = serving_endpoints(&view);
    let mesh = Mesh {
        services: service_models(serving),
        ..Mesh::default()
    };
    mesh.validate().expect("the service is still valid");
    let rs = translate::envoy_resources(&mesh, &EnvoyOptions::default());
    let cla = load_assignment(&rs, "outbound|8080|web.default");
    assert_eq!(
        addresses(&cla),
        BTreeSet::from([
            "10.0.0.1".to_string(),
            "10.0.0.5".to_string(),
            "10.0.0.6".to_string()
        ])
    );
}

/// Two nodes on a real etcd with per-node RBAC, each writing only under its own
/// prefix: node-b (its own credentials) writes endpoints of node-a's service `web`
/// carrying node-a's pod's identity (`default/web`, which the operator's scope lets
/// only node-a host), as identity and as a further accepted ID, one carrying the
/// namespace-wide prefix `.../sa/*`, one at `::ffff:127.0.0.1`, then more endpoints
/// of its own account than node-a's reader loads from one node. node-a's reader
/// (`--registry-scope`, a cap of 3) drops each forged entry alone with its reason,
/// keeps the first 3 of node-b's own, and the translated caller cluster never
/// accepts `default/web` from a node-b address. Without the scope check (mutant
/// `registry-any-scope`) this fails on "node-b's entry claiming node-a's pod was
/// loaded"; without the cap (mutant `registry-uncapped-node`) on "node-b's entries
/// beyond the cap were loaded".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cannot_claim_another_nodes_pods_or_flood_the_registry() {
    const B_ID: &str = "spiffe://cluster.local/ns/default/sa/web-b";
    const C_ID: &str = "spiffe://cluster.local/ns/default/sa/web-c";
    let pki = Pki::new();
    let etcd = Etcd::start(&pki);
    let mut root = secure(&etcd, &pki).await;
    let scope = flock_core::issuance::parse_scope(
        "node-a: default/web default/client\nnode-b: default/web-b\nnode-c: default/web-c\n",
    )
    .unwrap();
    let a = registry::connect(
        &RegistrySpec::EtcdTls(vec![etcd.endpoint()]),
        RegistryOptions {
            scope: Some(Arc::new(scope)),
            max_entries_per_node: 3,
            ..opts("node-a", pki.registry_tls("node-a"), None)
        },
    )
    .await
    .unwrap();
    let b = node_b(&etcd, &pki).await;
    let own = ep("node-a", "pa", "10.0.0.1", Some(WEB_ID));
    a.put(&own).await.unwrap();

    // node-b's forgeries, each written with node-b's own etcd credentials under its
    // own prefix (RBAC allows it: the prefix is not what is forged).
    let claims_web = ep("node-b", "forged", "10.0.0.20", Some(WEB_ID));
    let also_web = Endpoint {
        also_accept: vec![WEB_ID.to_string()],
        ..ep("node-b", "also", "10.0.0.21", Some(B_ID))
    };
    let wildcard = ep(
        "node-b",
        "wild",
        "10.0.0.22",
        Some("spiffe://cluster.local/ns/default/sa/*"),
    );
    let mapped = ep("node-b", "mapped", "::ffff:127.0.0.1", Some(B_ID));
    for e in [&claims_web, &also_web, &wildcard, &mapped] {
        b.put(e).await.unwrap();
    }
    // Then five of its own account's: the reader loads the first three.
    let mut flood = Vec::new();
    for i in 0..5 {
        let e = ep(
            "node-b",
            &format!("own{i}"),
            &format!("10.0.1.{i}"),
            Some(B_ID),
        );
        b.put(&e).await.unwrap();
        flood.push(e);
    }
    // node-c's entry, written last by root: once node-a sees it, it saw all of the above.
    let late = ep("node-c", "late", "10.0.2.1", Some(C_ID));
    root_put(&mut root, &late.key(), serde_json::to_vec(&late).unwrap()).await;
    let view = wait_view(&*a, "node-c's late endpoint", |v| {
        v.endpoints.contains_key(&late.key())
    })
    .await;
    let rejections = a.rejections().expect("the etcd backend counts rejections");
    let refused = rejections.refused();

    for (e, why) in [(&claims_web, Reject::Scope), (&also_web, Reject::Scope)] {
        assert!(
            !view.endpoints.contains_key(&e.key()),
            "node-b's entry claiming node-a's pod was loaded: {e:?}"
        );
        assert_eq!(refused.get(&e.key()), Some(&why), "{refused:?}");
    }
    assert!(!view.endpoints.contains_key(&wildcard.key()));
    assert!(refused.contains_key(&wildcard.key()), "{refused:?}");
    assert!(!view.endpoints.contains_key(&mapped.key()));
    assert_eq!(
        refused.get(&mapped.key()),
        Some(&Reject::Address),
        "{refused:?}"
    );

    let kept: Vec<&Endpoint> = view
        .endpoints
        .values()
        .map(|r| &*r.endpoint)
        .filter(|e| e.node == "node-b")
        .collect();
    assert_eq!(
        kept.len(),
        3,
        "node-b's entries beyond the cap were loaded: {kept:?}"
    );
    for (i, e) in flood.iter().enumerate() {
        assert_eq!(view.endpoints.contains_key(&e.key()), i < 3, "{}", e.key());
    }
    assert_eq!(rejections.count(Reject::NodeCap), 2);
    assert!(view.endpoints.contains_key(&own.key()));

    // The caller's mTLS cluster accepts `default/web` from node-a's endpoint only:
    // every other endpoint is pinned to its own account.
    let (serving, _) = serving_endpoints(&view);
    let mut mesh = Mesh {
        services: service_models(serving),
        ..Mesh::default()
    };
    mesh.pods.push(translate::Pod {
        name: "client-0".into(),
        namespace: "default".into(),
        uid: None,
        ip: "10.0.0.99".parse().unwrap(),
        netns: None,
        inbound: Vec::new(),
        outbound_port: 15001,
        identity: Some(CLIENT_ID.into()),
        capture: None,
    });
    mesh.validate().expect("a valid mesh");
    let rs = translate::envoy_resources(&mesh, &EnvoyOptions::default());
    let cla = load_assignment(&rs, &format!("outbound|8080|web.default|{CLIENT_ID}"));
    for lb in cla.endpoints.iter().flat_map(|l| &l.lb_endpoints) {
        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &lb.host_identifier else {
            panic!("an endpoint without an address")
        };
        let address = match e.address.as_ref().and_then(|a| a.address.as_ref()) {
            Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(s)) => {
                s.address.clone()
            }
            other => panic!("{other:?}"),
        };
        let pinned = lb
            .metadata
            .as_ref()
            .and_then(|m| {
                m.filter_metadata
                    .get(translate::envoy::TRANSPORT_SOCKET_MATCH)
            })
            .and_then(|s| s.fields.get(translate::envoy::PEER_MATCH_KEY))
            .and_then(|v| match &v.kind {
                Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(s)) => {
                    Some(s.clone())
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("{address}: not pinned"));
        let want = match address.as_str() {
            "10.0.0.1" => WEB_ID,
            a if a.starts_with("10.0.1.") => B_ID,
            "10.0.2.1" => C_ID,
            a => panic!("{a}: unexpected endpoint"),
        };
        assert_eq!(pinned, want, "{address}");
    }
}

/// Never downgrade, end to end: node-b's endpoint of `web:8080` has a SPIFFE ID; root
/// writes a valid but identity-less endpoint of the same port under another node's
/// prefix. The agent serving a caller with an identity excludes it (and says so), and
/// in the translated Envoy resources the caller's route still goes to the mTLS
/// cluster and no endpoint list holds the identity-less address: it never gets a
/// plaintext path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_less_entry_never_creates_a_plaintext_path() {
    let pki = Pki::new();
    let etcd = Etcd::start(&pki);
    let mut root = secure(&etcd, &pki).await;
    let (a, b) = (node_a(&etcd, &pki).await, node_b(&etcd, &pki).await);
    let eb = ep("node-b", "web-0", "10.0.0.2", Some(WEB_ID));
    b.put(&eb).await.unwrap();
    let plain = ep("node-c", "web-1", "10.0.0.77", None);
    root_put(&mut root, &plain.key(), serde_json::to_vec(&plain).unwrap()).await;
    let view = wait_view(&*a, "both endpoints of web", |v| {
        v.endpoints.contains_key(&eb.key()) && v.endpoints.contains_key(&plain.key())
    })
    .await;

    let (serving, excluded) = serving_endpoints(&view);
    assert_eq!(
        excluded,
        std::collections::BTreeMap::from([(plain.key(), Reject::Downgrade)])
    );
    let mut mesh = Mesh {
        services: service_models(serving),
        ..Mesh::default()
    };
    mesh.pods.push(translate::Pod {
        name: "client-0".into(),
        namespace: "default".into(),
        uid: None,
        ip: "10.0.0.1".parse().unwrap(),
        netns: Some("/run/netns/client-0".into()),
        inbound: Vec::new(),
        outbound_port: 15001,
        identity: Some(CLIENT_ID.into()),
        capture: None,
    });
    mesh.validate().unwrap();
    // The translation alone (without the agent's filter) must hold the line too.
    let mut unfiltered = mesh.clone();
    unfiltered.services = service_models(view.endpoints.values().map(|e| &**e));
    for (what, m) in [("agent", &mesh), ("translation alone", &unfiltered)] {
        let rs = translate::envoy_resources(m, &EnvoyOptions::default());
        let rc: RouteConfiguration =
            decode(find(&rs, ROUTE, &format!("outbound|http|{CLIENT_ID}")));
        let vh = rc
            .virtual_hosts
            .iter()
            .find(|v| v.name == "web.default:8080")
            .expect("a virtual host for web:8080");
        let target = match &vh.routes[0].action {
            Some(route::Action::Route(a)) => match &a.cluster_specifier {
                Some(route_action::ClusterSpecifier::Cluster(c)) => c.clone(),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        };
        assert_eq!(
            target,
            format!("outbound|8080|web.default|{CLIENT_ID}"),
            "{what}: the caller's route must stay on the mTLS cluster"
        );
        assert!(
            rs.iter().any(|r| r.type_url == CLUSTER && r.name == target),
            "{what}: the mTLS cluster exists"
        );
        for r in rs.iter().filter(|r| r.type_url == ENDPOINT) {
            let cla = ClusterLoadAssignment::decode(r.any.value.as_slice()).unwrap();
            assert!(
                !addresses(&cla).contains("10.0.0.77"),
                "{what}: {} routes to the identity-less endpoint",
                r.name
            );
        }
    }
}

fn find<'a>(rs: &'a [translate::Resource], type_url: &str, name: &str) -> &'a translate::Resource {
    rs.iter()
        .find(|r| r.type_url == type_url && r.name == name)
        .unwrap_or_else(|| {
            panic!(
                "no {type_url} {name}; have {:?}",
                rs.iter().map(|r| &r.name).collect::<Vec<_>>()
            )
        })
}

fn decode<M: Message + Default>(r: &translate::Resource) -> M {
    M::decode(r.any.value.as_slice()).unwrap()
}

fn load_assignment(rs: &[translate::Resource], name: &str) -> ClusterLoadAssignment {
    decode(find(rs, ENDPOINT, name))
}

fn addresses(cla: &ClusterLoadAssignment) -> BTreeSet<String> {
    cla.endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => ep.address.clone(),
            _ => None,
        })
        .filter_map(|a| match a.address {
            Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(s)) => {
                Some(s.address)
            }
            _ => None,
        })
        .collect()
}
