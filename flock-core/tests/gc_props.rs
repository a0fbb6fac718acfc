#![cfg(not(loom))]
//! Property tests for the orphan-GC planner (`flock_core::gc`): random stores,
//! attachments, registries, subscriptions, pins and xDS entries over random
//! sequences of sweeps.

use std::collections::{BTreeMap, BTreeSet};

use flock_core::gc::{GcInputs, GcPolicy, GcState, Kind, OrphanPlan, Owned, PodKey, plan};
use proptest::prelude::*;

fn pod(n: u32) -> PodKey {
    PodKey::new(format!("c{n}"), "eth0")
}

/// Single-owner items: ids from a small universe so sweeps share items, owners from
/// a pod universe larger than the store's so some are orphans.
fn arb_owned(prefix: &'static str) -> impl Strategy<Value = Vec<Owned>> {
    prop::collection::vec((0u32..10, 0u32..10), 0..10).prop_map(move |v| {
        v.into_iter()
            .map(|(id, owner)| Owned::new(format!("{prefix}{id}"), pod(owner)))
            .collect()
    })
}

fn arb_shared() -> impl Strategy<Value = Vec<Owned>> {
    prop::collection::vec((0u32..6, prop::collection::btree_set(0u32..10, 0..3)), 0..6).prop_map(
        |v| {
            v.into_iter()
                .map(|(id, owners)| Owned::shared(format!("s{id}"), owners.into_iter().map(pod)))
                .collect()
        },
    )
}

fn arb_inputs() -> impl Strategy<Value = GcInputs> {
    (
        prop::collection::btree_set(0u32..8, 0..8),
        prop::option::of(prop::collection::btree_set(0u32..8, 0..8)),
        arb_owned("e"),
        arb_shared(),
        arb_owned("n"),
        arb_owned("x"),
    )
        .prop_map(
            |(pods, valid, endpoints, subscriptions, netns_pins, xds)| GcInputs {
                pods: pods.into_iter().map(pod).collect(),
                valid_attachments: valid.map(|v| v.into_iter().map(pod).collect()),
                endpoints,
                subscriptions,
                netns_pins,
                xds,
            },
        )
}

fn arb_policy() -> impl Strategy<Value = GcPolicy> {
    (0u32..5, 0u32..=120, 0usize..5).prop_map(
        |(confirm_sweeps, max_remove_percent, always_allowed)| GcPolicy {
            confirm_sweeps,
            max_remove_percent,
            always_allowed,
        },
    )
}

fn live_pods(inputs: &GcInputs) -> BTreeSet<PodKey> {
    inputs
        .pods
        .iter()
        .filter(|p| {
            inputs
                .valid_attachments
                .as_ref()
                .is_none_or(|v| v.contains(p))
        })
        .cloned()
        .collect()
}

fn owned_lists<'a>(
    inputs: &'a GcInputs,
    p: &'a OrphanPlan,
) -> [(Kind, &'a [Owned], &'a [String]); 4] {
    [
        (Kind::Endpoint, &inputs.endpoints, &p.endpoints),
        (Kind::Subscription, &inputs.subscriptions, &p.subscriptions),
        (Kind::NetnsPin, &inputs.netns_pins, &p.netns_pins),
        (Kind::XdsResource, &inputs.xds, &p.xds),
    ]
}

fn strictly_sorted<T: Ord>(v: &[T]) -> bool {
    v.windows(2).all(|w| w[0] < w[1])
}

