//! The registry sync's decision: what to put and delete so that the shared registry
//! holds exactly this node's wanted endpoints.
//!
//! The node's own pod table is the source of truth; the registry is a replica of it
//! that may be unreachable or hang at any moment. CNI `ADD`/`DEL` therefore do not
//! write the registry themselves: they change the table and wake the registry sync,
//! which compares what the live pods want ([`plan`]'s `desired`: key → endpoint) with
//! what the registry holds of this node ([`Held`]) and makes the two match, retrying
//! with backoff ([`crate::backoff`]) while the registry is down. After every change of
//! the table or of the registry's view it plans again from scratch, so an operation
//! that failed, timed out or was overtaken by a newer change is simply replanned.
//!
//! The plan is ordered: every delete first, then every put, each group by key. Deletes
//! first because a held endpoint nobody wants is a ghost that remote nodes route to
//! now (R4's consequence), while a missing put only delays a new pod's first remote
//! traffic. A held endpoint is deleted at the revision it was seen at, so a newer
//! registration of the same key (the pod came back meanwhile) survives; an endpoint
//! whose write timed out has no known revision ([`Held::Unknown`]: the write may land
//! later or never), so it is deleted unconditionally if no live pod wants it.
//!
//! Around each put the agent applies the R4 guard of
//! [`crate::lifecycle::guard::register_if_live`]: it puts only a key that is still
//! wanted at that moment and, after the put, undoes it if the pod left meanwhile; the
//! next plan catches anything else.
//!
//! # Example
//!
//! ```
//! use std::collections::BTreeMap;
//! use flock_core::regsync::{plan, Held, SyncOp};
//!
//! let desired = BTreeMap::from([("n1/a".to_string(), "10.0.0.1"), ("n1/b".to_string(), "10.0.0.2")]);
//! let held = BTreeMap::from([
//!     ("n1/a".to_string(), Held::Known { value: "10.0.0.1", revision: 7 }),
//!     ("n1/gone".to_string(), Held::Known { value: "10.0.0.9", revision: 8 }),
//!     ("n1/late".to_string(), Held::Unknown),
//! ]);
//! assert_eq!(
//!     plan(&desired, &held),
//!     vec![
//!         SyncOp::Delete { key: "n1/gone".to_string(), revision: Some(8) },
//!         SyncOp::Delete { key: "n1/late".to_string(), revision: None },
//!         SyncOp::Put { key: "n1/b".to_string(), value: "10.0.0.2" },
//!     ]
//! );
//! ```

use std::collections::{BTreeMap, BTreeSet};

/// What the registry holds of this node under one key, as far as the agent knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held<E> {
    /// The registry's view shows `value`, last written at `revision`.
    Known {
        /// The value held.
        value: E,
        /// Its mod revision (for a conditional delete).
        revision: u64,
    },
    /// A write of this key failed without an answer (timeout, dropped connection): it
    /// may have landed, may land later, or never. Deleted if no pod wants the key.
    Unknown,
}

/// One registry write of a [`plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncOp<E> {
    /// Delete `key`; at `revision` when known (a newer write of the key survives),
    /// unconditionally when the write's outcome is unknown.
    Delete {
        /// The key.
        key: String,
        /// The revision it was seen at, if known.
        revision: Option<u64>,
    },
    /// Put `value` under `key`.
    Put {
        /// The key.
        key: String,
        /// The endpoint.
        value: E,
    },
}

impl<E> SyncOp<E> {
    /// The key the op writes.
    pub fn key(&self) -> &str {
        match self {
            SyncOp::Delete { key, .. } | SyncOp::Put { key, .. } => key,
        }
    }
}

/// The ordered writes that turn `held` into `desired` (see the module docs): deletes of
/// every held key no pod wants, then puts of every wanted key not held with the same
/// value, each group in key order. Empty exactly when the registry matches.
pub fn plan<E: Clone + PartialEq>(
    desired: &BTreeMap<String, E>,
    held: &BTreeMap<String, Held<E>>,
) -> Vec<SyncOp<E>> {
    let deletes = held
        .iter()
        .filter(|(key, _)| !desired.contains_key(*key))
        .map(|(key, h)| SyncOp::Delete {
            key: key.clone(),
            revision: match h {
                Held::Known { revision, .. } => Some(*revision),
                Held::Unknown => None,
            },
        });
    let puts = desired
        .iter()
        .filter(|(key, value)| {
            !matches!(held.get(*key), Some(Held::Known { value: v, .. }) if v == *value)
        })
        .map(|(key, value)| SyncOp::Put {
            key: key.clone(),
            value: value.clone(),
        });
    deletes.chain(puts).collect()
}

/// How the registry sync guards one put (R4 in its registry form): the put is sent
/// only while its pod is still wanted; its key is tracked before it is sent (so a put
/// that timed out and lands later shows up in the view as a key the sync knows, and is
/// deleted if no pod wants it by then, instead of staying as a ghost) and remembered
/// as of unknown outcome if it fails without an answer; after it lands, it is undone
/// at the revision it wrote if its pod left meanwhile (RemovePod leaves the table
/// before it hands the pod's keys over, so the withdrawal may have run before the put
/// landed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutGuard {
    guarded: bool,
}

impl Default for PutGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl PutGuard {
    /// The guard (without it only under the `regsync-unguarded` mutant).
    pub fn new() -> Self {
        Self {
            guarded: !crate::reintroduced!("regsync-unguarded"),
        }
    }

