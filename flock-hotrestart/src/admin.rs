//! A minimal client for Envoy's admin endpoint: `GET /server_info` (is epoch N LIVE?)
//! and `POST /drain_listeners?graceful` (graceful shutdown).
//!
//! HTTP/1.1 through hyper's client over one short-lived connection per request, to
//! Envoy's admin unix socket (the default: `admin.address.pipe` in the bootstrap, mode
//! `0600` in the supervisor's `0700` control directory, see [`crate::control`]) or,
//! opted into for compatibility, a TCP `HOST:PORT` (which any local process can
//! reach). Each request is bounded by a timeout (a wedged Envoy must not wedge the supervisor's loop) and by a
//! body size limit (a misbehaving endpoint must not make it buffer without bound).
//! Errors say which step failed (connect, request, status, body, JSON).
//!
//! Envoy hands the admin listener to the new epoch during a hot restart, so the epoch
//! and base id in the answer (`command_line_options.restart_epoch` / `base_id`) say
//! which process answered: "epoch N is LIVE" is `state == LIVE && restart_epoch == N`.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use flock_core::epoch::PredecessorStatus;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// The largest admin response read, in bytes (`/server_info` is ~120 KiB on 1.40).
pub const MAX_RESPONSE_BYTES: usize = 4 << 20;

/// What `/server_info` said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// `state`: `LIVE`, `DRAINING`, `PRE_INITIALIZING` or `INITIALIZING`.
    pub state: String,
    /// `command_line_options.restart_epoch`.
    pub epoch: u32,
    /// `command_line_options.base_id`.
    pub base_id: u32,
}

impl ServerInfo {
    /// Whether the answering Envoy is LIVE.
    pub fn is_live(&self) -> bool {
        self.state == "LIVE"
    }

    /// As the input of [`flock_core::epoch::start_epoch`].
    pub fn status(&self) -> PredecessorStatus {
        if self.is_live() {
            PredecessorStatus::Live {
                epoch: self.epoch,
                base_id: self.base_id,
            }
        } else {
            PredecessorStatus::NotLive {
                epoch: self.epoch,
                base_id: self.base_id,
            }
        }
    }
}

impl fmt::Display for ServerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "epoch {} of base id {} {}",
            self.epoch, self.base_id, self.state
        )
    }
}

/// Where Envoy's admin listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdminAddress {
    /// A unix socket (`admin.address.pipe`): the default, private to the uid that may
    /// open it.
    Unix(PathBuf),
    /// `HOST:PORT` over TCP: opt-in compatibility; any process on the host can reach a
    /// loopback port, stop Envoy (`/quitquitquit`) and read its config.
    Tcp(String),
}

impl fmt::Display for AdminAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
            Self::Tcp(addr) => write!(f, "http://{addr}"),
        }
    }
}

impl From<PathBuf> for AdminAddress {
    fn from(path: PathBuf) -> Self {
        Self::Unix(path)
    }
}

impl From<&std::path::Path> for AdminAddress {
    fn from(path: &std::path::Path) -> Self {
        Self::Unix(path.to_owned())
    }
}

impl From<String> for AdminAddress {
    /// `HOST:PORT` over TCP.
    fn from(addr: String) -> Self {
        Self::Tcp(addr)
    }
}

/// A client of one admin address.
#[derive(Clone, Debug)]
pub struct AdminClient {
    address: AdminAddress,
    timeout: Duration,
}

impl AdminClient {
    /// A client of `address` (a unix socket path, or a `HOST:PORT` string for TCP)
    /// whose requests each take at most `timeout`.
    pub fn new(address: impl Into<AdminAddress>, timeout: Duration) -> Self {
        Self {
            address: address.into(),
            timeout,
        }
    }

    /// The admin address.
    pub fn address(&self) -> &AdminAddress {
        &self.address
    }

    /// `GET path`: the body of a 200 (at most [`MAX_RESPONSE_BYTES`]), for any admin
    /// page (`/stats`, `/config_dump`, `/ready`...).
    pub async fn get(&self, path: &str) -> io::Result<Vec<u8>> {
        self.request(Method::GET, path).await
    }

