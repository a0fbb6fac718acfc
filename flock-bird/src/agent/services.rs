//! The registry's services as the translation serves them, kept incrementally.
//!
//! [`served_services`] is the definition: every endpoint of the registry view goes
//! through the whole-view rules ([`serving_endpoints`]), is grouped into services
//! ([`service_models`]), each service gets its Kubernetes cluster IPs (a VIP already
//! given to a Service earlier in (namespace, name) order is left out), and each
//! service the translation's validation refuses is left out alone. Computed that way
//! on every publish, a change of one endpoint costs O(registry): at 50,000 remote
//! endpoints the agent spent most of a second per change there.
//!
//! [`ServiceTable`] gives the same result while doing O(changed services) work per
//! change. Every rule above is per service, except the VIP rule, which depends on
//! which services exist and the Kubernetes snapshot: so a change of endpoints
//! re-derives only the services its keys belonged to or now belong to, and the VIPs
//! are reassigned only when the set of services or the snapshot changes. The view's
//! [`Delta`](crate::registry::Delta) names the changed keys when the table saw the
//! view just before, and the view's recent deltas when it missed a few (under churn,
//! nearly every publish follows missed views); otherwise (more missed views than the
//! backend keeps deltas of, a backend without deltas) the table is rebuilt from the
//! whole view. A proptest checks that the table equals
//! [`served_services`] after every step of random change sequences, with missed views
//! and VIP collisions.

use super::mesh::{service_models, serving_endpoints, serving_of_one};
use crate::model::Endpoint;
use crate::registry::View;
use flock_core::registry::Reject;
// How the table catches up with a newer view. (Deltas, not a diff of the last
// view's persistent map against this one: imbl 6.1's `OrdMap::diff` misses changes
// once the maps are a few tree levels deep; in a check of 2,000 random rounds of
// edits on a 50,000-key map, 757 diffs lacked a changed key.)
use flock_core::regsync::{CatchUp, catch_up};
use flock_xds::translate;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Weak};

/// The cluster IPs of services: `(token, vips_of)`. The token names the source's
/// state (the Kubernetes snapshot): a different token means any service's VIPs may
/// have changed.
pub type Vips<'a> = (usize, &'a dyn Fn(&str, &str) -> Vec<IpAddr>);

type ServiceId = (String, String);

/// The services [`ServiceTable`] serves, computed from the whole view: the valid
/// services in (namespace, name) order, and the keys the whole-view rules left out.
/// The definition the table is checked against, and the baseline of the scale
/// benchmark.
pub fn served_services(
    view: &View,
    vips: Option<Vips<'_>>,
) -> (Vec<translate::Service>, BTreeMap<String, Reject>) {
    let (serving, excluded) = serving_endpoints(view);
    let mut taken: BTreeSet<IpAddr> = BTreeSet::new();
    let mut out = Vec::new();
    for mut svc in service_models(serving) {
        if let Some((_, vips_of)) = vips {
            svc.vips = claim_vips(&svc, vips_of(&svc.namespace, &svc.name), &mut taken);
        }
        if let Some(svc) = validated(svc) {
            out.push(svc);
        }
    }
    (out, excluded)
}

/// The VIPs of `svc` not already `taken` by a service before it (the API never
/// assigns one twice; a stale snapshot might, and the shared route configuration must
/// not hold one domain twice).
fn claim_vips(
    svc: &translate::Service,
    candidates: Vec<IpAddr>,
    taken: &mut BTreeSet<IpAddr>,
) -> Vec<IpAddr> {
    let mut vips = Vec::new();
    for vip in candidates {
        if taken.insert(vip) {
            vips.push(vip);
        } else {
            tracing::warn!(service = %svc.name, namespace = %svc.namespace, %vip, "cluster IP also another Service's; not a host name of this one");
        }
    }
    vips
}

