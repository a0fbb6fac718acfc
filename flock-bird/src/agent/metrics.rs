//! The agent's counters, read by `/metrics`.

use std::sync::atomic::AtomicU64;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    /// AddPod requests that meshed a pod.
    pub pods_added: AtomicU64,
    /// RemovePod requests that removed a pod.
    pub pods_removed: AtomicU64,
    /// Requests ignored (not meshed, unknown).
    pub pods_ignored: AtomicU64,
    /// Requests that failed.
    pub pod_errors: AtomicU64,
    /// Snapshots published (Envoy group).
    pub publishes: AtomicU64,
    /// Liveness probes run / failed.
    pub probes: AtomicU64,
    /// Liveness probes that failed.
    pub probe_failures: AtomicU64,
    /// Health transitions applied to the registry.
    pub health_changes: AtomicU64,
    /// Re-registrations undone because the pod was removed meanwhile (R4 guard).
    pub guard_undos: AtomicU64,
    /// GC sweeps run.
    pub gc_sweeps: AtomicU64,
    /// Items the GC removed, by kind (store, endpoint).
    pub gc_removed_store: AtomicU64,
    /// Registry endpoints the GC removed.
    pub gc_removed_endpoints: AtomicU64,
    /// Sweeps on which the breaker refused a kind.
    pub gc_breaker_trips: AtomicU64,
    /// Registry operations that failed.
    pub registry_errors: AtomicU64,
    /// Transparent capture's counters.
    pub capture: super::CaptureMetrics,
    /// Registry writes the sync has left to do.
    pub registry_pending_ops: AtomicU64,
    /// Registry sync rounds that failed (each is retried with backoff).
    pub registry_sync_errors: AtomicU64,
    /// ADDs undone because their caller (the plugin) went away before the answer: the
    /// runtime saw the ADD fail, so the pod must not stay meshed.
    pub adds_undone: AtomicU64,
}
