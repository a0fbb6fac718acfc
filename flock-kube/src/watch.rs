//! Node-scoped reflectors: this node's pods, Services, EndpointSlices, Namespaces,
//! Nodes, flock's AuthorizationPolicies and Gateway API HTTPRoutes, folded into one persistent [`Snapshot`]
//! behind a watch channel. A cluster without the AuthorizationPolicy CRD (or the Gateway
//! API's) answers its list with 404: that reads as "no policies" ("no routes"), asked
//! again after the backoff, not as an outage.
//!
//! Each resource has its own `kube::runtime::watcher`. Its events fold into the
//! snapshot: a (re-)list (`Init` … `InitApply` … `InitDone`) builds the resource's set
//! aside and replaces the old set only at `InitDone`, so objects deleted while the
//! watch was away (a `410 Gone` forcing a re-list, an outage) disappear, and readers
//! never see a half-listed set.
//!
//! On a watcher error the last-known state is kept, `last_error` says why, and after
//! kube's default backoff ([`DefaultBackoff`]: 0.8 s doubling to 30 s, jittered) a
//! fresh watcher re-lists. The re-list is deliberate: kube's watcher resumes a
//! broken watch silently (nothing is emitted when the resumed watch succeeds), so the
//! only proof that the API is back and the state is current is a completed list; it
//! also replaces whatever changed during the outage. client-go's reflector does the
//! same (a failed watch returns to list-and-watch).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use imbl::OrdMap;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::policy::AuthorizationPolicy;
use kube::api::Api;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Errors talking to the Kubernetes API.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig file could not be read or used.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// No kubeconfig was given and the in-cluster configuration is missing.
    #[error(
        "in-cluster Kubernetes configuration (KUBERNETES_SERVICE_HOST/PORT and the service-account token): {0}"
    )]
    InCluster(String),
    /// The HTTP client could not be built from the configuration.
    #[error("Kubernetes client: {0}")]
    Client(String),
    /// A request failed.
    #[error("{action}: {source}")]
    Api {
        /// The request, e.g. `GET node node-a`.
        action: String,
        /// What the client or the API server said.
        #[source]
        source: kube::Error,
    },
    /// An optimistic-concurrency write kept conflicting with other writers.
    #[error("{0}")]
    Conflict(String),
}

/// A client from `kubeconfig`, or the in-cluster configuration (service-account token,
/// `KUBERNETES_SERVICE_HOST`) when `None`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeError> {
    let config = match kubeconfig {
        Some(path) => {
            let bad = |message: String| KubeError::Kubeconfig {
                path: path.to_path_buf(),
                message,
            };
            let file = kube::config::Kubeconfig::read_from(path).map_err(|e| bad(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| bad(e.to_string()))?
        }
        None => kube::Config::incluster().map_err(|e| KubeError::InCluster(e.to_string()))?,
    };
    kube::Client::try_from(config).map_err(|e| KubeError::Client(e.to_string()))
}

/// What to watch.
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// This node's name: pods are watched with `spec.nodeName=<node_name>`.
    pub node_name: String,
    /// Watch EndpointSlices and every Node (for `--registry kubernetes`); else only
    /// this node's Node object.
    pub endpoint_slices: bool,
}

/// The watched state at one moment. Cloning is cheap (persistent maps).
#[derive(Clone, Default, Debug)]
pub struct Snapshot {
    /// This node's pods by (namespace, name).
    pub pods: OrdMap<(String, String), Arc<Pod>>,
    /// Every Service by (namespace, name).
    pub services: OrdMap<(String, String), Arc<Service>>,
    /// Every EndpointSlice by (namespace, name); empty unless `endpoint_slices`.
    pub slices: OrdMap<(String, String), Arc<EndpointSlice>>,
    /// Namespace labels by namespace name.
    pub namespaces: OrdMap<String, BTreeMap<String, String>>,
    /// Node labels by node name: every node with `endpoint_slices`, else only this one.
    pub nodes: OrdMap<String, BTreeMap<String, String>>,
    /// flock's `AuthorizationPolicy` objects by (namespace, name); empty (and synced)
    /// on a cluster without their CRD.
    pub policies: OrdMap<(String, String), Arc<AuthorizationPolicy>>,
    /// Gateway API `HTTPRoute` objects by (namespace, name); empty (and synced) on a
    /// cluster without the Gateway API CRDs.
    pub routes: OrdMap<(String, String), Arc<crate::route::HttpRoute>>,
    /// Every watcher has completed its first list. Stays true through outages: the
    /// maps are then the last-known state and `last_error` says why they may be stale.
    pub synced: bool,
    /// Why some watcher is failing now (`None` once each has re-listed successfully).
    pub last_error: Option<String>,
    /// Bumped on every change published.
    pub generation: u64,
}

