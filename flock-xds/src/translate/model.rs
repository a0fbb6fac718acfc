//! The mesh model: what a control plane knows about services, pods and secrets, as
//! the JSON a user of the `serve` example writes.
//!
//! Every struct rejects unknown fields, so a typo is an error with a line number
//! instead of a silently ignored setting. [`Mesh::from_json`] parses *and* validates;
//! [`Mesh::validate`] reports every problem at once, each with the path of the field
//! at fault (`services[1].endpoints[0].weight`).
//!
//! ```json
//! {
//!   "services": [{
//!     "name": "web", "namespace": "default",
//!     "ports": [{"name": "http", "port": 8080, "protocol": "http"}],
//!     "endpoints": [{"address": "10.0.0.7", "port": 15006,
//!                    "locality": {"region": "eu", "zone": "eu-1"}, "weight": 2}]
//!   }],
//!   "pods": [{
//!     "name": "web-0", "ip": "10.0.0.7", "netns": "/var/run/netns/web-0",
//!     "inbound": [{"app_port": 8080, "listen_port": 15006, "protocol": "http"}]
//!   }],
//!   "secrets": [{"name": "root-ca", "kind": {"validation_context": {"trusted_ca_pem": "-----BEGIN CERTIFICATE-----..."}}}]
//! }
//! ```

use flock_core::pod;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

/// Largest JSON document [`Mesh::from_json`] accepts (16 MiB).
pub const MAX_JSON_BYTES: usize = 16 << 20;
/// Most endpoints in a mesh (summed over all services).
pub const MAX_ENDPOINTS: usize = 100_000;
/// Most services in a mesh.
pub const MAX_SERVICES: usize = 10_000;
/// Most pods in a mesh.
pub const MAX_PODS: usize = 10_000;
/// Most secrets in a mesh.
pub const MAX_SECRETS: usize = 10_000;
/// Longest service name, namespace or port name (the DNS label limit).
pub use flock_core::pod::MAX_LABEL_LEN;
/// Longest pod, secret or locality name (the DNS subdomain limit).
pub use flock_core::pod::MAX_NAME_LEN;
/// Longest `netns` path (Linux `PATH_MAX`).
pub use flock_core::pod::MAX_NETNS_LEN as MAX_PATH_LEN;
/// Most ports of one service, and most inbound ports of one pod: the pod
/// validator's limit, so a pod the agent accepts is one the translation accepts.
pub use flock_core::pod::MAX_PORTS;
/// Most [`Endpoint::also_accept`] IDs of one endpoint (the registry's limit, so an
/// entry the agent accepts is one the translation accepts).
pub use flock_core::registry::MAX_ALSO_ACCEPT;
/// Most virtual IPs of one service (Kubernetes gives at most two: one per family).
pub const MAX_VIPS: usize = 8;
/// Longest PEM string of a secret (1 MiB).
pub const MAX_PEM_LEN: usize = 1 << 20;

/// The default outbound listener port of a pod (`127.0.0.1:15001` in the pod).
pub const DEFAULT_OUTBOUND_PORT: u16 = 15001;

/// Everything the translation needs to know: services, pods and secrets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mesh {
    /// The services clients reach (outbound clusters, endpoints and routes).
    #[serde(default)]
    pub services: Vec<Service>,
    /// The pods on this node whose traffic the node-local Envoy carries (inbound and
    /// outbound listeners, one cluster per app port).
    #[serde(default)]
    pub pods: Vec<Pod>,
    /// TLS secrets served over SDS, by name.
    #[serde(default)]
    pub secrets: Vec<Secret>,
}

/// A service: a name, its ports and the endpoints behind them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// Service name: a DNS label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63
    /// characters), unique within its namespace.
    pub name: String,
    /// Namespace: a DNS label. Default `"default"`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The ports clients dial, at least one, each number once. The first `http` or
    /// `grpc` port also gets the port-less host names in the outbound routes.
    pub ports: Vec<ServicePort>,
    /// The endpoints (pod addresses) behind the service.
    #[serde(default)]
    pub endpoints: Vec<Endpoint>,
    /// Virtual IPs of the service (Kubernetes ClusterIPs): each VIP × port is one more
    /// host name of that port in the outbound routes (`<ip>:<port>`, IPv6 in brackets),
    /// and the bare `<ip>` of the first `http`/`grpc` port, like the port-less names;
    /// proxyless gRPC clients may dial `xds:///<ip>:<port>`. At most
    /// [`MAX_VIPS`], not unspecified or multicast, and no host name may be another
    /// service's too. Default: none.
    #[serde(default)]
    pub vips: Vec<IpAddr>,
    /// Traffic policy: the rules of the `HTTPRoute`s whose parent is this service
    /// ([`flock_core::route`]), each for one HTTP/gRPC port or all of them. A port
    /// with rules routes by them (and answers 404 to what none matches); a port
    /// without keeps the default route to all its endpoints. At most
    /// [`MAX_ROUTE_RULES`]. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<RouteRule>,
    /// Connection-pool limits of the service's clusters; default
    /// [`ConnectionPool::default`] (every mesh cluster has limits: one Envoy
    /// carries every pod of the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<ConnectionPool>,
}

/// Most route rules of one service (16 routes of 16 rules each).
pub const MAX_ROUTE_RULES: usize = 256;

pub use super::policy::ConnectionPool;
pub use flock_core::route::RouteRule;

/// One port of a service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServicePort {
    /// Optional port name (a DNS label, unique within the service); informational.
    #[serde(default)]
    pub name: Option<String>,
    /// The port number clients dial (1–65535).
    pub port: u16,
    /// What the port speaks. Default `http`.
    #[serde(default)]
    pub protocol: Protocol,
}

/// The application protocol of a port (shared with the agent's pod model).
pub use flock_core::pod::Protocol;

