//! The agent's data: a stored pod ([`PodRecord`]) and a registered endpoint
//! ([`Endpoint`]), shared by the store, the registry backends and the agent.

use flock_core::UnixMs;
use flock_core::capture::policy::PodCapture;
use flock_core::pod::{AdmittedPod, PodFields, PodKey};
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// A registry entry: a document of the registry and of the admin API (`flock-admin`).
pub use flock_admin::api::Endpoint;
pub use flock_core::pod::{
    Health, INBOUND_BASE_PORT, OUTBOUND_PORT, PORTS_ANNOTATION, PodPort, Protocol,
    SERVICE_ACCOUNT_ANNOTATION, SERVICE_ANNOTATION,
};

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
    /// The service account, when known ([`SERVICE_ACCOUNT_ANNOTATION`]).
    pub service_account: String,
    /// Application ports ([`PORTS_ANNOTATION`]).
    pub ports: Vec<PodPort>,
    /// The CNI network name the pod was added on.
    pub network_name: String,
    /// When the agent added it (ms since the Unix epoch).
    pub added_at_ms: UnixMs,
    /// The pod's transparent capture, as resolved at ADD (node flags, the pod's
    /// annotations, the CNI result's gateways): what CHECK and start-up repair verify
    /// its netns against. Absent: not captured — and absent in records written before
    /// capture existed, which load unchanged; an uncaptured record is written without
    /// the field, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<PodCapture>,
    /// The pod's own authorization policy as written ([`flock_core::authz::ANNOTATION`]):
    /// it narrows what the namespace's and service's policies allow on the pod's
    /// inbound ports. Absent in records written before policies existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authz: Option<String>,
    /// The labels its endpoints carry for route subsets
    /// ([`flock_core::pod::LABELS_ANNOTATION`]). Absent when none (so a record
    /// without labels reads in an agent that predates them), and in kube mode, where
    /// they come from the API live.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: flock_core::labels::Labels,
}

impl PodRecord {
    /// `<namespace>/<name>`.
    pub fn pod_ref(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The fields the pod validator checks ([`flock_core::pod::validate`]).
    pub fn fields(&self) -> PodFields<'_> {
        PodFields {
            key: &self.key,
            name: &self.name,
            namespace: &self.namespace,
            uid: &self.uid,
            netns: &self.netns,
            ips: &self.ips,
            service: &self.service,
            service_account: &self.service_account,
            ports: &self.ports,
            network_name: &self.network_name,
            labels: &self.labels,
        }
    }

    /// The record of a pod the validator admitted, added at `added_at`, without
    /// capture (the agent resolves the pod's capture against its node's settings and
    /// sets [`capture`](Self::capture)).
    pub fn admitted(pod: AdmittedPod, added_at: UnixMs) -> Self {
        Self {
            key: pod.key,
            name: pod.name,
            namespace: pod.namespace,
            uid: pod.uid,
            netns: pod.netns,
            ips: pod.ips,
            service: pod.service,
            service_account: pod.service_account,
            ports: pod.ports,
            network_name: pod.network_name,
            added_at_ms: added_at,
            capture: None,
            authz: pod.authz,
            labels: pod.labels,
        }
    }

    /// The address the mesh uses: the first IP. Every validated record has one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.ips.first().copied()
    }
}
