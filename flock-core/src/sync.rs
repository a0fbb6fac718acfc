//! The synchronization primitives every concurrent type in flock-core uses.
//!
//! Under `RUSTFLAGS="--cfg loom"` these wrap loom's model-checked versions, so a loom
//! test explores every interleaving of the real production code rather than of a copy
//! (tokio's pattern). Code in this crate must use `Arc`, `Mutex` and `Condvar` from
//! here, never from `std::sync` directly; `clippy.toml` makes that a lint error.
//!
//! [`Mutex::lock`] never fails: every critical section in flock-core leaves its data
//! consistent before anything that can panic runs (callers' closures run on values,
//! not on the guarded state), so a lock poisoned by a panicking thread still guards
//! valid data, and refusing it would only turn one failure into many.

// The one place std's primitives are allowed in (see clippy.toml).
#![allow(clippy::disallowed_types)]

#[cfg(loom)]
use loom::sync as imp;
#[cfg(not(loom))]
use std::sync as imp;

pub use imp::{Arc, MutexGuard, atomic};

/// Whether the primitives here are loom's. Those panic outside a loom model, so the
/// doc examples that use them return early when this is set (a hidden first line):
/// `cargo test` under `--cfg loom` then runs only the loom models.
#[doc(hidden)]
pub const LOOM: bool = cfg!(loom);

/// A mutual-exclusion lock whose [`lock`](Mutex::lock) recovers from poisoning.
pub struct Mutex<T>(imp::Mutex<T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `value`.
    pub fn new(value: T) -> Self {
        Self(imp::Mutex::new(value))
    }

    /// Blocks until the lock is held; recovers the data if a panicking thread
    /// poisoned it (see the module docs for why that is sound here).
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The data, through an exclusive borrow (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.0
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The data, consuming the mutex.
    pub fn into_inner(self) -> T {
        self.0
            .into_inner()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<T> std::fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Mutex { .. }")
    }
}

/// A condition variable paired with [`Mutex`]; waits recover from poisoning too.
pub struct Condvar(imp::Condvar);

impl Condvar {
    /// A new condition variable.
    pub fn new() -> Self {
        Self(imp::Condvar::new())
    }

    /// Releases `guard`, blocks until notified, and re-acquires the lock.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.0
            .wait(guard)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        self.0.notify_all();
    }

    /// Wakes one waiter.
    pub fn notify_one(&self) {
        self.0.notify_one();
    }
}

impl Default for Condvar {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Condvar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Condvar { .. }")
    }
}

/// Locks `mutex` (the same as [`Mutex::lock`]; kept for call sites that read better
/// as a function).
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock()
}
