//! Listeners: unix sockets in private directories, plain TCP, and mutual TLS, behind
//! one accept loop that caps connections and backs off on accept errors.
//!
//! # Unix sockets
//!
//! [`bind_unix`] only binds in a directory that exists, is a real directory (not a
//! symlink), is owned by our effective uid and is not group- or other-writable
//! ([`ensure_private_dir`] makes one): in such a directory nobody else can create,
//! replace or swap in a symlink for the socket path, which is what makes the rest safe.
//! The socket is bound in a fresh 0700 subdirectory, given its mode (0600 by default),
//! then renamed into place, so it never exists at its path with the looser mode the
//! process umask would give it — a window in which another uid could connect — and the
//! process-wide umask is never changed (other threads may be creating files). A stale
//! socket at the path is replaced; anything else (a file, a directory, a symlink) is
//! an error, and nothing is ever `chmod`ed through a symlink.
//!
//! # Connection bounds
//!
//! Connections count against one of two caps: TCP and TLS listeners against
//! [`ConnectionLimits::max_connections`], unix-socket listeners against
//! [`ConnectionLimits::max_unix_connections`] (each server-wide, across the listeners
//! of its kind). The two are separate so that clients who can reach the TCP port —
//! with a certificate or without one — cannot take the slots the node's Envoy needs on
//! the unix socket. A connection over its cap is closed as soon as it is accepted and
//! counted in `flock_xds_connections_refused_total`; the gauge
//! `flock_xds_connections_open` follows the rest.
//!
//! A TCP/TLS connection holds its slot only while it carries an authorized stream:
//! one that has not completed its TLS handshake, or carries no stream the authorizer
//! allowed (it opened none, or only refused ones, e.g. a client without a
//! certificate), for [`ConnectionLimits::idle_timeout`] is closed and counted in
//! `flock_xds_connections_idle_closed_total` (`..._handshake_timeout_total` when the
//! handshake was not done). The timer starts at accept and again whenever the
//! connection's last stream ends. Unix-socket connections have no idle timeout (only
//! allowed uids can open one).
//!
//! TLS handshakes run beside the accept loop (a slow client never holds up others),
//! each with the [`ServerTls`] configuration current at its accept, so a rotated
//! certificate, key or CA bundle is used by every new connection
//! ([`Server::serve_tls_reloadable`]).
//!
//! Each connection may carry at most
//! [`ConnectionLimits::max_concurrent_streams_per_connection`] streams (HTTP/2
//! `SETTINGS_MAX_CONCURRENT_STREAMS`; without it hyper allows any number).
//!
//! An accept error about one connection (it was reset or aborted before we took it)
//! is skipped at once. Any other — above all running out of file descriptors
//! (`EMFILE`/`ENFILE`) or memory (`ENOBUFS`/`ENOMEM`), which persist until some
//! connection closes — pauses the loop: [`AcceptBackoff`] from 10 ms doubling to 1 s,
//! reset by the next successful accept. Retrying at once would spin a core on an error
//! that cannot clear while we spin (the pending connection stays in the backlog, so
//! every `accept` fails again).

use super::Server;
use super::auth::{RefusalReason, Refusals};
use super::coalesce::Coalescing;
use super::conn::{ConnInfo, ConnState, Pool};
use super::metrics::Metrics;
use super::tls::ServerTls;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::future::Future;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use zeroize::Zeroizing;

/// Bounds on the connections of one [`Server`] (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once, across the server's TCP and TLS listeners (default
    /// 1024).
    pub max_connections: usize,
    /// Connections open at once, across the server's unix-socket listeners (default
    /// 1024): a pool of its own, which TCP/TLS clients cannot take.
    pub max_unix_connections: usize,
    /// How long a TCP/TLS connection may go without an authorized stream (from its
    /// accept, handshake included, or from the end of its last stream) before it is
    /// closed (default 10 s; `None`: never, and TLS handshakes get 10 s).
    pub idle_timeout: Option<Duration>,
    /// Streams open at once on one connection (default 100).
    pub max_concurrent_streams_per_connection: u32,
    /// The pause after an accept error.
    pub accept_error_backoff: AcceptBackoff,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_unix_connections: 1024,
            idle_timeout: Some(Duration::from_secs(10)),
            max_concurrent_streams_per_connection: 100,
            accept_error_backoff: AcceptBackoff::default(),
        }
    }
}