/// One endpoint of a service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The IP address to connect to (an IPv4 or IPv6 string; not unspecified or
    /// multicast). A malformed address is a JSON error at its line.
    pub address: IpAddr,
    /// The port to connect to (1–65535): for a meshed pod, the `listen_port` of its
    /// inbound listener, so traffic enters through the pod's Envoy; otherwise the
    /// application's own port.
    pub port: u16,
    /// Where the endpoint runs. Default: all fields empty. Endpoints are grouped by
    /// locality; proxyless gRPC clients need one, and an empty one is still sent.
    #[serde(default)]
    pub locality: Locality,
    /// Health as the control plane knows it. Default `healthy`.
    #[serde(default)]
    pub health: Health,
    /// Load-balancing weight (at least 1). Default 1. The weights of one
    /// service port's endpoints must sum to at most `u32::MAX`.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Which service port this endpoint serves. Default (absent or `null`): every port
    /// of the service.
    #[serde(default)]
    pub service_port: Option<u16>,
    /// The endpoint's SPIFFE ID, when it serves mTLS. When any endpoint of a service
    /// port has one, the port is mTLS: callers with an identity reach it over mTLS and
    /// verify the server's certificate names one of these IDs, and an endpoint of that
    /// port without an identity is left out ([`port_endpoints`]), never a reason to
    /// fall back to plaintext. Only a port where no endpoint has one is plaintext.
    ///
    /// An ID ending in `/*` (`spiffe://td/ns/shop/sa/*`) accepts any SPIFFE ID under
    /// that path (a URI SAN prefix match on `spiffe://td/ns/shop/sa/`): what a
    /// registry knows when it knows the callee's namespace but not its accounts. It is
    /// still an identity, so the port is still mTLS.
    #[serde(default)]
    pub identity: Option<String>,
    /// Further SPIFFE IDs (or `/*` ID prefixes, as in `identity`) the endpoint may
    /// present: a caller's verification of the endpoint's service port accepts each of
    /// them as well as `identity`. For a registry that knows the accounts a service
    /// runs as but not which one each endpoint has (a Kubernetes EndpointSlice), so
    /// every endpoint must be accepted under any of them. Only meaningful with
    /// `identity` (without one it is an error), at most [`MAX_ALSO_ACCEPT`], each
    /// validated like `identity`. Default: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also_accept: Vec<String>,
    /// The pod's labels a route subset selects on ([`flock_core::labels`]: at most
    /// 8, keys and values as Kubernetes writes them). Default: none.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: flock_core::labels::Labels,
}

/// A failure domain, as in Envoy's `Locality`.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Locality {
    /// Region (default empty), at most 253 characters.
    #[serde(default)]
    pub region: String,
    /// Zone within the region (default empty), at most 253 characters.
    #[serde(default)]
    pub zone: String,
    /// Sub-zone within the zone (default empty), at most 253 characters.
    #[serde(default)]
    pub sub_zone: String,
}

/// Health of an endpoint (shared with the agent's liveness and registry).
pub use flock_core::pod::Health;

/// A pod on this node, whose traffic the node-local Envoy carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pod {
    /// Pod name: a DNS subdomain (`[a-z0-9.-]`, starting and ending alphanumeric, at
    /// most 253 characters), unique within its namespace.
    pub name: String,
    /// Namespace: a DNS label. Default `"default"`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The pod's UID, informational (at most 128 characters).
    #[serde(default)]
    pub uid: Option<String>,
    /// The pod's IP address, where its inbound listeners bind (not unspecified or
    /// multicast).
    pub ip: IpAddr,
    /// Absolute path of the pod's network namespace file (e.g.
    /// `/var/run/netns/web-0`). Envoy runs in the host namespace and binds the pod's
    /// listeners and connects to its app inside this namespace. `null` (the default):
    /// the host namespace. The file must exist when Envoy loads the config; that is
    /// not checked here.
    #[serde(default)]
    pub netns: Option<String>,
    /// The ports the pod's application serves, each reached through an inbound
    /// listener.
    #[serde(default)]
    pub inbound: Vec<InboundPort>,
    /// Port of the pod's outbound HTTP listener on `127.0.0.1` inside the pod (the app
    /// sends its HTTP/gRPC requests there, with the service as `Host`/`:authority`).
    /// Default 15001; `0`: no outbound listener.
    #[serde(default = "default_outbound_port")]
    pub outbound_port: u16,
    /// The pod's SPIFFE ID (`spiffe://trust-domain/path`), for mTLS. Validated, not
    /// translated yet.
    #[serde(default)]
    pub identity: Option<String>,
    /// Transparent capture: the pod's traffic is redirected to Envoy by packet
    /// rules in its netns (installed by someone else), so unmodified apps are meshed.
    /// `None` (the default): no capture, apps use the outbound listener explicitly.
    /// Needs `netns` and a non-zero `outbound_port`. See the
    /// [module docs](super#transparent-capture).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<Capture>,
}

/// The default [`Capture::mark`]: the `SO_MARK` of Envoy's sockets in a captured
/// pod's netns, which the capture rules let out unredirected.
pub const DEFAULT_CAPTURE_MARK: u32 = 0x539;

/// How a pod's traffic is captured (see [`Pod::capture`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capture {
    /// Whether the pod's inbound listeners also take plaintext. Default `strict`.
    #[serde(default)]
    pub mode: CaptureMode,
    /// `SO_MARK` set on every socket Envoy opens inside the pod's netns (the
    /// passthrough and app clusters), so the capture rules, which skip packets with
    /// this mark, do not redirect Envoy's own connections back to Envoy. Not 0.
    /// Default [`DEFAULT_CAPTURE_MARK`].
    #[serde(default = "default_capture_mark")]
    pub mark: u32,
}

/// Whether a captured pod's inbound listeners accept plaintext callers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CaptureMode {
    /// Only mTLS (for a pod with an identity): a caller outside the mesh is refused.
    #[default]
    Strict,
    /// mTLS and plaintext side by side (a TLS inspector tells them apart): for
    /// migrating a namespace while some callers are not meshed yet.
    Permissive,
}

fn default_capture_mark() -> u32 {
    DEFAULT_CAPTURE_MARK
}

