//! What the server knows about one accepted connection beyond its transport peer:
//! which pool its slot came from, how many authorized streams it carries now (the
//! idle timeout closes a TCP/TLS connection that carries none), and its identity for
//! the subscription budget's per-connection level.
//!
//! The state travels with the connection's connect info ([`ConnInfo`]), so every RPC
//! finds it in its request's extensions.

use flock_core::sync::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::Waker;

/// Which connection cap a listener's connections count against. The node's Envoy
/// connects over the unix socket; TCP/TLS clients (proxyless gRPC, and anyone who can
/// reach the port, certificate or not) have their own pool, so they cannot take the
/// slots the node's Envoy needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pool {
    /// TCP and TLS listeners.
    Tcp = 0,
    /// Unix-socket listeners.
    Unix = 1,
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// One connection's shared state.
#[derive(Debug)]
pub(crate) struct ConnState {
    /// A process-unique id (the budget's per-connection key).
    pub(crate) id: u64,
    /// The pool its slot came from.
    pub(crate) pool: Pool,
    /// Authorized streams (and fetches) in progress on it.
    active: AtomicUsize,
    /// Whether its transport is ready for HTTP/2 (TLS: the handshake completed).
    established: AtomicBool,
    /// The connection's reader, woken when its last stream ends (so the idle timer
    /// starts at once, not at the client's next byte).
    waker: Mutex<Option<Waker>>,
}

impl ConnState {
    pub(crate) fn new(pool: Pool, established: bool) -> Arc<Self> {
        Arc::new(Self {
            id: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
            pool,
            active: AtomicUsize::new(0),
            established: AtomicBool::new(established),
            waker: Mutex::new(None),
        })
    }

    /// Counts one authorized stream until the guard drops.
    pub(crate) fn stream(self: &Arc<Self>) -> StreamGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        StreamGuard(Arc::clone(self))
    }

    pub(crate) fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    pub(crate) fn established(&self) -> bool {
        self.established.load(Ordering::Acquire)
    }

    pub(crate) fn set_established(&self) {
        self.established.store(true, Ordering::Release);
    }

    pub(crate) fn register(&self, waker: &Waker) {
        let mut slot = self.waker.lock();
        match slot.as_ref() {
            Some(w) if w.will_wake(waker) => {}
            _ => *slot = Some(waker.clone()),
        }
    }
}

/// One authorized stream on a connection (see [`ConnState::stream`]).
#[derive(Debug)]
pub(crate) struct StreamGuard(Arc<ConnState>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            let waker = self.0.waker.lock().take();
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

/// A connection's connect info: the transport's own (`UdsConnectInfo`,
/// `TcpConnectInfo`) and the connection's state.
#[derive(Debug, Clone)]
pub(crate) struct ConnInfo<I> {
    pub(crate) inner: I,
    pub(crate) state: Arc<ConnState>,
}

impl<I> ConnInfo<I> {
    /// The transport's own connect info.
    pub(crate) fn get_ref(&self) -> &I {
        &self.inner
    }
}

/// The state of the connection `req` arrived on, when it came through one of this
/// crate's listeners.
pub(crate) fn state_of<T>(req: &tonic::Request<T>) -> Option<Arc<ConnState>> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};
    let ext = req.extensions();
    if let Some(info) = ext.get::<ConnInfo<UdsConnectInfo>>() {
        return Some(Arc::clone(&info.state));
    }
    if let Some(info) = ext.get::<TlsConnectInfo<ConnInfo<TcpConnectInfo>>>() {
        return Some(Arc::clone(&info.get_ref().state));
    }
    if let Some(info) = ext.get::<ConnInfo<TcpConnectInfo>>() {
        return Some(Arc::clone(&info.state));
    }
    None
}
