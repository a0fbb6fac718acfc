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
//! per-change cost). When only some services changed under their names, the memo edits
//! its last output in place and the comparisons are of pointers in one contiguous
//! list ([`Memo::translate_shared`]). The route configurations depend on every
//! service: they are joined from per-service parts, and re-joined only when a part
//! changed; an equal secret reuses its resource.
//!
//! The one-shot translations run a fresh memo, so there is one translation, not a
//! memoized copy kept equal to it by a test. A memo's translations also depend on
//! the options (the local locality, timeouts): a call with options different from
//! the previous call's starts over.

use super::envoy::{
    EnvoyOptions, blackhole_cluster, caller_routes, caller_service_clusters,
    capture_caller_resources, capture_listener, encoded_service_routes, outbound_routes,
    pod_resources, routes_from_parts, secret_resource, service_resources, vhds_resources,
    vhds_route_config, vhds_split,
};
use super::grpc::grpc_service_resources;
use super::model::ambiguous_service_names;
use super::model::{Mesh, Pod, Secret, Service};
use super::names;
use super::{Resource, sort_dedup};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, VIRTUAL_HOST};
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
/// takes. The six xDS types are always present (possibly empty), so replacing each
/// removes what went away.
pub type Entries = BTreeMap<&'static str, Vec<(Name, ContentHash, Arc<Any>)>>;

/// One entity's translated resources, shared (`Arc`) so reuse copies pointers, not
/// bytes.
type Translated = Arc<Group>;

/// One entity's resources and how many there are of each of the six types: a
/// translation is a list of groups, and its per-type counts are sums of these, so
/// neither needs a walk over every resource.
#[derive(Debug)]
struct Group {
    items: Vec<Shared>,
    counts: [usize; 6],
}

impl std::ops::Deref for Group {
    type Target = [Shared];
    fn deref(&self) -> &[Shared] {
        &self.items
    }
}

fn group(items: Vec<Shared>) -> Translated {
    let mut counts = [0; 6];
    for (type_url, ..) in &items {
        counts[slot(type_url)] += 1;
    }
    Arc::new(Group { items, counts })
}

/// One translation's output: every entity's resources, as the shared groups the memo
/// keeps (one pointer per entity, not per resource). [`Translation::entries`] lists
/// them per type, which only a publisher that cannot apply the memo's
/// [`Changes`] needs.
///
/// The list is shared with the memo, which edits it in place on its next pass when
/// the publisher has dropped this one (no copy per publish).
#[derive(Debug, Default)]
pub struct Translation {
    groups: Arc<Vec<Translated>>,
    counts: [usize; 6],
}

/// A translation's groups while a whole pass builds them.
#[derive(Debug, Default)]
struct Out {
    groups: Vec<Translated>,
    counts: [usize; 6],
}

impl Out {
    fn push(&mut self, t: &Translated) {
        for (sum, n) in self.counts.iter_mut().zip(t.counts) {
            *sum += n;
        }
        self.groups.push(Arc::clone(t));
    }
}

/// Replaces `groups[at]` with `t`, keeping the per-type `counts` of `groups`.
fn set_group(groups: &mut [Translated], counts: &mut [usize; 6], at: usize, t: &Translated) {
    for ((sum, old), new) in counts.iter_mut().zip(groups[at].counts).zip(t.counts) {
        *sum = *sum - old + new;
    }
    groups[at] = Arc::clone(t);
}

