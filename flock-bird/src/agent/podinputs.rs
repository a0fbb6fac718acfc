//! What a per-pod derivation reads (the pod table and each pod's SPIFFE ID), kept
//! from one pass to the next so the next pass visits only the pods whose inputs
//! changed.
//!
//! The registry sync's desired endpoints and the publish's pod models are each
//! derived per pod from the pod's record and its SPIFFE ID. Both used to visit
//! every pod on every change of the table or the identity view (which changes on
//! every ADD: the pod subscribes), with several map lookups per pod, so an ADD cost
//! O(pods) tree descents. Both inputs are journaled persistent maps
//! ([`flock_core::journal`]), so keeping last pass's copies is O(1), and each copy
//! names the keys changed since an earlier one: the changed pods are found in
//! O(changes). When a journal does not reach back that far (a pass that missed more
//! than [`flock_core::journal::RECENT`] changes), a merge walk of the two copies
//! finds them with one key comparison per pod and no lookups. (The walk alone, one
//! comparison per pod, twice per ADD, was a tenth of the agent's CPU per ADD at a
//! thousand pods.)

use crate::identity::IdentityView;
use crate::model::PodRecord;
use flock_core::journal::Snapshot;
use flock_core::pod::PodKey;
use std::collections::BTreeSet;
use std::sync::Arc;

/// One pass's inputs (see the [module docs](self)).
#[derive(Clone, Default)]
pub(super) struct PodInputs {
    /// The pod table.
    pub(super) table: Snapshot<PodKey, Arc<PodRecord>>,
    /// Which SPIFFE ID each subscribed pod has.
    subscriptions: Snapshot<PodKey, String>,
    /// The SPIFFE IDs that have an SVID, sorted: a pod's SPIFFE ID counts only once
    /// its SVID is issued ([`IdentityView::svid_of`]). Only the IDs are kept, not the
    /// SVIDs: a pass must not keep an old view's private keys alive.
    issued: Arc<Vec<String>>,
}

impl PodInputs {
    /// The inputs now: `table` and the identity view's subscriptions and issued IDs.
    /// `prev`'s list of issued IDs is reused when it is the same (the common case:
    /// no allocation).
    pub(super) fn new(
        table: Snapshot<PodKey, Arc<PodRecord>>,
        identity: Option<&IdentityView>,
        prev: Option<&PodInputs>,
    ) -> Self {
        let Some(view) = identity else {
            return Self {
                table,
                ..Self::default()
            };
        };
        let same = prev.is_some_and(|p| {
            p.issued.len() == view.svids.len()
                && p.issued.iter().zip(view.svids.keys()).all(|(a, b)| a == b)
        });
        let issued = match prev {
            Some(p) if same => Arc::clone(&p.issued),
            _ => Arc::new(view.svids.keys().cloned().collect()),
        };
        Self {
            table,
            subscriptions: view.subscriptions.clone(),
            issued,
        }
    }

    /// The SPIFFE ID `key`'s pod has: subscribed, and its SVID issued.
    pub(super) fn spiffe_id(&self, key: &PodKey) -> Option<&str> {
        self.subscriptions
            .get(key)
            .filter(|id| self.issued.binary_search(id).is_ok())
            .map(String::as_str)
    }

    /// The pods whose record (by value) or SPIFFE ID may differ between `prev` and
    /// `self`: a superset of the pods whose derivation can differ. A pod whose record
    /// was replaced by an equal one is not named (its derivation is the same).
    pub(super) fn changed_since(&self, prev: &PodInputs) -> BTreeSet<PodKey> {
        let mut changed = BTreeSet::new();
        changed_keys(
            &prev.table,
            &self.table,
            |a, b| Arc::ptr_eq(a, b) || a == b,
            &mut changed,
        );
        changed_keys(
            &prev.subscriptions,
            &self.subscriptions,
            |a, b| a == b,
            &mut changed,
        );
        if !Arc::ptr_eq(&self.issued, &prev.issued) {
            // An SVID issued or gone changes the SPIFFE ID of every pod subscribed to
            // it: rare (an identity's first pod, or its last one leaving), so the
            // subscriptions are scanned.
            let was: BTreeSet<&String> = prev.issued.iter().collect();
            let is: BTreeSet<&String> = self.issued.iter().collect();
            let flipped: BTreeSet<&String> = was.symmetric_difference(&is).copied().collect();
            if !flipped.is_empty() {
                for (key, id) in prev.subscriptions.iter().chain(self.subscriptions.iter()) {
                    if flipped.contains(id) {
                        changed.insert(key.clone());
                    }
                }
            }
        }
        changed
    }
}

