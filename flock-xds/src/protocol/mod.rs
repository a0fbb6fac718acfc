//! The xDS protocol as deterministic, I/O-free state machines.
//!
//! * [`sotw`]: one State-of-the-World stream for one type ([`SotwState`]);
//! * [`delta`]: one incremental (Delta) stream for one type ([`DeltaState`]);
//! * [`order`]: the ADS coordinator ([`Ads`]) that multiplexes the per-type machines
//!   of one stream and decides which type's response goes next.
//!
//! All machines share the same model of a stream: the **latest snapshot**, the
//! client's **subscription**, what the client **holds** (what we sent it, or what it
//! announced in `initial_resource_versions`), and the set of **pending** names where
//! the two differ. Nothing else is stored — in particular no queue of versions — so a
//! slow stream coalesces to the newest state and its memory is bounded by the number
//! of resources it subscribes to, whatever the publish rate. See the crate docs for
//! the protocol decisions.

pub mod delta;
pub mod order;
pub mod sotw;
mod state;

pub use delta::{DeltaRequest, DeltaResource, DeltaResponse, DeltaState};
pub use order::{Ads, DeltaAds, SotwAds, TypeMachine};
pub use sotw::{SotwRequest, SotwResponse, SotwState};
pub use state::Gate;

use flock_core::resources::Name;
use std::collections::BTreeSet;

/// What the client subscribes to for one type on one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subscription {
    /// Subscribed with an explicit `*`.
    wildcard: bool,
    /// Subscribed by the legacy rule: the first request of a wildcard-capable type
    /// (LDS, CDS) named nothing.
    legacy: bool,
    /// Names subscribed explicitly (never contains `*`).
    names: BTreeSet<Name>,
    /// The type's names are namespaces ([`uses_namespaces`](crate::types::uses_namespaces)):
    /// a subscribed name also covers every `<name>/<host>`.
    namespaces: bool,
    /// Namespaces linked from the route configurations the stream subscribes to (the
    /// ADS coordinator keeps them equal): Envoy (1.40, Delta ADS) opens its virtual
    /// host subscription naming nothing, and adds a route configuration's VHDS watch
    /// to it without a request, so the route configurations it asked for are the
    /// namespaces it wants. Their virtual hosts then go out after the configuration
    /// itself (the make order), when its watch exists: sent before, Envoy drops them.
    linked: BTreeSet<Name>,
}

impl Subscription {
    /// An empty subscription of `type_url` (namespace matching if the type uses it).
    pub fn for_type(type_url: &str) -> Self {
        Self {
            namespaces: crate::types::uses_namespaces(type_url),
            ..Self::default()
        }
    }

    /// Whether the subscribed names are namespaces.
    pub fn by_namespace(&self) -> bool {
        self.namespaces
    }

    /// Whether the client receives every resource of the type.
    pub fn is_wildcard(&self) -> bool {
        self.wildcard || self.legacy
    }

    /// The names subscribed explicitly (a wildcard subscription may have some too).
    pub fn names(&self) -> &BTreeSet<Name> {
        &self.names
    }

    /// The bytes of the names subscribed explicitly (their lengths summed).
    pub fn bytes(&self) -> usize {
        self.names.iter().map(|n| n.len()).sum()
    }

    /// Whether `name` is subscribed, explicitly, by wildcard or by its namespace.
    pub fn contains(&self, name: &str) -> bool {
        self.is_wildcard()
            || self.names.contains(name)
            || (self.namespaces
                && crate::types::namespace_of(name)
                    .is_some_and(|ns| self.names.contains(ns) || self.linked.contains(ns)))
    }
}

/// How a request was classified. The ACK/NACK part of a request is only trusted when
/// its `response_nonce` is the latest nonce sent for that type on that stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestKind {
    /// Nothing of this type was sent on this stream yet (empty nonce).
    Initial,
    /// The client accepted the response with this snapshot version.
    Ack {
        /// Snapshot version of the acknowledged response.
        version: u64,
    },
    /// The client rejected the response with this snapshot version. The last ACKed
    /// version stays the client's good configuration; the rejected content is not
    /// resent (it would only be rejected again) until it changes.
    Nack {
        /// Snapshot version of the rejected response.
        version: u64,
        /// The last version the client ACKed on this stream, if any: what it still runs.
        kept_version: Option<u64>,
        /// `error_detail.message` as sent by the client.
        error: String,
    },
    /// A request carrying the latest nonce whose response was already ACKed or
    /// NACKed: a subscription change or a duplicate.
    Update,
    /// The nonce is not the latest sent for this type on this stream: the client had
    /// not yet seen our newest response. Its ACK/NACK part is ignored. SotW ignores the
    /// request entirely; Delta still applies its subscription changes (see crate docs).
    Stale,
}

/// The result of feeding one request to a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutcome {
    /// The type URL of the request.
    pub type_url: Name,
    /// The classification.
    pub kind: RequestKind,
    /// Whether the subscription changed.
    pub subscription_changed: bool,
}

/// Per-stream nonce source: nonces are decimal, unique and increasing on a stream,
/// shared by all types of an ADS stream.
#[derive(Debug, Clone, Default)]
pub struct Nonces(u64);

impl Nonces {
    /// A source whose first nonce is `1`.
    pub fn new() -> Self {
        Self(0)
    }

    /// The next nonce.
    pub fn next_nonce(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }

    /// The last nonce handed out (0 if none).
    pub fn last(&self) -> u64 {
        self.0
    }
}

/// What a machine would send if allowed: used by the ADS coordinator to order types.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pending {
    /// Some subscribed resource is new or changed relative to what the client holds.
    pub make: bool,
    /// Some resource the client holds is gone from the snapshot.
    pub brk: bool,
}

/// Size of a machine's state: bounded by the subscribed resources, never by the
/// number of publishes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Resources the client holds (as far as we know).
    pub held: usize,
    /// Names whose newest state has not been sent yet.
    pub pending: usize,
}

impl std::ops::Add for StreamStats {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            held: self.held + other.held,
            pending: self.pending + other.pending,
        }
    }
}

/// Whether a snapshot at `incoming` may replace the one at `current`: only a newer
/// one may (R1 at the stream level: whatever order the server's tasks deliver
/// snapshots in, a stream never goes back to older content).
pub(crate) fn is_newer(current: u64, incoming: u64) -> bool {
    if flock_core::reintroduced!("xds-snapshot-regress") {
        incoming > 0
    } else {
        incoming > current
    }
}
