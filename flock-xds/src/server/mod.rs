//! The gRPC xDS server (envoy-types + tonic) over the protocol machines and the cache.
//!
//! [`Server`] serves `StreamAggregatedResources` and `DeltaAggregatedResources` (ADS)
//! and the per-type services (LDS, RDS, CDS, EDS, SDS: `Stream*`, `Delta*` and
//! `Fetch*`) from one [`Cache`] of `Any` resources, over TCP or a unix socket. Each
//! stream is one task running the loop in `stream.rs`: requests are fed before
//! anything is polled, snapshots arrive through the group publisher's sink (version
//! order = content order), and a response is built only when the outbound slot is
//! free, so a slow client costs one snapshot reference, never a queue.
//!
//! Callbacks ([`Callbacks`]) see every stream event; NACKs are also logged at `warn`
//! with the client's `error_detail`, and counted in [`Metrics`].
//!
//! # Security
//!
//! Every RPC — ADS and per-type, SotW and Delta, stream and fetch — starts by asking
//! the [`Authorizer`] about the connection's [`Peer`] (see [`auth`] for the contract):
//! a refusal ends it before any request is read, so a refused client learns nothing,
//! not even whether a snapshot exists. The [`Principal`] it returns, not the client's
//! `Node`, decides the stream's snapshot group ([`GroupChoice`]) and whether the SDS
//! type may be subscribed. The listeners ([`Server::serve_unix`],
//! [`Server::serve_tcp`], [`Server::serve_tls`]) and their bounds are described in
//! `listen.rs`'s docs, summarised at [`ConnectionLimits`] and [`bind_unix_with_mode`].

pub mod accesslog;
pub mod auth;
mod budget;
mod coalesce;
mod conn;
mod convert;
mod listen;
mod metrics;
mod peer;
mod stream;
mod tls;

pub use auth::{AllowAll, Authorizer, GroupChoice, Principal};
pub use budget::{SubscriptionBudget, Usage};
pub use convert::Limits;
pub use listen::{
    AcceptBackoff, ConnectionLimits, TlsSettings, bind_unix, bind_unix_with_mode,
    ensure_private_dir,
};
pub use metrics::Metrics;
pub use peer::{Peer, identity_of};
pub use tls::ServerTls;

