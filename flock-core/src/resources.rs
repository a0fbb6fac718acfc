//! Typed resource sets and their diff: what Delta xDS sends, and nothing more.
//!
//! A [`ResourceSet`] maps a type URL (e.g.
//! `type.googleapis.com/envoy.config.cluster.v3.Cluster`) to resource names, and each
//! name to an [`Entry`]: the resource's [`ContentHash`] and its value. The content hash
//! *is* the resource's version, so a resource whose bytes did not change keeps its
//! version and is never resent — an xDS client that reconnects with
//! `initial_resource_versions` gets exactly what it lacks.
//!
//! **Cost of a change.** go-control-plane re-marshals and re-hashes every resource on
//! every delta snapshot: O(all resources) per change. Here the caller hashes a resource
//! once, when it builds it, and a set derived from the previous one with
//! [`ResourceSet::edit`] remembers which names the builder touched, with their hashes
//! before and after. [`diff`] of a set against the set it was derived from reads only
//! that journal: O(k) for k changes, whatever the number of resources. Any other pair
//! of sets is diffed by a merge walk that skips every type whose map is shared
//! (`Arc::ptr_eq`), so it is O(size of the types that differ). `benches/resources.rs` measures both against re-hashing everything.
//!
//! **Immutability (race R2).** Maps and values are behind `Arc`s and a built set
//! has no mutating method: a builder copies the map of a type the first time it changes
//! it (copy-on-write), so a set that a stream is encoding is never touched.
//!
//! ```
//! use flock_core::ContentHash;
//! use flock_core::resources::{ResourceSet, diff};
//!
//! const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
//! let v1 = ResourceSet::new()
//!     .edit()
//!     .upsert(CLUSTER, "svc-a", ContentHash::of(b"a1"), "a1".to_string())
//!     .upsert(CLUSTER, "svc-b", ContentHash::of(b"b1"), "b1".to_string())
//!     .build();
//! let v2 = v1
//!     .edit()
//!     .upsert(CLUSTER, "svc-a", ContentHash::of(b"a1"), "a1".to_string()) // same bytes: no change
//!     .upsert(CLUSTER, "svc-b", ContentHash::of(b"b2"), "b2".to_string())
//!     .remove(CLUSTER, "svc-c") // absent: no change
//!     .build();
//! let d = diff(&v1, &v2);
//! let clusters = &d.types[CLUSTER];
//! assert!(clusters.added.is_empty());
//! assert_eq!(clusters.changed, vec!["svc-b".into()]);
//! assert!(clusters.removed.is_empty());
//! ```

use crate::ContentHash;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

/// A resource name or type URL, cheap to clone (sets share names between versions).
pub type Name = Arc<str>;

/// One resource: its content hash (its version) and its value.
#[derive(Debug)]
pub struct Entry<V> {
    hash: ContentHash,
    value: Arc<V>,
}

impl<V> Entry<V> {
    /// The content hash: the resource's version.
    pub fn hash(&self) -> ContentHash {
        self.hash
    }

    /// The resource.
    pub fn value(&self) -> &Arc<V> {
        &self.value
    }
}

impl<V> Clone for Entry<V> {
    fn clone(&self) -> Self {
        Self {
            hash: self.hash,
            value: Arc::clone(&self.value),
        }
    }
}

/// One type's resources: a persistent (structurally shared) ordered map, so a set
/// derived from another shares every node but the O(log n) ones on the paths to the
/// changed names. Deriving a set and dropping its predecessor therefore cost
/// O(changes × log n), not a copy of the type's whole map.
type TypeMap<V> = imbl::OrdMap<Name, Entry<V>>;

/// Identity of one built set, so a later set can say which set it was derived from.
/// Held by `Arc`: while any set or journal refers to it, its address is unique.
#[derive(Debug)]
struct Stamp;

/// What a builder did to one name: its hash in the parent set and in the built one
/// (`None`: absent). Recording both makes the journal diff free of map lookups: at
/// 10,000 resources each lookup is a walk over cold tree nodes and keys, and a diff
/// is taken once per publish and per stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Touch {
    before: Option<ContentHash>,
    after: Option<ContentHash>,
}

/// Type URL → name → what the builder did to it.
type Touched = BTreeMap<Name, BTreeMap<Name, Touch>>;

/// Which names a builder touched, relative to the set it started from.
#[derive(Debug, Clone)]
struct Journal {
    parent: Arc<Stamp>,
    touched: Touched,
}

/// An immutable set of typed resources. See the module docs.
pub struct ResourceSet<V> {
    types: BTreeMap<Name, TypeMap<V>>,
    stamp: Arc<Stamp>,
    journal: Option<Journal>,
}

