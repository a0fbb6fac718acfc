//! The registry sync: the one path by which CNI `ADD`/`DEL` reach the registry.
//!
//! The pod table is the source of truth; the registry is a replica that may be down
//! or hang (an etcd that is partitioned or stopped answers nothing, it does not
//! refuse). So AddPod's `RegistryRegister` step *announces* the pod (it may now be
//! reachable from other nodes: its xDS is published) and RemovePod's
//! `RegistryUnregister` hands the pod's registry keys over for removal; both wake the
//! sync and wait for it a bounded time ([`crate::agent::AgentConfig::register_wait`]),
//! then answer the runtime whatever the registry did.
//!
//! The sync task plans with [`flock_core::regsync::plan`]: desired = the endpoints of
//! the announced pods still in the table; held = what the registry view shows of the
//! keys this agent process wrote, tried to write or was asked to remove, plus writes
//! whose outcome is unknown. It applies the plan in order, every call bounded by
//! [`crate::agent::AgentConfig::registry_op_timeout`], and plans again until nothing is
//! left. A failed or timed-out call ends the round; the next one comes after a backoff
//! ([`flock_core::backoff`]), at once when the registry reconnects (a new view
//! generation, or the view synced again), or on any view change while in sync.
//!
//! Ghosts (R4 in its registry form) are ruled out in three ways:
//! * a key is *tracked before its put is sent*, so a put that timed out and lands
//!   later (the request was abandoned, not undone) is seen in the view and deleted if
//!   no pod wants it; tracked keys are forgotten only a while after they were last
//!   written and seen gone ([`LINGER`]);
//! * the put re-checks the pod after it lands and undoes itself (at the revision it
//!   wrote) if the pod left meanwhile, as `flock_core::lifecycle::guard` requires;
//! * every change of the table wakes the sync, which plans from the table as it is
//!   then, never from a list taken before.
//!
//! Anything this process never knew about (a crash between two steps) is still the
//! orphan GC's job.

use super::Agent;
use super::podinputs::PodInputs;
use crate::model::{Endpoint, Health, PodRecord};
use flock_core::backoff::Backoff;
use flock_core::journal::{JournaledMap, Snapshot};
use flock_core::pod::PodKey;
use flock_core::regsync::{Held, PutGuard, SyncOp, plan};
use flock_core::sync::{Mutex, lock};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// How long a key the sync wrote or removed stays tracked after it was last written
/// and is gone from the view: a write abandoned on a timeout that lands later than
/// this is left to the orphan GC.
pub const LINGER: Duration = Duration::from_secs(60);

/// How often a clean round forgets tracked keys (see [`Agent::prune`]).
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// Rounds of planning in one go before a pause: the plan converges in one or two
/// unless the table keeps changing under it.
const MAX_PLANS_PER_ROUND: usize = 8;

/// Where the registry sync stands (for `/readyz`, `/metrics` and waiters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncStatus {
    /// The highest request the registry fully reflects.
    pub applied: u64,
    /// The highest request whose round failed (it is retried).
    pub failed: u64,
    /// True when the last round left the registry matching the live pods.
    pub in_sync: bool,
    /// Writes the last plan had left when the round ended.
    pub pending: usize,
    /// Why the last round failed, while out of sync.
    pub last_error: Option<String>,
    /// When a round last left the registry matching the live pods (at start: when the
    /// sync was created, with nothing to write yet).
    pub last_ok: Instant,
}

impl SyncStatus {
    /// How long ago the registry last matched the live pods.
    pub fn since_in_sync(&self) -> Duration {
        self.last_ok.elapsed()
    }
}

#[derive(Default)]
struct State {
    /// Pods whose `RegistryRegister` step ran: the only ones that may be registered
    /// (remote traffic only once the local proxy has the pod's config).
    /// A persistent set: the desired endpoints keep last round's copy (O(1)) and
    /// visit only the pods announced or withdrawn since.
    announced: JournaledMap<PodKey, ()>,
    /// Keys this process wrote, tried to write or was asked to remove → when last
    /// touched.
    tracked: BTreeMap<String, Instant>,
    /// Keys whose last write failed without an answer: it may land later.
    unknown: BTreeSet<String>,
    /// Requests made so far (each ADD/DEL hand-over is one).
    requested: u64,
    /// The registry call in flight (what, key) and when it was sent: a waiter does not
    /// wait for a call that has already gone unanswered for the registry wait.
    call: Option<(Instant, String)>,
    /// Counts the changes of `announced`.
    announced_gen: u64,
    /// Keys handed over by [`Agent::withdraw`] since the last clean plan, each with
    /// the number of its hand-over: they become tracked, so the next plan must look at
    /// them even if nothing else about them changed.
    withdrawn: BTreeMap<String, u64>,
    /// Hand-overs so far (stamps `withdrawn`).
    withdrawals: u64,
    /// When [`Agent::prune`] last ran.
    pruned: Option<Instant>,
}

