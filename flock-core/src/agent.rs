//! The node agent's state and every decision it makes about its pods, as a sans-IO
//! machine: events in, decisions and actions out, no I/O, no clock, no locks.
//!
//! The agent runtime (`flock-bird`) keeps one [`AgentCore`] behind one mutex and does
//! only I/O around it: it writes the pod store, calls the registry and the identity
//! provider, probes pods, and feeds what happened back in. Each method here is one
//! step of one of the agent's operations, taken while that mutex is held; between two
//! steps the runtime does I/O without it. So the agent's interleavings are the
//! interleavings of these steps, and `tests/loom_agent.rs` model-checks them with
//! the agent's own protocol (ADD, DEL, the liveness re-registration, the orphan GC, the
//! resubscription) run on this type, as `quinn-proto` does for a QUIC connection.
//!
//! What it holds:
//! * the live pod table (a [`JournaledMap`], so a reader finds the pods changed since
//!   its last look in O(changes)), each pod's [`Liveness`], and the pods whose network
//!   namespace was missing when last checked;
//! * the registry keys this agent process wrote, with the revision of its last write
//!   (what an undo or a withdrawal may delete, and at which revision);
//! * the orphan GC's hysteresis state and its last report;
//! * the per-pod turns ([`AgentCore::acquire`]): operations on one pod (ADD, DEL, a GC
//!   removal, kube mode's membership resync) run one at a time, in arrival order;
//!   operations on different pods proceed in parallel.
//!
//! # The races it rules out
//! * **R3** (startup load wipes a concurrent ADD): [`AgentCore::load`] merges, never
//!   replaces ([`crate::lifecycle::merge::merge_loaded`]).
//! * **R4** (ghost endpoint): a registration made outside the pod's turn (the liveness
//!   re-registration) is re-checked after it lands ([`AgentCore::registered`]); a pod
//!   gone by then gets it undone, and only at the revision this write produced, so a
//!   newer registration of a re-added pod survives the undo.
//! * **R6** (leaked subscription): [`AgentCore::subscribed`], the same re-check for an
//!   identity subscription made outside the pod's turn (the start-up resubscription).
//!   Its undo has no revision to be conditional on, so it runs in the pod's turn and
//!   only while the pod is still gone ([`AgentCore::may_unsubscribe`]): a DEL and a
//!   new ADD of the same pod may both have run since the re-check.
//! * **The orphan GC removing what a re-added pod owns**: the GC's endpoint deletes are
//!   conditional on the revision its plan saw ([`GcActions::endpoints`]), and a
//!   planned unsubscribe runs in the pod's turn only if the pod is still not live
//!   then ([`AgentCore::may_unsubscribe`]): the plan was made from a view taken
//!   before, and the pod may have been added again since.
//! * **An ADD its caller gave up on**: kept, the pod would be meshed while the runtime
//!   thinks the ADD failed and never sends its DEL ([`after_answer`]).
//! * **A repeated DEL answered as if the pod had come back** ([`AgentCore::withdrawal`]).
//!
//! Each fix keeps its old shape behind [`crate::reintroduced!`], so the test script can
//! show that the loom models, the property tests and the agent's end-to-end tests fail
//! without it.

use crate::authz::{PortService, Sourced, Target};
use crate::gc::{GcInputs, GcPolicy, GcReport, GcState, Owned};
use crate::journal::{JournaledMap, Snapshot};
use crate::lifecycle::liveness::{Health, Liveness, LivenessPolicy, Transition};
use crate::lifecycle::merge::{MergeReport, merge_loaded};
use crate::pod::PodKey;
// Shared data, not a synchronization point: std's Arc even under loom (as in
// `resources`), so the policy table works outside a loom model too.
use crate::time::MonoMs;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

/// Which operation holds or waits for a pod's turn (reported by
/// [`AgentCore::busy`], and the resync's turn is what the `r4-kube-resync` mutant
/// skips).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// A CNI ADD (and the undo of an ADD whose caller went away).
    Add,
    /// A CNI DEL.
    Remove,
    /// The orphan GC's removal of a pod or of its leaked subscription.
    Gc,
    /// Kube mode's resync of the pod's Service memberships.
    Resync,
    /// The undo of a resubscription that lost its race with a DEL.
    Undo,
}

