//! The admin API's client (what `flockctl` uses), on hyper.
//!
//! One connection per request (the server closes after each), a connect timeout and
//! a whole-request timeout, and a cap on the body it will read: a wrong `--admin`
//! address pointing at some other server must produce an error, not a hang or an
//! unbounded read.

use crate::api::{Pods, RegistryView, Route, Snapshot, Status};
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::Request;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Why a request to the admin endpoint failed. The underlying error is the
/// [`source`](std::error::Error::source), not repeated in the message (print the
/// chain, e.g. `anyhow`'s `{:#}`).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address does not resolve.
    #[error("resolving {addr}")]
    Resolve {
        /// The address as given.
        addr: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The address cannot be a `Host` header (control characters).
    #[error("{addr:?} is not a HOST:PORT address")]
    Address {
        /// The address as given.
        addr: String,
    },
    /// No connection (nothing listening, refused, unreachable).
    #[error("connecting to the agent's admin endpoint {addr} (is flock-agent running?)")]
    Connect {
        /// The address as given.
        addr: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The connection or the whole request took longer than its timeout.
    #[error("{what} {addr} timed out after {after:?}")]
    Timeout {
        /// Connecting or the request.
        what: &'static str,
        /// The address as given.
        addr: String,
        /// The timeout.
        after: Duration,
    },
    /// An HTTP-level failure (not HTTP, connection reset…).
    #[error("GET {path}")]
    Http {
        /// The path requested.
        path: &'static str,
        /// hyper's error.
        #[source]
        source: hyper::Error,
    },
    /// The body is larger than the client reads.
    #[error("GET {path}: the response is larger than {limit} bytes")]
    TooLarge {
        /// The path requested.
        path: &'static str,
        /// The limit.
        limit: usize,
    },
    /// A status other than the one expected; `body` is the server's explanation.
    #[error("GET {path} answered {status}: {}", body.trim())]
    Status {
        /// The path requested.
        path: &'static str,
        /// The status.
        status: u16,
        /// The body, lossily decoded.
        body: String,
    },
    /// The body is not the document the path serves.
    #[error("GET {path}: not the expected document")]
    Decode {
        /// The path requested.
        path: &'static str,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
}

/// A client of one agent's admin endpoint.
#[derive(Debug, Clone)]
pub struct AdminClient {
    addr: String,
    connect_timeout: Duration,
    request_timeout: Duration,
    max_body: usize,
}

/// A response as read: status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawResponse {
    /// The HTTP status.
    pub status: u16,
    /// The body.
    pub body: Bytes,
}

impl AdminClient {
    /// The default connect timeout.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
    /// The default timeout of a whole request.
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
    /// The default body limit (a node's pod list or snapshot names fit many times).
    pub const MAX_BODY: usize = 16 * 1024 * 1024;

    /// A client of the endpoint at `addr` (`HOST:PORT`), with the default limits.
    pub fn new(addr: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            connect_timeout: Self::CONNECT_TIMEOUT,
            request_timeout: Self::REQUEST_TIMEOUT,
            max_body: Self::MAX_BODY,
        }
    }

    /// Sets the connect timeout.
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Sets the timeout of a whole request (connect included).
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// Sets the largest body read.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// `/debug/status`.
    pub async fn status(&self) -> Result<Status, ClientError> {
        self.document(Route::Status).await
    }

    /// `/debug/pods`.
    pub async fn pods(&self) -> Result<Pods, ClientError> {
        self.document(Route::Pods).await
    }

    /// `/debug/snapshot`.
    pub async fn snapshot(&self) -> Result<Snapshot, ClientError> {
        self.document(Route::Snapshot).await
    }

    /// `/debug/registry`.
    pub async fn registry(&self) -> Result<RegistryView, ClientError> {
        self.document(Route::Registry).await
    }

    /// `/debug/policies`.
    pub async fn policies(&self) -> Result<crate::api::Policies, ClientError> {
        self.document(Route::Policies).await
    }

    /// `/debug/proxy-status`.
    pub async fn proxy_status(&self) -> Result<crate::api::ProxyStatus, ClientError> {
        self.document(Route::ProxyStatus).await
    }

    /// `/debug/routes`.
    pub async fn routes(&self) -> Result<crate::api::Routes, ClientError> {
        self.document(Route::Routes).await
    }

    /// `/metrics`, as text.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        let r = self.expect_ok(Route::Metrics).await?;
        Ok(String::from_utf8_lossy(&r.body).into_owned())
    }

    /// GETs a route and decodes its document (status 200 expected).
    pub async fn document<T: DeserializeOwned>(&self, route: Route) -> Result<T, ClientError> {
        let r = self.expect_ok(route).await?;
        decode(route, &r.body)
    }

    async fn expect_ok(&self, route: Route) -> Result<RawResponse, ClientError> {
        let r = self.get(route).await?;
        if r.status != 200 {
            return Err(ClientError::Status {
                path: route.path(),
                status: r.status,
                body: String::from_utf8_lossy(&r.body).into_owned(),
            });
        }
        Ok(r)
    }

    /// GETs a route: any status, the body up to the limit.
    pub async fn get(&self, route: Route) -> Result<RawResponse, ClientError> {
        let timeout = self.request_timeout;
        tokio::time::timeout(timeout, self.get_inner(route))
            .await
            .unwrap_or_else(|_| {
                Err(ClientError::Timeout {
                    what: "GET from",
                    addr: self.addr.clone(),
                    after: timeout,
                })
            })
    }

    async fn get_inner(&self, route: Route) -> Result<RawResponse, ClientError> {
        let path = route.path();
        let req = Request::get(path)
            .header(hyper::header::HOST, &self.addr)
            .body(Empty::<Bytes>::new())
            .map_err(|_| ClientError::Address {
                addr: self.addr.clone(),
            })?;
        let stream = tokio::time::timeout(self.connect_timeout, self.connect())
            .await
            .unwrap_or_else(|_| {
                Err(ClientError::Timeout {
                    what: "connecting to",
                    addr: self.addr.clone(),
                    after: self.connect_timeout,
                })
            })?;
        let http = |source| ClientError::Http { path, source };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(http)?;
        // The connection task ends with the response (the server closes it); on an
        // early return or a timeout the guard ends it.
        let _conn = AbortOnDrop(tokio::spawn(conn));
        let resp = sender.send_request(req).await.map_err(http)?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), self.max_body)
            .collect()
            .await
            .map_err(|e| match e.downcast::<hyper::Error>() {
                Ok(e) => http(*e),
                Err(_) => ClientError::TooLarge {
                    path,
                    limit: self.max_body,
                },
            })?
            .to_bytes();
        Ok(RawResponse {
            status: status.as_u16(),
            body,
        })
    }

    async fn connect(&self) -> Result<tokio::net::TcpStream, ClientError> {
        let addrs: Vec<_> = tokio::net::lookup_host(&self.addr)
            .await
            .map_err(|source| ClientError::Resolve {
                addr: self.addr.clone(),
                source,
            })?
            .collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "resolves to nothing");
        for a in addrs {
            match tokio::net::TcpStream::connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(ClientError::Connect {
            addr: self.addr.clone(),
            source: last,
        })
    }
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Decodes the document of `route` from a response body (the client's only parser of
/// what the network sent; fuzzed with the request router).
pub fn decode<T: DeserializeOwned>(route: Route, body: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(body).map_err(|source| ClientError::Decode {
        path: route.path(),
        source,
    })
}
