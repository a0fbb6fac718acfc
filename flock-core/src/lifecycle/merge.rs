//! Loading stored pods into the live in-memory table: merge, never replace (R3).
//!
//! At startup the xDS side loads every stored pod (`GetAll`) and installs it in the
//! live table while the CNI server is already serving `AddPod`s. Replacing the table
//! wholesale with what was read would wipe an `AddPod` that wrote the table
//! between the read and the replacement (its pod would lose its mTLS identity
//! mapping until re-added). Here the load only *adds keys that are absent*: a key
//! already in memory was written by a concurrent `AddPod` and is newer than the
//! stored copy, so it is kept; nothing is removed or replaced.
//!
//! Known, bounded consequence: a pod *removed* between the load's store read and
//! its merge is re-added to memory from the stale read. That entry is not in the
//! store, so the orphan GC ([`crate::gc`], kind `XdsResource`) withdraws it after
//! its confirmation sweeps; the alternative (losing a live pod) is not repaired by
//! anything.
//!
//! [`PodTable`] packages the rule with a lock so the agent uses it rather than
//! re-implementing it; [`merge_loaded`] is the same rule on a plain map.
//!
//! # Example
//!
//! ```
//! # if flock_core::sync::LOOM { return; } // loom's primitives work only inside a model
//! use std::collections::BTreeMap;
//! use flock_core::lifecycle::merge::PodTable;
//!
//! let table = PodTable::new();
//! let stored = BTreeMap::from([("pod-a", "stored"), ("pod-b", "stored")]);
//! // An AddPod for pod-b lands after the store was read but before the merge.
//! table.insert("pod-b", "fresh");
//! let report = table.load_merge(stored);
//! assert_eq!(report.added, vec!["pod-a"]);
//! assert_eq!(report.kept, vec!["pod-b"]);
//! assert_eq!(table.snapshot()["pod-b"], "fresh");
//! ```

use std::collections::BTreeMap;

use crate::journal::{JournaledMap, Snapshot};
use crate::sync::{Mutex, lock};

/// What a merge did, keys sorted ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeReport<K> {
    /// Loaded keys that were absent and were added.
    pub added: Vec<K>,
    /// Loaded keys already present in memory (newer), left untouched.
    pub kept: Vec<K>,
}

// Manual impl: a derive would needlessly require `K: Default`.
impl<K> Default for MergeReport<K> {
    fn default() -> Self {
        Self {
            added: Vec::new(),
            kept: Vec::new(),
        }
    }
}

/// Merges `loaded` into `live`: inserts each loaded key that is absent, keeps every
/// key that is present (its value is newer), never removes anything.
pub fn merge_loaded<K, V>(
    live: &mut BTreeMap<K, V>,
    loaded: impl IntoIterator<Item = (K, V)>,
) -> MergeReport<K>
where
    K: Ord + Clone,
{
    // Re-introduces R3 so the loom test can show it catches it; never enabled in
    // builds: it replaces the table wholesale with what was loaded.
    if crate::reintroduced!("r3") {
        live.clear();
    }

    // Collecting first dedups the load (the last copy of a key wins) and sorts it,
    // so the report is sorted and a key is never both added and kept.
    let loaded: BTreeMap<K, V> = loaded.into_iter().collect();
    let mut report = MergeReport::default();
    for (key, value) in loaded {
        if live.contains_key(&key) {
            report.kept.push(key);
        } else {
            live.insert(key.clone(), value);
            report.added.push(key);
        }
    }
    report
}

/// A live pod table shared between the CNI server, the xDS side and background
/// loops. Every method takes the lock once; no caller code runs under it. The map is
/// persistent ([`imbl::OrdMap`]), so [`PodTable::shared`] hands out a consistent copy
/// in O(1) instead of copying every pod: the publish and the registry sync read the
/// whole table on every pod change.
#[derive(Debug)]
pub struct PodTable<K: Ord + Clone, V: Clone> {
    inner: Mutex<Table<K, V>>,
}

#[derive(Debug)]
struct Table<K: Ord + Clone, V: Clone> {
    /// Its version counts the changes (inserts, removes, each key a merge added), and
    /// its snapshots name the keys of the recent ones.
    pods: JournaledMap<K, V>,
}