/// A waiter's place in a pod's queue ([`AgentCore::acquire`], [`AgentCore::cancel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// The answer of [`AgentCore::acquire`].
#[derive(Debug, PartialEq, Eq)]
pub enum Acquire {
    /// The turn is the caller's now; it must [`release`](AgentCore::release) it.
    Now,
    /// Another operation holds the turn: the caller's waiter is handed back by the
    /// [`release`](AgentCore::release) that passes the turn on to it. A caller that
    /// stops waiting [`cancel`](AgentCore::cancel)s the ticket.
    Queued(Ticket),
}

/// One pod's turn: who holds it and who waits, in arrival order.
#[derive(Debug)]
struct Turn<W> {
    holder: OpKind,
    waiting: VecDeque<(Ticket, OpKind, W)>,
}

/// Where a registration or subscription made outside the pod's turn stands after
/// its re-check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guard {
    /// The pod is still live: keep it.
    Keep,
    /// The pod left while the write was in flight, and its teardown may have run
    /// before the write landed: undo it.
    Undo(Undo),
}

/// An undo the runtime performs after [`Guard::Undo`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Undo {
    /// The registry key, for a registration (`None` for a subscription).
    pub key: Option<String>,
    /// Delete only at this revision (the one the undone write produced): a newer
    /// registration of the same key, by an ADD of the pod that came back meanwhile,
    /// must survive. `None` deletes whatever is there (only the
    /// `undo-unconditional` mutant).
    pub revision: Option<u64>,
}

/// Who made a registration outside the pod's turn (each has its own mutant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// The liveness loop's re-registration with the pod's new health.
    Liveness,
    /// Kube mode's membership resync.
    KubeResync,
}

/// What a RemovePod hands to the registry sync ([`AgentCore::withdrawal`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withdrawal {
    /// The pod's registry keys: those the view shows for it and those this agent wrote.
    pub keys: Vec<String>,
    /// Whether those keys make the pod count as known to the DEL. Never: keys still
    /// awaiting their withdrawal are not the pod (only the `del-counts-pending-keys`
    /// mutant counts them).
    pub counts_as_known: bool,
}

/// What [`AgentCore::stored`] changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored<R> {
    /// The record the new one replaced (a repeated ADD).
    pub replaced: Option<R>,
    /// The pod's health went back to undecided: what it registers may change even if
    /// its record compares equal.
    pub health_reset: bool,
}

/// What the GC sees of one endpoint this node owns in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenEndpoint {
    /// Its registry key.
    pub key: String,
    /// The pod it belongs to.
    pub pod: PodKey,
    /// The revision the view shows (its last write).
    pub revision: u64,
}

/// One sweep's inputs from outside the core (the pods come from its own table).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcSweep {
    /// The runtime's valid attachments, when the sweep was triggered by a CNI GC.
    pub valid_attachments: Option<Vec<PodKey>>,
    /// Endpoints this node owns in the registry (read before the table: see
    /// [`crate::gc`]'s rules).
    pub endpoints: Vec<SeenEndpoint>,
    /// Pods with an identity subscription.
    pub subscriptions: Vec<PodKey>,
}

/// One orphan endpoint delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointDelete {
    /// The registry key.
    pub key: String,
    /// Delete only at this revision, the one the plan saw. `None`: whatever is there
    /// (only the `gc-unconditional` mutant).
    pub revision: Option<u64>,
}

/// What one sweep removes, in this order: pods (each in its turn, by a RemovePod),
/// endpoints (conditional deletes), subscriptions (each in the pod's turn, after
/// [`AgentCore::may_unsubscribe`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcActions {
    /// Stored pods the runtime no longer knows.
    pub pods: Vec<PodKey>,
    /// Orphan endpoints.
    pub endpoints: Vec<EndpointDelete>,
    /// Pods whose subscription leaked.
    pub unsubscribe: Vec<PodKey>,
    /// The planner's report (what was ripe, what the breaker held back).
    pub report: GcReport,
}

