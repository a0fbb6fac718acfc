//! `--registry kubernetes`: remote endpoints from the API's EndpointSlices (needs
//! `--kube`, whose reflectors it reads).
//!
//! Kubernetes is the registry: the agent writes nothing. [`Registry::put`],
//! [`Registry::delete`] and [`Registry::delete_if_revision`] do nothing and say so
//! ([`Registry::read_only`] is true, so the agent does not track its registrations as
//! its own and its orphan GC leaves the view alone: those endpoints belong to the
//! EndpointSlice controller).
//!
//! The [`View`] is built from the watch's [`Snapshot`] (see the design in
//! `flock_kube::map`): each EndpointSlice with its Service (`kubernetes.io/service-name`)
//! through [`map::slice_endpoints`], health from the endpoint conditions, locality from
//! the endpoint's zone or its Node's topology labels, and callee identities from the
//! namespace's `flock.io/mesh: enabled` label and the Service's
//! `flock.io/service-accounts` annotation (exact IDs), else
//! `spiffe://<td>/ns/<ns>/sa/*` (any account of the namespace: a SAN prefix match).
//! Services in namespaces that are not meshed are plaintext.
//!
//! Each bad slice endpoint (and each bad Service) is left out alone and counted in
//! [`Rejections`] like a bad etcd entry. On every snapshot change only the slices whose
//! object, Service, namespace mesh label or (when Nodes changed) node labels changed
//! are mapped again; the others keep their endpoints. While the API is unreachable the
//! snapshot keeps the last-known objects, so the view keeps the last-known endpoints;
//! the reflectors re-list when it comes back.
//!
//! Limitations: a slice names one port per Service port, the pod's own app port, so a
//! caller's mTLS connection reaches the callee's app directly unless the callee's
//! capture rules redirect that port to its inbound listener (`--capture`; not for a
//! caller on the callee's own node, whose connections come from the probe source).
//! For mesh traffic between pods use `--kube` with an etcd registry
//! (docs/kubernetes.md, "Ports and capture").
//!
//! A slice does not say which account each endpoint runs as: with a
//! `flock.io/service-accounts` annotation of several accounts each endpoint carries
//! the first as its `identity` and the others as `also_accept`, so a caller accepts
//! any of the listed accounts from every endpoint of the Service (and no other).

use super::{Registered, Registry, RegistryError, Rejections, View};
use crate::model::Endpoint;
use flock_core::pod::{PodKey, check_ip};
use flock_core::registry::{Reject, Rejected};
use flock_kube::map::{self, MapError, ServiceInfo};
use flock_kube::watch::{KubeWatch, Snapshot};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use tokio::sync::watch;

/// The backend's name in logs, metrics and `/debug/registry`.
pub const DESCRIBE: &str = "kubernetes";

/// The `kubernetes` backend (see the module docs).
pub struct KubeRegistry {
    view_tx: watch::Sender<Arc<View>>,
    rejections: Arc<Rejections>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KubeRegistry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KubeRegistry {
    /// Starts following `watch` (started with `endpoint_slices: true`). SPIFFE IDs of
    /// meshed Services are built in `trust_domain`.
    pub fn start(watch: &KubeWatch, trust_domain: String) -> Self {
        let mut snapshots = watch.view();
        let rejections = Arc::new(Rejections::default());
        let mut builder = ViewBuilder::new(trust_domain, Arc::clone(&rejections));
        let first = snapshots.borrow_and_update().clone();
        let (view_tx, _) = watch::channel(Arc::new(builder.update(&first)));
        let tx = view_tx.clone();
        let task = tokio::spawn(async move {
            while snapshots.changed().await.is_ok() {
                let snapshot = snapshots.borrow_and_update().clone();
                let view = builder.update(&snapshot);
                tx.send_if_modified(|current| {
                    if **current == view {
                        return false;
                    }
                    *current = Arc::new(view);
                    true
                });
            }
        });
        Self {
            view_tx,
            rejections,
            task,
        }
    }
}

#[async_trait::async_trait]
impl Registry for KubeRegistry {
    async fn put(&self, _ep: &Endpoint) -> Result<u64, RegistryError> {
        // The EndpointSlice controller registers pods; nothing to write.
        Ok(0)
    }

    async fn delete(&self, _key: &str) -> Result<bool, RegistryError> {
        Ok(false)
    }

    async fn delete_if_revision(&self, _key: &str, _revision: u64) -> Result<bool, RegistryError> {
        Ok(false)
    }

    fn view(&self) -> watch::Receiver<Arc<View>> {
        self.view_tx.subscribe()
    }

    fn describe(&self) -> String {
        DESCRIBE.to_string()
    }

