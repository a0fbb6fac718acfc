//! The agent: pod lifecycle (AddPod / RemovePod in flock-core's step order), the mesh
//! model built from local pods and the registry, and the one publisher of xDS.
//!
//! # Where each race of the audit is closed
//! * **R1** (version vs content): every publish goes through the node group's
//!   `flock_core::snapshot::Publisher`, and the mesh is read *inside* the publish
//!   closure, under its lock, so a later version is always built from later state.
//! * **R3** (startup load wipes a concurrent AddPod): [`Agent::load`] merges the stored
//!   pods into the live table with `PodTable::load_merge` (adds absent keys only).
//! * **R4** (ghost endpoint): `RemovePod` deletes the store record first
//!   (`flock_core::lifecycle::REMOVE_POD`), and the liveness loop's re-registration
//!   re-checks the pod after registering and undoes it with a *conditional* delete
//!   (only the revision it wrote) — the async form of
//!   `flock_core::lifecycle::guard::register_if_live`.
//! * Operations on one pod are serialized by a per-pod lock; different pods proceed
//!   in parallel.

use crate::identity::{IdentityProvider, IdentityView, PodIdentity};
use crate::model::{
    Endpoint, Health, INBOUND_BASE_PORT, OUTBOUND_PORT, PORTS_ANNOTATION, PodPort, PodRecord,
    Protocol, SERVICE_ANNOTATION,
};
use crate::registry::{Registry, View};
use crate::store::PodStore;
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_core::gc::{GcInputs, GcPolicy, GcState, Owned, PodKey};
use flock_core::lifecycle::liveness::{Health as Live, Liveness, LivenessPolicy};
use flock_core::lifecycle::merge::PodTable;
use flock_core::lifecycle::steps::{ADD_POD, REMOVE_POD, Step};
use flock_core::resources::Name;
use flock_xds::cache::Cache;
use flock_xds::callbacks::NodeInfo;
use flock_xds::translate::{self, EnvoyOptions, Mesh};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The node group of Envoy proxies (`user_agent_name` contains "envoy").
pub const ENVOY_GROUP: &str = "envoy";
/// The node group of proxyless gRPC clients (every other node).
pub const GRPC_GROUP: &str = "grpc";

/// Which translation an xDS node gets.
pub fn group_of(node: &NodeInfo) -> String {
    if node.user_agent_name.to_ascii_lowercase().contains("envoy") {
        ENVOY_GROUP.to_string()
    } else {
        GRPC_GROUP.to_string()
    }
}

/// Settings of the agent that are not I/O endpoints.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This node's name (`--node-name`): owner of its registry endpoints.
    pub node_name: String,
    /// Zone of this node's endpoints (`--zone`).
    pub zone: String,
    /// Region of this node's endpoints (`--region`).
    pub region: String,
    /// Liveness probe schedule and thresholds.
    pub liveness: LivenessPolicy,
    /// One probe's timeout.
    pub probe_timeout: Duration,
    /// Trailing debounce of registry-driven republishing.
    pub refresh_debounce: Duration,
    /// Period of the orphan GC.
    pub gc_interval: Duration,
    /// The orphan GC's hysteresis and breaker.
    pub gc_policy: GcPolicy,
}

impl AgentConfig {
    /// Defaults for a node named `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            zone: String::new(),
            region: String::new(),
            liveness: LivenessPolicy::default(),
            probe_timeout: Duration::from_secs(1),
            refresh_debounce: Duration::from_millis(100),
            gc_interval: Duration::from_secs(60),
            gc_policy: GcPolicy::default(),
        }
    }
}

/// Why a CNI request was not done.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// The request is malformed (the plugin reports it to the runtime).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A step failed; the pod was rolled back.
    #[error("{step} failed: {message}")]
    Step {
        /// The step.
        step: Step,
        /// Why.
        message: String,
    },
}

