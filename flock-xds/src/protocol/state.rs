//! The state both protocol variants share: latest snapshot, subscription, held,
//! pending, nonces and ACK tracking for one type on one stream.

use super::{Nonces, Pending, RequestKind, StreamStats, Subscription};
use flock_core::resources::{Entry, Name, ResourceSet, TypeDiff, diff};
use std::collections::{BTreeMap, BTreeSet};

/// What the stream remembers about a resource the client holds.
pub(crate) trait Held<V> {
    fn from_entry(entry: &Entry<V>) -> Self;
    /// Whether the client holds exactly this entry's content.
    fn matches(&self, entry: &Entry<V>) -> bool;
}

impl<V> Held<V> for Entry<V> {
    fn from_entry(entry: &Entry<V>) -> Self {
        entry.clone()
    }
    fn matches(&self, entry: &Entry<V>) -> bool {
        self.hash() == entry.hash()
    }
}

/// The allowance the ADS coordinator gives one type for one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    /// New and changed resources may be sent.
    pub changes: bool,
    /// Removals may be sent.
    pub removals: bool,
}

impl Gate {
    /// Everything may be sent: a stream that serves one type.
    pub const OPEN: Gate = Gate {
        changes: true,
        removals: true,
    };
}

/// A response about to be sent, before protocol-specific encoding.
pub(crate) struct Plan<V> {
    pub nonce: u64,
    pub version: u64,
    pub upserts: Vec<(Name, Entry<V>)>,
    pub removals: Vec<Name>,
}

pub(crate) struct Core<V, H> {
    pub type_url: Name,
    pub sub: Subscription,
    /// A request of this type was received on this stream.
    pub requested: bool,
    set: ResourceSet<V>,
    version: u64,
    pub held: BTreeMap<Name, H>,
    /// Subscribed names in the snapshot whose content the client does not hold, with
    /// that content (kept current by `refresh`, which every snapshot change of the
    /// name goes through), so a response needs no second lookup in the snapshot.
    make: BTreeMap<Name, Entry<V>>,
    /// Held names no longer in the snapshot.
    brk: BTreeSet<Name>,
    last_nonce: Option<u64>,
    /// The response sent last, until the client ACKs or NACKs it: at most one response
    /// per type is in flight (the go-control-plane watch-per-request model).
    /// (The snapshot version of that response; its nonce is `last_nonce`.)
    outstanding: Option<u64>,
    acked_version: Option<u64>,
    sent_any: bool,
}

impl<V, H: Held<V>> Core<V, H> {
    pub fn new(type_url: &str) -> Self {
        Self {
            type_url: Name::from(type_url),
            sub: Subscription::for_type(type_url),
            requested: false,
            set: ResourceSet::new(),
            version: 0,
            held: BTreeMap::new(),
            make: BTreeMap::new(),
            brk: BTreeSet::new(),
            last_nonce: None,
            outstanding: None,
            acked_version: None,
            sent_any: false,
        }
    }

