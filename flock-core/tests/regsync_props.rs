#![cfg(not(loom))]
//! Property tests for the registry sync's plan (`flock_core::regsync`): random wanted
//! and held endpoints, including writes of unknown outcome.

use std::collections::{BTreeMap, BTreeSet};

use flock_core::regsync::{Held, SyncOp, plan};
use proptest::prelude::*;

fn arb_desired() -> impl Strategy<Value = BTreeMap<String, u8>> {
    prop::collection::btree_map((0u8..12).prop_map(|k| format!("k{k}")), 0u8..3, 0..10)
}

fn arb_held() -> impl Strategy<Value = BTreeMap<String, Held<u8>>> {
    prop::collection::btree_map(
        (0u8..12).prop_map(|k| format!("k{k}")),
        prop_oneof![
            (0u8..3, 1u64..100).prop_map(|(value, revision)| Held::Known { value, revision }),
            Just(Held::Unknown),
        ],
        0..10,
    )
}

/// What the registry holds after every op of `ops` succeeded, as key → value
/// (an unknown write that lands counts as present with no value known: `None`).
fn apply(held: &BTreeMap<String, Held<u8>>, ops: &[SyncOp<u8>]) -> BTreeMap<String, Option<u8>> {
    let mut reg: BTreeMap<String, Option<u8>> = held
        .iter()
        .map(|(k, h)| {
            let v = match h {
                Held::Known { value, .. } => Some(*value),
                Held::Unknown => None,
            };
            (k.clone(), v)
        })
        .collect();
    for op in ops {
        match op {
            SyncOp::Delete { key, .. } => {
                reg.remove(key);
            }
            SyncOp::Put { key, value } => {
                reg.insert(key.clone(), Some(*value));
            }
        }
    }
    reg
}

proptest! {
    /// After the plan the registry holds exactly the wanted endpoints with their
    /// wanted values: no ghost (a held key nobody wants, known or of unknown outcome)
    /// and nothing missing or stale.
    #[test]
    fn the_plan_makes_the_registry_hold_exactly_what_is_wanted(desired in arb_desired(), held in arb_held()) {
        let ops = plan(&desired, &held);
        let after = apply(&held, &ops);
        let want: BTreeMap<String, Option<u8>> = desired.iter().map(|(k, v)| (k.clone(), Some(*v))).collect();
        prop_assert_eq!(after, want);
    }

    /// Every delete comes before every put, each key is written at most once, and
    /// each group is in key order.
    #[test]
    fn deletes_come_first_and_each_key_once_in_order(desired in arb_desired(), held in arb_held()) {
        let ops = plan(&desired, &held);
        let first_put = ops.iter().position(|o| matches!(o, SyncOp::Put { .. })).unwrap_or(ops.len());
        let puts_only = ops[first_put..].iter().all(|o| matches!(o, SyncOp::Put { .. }));
        prop_assert!(puts_only, "a delete after a put: {:?}", ops);
        let keys: Vec<&str> = ops.iter().map(|o| o.key()).collect();
        let unique: BTreeSet<&str> = keys.iter().copied().collect();
        prop_assert_eq!(unique.len(), keys.len());
        prop_assert!(keys[..first_put].windows(2).all(|w| w[0] < w[1]));
        prop_assert!(keys[first_put..].windows(2).all(|w| w[0] < w[1]));
    }

    /// The plan writes nothing that already matches, and it is empty exactly when the
    /// registry holds every wanted value and nothing else.
    #[test]
    fn a_matching_registry_gets_no_write(desired in arb_desired(), held in arb_held()) {
        let ops = plan(&desired, &held);
        for op in &ops {
            let matches = matches!(
                (held.get(op.key()), desired.get(op.key())),
                (Some(Held::Known { value, .. }), Some(want)) if value == want
            );
            prop_assert!(!matches, "wrote {} which already matched", op.key());
        }
        let in_sync = held.len() == desired.len()
            && desired.iter().all(|(k, v)| matches!(held.get(k), Some(Held::Known { value, .. }) if value == v));
        prop_assert_eq!(ops.is_empty(), in_sync);
    }

    /// A held key is deleted at the revision it was seen at (a newer registration of
    /// the key survives the delete); only a write of unknown outcome is deleted
    /// unconditionally. A wanted key is never deleted.
    #[test]
    fn deletes_are_conditional_on_the_seen_revision(desired in arb_desired(), held in arb_held()) {
        for op in plan(&desired, &held) {
            if let SyncOp::Delete { key, revision } = op {
                prop_assert!(!desired.contains_key(&key));
                match held.get(&key) {
                    Some(Held::Known { revision: seen, .. }) => prop_assert_eq!(revision, Some(*seen)),
                    Some(Held::Unknown) => prop_assert_eq!(revision, None),
                    None => prop_assert!(false, "deleted {} which is not held", key),
                }
            }
        }
    }

    /// Planning again after the plan succeeded finds nothing to do (the sync settles).
    #[test]
    fn a_second_plan_after_success_is_empty(desired in arb_desired(), held in arb_held()) {
        let ops = plan(&desired, &held);
        let after: BTreeMap<String, Held<u8>> = apply(&held, &ops)
            .into_iter()
            .map(|(k, v)| (k, v.map_or(Held::Unknown, |value| Held::Known { value, revision: 1000 })))
            .collect();
        prop_assert!(plan(&desired, &after).is_empty());
    }
}
