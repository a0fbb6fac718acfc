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
//! with `FLOCK_REINTRODUCE=r3|r4|r6|undo-unconditional` in a
//! `--cfg loom --cfg flock_mutants` build (see `flock_core::reintroduce`; never in
//! real builds).
//!
//! The registry and the identity subscriptions are revisioned, as etcd is: every
//! write of a pod's entry produces a new revision, and an undo deletes only the
//! revision its own write produced. So a stale undo racing a newer registration of
//! the same pod (the pod came back) is told apart from a correct one.

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

/// A revisioned registry (or subscription table): pod id → the revision of the write
/// that put its entry there.
#[derive(Debug, Clone, Default)]
struct Entries {
    at: BTreeMap<u32, u64>,
    revision: u64,
}

type Revisioned = Arc<Mutex<Entries>>;

fn revisioned(items: &[u32]) -> Revisioned {
    let mut e = Entries::default();
    for pod in items {
        e.revision += 1;
        e.at.insert(*pod, e.revision);
    }
    Arc::new(Mutex::new(e))
}

/// Writes `pod`'s entry; returns the revision the write produced.
fn put(target: &Revisioned, pod: u32) -> u64 {
    let mut e = lock(target);
    e.revision += 1;
    let rev = e.revision;
    e.at.insert(pod, rev);
    rev
}

/// Deletes `pod`'s entry: only while it is still at revision `at` (`Some`), or
/// whatever is there (`None`).
fn delete(target: &Revisioned, pod: u32, at: Option<u64>) {
    let mut e = lock(target);
    if at.is_none() || e.at.get(&pod).copied() == at {
        e.at.remove(&pod);
    }
}

fn pods(target: &Revisioned) -> BTreeSet<u32> {
    lock(target).at.keys().copied().collect()
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
    registry: Revisioned,
    subscriptions: Revisioned,
}

impl World {
    fn new(store: &[u32], registry: &[u32], subscriptions: &[u32]) -> Self {
        Self {
            store: set(store),
            registry: revisioned(registry),
            subscriptions: revisioned(subscriptions),
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
                Step::RegistryUnregister => delete(&self.registry, pod, None),
                Step::IdentityUnsubscribe => delete(&self.subscriptions, pod, None),
                Step::XdsWithdraw => {} // not modelled: no background task writes xDS
                Step::CaptureRemove => {} // not modelled: no background task writes rules
                other => panic!("REMOVE_POD contains a non-removal step {other}"),
            }
        }
    }

    /// Executes `AddPod` for `pod` by iterating `lifecycle::steps::ADD_POD` (the pod
    /// came back: a newer registration and subscription of the same pod).
    fn add_pod(&self, pod: u32) {
        for step in Op::AddPod.steps() {
            match step {
                Step::StoreWrite => {
                    lock(&self.store).insert(pod);
                }
                Step::IdentitySubscribe => {
                    put(&self.subscriptions, pod);
                }
                Step::RegistryRegister => {
                    put(&self.registry, pod);
                }
                Step::XdsPublish | Step::CaptureApply => {} // not modelled (as above)
                other => panic!("ADD_POD contains a non-add step {other}"),
            }
        }
    }

    /// A background loop (liveness or resubscriber): `GetAll` the store, then for
    /// each pod register into `target` through `register_if_live`, whose undo
    /// deletes only at the revision the write produced.
    fn background_register(&self, target: &Revisioned) -> Vec<(u32, Guarded)> {
        let pods: Vec<u32> = lock(&self.store).iter().copied().collect();
        pods.into_iter()
            .map(|pod| {
                let outcome = register_if_live(
                    || lock(&self.store).contains(&pod),
                    || put(target, pod),
                    |at| delete(target, pod, at),
                );
                (pod, outcome)
            })
            .collect()
    }
}

