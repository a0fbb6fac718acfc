//! The plugin's gRPC client: `flock.cni.v1.CniService` on a unix socket, every call
//! bounded by a deadline (connect included).
//!
//! Its errors name the real cause, because the operator's next step differs: no agent
//! at the socket (start it), an agent that took the request and did not answer in time
//! (it is alive but slow or stuck on a dependency; it finishes the operation on its
//! own), or an agent that answered with an error (read its message).

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
    /// No connection could be made: nothing listens on the socket (the file is
    /// missing, or the connection was refused).
    Unreachable {
        /// The agent's socket.
        socket: PathBuf,
        /// What connecting said ("connection refused", "no such socket", ...).
        why: String,
    },
    /// No connection to the socket within the timeout: something holds the socket
    /// but does not accept connections (its listen backlog is full).
    ConnectTimeout {
        /// The agent's socket.
        socket: PathBuf,
        /// The call's timeout.
        after: Duration,
    },
    /// Connected and sent, but no answer within the timeout: the agent is up and has
    /// the request (it completes the operation on its own; an ADD whose answer nobody
    /// received is undone).
    Timeout {
        /// The agent's socket.
        socket: PathBuf,
        /// The call's timeout.
        after: Duration,
    },
    /// The agent answered with a gRPC error status.
    Status(tonic::Status),
}

/// `d` as an operator reads it: whole seconds as "5 s", anything else in ms.
fn span(d: Duration) -> String {
    let ms = d.as_millis();
    if ms > 0 && ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable { socket, why } => write!(
                f,
                "no flock agent at {}: {why} (is the flock agent running?)",
                socket.display()
            ),
            Self::ConnectTimeout { socket, after } => write!(
                f,
                "the flock agent did not accept a connection within {} at {}",
                span(*after),
                socket.display()
            ),
            Self::Timeout { socket, after } => write!(
                f,
                "the flock agent did not answer within {} at {} (it has the request)",
                span(*after),
                socket.display()
            ),
            Self::Status(s) => write!(
                f,
                "the flock agent answered: gRPC {:?}: {}",
                s.code(),
                s.message()
            ),
        }
    }
}

impl std::error::Error for AgentError {}

impl AgentError {
    /// True when the agent is not there at all (as opposed to answering badly, or
    /// not answering in time: [`AgentError::Timeout`] is not unreachable).
    pub fn is_unreachable(&self) -> bool {
        match self {
            Self::Unreachable { .. } | Self::ConnectTimeout { .. } => true,
            Self::Timeout { .. } => false,
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
        .map_err(|e| AgentError::Unreachable {
            socket: socket.to_owned(),
            why: connect_failure(&e),
        })?;
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
    let start = tokio::time::Instant::now();
    let deadline = start + timeout;
    // An agent handing the node to its successor (an upgrade) leaves the socket
    // missing or unanswered for a moment: connecting again for a while lets a CNI call
    // of that moment wait for the new agent instead of failing the pod's sandbox.
    let retry_until = (start + CONNECT_RETRY).min(deadline);
    let mut pause = Duration::from_millis(20);
    let client = loop {
        match tokio::time::timeout_at(deadline, connect(socket)).await {
            Ok(Ok(client)) => break client,
            Ok(Err(AgentError::Unreachable { ref why, .. }))
                if is_absent(why) && tokio::time::Instant::now() + pause < retry_until =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(AgentError::ConnectTimeout {
                    socket: socket.to_owned(),
                    after: timeout,
                });
            }
        }
    };
    match tokio::time::timeout_at(deadline, call(client)).await {
        Ok(result) => result
            .map(tonic::Response::into_inner)
            .map_err(AgentError::Status),
        Err(_) => Err(AgentError::Timeout {
            socket: socket.to_owned(),
            after: timeout,
        }),
    }
}

/// How long [`call`] keeps connecting to a socket that is missing or refuses
/// (within the call's timeout): longer than an agent's hand-over to its successor.
pub const CONNECT_RETRY: Duration = Duration::from_secs(3);

/// Whether a connect failure (as [`connect_failure`] words it) means nobody listens
/// yet: the socket file is missing or refuses, as between two agents.
fn is_absent(why: &str) -> bool {
    why == NO_SUCH_SOCKET || why.starts_with(REFUSED)
}

const NO_SUCH_SOCKET: &str = "no such socket";
const REFUSED: &str = "connection refused";

/// Why connecting failed, in words: the OS error when there is one (tonic wraps it in
/// "transport error"), else the whole error chain.
fn connect_failure(e: &(dyn std::error::Error + 'static)) -> String {
    let mut source = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::NotFound => NO_SUCH_SOCKET.into(),
                std::io::ErrorKind::ConnectionRefused => {
                    format!("{REFUSED} (the socket exists but nothing listens on it)")
                }
                // A unix socket's connect does not wait on a full listen backlog.
                std::io::ErrorKind::WouldBlock => {
                    "its listen backlog is full (the agent is not accepting connections)".into()
                }
                std::io::ErrorKind::PermissionDenied => {
                    format!("{io} (the plugin must run as root)")
                }
                _ => io.to_string(),
            };
        }
        source = s.source();
    }
    chain(e)
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