/// The pause after consecutive accept errors: `min`, doubling, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptBackoff {
    /// The first pause (default 10 ms).
    pub min: Duration,
    /// The longest pause (default 1 s).
    pub max: Duration,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self {
            min: Duration::from_millis(10),
            max: Duration::from_secs(1),
        }
    }
}

impl AcceptBackoff {
    /// The pause after the `errors`-th consecutive accept error (from 0). No jitter:
    /// the loop guards one local resource, there is no fleet to de-synchronise. A zero
    /// `min` still pauses 1 ms, so no setting makes the loop spin.
    pub fn delay(&self, errors: u32) -> Duration {
        let min = self.min.max(Duration::from_millis(1));
        flock_core::backoff::Backoff::new(min, self.max.max(min)).ceiling_at(errors)
    }
}

/// Certificates for [`Server::serve_tls`]: the server's chain and key, and the CA
/// client certificates are verified against.
pub struct TlsSettings {
    /// The server certificate chain (PEM).
    pub cert_chain_pem: String,
    /// The server's private key (PEM), wiped from memory when dropped.
    pub key_pem: Zeroizing<String>,
    /// The CA bundle (PEM) client certificates must chain to.
    pub client_ca_pem: String,
}

impl std::fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSettings")
            .field(
                "cert_chain_pem",
                &format_args!("{} bytes", self.cert_chain_pem.len()),
            )
            .field("key_pem", &format_args!("<redacted>"))
            .field(
                "client_ca_pem",
                &format_args!("{} bytes", self.client_ca_pem.len()),
            )
            .finish()
    }
}

/// The most bytes of one PEM input (a chain of a few certificates is a few KiB).
const MAX_PEM_BYTES: usize = 1 << 20;

/// How long a TLS client may take to finish its handshake: a client that stalls holds
/// a connection slot until then.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl TlsSettings {
    /// Every PEM input present and under [`MAX_PEM_BYTES`].
    pub(crate) fn check(&self) -> io::Result<()> {
        for (what, pem) in [
            ("cert_chain_pem", self.cert_chain_pem.as_str()),
            ("key_pem", self.key_pem.as_str()),
            ("client_ca_pem", self.client_ca_pem.as_str()),
        ] {
            if pem.trim().is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "TLS settings: {what} is empty (serve_tls needs a server certificate, its key and a client CA)"
                    ),
                ));
            }
            if pem.len() > MAX_PEM_BYTES {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "TLS settings: {what} is {} bytes, over the limit of {MAX_PEM_BYTES}",
                        pem.len()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Connection counters of one server, and the refusal counters of its authorizer.
#[derive(Debug, Clone, Default)]
pub(crate) struct TransportMetrics {
    pub(crate) connections: Arc<Connections>,
    pub(crate) refusals: Arc<Refusals>,
}

impl TransportMetrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "flock_xds_connections_open",
            "xDS connections open now",
            self.connections.gauge.clone(),
        );
        registry.register(
            "flock_xds_connections_refused",
            "xDS connections closed at accept because the server was at its connection cap",
            self.connections.refused.clone(),
        );
        registry.register(
            "flock_xds_connections_idle_closed",
            "TCP/TLS xDS connections closed for carrying no authorized stream for the idle timeout",
            self.connections.idle_closed.clone(),
        );
        registry.register(
            "flock_xds_connections_handshake_timeout",
            "TLS xDS connections closed for not completing the handshake within the idle timeout",
            self.connections.handshake_timeouts.clone(),
        );
        registry.register_collector(Box::new(RefusalsCollector(Arc::clone(&self.refusals))));
    }
}

#[derive(Debug)]
struct RefusalsCollector(Arc<Refusals>);

impl Collector for RefusalsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "flock_xds_unauthorized",
            "xDS RPCs refused by the authorizer, or SDS requests by a principal without secrets, by reason.",
            None,
            MetricType::Counter,
        )?;
        for reason in RefusalReason::ALL {
            self.0
                .counter(reason)
                .encode(family.encode_family(&[("reason", reason.as_str())])?)?;
        }
        Ok(())
    }
}

