//! AddPod and RemovePod in flock-core's step order, CHECK, and the startup load.

use super::{AddPodInput, Agent, PodError, PodOutcome};
use crate::identity::PodIdentity;
use crate::kube::KubeAdmission;
use crate::model::{Endpoint, Health, PodRecord, SERVICE_ANNOTATION};
use flock_core::agent::{Guard, OpKind, Unsubscriber};
use flock_core::lifecycle::steps::{ADD_POD, Op, Step};
use flock_core::pod::PodKey;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::oneshot;

/// Where an ADD's answer goes; a send fails when the caller is gone.
type Answer = oneshot::Sender<Result<PodOutcome, PodError>>;

/// The operation's task ended without answering (it panicked).
fn answer_lost() -> PodError {
    PodError::Invalid("the agent's task for this request ended without an answer".into())
}

/// An ADD's store write, in its blocking task: `Err` says why the record is not
/// durable.
type Durable = tokio::task::JoinHandle<Result<(), String>>;

/// The blocking task of a store write ended without a result (it panicked).
fn store_task_lost() -> String {
    "pod store: the write's task ended without a result".into()
}

/// Waits for an ADD's pending store write (none: nothing to wait for).
async fn await_durable(pending: &mut Option<Durable>) -> Result<(), String> {
    match pending.take() {
        None => Ok(()),
        Some(task) => match task.await {
            Ok(synced) => synced,
            Err(_) => Err(store_task_lost()),
        },
    }
}

impl Agent {
    /// `Step::StoreWrite`: the record's write ([`crate::store::PodStore::put`]:
    /// temporary file, rename, and with `Durability::PowerLoss` an fsync before and
    /// after the rename), in a blocking task.
    ///
    /// Awaited here only when the ADD captures the pod's traffic or replaces a pod the
    /// agent holds; otherwise the ADD's next steps run while the disk works (with the
    /// two fsyncs 0.5–0.8 ms on this project's test machines, as long as those steps
    /// together), and the registry step waits for the write. What may run before the
    /// record is written is what a crash cannot leave behind without it:
    /// the pod table, the identity subscription and the published snapshot live in
    /// this process (a restart rebuilds them from the store, and the node's Envoy gets
    /// the restarted agent's snapshot), and the ADD is not answered until the write is
    /// done. What must not: capture rules (they outlive this process, in the pod's
    /// network namespace, and start-up repair verifies them against the stored
    /// record), the registry entry (it outlives the node), and a replaced record of an
    /// announced pod (the registry sync would register it at once).
    ///
    /// The record is validated and encoded first, here: a record the store refuses
    /// fails the step before anything else happens.
    fn store_write(&self, rec: &PodRecord) -> Result<Durable, String> {
        let encoded = self.store.encode(rec).map_err(|e| e.to_string())?;
        let store = Arc::clone(&self.store);
        Ok(tokio::task::spawn_blocking(move || {
            store.put_encoded(&encoded).map_err(|e| e.to_string())
        }))
    }

    /// Whether an ADD of `rec` may run its next steps before its store write is done
    /// (see [`store_write`](Self::store_write)).
    fn may_overlap_store_write(&self, rec: &PodRecord) -> bool {
        rec.capture.is_none() && !self.is_live(&rec.key)
    }

    /// Subscribes a pod's identity, guarded (R6): if the pod was removed while the
    /// subscription was being made, it is withdrawn again.
    pub(super) async fn subscribe_identity(&self, rec: &PodRecord) -> Result<(), String> {
        let Some(provider) = &self.identity else {
            return Ok(());
        };
        provider
            .subscribe(&PodIdentity::from(rec))
            .await
            .map_err(|e| e.to_string())?;
        // The re-check: RemovePod deletes the store record before it unsubscribes, so
        // a pod gone now may have had its unsubscribe run before this subscribe.
        let guard = self.core().subscribed(&rec.key);
        if let Guard::Undo(_) = guard {
            self.metrics.guard_undos.fetch_add(1, Ordering::Relaxed);
            // In the pod's turn and only while it is still gone: a DEL and a new ADD
            // of the pod may both have run since the re-check, and the ADD's
            // subscription must stay.
            self.in_turn(&rec.key, OpKind::Undo, async {
                let may = self
                    .core()
                    .may_unsubscribe(&rec.key, Unsubscriber::Resubscription);
                if may {
                    provider.unsubscribe(&rec.key).await;
                }
            })
            .await;
        }
        Ok(())
    }

