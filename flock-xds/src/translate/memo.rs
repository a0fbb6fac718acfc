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
    EnvoyOptions, blackhole_cluster, caller_routes, caller_service_clusters,
    capture_caller_resources, capture_listener, outbound_routes, pod_resources, secret_resource,
    service_resources,
};
use super::grpc::grpc_service_resources;
use super::model::{Mesh, Pod, Secret, Service};
use super::{Resource, sort_dedup};
use crate::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::resources::Name;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
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

/// One service's memo entry: the model translated, its own resources, and per
/// caller identity its mTLS clusters ([`caller_service_clusters`]), all made from
/// this model alone.
#[derive(Debug)]
struct ServiceMemo {
    model: Arc<Service>,
    own: Translated,
    callers: HashMap<String, Translated>,
    /// The pass that last saw the service (entries not seen by a pass are dropped).
    seen: u64,
}

/// The per-entity translation memo of one node group. See the [module docs](self).
#[derive(Debug)]
pub struct Memo {
    flavor: Flavor,
    /// The options of the last translation: the cached resources were made with them.
    opts: Option<EnvoyOptions>,
    /// By (namespace, name): unique in a valid mesh.
    pods: HashMap<(String, String), (Pod, Translated)>,
    /// By namespace, then name, so a lookup borrows the model's strings instead of
    /// allocating a key per service per publish.
    services: HashMap<String, HashMap<String, ServiceMemo>>,
    pass: u64,
}

/// Appends an entity's resources to the translation's entries.
fn push(out: &mut Entries, t: &Translated) {
    for (type_url, name, hash, any) in t.iter() {
        out.entry(type_url)
            .or_default()
            .push((name.clone(), *hash, Arc::clone(any)));
    }
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
            pass: 0,
        }
    }

    /// How many pods and services the memo holds translations of.
    pub fn len(&self) -> usize {
        self.pods.len() + self.services.values().map(HashMap::len).sum::<usize>()
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
        let services: Vec<Arc<Service>> = mesh.services.iter().cloned().map(Arc::new).collect();
        self.translate_shared(&services, &mesh.pods, &mesh.secrets, opts)
    }

    /// [`Memo::translate`] of the mesh with these services, pods and secrets, for a
    /// caller that keeps its services shared: a service passed as the same `Arc` as
    /// last time is known unchanged without comparing it (a pointer comparison instead
    /// of walking its endpoints), so a publish after one endpoint change compares
    /// O(services) pointers and translates one service. Its mTLS clusters for each
    /// caller are kept with it too. What stays O(services) per publish: the route
    /// configurations (one virtual host per service port in each) and, for captured
    /// pods, their outbound listeners.
    pub fn translate_shared(
        &mut self,
        services: &[Arc<Service>],
        pods: &[Pod],
        secrets: &[Secret],
        opts: &EnvoyOptions,
    ) -> Entries {
        if self.opts.as_ref() != Some(opts) {
            self.pods.clear();
            self.services.clear();
            self.opts = Some(opts.clone());
        }
        self.pass += 1;
        let pass = self.pass;
        let envoy = self.flavor == Flavor::Envoy;
        let mut out: Entries = [LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET]
            .into_iter()
            .map(|t| (t, Vec::new()))
            .collect();
        let mut next_pods = HashMap::new();
        if envoy {
            next_pods.reserve(pods.len());
            for pod in pods {
                let id = (pod.namespace.clone(), pod.name.clone());
                let t = match self.pods.remove(&id) {
                    Some((cached, t)) if &cached == pod => t,
                    _ => share(pod_resources(pod, opts)),
                };
                push(&mut out, &t);
                next_pods.insert(id, (pod.clone(), t));
            }
        }
        let callers: BTreeSet<&str> = if envoy {
            pods.iter()
                .filter(|p| p.outbound_port != 0)
                .filter_map(|p| p.identity.as_deref())
                .filter(|id| super::model::trust_domain(id).is_some())
                .collect()
        } else {
            BTreeSet::new()
        };
        // The mTLS cluster names per caller, for its routes.
        let mut mtls: BTreeMap<&str, HashSet<Name>> =
            callers.iter().map(|c| (*c, HashSet::new())).collect();
        for svc in services {
            let by_name = match self.services.get_mut(svc.namespace.as_str()) {
                Some(m) => m,
                None => self.services.entry(svc.namespace.clone()).or_default(),
            };
            let entry = match by_name.get_mut(svc.name.as_str()) {
                Some(e) if Arc::ptr_eq(&e.model, svc) || *e.model == **svc => {
                    e.model = Arc::clone(svc);
                    e
                }
                _ => {
                    let own = if envoy {
                        share(service_resources(svc, opts))
                    } else {
                        share(grpc_service_resources(svc, opts))
                    };
                    by_name.insert(
                        svc.name.clone(),
                        ServiceMemo {
                            model: Arc::clone(svc),
                            own,
                            callers: HashMap::new(),
                            seen: pass,
                        },
                    );
                    by_name.get_mut(svc.name.as_str()).expect("just inserted")
                }
            };
            // The same (namespace, name) twice in one pass is an invalid mesh: both
            // are translated, as a whole translation would, and the later one is kept.
            entry.seen = pass;
            push(&mut out, &entry.own);
            entry.callers.retain(|id, _| callers.contains(id.as_str()));
            for caller in &callers {
                let t = match entry.callers.get(*caller) {
                    Some(t) => Arc::clone(t),
                    None => {
                        let t = share(caller_service_clusters(caller, svc, opts));
                        entry.callers.insert((*caller).to_string(), Arc::clone(&t));
                        t
                    }
                };
                let names = mtls.get_mut(caller).expect("one set per caller");
                // Two services of one name (an invalid mesh) make the same clusters:
                // they are emitted once.
                if t.iter()
                    .any(|(ty, n, ..)| *ty == CLUSTER && names.contains(n))
                {
                    continue;
                }
                names.extend(
                    t.iter()
                        .filter(|(ty, ..)| *ty == CLUSTER)
                        .map(|(_, n, ..)| n.clone()),
                );
                push(&mut out, &t);
            }
        }
        for by_name in self.services.values_mut() {
            by_name.retain(|_, e| e.seen == pass);
        }
        self.services.retain(|_, m| !m.is_empty());
        if envoy {
            push(&mut out, &share(vec![outbound_routes(services, opts)]));
            for (caller, names) in &mtls {
                let has = |name: &str| names.contains(name);
                push(
                    &mut out,
                    &share(vec![caller_routes(caller, services, opts, &has)]),
                );
            }
            // A captured pod's outbound listener routes by the services' addresses,
            // so it changes with any service: translated every time, like the routes.
            let captured: Vec<&Pod> = pods.iter().filter(|p| p.capture.is_some()).collect();
            let capture_callers: BTreeSet<&str> = captured
                .iter()
                .filter_map(|p| p.identity.as_deref())
                .collect();
            let mut capture = Vec::with_capacity(captured.len() + 1);
            capture.extend(
                captured
                    .iter()
                    .filter_map(|p| capture_listener(p, services, opts)),
            );
            for identity in capture_callers {
                capture.extend(capture_caller_resources(identity, services, opts));
            }
            if !captured.is_empty() {
                capture.push(blackhole_cluster());
            }
            push(&mut out, &share(capture));
            push(
                &mut out,
                &share(secrets.iter().map(secret_resource).collect()),
            );
        }
        self.pods = next_pods;
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