/// Counters of the watchers' activity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchStats {
    /// Objects received (list items and watch events).
    pub events: u64,
    /// Watcher errors (each followed by a backoff and a re-list).
    pub errors: u64,
    /// Completed lists (the first ones included).
    pub lists: u64,
}

/// Why [`KubeWatch::pod`] has no pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// Neither this node's pod watch nor a direct GET has the pod.
    #[error(
        "pod {pod} does not exist in the Kubernetes API (not in this node's pod watch, and a direct GET answered 404)"
    )]
    NotFound {
        /// `namespace/name`.
        pod: String,
    },
    /// The API could not answer the direct GET; the cause says why.
    #[error("Kubernetes API unreachable: {0}")]
    Unreachable(String),
    /// The pod exists but is not scheduled on this node.
    #[error("pod {pod} is {}, not on this node {this_node}", match .node { Some(n) => format!("scheduled on node {n}"), None => "not scheduled on any node yet".to_string() })]
    NotOnThisNode {
        /// `namespace/name`.
        pod: String,
        /// The node the pod is scheduled on (`None`: not scheduled).
        node: Option<String>,
        /// This node.
        this_node: String,
    },
}

/// How long the direct GET of [`KubeWatch::pod`] may take.
const GET_TIMEOUT: Duration = Duration::from_secs(10);

struct WatcherStatus {
    synced: bool,
    error: Option<String>,
}

struct State {
    snapshot: Snapshot,
    watchers: Vec<WatcherStatus>,
}

struct Shared {
    state: Mutex<State>,
    tx: watch::Sender<Arc<Snapshot>>,
    events: AtomicU64,
    errors: AtomicU64,
    lists: AtomicU64,
}

impl Shared {
    /// Applies `change` (to the snapshot and this watcher's status) and publishes.
    fn update(&self, watcher: usize, change: impl FnOnce(&mut Snapshot, &mut WatcherStatus)) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let State { snapshot, watchers } = &mut *state;
        change(snapshot, &mut watchers[watcher]);
        snapshot.synced = watchers.iter().all(|w| w.synced);
        let errors: Vec<&str> = watchers.iter().filter_map(|w| w.error.as_deref()).collect();
        snapshot.last_error = (!errors.is_empty()).then(|| errors.join("; "));
        snapshot.generation += 1;
        self.tx.send_replace(Arc::new(snapshot.clone()));
    }
}

/// A resource folded into one map of the snapshot.
trait Slot:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
    type Key: Ord + Clone + Send + Sync + 'static;
    type Val: Clone + Send + Sync + 'static;
    const NAME: &'static str;
    /// A resource a cluster may not serve (a CRD not installed): its 404 reads as "no
    /// objects", not as an outage that keeps the view unsynced.
    const OPTIONAL: bool = false;
    fn map(snapshot: &mut Snapshot) -> &mut OrdMap<Self::Key, Self::Val>;
    fn key(&self) -> Self::Key;
    fn val(self) -> Self::Val;
}

macro_rules! namespaced_slot {
    ($ty:ty, $name:literal, $field:ident) => {
        impl Slot for $ty {
            type Key = (String, String);
            type Val = Arc<$ty>;
            const NAME: &'static str = $name;
            fn map(snapshot: &mut Snapshot) -> &mut OrdMap<Self::Key, Self::Val> {
                &mut snapshot.$field
            }
            fn key(&self) -> Self::Key {
                (self.namespace().unwrap_or_default(), self.name_any())
            }
            fn val(self) -> Self::Val {
                Arc::new(self)
            }
        }
    };
}

macro_rules! labels_slot {
    ($ty:ty, $name:literal, $field:ident) => {
        impl Slot for $ty {
            type Key = String;
            type Val = BTreeMap<String, String>;
            const NAME: &'static str = $name;
            fn map(snapshot: &mut Snapshot) -> &mut OrdMap<Self::Key, Self::Val> {
                &mut snapshot.$field
            }
            fn key(&self) -> Self::Key {
                self.name_any()
            }
            fn val(self) -> Self::Val {
                self.metadata.labels.unwrap_or_default()
            }
        }
    };
}