    /// `POST path`: the body of a 200 (e.g. `/quitquitquit`).
    pub async fn post(&self, path: &str) -> io::Result<Vec<u8>> {
        self.request(Method::POST, path).await
    }

    /// `GET /server_info`.
    pub async fn server_info(&self) -> io::Result<ServerInfo> {
        let body = self.request(Method::GET, "/server_info").await?;
        parse_server_info(&body)
    }

    /// `/server_info` as a [`PredecessorStatus`]; any error is `Unreachable`.
    pub async fn probe(&self) -> PredecessorStatus {
        match self.server_info().await {
            Ok(info) => info.status(),
            Err(_) => PredecessorStatus::Unreachable,
        }
    }

    /// `POST /drain_listeners?graceful`: Envoy stops accepting after its drain time
    /// and asks HTTP clients to close connections meanwhile.
    pub async fn drain_listeners_gracefully(&self) -> io::Result<()> {
        self.request(Method::POST, "/drain_listeners?graceful")
            .await
            .map(drop)
    }

    /// One request on its own connection; the body of a 200, at most
    /// [`MAX_RESPONSE_BYTES`].
    async fn request(&self, method: Method, path: &str) -> io::Result<Vec<u8>> {
        let what = format!("admin {method} {}{path}", self.address);
        let connect = |e: io::Error| io::Error::new(e.kind(), format!("{what}: connect: {e}"));
        let attempt = async {
            match &self.address {
                AdminAddress::Unix(socket) => {
                    let stream = UnixStream::connect(socket).await.map_err(connect)?;
                    exchange(stream, "localhost", method, path, &what).await
                }
                AdminAddress::Tcp(addr) => {
                    let stream = TcpStream::connect(addr).await.map_err(connect)?;
                    exchange(stream, addr, method, path, &what).await
                }
            }
        };
        tokio::time::timeout(self.timeout, attempt)
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{what}: no answer in {:?}", self.timeout),
                )
            })?
    }
}

