//! Incremental translation: a per-entity memo, and the whole-mesh translations
//! ([`envoy_resources`](super::envoy_resources), [`grpc_resources`](super::grpc_resources))
//! built on it.
//!
//! A control plane re-publishes the whole mesh on every change, but between two
//! publishes most pods and services are unchanged. A [`Memo`] keeps, per pod and per
//! service, the model it last translated and the encoded, hashed resources it gave; a
//! pod or service whose model is equal reuses them (shared `Arc`s, no re-encoding and
//! no re-hashing). A publish then costs O(entities) comparisons plus O(changed
//! entities) encoding, instead of re-encoding the whole mesh (go-control-plane's
//! per-change cost). The routes shared by every pod, the per-caller mTLS resources
//! and the secrets depend on the whole mesh and are translated every time.
//!
//! The one-shot translations run a fresh memo, so there is one translation, not a
//! memoized copy kept equal to it by a test. A memo's translations also depend on
//! the options (the local locality, timeouts): a call with options different from
//! the previous call's starts over.

use super::envoy::{
    EnvoyOptions, blackhole_cluster, caller_routes, caller_service_clusters,
    capture_caller_resources, capture_listener, encoded_service_routes, outbound_routes,
    pod_resources, routes_from_parts, secret_resource, service_resources,
};
use super::grpc::grpc_service_resources;
use super::model::ambiguous_service_names;
use super::model::{Mesh, Pod, Secret, Service};
use super::names;
use super::{Resource, sort_dedup};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::resources::{Name, ResourceSet};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// Which node group a memo translates for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flavor {
    /// The node-local Envoy: pods' listeners and clusters, services, routes, mTLS
    /// clusters, secrets (as [`envoy_resources`](super::envoy_resources)).
    Envoy,
    /// Proxyless gRPC clients: services only (as
    /// [`grpc_resources`](super::grpc_resources)).
    Grpc,
}

/// The resources of one translation, per type URL: `(name, hash, resource)` in the
/// shape [`ResourceSetBuilder::replace_type`](flock_core::resources::ResourceSetBuilder::replace_type)
/// takes. The five xDS types are always present (possibly empty), so replacing each
/// removes what went away.
pub type Entries = BTreeMap<&'static str, Vec<(Name, ContentHash, Arc<Any>)>>;

/// One entity's translated resources, shared (`Arc`) so reuse copies pointers, not
/// bytes.
type Translated = Arc<Group>;

/// One entity's resources and how many there are of each of the five types: a
/// translation is a list of groups, and its per-type counts are sums of these, so
/// neither needs a walk over every resource.
#[derive(Debug)]
struct Group {
    items: Vec<Shared>,
    counts: [usize; 5],
}

impl std::ops::Deref for Group {
    type Target = [Shared];
    fn deref(&self) -> &[Shared] {
        &self.items
    }
}

fn group(items: Vec<Shared>) -> Translated {
    let mut counts = [0; 5];
    for (type_url, ..) in &items {
        counts[slot(type_url)] += 1;
    }
    Arc::new(Group { items, counts })
}

/// One translation's output: every entity's resources, as the shared groups the memo
/// keeps (one pointer per entity, not per resource). [`Translation::entries`] lists
/// them per type, which only a publisher that cannot apply the memo's
/// [`Changes`] needs.
#[derive(Debug, Default)]
pub struct Translation {
    groups: Vec<Translated>,
    counts: [usize; 5],
}

impl Translation {
    fn push(&mut self, t: &Translated) {
        for (sum, n) in self.counts.iter_mut().zip(t.counts) {
            *sum += n;
        }
        self.groups.push(Arc::clone(t));
    }

    /// The resources per type URL, each type's in translation order.
    pub fn entries(&self) -> Entries {
        let mut lists: Lists = Default::default();
        for (list, n) in lists.iter_mut().zip(self.counts) {
            list.reserve(n);
        }
        for t in &self.groups {
            for (type_url, name, hash, any) in t.iter() {
                lists[slot(type_url)].push((name.clone(), *hash, Arc::clone(any)));
            }
        }
        TYPES.into_iter().zip(lists).collect()
    }

