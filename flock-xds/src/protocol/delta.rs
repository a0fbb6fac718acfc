//! Delta (incremental) xDS: per-resource versions, subscribe/unsubscribe, removals.

use super::state::{Core, Gate, Held};
use super::{Nonces, Pending, RequestOutcome, StreamStats, Subscription};
use crate::types::{WILDCARD, allows_legacy_wildcard};
use flock_core::ContentHash;
use flock_core::resources::{Entry, Name, ResourceSet, TypeDiff};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The fields of a `DeltaDiscoveryRequest` the protocol decides on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeltaRequest {
    /// `type_url`.
    pub type_url: String,
    /// `resource_names_subscribe` (`*` subscribes to everything).
    pub resource_names_subscribe: Vec<String>,
    /// `resource_names_unsubscribe` (`*` ends a wildcard subscription).
    pub resource_names_unsubscribe: Vec<String>,
    /// `initial_resource_versions`: name → version the client already holds (only
    /// read on the first request of the type on the stream).
    pub initial_resource_versions: BTreeMap<String, String>,
    /// `response_nonce`.
    pub response_nonce: String,
    /// `error_detail.message`, present on a NACK.
    pub error_detail: Option<String>,
}

/// One resource in a Delta response.
pub struct DeltaResource<V> {
    /// `Resource.name`.
    pub name: Name,
    /// The content hash; `Resource.version` is its hex form ([`version`](Self::version)).
    pub hash: ContentHash,
    /// The resource.
    pub value: Arc<V>,
}

impl<V> DeltaResource<V> {
    /// `Resource.version`: the content hash in hex.
    pub fn version(&self) -> String {
        self.hash.to_hex()
    }
}

/// A `DeltaDiscoveryResponse` to send.
pub struct DeltaResponse<V> {
    /// `type_url`.
    pub type_url: Name,
    /// `system_version_info`: the snapshot version, in decimal (informational).
    pub system_version_info: String,
    /// The snapshot version as a number.
    pub version: u64,
    /// `nonce`: unique and increasing on the stream.
    pub nonce: String,
    /// `resources`: new or changed resources, never one the client holds unchanged.
    pub resources: Vec<DeltaResource<V>>,
    /// `removed_resources`: subscribed names the client holds that no longer exist.
    pub removed_resources: Vec<Name>,
}

impl<V> fmt::Debug for DeltaResponse<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeltaResponse")
            .field("type_url", &self.type_url)
            .field("system_version_info", &self.system_version_info)
            .field("nonce", &self.nonce)
            .field(
                "resources",
                &self
                    .resources
                    .iter()
                    .map(|r| (&r.name, r.hash))
                    .collect::<Vec<_>>(),
            )
            .field("removed_resources", &self.removed_resources)
            .finish()
    }
}

/// What a Delta stream knows a client holds: a content hash we sent, or a version
/// string the client announced in `initial_resource_versions`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DeltaHeld {
    Hash(ContentHash),
    Announced(Box<str>),
}

impl<V> Held<V> for DeltaHeld {
    fn from_entry(entry: &Entry<V>) -> Self {
        DeltaHeld::Hash(entry.hash())
    }
    fn matches(&self, entry: &Entry<V>) -> bool {
        match self {
            DeltaHeld::Hash(h) => *h == entry.hash(),
            // Compared once: after a resend the stream holds the hash itself.
            DeltaHeld::Announced(v) => **v == entry.hash().to_hex(),
        }
    }
}

/// One Delta stream for one type. See the crate docs for the protocol decisions.
///
/// Same driving rules as [`SotwState`](super::SotwState): feed requests and newer
/// snapshots, then send what [`poll_response`](Self::poll_response) returns until it
/// returns `None`, polling only when the response can be written at once.
pub struct DeltaState<V> {
    core: Core<V, DeltaHeld>,
    nonces: Nonces,
}

impl<V> DeltaState<V> {
    /// A stream of `type_url` that has seen no request and no snapshot yet.
    pub fn new(type_url: &str) -> Self {
        Self {
            core: Core::new(type_url),
            nonces: Nonces::new(),
        }
    }

    /// The type URL.
    pub fn type_url(&self) -> &Name {
        &self.core.type_url
    }

