//! Register-then-recheck: the protocol every background registration (liveness
//! re-registering an endpoint with new health, R4; the identity resubscriber, R6)
//! follows so that it cannot outlive a concurrent `RemovePod`.
//!
//! 1. Check that the pod is live (in the store). If not: skip.
//! 2. Register; the write says what it produced (its registry revision).
//! 3. **Re-check** membership. If the pod is gone now, undo the registration, and
//!    only that one: the undo is conditional on the revision step 2 produced.
//!
//! Combined with `RemovePod` deleting the store record *before* it unregisters
//! ([`super::steps::REMOVE_POD`]), no interleaving leaves a registration behind: a
//! registration that lands before `RemovePod`'s unregister is removed by it; one
//! that lands after it is followed by a re-check that runs after the store delete,
//! sees the pod gone, and undoes. The loom models in `tests/loom_lifecycle.rs`
//! check every interleaving of this code against `RemovePod`'s steps.
//!
//! Requirements on the callbacks:
//! * `is_live` must read the same linearizable store that `RemovePod`'s
//!   `StoreDelete` writes (the agent's pod store under its lock), never a snapshot
//!   taken earlier; the first check may use the snapshot the loop iterates, the
//!   re-check may not.
//! * `register` returns what its write produced (for etcd: the revision of the put;
//!   `()` for a write without one), and `unregister` receives it: `Some(w)` removes
//!   the entry only while it is still `w` (for etcd: a delete conditioned on that
//!   revision), so the undo cannot remove a registration that a newer `AddPod` of the
//!   same pod wrote after the pod came back. `None` removes whatever is there; only
//!   the `undo-unconditional` mutant passes it. `unregister` must be idempotent.
//!
//! The async agent cannot pass `async` closures here; it mirrors the three steps
//! exactly (`if !store.contains(p) { skip }; registry.register(p).await?; if
//! !store.contains(p) { registry.unregister(p).await }`) and its integration test
//! asserts the same [`Guarded`] outcomes.
//!
//! # Example
//!
//! ```
//! use std::cell::RefCell;
//! use flock_core::lifecycle::guard::{register_if_live, Guarded};
//!
//! let store = RefCell::new(vec!["pod"]);
//! // The registry: the pod's entry and the revision that wrote it.
//! let registry = RefCell::new(None::<(&str, u64)>);
//! // RemovePod deletes the store record while our registration is in flight.
//! let outcome = register_if_live(
//!     || store.borrow().contains(&"pod"),
//!     || {
//!         *registry.borrow_mut() = Some(("pod", 7));
//!         store.borrow_mut().clear(); // the concurrent RemovePod's first step
//!         7 // the revision of our write
//!     },
//!     // Delete only the entry our write left (an etcd delete at that revision).
//!     |at: Option<u64>| {
//!         let mut entry = registry.borrow_mut();
//!         if at.is_none() || entry.map(|(_, rev)| rev) == at {
//!             *entry = None;
//!         }
//!     },
//! );
//! assert_eq!(outcome, Guarded::Undone);
//! assert!(registry.borrow().is_none());
//! ```

use serde::{Deserialize, Serialize};

/// The outcome of [`register_if_live`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Guarded {
    /// The pod was not live at the first check; nothing was registered.
    Skipped,
    /// Registered, and the pod was still live at the re-check.
    Registered,
    /// Registered, but the pod was gone at the re-check, so the registration was
    /// undone.
    Undone,
}

/// Registers something for a pod only while the pod is live, undoing it (only what
/// this registration wrote) if the pod disappeared during the registration. See the
/// module docs for the protocol and the requirements on the callbacks.
pub fn register_if_live<L, R, U, W>(is_live: L, register: R, unregister: U) -> Guarded
where
    L: Fn() -> bool,
    R: FnOnce() -> W,
    U: FnOnce(Option<W>),
{
    if !is_live() {
        return Guarded::Skipped;
    }
    let written = register();
    // `reintroduced!("r6")` re-introduces R6 (a resubscriber without the
    // re-check) so the loom test can show it catches it; never enabled in builds.
    if crate::reintroduced!("r6") || is_live() {
        Guarded::Registered
    } else {
        // The pod may have come back meanwhile and its new AddPod registered again:
        // the undo is conditional on our write. `undo-unconditional` deletes whatever
        // is there, the newer registration included.
        unregister((!crate::reintroduced!("undo-unconditional")).then_some(written));
        Guarded::Undone
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn skips_registration_when_the_pod_is_not_live() {
        let registered = Cell::new(false);
        let out = register_if_live(|| false, || registered.set(true), |_| {});
        assert_eq!(out, Guarded::Skipped);
        assert!(!registered.get());
    }

    #[test]
    fn keeps_the_registration_when_the_pod_is_still_live() {
        let registered = Cell::new(false);
        let out = register_if_live(|| true, || registered.set(true), |_| registered.set(false));
        assert_eq!(out, Guarded::Registered);
        assert!(registered.get());
    }

    #[test]
    fn undoes_the_registration_when_the_pod_vanished_meanwhile() {
        let live = Cell::new(true);
        let registered = Cell::new(false);
        let out = register_if_live(
            || live.get(),
            || {
                registered.set(true);
                live.set(false);
            },
            |_| registered.set(false),
        );
        assert_eq!(out, Guarded::Undone);
        assert!(!registered.get());
    }

    #[test]
    fn the_undo_is_conditional_on_what_the_registration_wrote() {
        let live = Cell::new(true);
        let undone_at = Cell::new(None);
        let out = register_if_live(
            || live.get(),
            || {
                live.set(false);
                41_u64
            },
            |at| undone_at.set(Some(at)),
        );
        assert_eq!(out, Guarded::Undone);
        assert_eq!(undone_at.get(), Some(Some(41)));
    }

    #[test]
    fn checks_membership_exactly_twice_when_registering() {
        let checks = Cell::new(0);
        register_if_live(
            || {
                checks.set(checks.get() + 1);
                true
            },
            || {},
            |_| {},
        );
        assert_eq!(checks.get(), 2);
    }
}