    /// Startup: loads the store and **merges** it into the live table (R3), starts
    /// tracking liveness of the loaded pods, re-registers their endpoints (they may
    /// have expired with a previous lease) and publishes. Returns the number of
    /// pods loaded and quarantined.
    pub async fn load(self: &Arc<Self>) -> Result<(usize, usize), String> {
        let store = Arc::clone(&self.store);
        let report = tokio::task::spawn_blocking(move || store.load_all())
            .await
            .map_err(|e| format!("loading the pod store: {e}"))?
            .map_err(|e| format!("loading the pod store: {e}"))?;
        let quarantined = report.quarantined.len();
        let loaded: Vec<(PodKey, Arc<PodRecord>)> = report
            .pods
            .into_iter()
            .map(|p| (p.key.clone(), Arc::new(p)))
            .collect();
        for (key, rec) in &loaded {
            self.note_netns(key, &rec.netns);
        }
        // Warm-up and probe deadlines are this process's own: monotonic time.
        let merge = self.core().load(loaded, flock_clock::mono_now());
        // Captured pods' rules: a netns that outlived the agent may have lost or
        // changed them meanwhile. Before the store counts as loaded, so no ADD or CHECK
        // is answered against rules still being repaired.
        let captured: Vec<PodRecord> = merge
            .added
            .iter()
            .filter_map(|key| self.pod(key))
            .filter(|rec| rec.capture.is_some())
            .map(|rec| PodRecord::clone(&rec))
            .collect();
        let repaired = self.capture_repair(&captured).await;
        if let Err(e) = self.refresh_node_table().await {
            // The next captured ADD or DEL rebuilds it again.
            tracing::error!("kubelet's probes to captured pods may be refused: {e}");
        }
        self.store_loaded.store(true, Ordering::Release);
        tracing::info!(
            captured = captured.len(),
            capture_repaired = repaired,
            loaded = merge.added.len(),
            kept_newer = merge.kept.len(),
            quarantined,
            "pod store loaded (merged into the live table)"
        );
        for key in &merge.added {
            if let Some(rec) = self.pod(key)
                && let Err(e) = self.subscribe_identity(&rec).await
            {
                tracing::warn!(pod = %rec.pod_ref(), "identity resubscription failed (the GC retries): {e}");
            }
        }
        // Their endpoints are registered again by the registry sync (they may have
        // expired with a previous lease) BEFORE the first publish: Envoy keeps serving
        // its last configuration until it gets one, and a snapshot published from a
        // registry view still without them would drop the node's own services from
        // it (an agent restarting or taking over from its predecessor turned requests
        // to them into 404s until the sync caught up). Bounded like an ADD: a
        // registry that is down does not hold up the start.
        // The mutant publishes first, as the load did before.
        if flock_core::reintroduced!("load-publishes-before-sync") {
            self.publish();
        }
        for key in &merge.added {
            self.announce(key);
        }
        if let Err(why) = self.sync_wait(self.sync_kick()).await {
            tracing::warn!(%why, "stored pods served locally; their registration is pending (the registry sync retries)");
        }
        self.publish();
        Ok((merge.added.len(), quarantined))
    }

    /// The endpoints a pod registers: one per app port of its annotated service, or
    /// in kube mode (a record without a service) one per Service port it is a member
    /// of now.
    pub(super) fn endpoints_of(&self, rec: &PodRecord, health: Health) -> Vec<Endpoint> {
        let identity = self
            .identity_view()
            .and_then(|v| v.svid_of(&rec.key).map(|s| s.spiffe_id.clone()));
        self.endpoints_with(rec, health, identity.as_deref())
    }

