//! Envoy hot-restart supervisor library: epochs, state file, debounce + gate, validate-before-restart.
//!
//! **Status: skeleton.** This crate's contents land with issue 5 (flock-supervisor); until then it only
//! documents its place in the workspace (see the repository's `ARCHITECTURE.md`).
#![forbid(unsafe_code)]