/// One announced pod's endpoints and what they were derived from.
struct Derived {
    rec: Arc<PodRecord>,
    health: Health,
    spiffe_id: Option<String>,
    endpoints: Vec<(String, Endpoint)>,
}

/// The desired registry content, kept between rounds ([`Agent::desired`]).
#[derive(Default)]
struct Desired {
    by_pod: BTreeMap<PodKey, Derived>,
    /// Every announced pod's endpoints by key: `by_pod`'s, merged.
    all: Arc<BTreeMap<String, Endpoint>>,
    /// What `all` was derived from: while these are the same, so is `all`.
    inputs: Option<Inputs>,
    /// The pod table, SPIFFE IDs and announced set `by_pod` was derived from, so the
    /// next derivation visits only the pods whose inputs changed.
    seen: Option<(PodInputs, Snapshot<PodKey, ()>)>,
    /// Keys whose desired endpoint may have changed since the last clean plan.
    changed: BTreeSet<String>,
    /// The view (seq, generation) of the last plan that found nothing to do.
    clean: Option<(u64, u64)>,
}

/// What the desired endpoints are derived from, by version (read before the values,
/// so a change made meanwhile only costs one more derivation).
#[derive(PartialEq, Eq)]
struct Inputs {
    pods: u64,
    announced: u64,
    health: u64,
    /// The identity view's generation (not its address: a freed view's address can
    /// come back with another view).
    identity: Option<u64>,
}

/// The sync's shared state (see the module docs).
pub(super) struct RegSync {
    state: Mutex<State>,
    /// Only the sync task reads and writes it.
    desired: Mutex<Desired>,
    /// Counts pods' health transitions (the registered health is part of the desired
    /// endpoints).
    pub(super) health_gen: std::sync::atomic::AtomicU64,
    wake: Notify,
    status: watch::Sender<SyncStatus>,
    started: AtomicBool,
}

impl RegSync {
    pub(super) fn new() -> Self {
        Self {
            state: Mutex::new(State::default()),
            desired: Mutex::new(Desired::default()),
            health_gen: std::sync::atomic::AtomicU64::new(0),
            wake: Notify::new(),
            status: watch::channel(SyncStatus {
                applied: 0,
                failed: 0,
                in_sync: true,
                pending: 0,
                last_error: None,
                last_ok: Instant::now(),
            })
            .0,
            started: AtomicBool::new(false),
        }
    }
}

/// A put of an endpoint of unknown outcome, or a failed delete.
struct RoundError(String);

impl Agent {
    /// Where the registry sync stands.
    pub fn registry_sync_status(&self) -> SyncStatus {
        self.sync.status.borrow().clone()
    }

    /// Why the registry does not reflect this node's pods now, if it does not: the
    /// view is disconnected or the sync has writes left. `None` when in sync.
    pub fn registry_out_of_sync(&self) -> Option<String> {
        if self.registry.read_only() {
            return None;
        }
        let view_synced = self.registry.view().borrow().synced;
        let s = self.registry_sync_status();
        if view_synced && s.in_sync {
            return None;
        }
        let mut why = format!("registry {} out of sync", self.registry.describe());
        if !view_synced {
            why.push_str(" (disconnected; reconnecting)");
        }
        if s.pending > 0 {
            why.push_str(&format!("; {} write(s) pending", s.pending));
        }
        why.push_str(&format!(
            "; last in sync {:.1}s ago",
            s.since_in_sync().as_secs_f64()
        ));
        if let Some(e) = &s.last_error {
            why.push_str(&format!("; last error: {e}"));
        }
        Some(why)
    }

    /// AddPod's `RegistryRegister`: the pod may be registered from now on.
    pub(super) fn announce(self: &Arc<Self>, key: &PodKey) -> u64 {
        {
            let mut st = lock(&self.sync.state);
            st.announced.insert(key.clone(), ());
            st.announced_gen += 1;
        }
        self.sync_kick()
    }

