#![cfg(loom)]
//! Loom models of the pod-lifecycle races R3, R4 and R6 (docs/races.md),
//! run against the real `flock_core::lifecycle` code (its step constants, its
//! `PodTable`, its `register_if_live`) with loom's `Mutex` from `flock_core::sync`.
//!
//! ```text
//! RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
//!   cargo test -p flock-core --release --test loom_lifecycle --target-dir target/loom
//! ```
//!
//! Each model states the mutation that makes it fail; the mutations are switched on
//! with `FLOCK_REINTRODUCE=r3|r4|r6` in a `--cfg loom --cfg flock_mutants` build (see
//! `flock_core::reintroduce`; never in real builds).

use std::collections::{BTreeMap, BTreeSet};

use flock_core::lifecycle::guard::{Guarded, register_if_live};
use flock_core::lifecycle::merge::PodTable;
use flock_core::lifecycle::steps::{ADD_POD, Op, Step};
use flock_core::sync::{Arc, Mutex, lock};
use loom::thread;

type Set = Arc<Mutex<BTreeSet<u32>>>;

fn set(items: &[u32]) -> Set {
    Arc::new(Mutex::new(items.iter().copied().collect()))
}

/// Runs `f` under loom with a preemption bound of 3 unless `LOOM_MAX_PREEMPTIONS`
/// says otherwise.
fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// The model world `RemovePod` acts on: the pod store, the registry and the identity
/// subscriptions, each a set of pod ids behind its own lock (as in the agent: three
/// separate systems, no lock spans them).
#[derive(Clone)]
struct World {
    store: Set,
    registry: Set,
    subscriptions: Set,
}

impl World {
    fn new(store: &[u32], registry: &[u32], subscriptions: &[u32]) -> Self {
        Self {
            store: set(store),
            registry: set(registry),
            subscriptions: set(subscriptions),
        }
    }

    /// Executes `RemovePod` for `pod` by iterating `lifecycle::steps::REMOVE_POD`:
    /// the order is the library's, not this test's.
    fn remove_pod(&self, pod: u32) {
        for step in Op::RemovePod.steps() {
            match step {
                Step::StoreDelete => {
                    lock(&self.store).remove(&pod);
                }
                Step::RegistryUnregister => {
                    lock(&self.registry).remove(&pod);
                }
                Step::IdentityUnsubscribe => {
                    lock(&self.subscriptions).remove(&pod);
                }
                Step::XdsWithdraw => {} // not modelled: no background task writes xDS
                Step::CaptureRemove => {} // not modelled: no background task writes rules
                other => panic!("REMOVE_POD contains a non-removal step {other}"),
            }
        }
    }

    /// A background loop (liveness or resubscriber): `GetAll` the store, then for
    /// each pod register into `target` through `register_if_live`.
    fn background_register(&self, target: &Set) -> Vec<(u32, Guarded)> {
        let pods: Vec<u32> = lock(&self.store).iter().copied().collect();
        pods.into_iter()
            .map(|pod| {
                let outcome = register_if_live(
                    || lock(&self.store).contains(&pod),
                    || {
                        lock(target).insert(pod);
                    },
                    || {
                        lock(target).remove(&pod);
                    },
                );
                (pod, outcome)
            })
            .collect()
    }
}

/// R3: thread A is the startup load (reads a snapshot of storage, then
/// `PodTable::load_merge`); thread B is an `AddPod` executing `ADD_POD` (the store
/// write, then the xDS publish that inserts into the live table). In every
/// interleaving the added pod, and the stored one, are in the table at the end,
/// with the added pod's fresh value.
///
/// Fails with `reintroduced!("r3")` (`load_merge` replaces the table
/// wholesale): A reads storage, B writes storage and table, A's
/// replace wipes B's pod.
#[test]
fn r3_startup_load_never_wipes_a_concurrent_add() {
    model(|| {
        let storage = Arc::new(Mutex::new(BTreeMap::from([(1u32, "stored")])));
        let table = Arc::new(PodTable::new());

        let load = {
            let (storage, table) = (storage.clone(), table.clone());
            thread::spawn(move || {
                let loaded = lock(&storage).clone(); // GetAll
                table.load_merge(loaded);
            })
        };
        let add = {
            let (storage, table) = (storage.clone(), table.clone());
            thread::spawn(move || {
                for step in ADD_POD {
                    match step {
                        Step::StoreWrite => {
                            lock(&storage).insert(2, "added");
                        }
                        Step::XdsPublish => {
                            table.insert(2, "added");
                        }
                        _ => {} // identity and registry: not part of this race
                    }
                }
            })
        };
        load.join().expect("load thread");
        add.join().expect("add thread");

        assert_eq!(
            table.get(&2),
            Some("added"),
            "R3: the concurrent AddPod was lost"
        );
        assert_eq!(
            table.get(&1),
            Some("stored"),
            "the stored pod was not loaded"
        );
    });
}

/// R4: thread A runs `RemovePod` (steps from `REMOVE_POD`) for pod 1 while thread B
/// runs the liveness loop, re-registering pod 1's endpoint (new health) through
/// `register_if_live`. At the end the registry never holds pod 1: no ghost
/// endpoint.
///
/// Fails with `reintroduced!("r4")` (the racy `RemovePod` order:
/// unregister first, store delete last: B's re-check runs before the store delete
/// and keeps the ghost), and with `reintroduced!("r6")` or the re-check
/// removed from `register_if_live` by hand (B checks, A deletes and unregisters,
/// B registers and nobody undoes it).
#[test]
fn r4_liveness_reregistration_never_leaves_a_ghost_endpoint() {
    model(|| {
        let world = World::new(&[1], &[1], &[1]);
        let remove = {
            let world = world.clone();
            thread::spawn(move || world.remove_pod(1))
        };
        let liveness = {
            let world = world.clone();
            thread::spawn(move || {
                let registry = world.registry.clone();
                world.background_register(&registry)
            })
        };
        remove.join().expect("remove thread");
        let outcomes = liveness.join().expect("liveness thread");

        assert!(lock(&world.store).is_empty());
        assert!(
            !lock(&world.registry).contains(&1),
            "R4: ghost endpoint after {outcomes:?}"
        );
    });
}

/// R6: thread A runs `RemovePod` for pod 1 while thread B, the identity
/// resubscriber, resubscribes every stored pod through `register_if_live`. Pod 2
/// stays. At the end pod 1 has no subscription (none leaked) and pod 2 still has
/// its own (the guard does not over-remove).
///
/// Fails with `reintroduced!("r4")` (store delete last: the resubscriber's
/// re-check still sees pod 1) and with `reintroduced!("r6")` or the
/// re-check removed from `register_if_live` by hand (a resubscriber without the re-check).
#[test]
fn r6_resubscribe_never_leaks_a_removed_pods_subscription() {
    model(|| {
        let world = World::new(&[1, 2], &[], &[1, 2]);
        let remove = {
            let world = world.clone();
            thread::spawn(move || world.remove_pod(1))
        };
        let resubscriber = {
            let world = world.clone();
            thread::spawn(move || {
                let subscriptions = world.subscriptions.clone();
                world.background_register(&subscriptions)
            })
        };
        remove.join().expect("remove thread");
        let outcomes = resubscriber.join().expect("resubscriber thread");

        let subscriptions = lock(&world.subscriptions).clone();
        assert_eq!(
            subscriptions,
            BTreeSet::from([2]),
            "R6: leaked or lost subscription after {outcomes:?}"
        );
        assert!(outcomes.contains(&(2, Guarded::Registered)));
    });
}