/// Adds to `out` every key whose entry differs between `a` and `b` (added, removed,
/// or a value not `same`): the keys `b`'s journal names since `a` whose entries
/// differ, or, when the journal does not reach back to `a`, [`diff_keys`].
pub(super) fn changed_keys<K: Ord + Clone, V: Clone>(
    a: &Snapshot<K, V>,
    b: &Snapshot<K, V>,
    same: impl Fn(&V, &V) -> bool,
    out: &mut BTreeSet<K>,
) {
    if a.ptr_eq(b) {
        return;
    }
    match b.changed_since(a) {
        Some(keys) => {
            for key in keys {
                let differs = match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => !same(x, y),
                    (None, None) => false,
                    _ => true,
                };
                if differs {
                    out.insert(key.clone());
                }
            }
        }
        _ => diff_keys(a.iter(), b.iter(), same, out),
    }
}

/// Adds to `out` every key whose entry differs between the sorted maps `a` and `b`
/// (added, removed, or a value not `same`): a merge walk, one key comparison per
/// entry and no lookups. (`imbl`'s own `diff`, which skips shared subtrees, missed
/// changed keys in a table of 2,000 pods: `every_changed_pod_is_named_in_a_big_table`.)
pub(super) fn diff_keys<'a, K: Ord + Clone + 'a, V: 'a>(
    a: impl Iterator<Item = (&'a K, &'a V)>,
    b: impl Iterator<Item = (&'a K, &'a V)>,
    same: impl Fn(&V, &V) -> bool,
    out: &mut BTreeSet<K>,
) {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    loop {
        match (a.peek(), b.peek()) {
            (None, None) => return,
            (Some((k, _)), None) => {
                out.insert((*k).clone());
                a.next();
            }
            (None, Some((k, _))) => {
                out.insert((*k).clone());
                b.next();
            }
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(kb) {
                std::cmp::Ordering::Less => {
                    out.insert((*ka).clone());
                    a.next();
                }
                std::cmp::Ordering::Greater => {
                    out.insert((*kb).clone());
                    b.next();
                }
                std::cmp::Ordering::Equal => {
                    if !same(va, vb) {
                        out.insert((*ka).clone());
                    }
                    a.next();
                    b.next();
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Svid;
    use flock_core::journal::JournaledMap;

    fn key(i: usize) -> PodKey {
        PodKey::new(format!("c{i}"), "eth0")
    }

    fn rec(i: usize, service: &str) -> Arc<PodRecord> {
        Arc::new(PodRecord {
            key: key(i),
            name: format!("p{i}"),
            namespace: "default".into(),
            uid: String::new(),
            netns: format!("/var/run/netns/p{i}"),
            ips: vec![std::net::IpAddr::from([10, 0, 0, i as u8])],
            service: service.into(),
            service_account: String::new(),
            ports: Vec::new(),
            network_name: "net".into(),
            added_at_ms: flock_core::time::UnixMs(0),
            capture: None,
            authz: None,
            labels: Default::default(),
        })
    }

    fn svid(id: &str) -> Arc<Svid> {
        Arc::new(Svid {
            spiffe_id: id.into(),
            cert_chain_pem: String::new(),
            private_key_pem: crate::identity::SecretPem::new(String::new()),
            not_after_ms: flock_core::time::UnixMs(0),
            issued_ms: flock_core::time::UnixMs(0),
            issued_mono: flock_core::time::MonoMs(0),
            serial: String::new(),
        })
    }

    /// What each pod's derivation reads, from scratch: the oracle `changed_since`
    /// must cover.
    fn per_pod(inputs: &PodInputs, keys: &[PodKey]) -> Vec<(Option<PodRecord>, Option<String>)> {
        keys.iter()
            .map(|k| {
                (
                    inputs.table.get(k).map(|r| (**r).clone()),
                    inputs.spiffe_id(k).map(str::to_string),
                )
            })
            .collect()
    }

    proptest::proptest! {
        /// Every pod whose record or SPIFFE ID differs between two passes is named,
        /// whatever the steps between them (records added, replaced, removed;
        /// subscriptions made and dropped; SVIDs issued and revoked).
        #[test]
        fn every_pod_whose_inputs_differ_is_named(
            steps in proptest::collection::vec((0u8..6, 0usize..12, 0usize..3), 0..40),
            split in 0usize..40,
        ) {
            let keys: Vec<PodKey> = (0..12).map(key).collect();
            let ids = ["spiffe://td/a", "spiffe://td/b", "spiffe://td/c"];
            let mut table = JournaledMap::new();
            let mut subs = JournaledMap::new();
            let mut view = IdentityView::default();
            let mut prev: Option<PodInputs> = None;
            let mut first: Option<PodInputs> = None;
            for (n, (op, pod, id)) in steps.iter().enumerate() {
                match op {
                    // Op 0 with an equal record replaces it by an equal one (a change
                    // in the journal, none by value).
                    0 => { table.insert(keys[*pod].clone(), rec(*pod, ids[*id])); }
                    1 => { table.remove(&keys[*pod]); }
                    2 => { subs.insert(keys[*pod].clone(), ids[*id].to_string()); }
                    3 => { subs.remove(&keys[*pod]); }
                    4 => { view.svids.insert(ids[*id].to_string(), svid(ids[*id])); }
                    _ => { view.svids.remove(ids[*id]); }
                }
                view.subscriptions = subs.snapshot();
                let now = PodInputs::new(table.snapshot(), Some(&view), prev.as_ref());
                if n == split.min(steps.len() - 1) {
                    first = Some(now.clone());
                }
                prev = Some(now);
            }
            if let (Some(a), Some(b)) = (first, prev) {
                let named = b.changed_since(&a);
                let (before, after) = (per_pod(&a, &keys), per_pod(&b, &keys));
                for (i, k) in keys.iter().enumerate() {
                    if before[i] != after[i] {
                        proptest::prop_assert!(named.contains(k), "{k} changed but not named");
                    }
                    // And only what may differ: its record by value, its
                    // subscription, or an SVID of its subscription issued or gone.
                    let flipped = |inputs: &PodInputs| inputs.subscriptions.get(k).is_some_and(|id| {
                        a.issued.binary_search(id).is_ok() != b.issued.binary_search(id).is_ok()
                    });
                    let may = a.table.get(k).map(|r| &**r) != b.table.get(k).map(|r| &**r)
                        || a.subscriptions.get(k) != b.subscriptions.get(k)
                        || flipped(&a)
                        || flipped(&b);
                    proptest::prop_assert!(!named.contains(k) || may, "{k} named but unchanged");
                }
            }
        }
    }

    /// The same over tables deep enough that the diff skips shared subtrees: every
    /// record changed between two passes is named, with thousands of pods and runs
    /// of inserts, replacements and removals between the passes.
    #[test]
    fn every_changed_pod_is_named_in_a_big_table() {
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let keys: Vec<PodKey> = (0..3000).map(key).collect();
        let mut table = JournaledMap::new();
        for (i, k) in keys.iter().enumerate().take(2000) {
            table.insert(k.clone(), rec(i, "a"));
        }
        let check = |was: &PodInputs, now: &PodInputs, round: usize| {
            let named = now.changed_since(was);
            for k in &keys {
                let (a, b) = (was.table.get(k), now.table.get(k));
                if a.map(|r| &**r) != b.map(|r| &**r) {
                    assert!(
                        named.contains(k),
                        "round {round}: {k} changed but not named"
                    );
                }
            }
        };
        let mut prev = PodInputs::new(table.snapshot(), None, None);
        // Passes that missed hundreds of changes (the journal reaches back) and
        // thousands (it does not: the merge walk).
        let first = prev.clone();
        let mut tenth = None;
        for round in 0..400 {
            for _ in 0..=next(8) {
                let i = next(3000) as usize;
                match next(3) {
                    0 => {
                        table.insert(keys[i].clone(), rec(i, "a"));
                    }
                    1 => {
                        table.insert(keys[i].clone(), rec(i, "b"));
                    }
                    _ => {
                        table.remove(&keys[i]);
                    }
                }
            }
            let now = PodInputs::new(table.snapshot(), None, Some(&prev));
            check(&prev, &now, round);
            if round == 300 {
                tenth = Some(now.clone());
            }
            prev = now;
        }
        assert!(
            prev.table.changed_since(&first.table).is_none(),
            "the journal does not reach back 400 rounds"
        );
        check(&first, &prev, 400);
        let tenth = tenth.unwrap();
        assert!(
            prev.table.changed_since(&tenth.table).is_some(),
            "the journal reaches back 100 rounds"
        );
        check(&tenth, &prev, 400);
    }

    #[test]
    fn nothing_changed_names_nothing() {
        let mut table = JournaledMap::new();
        table.insert(key(1), rec(1, "a"));
        let table = table.snapshot();
        let mut view = IdentityView::default();
        let mut subs = JournaledMap::new();
        subs.insert(key(1), "spiffe://td/a".into());
        view.subscriptions = subs.snapshot();
        view.svids
            .insert("spiffe://td/a".into(), svid("spiffe://td/a"));
        let a = PodInputs::new(table.clone(), Some(&view), None);
        let b = PodInputs::new(table, Some(&view), Some(&a));
        assert!(
            Arc::ptr_eq(&a.issued, &b.issued),
            "the issued IDs are reused"
        );
        assert!(b.changed_since(&a).is_empty());
        assert_eq!(b.spiffe_id(&key(1)), Some("spiffe://td/a"));
    }
}
