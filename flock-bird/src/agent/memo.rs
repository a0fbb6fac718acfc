//! The per-entity translation memo of one node group.

use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::gc::PodKey;
use flock_core::resources::Name;
use flock_xds::translate::{self, EnvoyOptions, Mesh};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// Translated resources, shared (`Arc`) so a publish copies pointers, not bytes.
type Translated = Arc<Vec<(&'static str, Name, ContentHash, Arc<Any>)>>;

/// Per-entity translation memo of one node group: a pod or service whose model did
/// not change since the last publish reuses its encoded, hashed resources, so a
/// publish costs O(entities) comparisons plus O(changed entities) encoding instead of
/// re-encoding and re-hashing the whole mesh (go-control-plane's per-change cost).
#[derive(Default)]
pub(super) struct Memo {
    pods: HashMap<PodKey, (translate::Pod, Translated)>,
    services: HashMap<(String, String), (translate::Service, Translated)>,
}

fn share(resources: Vec<translate::Resource>) -> Translated {
    Arc::new(
        resources
            .into_iter()
            .map(|r| (r.type_url, Name::from(r.name), r.hash, Arc::new(r.any)))
            .collect(),
    )
}

pub(super) type Entries = BTreeMap<&'static str, Vec<(Name, ContentHash, Arc<Any>)>>;

impl Memo {
    /// Every resource of the group for `mesh`, per type (the five xDS types always
    /// present, so `replace_type` removes what went away). Same output as
    /// `translate::envoy_resources` / `grpc_resources`.
    pub(super) fn translate(
        &mut self,
        envoy: bool,
        mesh: &Mesh,
        pod_keys: &[PodKey],
        opts: &EnvoyOptions,
    ) -> Entries {
        use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET};
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
        let mut pods = HashMap::with_capacity(mesh.pods.len());
        if envoy {
            for (key, pod) in pod_keys.iter().zip(&mesh.pods) {
                let t = match self.pods.remove(key) {
                    Some((cached, t)) if &cached == pod => t,
                    _ => share(translate::pod_resources(pod, opts)),
                };
                push(&t);
                pods.insert(key.clone(), (pod.clone(), t));
            }
        }
        let mut services = HashMap::with_capacity(mesh.services.len());
        for svc in &mesh.services {
            let id = (svc.namespace.clone(), svc.name.clone());
            let t = match self.services.remove(&id) {
                Some((cached, t)) if &cached == svc => t,
                _ if envoy => share(translate::service_resources(svc)),
                _ => share(translate::grpc_service_resources(svc)),
            };
            push(&t);
            services.insert(id, (svc.clone(), t));
        }
        if envoy {
            push(&share(vec![translate::outbound_routes(
                &mesh.services,
                opts,
            )]));
            let callers: BTreeSet<&str> = mesh
                .pods
                .iter()
                .filter(|p| p.outbound_port != 0)
                .filter_map(|p| p.identity.as_deref())
                .collect();
            for identity in callers {
                push(&share(translate::caller_resources(
                    identity,
                    &mesh.services,
                    opts,
                )));
            }
            push(&share(
                mesh.secrets
                    .iter()
                    .map(translate::secret_resource)
                    .collect(),
            ));
        }
        self.pods = pods;
        self.services = services;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(entries: &Entries) -> Vec<(String, String, ContentHash)> {
        entries
            .iter()
            .flat_map(|(t, list)| {
                list.iter()
                    .map(move |(n, h, _)| (t.to_string(), n.to_string(), *h))
            })
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    fn full(resources: Vec<translate::Resource>) -> Vec<(String, String, ContentHash)> {
        resources
            .into_iter()
            .map(|r| (r.type_url.to_string(), r.name, r.hash))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The memo gives exactly what the whole-mesh translation gives, before and after
    /// a change, for both groups.
    #[test]
    fn the_translation_memo_equals_the_full_translation() {
        let mesh = |port: u16| {
            Mesh::from_json(
                format!(
                    r#"{{"services": [{{"name": "web", "ports": [{{"port": 8080}}, {{"port": 9090, "protocol": "grpc"}}],
                        "endpoints": [{{"address": "10.0.0.1", "port": 15006}}, {{"address": "10.0.0.2", "port": {port}}}]}}],
                       "pods": [{{"name": "a", "ip": "10.0.0.1", "netns": "/run/netns/a", "inbound": [{{"app_port": 8080, "listen_port": 15006}}]}},
                                {{"name": "b", "ip": "10.0.0.2", "netns": "/run/netns/b", "inbound": [{{"app_port": 8080, "listen_port": {port}}}]}}]}}"#
                )
                .as_bytes(),
            )
            .unwrap()
        };
        let keys = [PodKey::new("a", "eth0"), PodKey::new("b", "eth0")];
        let opts = EnvoyOptions::default();
        let mut envoy = Memo::default();
        let mut grpc = Memo::default();
        for port in [15006, 15007, 15007] {
            let m = mesh(port);
            assert_eq!(
                flat(&envoy.translate(true, &m, &keys, &opts)),
                full(translate::envoy_resources(&m, &opts))
            );
            assert_eq!(
                flat(&grpc.translate(false, &m, &keys, &opts)),
                full(translate::grpc_resources(&m))
            );
        }
        assert_eq!(envoy.pods.len(), 2);
    }
}
