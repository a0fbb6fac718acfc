//! The translation model: services from the registry view, pods from the live table,
//! secrets from the identity view. The conversions are pure functions, so a test can
//! check that every pod the validator admits becomes a pod and a service the
//! translation accepts.

use super::podinputs::PodInputs;
use super::{Agent, AgentConfig};
use crate::identity::IdentityView;
use crate::model::{Endpoint, Health, OUTBOUND_PORT, PodRecord};
use crate::registry::View;
use flock_core::authz::{Sourced, Target};
use flock_core::journal::Snapshot;
use flock_core::pod::MAX_PORTS;
use flock_core::registry::Reject;
use flock_xds::translate::{self, Mesh};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The registry endpoints a pod registers, one per app port, placed on this node.
pub fn endpoints(
    rec: &PodRecord,
    node: &AgentConfig,
    health: Health,
    identity: Option<&str>,
) -> Vec<Endpoint> {
    // A validated record always has an IP; a record without one registers nothing.
    let Some(address) = rec.ip() else {
        return Vec::new();
    };
    rec.ports
        .iter()
        .map(|p| Endpoint {
            service: rec.service.clone(),
            namespace: rec.namespace.clone(),
            service_port: p.app_port,
            protocol: p.protocol,
            address,
            port: p.dialled_port(),
            node: node.node_name.clone(),
            pod: rec.pod_ref(),
            pod_key: rec.key.clone(),
            region: node.region.clone(),
            zone: node.zone.clone(),
            health,
            identity: identity.map(str::to_string),
            // A pod has one identity.
            also_accept: Vec::new(),
            labels: rec.labels.clone(),
        })
        .collect()
}

/// The registry endpoints the agent serves, and the keys it leaves out by a rule
/// that needs the whole view (each entry was already checked on its own by the
/// registry backend):
///
/// * never downgrade ([`Reject::Downgrade`]): a service port (namespace, service,
///   port) where any endpoint has an identity is mTLS, and its endpoints without one
///   are left out. Mixing must not switch the port's callers to plaintext: one
///   identity-less registry entry would otherwise turn off encryption and peer
///   verification for every caller of the port. (The translation applies the same
///   rule, [`translate::port_endpoints`]; filtering here lets the agent name and
///   count each excluded key.)
/// * the port cap ([`Reject::TooManyPorts`]): the translation refuses a service with
///   more than [`MAX_PORTS`] ports, so entries of the ports beyond the lowest
///   [`MAX_PORTS`] are left out instead of the whole service.
///
/// With both, every service [`service_models`] forms from the result passes the
/// model's validation.
pub fn serving_endpoints(view: &View) -> (Vec<&Endpoint>, BTreeMap<String, Reject>) {
    serving_of(
        view.endpoints
            .iter()
            .map(|(k, e)| (k.as_str(), &*e.endpoint)),
    )
}

/// [`serving_endpoints`] of the endpoints `eps` yields (by key, each key once).
pub(crate) fn serving_of<'a>(
    eps: impl Iterator<Item = (&'a str, &'a Endpoint)> + Clone,
) -> (Vec<&'a Endpoint>, BTreeMap<String, Reject>) {
    let mtls: BTreeSet<(&str, &str, u16)> = eps
        .clone()
        .filter(|(_, e)| e.identity.is_some())
        .map(|(_, e)| (e.namespace.as_str(), e.service.as_str(), e.service_port))
        .collect();
    let mut ports: BTreeMap<(&str, &str), BTreeSet<u16>> = BTreeMap::new();
    for (_, e) in eps.clone() {
        ports
            .entry((e.namespace.as_str(), e.service.as_str()))
            .or_default()
            .insert(e.service_port);
    }
    let mut kept = Vec::with_capacity(eps.size_hint().0);
    let mut excluded = BTreeMap::new();
    for (key, e) in eps {
        let svc = (e.namespace.as_str(), e.service.as_str());
        let allowed = ports
            .get(&svc)
            .is_some_and(|p| p.iter().take(MAX_PORTS).any(|p| *p == e.service_port));
        if !allowed {
            excluded.insert(key.to_string(), Reject::TooManyPorts);
        } else if e.identity.is_none() && mtls.contains(&(svc.0, svc.1, e.service_port)) {
            excluded.insert(key.to_string(), Reject::Downgrade);
        } else {
            kept.push(e);
        }
    }
    (kept, excluded)
}