/// What an AddPod/RemovePod did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodOutcome {
    /// Done; the message says what.
    Done(String),
    /// Nothing to do (not meshed, unknown pod); the message says why.
    Ignored(String),
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    /// AddPod requests that meshed a pod.
    pub pods_added: AtomicU64,
    /// RemovePod requests that removed a pod.
    pub pods_removed: AtomicU64,
    /// Requests ignored (not meshed, unknown).
    pub pods_ignored: AtomicU64,
    /// Requests that failed.
    pub pod_errors: AtomicU64,
    /// Snapshots published (Envoy group).
    pub publishes: AtomicU64,
    /// Liveness probes run / failed.
    pub probes: AtomicU64,
    /// Liveness probes that failed.
    pub probe_failures: AtomicU64,
    /// Health transitions applied to the registry.
    pub health_changes: AtomicU64,
    /// Re-registrations undone because the pod was removed meanwhile (R4 guard).
    pub guard_undos: AtomicU64,
    /// GC sweeps run.
    pub gc_sweeps: AtomicU64,
    /// Items the GC removed, by kind (store, endpoint).
    pub gc_removed_store: AtomicU64,
    /// Registry endpoints the GC removed.
    pub gc_removed_endpoints: AtomicU64,
    /// Sweeps on which the breaker refused a kind.
    pub gc_breaker_trips: AtomicU64,
    /// Registry operations that failed.
    pub registry_errors: AtomicU64,
}

/// The agent. See the module docs.
pub struct Agent {
    cfg: AgentConfig,
    store: Arc<PodStore>,
    pods: PodTable<PodKey, PodRecord>,
    registry: Arc<dyn Registry>,
    cache: Arc<Cache<Any>>,
    identity: Option<Arc<dyn IdentityProvider>>,
    /// Registry keys this agent wrote → the revision of its last write.
    own: Mutex<BTreeMap<String, u64>>,
    liveness: Mutex<BTreeMap<PodKey, Liveness>>,
    locks: Mutex<HashMap<PodKey, Arc<tokio::sync::Mutex<()>>>>,
    gc_state: Mutex<GcState>,
    last_gc: Mutex<Option<flock_core::gc::GcReport>>,
    store_loaded: AtomicBool,
    first_published: AtomicBool,
    envoy_memo: Mutex<Memo>,
    grpc_memo: Mutex<Memo>,
    /// Pods whose network namespace file was missing when last checked (at AddPod,
    /// load, and every liveness round). Kept here so a publish makes no syscall per
    /// pod (a `stat` of a netns link costs ~10 µs: 1,000 pods made it the dominant
    /// cost of a publish).
    netns_missing: Mutex<BTreeSet<PodKey>>,
    /// The metrics.
    pub metrics: AgentMetrics,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Parses [`PORTS_ANNOTATION`]: `8080`, `8080/http,50051/grpc`, `5432/tcp`.
pub fn parse_ports(spec: &str) -> Result<Vec<PodPort>, String> {
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, part) in spec
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .enumerate()
    {
        if i >= 32 {
            return Err(format!("{PORTS_ANNOTATION}: more than 32 ports"));
        }
        let (port, proto) = part.split_once('/').unwrap_or((part, "http"));
        let app_port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{PORTS_ANNOTATION}: {port:?} is not a port (1-65535)"))?;
        let protocol = match proto {
            "http" => Protocol::Http,
            "grpc" => Protocol::Grpc,
            "tcp" => Protocol::Tcp,
            other => {
                return Err(format!(
                    "{PORTS_ANNOTATION}: protocol {other:?} of port {app_port} is not http, grpc or tcp"
                ));
            }
        };
        if !seen.insert(app_port) {
            return Err(format!(
                "{PORTS_ANNOTATION}: port {app_port} is listed twice"
            ));
        }
        let listen_port = INBOUND_BASE_PORT + i as u16;
        if seen.contains(&listen_port) || app_port == OUTBOUND_PORT {
            return Err(format!(
                "{PORTS_ANNOTATION}: port {app_port} collides with Envoy's ports ({OUTBOUND_PORT}, {INBOUND_BASE_PORT}+)"
            ));
        }
        ports.push(PodPort {
            app_port,
            listen_port,
            protocol,
        });
    }
    if let Some(p) = ports
        .iter()
        .find(|p| ports.iter().any(|q| q.listen_port == p.app_port))
    {
        return Err(format!(
            "{PORTS_ANNOTATION}: app port {} collides with an inbound listener port",
            p.app_port
        ));
    }
    Ok(ports)
}