impl Metrics {
    /// xDS RPCs refused so far for `reason` (`"unauthenticated"`,
    /// `"permission_denied"`, `"secrets"`); 0 for any other label.
    pub fn unauthorized(&self, reason: &str) -> u64 {
        RefusalReason::ALL
            .into_iter()
            .find(|r| r.as_str() == reason)
            .map_or(0, |r| self.transport.refusals.count(r))
    }

    /// Connections open now, across the server's listeners.
    pub fn connections_open(&self) -> u64 {
        self.transport
            .connections
            .open
            .iter()
            .map(|n| n.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// TCP/TLS connections closed by the idle timeout after their handshake.
    pub fn connections_idle_closed(&self) -> u64 {
        self.transport.connections.idle_closed.get()
    }

    /// TLS connections closed by the idle timeout before their handshake completed.
    pub fn connections_handshake_timeouts(&self) -> u64 {
        self.transport.connections.handshake_timeouts.get()
    }

    /// Connections closed at accept because the server was at its cap.
    pub fn connections_refused(&self) -> u64 {
        self.transport.connections.refused.get()
    }
}

/// The open connections of one server, per pool.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    open: [AtomicUsize; 2],
    gauge: Gauge,
    refused: Counter,
    idle_closed: Counter,
    handshake_timeouts: Counter,
    /// Whether the pool's cap was hit since the last connection under it: one `warn`
    /// per episode, not one per refused connection.
    saturated: [AtomicBool; 2],
}

impl Connections {
    /// Takes a slot of `pool` if fewer than `max` of its slots are open.
    fn try_open(self: &Arc<Self>, pool: Pool, max: usize) -> Option<ConnGuard> {
        let taken = self.open[pool as usize]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if taken {
            self.gauge.inc();
            self.saturated[pool as usize].store(false, Ordering::Relaxed);
            Some(ConnGuard(Arc::clone(self), pool))
        } else {
            self.refused.inc();
            if !self.saturated[pool as usize].swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    max_connections = max,
                    listeners = ?pool,
                    "xDS server at its connection cap; closing new connections until one ends"
                );
            }
            None
        }
    }
}

/// One open connection's slot, given back on drop (when the connection ends, or when
/// its TLS handshake fails).
#[derive(Debug)]
pub(crate) struct ConnGuard(Arc<Connections>, Pool);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.open[self.1 as usize].fetch_sub(1, Ordering::AcqRel);
        self.0.gauge.dec();
    }
}

/// A listener the accept loop can poll.
pub(crate) trait Accept: Send + Unpin + 'static {
    type Io: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static;
    /// The connection cap its connections count against.
    const POOL: Pool;
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Io>>;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    const POOL: Pool = Pool::Tcp;
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Io>> {
        tokio::net::TcpListener::poll_accept(self, cx).map_ok(|(stream, _)| {
            // gRPC messages are small and latency-bound (Nagle would hold ACKs back).
            let _ = stream.set_nodelay(true);
            stream
        })
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    const POOL: Pool = Pool::Unix;
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Io>> {
        tokio::net::UnixListener::poll_accept(self, cx).map_ok(|(stream, _)| stream)
    }
}

/// What to do after an accept error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcceptErrorAction {
    /// The error was about one connection (gone before we took it): accept again now.
    Retry,
    /// Out of a resource, or an error we do not know: pause before accepting again.
    Pause,
}

/// Classifies an accept error (see the module docs).
pub(crate) fn accept_error_action(e: &io::Error) -> AcceptErrorAction {
    use nix::errno::Errno;
    let per_connection = [
        Errno::ECONNABORTED,
        Errno::ECONNRESET,
        Errno::EPROTO,
        Errno::EPERM,
        Errno::EINTR,
        Errno::EAGAIN,
    ];
    match e.raw_os_error() {
        Some(code) if per_connection.iter().any(|&x| x as i32 == code) => AcceptErrorAction::Retry,
        _ => AcceptErrorAction::Pause,
    }
}

