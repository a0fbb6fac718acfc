//! The node-agent runtime ("one bird of the flock"): pod store, CNI server, registry, identity, liveness, orphan GC and xDS wiring.
//!
//! **Status: skeleton.** This crate's contents land with issue 6 (flock-agent); until then it only
//! documents its place in the workspace (see the repository's `ARCHITECTURE.md`).
#![forbid(unsafe_code)]
