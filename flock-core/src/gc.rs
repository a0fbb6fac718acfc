//! The orphan-GC planner: which stored pods, registry endpoints, identity
//! subscriptions, netns pins and xDS entries have outlived their pod, and which of
//! them may be removed on this sweep.
//!
//! The agent gathers the inputs (a [`GcInputs`]), calls [`plan`] with the state the
//! previous sweep returned, executes the returned [`OrphanPlan`] against the real pod
//! store, registry, identity provider and xDS cache, and keeps the returned
//! [`GcState`] for the next sweep. The planner is pure: no I/O, no clock, no
//! randomness, sorted output.
//!
//! # Why a sweep exists at all
//!
//! The lifecycle ordering ([`crate::lifecycle`]) and the register-then-recheck guard
//! make races R4 and R6 (docs/races.md) impossible *while the agent runs*: R4's
//! ghost endpoint (liveness re-registers a pod that `RemovePod` is tearing down) and
//! R6's leaked subscription (the resubscriber subscribes a pod that was just
//! removed). What they cannot cover is the agent crashing between two steps, a CNI
//! `DEL` that never arrived, or an owner-less entry left by an older agent. The
//! sweep is the level-triggered repair for all of those: anything whose owner is not
//! a live pod is eventually removed.
//!
//! # Rules
//!
//! * **Live pod.** A pod is live when it is in the store and, if the runtime sent a
//!   CNI `GC` with its valid attachments, also in those. Nothing owned by a live pod
//!   is ever removed. A subscription shared by several pods (one SPIFFE ID) is an
//!   orphan only when *none* of its owners is live.
//! * **Store entries** are judged only against the runtime's valid attachments. A
//!   sweep without them carries the store counts over unchanged: "no evidence" is
//!   neither "orphan" nor "not an orphan".
//! * **Hysteresis.** An item is removed only once it was an orphan on
//!   [`GcPolicy::confirm_sweeps`] consecutive sweeps; one sweep on which it is not an
//!   orphan drops its count. The inputs of one sweep are several separate reads
//!   (store, registry, identity, xDS) and are not a consistent cut, so a single
//!   sweep can see an in-flight `AddPod`'s endpoint before its store record, or
//!   race a `RemovePod`; requiring the same verdict on several sweeps makes those
//!   transient views harmless. The agent should also read the owned resources
//!   *first* and the store *last*: `AddPod` writes the store first, so anything an
//!   `AddPod` registered before the registry read has its store record visible by
//!   the store read.
//! * **Breaker.** Per kind, at most [`GcPolicy::max_remove_percent`] of that kind's
//!   population (but always at least [`GcPolicy::always_allowed`] items, so a
//!   one-pod node can still collect) may be removed in one pass. If more orphans are
//!   ripe, *none* of that kind is removed and the report carries a [`Tripped`]: a
//!   store emptied by a bug, or a runtime sending an empty attachment list, must not
//!   wipe the node's registry endpoints. Held-back orphans keep their counts, so
//!   once an operator confirms (for example by running one pass with
//!   `max_remove_percent = 100`), they go immediately. A trip is sticky by design:
//!   it needs a human or a shrinking orphan set, never just time.
//! * **Bounded state.** [`GcState`] holds a count only for items that are orphans
//!   on the current sweep; everything that disappeared or became owned is dropped.
//! * **Determinism.** Every list in the plan and report is sorted.
//!
//! # Example
//!
//! ```
//! use flock_core::gc::{plan, GcInputs, GcPolicy, GcState, Owned, PodKey};
//!
//! let live = PodKey::new("sandbox-a", "eth0");
//! let gone = PodKey::new("sandbox-b", "eth0");
//! let inputs = GcInputs {
//!     pods: vec![live.clone()],
//!     endpoints: vec![
//!         Owned::new("10.0.0.5:8080", live.clone()),
//!         Owned::new("10.0.0.6:8080", gone.clone()),
//!     ],
//!     ..GcInputs::default()
//! };
//! let policy = GcPolicy { confirm_sweeps: 2, ..GcPolicy::default() };
//!
//! // First sweep: the orphan is seen once, nothing is removed yet.
//! let (first, state) = plan(&inputs, &GcState::default(), &policy);
//! assert!(first.is_empty());
//! assert_eq!(state.len(), 1);
//!
//! // Second consecutive sweep: removed. The live pod's endpoint never is.
//! let (second, _state) = plan(&inputs, &state, &policy);
//! assert_eq!(second.endpoints, vec!["10.0.0.6:8080".to_string()]);
//! assert!(second.report.tripped().next().is_none());
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

