//! Unmeshed pods (kube mode): a pod that should be meshed on this node, runs, and has
//! no record in the agent's store started without the mesh — the node's CNI chain did
//! not have the plugin yet (a node without the startup taint, a conflist rewritten by
//! another installer) — so nothing captures its traffic and its app is reachable
//! around Envoy. Istio and Linkerd ship a repair controller for exactly this.
//!
//! Every sweep (the GC interval) compares the reflector's pods of this node
//! ([`flock_kube::map::should_be_meshed_on`]: opted in, `Running`, not hostNetwork, not
//! terminating) with the store. Each such pod is reported: the gauge
//! `flock_agent_unmeshed_pods`, one `warn` line and one Warning Event (reason
//! `Unmeshed`) on the pod, once per pod UID. With `--repair delete` the pod is also
//! deleted, so its controller recreates it — and the new sandbox's ADD meshes it. At
//! most [`MAX_DELETES_PER_SWEEP`] deletions per sweep: a store that lost its records
//! must not empty the node in one go.
//!
//! Nothing is swept while the reflector is not synced (its pods may be stale) or
//! before the agent is ready (its store not loaded yet).

use crate::agent::Agent;
use crate::kube::KubePods;
use k8s_openapi::api::core::v1::{Event, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Pods deleted at most per sweep with `--repair delete`.
pub const MAX_DELETES_PER_SWEEP: usize = 5;

/// What the agent does with an unmeshed pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RepairMode {
    /// Report it (metric, log, Event).
    #[default]
    Report,
    /// Report it and delete it, so its controller recreates it meshed.
    Delete,
}

/// One unmeshed pod.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unmeshed {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

/// The pods of `snapshot` that should be meshed on `node` and have no record in
/// `stored` (namespace, name).
pub fn find_unmeshed(
    snapshot: &flock_kube::watch::Snapshot,
    node: &str,
    stored: &BTreeSet<(String, String)>,
) -> Vec<Unmeshed> {
    snapshot
        .pods
        .iter()
        .filter(|(key, _)| !stored.contains(*key))
        .filter_map(|((ns, _), pod)| {
            let facts = flock_kube::map::should_be_meshed_on(
                pod,
                snapshot.namespaces.get(ns.as_str()),
                node,
            )?;
            Some(Unmeshed {
                namespace: facts.namespace,
                name: facts.name,
                uid: facts.uid,
            })
        })
        .collect()
}

/// The sweeper (see the module docs).
#[derive(Debug)]
pub struct Repairer {
    mode: RepairMode,
    node: String,
    unmeshed: AtomicU64,
    deleted: AtomicU64,
    reported: Mutex<HashSet<String>>,
}

impl Repairer {
    /// A sweeper for `node`.
    pub fn new(node: impl Into<String>, mode: RepairMode) -> Self {
        Self {
            mode,
            node: node.into(),
            unmeshed: AtomicU64::new(0),
            deleted: AtomicU64::new(0),
            reported: Mutex::new(HashSet::new()),
        }
    }

    /// Unmeshed pods found by the last sweep.
    pub fn unmeshed(&self) -> u64 {
        self.unmeshed.load(Ordering::Relaxed)
    }

    /// Pods deleted so far (`--repair delete`).
    pub fn deleted(&self) -> u64 {
        self.deleted.load(Ordering::Relaxed)
    }

    /// One sweep; returns the unmeshed pods found (none when it could not tell).
    pub async fn sweep(&self, agent: &Agent, kube: &KubePods) -> Vec<Unmeshed> {
        let snapshot = kube.snapshot();
        if !snapshot.synced || agent.not_ready().is_some() {
            return Vec::new();
        }
        let stored: BTreeSet<(String, String)> = agent
            .pods()
            .into_values()
            .map(|r| (r.namespace, r.name))
            .collect();
        let found = find_unmeshed(&snapshot, &self.node, &stored);
        self.unmeshed.store(found.len() as u64, Ordering::Relaxed);
        let client = kube.watch().client().clone();
        let mut deletes = 0;
        for pod in &found {
            let first = self
                .reported
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(pod.uid.clone());
            if first {
                tracing::warn!(
                    pod = %format!("{}/{}", pod.namespace, pod.name),
                    uid = %pod.uid,
                    repair = ?self.mode,
                    "a pod that should be meshed is running without the mesh (it started before the CNI plugin was in the node's chain): its traffic bypasses Envoy; \
                     delete it so it is recreated meshed, or run the agent with --repair delete"
                );
                if let Err(e) = self.event(&client, pod).await {
                    tracing::warn!(error = %e, pod = %pod.name, "could not record the Unmeshed event");
                }
            }
            if self.mode == RepairMode::Delete && deletes < MAX_DELETES_PER_SWEEP {
                deletes += 1;
                let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), &pod.namespace);
                // Only this pod: a precondition on its UID, so a pod recreated under
                // the same name meanwhile is not deleted.
                let params = kube::api::DeleteParams {
                    preconditions: Some(kube::api::Preconditions {
                        uid: Some(pod.uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                };
                match api.delete(&pod.name, &params).await {
                    Ok(_) => {
                        self.deleted.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), "deleted an unmeshed pod (--repair delete): its controller recreates it meshed");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, pod = %pod.name, "could not delete an unmeshed pod");
                    }
                }
            }
        }
        // Forget pods that are gone (their UIDs never return).
        let live: HashSet<&str> = found.iter().map(|p| p.uid.as_str()).collect();
        self.reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|uid| live.contains(uid.as_str()));
        found
    }

    async fn event(&self, client: &kube::Client, pod: &Unmeshed) -> Result<(), kube::Error> {
        let now = k8s_openapi::jiff::Timestamp::now();
        let api: kube::Api<Event> = kube::Api::namespaced(client.clone(), &pod.namespace);
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", pod.name)),
                namespace: Some(pod.namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name.clone()),
                namespace: Some(pod.namespace.clone()),
                uid: Some(pod.uid.clone()),
                ..Default::default()
            },
            reason: Some("Unmeshed".into()),
            message: Some(format!(
                "running without the mesh on node {}: its traffic bypasses Envoy (it started before the CNI plugin was in the node's chain); {}",
                self.node,
                match self.mode {
                    RepairMode::Report => "delete it to recreate it meshed",
                    RepairMode::Delete => "flock-agent deletes it (--repair delete)",
                }
            )),
            type_: Some("Warning".into()),
            reporting_component: Some("flock-agent".into()),
            reporting_instance: Some(self.node.clone()),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some("flock-agent".into()),
                host: Some(self.node.clone()),
            }),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            event_time: Some(MicroTime(now)),
            count: Some(1),
            ..Default::default()
        };
        api.create(&kube::api::PostParams::default(), &event)
            .await?;
        Ok(())
    }
}