/// [`serving_of`] for the endpoints of one service (the service table re-derives one
/// service per change): the same rules over sorted port lists instead of sets keyed
/// by (namespace, name, port), whose every insert compared the two names again.
pub(crate) fn serving_of_one<'a>(
    eps: impl Iterator<Item = (&'a str, &'a Endpoint)> + Clone,
) -> (Vec<&'a Endpoint>, BTreeMap<String, Reject>) {
    let sorted = |ports: &mut Vec<u16>| {
        ports.sort_unstable();
        ports.dedup();
    };
    // The lowest MAX_PORTS ports are served.
    let mut ports: Vec<u16> = eps.clone().map(|(_, e)| e.service_port).collect();
    sorted(&mut ports);
    ports.truncate(MAX_PORTS);
    let mut mtls: Vec<u16> = eps
        .clone()
        .filter(|(_, e)| e.identity.is_some())
        .map(|(_, e)| e.service_port)
        .collect();
    sorted(&mut mtls);
    let mut kept = Vec::with_capacity(eps.size_hint().0);
    let mut excluded = BTreeMap::new();
    for (key, e) in eps {
        if ports.binary_search(&e.service_port).is_err() {
            excluded.insert(key.to_string(), Reject::TooManyPorts);
        } else if e.identity.is_none() && mtls.binary_search(&e.service_port).is_ok() {
            excluded.insert(key.to_string(), Reject::Downgrade);
        } else {
            kept.push(e);
        }
    }
    (kept, excluded)
}