/// One port the application of a pod serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboundPort {
    /// The port the application listens on inside the pod; Envoy connects to
    /// `127.0.0.1:app_port` from inside the pod, or for a captured pod to
    /// `<pod ip>:app_port` from the caller's address (so the app must listen on the
    /// pod's address or all addresses). Unique within the pod.
    pub app_port: u16,
    /// The port of Envoy's inbound listener on the pod IP; service endpoints of this
    /// pod use it as their `port`. Unique within the pod. It may equal `app_port`
    /// only if the application listens on `127.0.0.1` alone (or, for a
    /// [`proxyless`](Self::proxyless) port, must: there it is the app's own).
    pub listen_port: u16,
    /// What the port speaks. Default `http`.
    #[serde(default)]
    pub protocol: Protocol,
    /// Who may call this port ([`flock_core::authz`]): the policies in force for the
    /// service ports it serves, enforced by Envoy RBAC on the verified peer
    /// certificate (`super::authz`). Absent: no policy, as without policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authz: Option<InboundAuthz>,
    /// The application serves this port itself as a proxyless gRPC xDS server (gRPC's
    /// `XdsServer`): Envoy gets no listener or cluster for it, and the proxyless
    /// translation serves the server the listener
    /// `grpc/server?xds.resource.listening_address=<pod ip>:<app_port>`, with mTLS from
    /// the server's own certificate provider and this port's RBAC
    /// ([`super::grpc`]). Needs protocol `grpc` and `listen_port` equal to `app_port`
    /// (callers dial the app directly). On a captured pod the capture rules must leave
    /// the port alone (the agent's do). Default `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub proxyless: bool,
}

/// The policies of one inbound port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboundAuthz {
    /// The service ports the port serves (a rule's `to.ports` name service ports).
    #[serde(default)]
    pub service_ports: std::collections::BTreeSet<u16>,
    /// The pod's namespace's policy.
    #[serde(default)]
    pub namespace_policy: Option<PolicyInput>,
    /// The service's own policy.
    #[serde(default)]
    pub service_policy: Option<PolicyInput>,
    /// The pod's annotation ([`flock_core::authz::ANNOTATION`]): narrows, never widens.
    #[serde(default)]
    pub annotation: Option<PolicyInput>,
    /// The policy that governs the port, as its denials are counted (`namespace` or
    /// `namespace/service`); empty: not counted.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub governed_by: String,
}

/// A policy as the agent received it: its spec, or why it was refused (which refuses
/// every call it governs: fail closed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyInput {
    /// The written policy.
    Spec(flock_core::authz::PolicySpec),
    /// Why it was refused.
    Refused(String),
}

impl PolicyInput {
    /// The policy checked, or its refusal.
    pub fn checked(&self) -> flock_core::authz::Checked {
        match self {
            PolicyInput::Spec(s) => flock_core::authz::Policy::from_spec(s),
            PolicyInput::Refused(why) => Err(flock_core::authz::PolicyError {
                field: "policy".to_string(),
                reason: why.clone(),
            }),
        }
    }
}

impl InboundAuthz {
    /// The effective policy of the port of a pod in `namespace`.
    pub fn effective(&self, namespace: &str) -> flock_core::authz::Effective {
        let ns = self.namespace_policy.as_ref().map(PolicyInput::checked);
        let svc = self.service_policy.as_ref().map(PolicyInput::checked);
        let ann = self.annotation.as_ref().map(PolicyInput::checked);
        flock_core::authz::effective(namespace, ns.as_ref(), svc.as_ref())
            .narrowed(namespace, ann.as_ref())
    }
}

/// A TLS secret served over SDS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Secret {
    /// The SDS resource name (`[A-Za-z0-9._:/-]`, at most 253 characters), unique.
    pub name: String,
    /// What the secret holds.
    pub kind: SecretKind,
}

/// The contents of a [`Secret`]: `{"tls_certificate": {...}}` or
/// `{"validation_context": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SecretKind {
    /// A certificate and its private key (a server's or a client's identity).
    TlsCertificate {
        /// The PEM certificate chain (leaf first).
        certificate_chain_pem: String,
        /// The PEM private key. Never shown by `Debug`.
        private_key_pem: PrivateKeyPem,
    },
    /// Trusted CA certificates to validate peers with.
    ValidationContext {
        /// The PEM CA bundle.
        trusted_ca_pem: String,
    },
}

/// A PEM private key: a string whose `Debug` output is `<redacted>`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PrivateKeyPem(pub String);

impl fmt::Debug for PrivateKeyPem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<redacted {} bytes>", self.0.len())
    }
}

impl Drop for PrivateKeyPem {
    fn drop(&mut self) {
        // Wipe the key before its memory is freed: a mesh is rebuilt on every change,
        // so without this each rebuild would leave one more copy of every key behind.
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

fn default_namespace() -> String {
    "default".to_string()
}
fn default_weight() -> u32 {
    1
}
fn default_outbound_port() -> u16 {
    DEFAULT_OUTBOUND_PORT
}

/// One problem of a mesh, at a path such as `services[1].endpoints[0].weight`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationError {
    /// Where the problem is (field path from the mesh root).
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a mesh could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// The document is larger than [`MAX_JSON_BYTES`].
    #[error("mesh JSON is {len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Size of the document.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The document is not valid JSON or does not fit the model (unknown field,
    /// wrong type, malformed IP address…).
    #[error("mesh JSON, line {line} column {column}: {message}")]
    Json {
        /// 1-based line of the error (0 if unknown).
        line: usize,
        /// 1-based column of the error (0 if unknown).
        column: usize,
        /// serde_json's description, without its position suffix.
        message: String,
    },
    /// The document parsed but the mesh is invalid; every problem is listed.
    #[error("invalid mesh: {}", join_errors(.0))]
    Invalid(Vec<ValidationError>),
}

fn join_errors(errors: &[ValidationError]) -> String {
    let mut s = format!("{} problem(s)", errors.len());
    for e in errors {
        s.push_str("; ");
        s.push_str(&e.to_string());
    }
    s
}

impl Mesh {
    /// Parses a JSON document and [validates](Self::validate) the mesh. Rejects
    /// documents over [`MAX_JSON_BYTES`] before parsing; JSON errors carry the line
    /// and column.
    pub fn from_json(bytes: &[u8]) -> Result<Mesh, MeshError> {
        if bytes.len() > MAX_JSON_BYTES {
            return Err(MeshError::TooLarge {
                len: bytes.len(),
                limit: MAX_JSON_BYTES,
            });
        }
        let mesh: Mesh = serde_json::from_slice(bytes).map_err(|e| {
            let full = e.to_string();
            // serde_json appends " at line L column C"; we report them as fields.
            let message = match full.rfind(" at line ") {
                Some(i) if e.line() > 0 => full[..i].to_string(),
                _ => full,
            };
            MeshError::Json {
                line: e.line(),
                column: e.column(),
                message,
            }
        })?;
        mesh.validate().map_err(MeshError::Invalid)?;
        Ok(mesh)
    }

