//! The liveness round (probe every due pod, apply health changes) and the guarded
//! re-registration it triggers (R4).

use super::Agent;
use crate::model::{Health, PodRecord};
use flock_core::agent::{Guard, Writer};
use flock_core::pod::PodKey;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Agent {
    /// Each live pod's health decision.
    pub fn health(&self) -> BTreeMap<PodKey, Health> {
        self.core().healths()
    }

    /// When the next liveness probe is due (the core's deadline); `None` without pods.
    pub fn next_probe(&self) -> Option<flock_core::MonoMs> {
        self.core().next_probe()
    }

    /// Records whether `netns` exists; returns whether that changed.
    pub(super) fn note_netns(&self, key: &PodKey, netns: &str) -> bool {
        let exists = std::path::Path::new(netns).exists();
        self.core().note_netns(key, exists)
    }

    /// The health a pod's endpoints are registered with: unhealthy once its probes say
    /// so, else serving.
    pub(super) fn registered_health(&self, key: &PodKey) -> Health {
        self.core().registered_health(key)
    }

    /// Re-registers a pod's endpoints with its current health, guarded (R4): after
    /// the put, the pod must still be live, else the registration is undone — only
    /// if it is still the one we wrote.
    pub async fn reregister(&self, key: &PodKey) {
        let Some(rec) = self.pod(key) else {
            return;
        };
        let health = self.registered_health(key);
        for ep in self.endpoints_of(&rec, health) {
            let ep_key = ep.key();
            let rev = match self.registry.put(&ep).await {
                Ok(rev) => rev,
                Err(e) => {
                    self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %rec.pod_ref(), "re-register failed: {e}");
                    continue;
                }
            };
            // The re-check: RemovePod deletes the store record before it unregisters,
            // so if the pod is gone now, its unregister may already have run and
            // missed this put.
            let guard = self.core().registered(key, &ep_key, rev, Writer::Liveness);
            if let Guard::Undo(undo) = guard {
                self.metrics.guard_undos.fetch_add(1, Ordering::Relaxed);
                self.undo_registration(&ep_key, undo.revision).await;
            }
        }
    }

    /// Undoes a registration whose pod left while it was in flight, at the revision
    /// it wrote (`None`: whatever is there, only under a mutant).
    pub(super) async fn undo_registration(&self, ep_key: &str, revision: Option<u64>) {
        let undone = match revision {
            Some(rev) => self.registry.delete_if_revision(ep_key, rev).await,
            None => self.registry.delete(ep_key).await,
        };
        if let Err(e) = undone {
            tracing::warn!(endpoint = %ep_key, "undo of a late registration failed (GC removes it): {e}");
        }
    }

    /// Runs one liveness round: probes every due pod (in parallel) and applies
    /// transitions to the registry.
    pub async fn liveness_round(self: &Arc<Self>) {
        // One clock read for the round: which pods are due, and the time their results
        // are recorded at (monotonic: a wall-clock jump neither skips nor repeats probes).
        let now = flock_clock::mono_now();
        let due: Vec<Arc<PodRecord>> = self.core().due(now);
        let mut netns_changed = false;
        for pod in &due {
            netns_changed |= self.note_netns(&pod.key, &pod.netns);
        }
        if netns_changed {
            self.publish();
        }
        let mut probes = tokio::task::JoinSet::new();
        for pod in due {
            let timeout = self.cfg.probe_timeout;
            probes.spawn(async move {
                let ok = crate::probe::probe_pod(&pod, timeout).await;
                (pod.key.clone(), ok)
            });
        }
        while let Some(Ok((key, ok))) = probes.join_next().await {
            self.metrics.probes.fetch_add(1, Ordering::Relaxed);
            if !ok {
                self.metrics.probe_failures.fetch_add(1, Ordering::Relaxed);
            }
            let transition = self.core().probed(&key, now, ok);
            if let Some(t) = transition {
                // After the change: the registry sync re-derives the desired endpoints.
                self.sync.health_gen.fetch_add(1, Ordering::Release);
                tracing::info!(%key, from = ?t.from, to = ?t.to, "pod health changed");
                self.metrics.health_changes.fetch_add(1, Ordering::Relaxed);
                self.reregister(&key).await;
            }
        }
    }
}
