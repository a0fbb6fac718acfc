//! The orphan-GC executor: flock-core plans, this removes.

use super::{Agent, PodOutcome};
use flock_core::gc::{GcInputs, Owned};
use flock_core::pod::PodKey;
use flock_core::sync::lock;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Agent {
    /// The last GC report.
    pub fn last_gc(&self) -> Option<flock_core::gc::GcReport> {
        lock(&self.last_gc).clone()
    }

    /// One orphan-GC sweep (flock-core's planner, hysteresis and breaker). With
    /// `valid` (from a CNI GC), stored pods not in it are judged too. Returns how
    /// many items were removed.
    pub async fn gc_sweep(self: &Arc<Self>, valid: Option<Vec<PodKey>>) -> usize {
        // Owned resources first, the store last (see flock_core::gc).
        let view = self.registry.view().borrow().clone();
        // A read-only registry's entries (EndpointSlices) are not the agent's to
        // remove, even those of pods on this node.
        let read_only = self.registry.read_only();
        let endpoints: Vec<Owned> = view
            .endpoints
            .iter()
            .filter(|_| !read_only)
            .filter(|(_, e)| e.node == self.cfg.node_name)
            .map(|(k, e)| Owned::new(k.clone(), e.pod_key.clone()))
            .collect();
        let subscriptions: Vec<Owned> = self
            .identity_view()
            .map(|v| {
                v.subscriptions
                    .keys()
                    .map(|k| Owned::new(k.to_string(), k.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let pods: Vec<PodKey> = self.pods.snapshot().into_keys().collect();
        let inputs = GcInputs {
            pods,
            valid_attachments: valid,
            endpoints,
            subscriptions,
            ..GcInputs::default()
        };
        let (plan, next) = {
            let state = lock(&self.gc_state);
            flock_core::gc::plan(&inputs, &state, &self.cfg.gc_policy)
        };
        *lock(&self.gc_state) = next;
        self.metrics.gc_sweeps.fetch_add(1, Ordering::Relaxed);
        if !plan.store.is_empty() || !plan.endpoints.is_empty() {
            self.failpoint(|| "gc/planned".into());
        }
        for t in plan.report.tripped() {
            self.metrics
                .gc_breaker_trips
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!("{t}");
        }
        let mut removed = 0;
        for key in &plan.store {
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
            let deleted = if flock_core::reintroduced!("gc-unconditional") {
                self.registry.delete(ep).await
            } else {
                match view.revision_of(ep) {
                    Some(rev) => self.registry.delete_if_revision(ep, rev).await,
                    None => Ok(false),
                }
            };
            match deleted {
                Ok(true) => {
                    removed += 1;
                    lock(&self.own).remove(ep);
                    self.metrics
                        .gc_removed_endpoints
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(endpoint = %ep, "GC removed an orphan endpoint");
                    self.failpoint(|| "gc/endpoint-removed".into());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(endpoint = %ep, "GC could not remove an orphan endpoint: {e}")
                }
            }
        }
        if let (Some(provider), Some(view)) = (&self.identity, self.identity_view()) {
            for id in &plan.subscriptions {
                if let Some(key) = view.subscriptions.keys().find(|k| &k.to_string() == id) {
                    provider.unsubscribe(key).await;
                    removed += 1;
                    tracing::warn!(pod = %key, "GC removed a leaked identity subscription");
                }
            }
        }
        *lock(&self.last_gc) = Some(plan.report);
        removed
    }
}
