//! The agent's data: a stored pod ([`PodRecord`]) and a registered endpoint
//! ([`Endpoint`]), shared by the store, the registry backends and the agent.

use flock_core::gc::PodKey;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// The annotation that meshes a pod: the service it belongs to. Pods without it are
/// IGNORED by the agent.
pub const SERVICE_ANNOTATION: &str = "flock.io/service";
/// The annotation listing a pod's application ports: `8080`, `8080/http,50051/grpc`,
/// `5432/tcp`. Default protocol `http`. Absent: the pod only calls out.
pub const PORTS_ANNOTATION: &str = "flock.io/ports";
/// First port of Envoy's inbound listeners on the pod IP (one per app port, in order).
pub const INBOUND_BASE_PORT: u16 = 15006;
/// Envoy's outbound HTTP listener on the pod's loopback.
pub const OUTBOUND_PORT: u16 = 15001;

/// How an application port speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// HTTP/1.1 or HTTP/2.
    Http,
    /// gRPC (HTTP/2).
    Grpc,
    /// Opaque TCP.
    Tcp,
}

/// One application port of a pod and Envoy's inbound listener port for it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodPort {
    /// The port the app listens on inside the pod (also the service port).
    pub app_port: u16,
    /// Envoy's inbound listener on the pod IP (`INBOUND_BASE_PORT + index`).
    pub listen_port: u16,
    /// How the port speaks.
    pub protocol: Protocol,
}

/// A meshed pod as the agent stores it (one file per pod; see `store`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodRecord {
    /// The CNI attachment: container ID and interface name.
    pub key: PodKey,
    /// Kubernetes pod name (`K8S_POD_NAME`).
    pub name: String,
    /// Kubernetes namespace (`K8S_POD_NAMESPACE`).
    pub namespace: String,
    /// Kubernetes pod UID (may be empty).
    pub uid: String,
    /// The pod's network namespace path (`CNI_NETNS`).
    pub netns: String,
    /// The pod's IPs (from the primary CNI's result), first one used for the mesh.
    pub ips: Vec<IpAddr>,
    /// The service ([`SERVICE_ANNOTATION`]).
    pub service: String,
    /// The service account, when known (annotation `flock.io/service-account`).
    pub service_account: String,
    /// Application ports ([`PORTS_ANNOTATION`]).
    pub ports: Vec<PodPort>,
    /// The CNI network name the pod was added on.
    pub network_name: String,
    /// When the agent added it (ms since the Unix epoch).
    pub added_at_ms: u64,
}

impl PodRecord {
    /// `<namespace>/<name>`.
    pub fn pod_ref(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Health of a registered endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Serving.
    Healthy,
    /// Failing its probes.
    Unhealthy,
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
    /// The port to connect to: the pod's inbound listener port.
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
}

impl Endpoint {
    /// The registry key of this endpoint, unique across the mesh:
    /// `<namespace>/<service>/<node>/<container_id>/<ifname>/<service_port>`.
    /// Its parts are validated by the agent (no `/` inside them).
    pub fn key(&self) -> String {
        format!(
            "{}/{}/{}/{}/{}/{}",
            self.namespace,
            self.service,
            self.node,
            self.pod_key.container_id,
            self.pod_key.ifname,
            self.service_port
        )
    }
}
