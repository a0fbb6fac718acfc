//! The flock agent's admin API: the typed JSON documents of its views and the HTTP client `flockctl` uses.
//!
//! The agent (flock-bird's `admin::server`) builds the documents in [`api`] and serves
//! them; [`client`] fetches and decodes them. Both sides share these types, so they
//! cannot disagree on a key. The crate carries none of the agent's registry,
//! Kubernetes or SPIRE code, so a client links only serde, hyper and tokio.
//!
//! ```no_run
//! # async fn f() -> Result<(), flock_admin::ClientError> {
//! let status = flock_admin::AdminClient::new("127.0.0.1:18090").status().await?;
//! println!("ready: {}", status.ready);
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod client;
pub mod policy;

pub use api::Route;
pub use client::{AdminClient, ClientError};