/// The accept loop: a stream of counted connections for tonic. Never yields an error
/// (tonic would retry at once, which is the spin this loop exists to prevent).
pub(crate) struct Incoming<A> {
    listener: A,
    connections: Arc<Connections>,
    pool: Pool,
    max_connections: usize,
    idle_timeout: Option<Duration>,
    /// Whether connections are ready for HTTP/2 at accept (not TLS).
    established: bool,
    backoff: AcceptBackoff,
    errors: u32,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<A: Accept> Incoming<A> {
    pub(crate) fn new(
        listener: A,
        connections: Arc<Connections>,
        limits: &ConnectionLimits,
    ) -> Self {
        let (pool, max_connections) = match A::POOL {
            // The bug: the unix socket shares the TCP/TLS listeners' cap, so clients
            // without a certificate can take every slot the node's Envoy needs.
            Pool::Unix if flock_core::reintroduced!("xds-shared-connection-pool") => {
                (Pool::Tcp, limits.max_connections)
            }
            Pool::Unix => (Pool::Unix, limits.max_unix_connections),
            Pool::Tcp => (Pool::Tcp, limits.max_connections),
        };
        let idle_timeout = match A::POOL {
            Pool::Tcp if !flock_core::reintroduced!("xds-idle-connections-kept") => {
                limits.idle_timeout
            }
            _ => None,
        };
        Self {
            listener,
            connections,
            pool,
            max_connections,
            idle_timeout,
            established: true,
            backoff: limits.accept_error_backoff,
            errors: 0,
            pause: None,
        }
    }
}

impl<A: Accept> tokio_stream::Stream for Incoming<A> {
    type Item = Result<Counted<A::Io>, std::convert::Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(pause) = this.pause.as_mut() {
                ready!(pause.as_mut().poll(cx));
                this.pause = None;
            }
            match ready!(this.listener.poll_accept(cx)) {
                Ok(io) => {
                    this.errors = 0;
                    match this.connections.try_open(this.pool, this.max_connections) {
                        Some(slot) => {
                            let state = ConnState::new(this.pool, this.established);
                            let idle = this.idle_timeout.map(|timeout| IdleTimer {
                                timeout,
                                sleep: Box::pin(tokio::time::sleep(timeout)),
                                busy: false,
                                connections: Arc::clone(&this.connections),
                            });
                            return Poll::Ready(Some(Ok(Counted {
                                io: Coalescing::new(io),
                                state,
                                idle,
                                _slot: slot,
                            })));
                        }
                        // Over the cap: dropping the stream closes it now, before it
                        // costs a TLS handshake or an HTTP/2 connection.
                        None => continue,
                    }
                }
                Err(e) => match accept_error_action(&e) {
                    AcceptErrorAction::Retry => {
                        tracing::debug!("xDS accept: {e} (one connection; accepting the next)");
                    }
                    AcceptErrorAction::Pause => {
                        if flock_core::reintroduced!("xds-accept-spin") {
                            tracing::warn!(error = %e, "xDS accept failed");
                        } else {
                            let delay = this.backoff.delay(this.errors);
                            this.errors = this.errors.saturating_add(1);
                            tracing::warn!(
                                error = %e,
                                pause_ms = delay.as_millis() as u64,
                                "xDS accept failed; pausing before accepting again"
                            );
                            this.pause = Some(Box::pin(tokio::time::sleep(delay)));
                        }
                    }
                },
            }
        }
    }
}

/// An accepted connection holding its slot under the cap, its writes coalesced
/// ([`Coalescing`]), closed by its idle timer if it has one.
pub(crate) struct Counted<Io> {
    io: Coalescing<Io>,
    state: Arc<ConnState>,
    idle: Option<IdleTimer>,
    _slot: ConnGuard,
}

/// Closes a connection that carries no authorized stream for `timeout` (see the
/// module docs). Checked on every read: hyper and the TLS handshake always keep a read
/// pending, and the end of the connection's last stream wakes that read.
struct IdleTimer {
    timeout: Duration,
    sleep: Pin<Box<tokio::time::Sleep>>,
    /// Whether a stream was active at the last check (the timer restarts when the
    /// last one ends).
    busy: bool,
    connections: Arc<Connections>,
}

