//! Gateway API `HTTPRoute` objects (`gateway.networking.k8s.io/v1`, namespaced; the
//! upstream CRD) and their mapping to the agent's traffic-policy routes (pure).
//!
//! The object is kept with its spec as raw JSON and checked here, one object at a
//! time, by the same reader as a `--routes-dir` file
//! ([`flock_core::route::SourcedRoute::read`]): the CRD's schema is the API server's
//! first check, not the only one, and a bad object is refused alone. Routes whose
//! parents are Gateways (not Services) are not the mesh's: they are left out, not
//! reported as refused.

use flock_core::route::{RouteError, SourcedRoute};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// One `HTTPRoute` object: its metadata and its spec as written.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HttpRoute {
    /// The object's metadata (its namespace is the route's).
    pub metadata: ObjectMeta,
    /// The route, unparsed.
    #[serde(default)]
    pub spec: serde_json::Value,
}

impl k8s_openapi::Resource for HttpRoute {
    const API_VERSION: &'static str = "gateway.networking.k8s.io/v1";
    const GROUP: &'static str = "gateway.networking.k8s.io";
    const KIND: &'static str = "HTTPRoute";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "httproutes";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for HttpRoute {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Whether `spec` names a Service parent (kind `Service`, core group): a route the
/// mesh serves, or must report. A Gateway's route is someone else's.
fn has_service_parent(spec: &serde_json::Value) -> bool {
    spec.get("parentRefs")
        .and_then(|p| p.as_array())
        .is_some_and(|refs| {
            refs.iter().any(|r| {
                r.get("kind").and_then(|k| k.as_str()) == Some("Service")
                    && r.get("group")
                        .and_then(|g| g.as_str())
                        .unwrap_or("")
                        .is_empty()
            })
        })
}

/// The key of the object `namespace/name` among the agent's routes.
pub fn key_of(namespace: &str, name: &str) -> String {
    format!("HTTPRoute {namespace}/{name}")
}

/// The mesh's routes among `objects` ((namespace, name) → object): for each object
/// with a Service parent, its key ([`key_of`]) and its route or refusal.
pub fn routes_by_key<'a>(
    objects: impl IntoIterator<Item = (&'a (String, String), &'a HttpRoute)>,
) -> Vec<(String, SourcedRoute)> {
    let mut out = Vec::new();
    for ((namespace, name), obj) in objects {
        if !has_service_parent(&obj.spec) {
            continue;
        }
        let origin = format!("HTTPRoute {namespace}/{name}");
        let document = serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "annotations": obj.metadata.annotations.clone().unwrap_or_default(),
            },
            "spec": obj.spec,
        });
        let route = match serde_json::to_vec(&document) {
            Ok(bytes) => SourcedRoute::read(origin, &bytes),
            Err(e) => SourcedRoute {
                origin,
                written: Err(RouteError {
                    field: "spec".into(),
                    reason: e.to_string(),
                }),
            },
        };
        out.push((key_of(namespace, name), route));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(name: &str, spec: serde_json::Value) -> ((String, String), HttpRoute) {
        (
            ("shop".to_string(), name.to_string()),
            HttpRoute {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    namespace: Some("shop".into()),
                    ..Default::default()
                },
                spec,
            },
        )
    }

    #[test]
    fn service_routes_are_read_gateway_routes_left_out_and_bad_ones_refused_alone() {
        let good = obj(
            "web",
            serde_json::json!({
                "parentRefs": [{ "group": "", "kind": "Service", "name": "web", "port": 80 }],
                "rules": [{ "backendRefs": [{ "name": "web-v1", "port": 80 }] }]
            }),
        );
        let gateway = obj(
            "edge",
            serde_json::json!({ "parentRefs": [{ "name": "gw" }], "rules": [] }),
        );
        let bad = obj(
            "bad",
            serde_json::json!({
                "parentRefs": [{ "group": "", "kind": "Service", "name": "web" }],
                "rules": [{ "filters": [{ "type": "URLRewrite" }] }]
            }),
        );
        let objects = [good, gateway, bad];
        let routes = routes_by_key(objects.iter().map(|(k, v)| (k, v)));
        assert_eq!(routes.len(), 2);
        assert_eq!(routes[0].0, "HTTPRoute shop/web");
        let web = routes[0].1.written.as_ref().unwrap();
        assert_eq!(web.id, "shop/web");
        let refused = routes[1].1.written.as_ref().unwrap_err();
        assert_eq!(refused.field, "spec.rules[0].filters[0]");
    }
}
