//! Test builds only (feature `fault-injection`, and [`ARM_ENV`] set at start): configs
//! a real Envoy rejects, on demand, so the Envoy-fault tests can make a real Envoy NACK every update.
//!
//! While the file [`SWITCH`] exists in the pod store's directory, every cluster and
//! listener of the Envoy group's snapshots is made invalid the way Envoy's own
//! validation catches it: a cluster gets a negative `connect_timeout` ("Invalid
//! duration: Expected positive duration"), a listener loses its filter chains ("no
//! filter chains specified"). Each resource keeps its name, and its content hash
//! changes, so every CDS and LDS update carries only rejected resources and is NACKed
//! whole; Envoy keeps its last accepted config. Once the file is gone, the next
//! publish carries the valid resources again (their hashes differ from the poisoned
//! ones), so Envoy is resent all of them and ACKs.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::google::protobuf::{Any, Duration};
use flock_core::ContentHash;
use flock_xds::translate::Entries;
use flock_xds::types::{CLUSTER, LISTENER};
use prost::Message as _;
use std::sync::Arc;

/// The environment variable that arms fault injection in a build that has it:
/// `FLOCK_FAULT_INJECTION=1` in the agent's environment at start. Without it the
/// failpoints and the switch are not looked at, so the benchmarks, which `cargo` builds
/// with this feature (it is unified from flock-agent's dev-dependencies), measure what
/// a release build does: no file lookup per publish and per AddPod step.
pub const ARM_ENV: &str = "FLOCK_FAULT_INJECTION";

/// Whether [`ARM_ENV`] is `1` (read once).
pub(crate) fn armed() -> bool {
    static ARMED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ARMED.get_or_init(|| std::env::var_os(ARM_ENV).is_some_and(|v| v == "1"))
}

/// The switch file's name in the store directory (not a pod file's name, so the
/// store's load ignores it).
pub const SWITCH: &str = "fault-xds-invalid";

/// `entries` as they are, or poisoned while `store_dir`/[`SWITCH`] exists.
pub(crate) fn poison_if_armed(mut entries: Entries, store_dir: &std::path::Path) -> Entries {
    if !store_dir.join(SWITCH).exists() {
        return entries;
    }
    tracing::warn!(
        "fault injection: publishing clusters and listeners Envoy rejects ({SWITCH} exists)"
    );
    for (type_url, list) in entries.iter_mut() {
        for (_, hash, any) in list.iter_mut() {
            let value = match *type_url {
                CLUSTER => Cluster::decode(any.value.as_slice()).ok().map(|mut c| {
                    c.connect_timeout = Some(Duration {
                        seconds: -1,
                        nanos: 0,
                    });
                    c.encode_to_vec()
                }),
                LISTENER => Listener::decode(any.value.as_slice()).ok().map(|mut l| {
                    l.filter_chains.clear();
                    l.default_filter_chain = None;
                    l.encode_to_vec()
                }),
                _ => None,
            };
            if let Some(value) = value {
                *hash = ContentHash::of(&value);
                *any = Arc::new(Any {
                    type_url: any.type_url.clone(),
                    value,
                });
            }
        }
    }
    entries
}

/// The failpoint file's name in the store directory: it holds one failpoint name,
/// optionally followed by ` stop`. See [`failpoint`].
pub const FAILPOINT: &str = "failpoint";

/// Failpoints: named points of AddPod, RemovePod, the GC sweep and the registry sync
/// where the agent can be killed (SIGKILL: a crash exactly there) or stopped (SIGSTOP:
/// an agent that hangs there), deterministically. In an agent started with
/// [`ARM_ENV`]`=1`, armed by writing the point's name into `store_dir`/[`FAILPOINT`]; the first time the agent reaches that point the
/// file is removed (so the restarted agent runs on) and the signal is raised. The
/// names: `add/start`, `add/<step>` after each AddPod step (`add/StoreWrite`, ...,
/// `add/RegistryRegister`), `remove/start`, `remove/<step>` likewise, `gc/planned`,
/// `gc/pod-removed`, `gc/endpoint-removed`, `regsync/put`, `regsync/delete`.
pub(crate) fn failpoint(store_dir: &std::path::Path, name: &str) {
    if !armed() {
        return;
    }
    let path = store_dir.join(FAILPOINT);
    let Ok(armed) = std::fs::read_to_string(&path) else {
        return;
    };
    let armed = armed.trim();
    let (point, stop) = match armed.strip_suffix(" stop") {
        Some(point) => (point, true),
        None => (armed, false),
    };
    if point != name {
        return;
    }
    let _ = std::fs::remove_file(&path);
    let signal = if stop {
        nix::sys::signal::Signal::SIGSTOP
    } else {
        nix::sys::signal::Signal::SIGKILL
    };
    tracing::error!(failpoint = name, %signal, "fault injection: failpoint reached");
    let _ = nix::sys::signal::raise(signal);
}
