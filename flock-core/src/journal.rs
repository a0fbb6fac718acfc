//! A persistent ordered map that remembers which keys its recent changes touched, so
//! a reader holding an older snapshot finds what changed since without comparing the
//! two maps entry by entry.
//!
//! The agent derives per-pod state (registry endpoints, translation models) from the
//! pod table and the identity subscriptions, and re-derives only the pods whose
//! inputs changed since its last pass. Finding those pods by a merge walk of the two
//! snapshots costs one key comparison per pod, twice per pod change: at a thousand
//! pods that walk was a tenth of the agent's CPU per ADD. (`imbl`'s own diff, which
//! skips shared subtrees, is not used: it misses changed keys in deep trees.) Here
//! every change appends its key to a bounded journal that travels with each
//! snapshot, so [`Snapshot::changed_since`] reads the keys of the changes in
//! between: O(changes), or `None` when the journal no longer reaches back that far
//! and the reader must compare the maps.
//!
//! Only the owner ([`JournaledMap`], not `Clone`) changes the map, so a snapshot's
//! history is one line: two snapshots of the same owner ([`Snapshot::lineage`])
//! differ exactly by the journal's entries between their versions.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};

/// How many changes a snapshot remembers: a reader further behind compares maps.
pub const RECENT: usize = 1024;

/// Lineage ids: 0 is the default (ownerless) snapshot's. An id source, not
/// synchronization, so a plain std atomic (also under loom).
static NEXT_LINEAGE: AtomicU64 = AtomicU64::new(1);

/// An immutable state of a [`JournaledMap`]: the map (read through `Deref`), its
/// version, and the keys of its last changes (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Snapshot<K: Ord + Clone, V: Clone> {
    map: imbl::OrdMap<K, V>,
    lineage: u64,
    version: u64,
    /// The keys of changes `version - recent.len() + 1 ..= version`, in order.
    recent: imbl::Vector<K>,
}

impl<K: Ord + Clone, V: Clone> Default for Snapshot<K, V> {
    fn default() -> Self {
        Self {
            map: imbl::OrdMap::new(),
            lineage: 0,
            version: 0,
            recent: imbl::Vector::new(),
        }
    }
}

/// Equal maps, whatever their owners and journals.
impl<K: Ord + Clone, V: Clone + PartialEq> PartialEq for Snapshot<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl<K: Ord + Clone, V: Clone + Eq> Eq for Snapshot<K, V> {}

impl<K: Ord + Clone, V: Clone> Deref for Snapshot<K, V> {
    type Target = imbl::OrdMap<K, V>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<K: Ord + Clone, V: Clone> Snapshot<K, V> {
    /// Counts the owner's changes up to this snapshot.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Which owner this snapshot is of (0: none, a default snapshot).
    pub fn lineage(&self) -> u64 {
        self.lineage
    }

    /// The keys changed (inserted, replaced or removed, in that order, a key as often
    /// as it changed) between `earlier` and `self`, if both are of the same owner,
    /// `earlier` is not the newer one and the journal reaches back to it; `None`
    /// otherwise (the caller compares the maps). An empty iterator: the same state.
    pub fn changed_since<'a>(
        &'a self,
        earlier: &Snapshot<K, V>,
    ) -> Option<impl Iterator<Item = &'a K> + 'a> {
        if self.lineage != earlier.lineage || earlier.version > self.version {
            return None;
        }
        let behind = usize::try_from(self.version - earlier.version).ok()?;
        if behind > self.recent.len() {
            return None;
        }
        Some(self.recent.iter().skip(self.recent.len() - behind))
    }

    /// The map itself.
    pub fn map(&self) -> &imbl::OrdMap<K, V> {
        &self.map
    }
}

/// The owner of a journaled map: the only way to change it (see the
/// [module docs](self)). Reads go to the current map through `Deref`.
#[derive(Debug)]
pub struct JournaledMap<K: Ord + Clone, V: Clone> {
    now: Snapshot<K, V>,
}

impl<K: Ord + Clone, V: Clone> Default for JournaledMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Clone, V: Clone> Deref for JournaledMap<K, V> {
    type Target = imbl::OrdMap<K, V>;
    fn deref(&self) -> &Self::Target {
        &self.now.map
    }
}

