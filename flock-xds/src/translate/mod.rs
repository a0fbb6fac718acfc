//! Mesh translation: a [`Mesh`] (services, pods, secrets) to Envoy and proxyless-gRPC
//! xDS resources. Pure functions, no I/O: the same mesh always gives byte-identical
//! resources, so content hashes (the Delta versions) only change when a resource
//! really does.
//!
//! * [`model`]: the mesh as JSON ([`Mesh::from_json`], [`Mesh::validate`]);
//! * [`envoy`]: resources for the node-local Envoy ([`envoy_resources`]);
//! * [`grpc`]: resources for proxyless gRPC clients ([`grpc_resources`]);
//! * [`memo`]: the per-entity translation [`Memo`] a control plane keeps between
//!   publishes; the whole-mesh translations run a fresh one;
//! * [`refs`]: [`EnvoyReferences`], what a resource refers to, for
//!   [`cache::check_consistency`](crate::cache::check_consistency).
//!
//! # Resource naming scheme
//!
//! `<ns>` is a namespace, `<pod>` a pod name, `<svc>` a service name, `<port>` a
//! service port, `<app_port>` a pod's application port. Service names and namespaces
//! are DNS labels and pod names DNS subdomains ([`Mesh::validate`] enforces it), so
//! the separators `|`, `/`, `:` and the `.` between service and namespace cannot
//! occur inside a part and names never collide.
//!
//! | resource | type | name | made by |
//! |---|---|---|---|
//! | inbound listener, on `<pod ip>:<listen_port>` in the pod's netns | LDS | `inbound\|<ns>/<pod>\|<app_port>` | [`pod_resources`] |
//! | app cluster, `127.0.0.1:<app_port>` from inside the pod (STATIC) | CDS | `inbound\|<app_port>\|<ns>/<pod>` | [`pod_resources`] |
//! | outbound listener, `127.0.0.1:<outbound_port>` in the pod's netns | LDS | `outbound\|<ns>/<pod>` | [`pod_resources`] |
//! | captured pod's outbound listener, `0.0.0.0:<outbound_port>` (`[::]` for an IPv6 pod) in the pod's netns | LDS | `outbound\|<ns>/<pod>` | [`capture_listener`] |
//! | captured pod's passthrough (`ORIGINAL_DST`, from inside the pod's netns) | CDS | `passthrough\|<ns>/<pod>` | [`pod_resources`] |
//! | the cluster closing what it gets (STATIC, no endpoints), when any pod is captured | CDS | `blackhole` | [`blackhole_cluster`] |
//! | TCP service port's mTLS cluster for captured callers `<id>` | CDS | `outbound\|<port>\|<svc>.<ns>\|<id>` | [`capture_caller_resources`] |
//! | outbound routes of every pod (one virtual host `<svc>.<ns>:<port>` per HTTP/gRPC service port; its domains include the service's VIPs `<ip>:<port>`) | RDS | `outbound\|http` | [`outbound_routes`] |
//! | service port cluster (EDS over ADS) | CDS | `outbound\|<port>\|<svc>.<ns>` | [`service_resources`], [`grpc_service_resources`] |
//! | service port endpoints | EDS | `outbound\|<port>\|<svc>.<ns>` (the cluster's name) | [`service_resources`], [`grpc_service_resources`] |
//! | outbound routes of the pods with SPIFFE ID `<id>` | RDS | `outbound\|http\|<id>` | [`caller_resources`] |
//! | service port cluster over mTLS for callers `<id>` | CDS | `outbound\|<port>\|<svc>.<ns>\|<id>` | [`caller_resources`] |
//! | its endpoints: the service port's, under the mTLS cluster's own name (a cluster added on a name another cluster already watches would get no EDS response and wait out Envoy's initial fetch timeout) | EDS | `outbound\|<port>\|<svc>.<ns>\|<id>` | [`caller_resources`], [`capture_caller_resources`] |
//! | secret: a pod's certificate (`TlsCertificate`), named by its SPIFFE ID; a trust bundle (`ValidationContext`), named by its trust domain | SDS | the secret's `name` | [`secret_resource`] |
//! | proxyless gRPC listener (`ApiListener`; the client dials `xds:///<svc>.<ns>:<port>` or `xds:///<vip>:<port>`) | LDS | `<svc>.<ns>:<port>`, `<vip>:<port>` | [`grpc_service_resources`] |
//! | proxyless gRPC server listener (gRPC's `XdsServer` on a pod's [`proxyless`](InboundPort::proxyless) port: mTLS from the app's `flock` certificate provider, the port's RBAC) | LDS | `grpc/server?xds.resource.listening_address=<pod ip>:<app_port>` | [`grpc_pod_resources`] |
//! | proxyless gRPC route configuration | RDS | `grpc\|<svc>.<ns>:<port>` | [`grpc_service_resources`] |
//!
//! The inbound listener of an HTTP or gRPC port holds an HTTP connection manager with
//! an inline route configuration (also named `inbound|<app_port>|<ns>/<pod>`, one
//! virtual host `*`); a TCP port holds a TCP proxy to the app cluster.
//!
//! **mTLS.** A pod with an `identity` (SPIFFE ID) gets TLS on its inbound listeners:
//! Envoy presents the SDS certificate named by that ID and requires a client
//! certificate from the same trust domain (validation context secret named by the
//! trust domain). Its outbound listener uses the routes `outbound|http|<id>`, whose
//! clusters for service ports where any endpoint has an `identity` connect over
//! mTLS, present the caller's certificate and accept from each endpoint only a server
//! certificate naming that endpoint's own IDs, its `identity` and its `also_accept`
//! IDs (an endpoint identity `spiffe://td/path/*` accepts any ID under
//! `spiffe://td/path/`, a SAN prefix match), never another endpoint's: one
//! `transport_socket_matches` entry per distinct set of IDs, selected by the
//! endpoint's `envoy.transport_socket_match` metadata (`flock.peer`), and a fallback
//! socket that accepts no workload certificate. Never downgrade: an endpoint without an
//! identity in such a port is left out of its endpoints ([`model::port_endpoints`]);
//! only ports where no endpoint has an identity keep the plain cluster. The secrets
//! must be in the mesh (the consistency check says which is missing). Pods without an
//! identity stay plaintext. The app behind an inbound HTTP/gRPC listener learns the
//! verified caller's SPIFFE ID from `x-forwarded-client-cert` (`URI=`); an XFCC the
//! caller sent itself is replaced, or removed on a plaintext connection.
//!
//! **Host names.** A pod's app reaches a service through its outbound listener with
//! `Host`/`:authority` set to `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc` or
//! `<svc>.<ns>.svc.cluster.local` followed by `:<port>`, or without the port for the
//! service's first HTTP/gRPC port. A service's VIPs (Kubernetes ClusterIPs) are host
//! names too: `<ip>:<port>` (IPv6 in brackets) and the bare `<ip>` for the first
//! HTTP/gRPC port. Envoy rejects a route configuration in which two
//! virtual hosts share a domain, and the route configuration is shared by all pods,
//! so the bare `<svc>` forms are only generated for a service name that exists in a
//! single namespace (otherwise clients use `<svc>.<ns>`). TCP service ports get
//! clusters and endpoints but no outbound route.
//!
//! **Many nodes.** The service port clusters (plain and mTLS) are the mesh
//! clusters: their endpoints are pods on this and other nodes, and a node can die.
//! * *Locality*: with [`EnvoyOptions::local_locality`] set (the agent's `--region`
//!   and `--zone`), each `ClusterLoadAssignment` puts the caller's zone at priority
//!   0, the rest of its region next and other regions last (renumbered without
//!   gaps), so traffic stays in the zone and fails over when it has no healthy
//!   endpoint left. Without it every endpoint is priority 0. Proxyless gRPC gets
//!   the same priorities.
//! * *Outlier detection* on every mesh cluster: consecutive gateway failures
//!   (connect failures and resets count) and 5xx eject a host within a second, up
//!   to all of them; a 1 s connect timeout makes a dead node's connects fail fast.
//!   The per-pod app clusters have neither: their one endpoint is the pod's own app.
//! * *Retries* on the outbound routes (shared and per caller): idempotent methods
//!   retry on `connect-failure,refused-stream,reset,gateway-error` with a per-try
//!   timeout; all other requests only on `connect-failure,refused-stream,
//!   reset-before-request` (never reached the app). At most 2 retries, each to
//!   another host and priority. The inbound routes (one local app) and TCP ports
//!   have none: a TCP proxy cannot replay a byte stream, and TCP service ports have
//!   no outbound route here; proxyless gRPC routes have none either (gRPC's own
//!   transparent retries cover what never reached a server).
//!
//! **Two node groups.** Serve [`envoy_resources`] and [`grpc_resources`] to different
//! node groups of the [`Cache`](crate::cache::Cache) (e.g. by a node metadata key or
//! an id prefix): Envoy rejects `ApiListener`s received over LDS, and a gRPC client has
//! no use for Envoy's listeners. Their clusters and endpoints are byte-identical.
//!
//! **Incremental translation.** A control plane can re-translate only the entity that
//! changed: [`pod_resources`] for a pod, [`service_resources`] /
//! [`grpc_service_resources`] for a service (and [`outbound_routes`] when a service's
//! ports or name change), [`secret_resource`] for a secret; then [`upsert_all`] into
//! a builder of the previous set (and remove what went away). Or translate the whole
//! mesh and [`replace_all`]: the builder ignores an upsert whose hash equals the
//! current one, so [`flock_core::resources::diff`] of the new set against the old one
//! still costs O(changes), and unchanged resources keep their versions and are not
//! resent.
//!
//! # Transparent capture
//!
//! Off by default; per pod with [`Pod::capture`]. Rules in the pod's netns (not made
//! here) redirect the app's TCP connections to `outbound_port` and its inbound app
//! ports to their listen ports, and let out packets carrying [`Capture::mark`]. Then:
//!
//! * the outbound listener ([`capture_listener`]) binds the wildcard address in the
//!   pod's netns with the `original_dst` listener filter and picks a filter chain by
//!   the destination the app dialled: a service port's VIPs and serving endpoint
//!   addresses on the service port → the cluster the pod's outbound routes use for
//!   that port (mTLS where the port is, TCP ports too); `127.0.0.1:<outbound_port>` →
//!   the Host-based routes as without capture; another address on the listener port →
//!   `blackhole` (not redirected, so no original destination: passing it through would
//!   loop into Envoy); anything else → the pod's `passthrough|<ns>/<pod>`
//!   (`ORIGINAL_DST`, connecting from inside the pod's netns), so destinations outside
//!   the mesh keep working;
//! * every socket Envoy opens inside the pod's netns (passthrough, app clusters) sets
//!   `SO_MARK` = the mark (`upstream_bind_config.socket_options`), so the rules do not
//!   redirect Envoy's own connections back to it. The service clusters connect from
//!   the host namespace and never meet the pod's rules;
//! * [`CaptureMode::Permissive`] inbound listeners of a pod with an identity add a TLS
//!   inspector and a plaintext chain (`transport_protocol: raw_buffer`) next to the mTLS
//!   one (`tls`), for callers not meshed yet; [`CaptureMode::Strict`] keeps mTLS only,
//!   the same listener as without capture.
//!
//! A direct connection to an endpoint's address is load-balanced over the whole
//! service port, not pinned to the pod dialled (the model has no `targetPort`; the
//! service port is matched). Without capture the output is unchanged.
//!
//! # Example
//!
//! ```
//! use flock_core::resources::ResourceSet;
//! use flock_xds::cache::check_consistency;
//! use flock_xds::translate::{self, EnvoyOptions, EnvoyReferences, Mesh};
//!
//! let mesh = Mesh::from_json(br#"{
//!   "services": [{"name": "greeter", "ports": [{"port": 50051, "protocol": "grpc"}],
//!                 "endpoints": [{"address": "10.0.0.7", "port": 15006}]}],
//!   "pods": [{"name": "greeter-0", "ip": "10.0.0.7", "netns": "/var/run/netns/greeter-0",
//!             "inbound": [{"app_port": 50051, "listen_port": 15006, "protocol": "grpc"}]}]
//! }"#).unwrap();
//!
//! let envoy = translate::envoy_resources(&mesh, &EnvoyOptions::default());
//! let names: Vec<&str> = envoy.iter().map(|r| r.name.as_str()).collect();
//! assert!(names.contains(&"inbound|default/greeter-0|50051"));
//! assert!(names.contains(&"outbound|50051|greeter.default"));
//!
//! let mut builder = ResourceSet::new().edit();
//! translate::replace_all(&mut builder, envoy);
//! let set = builder.build();
//! check_consistency(&set, &EnvoyReferences).unwrap();
//!
//! let grpc = translate::grpc_resources(&mesh);
//! assert!(grpc.iter().any(|r| r.name == "greeter.default:50051"));
//! check_consistency(&translate::into_set(grpc), &EnvoyReferences).unwrap();
//! ```

