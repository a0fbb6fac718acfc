//! The startup taint: `flock.io/agent-not-ready:NoSchedule` keeps pods off a node
//! until its agent is ready; the agent removes it from its own Node.
//!
//! The removal is a JSON merge patch of `spec.taints` (the list without our taint)
//! carrying the `metadata.resourceVersion` read with it. A merge patch replaces the
//! whole list, so without the precondition a taint another controller added between
//! our GET and our PATCH would be dropped; with it the API server answers 409 Conflict
//! and we re-read and retry.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::watch::KubeError;

/// The startup taint's key (effect `NoSchedule`).
pub const STARTUP_TAINT_KEY: &str = "flock.io/agent-not-ready";

/// How many GET+PATCH rounds before giving up on conflicts.
const MAX_ATTEMPTS: usize = 5;

/// Removes every taint keyed [`STARTUP_TAINT_KEY`] from `node`, keeping the others.
/// `Ok(false)`: the node had no such taint (nothing written).
pub async fn remove_startup_taint(client: &kube::Client, node: &str) -> Result<bool, KubeError> {
    let api: Api<Node> = Api::all(client.clone());
    for attempt in 1..=MAX_ATTEMPTS {
        let current = api.get(node).await.map_err(|source| KubeError::Api {
            action: format!("GET node {node}"),
            source,
        })?;
        let taints = current
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        if !taints.iter().any(|t| t.key == STARTUP_TAINT_KEY) {
            return Ok(false);
        }
        let kept: Vec<_> = taints
            .into_iter()
            .filter(|t| t.key != STARTUP_TAINT_KEY)
            .collect();
        let patch = json!({
            "metadata": { "resourceVersion": current.metadata.resource_version },
            "spec": { "taints": kept },
        });
        match api
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::info!(node, kept = kept.len(), "startup taint removed");
                return Ok(true);
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                tracing::info!(
                    node,
                    attempt,
                    "Node changed between GET and PATCH; re-reading it"
                );
            }
            Err(source) => {
                return Err(KubeError::Api {
                    action: format!("PATCH node {node} (remove taint {STARTUP_TAINT_KEY})"),
                    source,
                });
            }
        }
    }
    Err(KubeError::Conflict(format!(
        "PATCH node {node} (remove taint {STARTUP_TAINT_KEY}): the Node changed between read and \
         write {MAX_ATTEMPTS} times in a row (409 Conflict each time)"
    )))
}
