//! ADS: one stream, many types, and the order their responses go out in.
//!
//! **Adds and changes ("make")** go out in Envoy's documented order
//! SDS → CDS → EDS → LDS → RDS → VHDS: a type's new or changed resources are withheld while
//! any type before it in that order has new or changed resources not yet *sent*. So
//! a cluster's endpoints never arrive before the cluster (Envoy can drop endpoints of
//! a cluster it does not have yet and then wait forever), a changed cluster is sent
//! before its endpoints' change, listeners arrive after the clusters they route to,
//! and route configurations after their listeners.
//!
//! **Removals ("break")** go out in the order VHDS → LDS → RDS → CDS → EDS → SDS: a type's
//! removals are withheld while any type before it in that order has anything unsent
//! (new, changed or removed). An LDS/RDS update that drops the last reference to a
//! cluster therefore goes out before the CDS removal of that cluster
//! (make-before-break). How a withheld removal looks on the wire:
//!
//! * **SotW**: a response carries the full set, so a withheld removal is a resource
//!   the response still *includes*, at the content the client holds; the removal
//!   happens in a later response of that type, once the referrers are out.
//! * **Delta**: the name is left out of `removed_resources` until then.
//!
//! "Sent" is the bar, not "ACKed": responses on one stream are processed in order, so
//! a client has applied the CDS response before it reads the EDS one behind it, and
//! Envoy only subscribes to a cluster's endpoints after it has the cluster. Waiting
//! for the CDS ACK would cost a round trip per change for no ordering gain. Each type
//! still has at most one response in flight, so a type waiting for its ACK holds back
//! the types after it — with one exception, below.
//!
//! **Endpoints requested by name go out while a CDS response awaits its ACK.** Envoy
//! withholds the ACK of a CDS response while the clusters it added or changed warm,
//! and a cluster warms on its endpoints. Holding EDS back behind CDS's next change then
//! stalls both until Envoy gives up waiting (its initial fetch timeout, 15 s): new
//! services are unreachable that long after any burst of changes. A client asks for a
//! cluster's endpoints only once it has the cluster, so endpoints it asked for by name
//! never arrive before their cluster; a wildcard EDS subscriber gets endpoints it did
//! not ask for, and for it the rule stays strict.
//!
//! **Virtual hosts (VHDS)** are ordered as route configurations' parts: a virtual
//! host's change goes out after RDS's (so after the clusters it routes to, and after
//! the route configuration whose name is its namespace). Its removal goes first of
//! all: removing a virtual host breaks no reference (a route configuration names its
//! virtual hosts' namespace, not them), and a host name moving between services
//! (a Service gone from one namespace and added in another, a reused cluster IP)
//! must leave before it arrives — Envoy rejects a route table with two virtual hosts
//! sharing a domain, and with whole route configurations the move was one update.
//! Held behind a listener's removal instead, the new virtual host would go out
//! first. Still before the clusters' removals: a virtual host never routes to a
//! cluster already gone.
//!
//! Types outside these six (runtime, extension configs…) are not ordered.
//!
//! Progress: the make order is a chain, so the first type in it with unsent changes is
//! never withheld; once no changes are unsent, the first type in the break order with
//! unsent removals is never withheld. Nothing waits on something that waits on it —
//! including the client: the one wait Envoy adds (a CDS ACK on EDS) is the exception
//! above.

use super::state::Gate;
use super::{
    DeltaRequest, DeltaResponse, DeltaState, Nonces, Pending, RequestOutcome, SotwRequest,
    SotwResponse, SotwState, StreamStats,
};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, VIRTUAL_HOST};
use flock_core::resources::{Name, ResourceSet, TypeDiff, diff};
use std::collections::BTreeMap;
use std::fmt;

/// The order adds and changes go out in.
pub const MAKE_ORDER: [&str; 6] = [SECRET, CLUSTER, ENDPOINT, LISTENER, ROUTE, VIRTUAL_HOST];
/// The order removals go out in.
pub const BREAK_ORDER: [&str; 6] = [VIRTUAL_HOST, LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET];

fn rank(order: &[&str; 6], type_url: &str) -> Option<usize> {
    order.iter().position(|t| *t == type_url)
}