/// The pod attachment every input is keyed by (defined with the pod validator).
pub use crate::pod::PodKey;

/// A resource the node owns on behalf of one or more pods.
///
/// Registry endpoints, netns pins and xDS entries have one owner; an identity
/// subscription is shared by every pod with the same SPIFFE ID. If the same `id`
/// appears several times in one input list, its owners are united.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Owned {
    /// The resource's identity in its own system (endpoint key, subscription key,
    /// pin path, xDS resource name).
    pub id: String,
    /// The pods this resource belongs to. Empty means it belongs to nobody (an
    /// orphan).
    pub owners: BTreeSet<PodKey>,
}

impl Owned {
    /// A resource owned by exactly one pod.
    pub fn new(id: impl Into<String>, owner: PodKey) -> Self {
        Self {
            id: id.into(),
            owners: BTreeSet::from([owner]),
        }
    }

    /// A resource shared by several pods (for example one SPIFFE ID's subscription).
    pub fn shared(id: impl Into<String>, owners: impl IntoIterator<Item = PodKey>) -> Self {
        Self {
            id: id.into(),
            owners: owners.into_iter().collect(),
        }
    }
}

/// The kinds of things the planner collects, in the order they are reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// A pod record in the agent's durable pod store.
    StoreEntry,
    /// An endpoint this node registered in the shared service registry.
    Endpoint,
    /// An identity (SVID) subscription.
    Subscription,
    /// A pinned network namespace.
    NetnsPin,
    /// A per-pod xDS resource in the snapshot cache.
    XdsResource,
}

impl Kind {
    /// Every kind, in report order.
    pub const ALL: [Kind; 5] = [
        Kind::StoreEntry,
        Kind::Endpoint,
        Kind::Subscription,
        Kind::NetnsPin,
        Kind::XdsResource,
    ];
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::StoreEntry => "store-entry",
            Kind::Endpoint => "endpoint",
            Kind::Subscription => "subscription",
            Kind::NetnsPin => "netns-pin",
            Kind::XdsResource => "xds-resource",
        })
    }
}

/// Tuning for [`plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcPolicy {
    /// `K`: consecutive sweeps an item must be an orphan on before it is removed.
    /// `0` is treated as `1`. Default `3`: with a 60 s sweep period an orphan
    /// lives about three minutes, long enough for every in-flight `AddPod` or
    /// `RemovePod` to finish and the sweep inputs to agree.
    pub confirm_sweeps: u32,
    /// The breaker: the largest share of one kind's population, in percent, that one
    /// pass may remove. Values above 100 are treated as 100. Default `25`.
    pub max_remove_percent: u32,
    /// Removals that are always allowed per kind regardless of the percentage, so a
    /// node with one or two pods can still collect. Default `3`.
    pub always_allowed: usize,
}

impl Default for GcPolicy {
    fn default() -> Self {
        Self {
            confirm_sweeps: 3,
            max_remove_percent: 25,
            always_allowed: 3,
        }
    }
}

impl GcPolicy {
    /// The most items of a kind with `population` members one pass may remove:
    /// `max(always_allowed, floor(population * max_remove_percent / 100))`.
    pub fn limit(&self, population: usize) -> usize {
        let percent = self.max_remove_percent.min(100) as usize;
        let share = population.saturating_mul(percent) / 100;
        share.max(self.always_allowed)
    }

    fn threshold(&self) -> u32 {
        self.confirm_sweeps.max(1)
    }
}

/// One sweep's view of the node. The agent reads the owned resources first and the
/// store last (see the module docs). Order and duplicates in the lists do not
/// matter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcInputs {
    /// Pods in the durable pod store.
    pub pods: Vec<PodKey>,
    /// The runtime's valid attachments, present only when this sweep was triggered
    /// by a CNI `GC` (`cni.dev/valid-attachments`).
    pub valid_attachments: Option<Vec<PodKey>>,
    /// Endpoints this node owns in the registry.
    pub endpoints: Vec<Owned>,
    /// Identity subscriptions (owner sets: pods sharing a SPIFFE ID share one).
    pub subscriptions: Vec<Owned>,
    /// Pinned network namespaces.
    pub netns_pins: Vec<Owned>,
    /// Per-pod xDS resources.
    pub xds: Vec<Owned>,
}