/// The agent's state and decisions (see the module docs). `R` is the pod record the
/// runtime stores (shared, so cheap to clone); `W` is how the runtime wakes an
/// operation waiting for a pod's turn.
#[derive(Debug)]
pub struct AgentCore<R: Clone, W> {
    pods: JournaledMap<PodKey, R>,
    liveness: BTreeMap<PodKey, Liveness>,
    policy: LivenessPolicy,
    own: BTreeMap<String, u64>,
    netns_missing: BTreeSet<PodKey>,
    gc: GcState,
    last_gc: Option<GcReport>,
    turns: BTreeMap<PodKey, Turn<W>>,
    tickets: u64,
    /// The authorization policies in force, by what each governs (journaled: the
    /// publish finds the targets changed since its last pass in O(changes)).
    policies: JournaledMap<Target, Arc<Sourced>>,
    /// The Service ports each live pod's ports serve, where they come from outside the
    /// record (kube mode's memberships; journaled like the policies: a membership
    /// change re-derives that pod's policies and no other pod's).
    pod_services: JournaledMap<PodKey, Arc<Vec<PortService>>>,
    /// The traffic-policy routes in force, by source key (a file name, an object's
    /// `<namespace>/<name>`), refusals included (the status names them).
    routes: JournaledMap<String, Arc<crate::route::SourcedRoute>>,
}

impl<R: Clone, W> AgentCore<R, W> {
    /// An empty agent whose pods are probed with `policy`.
    pub fn new(policy: LivenessPolicy) -> Self {
        Self {
            pods: JournaledMap::new(),
            liveness: BTreeMap::new(),
            policy,
            own: BTreeMap::new(),
            netns_missing: BTreeSet::new(),
            gc: GcState::default(),
            last_gc: None,
            turns: BTreeMap::new(),
            tickets: 0,
            policies: JournaledMap::new(),
            pod_services: JournaledMap::new(),
            routes: JournaledMap::new(),
        }
    }

    // ------------------------------------------------------------------ reads

    /// The pod's record, if it is live.
    pub fn pod(&self, key: &PodKey) -> Option<&R> {
        self.pods.get(key)
    }

    /// Whether the pod is live: in the table, which RemovePod leaves first.
    pub fn is_live(&self, key: &PodKey) -> bool {
        self.pods.contains_key(key)
    }

    /// How many pods are live.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// The live pods, sharing the table's nodes (O(1)), with the keys of their recent
    /// changes.
    pub fn pods(&self) -> Snapshot<PodKey, R> {
        self.pods.snapshot()
    }

    /// Counts the table's changes: equal versions, equal tables.
    pub fn pods_version(&self) -> u64 {
        self.pods.version()
    }

    /// Each live pod's health decision.
    pub fn healths(&self) -> BTreeMap<PodKey, Health> {
        self.liveness
            .iter()
            .map(|(k, l)| (k.clone(), l.health()))
            .collect()
    }

    /// The health a pod's endpoints are registered with: unhealthy once its probes
    /// say so, else serving (a new pod is not kept out of the mesh until its first
    /// probes pass).
    pub fn registered_health(&self, key: &PodKey) -> Health {
        match self.liveness.get(key).map(Liveness::health) {
            Some(Health::Unhealthy) => Health::Unhealthy,
            _ => Health::Healthy,
        }
    }

    /// The pods whose network namespace was missing when last checked: not served
    /// (Envoy refuses a whole listener update over one missing netns path).
    pub fn netns_missing(&self) -> &BTreeSet<PodKey> {
        &self.netns_missing
    }

    /// The registry keys this agent process wrote, with the revision of its last write.
    pub fn own(&self) -> &BTreeMap<String, u64> {
        &self.own
    }

    /// The keys of `pod` among [`own`](Self::own), with their revisions.
    pub fn own_of(&self, pod: &PodKey) -> BTreeMap<String, u64> {
        self.own
            .iter()
            .filter(|(k, _)| key_owner(k).as_ref() == Some(pod))
            .map(|(k, rev)| (k.clone(), *rev))
            .collect()
    }

    /// The authorization policies in force, with the targets of their recent changes.
    pub fn policies(&self) -> Snapshot<Target, Arc<Sourced>> {
        self.policies.snapshot()
    }

    /// Sets (`Some`) or removes (`None`) the policy of `target`, as its source now
    /// says. Returns whether what is in force changed: an equal policy read again
    /// (a file rewritten with the same content, a resync) changes nothing, so nothing
    /// is re-translated.
    pub fn set_policy(&mut self, target: Target, policy: Option<Sourced>) -> bool {
        match policy {
            Some(p) => {
                if self.policies.get(&target).is_some_and(|old| **old == p) {
                    return false;
                }
                self.policies.insert(target, Arc::new(p));
                true
            }
            None => self.policies.remove(&target).is_some(),
        }
    }