    /// Whether every type's count equals that type's count in `set`: a cheap check
    /// that a set built by applying [`Changes`] holds what this translation lists (a
    /// translation of a valid mesh names each resource once).
    pub fn counts_match<V>(&self, set: &ResourceSet<V>) -> bool {
        TYPES
            .iter()
            .zip(self.counts)
            .all(|(t, n)| set.len_of(t) == n)
    }
}

/// One translated resource, shared.
type Shared = (&'static str, Name, ContentHash, Arc<Any>);

/// A route configuration as last joined: the parts it was joined from (in order)
/// and the result.
#[derive(Debug)]
struct Joined {
    parts: Vec<Arc<Vec<u8>>>,
    route: Shared,
}

/// One service's memo entry: the model translated, its own resources, and per
/// caller identity its mTLS clusters ([`caller_service_clusters`]), all made from
/// this model alone.
#[derive(Debug)]
struct ServiceMemo {
    model: Arc<Service>,
    own: Translated,
    callers: HashMap<String, Translated>,
    /// Its part of the shared outbound route configuration
    /// ([`encoded_service_routes`]), with whether its bare name was a domain in it.
    route: Option<(bool, Arc<Vec<u8>>)>,
    /// Its part of each caller's route configuration, likewise.
    caller_routes: HashMap<String, (bool, Arc<Vec<u8>>)>,
    /// What it emitted in the last pass that joined route configurations.
    emitted: Option<Emitted>,
}

/// A service's output of one pass beyond its own resources: its mTLS clusters per
/// caller and its route parts (the shared configuration's, then each caller's), in
/// the pass's caller order. Valid for a later pass with the same model, the same
/// callers (`epoch`) and the same route form (`short`).
#[derive(Debug)]
struct Emitted {
    epoch: u64,
    short: bool,
    callers: Vec<Translated>,
    parts: Vec<Arc<Vec<u8>>>,
}

/// The service entries of the last pass, handed out to this pass's services one by
/// one ([`OldServices::take`]); what is left at the end went away.
enum OldServices {
    /// Both passes' services sorted by (namespace, name), each once: a merge walk.
    Sorted(std::iter::Peekable<std::vec::IntoIter<Box<ServiceMemo>>>),
    /// Otherwise (an invalid mesh now or last pass): by (namespace, name), the later
    /// of two kept.
    ByKey(HashMap<(String, String), Box<ServiceMemo>>),
}

impl OldServices {
    // Boxed entries on purpose: see `Memo::services`.
    #[allow(clippy::vec_box)]
    fn new(entries: Vec<Box<ServiceMemo>>, sorted: bool) -> Self {
        if sorted {
            Self::Sorted(entries.into_iter().peekable())
        } else {
            Self::ByKey(
                entries
                    .into_iter()
                    .map(|e| ((e.model.namespace.clone(), e.model.name.clone()), e))
                    .collect(),
            )
        }
    }

    /// `svc`'s entry of the last pass, if it had one. In the merge walk, the entries
    /// before it went away (recorded in `ch`).
    fn take(&mut self, svc: &Arc<Service>, ch: &mut Changes) -> Option<Box<ServiceMemo>> {
        match self {
            Self::Sorted(entries) => {
                while let Some(e) = entries.peek() {
                    if Arc::ptr_eq(&e.model, svc) {
                        return entries.next();
                    }
                    let here = (e.model.namespace.as_str(), e.model.name.as_str());
                    match here.cmp(&(svc.namespace.as_str(), svc.name.as_str())) {
                        std::cmp::Ordering::Less => {
                            if let Some(gone) = entries.next() {
                                gone.forget(ch);
                            }
                        }
                        std::cmp::Ordering::Equal => return entries.next(),
                        std::cmp::Ordering::Greater => return None,
                    }
                }
                None
            }
            Self::ByKey(entries) => entries.remove(&(svc.namespace.clone(), svc.name.clone())),
        }
    }

    /// Records every entry not taken as gone.
    fn finish(self, ch: &mut Changes) {
        match self {
            Self::Sorted(entries) => entries.for_each(|e| e.forget(ch)),
            Self::ByKey(entries) => entries.into_values().for_each(|e| e.forget(ch)),
        }
    }
}

impl ServiceMemo {
    /// Records its resources as gone.
    fn forget(&self, ch: &mut Changes) {
        ch.gone(&self.own);
        for t in self.callers.values() {
            ch.gone(t);
        }
    }
}

/// The per-entity translation memo of one node group. See the [module docs](self).
#[derive(Debug)]
pub struct Memo {
    flavor: Flavor,
    /// The options of the last translation: the cached resources were made with them.
    opts: Option<EnvoyOptions>,
    /// By (namespace, name): unique in a valid mesh.
    pods: HashMap<PodId, PodMemo>,
    /// In the last pass's order: by (namespace, name) if `services_sorted`. Boxed:
    /// a pass moves every entry into the next list, a pointer each (an entry is
    /// some 200 bytes; moving 2,000 of them was a tenth of a publish's time).
    #[allow(clippy::vec_box)]
    services: Vec<Box<ServiceMemo>>,
    /// The last pass's services were sorted by (namespace, name), each once.
    services_sorted: bool,
    /// Counts the changes of `callers` (stamps [`Emitted`]).
    callers_epoch: u64,
    pass: u64,
    /// The resources translated every time (routes, capture, secrets) last time.
    always: Option<Translated>,
    /// The caller identities (pods with an outbound listener) of the last pass.
    callers: Vec<String>,
    /// Each route configuration as last joined, by caller (`None`: the shared
    /// outbound routes). A configuration whose parts are the same as last time (by
    /// pointer, or by bytes for a re-translated service whose part came out equal)
    /// is reused: an endpoint change alters no route, so it neither re-joins nor
    /// re-hashes some megabytes of route configuration per publish.
    joined: HashMap<Option<String>, Joined>,
    /// Each secret as last translated, by name: an equal secret reuses its resource
    /// instead of re-encoding and re-hashing its PEMs.
    secrets: HashMap<String, (Secret, Shared)>,
    /// The last translation was of a mesh with no (namespace, name) twice, with the
    /// options of the one before it: the changes it recorded are exact.
    clean: bool,
    /// What the last translation changed against the one before, if exact.
    changes: Option<Changes>,
}

/// What one translation changed against the memo's previous one: resources to
/// remove, then resources to upsert (an upsert of an unchanged hash is a no-op for
/// [`ResourceSetBuilder::upsert_shared`](flock_core::resources::ResourceSetBuilder::upsert_shared)).
/// Applied to the set the previous translation produced, it gives the set of this
/// one in O(changed entities) instead of O(resources).
#[derive(Debug, Default)]
pub struct Changes {
    /// Resources gone, by (type URL, name).
    pub removes: Vec<(&'static str, Name)>,
    /// Resources new or possibly changed.
    pub upserts: Vec<(&'static str, Name, ContentHash, Arc<Any>)>,
}

impl Changes {
    /// `prev` (the set the previous translation built) with these changes applied:
    /// the removes, then the upserts.
    pub fn apply(self, prev: &ResourceSet<Any>) -> ResourceSet<Any> {
        let mut b = prev.edit();
        for (type_url, name) in &self.removes {
            b.remove(type_url, name);
        }
        for (type_url, name, hash, any) in self.upserts {
            b.upsert_shared(type_url, &name, hash, any);
        }
        b.build()
    }

    fn added(&mut self, t: &Translated) {
        for (type_url, name, hash, any) in t.iter() {
            self.upserts
                .push((type_url, name.clone(), *hash, Arc::clone(any)));
        }
    }

    fn gone(&mut self, t: &Translated) {
        // The mutant forgets to remove what went away: a deleted pod's listener
        // would stay in the published set.
        if flock_core::reintroduced!("memo-changes-keep-gone") {
            return;
        }
        for (type_url, name, ..) in t.iter() {
            self.removes.push((type_url, name.clone()));
        }
    }

    fn replaced(&mut self, old: &Translated, new: &Translated) {
        if Arc::ptr_eq(old, new) {
            return;
        }
        let kept: HashSet<(&str, &Name)> = new.iter().map(|(t, n, ..)| (*t, n)).collect();
        let before: HashMap<(&str, &Name), ContentHash> =
            old.iter().map(|(t, n, h, _)| ((*t, n), *h)).collect();
        for (type_url, name, ..) in old.iter() {
            if !kept.contains(&(*type_url, name)) {
                self.removes.push((type_url, name.clone()));
            }
        }
        for (type_url, name, hash, any) in new.iter() {
            if before.get(&(*type_url, name)) != Some(hash) {
                self.upserts
                    .push((type_url, name.clone(), *hash, Arc::clone(any)));
            }
        }
    }
}

/// The five xDS types, in the order of a translation's [`Lists`].
const TYPES: [&str; 5] = [LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET];

/// A translation's entries while it is built: one list per type of [`TYPES`]
/// (indexed, not a map lookup of a 50-byte type URL per resource per publish).
type Lists = [Vec<(Name, ContentHash, Arc<Any>)>; 5];

/// `type_url`'s index in [`TYPES`]: by pointer (the constants themselves) first.
fn slot(type_url: &str) -> usize {
    TYPES
        .iter()
        .position(|t| std::ptr::eq(*t, type_url))
        .or_else(|| TYPES.iter().position(|t| *t == type_url))
        .expect("one of the five xDS types")
}

fn share(resources: Vec<Resource>) -> Translated {
    group(resources.into_iter().map(shared).collect())
}

fn shared(r: Resource) -> Shared {
    (r.type_url, Name::from(r.name), r.hash, Arc::new(r.any))
}

/// Whether two lists of route parts are the same: pointers first, bytes for a part
/// re-encoded this pass.
fn same_parts(a: &[Arc<Vec<u8>>], b: &[Arc<Vec<u8>>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| Arc::ptr_eq(x, y) || x.as_slice() == y.as_slice())
}

impl Memo {
    /// An empty memo for `flavor`.
    pub fn new(flavor: Flavor) -> Self {
        Self {
            flavor,
            opts: None,
            pods: HashMap::new(),
            services: Vec::new(),
            services_sorted: false,
            callers_epoch: 0,
            pass: 0,
            always: None,
            callers: Vec::new(),
            joined: HashMap::new(),
            secrets: HashMap::new(),
            clean: false,
            changes: None,
        }
    }

    /// What the last translation changed against the one before it, if the memo
    /// knows exactly: not after the first translation, a change of options, a mesh
    /// with a (namespace, name) twice, or [`Memo::forget_output`]. A publisher applies
    /// it to the set it built from the previous translation; `None` means replace
    /// every type with the translation's entries.
    pub fn take_changes(&mut self) -> Option<Changes> {
        self.changes.take()
    }

    /// The previous translation's output was not published as it was (a test's
    /// fault injection altered it): the next translation records no changes.
    pub fn forget_output(&mut self) {
        self.clean = false;
        self.changes = None;
    }

    /// How many pods and services the memo holds translations of.
    pub fn len(&self) -> usize {
        self.pods.len() + self.services.len()
    }

    /// Whether the memo holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every resource of the group for `mesh`, reusing the resources of each pod and
    /// service whose model equals the one translated last time. The memo then holds
    /// exactly `mesh`'s pods and services (what went away is forgotten). Nothing is
    /// reused if `opts` differ from the last call's.
    pub fn translate(&mut self, mesh: &Mesh, opts: &EnvoyOptions) -> Entries {
        let services: Vec<Arc<Service>> = mesh.services.iter().cloned().map(Arc::new).collect();
        let pods: Vec<Arc<Pod>> = mesh.pods.iter().cloned().map(Arc::new).collect();
        self.translate_shared(&services, &pods, &mesh.secrets, opts)
            .entries()
    }

    /// [`Memo::translate`] of the mesh with these services, pods and secrets, for a
    /// caller that keeps its services shared: a service passed as the same `Arc` as
    /// last time is known unchanged without comparing it (a pointer comparison instead
    /// of walking its endpoints), so a publish after one endpoint change compares
    /// O(services) pointers and translates one service. Pods likewise: an unchanged pod
    /// passed as the same `Arc` is neither compared nor copied. Its mTLS clusters for each
    /// caller are kept with it too. What stays O(services) per publish: the route
    /// configurations (one virtual host per service port in each) and, for captured
    /// pods, their outbound listeners.
    pub fn translate_shared(
        &mut self,
        services: &[Arc<Service>],
        pods: &[Arc<Pod>],
        secrets: &[Secret],
        opts: &EnvoyOptions,
    ) -> Translation {
        if self.opts.as_ref() != Some(opts) {
            self.pods.clear();
            self.services.clear();
            self.always = None;
            self.joined.clear();
            self.secrets.clear();
            self.clean = false;
            self.opts = Some(opts.clone());
        }
        let mut exact = self.clean;
        let mut ch = Changes::default();
        self.pass += 1;
        let pass = self.pass;
        let envoy = self.flavor == Flavor::Envoy;
        let mut out = Translation {
            groups: Vec::with_capacity(pods.len() + services.len() + 1),
            counts: [0; 5],
        };
        // Kept in place and marked with the pass (one lookup per pod, no new map),
        // then swept: what this pass did not see went away.
        let mut pods_twice = false;
        if envoy {
            for pod in pods {
                let id = PodId(Arc::clone(pod));
                match self.pods.get_mut(&id) {
                    Some(m) if m.seen == pass => {
                        // The same (namespace, name) twice (an invalid mesh): both are
                        // translated, as a whole translation would, and the later one
                        // is kept.
                        pods_twice = true;
                        exact = false;
                        let t = share(pod_resources(pod, opts));
                        out.push(&t);
                        *m = PodMemo {
                            pod: Arc::clone(pod),
                            translated: t,
                            seen: pass,
                        };
                    }
                    Some(m) => {
                        if !Arc::ptr_eq(&m.pod, pod) && m.pod != *pod {
                            let t = share(pod_resources(pod, opts));
                            ch.replaced(&m.translated, &t);
                            m.translated = t;
                        }
                        m.pod = Arc::clone(pod);
                        m.seen = pass;
                        out.push(&m.translated);
                    }
                    None => {
                        let t = share(pod_resources(pod, opts));
                        ch.added(&t);
                        out.push(&t);
                        self.pods.insert(
                            id,
                            PodMemo {
                                pod: Arc::clone(pod),
                                translated: t,
                                seen: pass,
                            },
                        );
                    }
                }
            }
        }
        self.pods.retain(|_, m| {
            let keep = m.seen == pass;
            if !keep {
                ch.gone(&m.translated);
            }
            keep
        });
        let callers: BTreeSet<&str> = if envoy {
            pods.iter()
                .filter(|p| p.outbound_port != 0)
                .filter_map(|p| p.identity.as_deref())
                .filter(|id| super::model::trust_domain(id).is_some())
                .collect()
        } else {
            BTreeSet::new()
        };
        // The mTLS cluster names per caller, for its routes.
        let mut mtls: BTreeMap<&str, HashSet<Name>> =
            callers.iter().map(|c| (*c, HashSet::new())).collect();
        // The route configurations are joined from per-service parts when no domain
        // can be in two services; otherwise (an invalid mesh) they are built whole,
        // which drops the later duplicate domains.
        let sorted = joinable(services);
        let order_clean = sorted.is_some() && !pods_twice;
        exact &= sorted.is_some();
        // `Some` when the route configurations are joined from per-service parts.
        let order = if envoy { sorted.as_ref() } else { None };
        let ambiguous = if order.is_some() {
            ambiguous_service_names(services)
        } else {
            BTreeSet::new()
        };
        // Per route configuration (the shared one, then each caller's in `callers`
        // order), its parts in service order.
        let mut route_parts: Vec<Vec<Arc<Vec<u8>>>> = if order.is_some() {
            (0..=callers.len())
                .map(|_| Vec::with_capacity(services.len()))
                .collect()
        } else {
            Vec::new()
        };
        // With the same callers as last pass, a kept entry holds exactly this pass's
        // callers: the per-entry clean-up below is skipped (O(1) per unchanged
        // service instead of a set lookup per caller).
        let callers_same = self.callers.len() == callers.len()
            && self.callers.iter().zip(&callers).all(|(a, b)| a == b);
        let iteration: Vec<&Arc<Service>> = match &sorted {
            Some(sorted) => sorted.clone(),
            None => services.iter().collect(),
        };
        // The entries of the last pass, in its order: walked beside this pass's
        // services (both sorted) so an unchanged service is found by one pointer
        // comparison, not by hashing its namespace and name.
        let mut old = OldServices::new(
            std::mem::take(&mut self.services),
            self.services_sorted && sorted.is_some(),
        );
        let epoch = if callers_same {
            self.callers_epoch
        } else {
            self.callers_epoch + 1
        };
        let mut kept: Vec<Box<ServiceMemo>> = Vec::with_capacity(iteration.len());
        for svc in iteration {
            let mut old_callers = HashMap::new();
            let mut entry = match old.take(svc, &mut ch) {
                Some(mut e) if Arc::ptr_eq(&e.model, svc) || *e.model == **svc => {
                    e.model = Arc::clone(svc);
                    e
                }
                prev => {
                    let own = if envoy {
                        share(service_resources(svc, opts))
                    } else {
                        share(grpc_service_resources(svc, opts))
                    };
                    match prev {
                        Some(mut prev) => {
                            ch.replaced(&prev.own, &own);
                            old_callers = std::mem::take(&mut prev.callers);
                        }
                        None => ch.added(&own),
                    }
                    Box::new(ServiceMemo {
                        model: Arc::clone(svc),
                        own,
                        callers: HashMap::new(),
                        route: None,
                        caller_routes: HashMap::new(),
                        emitted: None,
                    })
                }
            };
            // The same (namespace, name) twice in one pass is an invalid mesh: both
            // are translated, as a whole translation would, and the later one is kept.
            out.push(&entry.own);
            let short = order.is_some() && !ambiguous.contains(svc.name.as_str());
            // What this entry emitted last pass is what it emits now if the model,
            // the callers and the route form are the same: pushed again without a
            // lookup per caller.
            if let Some(em) = &entry.emitted
                && order.is_some()
                && em.epoch == epoch
                && em.short == short
            {
                route_parts[0].push(Arc::clone(&em.parts[0]));
                for (index, t) in em.callers.iter().enumerate() {
                    out.push(t);
                    route_parts[index + 1].push(Arc::clone(&em.parts[index + 1]));
                }
                kept.push(entry);
                continue;
            }
            let mut emitted = Emitted {
                epoch,
                short,
                callers: Vec::with_capacity(callers.len()),
                parts: Vec::with_capacity(callers.len() + 1),
            };
            if !callers_same {
                entry.callers.retain(|id, t| {
                    let keep = callers.contains(id.as_str());
                    if !keep {
                        ch.gone(t);
                    }
                    keep
                });
                entry
                    .caller_routes
                    .retain(|id, _| callers.contains(id.as_str()));
            }
            if order.is_some() {
                let part = match &entry.route {
                    Some((was, part)) if *was == short => Arc::clone(part),
                    _ => {
                        let part =
                            Arc::new(encoded_service_routes(svc, short, opts, &|s, port| {
                                names::outbound_cluster(s, port)
                            }));
                        entry.route = Some((short, Arc::clone(&part)));
                        part
                    }
                };
                emitted.parts.push(Arc::clone(&part));
                route_parts[0].push(part);
            }
            for (index, caller) in callers.iter().enumerate() {
                let t = match entry.callers.get(*caller) {
                    Some(t) => Arc::clone(t),
                    None => {
                        let t = share(caller_service_clusters(caller, svc, opts));
                        match old_callers.remove(*caller) {
                            Some(old) => ch.replaced(&old, &t),
                            None => ch.added(&t),
                        }
                        entry.callers.insert((*caller).to_string(), Arc::clone(&t));
                        t
                    }
                };
                if order.is_none() {
                    // Two services of one name (an invalid mesh) make the same
                    // clusters: they are emitted once. (A joinable mesh has no
                    // (namespace, name) twice, so its cluster names are unique.)
                    let names = mtls.get_mut(caller).expect("one set per caller");
                    if t.iter()
                        .any(|(ty, n, ..)| *ty == CLUSTER && names.contains(n))
                    {
                        continue;
                    }
                    names.extend(
                        t.iter()
                            .filter(|(ty, ..)| *ty == CLUSTER)
                            .map(|(_, n, ..)| n.clone()),
                    );
                }
                out.push(&t);
                if order.is_some() {
                    let part = match entry.caller_routes.get(*caller) {
                        Some((was, part)) if *was == short => Arc::clone(part),
                        _ => {
                            let has = |name: &str| {
                                t.iter().any(|(ty, n, ..)| *ty == CLUSTER && &**n == name)
                            };
                            let part =
                                Arc::new(encoded_service_routes(svc, short, opts, &|s, port| {
                                    let name = names::mtls_cluster(s, port, caller);
                                    if has(&name) {
                                        name
                                    } else {
                                        names::outbound_cluster(s, port)
                                    }
                                }));
                            entry
                                .caller_routes
                                .insert((*caller).to_string(), (short, Arc::clone(&part)));
                            part
                        }
                    };
                    emitted.parts.push(Arc::clone(&part));
                    route_parts[index + 1].push(part);
                }
                emitted.callers.push(t);
            }
            for old in old_callers.values() {
                ch.gone(old);
            }
            entry.emitted = order.is_some().then_some(emitted);
            kept.push(entry);
        }
        // What this pass did not see went away.
        old.finish(&mut ch);
        self.services = kept;
        self.services_sorted = sorted.is_some();
        self.callers_epoch = epoch;
        // The resources translated every time, as one group: compared with last
        // time's as a whole (they are few: routes, captured pods, secrets).
        let mut always: Vec<Shared> = Vec::new();
        if envoy && order.is_some() {
            let mut joined = HashMap::with_capacity(mtls.len() + 1);
            let keys = std::iter::once(None).chain(callers.iter().map(|c| Some(*c)));
            for (key, parts) in keys.zip(route_parts) {
                let key = key.map(str::to_string);
                let route = match self.joined.remove(&key) {
                    Some(last) if same_parts(&last.parts, &parts) => last.route,
                    _ => {
                        let name = match &key {
                            None => names::OUTBOUND_ROUTE.to_string(),
                            Some(caller) => names::outbound_route_for(caller),
                        };
                        shared(routes_from_parts(&name, parts.iter().map(|p| p.as_slice())))
                    }
                };
                always.push(route.clone());
                joined.insert(key, Joined { parts, route });
            }
            self.joined = joined;
        } else if envoy {
            self.joined.clear();
            always.push(shared(outbound_routes(services, opts)));
            for (caller, names) in &mtls {
                let has = |name: &str| names.contains(name);
                always.push(shared(caller_routes(caller, services, opts, &has)));
            }
        }
        if envoy {
            // A captured pod's outbound listener routes by the services' addresses,
            // so it changes with any service: translated every time, like the routes.
            let captured: Vec<&Pod> = pods
                .iter()
                .filter(|p| p.capture.is_some())
                .map(|p| &**p)
                .collect();
            let capture_callers: BTreeSet<&str> = captured
                .iter()
                .filter_map(|p| p.identity.as_deref())
                .collect();
            let mut capture = Vec::with_capacity(captured.len() + 1);
            capture.extend(
                captured
                    .iter()
                    .filter_map(|p| capture_listener(p, services, opts)),
            );
            for identity in capture_callers {
                capture.extend(capture_caller_resources(identity, services, opts));
            }
            if !captured.is_empty() {
                capture.push(blackhole_cluster());
            }
            always.extend(capture.into_iter().map(shared));
            let mut next_secrets = HashMap::with_capacity(secrets.len());
            for secret in secrets {
                // Equal: the kept copy moves over (no copy of key material).
                let kept = match self.secrets.remove(&secret.name) {
                    Some((last, r)) if last == *secret => (last, r),
                    _ => (secret.clone(), shared(secret_resource(secret))),
                };
                always.push(kept.1.clone());
                next_secrets.insert(secret.name.clone(), kept);
            }
            self.secrets = next_secrets;
        }
        let always = group(always);
        out.push(&always);
        match &self.always {
            Some(old) => ch.replaced(old, &always),
            None => ch.added(&always),
        }
        self.always = Some(always);
        if !callers_same {
            self.callers = callers.iter().map(|c| (*c).to_string()).collect();
        }
        self.changes = exact.then_some(ch);
        // A mesh with a (namespace, name) twice is translated whole, and the memo
        // keeps one of the two: the next translation records no changes either.
        self.clean = order_clean;
        out
    }
}

/// One pod's memo entry: the model translated (the key's pod is only its name), its
/// resources, and the pass that last saw it.
#[derive(Debug)]
struct PodMemo {
    pod: Arc<Pod>,
    translated: Translated,
    seen: u64,
}

/// A pod as the memo's key: its (namespace, name), the pod's identity in the
/// translation. Holding the pod itself lets a lookup by a new pod's `Arc` allocate
/// nothing (the key keeps the first `Arc` of the name; [`PodMemo::pod`] the latest).
#[derive(Debug)]
struct PodId(Arc<Pod>);

impl PartialEq for PodId {
    fn eq(&self, other: &Self) -> bool {
        self.0.namespace == other.0.namespace && self.0.name == other.0.name
    }
}

impl Eq for PodId {}

impl std::hash::Hash for PodId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.namespace.hash(state);
        self.0.name.hash(state);
    }
}

/// The services in (namespace, name) order if the route configurations can be
/// joined from per-service parts: no (namespace, name) twice and no VIP in two
/// services (the only ways two services of a mesh share a domain: names are DNS
/// labels, so a name-derived domain is one service's alone). `None` otherwise.
fn joinable(services: &[Arc<Service>]) -> Option<Vec<&Arc<Service>>> {
    fn key(s: &Service) -> (&str, &str) {
        (s.namespace.as_str(), s.name.as_str())
    }
    let mut sorted: Vec<&Arc<Service>> = services.iter().collect();
    // The agent's services come sorted: check before sorting.
    if !sorted.windows(2).all(|w| key(w[0]) <= key(w[1])) {
        sorted.sort_by(|a, b| key(a).cmp(&key(b)));
    }
    if sorted.windows(2).any(|w| key(w[0]) == key(w[1])) {
        return None;
    }
    let mut vips = HashSet::new();
    for s in &sorted {
        let mut own = HashSet::new();
        for vip in &s.vips {
            if own.insert(*vip) && !vips.insert(*vip) {
                return None;
            }
        }
    }
    Some(sorted)
}

/// A whole translation with a fresh memo, as a sorted list of owned resources.
pub(crate) fn translate_once(flavor: Flavor, mesh: &Mesh, opts: &EnvoyOptions) -> Vec<Resource> {
    // The memo is dropped before the resources are taken out of their `Arc`s, so each
    // is held once and moved, not copied.
    let entries = Memo::new(flavor).translate(mesh, opts);
    let mut out = Vec::new();
    for (type_url, list) in entries {
        for (name, hash, any) in list {
            out.push(Resource {
                type_url,
                name: name.to_string(),
                hash,
                any: Arc::try_unwrap(any).unwrap_or_else(|shared| (*shared).clone()),
            });
        }
    }
    sort_dedup(out)
}
