//! How the agent's xDS clients answer: which proxies reject their config (NACK) and
//! which leave a response unanswered too long, for `/readyz` and `/metrics`.
//!
//! A proxy that NACKs keeps running its last accepted config (Envoy never applies
//! part of a rejected update), so nothing breaks at once, but every change after it —
//! new pods, removed endpoints, rotated certificates — stops reaching that proxy. An
//! operator must see that without reading logs: `/readyz` names each such stream
//! (node, type, rejected and kept version, Envoy's error, cut to [`MAX_ERROR`]), and
//! flock-xds counts them by type (`flock_xds_nacks_total`, `flock_xds_streams_nacked`).
//! A type stays reported until the proxy ACKs a response of it that carries resources
//! (rejected resources are not resent until they change, so the ACK of a Delta
//! response that only removes names does not mean the proxy has them), or its stream
//! ends.
//! A proxy that does not answer a response for [`SLOW_ACK`] is named the same way and
//! counted in `flock_agent_xds_streams_slow_ack`; the server sends it nothing more of
//! that type meanwhile (one response in flight per type), so it costs no memory and
//! other streams go on.
//!
//! **Neither makes the agent not ready.** `/readyz` is the agent's own readiness: its
//! CNI server, store and xDS server work, and pods on the node can start. A NACK is
//! the proxy's verdict on one config, and the CNI path must keep working through it
//! (pods ADDed meanwhile are stored, registered and published; the proxy picks them
//! up as soon as it accepts a config again). Failing the probe would also let any one
//! xDS client — a proxyless gRPC app is one — take the node agent out of service by
//! NACKing on purpose, and a DaemonSet rollout would stall on a proxy's problem. So
//! `/readyz` stays 200 and carries the reason as an extra line; alert on
//! `flock_xds_streams_nacked > 0` or `flock_agent_xds_streams_slow_ack > 0`.

use flock_xds::callbacks::{Callbacks, NodeInfo, ResponseInfo, StreamId, StreamKind};
use flock_xds::protocol::RequestOutcome;
use flock_xds::sync_status::{StreamSync, SyncTracker};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use flock_xds::sync_status::MAX_ERROR;

/// How long a response may stay unanswered (no ACK or NACK) before the stream is
/// reported as slow. Envoy answers in milliseconds; seconds mean a stuck or
/// overloaded proxy (its main thread applies config).
pub const SLOW_ACK: Duration = Duration::from_secs(5);

/// The most streams `/readyz` names; the rest are counted.
const MAX_NAMED: usize = 8;

/// The xDS [`Callbacks`] hook that keeps, per open stream and type, what was sent,
/// ACKed and rejected (flock-xds's [`SyncTracker`]: the proxy status), and reads the
/// NACKing and slow streams from it. Memory: one entry per open stream (bounded by
/// the server's `max_open_streams`), five types each.
#[derive(Debug, Default)]
pub struct XdsAnswers {
    sync: SyncTracker,
}

impl XdsAnswers {
    /// The proxy status of every open stream (`/debug/proxy-status`).
    pub fn sync(&self) -> &SyncTracker {
        &self.sync
    }

    /// Open streams whose latest answer for some type is a NACK.
    pub fn rejecting(&self) -> usize {
        self.sync
            .with_streams(|s| s.values().filter(|s| s.rejecting()).count())
    }

    /// Open streams with a response unanswered for more than [`SLOW_ACK`] at `now`.
    pub fn slow(&self, now: Instant) -> usize {
        self.sync.with_streams(|s| {
            s.values()
                .filter(|s| Self::oldest(s, now).is_some())
                .count()
        })
    }

    /// The oldest response of `s` unanswered for more than [`SLOW_ACK`].
    fn oldest(s: &StreamSync, now: Instant) -> Option<(&'static str, u64, Duration)> {
        s.types
            .iter()
            .filter(|(_, t)| t.in_flight)
            .filter_map(|(name, t)| {
                let (v, sent) = t.sent?;
                Some((*name, v, now.saturating_duration_since(sent)))
            })
            .filter(|(_, _, age)| *age > SLOW_ACK)
            .max_by_key(|(_, _, age)| *age)
    }