    /// Checks everything the translation relies on and returns every problem: names
    /// that would break the resource naming scheme, duplicates (services, pods,
    /// secrets, ports, endpoints, listener addresses), zero ports and weights,
    /// endpoints for ports the service does not have, unusable addresses, limits.
    /// A mesh that passes translates to a self-consistent set of resources.
    pub fn validate(&self) -> Result<(), Vec<ValidationError>> {
        let mut v = Validator::default();
        v.mesh(self);
        if v.errors.is_empty() {
            Ok(())
        } else {
            Err(v.errors)
        }
    }
}

impl Mesh {
    /// Resolves every service's route rules against the mesh's services
    /// ([`super::policy::resolve`]), after making the services of the route subsets
    /// they name anew ([`super::policy::subset_services`]; an earlier call's subset
    /// services are replaced): what a control
    /// plane that writes rules by hand calls before translating. Returns what was
    /// dropped.
    pub fn resolve_routes(&mut self) -> Vec<super::policy::RouteProblem> {
        // The route subsets first, so the rules resolve against them; those of an
        // earlier call are made again (a subset whose endpoints are gone must not be
        // kept with its old ones).
        self.services.retain(|s| s.subset_of().is_none());
        let subsets = {
            let services = &self.services;
            let lookup = |ns: &str, name: &str| {
                services
                    .iter()
                    .find(|s| s.namespace == ns && s.name == name)
            };
            super::policy::subset_services(services.iter().flat_map(|s| &s.routes), &lookup)
        };
        self.services.extend(subsets);
        let snapshot = self.services.clone();
        let lookup = |ns: &str, name: &str| {
            snapshot
                .iter()
                .find(|s| s.namespace == ns && s.name == name)
        };
        let mut problems = Vec::new();
        for s in &mut self.services {
            if s.routes.is_empty() {
                continue;
            }
            let (rules, p) = super::policy::resolve(&s.routes, s, &lookup);
            s.routes = rules;
            problems.extend(p);
        }
        problems
    }
}

impl Service {
    /// For a route subset's service (`web~version=v2`,
    /// [`flock_core::route::subset_service_name`]): the Service it is a subset of and
    /// its selector. Such a service carries clusters and endpoints only: no host
    /// names, virtual hosts, gRPC listener or capture chain (its endpoints are its
    /// Service's too, and are reached by that name).
    pub fn subset_of(&self) -> Option<(&str, &str)> {
        self.name.split_once(flock_core::route::SUBSET_SEPARATOR)
    }

