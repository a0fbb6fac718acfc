//! The admin API's documents: one Rust type per JSON view, shared by the server
//! (which builds them from the agent) and the client (which decodes them), so the
//! two cannot disagree on a key.

pub use flock_core::UnixMs;
pub use flock_core::pod::{Health, PodKey, PodPort, Protocol};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

/// Every path the admin endpoint serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// `/healthz`: the process answers (text `ok`).
    Healthz,
    /// `/readyz`: 200 `ready` or 503 `not ready: <why>` (text), for probes.
    Readyz,
    /// `/metrics`: Prometheus text.
    Metrics,
    /// `/debug/status`: [`Status`].
    Status,
    /// `/debug/pods`: [`Pods`].
    Pods,
    /// `/debug/snapshot`: [`Snapshot`].
    Snapshot,
    /// `/debug/registry`: [`RegistryView`].
    Registry,
    /// `/debug/policies`: [`Policies`].
    Policies,
    /// `/debug/proxy-status`: [`ProxyStatus`].
    ProxyStatus,
    /// `/debug/routes`: [`Routes`].
    Routes,
}

impl Route {
    /// Every route, in the order the 404 page lists them.
    pub const ALL: [Route; 10] = [
        Route::Healthz,
        Route::Readyz,
        Route::Metrics,
        Route::Status,
        Route::Pods,
        Route::Snapshot,
        Route::Registry,
        Route::Policies,
        Route::ProxyStatus,
        Route::Routes,
    ];

    /// The route's path.
    pub fn path(self) -> &'static str {
        match self {
            Route::Healthz => "/healthz",
            Route::Readyz => "/readyz",
            Route::Metrics => "/metrics",
            Route::Status => "/debug/status",
            Route::Pods => "/debug/pods",
            Route::Snapshot => "/debug/snapshot",
            Route::Registry => "/debug/registry",
            Route::Policies => "/debug/policies",
            Route::ProxyStatus => "/debug/proxy-status",
            Route::Routes => "/debug/routes",
        }
    }

    /// The route serving `path` (no query), if any.
    pub fn from_path(path: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.path() == path)
    }
}

/// `/debug/status`: readiness and a summary of what the agent holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Whether `/readyz` answers 200.
    pub ready: bool,
    /// Why not, when not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<String>,
    /// This agent's node name.
    pub node: String,
    /// Meshed pods on this node.
    pub pods: usize,
    /// The registry backend (`memory`, `file:…`, `etcd://…`).
    pub registry: String,
    /// Whether the registry view is synced.
    pub registry_synced: bool,
    /// The version of the Envoy group's xDS snapshot, once one is published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds_version: Option<u64>,
    /// The authorization policies refused (each denies every call to what it
    /// governs until it is fixed): `<target> (<origin>): <error>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies_refused: Vec<String>,
}

impl Status {
    /// The `/readyz` body for this status (`ready` or `not ready: <why>`, one line).
    pub fn readiness_line(&self) -> String {
        match (&self.not_ready, self.ready) {
            (_, true) => "ready\n".to_string(),
            (Some(why), false) => format!("not ready: {why}\n"),
            (None, false) => "not ready\n".to_string(),
        }
    }
}

/// `/debug/policies`: the authorization policies in force, and the meshed pods they
/// govern on this node (with each pod's own narrowing annotation).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policies {
    /// By target (namespace, then service).
    pub policies: Vec<PolicyEntry>,
    /// This node's meshed pods: who they are, so a check can name the pods a
    /// service's calls reach and their annotations.
    pub pods: Vec<PodPolicy>,
}

/// `/debug/proxy-status`: every open xDS stream (a node's Envoy, a proxyless gRPC
/// app) and, per type it asked for, what the agent sent, what it ACKed and what it
/// rejected.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyStatus {
    /// The agent's current snapshot version for the node's Envoy group, if any: a
    /// stream of that group SYNCED at a lower version has not been sent the newest
    /// yet (the server sends one response per type at a time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envoy_version: Option<u64>,
    /// Open streams, oldest first.
    pub streams: Vec<ProxyStream>,
}

/// `/debug/routes`: the traffic-policy routes the agent read, and what of each is
/// served.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routes {
    /// Every route, by source key.
    pub routes: Vec<RouteEntry>,
}

