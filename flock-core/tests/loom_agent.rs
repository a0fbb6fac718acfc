#![cfg(loom)]
//! Loom models of the node agent's own interleavings, run on its sans-IO core
//! (`flock_core::agent::AgentCore`) behind one loom `Mutex`, as the agent runtime
//! (`flock-bird`) keeps it: the CNI ADD and DEL, the liveness loop's re-registration,
//! the start-up resubscription, the orphan GC and the per-pod turns.
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
//!   cargo test -p flock-core --release --test loom_agent --target-dir target/loom
//! ```
//!
//! Each thread below follows the agent's protocol step by step: a call into the core
//! under its lock, then I/O against the model world without it (the registry, a map of
//! key to revision with a global revision counter as etcd's; the identity provider's
//! subscriptions; the pod store), then the next call. The world's systems are separate
//! locks, as in the agent: no lock spans two of them. Every model states the mutation
//! it catches (`FLOCK_REINTRODUCE=<name>` in a `--cfg loom --cfg flock_mutants` build).

use std::collections::{BTreeMap, BTreeSet};

use flock_core::agent::{
    Acquire, AgentCore, GcSweep, Guard, OpKind, SeenEndpoint, Unsubscriber, Writer,
};
use flock_core::gc::GcPolicy;
use flock_core::lifecycle::liveness::LivenessPolicy;
use flock_core::pod::PodKey;
use flock_core::sync::{Arc, Condvar, Mutex, lock};
use flock_core::time::MonoMs;
use loom::thread;

/// Runs `f` under loom with a preemption bound of 3 unless `LOOM_MAX_PREEMPTIONS`
/// says otherwise.
fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// How a waiting operation is woken when the turn passes to it.
struct Signal {
    given: Mutex<bool>,
    cv: Condvar,
}

impl Default for Signal {
    fn default() -> Self {
        Self {
            given: Mutex::new(false),
            cv: Condvar::new(),
        }
    }
}

impl Signal {
    fn give(&self) {
        *lock(&self.given) = true;
        self.cv.notify_one();
    }

    fn wait(&self) {
        let mut given = lock(&self.given);
        while !*given {
            given = self.cv.wait(given);
        }
    }
}

/// The records are distinct numbers: which ADD wrote a pod is visible.
type Core = AgentCore<u32, Arc<Signal>>;

/// The world the agent does I/O on.
#[derive(Clone)]
struct World {
    core: Arc<Mutex<Core>>,
    /// Registry key → revision of its last write.
    registry: Arc<Mutex<(u64, BTreeMap<String, u64>)>>,
    /// Pods with an identity subscription.
    identity: Arc<Mutex<BTreeSet<PodKey>>>,
    /// The pod store: pod → record.
    store: Arc<Mutex<BTreeMap<PodKey, u32>>>,
}

fn pod() -> PodKey {
    PodKey::new("sandbox", "eth0")
}

/// The pod's one registry key (one app port).
fn key() -> String {
    "node-a/ns/svc/sandbox/eth0/8080".to_string()
}

impl World {
    fn new() -> Self {
        Self {
            core: Arc::new(Mutex::new(Core::new(LivenessPolicy::default()))),
            registry: Arc::new(Mutex::new((0, BTreeMap::new()))),
            identity: Arc::new(Mutex::new(BTreeSet::new())),
            store: Arc::new(Mutex::new(BTreeMap::new())),
        }
    }

    /// A pod the agent holds, registered and subscribed (set up before the threads).
    fn with_live_pod(self, record: u32) -> Self {
        lock(&self.store).insert(pod(), record);
        lock(&self.core).stored(pod(), record, MonoMs(0));
        let rev = self.put(&key());
        lock(&self.core).wrote(&key(), rev);
        lock(&self.identity).insert(pod());
        self
    }

    /// What a pod the agent lost track of leaves behind (a crash between two steps):
    /// its endpoint and its subscription, with no record.
    fn with_leftovers(self) -> Self {
        self.put(&key());
        lock(&self.identity).insert(pod());
        self
    }

    // ---- the registry, as etcd: a global revision per write

    fn put(&self, key: &str) -> u64 {
        let mut reg = lock(&self.registry);
        reg.0 += 1;
        let rev = reg.0;
        reg.1.insert(key.to_string(), rev);
        rev
    }

    fn delete_if_revision(&self, key: &str, rev: u64) {
        let mut reg = lock(&self.registry);
        if reg.1.get(key) == Some(&rev) {
            reg.1.remove(key);
        }
    }

    fn delete(&self, key: &str) {
        lock(&self.registry).1.remove(key);
    }

    fn registered(&self) -> bool {
        lock(&self.registry).1.contains_key(&key())
    }

    fn subscribed(&self) -> bool {
        lock(&self.identity).contains(&pod())
    }

    fn live(&self) -> Option<u32> {
        lock(&self.core).pod(&pod()).copied()
    }

    // ---- the agent's operations, in its protocol