    /// [`Mesh::validate`] of a mesh of this service alone (the same problems, with
    /// paths under `services[0]`), without building one: the agent validates a
    /// service on its own each time its endpoints change, and copying the service
    /// into a mesh for that cost more than the checks.
    pub fn validate(&self) -> Result<(), Vec<ValidationError>> {
        let mut v = Validator::default();
        v.endpoint_total(self.endpoints.len());
        // What `Validator::mesh` checks of each service; the checks across services
        // (duplicate names, a VIP host name of two services) cannot fail for one.
        v.service("services[0]", self);
        if v.errors.is_empty() {
            Ok(())
        } else {
            Err(v.errors)
        }
    }
}

#[derive(Default)]
struct Validator {
    errors: Vec<ValidationError>,
}

impl Validator {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(ValidationError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn mesh(&mut self, m: &Mesh) {
        if m.services.len() > MAX_SERVICES {
            self.err(
                "services",
                format!(
                    "{} services, more than the limit of {MAX_SERVICES}",
                    m.services.len()
                ),
            );
        }
        if m.pods.len() > MAX_PODS {
            self.err(
                "pods",
                format!("{} pods, more than the limit of {MAX_PODS}", m.pods.len()),
            );
        }
        if m.secrets.len() > MAX_SECRETS {
            self.err(
                "secrets",
                format!(
                    "{} secrets, more than the limit of {MAX_SECRETS}",
                    m.secrets.len()
                ),
            );
        }
        self.endpoint_total(m.services.iter().map(|s| s.endpoints.len()).sum());

        let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
        // VIP host name → the service that has it: the outbound route configuration is
        // shared by every pod and Envoy rejects one in which two virtual hosts share a
        // domain, so a VIP host name must belong to one service only.
        let mut vip_hosts: HashMap<String, usize> = HashMap::new();
        for (i, s) in m.services.iter().enumerate() {
            let path = format!("services[{i}]");
            self.service(&path, s);
            for host in vip_domains(s) {
                if let Some(&first) = vip_hosts.get(&host) {
                    if first != i {
                        self.err(
                            format!("{path}.vips"),
                            format!("VIP host name {host} is also services[{first}]'s"),
                        );
                    }
                } else {
                    vip_hosts.insert(host, i);
                }
            }
            if let Some(first) = seen.insert((&s.namespace, &s.name), i) {
                self.err(
                    format!("{path}.name"),
                    format!(
                        "duplicate service {}.{} (also services[{first}])",
                        s.name, s.namespace
                    ),
                );
            }
        }

        let mut seen: HashMap<(&str, &str), usize> = HashMap::new();
        // (netns, ip, port) → the listener that binds it, to catch two listeners on
        // one socket address.
        let mut binds: HashMap<(Option<&str>, IpAddr, u16), String> = HashMap::new();
        // (ip, port) → the proxyless port there: its server listener is named by the
        // address alone, whatever the network namespace.
        let mut proxyless: HashMap<(IpAddr, u16), String> = HashMap::new();
        for (i, p) in m.pods.iter().enumerate() {
            let path = format!("pods[{i}]");
            self.pod(&path, p);
            if let Some(first) = seen.insert((&p.namespace, &p.name), i) {
                self.err(
                    format!("{path}.name"),
                    format!(
                        "duplicate pod {}/{} (also pods[{first}])",
                        p.namespace, p.name
                    ),
                );
            }
            let netns = p.netns.as_deref();
            let mut bind = |v: &mut Validator, at: String, ip: IpAddr, port: u16| {
                if port == 0 {
                    return; // reported by `pod`
                }
                if let Some(other) = binds.get(&(netns, ip, port)) {
                    v.err(
                        at.clone(),
                        format!(
                            "listener address {} in network namespace {} is also bound by {other}",
                            std::net::SocketAddr::new(ip, port),
                            netns.unwrap_or("(host)")
                        ),
                    );
                } else {
                    binds.insert((netns, ip, port), at);
                }
            };
            for (j, ib) in p.inbound.iter().enumerate().filter(|(_, ib)| ib.proxyless) {
                let at = format!("{path}.inbound[{j}].proxyless");
                if let Some(other) = proxyless.get(&(p.ip, ib.app_port)) {
                    self.err(
                        at,
                        format!(
                            "proxyless server address {} is also {other}'s",
                            std::net::SocketAddr::new(p.ip, ib.app_port)
                        ),
                    );
                } else {
                    proxyless.insert((p.ip, ib.app_port), at);
                }
            }
            // A proxyless port is the app's own socket, not a listener of Envoy's.
            for (j, ib) in p.inbound.iter().enumerate().filter(|(_, ib)| !ib.proxyless) {
                bind(
                    self,
                    format!("{path}.inbound[{j}].listen_port"),
                    p.ip,
                    ib.listen_port,
                );
            }
            if p.outbound_port != 0 {
                bind(
                    self,
                    format!("{path}.outbound_port"),
                    IpAddr::V4(Ipv4Addr::LOCALHOST),
                    p.outbound_port,
                );
            }
        }

        // Route backends: each an HTTP/gRPC port of a service of the mesh, with the
        // `mtls` its port has (Mesh::resolve_routes sets both): a stale flag would send
        // callers with an identity to the plaintext cluster of an mTLS port.
        let by_name: HashMap<(&str, &str), &Service> = m
            .services
            .iter()
            .map(|s| ((s.namespace.as_str(), s.name.as_str()), s))
            .collect();
        for (i, s) in m.services.iter().enumerate() {
            for (j, r) in s.routes.iter().enumerate() {
                for (k, b) in r.backends.iter().enumerate() {
                    let path = format!("services[{i}].routes[{j}].backends[{k}]");
                    // A subset backend's requests go to its subset's clusters.
                    let target = b.target();
                    match by_name.get(&(b.namespace.as_str(), &*target)) {
                        Some(t) if t.ports.iter().any(|p| p.port == b.port && p.protocol.is_http()) => {
                            if port_endpoints(t, b.port).mtls != b.mtls {
                                self.err(
                                    format!("{path}.mtls"),
                                    "does not match the backend port's endpoints (run Mesh::resolve_routes)",
                                );
                            }
                        }
                        _ => self.err(
                            path,
                            format!(
                                "{}.{} has no HTTP or gRPC port {} in the mesh (run Mesh::resolve_routes)",
                                target, b.namespace, b.port
                            ),
                        ),
                    }
                }
            }
        }

        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, s) in m.secrets.iter().enumerate() {
            let path = format!("secrets[{i}]");
            self.secret(&path, s);
            if let Some(first) = seen.insert(&s.name, i) {
                self.err(
                    format!("{path}.name"),
                    format!("duplicate secret {:?} (also secrets[{first}])", s.name),
                );
            }
        }
    }

    fn endpoint_total(&mut self, total: usize) {
        if total > MAX_ENDPOINTS {
            self.err(
                "services",
                format!("{total} endpoints in all, more than the limit of {MAX_ENDPOINTS}"),
            );
        }
    }