/// One route's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteEntry {
    /// The source's key (a file name).
    pub key: String,
    /// Where it came from (a path).
    pub origin: String,
    /// `<namespace>/<name>`, when it parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// `Accepted`, `PartiallyInvalid` (see `problems`) or `Refused` (none of it is
    /// served).
    pub state: String,
    /// What is wrong.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// One open xDS stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyStream {
    /// The server's stream number (as in the agent's logs and `/readyz`).
    pub stream: u64,
    /// `Node.id` of its first request.
    pub node: String,
    /// `Node.cluster`.
    #[serde(default)]
    pub cluster: String,
    /// `Node.user_agent_name` (`envoy`, `grpc-go`…).
    #[serde(default)]
    pub user_agent: String,
    /// The discovery service: `ads-delta`, `ads-sotw`, or `<type>-delta`/`<type>-sotw`.
    pub service: String,
    /// Per type, in `cds`, `eds`, `lds`, `rds`, `sds` order.
    pub types: Vec<TypeStatus>,
}

/// Where one type of one stream stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeStatus {
    /// `cds`, `eds`, `lds`, `rds` or `sds`.
    #[serde(rename = "type")]
    pub type_name: String,
    /// The verdict.
    pub state: SyncState,
    /// The version of the latest response sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<u64>,
    /// The version last ACKed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked: Option<u64>,
    /// The rejected version, when NACKED.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected: Option<u64>,
    /// The proxy's reason, when NACKED (its own text, cut to 300 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A type's verdict, as `istioctl proxy-status` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SyncState {
    /// The latest response was ACKed.
    #[serde(rename = "SYNCED")]
    Synced,
    /// The latest response is not answered yet.
    #[serde(rename = "STALE")]
    Stale,
    /// The proxy rejected a response and accepted none with resources since; it
    /// keeps running the version it last ACKed.
    #[serde(rename = "NACKED")]
    Nacked,
    /// Asked for; nothing sent yet.
    #[serde(rename = "NOT SENT")]
    NotSent,
}

impl SyncState {
    /// The name on the wire and in `flockctl proxy-status`.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncState::Synced => "SYNCED",
            SyncState::Stale => "STALE",
            SyncState::Nacked => "NACKED",
            SyncState::NotSent => "NOT SENT",
        }
    }
}

/// One policy as the agent holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyEntry {
    /// What it governs.
    pub target: flock_core::authz::Target,
    /// Where it came from.
    pub origin: String,
    /// The policy, when it checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<flock_core::authz::PolicySpec>,
    /// Why it was refused (it denies every call to its target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One meshed pod's place under the policies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodPolicy {
    /// `<namespace>/<name>`.
    pub pod: String,
    /// Its namespace.
    pub namespace: String,
    /// Its service (empty in kube mode, where Services select pods).
    pub service: String,
    /// Its own `flock.io/authz` annotation, as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotation: Option<String>,
}

/// `/debug/pods`: the pods meshed on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pods {
    /// By CNI attachment (container ID, interface).
    pub pods: Vec<Pod>,
}

/// One meshed pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    /// `<namespace>/<name>`.
    pub pod: String,
    /// The CNI container ID.
    pub container_id: String,
    /// The CNI interface name.
    pub ifname: String,
    /// The Kubernetes pod UID (may be empty).
    pub uid: String,
    /// The pod's service (`flock.io/service`); empty in kube mode, where the
    /// Services that select the pod are its memberships (see `/debug/registry`).
    pub service: String,
    /// The service account its identity names (empty: `default`); in kube mode the
    /// pod's `spec.serviceAccountName`.
    #[serde(default)]
    pub service_account: String,
    /// The pod's IPs; the first is the one meshed.
    pub ips: Vec<IpAddr>,
    /// The network namespace path.
    pub netns: String,
    /// The application ports and their inbound listeners.
    pub ports: Vec<PodPort>,
    /// The liveness decision, a word on the wire (`"unknown"` until probes decide).
    pub health: Health,
    /// When the agent added it (ms since the Unix epoch).
    pub added_at_ms: UnixMs,
}

/// `/debug/snapshot`: the xDS snapshots served, by node group.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// By node group (`envoy`, `grpc`); a group is absent until its first publish.
    pub groups: BTreeMap<String, SnapshotGroup>,
}

/// The snapshot of one node group.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SnapshotGroup {
    /// The snapshot version.
    pub version: u64,
    /// Resource names by short type name (`lds`, `cds`…).
    pub resources: BTreeMap<String, Vec<String>>,
}