pub mod authz;
pub mod envoy;
pub mod grpc;
pub mod memo;
pub mod model;
pub mod policy;
pub mod refs;
pub mod telemetry;

pub use envoy::{
    EnvoyOptions, blackhole_cluster, caller_resources, capture_caller_resources, capture_listener,
    envoy_resources, outbound_routes, pod_resources, secret_resource, service_resources,
};
pub use grpc::{
    AppCertificates, CERTIFICATE_PROVIDER, SERVER_LISTENER_TEMPLATE, grpc_pod_resources,
    grpc_resources, grpc_service_resources, proxyless_bootstrap, server_listener_name,
};
pub use memo::{Changes, Entries, Flavor, Memo, Translation};
pub use model::{
    Capture, CaptureMode, DEFAULT_CAPTURE_MARK, Endpoint, Health, InboundAuthz, InboundPort,
    Locality, Mesh, MeshError, Pod, PolicyInput, PortEndpoints, PrivateKeyPem, Protocol, Secret,
    SecretKind, Service, ServicePort, ValidationError, identity_prefix, port_endpoints,
};
pub use refs::EnvoyReferences;

use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, VIRTUAL_HOST};
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::resources::{Name, ResourceSet, ResourceSetBuilder};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// One translated xDS resource.
#[derive(Clone, PartialEq)]
pub struct Resource {
    /// Its type URL, one of [`crate::types`]' constants.
    pub type_url: &'static str,
    /// Its xDS name (see the naming scheme in the [module docs](self)).
    pub name: String,
    /// `ContentHash::of(&any.value)`: its Delta version.
    pub hash: ContentHash,
    /// The encoded resource.
    pub any: Any,
}

