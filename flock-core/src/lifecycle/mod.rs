//! Pod lifecycle rules: the order of the `AddPod`/`RemovePod` steps, how stored pods
//! are loaded into the live table, the register-then-recheck guard, and the
//! per-pod liveness state machine.
//!
//! Each rule closes one race of docs/races.md by construction;
//! the agent (`flock-bird`) performs the I/O and must follow these rules exactly,
//! and the loom models in `tests/loom_lifecycle.rs` run the real code from here.
//!
//! | rule | module | race it prevents |
//! |---|---|---|
//! | `RemovePod` deletes the store record **first**, then tears down xDS, registry, identity and capture rules | [`steps`] | R4 ghost endpoint, R6 leaked subscription (with the guard) |
//! | `AddPod` writes the store record first, then a captured pod's rules, and registers in the registry last | [`steps`] | crash leaves a repairable record; no connection around Envoy; no remote traffic before local config |
//! | loading stored pods **merges** (adds absent keys only), never replaces | [`merge`] | R3 startup load wipes a concurrent `AddPod` |
//! | register, then **re-check** store membership, undo if the pod is gone | [`guard`] | R4 (liveness re-register) and R6 (resubscribe) |
//! | health changes only after thresholds, not during warm-up, reported once | [`liveness`] | flapping re-registrations that widen the R4 window |
//!
//! Why the pair "store delete first" + "re-check after register" is enough: a
//! background task (liveness, resubscriber) that registers something for pod `p`
//! does so either *before* `RemovePod`'s unregister step, which then removes it, or
//! *after* it; in the latter case its re-check runs after the unregister, which runs
//! after the store delete, so the re-check sees `p` gone and undoes the
//! registration. Either way nothing for `p` survives. With the opposite order
//! (unregister first, store delete last) the re-check can run before the store
//! delete, see `p` still present, and keep a ghost — which is what the loom model
//! shows under `reintroduced!("r4")`.
//!
//! # Example
//!
//! ```
//! # if flock_core::sync::LOOM { return; } // loom's primitives work only inside a model
//! use std::collections::BTreeMap;
//! use flock_core::lifecycle::{guard::{register_if_live, Guarded}, merge::PodTable, steps::{Step, REMOVE_POD}};
//! use flock_core::sync::{lock, Mutex};
//!
//! // The live table at startup: an AddPod already wrote "b"; the store load merges.
//! let table = PodTable::new();
//! table.insert("b", 2);
//! let report = table.load_merge(BTreeMap::from([("a", 1), ("b", 0)]));
//! assert_eq!((report.added, report.kept), (vec!["a"], vec!["b"]));
//! assert_eq!(table.snapshot(), BTreeMap::from([("a", 1), ("b", 2)]));
//!
//! // RemovePod runs its steps in order; the store delete comes first.
//! assert_eq!(REMOVE_POD[0], Step::StoreDelete);
//! let store = Mutex::new(vec!["a"]);
//! let registry = Mutex::new(Vec::<&str>::new());
//! lock(&store).clear(); // RemovePod's first step has run ...
//! // ... so a liveness re-registration racing with it undoes itself.
//! let outcome = register_if_live(
//!     || lock(&store).contains(&"a"),
//!     || lock(&registry).push("a"),
//!     |_| lock(&registry).retain(|p| *p != "a"),
//! );
//! assert_eq!(outcome, Guarded::Skipped);
//! assert!(lock(&registry).is_empty());
//! ```

pub mod guard;
pub mod liveness;
pub mod merge;
pub mod steps;

pub use guard::{Guarded, register_if_live};
pub use liveness::{Health, Liveness, LivenessPolicy, Transition};
pub use merge::{MergeReport, PodTable, merge_loaded};
pub use steps::{ADD_POD, Op, REMOVE_POD, Step};