/// `/debug/registry`: the registry view (every node's endpoints).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryView {
    /// The backend (`memory`, `file:…`, `etcd://…`).
    pub backend: String,
    /// Whether the view is synced (initial list loaded, watch connected).
    pub synced: bool,
    /// The view's revision.
    pub revision: u64,
    /// Incremented on every (re)connect and resync.
    pub generation: u64,
    /// The endpoints by key.
    pub endpoints: BTreeMap<String, Endpoint>,
}

/// One endpoint in the shared registry: one (pod, app port).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// Service name.
    pub service: String,
    /// Service namespace.
    pub namespace: String,
    /// The service port (= the pod's app port).
    pub service_port: u16,
    /// How the port speaks.
    pub protocol: Protocol,
    /// The address to connect to: the pod IP.
    pub address: IpAddr,
    /// The port to connect to: the pod's inbound listener port (a proxyless gRPC
    /// server's port: the app's own).
    pub port: u16,
    /// The node (agent `--node-name`) that owns it.
    pub node: String,
    /// The pod, `<namespace>/<name>`.
    pub pod: String,
    /// The pod's CNI attachment.
    pub pod_key: PodKey,
    /// Region of the node.
    pub region: String,
    /// Zone of the node.
    pub zone: String,
    /// Health as probed by the owning agent.
    pub health: Health,
    /// The pod's SPIFFE ID when it serves mTLS (its inbound listeners require it).
    #[serde(default)]
    pub identity: Option<String>,
    /// Further SPIFFE IDs (or `/*` ID prefixes) callers accept from this endpoint, only
    /// with `identity`: a registry that knows a service's accounts but not which one
    /// each endpoint runs as (a Kubernetes EndpointSlice) lists the others here.
    /// Absent in entries written before it existed, and by agents for their own pods
    /// (a pod has one identity).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also_accept: Vec<String>,
    /// The pod's labels a route subset may select on (`version: v2`): those of the
    /// `flock.io/labels` annotation, or in kube mode the pod's labels named by the
    /// agent's `--endpoint-labels`. Absent when none, and in entries written before
    /// subsets existed.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: flock_core::labels::Labels,
}

impl Endpoint {
    /// The registry key of this endpoint, unique across the mesh:
    /// `<node>/<namespace>/<service>/<container_id>/<ifname>/<service_port>`
    /// ([`flock_core::registry::endpoint_key`]). The node comes first so that etcd RBAC
    /// can confine each agent to writing under `<prefix><node>/`. Its parts are
    /// validated by the agent (no `/` inside them).
    pub fn key(&self) -> String {
        flock_core::registry::endpoint_key(
            &self.node,
            &self.namespace,
            &self.service,
            &self.pod_key.container_id,
            &self.pod_key.ifname,
            self.service_port,
        )
    }

    /// The fields [`flock_core::registry::check_entry`] checks, for this endpoint
    /// found under `key` (relative to the registry prefix).
    pub fn entry_fields<'a>(&'a self, key: &'a str) -> flock_core::registry::EntryFields<'a> {
        flock_core::registry::EntryFields {
            key,
            node: &self.node,
            namespace: &self.namespace,
            service: &self.service,
            service_port: self.service_port,
            address: self.address,
            port: self.port,
            pod: &self.pod,
            container_id: &self.pod_key.container_id,
            ifname: &self.pod_key.ifname,
            region: &self.region,
            zone: &self.zone,
            identity: self.identity.as_deref(),
            also_accept: &self.also_accept,
            labels: &self.labels,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_routes_round_trip() {
        for r in Route::ALL {
            assert_eq!(Route::from_path(r.path()), Some(r));
        }
        assert_eq!(Route::from_path("/debug"), None);
        assert_eq!(Route::from_path("/healthz/"), None);
    }

    #[test]
    fn health_is_a_lowercase_word_on_the_wire() {
        assert_eq!(
            serde_json::to_string(&Health::Unhealthy).unwrap(),
            "\"unhealthy\""
        );
        assert_eq!(
            serde_json::from_str::<Health>("\"unknown\"").unwrap(),
            Health::Unknown
        );
        assert!(serde_json::from_str::<Health>("\"Unknown\"").is_err());
    }

    #[test]
    fn readiness_lines_match_the_probe_text() {
        let mut s = Status {
            ready: true,
            not_ready: None,
            node: "n1".into(),
            pods: 0,
            registry: "memory".into(),
            registry_synced: true,
            xds_version: None,
            policies_refused: Vec::new(),
        };
        assert_eq!(s.readiness_line(), "ready\n");
        s.ready = false;
        s.not_ready = Some("registry memory not synced".into());
        assert_eq!(
            s.readiness_line(),
            "not ready: registry memory not synced\n"
        );
    }
}