    /// The `/readyz` lines at `now` (none when every proxy accepts its config in
    /// time): one per rejecting or slow stream, at most eight and a count of
    /// the rest. Client strings are written escaped (`{:?}`), so a node ID or an error
    /// message cannot add lines of its own.
    pub fn describe(&self, now: Instant) -> Option<String> {
        self.sync.with_streams(|streams| {
            let mut lines = Vec::new();
            let mut more = 0usize;
            for (id, s) in streams.iter() {
                let mut parts = Vec::new();
                for (t, r) in s
                    .types
                    .iter()
                    .filter_map(|(t, ts)| Some((t, ts.rejected.as_ref()?)))
                {
                    let kept = r.kept.map_or("none".to_string(), |v| v.to_string());
                    parts.push(format!(
                        "rejects {t} version {} (keeps {kept}): {:?}",
                        r.version, r.error
                    ));
                }
                if let Some((t, v, age)) = Self::oldest(s, now) {
                    parts.push(format!(
                        "has not answered {t} version {v} for {:.1}s",
                        age.as_secs_f64()
                    ));
                }
                if parts.is_empty() {
                    continue;
                }
                if lines.len() == MAX_NAMED {
                    more += 1;
                    continue;
                }
                lines.push(format!(
                    "xds: stream {} node {:?} {}",
                    id.0,
                    s.node.id,
                    parts.join("; ")
                ));
            }
            if more > 0 {
                lines.push(format!("xds: and {more} more streams"));
            }
            (!lines.is_empty()).then(|| lines.join("\n"))
        })
    }
}

impl Callbacks for XdsAnswers {
    fn on_stream_open(&self, stream: StreamId, kind: StreamKind, node: &NodeInfo) {
        self.sync.on_stream_open(stream, kind, node);
    }

    fn on_stream_closed(&self, stream: StreamId, node: &NodeInfo) {
        self.sync.on_stream_closed(stream, node);
    }

    fn on_response(&self, stream: StreamId, node: &NodeInfo, response: &ResponseInfo<'_>) {
        self.sync.on_response(stream, node, response);
    }

    fn on_request(&self, stream: StreamId, node: &NodeInfo, outcome: &RequestOutcome) {
        self.sync.on_request(stream, node, outcome);
    }
}

/// Several hooks as one: every event goes to each, in order.
pub struct Fanout(pub Vec<Arc<dyn Callbacks>>);

impl std::fmt::Debug for Fanout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fanout({} hooks)", self.0.len())
    }
}

impl Callbacks for Fanout {
    fn on_stream_open(&self, stream: StreamId, kind: StreamKind, node: &NodeInfo) {
        self.0
            .iter()
            .for_each(|c| c.on_stream_open(stream, kind, node));
    }

    fn on_stream_closed(&self, stream: StreamId, node: &NodeInfo) {
        self.0.iter().for_each(|c| c.on_stream_closed(stream, node));
    }

    fn on_request(&self, stream: StreamId, node: &NodeInfo, outcome: &RequestOutcome) {
        self.0
            .iter()
            .for_each(|c| c.on_request(stream, node, outcome));
    }

    fn on_response(&self, stream: StreamId, node: &NodeInfo, response: &ResponseInfo<'_>) {
        self.0
            .iter()
            .for_each(|c| c.on_response(stream, node, response));
    }