impl<V> Clone for ResourceSet<V> {
    /// A clone is the same set: it shares maps, stamp and journal, so diffs against it
    /// behave exactly as against the original.
    fn clone(&self) -> Self {
        Self {
            types: self.types.clone(),
            stamp: Arc::clone(&self.stamp),
            journal: self.journal.clone(),
        }
    }
}

impl<V> Default for ResourceSet<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> fmt::Debug for ResourceSet<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (type_url, names) in &self.types {
            map.entry(type_url, &names.len());
        }
        map.finish()
    }
}

impl<V> ResourceSet<V> {
    /// The empty set.
    pub fn new() -> Self {
        Self {
            types: BTreeMap::new(),
            stamp: Arc::new(Stamp),
            journal: None,
        }
    }

    /// A builder for a new set derived from this one.
    pub fn edit(&self) -> ResourceSetBuilder<V> {
        ResourceSetBuilder {
            types: self.types.clone(),
            parent: Arc::clone(&self.stamp),
            touched: BTreeMap::new(),
        }
    }

    /// The entry for `name` of type `type_url`.
    pub fn get(&self, type_url: &str, name: &str) -> Option<&Entry<V>> {
        self.types.get(type_url)?.get(name)
    }

    /// The resources of one type, in name order.
    pub fn iter_type<'a>(
        &'a self,
        type_url: &str,
    ) -> impl Iterator<Item = (&'a Name, &'a Entry<V>)> + 'a {
        self.types.get(type_url).into_iter().flat_map(|m| m.iter())
    }

    /// The type URLs that have at least one resource, in order.
    pub fn type_urls(&self) -> impl Iterator<Item = &Name> {
        self.types.keys()
    }

    /// Number of resources of one type.
    pub fn len_of(&self, type_url: &str) -> usize {
        self.types.get(type_url).map_or(0, |m| m.len())
    }

    /// Number of resources of all types.
    pub fn len(&self) -> usize {
        self.types.values().map(|m| m.len()).sum()
    }

    /// Whether the set holds no resource.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    /// Whether `self` and `other` hold the same names with the same hashes.
    pub fn same_content(&self, other: &Self) -> bool {
        diff(self, other).is_empty()
    }
}

/// Builds a [`ResourceSet`] from a previous one, recording what it touches.
pub struct ResourceSetBuilder<V> {
    types: BTreeMap<Name, TypeMap<V>>,
    parent: Arc<Stamp>,
    touched: Touched,
}

impl<V> ResourceSetBuilder<V> {
    /// Inserts or replaces a resource. If a resource with the same name and hash is
    /// already there, nothing changes (its version stays, it is not resent).
    pub fn upsert(&mut self, type_url: &str, name: &str, hash: ContentHash, value: V) -> &mut Self {
        self.upsert_shared(type_url, name, hash, Arc::new(value))
    }

    /// Like [`upsert`](Self::upsert) for a value that is already shared.
    pub fn upsert_shared(
        &mut self,
        type_url: &str,
        name: &str,
        hash: ContentHash,
        value: Arc<V>,
    ) -> &mut Self {
        // One lookup decides both "unchanged" and which key to reuse.
        let (key, before) = match self.types.get(type_url).and_then(|m| m.get_key_value(name)) {
            Some((_, e)) if e.hash == hash => return self,
            Some((k, e)) => (Arc::clone(k), Some(e.hash)),
            None => (Name::from(name), None),
        };
        let (type_key, map) = self.type_map_mut(type_url);
        map.insert(Arc::clone(&key), Entry { hash, value });
        self.record(type_key, key, before, Some(hash));
        self
    }

    /// Removes a resource if present.
    pub fn remove(&mut self, type_url: &str, name: &str) -> &mut Self {
        if !self
            .types
            .get(type_url)
            .is_some_and(|m| m.contains_key(name))
        {
            return self;
        }
        let (type_key, map) = self.type_map_mut(type_url);
        if let Some((name, entry)) = map.remove_with_key(name) {
            self.record(type_key, name, Some(entry.hash), None);
        }
        self
    }

    /// Journals one write. `before` is the name's hash in the builder before it, which
    /// at the first write of a name is its hash in the parent set.
    fn record(
        &mut self,
        type_url: Name,
        name: Name,
        before: Option<ContentHash>,
        after: Option<ContentHash>,
    ) {
        self.touched
            .entry(type_url)
            .or_default()
            .entry(name)
            .or_insert(Touch { before, after })
            .after = after;
    }

