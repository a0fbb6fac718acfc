//! Kubernetes for the flock agent: API objects mapped to mesh records, node-scoped reflectors, the startup taint.
//!
//! * [`map`] (pure): a pod, its namespace and the Services that select it → the facts
//!   the agent meshes the pod with (service account, ports, memberships); Services and
//!   EndpointSlices → remote endpoints.
//! * [`policy`] (pure): flock's `AuthorizationPolicy` custom resource and the policies
//!   it puts in force, by target.
//! * [`route`] (pure): Gateway API `HTTPRoute` objects with a Service parent, read
//!   into the agent's traffic-policy routes.
//! * [`watch`]: reflectors of this node's pods, Services, EndpointSlices, Namespaces,
//!   Nodes, AuthorizationPolicies and HTTPRoutes, behind one watch channel.
//! * [`taint`]: removing the startup taint from this node once the agent is ready.
//! * `double` (feature `testing`): an API-server double for tests.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "testing")]
pub mod double;
pub mod map;
pub mod policy;
pub mod route;
pub mod taint;
pub mod watch;