/// R3: thread A is the startup load (reads a snapshot of storage, then
/// `PodTable::load_merge`); thread B is an `AddPod` of pod 2, which storage already
/// holds with an older record, executing `ADD_POD` (the store write of the new
/// record, then the xDS publish that inserts it into the live table). In every
/// interleaving the table ends with pod 2's new record, and pod 1's stored one. The
/// stored and the added records of pod 2 differ, so a load that wipes the table and
/// puts the stored records back is told apart from a merge.
///
/// Fails with `reintroduced!("r3")` (`load_merge` replaces the table
/// wholesale): A reads storage, B writes storage and table, A's
/// replace puts the older stored record of pod 2 back over B's.
#[test]
fn r3_startup_load_never_wipes_a_concurrent_add() {
    model(|| {
        let storage = Arc::new(Mutex::new(BTreeMap::from([
            (1u32, "stored-1"),
            (2, "stored-2 (older)"),
        ])));
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
                            lock(&storage).insert(2, "added-2");
                        }
                        Step::XdsPublish => {
                            table.insert(2, "added-2");
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
            Some("added-2"),
            "R3: the startup load lost the concurrent AddPod's record"
        );
        assert_eq!(
            table.get(&1),
            Some("stored-1"),
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
            !pods(&world.registry).contains(&1),
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

        let subscriptions = pods(&world.subscriptions);
        assert!(
            !subscriptions.contains(&1),
            "R6: the subscription of the removed pod leaked after {outcomes:?}"
        );
        assert_eq!(
            subscriptions,
            BTreeSet::from([2]),
            "pod 2's own subscription was lost (the guard over-removed) after {outcomes:?}"
        );
        assert!(outcomes.contains(&(2, Guarded::Registered)));
    });
}

/// R4's undo against a pod that came back: thread A runs `RemovePod` for pod 1, then
/// `AddPod` for it again (a newer registration, a newer revision); thread B is the
/// liveness loop re-registering pod 1 through `register_if_live`. When B's re-check
/// sees the pod gone, A's re-add may already have registered it again; B's undo
/// deletes only the revision B wrote. At the end pod 1 is stored and registered.
///
/// Fails with `reintroduced!("undo-unconditional")` (the undo deletes whatever is
/// there): B registers after A's unregister, re-checks before A's re-add stores the
/// pod, A re-adds, and B's undo deletes the newer registration.
#[test]
fn r4_an_undo_never_deletes_the_registration_of_a_pod_that_came_back() {
    model(|| {
        let world = World::new(&[1], &[1], &[]);
        let remove_and_add = {
            let world = world.clone();
            thread::spawn(move || {
                world.remove_pod(1);
                world.add_pod(1);
            })
        };
        let liveness = {
            let world = world.clone();
            thread::spawn(move || {
                let registry = world.registry.clone();
                world.background_register(&registry)
            })
        };
        remove_and_add.join().expect("remove-and-add thread");
        let outcomes = liveness.join().expect("liveness thread");

        assert!(lock(&world.store).contains(&1));
        assert!(
            pods(&world.registry).contains(&1),
            "R4 undo: a stale undo deleted the newer registration of the pod that came back \
             (registry {:?}, liveness {outcomes:?})",
            lock(&world.registry).at
        );
    });
}

/// R6's undo against a pod that came back: as the R4 model above, with the identity
/// resubscriber and the subscriptions. At the end pod 1 is stored and subscribed.
///
/// Fails with `reintroduced!("undo-unconditional")`: the resubscriber's stale undo
/// withdraws the subscription the re-add made.
#[test]
fn r6_an_undo_never_withdraws_the_subscription_of_a_pod_that_came_back() {
    model(|| {
        let world = World::new(&[1], &[], &[1]);
        let remove_and_add = {
            let world = world.clone();
            thread::spawn(move || {
                world.remove_pod(1);
                world.add_pod(1);
            })
        };
        let resubscriber = {
            let world = world.clone();
            thread::spawn(move || {
                let subscriptions = world.subscriptions.clone();
                world.background_register(&subscriptions)
            })
        };
        remove_and_add.join().expect("remove-and-add thread");
        let outcomes = resubscriber.join().expect("resubscriber thread");

        assert!(lock(&world.store).contains(&1));
        assert!(
            pods(&world.subscriptions).contains(&1),
            "R6 undo: a stale undo withdrew the newer subscription of the pod that came back \
             (subscriptions {:?}, resubscriber {outcomes:?})",
            lock(&world.subscriptions).at
        );
    });
}