    /// A service's route rules and pool: what [`flock_core::route`] checks of a
    /// route, again (the mesh JSON carries rules written by hand), and that each
    /// rule's port is one of the service's HTTP/gRPC ports.
    fn routes(&mut self, path: &str, s: &Service) {
        if s.routes.len() > MAX_ROUTE_RULES {
            self.err(
                format!("{path}.routes"),
                format!(
                    "{} rules, more than the limit of {MAX_ROUTE_RULES}",
                    s.routes.len()
                ),
            );
        }
        for (j, r) in s.routes.iter().enumerate() {
            let rp = format!("{path}.routes[{j}]");
            if let Some(port) = r.port
                && !s
                    .ports
                    .iter()
                    .any(|p| p.port == port && p.protocol.is_http())
            {
                self.err(
                    format!("{rp}.port"),
                    format!("{port} is not an HTTP or gRPC port of the service"),
                );
            }
            if r.matches.len() > flock_core::route::MAX_MATCHES
                || r.backends.len() > flock_core::route::MAX_BACKENDS
            {
                self.err(&rp, "too many matches or backends");
            }
            for (k, m) in r.matches.iter().enumerate() {
                let p = match &m.path {
                    flock_core::route::PathMatch::Exact(p)
                    | flock_core::route::PathMatch::Prefix(p) => p,
                };
                if !p.starts_with('/')
                    || p.len() > flock_core::route::MAX_PATH_LEN
                    || p.chars().any(char::is_control)
                {
                    self.err(
                        format!("{rp}.matches[{k}].path"),
                        "must start with / (at most 1024 characters, no control characters)",
                    );
                }
                if m.headers.len() > flock_core::route::MAX_HEADERS
                    || m.headers.iter().any(|h| {
                        h.name.is_empty()
                            || h.name.starts_with(':')
                            || h.name.len() > flock_core::route::MAX_HEADER_NAME_LEN
                            || h.value.len() > flock_core::route::MAX_HEADER_VALUE_LEN
                            || h.name.chars().chain(h.value.chars()).any(char::is_control)
                    })
                {
                    self.err(
                        format!("{rp}.matches[{k}].headers"),
                        "an invalid or oversized header match",
                    );
                }
                if m.method
                    .as_deref()
                    .is_some_and(|mt| !flock_core::route::METHODS.contains(&mt))
                {
                    self.err(format!("{rp}.matches[{k}].method"), "not an HTTP method");
                }
            }
            // Bounds Envoy and gRPC need (a Duration past protobuf's range, or a
            // status outside 100-599, NACKs the route configuration every service of
            // the node shares), as flock_core::route checks a written route.
            let max = flock_core::route::MAX_TIMEOUT_MS;
            if r.timeout_ms.is_some_and(|t| t > max) {
                self.err(format!("{rp}.timeout_ms"), "longer than 1 h");
            }
            if let Some(retry) = &r.retry {
                if retry.attempts > flock_core::route::MAX_ATTEMPTS {
                    self.err(format!("{rp}.retry.attempts"), "more than 10");
                }
                if retry.per_try_timeout_ms.is_some_and(|t| t > max)
                    || retry.backoff_ms.is_some_and(|t| t > max)
                {
                    self.err(
                        format!("{rp}.retry"),
                        "a timeout or back-off longer than 1 h",
                    );
                }
                if retry.codes.len() > 100 || retry.codes.iter().any(|c| !(400..=599).contains(c)) {
                    self.err(
                        format!("{rp}.retry.codes"),
                        "codes must be 400-599 (at most 100)",
                    );
                }
            }
            let mut sum = 0u64;
            for (k, b) in r.backends.iter().enumerate() {
                self.label(
                    &format!("{rp}.backends[{k}].service"),
                    "service name",
                    &b.service,
                );
                self.label(
                    &format!("{rp}.backends[{k}].namespace"),
                    "namespace",
                    &b.namespace,
                );
                if b.port == 0 {
                    self.err(format!("{rp}.backends[{k}].port"), "port must be 1-65535");
                }
                if let Err(why) = flock_core::labels::check(&b.subset) {
                    self.err(format!("{rp}.backends[{k}].subset"), why);
                }
                sum += u64::from(b.weight);
            }
            if sum > u64::from(u32::MAX) {
                self.err(format!("{rp}.backends"), "weights sum to more than 2^32-1");
            }
        }
        if let Some(pool) = &s.pool
            && (pool.max_connections == 0
                || pool.max_pending_requests == 0
                || pool.max_requests == 0
                || !(1..=100).contains(&pool.retry_budget_percent))
        {
            self.err(
                format!("{path}.pool"),
                "limits must be at least 1, the retry budget 1-100%",
            );
        }
    }

    fn service(&mut self, path: &str, s: &Service) {
        match s.subset_of() {
            None => self.label(&format!("{path}.name"), "service name", &s.name),
            Some((base, selector)) => {
                self.label(&format!("{path}.name"), "service name", base);
                match flock_core::labels::parse(selector) {
                    Ok(l) if !l.is_empty() && flock_core::labels::render(&l) == selector => {}
                    Ok(_) => self.err(
                        format!("{path}.name"),
                        "a subset's selector must be non-empty, in key order, without spaces",
                    ),
                    Err(why) => self.err(format!("{path}.name"), format!("subset {why}")),
                }
                if !s.vips.is_empty() || !s.routes.is_empty() {
                    self.err(
                        format!("{path}.name"),
                        "a subset has no VIPs and no routes of its own",
                    );
                }
            }
        }
        self.label(&format!("{path}.namespace"), "namespace", &s.namespace);
        if s.ports.is_empty() {
            self.err(format!("{path}.ports"), "a service needs at least one port");
        }
        if s.ports.len() > MAX_PORTS {
            self.err(
                format!("{path}.ports"),
                format!(
                    "{} ports, more than the limit of {MAX_PORTS}",
                    s.ports.len()
                ),
            );
        }
        if s.vips.len() > MAX_VIPS {
            self.err(
                format!("{path}.vips"),
                format!("{} VIPs, more than the limit of {MAX_VIPS}", s.vips.len()),
            );
        }
        let mut vips = HashSet::new();
        for (j, ip) in s.vips.iter().enumerate() {
            self.address(&format!("{path}.vips[{j}]"), *ip);
            if !vips.insert(ip) {
                self.err(format!("{path}.vips[{j}]"), format!("duplicate VIP {ip}"));
            }
        }
        let mut numbers = HashSet::new();
        let mut names = HashSet::new();
        for (j, p) in s.ports.iter().enumerate() {
            let pp = format!("{path}.ports[{j}]");
            if p.port == 0 {
                self.err(format!("{pp}.port"), "port must be 1-65535");
            } else if !numbers.insert(p.port) {
                self.err(format!("{pp}.port"), format!("duplicate port {}", p.port));
            }
            if let Some(name) = &p.name {
                self.label(&format!("{pp}.name"), "port name", name);
                if !names.insert(name.as_str()) {
                    self.err(
                        format!("{pp}.name"),
                        format!("duplicate port name {name:?}"),
                    );
                }
            }
        }
        self.routes(path, s);
        // Per service port: which endpoints (address, port) it has, and their weight sum.
        let mut per_port: BTreeMap<u16, (HashSet<(IpAddr, u16)>, u64)> = BTreeMap::new();
        // The ports an endpoint without a service port serves: every port, in order
        // (so its duplicates are reported in port order).
        let mut every_port: Vec<u16> = numbers.iter().copied().collect();
        every_port.sort_unstable();
        for (k, e) in s.endpoints.iter().enumerate() {
            // The path is formatted only for an error: a service is re-validated on
            // every change of its endpoints, and formatting each endpoint's paths up
            // front was most of the validation's cost.
            let ep = || format!("{path}.endpoints[{k}]");
            if let Err(why) = pod::check_ip(e.address) {
                self.err(format!("{}.address", ep()), why);
            }
            if e.port == 0 {
                self.err(format!("{}.port", ep()), "port must be 1-65535");
            }
            if let Some(id) = &e.identity {
                self.spiffe_id(|| format!("{}.identity", ep()), id, true);
            }
            if !e.also_accept.is_empty() && e.identity.is_none() {
                // Without `identity` the endpoint counts as identity-less (plaintext
                // port, or left out of an mTLS one): the extra IDs would be ignored.
                self.err(
                    format!("{}.also_accept", ep()),
                    "also_accept needs an identity",
                );
            }
            if e.also_accept.len() > MAX_ALSO_ACCEPT {
                self.err(
                    format!("{}.also_accept", ep()),
                    format!(
                        "{} IDs, more than the limit of {MAX_ALSO_ACCEPT}",
                        e.also_accept.len()
                    ),
                );
            } else {
                for (j, id) in e.also_accept.iter().enumerate() {
                    self.spiffe_id(|| format!("{}.also_accept[{j}]", ep()), id, true);
                }
            }
            if e.weight == 0 {
                self.err(format!("{}.weight", ep()), "weight must be at least 1");
            }
            if let Err(why) = flock_core::labels::check(&e.labels) {
                self.err(format!("{}.labels", ep()), why);
            }
            self.locality(&|| format!("{}.locality", ep()), &e.locality);
            let one;
            let serves: &[u16] = match e.service_port {
                Some(sp) if !numbers.contains(&sp) => {
                    self.err(
                        format!("{}.service_port", ep()),
                        format!("service {}.{} has no port {sp}", s.name, s.namespace),
                    );
                    continue;
                }
                Some(sp) => {
                    one = [sp];
                    &one
                }
                None => &every_port,
            };
            for &sp in serves {
                let (set, sum) = per_port.entry(sp).or_default();
                if !set.insert((e.address, e.port)) {
                    self.err(
                        ep(),
                        format!(
                            "duplicate endpoint {} for port {sp}",
                            std::net::SocketAddr::new(e.address, e.port)
                        ),
                    );
                }
                *sum += u64::from(e.weight);
            }
        }
        for (sp, (_, sum)) in per_port {
            if sum > u64::from(u32::MAX) {
                self.err(
                    format!("{path}.endpoints"),
                    format!(
                        "the weights of port {sp}'s endpoints sum to {sum}, more than {}",
                        u32::MAX
                    ),
                );
            }
        }
    }