/// One HTTP/1.1 exchange on `stream`; the body of a 200.
async fn exchange<S>(
    stream: S,
    host: &str,
    method: Method,
    path: &str,
    what: &str,
) -> io::Result<Vec<u8>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let fail = |step: &str, e: &dyn fmt::Display| io::Error::other(format!("{what}: {step}: {e}"));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| fail("handshake", &e))?;
    // Drives the connection; it ends when the response is read and `sender`
    // dropped, or when the exchange is cancelled by the timeout.
    let conn = tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, host)
        .body(Empty::<Bytes>::new())
        .map_err(|e| fail("request", &e))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| fail("request", &e))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| {
            fail(
                "body",
                &format!("{e} (the limit is {MAX_RESPONSE_BYTES} bytes)"),
            )
        })?
        .to_bytes();
    drop(sender);
    conn.abort();
    if status != StatusCode::OK {
        return Err(invalid(format!("{what}: HTTP {status}")));
    }
    Ok(body.to_vec())
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Parses the JSON of `/server_info`. Never panics on any input (fuzzed).
pub fn parse_server_info(body: &[u8]) -> io::Result<ServerInfo> {
    let json: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("server_info JSON: {e}")))?;
    let state = json
        .get("state")
        .and_then(|s| s.as_str())
        .ok_or_else(|| invalid("server_info has no state"))?
        .to_owned();
    let options = json
        .get("command_line_options")
        .ok_or_else(|| invalid("server_info has no command_line_options"))?;
    let number = |key: &str| -> io::Result<u32> {
        let value = options
            .get(key)
            .ok_or_else(|| invalid(format!("server_info has no {key}")))?;
        // proto3 JSON prints 64-bit integers as strings, 32-bit ones as numbers.
        let n = match value {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::String(s) => s.parse::<u64>().ok(),
            _ => None,
        };
        n.and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid(format!("server_info {key} is not a u32: {value}")))
    };
    Ok(ServerInfo {
        state,
        epoch: number("restart_epoch")?,
        base_id: number("base_id")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An admin endpoint on a local port that answers each connection with `raw`
    /// (written as is, then the connection is closed).
    async fn serve(raw: Vec<u8>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let raw = raw.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = stream.write_all(&raw).await;
                });
            }
        });
        addr
    }

    const INFO: &str =
        r#"{"state":"LIVE","command_line_options":{"restart_epoch":3,"base_id":"7"}}"#;

    /// The default transport: Envoy's admin on a unix socket (`admin.address.pipe`).
    #[tokio::test]
    async fn reads_server_info_over_a_unix_socket() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the request head");
                head.extend_from_slice(&buf[..n]);
            }
            assert!(head.starts_with(b"GET /server_info HTTP/1.1\r\n"));
            let raw = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{INFO}",
                INFO.len()
            );
            stream.write_all(raw.as_bytes()).await.unwrap();
        });
        let client = AdminClient::new(path.clone(), Duration::from_secs(5));
        assert_eq!(client.address(), &AdminAddress::Unix(path));
        assert_eq!(
            client.probe().await,
            PredecessorStatus::Live {
                epoch: 3,
                base_id: 7
            }
        );
    }

    #[tokio::test]
    async fn reads_a_chunked_server_info_as_envoy_sends_it() {
        let (a, b) = INFO.split_at(20);
        let raw = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
             {:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        );
        let client = AdminClient::new(serve(raw.into_bytes()).await, Duration::from_secs(5));
        assert_eq!(
            client.probe().await,
            PredecessorStatus::Live {
                epoch: 3,
                base_id: 7
            }
        );
    }

    #[tokio::test]
    async fn a_non_200_is_an_error_that_names_the_status_and_the_request() {
        let raw = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n".to_vec();
        let addr = serve(raw).await;
        let client = AdminClient::new(addr.clone(), Duration::from_secs(5));
        let e = client
            .drain_listeners_gracefully()
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("503") && e.contains(&addr) && e.contains("/drain_listeners"),
            "{e}"
        );
        assert_eq!(client.probe().await, PredecessorStatus::Unreachable);
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused() {
        let big = MAX_RESPONSE_BYTES + 1;
        let mut raw = format!("HTTP/1.1 200 OK\r\ncontent-length: {big}\r\n\r\n").into_bytes();
        raw.resize(raw.len() + big, b' ');
        let client = AdminClient::new(serve(raw).await, Duration::from_secs(20));
        let e = client.server_info().await.unwrap_err().to_string();
        assert!(e.contains("body") && e.contains("limit"), "{e}");
    }

    #[tokio::test]
    async fn connection_refused_says_connect() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = AdminClient::new(format!("127.0.0.1:{port}"), Duration::from_secs(5));
        let e = client.server_info().await.unwrap_err();
        assert!(e.to_string().contains("connect"), "{e}");
    }

    /// An endpoint that accepts but never answers: the timeout ends the request (on
    /// a paused clock, so the test does not wait for it).
    #[tokio::test(start_paused = true)]
    async fn a_silent_endpoint_times_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let _held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                conns.push(s);
            }
        });
        let client = AdminClient::new(addr, Duration::from_secs(1));
        let e = client.server_info().await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("no answer in 1s"), "{e}");
    }

    #[test]
    fn parses_server_info_both_integer_spellings() {
        let body = br#"{"state":"LIVE","command_line_options":{"restart_epoch":3,"base_id":"77"}}"#;
        let info = parse_server_info(body).unwrap();
        assert_eq!(
            info,
            ServerInfo {
                state: "LIVE".into(),
                epoch: 3,
                base_id: 77
            }
        );
        assert_eq!(
            info.status(),
            PredecessorStatus::Live {
                epoch: 3,
                base_id: 77
            }
        );
        let body =
            br#"{"state":"INITIALIZING","command_line_options":{"restart_epoch":4,"base_id":77}}"#;
        assert_eq!(
            parse_server_info(body).unwrap().status(),
            PredecessorStatus::NotLive {
                epoch: 4,
                base_id: 77
            }
        );
        assert!(parse_server_info(b"{}").is_err());
        assert!(parse_server_info(b"not json").is_err());
    }
}
