//! Envoy hot-restart supervisor library: runs Envoy, hot-restarts it on SIGHUP and on
//! config changes without dropping a request, and hands a chain over between two
//! supervisor processes.
//!
//! This crate performs the I/O; every decision comes from [`flock_core::epoch`]:
//! the lifecycle machine [`flock_core::epoch::supervisor::Supervisor`] (live timeout,
//! failure-count reset, give-up, shutdown stages, start decision, restart gate) and
//! the state-file write rule `write_decision`, applied under the file's lock. The
//! binary `flock-supervisor` is argument parsing around [`config`] and
//! [`supervisor::run`]. See `README.md` for how to run Envoy under it.
//!
//! | module | job |
//! |---|---|
//! | [`config`] | the supervisor's configuration, defaults and limits, and its policy |
//! | [`supervisor`] | the I/O loop around the lifecycle machine: signals, inotify, child exits, timers |
//! | [`admin`] | `GET /server_info` (which epoch is LIVE), graceful drain; over Envoy's admin unix socket (TCP opt-in) |
//! | [`control`] | Envoy's private `0700` control directory: hot-restart sockets (`--socket-path`), admin socket |
//! | [`envoys`] | the Envoy side behind one trait (real, or a test's fake): validate, spawn, signal, admin probe and drain |
//! | [`envoy`] | `--mode validate`, spawning an epoch, the parent-death exec shim |
//! | [`statefile`] | `<state-dir>/epoch`: lock-free reads, `flock(2)`-locked writes (R8) |
//! | [`watch`] | inotify on the config's directory |
//! | [`metrics`] | Prometheus textfile, ready file |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod config;
pub mod control;
pub mod envoy;
pub mod envoys;
pub mod metrics;
pub mod statefile;
pub mod supervisor;
pub mod watch;

pub use config::{Config, ConfigError};
pub use envoys::{Envoys, RealEnvoys};
pub use supervisor::{Exit, SupervisorError, run, run_with};
