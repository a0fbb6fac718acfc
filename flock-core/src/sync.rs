//! The synchronization primitives every concurrent type in flock-core uses.
//!
//! Under `RUSTFLAGS="--cfg loom"` these are loom's model-checked versions, so a loom
//! test explores every interleaving of the real production code rather than of a copy
//! (tokio's pattern). Code in this crate must import `Arc`, `Mutex` and `Condvar`
//! from here, never from `std::sync` directly.

#[cfg(loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};

#[cfg(not(loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard, atomic};

/// Locks `mutex`, recovering the data if a panicking thread poisoned it.
///
/// Every critical section in flock-core leaves its data consistent before anything
/// that can panic runs (callers' closures run on values, not on the guarded state),
/// so a poisoned lock still guards valid data and refusing it would only turn one
/// failure into many.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}
