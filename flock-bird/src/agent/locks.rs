//! Per-pod locks: the operations on one pod (AddPod, RemovePod, a GC removal) run one
//! at a time; operations on different pods proceed in parallel.

use flock_core::pod::PodKey;
use flock_core::sync::Mutex;
use flock_core::sync::lock;
use std::collections::HashMap;
use std::sync::Arc;

/// A lock per pod key, created on first use and dropped when nobody holds or waits
/// for it (the map does not grow with every pod ever seen).
pub(super) struct PodLocks(Mutex<HashMap<PodKey, Arc<tokio::sync::Mutex<()>>>>);

impl PodLocks {
    pub(super) fn new() -> Self {
        Self(Mutex::new(HashMap::new()))
    }

    /// Runs `op` holding `key`'s lock.
    pub(super) async fn run<T>(&self, key: &PodKey, op: impl Future<Output = T>) -> T {
        let m = Arc::clone(lock(&self.0).entry(key.clone()).or_default());
        let guard = m.lock_owned().await;
        let out = op.await;
        drop(guard);
        let mut locks = lock(&self.0);
        // Only the map holds it now (our guard is gone, and a waiter holds a clone):
        // nobody needs it any more.
        if locks.get(key).is_some_and(|m| Arc::strong_count(m) == 1) {
            locks.remove(key);
        }
        out
    }
}