    /// Classifies a request and applies its subscription changes. Unlike SotW, a
    /// stale request's subscription changes are applied (only its ACK/NACK part is
    /// ignored): Delta changes are incremental and the client never repeats them.
    pub fn on_request(&mut self, req: &DeltaRequest) -> RequestOutcome {
        let kind = self
            .core
            .classify(&req.response_nonce, req.error_detail.as_deref());
        let first = !self.core.requested;
        self.core.requested = true;
        if !first
            && req.resource_names_subscribe.is_empty()
            && req.resource_names_unsubscribe.is_empty()
        {
            // A plain ACK or NACK: the subscription stays. Envoy subscribes to every
            // cluster's endpoints by name, so rebuilding the subscription here would
            // cost O(subscribed names) per ACK on every stream.
            return RequestOutcome {
                type_url: self.core.type_url.clone(),
                kind,
                subscription_changed: false,
            };
        }
        let mut next = self.core.sub.clone();
        // A namespace (VHDS) is not a resource: nothing is owed about the name itself;
        // its resources are sent as any subscribed resource is.
        let by_namespace = self.core.sub.by_namespace();
        let newly: Vec<Name> = req
            .resource_names_subscribe
            .iter()
            .filter(|n| *n != WILDCARD && !by_namespace && !self.core.sub.contains(n))
            .map(|n| Name::from(n.as_str()))
            .collect();
        if first
            && req.resource_names_subscribe.is_empty()
            && allows_legacy_wildcard(&self.core.type_url)
        {
            next.legacy = true;
        }
        for name in &req.resource_names_subscribe {
            if name == WILDCARD {
                next.wildcard = true;
            } else {
                next.names.insert(Name::from(name.as_str()));
            }
        }
        for name in &req.resource_names_unsubscribe {
            if name == WILDCARD {
                next.wildcard = false;
                next.legacy = false;
            } else {
                next.names.remove(name.as_str());
            }
        }
        let mut announced = Vec::new();
        if first {
            for (name, version) in &req.initial_resource_versions {
                let name = Name::from(name.as_str());
                self.core
                    .held
                    .insert(name.clone(), DeltaHeld::Announced(version.as_str().into()));
                announced.push(name);
            }
        }
        let subscription_changed = self.core.set_subscription(next);
        for name in &announced {
            // Forgets what is not subscribed, marks removals and stale versions.
            self.core.refresh(name);
        }
        for name in &newly {
            // A newly subscribed name is owed an answer about its current state: the
            // resource if it exists, a removal if it does not (the Delta way to say
            // "does not exist"). Marking it held at an unknown version ("") makes the
            // answer pending either way — also when the resource is deleted before
            // the answer goes out. It is the only way to correct a client that got
            // the name from a response already in flight when it unsubscribed and
            // subscribed again (we forgot it at the unsubscribe): the model test found
            // both orders (missing at resubscribe, and deleted just after it).
            if self.core.sub.contains(name) && !self.core.held.contains_key(name) {
                self.core
                    .held
                    .insert(name.clone(), DeltaHeld::Announced("".into()));
                self.core.refresh(name);
            }
        }
        RequestOutcome {
            type_url: self.core.type_url.clone(),
            kind,
            subscription_changed,
        }
    }

    /// Takes a snapshot; returns false (and ignores it) unless it is newer than the
    /// last one taken. Costs O(changes of this type) when `set` was derived from the
    /// previous one with `edit()`.
    pub fn on_snapshot(&mut self, set: &ResourceSet<V>, version: u64) -> bool {
        self.core.on_snapshot(set, version)
    }

    /// The next response, if the client lacks something (or awaits its first
    /// response) and has acknowledged the previous one.
    pub fn poll_response(&mut self) -> Option<DeltaResponse<V>> {
        let mut nonces = std::mem::take(&mut self.nonces);
        let out = self.poll_gated(Gate::OPEN, &mut nonces);
        self.nonces = nonces;
        out
    }

