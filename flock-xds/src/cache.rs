//! The snapshot cache: one [`Publisher`] of a [`ResourceSet`] per node group.
//!
//! A node is mapped to a group by a [`NodeHash`] (go-control-plane's `NodeHash`): by
//! default its ID ([`ById`]), or anything the embedding control plane chooses (a
//! closure `Fn(&NodeInfo) -> String` works). Every group is one
//! [`flock_core::snapshot::Publisher`], so versions of a group follow content order
//! (R1) and published sets are immutable (R2); a stream subscribes to its group
//! with [`Publisher::add_sink`] or [`Publisher::wait_newer`] and feeds the snapshots to
//! its protocol machine, which coalesces to the newest.
//!
//! Version 0 of a group is "not set yet": streams send nothing until the first
//! [`set_snapshot`](Cache::set_snapshot) or [`update`](Cache::update), so a client
//! that connects before its configuration exists waits instead of being initialized
//! with nothing.

use crate::callbacks::NodeInfo;
use flock_core::resources::{Name, ResourceSet};
use flock_core::snapshot::{Publisher, Snapshot};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use flock_core::sync::{Mutex, MutexGuard};

/// Chooses the group whose snapshot a node receives.
pub trait NodeHash: Send + Sync {
    /// The group of `node`.
    fn group(&self, node: &NodeInfo) -> String;
}

/// Groups nodes by their ID: every node has its own snapshot.
#[derive(Debug, Clone, Copy, Default)]
pub struct ById;

impl NodeHash for ById {
    fn group(&self, node: &NodeInfo) -> String {
        node.id.clone()
    }
}

impl<F: Fn(&NodeInfo) -> String + Send + Sync> NodeHash for F {
    fn group(&self, node: &NodeInfo) -> String {
        self(node)
    }
}

/// Names the resources a resource refers to, so the cache can check a snapshot is
/// self-consistent without decoding protos itself. For Envoy resources: a cluster's
/// EDS service name (or its own name for EDS clusters), a listener's RDS route
/// configuration names, secrets named by transport sockets…
pub trait References<V> {
    /// Calls `refer(type_url, name)` for every resource `value` (of `type_url`) refers to.
    fn references(&self, type_url: &str, value: &V, refer: &mut dyn FnMut(&str, &str));
}

impl<V, F: Fn(&str, &V, &mut dyn FnMut(&str, &str))> References<V> for F {
    fn references(&self, type_url: &str, value: &V, refer: &mut dyn FnMut(&str, &str)) {
        self(type_url, value, refer)
    }
}

/// One reference to a resource that is not in the set.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MissingReference {
    /// Type of the referring resource.
    pub from_type: Name,
    /// Name of the referring resource.
    pub from_name: Name,
    /// Type of the missing resource.
    pub to_type: Name,
    /// Name of the missing resource.
    pub to_name: Name,
}

impl fmt::Display for MissingReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:?} refers to {} {:?}, which does not exist",
            crate::types::short_name(&self.from_type),
            self.from_name,
            crate::types::short_name(&self.to_type),
            self.to_name
        )
    }
}

/// A snapshot that refers to resources it does not contain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inconsistent snapshot: {} missing reference(s), first: {}", .missing.len(), .missing[0])]
pub struct ConsistencyError {
    /// Every missing reference, sorted (never empty).
    pub missing: Vec<MissingReference>,
}

