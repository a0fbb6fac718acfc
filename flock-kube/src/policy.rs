//! flock's `AuthorizationPolicy` custom resource (`flock.io/v1alpha1`, namespaced; the
//! CRD is `deploy/authorizationpolicy-crd.yaml`) and its mapping to the agent's
//! policies by target (pure).
//!
//! The object's `spec` is a policy document, the same as a policy file's
//! ([`flock_core::authz::PolicySpec`]): `service` (absent: the whole namespace),
//! `default`, `rules`. The namespace is the object's. The spec is kept as raw JSON and
//! checked here, one object at a time, by the same parser as a file: the CRD's schema
//! is the API server's first check, not the only one (an object written before the
//! schema tightened, or to a server that skips it, is checked all the same), and a bad
//! object refuses only what it names.
//!
//! Fail closed:
//! * an object whose spec does not parse or check refuses every call to what it names
//!   (its `spec.service` when that is a readable service name, else its namespace:
//!   what it governs cannot be told, so the widest thing it could govern is refused);
//! * two objects naming the same target refuse that target, naming both: which one an
//!   operator meant cannot be told.

use std::collections::BTreeMap;

use flock_core::authz::{PolicyError, Sourced, Target};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// One `AuthorizationPolicy` object: its metadata and its spec as written.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AuthorizationPolicy {
    /// The object's metadata (its namespace is the policy's).
    pub metadata: ObjectMeta,
    /// The policy document, unparsed.
    #[serde(default)]
    pub spec: serde_json::Value,
}

