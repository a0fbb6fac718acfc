//! The xDS server test setup the wire tests share: node `n1`'s cache holding a few
//! resources, the server on a TCP port, raw ADS streams to it, and request builders.

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest,
};
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::resources::ResourceSetBuilder;
use flock_xds::cache::Cache;
use flock_xds::client::{self, DeltaStream, SotwStream};
use flock_xds::server::Server;
use std::sync::Arc;

/// The node every test client is.
pub const NODE: &str = "n1";

/// One test resource: (type URL, name, body). Its `Any` carries the body's bytes and
/// its version is the body's hash.
pub type Res<'a> = (&'a str, &'a str, &'a str);

/// The `Any` a resource with `body` is sent as.
pub fn any(type_url: &str, body: &str) -> Any {
    Any {
        type_url: type_url.to_string(),
        value: body.as_bytes().to_vec(),
    }
}

/// Upserts one resource into a snapshot being built.
pub fn put(b: &mut ResourceSetBuilder<Any>, t: &str, name: &str, body: &str) {
    b.upsert(t, name, ContentHash::of(body.as_bytes()), any(t, body));
}

/// Publishes one new snapshot for [`NODE`]: the last one with `resources` upserted.
pub fn upsert(cache: &Cache<Any>, resources: &[Res<'_>]) {
    cache.update(NODE, |s| {
        let mut b = s.edit();
        for (t, name, body) in resources {
            put(&mut b, t, name, body);
        }
        b.build()
    });
}

/// A cache whose first snapshot for [`NODE`] holds `resources` (version 1).
pub fn cache_with(resources: &[Res<'_>]) -> Arc<Cache<Any>> {
    let cache = Arc::new(Cache::by_node_id());
    upsert(&cache, resources);
    cache
}

/// A server running on a free 127.0.0.1 port until [`Running::stop`].
pub struct Running {
    pub server: Server,
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    /// `http://127.0.0.1:<port>`, for [`client::connect`].
    pub target: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Serves `server` over TCP on a listener bound to port 0 (no port to race for).
pub async fn start_tcp(server: Server) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let target = format!("http://127.0.0.1:{port}");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let task = tokio::spawn(async move {
        s.serve_tcp(listener, async {
            let _ = stopped.await;
        })
        .await
    });
    Running {
        server,
        port,
        target,
        stop: Some(stop),
        task,
    }
}

/// `cache` served by a default [`Server`] (the common case).
pub async fn serve(cache: &Arc<Cache<Any>>) -> Running {
    start_tcp(Server::new(Arc::clone(cache))).await
}

impl Running {
    /// A state-of-the-world ADS stream on a new connection.
    pub async fn sotw(&self) -> SotwStream {
        client::sotw(client::connect(&self.target).await.unwrap())
            .await
            .unwrap()
    }

    /// A Delta ADS stream on a new connection.
    pub async fn delta(&self) -> DeltaStream {
        client::delta(client::connect(&self.target).await.unwrap())
            .await
            .unwrap()
    }

    /// Stops the server and checks it shut down cleanly.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

/// A state-of-the-world request from [`NODE`].
pub fn sotw_req(type_url: &str, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(client::node(NODE)),
        type_url: type_url.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..DiscoveryRequest::default()
    }
}

/// A Delta request from [`NODE`].
pub fn delta_req(
    type_url: &str,
    subscribe: &[&str],
    unsubscribe: &[&str],
    nonce: &str,
) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(client::node(NODE)),
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..DeltaDiscoveryRequest::default()
    }
}

/// The names of a Delta response's resources, in order.
pub fn names(resp: &DeltaDiscoveryResponse) -> Vec<&str> {
    resp.resources.iter().map(|r| r.name.as_str()).collect()
}