impl IdleTimer {
    fn check(&mut self, state: &ConnState, cx: &mut Context<'_>) -> io::Result<()> {
        state.register(cx.waker());
        if state.active() > 0 {
            self.busy = true;
            return Ok(());
        }
        if self.busy {
            self.busy = false;
            self.sleep
                .as_mut()
                .reset(tokio::time::Instant::now() + self.timeout);
        }
        if self.sleep.as_mut().poll(cx).is_pending() {
            return Ok(());
        }
        let what = if state.established() {
            self.connections.idle_closed.inc();
            "carried no authorized stream"
        } else {
            self.connections.handshake_timeouts.inc();
            "did not complete its TLS handshake"
        };
        tracing::debug!(timeout = ?self.timeout, "xDS connection {what}; closing it");
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the connection {what} within {:?}", self.timeout),
        ))
    }
}

impl<Io> Counted<Io> {
    pub(crate) fn state(&self) -> &Arc<ConnState> {
        &self.state
    }
}

impl<Io: Connected> Connected for Counted<Io> {
    type ConnectInfo = ConnInfo<Io::ConnectInfo>;
    fn connect_info(&self) -> Self::ConnectInfo {
        ConnInfo {
            inner: self.io.get_ref().connect_info(),
            state: Arc::clone(&self.state),
        }
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Counted<Io> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(idle) = this.idle.as_mut() {
            idle.check(&this.state, cx)?;
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Counted<Io> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl Server {
    /// Serves `listener` until `shutdown` resolves, then ends every stream (see
    /// [`Server::shutdown`]).
    async fn serve_incoming<A: Accept>(
        &self,
        listener: A,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let incoming = Incoming::new(
            listener,
            Arc::clone(&self.inner.metrics.transport.connections),
            &self.inner.connection_limits,
        );
        let this = self.clone();
        self.routes(self.transport_builder())
            .serve_with_incoming_shutdown(incoming, async move {
                shutdown.await;
                this.shutdown();
            })
            .await
            .map_err(io::Error::other)
    }

    /// Serves plain gRPC (no TLS) on a bound TCP listener until `shutdown` resolves
    /// (then every stream ends with `UNAVAILABLE`, see [`Server::shutdown`]). A TCP
    /// address authenticates nothing: pair this with an authorizer that refuses
    /// [`Peer::Tcp`](super::Peer::Tcp), or keep the listener on loopback behind
    /// another authentication layer.
    pub async fn serve_tcp(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        self.serve_incoming(listener, shutdown).await
    }

    /// Serves gRPC over mutual TLS on a bound TCP listener until `shutdown` resolves.
    /// Client certificates are verified against `tls.client_ca_pem`; a client without
    /// one still completes the handshake and reaches the authorizer as a
    /// [`Peer::Tls`](super::Peer::Tls) without identity (so it is told
    /// `UNAUTHENTICATED`). Bad PEM is an `InvalidInput` error before anything is
    /// served.
    pub async fn serve_tls(
        &self,
        listener: tokio::net::TcpListener,
        tls: TlsSettings,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let tls = Arc::new(ServerTls::new(&tls)?);
        self.serve_tls_reloadable(listener, tls, shutdown).await
    }

    /// [`serve_tls`](Self::serve_tls) with a configuration the caller may
    /// [replace](ServerTls::replace) while it serves: every connection accepted after
    /// a replacement is handshaken with the new certificate, key and client CA.
    pub async fn serve_tls_reloadable(
        &self,
        listener: tokio::net::TcpListener,
        tls: Arc<ServerTls>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let mut incoming = Incoming::new(
            listener,
            Arc::clone(&self.inner.metrics.transport.connections),
            &self.inner.connection_limits,
        );
        incoming.established = false;
        // The handshake's own bound: the idle timer ends a stalled handshake first
        // (and counts it); this one is for a server without an idle timeout.
        let handshake_timeout = match incoming.idle_timeout {
            Some(idle) => idle + Duration::from_secs(1),
            None => TLS_HANDSHAKE_TIMEOUT,
        };
        let (tx, rx) = tokio::sync::mpsc::channel(128);
        let accept = tokio::spawn(async move {
            use tokio_stream::StreamExt as _;
            loop {
                let conn = tokio::select! {
                    _ = tx.closed() => return,
                    conn = incoming.next() => conn,
                };
                let Some(Ok(conn)) = conn else { return };
                let acceptor = tls.acceptor();
                let tx = tx.clone();
                // Handshakes run beside the loop: a client that stalls its handshake
                // holds only its own slot, until the idle timer (or this bound) ends it.
                tokio::spawn(async move {
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(conn)).await {
                        Ok(Ok(stream)) => {
                            stream.get_ref().0.state().set_established();
                            let _ = tx.send(Ok::<_, std::convert::Infallible>(stream)).await;
                        }
                        Ok(Err(e)) => tracing::debug!("xDS TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!(
                            ?handshake_timeout,
                            "xDS TLS handshake did not complete in time"
                        ),
                    }
                });
            }
        });
        let this = self.clone();
        let result = self
            .routes(self.transport_builder())
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::ReceiverStream::new(rx),
                async move {
                    shutdown.await;
                    this.shutdown();
                },
            )
            .await
            .map_err(io::Error::other);
        accept.abort();
        result
    }

    /// Serves on a unix socket at `path`, bound by [`bind_unix`] (mode 0600, in a
    /// private directory), until `shutdown` resolves. The socket file is removed on
    /// return.
    pub async fn serve_unix(
        &self,
        path: &Path,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let listener = bind_unix(path)?;
        self.serve_unix_listener(listener, path, shutdown).await
    }

    /// Serves on a unix listener already bound at `path` (e.g. by
    /// [`bind_unix_with_mode`]) until `shutdown` resolves, then removes `path`.
    pub async fn serve_unix_listener(
        &self,
        listener: tokio::net::UnixListener,
        path: &Path,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let result = self.serve_incoming(listener, shutdown).await;
        remove_socket(path);
        result
    }
}

/// Removes the socket at `path` if it is (still) a socket.
fn remove_socket(path: &Path) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(path);
    }
}

