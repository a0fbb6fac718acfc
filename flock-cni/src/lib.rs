//! CNI 1.1 chained plugin, the agent-facing CNI API, and the race-free install-cni daemon.
//!
//! * [`cni`]: the spec as a plugin sees it (environment, stdin network config, error
//!   codes, result version conversion), total on any input.
//! * [`plugin`]: one invocation of the `flock-cni` binary, verb by verb.
//! * [`proto`] and [`client`]: the `flock.cni.v1.CniService` gRPC API the node agent
//!   serves on a unix socket, and the plugin's bounded-time client.
//! * [`install`]: the `flock-install-cni` daemon, which executes the decisions of
//!   [`flock_core::cniconf`] on a real directory (inotify armed before the scan, one
//!   queue, per-file ledger, atomic writes, restore on exit).
//! * `testing` (feature `testing`): an in-process double of the agent's service.
//!
//! [`plugin`], [`proto`] and [`client`] need the default feature `grpc`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "grpc")]
pub mod client;
pub mod cni;
pub mod install;
#[cfg(feature = "grpc")]
pub mod plugin;
#[cfg(feature = "grpc")]
pub mod proto;
#[cfg(feature = "testing")]
pub mod testing;