    /// RemovePod's `RegistryUnregister`: the pod is no longer wanted (it left the
    /// table); `keys` are its registry keys, to remove.
    pub(super) fn withdraw(self: &Arc<Self>, key: &PodKey, keys: Vec<String>) -> u64 {
        let now = Instant::now();
        {
            let mut st = lock(&self.sync.state);
            st.announced.remove(key);
            st.announced_gen += 1;
            st.withdrawals += 1;
            let stamp = st.withdrawals;
            for k in keys {
                st.tracked.insert(k.clone(), now);
                st.withdrawn.insert(k, stamp);
            }
        }
        self.sync_kick()
    }

    /// Wakes the registry sync: it plans again from the pod table and the view.
    pub fn request_registry_sync(self: &Arc<Self>) {
        self.sync_kick();
    }

    /// Wakes the sync (starting it on first use); returns the request's number.
    pub(super) fn sync_kick(self: &Arc<Self>) -> u64 {
        let seq = {
            let mut st = lock(&self.sync.state);
            st.requested += 1;
            st.requested
        };
        if !self.sync.started.swap(true, Ordering::AcqRel) {
            tokio::spawn(run(Arc::downgrade(self), self.registry.view()));
        }
        self.sync.wake.notify_one();
        seq
    }

    /// Waits until request `seq` is in the registry, the sync failed on it, or
    /// [`super::AgentConfig::register_wait`] passed (counted from when the registry
    /// call in flight was sent, if there is one). `Err` says why it is not (yet).
    pub(super) async fn sync_wait(&self, seq: u64) -> Result<(), String> {
        if self.registry.read_only() {
            return Ok(());
        }
        let mut rx = self.sync.status.subscribe();
        {
            // Failing now (in backoff): answer at once with why; the sync retries on
            // its own schedule.
            let s = rx.borrow_and_update();
            if !s.in_sync
                && let Some(e) = &s.last_error
            {
                return Err(e.clone());
            }
        }
        // A registry that hangs (stopped, partitioned) is seen first as a call that
        // does not come back; the round only fails once the call's own bound
        // (`registry_op_timeout`, seconds) passes. Waiting for that would make every
        // ADD and DEL of that window take the full registry wait, so the wait ends
        // once the call in flight has gone unanswered for the registry wait: only the
        // first of those windows costs the runtime anything.
        let mut deadline = Instant::now() + self.cfg.register_wait;
        if let Some((since, _)) = &lock(&self.sync.state).call {
            deadline = deadline.min(*since + self.cfg.register_wait);
        }
        // (A deadline already past still sees a request that is already applied:
        // the wait is polled before its deadline.)
        let waited = tokio::time::timeout_at(
            deadline,
            rx.wait_for(|s| s.applied >= seq || s.failed >= seq),
        )
        .await;
        match waited {
            Ok(Ok(s)) if s.applied >= seq => Ok(()),
            Ok(Ok(s)) => Err(s
                .last_error
                .clone()
                .unwrap_or_else(|| "registry write failed".into())),
            Ok(Err(_)) => Err("the registry sync stopped".into()),
            Err(_) => match lock(&self.sync.state).call.clone() {
                Some((since, what)) => Err(format!(
                    "the registry has not answered {what} for {:?} (the sync retries; ADD and DEL no longer wait for it)",
                    since.elapsed()
                )),
                None => Err(format!(
                    "the registry did not confirm within {:?}",
                    self.cfg.register_wait
                )),
            },
        }
    }

