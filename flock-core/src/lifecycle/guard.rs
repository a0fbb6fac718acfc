//! Register-then-recheck: the protocol every background registration (liveness
//! re-registering an endpoint with new health, R4; the identity resubscriber, R6)
//! follows so that it cannot outlive a concurrent `RemovePod`.
//!
//! 1. Check that the pod is live (in the store). If not: skip.
//! 2. Register.
//! 3. **Re-check** membership. If the pod is gone now, undo the registration.
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
//! * `unregister` must be idempotent and must remove only what `register` wrote
//!   (for etcd: a delete conditioned on the revision `register` produced), so an
//!   undo cannot remove a registration made by a newer `AddPod` of the same key.
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
//! let registry = RefCell::new(Vec::new());
//! // RemovePod deletes the store record while our registration is in flight.
//! let outcome = register_if_live(
//!     || store.borrow().contains(&"pod"),
//!     || {
//!         registry.borrow_mut().push("pod");
//!         store.borrow_mut().clear(); // the concurrent RemovePod's first step
//!     },
//!     || registry.borrow_mut().retain(|p| *p != "pod"),
//! );
//! assert_eq!(outcome, Guarded::Undone);
//! assert!(registry.borrow().is_empty());
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

/// Registers something for a pod only while the pod is live, undoing it if the
/// pod disappeared during the registration. See the module docs for the protocol
/// and the requirements on the callbacks.
pub fn register_if_live<L, R, U>(is_live: L, register: R, unregister: U) -> Guarded
where
    L: Fn() -> bool,
    R: FnOnce(),
    U: FnOnce(),
{
    if !is_live() {
        return Guarded::Skipped;
    }
    register();
    // `reintroduced!("r6")` re-introduces R6 (a resubscriber without the
    // re-check) so the loom test can show it catches it; never enabled in builds.
    if crate::reintroduced!("r6") || is_live() {
        Guarded::Registered
    } else {
        unregister();
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
        let out = register_if_live(|| false, || registered.set(true), || {});
        assert_eq!(out, Guarded::Skipped);
        assert!(!registered.get());
    }

    #[test]
    fn keeps_the_registration_when_the_pod_is_still_live() {
        let registered = Cell::new(false);
        let out = register_if_live(|| true, || registered.set(true), || registered.set(false));
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
            || registered.set(false),
        );
        assert_eq!(out, Guarded::Undone);
        assert!(!registered.get());
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
            || {},
        );
        assert_eq!(checks.get(), 2);
    }
}