    fn rejections(&self) -> Option<Arc<Rejections>> {
        Some(Arc::clone(&self.rejections))
    }

    fn read_only(&self) -> bool {
        true
    }
}

/// One mapped slice: the inputs it was mapped from (compared by pointer and value on
/// the next snapshot) and what it gave.
struct MappedSlice {
    slice: Arc<EndpointSlice>,
    service: Option<Arc<Service>>,
    meshed: bool,
    revision: u64,
    /// (key, endpoint)
    endpoints: Vec<(String, Endpoint)>,
    /// Rejection keys with their reason.
    rejected: Vec<(String, Rejected)>,
}

/// A Service's mapping, or why it has none.
type MappedService = Result<Arc<ServiceInfo>, MapError>;

/// Turns snapshots into views, remembering what each slice and Service gave.
struct ViewBuilder {
    trust_domain: String,
    rejections: Arc<Rejections>,
    services: HashMap<(String, String), (Arc<Service>, MappedService)>,
    slices: HashMap<(String, String), MappedSlice>,
    /// The previous snapshot (its node labels, compared by pointer).
    previous: Option<Arc<Snapshot>>,
    revision: u64,
    generation: u64,
    was_erroring: bool,
    /// The endpoints of the last view built, and the revision they got.
    last_endpoints: super::OrdMap<String, super::Registered>,
    view_revision: u64,
}

impl ViewBuilder {
    fn new(trust_domain: String, rejections: Arc<Rejections>) -> Self {
        Self {
            trust_domain,
            rejections,
            services: HashMap::new(),
            slices: HashMap::new(),
            previous: None,
            revision: 0,
            generation: 0,
            was_erroring: false,
            last_endpoints: super::OrdMap::new(),
            view_revision: 0,
        }
    }

    /// The Service's mapping, re-parsed only if its object changed.
    fn service(&mut self, key: &(String, String), svc: &Arc<Service>) -> MappedService {
        if let Some((cached, info)) = self.services.get(key)
            && Arc::ptr_eq(cached, svc)
        {
            return info.clone();
        }
        let info = map::service_info(svc).map(Arc::new);
        self.services
            .insert(key.clone(), (Arc::clone(svc), info.clone()));
        info
    }

    fn update(&mut self, snap: &Arc<Snapshot>) -> View {
        self.revision += 1;
        let revision = self.revision;
        // Node labels feed every slice's locality: when they change (rare), every
        // slice is mapped again.
        let nodes_changed = !self
            .previous
            .as_ref()
            .is_some_and(|p| p.nodes.ptr_eq(&snap.nodes));
        self.previous = Some(Arc::clone(snap));
        self.services.retain(|k, _| snap.services.contains_key(k));

        let mut slices = HashMap::with_capacity(snap.slices.len());
        for (key, slice) in snap.slices.iter() {
            let (ns, name) = key;
            let owner = slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(map::SERVICE_NAME_LABEL))
                .cloned();
            let service = owner
                .as_ref()
                .and_then(|svc| snap.services.get(&(ns.clone(), svc.clone())))
                .cloned();
            let meshed = snap
                .namespaces
                .get(ns)
                .and_then(|l| l.get(map::MESH_LABEL))
                .is_some_and(|v| v == map::MESH_ENABLED);
            if let Some(prev) = self.slices.remove(key)
                && !nodes_changed
                && Arc::ptr_eq(&prev.slice, slice)
                && prev.meshed == meshed
                && match (&prev.service, &service) {
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    (None, None) => true,
                    _ => false,
                }
            {
                slices.insert(key.clone(), prev);
                continue;
            }
            // A slice whose Service is gone (or not yet seen) serves nothing: without
            // the Service there is no port name to port mapping and no identity rule.
            let mut mapped = MappedSlice {
                slice: Arc::clone(slice),
                service: service.clone(),
                meshed,
                revision,
                endpoints: Vec::new(),
                rejected: Vec::new(),
            };
            if let (Some(owner), Some(svc)) = (&owner, &service) {
                match self.service(&(ns.clone(), owner.clone()), svc) {
                    Ok(info) => {
                        let node_labels = |node: &str| -> Option<BTreeMap<String, String>> {
                            snap.nodes.get(node).cloned()
                        };
                        let (found, errors) = map::slice_endpoints(
                            &info,
                            slice,
                            meshed,
                            &self.trust_domain,
                            &node_labels,
                        );
                        for e in errors {
                            mapped.rejected.push((
                                format!("kubernetes/{ns}/endpointslices/{name}/{}", e.field),
                                Rejected::new(reason_of(&e.field), e.message.clone()),
                            ));
                        }
                        mapped.endpoints = found
                            .into_iter()
                            .map(|r| endpoint_of(r, name))
                            .map(|e| (e.key(), e))
                            .collect();
                    }
                    // Every slice of a bad Service carries its refusal (one key, so it is
                    // warned about and counted once, and stays refused while any slice
                    // of it is held unchanged).
                    Err(e) => mapped.rejected.push((
                        format!("kubernetes/{ns}/services/{owner}/{}", e.field),
                        Rejected::new(reason_of(&e.field), e.message),
                    )),
                }
            }
            slices.insert(key.clone(), mapped);
        }
        self.slices = slices;