impl Resource {
    /// A resource of `type_url` named `name`, hashing `any.value`.
    pub fn new(type_url: &'static str, name: String, any: Any) -> Self {
        Resource {
            type_url,
            name,
            hash: ContentHash::of(&any.value),
            any,
        }
    }
}

/// Shows the type, name, hash and size, never the bytes (a secret holds a private
/// key).
impl fmt::Debug for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resource")
            .field("type_url", &self.type_url)
            .field("name", &self.name)
            .field("hash", &self.hash)
            .field("bytes", &self.any.value.len())
            .finish()
    }
}

/// Sorts by type URL and name and drops later duplicates of a (type, name).
pub(crate) fn sort_dedup(mut out: Vec<Resource>) -> Vec<Resource> {
    out.sort_by(|a, b| (a.type_url, &a.name).cmp(&(b.type_url, &b.name)));
    out.dedup_by(|a, b| a.type_url == b.type_url && a.name == b.name);
    out
}

/// Makes `resources` the complete contents of the six xDS types (listeners, routes,
/// clusters, endpoints, secrets, virtual hosts) and of any other type among them: names of those
/// types not in `resources` are removed. An upsert whose hash equals the current
/// entry's is not recorded as a change (see
/// [`ResourceSetBuilder::upsert`]), so the built set's
/// [`diff`](flock_core::resources::diff) against the builder's parent visits only
/// what really changed, and unchanged resources keep their versions. The cost of
/// this call is O(resources) hash comparisons; no resource is re-encoded.
pub fn replace_all(builder: &mut ResourceSetBuilder<Any>, resources: Vec<Resource>) {
    type Entries = Vec<(Name, ContentHash, Arc<Any>)>;
    let mut by_type: BTreeMap<&'static str, Entries> =
        [LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET, VIRTUAL_HOST]
            .into_iter()
            .map(|t| (t, Vec::new()))
            .collect();
    for r in resources {
        by_type
            .entry(r.type_url)
            .or_default()
            .push((Name::from(r.name), r.hash, Arc::new(r.any)));
    }
    for (type_url, list) in by_type {
        builder.replace_type(type_url, list);
    }
}