    /// Runs `op` in the pod's turn (`flock-bird`'s `in_turn`).
    fn in_turn<T>(&self, kind: OpKind, op: impl FnOnce() -> T) -> T {
        let signal = Arc::new(Signal::default());
        let acquired = lock(&self.core).acquire(&pod(), kind, signal.clone());
        if let Acquire::Queued(_) = acquired {
            signal.wait();
        }
        let out = op();
        let next = lock(&self.core).release(&pod(), kind);
        if let Some(next) = next {
            next.give();
        }
        out
    }

    /// CNI ADD of record `record`: store write, table, subscription, registration.
    fn add(&self, record: u32) {
        self.in_turn(OpKind::Add, || {
            lock(&self.store).insert(pod(), record);
            lock(&self.core).stored(pod(), record, MonoMs(1));
            lock(&self.identity).insert(pod());
            let rev = self.put(&key());
            lock(&self.core).wrote(&key(), rev);
        });
    }

    /// CNI DEL: the store first (R4), out of the table, then its keys and its
    /// subscription.
    fn remove(&self) {
        self.in_turn(OpKind::Remove, || {
            lock(&self.store).remove(&pod());
            lock(&self.core).removed(&pod());
            let in_view: Vec<String> = lock(&self.registry)
                .1
                .keys()
                .filter(|k| flock_core::agent::key_owner(k) == Some(pod()))
                .cloned()
                .collect();
            let withdrawal = lock(&self.core).withdrawal(&pod(), in_view);
            for k in &withdrawal.keys {
                self.delete(k);
                lock(&self.core).forget(k);
            }
            lock(&self.identity).remove(&pod());
        });
    }

    /// The liveness loop's re-registration after a health change: outside the pod's
    /// turn, guarded by the core's re-check.
    fn reregister(&self) {
        if !lock(&self.core).is_live(&pod()) {
            return;
        }
        let rev = self.put(&key());
        let guard = lock(&self.core).registered(&pod(), &key(), rev, Writer::Liveness);
        if let Guard::Undo(undo) = guard {
            match undo.revision {
                Some(rev) => self.delete_if_revision(&key(), rev),
                None => self.delete(&key()),
            }
        }
    }

    /// The start-up resubscription of a loaded pod: outside its turn, guarded.
    fn resubscribe(&self) {
        if !lock(&self.core).is_live(&pod()) {
            return;
        }
        lock(&self.identity).insert(pod());
        let guard = lock(&self.core).subscribed(&pod());
        if let Guard::Undo(_) = guard {
            self.in_turn(OpKind::Undo, || {
                if lock(&self.core).may_unsubscribe(&pod(), Unsubscriber::Resubscription) {
                    lock(&self.identity).remove(&pod());
                }
            });
        }
    }

    /// One orphan-GC sweep that removes what it finds at once (one confirming sweep,
    /// no breaker): the registry and the identity provider read first, the plan in
    /// the core, then the conditional deletes and the unsubscribes in the pod's turn.
    fn gc(&self) {
        let endpoints: Vec<SeenEndpoint> = lock(&self.registry)
            .1
            .iter()
            .map(|(k, rev)| SeenEndpoint {
                key: k.clone(),
                pod: flock_core::agent::key_owner(k).expect("a pod's key"),
                revision: *rev,
            })
            .collect();
        let subscriptions: Vec<PodKey> = lock(&self.identity).iter().cloned().collect();
        let policy = GcPolicy {
            confirm_sweeps: 1,
            max_remove_percent: 100,
            always_allowed: 10,
        };
        let sweep = GcSweep {
            valid_attachments: None,
            endpoints,
            subscriptions,
        };
        let actions = lock(&self.core).gc_plan(sweep, &policy);
        for ep in &actions.endpoints {
            match ep.revision {
                Some(rev) => self.delete_if_revision(&ep.key, rev),
                None => self.delete(&ep.key),
            }
        }
        for p in &actions.unsubscribe {
            self.in_turn(OpKind::Gc, || {
                if lock(&self.core).may_unsubscribe(p, Unsubscriber::Gc) {
                    lock(&self.identity).remove(p);
                }
            });
        }
    }
}

/// R4 in the agent: the liveness re-registration (outside the pod's turn) racing a
/// DEL. In every interleaving the removed pod leaves no endpoint behind.
///
/// Fails with `r4-agent` (no re-check after the put): the re-registration checks the
/// pod live, the DEL removes it and withdraws its key, then the put lands: a ghost.
#[test]
fn a_reregistration_racing_a_del_leaves_no_ghost() {
    model(|| {
        let w = World::new().with_live_pod(1);
        let liveness = {
            let w = w.clone();
            thread::spawn(move || w.reregister())
        };
        w.remove();
        liveness.join().unwrap();
        assert_eq!(w.live(), None);
        assert!(
            !w.registered(),
            "ghost endpoint: the removed pod is still registered"
        );
    });
}

