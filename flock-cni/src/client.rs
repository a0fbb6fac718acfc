//! The plugin's gRPC client: `flock.cni.v1.CniService` on a unix socket, every call
//! bounded by a deadline (connect included).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::proto::v1::cni_service_client::CniServiceClient;

/// Why a call to the agent did not produce an answer.
#[derive(Debug)]
pub enum AgentError {
    /// Nothing listens on the socket (missing, refused, connection dropped).
    Unreachable(String),
    /// No connection to the socket within the timeout (nothing accepts it).
    ConnectTimeout(Duration),
    /// Connected and sent, but no answer within the timeout: the agent is up and has
    /// the request (it completes the operation on its own; an ADD whose answer nobody
    /// received is undone).
    Timeout(Duration),
    /// The agent answered with a gRPC error status.
    Status(tonic::Status),
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable(why) => write!(f, "agent unreachable: {why}"),
            Self::ConnectTimeout(d) => write!(
                f,
                "agent unreachable: no connection within {} ms",
                d.as_millis()
            ),
            Self::Timeout(d) => write!(
                f,
                "the flock agent got the request but did not answer within {} ms",
                d.as_millis()
            ),
            Self::Status(s) => write!(f, "agent returned gRPC {:?}: {}", s.code(), s.message()),
        }
    }
}

impl std::error::Error for AgentError {}

impl AgentError {
    /// True when the agent is not there at all (as opposed to answering badly, or
    /// not answering in time: [`AgentError::Timeout`] is not unreachable).
    pub fn is_unreachable(&self) -> bool {
        match self {
            Self::Unreachable(_) | Self::ConnectTimeout(_) => true,
            Self::Timeout(_) => false,
            Self::Status(s) => s.code() == tonic::Code::Unavailable,
        }
    }
}

/// Connects to the agent's socket.
pub async fn connect(socket: &Path) -> Result<CniServiceClient<Channel>, AgentError> {
    let path: PathBuf = socket.to_owned();
    // The URI is required by tonic and ignored by the connector.
    let channel = Endpoint::from_static("http://flock-agent.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| AgentError::Unreachable(format!("{}: {}", socket.display(), chain(&e))))?;
    Ok(CniServiceClient::new(channel))
}

/// Runs `call` on a fresh connection to `socket`, all within `timeout`. A timeout
/// says whether the connection was made ([`AgentError::Timeout`]: the agent has the
/// request) or not ([`AgentError::ConnectTimeout`]).
pub async fn call<T, F, Fut>(socket: &Path, timeout: Duration, call: F) -> Result<T, AgentError>
where
    F: FnOnce(CniServiceClient<Channel>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let client = match tokio::time::timeout_at(deadline, connect(socket)).await {
        Ok(client) => client?,
        Err(_) => return Err(AgentError::ConnectTimeout(timeout)),
    };
    match tokio::time::timeout_at(deadline, call(client)).await {
        Ok(result) => result
            .map(tonic::Response::into_inner)
            .map_err(AgentError::Status),
        Err(_) => Err(AgentError::Timeout(timeout)),
    }
}

/// An error and its sources, `: `-separated (tonic's transport errors hide the cause).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
