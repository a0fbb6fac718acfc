//! A raw ADS client: sends discovery requests exactly as given and hands back every
//! response. For conformance tests, benchmarks and debugging tools (it applies no
//! protocol logic of its own: ACKs, subscriptions and nonces are the caller's).

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Status, Streaming};

/// Connects to `target`: `http://HOST:PORT` or `unix:PATH`.
pub async fn connect(target: &str) -> Result<Channel, tonic::transport::Error> {
    if let Some(path) = target.strip_prefix("unix:") {
        let path = PathBuf::from(path);
        // The URI is required by tonic and ignored by the connector.
        Endpoint::from_static("http://xds.invalid")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    tokio::net::UnixStream::connect(path)
                        .await
                        .map(hyper_util::rt::TokioIo::new)
                }
            }))
            .await
    } else {
        Endpoint::from_shared(target.to_string())?.connect().await
    }
}

/// A node with this ID.
pub fn node(id: &str) -> Node {
    Node {
        id: id.to_string(),
        ..Node::default()
    }
}

/// Why a [`recv`](AdsStream::recv) produced no response.
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// Nothing arrived in time.
    #[error("no response within {0:?}")]
    Timeout(Duration),
    /// The server ended the stream with this status.
    #[error("stream ended: {0}")]
    Status(Status),
    /// The server ended the stream cleanly.
    #[error("stream ended by the server")]
    Ended,
}

/// One ADS stream of either flavor: `Req` is `DiscoveryRequest` or `DeltaDiscoveryRequest`.
pub struct AdsStream<Req, Resp> {
    tx: mpsc::UnboundedSender<Req>,
    rx: Streaming<Resp>,
}

impl<Req, Resp> std::fmt::Debug for AdsStream<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdsStream")
    }
}

/// A State-of-the-World ADS stream.
pub type SotwStream = AdsStream<DiscoveryRequest, DiscoveryResponse>;
/// A Delta ADS stream.
pub type DeltaStream = AdsStream<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;

impl<Req, Resp> AdsStream<Req, Resp> {
    /// Sends one request (never blocks; requests queue in the transport).
    pub fn send(&self, req: Req) -> Result<(), Status> {
        self.tx
            .send(req)
            .map_err(|_| Status::cancelled("the stream's request side is closed"))
    }

    /// The next response, waiting at most `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> Result<Resp, RecvError> {
        match tokio::time::timeout(timeout, self.rx.message()).await {
            Err(_) => Err(RecvError::Timeout(timeout)),
            Ok(Ok(Some(resp))) => Ok(resp),
            Ok(Ok(None)) => Err(RecvError::Ended),
            Ok(Err(status)) => Err(RecvError::Status(status)),
        }
    }

    /// Ends the request side (the server then ends the stream).
    pub fn close(self) -> Streaming<Resp> {
        self.rx
    }
}

/// Opens a SotW ADS stream on `channel`.
pub async fn sotw(channel: Channel) -> Result<SotwStream, Status> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut client =
        AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let stream = client
        .stream_aggregated_resources(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    Ok(AdsStream { tx, rx: stream })
}

/// Opens a Delta ADS stream on `channel`.
pub async fn delta(channel: Channel) -> Result<DeltaStream, Status> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut client =
        AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let stream = client
        .delta_aggregated_resources(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    Ok(AdsStream { tx, rx: stream })
}