/// R4's undo against a pod that came back: the re-registration racing a DEL and a
/// new ADD of the same pod. In every interleaving the re-added pod ends registered:
/// an undo deletes only the revision its own put wrote.
///
/// Fails with `undo-unconditional`: the re-registration's put lands, its re-check
/// falls between the DEL and the new ADD (pod gone), the new ADD registers, and the
/// undo deletes the new ADD's registration.
#[test]
fn an_undo_never_deletes_the_registration_of_a_pod_added_again() {
    model(|| {
        let w = World::new().with_live_pod(1);
        // The DEL and the new ADD on the spawned thread, the re-registration on this
        // one: the losing schedule then takes three preemptions (the bound CI runs).
        let runtime = {
            let w = w.clone();
            thread::spawn(move || {
                w.remove();
                w.add(2);
            })
        };
        w.reregister();
        runtime.join().unwrap();
        assert_eq!(w.live(), Some(2));
        assert!(
            w.registered(),
            "lost endpoint: the re-added pod is live but not registered"
        );
    });
}

/// R6 in the agent: the start-up resubscription (outside the pod's turn) racing a
/// DEL. In every interleaving the removed pod keeps no subscription.
///
/// Fails with `r6-agent` (no re-check after subscribing).
#[test]
fn a_resubscription_racing_a_del_leaks_no_subscription() {
    model(|| {
        let w = World::new().with_live_pod(1);
        let resubscriber = {
            let w = w.clone();
            thread::spawn(move || w.resubscribe())
        };
        w.remove();
        resubscriber.join().unwrap();
        assert_eq!(w.live(), None);
        assert!(
            !w.subscribed(),
            "leaked subscription: the removed pod is still subscribed"
        );
    });
}

/// The orphan GC racing an ADD of the pod whose leftovers it planned to remove. In
/// every interleaving the added pod ends registered and subscribed.
///
/// Fails with `gc-unconditional` (the GC deletes the endpoint whatever its revision:
/// the ADD's new registration goes) and with `gc-unsubscribe-unconditional` (the GC
/// unsubscribes without checking, in its turn after the ADD's: the live pod loses its
/// certificate).
#[test]
fn the_gc_racing_an_add_removes_nothing_the_added_pod_owns() {
    model(|| {
        let w = World::new().with_leftovers();
        let gc = {
            let w = w.clone();
            thread::spawn(move || w.gc())
        };
        w.add(7);
        gc.join().unwrap();
        assert_eq!(w.live(), Some(7));
        assert!(
            w.registered(),
            "the GC deleted the registration of a pod added after its plan"
        );
        assert!(
            w.subscribed(),
            "the GC withdrew the subscription of a pod added after its plan"
        );
    });
}

/// R3 in the agent: the start-up load (the store read, then the core's merge) racing
/// an ADD of the same pod with a newer record. In every interleaving the table ends
/// with the ADD's record, never the stored one.
///
/// Fails with `r3` (the load replaces the table): the load reads the store, the ADD
/// writes store and table, the load's replace puts the old record back.
#[test]
fn the_startup_load_never_replaces_a_concurrent_adds_record() {
    model(|| {
        let w = World::new();
        lock(&w.store).insert(pod(), 1);
        let load = {
            let w = w.clone();
            thread::spawn(move || {
                let stored: Vec<(PodKey, u32)> = lock(&w.store)
                    .iter()
                    .map(|(k, v)| (k.clone(), *v))
                    .collect();
                lock(&w.core).load(stored, MonoMs(0));
            })
        };
        w.add(2);
        load.join().unwrap();
        assert_eq!(
            w.live(),
            Some(2),
            "the startup load replaced the record a concurrent ADD wrote"
        );
    });
}

/// The per-pod turns: a DEL and an ADD of the same pod, and a third operation that
/// gives up waiting, never overlap, every operation that waits gets its turn, and
/// nothing is left held at the end.
#[test]
fn turns_admit_one_operation_per_pod_and_lose_no_waiter() {
    model(|| {
        let w = World::new();
        let inside = Arc::new(Mutex::new(0u32));
        let enter = |w: &World, inside: &Arc<Mutex<u32>>, kind| {
            w.in_turn(kind, || {
                {
                    let mut n = lock(inside);
                    *n += 1;
                    assert_eq!(*n, 1, "two operations on one pod at once");
                }
                loom::thread::yield_now();
                *lock(inside) -= 1;
            });
        };
        let other = {
            let (w, inside) = (w.clone(), inside.clone());
            thread::spawn(move || enter(&w, &inside, OpKind::Remove))
        };
        // An operation whose future is dropped while it waits: it leaves the queue,
        // or, if the turn was passed to it already, gives it back.
        let giving_up = {
            let w = w.clone();
            thread::spawn(move || {
                let signal = Arc::new(Signal::default());
                let acquired = lock(&w.core).acquire(&pod(), OpKind::Gc, signal);
                let holds = match acquired {
                    Acquire::Now => true,
                    Acquire::Queued(ticket) => !lock(&w.core).cancel(&pod(), ticket),
                };
                if holds {
                    let next = lock(&w.core).release(&pod(), OpKind::Gc);
                    if let Some(next) = next {
                        next.give();
                    }
                }
            })
        };
        enter(&w, &inside, OpKind::Add);
        other.join().unwrap();
        giving_up.join().unwrap();
        assert!(
            lock(&w.core).busy().is_empty(),
            "a turn is still held after every operation ended"
        );
    });
}