    /// The endpoints of every announced pod still in the table, by key. Only the
    /// pods whose record, SPIFFE ID or announcement changed since the last round are
    /// visited and re-derived ([`PodInputs::changed_since`]); every pod after a health
    /// transition (rare; the registered health is per pod but its changes are only
    /// counted). Deriving every pod's endpoints (names formatted, keys built, strings
    /// copied), and later even visiting every pod, on every round made each ADD cost
    /// O(pods). Kube mode's records (no service annotation) depend on the Service
    /// memberships too, and are derived every time.
    fn desired(&self) -> Arc<BTreeMap<String, Endpoint>> {
        // Versions first, values after (see `Inputs`).
        let health = self.sync.health_gen.load(Ordering::Acquire);
        // The table and its version together, in O(1).
        let pods = self.core().pods();
        let pods_version = pods.version();
        let identity = self.identity_view();
        let announced_gen = lock(&self.sync.state).announced_gen;
        let inputs = Inputs {
            pods: pods_version,
            announced: announced_gen,
            health,
            identity: identity.as_ref().map(|v| v.generation),
        };
        let mut cache = lock(&self.sync.desired);
        // Kube mode's memberships have no version here: derived every time.
        if self.kube.is_none() && cache.inputs.as_ref() == Some(&inputs) {
            return Arc::clone(&cache.all);
        }
        let same_health = cache.inputs.as_ref().is_some_and(|i| i.health == health);
        cache.inputs = Some(inputs);
        // Read after its version (a change meanwhile is seen again next time); an
        // O(1) copy of the persistent set (lock order: desired, state).
        let announced = lock(&self.sync.state).announced.snapshot();
        let now = PodInputs::new(
            pods,
            identity.as_deref(),
            cache.seen.as_ref().map(|(p, _)| p),
        );
        let Desired {
            by_pod,
            all,
            changed,
            seen,
            ..
        } = &mut *cache;
        let visit: Vec<PodKey> = match seen {
            Some((was, was_announced)) if same_health && self.kube.is_none() => {
                let mut keys = now.changed_since(was);
                super::podinputs::changed_keys(was_announced, &announced, |_, _| true, &mut keys);
                keys.into_iter().collect()
            }
            _ => by_pod
                .keys()
                .cloned()
                .chain(announced.keys().cloned())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        };
        for key in visit {
            let rec = match now.table.get(&key) {
                Some(rec) if announced.contains_key(&key) => Arc::clone(rec),
                _ => {
                    // Withdrawn, or gone from the table: its endpoints are not wanted.
                    if let Some(old) = by_pod.remove(&key) {
                        let map = Arc::make_mut(all);
                        for (k, _) in old.endpoints {
                            map.remove(&k);
                            changed.insert(k);
                        }
                    }
                    continue;
                }
            };
            let health = self.registered_health(&key);
            let spiffe_id = now.spiffe_id(&key);
            let fresh = by_pod.get(&key).is_some_and(|d| {
                !rec.service.is_empty()
                    && Arc::ptr_eq(&d.rec, &rec)
                    && d.health == health
                    && d.spiffe_id.as_deref() == spiffe_id
            });
            if fresh {
                continue;
            }
            let endpoints: Vec<(String, Endpoint)> = self
                .endpoints_with(&rec, health, spiffe_id)
                .into_iter()
                .map(|ep| (ep.key(), ep))
                .collect();
            let map = Arc::make_mut(all);
            if let Some(old) = by_pod.remove(&key) {
                for (k, _) in old.endpoints {
                    map.remove(&k);
                    changed.insert(k);
                }
            }
            for (k, ep) in &endpoints {
                map.insert(k.clone(), ep.clone());
                changed.insert(k.clone());
            }
            by_pod.insert(
                key,
                Derived {
                    rec,
                    health,
                    spiffe_id: spiffe_id.map(str::to_string),
                    endpoints,
                },
            );
        }
        *seen = Some((now, announced));
        Arc::clone(all)
    }

    /// Whether `key`'s pod is still wanted in the registry now (R4's re-check): in
    /// the table (which RemovePod leaves first) and announced.
    fn still_wanted(&self, pod: &PodKey) -> bool {
        self.is_live(pod) && lock(&self.sync.state).announced.contains_key(pod)
    }

    /// What the registry holds of the keys the sync knows about (of `only`, if given).
    fn held(
        &self,
        view: &crate::registry::View,
        only: Option<&BTreeSet<String>>,
    ) -> BTreeMap<String, Held<Endpoint>> {
        let st = lock(&self.sync.state);
        let core = self.core();
        let own = core.own();
        let mut held = BTreeMap::new();
        let hold = |key: &String| match view.endpoints.get(key) {
            Some(ep) if ep.node == self.cfg.node_name => {
                let revision = ep.revision;
                held.insert(
                    key.clone(),
                    Held::Known {
                        value: (**ep).clone(),
                        revision,
                    },
                );
            }
            _ if st.unknown.contains(key) => {
                held.insert(key.clone(), Held::Unknown);
            }
            _ => {}
        };
        match only {
            Some(keys) => keys
                .iter()
                .filter(|k| {
                    st.tracked.contains_key(*k) || own.contains_key(*k) || st.unknown.contains(*k)
                })
                .for_each(hold),
            None => st
                .tracked
                .keys()
                .chain(own.keys())
                .chain(st.unknown.iter())
                .for_each(hold),
        }
        held
    }