/// Upserts `resources` into `builder` and removes nothing: for re-translating one
/// entity (a pod, a service, a secret). Unchanged resources (equal hash) are not
/// recorded as changes.
pub fn upsert_all(builder: &mut ResourceSetBuilder<Any>, resources: Vec<Resource>) {
    for r in resources {
        builder.upsert(r.type_url, &r.name, r.hash, r.any);
    }
}

/// A new set holding exactly `resources`.
pub fn into_set(resources: Vec<Resource>) -> ResourceSet<Any> {
    let mut builder = ResourceSet::new().edit();
    upsert_all(&mut builder, resources);
    builder.build()
}

/// Resource names (see the [naming scheme](self#resource-naming-scheme)).
pub mod names {
    use super::model::{Pod, Service};

    /// The route configuration of every pod's outbound listener.
    pub const OUTBOUND_ROUTE: &str = "outbound|http";

    /// `inbound|<ns>/<pod>|<app_port>`: the inbound listener of a pod's app port.
    pub fn inbound_listener(pod: &Pod, app_port: u16) -> String {
        format!("inbound|{}/{}|{app_port}", pod.namespace, pod.name)
    }

    /// `inbound|<app_port>|<ns>/<pod>`: the cluster reaching a pod's app port.
    pub fn inbound_cluster(pod: &Pod, app_port: u16) -> String {
        format!("inbound|{app_port}|{}/{}", pod.namespace, pod.name)
    }