/// Whether the translation accepts `svc` (logged if not: one inconsistent service
/// never blocks the rest of the mesh).
fn is_valid(svc: &translate::Service) -> bool {
    match svc.validate() {
        Ok(()) => true,
        Err(errors) => {
            tracing::warn!(
                service = %svc.name,
                namespace = %svc.namespace,
                "registry entries of this service are inconsistent; not served: {}",
                errors
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            false
        }
    }
}

/// `svc` if the translation accepts it ([`is_valid`]), else `None`.
fn validated(svc: translate::Service) -> Option<translate::Service> {
    is_valid(&svc).then_some(svc)
}

/// One service of the table.
#[derive(Debug, Default)]
struct Entry {
    /// The registry keys of its endpoints (each allocation shared with
    /// [`ServiceTable::service_of`]), each with its endpoint in the view last seen (the
    /// view's allocation): re-deriving the service reads them here, instead of
    /// looking every key of it up in the view (at 50,000 endpoints, those lookups
    /// were a tenth of the agent's CPU per change).
    keys: BTreeMap<Arc<str>, Arc<Endpoint>>,
    /// The model of its serving endpoints with the VIPs it claimed (`vips`); `None`
    /// if every endpoint is left out (the service is then not formed at all, and
    /// claims no VIP).
    model: Option<Arc<translate::Service>>,
    /// The keys the whole-view rules left out.
    excluded: Vec<(String, Reject)>,
    /// The VIPs it claimed.
    vips: Vec<IpAddr>,
    /// What is served: `model`, the same allocation, if valid. (One copy of a
    /// service's endpoints, not two: at 50,000 remote endpoints a second copy held
    /// about 300 bytes per endpoint.)
    served: Option<Arc<translate::Service>>,
    /// Its id, shared by every key of it in [`ServiceTable::service_of`] (one copy of
    /// the namespace and name per service, not per endpoint).
    shared_id: Option<Arc<ServiceId>>,
}

impl Entry {
    /// Files `key` (endpoint `ep`) under this entry (id `id`); the shared id for
    /// `service_of`.
    fn file(&mut self, id: &ServiceId, key: Arc<str>, ep: Arc<Endpoint>) -> Arc<ServiceId> {
        self.keys.insert(key, ep);
        Arc::clone(self.shared_id.get_or_insert_with(|| Arc::new(id.clone())))
    }
}

/// How the table last caught up with the registry view.
#[derive(Debug)]
struct Seen {
    /// The view itself (weak: the table must not keep an old registry alive), for
    /// backends that do not count their changes.
    view: Weak<View>,
    seq: u64,
}

/// [`served_services`], kept incrementally (see the [module docs](self)).
#[derive(Debug, Default)]
pub struct ServiceTable {
    seen: Option<Seen>,
    services: BTreeMap<ServiceId, Entry>,
    /// The service of each key in the table.
    service_of: HashMap<Arc<str>, Arc<ServiceId>>,
    /// The VIP source's token at the last assignment (`None`: no VIPs).
    vips_token: Option<usize>,
    excluded: BTreeMap<String, Reject>,
    /// The served services in order, rebuilt when one of them changed.
    served: Arc<Vec<Arc<translate::Service>>>,
    /// Counts the changes of `served`.
    generation: u64,
    excluded_generation: u64,
}

impl ServiceTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The served services, in (namespace, name) order.
    pub fn services(&self) -> &Arc<Vec<Arc<translate::Service>>> {
        &self.served
    }

    /// The keys left out by the whole-view rules.
    pub fn excluded(&self) -> &BTreeMap<String, Reject> {
        &self.excluded
    }

    /// Counts the changes of [`ServiceTable::services`].
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Counts the changes of [`ServiceTable::excluded`].
    pub fn excluded_generation(&self) -> u64 {
        self.excluded_generation
    }

    /// Catches up with `view` and the VIP source. Returns whether the served
    /// services changed.
    pub fn update(&mut self, view: &Arc<View>, vips: Option<Vips<'_>>) -> bool {
        let before = self.generation;
        let before_excluded = self.excluded_generation;
        let mut dirty: BTreeSet<ServiceId> = BTreeSet::new();
        // A backend that counts its changes (`seq`) names the keys of each change;
        // for one that does not, a different view may differ anywhere.
        let catch_up = match &self.seen {
            Some(seen) if view.seq != 0 && seen.seq == view.seq => CatchUp::Nothing,
            Some(seen) if view.seq == 0 && std::ptr::eq(seen.view.as_ptr(), Arc::as_ptr(view)) => {
                CatchUp::Nothing
            }
            // Missed views take their own deltas (flock_core::regsync::catch_up).
            Some(seen) if view.seq != 0 => catch_up(seen.seq, view.seq, view.recent.len()),
            _ => CatchUp::Rebuild,
        };
        match catch_up {
            CatchUp::Nothing => {}
            CatchUp::Deltas(k) => {
                let one = [Arc::clone(&view.delta)];
                let deltas: Vec<&Arc<crate::registry::Delta>> = if k == 1 {
                    one.iter().collect()
                } else {
                    view.recent.iter().skip(view.recent.len() - k).collect()
                };
                // A key changed in several deltas is filed once, by its endpoint in
                // this view (where it is now is all that matters).
                let mut keys: BTreeSet<&str> = BTreeSet::new();
                for delta in deltas {
                    keys.extend(delta.keys().map(String::as_str));
                }
                for key in keys {
                    self.move_key(key, view, &mut dirty);
                }
            }
            CatchUp::Rebuild => self.rebuild(view, &mut dirty),
        }
        self.seen = Some(Seen {
            view: Arc::downgrade(view),
            seq: view.seq,
        });
        // Re-derive the touched services; note whether the set of formed services
        // changed (VIPs are claimed in service order).
        let mut formed_changed = false;
        let mut excluded_changed = false;
        // Each changed service's exclusions, old and new, applied together after the
        // loop (flock_core::registry::apply_exclusions: a key may move between two of
        // them).
        let mut exclusion_changes = Vec::new();
        for id in &dirty {
            let Some(entry) = self.services.get_mut(id) else {
                continue;
            };
            let was_formed = entry.model.is_some();
            let (base, excluded) = classify(&entry.keys);
            if entry.excluded != excluded {
                let old = std::mem::replace(&mut entry.excluded, excluded.clone());
                exclusion_changes.push((old, excluded));
                excluded_changed = true;
            }
            formed_changed |= was_formed != base.is_some();
            // The VIPs claimed so far; reassigned below if the formed services or the
            // VIP source changed.
            entry.vips = if base.is_some() {
                std::mem::take(&mut entry.vips)
            } else {
                Vec::new()
            };
            entry.model = base.map(|mut svc| {
                svc.vips = entry.vips.clone();
                Arc::new(svc)
            });
            if entry.keys.is_empty() {
                formed_changed |= was_formed;
                self.services.remove(id);
            }
        }
        flock_core::registry::apply_exclusions(&mut self.excluded, exclusion_changes);
        let token = vips.map(|v| v.0);
        let mut served_changed = false;
        if formed_changed || token != self.vips_token {
            // Reassign every service's VIPs in order; re-derive those that moved.
            let mut taken = BTreeSet::new();
            for (id, entry) in self.services.iter_mut() {
                let vips = match (&entry.model, vips) {
                    (Some(model), Some((_, vips_of))) => {
                        claim_vips(model, vips_of(&id.0, &id.1), &mut taken)
                    }
                    _ => Vec::new(),
                };
                if vips != entry.vips {
                    if let Some(model) = &mut entry.model {
                        Arc::make_mut(model).vips = vips.clone();
                    }
                    entry.vips = vips;
                    dirty.insert(id.clone());
                }
            }
            self.vips_token = token;
        }
        // The services whose served model changed while they stayed served: these
        // are replaced where they are in the list; any other change (a service
        // served or not served any more) re-lists the table.
        let mut replaced = Vec::new();
        let mut relist = false;
        for id in &dirty {
            let Some(entry) = self.services.get_mut(id) else {
                served_changed = true;
                relist = true;
                continue;
            };
            let served = entry
                .model
                .as_ref()
                .filter(|model| is_valid(model))
                .map(Arc::clone);
            if entry.served.as_deref() == served.as_deref() {
                // Unchanged: the model shares the served allocation (the list holds
                // it), rather than keep a second, equal copy.
                if let Some(old) = &entry.served {
                    entry.model = Some(Arc::clone(old));
                }
            } else {
                let was_served = entry.served.is_some();
                entry.served = served;
                served_changed = true;
                match &entry.served {
                    Some(now) if was_served => replaced.push(Arc::clone(now)),
                    _ => relist = true,
                }
            }
        }
        if served_changed {
            // In place when nothing else holds the list (the last publish is done with
            // it): a change of one service's endpoints costs a binary search, not a
            // walk over every entry of the table.
            if !relist {
                let list = Arc::make_mut(&mut self.served);
                for svc in replaced {
                    let at = list.binary_search_by(|s| {
                        (s.namespace.as_str(), s.name.as_str())
                            .cmp(&(svc.namespace.as_str(), svc.name.as_str()))
                    });
                    match at {
                        Ok(at) => list[at] = svc,
                        Err(_) => {
                            relist = true;
                            break;
                        }
                    }
                }
            }
            if relist {
                self.served = Arc::new(
                    self.services
                        .values()
                        .filter_map(|e| e.served.clone())
                        .collect(),
                );
            }
            self.generation += 1;
        }
        if excluded_changed {
            self.excluded_generation += 1;
        }
        self.generation != before || self.excluded_generation != before_excluded
    }

    /// Files `key` under the service its endpoint in `view` names (or under none if
    /// it is gone), marking the old and the new service dirty.
    fn move_key(&mut self, key: &str, view: &View, dirty: &mut BTreeSet<ServiceId>) {
        let found = view.endpoints.get(key);
        let now = found.map(|e| (e.namespace.clone(), e.service.clone()));
        let before = self.service_of.get(key).cloned();
        let moved = before.as_deref() != now.as_ref();
        if let Some(id) = &before
            && moved
        {
            if let Some(entry) = self.services.get_mut(&**id) {
                entry.keys.remove(key);
            }
            self.service_of.remove(key);
        }
        if let Some(id) = &before {
            dirty.insert((**id).clone());
        }
        if let (Some(id), Some(found)) = (now, found) {
            let ep = Arc::clone(&found.endpoint);
            if moved {
                let key: Arc<str> = Arc::from(key);
                let entry = self.services.entry(id.clone()).or_default();
                let shared = entry.file(&id, Arc::clone(&key), ep);
                self.service_of.insert(key, shared);
            } else if let Some(held) = self
                .services
                .get_mut(&id)
                .and_then(|entry| entry.keys.get_mut(key))
            {
                *held = ep;
            }
            dirty.insert(id);
        }
    }

    /// Forgets everything and files every key of `view`.
    fn rebuild(&mut self, view: &View, dirty: &mut BTreeSet<ServiceId>) {
        dirty.extend(self.services.keys().cloned());
        for entry in self.services.values_mut() {
            entry.keys.clear();
        }
        self.service_of.clear();
        for (key, e) in &view.endpoints {
            let id = (e.namespace.clone(), e.service.clone());
            let key: Arc<str> = Arc::from(key.as_str());
            let entry = self.services.entry(id.clone()).or_default();
            let shared = entry.file(&id, Arc::clone(&key), Arc::clone(&e.endpoint));
            self.service_of.insert(key, shared);
            dirty.insert(id);
        }
    }
}

/// One service's model and left-out keys: the whole-view rules of
/// [`serving_endpoints`] restricted to its keys (each rule looks at one service's
/// endpoints only).
fn classify(
    keys: &BTreeMap<Arc<str>, Arc<Endpoint>>,
) -> (Option<translate::Service>, Vec<(String, Reject)>) {
    debug_assert!(
        keys.values()
            .map(|e| (&e.namespace, &e.service))
            .collect::<BTreeSet<_>>()
            .len()
            <= 1,
        "one service's keys"
    );
    let (serving, excluded) = serving_of_one(keys.iter().map(|(k, e)| (&**k, &**e)));
    let base = service_models(serving).into_iter().next();
    (base, excluded.into_iter().collect())
}