/// Checks every per-sweep invariant of one plan.
fn check_sweep(
    inputs: &GcInputs,
    policy: &GcPolicy,
    p: &OrphanPlan,
    next: &GcState,
) -> Result<(), TestCaseError> {
    let live = live_pods(inputs);

    // Never remove a live pod's store entry; store entries only on CNI GC sweeps.
    for removed in &p.store {
        prop_assert!(!live.contains(removed), "removed live pod {removed}");
        prop_assert!(inputs.valid_attachments.is_some());
        prop_assert!(inputs.pods.contains(removed));
    }
    prop_assert!(strictly_sorted(&p.store));

    // Never remove anything with a live owner (in any of its duplicate entries).
    let mut distinct_items = BTreeSet::<PodKey>::from_iter(inputs.pods.iter().cloned()).len();
    for (kind, items, removed) in owned_lists(inputs, p) {
        prop_assert!(strictly_sorted(removed), "{kind} not sorted");
        let mut owners: BTreeMap<&str, BTreeSet<&PodKey>> = BTreeMap::new();
        for item in items {
            owners
                .entry(&item.id)
                .or_default()
                .extend(item.owners.iter());
        }
        distinct_items += owners.len();
        for id in removed {
            let Some(set) = owners.get(id.as_str()) else {
                return Err(TestCaseError::fail(format!(
                    "{kind} {id} removed but not in inputs"
                )));
            };
            prop_assert!(
                set.iter().all(|o| !live.contains(*o)),
                "{kind} {id} has a live owner"
            );
        }
    }

    // The breaker: never more than the limit; a trip removes none of that kind.
    let removed_counts = [
        (Kind::StoreEntry, p.store.len()),
        (Kind::Endpoint, p.endpoints.len()),
        (Kind::Subscription, p.subscriptions.len()),
        (Kind::NetnsPin, p.netns_pins.len()),
        (Kind::XdsResource, p.xds.len()),
    ];
    for (kind, removed) in removed_counts {
        let Some(report) = p.report.kind(kind) else {
            return Err(TestCaseError::fail(format!("no report for {kind}")));
        };
        prop_assert_eq!(report.removed, removed);
        prop_assert!(
            removed <= policy.limit(report.population),
            "{kind}: {removed} > limit"
        );
        if let Some(t) = report.tripped {
            prop_assert_eq!(removed, 0);
            prop_assert!(t.would_remove > t.limit);
            prop_assert_eq!(t.limit, policy.limit(t.population));
        }
    }

    // Bounded state: at most one count per current item.
    prop_assert!(
        next.len() <= distinct_items,
        "state {} > items {}",
        next.len(),
        distinct_items
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Over random sequences of sweeps: nothing owned by a live pod is removed, the
    /// breaker never lets more than its limit through (and a trip removes none),
    /// output is sorted, and `GcState` never holds more entries than there are
    /// current items.
    #[test]
    fn random_sweeps_respect_liveness_breaker_and_bounds(
        sweeps in prop::collection::vec(arb_inputs(), 1..8),
        policy in arb_policy(),
    ) {
        let mut state = GcState::default();
        for inputs in &sweeps {
            let (p, next) = plan(inputs, &state, &policy);
            check_sweep(inputs, &policy, &p, &next)?;
            state = next;
        }
    }

    /// Arbitrary (even forged) prior state cannot make the planner remove a live
    /// pod's resources.
    #[test]
    fn forged_state_cannot_remove_live_resources(
        inputs in arb_inputs(),
        policy in arb_policy(),
        warmup in prop::collection::vec(arb_inputs(), 0..6),
    ) {
        let mut state = GcState::default();
        for w in &warmup {
            state = plan(w, &state, &policy).1;
        }
        let (p, next) = plan(&inputs, &state, &policy);
        check_sweep(&inputs, &policy, &p, &next)?;
    }

    /// A stable orphan of every owned kind, amid random churn of other items, is
    /// removed on exactly the K-th sweep (never before) unless the breaker tripped
    /// for its kind on that sweep; a stable orphan store entry is removed on exactly
    /// the K-th sweep that carried valid attachments.
    #[test]
    fn stable_orphans_are_removed_after_exactly_k_sweeps(
        churn in prop::collection::vec(arb_inputs(), 12),
        policy in arb_policy(),
    ) {
        let k = policy.confirm_sweeps.max(1) as usize;
        let ghost = pod(99); // never in the store
        let stale = pod(98); // in the store, never a valid attachment
        let mut state = GcState::default();
        let mut store_sweeps = 0;
        let mut store_done = false;
        for (i, mut inputs) in churn.into_iter().enumerate() {
            let sweep = i + 1;
            inputs.endpoints.push(Owned::new("ghost-endpoint", ghost.clone()));
            inputs.subscriptions.push(Owned::shared("ghost-sub", [ghost.clone(), pod(97)]));
            inputs.netns_pins.push(Owned::new("ghost-pin", ghost.clone()));
            inputs.xds.push(Owned::new("ghost-xds", ghost.clone()));
            inputs.pods.push(stale.clone());
            if let Some(v) = inputs.valid_attachments.as_mut() {
                v.retain(|p| *p != stale);
                store_sweeps += 1;
            }
            let (p, next) = plan(&inputs, &state, &policy);
            state = next;

            if sweep <= k {
                for (kind, _, removed) in owned_lists(&inputs, &p) {
                    let is_ghost = removed.iter().any(|id| id.starts_with("ghost"));
                    let tripped = p.report.kind(kind).and_then(|r| r.tripped).is_some();
                    if sweep < k {
                        prop_assert!(!is_ghost, "{kind} ghost removed on sweep {sweep} < K={k}");
                    } else {
                        prop_assert_eq!(is_ghost, !tripped, "{} ghost on sweep K={}", kind, k);
                    }
                }
            }
            if !store_done && inputs.valid_attachments.is_some() {
                let removed = p.store.contains(&stale);
                let tripped = p.report.kind(Kind::StoreEntry).and_then(|r| r.tripped).is_some();
                if store_sweeps < k {
                    prop_assert!(!removed, "store orphan removed after {store_sweeps} < K={k}");
                } else {
                    prop_assert_eq!(removed, !tripped);
                    store_done = true;
                }
            } else if !store_done {
                prop_assert!(!p.store.contains(&stale));
            }
        }
    }

    /// With the breaker wide open (100%), every ripe orphan goes: the set removed on
    /// a sweep is exactly the items that were orphans on the last K sweeps.
    #[test]
    fn open_breaker_removes_exactly_the_confirmed_orphans(
        sweeps in prop::collection::vec(arb_inputs(), 1..8),
        k in 1u32..4,
    ) {
        let policy = GcPolicy { confirm_sweeps: k, max_remove_percent: 100, always_allowed: 0 };
        let mut state = GcState::default();
        let mut history: Vec<BTreeSet<String>> = Vec::new();
        for inputs in &sweeps {
            let live = live_pods(inputs);
            let mut orphans = BTreeSet::new();
            let (p, next) = plan(inputs, &state, &policy);
            let mut removed = BTreeSet::new();
            for (kind, items, r) in owned_lists(inputs, &p) {
                let mut owners: BTreeMap<&str, bool> = BTreeMap::new();
                for item in items {
                    *owners.entry(&item.id).or_default() |= item.owners.iter().any(|o| live.contains(o));
                }
                orphans.extend(owners.into_iter().filter(|(_, l)| !l).map(|(id, _)| format!("{kind}:{id}")));
                removed.extend(r.iter().map(|id| format!("{kind}:{id}")));
            }
            history.push(orphans);
            let window = &history[history.len().saturating_sub(k as usize)..];
            let expected: BTreeSet<String> = if window.len() < k as usize {
                BTreeSet::new()
            } else {
                window.iter().skip(1).fold(window[0].clone(), |acc, s| &acc & s)
            };
            prop_assert_eq!(removed, expected);
            state = next;
        }
    }
}
