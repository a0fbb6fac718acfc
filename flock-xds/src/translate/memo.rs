//! Incremental translation: a per-entity memo, and the whole-mesh translations
//! ([`envoy_resources`](super::envoy_resources), [`grpc_resources`](super::grpc_resources))
//! built on it.
//!
//! A control plane re-publishes the whole mesh on every change, but between two
//! publishes most pods and services are unchanged. A [`Memo`] keeps, per pod and per
//! service, the model it last translated and the encoded, hashed resources it gave; a
//! pod or service whose model is equal reuses them (shared `Arc`s, no re-encoding and
//! no re-hashing). A publish then costs O(entities) comparisons plus O(changed
//! entities) encoding, instead of re-encoding the whole mesh (go-control-plane's
//! per-change cost). The routes shared by every pod, the per-caller mTLS resources
//! and the secrets depend on the whole mesh and are translated every time.
//!
//! The one-shot translations run a fresh memo, so there is one translation, not a
//! memoized copy kept equal to it by a test. A memo's translations also depend on
//! the options (the local locality, timeouts): a call with options different from
//! the previous call's starts over.

use super::envoy::{
    EnvoyOptions, blackhole_cluster, caller_resources, capture_caller_resources, capture_listener,
    outbound_routes, pod_resources, secret_resource, service_resources,
};
use super::grpc::grpc_service_resources;
use super::model::{Mesh, Pod, Service};
use super::{Resource, sort_dedup};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::resources::Name;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// Which node group a memo translates for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flavor {
    /// The node-local Envoy: pods' listeners and clusters, services, routes, mTLS
    /// clusters, secrets (as [`envoy_resources`](super::envoy_resources)).
    Envoy,
    /// Proxyless gRPC clients: services only (as
    /// [`grpc_resources`](super::grpc_resources)).
    Grpc,
}

/// The resources of one translation, per type URL: `(name, hash, resource)` in the
/// shape [`ResourceSetBuilder::replace_type`](flock_core::resources::ResourceSetBuilder::replace_type)
/// takes. The five xDS types are always present (possibly empty), so replacing each
/// removes what went away.
pub type Entries = BTreeMap<&'static str, Vec<(Name, ContentHash, Arc<Any>)>>;

/// One entity's translated resources, shared (`Arc`) so reuse copies pointers, not
/// bytes.
type Translated = Arc<Vec<(&'static str, Name, ContentHash, Arc<Any>)>>;

/// The per-entity translation memo of one node group. See the [module docs](self).
#[derive(Debug)]
pub struct Memo {
    flavor: Flavor,
    /// The options of the last translation: the cached resources were made with them.
    opts: Option<EnvoyOptions>,
    /// By (namespace, name): unique in a valid mesh.
    pods: HashMap<(String, String), (Pod, Translated)>,
    services: HashMap<(String, String), (Service, Translated)>,
}

fn share(resources: Vec<Resource>) -> Translated {
    Arc::new(
        resources
            .into_iter()
            .map(|r| (r.type_url, Name::from(r.name), r.hash, Arc::new(r.any)))
            .collect(),
    )
}

impl Memo {
    /// An empty memo for `flavor`.
    pub fn new(flavor: Flavor) -> Self {
        Self {
            flavor,
            opts: None,
            pods: HashMap::new(),
            services: HashMap::new(),
        }
    }

    /// How many pods and services the memo holds translations of.
    pub fn len(&self) -> usize {
        self.pods.len() + self.services.len()
    }

    /// Whether the memo holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every resource of the group for `mesh`, reusing the resources of each pod and
    /// service whose model equals the one translated last time. The memo then holds
    /// exactly `mesh`'s pods and services (what went away is forgotten). Nothing is
    /// reused if `opts` differ from the last call's.
    pub fn translate(&mut self, mesh: &Mesh, opts: &EnvoyOptions) -> Entries {
        if self.opts.as_ref() != Some(opts) {
            self.pods.clear();
            self.services.clear();
            self.opts = Some(opts.clone());
        }
        let envoy = self.flavor == Flavor::Envoy;
        let mut out: Entries = [LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET]
            .into_iter()
            .map(|t| (t, Vec::new()))
            .collect();
        let mut push = |t: &Translated| {
            for (type_url, name, hash, any) in t.iter() {
                out.entry(type_url)
                    .or_default()
                    .push((name.clone(), *hash, Arc::clone(any)));
            }
        };
        let mut pods = HashMap::new();
        if envoy {
            pods.reserve(mesh.pods.len());
            for pod in &mesh.pods {
                let id = (pod.namespace.clone(), pod.name.clone());
                let t = match self.pods.remove(&id) {
                    Some((cached, t)) if &cached == pod => t,
                    _ => share(pod_resources(pod, opts)),
                };
                push(&t);
                pods.insert(id, (pod.clone(), t));
            }
        }
        let mut services = HashMap::with_capacity(mesh.services.len());
        for svc in &mesh.services {
            let id = (svc.namespace.clone(), svc.name.clone());
            let t = match self.services.remove(&id) {
                Some((cached, t)) if &cached == svc => t,
                _ if envoy => share(service_resources(svc, opts)),
                _ => share(grpc_service_resources(svc, opts)),
            };
            push(&t);
            services.insert(id, (svc.clone(), t));
        }
        if envoy {
            push(&share(vec![outbound_routes(&mesh.services, opts)]));
            let callers: BTreeSet<&str> = mesh
                .pods
                .iter()
                .filter(|p| p.outbound_port != 0)
                .filter_map(|p| p.identity.as_deref())
                .collect();
            for identity in callers {
                push(&share(caller_resources(identity, &mesh.services, opts)));
            }
            // A captured pod's outbound listener routes by the services' addresses,
            // so it changes with any service: translated every time, like the routes.
            let captured: Vec<&Pod> = mesh.pods.iter().filter(|p| p.capture.is_some()).collect();
            let capture_callers: BTreeSet<&str> = captured
                .iter()
                .filter_map(|p| p.identity.as_deref())
                .collect();
            let mut capture = Vec::with_capacity(captured.len() + 1);
            capture.extend(
                captured
                    .iter()
                    .filter_map(|p| capture_listener(p, &mesh.services, opts)),
            );
            for identity in capture_callers {
                capture.extend(capture_caller_resources(identity, &mesh.services, opts));
            }
            if !captured.is_empty() {
                capture.push(blackhole_cluster());
            }
            push(&share(capture));
            push(&share(mesh.secrets.iter().map(secret_resource).collect()));
        }
        self.pods = pods;
        self.services = services;
        out
    }
}

/// A whole translation with a fresh memo, as a sorted list of owned resources.
pub(crate) fn translate_once(flavor: Flavor, mesh: &Mesh, opts: &EnvoyOptions) -> Vec<Resource> {
    // The memo is dropped before the resources are taken out of their `Arc`s, so each
    // is held once and moved, not copied.
    let entries = Memo::new(flavor).translate(mesh, opts);
    let mut out = Vec::new();
    for (type_url, list) in entries {
        for (name, hash, any) in list {
            out.push(Resource {
                type_url,
                name: name.to_string(),
                hash,
                any: Arc::try_unwrap(any).unwrap_or_else(|shared| (*shared).clone()),
            });
        }
    }
    sort_dedup(out)
}