    /// Before the put: whether to send it, from whether its pod is still wanted now.
    pub fn send(&self, still_wanted: bool) -> bool {
        !self.guarded || still_wanted
    }

    /// Whether the key is tracked before the put is sent, and marked of unknown
    /// outcome when the put fails without an answer.
    pub fn track(&self) -> bool {
        self.guarded
    }

    /// After the put landed: whether to undo it (at its revision), from whether its
    /// pod is still wanted now.
    pub fn undo(&self, still_wanted: bool) -> bool {
        self.guarded && !still_wanted
    }
}

/// The keys a plan must look at when it need not look at all of them: since the last
/// plan that found nothing to do, those whose desired endpoint `changed`, those the
/// registry view changed (`view_changed`: another writer may have deleted or
/// overwritten one of this node's keys, and only the view says so), those handed
/// over for removal (`withdrawn`) and those whose last write is of unknown outcome.
/// Every other key still matches as it did then, so a plan over these alone makes the
/// same writes as a plan over all ([`plan`] decides each key on its own).
pub fn plan_candidates<'a>(
    changed: &BTreeSet<String>,
    view_changed: impl IntoIterator<Item = &'a String>,
    withdrawn: impl IntoIterator<Item = &'a String>,
    unknown: impl IntoIterator<Item = &'a String>,
) -> BTreeSet<String> {
    let mut keys = changed.clone();
    if !crate::reintroduced!("regsync-plan-misses-view-changes") {
        keys.extend(view_changed.into_iter().cloned());
    }
    keys.extend(withdrawn.into_iter().cloned());
    keys.extend(unknown.into_iter().cloned());
    keys
}

/// How a reader that keeps state derived from the registry view (the agent's service
/// table) catches up with a newer view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatchUp {
    /// Nothing changed.
    Nothing,
    /// Apply the view's last `k` deltas, oldest first.
    Deltas(usize),
    /// Derive everything again from the whole view.
    Rebuild,
}

/// How to catch up from the view numbered `seen` to the view numbered `now` (views
/// count their changes; `0`: a backend that does not), when the view keeps its last
/// `recent` deltas. The watch channel the view comes through keeps only the newest
/// view: a delta says how a view differs from the one just before it, and applied
/// over a view that was missed it would lose that view's changes, so every missed
/// view's delta is applied, or everything is derived again when the view no longer
/// keeps them.
pub fn catch_up(seen: u64, now: u64, recent: usize) -> CatchUp {
    if now == 0 || seen == 0 || now < seen {
        return CatchUp::Rebuild;
    }
    let missed = now - seen;
    if missed == 0 {
        return CatchUp::Nothing;
    }
    if missed == 1 || crate::reintroduced!("service-table-delta-over-gap") {
        return CatchUp::Deltas(1);
    }
    match usize::try_from(missed) {
        Ok(k) if k <= recent => CatchUp::Deltas(k),
        _ => CatchUp::Rebuild,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_matching_registry_needs_nothing() {
        let desired = BTreeMap::from([("a".to_string(), 1)]);
        let held = BTreeMap::from([(
            "a".to_string(),
            Held::Known {
                value: 1,
                revision: 3,
            },
        )]);
        assert!(plan(&desired, &held).is_empty());
    }

    #[test]
    fn a_changed_value_is_put_again_and_an_unknown_wanted_key_is_put() {
        let desired = BTreeMap::from([("a".to_string(), 2), ("b".to_string(), 5)]);
        let held = BTreeMap::from([
            (
                "a".to_string(),
                Held::Known {
                    value: 1,
                    revision: 3,
                },
            ),
            ("b".to_string(), Held::Unknown),
        ]);
        assert_eq!(
            plan(&desired, &held),
            vec![
                SyncOp::Put {
                    key: "a".to_string(),
                    value: 2
                },
                SyncOp::Put {
                    key: "b".to_string(),
                    value: 5
                }
            ]
        );
    }

    #[test]
    fn catching_up_applies_every_missed_delta_or_rebuilds() {
        assert_eq!(catch_up(5, 5, 8), CatchUp::Nothing);
        assert_eq!(catch_up(5, 6, 8), CatchUp::Deltas(1));
        assert_eq!(catch_up(5, 9, 8), CatchUp::Deltas(4));
        assert_eq!(catch_up(5, 20, 8), CatchUp::Rebuild);
        assert_eq!(catch_up(0, 3, 8), CatchUp::Rebuild);
        assert_eq!(catch_up(3, 0, 8), CatchUp::Rebuild);
        assert_eq!(catch_up(9, 3, 8), CatchUp::Rebuild);
    }

    #[test]
    fn plan_candidates_include_the_views_changes() {
        let changed = BTreeSet::from(["a".to_string()]);
        let view = ["b".to_string()];
        let withdrawn = ["c".to_string()];
        let unknown = ["d".to_string()];
        let keys = plan_candidates(&changed, &view, &withdrawn, &unknown);
        assert_eq!(keys.into_iter().collect::<Vec<_>>(), ["a", "b", "c", "d"]);
    }

    #[test]
    fn a_put_is_sent_tracked_and_kept_only_while_its_pod_is_wanted() {
        let g = PutGuard::new();
        assert!(g.send(true) && !g.send(false));
        assert!(g.track());
        assert!(g.undo(false) && !g.undo(true));
    }
}
