#![cfg(not(loom))]
//! Properties of `resources::diff`: the journal shortcut agrees with the full walk, and
//! applying a diff to the older set reproduces the newer one exactly.

use flock_core::ContentHash;
use flock_core::resources::{Diff, Name, ResourceSet, diff, diff_full};
use proptest::prelude::*;
use std::collections::BTreeMap;

const TYPES: [&str; 3] = ["t/Cluster", "t/ClusterLoadAssignment", "t/Listener"];

#[derive(Debug, Clone)]
enum Op {
    Upsert { ty: usize, name: u8, content: u8 },
    Remove { ty: usize, name: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..TYPES.len(), 0u8..12, 0u8..4).prop_map(|(ty, name, content)| Op::Upsert { ty, name, content }),
        1 => (0..TYPES.len(), 0u8..12).prop_map(|(ty, name)| Op::Remove { ty, name }),
    ]
}

fn apply_ops(base: &ResourceSet<u8>, ops: &[Op]) -> ResourceSet<u8> {
    let mut b = base.edit();
    for op in ops {
        match *op {
            Op::Upsert { ty, name, content } => {
                b.upsert(
                    TYPES[ty],
                    &format!("r{name}"),
                    ContentHash::of(&[content]),
                    content,
                );
            }
            Op::Remove { ty, name } => {
                b.remove(TYPES[ty], &format!("r{name}"));
            }
        }
    }
    b.build()
}

/// The content of a set as plain data: type → name → hash.
fn content(set: &ResourceSet<u8>) -> BTreeMap<String, BTreeMap<String, ContentHash>> {
    set.type_urls()
        .map(|t| {
            let names = set
                .iter_type(t)
                .map(|(n, e)| (n.to_string(), e.hash()))
                .collect();
            (t.to_string(), names)
        })
        .collect()
}

/// Applies `d` to `prev`'s content, taking added and changed resources from `next`.
fn apply_diff(
    prev: &ResourceSet<u8>,
    next: &ResourceSet<u8>,
    d: &Diff,
) -> BTreeMap<String, BTreeMap<String, ContentHash>> {
    let mut out = content(prev);
    for (t, td) in &d.types {
        let names = out.entry(t.to_string()).or_default();
        for n in &td.removed {
            assert!(
                names.remove(n.as_ref()).is_some(),
                "removed {n} was not in prev"
            );
        }
        for n in td.added.iter().chain(&td.changed) {
            let e = next.get(t, n).expect("added/changed name exists in next");
            names.insert(n.to_string(), e.hash());
        }
    }
    out.retain(|_, names| !names.is_empty());
    out
}

fn assert_sorted_unique(d: &Diff) {
    for td in d.types.values() {
        for list in [&td.added, &td.changed, &td.removed] {
            assert!(
                list.windows(2).all(|w| w[0] < w[1]),
                "names sorted and unique: {list:?}"
            );
        }
    }
}

proptest! {
    #[test]
    fn diff_round_trips(seed in prop::collection::vec(op(), 0..40), edit in prop::collection::vec(op(), 0..20)) {
        let v1 = apply_ops(&ResourceSet::new(), &seed);
        let v2 = apply_ops(&v1, &edit);
        let fast = diff(&v1, &v2);
        let full = diff_full(&v1, &v2);
        prop_assert_eq!(&fast, &full);
        assert_sorted_unique(&fast);
        prop_assert_eq!(apply_diff(&v1, &v2, &fast), content(&v2));
        // And backwards (v1 was not derived from v2: the full walk).
        let back = diff(&v2, &v1);
        prop_assert_eq!(apply_diff(&v2, &v1, &back), content(&v1));
    }

    #[test]
    fn diff_across_two_generations_is_still_exact(
        seed in prop::collection::vec(op(), 0..30),
        e1 in prop::collection::vec(op(), 0..10),
        e2 in prop::collection::vec(op(), 0..10),
    ) {
        let v1 = apply_ops(&ResourceSet::new(), &seed);
        let v2 = apply_ops(&v1, &e1);
        let v3 = apply_ops(&v2, &e2);
        let d = diff(&v1, &v3);
        prop_assert_eq!(&d, &diff_full(&v1, &v3));
        prop_assert_eq!(apply_diff(&v1, &v3, &d), content(&v3));
    }

    #[test]
    fn an_unchanged_resource_never_appears_in_a_diff(
        seed in prop::collection::vec(op(), 1..30),
        edit in prop::collection::vec(op(), 0..20),
    ) {
        let v1 = apply_ops(&ResourceSet::new(), &seed);
        let v2 = apply_ops(&v1, &edit);
        let d = diff(&v1, &v2);
        for (t, td) in &d.types {
            for n in &td.changed {
                prop_assert_ne!(v1.get(t, n).unwrap().hash(), v2.get(t, n).unwrap().hash());
            }
        }
        let untouched: Vec<Name> = v1.iter_type(TYPES[0]).filter(|(n, e)| v2.get(TYPES[0], n).map(|x| x.hash()) == Some(e.hash())).map(|(n, _)| n.clone()).collect();
        if let Some(td) = d.types.get(TYPES[0]) {
            for n in untouched {
                prop_assert!(!td.added.contains(&n) && !td.changed.contains(&n) && !td.removed.contains(&n));
            }
        }
    }
}