impl k8s_openapi::Resource for AuthorizationPolicy {
    const API_VERSION: &'static str = "flock.io/v1alpha1";
    const GROUP: &'static str = "flock.io";
    const KIND: &'static str = "AuthorizationPolicy";
    const VERSION: &'static str = "v1alpha1";
    const URL_PATH_SEGMENT: &'static str = "authorizationpolicies";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for AuthorizationPolicy {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The target `spec` names in `namespace`: its `service` when that is a service name,
/// the namespace when it names none, and the namespace too when `service` is there but
/// unreadable (see the [module docs](self)).
pub fn target_of(namespace: &str, spec: &serde_json::Value) -> Target {
    let service = spec
        .get("service")
        .and_then(serde_json::Value::as_str)
        .filter(|s| Target::from_file_name(&format!("{namespace}.{s}.json")).is_some());
    Target {
        namespace: namespace.to_string(),
        service: service.map(str::to_string),
    }
}

/// What `objects` ((namespace, name) → object) put in force, by target: each object's
/// policy or refusal, and a refusal naming both for a target two objects name.
pub fn policies_by_target<'a>(
    objects: impl IntoIterator<Item = (&'a (String, String), &'a AuthorizationPolicy)>,
) -> BTreeMap<Target, Sourced> {
    let mut named: BTreeMap<Target, Vec<&'a str>> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for ((namespace, name), object) in objects {
        let target = target_of(namespace, &object.spec);
        let origin = format!("AuthorizationPolicy {namespace}/{name}");
        let names = named.entry(target.clone()).or_default();
        names.push(name);
        if names.len() > 1 {
            let list = names.join(", ");
            out.insert(
                target.clone(),
                Sourced {
                    origin: format!("AuthorizationPolicy {namespace}/{{{list}}}"),
                    written: Err(PolicyError {
                        field: "spec.service".to_string(),
                        reason: format!(
                            "{} AuthorizationPolicies ({list}) govern {target}; one target takes one policy",
                            names.len()
                        ),
                    }),
                },
            );
            continue;
        }
        // The spec as a document: a spec that is not an object is refused by the
        // parser with its own message (`null`: no spec at all).
        let bytes = serde_json::to_vec(&object.spec).unwrap_or_default();
        out.insert(target.clone(), Sourced::read(origin, &target, &bytes));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(
        ns: &str,
        name: &str,
        spec: serde_json::Value,
    ) -> ((String, String), AuthorizationPolicy) {
        (
            (ns.to_string(), name.to_string()),
            AuthorizationPolicy {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    namespace: Some(ns.to_string()),
                    ..Default::default()
                },
                spec,
            },
        )
    }

    fn target(ns: &str, svc: Option<&str>) -> Target {
        Target {
            namespace: ns.to_string(),
            service: svc.map(str::to_string),
        }
    }

    #[test]
    fn an_object_governs_its_namespace_or_the_service_its_spec_names() {
        let objects = BTreeMap::from([
            object("default", "ns-wide", json!({"default": "deny"})),
            object(
                "default",
                "web",
                json!({"service": "web", "rules": [{"action": "allow", "from": {"serviceAccounts": ["default/a"]}}]}),
            ),
        ]);
        let by_target = policies_by_target(&objects);
        assert_eq!(by_target.len(), 2);
        let ns = &by_target[&target("default", None)];
        assert_eq!(ns.origin, "AuthorizationPolicy default/ns-wide");
        assert!(ns.written.is_ok(), "{ns:?}");
        let web = &by_target[&target("default", Some("web"))];
        let spec = web.written.as_ref().expect("web's policy checks");
        assert_eq!(spec.namespace.as_deref(), Some("default"));
        assert_eq!(spec.rules.len(), 1);
    }

    #[test]
    fn a_bad_spec_refuses_what_it_names_and_nothing_else() {
        let objects = BTreeMap::from([
            object("default", "typo", json!({"service": "web", "rulez": []})),
            object(
                "default",
                "api",
                json!({"service": "api", "default": "deny"}),
            ),
        ]);
        let by_target = policies_by_target(&objects);
        let web = &by_target[&target("default", Some("web"))];
        let e = web
            .written
            .as_ref()
            .expect_err("an unknown field is refused");
        assert!(e.to_string().contains("rulez"), "{e}");
        assert!(by_target[&target("default", Some("api"))].written.is_ok());
    }

    #[test]
    fn an_unreadable_service_name_refuses_the_whole_namespace() {
        for spec in [json!({"service": 7}), json!({"service": "Not_A_Label"})] {
            let objects = BTreeMap::from([object("shop", "odd", spec.clone())]);
            let by_target = policies_by_target(&objects);
            let ns = by_target
                .get(&target("shop", None))
                .unwrap_or_else(|| panic!("{spec} governs the namespace: {by_target:?}"));
            assert!(ns.written.is_err(), "{spec}: {ns:?}");
        }
    }

    #[test]
    fn a_spec_naming_another_namespace_is_refused() {
        let objects = BTreeMap::from([object("shop", "x", json!({"namespace": "bank"}))]);
        let by_target = policies_by_target(&objects);
        assert!(by_target[&target("shop", None)].written.is_err());
        assert!(!by_target.contains_key(&target("bank", None)));
    }

    #[test]
    fn two_objects_for_one_target_refuse_it_naming_both() {
        let objects = BTreeMap::from([
            object(
                "default",
                "one",
                json!({"service": "web", "default": "deny"}),
            ),
            object(
                "default",
                "two",
                json!({"service": "web", "default": "all-authenticated"}),
            ),
        ]);
        let by_target = policies_by_target(&objects);
        let web = &by_target[&target("default", Some("web"))];
        let e = web.written.as_ref().expect_err("a conflict fails closed");
        assert!(e.reason.contains("one, two"), "{e}");
        assert_eq!(web.origin, "AuthorizationPolicy default/{one, two}");
    }

    #[test]
    fn a_missing_or_non_object_spec_is_refused() {
        for spec in [serde_json::Value::Null, json!("deny"), json!([1])] {
            let objects = BTreeMap::from([object("default", "x", spec.clone())]);
            let by_target = policies_by_target(&objects);
            assert!(
                by_target[&target("default", None)].written.is_err(),
                "{spec}"
            );
        }
    }
}