    /// `outbound|<ns>/<pod>`: a pod's outbound listener.
    pub fn outbound_listener(pod: &Pod) -> String {
        format!("outbound|{}/{}", pod.namespace, pod.name)
    }

    /// `outbound|<port>|<svc>.<ns>`: a service port's cluster and endpoints.
    pub fn outbound_cluster(service: &Service, port: u16) -> String {
        outbound_cluster_of(&service.name, &service.namespace, port)
    }

    /// [`outbound_cluster`] of the service `name` in `namespace`.
    pub fn outbound_cluster_of(name: &str, namespace: &str, port: u16) -> String {
        format!("outbound|{port}|{name}.{namespace}")
    }

    /// [`mtls_cluster`] of the service `name` in `namespace`.
    pub fn mtls_cluster_of(name: &str, namespace: &str, port: u16, identity: &str) -> String {
        format!("{}|{identity}", outbound_cluster_of(name, namespace, port))
    }

    /// `<svc>.<ns>:<port>`: a service port's virtual host, and its proxyless gRPC
    /// listener (the client dials `xds:///<svc>.<ns>:<port>`).
    pub fn service_authority(service: &Service, port: u16) -> String {
        format!("{}.{}:{port}", service.name, service.namespace)
    }

    /// `grpc|<svc>.<ns>:<port>`: a gRPC service port's route configuration for
    /// proxyless clients.
    pub fn grpc_route(service: &Service, port: u16) -> String {
        format!("grpc|{}.{}:{port}", service.name, service.namespace)
    }

