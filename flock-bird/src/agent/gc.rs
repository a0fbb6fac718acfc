//! The orphan-GC executor: the core plans (`flock_core::agent::AgentCore::gc_plan`),
//! this removes.

use super::{Agent, PodOutcome};
use flock_core::agent::{GcSweep, OpKind, SeenEndpoint, Unsubscriber};
use flock_core::pod::PodKey;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Agent {
    /// The last GC report.
    pub fn last_gc(&self) -> Option<flock_core::gc::GcReport> {
        self.core().last_gc().cloned()
    }

    /// One orphan-GC sweep (flock-core's planner, hysteresis and breaker). With
    /// `valid` (from a CNI GC), stored pods not in it are judged too. Returns how
    /// many items were removed.
    pub async fn gc_sweep(self: &Arc<Self>, valid: Option<Vec<PodKey>>) -> usize {
        // Owned resources first, the table last (inside the core's plan; see
        // flock_core::gc).
        let view = self.registry.view().borrow().clone();
        // A read-only registry's entries (EndpointSlices) are not the agent's to
        // remove, even those of pods on this node.
        let read_only = self.registry.read_only();
        let endpoints: Vec<SeenEndpoint> = view
            .endpoints
            .iter()
            .filter(|_| !read_only)
            .filter(|(_, e)| e.node == self.cfg.node_name)
            .map(|(k, e)| SeenEndpoint {
                key: k.clone(),
                pod: e.pod_key.clone(),
                revision: e.revision,
            })
            .collect();
        let subscriptions: Vec<PodKey> = self
            .identity_view()
            .map(|v| v.subscriptions.keys().cloned().collect())
            .unwrap_or_default();
        let sweep = GcSweep {
            valid_attachments: valid,
            endpoints,
            subscriptions,
        };
        let plan = self.core().gc_plan(sweep, &self.cfg.gc_policy);
        self.metrics.gc_sweeps.fetch_add(1, Ordering::Relaxed);
        if !plan.pods.is_empty() || !plan.endpoints.is_empty() {
            self.failpoint(|| "gc/planned".into());
        }
        for t in plan.report.tripped() {
            self.metrics
                .gc_breaker_trips
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!("{t}");
        }
        let mut removed = 0;
        for key in &plan.pods {
            match self.remove_pod(key).await {
                Ok(PodOutcome::Done(_)) => {
                    removed += 1;
                    self.metrics
                        .gc_removed_store
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%key, "GC removed a pod the runtime no longer knows");
                    self.failpoint(|| "gc/pod-removed".into());
                }
                Ok(PodOutcome::Ignored(_)) => {}
                // Kept whole (stored and served); the next sweep tries again.
                Err(e) => tracing::warn!(%key, "GC could not remove a pod: {e}"),
            }
        }
        for ep in &plan.endpoints {
            // Conditional on the revision the plan was made from: if the pod came back
            // after the view was taken (its AddPod re-registered the same key), that
            // newer registration is not an orphan and must survive this sweep.
            let deleted = match ep.revision {
                Some(rev) => self.registry.delete_if_revision(&ep.key, rev).await,
                None => self.registry.delete(&ep.key).await,
            };
            match deleted {
                Ok(true) => {
                    removed += 1;
                    self.core().forget(&ep.key);
                    self.metrics
                        .gc_removed_endpoints
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(endpoint = %ep.key, "GC removed an orphan endpoint");
                    self.failpoint(|| "gc/endpoint-removed".into());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(endpoint = %ep.key, "GC could not remove an orphan endpoint: {e}")
                }
            }
        }
        if let Some(provider) = &self.identity {
            for key in &plan.unsubscribe {
                // In the pod's turn, and only if it is still gone: an ADD since the
                // plan made it live again, and withdrawing its new subscription would
                // leave a meshed pod without its certificate.
                let withdrawn = self
                    .in_turn(key, OpKind::Gc, async {
                        if !self.core().may_unsubscribe(key, Unsubscriber::Gc) {
                            return false;
                        }
                        provider.unsubscribe(key).await;
                        true
                    })
                    .await;
                if withdrawn {
                    removed += 1;
                    tracing::warn!(pod = %key, "GC removed a leaked identity subscription");
                }
            }
        }
        removed
    }
}
