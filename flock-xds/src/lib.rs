//! xDS server library: snapshot cache, ADS (SotW and Delta), per-type services and mesh translation for Envoy and proxyless gRPC.
//!
//! **Status: skeleton.** This crate's contents land with issue 3 (flock-xds); until then it only
//! documents its place in the workspace (see the repository's `ARCHITECTURE.md`).
#![forbid(unsafe_code)]
