//! The single publish point: version order always equals content order.
//!
//! Every state change the agent makes — a CNI ADD or DEL, a registry refresh, an
//! identity rotation — goes through one [`Publisher`]. Inside one critical section it
//!
//! 1. computes the next state from the latest published one (the caller's closure),
//! 2. assigns the next version number,
//! 3. stores the new [`Snapshot`] as the latest, hands it to every sink and wakes
//!    every waiter.
//!
//! **Why (race R1, lost update):** an agent that computes a version from an atomic
//! counter, then reads its maps, then sets the cache, with nothing holding the three
//! steps together, can have two writers interleave so that version 11 (with both
//! changes) is set first and version 10 (with only one) set last: the stale snapshot
//! wins and a removed listener stays resurrected. Here the three steps are one step;
//! `tests/loom_snapshot.rs` explores every interleaving of several writers and a reader
//! and checks that versions only grow and every completed write is in the latest state.
//! `reintroduced!("r1")` (see [`crate::reintroduce`]) restores that shape (a
//! counter outside the lock) and that loom test fails.
//!
//! **Why (race R2, aliased mutation):** a published [`Snapshot`] is behind an
//! `Arc` and only ever handed out as `&S`; the closure that builds the next state gets
//! the previous state by shared reference and must return a new value. There is no
//! `&mut` path to a value a reader may be encoding, so a torn read is impossible by
//! construction, not by convention.
//!
//! Sinks are how async code (the xDS server) receives snapshots without a thread per
//! subscriber: a sink is called under the publish lock, in version order, and must
//! only do something cheap and non-blocking (for example `tokio::sync::watch::Sender::
//! send_replace`). Blocking code can instead wait with [`Publisher::wait_newer`].
//!
//! ```
//! # if flock_core::sync::LOOM { return; } // loom's primitives work only inside a model
//! use flock_core::snapshot::Publisher;
//! use std::collections::BTreeSet;
//!
//! let publisher = Publisher::new(BTreeSet::<String>::new());
//! let first = publisher.publish(|pods| {
//!     let mut next = pods.clone();
//!     next.insert("pod-a".to_string());
//!     next
//! });
//! assert_eq!(first.version(), 1);
//!
//! // A change that turns out to be a no-op publishes nothing.
//! assert!(publisher.try_publish(|pods| (!pods.contains("pod-a")).then(|| pods.clone())).is_none());
//!
//! // A waiter asks for anything newer than what it has seen.
//! let latest = publisher.wait_newer(0);
//! assert_eq!(latest.version(), 1);
//! assert!(latest.state().contains("pod-a"));
//! ```

use crate::sync::{Arc, Condvar, Mutex, lock};
use std::fmt;

/// One published state: immutable, shared, with the version it was published at.
pub struct Snapshot<S> {
    version: u64,
    state: S,
}

impl<S> Snapshot<S> {
    /// The version: 0 for the initial state, then 1, 2, 3… in publish order.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The state as it was when this version was published.
    pub fn state(&self) -> &S {
        &self.state
    }
}

impl<S: fmt::Debug> fmt::Debug for Snapshot<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot")
            .field("version", &self.version)
            .field("state", &self.state)
            .finish()
    }
}

/// Identifies a sink registered with [`Publisher::add_sink`], to remove it later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SinkId(u64);

type Sink<S> = Box<dyn Fn(&Arc<Snapshot<S>>) + Send + Sync>;

struct Inner<S> {
    latest: Arc<Snapshot<S>>,
    sinks: Vec<(SinkId, Sink<S>)>,
    next_sink_id: u64,
}

/// The one serialization point for a piece of published state. See the module docs.
pub struct Publisher<S> {
    inner: Mutex<Inner<S>>,
    published: Condvar,
    /// A version counter outside any lock (the R1 shape). Only compiled in to show
    /// that the loom test catches R1.
    #[cfg(flock_mutants)]
    racy_counter: crate::sync::atomic::AtomicU64,
}

