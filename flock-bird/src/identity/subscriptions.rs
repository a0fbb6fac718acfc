//! The pods' identity subscriptions (pod → SPIFFE ID), journaled, with a count of
//! subscribers per SPIFFE ID.
//!
//! A provider keeps one SVID per SPIFFE ID that has a subscriber, and drops it when the
//! last one leaves. Finding the last one used to scan every subscription on every
//! unsubscribe (a DEL's cost grew with the pods on the node); the count answers it in
//! O(log pods).

use flock_core::journal::{JournaledMap, Snapshot};
use flock_core::pod::PodKey;
use std::collections::HashMap;

/// Pod → SPIFFE ID, and subscribers per SPIFFE ID.
pub(crate) struct Subscriptions {
    by_pod: JournaledMap<PodKey, String>,
    /// Every ID with at least one subscriber, and how many: the number of pods that
    /// `by_pod` maps to it (never 0: an ID is removed with its last subscriber).
    subscribers: HashMap<String, usize>,
}

/// What an insert or remove did to the ID a pod left.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Left {
    /// The ID the pod was subscribed to.
    pub id: String,
    /// Whether the pod was its last subscriber (its SVID is to be dropped).
    pub last: bool,
}

impl Subscriptions {
    pub(crate) fn new() -> Self {
        Self {
            by_pod: JournaledMap::new(),
            subscribers: HashMap::new(),
        }
    }

    /// `key`'s SPIFFE ID.
    pub(crate) fn get(&self, key: &PodKey) -> Option<&String> {
        self.by_pod.get(key)
    }

    /// The subscriptions as they are now (for the published view).
    pub(crate) fn snapshot(&self) -> Snapshot<PodKey, String> {
        self.by_pod.snapshot()
    }

    /// Subscribes `key` to `id`. When `key` was subscribed to another ID, the ID it left
    /// (and whether it was that ID's last subscriber).
    pub(crate) fn insert(&mut self, key: PodKey, id: String) -> Option<Left> {
        if self.by_pod.get(&key) == Some(&id) {
            return None;
        }
        *self.subscribers.entry(id.clone()).or_default() += 1;
        let previous = self.by_pod.insert(key, id)?;
        Some(self.leave(previous))
    }

    /// Removes `key`'s subscription: the ID it had, and whether `key` was its last
    /// subscriber. `None` if `key` had none.
    pub(crate) fn remove(&mut self, key: &PodKey) -> Option<Left> {
        let id = self.by_pod.remove(key)?;
        Some(self.leave(id))
    }

    /// Whether any pod is subscribed to `id`.
    pub(crate) fn has_subscribers(&self, id: &str) -> bool {
        self.subscribers.contains_key(id)
    }

    fn leave(&mut self, id: String) -> Left {
        let last = match self.subscribers.get_mut(&id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.subscribers.remove(&id);
                true
            }
        };
        Left { id, last }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u8) -> PodKey {
        PodKey::new(format!("ctr-{i}"), "eth0")
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..12u8, 0..4u8).prop_map(|(k, id)| Op::Insert(k, id)),
            (0..12u8).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Over any sequence of subscribes and unsubscribes, an ID a pod leaves is
        /// reported as left by its last subscriber exactly when no other pod is
        /// subscribed to it (what the scan of every subscription answered), and the
        /// subscriptions are those a plain map would hold.
        #[test]
        fn last_subscriber_is_reported_exactly_when_no_other_pod_has_the_id(
            ops in proptest::collection::vec(op(), 1..200)
        ) {
            let mut subs = Subscriptions::new();
            let mut model: std::collections::BTreeMap<PodKey, String> = Default::default();
            for op in ops {
                let (left, expected_id) = match op {
                    Op::Insert(k, id) => {
                        let id = format!("spiffe://td/ns/default/sa/sa-{id}");
                        let before = model.insert(key(k), id.clone());
                        let changed = before.as_ref() != Some(&id);
                        (subs.insert(key(k), id), before.filter(|_| changed))
                    }
                    Op::Remove(k) => (subs.remove(&key(k)), model.remove(&key(k))),
                };
                match (left, expected_id) {
                    (None, None) => {}
                    (Some(left), Some(id)) => {
                        prop_assert_eq!(&left.id, &id);
                        let others = model.values().any(|v| *v == id);
                        prop_assert_eq!(left.last, !others, "{} left; others hold it: {}", id, others);
                    }
                    (got, want) => prop_assert!(false, "left {:?}, expected {:?}", got, want),
                }
                let held: std::collections::BTreeMap<PodKey, String> = subs
                    .snapshot()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                prop_assert_eq!(&held, &model);
            }
        }
    }
}