    fn pod(&mut self, path: &str, p: &Pod) {
        self.subdomain(&format!("{path}.name"), "pod name", &p.name);
        self.label(&format!("{path}.namespace"), "namespace", &p.namespace);
        if let Some(uid) = &p.uid
            && let Err(why) = pod::check_uid(uid)
        {
            self.err(format!("{path}.uid"), format!("uid {why}"));
        }
        self.address(&format!("{path}.ip"), p.ip);
        if let Some(netns) = &p.netns
            && let Err(why) = pod::check_netns(netns)
        {
            self.err(format!("{path}.netns"), format!("netns {why}"));
        }
        if p.inbound.len() > MAX_PORTS {
            self.err(
                format!("{path}.inbound"),
                format!(
                    "{} inbound ports, more than the limit of {MAX_PORTS}",
                    p.inbound.len()
                ),
            );
        }
        let mut app_ports = HashSet::new();
        for (j, ib) in p.inbound.iter().enumerate() {
            let ip = format!("{path}.inbound[{j}]");
            if ib.app_port == 0 {
                self.err(format!("{ip}.app_port"), "port must be 1-65535");
            } else if !app_ports.insert(ib.app_port) {
                self.err(
                    format!("{ip}.app_port"),
                    format!("duplicate app_port {}", ib.app_port),
                );
            }
            if ib.listen_port == 0 {
                self.err(format!("{ip}.listen_port"), "port must be 1-65535");
            }
            if ib.proxyless {
                if ib.protocol != Protocol::Grpc {
                    self.err(
                        format!("{ip}.proxyless"),
                        "a proxyless port must have protocol grpc",
                    );
                }
                if ib.listen_port != ib.app_port {
                    self.err(
                        format!("{ip}.proxyless"),
                        format!(
                            "a proxyless port is dialled directly: listen_port {} must equal app_port {}",
                            ib.listen_port, ib.app_port
                        ),
                    );
                }
            }
        }
        if let Some(id) = &p.identity {
            self.spiffe_id(|| format!("{path}.identity"), id, false);
        }
        if let Some(c) = &p.capture {
            // Without a netns the outbound listener would bind 0.0.0.0 in the host
            // namespace and take the node's connections.
            if p.netns.is_none() {
                self.err(format!("{path}.capture"), "capture needs a netns");
            }
            if p.outbound_port == 0 {
                self.err(
                    format!("{path}.capture"),
                    "capture needs an outbound listener (outbound_port not 0)",
                );
            }
            if c.mark == 0 {
                self.err(
                    format!("{path}.capture.mark"),
                    "mark must not be 0 (unmarked sockets are redirected)",
                );
            }
        }
    }

    /// A SPIFFE ID, or with `allow_prefix` also an ID prefix `spiffe://td/path/*`
    /// (an endpoint may name "any ID under this path"; a pod presents one exact ID).
    fn spiffe_id(&mut self, at: impl FnOnce() -> String, id: &str, allow_prefix: bool) {
        let exact = match id.strip_suffix("/*") {
            Some(prefix) if allow_prefix => prefix,
            Some(_) => {
                self.err(
                    at(),
                    format!("a pod's identity must be one SPIFFE ID, not the prefix {id:?}"),
                );
                return;
            }
            None => id,
        };
        if trust_domain(exact).is_none()
            || exact
                .chars()
                .any(|c| c.is_control() || c.is_whitespace() || c == '|' || c == '*')
            || exact.ends_with('/')
        {
            self.err(
                at(),
                format!(
                    "identity must be a SPIFFE ID (spiffe://trust-domain/path){}, not {id:?}",
                    if allow_prefix {
                        " or an ID prefix (spiffe://trust-domain/path/*)"
                    } else {
                        ""
                    }
                ),
            );
        }
    }