    /// `outbound|http|<spiffe-id>`: the outbound routes of the pods with this
    /// identity (their clusters present its certificate).
    pub fn outbound_route_for(identity: &str) -> String {
        format!("{OUTBOUND_ROUTE}|{identity}")
    }

    /// `passthrough|<ns>/<pod>`: a captured pod's `ORIGINAL_DST` cluster for
    /// destinations outside the mesh.
    pub fn passthrough_cluster(pod: &Pod) -> String {
        format!("passthrough|{}/{}", pod.namespace, pod.name)
    }

    /// The cluster that closes every connection (for connections to a captured
    /// pod's outbound listener that have no original destination).
    pub const BLACKHOLE_CLUSTER: &str = "blackhole";

    /// `capture|<svc>.<ns>:<port>`: the inline route configuration of a captured
    /// pod's filter chain for a service port.
    pub fn capture_route(service: &Service, port: u16) -> String {
        format!("capture|{}.{}:{port}", service.name, service.namespace)
    }

    /// `outbound|<port>|<svc>.<ns>|<spiffe-id>`: a service port's mTLS cluster for
    /// callers with this identity, and the name of its endpoints (the service
    /// port's, in a `ClusterLoadAssignment` of its own).
    pub fn mtls_cluster(service: &Service, port: u16, identity: &str) -> String {
        format!("{}|{identity}", outbound_cluster(service, port))
    }

    /// `outbound|<port>|<svc>.<ns>|<spiffe-id>|direct-<i>`: the `ORIGINAL_DST` mTLS
    /// cluster by which captured callers with this identity reach the one endpoint
    /// they dialled by address, for the service port's `i`th set of accepted IDs.
    pub fn direct_cluster(service: &Service, port: u16, identity: &str, set: usize) -> String {
        format!("{}|direct-{set}", mtls_cluster(service, port, identity))
    }
}

/// Type URLs of the extensions the translation embeds (filters, protocol options,
/// transport sockets).
pub mod type_urls {
    /// `envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager`.
    pub const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
    /// `envoy.extensions.filters.http.router.v3.Router`.
    pub const ROUTER: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";
    /// `envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy`.
    pub const TCP_PROXY: &str =
        "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";
    /// `envoy.extensions.upstreams.http.v3.HttpProtocolOptions`.
    pub const HTTP_PROTOCOL_OPTIONS: &str =
        "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions";
    /// `envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext`.
    pub const DOWNSTREAM_TLS: &str =
        "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext";
    /// `envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate`.
    pub const PREVIOUS_HOSTS: &str =
        "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate";
    /// `envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig`.
    pub const PREVIOUS_PRIORITIES: &str = "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig";
    /// `envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext`.
    pub const UPSTREAM_TLS: &str =
        "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
    /// `envoy.extensions.filters.listener.original_dst.v3.OriginalDst`.
    pub const ORIGINAL_DST: &str =
        "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst";
    /// `envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector`.
    pub const TLS_INSPECTOR: &str =
        "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector";
    /// `envoy.extensions.filters.listener.original_src.v3.OriginalSrc`.
    pub const ORIGINAL_SRC: &str =
        "type.googleapis.com/envoy.extensions.filters.listener.original_src.v3.OriginalSrc";
    /// `envoy.extensions.filters.network.set_filter_state.v3.Config`.
    pub const SET_FILTER_STATE: &str =
        "type.googleapis.com/envoy.extensions.filters.network.set_filter_state.v3.Config";
    /// `envoy.extensions.local_address_selectors.filter_state_override.v3.Config`.
    pub const FILTER_STATE_OVERRIDE_SELECTOR: &str = "type.googleapis.com/envoy.extensions.local_address_selectors.filter_state_override.v3.Config";
}
