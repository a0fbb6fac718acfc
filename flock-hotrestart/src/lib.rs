//! Envoy hot-restart supervisor library: runs Envoy, hot-restarts it on SIGHUP and on
//! config changes without dropping a request, and hands a chain over between two
//! supervisor processes.
//!
//! This crate performs the I/O; every decision comes from [`flock_core::epoch`]
//! (`start_epoch`, `write_decision`, `RestartGate`, and the in-process rules
//! `after_newest_exit`, `start_input`, `predecessor_drained`) and
//! [`flock_core::backoff`]. The binary `flock-supervisor` is argument
//! parsing around [`supervisor::run`]. See `README.md` for how to run Envoy under it.
//!
//! | module | job |
//! |---|---|
//! | [`supervisor`] | the event loop: signals, inotify, child exits, timers |
//! | [`admin`] | `GET /server_info` (which epoch is LIVE), graceful drain |
//! | [`envoy`] | `--mode validate`, spawning an epoch, the parent-death exec shim |
//! | [`statefile`] | `<state-dir>/epoch`: lock-free reads, `flock(2)`-locked writes (R8) |
//! | [`watch`] | inotify on the config's directory |
//! | [`metrics`] | Prometheus textfile, ready file |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod envoy;
pub mod metrics;
pub mod statefile;
pub mod supervisor;
pub mod watch;

pub use supervisor::{Config, Exit, SupervisorError, run};