/// Per-item orphan counts carried from one sweep to the next. Opaque on purpose:
/// only [`plan`] writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcState {
    store: BTreeMap<PodKey, u32>,
    endpoints: BTreeMap<String, u32>,
    subscriptions: BTreeMap<String, u32>,
    netns_pins: BTreeMap<String, u32>,
    xds: BTreeMap<String, u32>,
}

impl GcState {
    /// Number of items with a running orphan count.
    pub fn len(&self) -> usize {
        self.store.len()
            + self.endpoints.len()
            + self.subscriptions.len()
            + self.netns_pins.len()
            + self.xds.len()
    }

    /// Whether no item has a running orphan count.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Consecutive sweeps the store entry `pod` has been an orphan on (0 if none).
    pub fn store_count(&self, pod: &PodKey) -> u32 {
        self.store.get(pod).copied().unwrap_or(0)
    }

    /// Consecutive sweeps the item `id` of `kind` has been an orphan on (0 if none).
    /// For [`Kind::StoreEntry`] use [`GcState::store_count`]; this returns 0.
    pub fn count(&self, kind: Kind, id: &str) -> u32 {
        let map = match kind {
            Kind::StoreEntry => return 0,
            Kind::Endpoint => &self.endpoints,
            Kind::Subscription => &self.subscriptions,
            Kind::NetnsPin => &self.netns_pins,
            Kind::XdsResource => &self.xds,
        };
        map.get(id).copied().unwrap_or(0)
    }
}

/// The breaker refused a kind's removals for this pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tripped {
    /// The kind that was held back.
    pub kind: Kind,
    /// Ripe orphans that would have been removed.
    pub would_remove: usize,
    /// That kind's population on this sweep.
    pub population: usize,
    /// The most the policy allows for that population.
    pub limit: usize,
}

impl fmt::Display for Tripped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gc breaker tripped for {}: would remove {} of {} (limit {}); nothing of this kind removed",
            self.kind, self.would_remove, self.population, self.limit
        )
    }
}

/// What one sweep decided about one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindReport {
    /// The kind.
    pub kind: Kind,
    /// Distinct items of this kind in the inputs.
    pub population: usize,
    /// Whether this kind was judged at all (store entries need valid attachments).
    pub evaluated: bool,
    /// Items that are orphans on this sweep.
    pub orphans: usize,
    /// Orphans whose count reached the confirmation threshold.
    pub ripe: usize,
    /// Items the plan removes (`ripe`, or 0 if the breaker tripped).
    pub removed: usize,
    /// Set when the breaker held this kind back.
    pub tripped: Option<Tripped>,
}

/// Per-kind summary of one sweep, in [`Kind::ALL`] order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// One entry per kind.
    pub kinds: Vec<KindReport>,
}

impl GcReport {
    /// The kinds the breaker held back on this sweep.
    pub fn tripped(&self) -> impl Iterator<Item = &Tripped> + '_ {
        self.kinds.iter().filter_map(|k| k.tripped.as_ref())
    }

    /// The report for `kind`.
    pub fn kind(&self, kind: Kind) -> Option<&KindReport> {
        self.kinds.iter().find(|k| k.kind == kind)
    }
}

/// What to remove on this sweep, each list sorted ascending.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrphanPlan {
    /// Store entries the runtime no longer knows.
    pub store: Vec<PodKey>,
    /// Registry endpoints to unregister.
    pub endpoints: Vec<String>,
    /// Identity subscriptions to cancel.
    pub subscriptions: Vec<String>,
    /// Netns pins to release.
    pub netns_pins: Vec<String>,
    /// xDS resources to withdraw.
    pub xds: Vec<String>,
    /// Per-kind summary, including breaker trips.
    pub report: GcReport,
}

impl OrphanPlan {
    /// Total number of removals in the plan.
    pub fn len(&self) -> usize {
        self.store.len()
            + self.endpoints.len()
            + self.subscriptions.len()
            + self.netns_pins.len()
            + self.xds.len()
    }