    /// [`Agent::endpoints_of`] with the pod's SPIFFE ID given (the one the caller
    /// derived from, so what it records matches what the endpoints carry).
    pub(super) fn endpoints_with(
        &self,
        rec: &PodRecord,
        health: Health,
        identity: Option<&str>,
    ) -> Vec<Endpoint> {
        if !rec.service.is_empty() {
            return super::mesh::endpoints(rec, &self.cfg, health, identity);
        }
        match &self.kube {
            Some(kube) => {
                super::member_endpoints(rec, &kube.members(rec), &self.cfg, health, identity)
            }
            None => Vec::new(),
        }
    }

    /// CNI ADD: runs `flock_core::lifecycle::ADD_POD` in order; on a failed step,
    /// rolls back with `REMOVE_POD` in full. Answers once a snapshot with the pod is
    /// published. Dropping the returned future abandons the ADD midway; the CNI server
    /// uses [`add_pod_to_completion`](Self::add_pod_to_completion) instead.
    pub async fn add_pod(self: &Arc<Self>, input: &AddPodInput) -> Result<PodOutcome, PodError> {
        let (tx, rx) = oneshot::channel();
        self.add_pod_answering(input, tx).await;
        rx.await.unwrap_or_else(|_| Err(answer_lost()))
    }

    /// CNI ADD run to completion in a task of its own, whether or not the caller
    /// waits: tonic drops a handler's future when the plugin disconnects or times out,
    /// which would abandon the steps midway (a store record without xDS, a
    /// registration without a record). If the caller is gone when the answer is ready
    /// (the runtime saw the ADD fail, and will not DEL a pod it thinks was never
    /// added), a successful ADD is undone by a RemovePod, under the same pod lock, so a
    /// retried ADD queued behind it sees the pod removed and adds it again.
    pub async fn add_pod_to_completion(
        self: &Arc<Self>,
        input: AddPodInput,
    ) -> Result<PodOutcome, PodError> {
        let (tx, rx) = oneshot::channel();
        let agent = Arc::clone(self);
        tokio::spawn(async move { agent.add_pod_answering(&input, tx).await });
        rx.await.unwrap_or_else(|_| Err(answer_lost()))
    }

    /// CNI DEL run to completion in a task of its own, whether or not the caller waits
    /// (see [`add_pod_to_completion`](Self::add_pod_to_completion)): a DEL always
    /// completes.
    pub async fn remove_pod_to_completion(
        self: &Arc<Self>,
        key: PodKey,
    ) -> Result<PodOutcome, PodError> {
        let agent = Arc::clone(self);
        tokio::spawn(async move { agent.remove_pod(&key).await })
            .await
            .unwrap_or_else(|_| Err(answer_lost()))
    }