/// What the ADS coordinator needs from a per-type machine.
pub trait TypeMachine<V> {
    /// The response type.
    type Response;
    /// A machine for a type first requested on the stream.
    fn for_type(type_url: &str) -> Self;
    /// Takes the stream's newer snapshot, with this type's part of the diff.
    fn take_snapshot(&mut self, set: &ResourceSet<V>, version: u64, diff: Option<&TypeDiff>);
    /// What would be sent if allowed.
    fn pending_work(&self) -> Pending;
    /// The next response allowed by `gate`.
    fn poll_with(&mut self, gate: Gate, nonces: &mut Nonces) -> Option<Self::Response>;
    /// The machine's state size.
    fn state_stats(&self) -> StreamStats;
    /// How many names the type's subscription holds (`*` not counted).
    fn subscription_names(&self) -> usize;
    /// Bytes of the names explicitly subscribed (their lengths summed).
    fn subscription_bytes(&self) -> usize;
    /// Whether a response of this type is out and not yet ACKed or NACKed.
    fn awaits_ack(&self) -> bool;
    /// Whether the client receives every resource of the type (`*` or the legacy
    /// rule), not only the names it asked for.
    fn is_wildcard(&self) -> bool;
}

impl<V> TypeMachine<V> for SotwState<V> {
    type Response = SotwResponse<V>;
    fn for_type(type_url: &str) -> Self {
        SotwState::new(type_url)
    }
    fn take_snapshot(&mut self, set: &ResourceSet<V>, version: u64, diff: Option<&TypeDiff>) {
        self.apply(set, version, diff);
    }
    fn pending_work(&self) -> Pending {
        self.pending()
    }
    fn poll_with(&mut self, gate: Gate, nonces: &mut Nonces) -> Option<SotwResponse<V>> {
        self.poll_gated(gate, nonces)
    }
    fn state_stats(&self) -> StreamStats {
        self.stats()
    }
    fn subscription_names(&self) -> usize {
        self.subscription().names().len()
    }
    fn subscription_bytes(&self) -> usize {
        self.subscription().bytes()
    }
    fn awaits_ack(&self) -> bool {
        self.awaiting_ack()
    }
    fn is_wildcard(&self) -> bool {
        self.subscription().is_wildcard()
    }
}

impl<V> TypeMachine<V> for DeltaState<V> {
    type Response = DeltaResponse<V>;
    fn for_type(type_url: &str) -> Self {
        DeltaState::new(type_url)
    }
    fn take_snapshot(&mut self, set: &ResourceSet<V>, version: u64, diff: Option<&TypeDiff>) {
        self.apply(set, version, diff);
    }
    fn pending_work(&self) -> Pending {
        if self.is_requested() {
            self.pending()
        } else {
            Pending::default()
        }
    }
    fn poll_with(&mut self, gate: Gate, nonces: &mut Nonces) -> Option<DeltaResponse<V>> {
        self.poll_gated(gate, nonces)
    }
    fn state_stats(&self) -> StreamStats {
        self.stats()
    }
    fn subscription_names(&self) -> usize {
        self.subscription().names().len()
    }
    fn subscription_bytes(&self) -> usize {
        self.subscription().bytes()
    }
    fn awaits_ack(&self) -> bool {
        self.awaiting_ack()
    }
    fn is_wildcard(&self) -> bool {
        self.subscription().is_wildcard()
    }
}

/// One ADS stream: a machine per requested type, one snapshot, one nonce source, and
/// the ordering rules of the module docs.
pub struct Ads<V, M> {
    machines: BTreeMap<Name, M>,
    set: ResourceSet<V>,
    version: u64,
    nonces: Nonces,
}

/// An ADS stream speaking State-of-the-World (`StreamAggregatedResources`).
pub type SotwAds<V> = Ads<V, SotwState<V>>;
/// An ADS stream speaking Delta (`DeltaAggregatedResources`).
pub type DeltaAds<V> = Ads<V, DeltaState<V>>;

impl<V, M: TypeMachine<V>> Default for Ads<V, M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V, M: TypeMachine<V>> Ads<V, M> {
    /// A stream with no request and no snapshot yet.
    pub fn new() -> Self {
        Self {
            machines: BTreeMap::new(),
            set: ResourceSet::new(),
            version: 0,
            nonces: Nonces::new(),
        }
    }