    /// The traffic-policy routes in force, by source key, with the keys of their
    /// recent changes.
    pub fn routes(&self) -> Snapshot<String, Arc<crate::route::SourcedRoute>> {
        self.routes.snapshot()
    }

    /// Sets (`Some`) or removes (`None`) the route its source names `key`. Returns
    /// whether what is in force changed (an equal route read again changes nothing).
    pub fn set_route(&mut self, key: String, route: Option<crate::route::SourcedRoute>) -> bool {
        match route {
            Some(r) => {
                if self.routes.get(&key).is_some_and(|old| **old == r) {
                    return false;
                }
                self.routes.insert(key, Arc::new(r));
                true
            }
            None => self.routes.remove(&key).is_some(),
        }
    }

    /// The Service ports each pod's ports serve (see
    /// [`set_pod_services`](Self::set_pod_services)), with the pods of recent changes.
    pub fn pod_services(&self) -> Snapshot<PodKey, Arc<Vec<PortService>>> {
        self.pod_services.snapshot()
    }

    /// Sets the Service ports `pod`'s ports serve (sorted and deduplicated here; empty
    /// removes the entry). Returns whether that changed: the same memberships read
    /// again re-derive nothing. [`removed`](Self::removed) forgets the pod's.
    pub fn set_pod_services(&mut self, pod: &PodKey, mut services: Vec<PortService>) -> bool {
        services.sort();
        services.dedup();
        if services.is_empty() {
            return self.pod_services.remove(pod).is_some();
        }
        if self
            .pod_services
            .get(pod)
            .is_some_and(|old| **old == services)
        {
            return false;
        }
        self.pod_services.insert(pod.clone(), Arc::new(services));
        true
    }

    /// The last sweep's report.
    pub fn last_gc(&self) -> Option<&GcReport> {
        self.last_gc.as_ref()
    }

    /// Which pods have an operation running, and how many wait behind it.
    pub fn busy(&self) -> BTreeMap<PodKey, (OpKind, usize)> {
        self.turns
            .iter()
            .map(|(k, t)| (k.clone(), (t.holder, t.waiting.len())))
            .collect()
    }

    // ------------------------------------------------------------------ turns

    /// Asks for `pod`'s turn for an operation of `kind`. Without a holder the turn is
    /// the caller's at once; else `waiter` is queued and handed back, in arrival
    /// order, by the [`release`](Self::release) that passes the turn to it.
    pub fn acquire(&mut self, pod: &PodKey, kind: OpKind, waiter: W) -> Acquire {
        // The resync outside the pod's turn: it may then put a membership while a DEL
        // of the pod tears it down (its re-check is the other half of the mutant).
        if kind == OpKind::Resync && crate::reintroduced!("r4-kube-resync") {
            return Acquire::Now;
        }
        match self.turns.get_mut(pod) {
            None => {
                self.turns.insert(
                    pod.clone(),
                    Turn {
                        holder: kind,
                        waiting: VecDeque::new(),
                    },
                );
                Acquire::Now
            }
            Some(turn) => {
                self.tickets += 1;
                let ticket = Ticket(self.tickets);
                turn.waiting.push_back((ticket, kind, waiter));
                Acquire::Queued(ticket)
            }
        }
    }

    /// Ends the holder's turn on `pod` (an operation of `kind`). Returns the waiter the
    /// turn passes to, which the runtime must wake; if that waiter is gone, the
    /// runtime releases on its behalf. `None`: nobody waits, the pod is free.
    pub fn release(&mut self, pod: &PodKey, kind: OpKind) -> Option<W> {
        if kind == OpKind::Resync && crate::reintroduced!("r4-kube-resync") {
            return None;
        }
        let turn = self.turns.get_mut(pod)?;
        match turn.waiting.pop_front() {
            Some((_, next, waiter)) => {
                turn.holder = next;
                Some(waiter)
            }
            None => {
                self.turns.remove(pod);
                None
            }
        }
    }