impl Translation {
    /// The resources per type URL, each type's in translation order.
    pub fn entries(&self) -> Entries {
        let mut lists: Lists = Default::default();
        for (list, n) in lists.iter_mut().zip(self.counts) {
            list.reserve(n);
        }
        for t in self.groups.iter() {
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
    /// With VHDS ([`EnvoyOptions::vhds`]): the virtual host resources of `parts`, one
    /// group for every route configuration ([`vhds_group`]).
    vhosts: Option<Translated>,
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
        if let Some(v) = self.emitted.as_ref().and_then(|e| e.vhosts.as_ref()) {
            ch.gone(v);
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
    /// The last translation's groups and their per-type counts (what it returned).
    output: Arc<Vec<Translated>>,
    output_counts: [usize; 6],
    /// Where each input sits in `output`, when the last translation allows the next
    /// to edit it in place ([`Memo::translate_in_place`]).
    layout: Option<Layout>,
    /// How many translations were edits of the last output in place.
    in_place: u64,
}

/// The inputs of a clean translation (no (namespace, name) twice, services given in
/// (namespace, name) order, no captured pod), by address, in input order. Its
/// `output` is then laid out by position: one group per pod (Envoy flavor), then per
/// service its own group and one per caller, then the group of routes and secrets.
/// The addresses stay valid as identities: the memo holds every one of these `Arc`s
/// (the pods here, the services in their entries), so none is freed and reused
/// meanwhile.
#[derive(Debug)]
struct Layout {
    pods: Vec<Arc<Pod>>,
    services: Vec<usize>,
}

/// How this translation's pods differ from the last one's, position by position
/// ([`pod_edit`]).
#[derive(Debug, PartialEq, Eq)]
enum PodEdit {
    /// The very same `Arc`s.
    Same,
    /// One pod more, at this index; the others the same `Arc`s in the same order.
    Insert(usize),
    /// One pod less, at this index of the last list.
    Remove(usize),
    /// Other `Arc`s at these indices, the rest the same.
    Replace(Vec<usize>),
}

/// The edit that turns the pod list `was` into `now` if it is one of [`PodEdit`]'s
/// (what an ADD, a DEL or a changed record does to the agent's list); `None` for any
/// other difference.
fn pod_edit(was: &[Arc<Pod>], now: &[Arc<Pod>]) -> Option<PodEdit> {
    let same = |a: &[Arc<Pod>], b: &[Arc<Pod>]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y))
    };
    let first_difference = was
        .iter()
        .zip(now)
        .position(|(a, b)| !Arc::ptr_eq(a, b))
        .unwrap_or(was.len().min(now.len()));
    if was.len() == now.len() {
        let replaced: Vec<usize> = (first_difference..now.len())
            .filter(|&i| !Arc::ptr_eq(&was[i], &now[i]))
            .collect();
        Some(if replaced.is_empty() {
            PodEdit::Same
        } else {
            PodEdit::Replace(replaced)
        })
    } else if now.len() == was.len() + 1 {
        let i = first_difference;
        same(&was[i..], &now[i + 1..]).then_some(PodEdit::Insert(i))
    } else if was.len() == now.len() + 1 {
        let i = first_difference;
        same(&was[i + 1..], &now[i..]).then_some(PodEdit::Remove(i))
    } else {
        None
    }
}

