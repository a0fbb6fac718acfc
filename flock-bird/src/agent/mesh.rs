//! The translation model: services from the registry view, pods from the live table,
//! secrets from the identity view.

use super::Agent;
use crate::model::{Health, OUTBOUND_PORT, Protocol};
use crate::registry::View;
use flock_core::sync::lock;
use flock_xds::translate::{self, Mesh};
use std::collections::BTreeMap;

impl Agent {
    /// Builds the mesh from the live pods and the registry view.
    pub(super) fn mesh(&self, view: &View) -> Mesh {
        let mut services: BTreeMap<(String, String), translate::Service> = BTreeMap::new();
        for ep in view.endpoints.values() {
            let svc = services
                .entry((ep.namespace.clone(), ep.service.clone()))
                .or_insert_with(|| translate::Service {
                    name: ep.service.clone(),
                    namespace: ep.namespace.clone(),
                    ports: Vec::new(),
                    endpoints: Vec::new(),
                });
            if !svc.ports.iter().any(|p| p.port == ep.service_port) {
                svc.ports.push(translate::ServicePort {
                    name: None,
                    port: ep.service_port,
                    protocol: xlate_protocol(ep.protocol),
                });
            }
            svc.endpoints.push(translate::Endpoint {
                address: ep.address,
                port: ep.port,
                locality: translate::Locality {
                    region: ep.region.clone(),
                    zone: ep.zone.clone(),
                    sub_zone: String::new(),
                },
                health: match ep.health {
                    Health::Healthy => translate::Health::Healthy,
                    Health::Unhealthy => translate::Health::Unhealthy,
                },
                weight: 1,
                service_port: Some(ep.service_port),
                identity: ep.identity.clone(),
            });
        }
        let mut mesh = Mesh::default();
        for mut svc in services.into_values() {
            svc.ports.sort_by_key(|p| p.port);
            svc.endpoints
                .sort_by_key(|e| (e.service_port, e.address, e.port));
            svc.endpoints
                .dedup_by_key(|e| (e.service_port, e.address, e.port));
            let one = Mesh {
                services: vec![svc],
                ..Mesh::default()
            };
            match one.validate() {
                Ok(()) => mesh.services.extend(one.services),
                Err(errors) => tracing::warn!(
                    service = %one.services[0].name,
                    "registry entries of this service are inconsistent; not served: {}",
                    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
                ),
            }
        }
        let identity = self.identity_view();
        if let Some(view) = &identity {
            // Certificates named by SPIFFE ID, bundles by trust domain (the names the
            // translation's TLS contexts refer to).
            for svid in view.svids.values() {
                mesh.secrets.push(translate::Secret {
                    name: svid.spiffe_id.clone(),
                    kind: translate::SecretKind::TlsCertificate {
                        certificate_chain_pem: svid.cert_chain_pem.clone(),
                        private_key_pem: translate::PrivateKeyPem(
                            svid.private_key_pem.expose().to_string(),
                        ),
                    },
                });
            }
            for bundle in view.bundles.values() {
                mesh.secrets.push(translate::Secret {
                    name: bundle.trust_domain.clone(),
                    kind: translate::SecretKind::ValidationContext {
                        trusted_ca_pem: bundle.ca_pem.clone(),
                    },
                });
            }
        }
        for rec in self.pods.snapshot().into_values() {
            // Envoy refuses a whole listener update if one netns path is missing:
            // a pod whose namespace is gone (DEL never came) is left to the GC.
            if lock(&self.netns_missing).contains(&rec.key) {
                tracing::debug!(pod = %rec.pod_ref(), netns = %rec.netns, "netns missing; pod not served");
                continue;
            }
            let pod = translate::Pod {
                name: rec.name.clone(),
                namespace: rec.namespace.clone(),
                uid: (!rec.uid.is_empty()).then(|| rec.uid.clone()),
                ip: rec.ips[0],
                netns: Some(rec.netns.clone()),
                inbound: rec
                    .ports
                    .iter()
                    .map(|p| translate::InboundPort {
                        app_port: p.app_port,
                        listen_port: p.listen_port,
                        protocol: xlate_protocol(p.protocol),
                    })
                    .collect(),
                outbound_port: OUTBOUND_PORT,
                identity: identity
                    .as_ref()
                    .and_then(|v| v.svid_of(&rec.key))
                    .map(|s| s.spiffe_id.clone()),
            };
            let one = Mesh {
                pods: vec![pod],
                ..Mesh::default()
            };
            match one.validate() {
                Ok(()) => {
                    mesh.pods.extend(one.pods);
                }
                Err(errors) => tracing::warn!(
                    pod = %rec.pod_ref(),
                    "pod not served: {}",
                    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
                ),
            }
        }
        mesh
    }
}

pub(super) fn xlate_protocol(p: Protocol) -> translate::Protocol {
    match p {
        Protocol::Http => translate::Protocol::Http,
        Protocol::Grpc => translate::Protocol::Grpc,
        Protocol::Tcp => translate::Protocol::Tcp,
    }
}
