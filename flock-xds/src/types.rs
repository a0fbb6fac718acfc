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
/// SDS: `envoy.extensions.transport_sockets.tls.v3.Secret`.
pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// The wildcard resource name (`*`).
pub const WILDCARD: &str = "*";

/// Whether a first request with no resource names means "everything" (the legacy
/// wildcard): true for LDS and CDS only, as in Envoy and go-control-plane. Any type
/// can still subscribe to everything explicitly with `*`.
pub fn allows_legacy_wildcard(type_url: &str) -> bool {
    type_url == LISTENER || type_url == CLUSTER
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
        other => other.rsplit('/').next().unwrap_or(other),
    }
}