    /// Whether the plan removes nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Plans one GC sweep. Returns what to remove now and the state for the next sweep.
///
/// Pure and total: any inputs, state and policy give a plan; nothing owned by a live
/// pod is ever in it.
pub fn plan(inputs: &GcInputs, state: &GcState, policy: &GcPolicy) -> (OrphanPlan, GcState) {
    let store: BTreeSet<&PodKey> = inputs.pods.iter().collect();
    let valid: Option<BTreeSet<&PodKey>> = inputs
        .valid_attachments
        .as_ref()
        .map(|v| v.iter().collect());
    let is_live = |pod: &PodKey| -> bool {
        store.contains(pod) && valid.as_ref().is_none_or(|v| v.contains(pod))
    };

    let mut next = GcState::default();
    let mut out = OrphanPlan::default();

    // Store entries: orphans are store entries the runtime did not list as valid.
    let store_items: BTreeMap<PodKey, bool> = store
        .iter()
        .map(|&pod| {
            let orphan = valid.as_ref().is_some_and(|v| !v.contains(pod));
            (pod.clone(), orphan)
        })
        .collect();
    let (removed, counts, report) = match valid {
        Some(_) => sweep_kind(Kind::StoreEntry, store_items, &state.store, policy),
        None => carry_over(&store_items, &state.store),
    };
    out.store = removed;
    next.store = counts;
    out.report.kinds.push(report);

    // Owned kinds: orphans are items none of whose owners is live.
    let owned = |kind: Kind, items: &[Owned], prev: &BTreeMap<String, u32>| {
        let mut any_live: BTreeMap<String, bool> = BTreeMap::new();
        for item in items {
            let live = item.owners.iter().any(&is_live);
            *any_live.entry(item.id.clone()).or_insert(false) |= live;
        }
        let orphan_flags = any_live.into_iter().map(|(id, live)| (id, !live)).collect();
        sweep_kind(kind, orphan_flags, prev, policy)
    };
    let (removed, counts, report) = owned(Kind::Endpoint, &inputs.endpoints, &state.endpoints);
    (out.endpoints, next.endpoints) = (removed, counts);
    out.report.kinds.push(report);
    let (removed, counts, report) = owned(
        Kind::Subscription,
        &inputs.subscriptions,
        &state.subscriptions,
    );
    (out.subscriptions, next.subscriptions) = (removed, counts);
    out.report.kinds.push(report);
    let (removed, counts, report) = owned(Kind::NetnsPin, &inputs.netns_pins, &state.netns_pins);
    (out.netns_pins, next.netns_pins) = (removed, counts);
    out.report.kinds.push(report);
    let (removed, counts, report) = owned(Kind::XdsResource, &inputs.xds, &state.xds);
    (out.xds, next.xds) = (removed, counts);
    out.report.kinds.push(report);
    (out, next)
}

/// Applies hysteresis and the breaker to one kind. `items` maps every distinct item
/// of the kind to whether it is an orphan on this sweep.
fn sweep_kind<I: Ord + Clone>(
    kind: Kind,
    items: BTreeMap<I, bool>,
    prev: &BTreeMap<I, u32>,
    policy: &GcPolicy,
) -> (Vec<I>, BTreeMap<I, u32>, KindReport) {
    let population = items.len();
    let mut counts = BTreeMap::new();
    let mut ripe = Vec::new();
    for (id, orphan) in items {
        if !orphan {
            continue; // Not an orphan now: its count (if any) is dropped.
        }
        let count = prev.get(&id).copied().unwrap_or(0).saturating_add(1);
        if count >= policy.threshold() {
            ripe.push(id.clone());
        }
        counts.insert(id, count);
    }
    let limit = policy.limit(population);
    let mut report = KindReport {
        kind,
        population,
        evaluated: true,
        orphans: counts.len(),
        ripe: ripe.len(),
        removed: ripe.len(),
        tripped: None,
    };
    if ripe.len() > limit {
        report.tripped = Some(Tripped {
            kind,
            would_remove: ripe.len(),
            population,
            limit,
        });
        report.removed = 0;
        ripe.clear(); // Held back; the counts stay so they go once confirmed.
    }
    (ripe, counts, report)
}

/// A kind that cannot be judged this sweep: keep the counts of items still present,
/// unchanged; drop the rest; remove nothing.
fn carry_over<I: Ord + Clone>(
    items: &BTreeMap<I, bool>,
    prev: &BTreeMap<I, u32>,
) -> (Vec<I>, BTreeMap<I, u32>, KindReport) {
    let counts: BTreeMap<I, u32> = prev
        .iter()
        .filter(|(id, _)| items.contains_key(*id))
        .map(|(id, c)| (id.clone(), *c))
        .collect();
    let report = KindReport {
        kind: Kind::StoreEntry,
        population: items.len(),
        evaluated: false,
        orphans: 0,
        ripe: 0,
        removed: 0,
        tripped: None,
    };
    (Vec::new(), counts, report)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn pod(n: u32) -> PodKey {
        PodKey::new(format!("c{n}"), "eth0")
    }

    fn ep(id: &str, owner: u32) -> Owned {
        Owned::new(id, pod(owner))
    }

    fn k(n: u32) -> GcPolicy {
        GcPolicy {
            confirm_sweeps: n,
            ..GcPolicy::default()
        }
    }

    /// Runs `sweeps` sweeps over the same inputs, returning every plan.
    fn run(inputs: &GcInputs, policy: &GcPolicy, sweeps: usize) -> (Vec<OrphanPlan>, GcState) {
        let mut state = GcState::default();
        let mut plans = Vec::new();
        for _ in 0..sweeps {
            let (p, s) = plan(inputs, &state, policy);
            plans.push(p);
            state = s;
        }
        (plans, state)
    }

    #[test]
    fn orphan_endpoint_is_removed_on_the_kth_consecutive_sweep_not_before() {
        let inputs = GcInputs {
            pods: vec![pod(1)],
            endpoints: vec![ep("e1", 1), ep("e2", 2)],
            ..GcInputs::default()
        };
        let (plans, _) = run(&inputs, &k(3), 4);
        assert!(plans[0].is_empty());
        assert!(plans[1].is_empty());
        assert_eq!(plans[2].endpoints, vec!["e2".to_string()]);
        // A failed removal is retried on the next sweep (the count stays ripe).
        assert_eq!(plans[3].endpoints, vec!["e2".to_string()]);
    }

    #[test]
    fn one_sweep_where_the_item_is_owned_resets_its_count() {
        let policy = k(2);
        let orphaned = GcInputs {
            pods: vec![pod(1)],
            endpoints: vec![ep("e2", 2)],
            ..GcInputs::default()
        };
        let owned = GcInputs {
            pods: vec![pod(1), pod(2)],
            ..orphaned.clone()
        };
        let (p1, s1) = plan(&orphaned, &GcState::default(), &policy);
        assert!(p1.is_empty());
        assert_eq!(s1.count(Kind::Endpoint, "e2"), 1);
        let (p2, s2) = plan(&owned, &s1, &policy);
        assert!(p2.is_empty());
        assert_eq!(s2.count(Kind::Endpoint, "e2"), 0);
        assert!(s2.is_empty());
        let (p3, s3) = plan(&orphaned, &s2, &policy);
        assert!(p3.is_empty(), "the count restarted from zero");
        let (p4, _) = plan(&orphaned, &s3, &policy);
        assert_eq!(p4.endpoints, vec!["e2".to_string()]);
    }

    #[test]
    fn confirm_sweeps_zero_behaves_as_one() {
        let inputs = GcInputs {
            endpoints: vec![ep("e", 9)],
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &k(0));
        assert_eq!(p.endpoints, vec!["e".to_string()]);
    }

    #[test]
    fn state_keeps_only_current_orphans_and_drops_vanished_items() {
        let policy = k(5);
        let inputs = GcInputs {
            pods: vec![pod(1)],
            endpoints: vec![ep("e1", 1), ep("e2", 2), ep("e3", 3)],
            xds: vec![ep("x2", 2)],
            ..GcInputs::default()
        };
        let (_, s) = plan(&inputs, &GcState::default(), &policy);
        assert_eq!(s.len(), 3);
        let shrunk = GcInputs {
            pods: vec![pod(1)],
            endpoints: vec![ep("e1", 1)],
            ..GcInputs::default()
        };
        let (_, s) = plan(&shrunk, &s, &policy);
        assert!(s.is_empty());
    }

    #[test]
    fn shared_subscription_survives_while_any_owner_is_live() {
        let policy = k(1);
        let inputs = GcInputs {
            pods: vec![pod(1)],
            subscriptions: vec![
                Owned::shared("spiffe://td/ns/a/sa/x", [pod(1), pod(2)]),
                Owned::shared("spiffe://td/ns/a/sa/y", [pod(2), pod(3)]),
                Owned::shared("spiffe://td/ns/a/sa/nobody", []),
            ],
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &policy);
        assert_eq!(
            p.subscriptions,
            vec![
                "spiffe://td/ns/a/sa/nobody".to_string(),
                "spiffe://td/ns/a/sa/y".to_string()
            ]
        );
    }

    #[test]
    fn duplicate_ids_unite_their_owners() {
        let inputs = GcInputs {
            pods: vec![pod(1)],
            endpoints: vec![ep("e", 2), ep("e", 1)],
            ..GcInputs::default()
        };
        let (p, s) = plan(&inputs, &GcState::default(), &k(1));
        assert!(p.is_empty());
        assert!(s.is_empty());
        assert_eq!(p.report.kind(Kind::Endpoint).map(|r| r.population), Some(1));
    }

    #[test]
    fn store_entries_are_judged_only_when_valid_attachments_are_given() {
        let policy = k(2);
        let without = GcInputs {
            pods: vec![pod(1), pod(2)],
            ..GcInputs::default()
        };
        let with = GcInputs {
            valid_attachments: Some(vec![pod(1)]),
            ..without.clone()
        };
        let (p, s) = plan(&without, &GcState::default(), &policy);
        assert!(p.is_empty());
        assert!(s.is_empty());
        let report = p.report.kind(Kind::StoreEntry).copied();
        assert_eq!(report.map(|r| r.evaluated), Some(false));

        let (p, s) = plan(&with, &s, &policy);
        assert!(p.is_empty());
        assert_eq!(s.store_count(&pod(2)), 1);
        // A sweep with no CNI GC neither confirms nor resets.
        let (p, s) = plan(&without, &s, &policy);
        assert!(p.is_empty());
        assert_eq!(s.store_count(&pod(2)), 1);
        let (p, _) = plan(&with, &s, &policy);
        assert_eq!(p.store, vec![pod(2)]);
    }

    #[test]
    fn carried_store_counts_are_dropped_when_the_entry_disappears() {
        let policy = k(3);
        let with = GcInputs {
            pods: vec![pod(1), pod(2)],
            valid_attachments: Some(vec![pod(1)]),
            ..GcInputs::default()
        };
        let (_, s) = plan(&with, &GcState::default(), &policy);
        assert_eq!(s.store_count(&pod(2)), 1);
        let gone = GcInputs {
            pods: vec![pod(1)],
            ..GcInputs::default()
        };
        let (_, s) = plan(&gone, &s, &policy);
        assert!(s.is_empty());
    }

    #[test]
    fn pod_missing_from_valid_attachments_is_not_live_for_its_resources() {
        let inputs = GcInputs {
            pods: vec![pod(1)],
            valid_attachments: Some(vec![]),
            endpoints: vec![ep("e1", 1)],
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &k(1));
        assert_eq!(p.store, vec![pod(1)]);
        assert_eq!(p.endpoints, vec!["e1".to_string()]);
    }

    #[test]
    fn valid_attachment_without_a_store_entry_does_not_make_a_pod_live() {
        let inputs = GcInputs {
            pods: vec![],
            valid_attachments: Some(vec![pod(1)]),
            endpoints: vec![ep("e1", 1)],
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &k(1));
        assert_eq!(p.endpoints, vec!["e1".to_string()]);
    }

    #[test]
    fn live_pods_resources_are_never_removed_however_old_the_state() {
        let inputs = GcInputs {
            pods: vec![pod(1)],
            valid_attachments: Some(vec![pod(1)]),
            endpoints: vec![ep("e1", 1)],
            subscriptions: vec![ep("s1", 1)],
            netns_pins: vec![ep("n1", 1)],
            xds: vec![ep("x1", 1)],
        };
        // Forge a state claiming everything was an orphan many times.
        let mut state = GcState::default();
        state.store.insert(pod(1), 99);
        for map in [
            &mut state.endpoints,
            &mut state.subscriptions,
            &mut state.netns_pins,
            &mut state.xds,
        ] {
            for id in ["e1", "s1", "n1", "x1"] {
                map.insert(id.to_string(), u32::MAX);
            }
        }
        let (p, s) = plan(&inputs, &state, &k(1));
        assert!(p.is_empty());
        assert!(s.is_empty());
    }

    #[test]
    fn empty_store_after_a_bug_trips_the_breaker_and_removes_no_endpoints() {
        let endpoints: Vec<Owned> = (0..20).map(|i| ep(&format!("e{i:02}"), i)).collect();
        let inputs = GcInputs {
            pods: vec![],
            endpoints,
            ..GcInputs::default()
        };
        let (p, s) = plan(&inputs, &GcState::default(), &k(1));
        assert!(p.endpoints.is_empty());
        let trips: Vec<Tripped> = p.report.tripped().copied().collect();
        assert_eq!(
            trips,
            vec![Tripped {
                kind: Kind::Endpoint,
                would_remove: 20,
                population: 20,
                limit: 5,
            }]
        );
        // Held-back orphans keep (and keep growing) their counts.
        assert_eq!(s.count(Kind::Endpoint, "e00"), 1);
        let (p, s) = plan(&inputs, &s, &k(1));
        assert!(p.endpoints.is_empty());
        assert_eq!(s.count(Kind::Endpoint, "e00"), 2);
        // An operator-confirmed pass (100%) removes them at once.
        let force = GcPolicy {
            max_remove_percent: 100,
            ..k(1)
        };
        let (p, _) = plan(&inputs, &s, &force);
        assert_eq!(p.endpoints.len(), 20);
    }

    #[test]
    fn breaker_trips_per_kind_and_leaves_other_kinds_alone() {
        let inputs = GcInputs {
            pods: (0..4).map(pod).collect(),
            endpoints: (0..10).map(|i| ep(&format!("e{i}"), i)).collect(),
            xds: vec![ep("x9", 9)],
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &k(1));
        assert!(p.endpoints.is_empty());
        assert_eq!(p.xds, vec!["x9".to_string()]);
        let trips: Vec<Kind> = p.report.tripped().map(|t| t.kind).collect();
        assert_eq!(trips, vec![Kind::Endpoint]);
    }

    #[test]
    fn runtime_sending_an_empty_attachment_list_cannot_wipe_the_store() {
        let inputs = GcInputs {
            pods: (0..10).map(pod).collect(),
            valid_attachments: Some(vec![]),
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &k(1));
        assert!(p.store.is_empty());
        assert_eq!(
            p.report.kind(Kind::StoreEntry).and_then(|r| r.tripped),
            Some(Tripped {
                kind: Kind::StoreEntry,
                would_remove: 10,
                population: 10,
                limit: 3,
            })
        );
    }

    #[test]
    fn absolute_floor_lets_a_one_pod_node_collect() {
        let inputs = GcInputs {
            pods: vec![pod(1)],
            valid_attachments: Some(vec![]),
            endpoints: vec![ep("e1", 1)],
            ..GcInputs::default()
        };
        let (p, _) = plan(&inputs, &GcState::default(), &k(1));
        assert_eq!(p.store, vec![pod(1)]);
        assert_eq!(p.endpoints, vec!["e1".to_string()]);
        assert!(p.report.tripped().next().is_none());
    }

    #[test]
    fn exactly_the_limit_is_allowed_one_more_trips() {
        let policy = GcPolicy {
            confirm_sweeps: 1,
            max_remove_percent: 50,
            always_allowed: 0,
        };
        let mk = |orphans: u32| GcInputs {
            pods: (0..10 - orphans).map(pod).collect(),
            endpoints: (0..10).map(|i| ep(&format!("e{i}"), i)).collect(),
            ..GcInputs::default()
        };
        let (p, _) = plan(&mk(5), &GcState::default(), &policy);
        assert_eq!(p.endpoints.len(), 5);
        let (p, _) = plan(&mk(6), &GcState::default(), &policy);
        assert!(p.endpoints.is_empty());
        assert_eq!(p.report.tripped().count(), 1);
    }

    #[test]
    fn only_ripe_orphans_count_against_the_breaker() {
        // Ten orphans appear two per sweep; each pair ripens one sweep later, so
        // at most 2 are ripe at once and the breaker (20% of ~14) never trips,
        // although 10 orphans (more than the limit) are collected in total.
        let policy = GcPolicy {
            confirm_sweeps: 2,
            max_remove_percent: 20,
            always_allowed: 0,
        };
        let mut state = GcState::default();
        let mut removed: BTreeSet<String> = BTreeSet::new();
        for sweep in 0..8u32 {
            let orphans = (0..(sweep * 2).min(10))
                .map(|i| ep(&format!("e{i}"), 100 + i))
                .filter(|o| !removed.contains(&o.id));
            let inputs = GcInputs {
                endpoints: orphans
                    .chain((0..10).map(|i| ep(&format!("l{i}"), i)))
                    .collect(),
                pods: (0..10).map(pod).collect(),
                ..GcInputs::default()
            };
            let (p, s) = plan(&inputs, &state, &policy);
            assert!(p.report.tripped().next().is_none(), "sweep {sweep}");
            removed.extend(p.endpoints);
            state = s;
        }
        assert_eq!(removed.len(), 10);
        assert!(removed.iter().all(|id| id.starts_with('e')));
    }

    #[test]
    fn limit_saturates_and_clamps_the_percentage() {
        let policy = GcPolicy {
            confirm_sweeps: 1,
            max_remove_percent: 1000,
            always_allowed: 0,
        };
        assert_eq!(policy.limit(10), 10);
        assert_eq!(policy.limit(usize::MAX), usize::MAX / 100);
        assert_eq!(GcPolicy::default().limit(0), 3);
        assert_eq!(GcPolicy::default().limit(100), 25);
    }

    #[test]
    fn counts_saturate_instead_of_overflowing() {
        let inputs = GcInputs {
            endpoints: vec![ep("e", 1)],
            ..GcInputs::default()
        };
        let mut state = GcState::default();
        state.endpoints.insert("e".into(), u32::MAX);
        let (p, s) = plan(&inputs, &state, &k(3));
        assert_eq!(p.endpoints, vec!["e".to_string()]);
        assert_eq!(s.count(Kind::Endpoint, "e"), u32::MAX);
    }

    #[test]
    fn output_is_sorted_whatever_the_input_order() {
        let inputs = GcInputs {
            pods: vec![pod(5), pod(3), pod(4)],
            valid_attachments: Some(vec![pod(4)]),
            endpoints: vec![ep("z", 9), ep("a", 8), ep("m", 7)],
            ..GcInputs::default()
        };
        let policy = GcPolicy {
            confirm_sweeps: 1,
            max_remove_percent: 100,
            always_allowed: 0,
        };
        let (p, _) = plan(&inputs, &GcState::default(), &policy);
        assert_eq!(p.store, vec![pod(3), pod(5)]);
        assert_eq!(p.endpoints, vec!["a", "m", "z"]);
        let kinds: Vec<Kind> = p.report.kinds.iter().map(|r| r.kind).collect();
        assert_eq!(kinds, Kind::ALL.to_vec());
    }

    #[test]
    fn every_owned_kind_is_collected() {
        let inputs = GcInputs {
            pods: vec![pod(1)],
            endpoints: vec![ep("e", 2)],
            subscriptions: vec![ep("s", 2)],
            netns_pins: vec![ep("n", 2)],
            xds: vec![ep("x", 2)],
            ..GcInputs::default()
        };
        let (p, s) = plan(&inputs, &GcState::default(), &k(1));
        assert_eq!(p.endpoints, vec!["e"]);
        assert_eq!(p.subscriptions, vec!["s"]);
        assert_eq!(p.netns_pins, vec!["n"]);
        assert_eq!(p.xds, vec!["x"]);
        assert_eq!(p.len(), 4);
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn report_serializes_for_the_admin_api() {
        let t = Tripped {
            kind: Kind::Endpoint,
            would_remove: 4,
            population: 5,
            limit: 3,
        };
        let json = serde_json::to_string(&t).unwrap_or_default();
        assert!(json.contains("\"would_remove\":4"));
        assert!(t.to_string().contains("endpoint"));
        assert_eq!(PodKey::new("abc", "eth0").to_string(), "abc/eth0");
    }
}