    /// Withdraws a queued `ticket` whose operation stopped waiting. Returns `true` if
    /// it was still queued (nothing else to do); `false` if the turn had already been
    /// passed to it, so the caller holds it now and must
    /// [`release`](Self::release) it.
    pub fn cancel(&mut self, pod: &PodKey, ticket: Ticket) -> bool {
        let Some(turn) = self.turns.get_mut(pod) else {
            return false;
        };
        let before = turn.waiting.len();
        turn.waiting.retain(|(t, _, _)| *t != ticket);
        turn.waiting.len() != before
    }

    // ------------------------------------------------------------------ ADD / DEL

    /// AddPod's store write is done (or, for a pod neither captured nor held, under
    /// way): the pod is live from now on, with its liveness tracked from `now`.
    pub fn stored(&mut self, pod: PodKey, record: R, now: MonoMs) -> Stored<R> {
        let replaced = self.pods.insert(pod.clone(), record);
        let health_reset = self
            .liveness
            .insert(pod, Liveness::new(now, self.policy))
            .is_some();
        Stored {
            replaced,
            health_reset,
        }
    }

    /// Records whether `pod`'s network namespace exists; returns whether that changed.
    pub fn note_netns(&mut self, pod: &PodKey, exists: bool) -> bool {
        if exists {
            self.netns_missing.remove(pod)
        } else {
            self.netns_missing.insert(pod.clone())
        }
    }

    /// RemovePod's store delete is done: the pod leaves the table (from here no
    /// background loop sees it, and every re-check after a write in flight fails).
    /// Returns its record.
    pub fn removed(&mut self, pod: &PodKey) -> Option<R> {
        self.liveness.remove(pod);
        self.netns_missing.remove(pod);
        self.pod_services.remove(pod);
        self.pods.remove(pod)
    }

    /// The registry keys RemovePod hands to the registry sync: `in_view`, the keys the
    /// registry view shows for the pod on this node, and those this agent wrote for it.
    pub fn withdrawal(
        &self,
        pod: &PodKey,
        in_view: impl IntoIterator<Item = String>,
    ) -> Withdrawal {
        let mut keys: BTreeSet<String> = in_view.into_iter().collect();
        keys.extend(self.own_of(pod).into_keys());
        Withdrawal {
            counts_as_known: crate::reintroduced!("del-counts-pending-keys") && !keys.is_empty(),
            keys: keys.into_iter().collect(),
        }
    }

    // ------------------------------------------------------------------ guards

    /// A registration of `pod`'s `key` made outside the pod's turn landed at
    /// `revision`: the R4 re-check. Kept (and recorded as this agent's write) while
    /// the pod is live; otherwise to be undone at that revision.
    pub fn registered(&mut self, pod: &PodKey, key: &str, revision: u64, by: Writer) -> Guard {
        let unguarded = match by {
            Writer::Liveness => crate::reintroduced!("r4-agent"),
            Writer::KubeResync => crate::reintroduced!("r4-kube-resync"),
        };
        if unguarded || self.is_live(pod) {
            self.own.insert(key.to_string(), revision);
            return Guard::Keep;
        }
        Guard::Undo(Undo {
            key: Some(key.to_string()),
            revision: (!crate::reintroduced!("undo-unconditional")).then_some(revision),
        })
    }

    /// An identity subscription of `pod` made outside its turn is in place: the R6
    /// re-check. Kept while the pod is live; otherwise to be withdrawn, in the pod's
    /// turn and after [`may_unsubscribe`](Self::may_unsubscribe) (a DEL and a new ADD
    /// of the pod may both have run since).
    pub fn subscribed(&self, pod: &PodKey) -> Guard {
        if crate::reintroduced!("r6-agent") || self.is_live(pod) {
            return Guard::Keep;
        }
        Guard::Undo(Undo {
            key: None,
            revision: None,
        })
    }

    /// The registry now holds `key` at `revision` by this agent's write (an ADD's or
    /// the registry sync's).
    pub fn wrote(&mut self, key: &str, revision: u64) {
        self.own.insert(key.to_string(), revision);
    }

    /// `key` is no longer this agent's write: deleted, or rewritten by someone else.
    pub fn forget(&mut self, key: &str) {
        self.own.remove(key);
    }

    // ------------------------------------------------------------------ load