namespaced_slot!(Pod, "pods", pods);
namespaced_slot!(Service, "services", services);
namespaced_slot!(EndpointSlice, "endpointslices", slices);
labels_slot!(Namespace, "namespaces", namespaces);
labels_slot!(Node, "nodes", nodes);

impl Slot for AuthorizationPolicy {
    type Key = (String, String);
    type Val = Arc<AuthorizationPolicy>;
    const NAME: &'static str = "authorizationpolicies.flock.io";
    const OPTIONAL: bool = true;
    fn map(snapshot: &mut Snapshot) -> &mut OrdMap<Self::Key, Self::Val> {
        &mut snapshot.policies
    }
    fn key(&self) -> Self::Key {
        (self.namespace().unwrap_or_default(), self.name_any())
    }
    fn val(self) -> Self::Val {
        Arc::new(self)
    }
}

impl Slot for crate::route::HttpRoute {
    type Key = (String, String);
    type Val = Arc<crate::route::HttpRoute>;
    const NAME: &'static str = "httproutes.gateway.networking.k8s.io";
    const OPTIONAL: bool = true;
    fn map(snapshot: &mut Snapshot) -> &mut OrdMap<Self::Key, Self::Val> {
        &mut snapshot.routes
    }
    fn key(&self) -> Self::Key {
        (self.namespace().unwrap_or_default(), self.name_any())
    }
    fn val(self) -> Self::Val {
        Arc::new(self)
    }
}

/// Whether `e` is the API server's 404 for a resource it does not serve.
fn not_served(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 404)
}

/// The reflectors of one node. Dropping it stops the watchers.
pub struct KubeWatch {
    client: kube::Client,
    node_name: String,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for KubeWatch {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl KubeWatch {
    /// Spawns the watchers (needs a tokio runtime); the view is unsynced until every
    /// first list is done.
    pub fn start(client: kube::Client, opts: WatchOptions) -> KubeWatch {
        let node = opts.node_name.clone();
        let watcher_count = if opts.endpoint_slices { 7 } else { 6 };
        let (tx, _) = watch::channel(Arc::new(Snapshot::default()));
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                snapshot: Snapshot::default(),
                watchers: (0..watcher_count)
                    .map(|_| WatcherStatus {
                        synced: false,
                        error: None,
                    })
                    .collect(),
            }),
            tx,
            events: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            lists: AtomicU64::new(0),
        });
        let config = watcher::Config::default;
        let mut tasks = vec![
            spawn_watcher::<Pod>(
                Api::all(client.clone()),
                config().fields(&format!("spec.nodeName={node}")),
                &shared,
                0,
            ),
            spawn_watcher::<Service>(Api::all(client.clone()), config(), &shared, 1),
            spawn_watcher::<Namespace>(Api::all(client.clone()), config(), &shared, 2),
            spawn_watcher::<AuthorizationPolicy>(Api::all(client.clone()), config(), &shared, 4),
            spawn_watcher::<crate::route::HttpRoute>(
                Api::all(client.clone()),
                config(),
                &shared,
                5,
            ),
        ];
        if opts.endpoint_slices {
            tasks.push(spawn_watcher::<Node>(
                Api::all(client.clone()),
                config(),
                &shared,
                3,
            ));
            tasks.push(spawn_watcher::<EndpointSlice>(
                Api::all(client.clone()),
                config(),
                &shared,
                6,
            ));
        } else {
            tasks.push(spawn_watcher::<Node>(
                Api::all(client.clone()),
                config().fields(&format!("metadata.name={node}")),
                &shared,
                3,
            ));
        }
        KubeWatch {
            client,
            node_name: opts.node_name,
            shared,
            tasks,
        }
    }

    /// The snapshot channel (the current value is the latest snapshot).
    pub fn view(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.shared.tx.subscribe()
    }

    /// The client the watchers use.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// This node's name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// Counters of the watchers' activity.
    pub fn stats(&self) -> WatchStats {
        WatchStats {
            events: self.shared.events.load(Ordering::Relaxed),
            errors: self.shared.errors.load(Ordering::Relaxed),
            lists: self.shared.lists.load(Ordering::Relaxed),
        }
    }

    /// The pod `namespace/name` on this node: from the reflector if it shows up there
    /// within `wait`, else by a direct GET (the CNI ADD for a new pod can race ahead of
    /// the watch event announcing it).
    pub async fn pod(
        &self,
        namespace: &str,
        name: &str,
        wait: Duration,
    ) -> Result<Arc<Pod>, LookupError> {
        let key = (namespace.to_string(), name.to_string());
        let pod_name = format!("{namespace}/{name}");
        let mut view = self.view();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(pod) = view.borrow_and_update().pods.get(&key).cloned() {
                return Ok(pod);
            }
            match tokio::time::timeout_at(deadline, view.changed()).await {
                Ok(Ok(())) => {}
                _ => break,
            }
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let pod = match tokio::time::timeout(GET_TIMEOUT, api.get_opt(name)).await {
            Err(_) => {
                return Err(LookupError::Unreachable(format!(
                    "GET pod {pod_name}: no answer from the API server within {GET_TIMEOUT:?}"
                )));
            }
            Ok(Err(e)) => {
                return Err(LookupError::Unreachable(format!(
                    "GET pod {pod_name} (after {wait:?} not in this node's pod watch): {e}"
                )));
            }
            Ok(Ok(None)) => return Err(LookupError::NotFound { pod: pod_name }),
            Ok(Ok(Some(pod))) => pod,
        };
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty());
        if node.as_deref() != Some(self.node_name.as_str()) {
            return Err(LookupError::NotOnThisNode {
                pod: pod_name,
                node,
                this_node: self.node_name.clone(),
            });
        }
        Ok(Arc::new(pod))
    }
}