    /// Makes `resources` the complete contents of one type: upserts each and removes
    /// every other name of that type. Unchanged resources keep their versions.
    pub fn replace_type<I>(&mut self, type_url: &str, resources: I) -> &mut Self
    where
        I: IntoIterator<Item = (Name, ContentHash, Arc<V>)>,
    {
        let mut keep = BTreeSet::new();
        for (name, hash, value) in resources {
            self.upsert_shared(type_url, &name, hash, value);
            keep.insert(name);
        }
        let stale: Vec<Name> = self
            .types
            .get(type_url)
            .map(|m| m.keys().filter(|n| !keep.contains(*n)).cloned().collect())
            .unwrap_or_default();
        for name in stale {
            self.remove(type_url, &name);
        }
        self
    }

    /// Finishes the set. The builder stays usable: building again (after more edits)
    /// gives another set derived from the same parent.
    pub fn build(&mut self) -> ResourceSet<V> {
        // Cloning a persistent map copies one root pointer per type, not the resources.
        let mut types = self.types.clone();
        types.retain(|_, m| !m.is_empty());
        ResourceSet {
            types,
            stamp: Arc::new(Stamp),
            journal: Some(Journal {
                parent: Arc::clone(&self.parent),
                touched: self.touched.clone(),
            }),
        }
    }

    /// The map of one type, copied on first write if a published set shares it.
    fn type_map_mut(&mut self, type_url: &str) -> (Name, &mut TypeMap<V>) {
        let key: Name = match self.types.get_key_value(type_url) {
            Some((k, _)) => Arc::clone(k),
            None => Name::from(type_url),
        };
        // Writing to a shared map copies only the nodes on the path to the written
        // name (`Entry` clones by `Arc` for any `V`: pointers, not resources).
        let map = self.types.entry(Arc::clone(&key)).or_default();
        (key, map)
    }
}

/// What changed in one type between two sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TypeDiff {
    /// Names present only in the newer set.
    pub added: Vec<Name>,
    /// Names present in both with different hashes.
    pub changed: Vec<Name>,
    /// Names present only in the older set.
    pub removed: Vec<Name>,
}

impl TypeDiff {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }
}

/// What changed between two sets, per type; types without changes are absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    /// Type URL → changes of that type. Names are sorted within each list.
    pub types: BTreeMap<Name, TypeDiff>,
}

impl Diff {
    /// Whether the two sets had the same content.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }
}

/// The changes that turn `prev` into `next`. See the module docs for its cost.
pub fn diff<V>(prev: &ResourceSet<V>, next: &ResourceSet<V>) -> Diff {
    if Arc::ptr_eq(&prev.stamp, &next.stamp) {
        return Diff::default();
    }
    match &next.journal {
        Some(journal) if Arc::ptr_eq(&journal.parent, &prev.stamp) => {
            diff_touched(&journal.touched)
        }
        _ => diff_full(prev, next),
    }
}

/// The changes between any two sets by a merge walk over every type that is not
/// shared between them. [`diff`] uses this when `next` was not derived from `prev`.
pub fn diff_full<V>(prev: &ResourceSet<V>, next: &ResourceSet<V>) -> Diff {
    let mut out = Diff::default();
    let type_urls: BTreeSet<&Name> = prev.types.keys().chain(next.types.keys()).collect();
    let empty = TypeMap::new();
    for type_url in type_urls {
        let before = prev.types.get(type_url);
        let after = next.types.get(type_url);
        if let (Some(b), Some(a)) = (before, after)
            && b.ptr_eq(a)
        {
            continue;
        }
        let before = before.unwrap_or(&empty);
        let after = after.unwrap_or(&empty);
        let mut td = TypeDiff::default();
        let mut b = before.iter().peekable();
        let mut a = after.iter().peekable();
        loop {
            match (b.peek(), a.peek()) {
                (None, None) => break,
                (Some((bn, _)), None) => {
                    td.removed.push(Arc::clone(bn));
                    b.next();
                }
                (None, Some((an, _))) => {
                    td.added.push(Arc::clone(an));
                    a.next();
                }
                (Some((bn, be)), Some((an, ae))) => match bn.cmp(an) {
                    std::cmp::Ordering::Less => {
                        td.removed.push(Arc::clone(bn));
                        b.next();
                    }
                    std::cmp::Ordering::Greater => {
                        td.added.push(Arc::clone(an));
                        a.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if be.hash != ae.hash {
                            td.changed.push(Arc::clone(an));
                        }
                        b.next();
                        a.next();
                    }
                },
            }
        }
        if !td.is_empty() {
            out.types.insert(Arc::clone(type_url), td);
        }
    }
    out
}