impl<K: Ord + Clone, V: Clone> JournaledMap<K, V> {
    /// An empty map with a lineage of its own.
    pub fn new() -> Self {
        Self {
            now: Snapshot {
                lineage: NEXT_LINEAGE.fetch_add(1, Ordering::Relaxed),
                ..Snapshot::default()
            },
        }
    }

    fn record(&mut self, key: K) {
        self.now.version += 1;
        self.now.recent.push_back(key);
        if self.now.recent.len() > RECENT {
            self.now.recent.pop_front();
        }
    }

    /// Inserts or replaces `key`'s value (a change, even if equal); returns the
    /// previous value.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.record(key.clone());
        self.now.map.insert(key, value)
    }

    /// Removes `key`; a change only if it was present. Returns its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let removed = self.now.map.remove(key);
        if removed.is_some() {
            self.record(key.clone());
        }
        removed
    }

    /// Counts the changes so far.
    pub fn version(&self) -> u64 {
        self.now.version
    }

    /// The current state, sharing the map's nodes (O(1)).
    pub fn snapshot(&self) -> Snapshot<K, V> {
        self.now.clone()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn a_snapshot_names_the_keys_changed_after_an_earlier_one() {
        let mut m = JournaledMap::new();
        m.insert(1, "a");
        let early = m.snapshot();
        m.insert(2, "b");
        m.remove(&1);
        m.remove(&7); // absent: no change
        let now = m.snapshot();
        let keys: Vec<_> = now.changed_since(&early).unwrap().copied().collect();
        assert_eq!(keys, vec![2, 1]);
        assert_eq!(now.changed_since(&now).unwrap().count(), 0);
        assert!(
            early.changed_since(&now).is_none(),
            "the newer one as earlier"
        );
        assert_eq!(now.get(&2), Some(&"b"));
    }

    #[test]
    fn another_owner_or_a_journal_that_does_not_reach_back_names_nothing() {
        let mut a = JournaledMap::new();
        let mut b = JournaledMap::new();
        a.insert(1, ());
        b.insert(1, ());
        assert!(a.snapshot().changed_since(&b.snapshot()).is_none());
        assert!(a.snapshot().changed_since(&Snapshot::default()).is_none());
        let early = a.snapshot();
        for i in 0..RECENT {
            a.insert(i as i32, ());
        }
        assert_eq!(a.snapshot().changed_since(&early).unwrap().count(), RECENT);
        a.insert(-1, ());
        assert!(a.snapshot().changed_since(&early).is_none());
    }

    proptest::proptest! {
        /// Between any two snapshots whose distance the journal covers, the named
        /// keys are exactly the keys inserted or removed in between; a key whose
        /// value differs between the two maps is always among them.
        #[test]
        fn the_keys_named_are_the_keys_changed_in_between(
            ops in proptest::collection::vec((proptest::bool::ANY, 0u8..16, 0u8..4), 0..200),
            a in 0usize..200,
            b in 0usize..200,
        ) {
            let mut m = JournaledMap::new();
            let mut snaps = vec![m.snapshot()];
            let mut touched = vec![None];
            for (insert, k, v) in &ops {
                if *insert {
                    m.insert(*k, *v);
                    touched.push(Some(*k));
                } else {
                    touched.push(m.remove(k).map(|_| *k));
                }
                snaps.push(m.snapshot());
            }
            let (a, b) = (a.min(ops.len()), b.min(ops.len()));
            let (lo, hi) = (a.min(b), a.max(b));
            let named: Vec<u8> = snaps[hi].changed_since(&snaps[lo]).unwrap().copied().collect();
            let want: Vec<u8> = touched[lo + 1..=hi].iter().flatten().copied().collect();
            proptest::prop_assert_eq!(&named, &want);
            let named: BTreeSet<u8> = named.into_iter().collect();
            for k in 0u8..16 {
                if snaps[lo].get(&k) != snaps[hi].get(&k) {
                    proptest::prop_assert!(named.contains(&k));
                }
            }
        }
    }
}
