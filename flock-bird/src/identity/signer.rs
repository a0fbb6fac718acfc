//! The node-scoped signer's parts that live with the agent's identity code: the
//! built-in CA as its [`Issuer`] and the Kubernetes API as its [`PodSource`].
//!
//! The `flock-ca` binary serves [`flock_ca::server::SignerService`] over these: the CA
//! directory (the issuer key) is mounted there and nowhere else, and each request's pod
//! is looked up in the API (a GET by name) before anything is signed.

use super::BuiltinCa;
use flock_ca::server::{Issuer, PodSource, Signed, SourceError};
use flock_core::issuance::{self, PodFacts, Request};
use k8s_openapi::api::core::v1::Pod;
use std::sync::Arc;
use std::time::Duration;

/// The built-in CA signing CSRs: workload certificates for its SVID lifetime, node
/// credentials for `node_ttl`.
pub struct CaIssuer {
    /// The CA (from a CA directory it re-reads: issuer rotation).
    pub ca: Arc<BuiltinCa>,
    /// Lifetime of a node credential.
    pub node_ttl: Duration,
}

impl Issuer for CaIssuer {
    fn sign(&self, csr_der: &[u8], spiffe_id: &str, node: bool) -> Result<Signed, String> {
        let ttl = if node { self.node_ttl } else { self.ca.ttl() };
        let leaf = self
            .ca
            .sign_csr(csr_der, spiffe_id, ttl)
            .map_err(|e| e.to_string())?;
        Ok(Signed {
            cert_chain_pem: leaf.cert_chain_pem,
            bundle_pem: self.ca.bundle().ca_pem,
            not_after_ms: leaf.not_after_ms.as_millis(),
        })
    }
}

/// The Kubernetes API as the signer's source of truth: the pod's node, service
/// account, UID and phase, read by a GET at each request (never a cache a stale watch
/// could leave behind: a pod that moved or was replaced is seen as it is now).
pub struct KubePods {
    client: kube::Client,
}

impl KubePods {
    /// A source over `client` (needs `get` on pods in every namespace).
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

/// What the API's Pod says, for [`issuance::decide_kube`].
pub fn pod_facts(pod: &Pod) -> PodFacts {
    let spec = pod.spec.as_ref();
    PodFacts {
        node_name: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        service_account: spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        finished: matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        ),
    }
}

#[async_trait::async_trait]
impl PodSource for KubePods {
    async fn check(&self, node: &str, req: &Request<'_>) -> Result<(), SourceError> {
        let pods: kube::Api<Pod> = kube::Api::namespaced(self.client.clone(), req.namespace);
        let facts = match pods.get_opt(req.pod_name).await {
            Ok(pod) => pod.as_ref().map(pod_facts),
            Err(e) => return Err(SourceError::Unavailable(e.to_string())),
        };
        issuance::decide_kube(node, req, facts.as_ref()).map_err(SourceError::Refused)
    }

    fn describe(&self) -> String {
        "the Kubernetes API (a GET of each pod)".to_string()
    }
}