    /// The keys a plan must look at, when fewer than all: those whose desired endpoint
    /// changed, that the view changed, that were handed over for removal, or whose
    /// last write is of unknown outcome, since the last plan that found nothing to do.
    /// Every other key still matches as it did then, so a plan over these alone makes
    /// the same writes as a plan over all (a plan decides each key on its own). `None`
    /// (plan over all) after a failed round, a reconnect, or more missed views than
    /// the view's deltas cover. Returns the candidates and the last hand-over stamp
    /// they include.
    fn candidates(&self, view: &crate::registry::View) -> Option<(BTreeSet<String>, u64)> {
        let desired = lock(&self.sync.desired);
        let (seq, generation) = desired.clean?;
        if generation != view.generation || seq == 0 {
            return None;
        }
        let deltas = view.deltas_since(seq)?;
        let view_changed: Vec<&String> = deltas.flat_map(|d| d.keys()).collect();
        let st = lock(&self.sync.state);
        let keys = flock_core::regsync::plan_candidates(
            &desired.changed,
            view_changed,
            st.withdrawn.keys(),
            &st.unknown,
        );
        Some((keys, st.withdrawals))
    }

    /// Records a plan that found nothing to do at `view`: later plans start from it.
    fn mark_clean(&self, view: &crate::registry::View, withdrawals: u64) {
        let mut desired = lock(&self.sync.desired);
        desired.clean = Some((view.seq, view.generation));
        desired.changed.clear();
        lock(&self.sync.state)
            .withdrawn
            .retain(|_, stamp| *stamp > withdrawals);
    }

    /// Applies one bounded registry call; a timeout is an error.
    async fn bounded<T>(
        &self,
        what: &str,
        key: &str,
        fut: impl Future<Output = Result<T, crate::registry::RegistryError>>,
    ) -> Result<T, RoundError> {
        lock(&self.sync.state).call = Some((Instant::now(), format!("{what} {key:?}")));
        let answered = tokio::time::timeout(self.cfg.registry_op_timeout, fut).await;
        lock(&self.sync.state).call = None;
        match answered {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(RoundError(e.to_string())),
            Err(_) => Err(RoundError(format!(
                "{what} {key:?}: the registry did not answer within {:?}",
                self.cfg.registry_op_timeout
            ))),
        }
    }

    /// Plans and applies until the registry matches (see the module docs).
    async fn sync_round(&self) -> Result<(), RoundError> {
        for _ in 0..MAX_PLANS_PER_ROUND {
            let view = self.registry.view().borrow().clone();
            if !view.synced {
                return Err(RoundError(format!(
                    "registry {} disconnected (reconnecting)",
                    self.registry.describe()
                )));
            }
            let desired = self.desired();
            let (ops, withdrawals) = match self.candidates(&view) {
                Some((keys, withdrawals)) => {
                    let wanted: BTreeMap<String, Endpoint> = keys
                        .iter()
                        .filter_map(|k| desired.get(k).map(|ep| (k.clone(), ep.clone())))
                        .collect();
                    (plan(&wanted, &self.held(&view, Some(&keys))), withdrawals)
                }
                None => {
                    let withdrawals = lock(&self.sync.state).withdrawals;
                    (plan(&desired, &self.held(&view, None)), withdrawals)
                }
            };
            self.set_pending(ops.len());
            if ops.is_empty() {
                self.prune(&view, &desired);
                self.mark_clean(&view, withdrawals);
                return Ok(());
            }
            let total = ops.len();
            for (done, op) in ops.into_iter().enumerate() {
                self.set_pending(total - done);
                if let Err(e) = self.apply(op).await {
                    // Start the next round from the whole picture.
                    lock(&self.sync.desired).clean = None;
                    return Err(e);
                }
            }
            self.set_pending(0);
        }
        Err(RoundError(
            "the pods kept changing while the registry was written; planning again".into(),
        ))
    }

    fn set_pending(&self, pending: usize) {
        self.metrics
            .registry_pending_ops
            .store(pending as u64, Ordering::Relaxed);
        self.sync.status.send_if_modified(|s| {
            let changed = s.pending != pending;
            s.pending = pending;
            changed
        });
    }