fn spawn_watcher<K: Slot>(
    api: Api<K>,
    config: watcher::Config,
    shared: &Arc<Shared>,
    index: usize,
) -> JoinHandle<()> {
    tokio::spawn(run_watcher(api, config, shared.clone(), index))
}

async fn run_watcher<K: Slot>(
    api: Api<K>,
    config: watcher::Config,
    shared: Arc<Shared>,
    index: usize,
) {
    let mut backoff = DefaultBackoff::default();
    let mut said_not_served = false;
    loop {
        let mut stream = std::pin::pin!(watcher::watcher(api.clone(), config.clone()));
        // The set a (re-)list is building; it replaces the published one at InitDone.
        let mut listing: Option<OrdMap<K::Key, K::Val>> = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(Event::Init) => listing = Some(OrdMap::new()),
                Ok(Event::InitApply(obj)) => {
                    shared.events.fetch_add(1, Ordering::Relaxed);
                    listing
                        .get_or_insert_with(OrdMap::new)
                        .insert(obj.key(), obj.val());
                }
                Ok(Event::InitDone) => {
                    said_not_served = false;
                    let listed = listing.take().unwrap_or_default();
                    shared.lists.fetch_add(1, Ordering::Relaxed);
                    shared.update(index, |snapshot, status| {
                        *K::map(snapshot) = listed;
                        status.synced = true;
                        status.error = None;
                    });
                    backoff.reset();
                }
                Ok(Event::Apply(obj)) => {
                    shared.events.fetch_add(1, Ordering::Relaxed);
                    shared.update(index, |snapshot, _| {
                        K::map(snapshot).insert(obj.key(), obj.val());
                    });
                }
                Ok(Event::Delete(obj)) => {
                    shared.events.fetch_add(1, Ordering::Relaxed);
                    shared.update(index, |snapshot, _| {
                        K::map(snapshot).remove(&obj.key());
                    });
                }
                Err(e) if K::OPTIONAL && not_served(&e) => {
                    // No such resource here (its CRD is not installed): no objects,
                    // and the view is not held unsynced for it. Asked again after
                    // the backoff, so installing the CRD later is picked up.
                    if !said_not_served {
                        tracing::warn!(
                            resource = K::NAME,
                            "the API server does not serve this resource (its CRD is not installed); none are in force until it is"
                        );
                        said_not_served = true;
                    }
                    shared.update(index, |snapshot, status| {
                        K::map(snapshot).clear();
                        status.synced = true;
                        status.error = None;
                    });
                    break;
                }
                Err(e) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    let message = format!("{} watch: {e}", K::NAME);
                    tracing::warn!(error = %message, "Kubernetes watch failed; keeping the last-known state, re-listing after a backoff");
                    shared.update(index, |_, status| status.error = Some(message));
                    break;
                }
            }
        }
        tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(30))).await;
    }
}
