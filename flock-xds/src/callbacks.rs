//! Hooks for embedding control planes: the server calls these on stream events.

use crate::protocol::RequestOutcome;

/// Identifies one gRPC stream for the lifetime of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

/// Which discovery service a stream belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// `StreamAggregatedResources` (SotW ADS).
    SotwAds,
    /// `DeltaAggregatedResources` (Delta ADS).
    DeltaAds,
    /// A per-type SotW service (`StreamListeners`, `StreamClusters`…); the type URL.
    Sotw(&'static str),
    /// A per-type Delta service (`DeltaListeners`, `DeltaClusters`…); the type URL.
    Delta(&'static str),
}

/// The node a stream serves, as the first request identified it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct NodeInfo {
    /// `Node.id`.
    pub id: String,
    /// `Node.cluster`.
    pub cluster: String,
    /// `Node.user_agent_name` (e.g. `envoy`, `grpc-python`).
    pub user_agent_name: String,
}

impl NodeInfo {
    /// A node with this ID and nothing else.
    pub fn with_id(id: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            ..Self::default()
        }
    }
}

/// Summary of one response handed to the transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseInfo<'a> {
    /// The type URL.
    pub type_url: &'a str,
    /// The snapshot version (`version_info` / `system_version_info`).
    pub version: u64,
    /// The nonce.
    pub nonce: &'a str,
    /// Resources carried (SotW: the full set; Delta: new or changed ones).
    pub resources: usize,
    /// Names removed (Delta `removed_resources`; 0 for SotW).
    pub removed: usize,
}

/// Stream event hooks, all with empty defaults; implementations must be cheap and
/// must not block (they run on the stream's task). The async server calls them in
/// this order per stream: `on_stream_open`, then `on_request`/`on_response`/`on_nack`
/// as events happen, then `on_stream_closed` exactly once.
pub trait Callbacks: Send + Sync {
    /// A stream opened. `node` is known once the first request arrived, so this is
    /// called when it does.
    fn on_stream_open(&self, stream: StreamId, kind: StreamKind, node: &NodeInfo) {
        let _ = (stream, kind, node);
    }

    /// A stream closed (client gone, error or server shutdown).
    fn on_stream_closed(&self, stream: StreamId, node: &NodeInfo) {
        let _ = (stream, node);
    }

    /// A request was classified (including ACKs, NACKs and stale requests).
    fn on_request(&self, stream: StreamId, node: &NodeInfo, outcome: &RequestOutcome) {
        let _ = (stream, node, outcome);
    }

    /// A response was handed to the transport.
    fn on_response(&self, stream: StreamId, node: &NodeInfo, response: &ResponseInfo<'_>) {
        let _ = (stream, node, response);
    }

    /// The client rejected the response `rejected_version` of `type_url` with
    /// `error`; it keeps running `kept_version` (the last ACKed, if any). Called in
    /// addition to `on_request`, so a control plane can alert on this alone.
    fn on_nack(
        &self,
        stream: StreamId,
        node: &NodeInfo,
        type_url: &str,
        rejected_version: u64,
        kept_version: Option<u64>,
        error: &str,
    ) {
        let _ = (
            stream,
            node,
            type_url,
            rejected_version,
            kept_version,
            error,
        );
    }
}

/// Callbacks that do nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCallbacks;

impl Callbacks for NoCallbacks {}