use crate::cache::Cache;
use crate::callbacks::{Callbacks, NoCallbacks, StreamKind};
use crate::types;
use envoy_types::pb::envoy::service::cluster::v3::cluster_discovery_service_server::{
    ClusterDiscoveryService, ClusterDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_server::{
    EndpointDiscoveryService, EndpointDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::listener::v3::listener_discovery_service_server::{
    ListenerDiscoveryService, ListenerDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::route::v3::route_discovery_service_server::{
    RouteDiscoveryService, RouteDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::Any;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// The shared state of every stream of one server.
pub(crate) struct Inner {
    cache: Arc<Cache<Any>>,
    callbacks: Arc<dyn Callbacks>,
    metrics: Metrics,
    limits: Limits,
    authorizer: Arc<dyn Authorizer>,
    connection_limits: ConnectionLimits,
    identifier: String,
    /// Where Envoy's access log entries go ([`accesslog`]); `None`: not served.
    access_log_sink: Option<Arc<dyn accesslog::AccessLogSink>>,
    next_stream: AtomicU64,
    /// Streams holding a slot of `limits.max_open_streams` (see `stream.rs`).
    open_streams: std::sync::atomic::AtomicUsize,
    /// What every stream holds of `limits.subscription_budget` (see `budget.rs`).
    budgets: Arc<budget::Budgets>,
    shutdown: watch::Sender<bool>,
}

impl Inner {
    fn next_stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// An xDS server over a [`Cache`]. Cheap to clone; every clone is the same server.
///
/// ```no_run
/// # async fn demo() -> std::io::Result<()> {
/// use std::sync::Arc;
/// use flock_xds::{cache::Cache, server::Server};
/// let cache = Arc::new(Cache::by_node_id());
/// let server = Server::new(Arc::clone(&cache));
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:18000").await?;
/// server.serve_tcp(listener, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("streams_open", &self.inner.metrics.streams_open())
            .field("identifier", &self.inner.identifier)
            .finish()
    }
}

/// Builds a [`Server`] with callbacks, limits and a control-plane identifier.
pub struct ServerBuilder {
    cache: Arc<Cache<Any>>,
    callbacks: Arc<dyn Callbacks>,
    limits: Limits,
    authorizer: Arc<dyn Authorizer>,
    connection_limits: ConnectionLimits,
    identifier: String,
    access_log_sink: Option<Arc<dyn accesslog::AccessLogSink>>,
}

impl ServerBuilder {
    /// Serves Envoy's gRPC access log service into `sink`, to peers the authorizer
    /// trusts with secrets (default: not served; see [`accesslog`]).
    pub fn access_log_sink(mut self, sink: Arc<dyn accesslog::AccessLogSink>) -> Self {
        self.access_log_sink = Some(sink);
        self
    }

    /// Stream event hooks (default: none).
    pub fn callbacks(mut self, callbacks: impl Callbacks + 'static) -> Self {
        self.callbacks = Arc::new(callbacks);
        self
    }

    /// Shared stream event hooks.
    pub fn callbacks_arc(mut self, callbacks: Arc<dyn Callbacks>) -> Self {
        self.callbacks = callbacks;
        self
    }

    /// Input limits (default: [`Limits::default`]).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Who may use the server, as which group, with or without secrets (default:
    /// [`AllowAll`], which is only safe behind another authentication layer). Asked
    /// before anything else on every RPC; see [`auth`].
    pub fn authorizer(mut self, authorizer: impl Authorizer + 'static) -> Self {
        self.authorizer = Arc::new(authorizer);
        self
    }

    /// A shared authorizer (see [`authorizer`](Self::authorizer)).
    pub fn authorizer_arc(mut self, authorizer: Arc<dyn Authorizer>) -> Self {
        self.authorizer = authorizer;
        self
    }

    /// Connection bounds of the server's listeners (default:
    /// [`ConnectionLimits::default`]).
    pub fn connection_limits(mut self, limits: ConnectionLimits) -> Self {
        self.connection_limits = limits;
        self
    }

    /// `ControlPlane.identifier` sent in every response (default: `flock-xds`; empty
    /// sends none). Envoy shows it in `/config_dump`.
    pub fn identifier(mut self, identifier: impl Into<String>) -> Self {
        self.identifier = identifier.into();
        self
    }

    /// The server.
    pub fn build(self) -> Server {
        Server {
            inner: Arc::new(Inner {
                cache: self.cache,
                callbacks: self.callbacks,
                metrics: Metrics::default(),
                limits: self.limits,
                authorizer: self.authorizer,
                connection_limits: self.connection_limits,
                identifier: self.identifier,
                access_log_sink: self.access_log_sink,
                next_stream: AtomicU64::new(0),
                open_streams: Default::default(),
                budgets: budget::Budgets::new(self.limits.subscription_budget),
                shutdown: watch::Sender::new(false),
            }),
        }
    }
}

type BoxStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send + 'static>>;

impl Server {
    /// A server over `cache` with default settings.
    pub fn new(cache: Arc<Cache<Any>>) -> Self {
        Self::builder(cache).build()
    }

    /// A builder over `cache`.
    pub fn builder(cache: Arc<Cache<Any>>) -> ServerBuilder {
        ServerBuilder {
            cache,
            callbacks: Arc::new(NoCallbacks),
            limits: Limits::default(),
            authorizer: Arc::new(AllowAll),
            connection_limits: ConnectionLimits::default(),
            identifier: "flock-xds".to_string(),
            access_log_sink: None,
        }
    }

    /// The cache the server serves.
    pub fn cache(&self) -> &Arc<Cache<Any>> {
        &self.inner.cache
    }

    /// The server's counters.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Ends every open stream with `UNAVAILABLE` (clients reconnect) and makes
    /// [`serve_tcp`](Self::serve_tcp) / [`serve_unix`](Self::serve_unix) return. Streams
    /// never end by themselves, so a graceful gRPC shutdown needs this.
    pub fn shutdown(&self) {
        self.inner.shutdown.send_replace(true);
    }

    /// Asks the authorizer about the peer of `request`'s connection; a refusal is
    /// counted, logged once per peer, and ends the RPC with the authorizer's status.
    fn authorize<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        let peer = Peer::of(request);
        if flock_core::reintroduced!("xds-auth-bypass") {
            // The bug: every client is trusted as whatever its Node claims, secrets
            // included.
            return AllowAll.authorize(&peer);
        }
        match self.inner.authorizer.authorize(&peer) {
            Ok(principal) => {
                tracing::debug!(%peer, principal = %principal.name, "xDS client authorized");
                Ok(principal)
            }
            Err(status) => {
                self.inner.metrics.transport.refusals.refuse(
                    &peer,
                    auth::reason_of(&status),
                    &status,
                );
                Err(status)
            }
        }
    }

    /// Refuses a principal without `secrets` on the SDS per-type service (before the
    /// stream or fetch reads a request).
    fn check_type(&self, principal: &Principal, type_url: &str) -> Result<(), Status> {
        if type_url == types::SECRET && !principal.secrets {
            let status = auth::secrets_denied(principal);
            self.inner
                .metrics
                .transport
                .refusals
                .refuse_secrets(principal, &status);
            return Err(status);
        }
        Ok(())
    }

    fn spawn_stream<F: stream::Flavor>(
        &self,
        kind: StreamKind,
        fixed_type: Option<&'static str>,
        request: Request<Streaming<F::Req>>,
    ) -> Result<Response<BoxStream<F::Resp>>, Status> {
        let principal = self.authorize(&request)?;
        if let Some(t) = fixed_type {
            self.check_type(&principal, t)?;
        }
        // An authorized stream keeps its connection out of the idle timeout, and its
        // subscriptions count against the connection's and the client's budget.
        let conn = conn::state_of(&request);
        let active = conn.as_ref().map(|c| c.stream());
        let budget = budget::StreamBudget::new(
            &self.inner.budgets,
            conn.as_ref().map(|c| c.id),
            conn.as_ref().map_or(conn::Pool::Tcp, |c| c.pool),
            &principal.name,
        );
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(stream::run::<F>(
            Arc::clone(&self.inner),
            kind,
            fixed_type,
            principal,
            (active, budget),
            request.into_inner(),
            tx,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    fn fetch(
        &self,
        type_url: &'static str,
        request: &Request<DiscoveryRequest>,
    ) -> Result<DiscoveryResponse, Status> {
        let principal = self.authorize(request)?;
        self.check_type(&principal, type_url)?;
        let _active = conn::state_of(request).map(|c| c.stream());
        let req = request.get_ref();
        let req_conv = convert::sotw_request(req, Some(type_url), &self.inner.limits)?;
        let node = req
            .node
            .as_ref()
            .map(|n| convert::checked_node(n, &self.inner.limits))
            .transpose()?
            .ok_or_else(|| Status::invalid_argument("a fetch request must carry the node"))?;
        let group = match &principal.group {
            GroupChoice::Fixed(group) => group.clone(),
            GroupChoice::ByNode => self.inner.cache.group_of(&node),
        };
        let snapshot = self.inner.cache.publisher(&group).latest();
        if snapshot.version() == 0 {
            return Err(Status::unavailable(format!(
                "no snapshot is set yet for node group {group:?}"
            )));
        }
        let set = snapshot.state();
        let resources = if req_conv.resource_names.is_empty() {
            set.iter_type(type_url)
                .map(|(_, e)| (**e.value()).clone())
                .collect()
        } else {
            req_conv
                .resource_names
                .iter()
                .filter_map(|n| set.get(type_url, n))
                .map(|e| (**e.value()).clone())
                .collect()
        };
        Ok(DiscoveryResponse {
            version_info: snapshot.version().to_string(),
            resources,
            type_url: type_url.to_string(),
            control_plane: convert::control_plane(&self.inner.identifier),
            ..DiscoveryResponse::default()
        })
    }

    /// The tonic server settings every listener uses: keepalives, and the streams one
    /// connection may open ([`ConnectionLimits`]).
    fn transport_builder(&self) -> tonic::transport::Server {
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .max_concurrent_streams(
                self.inner
                    .connection_limits
                    .max_concurrent_streams_per_connection,
            )
    }

    /// ADS and every per-type service on `builder`.
    fn routes(&self, mut builder: tonic::transport::Server) -> tonic::transport::server::Router {
        let max = self.inner.limits.max_request_bytes;
        let access_log = self.inner.access_log_sink.is_some().then(|| {
            envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::AccessLogServiceServer::new(
                self.clone(),
            )
            .max_decoding_message_size(max)
        });
        builder
            .add_optional_service(access_log)
            .add_service(
                AggregatedDiscoveryServiceServer::new(self.clone()).max_decoding_message_size(max),
            )
            .add_service(
                ListenerDiscoveryServiceServer::new(self.clone()).max_decoding_message_size(max),
            )
            .add_service(
                RouteDiscoveryServiceServer::new(self.clone()).max_decoding_message_size(max),
            )
            .add_service(
                ClusterDiscoveryServiceServer::new(self.clone()).max_decoding_message_size(max),
            )
            .add_service(
                EndpointDiscoveryServiceServer::new(self.clone()).max_decoding_message_size(max),
            )
            .add_service(
                SecretDiscoveryServiceServer::new(self.clone()).max_decoding_message_size(max),
            )
    }

    /// The tonic router with ADS and every per-type service, for callers that serve
    /// other services on the same port or bring their own listener. The authorizer
    /// still runs on every RPC, but the connection cap does not (it lives in this
    /// crate's listeners), and a listener whose connect info this crate does not know
    /// gives the authorizer [`Peer::Unknown`].
    pub fn router(&self) -> tonic::transport::server::Router {
        self.routes(self.transport_builder())
    }
}

/// Where a server listens: `HOST:PORT` or `unix:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A TCP address.
    Tcp(std::net::SocketAddr),
    /// A unix socket path.
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path, e.g. unix:/run/flock/xds.sock".into());
            }
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        s.parse()
            .map(Listen::Tcp)
            .map_err(|e| format!("{s:?} is neither HOST:PORT nor unix:PATH ({e})"))
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Server {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.spawn_stream::<stream::Sotw>(StreamKind::SotwAds, None, request)
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.spawn_stream::<stream::Delta>(StreamKind::DeltaAds, None, request)
    }
}

/// Implements one per-type service (`Stream*`, `Delta*`, `Fetch*`) over the shared loop.
macro_rules! per_type_service {
    ($trait:ident, $type_url:expr, $sotw:ident, $sotw_stream:ident, $delta:ident, $delta_stream:ident, $fetch:ident) => {
        #[tonic::async_trait]
        impl $trait for Server {
            type $sotw_stream = BoxStream<DiscoveryResponse>;
            type $delta_stream = BoxStream<DeltaDiscoveryResponse>;

            async fn $sotw(
                &self,
                request: Request<Streaming<DiscoveryRequest>>,
            ) -> Result<Response<Self::$sotw_stream>, Status> {
                self.spawn_stream::<stream::Sotw>(
                    StreamKind::Sotw($type_url),
                    Some($type_url),
                    request,
                )
            }

            async fn $delta(
                &self,
                request: Request<Streaming<DeltaDiscoveryRequest>>,
            ) -> Result<Response<Self::$delta_stream>, Status> {
                self.spawn_stream::<stream::Delta>(
                    StreamKind::Delta($type_url),
                    Some($type_url),
                    request,
                )
            }

            async fn $fetch(
                &self,
                request: Request<DiscoveryRequest>,
            ) -> Result<Response<DiscoveryResponse>, Status> {
                self.fetch($type_url, &request).map(Response::new)
            }
        }
    };
}

per_type_service!(
    ListenerDiscoveryService,
    types::LISTENER,
    stream_listeners,
    StreamListenersStream,
    delta_listeners,
    DeltaListenersStream,
    fetch_listeners
);
per_type_service!(
    RouteDiscoveryService,
    types::ROUTE,
    stream_routes,
    StreamRoutesStream,
    delta_routes,
    DeltaRoutesStream,
    fetch_routes
);
per_type_service!(
    ClusterDiscoveryService,
    types::CLUSTER,
    stream_clusters,
    StreamClustersStream,
    delta_clusters,
    DeltaClustersStream,
    fetch_clusters
);
per_type_service!(
    EndpointDiscoveryService,
    types::ENDPOINT,
    stream_endpoints,
    StreamEndpointsStream,
    delta_endpoints,
    DeltaEndpointsStream,
    fetch_endpoints
);
per_type_service!(
    SecretDiscoveryService,
    types::SECRET,
    stream_secrets,
    StreamSecretsStream,
    delta_secrets,
    DeltaSecretsStream,
    fetch_secrets
);