    async fn add_pod_answering(self: &Arc<Self>, input: &AddPodInput, answer: Answer) {
        if let Some(kube) = &self.kube {
            let rec = match kube.admit(input).await {
                Ok(KubeAdmission::Meshed { pod, members }) => {
                    let rec = match self.admitted_record(*pod, input) {
                        Ok(rec) => rec,
                        Err(e) => {
                            self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed);
                            let _ = answer.send(Err(e));
                            return;
                        }
                    };
                    // Registered by this ADD even if the reflector does not show the
                    // pod yet (its GET answered first).
                    self.core()
                        .set_pod_services(&rec.key, members.port_services());
                    kube.remember(&rec.key, members);
                    rec
                }
                Ok(KubeAdmission::Ignored(why)) => {
                    self.metrics.pods_ignored.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(pod = %format!("{}/{}", input.namespace, input.name), "{why}");
                    let _ = answer.send(Ok(PodOutcome::Ignored(why)));
                    return;
                }
                Err(e) => {
                    self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %format!("{}/{}", input.namespace, input.name), "AddPod refused: {e}");
                    let _ = answer.send(Err(e));
                    return;
                }
            };
            return self.add_record(rec, answer).await;
        }
        let rec = match self.record_for(input) {
            Ok(Some(rec)) => rec,
            Ok(None) => {
                self.metrics.pods_ignored.fetch_add(1, Ordering::Relaxed);
                let _ = answer.send(Ok(PodOutcome::Ignored(format!(
                    "pod {}/{} has no {SERVICE_ANNOTATION} annotation: not meshed",
                    input.namespace, input.name
                ))));
                return;
            }
            Err(e) => {
                self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed);
                let _ = answer.send(Err(e));
                return;
            }
        };
        self.add_record(rec, answer).await
    }

    async fn add_record(self: &Arc<Self>, rec: PodRecord, answer: Answer) {
        let key = rec.key.clone();
        self.in_turn(&key, OpKind::Add, async {
                let result = self.add_locked(&rec).await;
                match &result {
                    Ok(_) => self.metrics.pods_added.fetch_add(1, Ordering::Relaxed),
                    Err(_) => self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed),
                };
                // Answered in the pod's turn: if the caller is gone, the undo runs
                // before any later operation on the pod.
                let succeeded = result.is_ok();
                let delivered = answer.send(result).is_ok();
                if flock_core::agent::after_answer(delivered, succeeded) {
                    tracing::warn!(pod = %rec.pod_ref(), key = %rec.key, "the ADD's caller went away before its answer (the runtime saw it fail); undoing it");
                    self.metrics.adds_undone.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = self.remove_locked(&rec.key).await {
                        tracing::warn!(pod = %rec.pod_ref(), key = %rec.key, "undoing the abandoned ADD stopped: {e}");
                    }
                }
            })
            .await
    }

    async fn add_locked(self: &Arc<Self>, rec: &PodRecord) -> Result<PodOutcome, PodError> {
        let mut version = 0;
        let mut registry_note = String::new();
        self.failpoint(|| "add/start".into());
        // The record's store write, when it runs beside the next steps (see
        // `store_write`).
        let mut pending_durable = None;
        let started = std::time::Instant::now();
        // Each step's own time (`StoreWrite:62,CaptureApply:1,...`, µs) in the `pod
        // added` line: which step a slow ADD spent its time in.
        let mut step_us = String::new();
        let mut step_started = started;
        for step in ADD_POD {
            let mut failed = *step;
            let done = match step {
                Step::StoreWrite => {
                    let written = match self.store_write(rec) {
                        Ok(write) if self.may_overlap_store_write(rec) => {
                            pending_durable = Some(write);
                            Ok(())
                        }
                        Ok(write) => await_durable(&mut Some(write)).await,
                        Err(refused) => Err(refused),
                    };
                    if written.is_ok() {
                        self.note_netns(&rec.key, &rec.netns);
                        let stored = self.core().stored(
                            rec.key.clone(),
                            Arc::new(rec.clone()),
                            flock_clock::mono_now(),
                        );
                        if stored.health_reset {
                            // A repeated ADD resets the pod's health (to serving)
                            // while its record may compare equal: the registry
                            // sync must re-derive its endpoints all the same.
                            self.sync.health_gen.fetch_add(1, Ordering::Release);
                        }
                    }
                    written
                }
                Step::CaptureApply => self.capture_apply(rec).await,
                Step::IdentitySubscribe => match &self.identity {
                    Some(provider) => provider
                        .subscribe(&PodIdentity::from(rec))
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    None => Ok(()),
                },
                Step::XdsPublish => {
                    version = self.publish();
                    Ok(())
                }
                Step::RegistryRegister => {
                    // The first step whose effect outlives this node: the record
                    // must be durable first.
                    match await_durable(&mut pending_durable).await {
                        Err(e) => {
                            failed = Step::StoreWrite;
                            Err(e)
                        }
                        Ok(()) => {
                            // Handed to the registry sync: the pod is served locally
                            // now, and an unreachable or hanging registry must not fail
                            // the ADD (the sync retries until the registry has it).
                            // Waits a bounded time so that in the normal case remote
                            // nodes know the pod when ADD answers.
                            let seq = self.announce(&rec.key);
                            registry_note = match self.sync_wait(seq).await {
                                Ok(()) => "registered".to_string(),
                                Err(why) => {
                                    tracing::warn!(pod = %rec.pod_ref(), key = %rec.key, %why, "pod served locally; its registration is pending (the registry sync retries)");
                                    format!("registration pending: {why}")
                                }
                            };
                            Ok(())
                        }
                    }
                }
                other => unreachable!("{other} is not an AddPod step"),
            };
            if let Err(mut message) = done {
                let step = &failed;
                // The rollback deletes the record: not while its write still runs.
                let _ = await_durable(&mut pending_durable).await;
                tracing::warn!(pod = %rec.pod_ref(), key = %rec.key, %step, %message, "AddPod step failed; rolling back");
                if let Err(undo) = self.remove_locked(&rec.key).await {
                    // The record stays stored and the pod held: the runtime's DEL for
                    // the failed ADD removes it once the store can delete again.
                    message = format!("{message}; rollback stopped: {undo}");
                }
                return Err(PodError::Step {
                    step: *step,
                    message,
                });
            }
            self.failpoint(|| format!("add/{step}"));
            let now = std::time::Instant::now();
            if !step_us.is_empty() {
                step_us.push(',');
            }
            step_us.push_str(&format!("{step}:{}", (now - step_started).as_micros()));
            step_started = now;
        }
        // Every AddPod sequence ends with the registry step, which waited; this holds
        // the answer back all the same should the steps ever change.
        if let Err(e) = await_durable(&mut pending_durable).await {
            let mut message = e;
            if let Err(undo) = self.remove_locked(&rec.key).await {
                message = format!("{message}; rollback stopped: {undo}");
            }
            return Err(PodError::Step {
                step: Step::StoreWrite,
                message,
            });
        }
        let took_us = started.elapsed().as_micros() as u64;
        tracing::info!(pod = %rec.pod_ref(), key = %rec.key, service = %rec.service, service_account = %rec.service_account, ports = rec.ports.len(), version, took_us, step_us, "pod added");
        if rec.service.is_empty() {
            let memberships: BTreeSet<String> = self
                .endpoints_of(rec, Health::Healthy)
                .into_iter()
                .map(|e| format!("{}:{}", e.service, e.service_port))
                .collect();
            return Ok(PodOutcome::Done(format!(
                "pod {} meshed with service account {} ({} port(s)); member of [{}]; xDS version {version}; {registry_note}",
                rec.pod_ref(),
                rec.service_account,
                rec.ports.len(),
                memberships.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
        Ok(PodOutcome::Done(format!(
            "pod {} meshed as {}.{} ({} port(s)); xDS version {version}; {registry_note}",
            rec.pod_ref(),
            rec.service,
            rec.namespace,
            rec.ports.len()
        )))
    }

    /// CNI DEL: runs `flock_core::lifecycle::REMOVE_POD` in order (store first: R4).
    /// Unknown pods are IGNORED; every step is idempotent.
    ///
    /// Fails, changing nothing, when the pod's stored record cannot be deleted (a
    /// read-only or failing disk): the pod stays stored *and* served, and the runtime
    /// retries the DEL. Answering success instead would bring the pod back at the next
    /// start (a ghost), and no tombstone can be written to a disk that refuses the
    /// delete.
    pub async fn remove_pod(self: &Arc<Self>, key: &PodKey) -> Result<PodOutcome, PodError> {
        match self
            .in_turn(key, OpKind::Remove, self.remove_locked(key))
            .await
        {
            Ok(true) => {
                self.metrics.pods_removed.fetch_add(1, Ordering::Relaxed);
                Ok(PodOutcome::Done(format!("pod {key} removed")))
            }
            Ok(false) => {
                self.metrics.pods_ignored.fetch_add(1, Ordering::Relaxed);
                Ok(PodOutcome::Ignored(format!(
                    "pod {key} is not known to this agent"
                )))
            }
            Err(message) => {
                self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%key, %message, "RemovePod failed; the pod is kept");
                Err(PodError::Step {
                    step: Step::StoreDelete,
                    message: format!(
                        "{message}; pod {key} is kept (still meshed) until a DEL succeeds"
                    ),
                })
            }
        }
    }

    /// Returns whether the pod was known (in the table or the store); an error (and
    /// no change) if its stored record could not be deleted.
    async fn remove_locked(self: &Arc<Self>, key: &PodKey) -> Result<bool, String> {
        let mut existed = false;
        // The removed record, for the capture removal at the end.
        let mut removed: Option<Arc<PodRecord>> = None;
        self.failpoint(|| "remove/start".into());
        for step in Op::RemovePod.steps() {
            match step {
                Step::StoreDelete => {
                    // The disk first: a record that cannot be deleted stops the removal
                    // before anything is torn down, so the pod is either fully kept or
                    // gone for good (no record left to resurrect it at the next start).
                    // R4 needs only that the pod leaves the table before the teardown
                    // steps below, which the next lines still do.
                    let store = Arc::clone(&self.store);
                    let k = key.clone();
                    match tokio::task::spawn_blocking(move || store.remove(&k)).await {
                        Ok(Ok(was)) => existed |= was,
                        Ok(Err(e)) => return Err(e.to_string()),
                        Err(e) => return Err(format!("store delete task: {e}")),
                    }
                    // Invisible first: from here no background loop sees the pod.
                    removed = self.core().removed(key);
                    existed |= removed.is_some();
                    if let Some(kube) = &self.kube {
                        kube.forget(key);
                    }
                }
                Step::XdsWithdraw => {
                    self.publish();
                }
                Step::RegistryUnregister => {
                    let in_view: Vec<String> = {
                        let view = self.registry.view().borrow().clone();
                        view.endpoints
                            .iter()
                            .filter(|(_, e)| e.node == self.cfg.node_name && &e.pod_key == key)
                            .map(|(k, _)| k.clone())
                            .collect()
                    };
                    // Handed to the registry sync, which deletes them (and retries
                    // while the registry is down); the DEL does not fail on the
                    // registry. The pod left the table above, so the sync's re-checks
                    // keep a registration still in flight from outliving it (R4).
                    // Registry keys do not make the pod "known": a withdrawal the sync
                    // has not finished leaves them in the view, and a repeated DEL of
                    // the removed pod must still answer that it is gone (IGNORED), not
                    // that it removed it again (`flock_core::agent::Withdrawal`).
                    let withdrawal = self.core().withdrawal(key, in_view);
                    existed |= withdrawal.counts_as_known;
                    let keys = withdrawal.keys;
                    let seq = self.withdraw(key, keys);
                    if let Err(why) = self.sync_wait(seq).await {
                        tracing::warn!(%key, %why, "pod removed locally; its unregistration is pending (the registry sync retries)");
                    }
                }
                Step::IdentityUnsubscribe => {
                    if let Some(provider) = &self.identity {
                        existed |= provider.view().borrow().subscriptions.contains_key(key);
                        provider.unsubscribe(key).await;
                    }
                }
                Step::CaptureRemove => {
                    if let Some(rec) = &removed {
                        self.capture_remove(rec).await;
                    }
                }
                other => unreachable!("{other} is not a RemovePod step"),
            }
            self.failpoint(|| format!("remove/{step}"));
        }
        if existed {
            tracing::info!(%key, "pod removed");
        }
        Ok(existed)
    }

    /// CNI CHECK: the pod is held as added and, if it is captured, its netns holds
    /// exactly its capture table (the error names the netns and the drift).
    pub async fn check_pod(&self, key: &PodKey) -> Result<(), String> {
        match self.pod(key) {
            Some(rec) => self.capture_check(&rec).await,
            None => Err(format!("pod {key} is not known to this agent")),
        }
    }
}
