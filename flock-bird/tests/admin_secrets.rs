//! No private key ever reaches the admin endpoint or a `Debug` rendering: an agent with
//! the built-in CA and a meshed pod (so its SDS snapshot holds an SVID with its key) is
//! read through every admin route, and every identity and agent type that holds a key
//! is formatted with `{:?}` and `{:#?}`; none of it may contain a PEM private-key header
//! or any line of the key's base64 body.

mod common;

use envoy_types::pb::google::protobuf::Any;
use flock_bird::admin::api::Route;
use flock_bird::admin::client::AdminClient;
use flock_bird::admin::server::{AgentViews, ServeOptions, serve_with};
use flock_bird::agent::{Agent, AgentConfig, ENVOY_GROUP, group_of};
use flock_bird::identity::{BuiltinCa, IdentityProvider};
use flock_bird::registry::{self, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_xds::cache::Cache;
use flock_xds::server::Server;
use flock_xds::types;
use std::sync::Arc;
use std::time::Duration;

/// The lines of a PEM key's base64 body that hold private bytes. PKCS#8 embeds the
/// public key, which the (public) certificate holds too, so a line of only public-key
/// bytes may legitimately appear in a certificate; those are left out.
fn key_lines(pem: &str, cert_chain_pem: &str) -> Vec<String> {
    pem.lines()
        .filter(|l| !l.starts_with("-----") && !cert_chain_pem.contains(l))
        .map(str::to_owned)
        .collect()
}

fn assert_clean(what: &str, text: &str, keys: &[String]) {
    assert!(
        !text.contains("PRIVATE KEY"),
        "{what} shows a private-key header:\n{text}"
    );
    for line in keys {
        assert!(
            !text.contains(line.as_str()),
            "{what} shows a line of the private key"
        );
    }
}

#[tokio::test]
async fn admin_documents_and_debug_output_never_contain_a_private_key() {
    let dir = tempfile::tempdir().unwrap();
    let reg = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "n1".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let ca = BuiltinCa::new(
        "cluster.local",
        Duration::from_secs(3600),
        flock_clock::unix_now,
    )
    .unwrap();
    let agent = Arc::new(
        Agent::new(AgentConfig::new("n1"), store, reg, Arc::clone(&cache))
            .with_identity(Arc::clone(&ca) as Arc<dyn IdentityProvider>),
    );
    agent.load().await.unwrap();
    agent
        .add_pod(&common::input("c1", Some("web"), "8080/http"))
        .await
        .unwrap();

    // The key really is in the agent: in the identity view and in the SDS snapshot.
    let view = ca.view().borrow().clone();
    let svid = view.svids.values().next().expect("the pod's SVID").clone();
    let pem = svid.private_key_pem.expose().to_owned();
    assert!(pem.contains("PRIVATE KEY"));
    let keys = key_lines(&pem, &svid.cert_chain_pem);
    // The first line holds the PKCS#8 header and the private scalar: always there.
    assert!(!keys.is_empty(), "no private key line to look for");
    let snap = cache.snapshot(ENVOY_GROUP).expect("an Envoy snapshot");
    assert!(
        snap.state().iter_type(types::SECRET).next().is_some(),
        "the SDS snapshot holds the pod's secret"
    );

    let xds = Server::builder(Arc::clone(&cache)).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let views = Arc::new(AgentViews::new(Arc::clone(&agent), &xds));
    let (_stop, stop) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        listener,
        Arc::clone(&views),
        ServeOptions::default(),
        async {
            let _ = stop.await;
        },
    ));
    let client = AdminClient::new(addr);
    for route in Route::ALL {
        let r = client.get(route).await.unwrap();
        assert_eq!(r.status, 200, "{}", route.path());
        assert_clean(route.path(), &String::from_utf8_lossy(&r.body), &keys);
    }
    // The snapshot document does list the secret, by name only.
    let snapshot = client.snapshot().await.unwrap();
    assert!(
        snapshot.groups[ENVOY_GROUP].resources["sds"]
            .iter()
            .any(|n| *n == svid.spiffe_id),
        "{snapshot:?}"
    );

    for (what, text) in [
        ("Svid {:?}", format!("{svid:?}")),
        ("Svid {:#?}", format!("{svid:#?}")),
        ("IdentityView {:?}", format!("{view:?}")),
        ("SecretPem {}", format!("{}", svid.private_key_pem)),
        ("BuiltinCa {:?}", format!("{ca:?}")),
        ("provider describe", ca.describe()),
        ("AgentViews {:?}", format!("{views:?}")),
        ("pods {:?}", format!("{:?}", agent.pods())),
    ] {
        assert_clean(what, &text, &keys);
    }
}
