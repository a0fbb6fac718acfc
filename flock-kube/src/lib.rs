//! Kubernetes for the flock agent: API objects mapped to mesh records, node-scoped reflectors, the startup taint.
//!
//! * [`map`] (pure): a pod, its namespace and the Services that select it → the facts
//!   the agent meshes the pod with (service account, ports, memberships); Services and
//!   EndpointSlices → remote endpoints.
//! * [`watch`]: reflectors of this node's pods, Services, EndpointSlices, Namespaces
//!   and Nodes, behind one watch channel.
//! * [`taint`]: removing the startup taint from this node once the agent is ready.
//! * `double` (feature `testing`): an API-server double for tests.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "testing")]
pub mod double;
pub mod map;
pub mod taint;
pub mod watch;
