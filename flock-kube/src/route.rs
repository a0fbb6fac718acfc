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
    /// The status controllers wrote (the mesh's entries: [`desired_status`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<serde_json::Value>,
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

/// The `controllerName` of the mesh's entries in an `HTTPRoute`'s `status.parents`.
pub const CONTROLLER_NAME: &str = "flock.io/mesh";

/// Most bytes of a condition message (the CRD's limit is 32,768).
pub const MAX_CONDITION_MESSAGE: usize = 1024;

/// What the mesh made of one route, for its status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteOutcome {
    /// Served; `problems` names each backend or rule dropped (none: served as written).
    Accepted {
        /// What was dropped, for the operator.
        problems: Vec<String>,
    },
    /// Nothing of it is served: why.
    Refused(String),
    /// Not the mesh's (no Service parent any more): the mesh's entries go.
    NotServed,
}

fn bounded_message(m: &str) -> String {
    if m.len() <= MAX_CONDITION_MESSAGE {
        return m.to_string();
    }
    let mut end = MAX_CONDITION_MESSAGE;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &m[..end])
}

/// The `status` the mesh reports for `obj`, or `None` when what it holds already says
/// so (no write needed). Gateway API's route status: one entry per Service
/// `parentRef` under [`CONTROLLER_NAME`], with conditions `Accepted` (`False`,
/// reason `UnsupportedValue`, for a refused route) and `ResolvedRefs` (`False`,
/// `BackendNotFound`, when a backend or rule was dropped), each with the object's
/// `metadata.generation` as `observedGeneration`. Other controllers' entries are
/// kept as they are (a merge patch replaces the whole list). A condition whose
/// status is unchanged keeps its `lastTransitionTime`; a new or changed one gets
/// `now` (RFC 3339): so every node's agent computes the same status from the same
/// object, and once one has written it the others find nothing to write.
pub fn desired_status(
    obj: &HttpRoute,
    outcome: &RouteOutcome,
    now: &str,
) -> Option<serde_json::Value> {
    use serde_json::{Value, json};
    let generation = obj.metadata.generation.unwrap_or(0);
    let existing: Vec<Value> = obj
        .status
        .as_ref()
        .and_then(|s| s.get("parents"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let ours = |e: &Value| e.get("controllerName").and_then(Value::as_str) == Some(CONTROLLER_NAME);
    let (accepted, resolved) = match outcome {
        RouteOutcome::Refused(why) => (
            ("False", "UnsupportedValue", bounded_message(why)),
            (
                "False",
                "UnsupportedValue",
                "the route is not served".to_string(),
            ),
        ),
        RouteOutcome::Accepted { problems } if problems.is_empty() => (
            ("True", "Accepted", "served by the mesh".to_string()),
            ("True", "ResolvedRefs", "every backend resolved".to_string()),
        ),
        RouteOutcome::Accepted { problems } => (
            ("True", "Accepted", "served by the mesh".to_string()),
            (
                "False",
                "BackendNotFound",
                bounded_message(&problems.join("; ")),
            ),
        ),
        RouteOutcome::NotServed => Default::default(),
    };
    let parent_refs: Vec<Value> = obj
        .spec
        .get("parentRefs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| {
            *outcome != RouteOutcome::NotServed
                && r.get("kind").and_then(Value::as_str) == Some("Service")
                && r.get("group")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .is_empty()
        })
        .cloned()
        .collect();
    let mut mine = Vec::new();
    for parent in &parent_refs {
        let before = existing
            .iter()
            .find(|e| ours(e) && e.get("parentRef") == Some(parent));
        let condition = |ty: &str, (status, reason, message): &(&str, &str, String)| {
            let old = before
                .and_then(|e| e.get("conditions"))
                .and_then(Value::as_array)
                .and_then(|cs| {
                    cs.iter()
                        .find(|c| c.get("type").and_then(Value::as_str) == Some(ty))
                });
            let since = old
                .filter(|c| c.get("status").and_then(Value::as_str) == Some(status))
                .and_then(|c| c.get("lastTransitionTime"))
                .and_then(Value::as_str)
                .unwrap_or(now);
            json!({
                "type": ty,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": since,
            })
        };
        mine.push(json!({
            "parentRef": parent,
            "controllerName": CONTROLLER_NAME,
            "conditions": [condition("Accepted", &accepted), condition("ResolvedRefs", &resolved)],
        }));
    }
    let theirs: Vec<Value> = existing.iter().filter(|e| !ours(e)).cloned().collect();
    let had: Vec<&Value> = existing.iter().filter(|e| ours(e)).collect();
    if had.len() == mine.len() && had.iter().zip(&mine).all(|(a, b)| *a == b) {
        return None;
    }
    Some(json!({ "parents": theirs.into_iter().chain(mine).collect::<Vec<_>>() }))
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
                status: None,
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

    fn web(status: Option<serde_json::Value>) -> HttpRoute {
        let mut r = obj(
            "web",
            serde_json::json!({
                "parentRefs": [
                    { "group": "", "kind": "Service", "name": "web", "port": 80 },
                    { "name": "gw" }
                ],
                "rules": [{ "backendRefs": [{ "name": "web-v1", "port": 80 }] }]
            }),
        )
        .1;
        r.metadata.generation = Some(3);
        r.status = status;
        r
    }

    fn condition<'a>(status: &'a serde_json::Value, ty: &str) -> &'a serde_json::Value {
        status["parents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["controllerName"] == CONTROLLER_NAME)
            .and_then(|p| p["conditions"].as_array())
            .and_then(|cs| cs.iter().find(|c| c["type"] == ty))
            .unwrap()
    }

    #[test]
    fn status_per_service_parent_and_none_when_already_written() {
        let ok = RouteOutcome::Accepted { problems: vec![] };
        let status = desired_status(&web(None), &ok, "2026-12-07T10:00:00Z").unwrap();
        let parents = status["parents"].as_array().unwrap();
        assert_eq!(
            parents.len(),
            1,
            "the Gateway parent is not the mesh's: {status}"
        );
        assert_eq!(parents[0]["parentRef"]["name"], "web");
        let accepted = condition(&status, "Accepted");
        assert_eq!(accepted["status"], "True");
        assert_eq!(accepted["observedGeneration"], 3);
        assert_eq!(condition(&status, "ResolvedRefs")["status"], "True");
        // Written: another agent (a later clock) computes nothing to write.
        assert_eq!(
            desired_status(&web(Some(status.clone())), &ok, "2026-12-07T11:00:00Z"),
            None
        );
        // A dropped backend: ResolvedRefs turns False at the new time, Accepted
        // keeps its time.
        let partly = RouteOutcome::Accepted {
            problems: vec!["backend web-v9.shop:80 not found".into()],
        };
        let next = desired_status(&web(Some(status)), &partly, "2026-12-07T12:00:00Z").unwrap();
        let resolved = condition(&next, "ResolvedRefs");
        assert_eq!(resolved["status"], "False");
        assert_eq!(resolved["reason"], "BackendNotFound");
        assert_eq!(resolved["lastTransitionTime"], "2026-12-07T12:00:00Z");
        assert!(resolved["message"].as_str().unwrap().contains("web-v9"));
        assert_eq!(
            condition(&next, "Accepted")["lastTransitionTime"],
            "2026-12-07T10:00:00Z"
        );
    }

    #[test]
    fn a_route_no_longer_the_meshs_loses_the_meshs_entries_only() {
        let other = serde_json::json!({"parents": [{
            "parentRef": {"name": "gw"}, "controllerName": "example.com/gateway",
            "conditions": []
        }]});
        let ok = RouteOutcome::Accepted { problems: vec![] };
        let ours = desired_status(&web(Some(other.clone())), &ok, "2026-12-07T10:00:00Z").unwrap();
        let gone = desired_status(&web(Some(ours)), &RouteOutcome::NotServed, "t").unwrap();
        assert_eq!(gone, other);
        assert_eq!(
            desired_status(&web(Some(other)), &RouteOutcome::NotServed, "t"),
            None
        );
        assert_eq!(
            desired_status(&web(None), &RouteOutcome::NotServed, "t"),
            None
        );
    }

    #[test]
    fn refused_routes_are_not_accepted_and_other_controllers_entries_stay() {
        let other = serde_json::json!({"parents": [{
            "parentRef": {"name": "gw"}, "controllerName": "example.com/gateway",
            "conditions": []
        }]});
        let long = "x".repeat(10_000);
        let status = desired_status(
            &web(Some(other)),
            &RouteOutcome::Refused(format!("spec.rules[0].filters[0]: {long}")),
            "2026-12-07T10:00:00Z",
        )
        .unwrap();
        let parents = status["parents"].as_array().unwrap();
        assert_eq!(parents.len(), 2);
        assert_eq!(parents[0]["controllerName"], "example.com/gateway");
        let accepted = condition(&status, "Accepted");
        assert_eq!(accepted["status"], "False");
        assert_eq!(accepted["reason"], "UnsupportedValue");
        let message = accepted["message"].as_str().unwrap();
        assert!(message.starts_with("spec.rules[0].filters[0]"));
        assert!(
            message.len() <= MAX_CONDITION_MESSAGE + 3,
            "{}",
            message.len()
        );
    }
}