/// The caller identity `pod` gives the translation: its SPIFFE ID if it has an
/// outbound listener and the ID names a trust domain.
fn caller_of(pod: &Pod) -> Option<&str> {
    if pod.outbound_port == 0 {
        return None;
    }
    pod.identity
        .as_deref()
        .filter(|id| super::model::trust_domain(id).is_some())
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

/// The six xDS types, in the order of a translation's [`Lists`].
const TYPES: [&str; 6] = [LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET, VIRTUAL_HOST];

/// A translation's entries while it is built: one list per type of [`TYPES`]
/// (indexed, not a map lookup of a 50-byte type URL per resource per publish).
type Lists = [Vec<(Name, ContentHash, Arc<Any>)>; 6];

/// `type_url`'s index in [`TYPES`]: by pointer (the constants themselves) first.
fn slot(type_url: &str) -> usize {
    TYPES
        .iter()
        .position(|t| std::ptr::eq(*t, type_url))
        .or_else(|| TYPES.iter().position(|t| *t == type_url))
        .expect("one of the six xDS types")
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

/// A pod's resources in `envoy`'s flavor (or proxyless gRPC's: its proxyless servers'
/// listeners).
fn pod_translation(envoy: bool, pod: &Pod, opts: &EnvoyOptions) -> Translated {
    if envoy {
        share(pod_resources(pod, opts))
    } else {
        share(super::grpc::grpc_pod_resources(pod))
    }
}

/// A service's own resources in `envoy`'s flavor (or proxyless gRPC's).
fn own_resources(envoy: bool, svc: &Service, opts: &EnvoyOptions) -> Translated {
    if envoy {
        share(service_resources(svc, opts))
    } else {
        share(grpc_service_resources(svc, opts))
    }
}

/// A service's part of the shared outbound route configuration.
fn shared_part(svc: &Service, short: bool, opts: &EnvoyOptions) -> Arc<Vec<u8>> {
    Arc::new(encoded_service_routes(
        svc,
        short,
        opts,
        &|ns, name, port, _| names::outbound_cluster_of(name, ns, port),
    ))
}

/// A service's part of `caller`'s route configuration: to its mTLS cluster of a port
/// where `clusters` (its clusters for `caller`) has one, else to the plain one.
fn caller_part(
    svc: &Service,
    short: bool,
    opts: &EnvoyOptions,
    caller: &str,
    clusters: &Translated,
) -> Arc<Vec<u8>> {
    let has = |name: &str| {
        clusters
            .iter()
            .any(|(ty, n, ..)| *ty == CLUSTER && &**n == name)
    };
    // A backend of a route rule says whether its port is mTLS itself: the memo
    // keeps this part while the service is unchanged, and the resolution that set
    // `BackendRef::mtls` is part of the service.
    Arc::new(encoded_service_routes(
        svc,
        short,
        opts,
        &|ns, name, port, backend_mtls| {
            let cluster = names::mtls_cluster_of(name, ns, port, caller);
            if backend_mtls.unwrap_or_else(|| has(&cluster)) {
                cluster
            } else {
                names::outbound_cluster_of(name, ns, port)
            }
        },
    ))
}

/// The name of route configuration `key` (`None`: the shared one).
fn route_name(key: Option<&str>) -> String {
    match key {
        None => names::OUTBOUND_ROUTE.to_string(),
        Some(caller) => names::outbound_route_for(caller),
    }
}

/// A service's virtual hosts as VHDS resources: its `parts` of the shared route
/// configuration and of each of `callers`' (in that order), one group. Built from the
/// parts (decoded, renamed), so it is exactly what joining them would have served.
fn vhds_group<'a>(
    parts: &[Arc<Vec<u8>>],
    callers: impl IntoIterator<Item = &'a str>,
) -> Translated {
    let keys = std::iter::once(None).chain(callers.into_iter().map(Some));
    share(
        keys.zip(parts)
            .flat_map(|(key, part)| vhds_resources(&route_name(key), part))
            .collect(),
    )
}

/// Pushes each secret's resource, reusing the one in `kept` for an equal secret (no
/// re-encoding and re-hashing of its PEMs); `kept` then holds these secrets.
fn push_secrets(
    kept: &mut HashMap<String, (Secret, Shared)>,
    secrets: &[Secret],
    always: &mut Vec<Shared>,
) {
    let mut next = HashMap::with_capacity(secrets.len());
    for secret in secrets {
        // Equal: the kept copy moves over (no copy of key material).
        let entry = match kept.remove(&secret.name) {
            Some((last, r)) if last == *secret => (last, r),
            _ => (secret.clone(), shared(secret_resource(secret))),
        };
        always.push(entry.1.clone());
        next.insert(secret.name.clone(), entry);
    }
    *kept = next;
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
            output: Arc::default(),
            output_counts: [0; 6],
            layout: None,
            in_place: 0,
        }
    }

    /// How many translations so far were edits of the previous one's output in
    /// place (given the same pods and services as the same `Arc`s but for a few
    /// services edited under their names), not a walk over every service.
    pub fn in_place_count(&self) -> u64 {
        self.in_place
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
        self.layout = None;
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
    /// caller are kept with it too.
    ///
    /// When the pods are the very same `Arc`s as last time and every service that is
    /// not has the same (namespace, name) and VIPs as the one at its place (an
    /// endpoint change, the common case at scale), the last output is edited in place
    /// instead ([`Memo::in_place_count`]): one pointer comparison per service over a
    /// contiguous list, and only the changed services' entries are touched; a route
    /// configuration is re-joined only if a changed service's part of it differs.
    /// Otherwise (a service or pod added or removed, a rename, captured pods, whose
    /// outbound listeners depend on every service) the whole pass walks every
    /// service once.
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
            self.layout = None;
            self.opts = Some(opts.clone());
        }
        if let Some(t) = self.translate_in_place(services, pods, secrets, opts) {
            return t;
        }
        // Until this pass has finished, no layout: a pass that did not finish (a
        // panic) leaves none for the next to edit.
        self.layout = None;
        let mut exact = self.clean;
        let mut ch = Changes::default();
        self.pass += 1;
        let pass = self.pass;
        let envoy = self.flavor == Flavor::Envoy;
        let vhds = envoy && opts.vhds;
        let mut out = Out {
            groups: Vec::with_capacity(pods.len() + services.len() + 1),
            counts: [0; 6],
        };
        // Kept in place and marked with the pass (one lookup per pod, no new map),
        // then swept: what this pass did not see went away.
        let mut pods_twice = false;
        {
            for pod in pods {
                let id = PodId(Arc::clone(pod));
                match self.pods.get_mut(&id) {
                    Some(m) if m.seen == pass => {
                        // The same (namespace, name) twice (an invalid mesh): both are
                        // translated, as a whole translation would, and the later one
                        // is kept.
                        pods_twice = true;
                        exact = false;
                        let t = pod_translation(envoy, pod, opts);
                        out.push(&t);
                        *m = PodMemo {
                            pod: Arc::clone(pod),
                            translated: t,
                            seen: pass,
                        };
                    }
                    Some(m) => {
                        if !Arc::ptr_eq(&m.pod, pod) && m.pod != *pod {
                            let t = pod_translation(envoy, pod, opts);
                            ch.replaced(&m.translated, &t);
                            m.translated = t;
                        }
                        m.pod = Arc::clone(pod);
                        m.seen = pass;
                        out.push(&m.translated);
                    }
                    None => {
                        let t = pod_translation(envoy, pod, opts);
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
            pods.iter().filter_map(|p| caller_of(p)).collect()
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
            // What the entry emitted before (its virtual hosts, with VHDS), if it is
            // emitted anew.
            let mut old_emitted = None;
            let mut entry = match old.take(svc, &mut ch) {
                Some(mut e) if Arc::ptr_eq(&e.model, svc) || *e.model == **svc => {
                    e.model = Arc::clone(svc);
                    e
                }
                prev => {
                    let own = own_resources(envoy, svc, opts);
                    match prev {
                        Some(mut prev) => {
                            ch.replaced(&prev.own, &own);
                            old_callers = std::mem::take(&mut prev.callers);
                            old_emitted = prev.emitted.take();
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
                if let Some(v) = &em.vhosts {
                    out.push(v);
                }
                kept.push(entry);
                continue;
            }
            if old_emitted.is_none() {
                old_emitted = entry.emitted.take();
            }
            let mut emitted = Emitted {
                epoch,
                short,
                callers: Vec::with_capacity(callers.len()),
                parts: Vec::with_capacity(callers.len() + 1),
                vhosts: None,
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
                        let part = shared_part(svc, short, opts);
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
                            let part = caller_part(svc, short, opts, caller, &t);
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
            if vhds && order.is_some() {
                let old = old_emitted.and_then(|e| {
                    // The virtual hosts' names hold the callers too, which the parts'
                    // bytes do not (a service routing every caller to its plain cluster
                    // has the same part for each): reused only for the same callers.
                    let same = e.epoch == emitted.epoch && same_parts(&e.parts, &emitted.parts);
                    e.vhosts.map(|v| (same, v))
                });
                let v = match old {
                    Some((true, v)) => v,
                    Some((false, v)) => {
                        let new = vhds_group(&emitted.parts, callers.iter().copied());
                        ch.replaced(&v, &new);
                        new
                    }
                    None => {
                        let new = vhds_group(&emitted.parts, callers.iter().copied());
                        ch.added(&new);
                        new
                    }
                };
                out.push(&v);
                emitted.vhosts = Some(v);
            } else if let Some(v) = old_emitted.and_then(|e| e.vhosts) {
                ch.gone(&v);
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
                    // With VHDS the configuration depends on its name alone.
                    Some(last) if vhds || same_parts(&last.parts, &parts) => last.route,
                    _ => {
                        let name = route_name(key.as_deref());
                        if vhds {
                            shared(vhds_route_config(&name))
                        } else {
                            shared(routes_from_parts(&name, parts.iter().map(|p| p.as_slice())))
                        }
                    }
                };
                always.push(route.clone());
                joined.insert(key, Joined { parts, route });
            }
            self.joined = joined;
        } else if envoy {
            self.joined.clear();
            let mut routes = vec![outbound_routes(services, opts)];
            for (caller, names) in &mtls {
                let has = |name: &str| names.contains(name);
                routes.push(caller_routes(caller, services, opts, &has));
            }
            for r in routes {
                if vhds {
                    always.extend(vhds_split(&r).into_iter().map(shared));
                } else {
                    always.push(shared(r));
                }
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
            // The trace collector every connection manager exports its spans to.
            always.extend(
                opts.tracing
                    .as_ref()
                    .map(|t| shared(super::telemetry::trace_collector_cluster(t))),
            );
            push_secrets(&mut self.secrets, secrets, &mut always);
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
        // The next pass may edit this output in place if it is laid out by position:
        // the services came in the order they were translated in, and no captured
        // pod's listener depends on every service.
        let pod_groups = pods.len();
        let in_input_order = sorted
            .as_ref()
            .is_some_and(|s| s.iter().zip(services).all(|(a, b)| Arc::ptr_eq(a, b)));
        let no_capture = !envoy || pods.iter().all(|p| p.capture.is_none());
        self.layout = (order_clean
            && in_input_order
            && no_capture
            && out.groups.len()
                == pod_groups + services.len() * (1 + callers.len() + usize::from(vhds)) + 1)
            .then(|| Layout {
                pods: pods.to_vec(),
                services: services.iter().map(|s| Arc::as_ptr(s) as usize).collect(),
            });
        self.output = Arc::new(out.groups);
        self.output_counts = out.counts;
        Translation {
            groups: Arc::clone(&self.output),
            counts: self.output_counts,
        }
    }

    /// The next translation as an edit of the last one's output, in O(changed
    /// services + pods + callers + secrets) instead of a walk over every service:
    /// when the last translation left a [`Layout`], the pods are the very same `Arc`s
    /// and every service that is not has the same (namespace, name) and VIPs as the
    /// one it replaces (so the order, the joinability and the short names stay the
    /// same). `None`, changing nothing, otherwise: the whole pass runs. The changes
    /// it records are exact, as the whole pass's are.
    fn translate_in_place(
        &mut self,
        services: &[Arc<Service>],
        pods: &[Arc<Pod>],
        secrets: &[Secret],
        opts: &EnvoyOptions,
    ) -> Option<Translation> {
        let envoy = self.flavor == Flavor::Envoy;
        let layout = self.layout.as_mut()?;
        if !self.clean || layout.services.len() != services.len() {
            return None;
        }
        // A pod added, removed or replaced is edited in place too, if the callers
        // stay the same (a caller identity new or gone changes every service's
        // groups) and no pod is captured (a captured pod's listener depends on every
        // service). An ADD or DEL with many pods present then costs O(its pod), not a
        // pass over every pod (a hash of each one's name, the caller set rebuilt).
        let pod_edit = pod_edit(&layout.pods, pods)?;
        let is_caller = |id: &str| self.callers.iter().any(|c| c == id);
        match &pod_edit {
            PodEdit::Same => {}
            PodEdit::Insert(i) => {
                let pod = &pods[*i];
                // Only Envoy's output of a pod depends on its capture and its caller
                // identity (the outbound listener and the callers' routes); the
                // proxyless flavor's is the pod's own server listeners.
                if (envoy
                    && (pod.capture.is_some() || caller_of(pod).is_some_and(|id| !is_caller(id))))
                    || self.pods.contains_key(&PodId(Arc::clone(pod)))
                {
                    return None;
                }
            }
            PodEdit::Remove(i) => {
                let pod = &layout.pods[*i];
                if !self
                    .pods
                    .get(&PodId(Arc::clone(pod)))
                    .is_some_and(|m| Arc::ptr_eq(&m.pod, pod))
                {
                    return None;
                }
                // Its caller identity stays a caller only if another pod has it.
                // (The same ID: it names a trust domain, as it did for this pod.)
                if envoy
                    && let Some(id) = caller_of(pod)
                    && !pods
                        .iter()
                        .any(|p| p.outbound_port != 0 && p.identity.as_deref() == Some(id))
                {
                    return None;
                }
            }
            PodEdit::Replace(at) => {
                for &i in at {
                    let (was, now) = (&layout.pods[i], &pods[i]);
                    if was.namespace != now.namespace
                        || was.name != now.name
                        || (envoy && now.capture.is_some())
                        || (envoy && caller_of(was) != caller_of(now))
                        || !self
                            .pods
                            .get(&PodId(Arc::clone(now)))
                            .is_some_and(|m| Arc::ptr_eq(&m.pod, was))
                    {
                        return None;
                    }
                }
            }
        }
        // A pointer comparison per service, over two contiguous arrays: the unchanged
        // services' entries are not touched.
        let changed: Vec<usize> = layout
            .services
            .iter()
            .zip(services)
            .enumerate()
            .filter(|(_, (a, s))| **a != Arc::as_ptr(s) as usize)
            .map(|(i, _)| i)
            .collect();
        // Every route configuration of the last pass was joined (a clean Envoy pass
        // joins them all): checked here, so nothing below fails half-way.
        if envoy
            && (self.joined.len() != 1 + self.callers.len()
                || !self.joined.contains_key(&None)
                || self
                    .callers
                    .iter()
                    .any(|c| !self.joined.contains_key(&Some(c.clone()))))
        {
            return None;
        }
        for &i in &changed {
            let (was, now) = (&self.services[i].model, &services[i]);
            if was.namespace != now.namespace || was.name != now.name || was.vips != now.vips {
                return None;
            }
        }
        let mut ch = Changes::default();
        let pod_groups = pods.len();
        let vhds = envoy && opts.vhds;
        // A service's groups: its own, one per caller, and its virtual hosts (VHDS).
        let per_service = 1 + self.callers.len() + usize::from(vhds);
        let output = Arc::make_mut(&mut self.output);
        let counts = &mut self.output_counts;
        match pod_edit {
            PodEdit::Same => {}
            PodEdit::Insert(i) => {
                let pod = &pods[i];
                let t = pod_translation(envoy, pod, opts);
                ch.added(&t);
                for (sum, n) in counts.iter_mut().zip(t.counts) {
                    *sum += n;
                }
                output.insert(i, Arc::clone(&t));
                self.pods.insert(
                    PodId(Arc::clone(pod)),
                    PodMemo {
                        pod: Arc::clone(pod),
                        translated: t,
                        seen: self.pass,
                    },
                );
                layout.pods.insert(i, Arc::clone(pod));
            }
            PodEdit::Remove(i) => {
                let pod = layout.pods.remove(i);
                if let Some(m) = self.pods.remove(&PodId(pod)) {
                    ch.gone(&m.translated);
                }
                for (sum, n) in counts.iter_mut().zip(output[i].counts) {
                    *sum -= n;
                }
                output.remove(i);
            }
            PodEdit::Replace(at) => {
                for i in at {
                    let pod = &pods[i];
                    if let Some(m) = self.pods.get_mut(&PodId(Arc::clone(pod))) {
                        if *m.pod != **pod {
                            let t = pod_translation(envoy, pod, opts);
                            ch.replaced(&m.translated, &t);
                            set_group(output, counts, i, &t);
                            m.translated = t;
                        }
                        m.pod = Arc::clone(pod);
                    }
                    layout.pods[i] = Arc::clone(pod);
                }
            }
        }
        // Per route configuration (the shared one, then each caller's), whether a
        // part changed.
        let mut dirty = vec![false; per_service];
        for i in changed {
            let svc = &services[i];
            layout.services[i] = Arc::as_ptr(svc) as usize;
            let entry = &mut self.services[i];
            if *entry.model == **svc {
                entry.model = Arc::clone(svc);
                continue;
            }
            entry.model = Arc::clone(svc);
            let at = pod_groups + i * per_service;
            let own = own_resources(envoy, svc, opts);
            ch.replaced(&entry.own, &own);
            set_group(output, counts, at, &own);
            entry.own = own;
            let Some(emitted) = entry.emitted.as_mut() else {
                continue;
            };
            let short = emitted.short;
            let part = shared_part(svc, short, opts);
            entry.route = Some((short, Arc::clone(&part)));
            for (index, caller) in self.callers.iter().enumerate() {
                let t = share(caller_service_clusters(caller, svc, opts));
                match entry.callers.insert(caller.clone(), Arc::clone(&t)) {
                    Some(old) => ch.replaced(&old, &t),
                    None => ch.added(&t),
                }
                set_group(output, counts, at + 1 + index, &t);
                let part = caller_part(svc, short, opts, caller, &t);
                entry
                    .caller_routes
                    .insert(caller.clone(), (short, Arc::clone(&part)));
                emitted.callers[index] = t;
                dirty[index + 1] |= replace_part(&mut self.joined, Some(caller), i, &part);
                emitted.parts[index + 1] = part;
            }
            dirty[0] |= replace_part(&mut self.joined, None, i, &part);
            emitted.parts[0] = part;
            if vhds {
                let new = vhds_group(&emitted.parts, self.callers.iter().map(String::as_str));
                match emitted.vhosts.replace(Arc::clone(&new)) {
                    Some(old) => ch.replaced(&old, &new),
                    None => ch.added(&new),
                }
                set_group(output, counts, at + per_service - 1, &new);
            }
        }
        let mut always: Vec<Shared> = Vec::new();
        if envoy {
            let keys = std::iter::once(None).chain(self.callers.iter().map(Some));
            for (key, dirty) in keys.zip(dirty) {
                let joined = self
                    .joined
                    .get_mut(&key.cloned())
                    .expect("checked: every route configuration was joined");
                // With VHDS a route configuration never changes: its virtual hosts do.
                if dirty && !vhds {
                    let name = match key {
                        None => names::OUTBOUND_ROUTE.to_string(),
                        Some(caller) => names::outbound_route_for(caller),
                    };
                    joined.route = shared(routes_from_parts(
                        &name,
                        joined.parts.iter().map(|p| p.as_slice()),
                    ));
                }
                always.push(joined.route.clone());
            }
            // The trace collector's cluster, as the whole pass makes it (the one of
            // last time: the options are the same).
            if opts.tracing.is_some() {
                let kept = self.always.as_ref().and_then(|last| {
                    last.iter()
                        .find(|(ty, name, ..)| {
                            *ty == CLUSTER && &**name == super::telemetry::TRACE_COLLECTOR_CLUSTER
                        })
                        .cloned()
                });
                always.extend(kept.or_else(|| {
                    opts.tracing
                        .as_ref()
                        .map(|t| shared(super::telemetry::trace_collector_cluster(t)))
                }));
            }
            push_secrets(&mut self.secrets, secrets, &mut always);
        }
        let last = self
            .always
            .take()
            .expect("a clean translation has its always group");
        let same = last.len() == always.len()
            && last
                .iter()
                .zip(&always)
                .all(|(a, b)| Arc::ptr_eq(&a.3, &b.3));
        let always = if same {
            last
        } else {
            let always = group(always);
            ch.replaced(&last, &always);
            let at = output.len() - 1;
            set_group(output, counts, at, &always);
            always
        };
        self.always = Some(always);
        self.changes = Some(ch);
        self.in_place += 1;
        Some(Translation {
            groups: Arc::clone(&self.output),
            counts: self.output_counts,
        })
    }
}

/// Puts `part` at `index` of `key`'s joined route configuration; whether it differs
/// from the part there (by pointer, then by bytes: a re-translated service's part is
/// often equal, as an endpoint change alters no route).
fn replace_part(
    joined: &mut HashMap<Option<String>, Joined>,
    key: Option<&String>,
    index: usize,
    part: &Arc<Vec<u8>>,
) -> bool {
    let Some(j) = joined.get_mut(&key.cloned()) else {
        return true;
    };
    let Some(slot) = j.parts.get_mut(index) else {
        return true;
    };
    let differs = !(Arc::ptr_eq(slot, part) || slot.as_slice() == part.as_slice());
    *slot = Arc::clone(part);
    differs
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