/// The services the registry's endpoints form, by (namespace, name): ports and
/// endpoints sorted, duplicate endpoints dropped. Not validated (see [`Agent`]'s
/// publish, which serves each valid service and logs the others).
pub fn service_models<'a>(eps: impl IntoIterator<Item = &'a Endpoint>) -> Vec<translate::Service> {
    // Keyed by the endpoints' own strings: a service's name is copied once, not once
    // per endpoint.
    let mut services: BTreeMap<(&str, &str), translate::Service> = BTreeMap::new();
    for ep in eps {
        let svc = services
            .entry((ep.namespace.as_str(), ep.service.as_str()))
            .or_insert_with(|| translate::Service {
                name: ep.service.clone(),
                namespace: ep.namespace.clone(),
                ports: Vec::new(),
                endpoints: Vec::new(),
                vips: Vec::new(),
                routes: Vec::new(),
                pool: None,
            });
        if !svc.ports.iter().any(|p| p.port == ep.service_port) {
            svc.ports.push(translate::ServicePort {
                name: None,
                port: ep.service_port,
                protocol: ep.protocol,
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
            health: ep.health,
            weight: 1,
            service_port: Some(ep.service_port),
            identity: ep.identity.clone(),
            also_accept: ep.also_accept.clone(),
            labels: ep.labels.clone(),
        });
    }
    services
        .into_values()
        .map(|mut svc| {
            svc.ports.sort_by_key(|p| p.port);
            svc.endpoints
                .sort_by_key(|e| (e.service_port, e.address, e.port));
            svc.endpoints
                .dedup_by_key(|e| (e.service_port, e.address, e.port));
            // The lists are kept for as long as the service is unchanged: a list grown
            // by doubling would hold up to twice its endpoints' size.
            svc.endpoints.shrink_to_fit();
            svc.ports.shrink_to_fit();
            svc
        })
        .collect()
}

/// A live pod as the translation sees it: its listeners bind its first IP in its
/// network namespace, and a captured record's mode and mark become its
/// [`translate::Pod::capture`] (none: the output is the same as before capture
/// existed). `None` for a record without an IP (the validator refuses one).
pub fn pod_model(
    rec: &PodRecord,
    identity: Option<String>,
    policies: &PodPolicies,
) -> Option<translate::Pod> {
    let authz = policies.inputs(rec);
    Some(translate::Pod {
        name: rec.name.clone(),
        namespace: rec.namespace.clone(),
        uid: (!rec.uid.is_empty()).then(|| rec.uid.clone()),
        ip: rec.ip()?,
        netns: Some(rec.netns.clone()),
        inbound: rec
            .ports
            .iter()
            .map(|p| translate::InboundPort {
                app_port: p.app_port,
                listen_port: p.dialled_port(),
                protocol: p.protocol,
                authz: authz.as_ref().map(|inputs| inputs.of_port(p.app_port)),
                proxyless: p.proxyless,
            })
            .collect(),
        outbound_port: OUTBOUND_PORT,
        identity,
        capture: rec.capture.as_ref().map(|c| translate::Capture {
            mode: match c.mode {
                flock_core::capture::Mode::Strict => translate::CaptureMode::Strict,
                flock_core::capture::Mode::Permissive => translate::CaptureMode::Permissive,
            },
            mark: c.mark,
        }),
    })
}

/// The authorization policies that govern one pod: its namespace's, and for each of
/// its ports the policy of the Service that port serves (as the agent's core holds
/// them; the pod's own annotation is in its record).
///
/// Which Service a port serves: in annotation mode the record's service, for every
/// port (its app port is the service port a rule's `to.ports` names); in kube mode the
/// memberships ([`flock_core::authz::PortService`]), so `to.ports` names the Service's
/// port. A port behind two Services under different policies (one Service's policy
/// against another's, or one's against none, which is the namespace's) is refused,
/// naming both: which the caller addressed cannot be told at the pod (fail closed).
#[derive(Clone, Debug, Default)]
pub struct PodPolicies {
    /// The namespace's policy.
    pub namespace: Option<Arc<Sourced>>,
    /// Kube mode's memberships the ports were read from (`None`: annotation mode).
    services: Option<Arc<Vec<flock_core::authz::PortService>>>,
    /// Per pod port: the service ports it serves and its Services' policy.
    ports: BTreeMap<u16, PortPolicy>,
}

/// One pod port's Services and the policy they put on it.
#[derive(Clone, Debug, Default)]
struct PortPolicy {
    service_ports: BTreeSet<u16>,
    policy: ServicePolicy,
    /// The Services' policy target the port's denials are counted under
    /// (`namespace/service`, `namespace/{a, b}` for a conflict); empty: none.
    service_target: String,
}

#[derive(Clone, Debug, Default)]
enum ServicePolicy {
    /// No Service policy: the namespace's governs.
    #[default]
    None,
    /// The one policy of the port's Services.
    One(Arc<Sourced>),
    /// Services under different policies: refused, with why.
    Conflict(String),
}

/// The translation's inputs of one pod: its namespace's policy and annotation, and
/// each port's.
struct PolicyInputs {
    namespace: Option<translate::PolicyInput>,
    annotation: Option<translate::PolicyInput>,
    ports: BTreeMap<u16, (BTreeSet<u16>, Option<translate::PolicyInput>, String)>,
    /// What a port without a Service policy counts its denials under: the namespace's
    /// policy, or the pod's annotation when only that governs.
    fallback_target: String,
}

impl PolicyInputs {
    fn of_port(&self, app_port: u16) -> translate::InboundAuthz {
        let (service_ports, service_policy, target) = self
            .ports
            .get(&app_port)
            .cloned()
            .unwrap_or_else(|| (BTreeSet::from([app_port]), None, String::new()));
        let governed_by = if service_policy.is_some() {
            target
        } else {
            self.fallback_target.clone()
        };
        translate::InboundAuthz {
            service_ports,
            namespace_policy: self.namespace.clone(),
            service_policy,
            annotation: self.annotation.clone(),
            governed_by,
        }
    }
}

fn sourced_input(p: &Arc<Sourced>) -> translate::PolicyInput {
    match &p.written {
        Ok(spec) => translate::PolicyInput::Spec(spec.clone()),
        Err(e) => translate::PolicyInput::Refused(format!("{}: {e}", p.origin)),
    }
}

impl PodPolicies {
    /// The policies of `rec`'s pod in `policies`; `services`: its ports' Services
    /// from outside the record (kube mode), `None` in annotation mode.
    pub fn of(
        rec: &PodRecord,
        policies: &Snapshot<Target, Arc<Sourced>>,
        services: Option<&Arc<Vec<flock_core::authz::PortService>>>,
    ) -> Self {
        let target = |service: &str| Target {
            namespace: rec.namespace.clone(),
            service: (!service.is_empty()).then(|| service.to_string()),
        };
        let namespace = policies.get(&target("")).cloned();
        let mut ports = BTreeMap::new();
        match services {
            Some(services) if rec.service.is_empty() => {
                let mut fronting: BTreeMap<u16, BTreeMap<&str, BTreeSet<u16>>> = BTreeMap::new();
                for s in services.iter() {
                    fronting
                        .entry(s.app_port)
                        .or_default()
                        .entry(&s.service)
                        .or_default()
                        .insert(s.service_port);
                }
                for (app_port, by_service) in fronting {
                    let named: Vec<(&str, Option<&Arc<Sourced>>)> = by_service
                        .keys()
                        .map(|svc| (*svc, policies.get(&target(svc))))
                        .collect();
                    let first = named[0].1;
                    let agree = named.iter().all(|(_, p)| match (p, first) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        (None, None) => true,
                        _ => false,
                    });
                    let service_target = if agree {
                        target(named[0].0).to_string()
                    } else {
                        format!(
                            "{}/{{{}}}",
                            rec.namespace,
                            named.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(", ")
                        )
                    };
                    let policy = match (agree, first) {
                        (true, None) => ServicePolicy::None,
                        (true, Some(p)) => ServicePolicy::One(Arc::clone(p)),
                        (false, _) => ServicePolicy::Conflict(format!(
                            "pod port {app_port} serves Services {} under different policies ({}); \
                             one policy must govern a port",
                            named.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(", "),
                            named
                                .iter()
                                .map(|(s, p)| match p {
                                    Some(p) => format!("{s}: {}", p.origin),
                                    None => format!("{s}: none"),
                                })
                                .collect::<Vec<_>>()
                                .join("; ")
                        )),
                    };
                    let service_ports = by_service.into_values().flatten().collect();
                    ports.insert(
                        app_port,
                        PortPolicy {
                            service_ports,
                            policy,
                            service_target,
                        },
                    );
                }
            }
            _ => {
                let policy = match policies.get(&target(&rec.service)) {
                    Some(p) if !rec.service.is_empty() => ServicePolicy::One(Arc::clone(p)),
                    _ => ServicePolicy::None,
                };
                for p in &rec.ports {
                    ports.insert(
                        p.app_port,
                        PortPolicy {
                            service_ports: BTreeSet::from([p.app_port]),
                            policy: policy.clone(),
                            service_target: target(&rec.service).to_string(),
                        },
                    );
                }
            }
        }
        PodPolicies {
            namespace,
            services: services.filter(|_| rec.service.is_empty()).cloned(),
            ports,
        }
    }

    /// The Services this pod's ports serve (what a service policy's change governs).
    fn service_names<'a>(&'a self, rec: &'a PodRecord) -> BTreeSet<&'a str> {
        match &self.services {
            Some(services) => services.iter().map(|s| s.service.as_str()).collect(),
            None => BTreeSet::from([rec.service.as_str()]),
        }
    }

    /// Whether `self` and `other` hold the very same policies and memberships.
    fn same(&self, other: &PodPolicies) -> bool {
        let eq = |a: &Option<Arc<Sourced>>, b: &Option<Arc<Sourced>>| match (a, b) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        let services = match (&self.services, &other.services) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
            (None, None) => true,
            _ => false,
        };
        let port = |a: &PortPolicy, b: &PortPolicy| {
            a.service_ports == b.service_ports
                && match (&a.policy, &b.policy) {
                    (ServicePolicy::None, ServicePolicy::None) => true,
                    (ServicePolicy::One(a), ServicePolicy::One(b)) => Arc::ptr_eq(a, b),
                    (ServicePolicy::Conflict(a), ServicePolicy::Conflict(b)) => a == b,
                    _ => false,
                }
        };
        eq(&self.namespace, &other.namespace)
            && services
            && self.ports.len() == other.ports.len()
            && self
                .ports
                .iter()
                .zip(&other.ports)
                .all(|((pa, a), (pb, b))| pa == pb && port(a, b))
    }

    /// The translation's inputs; `None` when no policy governs the pod (its ports are
    /// served as without policies).
    fn inputs(&self, rec: &PodRecord) -> Option<PolicyInputs> {
        let annotation = rec.authz.as_ref().map(|a| {
            match flock_core::authz::annotation_policy(a)
                .and_then(|_| flock_core::authz::parse_spec(a.as_bytes()))
            {
                Ok(spec) => translate::PolicyInput::Spec(spec),
                Err(e) => translate::PolicyInput::Refused(format!(
                    "annotation {}: {e}",
                    flock_core::authz::ANNOTATION
                )),
            }
        });
        let ports: BTreeMap<u16, (BTreeSet<u16>, Option<translate::PolicyInput>, String)> = self
            .ports
            .iter()
            .map(|(app_port, p)| {
                let input = match &p.policy {
                    ServicePolicy::None => None,
                    ServicePolicy::One(s) => Some(sourced_input(s)),
                    ServicePolicy::Conflict(why) => {
                        Some(translate::PolicyInput::Refused(why.clone()))
                    }
                };
                (
                    *app_port,
                    (p.service_ports.clone(), input, p.service_target.clone()),
                )
            })
            .collect();
        let namespace = self.namespace.as_ref().map(sourced_input);
        let governed = namespace.is_some()
            || annotation.is_some()
            || ports.values().any(|(_, input, _)| input.is_some());
        let fallback_target = if namespace.is_some() {
            rec.namespace.clone()
        } else {
            format!("{} (annotation)", rec.pod_ref())
        };
        governed.then_some(PolicyInputs {
            namespace,
            annotation,
            ports,
            fallback_target,
        })
    }
}

