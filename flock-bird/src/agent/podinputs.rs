//! What a per-pod derivation reads (the pod table and each pod's SPIFFE ID), kept
//! from one pass to the next so the next pass visits only the pods whose inputs
//! changed.
//!
//! The registry sync's desired endpoints and the publish's pod models are each
//! derived per pod from the pod's record and its SPIFFE ID. Both used to visit
//! every pod on every change of the table or the identity view (which changes on
//! every ADD: the pod subscribes), with several map lookups per pod, so an ADD cost
//! O(pods). Both inputs are persistent maps, so keeping last pass's copies is O(1)
//! and their diff skips the subtrees the two share: O(changed pods × log pods).

use crate::identity::IdentityView;
use crate::model::PodRecord;
use flock_core::pod::PodKey;
use std::collections::BTreeSet;
use std::sync::Arc;

/// One pass's inputs (see the [module docs](self)).
#[derive(Clone, Default)]
pub(super) struct PodInputs {
    /// The pod table.
    pub(super) table: imbl::OrdMap<PodKey, Arc<PodRecord>>,
    /// Which SPIFFE ID each subscribed pod has.
    subscriptions: imbl::OrdMap<PodKey, String>,
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
        table: imbl::OrdMap<PodKey, Arc<PodRecord>>,
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
        use imbl::ordmap::DiffItem;
        let mut changed = BTreeSet::new();
        let mut note = |item: DiffItem<'_, '_, PodKey, _>| {
            let key = match item {
                DiffItem::Add(k, _) | DiffItem::Remove(k, _) => k,
                DiffItem::Update { new: (k, _), .. } => k,
            };
            changed.insert(key.clone());
        };
        prev.table.diff(&self.table).for_each(&mut note);
        for item in prev.subscriptions.diff(&self.subscriptions) {
            let key = match item {
                DiffItem::Add(k, _) | DiffItem::Remove(k, _) => k,
                DiffItem::Update { new: (k, _), .. } => k,
            };
            changed.insert(key.clone());
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Svid;

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
            let mut table = imbl::OrdMap::new();
            let mut view = IdentityView::default();
            let mut prev: Option<PodInputs> = None;
            let mut first: Option<PodInputs> = None;
            for (n, (op, pod, id)) in steps.iter().enumerate() {
                match op {
                    0 => { table.insert(keys[*pod].clone(), rec(*pod, ids[*id])); }
                    1 => { table.remove(&keys[*pod]); }
                    2 => { view.subscriptions.insert(keys[*pod].clone(), ids[*id].to_string()); }
                    3 => { view.subscriptions.remove(&keys[*pod]); }
                    4 => { view.svids.insert(ids[*id].to_string(), svid(ids[*id])); }
                    _ => { view.svids.remove(ids[*id]); }
                }
                let now = PodInputs::new(table.clone(), Some(&view), prev.as_ref());
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
                }
            }
        }
    }

    #[test]
    fn nothing_changed_names_nothing() {
        let mut table = imbl::OrdMap::new();
        table.insert(key(1), rec(1, "a"));
        let mut view = IdentityView::default();
        view.subscriptions.insert(key(1), "spiffe://td/a".into());
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
