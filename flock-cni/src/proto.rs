//! The `flock.cni.v1` API (generated from `proto/flock/cni/v1/cni.proto`).

/// `flock.cni.v1`: the plugin-to-agent API.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("flock.cni.v1");
}