/// A pod's model if the translation accepts it; `None` (logged) if not.
fn validated_pod(
    rec: &PodRecord,
    identity: Option<String>,
    policies: &PodPolicies,
) -> Option<Arc<translate::Pod>> {
    let Some(pod) = pod_model(rec, identity, policies) else {
        tracing::warn!(pod = %rec.pod_ref(), "pod has no IP; not served");
        return None;
    };
    let one = Mesh {
        pods: vec![pod],
        ..Mesh::default()
    };
    match one.validate() {
        Ok(()) => one.pods.into_iter().next().map(Arc::new),
        Err(errors) => {
            tracing::warn!(pod = %rec.pod_ref(), "pod not served: {}", problems(&errors));
            None
        }
    }
}

fn problems(errors: &[translate::ValidationError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The secrets made from one identity view (held weakly: the cache must not keep an
/// old view's keys alive).
pub(super) type SecretsOf = (std::sync::Weak<IdentityView>, Arc<Vec<translate::Secret>>);

/// The pod models derived from one state of the pod table, identity view and
/// missing-netns set, and each pod's model by key with what it was derived from.
#[derive(Default)]
pub(super) struct PodsOf {
    /// The table and SPIFFE IDs the models were derived from (`None`: never).
    seen: Option<PodInputs>,
    missing: BTreeSet<flock_core::pod::PodKey>,
    pods: Arc<Vec<Arc<translate::Pod>>>,
    /// Every pod in the table whose netns is not missing.
    by_pod: BTreeMap<flock_core::pod::PodKey, PodModel>,
    /// The policies the models were derived from.
    policies: Snapshot<Target, Arc<Sourced>>,
    /// The pods' Services (kube mode's memberships) the models were derived from.
    pod_services: Snapshot<flock_core::pod::PodKey, Arc<Vec<flock_core::authz::PortService>>>,
    /// The pods of `by_pod` by (namespace, service): the pods a policy change
    /// governs, found without visiting the others.
    by_service: BTreeMap<(String, String), BTreeSet<flock_core::pod::PodKey>>,
}

/// One pod's model (`None`: refused, and logged when it was) and its inputs.
struct PodModel {
    rec: Arc<PodRecord>,
    spiffe_id: Option<String>,
    policies: PodPolicies,
    model: Option<Arc<translate::Pod>>,
}

impl PodsOf {
    fn insert(&mut self, key: flock_core::pod::PodKey, model: PodModel) {
        self.remove(&key);
        // Every pod is indexed under its namespace (the empty service when it serves
        // none), so a namespace policy finds it.
        let mut names = model.policies.service_names(&model.rec);
        if names.is_empty() {
            names.insert("");
        }
        for svc in names {
            self.by_service
                .entry((model.rec.namespace.clone(), svc.to_string()))
                .or_default()
                .insert(key.clone());
        }
        self.by_pod.insert(key, model);
    }

    fn remove(&mut self, key: &flock_core::pod::PodKey) {
        if let Some(old) = self.by_pod.remove(key) {
            let mut names = old.policies.service_names(&old.rec);
            if names.is_empty() {
                names.insert("");
            }
            for svc in names {
                let at = (old.rec.namespace.clone(), svc.to_string());
                if let Some(set) = self.by_service.get_mut(&at) {
                    set.remove(key);
                    if set.is_empty() {
                        self.by_service.remove(&at);
                    }
                }
            }
        }
    }

    /// The pods a change of `target`'s policy governs.
    fn governed_by(&self, target: &Target) -> Vec<flock_core::pod::PodKey> {
        let ns = target.namespace.clone();
        match &target.service {
            Some(svc) => self
                .by_service
                .get(&(ns, svc.clone()))
                .into_iter()
                .flatten()
                .cloned()
                .collect(),
            None => self
                .by_service
                .range((ns.clone(), String::new())..)
                .take_while(|((n, _), _)| *n == ns)
                .flat_map(|(_, keys)| keys.iter().cloned())
                .collect(),
        }
    }
}

/// What one publish translates: the registry's services (shared with the service
/// table, unchanged ones the very same `Arc`s as last time), the live pods and the
/// secrets.
pub(super) struct MeshParts {
    pub services: Arc<Vec<Arc<translate::Service>>>,
    pub pods: Arc<Vec<Arc<translate::Pod>>>,
    pub secrets: Arc<Vec<translate::Secret>>,
}

impl Agent {
    /// The mesh from the live pods, the registry view and the identity view. A
    /// service or pod the translation refuses is left out (and logged), so one bad
    /// entry never blocks the rest of the mesh. The services come from the
    /// incremental [`ServiceTable`](super::services::ServiceTable): a change of one
    /// endpoint re-derives one service, not the registry.
    pub(super) fn mesh_parts(
        &self,
        state: &mut super::publish::PublishState,
        view: &Arc<View>,
    ) -> MeshParts {
        // Kube mode, whatever the registry: a Service's ClusterIPs are host names of
        // its ports too (the snapshot's address names its state).
        let kube = self.kube.as_ref().map(|k| k.snapshot());
        let vips_of = |ns: &str, name: &str| match &kube {
            Some(snapshot) => crate::registry::kube::service_vips(snapshot, ns, name),
            None => Vec::new(),
        };
        let vips = kube.as_ref().map(|k| {
            (
                Arc::as_ptr(k) as usize,
                &vips_of as &dyn Fn(&str, &str) -> Vec<_>,
            )
        });
        let services = if self.cfg.publish_from_scratch {
            // The scale benchmark's baseline: everything recomputed, nothing shared.
            let (services, excluded) = super::services::served_services(view, vips);
            if let Some(r) = self.registry.rejections() {
                r.set_excluded(&self.registry.describe(), excluded);
            }
            Arc::new(services.into_iter().map(Arc::new).collect())
        } else {
            let table = &mut state.services;
            let excluded_before = table.excluded_generation();
            table.update(view, vips);
            if table.excluded_generation() != excluded_before
                && let Some(r) = self.registry.rejections()
            {
                r.set_excluded(&self.registry.describe(), table.excluded().clone());
            }
            Arc::clone(table.services())
        };
        // Connection-pool limits (kube mode: the Services' annotations), before the
        // routes, whose backends are then the limited values.
        let services = super::pools::apply(kube.as_ref(), services, &mut state.pools);
        // The snapshot's address is the service table's VIP token: keep the snapshot
        // alive until the next publish has compared it, or a snapshot allocated
        // where this one was freed (two reflector updates between two publishes)
        // would carry the same token and its VIP changes would be missed.
        state.kube_seen = kube.clone();
        // Traffic policy: the routed services carry their resolved rules.
        let routes = self.core().routes();
        let no_vips = |_: &str, _: &str| Vec::new();
        let services = super::routes::apply(
            &routes,
            services,
            &mut state.routed,
            vips.map_or(&no_vips as &dyn Fn(&str, &str) -> Vec<_>, |(_, f)| f),
        );
        let identity = self.identity_view();
        if self.cfg.publish_from_scratch {
            // The baseline again: every pod re-derived and re-validated, every secret
            // copied, as before the pod models and secrets were kept between publishes.
            state.pods = PodsOf::default();
            state.secrets = None;
        }
        let secrets = Self::secrets(&mut state.secrets, identity.as_ref());
        let pods = self.pod_models(&mut state.pods, identity.as_ref());
        MeshParts {
            services,
            pods,
            secrets,
        }
    }

    /// The live pods as the translation sees them. Only the pods whose record or
    /// SPIFFE ID changed since the last call are re-derived and re-validated, and only
    /// they are visited ([`PodInputs::changed_since`]); all of them when the set of
    /// pods whose netns is missing changed. A pod change used to visit every pod.
    fn pod_models(
        &self,
        cache: &mut PodsOf,
        identity: Option<&Arc<IdentityView>>,
    ) -> Arc<Vec<Arc<translate::Pod>>> {
        let (missing, table, policies, pod_services) = {
            let core = self.core();
            (
                core.netns_missing().clone(),
                core.pods(),
                core.policies(),
                core.pod_services(),
            )
        };
        let now = PodInputs::new(table, identity.map(|v| &**v), cache.seen.as_ref());
        let visit: Vec<flock_core::pod::PodKey> = match &cache.seen {
            Some(seen) if cache.missing == missing => {
                let mut changed = now.changed_since(seen);
                // A policy change re-derives the pods it governs, and no other.
                let mut targets = BTreeSet::new();
                super::podinputs::changed_keys(
                    &cache.policies,
                    &policies,
                    Arc::ptr_eq,
                    &mut targets,
                );
                // The mutant re-derives no governed pod: a policy reaches a pod only
                // when something else about it changes.
                if !flock_core::reintroduced!("authz-change-not-rederived") {
                    for t in &targets {
                        changed.extend(cache.governed_by(t));
                    }
                }
                // A pod whose Services changed (kube mode) may be under another
                // Service's policy now.
                super::podinputs::changed_keys(
                    &cache.pod_services,
                    &pod_services,
                    |a, b| Arc::ptr_eq(a, b) || a == b,
                    &mut changed,
                );
                if changed.is_empty() {
                    cache.seen = Some(now);
                    cache.policies = policies;
                    cache.pod_services = pod_services;
                    return Arc::clone(&cache.pods);
                }
                changed.into_iter().collect()
            }
            _ => {
                let gone: Vec<_> = cache
                    .by_pod
                    .keys()
                    .filter(|key| !now.table.contains_key(*key))
                    .cloned()
                    .collect();
                for key in gone {
                    cache.remove(&key);
                }
                now.table.keys().cloned().collect()
            }
        };
        for key in visit {
            let Some(rec) = now.table.get(&key) else {
                cache.remove(&key);
                continue;
            };
            // Envoy refuses a whole listener update if one netns path is missing:
            // a pod whose namespace is gone (DEL never came) is left to the GC.
            if missing.contains(&key) {
                tracing::debug!(pod = %rec.pod_ref(), netns = %rec.netns, "netns missing; pod not served");
                cache.remove(&key);
                continue;
            }
            let spiffe_id = now.spiffe_id(&key);
            let governing = PodPolicies::of(rec, &policies, pod_services.get(&key));
            let fresh = cache.by_pod.get(&key).is_some_and(|m| {
                Arc::ptr_eq(&m.rec, rec)
                    && m.spiffe_id.as_deref() == spiffe_id
                    && m.policies.same(&governing)
            });
            if !fresh {
                let model = validated_pod(rec, spiffe_id.map(str::to_string), &governing);
                cache.insert(
                    key,
                    PodModel {
                        rec: Arc::clone(rec),
                        spiffe_id: spiffe_id.map(str::to_string),
                        policies: governing,
                        model,
                    },
                );
            }
        }
        // In table order, as before: the models of the pods kept and accepted.
        let models: Arc<Vec<Arc<translate::Pod>>> = Arc::new(
            cache
                .by_pod
                .values()
                .filter_map(|m| m.model.clone())
                .collect(),
        );
        cache.pods = Arc::clone(&models);
        cache.seen = Some(now);
        cache.missing = missing;
        cache.policies = policies;
        cache.pod_services = pod_services;
        models
    }

    /// The secrets of the identity view: certificates named by SPIFFE ID, bundles by
    /// trust domain (the names the translation's TLS contexts refer to). Kept per
    /// view, so the private keys are copied once per identity change, not per publish.
    fn secrets(
        cached: &mut Option<SecretsOf>,
        identity: Option<&Arc<IdentityView>>,
    ) -> Arc<Vec<translate::Secret>> {
        let Some(view) = identity else {
            return Arc::default();
        };
        if let Some((seen, secrets)) = &*cached
            && std::ptr::eq(seen.as_ptr(), Arc::as_ptr(view))
        {
            return Arc::clone(secrets);
        }
        let mut secrets = Vec::new();
        for svid in view.svids.values() {
            secrets.push(translate::Secret {
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
            secrets.push(translate::Secret {
                name: bundle.trust_domain.clone(),
                kind: translate::SecretKind::ValidationContext {
                    trusted_ca_pem: bundle.ca_pem.clone(),
                },
            });
        }
        let secrets = Arc::new(secrets);
        *cached = Some((Arc::downgrade(view), Arc::clone(&secrets)));
        secrets
    }
}
