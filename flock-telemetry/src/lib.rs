//! flock's telemetry plumbing: one logging setup for every binary, and Prometheus metric helpers.
//!
//! - `logging` (feature `logging`, for binaries): `RUST_LOG`-style filtering with a
//!   default, text or JSON lines on stderr. Every flock binary calls
//!   `logging::init` once, first thing.
//! - [`metrics`]: rendering a [`prometheus_client`] registry in the Prometheus text
//!   format, bucketing client-supplied label values into a closed set, and a
//!   [`Collector`](prometheus_client::collector::Collector) that reads plain counters
//!   (atomics a library already keeps) at scrape time.
//!
//! This crate depends on no other flock crate, so any of them may use it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "logging")]
pub mod logging;
pub mod metrics;

pub use prometheus_client;
