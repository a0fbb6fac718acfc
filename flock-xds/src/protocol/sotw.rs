//! State-of-the-World: every response carries the full subscribed set of its type.

use super::state::{Core, Gate};
use super::{Nonces, Pending, RequestKind, RequestOutcome, StreamStats, Subscription};
use crate::types::{WILDCARD, allows_legacy_wildcard};
use flock_core::resources::{Entry, Name, ResourceSet, TypeDiff};
use std::fmt;
use std::sync::Arc;

/// The fields of a `DiscoveryRequest` the protocol decides on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SotwRequest {
    /// `type_url` (implicit on per-type services: the server fills it in).
    pub type_url: String,
    /// `version_info`: the last version the client accepted (informational).
    pub version_info: String,
    /// `resource_names`: the complete subscription of the type.
    pub resource_names: Vec<String>,
    /// `response_nonce`: the nonce of the response this request answers.
    pub response_nonce: String,
    /// `error_detail.message`, present on a NACK.
    pub error_detail: Option<String>,
}

/// A `DiscoveryResponse` to send.
pub struct SotwResponse<V> {
    /// `type_url`.
    pub type_url: Name,
    /// `version_info`: the snapshot version, in decimal.
    pub version_info: String,
    /// The snapshot version as a number (never decreases on a stream and type).
    pub version: u64,
    /// `nonce`: unique and increasing on the stream.
    pub nonce: String,
    /// `resources`: every subscribed resource of the type, in name order.
    pub resources: Vec<(Name, Arc<V>)>,
}

impl<V> fmt::Debug for SotwResponse<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SotwResponse")
            .field("type_url", &self.type_url)
            .field("version_info", &self.version_info)
            .field("nonce", &self.nonce)
            .field(
                "resources",
                &self.resources.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// One SotW stream for one type. See the crate docs for the protocol decisions.
///
/// Feed it requests ([`on_request`](Self::on_request)) and newer snapshots
/// ([`on_snapshot`](Self::on_snapshot)); after each, send what
/// [`poll_response`](Self::poll_response) returns until it returns `None`. Poll only
/// when the response can be written at once, never ahead: a response is always built
/// from the newest snapshot and subscription.
pub struct SotwState<V> {
    core: Core<V, Entry<V>>,
    nonces: Nonces,
}

impl<V> SotwState<V> {
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

    /// Classifies a request and applies its subscription. A stale request (see
    /// [`RequestKind::Stale`]) is ignored entirely: SotW requests carry the complete
    /// subscription, and the client will send it again when it ACKs or NACKs our
    /// newest response, which is in flight.
    pub fn on_request(&mut self, req: &SotwRequest) -> RequestOutcome {
        let kind = self
            .core
            .classify(&req.response_nonce, req.error_detail.as_deref());
        let subscription_changed = if kind == RequestKind::Stale {
            false
        } else {
            let first = !self.core.requested;
            self.core.requested = true;
            let next = sotw_subscription(
                &self.core.type_url,
                &req.resource_names,
                first,
                &self.core.sub,
            );
            self.core.set_subscription(next)
        };
        RequestOutcome {
            type_url: self.core.type_url.clone(),
            kind,
            subscription_changed,
        }
    }

    /// Takes a snapshot; returns false (and ignores it) unless it is newer than the
    /// last one taken.
    pub fn on_snapshot(&mut self, set: &ResourceSet<V>, version: u64) -> bool {
        self.core.on_snapshot(set, version)
    }

    /// The next response, if the client lacks something (or awaits its first
    /// response) and has acknowledged the previous one.
    pub fn poll_response(&mut self) -> Option<SotwResponse<V>> {
        let mut nonces = std::mem::take(&mut self.nonces);
        let out = self.poll_gated(Gate::OPEN, &mut nonces);
        self.nonces = nonces;
        out
    }

    /// Like [`poll_response`](Self::poll_response) under an ADS [`Gate`], with the
    /// stream's shared nonce source. Withheld changes are sent at the content the
    /// client holds (or left out if it holds none); withheld removals are sent again
    /// at the content the client holds, so it keeps them.
    pub fn poll_gated(&mut self, gate: Gate, nonces: &mut Nonces) -> Option<SotwResponse<V>> {
        let plan = self.core.take(gate, nonces)?;
        let resources = self
            .core
            .held
            .iter()
            .map(|(n, e)| (n.clone(), Arc::clone(e.value())))
            .collect();
        Some(SotwResponse {
            type_url: self.core.type_url.clone(),
            version_info: plan.version.to_string(),
            version: plan.version,
            nonce: plan.nonce.to_string(),
            resources,
        })
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

    /// Names and hashes of what the client holds, as far as the stream knows.
    pub fn held(&self) -> impl Iterator<Item = (&Name, flock_core::ContentHash)> {
        self.core.held.iter().map(|(n, e)| (n, e.hash()))
    }

    pub(crate) fn apply(&mut self, set: &ResourceSet<V>, version: u64, diff: Option<&TypeDiff>) {
        self.core.apply_snapshot(set, version, diff);
    }
}

impl<V> fmt::Debug for SotwState<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SotwState")
            .field("type_url", &self.core.type_url)
            .field("subscription", &self.core.sub)
            .field("version", &self.core.version())
            .field("stats", &self.core.stats())
            .finish()
    }
}

/// How many names (`*` not counted) the subscription of the request's type holds once
/// `req` is applied: a SotW request replaces the subscription, so this is the number of
/// distinct names it carries. (A stale request is ignored by the machine; counting it
/// anyway only refuses a client whose next request would carry the same list.)
pub fn names_after(req: &SotwRequest) -> usize {
    let named = req.resource_names.iter().filter(|n| *n != WILDCARD);
    let raw = named.clone().count();
    if raw <= 1 {
        return raw;
    }
    named
        .map(String::as_str)
        .collect::<std::collections::HashSet<&str>>()
        .len()
}

/// The bytes of the distinct names `req` subscribes (see [`names_after`]).
pub fn bytes_after(req: &SotwRequest) -> usize {
    req.resource_names
        .iter()
        .filter(|n| *n != WILDCARD)
        .map(String::as_str)
        .collect::<std::collections::HashSet<&str>>()
        .iter()
        .map(|n| n.len())
        .sum()
}

/// The subscription a SotW request expresses. `resource_names` is complete: `*` means
/// everything; an empty list means everything only under the legacy rule (first
/// request of LDS/CDS, and for as long as the list stays empty); after a non-empty
/// list, an empty one unsubscribes from everything.
fn sotw_subscription(
    type_url: &str,
    names: &[String],
    first: bool,
    prev: &Subscription,
) -> Subscription {
    let legacy = names.is_empty()
        && if first {
            allows_legacy_wildcard(type_url)
        } else {
            prev.legacy
        };
    Subscription {
        namespaces: crate::types::uses_namespaces(type_url),
        linked: Default::default(),
        wildcard: names.iter().any(|n| n == WILDCARD),
        legacy,
        names: names
            .iter()
            .filter(|n| *n != WILDCARD)
            .map(|n| Name::from(n.as_str()))
            .collect(),
    }
}