    /// Start-up: merges the pods read from the store into the live table (R3: adds
    /// absent keys, keeps the newer ones a concurrent ADD put there, removes nothing),
    /// and tracks the added pods' liveness from `now`.
    pub fn load(
        &mut self,
        loaded: impl IntoIterator<Item = (PodKey, R)>,
        now: MonoMs,
    ) -> MergeReport<PodKey> {
        // The merge rule runs on a plain copy, and the table then becomes that copy
        // key by key, so its journal names each change (the `r3` mutant empties the
        // copy, and the table must lose its pods then too).
        let mut live: BTreeMap<PodKey, R> = (*self.pods).clone().into_iter().collect();
        let report = merge_loaded(&mut live, loaded);
        let gone: Vec<PodKey> = self
            .pods
            .keys()
            .filter(|k| !live.contains_key(*k))
            .cloned()
            .collect();
        for key in &gone {
            self.removed(key);
        }
        for key in &report.added {
            if let Some(record) = live.remove(key) {
                self.pods.insert(key.clone(), record);
                self.liveness
                    .entry(key.clone())
                    .or_insert_with(|| Liveness::new(now, self.policy));
            }
        }
        report
    }

    // ------------------------------------------------------------------ liveness

    /// The pods due for a probe at `now`.
    pub fn due(&self, now: MonoMs) -> Vec<R> {
        self.liveness
            .iter()
            .filter(|(_, l)| l.is_due(now))
            .filter_map(|(k, _)| self.pods.get(k).cloned())
            .collect()
    }

    /// A probe of `pod` at `now` answered `ok`. Returns the health change, if any: the
    /// runtime then re-registers the pod ([`registered`](Self::registered) guards
    /// that). A result for a pod removed meanwhile is dropped.
    pub fn probed(&mut self, pod: &PodKey, now: MonoMs, ok: bool) -> Option<Transition> {
        self.liveness.get_mut(pod)?.observe(now, ok)
    }

    /// When the next probe is due (the liveness loop's deadline); `None` without pods.
    pub fn next_probe(&self) -> Option<MonoMs> {
        self.liveness.values().map(Liveness::next_probe).min()
    }

    // ------------------------------------------------------------------ GC

    /// Plans one orphan-GC sweep over `sweep` and the live table
    /// ([`crate::gc::plan`]: hysteresis, breaker) and keeps its state and report.
    pub fn gc_plan(&mut self, sweep: GcSweep, policy: &GcPolicy) -> GcActions {
        let revisions: BTreeMap<String, u64> = sweep
            .endpoints
            .iter()
            .map(|e| (e.key.clone(), e.revision))
            .collect();
        let by_id: BTreeMap<String, PodKey> = sweep
            .subscriptions
            .iter()
            .map(|k| (k.to_string(), k.clone()))
            .collect();
        let inputs = GcInputs {
            pods: self.pods.keys().cloned().collect(),
            valid_attachments: sweep.valid_attachments,
            endpoints: sweep
                .endpoints
                .into_iter()
                .map(|e| Owned::new(e.key, e.pod))
                .collect(),
            subscriptions: sweep
                .subscriptions
                .into_iter()
                .map(|k| Owned::new(k.to_string(), k))
                .collect(),
            ..GcInputs::default()
        };
        let (plan, next) = crate::gc::plan(&inputs, &self.gc, policy);
        self.gc = next;
        self.last_gc = Some(plan.report.clone());
        let unconditional = crate::reintroduced!("gc-unconditional");
        GcActions {
            pods: plan.store,
            endpoints: plan
                .endpoints
                .into_iter()
                .map(|key| EndpointDelete {
                    revision: if unconditional {
                        None
                    } else {
                        revisions.get(&key).copied()
                    },
                    key,
                })
                .collect(),
            unsubscribe: plan
                .subscriptions
                .iter()
                .filter_map(|id| by_id.get(id).cloned())
                .collect(),
            report: plan.report,
        }
    }

    /// Whether `pod`'s identity subscription may be withdrawn now, in the pod's
    /// turn: only if the pod is still not live. Both withdrawals decided outside the
    /// pod's turn ask this: the GC's (its plan saw the pod gone) and the undo of a
    /// resubscription whose re-check saw it gone ([`subscribed`](Self::subscribed)).
    /// An ADD of the pod since then made it live again and subscribed it in its own
    /// turn: withdrawing would leave a meshed pod without its certificate.
    pub fn may_unsubscribe(&self, pod: &PodKey, by: Unsubscriber) -> bool {
        let unchecked = match by {
            Unsubscriber::Gc => crate::reintroduced!("gc-unsubscribe-unconditional"),
            Unsubscriber::Resubscription => false,
        };
        unchecked || !self.is_live(pod)
    }
}