    /// Takes a snapshot; returns false (and ignores it) unless it is newer than the
    /// last one taken. The diff is computed once for all types: O(changes) when `set`
    /// was derived from the previous one, else O(size of the types that differ).
    pub fn on_snapshot(&mut self, set: &ResourceSet<V>, version: u64) -> bool {
        if !super::is_newer(self.version, version) {
            return false;
        }
        let d = diff(&self.set, set);
        for (type_url, machine) in &mut self.machines {
            machine.take_snapshot(set, version, d.types.get(type_url));
        }
        self.set = set.clone();
        self.version = version;
        true
    }

    /// The snapshot version the stream is at (0: none yet).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The machine of one type, if the client requested it.
    pub fn get(&self, type_url: &str) -> Option<&M> {
        self.machines.get(type_url)
    }

    /// The machine of a type, created (at the stream's snapshot) on first use.
    fn machine(&mut self, type_url: &str) -> &mut M {
        if !self.machines.contains_key(type_url) {
            let mut machine = M::for_type(type_url);
            if self.version > 0 {
                // No diff needed: nothing is subscribed or held yet; the first
                // request's subscription looks the names up.
                machine.take_snapshot(&self.set, self.version, None);
            }
            self.machines.insert(Name::from(type_url), machine);
        }
        self.machines
            .get_mut(type_url)
            .expect("inserted just above")
    }

    /// The next response of any type, in the order of the module docs. Call it until
    /// it returns `None` after every request and snapshot, and only when the response
    /// can be written at once.
    pub fn poll_response(&mut self) -> Option<M::Response> {
        let pending: Vec<TypeState> = self
            .machines
            .iter()
            .map(|(t, m)| TypeState {
                type_url: t.clone(),
                pending: m.pending_work(),
                awaits_ack: m.awaits_ack(),
                wildcard: m.is_wildcard(),
            })
            .collect();
        // Every type is a candidate: one with nothing pending may still owe its
        // initial response.
        let mut candidates: Vec<&Name> = pending.iter().map(|t| &t.type_url).collect();
        candidates.sort_by_key(|t| (rank(&MAKE_ORDER, t).unwrap_or(usize::MAX), *t));
        for type_url in candidates {
            let gate = gate_for(type_url, &pending);
            let machine = self.machines.get_mut(type_url).expect("listed above");
            if let Some(response) = machine.poll_with(gate, &mut self.nonces) {
                return Some(response);
            }
        }
        None
    }

    /// Names explicitly subscribed on the stream, summed over its types (`*` is not a
    /// name: a wildcard subscription is bounded by the snapshot, which the server
    /// controls).
    pub fn subscribed_names(&self) -> usize {
        self.machines.values().map(|m| m.subscription_names()).sum()
    }

    /// [`subscribed_names`](Self::subscribed_names) without the type `type_url`.
    fn subscribed_names_except(&self, type_url: &str) -> usize {
        self.machines
            .iter()
            .filter(|(t, _)| &***t != type_url)
            .map(|(_, m)| m.subscription_names())
            .sum()
    }

    /// Bytes of the names explicitly subscribed on the stream, summed over its types
    /// except `type_url` (what a byte budget is checked against, with the type of a
    /// request replaced by what the request leaves).
    fn subscribed_bytes_except(&self, type_url: &str) -> usize {
        self.machines
            .iter()
            .filter(|(t, _)| &***t != type_url)
            .map(|(_, m)| m.subscription_bytes())
            .sum()
    }

    /// The stream's state size (all types).
    pub fn stats(&self) -> StreamStats {
        self.machines
            .values()
            .fold(StreamStats::default(), |acc, m| acc + m.state_stats())
    }
}

/// One type's state as the ordering sees it.
struct TypeState {
    type_url: Name,
    pending: Pending,
    awaits_ack: bool,
    wildcard: bool,
}

