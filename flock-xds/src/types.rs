//! The xDS v3 type URLs flock serves, in one place.

/// Prefix every type URL starts with.
pub const TYPE_PREFIX: &str = "type.googleapis.com/";
/// LDS: `envoy.config.listener.v3.Listener`.
pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
/// RDS: `envoy.config.route.v3.RouteConfiguration`.
pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
/// CDS: `envoy.config.cluster.v3.Cluster`.
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
/// EDS: `envoy.config.endpoint.v3.ClusterLoadAssignment`.
pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
/// VHDS: `envoy.config.route.v3.VirtualHost`, a route configuration's virtual hosts
/// one resource each (Delta only), named `<route configuration>/<virtual host>`.
pub const VIRTUAL_HOST: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";
/// SDS: `envoy.extensions.transport_sockets.tls.v3.Secret`.
pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// The wildcard resource name (`*`).
pub const WILDCARD: &str = "*";

/// Whether a first request with no resource names means "everything" (the legacy
/// wildcard): true for LDS and CDS only, as in Envoy and go-control-plane. Any type
/// can still subscribe to everything explicitly with `*`. (VHDS is neither: see
/// [`Subscription`](crate::protocol::Subscription) for what its namespaces follow.)
pub fn allows_legacy_wildcard(type_url: &str) -> bool {
    type_url == LISTENER || type_url == CLUSTER
}

/// Whether a subscribed name of the type is a namespace: it stands for every resource
/// named `<name>/<anything without a slash>`. True for VHDS only: Envoy subscribes to a
/// route configuration's virtual hosts by the configuration's name and expects all of
/// them (its `use_namespace_matching`); a virtual host's own name is never a namespace,
/// as the part after the last `/` is the host.
pub fn uses_namespaces(type_url: &str) -> bool {
    type_url == VIRTUAL_HOST
}

/// The namespace of `name` for [`uses_namespaces`] types: everything before its last
/// `/` (a route configuration's name may contain slashes, a host cannot).
pub fn namespace_of(name: &str) -> Option<&str> {
    name.rfind('/').map(|at| &name[..at])
}

/// The short name of a type for logs and metrics (`"cds"`, `"eds"`…), or the URL's
/// last path segment for other types.
pub fn short_name(type_url: &str) -> &str {
    match type_url {
        LISTENER => "lds",
        ROUTE => "rds",
        CLUSTER => "cds",
        ENDPOINT => "eds",
        SECRET => "sds",
        VIRTUAL_HOST => "vhds",
        other => other.rsplit('/').next().unwrap_or(other),
    }
}
