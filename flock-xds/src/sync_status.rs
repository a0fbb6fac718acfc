//! Proxy status: per stream and type, the version sent, the version ACKed and the last
//! rejection — what `istioctl proxy-status` shows, as a [`Callbacks`] hook.
//!
//! Add a [`SyncTracker`] to a [`crate::server::ServerBuilder`] (`callbacks_arc`) and
//! read [`SyncTracker::streams`] to answer "is every proxy in sync?". Each type a
//! stream asked for is in one [`SyncState`]:
//!
//! * `NOT SENT`: asked for, nothing sent yet (no resource of it in the snapshot);
//! * `STALE`: the latest response is not answered yet (in flight);
//! * `NACKED`: the client rejected a response of this type and has not accepted one
//!   carrying resources since. A rejected resource is not resent until it changes, so
//!   the ACK of a Delta response that only removes names does not mean the client
//!   holds it: the type stays `NACKED` until an ACK of a response with resources;
//! * `SYNCED`: the latest response was ACKed.
//!
//! Only the six types the mesh serves are tracked (a client naming other type URLs
//! gets nothing of them, and cannot grow this table); streams are forgotten when they
//! close, so memory is bounded by the server's open-stream limit. The rejection text
//! is the client's, cut to [`MAX_ERROR`] bytes; print it escaped.

use crate::callbacks::{Callbacks, NodeInfo, ResponseInfo, StreamId, StreamKind};
use crate::protocol::{RequestKind, RequestOutcome};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, VIRTUAL_HOST};
use flock_core::sync::{Mutex, lock};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

/// The longest rejection message kept per stream and type.
pub const MAX_ERROR: usize = 300;

/// Where one type of one stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SyncState {
    /// The latest response was ACKed.
    Synced,
    /// The latest response is not answered yet.
    Stale,
    /// The client rejected a response and has not accepted one with resources since.
    Nacked,
    /// Asked for; nothing sent yet.
    NotSent,
}

impl SyncState {
    /// `SYNCED`, `STALE`, `NACKED` or `NOT SENT`.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncState::Synced => "SYNCED",
            SyncState::Stale => "STALE",
            SyncState::Nacked => "NACKED",
            SyncState::NotSent => "NOT SENT",
        }
    }
}

impl fmt::Display for SyncState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejected response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The rejected snapshot version.
    pub version: u64,
    /// The version the client keeps running (its last ACK), if any.
    pub kept: Option<u64>,
    /// The client's error text, cut to [`MAX_ERROR`] bytes.
    pub error: String,
}

/// One type of one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TypeSync {
    /// The latest response's version and when it was handed to the transport.
    pub sent: Option<(u64, Instant)>,
    /// Whether the latest response carried resources (a Delta response may only
    /// remove names).
    pub carried: bool,
    /// Whether the latest response is still unanswered.
    pub in_flight: bool,
    /// The version last ACKed.
    pub acked: Option<u64>,
    /// The standing rejection (see the module docs for when it clears).
    pub rejected: Option<Rejection>,
}

impl TypeSync {
    /// Where this type stands.
    pub fn state(&self) -> SyncState {
        if self.rejected.is_some() {
            SyncState::Nacked
        } else if self.in_flight {
            SyncState::Stale
        } else if self.acked.is_some() {
            SyncState::Synced
        } else {
            SyncState::NotSent
        }
    }
}

/// One open stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSync {
    /// The node its first request named.
    pub node: NodeInfo,
    /// The discovery service.
    pub kind: StreamKind,
    /// Short type name (`"cds"`…) → its state, for each type the stream asked for or
    /// was sent.
    pub types: BTreeMap<&'static str, TypeSync>,
}

impl StreamSync {
    /// Whether any type stands rejected.
    pub fn rejecting(&self) -> bool {
        self.types.values().any(|t| t.rejected.is_some())
    }
}

/// The short name of a type the mesh serves; `None` for other type URLs.
pub fn tracked(type_url: &str) -> Option<&'static str> {
    Some(match type_url {
        LISTENER => "lds",
        ROUTE => "rds",
        CLUSTER => "cds",
        ENDPOINT => "eds",
        SECRET => "sds",
        VIRTUAL_HOST => "vhds",
        _ => return None,
    })
}

/// `s` cut to at most `max` bytes on a character boundary, `…` marking a cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The [`Callbacks`] hook that keeps a [`StreamSync`] per open stream.
#[derive(Debug)]
pub struct SyncTracker {
    streams: Mutex<BTreeMap<StreamId, StreamSync>>,
}

impl Default for SyncTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl SyncTracker {
    /// A tracker with no stream.
    pub fn new() -> Self {
        Self {
            streams: Mutex::new(BTreeMap::new()),
        }
    }

    /// Every open stream, in stream order (a copy).
    pub fn streams(&self) -> Vec<(StreamId, StreamSync)> {
        lock(&self.streams)
            .iter()
            .map(|(id, s)| (*id, s.clone()))
            .collect()
    }

    /// Runs `f` on the open streams without copying them (`f` must be quick: the
    /// streams' tasks wait on the same lock).
    pub fn with_streams<R>(&self, f: impl FnOnce(&BTreeMap<StreamId, StreamSync>) -> R) -> R {
        f(&lock(&self.streams))
    }

