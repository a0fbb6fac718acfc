//! Dropping the Linux capabilities the agent does not use once its listeners are bound.
//!
//! What the agent needs while running, and why:
//!
//! * `CAP_SYS_ADMIN` — kept: the liveness probes `setns(CLONE_NEWNET)` into each pod's
//!   network namespace to connect to the pod's loopback, and `setns` into a network
//!   namespace needs it (nothing narrower exists).
//!
//! Everything else is dropped. The agent runs as root (uid 0) and owns what it writes
//! (the pod store, `/run/flock`), so it needs no `CAP_DAC_OVERRIDE`; it binds its
//! sockets, and chowns the xDS socket to the Envoy uid, *before* the drop, so neither
//! `CAP_NET_BIND_SERVICE` nor `CAP_CHOWN` is needed afterwards; reading peer credentials
//! (`SO_PEERCRED`) needs no capability; the network namespace files (`nsfs`) are
//! readable by everyone.
//!
//! Capabilities belong to threads, not processes: `capset` changes the calling thread
//! only, and a new thread inherits its creator's. The thread that bound the listeners
//! drops at once ([`drop_capabilities`]); every runtime worker calls
//! [`apply_pending_drop`] when it parks or unparks, so each drops on its next
//! scheduling step, and every thread created later starts from a dropped one.
//! The bounding set is cleared too (needs `CAP_SETPCAP`, dropped last), so an `exec`
//! could not regain anything.

use caps::{CapSet, Capability, CapsHashSet};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

/// The capabilities the agent keeps (see the module docs).
pub const KEPT: &[Capability] = &[Capability::CAP_SYS_ADMIN];

static REQUESTED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static DONE: Cell<bool> = const { Cell::new(false) };
}

fn kept() -> CapsHashSet {
    KEPT.iter().copied().collect()
}

/// Requests the drop for every thread, applies it on this one, and logs the result.
pub fn drop_capabilities() {
    REQUESTED.store(true, Ordering::Release);
    match apply() {
        Ok(bounding_cleared) => {
            let effective = caps::read(None, CapSet::Effective).unwrap_or_default();
            let mut names: Vec<String> = effective.iter().map(|c| c.to_string()).collect();
            names.sort();
            tracing::info!(
                kept = ?names,
                bounding_cleared,
                "dropped every other Linux capability"
            );
        }
        Err(e) => tracing::warn!("dropping capabilities failed: {e}"),
    }
}

/// A runtime worker's park/unpark hook: applies a requested drop once per thread.
pub fn apply_pending_drop() {
    if REQUESTED.load(Ordering::Acquire) && !DONE.with(Cell::get) {
        if let Err(e) = apply() {
            tracing::warn!("dropping capabilities on a runtime thread failed: {e}");
        }
    }
}

/// Drops every capability but [`KEPT`] on the calling thread: the bounding set (when
/// this thread may: `CAP_SETPCAP`), ambient, inheritable, then effective and
/// permitted. Returns whether the bounding set was cleared.
fn apply() -> Result<bool, caps::errors::CapsError> {
    DONE.with(|d| d.set(true));
    let keep = kept();
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
    let remaining: CapsHashSet = permitted.intersection(&keep).copied().collect();
    caps::set(None, CapSet::Effective, &remaining)?;
    caps::set(None, CapSet::Permitted, &remaining)?;
    Ok(may_clear_bounding)
}
