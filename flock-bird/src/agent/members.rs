//! Kube mode's registrations: one registry endpoint per Service port a pod is a member
//! of, kept current by a resync as labels and Services change.
//!
//! Memberships are live (a Service created after the pod's ADD selects it; a label
//! change moves it out of one), so they are not stored in the pod record. The resync
//! compares, for each live pod, the endpoints it should register now
//! ([`member_endpoints`] of [`crate::kube::KubePods::members`]) with what the registry
//! holds for it, and writes the difference:
//!
//! * in the pod's turn, so it never interleaves with the pod's AddPod or RemovePod;
//! * a put is re-checked against the live table afterwards and undone by a
//!   conditional delete if the pod went away meanwhile (R4, as the liveness
//!   re-registration does). With the lock held no RemovePod can run in between, so
//!   the re-check is the second layer; the mutant `r4-kube-resync` (scripts/test)
//!   removes both layers, as no schedule reaches the re-check while the lock holds;
//! * a registration the pod no longer has is deleted only at the revision this agent
//!   wrote or last saw ([`crate::registry::Registry::delete_if_revision`]), never a
//!   newer write of the same key.
//!
//! The orphan GC is unaffected: it judges a registry entry by its pod key, and every
//! membership of a live pod carries that pod's key, so none is an orphan while the pod
//! lives; a membership that stopped applying is the resync's to delete, not the GC's.

use super::{Agent, AgentConfig};
use crate::kube::Members;
use crate::model::{Endpoint, Health, PodRecord};
use flock_core::agent::{Guard, OpKind, Writer};
use flock_core::debounce::{Debounce, DebouncePoll};
use flock_core::pod::PodKey;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::watch;

/// The registry endpoints of a kube-mode pod (pure): one per member Service port, on
/// this node, at the pod's listener for the targeted app port. A terminating pod's
/// serving endpoints register as draining (no new requests, as Kubernetes marks a
/// terminating endpoint).
pub fn member_endpoints(
    rec: &PodRecord,
    members: &Members,
    node: &AgentConfig,
    health: Health,
    identity: Option<&str>,
) -> Vec<Endpoint> {
    let Some(address) = rec.ip() else {
        return Vec::new();
    };
    let health = if members.terminating && health == Health::Healthy {
        Health::Draining
    } else {
        health
    };
    members
        .ports
        .iter()
        .map(|m| Endpoint {
            service: m.service.clone(),
            namespace: rec.namespace.clone(),
            service_port: m.service_port,
            protocol: m.protocol,
            address,
            port: m.listen_port,
            node: node.node_name.clone(),
            pod: rec.pod_ref(),
            pod_key: rec.key.clone(),
            region: node.region.clone(),
            zone: node.zone.clone(),
            health,
            identity: identity.map(str::to_string),
            // A pod has one identity.
            also_accept: Vec::new(),
            labels: members.labels.clone(),
        })
        .collect()
}

impl Agent {
    /// One resync of kube mode's registrations (see the module docs); publishes when
    /// anything changed. Returns the number of registry writes. Does nothing until
    /// the reflectors are synced: an unsynced snapshot lacks pods and Services, and
    /// would read as "every membership is gone".
    pub async fn kube_resync(self: &Arc<Self>) -> usize {
        let Some(kube) = &self.kube else {
            return 0;
        };
        if !kube.snapshot().synced {
            return 0;
        }
        let live = self.core().pods();
        kube.retain(&live.keys().cloned().collect());
        let keys: Vec<PodKey> = live
            .iter()
            .filter(|(_, rec)| rec.service.is_empty())
            .map(|(key, _)| key.clone())
            .collect();
        // The Services each pod's ports serve decide which Service's authorization
        // policy governs them: a membership change re-derives that pod (and only it).
        let mut memberships_changed = 0;
        let stale: Vec<PodKey> = self
            .core()
            .pod_services()
            .keys()
            .filter(|k| !live.contains_key(*k))
            .cloned()
            .collect();
        for key in stale {
            // An ADD that failed after its admission set them.
            self.core().set_pod_services(&key, Vec::new());
        }
        for key in &keys {
            if let Some(rec) = live.get(key) {
                let services = kube.members(rec).port_services();
                if self.core().set_pod_services(key, services) {
                    memberships_changed += 1;
                }
            }
        }
        let mut writes = 0;
        for key in keys {
            writes += self
                .in_turn(&key, OpKind::Resync, self.resync_pod(&key))
                .await;
        }
        // A Service's own facts the translation reads from the snapshot (cluster IPs,
        // connection-pool annotations) change no membership: publish when the
        // Services differ from those the last publish read.
        let services_changed = || {
            let now = kube.snapshot();
            let state = super::lock(&self.publish);
            state
                .kube_seen
                .as_ref()
                .is_none_or(|seen| !seen.services.ptr_eq(&now.services))
        };
        if writes > 0 || memberships_changed > 0 {
            let version = self.publish();
            tracing::info!(
                writes,
                memberships_changed,
                version,
                "Service memberships changed; registry updated and published"
            );
        } else if services_changed() {
            let version = self.publish();
            tracing::debug!(version, "Services changed; published");
        }
        writes
    }