impl<K: Ord + Clone, V: Clone> Default for PodTable<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Clone, V: Clone> PodTable<K, V> {
    /// An empty table.
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Table {
                pods: JournaledMap::new(),
            }),
        }
    }

    /// Inserts or updates a pod (the `AddPod` path); returns the previous value.
    pub fn insert(&self, key: K, value: V) -> Option<V> {
        lock(&self.inner).pods.insert(key, value)
    }

    /// Removes a pod (the `RemovePod` path); returns its value.
    pub fn remove(&self, key: &K) -> Option<V> {
        lock(&self.inner).pods.remove(key)
    }

    /// Whether the pod is in the table.
    pub fn contains(&self, key: &K) -> bool {
        lock(&self.inner).pods.contains_key(key)
    }

    /// Number of pods in the table.
    pub fn len(&self) -> usize {
        lock(&self.inner).pods.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        lock(&self.inner).pods.is_empty()
    }

    /// Counts the changes of the table: equal versions, equal tables (so a reader can
    /// keep what it derived from the table until the version moves).
    pub fn version(&self) -> u64 {
        lock(&self.inner).pods.version()
    }

    /// Merges pods loaded from storage (see [`merge_loaded`]): adds absent keys,
    /// keeps present ones, removes nothing.
    pub fn load_merge(&self, loaded: impl IntoIterator<Item = (K, V)>) -> MergeReport<K> {
        let mut guard = lock(&self.inner);
        // Once, at startup: the rule runs on a plain copy of the table, and the table
        // then becomes that copy key by key (so its journal names each change). The
        // rule only adds, so the first loop removes nothing unless the rule is broken
        // (the `r3` mutant empties the copy, and the table must lose its pods then too,
        // or the mutant would not re-introduce the race it stands for).
        let mut live: BTreeMap<K, V> = (*guard.pods).clone().into_iter().collect();
        let report = merge_loaded(&mut live, loaded);
        let gone: Vec<K> = guard
            .pods
            .keys()
            .filter(|k| !live.contains_key(*k))
            .cloned()
            .collect();
        for key in &gone {
            guard.pods.remove(key);
        }
        for key in &report.added {
            if let Some(value) = live.remove(key) {
                guard.pods.insert(key.clone(), value);
            }
        }
        report
    }

    /// The pod's value, cloned.
    pub fn get(&self, key: &K) -> Option<V> {
        lock(&self.inner).pods.get(key).cloned()
    }

    /// A consistent copy of the whole table.
    pub fn snapshot(&self) -> BTreeMap<K, V> {
        (*lock(&self.inner).pods).clone().into_iter().collect()
    }

    /// The whole table as a persistent map sharing the table's nodes (O(1)), with its
    /// [`PodTable::version`] and the keys of its recent changes
    /// ([`Snapshot::changed_since`]).
    pub fn shared(&self) -> Snapshot<K, V> {
        lock(&self.inner).pods.snapshot()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn merge_adds_absent_keys() {
        let mut live = BTreeMap::new();
        let r = merge_loaded(&mut live, [(2, "b"), (1, "a")]);
        assert_eq!(r.added, vec![1, 2]);
        assert!(r.kept.is_empty());
        assert_eq!(live, BTreeMap::from([(1, "a"), (2, "b")]));
    }

    #[test]
    fn merge_keeps_the_newer_in_memory_value() {
        let mut live = BTreeMap::from([(1, "fresh")]);
        let r = merge_loaded(&mut live, [(1, "stale")]);
        assert_eq!(r.kept, vec![1]);
        assert_eq!(live[&1], "fresh");
    }

    #[test]
    fn merge_never_removes_pods_missing_from_the_load() {
        let mut live = BTreeMap::from([(7, "added-during-startup")]);
        let r = merge_loaded(&mut live, Vec::<(i32, &str)>::new());
        assert_eq!(r, MergeReport::default());
        assert_eq!(live.len(), 1);
    }

    #[test]
    fn merge_report_is_sorted_and_deduplicated() {
        let mut live = BTreeMap::from([(5, 0)]);
        let r = merge_loaded(&mut live, [(9, 1), (5, 1), (3, 1), (9, 2), (5, 2)]);
        assert_eq!(r.added, vec![3, 9]);
        assert_eq!(r.kept, vec![5]);
        assert_eq!(live[&9], 2, "the last loaded copy of a key wins");
    }

    #[test]
    fn pod_table_load_merge_preserves_a_concurrent_add() {
        let t = PodTable::new();
        t.insert("new", 2);
        let r = t.load_merge([("old", 1), ("new", 0)]);
        assert_eq!(r.added, vec!["old"]);
        assert_eq!(r.kept, vec!["new"]);
        assert_eq!(t.get(&"new"), Some(2));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn pod_table_snapshots_name_the_keys_changed_between_them() {
        let t = PodTable::new();
        t.insert("a", 1);
        let early = t.shared();
        t.insert("b", 2);
        t.remove(&"a");
        t.remove(&"zz");
        t.load_merge([("c", 3), ("b", 0)]);
        let now = t.shared();
        let keys: Vec<_> = now.changed_since(&early).unwrap().copied().collect();
        assert_eq!(keys, vec!["b", "a", "c"]);
        assert_eq!(now.version(), t.version());
        assert_eq!(now.get(&"b"), Some(&2), "the merge kept the live value");
    }

    #[test]
    fn pod_table_basic_operations() {
        let t: PodTable<u32, &str> = PodTable::default();
        assert!(t.is_empty());
        assert_eq!(t.insert(1, "a"), None);
        assert_eq!(t.insert(1, "b"), Some("a"));
        assert!(t.contains(&1));
        assert_eq!(t.snapshot(), BTreeMap::from([(1, "b")]));
        assert_eq!(t.remove(&1), Some("b"));
        assert!(!t.contains(&1));
        assert_eq!(t.get(&1), None);
    }
}