    /// Like [`poll_response`](Self::poll_response) under an ADS [`Gate`], with the
    /// stream's shared nonce source.
    pub fn poll_gated(&mut self, gate: Gate, nonces: &mut Nonces) -> Option<DeltaResponse<V>> {
        let plan = self.core.take(gate, nonces)?;
        Some(DeltaResponse {
            type_url: self.core.type_url.clone(),
            system_version_info: plan.version.to_string(),
            version: plan.version,
            nonce: plan.nonce.to_string(),
            resources: plan
                .upserts
                .into_iter()
                .map(|(name, entry)| DeltaResource {
                    name,
                    hash: entry.hash(),
                    value: Arc::clone(entry.value()),
                })
                .collect(),
            removed_resources: plan.removals,
        })
    }

    /// Sets the namespaces linked from the stream's route configuration subscription
    /// (VHDS; see [`Subscription`]). Nothing for a type without namespaces.
    pub fn link_namespaces(&mut self, namespaces: &std::collections::BTreeSet<Name>) {
        if !self.core.sub.by_namespace() || self.core.sub.linked == *namespaces {
            return;
        }
        let mut next = self.core.sub.clone();
        next.linked = namespaces.clone();
        self.core.set_subscription(next);
    }

    /// The client's subscription.
    pub fn subscription(&self) -> &Subscription {
        &self.core.sub
    }

    /// The snapshot version of the last response the client ACKed on this stream.
    pub fn acked_version(&self) -> Option<u64> {
        self.core.acked_version()
    }

    /// Whether a response is in flight (sent, not yet ACKed or NACKed).
    pub fn awaiting_ack(&self) -> bool {
        self.core.awaiting_ack()
    }

    /// What would be sent if allowed.
    pub fn pending(&self) -> Pending {
        self.core.pending()
    }

    /// The size of this machine's state.
    pub fn stats(&self) -> StreamStats {
        self.core.stats()
    }

    pub(crate) fn apply(&mut self, set: &ResourceSet<V>, version: u64, diff: Option<&TypeDiff>) {
        self.core.apply_snapshot(set, version, diff);
    }

    pub(crate) fn is_requested(&self) -> bool {
        self.core.requested
    }
}

/// How many names (`*` not counted) the subscription of the request's type holds once
/// `req` is applied to `current` (`None`: the type has no machine on the stream yet).
/// Follows [`DeltaState::on_request`]: subscriptions first, then unsubscriptions, so a
/// name in both lists ends up unsubscribed; `initial_resource_versions` subscribes
/// nothing by itself.
pub fn names_after(current: Option<&Subscription>, req: &DeltaRequest) -> usize {
    use std::collections::HashSet;
    let held = current.map_or(0, |s| s.names.len());
    let is_current = |n: &str| current.is_some_and(|s| s.names.contains(n));
    let unsubscribe: HashSet<&str> = req
        .resource_names_unsubscribe
        .iter()
        .map(String::as_str)
        .filter(|n| *n != WILDCARD)
        .collect();
    let added: HashSet<&str> = req
        .resource_names_subscribe
        .iter()
        .map(String::as_str)
        .filter(|n| *n != WILDCARD && !is_current(n) && !unsubscribe.contains(n))
        .collect();
    let removed = unsubscribe.iter().filter(|n| is_current(n)).count();
    held + added.len() - removed
}

/// The bytes of the names subscribed once `req` is applied (see [`names_after`]).
pub fn bytes_after(current: Option<&Subscription>, req: &DeltaRequest) -> usize {
    use std::collections::HashSet;
    let held = current.map_or(0, Subscription::bytes);
    let is_current = |n: &str| current.is_some_and(|s| s.names.contains(n));
    let unsubscribe: HashSet<&str> = req
        .resource_names_unsubscribe
        .iter()
        .map(String::as_str)
        .filter(|n| *n != WILDCARD)
        .collect();
    let added: usize = req
        .resource_names_subscribe
        .iter()
        .map(String::as_str)
        .filter(|n| *n != WILDCARD && !is_current(n) && !unsubscribe.contains(n))
        .collect::<HashSet<&str>>()
        .iter()
        .map(|n| n.len())
        .sum();
    let removed: usize = unsubscribe
        .iter()
        .filter(|n| is_current(n))
        .map(|n| n.len())
        .sum();
    held + added - removed
}

impl<V> fmt::Debug for DeltaState<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeltaState")
            .field("type_url", &self.core.type_url)
            .field("subscription", &self.core.sub)
            .field("version", &self.core.version())
            .field("stats", &self.core.stats())
            .finish()
    }
}