    /// Brings one pod's registrations to its current memberships (the caller holds the
    /// pod's turn).
    async fn resync_pod(&self, key: &PodKey) -> usize {
        // A read-only registry (`kubernetes`) is written by the EndpointSlice
        // controller: nothing to register, and its view holds no key of ours.
        if self.registry.read_only() {
            return 0;
        }
        let Some(rec) = self.pod(key) else {
            return 0;
        };
        let desired: BTreeMap<String, Endpoint> = self
            .endpoints_of(&rec, self.registered_health(key))
            .into_iter()
            .map(|e| (e.key(), e))
            .collect();
        let view = self.registry.view().borrow().clone();
        // What the pod holds now, at the revision to delete it at: this agent's own
        // write where it has one (the view may lag behind it), else the view's.
        let mut stale: BTreeMap<String, u64> = view
            .endpoints
            .iter()
            .filter(|(_, e)| e.node == self.cfg.node_name && &e.pod_key == key)
            .map(|(k, e)| (k.clone(), e.revision))
            .collect();
        stale.extend(self.core().own_of(key));
        let mut writes = 0;
        for (ep_key, ep) in &desired {
            stale.remove(ep_key);
            if view.endpoints.get(ep_key).map(|e| &**e) == Some(ep) {
                continue;
            }
            let rev = match self.registry.put(ep).await {
                Ok(rev) => rev,
                Err(e) => {
                    self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %rec.pod_ref(), endpoint = %ep_key, "membership registration failed (the next resync retries): {e}");
                    continue;
                }
            };
            writes += 1;
            // The R4 re-check, as in `reregister`: the pod's turn is held, but a
            // RemovePod of this key that ran before we took it left no record, and
            // we only got here if the record is live; checking again keeps the rule
            // local and true whoever calls this.
            let guard = self.core().registered(key, ep_key, rev, Writer::KubeResync);
            if let Guard::Undo(undo) = guard {
                self.metrics.guard_undos.fetch_add(1, Ordering::Relaxed);
                self.undo_registration(ep_key, undo.revision).await;
            }
        }
        for (ep_key, rev) in stale {
            match self.registry.delete_if_revision(&ep_key, rev).await {
                Ok(deleted) => {
                    // Gone, or rewritten at another revision by someone else: either
                    // way no longer a write of ours to track.
                    self.core().forget(&ep_key);
                    if deleted {
                        writes += 1;
                        tracing::info!(pod = %rec.pod_ref(), endpoint = %ep_key, "membership ended; endpoint unregistered");
                    }
                }
                Err(e) => {
                    self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %rec.pod_ref(), endpoint = %ep_key, "unregistering an ended membership failed (the next resync retries): {e}");
                }
            }
        }
        writes
    }

    /// Runs [`kube_resync`](Self::kube_resync) after every change of the Kubernetes
    /// reflectors, debounced like the registry refresher (a burst of events becomes
    /// one resync `refresh_debounce` after its last, at most `10 ×` that after its
    /// first), and every `gc_interval` (retrying writes that failed). Returns when
    /// `stop` turns true; at once without kube mode.
    pub async fn run_kube_resync(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let Some(kube) = self.kube.clone() else {
            return;
        };
        let mut view = kube.watch().view();
        let quiet_ms = u64::try_from(self.cfg.refresh_debounce.as_millis()).unwrap_or(u64::MAX);
        let mut debounce = Debounce::new(quiet_ms).with_cap(quiet_ms.saturating_mul(10));
        let mut retry = tokio::time::interval(self.cfg.gc_interval);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let deadline = debounce.deadline();
            let changed = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                changed = view.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    view.borrow_and_update();
                    true
                }
                _ = retry.tick() => true,
                () = async {
                    match deadline {
                        Some(at) => tokio::time::sleep_until(flock_clock::mono_instant(at)).await,
                        None => std::future::pending().await,
                    }
                } => false,
            };
            let now = flock_clock::mono_now();
            if changed {
                debounce.trigger(now);
            }
            if debounce.poll(now) == DebouncePoll::Fire {
                self.kube_resync().await;
            }
        }
    }
}