    fn on_nack(
        &self,
        stream: StreamId,
        node: &NodeInfo,
        type_url: &str,
        rejected_version: u64,
        kept_version: Option<u64>,
        error: &str,
    ) {
        self.0.iter().for_each(|c| {
            c.on_nack(
                stream,
                node,
                type_url,
                rejected_version,
                kept_version,
                error,
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flock_xds::protocol::RequestKind;
    use flock_xds::types::{CLUSTER, LISTENER};

    fn outcome(type_url: &str, kind: RequestKind) -> RequestOutcome {
        RequestOutcome {
            type_url: type_url.into(),
            kind,
            subscription_changed: false,
        }
    }

    fn respond(a: &XdsAnswers, id: u64, type_url: &str, version: u64) {
        a.on_response(
            StreamId(id),
            &NodeInfo::default(),
            &ResponseInfo {
                type_url,
                version,
                nonce: "1",
                resources: 1,
                removed: 0,
            },
        );
    }

    #[test]
    fn a_nack_is_reported_until_an_ack_of_its_type_or_the_stream_end() {
        let a = XdsAnswers::default();
        let node = NodeInfo::with_id("envoy-1\nxds: forged line");
        a.on_stream_open(StreamId(1), StreamKind::DeltaAds, &node);
        respond(&a, 1, CLUSTER, 7);
        a.on_request(
            StreamId(1),
            &node,
            &outcome(
                CLUSTER,
                RequestKind::Nack {
                    version: 7,
                    kept_version: Some(5),
                    error: "x".repeat(2 * MAX_ERROR),
                },
            ),
        );
        assert_eq!(a.rejecting(), 1);
        let line = a.describe(Instant::now()).unwrap();
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(line.contains("rejects cds version 7 (keeps 5)"), "{line}");
        assert!(line.len() < MAX_ERROR + 200, "{line}");
        // An ACK of another type leaves it, and so does an ACK of a removal only; an
        // ACK of clusters clears it.
        respond(&a, 1, LISTENER, 8);
        a.on_request(
            StreamId(1),
            &node,
            &outcome(LISTENER, RequestKind::Ack { version: 8 }),
        );
        assert_eq!(a.rejecting(), 1);
        a.on_response(
            StreamId(1),
            &node,
            &ResponseInfo {
                type_url: CLUSTER,
                version: 8,
                nonce: "3",
                resources: 0,
                removed: 1,
            },
        );
        a.on_request(
            StreamId(1),
            &node,
            &outcome(CLUSTER, RequestKind::Ack { version: 8 }),
        );
        assert_eq!(a.rejecting(), 1);
        respond(&a, 1, CLUSTER, 9);
        a.on_request(
            StreamId(1),
            &node,
            &outcome(CLUSTER, RequestKind::Ack { version: 9 }),
        );
        assert_eq!(a.rejecting(), 0);
        assert_eq!(a.describe(Instant::now()), None);
        a.on_request(
            StreamId(1),
            &node,
            &outcome(
                CLUSTER,
                RequestKind::Nack {
                    version: 10,
                    kept_version: Some(9),
                    error: "bad".into(),
                },
            ),
        );
        a.on_stream_closed(StreamId(1), &node);
        assert_eq!(a.rejecting(), 0);
        assert_eq!(a.describe(Instant::now()), None);
    }

    #[test]
    fn a_response_unanswered_past_the_limit_is_slow_until_answered() {
        let a = XdsAnswers::default();
        let node = NodeInfo::with_id("grpc-1");
        a.on_stream_open(StreamId(2), StreamKind::DeltaAds, &node);
        respond(&a, 2, LISTENER, 3);
        assert_eq!(a.slow(Instant::now()), 0);
        let later = Instant::now() + SLOW_ACK + Duration::from_secs(1);
        assert_eq!(a.slow(later), 1);
        let line = a.describe(later).unwrap();
        assert!(
            line.contains("has not answered lds version 3 for"),
            "{line}"
        );
        // A stale answer is for an older response: still in flight.
        a.on_request(StreamId(2), &node, &outcome(LISTENER, RequestKind::Stale));
        assert_eq!(a.slow(later), 1);
        a.on_request(
            StreamId(2),
            &node,
            &outcome(LISTENER, RequestKind::Ack { version: 3 }),
        );
        assert_eq!(a.slow(later), 0);
    }

    #[test]
    fn describe_names_a_bounded_number_of_streams() {
        let a = XdsAnswers::default();
        for id in 0..(MAX_NAMED as u64 + 3) {
            let node = NodeInfo::with_id(format!("n{id}"));
            a.on_stream_open(StreamId(id), StreamKind::DeltaAds, &node);
            a.on_request(
                StreamId(id),
                &node,
                &outcome(
                    CLUSTER,
                    RequestKind::Nack {
                        version: 1,
                        kept_version: None,
                        error: "e".into(),
                    },
                ),
            );
        }
        let text = a.describe(Instant::now()).unwrap();
        assert_eq!(text.lines().count(), MAX_NAMED + 1, "{text}");
        assert!(text.ends_with("xds: and 3 more streams"), "{text}");
    }
}