    fn with_type(&self, stream: StreamId, type_url: &str, f: impl FnOnce(&mut TypeSync)) {
        let Some(t) = tracked(type_url) else {
            return;
        };
        if let Some(s) = lock(&self.streams).get_mut(&stream) {
            f(s.types.entry(t).or_default());
        }
    }
}

impl Callbacks for SyncTracker {
    fn on_stream_open(&self, stream: StreamId, kind: StreamKind, node: &NodeInfo) {
        lock(&self.streams).insert(
            stream,
            StreamSync {
                node: node.clone(),
                kind,
                types: BTreeMap::new(),
            },
        );
    }

    fn on_stream_closed(&self, stream: StreamId, _node: &NodeInfo) {
        lock(&self.streams).remove(&stream);
    }

    fn on_response(&self, stream: StreamId, _node: &NodeInfo, response: &ResponseInfo<'_>) {
        self.with_type(stream, response.type_url, |t| {
            t.sent = Some((response.version, Instant::now()));
            t.carried = response.resources > 0;
            t.in_flight = true;
        });
    }

    fn on_request(&self, stream: StreamId, _node: &NodeInfo, outcome: &RequestOutcome) {
        self.with_type(stream, &outcome.type_url, |t| match &outcome.kind {
            RequestKind::Ack { version } => {
                t.in_flight = false;
                t.acked = Some(*version);
                if t.carried {
                    t.rejected = None;
                }
            }
            RequestKind::Nack {
                version,
                kept_version,
                error,
            } => {
                t.in_flight = false;
                t.rejected = Some(Rejection {
                    version: *version,
                    kept: *kept_version,
                    error: cut(error, MAX_ERROR),
                });
            }
            // A stale nonce answers an older response: the newest is still in
            // flight. A first request or a subscription change only makes the type
            // known (`NOT SENT` until a response).
            RequestKind::Stale | RequestKind::Initial | RequestKind::Update => {}
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(type_url: &str, kind: RequestKind) -> RequestOutcome {
        RequestOutcome {
            type_url: type_url.into(),
            kind,
            subscription_changed: false,
        }
    }

    fn respond(t: &SyncTracker, type_url: &str, version: u64, resources: usize) {
        t.on_response(
            StreamId(1),
            &NodeInfo::default(),
            &ResponseInfo {
                type_url,
                version,
                nonce: "n",
                resources,
                removed: usize::from(resources == 0),
            },
        );
    }

    fn answer(t: &SyncTracker, type_url: &str, kind: RequestKind) {
        t.on_request(StreamId(1), &NodeInfo::default(), &outcome(type_url, kind));
    }

    fn state(t: &SyncTracker, short: &str) -> Option<SyncState> {
        t.with_streams(|s| s.get(&StreamId(1))?.types.get(short).map(TypeSync::state))
    }

    #[test]
    fn a_type_goes_not_sent_stale_synced_nacked_and_back() {
        let t = SyncTracker::new();
        t.on_stream_open(
            StreamId(1),
            StreamKind::DeltaAds,
            &NodeInfo::with_id("envoy"),
        );
        answer(&t, CLUSTER, RequestKind::Initial);
        assert_eq!(state(&t, "cds"), Some(SyncState::NotSent));
        respond(&t, CLUSTER, 3, 2);
        assert_eq!(state(&t, "cds"), Some(SyncState::Stale));
        answer(&t, CLUSTER, RequestKind::Stale);
        assert_eq!(state(&t, "cds"), Some(SyncState::Stale));
        answer(&t, CLUSTER, RequestKind::Ack { version: 3 });
        assert_eq!(state(&t, "cds"), Some(SyncState::Synced));
        respond(&t, CLUSTER, 4, 1);
        answer(
            &t,
            CLUSTER,
            RequestKind::Nack {
                version: 4,
                kept_version: Some(3),
                error: "é".repeat(MAX_ERROR),
            },
        );
        assert_eq!(state(&t, "cds"), Some(SyncState::Nacked));
        let rejection = t.streams()[0].1.types["cds"].rejected.clone().unwrap();
        assert_eq!((rejection.version, rejection.kept), (4, Some(3)));
        assert!(rejection.error.len() <= MAX_ERROR + '…'.len_utf8());
        // The ACK of a removal only does not clear it; the ACK of resources does.
        respond(&t, CLUSTER, 5, 0);
        answer(&t, CLUSTER, RequestKind::Ack { version: 5 });
        assert_eq!(state(&t, "cds"), Some(SyncState::Nacked));
        respond(&t, CLUSTER, 6, 1);
        answer(&t, CLUSTER, RequestKind::Ack { version: 6 });
        assert_eq!(state(&t, "cds"), Some(SyncState::Synced));
        assert_eq!(t.streams()[0].1.types["cds"].acked, Some(6));
    }

    #[test]
    fn untracked_types_and_unknown_streams_are_ignored_and_closed_streams_forgotten() {
        let t = SyncTracker::new();
        answer(&t, CLUSTER, RequestKind::Initial);
        assert!(t.streams().is_empty());
        t.on_stream_open(StreamId(1), StreamKind::SotwAds, &NodeInfo::with_id("g"));
        answer(&t, "type.googleapis.com/made.Up", RequestKind::Initial);
        respond(&t, "type.googleapis.com/made.Up", 1, 1);
        assert!(t.streams()[0].1.types.is_empty());
        t.on_stream_closed(StreamId(1), &NodeInfo::with_id("g"));
        assert!(t.streams().is_empty());
    }
}