/// A DNS-label-like name check for the parts of registry keys and resource names.
fn check_name(what: &str, value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if value.len() > max {
        return Err(format!(
            "{what} is {} bytes long, more than {max}",
            value.len()
        ));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        || value.starts_with(['-', '.'])
    {
        return Err(format!(
            "{what} {value:?} must be lowercase letters, digits, '-' and '.' (a Kubernetes name)"
        ));
    }
    Ok(())
}

fn check_id(what: &str, value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() || value.len() > max {
        return Err(format!("{what} must be 1 to {max} bytes"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "{what} {:?} may only hold letters, digits, '-', '_' and '.'",
            value.chars().take(64).collect::<String>()
        ));
    }
    Ok(())
}

/// What AddPod needs from the CNI request, decoupled from the proto.
#[derive(Debug, Clone, Default)]
pub struct AddPodInput {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS`.
    pub netns: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_UID`.
    pub uid: String,
    /// The primary CNI's IPs, CIDR or plain.
    pub ips: Vec<String>,
    /// Pod annotations.
    pub annotations: BTreeMap<String, String>,
    /// The CNI network name.
    pub network_name: String,
}

impl Agent {
    /// An agent over its store, registry and xDS cache (whose node hash must be
    /// [`group_of`]). Call [`load`](Self::load) before serving.
    pub fn new(
        cfg: AgentConfig,
        store: Arc<PodStore>,
        registry: Arc<dyn Registry>,
        cache: Arc<Cache<Any>>,
    ) -> Self {
        Self {
            cfg,
            store,
            pods: PodTable::new(),
            registry,
            cache,
            identity: None,
            own: Mutex::new(BTreeMap::new()),
            liveness: Mutex::new(BTreeMap::new()),
            locks: Mutex::new(HashMap::new()),
            gc_state: Mutex::new(GcState::default()),
            last_gc: Mutex::new(None),
            store_loaded: AtomicBool::new(false),
            first_published: AtomicBool::new(false),
            envoy_memo: Mutex::new(Memo::default()),
            grpc_memo: Mutex::new(Memo::default()),
            netns_missing: Mutex::new(BTreeSet::new()),
            metrics: AgentMetrics::default(),
        }
    }

    /// Gives every meshed pod a workload identity from `provider` (mTLS between pods);
    /// without one, pods talk plaintext.
    pub fn with_identity(mut self, provider: Arc<dyn IdentityProvider>) -> Self {
        self.identity = Some(provider);
        self
    }

    /// The identity provider, if any.
    pub fn identity(&self) -> Option<&Arc<dyn IdentityProvider>> {
        self.identity.as_ref()
    }

    fn identity_view(&self) -> Option<Arc<IdentityView>> {
        self.identity.as_ref().map(|p| p.view().borrow().clone())
    }

    /// Subscribes a pod's identity, guarded (R6): if the pod was removed while the
    /// subscription was being made, it is withdrawn again.
    async fn subscribe_identity(&self, rec: &PodRecord) -> Result<(), String> {
        let Some(provider) = &self.identity else {
            return Ok(());
        };
        provider
            .subscribe(&PodIdentity::from(rec))
            .await
            .map_err(|e| e.to_string())?;
        // The re-check: RemovePod deletes the store record before it unsubscribes, so
        // a pod gone now may have had its unsubscribe run before this subscribe.
        #[cfg(not(flock_reintroduce = "r6-agent"))]
        if !self.pods.contains(&rec.key) {
            self.metrics.guard_undos.fetch_add(1, Ordering::Relaxed);
            provider.unsubscribe(&rec.key).await;
        }
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// The registry.
    pub fn registry(&self) -> &Arc<dyn Registry> {
        &self.registry
    }

    /// The xDS cache.
    pub fn cache(&self) -> &Arc<Cache<Any>> {
        &self.cache
    }

    /// The live pods.
    pub fn pods(&self) -> BTreeMap<PodKey, PodRecord> {
        self.pods.snapshot()
    }

    /// Each live pod's health decision.
    pub fn health(&self) -> BTreeMap<PodKey, Live> {
        lock(&self.liveness)
            .iter()
            .map(|(k, l)| (k.clone(), l.health()))
            .collect()
    }

    /// The last GC report.
    pub fn last_gc(&self) -> Option<flock_core::gc::GcReport> {
        lock(&self.last_gc).clone()
    }

    /// Why the agent is not ready, or `None` when it is: the store is loaded, the
    /// registry is synced and the first snapshot is published.
    pub fn not_ready(&self) -> Option<String> {
        if !self.store_loaded.load(Ordering::Acquire) {
            return Some("pod store not loaded yet".into());
        }
        let view = self.registry.view().borrow().clone();
        if !view.synced {
            return Some(format!("registry {} not synced", self.registry.describe()));
        }
        if !self.first_published.load(Ordering::Acquire) {
            return Some("first xDS snapshot not published yet".into());
        }
        None
    }

    /// Startup: loads the store and **merges** it into the live table (R3), starts
    /// tracking liveness of the loaded pods, re-registers their endpoints (they may
    /// have expired with a previous lease) and publishes. Returns the number of
    /// pods loaded and quarantined.
    pub async fn load(self: &Arc<Self>) -> Result<(usize, usize), String> {
        let store = Arc::clone(&self.store);
        let report = tokio::task::spawn_blocking(move || store.load_all())
            .await
            .map_err(|e| format!("loading the pod store: {e}"))?
            .map_err(|e| format!("loading the pod store: {e}"))?;
        let quarantined = report.quarantined.len();
        let loaded: Vec<(PodKey, PodRecord)> = report
            .pods
            .into_iter()
            .map(|p| (p.key.clone(), p))
            .collect();
        for (key, rec) in &loaded {
            self.note_netns(key, &rec.netns);
        }
        let merge = self.pods.load_merge(loaded);
        {
            let now = now_ms();
            let mut live = lock(&self.liveness);
            for key in &merge.added {
                live.entry(key.clone())
                    .or_insert_with(|| Liveness::new(now, self.cfg.liveness));
            }
        }
        self.store_loaded.store(true, Ordering::Release);
        tracing::info!(
            loaded = merge.added.len(),
            kept_newer = merge.kept.len(),
            quarantined,
            "pod store loaded (merged into the live table)"
        );
        for key in &merge.added {
            if let Some(rec) = self.pods.get(key)
                && let Err(e) = self.subscribe_identity(&rec).await
            {
                tracing::warn!(pod = %rec.pod_ref(), "identity resubscription failed (the GC retries): {e}");
            }
        }
        self.publish();
        for key in &merge.added {
            self.reregister(key).await;
        }
        Ok((merge.added.len(), quarantined))
    }

    async fn pod_lock(&self, key: &PodKey) -> tokio::sync::OwnedMutexGuard<()> {
        let m = Arc::clone(lock(&self.locks).entry(key.clone()).or_default());
        m.lock_owned().await
    }

    fn release_lock(&self, key: &PodKey) {
        let mut locks = lock(&self.locks);
        // Only this map and the caller's guard (dropped just before) held it.
        if locks.get(key).is_some_and(|m| Arc::strong_count(m) == 1) {
            locks.remove(key);
        }
    }

    /// Records whether `netns` exists; returns whether that changed.
    fn note_netns(&self, key: &PodKey, netns: &str) -> bool {
        let missing = !std::path::Path::new(netns).exists();
        let mut set = lock(&self.netns_missing);
        if missing {
            set.insert(key.clone())
        } else {
            set.remove(key)
        }
    }

    /// Validates an AddPod request into a record (no I/O).
    pub fn record_for(&self, input: &AddPodInput) -> Result<Option<PodRecord>, PodError> {
        let invalid = PodError::Invalid;
        let Some(service) = input.annotations.get(SERVICE_ANNOTATION) else {
            return Ok(None);
        };
        check_id("container id", &input.container_id, 256).map_err(invalid)?;
        check_id("interface name", &input.ifname, 64).map_err(invalid)?;
        check_name("pod name", &input.name, 253).map_err(invalid)?;
        check_name("pod namespace", &input.namespace, 63).map_err(invalid)?;
        check_name(SERVICE_ANNOTATION, service, 63).map_err(invalid)?;
        if input.netns.is_empty() || input.netns.len() > 4096 || !input.netns.starts_with('/') {
            return Err(invalid("netns must be an absolute path".into()));
        }
        if input.uid.len() > 128 {
            return Err(invalid("pod uid is longer than 128 bytes".into()));
        }
        let mut ips = Vec::new();
        for ip in input.ips.iter().take(16) {
            let addr = ip.split('/').next().unwrap_or("");
            let parsed: IpAddr = addr.parse().map_err(|_| {
                invalid(format!("IP {ip:?} from the primary CNI is not an address"))
            })?;
            ips.push(parsed);
        }
        if ips.is_empty() {
            return Err(invalid(
                "the primary CNI's result has no IP (is flock-cni chained after it?)".into(),
            ));
        }
        let ports = parse_ports(
            input
                .annotations
                .get(PORTS_ANNOTATION)
                .map(String::as_str)
                .unwrap_or(""),
        )
        .map_err(invalid)?;
        let service_account = input
            .annotations
            .get("flock.io/service-account")
            .cloned()
            .unwrap_or_default();
        if !service_account.is_empty() {
            check_name("flock.io/service-account", &service_account, 253).map_err(invalid)?;
        }
        Ok(Some(PodRecord {
            key: PodKey::new(&input.container_id, &input.ifname),
            name: input.name.clone(),
            namespace: input.namespace.clone(),
            uid: input.uid.clone(),
            netns: input.netns.clone(),
            ips,
            service: service.clone(),
            service_account,
            ports,
            network_name: input.network_name.clone(),
            added_at_ms: now_ms(),
        }))
    }

    /// The endpoints a pod registers (one per app port).
    fn endpoints_of(&self, rec: &PodRecord, health: Health) -> Vec<Endpoint> {
        let identity = self
            .identity_view()
            .and_then(|v| v.svid_of(&rec.key).map(|s| s.spiffe_id.clone()));
        rec.ports
            .iter()
            .map(|p| Endpoint {
                service: rec.service.clone(),
                namespace: rec.namespace.clone(),
                service_port: p.app_port,
                protocol: p.protocol,
                address: rec.ips[0],
                port: p.listen_port,
                node: self.cfg.node_name.clone(),
                pod: rec.pod_ref(),
                pod_key: rec.key.clone(),
                region: self.cfg.region.clone(),
                zone: self.cfg.zone.clone(),
                health,
                identity: identity.clone(),
            })
            .collect()
    }

    /// CNI ADD: runs `flock_core::lifecycle::ADD_POD` in order; on a failed step,
    /// rolls back with `REMOVE_POD` in full. Answers once a snapshot with the pod is
    /// published.
    pub async fn add_pod(self: &Arc<Self>, input: &AddPodInput) -> Result<PodOutcome, PodError> {
        let rec = match self.record_for(input) {
            Ok(Some(rec)) => rec,
            Ok(None) => {
                self.metrics.pods_ignored.fetch_add(1, Ordering::Relaxed);
                return Ok(PodOutcome::Ignored(format!(
                    "pod {}/{} has no {SERVICE_ANNOTATION} annotation: not meshed",
                    input.namespace, input.name
                )));
            }
            Err(e) => {
                self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let key = rec.key.clone();
        let guard = self.pod_lock(&key).await;
        let result = self.add_locked(&rec).await;
        drop(guard);
        self.release_lock(&key);
        match &result {
            Ok(_) => self.metrics.pods_added.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.metrics.pod_errors.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    async fn add_locked(self: &Arc<Self>, rec: &PodRecord) -> Result<PodOutcome, PodError> {
        let mut version = 0;
        for step in ADD_POD {
            let done = match step {
                Step::StoreWrite => {
                    let store = Arc::clone(&self.store);
                    let r = rec.clone();
                    match tokio::task::spawn_blocking(move || store.put(&r)).await {
                        Ok(Ok(())) => {
                            self.note_netns(&rec.key, &rec.netns);
                            self.pods.insert(rec.key.clone(), rec.clone());
                            lock(&self.liveness).insert(
                                rec.key.clone(),
                                Liveness::new(now_ms(), self.cfg.liveness),
                            );
                            Ok(())
                        }
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(e) => Err(e.to_string()),
                    }
                }
                Step::IdentitySubscribe => match &self.identity {
                    Some(provider) => provider
                        .subscribe(&PodIdentity::from(rec))
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    None => Ok(()),
                },
                Step::XdsPublish => {
                    version = self.publish();
                    Ok(())
                }
                Step::RegistryRegister => self.register(rec, Health::Healthy).await,
                other => unreachable!("{other} is not an AddPod step"),
            };
            if let Err(message) = done {
                tracing::warn!(pod = %rec.pod_ref(), key = %rec.key, %step, %message, "AddPod step failed; rolling back");
                self.remove_locked(&rec.key).await;
                return Err(PodError::Step {
                    step: *step,
                    message,
                });
            }
        }
        tracing::info!(pod = %rec.pod_ref(), key = %rec.key, service = %rec.service, ports = rec.ports.len(), version, "pod added");
        Ok(PodOutcome::Done(format!(
            "pod {} meshed as {}.{} ({} port(s)); xDS version {version}",
            rec.pod_ref(),
            rec.service,
            rec.namespace,
            rec.ports.len()
        )))
    }

    async fn register(&self, rec: &PodRecord, health: Health) -> Result<(), String> {
        for ep in self.endpoints_of(rec, health) {
            match self.registry.put(&ep).await {
                Ok(rev) => {
                    lock(&self.own).insert(ep.key(), rev);
                }
                Err(e) => {
                    self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e.to_string());
                }
            }
        }
        Ok(())
    }

    /// CNI DEL: runs `flock_core::lifecycle::REMOVE_POD` in order (store first: R4).
    /// Unknown pods are IGNORED; every step is idempotent.
    pub async fn remove_pod(self: &Arc<Self>, key: &PodKey) -> PodOutcome {
        let guard = self.pod_lock(key).await;
        let existed = self.remove_locked(key).await;
        drop(guard);
        self.release_lock(key);
        if existed {
            self.metrics.pods_removed.fetch_add(1, Ordering::Relaxed);
            PodOutcome::Done(format!("pod {key} removed"))
        } else {
            self.metrics.pods_ignored.fetch_add(1, Ordering::Relaxed);
            PodOutcome::Ignored(format!("pod {key} is not known to this agent"))
        }
    }

    /// Returns whether the pod was known (in the table or the store).
    async fn remove_locked(&self, key: &PodKey) -> bool {
        let mut existed = false;
        for step in REMOVE_POD {
            match step {
                Step::StoreDelete => {
                    // Invisible first: from here no background loop sees the pod.
                    existed |= self.pods.remove(key).is_some();
                    lock(&self.liveness).remove(key);
                    lock(&self.netns_missing).remove(key);
                    let store = Arc::clone(&self.store);
                    let k = key.clone();
                    match tokio::task::spawn_blocking(move || store.remove(&k)).await {
                        Ok(Ok(was)) => existed |= was,
                        Ok(Err(e)) => tracing::warn!(%key, "store delete failed (GC retries): {e}"),
                        Err(e) => tracing::warn!(%key, "store delete failed (GC retries): {e}"),
                    }
                }
                Step::XdsWithdraw => {
                    self.publish();
                }
                Step::RegistryUnregister => {
                    let keys: Vec<String> = {
                        let view = self.registry.view().borrow().clone();
                        let mut keys: BTreeSet<String> = view
                            .endpoints
                            .iter()
                            .filter(|(_, e)| e.node == self.cfg.node_name && &e.pod_key == key)
                            .map(|(k, _)| k.clone())
                            .collect();
                        keys.extend(
                            lock(&self.own)
                                .keys()
                                .filter(|k| key_owner(k).as_ref() == Some(key))
                                .cloned(),
                        );
                        keys.into_iter().collect()
                    };
                    for k in keys {
                        match self.registry.delete(&k).await {
                            Ok(was) => {
                                existed |= was;
                                lock(&self.own).remove(&k);
                            }
                            Err(e) => {
                                self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(%key, endpoint = %k, "unregister failed (GC retries): {e}");
                            }
                        }
                    }
                }
                Step::IdentityUnsubscribe => {
                    if let Some(provider) = &self.identity {
                        existed |= provider.view().borrow().subscriptions.contains_key(key);
                        provider.unsubscribe(key).await;
                    }
                }
                other => unreachable!("{other} is not a RemovePod step"),
            }
        }
        if existed {
            tracing::info!(%key, "pod removed");
        }
        existed
    }

    /// CNI CHECK: the pod is held as added.
    pub fn check_pod(&self, key: &PodKey) -> Result<(), String> {
        match self.pods.get(key) {
            Some(_) => Ok(()),
            None => Err(format!("pod {key} is not known to this agent")),
        }
    }

    /// Re-registers a pod's endpoints with its current health, guarded (R4): after
    /// the put, the pod must still be live, else the registration is undone — only
    /// if it is still the one we wrote.
    pub async fn reregister(&self, key: &PodKey) {
        let Some(rec) = self.pods.get(key) else {
            return;
        };
        let health = match lock(&self.liveness).get(key).map(Liveness::health) {
            Some(Live::Unhealthy) => Health::Unhealthy,
            _ => Health::Healthy,
        };
        for ep in self.endpoints_of(&rec, health) {
            let ep_key = ep.key();
            let rev = match self.registry.put(&ep).await {
                Ok(rev) => rev,
                Err(e) => {
                    self.metrics.registry_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %rec.pod_ref(), "re-register failed: {e}");
                    continue;
                }
            };
            // The re-check: RemovePod deletes the store record before it unregisters,
            // so if the pod is gone now, its unregister may already have run and
            // missed this put.
            #[cfg(not(flock_reintroduce = "r4-agent"))]
            let still_live = self.pods.contains(key);
            #[cfg(flock_reintroduce = "r4-agent")]
            let still_live = true;
            if still_live {
                lock(&self.own).insert(ep_key, rev);
            } else {
                self.metrics.guard_undos.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.registry.delete_if_revision(&ep_key, rev).await {
                    tracing::warn!(endpoint = %ep_key, "undo of a late registration failed (GC removes it): {e}");
                }
            }
        }
    }

    /// Runs one liveness round: probes every due pod (in parallel) and applies
    /// transitions to the registry.
    pub async fn liveness_round(self: &Arc<Self>) {
        let now = now_ms();
        let due: Vec<PodRecord> = {
            let live = lock(&self.liveness);
            self.pods
                .snapshot()
                .into_values()
                .filter(|p| live.get(&p.key).is_some_and(|l| l.is_due(now)))
                .collect()
        };
        let mut netns_changed = false;
        for pod in &due {
            netns_changed |= self.note_netns(&pod.key, &pod.netns);
        }
        if netns_changed {
            self.publish();
        }
        let mut probes = tokio::task::JoinSet::new();
        for pod in due {
            let timeout = self.cfg.probe_timeout;
            probes.spawn(async move {
                let ok = crate::probe::probe_pod(&pod, timeout).await;
                (pod.key, ok)
            });
        }
        while let Some(Ok((key, ok))) = probes.join_next().await {
            self.metrics.probes.fetch_add(1, Ordering::Relaxed);
            if !ok {
                self.metrics.probe_failures.fetch_add(1, Ordering::Relaxed);
            }
            let transition = lock(&self.liveness)
                .get_mut(&key)
                .and_then(|l| l.observe(now_ms(), ok));
            if let Some(t) = transition {
                tracing::info!(%key, from = ?t.from, to = ?t.to, "pod health changed");
                self.metrics.health_changes.fetch_add(1, Ordering::Relaxed);
                self.reregister(&key).await;
            }
        }
    }

    /// Builds the mesh from the live pods and the registry view.
    fn mesh(&self, view: &View) -> (Mesh, Vec<PodKey>) {
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
        let mut pod_keys = Vec::new();
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
                    pod_keys.push(rec.key.clone());
                }
                Err(errors) => tracing::warn!(
                    pod = %rec.pod_ref(),
                    "pod not served: {}",
                    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
                ),
            }
        }
        (mesh, pod_keys)
    }

    /// Publishes the current state to both node groups; returns the Envoy group's
    /// version. The state is read inside the publish closure (R1). Publishes nothing
    /// (no version consumed) when nothing changed.
    pub fn publish(&self) -> u64 {
        let opts = EnvoyOptions::default();
        let mut version = 0;
        for group in [ENVOY_GROUP, GRPC_GROUP] {
            let publisher = self.cache.publisher(group);
            // The very first snapshot is published even if empty: clients wait for
            // it, and readiness needs it.
            let first = publisher.latest().version() == 0;
            let published = publisher.try_publish(|prev| {
                let view = self.registry.view().borrow().clone();
                let (mesh, pod_keys) = self.mesh(&view);
                let mut memo = lock(if group == ENVOY_GROUP {
                    &self.envoy_memo
                } else {
                    &self.grpc_memo
                });
                let entries = memo.translate(group == ENVOY_GROUP, &mesh, &pod_keys, &opts);
                let mut b = prev.edit();
                for (type_url, list) in entries {
                    b.replace_type(type_url, list);
                }
                let next = b.build();
                let changed = !flock_core::resources::diff(prev, &next).is_empty();
                (changed || first).then_some(next)
            });
            let v = match published {
                Some(s) => {
                    if group == ENVOY_GROUP {
                        self.metrics.publishes.fetch_add(1, Ordering::Relaxed);
                    }
                    s.version()
                }
                None => publisher.latest().version(),
            };
            if group == ENVOY_GROUP {
                version = v;
            }
        }
        self.first_published.store(true, Ordering::Release);
        version
    }

    /// One orphan-GC sweep (flock-core's planner, hysteresis and breaker). With
    /// `valid` (from a CNI GC), stored pods not in it are judged too. Returns how
    /// many items were removed.
    pub async fn gc_sweep(self: &Arc<Self>, valid: Option<Vec<PodKey>>) -> usize {
        // Owned resources first, the store last (see flock_core::gc).
        let view = self.registry.view().borrow().clone();
        let endpoints: Vec<Owned> = view
            .endpoints
            .iter()
            .filter(|(_, e)| e.node == self.cfg.node_name)
            .map(|(k, e)| Owned::new(k.clone(), e.pod_key.clone()))
            .collect();
        let subscriptions: Vec<Owned> = self
            .identity_view()
            .map(|v| {
                v.subscriptions
                    .keys()
                    .map(|k| Owned::new(k.to_string(), k.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let pods: Vec<PodKey> = self.pods.snapshot().into_keys().collect();
        let inputs = GcInputs {
            pods,
            valid_attachments: valid,
            endpoints,
            subscriptions,
            ..GcInputs::default()
        };
        let (plan, next) = {
            let state = lock(&self.gc_state);
            flock_core::gc::plan(&inputs, &state, &self.cfg.gc_policy)
        };
        *lock(&self.gc_state) = next;
        self.metrics.gc_sweeps.fetch_add(1, Ordering::Relaxed);
        for t in plan.report.tripped() {
            self.metrics
                .gc_breaker_trips
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!("{t}");
        }
        let mut removed = 0;
        for key in &plan.store {
            if let PodOutcome::Done(_) = self.remove_pod(key).await {
                removed += 1;
                self.metrics
                    .gc_removed_store
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%key, "GC removed a pod the runtime no longer knows");
            }
        }
        for ep in &plan.endpoints {
            // Conditional on the revision the plan was made from: if the pod came back
            // after the view was taken (its AddPod re-registered the same key), that
            // newer registration is not an orphan and must survive this sweep.
            #[cfg(not(flock_reintroduce = "gc-unconditional"))]
            let deleted = match view.revisions.get(ep) {
                Some(rev) => self.registry.delete_if_revision(ep, *rev).await,
                None => Ok(false),
            };
            #[cfg(flock_reintroduce = "gc-unconditional")]
            let deleted = self.registry.delete(ep).await;
            match deleted {
                Ok(true) => {
                    removed += 1;
                    lock(&self.own).remove(ep);
                    self.metrics
                        .gc_removed_endpoints
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(endpoint = %ep, "GC removed an orphan endpoint");
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(endpoint = %ep, "GC could not remove an orphan endpoint: {e}")
                }
            }
        }
        if let (Some(provider), Some(view)) = (&self.identity, self.identity_view()) {
            for id in &plan.subscriptions {
                if let Some(key) = view.subscriptions.keys().find(|k| &k.to_string() == id) {
                    provider.unsubscribe(key).await;
                    removed += 1;
                    tracing::warn!(pod = %key, "GC removed a leaked identity subscription");
                }
            }
        }
        *lock(&self.last_gc) = Some(plan.report);
        removed
    }
}

fn xlate_protocol(p: Protocol) -> translate::Protocol {
    match p {
        Protocol::Http => translate::Protocol::Http,
        Protocol::Grpc => translate::Protocol::Grpc,
        Protocol::Tcp => translate::Protocol::Tcp,
    }
}

/// The pod key encoded in a registry key (`…/<container_id>/<ifname>/<port>`).
fn key_owner(key: &str) -> Option<PodKey> {
    let mut parts = key.rsplit('/');
    let _port = parts.next()?;
    let ifname = parts.next()?;
    let container = parts.next()?;
    Some(PodKey::new(container, ifname))
}

/// Translated resources, shared (`Arc`) so a publish copies pointers, not bytes.
type Translated = Arc<Vec<(&'static str, Name, ContentHash, Arc<Any>)>>;

/// Per-entity translation memo of one node group: a pod or service whose model did
/// not change since the last publish reuses its encoded, hashed resources, so a
/// publish costs O(entities) comparisons plus O(changed entities) encoding instead of
/// re-encoding and re-hashing the whole mesh (go-control-plane's per-change cost).
#[derive(Default)]
struct Memo {
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

type Entries = BTreeMap<&'static str, Vec<(Name, ContentHash, Arc<Any>)>>;

impl Memo {
    /// Every resource of the group for `mesh`, per type (the five xDS types always
    /// present, so `replace_type` removes what went away). Same output as
    /// `translate::envoy_resources` / `grpc_resources`.
    fn translate(
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
