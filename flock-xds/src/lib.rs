//! xDS server library: snapshot cache, ADS (SotW and Delta) and per-type services on tonic, and mesh translation for Envoy and proxyless gRPC.
//!
//! flock-xds is what Rust lacked: a go-control-plane. Put resources in a [`cache::Cache`]
//! (one snapshot per node or node group), hand it to a [`server::Server`], and Envoy
//! or any gRPC `xds:///` client gets them over ADS — SotW or Delta — or the per-type
//! services, over TCP or a unix socket. Versions follow content order (each group is a
//! `flock_core::snapshot::Publisher`), a change costs O(changed resources), a slow
//! stream coalesces instead of queueing, and CDS-before-EDS / make-before-break are
//! enforced per stream. [`translate`] turns a small mesh model into Envoy and
//! proxyless-gRPC resources; `cargo run -p flock-xds --example serve -- --help` serves
//! one from a JSON file.
//!
//! # Serve your own snapshot
//!
//! ```no_run
//! use envoy_types::pb::envoy::config::cluster::v3::Cluster;
//! use envoy_types::pb::google::protobuf::{Any, Duration};
//! use flock_core::ContentHash;
//! use flock_xds::{cache::Cache, server::Server, types::CLUSTER};
//! use prost::Message;
//! use std::sync::Arc;
//!
//! #[tokio::main]
//! async fn main() -> std::io::Result<()> {
//!     let cache = Arc::new(Cache::by_node_id());
//!     let cluster = Cluster {
//!         name: "backend".into(),
//!         connect_timeout: Some(Duration { seconds: 1, nanos: 0 }),
//!         ..Cluster::default()
//!     };
//!     let any = Any { type_url: CLUSTER.into(), value: cluster.encode_to_vec() };
//!     // Every Envoy whose bootstrap says `node: { id: envoy-1 }` gets this set; a
//!     // later `update` is diffed against it and only the changes are sent.
//!     cache.update("envoy-1", |prev| {
//!         prev.edit().upsert(CLUSTER, "backend", ContentHash::of(&any.value), any).build()
//!     });
//!     // `Server::new` allows every client (see "Who may connect" below): fine for a
//!     // demo on loopback, not for a node with secrets in its snapshots.
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:18000").await?;
//!     Server::new(cache).serve_tcp(listener, std::future::pending()).await
//! }
//! ```
//!
//! # Who may connect
//!
//! A snapshot may hold secrets (SDS: certificates *and private keys*), and a `Node` is
//! whatever the client writes, so the server never trusts it to say who the client
//! is. Every RPC first asks the server's [`server::Authorizer`] about the transport
//! [`server::Peer`] — the uid/gid/pid the kernel reports for a unix socket
//! (`SO_PEERCRED`), the SPIFFE ID and subject of a client certificate verified by
//! mTLS, or a bare TCP address, which authenticates nothing. The authorizer answers
//! with a [`server::Principal`] or refuses: `UNAUTHENTICATED` (no identity) or
//! `PERMISSION_DENIED` (known, not allowed); a refused client gets no resource of any
//! type, is logged once at `warn` with its uid or address, and is counted in
//! `flock_xds_unauthorized_total{reason}`. The principal fixes the stream's snapshot
//! group (or lets the cache group it by its `Node`, for a peer trusted to name its
//! own node) and whether it may see secrets: a principal without `secrets` asking for
//! the SDS type — the SDS service, or ADS SotW or Delta, named or wildcard — gets
//! `PERMISSION_DENIED` and no secret. The default authorizer, [`server::AllowAll`], is
//! only for a server behind another authentication layer.
//!
//! The listeners ([`server::Server::serve_unix`], `serve_tcp`, `serve_tls`) bind unix
//! sockets 0600 (or a chosen mode) only in a directory that is ours alone (not a
//! symlink, owned by our uid, not group/other-writable: [`server::ensure_private_dir`]
//! makes one), never `chmod` through a symlink, cap open connections and the streams
//! of each connection ([`server::ConnectionLimits`]), and back off on accept errors
//! such as running out of file descriptors instead of spinning.
//!
//! # Layers
//!
//! | module | what it does |
//! |---|---|
//! | [`types`] | the v3 type URLs (LDS, RDS, CDS, EDS, SDS) |
//! | [`protocol::sotw`] | one SotW stream of one type: subscription, ACK/NACK/stale, what to send |
//! | [`protocol::delta`] | one Delta stream of one type: subscribe/unsubscribe, initial versions, removals |
//! | [`protocol::order`] | one ADS stream: which type's response goes next |
//! | [`cache`] | per-group snapshots on `flock_core::snapshot::Publisher`, consistency check |
//! | [`callbacks`] | hooks for embedding control planes |
//! | [`server`] | the tonic services (ADS and per-type), authorization, unix/TCP/mTLS listeners, limits, metrics |
//! | [`translate`] | mesh model → Envoy and proxyless-gRPC resources (naming scheme there) |
//! | [`client`] | a raw ADS client for tests, benchmarks and debugging |
//!
//! The protocol layer is pure (no I/O, deterministic) and model-tested; the server is
//! a thin loop per stream over it (see [`server`]).
//!
//! # Resources and naming
//!
//! A snapshot is a [`flock_core::resources::ResourceSet`]: type URL → resource name →
//! (content hash, value). The value type `V` is the caller's (encoded bytes, a prost
//! `Any`, a test integer): this layer never decodes it. The **resource name** is the
//! xDS name the client subscribes to (a listener, route configuration, cluster,
//! cluster-load-assignment or secret name); the **content hash** is the Delta
//! resource version (`ContentHash::to_hex()`), so a resource that did not change is
//! never resent; the **snapshot version** (the group publisher's counter) is the SotW
//! `version_info` and the Delta `system_version_info`, in decimal.
//!
//! # Protocol decisions
//!
//! * **One response in flight per type.** After sending a response of a type, the
//!   stream sends nothing more of that type until the client ACKs or NACKs it
//!   (go-control-plane's watch-per-request model). Updates meanwhile coalesce: the
//!   machine holds only the latest snapshot and what the client holds, never a queue,
//!   so a slow stream's memory is bounded by its subscription whatever the publish
//!   rate.
//! * **Responses are built when polled.** A response is computed from the newest
//!   snapshot and subscription at the moment the server can write it; nothing is
//!   built ahead. A response for a name the client has since unsubscribed from is
//!   therefore never sent (a server that builds responses ahead can hand a client a
//!   resource it just unsubscribed from), and suppressing a response that would change
//!   nothing cannot lose a watch: there is no watch to lose, only pending names that
//!   stay pending (a server that drops its watch when it suppresses a no-op response
//!   leaves clients on stale endpoints until they reconnect).
//! * **ACK, NACK, stale.** A request whose `response_nonce` is the latest nonce sent
//!   for its type on the stream ACKs (no `error_detail`) or NACKs (with one) that
//!   response. Any other nonce is **stale**: the client had not seen our newest
//!   response yet, so its ACK/NACK says nothing about it and is ignored — matching it
//!   to the latest response is the go-control-plane bug class this avoids. For
//!   **SotW** a stale request is ignored entirely, as go-control-plane and the xDS
//!   spec ("the server should ignore requests with stale nonces") do: SotW requests
//!   carry the complete subscription, and the client sends it again when it ACKs or
//!   NACKs the response in flight (at most one is, see above; ignoring a stale request
//!   can only lose a subscription change when several responses are in flight). For
//!   **Delta** the subscription changes of a stale request are applied (only its
//!   ACK/NACK part is ignored): Delta changes are incremental and never repeated, and
//!   go-control-plane applies them too. A request on a type with nothing sent yet is
//!   initial whatever its nonce.
//! * **NACK keeps the last good version.** The client keeps running its last ACKed
//!   version ([`protocol::RequestKind::Nack`] carries both, for callbacks, logs and
//!   metrics). The rejected content is not resent — it would only be rejected again —
//!   and the stream treats it as held, so the next change of those resources (the
//!   fix, or a rollback) is sent. This matches Envoy and gRPC, which apply the valid
//!   resources of a response and reject the invalid ones.
//! * **Wildcards.** LDS and CDS requests naming nothing on the first request are
//!   wildcard (legacy); `*` subscribes any type to everything. SotW: a later
//!   non-empty list without `*` ends the legacy wildcard, and an empty list after
//!   that unsubscribes from everything. Delta: subscriptions are additive; only an
//!   unsubscribe of `*` ends a wildcard.
//! * **Delta.** `initial_resource_versions` seed what the client holds, so nothing it
//!   already has at the same hash is resent, and names it holds that no longer exist
//!   go out in `removed_resources`. Removals are only sent for subscribed names; an
//!   unsubscribed name is forgotten without a removal. A newly subscribed name that
//!   does not exist is answered with a removal (the Delta "does not exist" signal);
//!   this also corrects a client that unsubscribed and resubscribed a name while a
//!   response carrying it was in flight (the model test found that race: without the
//!   removal the client kept a deleted resource forever). A snapshot change costs
//!   O(changes): the stream intersects `resources::diff` with its subscription
//!   instead of scanning every resource.
//! * **The first response** of a type is sent even when it carries nothing new (an
//!   empty set, or a reconnect where the client holds everything), because clients
//!   wait for it to initialize. Version 0 (no snapshot set yet) is never sent.
//! * **R1 at the stream level.** A stream takes a snapshot only if it is newer than
//!   the one it has, so versions a client receives never go back, whatever order the
//!   server's tasks deliver snapshots in.
//! * **ADS ordering and make-before-break**: see [`protocol::order`]. Make-before-break
//!   holds among the types the stream knows; after a reconnect the server must feed
//!   the requests the client sent together before polling (so Delta learns every
//!   held type from `initial_resource_versions` first). SotW cannot keep it across a
//!   reconnect: a new stream knows nothing the client holds, and its first response
//!   of each type is the complete set.
//!
//! # Example
//!
//! ```
//! use flock_core::ContentHash;
//! use flock_xds::cache::Cache;
//! use flock_xds::protocol::{RequestKind, SotwAds, SotwRequest};
//! use flock_xds::types::{CLUSTER, ENDPOINT};
//!
//! // The control plane publishes a snapshot for node "n1".
//! let cache: Cache<&'static str> = Cache::by_node_id();
//! let snap = cache.update("n1", |prev| {
//!     prev.edit()
//!         .upsert(CLUSTER, "web", ContentHash::of(b"cluster web"), "cluster web")
//!         .upsert(ENDPOINT, "web", ContentHash::of(b"10.0.0.1"), "10.0.0.1")
//!         .build()
//! });
//!
//! // One ADS stream: the server feeds requests and snapshots, and sends what it polls.
//! let mut stream = SotwAds::new();
//! stream.on_snapshot(snap.state(), snap.version());
//! let req = |type_url: &str, names: &[&str], nonce: &str| SotwRequest {
//!     type_url: type_url.into(),
//!     resource_names: names.iter().map(|n| n.to_string()).collect(),
//!     response_nonce: nonce.into(),
//!     ..SotwRequest::default()
//! };
//! stream.on_request(&req(CLUSTER, &[], "")); // wildcard CDS
//! let cds = stream.poll_response().unwrap();
//! assert_eq!((cds.version_info.as_str(), cds.nonce.as_str()), ("1", "1"));
//! assert_eq!(cds.resources.len(), 1);
//! assert!(stream.poll_response().is_none(), "one response in flight per type");
//!
//! // The client ACKs and asks for the cluster's endpoints.
//! let ack = stream.on_request(&req(CLUSTER, &[], "1"));
//! assert_eq!(ack.kind, RequestKind::Ack { version: 1 });
//! stream.on_request(&req(ENDPOINT, &["web"], ""));
//! let eds = stream.poll_response().unwrap();
//! assert_eq!(*eds.resources[0].1, "10.0.0.1");
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cache;
pub mod callbacks;
pub mod client;
pub mod protocol;
pub mod server;
pub mod sync_status;
pub mod translate;
pub mod types;