/// What `type_url` may send now, given every type's state.
fn gate_for(type_url: &str, types: &[TypeState]) -> Gate {
    let before = |order: &[&str; 6], t: &str| match (rank(order, t), rank(order, type_url)) {
        (Some(a), Some(b)) => a < b,
        _ => false,
    };
    let this = types.iter().find(|t| &*t.type_url == type_url);
    // Endpoints requested by name are not held back by a CDS response awaiting its
    // ACK: Envoy withholds that ACK while the clusters it added or changed warm, and
    // they warm on their endpoints, so waiting would stall both until Envoy's initial
    // fetch timeout (15 s). It is safe because a client asks for a cluster's endpoints
    // only once it has the cluster; a wildcard EDS subscriber gets endpoints it did
    // not ask for, so for it the cluster must go first.
    let eds_by_name = type_url == ENDPOINT && this.is_some_and(|t| !t.wildcard);
    let changes = !types.iter().any(|t| {
        t.pending.make
            && before(&MAKE_ORDER, &t.type_url)
            && !(eds_by_name && &*t.type_url == CLUSTER && t.awaits_ack)
    });
    let removals = !types
        .iter()
        .any(|t| (t.pending.make || t.pending.brk) && before(&BREAK_ORDER, &t.type_url));
    let changes = if flock_core::reintroduced!("xds-eds-behind-unacked-cds") {
        !types
            .iter()
            .any(|t| t.pending.make && before(&MAKE_ORDER, &t.type_url))
    } else {
        changes
    };
    let changes = changes || flock_core::reintroduced!("xds-eds-before-cds");
    let removals = removals || flock_core::reintroduced!("xds-break-before-make");
    Gate { changes, removals }
}

impl<V> Ads<V, SotwState<V>> {
    /// Feeds a request to its type's machine (created on the type's first request).
    pub fn on_request(&mut self, req: &SotwRequest) -> RequestOutcome {
        self.machine(&req.type_url).on_request(req)
    }

    /// [`subscribed_names`](Self::subscribed_names) once `req` would be applied,
    /// without applying it: what a limit on the stream's subscription is checked
    /// against before the request is fed.
    pub fn subscribed_names_after(&self, req: &SotwRequest) -> usize {
        self.subscribed_names_except(&req.type_url) + super::sotw::names_after(req)
    }

    /// The bytes of the names subscribed on the stream once `req` would be applied
    /// (see [`subscribed_names_after`](Self::subscribed_names_after)).
    pub fn subscribed_bytes_after(&self, req: &SotwRequest) -> usize {
        self.subscribed_bytes_except(&req.type_url) + super::sotw::bytes_after(req)
    }
}

impl<V> Ads<V, DeltaState<V>> {
    /// Feeds a request to its type's machine (created on the type's first request).
    pub fn on_request(&mut self, req: &DeltaRequest) -> RequestOutcome {
        if req.type_url == VIRTUAL_HOST {
            // Linked before the request is applied: a reconnecting Envoy announces the
            // virtual hosts it holds in its first VHDS request (after its RDS one), and
            // each is compared, not forgotten as unsubscribed.
            self.machine(VIRTUAL_HOST);
            self.link_vhds();
        }
        let outcome = self.machine(&req.type_url).on_request(req);
        if req.type_url == ROUTE {
            self.link_vhds();
        }
        outcome
    }

    /// Links the route configurations the stream subscribes to into its VHDS
    /// subscription as namespaces (see [`Subscription`](super::Subscription)).
    fn link_vhds(&mut self) {
        let Some(routes) = self.machines.get(ROUTE) else {
            return;
        };
        let names = routes.subscription().names().clone();
        if let Some(vhds) = self.machines.get_mut(VIRTUAL_HOST) {
            vhds.link_namespaces(&names);
        }
    }

    /// [`subscribed_names`](Self::subscribed_names) once `req` would be applied,
    /// without applying it: Delta subscriptions accumulate over requests, so this is
    /// the stream's names plus what `req` adds, minus what it removes.
    pub fn subscribed_names_after(&self, req: &DeltaRequest) -> usize {
        let current = self.machines.get(req.type_url.as_str());
        self.subscribed_names_except(&req.type_url)
            + super::delta::names_after(current.map(DeltaState::subscription), req)
    }

    /// The bytes of the names subscribed on the stream once `req` would be applied
    /// (see [`subscribed_names_after`](Self::subscribed_names_after)).
    pub fn subscribed_bytes_after(&self, req: &DeltaRequest) -> usize {
        let current = self.machines.get(req.type_url.as_str());
        self.subscribed_bytes_except(&req.type_url)
            + super::delta::bytes_after(current.map(DeltaState::subscription), req)
    }
}

impl<V, M> fmt::Debug for Ads<V, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ads")
            .field("types", &self.machines.keys().collect::<Vec<_>>())
            .field("version", &self.version)
            .field("last_nonce", &self.nonces.last())
            .finish()
    }
}