        let mut view = View {
            synced: snap.synced,
            ..View::default()
        };
        let mut refused: BTreeSet<String> = BTreeSet::new();
        for mapped in self.slices.values() {
            for (key, ep) in &mapped.endpoints {
                view.endpoints
                    .insert(key.clone(), Registered::new(ep.clone(), mapped.revision));
            }
            for (key, why) in &mapped.rejected {
                self.rejections.reject(DESCRIBE, key, why);
                refused.insert(key.clone());
            }
        }
        // A key refused before and not now is fixed or gone: a later refusal is news.
        self.rejections.retain(|k| refused.contains(k));

        // The generation tells the agent the view may have missed changes (it runs its
        // orphan GC then): the first sync, and every recovery from a watch error (the
        // reflectors re-listed).
        let erroring = snap.last_error.is_some();
        if snap.synced && (self.generation == 0 || (self.was_erroring && !erroring)) {
            self.generation += 1;
        }
        self.was_erroring = erroring;
        view.generation = self.generation;
        // The view's revision counts changes of its endpoints (not snapshot changes
        // that left them alone, such as a pod event), so an unchanged view is not sent.
        // (The endpoints, not their revisions: a slice's revision also moves when
        // something the mapping leaves out changes.)
        let same = view.endpoints.len() == self.last_endpoints.len()
            && view
                .endpoints
                .iter()
                .zip(self.last_endpoints.iter())
                .all(|((k, a), (l, b))| k == l && a.endpoint == b.endpoint);
        if !same {
            self.view_revision += 1;
            self.last_endpoints = view.endpoints.clone();
        }
        view.revision = self.view_revision;
        view
    }
}

/// The rejection reason of a mapping error, by the field it names.
fn reason_of(field: &str) -> Reject {
    let field = field.to_ascii_lowercase();
    if field.contains("addresses") {
        Reject::Address
    } else if field.contains("port") {
        Reject::Port
    } else if field.contains("account") || field.contains("trust domain") {
        Reject::Identity
    } else if field.contains("name") || field.contains("ref") {
        Reject::Name
    } else {
        Reject::Undecodable
    }
}

/// The registry endpoint of a slice endpoint. Its key names the slice and the address
/// in the place of the CNI attachment (`<node>/<ns>/<svc>/<slice>/<address>/<port>`):
/// unique, and never one of an agent's own keys.
fn endpoint_of(r: map::RemoteEndpoint, slice: &str) -> Endpoint {
    Endpoint {
        pod_key: PodKey {
            container_id: slice.to_string(),
            ifname: r.address.to_string(),
        },
        service: r.service,
        namespace: r.namespace,
        service_port: r.service_port,
        protocol: r.protocol,
        address: r.address,
        port: r.port,
        node: r.node,
        pod: r.pod.unwrap_or_default(),
        region: r.region,
        zone: r.zone,
        health: r.health,
        // A slice does not say which of the Service's accounts each endpoint runs
        // as, so callers must accept every one of them from every endpoint.
        also_accept: r
            .identities
            .into_iter()
            .filter(|id| Some(id) != r.identity.as_ref())
            .collect(),
        labels: Default::default(),
        identity: r.identity,
    }
}

/// A Service's virtual IPs (its cluster IPs, not `None`), for the mesh model's
/// `vips`; empty for a headless Service or one the snapshot does not hold. Bad
/// entries are skipped (the Service's own mapping reports them).
pub fn service_vips(snapshot: &Snapshot, namespace: &str, name: &str) -> Vec<IpAddr> {
    let Some(svc) = snapshot
        .services
        .get(&(namespace.to_string(), name.to_string()))
    else {
        return Vec::new();
    };
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    let raw: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => Vec::new(),
    };
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in raw.into_iter().take(map::MAX_CLUSTER_IPS) {
        if let Ok(ip) = ip.parse::<IpAddr>()
            && check_ip(ip).is_ok()
            && !out.contains(&ip)
        {
            out.push(ip);
        }
    }
    out
}