    async fn apply(&self, op: SyncOp<crate::model::Endpoint>) -> Result<(), RoundError> {
        match op {
            SyncOp::Put { key, value } => {
                // R4 in its registry form (flock_core::regsync::PutGuard): only a pod
                // still wanted is registered.
                let guard = PutGuard::new();
                if !guard.send(self.still_wanted(&value.pod_key)) {
                    return Ok(());
                }
                // Tracked before the put is sent: if it times out and lands later, the
                // view shows a key the sync knows, and a pod gone by then gets it
                // deleted instead of leaving a ghost.
                if guard.track() {
                    lock(&self.sync.state)
                        .tracked
                        .insert(key.clone(), Instant::now());
                }
                let put = self.bounded("put", &key, self.registry.put(&value)).await;
                let rev = match put {
                    Ok(rev) => {
                        self.failpoint(|| "regsync/put".into());
                        rev
                    }
                    Err(e) => {
                        if guard.track() {
                            lock(&self.sync.state).unknown.insert(key.clone());
                        }
                        self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(e);
                    }
                };
                {
                    let mut st = lock(&self.sync.state);
                    st.unknown.remove(&key);
                    st.tracked.insert(key.clone(), Instant::now());
                }
                self.core().wrote(&key, rev);
                // R4's re-check: RemovePod leaves the table before it hands the pod's
                // keys over, so a pod gone now may have been withdrawn before this put
                // landed. Undo exactly this write.
                if guard.undo(self.still_wanted(&value.pod_key)) {
                    self.metrics.guard_undos.fetch_add(1, Ordering::Relaxed);
                    let undo = self.registry.delete_if_revision(&key, rev);
                    if self.bounded("undo put", &key, undo).await.is_ok() {
                        self.core().forget(&key);
                    }
                }
                Ok(())
            }
            SyncOp::Delete { key, revision } => {
                let deleted = match revision {
                    Some(rev) => {
                        let del = self.registry.delete_if_revision(&key, rev);
                        self.bounded("delete", &key, del).await
                    }
                    None => {
                        let del = self.registry.delete(&key);
                        self.bounded("delete", &key, del).await
                    }
                };
                match deleted {
                    Ok(_) => {
                        self.failpoint(|| "regsync/delete".into());
                        lock(&self.sync.state).unknown.remove(&key);
                        self.core().forget(&key);
                        Ok(())
                    }
                    Err(e) => {
                        self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Forgets tracked keys nobody wants that are gone from the view and were last
    /// touched more than [`LINGER`] ago.
    /// At most once per [`PRUNE_EVERY`]: it walks every tracked key and announced pod,
    /// and a key is forgotten only [`LINGER`] after its last write anyway.
    fn prune(&self, view: &crate::registry::View, desired: &BTreeMap<String, Endpoint>) {
        let now = Instant::now();
        let mut st = lock(&self.sync.state);
        if st
            .pruned
            .is_some_and(|at| now.duration_since(at) < PRUNE_EVERY)
        {
            return;
        }
        st.pruned = Some(now);
        let State {
            tracked, unknown, ..
        } = &mut *st;
        tracked.retain(|k, touched| {
            desired.contains_key(k)
                || view.endpoints.contains_key(k)
                || unknown.contains(k)
                || now.duration_since(*touched) < LINGER
        });
        // state, then core: the sync's lock order.
        let gone: Vec<PodKey> = {
            let core = self.core();
            st.announced
                .keys()
                .filter(|k| !core.is_live(k))
                .cloned()
                .collect()
        };
        for k in &gone {
            st.announced.remove(k);
        }
        if !gone.is_empty() {
            st.announced_gen += 1;
        }
    }

    /// Whether the view's changes since `since` (its [`View::seq`]) may leave the
    /// registry not matching the pods, so that a round must run. Every change is
    /// answered with a round when the changes are not known one by one (a backend
    /// without deltas, or more missed views than it keeps). Otherwise only a change of
    /// a key this agent writes, tracks or may have written counts, and not even that
    /// when the view now holds exactly what the last round wanted there under a
    /// revision this agent wrote (the echo of its own put). Before, every view change
    /// planned from every pod: each of the agent's own writes, and under churn every
    /// remote change, cost a round of O(pods).
    ///
    /// [`View::seq`]: crate::registry::View::seq
    fn view_change_needs_round(&self, view: &crate::registry::View, since: u64) -> bool {
        // No delta since `since`: only the revisions or the sync state moved (a backend
        // that counts its changes counts every change of an endpoint); the caller sees
        // reconnects.
        let Some(mut deltas) = view.deltas_since(since) else {
            return true;
        };
        let prefix = format!("{}/", self.cfg.node_name);
        // Lock order, here and everywhere the sync nests them: desired, state, core.
        let desired = lock(&self.sync.desired);
        let st = lock(&self.sync.state);
        let core = self.core();
        let own = core.own();
        let concerns = |key: &String| {
            let ours = key.starts_with(&prefix)
                || st.tracked.contains_key(key)
                || own.contains_key(key)
                || st.unknown.contains(key);
            if !ours {
                return false;
            }
            let echo = match (view.endpoints.get(key), desired.all.get(key)) {
                (Some(now), Some(want)) => {
                    **now == *want
                        && view.revision_of(key).as_ref() == own.get(key)
                        && !st.unknown.contains(key)
                }
                // Gone, and not wanted: nothing to write.
                (None, None) => !st.unknown.contains(key),
                _ => false,
            };
            !echo
        };
        deltas.any(|d| d.keys().any(concerns))
    }

    fn sync_ready(&self) -> bool {
        self.store_loaded.load(Ordering::Acquire)
            && self.kube.as_ref().is_none_or(|k| k.not_ready().is_none())
    }
}

/// The sync task: rounds on every wake, backoff while failing, at once on reconnect.
/// Holds the agent only weakly between rounds, so dropping the agent ends it (its
/// registry's view channel closes).
async fn run(agent: Weak<Agent>, mut view: watch::Receiver<Arc<crate::registry::View>>) {
    let (mut generation, mut synced, mut seq) = {
        let v = view.borrow_and_update();
        (v.generation, v.synced, v.seq)
    };
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let Some(a) = agent.upgrade() else { return };
        let sync = Arc::clone(&a.sync);
        let mut delay = None;
        let mut failing = false;
        if a.registry.read_only() {
            // Someone else writes this registry (EndpointSlices): nothing to sync.
            let requested = lock(&sync.state).requested;
            sync.status.send_modify(|s| {
                s.applied = requested;
                s.in_sync = true;
            });
        } else if !a.sync_ready() {
            // The table is not complete yet (store loading, reflectors listing): a
            // plan now would miss pods. Look again shortly.
            delay = Some(Duration::from_millis(200));
        } else {
            let seq = lock(&sync.state).requested;
            match a.sync_round().await {
                Ok(()) => {
                    backoff.reset();
                    sync.status.send_modify(|s| {
                        s.applied = s.applied.max(seq);
                        s.in_sync = true;
                        s.pending = 0;
                        s.last_error = None;
                        s.last_ok = Instant::now();
                    });
                }
                Err(RoundError(why)) => {
                    let d = backoff.next_delay(flock_clock::jitter());
                    a.metrics
                        .registry_sync_errors
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(registry = %a.registry.describe(), error = %why, retry_in = ?d, "registry sync: the registry does not reflect this node's pods yet; retrying");
                    // Every request made so far is answered "failed": waiting ADDs and
                    // DELs answer the runtime now instead of waiting out the bound.
                    let requested = lock(&sync.state).requested;
                    sync.status.send_modify(|s| {
                        s.failed = requested;
                        s.in_sync = false;
                        s.last_error = Some(why);
                    });
                    delay = Some(d);
                    failing = true;
                }
            }
        }
        drop(a);
        let sleep = tokio::time::sleep(delay.unwrap_or(Duration::from_secs(3600)));
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep, if delay.is_some() => break,
                // A request made during the round left a permit: the loop runs again.
                // While failing, a request does not cut the backoff short (a down
                // registry is not hammered by every ADD); its waiter is answered at
                // once from the status instead.
                _ = sync.wake.notified(), if !failing => break,
                changed = view.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let v = Arc::clone(&view.borrow_and_update());
                    let reconnected = v.generation != generation || (v.synced && !synced);
                    let since = std::mem::replace(&mut seq, v.seq);
                    generation = v.generation;
                    synced = v.synced;
                    if reconnected {
                        break;
                    }
                    // In sync, a change may show a late write of a tracked key; while
                    // failing, only a reconnect ends the backoff early.
                    if !failing {
                        let Some(a) = agent.upgrade() else { return };
                        if a.view_change_needs_round(&v, since) {
                            break;
                        }
                    }
                }
            }
        }
    }
}