/// Checks that every resource `refs` names exists in `set`. O(resources).
pub fn check_consistency<V>(
    set: &ResourceSet<V>,
    refs: &impl References<V>,
) -> Result<(), ConsistencyError> {
    let mut missing = Vec::new();
    for type_url in set.type_urls() {
        for (name, entry) in set.iter_type(type_url) {
            refs.references(type_url, entry.value(), &mut |to_type, to_name| {
                if set.get(to_type, to_name).is_none() {
                    missing.push(MissingReference {
                        from_type: type_url.clone(),
                        from_name: name.clone(),
                        to_type: Name::from(to_type),
                        to_name: Name::from(to_name),
                    });
                }
            });
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        missing.sort();
        missing.dedup();
        Err(ConsistencyError { missing })
    }
}

/// The group publisher type.
pub type GroupPublisher<V> = Publisher<ResourceSet<V>>;

/// Per-group snapshots. See the module docs.
pub struct Cache<V> {
    hash: Box<dyn NodeHash>,
    groups: Mutex<BTreeMap<String, Arc<GroupPublisher<V>>>>,
}

impl<V> Cache<V> {
    /// A cache grouping nodes with `hash`.
    pub fn new(hash: impl NodeHash + 'static) -> Self {
        Self {
            hash: Box::new(hash),
            groups: Mutex::new(BTreeMap::new()),
        }
    }

    /// A cache giving every node its own snapshot, keyed by node ID.
    pub fn by_node_id() -> Self {
        Self::new(ById)
    }

    /// The group of `node`.
    pub fn group_of(&self, node: &NodeInfo) -> String {
        self.hash.group(node)
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Arc<GroupPublisher<V>>>> {
        self.groups.lock()
    }

    /// The publisher of `group`, created empty (version 0: not set) on first use. A
    /// stream calls this with its node's group; publishers are never removed, so a
    /// stream and a later `set_snapshot` always meet on the same one.
    pub fn publisher(&self, group: &str) -> Arc<GroupPublisher<V>> {
        let mut groups = self.lock();
        if let Some(p) = groups.get(group) {
            return Arc::clone(p);
        }
        let p = Arc::new(Publisher::new(ResourceSet::new()));
        groups.insert(group.to_string(), Arc::clone(&p));
        p
    }

    /// The publisher of `node`'s group.
    pub fn publisher_for(&self, node: &NodeInfo) -> Arc<GroupPublisher<V>> {
        self.publisher(&self.group_of(node))
    }

    /// Replaces `group`'s snapshot with `set`. Prefer [`update`](Self::update) with
    /// an `edit()` of the previous set: streams then diff in O(changes).
    pub fn set_snapshot(&self, group: &str, set: ResourceSet<V>) -> Arc<Snapshot<ResourceSet<V>>> {
        self.publisher(group).publish(move |_| set)
    }

    /// Publishes the set `next` builds from `group`'s latest (under the group's
    /// publish lock: version order equals content order).
    pub fn update(
        &self,
        group: &str,
        next: impl FnOnce(&ResourceSet<V>) -> ResourceSet<V>,
    ) -> Arc<Snapshot<ResourceSet<V>>> {
        self.publisher(group).publish(next)
    }

    /// Like [`update`](Self::update), but publishes only if the new set passes
    /// [`check_consistency`]; otherwise nothing is published (no version consumed) and
    /// the error says which references are missing.
    pub fn update_checked(
        &self,
        group: &str,
        refs: &impl References<V>,
        next: impl FnOnce(&ResourceSet<V>) -> ResourceSet<V>,
    ) -> Result<Arc<Snapshot<ResourceSet<V>>>, ConsistencyError> {
        let mut error = None;
        let published = self.publisher(group).try_publish(|prev| {
            let set = next(prev);
            match check_consistency(&set, refs) {
                Ok(()) => Some(set),
                Err(e) => {
                    error = Some(e);
                    None
                }
            }
        });
        match (published, error) {
            (Some(snapshot), _) => Ok(snapshot),
            (None, Some(e)) => Err(e),
            (None, None) => unreachable!("try_publish publishes unless the closure said no"),
        }
    }

    /// The latest snapshot of `group`, if the group exists.
    pub fn snapshot(&self, group: &str) -> Option<Arc<Snapshot<ResourceSet<V>>>> {
        self.lock().get(group).map(|p| p.latest())
    }

    /// The groups that exist, in order.
    pub fn groups(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

impl<V> fmt::Debug for Cache<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("groups", &self.lock().len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE};
    use flock_core::ContentHash;

    /// Test resources: a value is the list of (type, name) it refers to.
    type Refs = Vec<(&'static str, &'static str)>;

    fn refs(_: &str, value: &Refs, refer: &mut dyn FnMut(&str, &str)) {
        for (t, n) in value {
            refer(t, n);
        }
    }

    fn put(b: &mut flock_core::resources::ResourceSetBuilder<Refs>, t: &str, n: &str, v: Refs) {
        b.upsert(t, n, ContentHash::of(format!("{n}{v:?}").as_bytes()), v);
    }

    #[test]
    fn nodes_in_one_group_share_a_publisher_and_a_custom_hash_chooses_the_group() {
        let cache: Cache<u32> = Cache::new(|n: &NodeInfo| n.cluster.clone());
        let a = NodeInfo {
            id: "a".into(),
            cluster: "web".into(),
            ..NodeInfo::default()
        };
        let b = NodeInfo {
            id: "b".into(),
            cluster: "web".into(),
            ..NodeInfo::default()
        };
        let p = cache.publisher_for(&a);
        assert_eq!(p.latest().version(), 0, "a new group is not set yet");
        cache.update("web", |s| {
            s.edit()
                .upsert(CLUSTER, "c", ContentHash::of(b"1"), 1)
                .build()
        });
        assert_eq!(cache.publisher_for(&b).latest().version(), 1);
        assert!(Arc::ptr_eq(&p, &cache.publisher_for(&b)));
        assert_eq!(cache.groups(), vec!["web".to_string()]);
        let by_id: Cache<u32> = Cache::by_node_id();
        assert_eq!(by_id.group_of(&a), "a");
    }

    #[test]
    fn a_consistent_snapshot_is_published() {
        let cache: Cache<Refs> = Cache::by_node_id();
        let snap = cache
            .update_checked("n", &refs, |s| {
                let mut b = s.edit();
                put(&mut b, CLUSTER, "c", vec![(ENDPOINT, "c")]);
                put(&mut b, ENDPOINT, "c", vec![]);
                put(&mut b, LISTENER, "l", vec![(ROUTE, "r")]);
                put(&mut b, ROUTE, "r", vec![(CLUSTER, "c")]);
                b.build()
            })
            .unwrap();
        assert_eq!(snap.version(), 1);
    }

    #[test]
    fn an_inconsistent_snapshot_is_refused_with_every_missing_reference() {
        let cache: Cache<Refs> = Cache::by_node_id();
        let err = cache
            .update_checked("n", &refs, |s| {
                let mut b = s.edit();
                put(&mut b, CLUSTER, "c", vec![(ENDPOINT, "c")]);
                put(&mut b, LISTENER, "l", vec![(ROUTE, "r"), (ROUTE, "r2")]);
                put(&mut b, ROUTE, "r2", vec![]);
                b.build()
            })
            .unwrap_err();
        let missing: Vec<(&str, &str, &str, &str)> = err
            .missing
            .iter()
            .map(|m| (&*m.from_type, &*m.from_name, &*m.to_type, &*m.to_name))
            .collect();
        assert_eq!(
            missing,
            vec![(CLUSTER, "c", ENDPOINT, "c"), (LISTENER, "l", ROUTE, "r")]
        );
        assert_eq!(
            err.to_string(),
            "inconsistent snapshot: 2 missing reference(s), first: cds \"c\" refers to eds \"c\", which does not exist"
        );
        assert_eq!(
            cache.snapshot("n").unwrap().version(),
            0,
            "nothing was published"
        );
    }
}
