//! The pure, deterministic core of flock: every decision the agent, CNI installer and supervisor make, with no I/O.
//!
//! (crate overview: written last, see ARCHITECTURE.md meanwhile)
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backoff;
pub mod cniconf;
pub mod epoch;
pub mod gc;
pub mod hash;
pub mod lifecycle;
pub mod resources;
pub mod snapshot;
pub mod sync;

pub use hash::ContentHash;