fn invalid(path: &Path, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{}: {what}", path.display()),
    )
}

/// Checks that `dir` is a directory only we can write in: a real directory (not a
/// symlink), owned by our effective uid, not group- or other-writable.
fn check_private_dir(dir: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
    if meta.file_type().is_symlink() {
        return Err(invalid(
            dir,
            "is a symlink; a socket directory must be a real directory (a symlink could be re-pointed)",
        ));
    }
    if !meta.is_dir() {
        return Err(invalid(dir, "is not a directory"));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid {
        return Err(invalid(
            dir,
            &format!(
                "is owned by uid {}, not by us (uid {euid}); its owner could replace our socket",
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(invalid(
            dir,
            &format!(
                "has mode {mode:04o}: group or others can write in it and so replace our socket; make it 0700 or 0750"
            ),
        ));
    }
    Ok(())
}

/// Makes `path` a private directory: creates it (and missing parents) with mode 0700
/// if it is missing, then checks it as [`bind_unix`] does — a real directory, not a
/// symlink, owned by our effective uid, not group- or other-writable. An existing
/// directory is never `chmod`ed (someone chose its mode); a wrong one is an error
/// naming the path and what is wrong.
pub fn ensure_private_dir(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|e| {
                    io::Error::new(e.kind(), format!("creating {}: {e}", path.display()))
                })?;
        }
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    }
    check_private_dir(path)
}

/// Binds a unix socket at `path` with mode 0600 (see [`bind_unix_with_mode`]).
pub fn bind_unix(path: &Path) -> io::Result<tokio::net::UnixListener> {
    bind_unix_with_mode(path, 0o600)
}

/// Binds a unix socket at `path` with `mode` (e.g. 0660 for a group of clients). The
/// parent directory must pass [`ensure_private_dir`]'s checks; a stale socket at
/// `path` is replaced, anything else (a file, a directory, a symlink) is an error.
/// The socket appears at `path` already with `mode` (see the module docs).
pub fn bind_unix_with_mode(path: &Path, mode: u32) -> io::Result<tokio::net::UnixListener> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Some(name) = path.file_name() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a socket path (no file name)", path.display()),
        ));
    };
    check_private_dir(&dir)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {}
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(invalid(path, "is a symlink; refusing to replace it"));
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                ),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    }
    // Bind in a fresh owner-only directory, set the mode, then move the socket into
    // place: nobody can connect to it before it has its final mode.
    let staging = dir.join(format!(
        ".{}.bind-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", staging.display())))?;
    let result = (|| {
        let tmp = staging.join("s");
        let listener = tokio::net::UnixListener::bind(&tmp)
            .map_err(|e| io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))?;
        // `tmp` was just created by us in a directory only we can enter: not a symlink.
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode & 0o777))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("moving the socket to {}: {e}", path.display()),
            )
        })?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_from_10ms_to_1s() {
        let b = AcceptBackoff::default();
        let schedule: Vec<u128> = (0..10).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(schedule, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(1));
        let zero = AcceptBackoff {
            min: Duration::ZERO,
            max: Duration::ZERO,
        };
        assert!(zero.delay(0) >= Duration::from_millis(1), "never spins");
    }

    #[test]
    fn resource_exhaustion_pauses_and_a_lost_connection_does_not() {
        use nix::errno::Errno;
        for errno in [
            Errno::EMFILE,
            Errno::ENFILE,
            Errno::ENOBUFS,
            Errno::ENOMEM,
            Errno::EINVAL,
        ] {
            let e = io::Error::from_raw_os_error(errno as i32);
            assert_eq!(accept_error_action(&e), AcceptErrorAction::Pause, "{errno}");
        }
        for errno in [Errno::ECONNABORTED, Errno::ECONNRESET, Errno::EPROTO] {
            let e = io::Error::from_raw_os_error(errno as i32);
            assert_eq!(accept_error_action(&e), AcceptErrorAction::Retry, "{errno}");
        }
        assert_eq!(
            accept_error_action(&io::Error::other("no errno")),
            AcceptErrorAction::Pause
        );
    }

    /// A listener that fails with `EMFILE` a number of times, then accepts one
    /// in-memory connection. A test double: the real EMFILE is in `tests/auth.rs`.
    struct Failing {
        errors_left: u32,
        calls: Arc<AtomicUsize>,
    }

    struct Duplex(tokio::io::DuplexStream);

    impl Connected for Duplex {
        type ConnectInfo = ();
        fn connect_info(&self) {}
    }
    impl AsyncRead for Duplex {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
        }
    }
    impl AsyncWrite for Duplex {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_flush(cx)
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
        }
    }

    impl Accept for Failing {
        type Io = Duplex;
        const POOL: Pool = Pool::Tcp;
        fn poll_accept(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<Duplex>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.errors_left > 0 {
                self.errors_left -= 1;
                return Poll::Ready(Err(io::Error::from_raw_os_error(
                    nix::errno::Errno::EMFILE as i32,
                )));
            }
            Poll::Ready(Ok(Duplex(tokio::io::duplex(64).0)))
        }
    }

    /// Eight EMFILEs in a row: the loop accepts eight times plus the success, sleeping
    /// the schedule in between (10+20+…+1000 ms of paused time), never retrying early.
    #[tokio::test(start_paused = true)]
    async fn emfile_pauses_on_the_backoff_schedule() {
        use tokio_stream::StreamExt as _;
        let calls = Arc::new(AtomicUsize::new(0));
        let listener = Failing {
            errors_left: 8,
            calls: Arc::clone(&calls),
        };
        let mut incoming = Incoming::new(listener, Arc::default(), &ConnectionLimits::default());
        let start = tokio::time::Instant::now();
        let conn = incoming.next().await.expect("a connection");
        assert!(conn.is_ok());
        let slept = start.elapsed();
        let expected: Duration = (0..8).map(|n| AcceptBackoff::default().delay(n)).sum();
        assert_eq!(slept, expected, "paused the whole schedule");
        assert_eq!(
            calls.load(Ordering::Relaxed),
            9,
            "one accept per pause, no spin"
        );
    }

    #[tokio::test]
    async fn the_cap_refuses_and_a_closed_connection_frees_its_slot() {
        let conns: Arc<Connections> = Arc::default();
        let a = conns.try_open(Pool::Tcp, 2).unwrap();
        let _b = conns.try_open(Pool::Tcp, 2).unwrap();
        assert!(conns.try_open(Pool::Tcp, 2).is_none());
        assert_eq!(conns.refused.get(), 1);
        assert_eq!(conns.gauge.get(), 2);
        // The unix pool is separate.
        let _u = conns.try_open(Pool::Unix, 2).unwrap();
        drop(a);
        assert_eq!(conns.gauge.get(), 2);
        assert!(conns.try_open(Pool::Tcp, 2).is_some());
    }
}
