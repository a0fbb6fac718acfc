//! The admin endpoint over a real agent (tempdir pod store, embedded registry): the
//! typed client reads back what the agent holds, and `/metrics` carries the agent's
//! and the xDS server's metrics in one exposition.

mod common;

use envoy_types::pb::google::protobuf::Any;
use flock_bird::admin::api::{Health, Route};
use flock_bird::admin::client::AdminClient;
use flock_bird::admin::server::{AgentViews, ServeOptions, serve_with};
use flock_bird::agent::{Agent, AgentConfig, ENVOY_GROUP, group_of};
use flock_bird::registry::{self, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_xds::cache::Cache;
use flock_xds::server::Server;
use std::sync::Arc;

#[tokio::test]
async fn the_client_reads_what_the_agent_holds() {
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
    let agent = Arc::new(Agent::new(
        AgentConfig::new("n1"),
        store,
        reg,
        Arc::clone(&cache),
    ));
    let xds = Server::builder(cache).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let views = Arc::new(AgentViews::new(Arc::clone(&agent), &xds));
    let (_stop, stop) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        listener,
        views,
        ServeOptions::default(),
        async {
            let _ = stop.await;
        },
    ));
    let client = AdminClient::new(addr);

    // Before the store is loaded: not ready, and /readyz says why.
    let status = client.status().await.unwrap();
    assert!(!status.ready);
    let readyz = client.get(Route::Readyz).await.unwrap();
    assert_eq!(readyz.status, 503);
    assert_eq!(readyz.body, status.readiness_line().into_bytes());

    agent.load().await.unwrap();
    agent
        .add_pod(&common::input("c1", Some("web"), "8080/http"))
        .await
        .unwrap();

    let status = client.status().await.unwrap();
    assert!(status.ready, "{status:?}");
    assert_eq!((status.node.as_str(), status.pods), ("n1", 1));
    let version = agent.cache().snapshot(ENVOY_GROUP).unwrap().version();
    assert_eq!(status.xds_version, Some(version));

    let pods = client.pods().await.unwrap().pods;
    assert_eq!(pods.len(), 1);
    let p = &pods[0];
    assert_eq!(
        (p.pod.as_str(), p.service.as_str()),
        ("default/pod-c1", "web")
    );
    assert_eq!(p.ips, vec!["10.1.0.5".parse::<std::net::IpAddr>().unwrap()]);
    assert_eq!(p.ports[0].app_port, 8080);
    assert_eq!(p.health, Health::Unknown);
    // On the wire, health is a word, not a Rust debug rendering.
    let raw = client.get(Route::Pods).await.unwrap();
    assert!(
        String::from_utf8_lossy(&raw.body).contains("\"health\": \"unknown\""),
        "{}",
        String::from_utf8_lossy(&raw.body)
    );

    let snap = client.snapshot().await.unwrap();
    let envoy = &snap.groups[ENVOY_GROUP];
    assert_eq!(envoy.version, version);
    assert!(
        envoy.resources["cds"]
            .iter()
            .any(|n| n.contains("default/pod-c1")),
        "{envoy:?}"
    );

    let reg = client.registry().await.unwrap();
    assert!(reg.synced);
    assert_eq!(reg.backend, agent.registry().describe());
    assert_eq!(reg.endpoints.len(), 1);
    let ep = reg.endpoints.values().next().unwrap();
    assert_eq!((ep.service.as_str(), ep.node.as_str()), ("web", "n1"));

    let metrics = client.metrics().await.unwrap();
    for line in [
        "flock_agent_pods 1",
        "flock_agent_ready 1",
        "flock_agent_pods_added_total 1",
        "flock_agent_registry_endpoints 1",
        "flock_xds_streams_open 0",
        "flock_xds_requests_total{type=\"cds\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line}\n{metrics}");
    }
    assert_eq!(
        metrics.matches("# TYPE flock_agent_pods gauge").count(),
        1,
        "{metrics}"
    );
}