impl<S> Publisher<S> {
    /// A publisher whose latest snapshot is `initial` at version 0.
    pub fn new(initial: S) -> Self {
        Self {
            inner: Mutex::new(Inner {
                latest: Arc::new(Snapshot {
                    version: 0,
                    state: initial,
                }),
                sinks: Vec::new(),
                next_sink_id: 0,
            }),
            published: Condvar::new(),
            #[cfg(flock_mutants)]
            racy_counter: crate::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The latest published snapshot.
    pub fn latest(&self) -> Arc<Snapshot<S>> {
        Arc::clone(&lock(&self.inner).latest)
    }

    /// Publishes the state `next` computes from the latest one, as the next version.
    ///
    /// `next` runs under the publish lock: it should only build the new state (cheap,
    /// in memory), never do I/O. If it panics, nothing is published.
    pub fn publish(&self, next: impl FnOnce(&S) -> S) -> Arc<Snapshot<S>> {
        match self.try_publish(|state| Some(next(state))) {
            Some(snapshot) => snapshot,
            // `try_publish` only returns None when the closure does.
            None => self.latest(),
        }
    }

    /// Like [`publish`](Self::publish), but `next` may return `None` to say "nothing
    /// changed": then no version is consumed and nobody is woken.
    pub fn try_publish(&self, next: impl FnOnce(&S) -> Option<S>) -> Option<Arc<Snapshot<S>>> {
        #[cfg(flock_mutants)]
        if crate::reintroduced!("r1") {
            return self.try_publish_r1(next);
        }
        let mut inner = lock(&self.inner);
        // R1: the state read, the version assignment and the hand-off to sinks below
        // all happen while this one guard is held.
        let state = next(&inner.latest.state)?;
        let snapshot = Arc::new(Snapshot {
            version: inner.latest.version + 1,
            state,
        });
        inner.latest = Arc::clone(&snapshot);
        for (_, sink) in &inner.sinks {
            sink(&snapshot);
        }
        drop(inner);
        self.published.notify_all();
        Some(snapshot)
    }

    /// Re-introduces race R1 — version from a counter outside the lock, state read
    /// and cache set in separate critical sections — so `tests/loom_snapshot.rs` can
    /// show that it catches it. Never compiled into a real build.
    #[cfg(flock_mutants)]
    fn try_publish_r1(&self, next: impl FnOnce(&S) -> Option<S>) -> Option<Arc<Snapshot<S>>> {
        use crate::sync::atomic::Ordering;
        let version = self.racy_counter.fetch_add(1, Ordering::SeqCst) + 1;
        // Outside loom (which explores every interleaving anyway), give the scheduler
        // the chance a loaded machine gives it between these unsynchronized steps, so
        // the over-the-wire stress test sees the race in every run, not most of them.
        #[cfg(not(loom))]
        std::thread::yield_now();
        let state = {
            let inner = lock(&self.inner);
            next(&inner.latest.state)?
        };
        #[cfg(not(loom))]
        std::thread::yield_now();
        let snapshot = Arc::new(Snapshot { version, state });
        let mut inner = lock(&self.inner);
        inner.latest = Arc::clone(&snapshot);
        for (_, sink) in &inner.sinks {
            sink(&snapshot);
        }
        drop(inner);
        self.published.notify_all();
        Some(snapshot)
    }

    /// Blocks until a snapshot with a version greater than `seen` is published and
    /// returns the latest one (intermediate versions are skipped: a slow reader
    /// coalesces to the newest state instead of queueing every version).
    pub fn wait_newer(&self, seen: u64) -> Arc<Snapshot<S>> {
        let mut inner = lock(&self.inner);
        while inner.latest.version <= seen {
            inner = self.published.wait(inner);
        }
        Arc::clone(&inner.latest)
    }

    /// Registers `sink`, calls it at once with the latest snapshot, then with every
    /// later one, in version order.
    ///
    /// The first call happens under the same lock as publishing, so a sink can never
    /// miss a version between "read the current state" and "subscribe". Sinks run under
    /// the publish lock: they must be quick and must not call back into this publisher
    /// (that would deadlock).
    pub fn add_sink(&self, sink: impl Fn(&Arc<Snapshot<S>>) + Send + Sync + 'static) -> SinkId {
        let mut inner = lock(&self.inner);
        let id = SinkId(inner.next_sink_id);
        inner.next_sink_id += 1;
        sink(&inner.latest);
        inner.sinks.push((id, Box::new(sink)));
        id
    }

    /// Unregisters a sink; returns whether it was registered.
    pub fn remove_sink(&self, id: SinkId) -> bool {
        let mut inner = lock(&self.inner);
        let before = inner.sinks.len();
        inner.sinks.retain(|(sink_id, _)| *sink_id != id);
        inner.sinks.len() != before
    }
}

impl<S: Default> Default for Publisher<S> {
    fn default() -> Self {
        Self::new(S::default())
    }
}

impl<S> fmt::Debug for Publisher<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = lock(&self.inner);
        f.debug_struct("Publisher")
            .field("version", &inner.latest.version)
            .field("sinks", &inner.sinks.len())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn with(items: &[u32], item: u32) -> Vec<u32> {
        let mut next = items.to_vec();
        next.push(item);
        next
    }

    #[test]
    fn versions_start_at_zero_and_count_publishes() {
        let p = Publisher::new(Vec::<u32>::new());
        assert_eq!(p.latest().version(), 0);
        assert_eq!(p.publish(|s| with(s, 1)).version(), 1);
        assert_eq!(p.publish(|s| with(s, 2)).version(), 2);
        assert_eq!(p.latest().state(), &vec![1, 2]);
    }

    #[test]
    fn a_no_op_consumes_no_version() {
        let p = Publisher::new(0u32);
        assert!(p.try_publish(|_| None).is_none());
        assert_eq!(p.latest().version(), 0);
    }

    #[test]
    fn an_old_snapshot_is_unchanged_by_later_publishes() {
        let p = Publisher::new(vec![1u32]);
        let held = p.latest();
        p.publish(|s| with(s, 2));
        assert_eq!(held.state(), &vec![1]);
        assert_eq!(held.version(), 0);
    }

    #[test]
    fn a_sink_sees_the_current_state_then_every_version_in_order() {
        let p = Publisher::new(Vec::<u32>::new());
        p.publish(|s| with(s, 7));
        let seen = std::sync::Arc::new(crate::sync::Mutex::new(Vec::new()));
        let log = std::sync::Arc::clone(&seen);
        let id = p.add_sink(move |snap| {
            log.lock().push((snap.version(), snap.state().clone()));
        });
        p.publish(|s| with(s, 8));
        assert!(p.remove_sink(id));
        assert!(!p.remove_sink(id));
        p.publish(|s| with(s, 9));
        assert_eq!(
            *seen.lock(),
            vec![(1, vec![7]), (2, vec![7, 8])],
            "the sink saw the state it subscribed at, then version 2, and nothing after removal"
        );
    }

    #[test]
    fn a_panicking_builder_publishes_nothing_and_the_publisher_keeps_working() {
        let p = std::sync::Arc::new(Publisher::new(1u32));
        let p2 = std::sync::Arc::clone(&p);
        let result = std::thread::spawn(move || p2.publish(|_| panic!("builder failed"))).join();
        assert!(result.is_err());
        assert_eq!(p.latest().version(), 0);
        assert_eq!(p.publish(|s| s + 1).version(), 1);
    }

    #[test]
    fn wait_newer_returns_the_latest_once_something_newer_exists() {
        let p = std::sync::Arc::new(Publisher::new(0u32));
        let writer = {
            let p = std::sync::Arc::clone(&p);
            std::thread::spawn(move || {
                for _ in 0..3 {
                    p.publish(|s| s + 1);
                }
            })
        };
        let mut seen = 0;
        while seen < 3 {
            let snap = p.wait_newer(seen);
            assert!(snap.version() > seen);
            assert_eq!(u64::from(*snap.state()), snap.version());
            seen = snap.version();
        }
        writer.join().unwrap();
    }
}
