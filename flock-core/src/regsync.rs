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

use std::collections::BTreeMap;

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
}