    fn secret(&mut self, path: &str, s: &Secret) {
        let at = format!("{path}.name");
        if s.name.is_empty() || s.name.len() > MAX_NAME_LEN {
            self.err(
                at,
                format!("secret name must be 1-{MAX_NAME_LEN} characters"),
            );
        } else if let Some(c) = s
            .name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || "._:/-".contains(*c)))
        {
            self.err(
                at,
                format!(
                    "secret name {:?} contains {c:?} (allowed: A-Z a-z 0-9 . _ : / -)",
                    s.name
                ),
            );
        }
        let pems: Vec<(&str, &str)> = match &s.kind {
            SecretKind::TlsCertificate {
                certificate_chain_pem,
                private_key_pem,
            } => vec![
                (
                    "kind.tls_certificate.certificate_chain_pem",
                    certificate_chain_pem,
                ),
                ("kind.tls_certificate.private_key_pem", &private_key_pem.0),
            ],
            SecretKind::ValidationContext { trusted_ca_pem } => {
                vec![("kind.validation_context.trusted_ca_pem", trusted_ca_pem)]
            }
        };
        for (field, pem) in pems {
            if pem.is_empty() {
                self.err(format!("{path}.{field}"), "must not be empty");
            } else if pem.len() > MAX_PEM_LEN {
                self.err(
                    format!("{path}.{field}"),
                    format!("longer than {MAX_PEM_LEN} bytes"),
                );
            }
        }
    }

    fn address(&mut self, path: &str, ip: IpAddr) {
        if let Err(why) = pod::check_ip(ip) {
            self.err(path, why);
        }
    }

    fn locality(&mut self, path: &dyn Fn() -> String, l: &Locality) {
        for (field, value) in [
            ("region", &l.region),
            ("zone", &l.zone),
            ("sub_zone", &l.sub_zone),
        ] {
            if value.len() > MAX_NAME_LEN || value.chars().any(char::is_control) {
                self.err(
                    format!("{}.{field}", path()),
                    format!("must be at most {MAX_NAME_LEN} bytes without control characters"),
                );
            }
        }
    }

    /// A DNS label ([`pod::check_label`]). Service names and namespaces are joined
    /// with `.` and `|` in resource names and host names, so neither may contain them.
    fn label(&mut self, path: &str, what: &str, s: &str) {
        if let Err(why) = pod::check_label(s) {
            self.err(path, format!("{what} {why}"));
        }
    }

    /// A DNS subdomain ([`pod::check_subdomain`]).
    fn subdomain(&mut self, path: &str, what: &str, s: &str) {
        if let Err(why) = pod::check_subdomain(s) {
            self.err(path, format!("{what} {why}"));
        }
    }
}

/// Whether `e` serves the service port `port`.
pub(crate) fn endpoint_serves(e: &Endpoint, port: u16) -> bool {
    e.service_port.is_none_or(|p| p == port)
}

/// The endpoints of one service port, split by the never-downgrade rule (see
/// [`port_endpoints`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortEndpoints<'a> {
    /// Whether the port is mTLS: at least one of its endpoints has an identity.
    pub mtls: bool,
    /// The endpoints traffic may go to: all of them for a plaintext port, only those
    /// with an identity for an mTLS port.
    pub serving: Vec<&'a Endpoint>,
    /// Endpoints without an identity in an mTLS port: left out.
    pub excluded: Vec<&'a Endpoint>,
}

/// The endpoints of `service` that serve `port`, by the never-downgrade rule: a port
/// with any endpoint that has an identity is mTLS, and its endpoints without one are
/// excluded. Mixing must not switch the port's callers to the plaintext cluster: that
/// would let anyone who can add one identity-less endpoint (a registry entry) turn off
/// encryption and peer verification for every caller of the port.
pub fn port_endpoints(service: &Service, port: u16) -> PortEndpoints<'_> {
    let all: Vec<&Endpoint> = service
        .endpoints
        .iter()
        .filter(|e| endpoint_serves(e, port))
        .collect();
    let mtls = all.iter().any(|e| e.identity.is_some());
    if !mtls {
        return PortEndpoints {
            mtls,
            serving: all,
            excluded: Vec::new(),
        };
    }
    let (serving, excluded) = all.into_iter().partition(|e| e.identity.is_some());
    PortEndpoints {
        mtls,
        serving,
        excluded,
    }
}

/// Service names that occur in more than one namespace (their bare name is
/// ambiguous as a host name).
pub(crate) fn ambiguous_service_names<S: std::borrow::Borrow<Service>>(
    services: &[S],
) -> BTreeSet<&str> {
    let mut by_name: HashMap<&str, &str> = HashMap::with_capacity(services.len());
    let mut out = BTreeSet::new();
    for s in services {
        let s = s.borrow();
        if let Some(ns) = by_name.insert(&s.name, &s.namespace)
            && ns != s.namespace
        {
            out.insert(s.name.as_str());
        }
    }
    out
}

/// The SAN prefix an endpoint identity `spiffe://td/path/*` stands for
/// (`spiffe://td/path/`), or `None` for an exact ID.
pub fn identity_prefix(id: &str) -> Option<&str> {
    id.strip_suffix('*').filter(|p| p.ends_with('/'))
}

/// `ip` as a host name: IPv6 in brackets (`[fd00::1]`), as in a URL authority.
pub(crate) fn ip_host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// The VIP host names of a service in the outbound routes: `<ip>:<port>` for each VIP
/// and HTTP/gRPC port, and `<ip>` for the first HTTP/gRPC port (TCP ports get no
/// route). In port order, then VIP order.
pub(crate) fn vip_domains(service: &Service) -> Vec<String> {
    let mut out = Vec::new();
    let mut first = true;
    let mut seen = BTreeSet::new();
    for p in service.ports.iter().filter(|p| p.protocol.is_http()) {
        if !seen.insert(p.port) {
            continue;
        }
        for ip in &service.vips {
            out.push(format!("{}:{}", ip_host(*ip), p.port));
        }
        if first {
            out.extend(service.vips.iter().map(|ip| ip_host(*ip)));
            first = false;
        }
    }
    out
}

/// The trust domain of a SPIFFE ID (`spiffe://<trust-domain>/<path>`), if `id` is one:
/// the name of the bundle (validation context) secret that verifies it.
pub fn trust_domain(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("spiffe://")?;
    let (td, path) = rest.split_once('/')?;
    (!td.is_empty() && !path.is_empty() && id.len() <= 2048).then_some(td)
}