/// The diff from the journal alone: `next` was built from `prev`, and the journal
/// holds each touched name's hash in both.
fn diff_touched(touched: &Touched) -> Diff {
    let mut out = Diff::default();
    for (type_url, names) in touched {
        let mut td = TypeDiff::default();
        for (name, touch) in names {
            match (touch.before, touch.after) {
                (None, Some(_)) => td.added.push(Arc::clone(name)),
                (Some(_), None) => td.removed.push(Arc::clone(name)),
                (Some(b), Some(a)) if b != a => td.changed.push(Arc::clone(name)),
                // Touched and then restored, or added and removed again.
                _ => {}
            }
        }
        if !td.is_empty() {
            out.types.insert(Arc::clone(type_url), td);
        }
    }
    out
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const E: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    fn h(s: &str) -> ContentHash {
        ContentHash::of(s.as_bytes())
    }

    fn names(v: &[Name]) -> Vec<&str> {
        v.iter().map(|n| n.as_ref()).collect()
    }

    #[test]
    fn unchanged_upsert_keeps_the_entry_and_reports_nothing() {
        let v1 = ResourceSet::new()
            .edit()
            .upsert(T, "a", h("1"), 1u32)
            .build();
        let v2 = v1.edit().upsert(T, "a", h("1"), 99u32).build();
        assert!(diff(&v1, &v2).is_empty());
        assert_eq!(
            **v2.get(T, "a").unwrap().value(),
            1,
            "the published value was kept"
        );
    }

    #[test]
    fn derived_diff_reports_added_changed_removed() {
        let v1 = ResourceSet::new()
            .edit()
            .upsert(T, "a", h("a"), ())
            .upsert(T, "b", h("b"), ())
            .upsert(E, "a", h("ea"), ())
            .build();
        let v2 = v1
            .edit()
            .upsert(T, "b", h("b2"), ())
            .upsert(T, "c", h("c"), ())
            .remove(E, "a")
            .build();
        let d = diff(&v1, &v2);
        assert_eq!(names(&d.types[T].added), ["c"]);
        assert_eq!(names(&d.types[T].changed), ["b"]);
        assert_eq!(names(&d.types[E].removed), ["a"]);
        assert_eq!(
            d,
            diff_full(&v1, &v2),
            "journal diff agrees with the full walk"
        );
        assert!(
            v2.len_of(E) == 0 && !v2.type_urls().any(|t| t.as_ref() == E),
            "empty types are dropped"
        );
    }

    #[test]
    fn touched_then_restored_is_not_a_change() {
        let v1 = ResourceSet::new().edit().upsert(T, "a", h("a"), ()).build();
        let v2 = v1
            .edit()
            .remove(T, "a")
            .upsert(T, "a", h("a"), ())
            .upsert(T, "x", h("x"), ())
            .remove(T, "x")
            .build();
        assert!(diff(&v1, &v2).is_empty());
    }

    #[test]
    fn building_does_not_touch_the_published_set() {
        let v1 = ResourceSet::new()
            .edit()
            .upsert(T, "a", h("a"), 1u32)
            .build();
        let _v2 = v1
            .edit()
            .upsert(T, "a", h("b"), 2u32)
            .remove(T, "a")
            .build();
        assert_eq!(v1.get(T, "a").unwrap().hash(), h("a"));
        assert_eq!(**v1.get(T, "a").unwrap().value(), 1);
    }

    #[test]
    fn diff_between_unrelated_sets_uses_the_full_walk() {
        let a = ResourceSet::new().edit().upsert(T, "a", h("a"), ()).build();
        let b = ResourceSet::new().edit().upsert(T, "b", h("b"), ()).build();
        let d = diff(&a, &b);
        assert_eq!(names(&d.types[T].added), ["b"]);
        assert_eq!(names(&d.types[T].removed), ["a"]);
        // Reverse direction: `a` was not derived from `b` either.
        let r = diff(&b, &a);
        assert_eq!(names(&r.types[T].added), ["a"]);
    }

    #[test]
    fn replace_type_removes_names_not_listed() {
        let v1 = ResourceSet::new()
            .edit()
            .upsert(T, "a", h("a"), ())
            .upsert(T, "b", h("b"), ())
            .build();
        let v2 = v1
            .edit()
            .replace_type(
                T,
                [
                    (Name::from("b"), h("b"), Arc::new(())),
                    (Name::from("c"), h("c"), Arc::new(())),
                ],
            )
            .build();
        let d = diff(&v1, &v2);
        assert_eq!(names(&d.types[T].removed), ["a"]);
        assert_eq!(names(&d.types[T].added), ["c"]);
        assert!(d.types[T].changed.is_empty());
    }

    #[test]
    fn a_set_diffed_with_itself_or_its_clone_is_empty() {
        let v1 = ResourceSet::new().edit().upsert(T, "a", h("a"), ()).build();
        assert!(diff(&v1, &v1).is_empty());
        assert!(diff(&v1, &v1.clone()).is_empty());
        assert!(v1.same_content(&v1.clone()));
    }
}
