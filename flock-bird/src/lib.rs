//! The node-agent runtime ("one bird of the flock"): pod store, CNI server, registry, liveness, orphan GC and xDS wiring.
//!
//! The rules (step order, merge-on-load, register-then-recheck, GC planning) come from
//! `flock_core::lifecycle` and `flock_core::gc`; this crate runs them against real I/O.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod access_log;
pub mod admin;
pub mod agent;
pub mod cni_server;
pub mod denials;
mod dirwatch;
pub mod identity;
pub mod kube;
pub mod model;
pub mod node_lock;
pub mod node_ready;
pub mod options;
pub mod probe;
pub mod registry;
pub mod repair;
pub mod runtime;
pub mod store;
pub mod workload_metrics;
pub mod xds_answers;
pub mod xds_auth;

/// Transparent capture's nftables I/O (`Nft::probe`, `apply`, `check`, `remove`),
/// re-exported for the agent binary's start-up probe.
pub use flock_capture;