/// Who withdraws a subscription outside the pod's own DEL
/// ([`AgentCore::may_unsubscribe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsubscriber {
    /// The orphan GC.
    Gc,
    /// The undo of a resubscription that lost its race with a DEL.
    Resubscription,
}

/// After an ADD's answer: whether the ADD must be undone. An ADD that succeeded but
/// whose caller was gone when it answered (the plugin timed out or was killed) failed
/// as far as the runtime knows, and the runtime never sends a DEL for a pod it thinks
/// was never added: kept, the pod would stay meshed and registered for good.
pub fn after_answer(delivered: bool, succeeded: bool) -> bool {
    !delivered && succeeded && !crate::reintroduced!("abandoned-add-kept")
}

/// The pod key encoded in a registry key (`…/<container_id>/<ifname>/<port>`).
pub fn key_owner(key: &str) -> Option<PodKey> {
    let mut parts = key.rsplit('/');
    let _port = parts.next()?;
    let ifname = parts.next()?;
    let container = parts.next()?;
    Some(PodKey::new(container, ifname))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    type Core = AgentCore<&'static str, u32>;

    fn pod(n: &str) -> PodKey {
        PodKey::new(n, "eth0")
    }

    fn key(p: &str) -> String {
        format!("node-a/ns/svc/{p}/eth0/8080")
    }

    #[test]
    fn turns_pass_in_arrival_order_and_free_the_pod_when_nobody_waits() {
        let mut c = Core::new(LivenessPolicy::default());
        let p = pod("a");
        assert_eq!(c.acquire(&p, OpKind::Add, 1), Acquire::Now);
        let Acquire::Queued(_) = c.acquire(&p, OpKind::Remove, 2) else {
            panic!("a second operation on a held pod must wait")
        };
        let Acquire::Queued(_) = c.acquire(&p, OpKind::Gc, 3) else {
            panic!("a third operation on a held pod must wait")
        };
        assert_eq!(
            c.acquire(&pod("b"), OpKind::Add, 9),
            Acquire::Now,
            "other pods proceed"
        );
        assert_eq!(c.busy()[&p], (OpKind::Add, 2));
        assert_eq!(c.release(&p, OpKind::Add), Some(2));
        assert_eq!(c.busy()[&p], (OpKind::Remove, 1));
        assert_eq!(c.release(&p, OpKind::Remove), Some(3));
        assert_eq!(c.release(&p, OpKind::Gc), None);
        assert!(
            !c.busy().contains_key(&p),
            "a free pod leaves no state behind"
        );
    }

    #[test]
    fn a_cancelled_waiter_is_skipped_and_a_late_cancel_owns_the_turn() {
        let mut c = Core::new(LivenessPolicy::default());
        let p = pod("a");
        assert_eq!(c.acquire(&p, OpKind::Add, 1), Acquire::Now);
        let Acquire::Queued(t2) = c.acquire(&p, OpKind::Remove, 2) else {
            panic!("must wait")
        };
        let Acquire::Queued(t3) = c.acquire(&p, OpKind::Remove, 3) else {
            panic!("must wait")
        };
        assert!(c.cancel(&p, t2), "still queued: withdrawn");
        assert_eq!(c.release(&p, OpKind::Add), Some(3));
        // The turn was passed to 3 before it cancelled: it holds the turn.
        assert!(!c.cancel(&p, t3));
        assert_eq!(c.release(&p, OpKind::Remove), None);
        assert!(c.busy().is_empty());
    }

    #[test]
    fn a_registration_that_lands_after_the_pod_left_is_undone_at_its_own_revision() {
        let mut c = Core::new(LivenessPolicy::default());
        let p = pod("a");
        c.stored(p.clone(), "rec", MonoMs(0));
        assert_eq!(
            c.registered(&p, &key("a"), 7, Writer::Liveness),
            Guard::Keep
        );
        assert_eq!(c.own().get(&key("a")), Some(&7));
        c.removed(&p);
        assert_eq!(
            c.registered(&p, &key("a"), 8, Writer::Liveness),
            Guard::Undo(Undo {
                key: Some(key("a")),
                revision: Some(8)
            })
        );
        assert_eq!(
            c.own().get(&key("a")),
            Some(&7),
            "an undone write is not recorded"
        );
        assert_eq!(
            c.subscribed(&p),
            Guard::Undo(Undo {
                key: None,
                revision: None
            })
        );
    }

    #[test]
    fn a_withdrawal_names_view_and_own_keys_and_never_counts_them_as_the_pod() {
        let mut c = Core::new(LivenessPolicy::default());
        let p = pod("a");
        c.wrote(&key("a"), 3);
        c.wrote(&key("b"), 4);
        let w = c.withdrawal(&p, ["node-a/ns/svc/a/eth0/9090".to_string()]);
        assert_eq!(
            w.keys,
            vec!["node-a/ns/svc/a/eth0/8080", "node-a/ns/svc/a/eth0/9090"]
        );
        assert!(!w.counts_as_known);
    }

    #[test]
    fn load_keeps_a_concurrent_add_and_tracks_only_what_it_added() {
        let mut c = Core::new(LivenessPolicy::default());
        c.stored(pod("b"), "fresh", MonoMs(5));
        let r = c.load([(pod("a"), "stored-a"), (pod("b"), "stored-b")], MonoMs(9));
        assert_eq!(r.added, vec![pod("a")]);
        assert_eq!(r.kept, vec![pod("b")]);
        assert_eq!(c.pod(&pod("b")), Some(&"fresh"));
        assert_eq!(c.due(MonoMs(9)).len(), 2);
        assert_eq!(c.next_probe(), Some(MonoMs(5)));
    }

    #[test]
    fn gc_deletes_at_the_seen_revision_and_unsubscribes_only_pods_still_gone() {
        let mut c = Core::new(LivenessPolicy::default());
        let policy = GcPolicy {
            confirm_sweeps: 1,
            max_remove_percent: 100,
            ..GcPolicy::default()
        };
        let gone = pod("gone");
        let actions = c.gc_plan(
            GcSweep {
                endpoints: vec![SeenEndpoint {
                    key: key("gone"),
                    pod: gone.clone(),
                    revision: 11,
                }],
                subscriptions: vec![gone.clone()],
                ..GcSweep::default()
            },
            &policy,
        );
        assert_eq!(
            actions.endpoints,
            vec![EndpointDelete {
                key: key("gone"),
                revision: Some(11)
            }]
        );
        assert_eq!(actions.unsubscribe, vec![gone.clone()]);
        assert!(c.last_gc().is_some());
        assert!(c.may_unsubscribe(&gone, Unsubscriber::Gc));
        // The pod is added again before the GC gets its turn.
        c.stored(gone.clone(), "back", MonoMs(1));
        assert!(!c.may_unsubscribe(&gone, Unsubscriber::Gc));
        assert!(!c.may_unsubscribe(&gone, Unsubscriber::Resubscription));
    }

    #[test]
    fn only_a_delivered_or_failed_add_is_kept() {
        assert!(after_answer(false, true));
        assert!(!after_answer(true, true));
        assert!(!after_answer(false, false));
    }

    #[test]
    fn probes_decide_health_and_the_registered_health_serves_until_unhealthy() {
        let policy = LivenessPolicy {
            warmup_ms: 0,
            unhealthy_threshold: 1,
            ..LivenessPolicy::default()
        };
        let mut c = Core::new(policy);
        let p = pod("a");
        c.stored(p.clone(), "rec", MonoMs(0));
        assert_eq!(c.registered_health(&p), Health::Healthy);
        let t = c.probed(&p, MonoMs(1), false).expect("a transition");
        assert_eq!(t.to, Health::Unhealthy);
        assert_eq!(c.registered_health(&p), Health::Unhealthy);
        c.removed(&p);
        assert_eq!(
            c.probed(&p, MonoMs(2), true),
            None,
            "a removed pod's result is dropped"
        );
    }

    #[test]
    fn key_owner_reads_the_pod_from_a_registry_key() {
        assert_eq!(key_owner(&key("abc")), Some(pod("abc")));
        assert_eq!(key_owner("x"), None);
    }
}
