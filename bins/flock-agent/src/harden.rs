//! Dropping the Linux capabilities the agent does not use.
//!
//! What the agent needs while running, and why:
//!
//! * `CAP_SYS_ADMIN` — kept: the liveness probes, and the threads that start `nft`
//!   and `ip` for a captured pod, `setns(CLONE_NEWNET)` into the pod's network
//!   namespace, and `setns` into a network namespace needs it (nothing narrower
//!   exists).
//! * `CAP_NET_ADMIN` — kept only with `--capture strict|permissive`: the agent runs
//!   `nft -j -f -` in each captured pod's netns (started from a thread that entered
//!   it) to install, check and remove the pod's nftables table, and changing a netns's
//!   nftables needs it. Kept in the bounding set too, so the `nft`/`ip` children
//!   (root, no file capabilities) get it on exec.
//!
//! Everything else goes. The agent runs as root (uid 0) and owns what it writes (the
//! pod store, `/run/flock`), so it needs no `CAP_DAC_OVERRIDE`; reading peer
//! credentials (`SO_PEERCRED`) needs no capability; the network namespace files that
//! runtimes bind-mount (`/var/run/netns/*`, `nsfs`) are readable by everyone. A
//! runtime that passes `/proc/<pid>/ns/net` paths instead needs `CAP_SYS_PTRACE` too
//! (`--keep-capability CAP_SYS_PTRACE`). Two more are needed only while the listeners
//! are bound, and only when the flags ask for them: `CAP_CHOWN` (the xDS socket handed
//! to `--envoy-uid` / `--xds-socket-group`) and `CAP_NET_BIND_SERVICE` (a port below
//! 1024).
//!
//! Capabilities belong to threads, not processes: `capset` changes the calling thread
//! only, and a new thread starts with its creator's. So the drop happens in two steps:
//!
//! 1. [`drop_early`], on the main thread before the async runtime starts any thread:
//!    everything but [`KEPT`], the `--keep-capability` extras and the bind-time ones
//!    the flags need. Every later thread inherits this.
//! 2. [`drop_capabilities`] once every listener is bound, for the bind-time ones (a
//!    no-op in the default configuration): at once on the calling thread, and on each
//!    runtime worker at its next park or unpark ([`apply_pending_drop`]). A blocking-pool
//!    thread started between the two steps (before the listeners are bound: the
//!    registry connection's name lookups) keeps them until tokio retires it (10 s
//!    idle).
//!
//! The bounding set is cleared too (with `CAP_SETPCAP`, itself dropped last), so an
//! `exec` could not regain anything.

use caps::{CapSet, Capability, CapsHashSet};
use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The capabilities the agent always keeps (see the module docs).
pub const KEPT: &[Capability] = &[Capability::CAP_SYS_ADMIN];

static REQUESTED: AtomicBool = AtomicBool::new(false);
/// What the final drop keeps: [`KEPT`] and the operator's extras (set by
/// [`drop_early`]).
static FINAL: Mutex<Option<CapsHashSet>> = Mutex::new(None);

thread_local! {
    static DONE: Cell<bool> = const { Cell::new(false) };
}

fn final_set() -> CapsHashSet {
    FINAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .unwrap_or_else(|| KEPT.iter().copied().collect())
}

/// Step 1 (before any other thread exists): keeps [`KEPT`], `extra` (the operator's
/// `--keep-capability`) and `bind_time` (what binding the listeners needs), plus
/// `CAP_SETPCAP` while there are bind-time ones to clear later.
pub fn drop_early(extra: &[Capability], bind_time: &[Capability]) {
    let mut final_keep: CapsHashSet = KEPT.iter().copied().collect();
    final_keep.extend(extra.iter().copied());
    *FINAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(final_keep.clone());
    let mut keep = final_keep;
    keep.extend(bind_time.iter().copied());
    if !bind_time.is_empty() {
        keep.insert(Capability::CAP_SETPCAP);
    }
    if let Err(e) = apply(&keep) {
        tracing::warn!("dropping capabilities at start failed: {e}");
    }
}

/// Step 2 (every listener bound): requests the final drop for every thread, applies
/// it on this one, and logs what is kept.
pub fn drop_capabilities() {
    REQUESTED.store(true, Ordering::Release);
    match apply(&final_set()) {
        Ok(_) => {
            // What the thread holds now, not what this step cleared: the bounding set
            // is usually cleared by the early step, which also drops CAP_SETPCAP.
            let sorted = |set: CapSet| {
                let mut names: Vec<String> = caps::read(None, set)
                    .unwrap_or_default()
                    .iter()
                    .map(|c| c.to_string())
                    .collect();
                names.sort();
                names
            };
            tracing::info!(
                kept = ?sorted(CapSet::Effective),
                bounding = ?sorted(CapSet::Bounding),
                "dropped every other Linux capability"
            );
        }
        Err(e) => tracing::warn!("dropping capabilities failed: {e}"),
    }
}

/// A runtime worker's park/unpark hook: applies a requested final drop once per
/// thread.
pub fn apply_pending_drop() {
    if REQUESTED.load(Ordering::Acquire) && !DONE.with(Cell::get) {
        DONE.with(|d| d.set(true));
        if let Err(e) = apply(&final_set()) {
            tracing::warn!("dropping capabilities on a runtime thread failed: {e}");
        }
    }
}

/// Drops every capability but `keep` on the calling thread: the bounding set (when
/// this thread may: `CAP_SETPCAP`), ambient, inheritable, then effective and
/// permitted. Returns whether the bounding set was cleared.
fn apply(keep: &CapsHashSet) -> Result<bool, caps::errors::CapsError> {
    let permitted = caps::read(None, CapSet::Permitted)?;
    let may_clear_bounding = caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP)?;
    if may_clear_bounding {
        for cap in caps::read(None, CapSet::Bounding)? {
            if !keep.contains(&cap) {
                caps::drop(None, CapSet::Bounding, cap)?;
            }
        }
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    let remaining: CapsHashSet = permitted.intersection(keep).copied().collect();
    caps::set(None, CapSet::Effective, &remaining)?;
    caps::set(None, CapSet::Permitted, &remaining)?;
    Ok(may_clear_bounding)
}
