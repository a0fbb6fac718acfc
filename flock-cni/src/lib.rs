//! CNI 1.1 chained plugin, the agent-facing CNI API, and the race-free install-cni daemon.
//!
//! **Status: skeleton.** This crate's contents land with issue 4 (flock-cni); until then it only
//! documents its place in the workspace (see the repository's `ARCHITECTURE.md`).
#![forbid(unsafe_code)]