    pub fn set(&self) -> &ResourceSet<V> {
        &self.set
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn acked_version(&self) -> Option<u64> {
        self.acked_version
    }

    pub fn awaiting_ack(&self) -> bool {
        self.outstanding.is_some()
    }

    pub fn stats(&self) -> StreamStats {
        StreamStats {
            held: self.held.len(),
            pending: self.make.len() + self.brk.len(),
        }
    }

    pub fn pending(&self) -> Pending {
        Pending {
            make: !self.make.is_empty(),
            brk: !self.brk.is_empty(),
        }
    }

    /// Recomputes whether `name` is pending, from the snapshot, subscription and held.
    pub fn refresh(&mut self, name: &Name) {
        self.make.remove(name);
        self.brk.remove(name);
        if !self.sub.contains(name) {
            self.held.remove(name);
            return;
        }
        let desired = self.set.get(&self.type_url, name);
        match (desired, self.held.get(name)) {
            (Some(entry), Some(held)) if held.matches(entry) => {}
            (Some(entry), _) => {
                self.make.insert(Name::clone(name), entry.clone());
            }
            (None, Some(_)) => {
                self.brk.insert(Name::clone(name));
            }
            (None, None) => {}
        }
    }

    /// The client no longer subscribes to `name`: forget it without a removal, and
    /// drop anything pending for it (a response for an old subscription is never sent
    /// after the unsubscribe).
    pub fn forget(&mut self, name: &Name) {
        self.held.remove(name);
        self.brk.remove(name);
        if !flock_core::reintroduced!("xds-unsubscribed-response") {
            self.make.remove(name);
        }
    }

    /// Replaces the subscription; returns whether it changed.
    pub fn set_subscription(&mut self, next: Subscription) -> bool {
        if next == self.sub {
            return false;
        }
        let prev = std::mem::replace(&mut self.sub, next);
        let mut touched: Vec<Name> = Vec::new();
        let mut dropped: Vec<Name> = Vec::new();
        if self.sub.namespaces {
            // A namespace stands for names it does not list: walk what it may cover.
            // (VHDS: one subscription change per route configuration, not per host.)
            touched.extend(
                self.set
                    .iter_type(&self.type_url)
                    .map(|(n, _)| n)
                    .filter(|n| self.sub.contains(n) && !prev.contains(n))
                    .cloned(),
            );
            dropped.extend(
                self.held
                    .keys()
                    .chain(self.make.keys())
                    .filter(|n| !self.sub.contains(n))
                    .cloned(),
            );
        } else if prev.is_wildcard() && !self.sub.is_wildcard() {
            // Everything not named explicitly is dropped.
            dropped.extend(
                self.held
                    .keys()
                    .chain(self.make.keys())
                    .filter(|n| !self.sub.names.contains(*n))
                    .cloned(),
            );
        } else if !prev.is_wildcard() && self.sub.is_wildcard() {
            touched.extend(self.set.iter_type(&self.type_url).map(|(n, _)| n.clone()));
        }
        touched.extend(self.sub.names.difference(&prev.names).cloned());
        dropped.extend(
            prev.names
                .difference(&self.sub.names)
                .filter(|n| !self.sub.contains(n))
                .cloned(),
        );
        for name in &dropped {
            self.forget(name);
        }
        for name in &touched {
            self.refresh(name);
        }
        true
    }

    /// Takes `set` if it is newer than the snapshot held (else returns false and
    /// ignores it: a stream never goes back, R1 per stream). Costs O(changes of this
    /// type) when `set` was derived from the previous one with `edit()`.
    pub fn on_snapshot(&mut self, set: &ResourceSet<V>, version: u64) -> bool {
        if !super::is_newer(self.version(), version) {
            return false;
        }
        let d = diff(self.set(), set);
        self.apply_snapshot(set, version, d.types.get(&self.type_url));
        true
    }

    /// Takes a newer snapshot; `diff` is this type's part of the diff from the
    /// previous one (None: the type did not change).
    pub fn apply_snapshot(&mut self, set: &ResourceSet<V>, version: u64, diff: Option<&TypeDiff>) {
        self.set = set.clone();
        self.version = version;
        let Some(diff) = diff else { return };
        for name in diff.added.iter().chain(&diff.changed).chain(&diff.removed) {
            if self.sub.contains(name) || self.held.contains_key(name) {
                self.refresh(name);
            }
        }
    }

    /// Classifies a request by its nonce and error detail, updating ACK tracking.
    pub fn classify(&mut self, nonce: &str, error: Option<&str>) -> RequestKind {
        if self.last_nonce.is_none() {
            // Nothing sent for this type on this stream: whatever nonce the client
            // carries (a reconnecting client may keep one from its previous stream),
            // this is its initial request.
            return RequestKind::Initial;
        }
        // From here on, an empty or foreign nonce is stale, as in go-control-plane
        // (clients may keep their latest nonce across streams and requests).
        let parsed = nonce.parse::<u64>().ok();
        let parsed = if flock_core::reintroduced!("xds-stale-nonce") {
            // The bug class: any ACK/NACK is matched to the latest response.
            parsed.and(self.last_nonce)
        } else {
            parsed
        };
        if parsed.is_none() || parsed != self.last_nonce {
            return RequestKind::Stale;
        }
        match self.outstanding.take() {
            None => RequestKind::Update,
            Some(version) => match error {
                Some(error) => RequestKind::Nack {
                    version,
                    kept_version: self.acked_version,
                    error: error.to_string(),
                },
                None => {
                    self.acked_version = Some(version);
                    RequestKind::Ack { version }
                }
            },
        }
    }

    /// Takes the next response allowed by `gate`, if any, and records it as held.
    pub fn take(&mut self, gate: Gate, nonces: &mut Nonces) -> Option<Plan<V>> {
        if !self.requested || self.outstanding.is_some() || self.version == 0 {
            return None;
        }
        // The first response of a type is due even when it changes nothing (an empty
        // set, or a reconnect where the client already holds everything): clients wait
        // for it to finish initializing. Not while something is pending but gated.
        let initial = !self.sent_any && self.make.is_empty() && self.brk.is_empty();
        let upserts: Vec<(Name, Entry<V>)> = if gate.changes {
            std::mem::take(&mut self.make).into_iter().collect()
        } else {
            Vec::new()
        };
        let removals: Vec<Name> = if gate.removals {
            self.brk.iter().cloned().collect()
        } else {
            Vec::new()
        };
        if upserts.is_empty() && removals.is_empty() && !initial {
            return None;
        }
        for (name, entry) in &upserts {
            self.held.insert(name.clone(), H::from_entry(entry));
        }
        for name in &removals {
            self.held.remove(name);
            self.brk.remove(name);
        }
        let nonce = nonces.next_nonce();
        self.last_nonce = Some(nonce);
        self.outstanding = Some(self.version);
        self.sent_any = true;
        Some(Plan {
            nonce,
            version: self.version,
            upserts,
            removals,
        })
    }
}
